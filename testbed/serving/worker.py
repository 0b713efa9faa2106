"""Prefill and decode worker processes: ``python -m testbed.serving.worker --role prefill|decode --config FILE``.

A prefill worker queues requests, computes them one at a time (a torch forward pass, or a sleep of its
hardware profile's time) and streams each layer's KV to the chosen decode worker while later layers
compute. A decode worker registers a request, waits until its whole KV has arrived and been verified,
then decodes it in a batch of at most BS_max, sending one server-sent event per token. The HTTP control
API's messages are `testbed.serving.protocol`'s (docs/protocol.md); compute and KV transfer sit behind
`testbed.serving.compute` and a KV connector (`testbed.kv.connector`, `tcp` by default).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import queue
import signal
import sys
import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from testbed.clock import now_s
from testbed.atomic import write_json
from testbed.errors import FieldError
from testbed.validation import shown
from testbed.blocks import BLOCK_TOKENS
from testbed.kv.transport import PROBE_PREFIX
from testbed.serving.httpio import BodyError, HangupWatch, RequestHandler, Server, read_json_body
from testbed.serving.kvmanager import prefilled_blocks
from testbed.serving.protocol import (
    DECODE_PREFIX_HEADER, Congestion, DecodeRequest, FinalEvent, Health, KVDestination, PrefillCancel, PrefillCancelled, PrefillRequest,
    PrefillResult, ProbeRequest, TokenEvent, WorkerState, own_prefill_s,
)

if TYPE_CHECKING:
    from testbed.kv.tcplog import TcpLog


@dataclass
class WorkerConfig:
    """What run.py writes for each worker (JSON); `model` is the scenario's raw ``model:`` section."""

    role: str
    instance: int
    cluster: str
    host: str
    port: int
    compute: str = "profile"
    profile: str = "h200"
    model: dict[str, Any] = field(default_factory=dict)
    scale: float = 1.0
    device: str = "auto"
    variant: str = "tiny"
    seed: int = 1
    kv_port: int | None = None
    kv_connections: int = 4
    kv_connector: str = "tcp"  # a name in testbed.kv.connector's registry
    kv_congestion_control: str | None = None  # TCP_CONGESTION of the KV connections (None: the namespace's default)
    kv_mss_bytes: int | None = None  # TCP_MAXSEG of the KV connections (None: the path's)
    bs_max: int = 20
    kv_timeout_s: float = 30.0  # a KV transfer, from the moment its first layer is handed to the sender
    request_timeout_s: float = 120.0  # a request's whole budget when its message does not carry one
    prefix_pool_bytes: int = 8 * 10**9
    model_source: str = ""  # the scenario file (a model given as a relative path is found beside it)
    ready_file: str | None = None
    bind: str = "0.0.0.0"
    tcp_log: str | None = None  # a prefill worker appends its KV connections' TCP samples here (testbed.kv.tcplog)

    @classmethod
    def load(cls, path: str | Path) -> "WorkerConfig":
        data = json.loads(Path(path).read_text())
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))


def _log(msg: str) -> None:
    print(f"[{now_s():.3f}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------- prefill


TORCH_POOL_MAX_BYTES = 1 << 30  # torch mode holds real tensors: a pool never takes more of the host's memory


def make_pool(cfg: WorkerConfig, spec: Any) -> Any:
    """The worker's prefix pool. Prefill: the hybrid rule (full-attention blocks + a linear/SWA state at the
    boundary). Decode: full-attention blocks only (the prefill always sends the final state), as SGLang's
    decode-side radix cache. Torch mode stores tensors (capacity capped at TORCH_POOL_MAX_BYTES of real
    bytes); profile mode accounts the spec's emulated bytes only."""
    from testbed.kv.pool import HybridPrefixPool

    kv1 = spec.kv_bytes(1)
    state = kv1.fixed_state_bytes + spec.kv_bytes(BLOCK_TOKENS).window_bytes if cfg.role == "prefill" else 0
    hybrid = state > 0 if cfg.role == "prefill" else False
    if cfg.compute == "torch":
        return HybridPrefixPool(min(cfg.prefix_pool_bytes, TORCH_POOL_MAX_BYTES), BLOCK_TOKENS, store_tensors=True, hybrid=hybrid)
    return HybridPrefixPool(cfg.prefix_pool_bytes, BLOCK_TOKENS, store_tensors=False,
                            full_bytes_per_token=kv1.full_attention_bytes, state_bytes=state, hybrid=hybrid)


@dataclass
class PrefillJob:
    req: PrefillRequest
    queued_s: float = field(default_factory=now_s)
    started: bool = False  # left the queue (guarded by PrefillWorker.lock)
    done: threading.Event = field(default_factory=threading.Event)
    result: dict[str, Any] = field(default_factory=dict)  # PrefillResult's fields, filled in as the job goes
    compute_after_first_s: float = 0.0  # compute time after the first layer was handed over (not blocked time)
    paused_s: float = 0.0  # time this prefill stood paused while preempting jobs ran (`PrefillWorker._preempt`)
    hit: Any = None  # the pool's prefix hit, referenced until the job ends
    checkpoint: Any = None  # torch: the cache at the last block boundary, stored in the pool on success

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def arrival_s(self) -> float:
        """When the request reached the router (its budgets run from there), else when it was queued here."""
        return self.req.arrival_s if self.req.arrival_s is not None else self.queued_s

    def answer(self) -> PrefillResult:
        return PrefillResult(request_id=self.request_id, **{"status": "failed", **self.result})

    def fail(self, reason: str) -> None:
        if not self.done.is_set():
            self.result.update(status="failed", reason=reason)
            self.done.set()


def _remember(ids: dict[str, float], request_id: str, keep_s: float) -> None:
    """Note `request_id` now in `ids` (oldest first) and forget those older than `keep_s`."""
    now = now_s()
    ids.pop(request_id, None)
    ids[request_id] = now
    while ids and next(iter(ids.values())) < now - keep_s:
        del ids[next(iter(ids))]


ROUTER_GONE = "the router went away (its client hung up)"  # a decode request's end when `DecodeWorker.abandon` ended it

PROBE_HIDDEN = ("send_queue_bytes", "inflight_bytes", "path_rate_bps", "queue_rtt_ms")  # KV figures a probe's own bytes would fake


class Destination:
    """One decode worker seen from a prefill worker: a `KVSender` (N TCP connections) fed by a bounded
    queue of layers, so a slow WAN blocks the compute loop once the queue is full (the bandwidth wall).
    Each transfer's end (trailer sent, receiver's verdict awaited) runs in its own thread, so the next
    request's layers keep flowing during that round trip."""

    QUEUE_LAYERS = 8

    def __init__(self, host: str, kv_port: int, connections: int, on_done: Callable[[PrefillJob], None], model_name: str,
                 kv_timeout_s: float, connector: str = "tcp", tcp_log: TcpLog | None = None, decode_instance: int = 0,
                 congestion_control: str | None = None, mss_bytes: int | None = None) -> None:
        self.host, self.kv_port, self.connections = host, kv_port, connections
        self.congestion_control = congestion_control
        self.mss_bytes = mss_bytes
        self.decode_instance = decode_instance
        self.tcp_log = tcp_log
        self.senders_made = 0  # a broken sender is replaced; its TCP log rows say which one they came from
        self.connector = connector
        self.model_name = model_name
        self.on_done = on_done
        self.kv_timeout_s = kv_timeout_s
        self.items: queue.Queue = queue.Queue(maxsize=self.QUEUE_LAYERS)
        self.sender: Any = None
        self.probe_sender: Any = None  # connections of their own for paced probes (`probe`), made at the first paced probe, paced anew at each
        self.failed: dict[str, str] = {}
        self.started: dict[str, float] = {}  # request id -> when its first layer was handed to the sender
        self.connect_lock = threading.Lock()
        self.probing = False  # a probe runs on this destination's connections (`probe`)
        threading.Thread(target=self._loop, daemon=True, name=f"kv->{host}:{kv_port}").start()

    def _connect(self) -> Any:
        with self.connect_lock:  # the transfer loop and a probe may both connect
            if self.sender is None:
                self.sender = self._new_sender()
                if self.tcp_log is not None and hasattr(self.sender, "on_sample"):  # a connector without TCP state has none
                    log, decode, serial = self.tcp_log, self.decode_instance, self.senders_made
                    self.sender.on_sample = lambda s: log.record(decode, serial, s)
                self.senders_made += 1
            return self.sender

    def _new_sender(self) -> Any:
        from testbed.kv.connector import KVEndpoint, get_connector

        tcp = {k: v for k, v in (("congestion_control", self.congestion_control), ("mss_bytes", self.mss_bytes)) if v}  # else: the connector's default
        return get_connector(self.connector).sender(KVEndpoint(self.host, self.kv_port), connections=self.connections, **tcp)

    def _probe_connect(self, pace_bps: float) -> Any:
        """The sender of a paced probe: as many connections as the KV sender's, with the same congestion control,
        but kept for probes, because the pacing cap turns on the kernel's pacing for good and KV goes unpaced."""
        if self.probe_sender is None:
            self.probe_sender = self._new_sender()
        if hasattr(self.probe_sender, "pace"):
            self.probe_sender.pace(pace_bps)
        return self.probe_sender

    def paces_itself(self) -> bool:
        """The KV connections' congestion control paces itself (BBR): the configured one, else this network
        namespace's default, which is what the connections take."""
        from testbed.kv.transport import paces_itself, tcp_sysctl

        return self.connector == "tcp" and paces_itself(self.congestion_control or tcp_sysctl("tcp_congestion_control"))

    def probe(self, req: ProbeRequest) -> dict[str, Any]:
        """An active probe to this destination (`KVSender.probe`): paced (`pace_bps` > 0) over the connections
        kept for probes, else over its KV connections; under a congestion control that paces itself (BBR)
        unpaced over the KV connections unless `pace_self_paced` (docs/router.md, "A paced probe", *Under
        BBR*). Refused while KV of this worker is queued for it (the KV is the measurement then, and a probe
        would compete with it). The answer's `paced` says whether it was paced."""
        if self.kv_pending():
            return {"ok": False, "reason": "KV is being sent to this destination"}
        paced = req.pace_bps > 0 and (req.pace_self_paced or not self.paces_itself())
        try:
            sender = self._probe_connect(req.pace_bps) if paced else self._connect()
        except Exception as exc:  # the decode side is unreachable: an answer, not a crashed handler
            return {"ok": False, "reason": f"probe connections to {self.host}:{self.kv_port}: {exc}"}
        if not hasattr(sender, "probe"):
            return {"ok": False, "reason": f"the {self.connector} connector cannot probe"}
        self.probing = True
        try:
            return {**sender.probe(req.bytes, req.pings, req.timeout_s, stop=req.fill_stop()), "paced": paced}
        except Exception as exc:
            if sender is self.probe_sender:  # broken: new connections at the next probe
                self.probe_sender = None
                threading.Thread(target=sender.close, daemon=True).start()
            return {"ok": False, "reason": f"probe to {self.host}:{self.kv_port} failed: {exc}"}
        finally:
            self.probing = False

    def kv_pending(self) -> bool:
        """KV of this worker is started or queued for this destination."""
        return bool(self.started) or not self.items.empty()

    def _drop_sender(self) -> None:
        sender, self.sender = self.sender, None
        if sender is not None:
            threading.Thread(target=sender.close, daemon=True).start()

    def _loop(self) -> None:
        from testbed.serving.compute import ProfileLayer

        while True:
            kind, job, payload = self.items.get()
            rid = job.request_id
            if kind == "abort":  # the prefill failed: drop what is queued, tell the receiver
                self.failed.pop(rid, None)
                self.started.pop(rid, None)
                if self.sender is not None:
                    self.sender.abort(rid, payload)
                continue
            start = self.started.setdefault(rid, now_s())
            if rid not in self.failed and self._elapsed_s(job, start) > self.kv_timeout_s:  # the KV timeout runs from the first layer
                self.failed[rid] = self._late()
                if self.sender is not None:
                    self.sender.abort(rid, self.failed[rid])
            if rid in self.failed:
                if kind == "finish":
                    self.started.pop(rid, None)
                    self._end(job, None, self.failed.pop(rid))
                continue
            try:
                sender = self._connect()
                if kind == "layer" and isinstance(payload, ProfileLayer):
                    sender.send_bytes(rid, payload.layer_index, payload.kind, payload.nbytes)
                elif kind == "layer":
                    sender.send_layer(rid, payload)
                else:
                    self.started.pop(rid, None)
                    left_s = max(0.0, self.kv_timeout_s - self._elapsed_s(job, start))
                    threading.Thread(target=self._finish, args=(sender, job, payload, left_s), daemon=True).start()
            except Exception as exc:  # the decode side went away or the WAN broke the connection
                reason = f"KV transfer to {self.host}:{self.kv_port} failed: {exc}"
                _log(reason)
                self._drop_sender()
                if kind == "finish":
                    self.started.pop(rid, None)
                    self._end(job, None, reason)
                else:
                    self.failed[rid] = reason

    @staticmethod
    def _elapsed_s(job: PrefillJob, start_s: float) -> float:
        """The transfer's clock: time since its first layer was handed over, less the time the prefill was
        still computing later layers (layer-wise streaming: a long prefill is not a slow transfer)."""
        return now_s() - start_s - job.compute_after_first_s

    def _late(self) -> str:
        return f"KV transfer to {self.host}:{self.kv_port} did not complete within {self.kv_timeout_s:g} s of its start"

    def _finish(self, sender: Any, job: PrefillJob, tokens: int, left_s: float) -> None:
        try:
            stats = sender.finish(job.request_id, tokens=tokens, model=self.model_name, timeout_s=left_s)
        except Exception as exc:
            self._end(job, None, f"KV transfer to {self.host}:{self.kv_port} failed: {exc}")
            return
        if not stats.ok and "timed out" in (stats.reason or ""):
            sender.abort(job.request_id, self._late())  # free the receiver's partial KV now
            self._end(job, stats, self._late())
            return
        self._end(job, stats, None if stats.ok else f"KV transfer to {self.host}:{self.kv_port} failed: {stats.reason}")

    def _end(self, job: PrefillJob, stats: Any, reason: str | None) -> None:
        if stats is not None:
            job.result.update(kv_bytes=stats.kv_bytes, wire_bytes=stats.wire_bytes, transfer_start_s=stats.start_s,
                              transfer_end_s=stats.end_s)
        job.result.update(status="ok" if reason is None else "failed", reason=reason)
        self.on_done(job)

    def congestion(self) -> dict[str, Any]:
        """The sender's signal (`KVSender.congestion`). While a probe runs here and no KV is started or queued
        for this destination, the bytes queued and in flight are the probe's own, not KV: its KV figures are
        zero and ``probing`` is 1, so a state poll neither reads the probe as KV backlog nor makes the router
        discard the probe as one under which KV moved (the probe's answer is its measurement)."""
        try:
            c = dict(self.sender.congestion()) if self.sender is not None else {}
        except Exception:
            return {}
        if c and self.probing and not self.kv_pending():
            c.update({k: 0.0 for k in PROBE_HIDDEN}, probing=1.0)
        return c


class PrefillWorker:
    QUEUE_RECHECK_S = 1.0  # a queued request re-reads its expected prefill time this often

    def __init__(self, cfg: WorkerConfig) -> None:
        from testbed.serving.compute import make_compute

        self.cfg = cfg
        self.compute = make_compute(cfg)
        self.pool = make_pool(cfg, self.compute.section.spec)
        # vLLM's `--scheduling-policy priority`: the lowest `priority` first, first come first served among
        # equals (a sequence number breaks ties); every request at priority 0 is plain FCFS
        self.jobs: queue.PriorityQueue[tuple[int, int, PrefillJob]] = queue.PriorityQueue()
        self._seq = itertools.count()
        # a queued job of a lower priority value preempts a running one at its next layer (`_preempt`); paced
        # (profile) compute only: a torch prefill runs to its end (its forward pass is not re-entrant)
        self.preemptive = hasattr(self.compute, "prefill_time_s")
        self.s_per_token = 0.0  # measured prefill seconds per computed token (EWMA), for early shedding
        self.busy = False
        self.dests: dict[tuple[str, int], Destination] = {}
        self.lock = threading.Lock()
        self.by_id: dict[str, PrefillJob] = {}  # the jobs submitted and not yet answered, for `cancel` (guarded by lock)
        self.left_queue = 0  # jobs still in `jobs` that failed or were cancelled there: not queue depth (guarded by lock)
        self.cancelled_early: dict[str, float] = {}  # ids cancelled before their request came (guarded by lock)
        self.answered: dict[str, float] = {}  # ids answered lately, oldest first: a cancel of one is not early (lock)
        self.tcp_log: TcpLog | None = None
        if cfg.tcp_log:
            from testbed.kv.tcplog import TcpLog

            self.tcp_log = TcpLog(cfg.tcp_log, cfg.cluster, cfg.instance)
        threading.Thread(target=self._loop, daemon=True, name="prefill").start()

    def close(self) -> None:
        """At shutdown: write what the TCP log still buffers."""
        if self.tcp_log is not None:
            self.tcp_log.close()

    def submit(self, req: PrefillRequest) -> PrefillResult:
        """Queue one prefill and answer when its transfer has ended. A request still queued when its
        request timeout, less its own expected prefill time, has run out fails with a reason naming this
        queue: past that point its prefill could not end within the request's budget."""
        job = PrefillJob(req)
        with self.lock:
            if self.cancelled_early.pop(req.request_id, None) is not None:  # its cancel overtook it: never run it
                return PrefillResult(req.request_id, "failed", "cancelled before it reached this worker: the request's "
                                     "client went away before its first token")
            self.by_id[req.request_id] = job
        try:
            self.jobs.put((req.priority, next(self._seq), job))
            return self._await(job)
        finally:
            with self.lock:
                if self.by_id.get(req.request_id) is job:
                    del self.by_id[req.request_id]
                _remember(self.answered, req.request_id, 2 * self.cfg.request_timeout_s)

    def _await(self, job: PrefillJob) -> PrefillResult:
        req = job.req
        timeout_s = req.request_timeout_s or self.cfg.request_timeout_s
        deadline_s = job.arrival_s + timeout_s
        while True:  # the expected prefill time is re-read: in torch mode it is measured as prefills finish
            reserve_s = self.expected_job_s(req)
            left_s = deadline_s - reserve_s - now_s()
            if job.done.wait(max(0.0, min(left_s, self.QUEUE_RECHECK_S))):
                break
            if left_s > self.QUEUE_RECHECK_S:
                continue
            with self.lock:
                queued = not job.started
                if queued:
                    job.started = True  # the loop skips it
                    self.left_queue += 1
            if queued:
                job.fail(f"waited {now_s() - job.queued_s:.1f} s in the queue of prefill instance {self.cfg.instance} "
                         f"(request timeout {timeout_s:g} s less its expected prefill {reserve_s:.1f} s)")
            break
        job.done.wait()
        return job.answer()

    def cancel(self, request_id: str) -> PrefillCancelled:
        """The router's client of `request_id` went away before its first token: a prefill still queued leaves
        the queue (answered as failed), one already running runs on. Says the prefill's times so far."""
        with self.lock:
            job = self.by_id.get(request_id)
            if job is None:  # answered already, or not come yet (the cancel overtook it: `submit` refuses it then)
                if request_id not in self.answered:
                    _remember(self.cancelled_early, request_id, 2 * self.cfg.request_timeout_s)
                return PrefillCancelled(request_id, found=False)
            dequeued = not job.started
            job.started = True  # the loop skips a job that has left the queue this way
            self.left_queue += dequeued
        if dequeued:
            job.fail("cancelled in the queue: the request's client went away before its first token")
        return PrefillCancelled(request_id, True, dequeued, job.result.get("prefill_start_s"), job.result.get("prefill_end_s"))

    def _shed(self, job: PrefillJob) -> str | None:
        """Early shedding (`PrefillRequest.shed_ttft_s`): the reason when the time already waited plus the
        expected prefill time exceeds the request's TTFT budget."""
        req = job.req
        if req.shed_ttft_s is None:
            return None
        waited = now_s() - job.arrival_s
        expected = self.expected_job_s(req)
        if waited + expected <= req.shed_ttft_s:
            return None
        return f"shed: predicted TTFT {waited + expected:.1f} s ({waited:.1f} s waited + {expected:.1f} s prefill) exceeds {req.shed_ttft_s:g} s"

    def expected_job_s(self, req: PrefillRequest) -> float:
        """`expected_prefill_s` of a queued request, from the router's view of its prefix hit."""
        return self.expected_prefill_s(req.input_len, min(req.cached_len, req.input_len - 1))

    def expected_prefill_s(self, input_len: int, cached_len: int) -> float:
        """The profile's prefill time; in torch mode, the measured seconds per computed token so far."""
        profile = getattr(self.compute, "prefill_time_s", None)
        if profile is not None:
            return float(profile(input_len, cached_len))
        return self.s_per_token * (input_len - cached_len)

    def probe(self, req: ProbeRequest) -> dict[str, Any]:
        """`POST /v1/probe`: an active probe to `req.decode` on that destination's KV connections."""
        return self._dest(req.decode).probe(req)

    def _dest(self, decode: KVDestination) -> Destination:
        key = (decode.host, decode.kv_port)
        with self.lock:
            if key not in self.dests:
                self.dests[key] = Destination(key[0], key[1], self.cfg.kv_connections, self._done, self.compute.section.spec.name,
                                              self.cfg.kv_timeout_s, self.cfg.kv_connector, self.tcp_log, decode.instance,
                                              self.cfg.kv_congestion_control, self.cfg.kv_mss_bytes)
            return self.dests[key]

    def _done(self, job: PrefillJob) -> None:
        """A transfer ended: a successful prefill leaves its full blocks in the prefix pool, with the
        linear/SWA state checkpointed at the last full block boundary (where a later prompt can reuse it)."""
        hashes = list(job.req.block_hashes)
        if job.result.get("status") == "ok":
            if self.pool.store_tensors:
                if job.checkpoint is not None:
                    self.pool.insert(hashes, job.checkpoint)
            else:
                self.pool.insert(hashes, tokens=prefilled_blocks(job.req.input_len, False) * BLOCK_TOKENS)
        self._release(job)
        job.done.set()

    def _release(self, job: PrefillJob) -> None:
        if job.hit is not None:
            self.pool.release(job.hit)
        job.hit = job.checkpoint = None

    def _loop(self) -> None:
        while True:
            _, _, job = self.jobs.get()
            self._take(job)
            self.busy = False

    def _take(self, job: PrefillJob) -> None:
        """Start one job taken off the queue, unless it failed there already or is shed."""
        with self.lock:
            if job.started:  # failed or cancelled in the queue already
                self.left_queue -= 1
                return
            job.started = True
        shed = self._shed(job)
        if shed is not None:
            job.fail(shed)
            return
        self.busy = True
        try:
            self._run(job)
        except Exception as exc:  # a bad request must not stop the worker
            _log(f"prefill {job.request_id} failed: {type(exc).__name__}: {exc}")
            self._release(job)
            job.fail(f"prefill failed: {type(exc).__name__}: {exc}")

    def _preempt(self, running: PrefillJob, left_s: float) -> None:
        """At a layer boundary of `running` (profile compute only; `left_s`: its expected compute still to
        do): run to their end the queued jobs of a lower `priority` value first, then let `running` go on
        (vLLM's priority scheduling preempts a running request of a lower priority; its chunked prefill
        lets a short prompt start within a step, which a layer of a paced prefill stands in for). Only with
        time `running` can spare: when it carries a TTFT objective, a job is run first only if `running`
        still ends its prefill within that objective after it (a prefill that would miss it anyway is not
        made later). The pause is real time: its later layers are not repaid."""
        req = running.req
        deadline_s = None if req.slo_ttft_s is None else running.arrival_s + req.slo_ttft_s
        while True:
            with self.jobs.mutex:  # the head is checked and taken at once (from the queue's heap, as its `get` takes it)
                heap = self.jobs.queue
                if not heap or heap[0][0] >= req.priority:
                    return
                if deadline_s is not None and now_s() + left_s + self.expected_job_s(heap[0][2].req) > deadline_s:
                    return
                _, _, job = heapq.heappop(heap)
            t_s = now_s()
            self._take(job)
            running.paused_s += now_s() - t_s

    def plan(self, job: PrefillJob) -> Any:
        """What to compute and send: resume from this pool's longest usable prefix (observed here, not the
        router's belief), send what the decode lacks, checkpoint at the last full block boundary."""
        from testbed.serving.compute import PrefillPlan

        req = job.req
        input_len = req.input_len
        job.hit = self.pool.match(list(req.block_hashes), max_tokens=input_len - 1, acquire=True)
        boundary = prefilled_blocks(input_len, self.pool.store_tensors) * BLOCK_TOKENS  # torch: the last token is the decode's
        return PrefillPlan(input_len, job.hit.tokens, req.decode_prefix_len,
                           boundary if boundary > job.hit.tokens else None, job.hit.cache, req.kv_dtype)

    def _run(self, job: PrefillJob) -> None:
        req = job.req
        dest = self._dest(req.decode)
        job.result["prefill_start_s"] = now_s()
        job.result["queue_s"] = job.result["prefill_start_s"] - job.queued_s

        handed: list[float] = []  # when the compute last handed a layer over (after any back-pressure)

        def computed() -> None:  # the compute ran from the last hand-over until now
            if handed:
                job.compute_after_first_s += now_s() - handed[-1]

        def on_layer(layer: Any) -> None:
            computed()
            dest.items.put(("layer", job, layer))  # blocks while the path is full: that time is the transfer's
            handed.append(now_s())
            if self.preemptive and req.priority > 0:
                left = 1.0 - (layer.layer_index + 1) / len(self.compute.section.spec.layers)
                self._preempt(job, left * self.expected_prefill_s(req.input_len, plan.cached_len))
                # the pause counts as this job's compute (from the hand-over): its KV clock pauses meanwhile

        try:
            plan = self.plan(job)
            job.result.update(prefill_cached_len=plan.cached_len, decode_prefix_len=plan.send_from)
            prompt = list(req.prompt_token_ids) if req.prompt_token_ids is not None else None
            out = self.compute.prefill(job.request_id, plan, prompt, on_layer)
        except Exception as exc:
            dest.items.put(("abort", job, f"prefill failed: {exc}"))
            raise
        job.checkpoint = out.checkpoint
        computed()
        job.result["prefill_end_s"] = now_s()
        if out.late_s is not None:
            job.result["prefill_late_s"] = out.late_s
        if job.paused_s:
            job.result["prefill_paused_s"] = job.paused_s
        # this prefill's own pace: the time other jobs ran while it stood paused is theirs, not its own
        took_s = own_prefill_s(job.result["prefill_start_s"], job.result["prefill_end_s"], job.paused_s) / max(1, req.input_len - plan.cached_len)
        self.s_per_token = took_s if self.s_per_token == 0 else 0.8 * self.s_per_token + 0.2 * took_s
        dest.items.put(("finish", job, out.tokens))

    def state(self) -> WorkerState:
        congestion: dict[str, Any] = {}
        for (host, port), d in list(self.dests.items()):
            c = d.congestion()
            if c:
                congestion[f"{host}:{port}"] = c
        return WorkerState("prefill", self.cfg.instance, self.cfg.cluster, queue_depth=max(0, self.jobs.qsize() - self.left_queue) + int(self.busy),
                           busy=self.busy, prefix_blocks=tuple(self.pool.prefix_hashes()), pool=self.pool.stats().to_dict(),
                           congestion=_merge_congestion(congestion))


def _merge_congestion(per_dest: dict[str, dict[str, Any]]) -> Congestion:
    """One congestion signal per worker (sums and maxima over its destinations), plus the detail."""
    if not per_dest:
        return Congestion()
    vals = list(per_dest.values())
    total = lambda k: sum(float(v.get(k) or 0) for v in vals)  # noqa: E731
    peak = lambda k: max(float(v.get(k) or 0) for v in vals)  # noqa: E731
    floor = min((float(v["min_rtt_ms"]) for v in vals if v.get("min_rtt_ms")), default=0.0)
    return Congestion(retransmits=total("retransmits"), rtt_ms=peak("rtt_ms"), min_rtt_ms=floor, cwnd=total("cwnd"),
                      send_queue_bytes=total("send_queue_bytes"), inflight_bytes=total("inflight_bytes"),
                      delivery_rate_bps=total("delivery_rate_bps"), goodput_bps=total("goodput_bps"),
                      path_rate_bps=total("path_rate_bps"), queue_rtt_ms=peak("queue_rtt_ms"), probing=total("probing"),
                      by_destination=per_dest)


# ------------------------------------------------------------------------------------------------ decode


def stream_late_s(first_token_s: float, due_at_first_s: float, now_s: float, due_s: float) -> float:
    """How far a request's token stream is behind its profile (profile mode, `decode_late_s`): its time
    since its first token less the profile's time of the steps since then (`Compute.decode_due_s` then
    and now). Measured, so a delay the pacer forgave or could not repay is in it."""
    return max(0.0, (now_s - first_token_s) - (due_s - due_at_first_s))


@dataclass
class DecodeSlot:
    req: DecodeRequest
    events: queue.Queue = field(default_factory=queue.Queue)
    kv_ready: threading.Event = field(default_factory=threading.Event)
    kv: Any = None  # a verified KVCache (torch) or a byte count (profile)
    kv_error: str | None = None
    kv_bytes: int = 0
    transfer_start_s: float | None = None
    transfer_end_s: float | None = None
    first_token_s: float | None = None
    emitted: int = 0
    next_input: int | None = None
    aborted: bool = False
    registered_s: float = field(default_factory=now_s)
    admitted_s: float | None = None  # ready to decode (KV verified), waiting for a place in the batch
    joined_s: float | None = None  # joined the batch
    prefix: Any = None  # this decode's pool hit (full-attention KV it will not be sent), held until the KV is in
    decode_prefix_len: int | None = None  # positions of that hit, told to the router (None: no block hashes given)
    due_at_first_s: float | None = None  # profile mode: the decode's profile time so far (`decode_due_s`) at this request's first token
    decode_late_s: float | None = None  # profile mode: its first-to-last token time past the profile's steps between them
    on_final: Callable[[], None] | None = None  # the worker's: its id is no longer in flight

    @property
    def request_id(self) -> str:
        return self.req.request_id

    def timeout_s(self, default_s: float) -> float:
        return self.req.request_timeout_s or default_s

    def deadline_s(self, default_s: float) -> float:
        """The request's deadline: its arrival at the router (or here) plus its request timeout."""
        return (self.req.arrival_s if self.req.arrival_s is not None else self.registered_s) + self.timeout_s(default_s)

    def final(self, status: str, reason: str | None) -> FinalEvent:
        if self.on_final is not None:
            self.on_final()
        queue_s = (self.joined_s or now_s()) - self.admitted_s if self.admitted_s is not None else None
        return FinalEvent(status, reason, self.kv_bytes, self.transfer_start_s, self.transfer_end_s, self.first_token_s,
                          now_s(), self.emitted, queue_s, self.decode_late_s)


class DecodeWorker:
    def __init__(self, cfg: WorkerConfig) -> None:
        from testbed.kv.connector import get_connector
        from testbed.serving.compute import make_compute

        self.cfg = cfg
        self.compute = make_compute(cfg)
        self.pool = make_pool(cfg, self.compute.section.spec)
        self.lock = threading.Lock()
        self.pending: dict[str, DecodeSlot] = {}
        self.ids_in_flight: set[str] = set()  # registered and not yet given their final event
        self.arrived: dict[str, tuple[float, Any]] = {}  # KV that came before its request
        self.admit_cond = threading.Condition()
        self.ready: deque[DecodeSlot] = deque()  # KV verified, waiting for a place in the batch
        self.active: list[DecodeSlot] = []
        self.placing: list[DecodeSlot] = []  # left the queue, being placed on the device (counted in `state`)
        self.receiver = get_connector(cfg.kv_connector).receiver(cfg.bind, int(cfg.kv_port or 9000), self._on_kv,
                                                                 timeout_s=cfg.kv_timeout_s).start()
        threading.Thread(target=self._loop, daemon=True, name="decode").start()

    def _on_kv(self, request_id: str, received: Any) -> None:
        """The transport's verdict on one transfer (verified KV, or failed with a reason); an active
        probe's bytes (checked like KV by the transport) are dropped here."""
        if request_id.startswith(PROBE_PREFIX):
            return
        with self.lock:
            slot = self.pending.get(request_id)
            if slot is None:
                self.arrived[request_id] = (now_s(), received)
                cutoff = now_s() - 2 * self.cfg.kv_timeout_s
                for rid in [r for r, v in self.arrived.items() if v[0] < cutoff]:
                    del self.arrived[rid]
                return
        self._fill(slot, received)

    def _fill(self, slot: DecodeSlot, received: Any) -> None:
        from testbed.serving.compute import join_prefix, restore_kv_dtype

        with self.lock:  # `_await_kv` lets go of the prefix too (an abandoned slot's): whoever takes it releases it
            prefix, slot.prefix = slot.prefix, None
        if slot.aborted:  # `abandon` ended it already: its KV is not wanted
            if prefix is not None:
                self.pool.release(prefix)
            return
        slot.kv = received.cache if received.cache is not None else received.kv_bytes
        slot.kv_error = None if received.ok else (received.reason or "transfer failed")
        hashes = list(slot.req.block_hashes)
        # KV that crossed in another dtype (float8: policy.kv_compression) decodes this request only: rounded
        # blocks in the pool would be served to later requests with the same prefix as the model's own
        rounded = slot.req.kv_dtype is not None and slot.req.kv_dtype != self.compute.section.spec.kv_dtype
        if received.ok and received.cache is not None:
            try:
                # float8 on the wire: back to the model's dtype (an undeclared dtype is left for `admit` to refuse)
                delta = restore_kv_dtype(received.cache, self.compute.section.spec.kv_dtype) if rounded else received.cache
                slot.kv = join_prefix(prefix.cache if prefix is not None else None, delta)
                if not rounded:
                    self.pool.insert(hashes, slot.kv)
            except ValueError as exc:
                slot.kv_error = str(exc)
        elif received.ok and hashes and not rounded:
            self.pool.insert(hashes, tokens=slot.req.input_len - 1)
        if prefix is not None:
            self.pool.release(prefix)
        slot.kv_bytes = int(received.kv_bytes)
        slot.transfer_start_s = received.first_frame_s
        slot.transfer_end_s = received.complete_s
        slot.kv_ready.set()

    def register(self, req: DecodeRequest) -> DecodeSlot:
        """Take a request: hold this pool's prefix of its prompt (`slot.prefix.tokens` is the
        ``decode_prefix_len`` the prefill is told) and wait for the rest of its KV."""
        slot = DecodeSlot(req)
        with self.lock:  # a second request of an id in flight took the first one's KV, or left it waiting to its timeout
            if slot.request_id in self.ids_in_flight:
                raise FieldError("request_id", f"{shown(slot.request_id)} is already in flight on this worker; give each "
                                 "request its own id")
            self.ids_in_flight.add(slot.request_id)
        slot.on_final = lambda: self._forget(slot.request_id)
        if req.block_hashes and req.input_len > 1:
            slot.prefix = self.pool.match(list(req.block_hashes), max_tokens=req.input_len - 1, acquire=True)
            slot.decode_prefix_len = slot.prefix.tokens
        with self.lock:
            early = self.arrived.pop(slot.request_id, None)
            if early is None:
                self.pending[slot.request_id] = slot
        if early is not None:
            self._fill(slot, early[1])
        threading.Thread(target=self._await_kv, args=(slot,), daemon=True).start()
        return slot

    def _forget(self, request_id: str) -> None:
        with self.lock:
            self.ids_in_flight.discard(request_id)

    def abandon(self, slot: DecodeSlot) -> None:
        """The router hung up on this request (`httpio.HangupWatch`): one still waiting for its KV ends now, failed
        (its prefix pin and its id in flight go with it, not at its request timeout: its prefill may have been
        cancelled in the queue and no KV will come); one in the batch leaves it at the next step, as when a token's
        write finds the connection closed."""
        slot.aborted = True
        slot.kv_ready.set()  # a slot waiting for its KV ends now (`_await_kv`); one in the batch at the next step (`_join`)

    def _await_kv(self, slot: DecodeSlot) -> None:
        """Wait for the KV until the request's deadline: the prefill's queue bound and the KV timeout (both on
        the prefill side) end a request earlier, with their own reasons."""
        ok = slot.kv_ready.wait(max(0.0, slot.deadline_s(self.cfg.request_timeout_s) - now_s()))
        with self.lock:
            self.pending.pop(slot.request_id, None)
            prefix, slot.prefix = slot.prefix, None
        if prefix is not None:
            self.pool.release(prefix)
        if not ok:
            slot.events.put(slot.final("failed", f"KV did not arrive within the request timeout "
                                                 f"({slot.timeout_s(self.cfg.request_timeout_s):g} s)"))
        elif slot.aborted:
            slot.events.put(slot.final("failed", ROUTER_GONE))
        elif slot.kv_error:
            slot.events.put(slot.final("failed", f"KV rejected: {slot.kv_error}"))
        elif self.cfg.compute == "torch" and not slot.req.prompt_token_ids:
            slot.events.put(slot.final("failed", "torch mode needs prompt_token_ids in the decode request"))
        elif (why := self._admit_kv(slot)) is not None:
            slot.kv = None
            slot.events.put(slot.final("failed", why))
        else:
            slot.admitted_s = now_s()
            with self.admit_cond:
                self.ready.append(slot)
                self.admit_cond.notify()

    def _admit_kv(self, slot: DecodeSlot) -> str | None:
        """`Compute.admit` on this request's own thread; the reason it fails, or None (any exception fails the
        request: this thread is the only one that would finish it)."""
        try:
            self.compute.admit(slot)
        except ValueError as exc:
            return f"KV rejected: {exc}"
        except Exception as exc:
            return f"KV rejected: {type(exc).__name__}: {exc}"
        return None

    def _place_kv(self, slot: DecodeSlot) -> str | None:
        """`Compute.place` as the request joins the batch; the reason it fails (e.g. the device is out of
        memory: this request fails, the batch goes on), or None."""
        try:
            self.compute.place(slot)
        except Exception as exc:
            slot.kv = None
            return f"KV could not be placed on the decode device: {type(exc).__name__}: {exc}"
        return None

    def _join(self) -> bool:
        """Between steps: ready requests join the batch up to BS_max, each placed on the device as it joins
        (`Compute.place`; one that cannot be fails alone); those past their deadline leave the batch queue
        failed, with a reason naming it. True when it had to wait for a request (idle)."""
        waited = False
        with self.admit_cond:
            while not self.active and not self.ready:
                waited = True
                self.admit_cond.wait()
            now = now_s()
            expired = [x for x in self.ready if not x.aborted and now > x.deadline_s(self.cfg.request_timeout_s)]
            gone = [x for x in list(self.ready) + self.active if x.aborted] + expired
            self.ready = deque(x for x in self.ready if not x.aborted and x not in expired)
            self.active = [x for x in self.active if not x.aborted]
            while len(self.active) + len(self.placing) < self.cfg.bs_max and self.ready:
                self.placing.append(self.ready.popleft())
        for slot in gone:
            slot.kv = None  # its device memory goes now (before others are placed), not when the client lets go
            if slot.aborted:  # its client has gone; a stream handler still waiting (`abandon`) returns on this
                slot.events.put(slot.final("failed", ROUTER_GONE))
        for slot in list(self.placing):  # outside the lock: a copy to the device takes a while
            why = self._place_kv(slot)
            self.placing.remove(slot)
            if why is None:
                slot.joined_s = now_s()
                self.active.append(slot)
            else:
                slot.events.put(slot.final("failed", why))
        for slot in expired:
            waited_s = now - (slot.admitted_s or now)
            slot.events.put(slot.final("failed", f"waited {waited_s:.1f} s in the batch queue of decode instance {self.cfg.instance} "
                                                 f"(request timeout {slot.timeout_s(self.cfg.request_timeout_s):g} s)"))
        return waited

    def _loop(self) -> None:
        """Continuous batching: up to BS_max requests per step, joining and leaving between steps."""
        while True:
            if self._join():
                self.compute.decode_idle()  # an empty batch owes nothing to the next step
            if not self.active:
                continue
            try:
                tokens = self.compute.decode_step(self.active)
            except Exception as exc:
                _log(f"decode step failed: {type(exc).__name__}: {exc}")
                for slot in self.active:
                    slot.kv = None
                    slot.events.put(slot.final("failed", f"decode failed: {type(exc).__name__}: {exc}"))
                self.active = []
                continue
            t, due = now_s(), self.compute.decode_due_s
            keep = []
            for slot, tok in zip(self.active, tokens):
                if slot.first_token_s is None:
                    slot.first_token_s, slot.due_at_first_s = t, due
                if due is not None and slot.due_at_first_s is not None:
                    slot.decode_late_s = stream_late_s(slot.first_token_s, slot.due_at_first_s, t, due)
                slot.events.put(TokenEvent(int(tok), slot.emitted, t))
                slot.emitted += 1
                if slot.emitted >= slot.req.output_len:
                    slot.kv = None
                    slot.events.put(slot.final("ok", None))
                else:
                    keep.append(slot)
            self.active = keep

    def state(self) -> WorkerState:
        with self.lock:
            waiting = len(self.pending)
        joining = len(self.placing)
        return WorkerState("decode", self.cfg.instance, self.cfg.cluster,
                           queue_depth=waiting + len(self.ready) + joining + len(self.active),
                           busy=bool(self.active) or joining > 0, batch=len(self.active), pool=self.pool.stats().to_dict())


# -------------------------------------------------------------------------------------------------- HTTP


def make_handler(worker: Any) -> type[BaseHTTPRequestHandler]:
    hangups = HangupWatch() if isinstance(worker, DecodeWorker) else None  # a decode stream's router that went away

    class Handler(RequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = worker.cfg.request_timeout_s  # for the request line, headers and body (`read_json_body` lifts it)

        def log_message(self, fmt: str, *args: Any) -> None:  # quiet: the run keeps its own records
            return

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """The stdlib's own refusals (a method it has no ``do_`` for, a malformed request line) as JSON too."""
            self.close_connection = True
            self._json(code, {"error": message or self.responses.get(code, ("error",))[0]})

        def _json(self, code: int, obj: dict[str, Any]) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/healthz":
                self._json(200, Health(True, worker.cfg.role, worker.cfg.instance).to_json())
            elif self.path == "/v1/state":
                self._json(200, worker.state().to_json())
            else:
                self._json(404, {"error": f"no such path {self.path}"})

        def do_POST(self) -> None:
            try:
                body = read_json_body(self)
            except BodyError as exc:
                self.close_connection = True  # what is left of a refused body is not read
                self._json(exc.status, {"error": str(exc)})
                return
            try:
                if body is not None and not isinstance(body, dict):
                    self._json(400, {"error": "body must be a JSON object"})
                elif self.path == "/v1/prefill" and isinstance(worker, PrefillWorker):
                    self._json(200, worker.submit(PrefillRequest.from_json(body)).to_json())
                elif self.path == "/v1/prefill/cancel" and isinstance(worker, PrefillWorker):
                    self._json(200, worker.cancel(PrefillCancel.from_json(body).request_id).to_json())
                elif self.path == "/v1/probe" and isinstance(worker, PrefillWorker):
                    self._json(200, worker.probe(ProbeRequest.from_json(body)))
                elif self.path == "/v1/decode" and isinstance(worker, DecodeWorker):
                    self._stream(worker.register(DecodeRequest.from_json(body)))
                else:
                    self._json(404, {"error": f"no such path {self.path} on a {worker.cfg.role} worker"})
            except FieldError as exc:  # one line naming the field, as for a scenario
                self._json(400, {"error": str(exc)})

        def _stream(self, slot: DecodeSlot) -> None:
            self.send_response(200)
            if slot.decode_prefix_len is not None:  # what the prefill need not send (SGLang's decode_prefix_len)
                self.send_header(DECODE_PREFIX_HEADER, str(slot.decode_prefix_len))
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            if hangups is not None:
                hangups.watch(self.connection, lambda: worker.abandon(slot))
            try:
                while True:
                    ev = slot.events.get()
                    self.wfile.write(b"data: " + json.dumps(ev.to_json()).encode() + b"\n\n")
                    self.wfile.flush()
                    if isinstance(ev, FinalEvent):
                        return
            except (BrokenPipeError, ConnectionResetError):
                slot.aborted = True
            finally:
                if hangups is not None:
                    hangups.unwatch(self.connection)

    return Handler


def serve(cfg: WorkerConfig) -> None:
    worker = PrefillWorker(cfg) if cfg.role == "prefill" else DecodeWorker(cfg)
    server = Server((cfg.bind, cfg.port), make_handler(worker))

    def stop(signum: int, frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if cfg.ready_file:
        write_json(cfg.ready_file, {"pid": os.getpid(), "port": cfg.port, "t_s": now_s()})
    _log(f"{cfg.role} {cfg.instance} ({cfg.compute}) on {cfg.host}:{cfg.port} ready")
    server.serve_forever(poll_interval=0.2)
    if hasattr(worker, "close"):
        worker.close()
    _log("stopped")
    sys.stderr.flush()
    os._exit(0)  # do not wait for request threads or torch's thread pools at interpreter exit


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbed.serving.worker")
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--config", required=True, help="worker config JSON written by `prfaas run`")
    args = p.parse_args(argv)
    cfg = WorkerConfig.load(args.config)
    cfg.role = args.role
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    serve(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
