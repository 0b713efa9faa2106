"""The router: an OpenAI-compatible front door that places each request's prefill and decode.

For each ``POST /v1/completions`` it asks the global KV cache manager for the prefix match in every
cluster, lets the policy decide (PrfaaS or PD-P, which instances), opens the decode stream
(``POST /v1/decode``, `testbed.serving.protocol`, docs/protocol.md) and then the prefill (``POST /v1/prefill``) that ships the KV to
that decode instance, relays the tokens to the client, and records one row per request. A background
poller reads every worker's ``/v1/state`` (queues, prefix pools, the transport's congestion signal);
the run pushes WAN samples to ``/v1/telemetry``; a control loop ticks the policy.

Units: the router works in emulated units (wire x scale). WAN samples arrive in wire units unless
they say ``"units": "emulated"``; metric names that carry bytes or bit rates end in ``_emulated``.
Times in records are seconds since the run's start (`testbed.clock.run_t0`). See docs/router.md.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import http.client
import json
import math
import signal
import socket
import struct
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator

from testbed import blocks, clock, units
from testbed.blocks import BLOCK_TOKENS, prompt_token_ids
from testbed.errors import FieldError, UserError
from testbed.rundir import CLIENT_DISCONNECTED, ROUTER_RECORD_COLUMNS, ROUTER_REQUESTS_FILE, SCHEDULER_FILE, router_records_frame
from testbed.models.spec import DTYPE_BYTES, parse_dtype
from testbed.scale import Scale
from testbed.validation import Fields, boolean, non_negative, shown, whole_number, positive_number
from testbed.kv.connector import KVConnectorScheduler, KVEndpoint
from testbed.serving.httpio import BodyError, HangupWatch, RequestHandler, Server, json_value, read_json_body
from testbed.serving.kvmanager import KVManager
from testbed.serving.prometheus import CONTENT_TYPE, RequestHistograms, RouterCollector, exposition, new_registry
from testbed.serving.policy.signals import GroundTruth, admit
from testbed.serving.protocol import (
    DECODE_PREFIX_HEADER, DecodeRequest, FinalEvent, KVDestination, PrefillCancel, PrefillCancelled, PrefillRequest, PrefillResult,
    ProbeRequest, TokenEvent, WorkerState, decode_event, request_id,
)
from testbed.serving.policy import (
    ClusterState, Decision, InstanceState, NoInstanceError, PolicySpec, RequestView, SchedulerLog,
    TelemetrySample, build_policy, parse_policy_section,
)
from testbed.serving.policy.spec import COMPRESSED_KV_DTYPE

COMPUTE_MODES = ("profile", "torch")


# ------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class PrefillInstanceConfig:
    cluster: str  # "prfaas" | "pd"
    instance: int
    host: str  # IP address
    port: int  # control port (8100 + instance)
    standby: bool = False  # started for role flips; receives nothing until flipped in


@dataclass(frozen=True)
class DecodeInstanceConfig:
    instance: int
    host: str
    port: int  # control port (8200 + instance)
    kv_port: int  # KV receive port (9000 + instance)
    standby: bool = False


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[PrefillInstanceConfig, ...]
    decode: tuple[DecodeInstanceConfig, ...]
    policy: PolicySpec = field(default_factory=PolicySpec)
    host: str = "0.0.0.0"
    port: int = 8000
    wan_capacity_bps: float = 100e9  # PrfaaS -> PD egress capacity, emulated units, until telemetry says otherwise
    scale: float = 1.0  # emulated = wire x scale
    model: str = "prfaas"
    compute: str = "profile"  # "torch": send prompt_token_ids to the workers
    kv_dtype: str = "bfloat16"  # the model's full-attention KV dtype (what `policy.kv_compression` shrinks to float8)
    vocab_size: int = 32000
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 300.0  # a request's whole budget; also the longest silence from a worker
    shed_ttft_s: float | None = None  # early shedding: prefill workers shed a request predicted past this TTFT
    slo_ttft_s: float | None = None  # the TTFT objective (serving.slo.ttft): a preemption may spend only a prefill's slack to it
    state_poll_s: float = 0.5
    state_timeout_s: float = 2.0
    max_blocks_per_instance: int = 1 << 20

    def to_mapping(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("prefill", "decode", "policy")}
        d["prefill"] = [asdict(p) for p in self.prefill]
        d["decode"] = [asdict(x) for x in self.decode]
        d["policy"] = self.policy.to_mapping()
        return d

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_mapping(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "RouterConfig":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"router config {path}: {exc}") from None
        return cls.from_mapping(data, str(path))

    @classmethod
    def from_mapping(cls, data: Any, source: str | None = None) -> "RouterConfig":
        f = Fields(data, "", source)
        d = cls((), ())
        pos = positive_number

        prefill = []
        for p in f.items("prefill"):
            prefill.append(PrefillInstanceConfig(p.choice("cluster", ("prfaas", "pd")), p.get("instance", whole_number),
                                                 p.get("host", str), p.get("port", whole_number), p.get("standby", boolean, False)))
            p.done()
        decode = []
        for x in f.items("decode"):
            decode.append(DecodeInstanceConfig(x.get("instance", whole_number), x.get("host", str), x.get("port", whole_number),
                                               x.get("kv_port", whole_number), x.get("standby", boolean, False)))
            x.done()
        cfg = cls(
            prefill=tuple(prefill),
            decode=tuple(decode),
            policy=parse_policy_section(f.section("policy")),
            host=f.get("host", str, d.host),
            port=f.get("port", whole_number, d.port),
            wan_capacity_bps=f.get("wan_capacity_bps", pos, d.wan_capacity_bps),
            scale=f.get("scale", lambda v: Scale(v).factor, d.scale),
            model=f.get("model", str, d.model),
            compute=f.choice("compute", COMPUTE_MODES, d.compute),
            kv_dtype=f.get("kv_dtype", parse_dtype, d.kv_dtype),
            vocab_size=f.get("vocab_size", whole_number, d.vocab_size),
            connect_timeout_s=f.get("connect_timeout_s", pos, d.connect_timeout_s),
            request_timeout_s=f.get("request_timeout_s", pos, d.request_timeout_s),
            shed_ttft_s=f.get("shed_ttft_s", pos, d.shed_ttft_s),
            slo_ttft_s=f.get("slo_ttft_s", pos, d.slo_ttft_s),
            state_poll_s=f.get("state_poll_s", pos, d.state_poll_s),
            state_timeout_s=f.get("state_timeout_s", pos, d.state_timeout_s),
            max_blocks_per_instance=f.get("max_blocks_per_instance", whole_number, d.max_blocks_per_instance),
        )
        f.done()
        if not cfg.decode:
            raise FieldError("decode", "needs at least one decode instance", source)
        if not cfg.prefill:
            raise FieldError("prefill", "needs at least one prefill instance", source)
        for name, items in (("prefill", cfg.prefill), ("decode", cfg.decode)):
            ids = [i.instance for i in items]
            if len(set(ids)) != len(ids):
                raise FieldError(name, f"instance ids must be unique, got {ids}", source)
        return cfg


# --------------------------------------------------------------------------------------- tokenising


def tokenize(text: str, vocab_size: int) -> list[int]:
    """Deterministic stand-in tokeniser: each whitespace-separated word hashed to one id."""
    return [int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little") % vocab_size for w in text.split()]


def block_hashes_of(token_ids: list[int]) -> list[int]:
    """One hash per `BLOCK_TOKENS` block of the prompt (the last may be partial), as in Mooncake traces."""
    out = []
    for i in range(0, len(token_ids), BLOCK_TOKENS):
        block = token_ids[i:i + BLOCK_TOKENS]
        digest = hashlib.blake2b(struct.pack(f"<{len(block)}q", *block), digest_size=8).digest()
        out.append(int.from_bytes(digest, "little") >> 1)
    return out


def detokenize(token_id: int) -> str:
    return f" t{token_id}"


class BadRequest(Exception):
    """A client mistake: answered with HTTP `status` and an OpenAI-style error naming `param`."""

    def __init__(self, param: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass
class Completion:
    """A parsed client request."""

    request_id: str
    input_len: int
    output_len: int
    block_hashes: list[int]
    token_ids: list[int] | None
    stream: bool
    model: str


def token_count(v: Any) -> int:
    """A request's token count (`max_tokens`, `prfaas.input_len`): a whole number from 1 to `units.MAX_TOKENS` (past any
    model's context; a decode of 10**21 tokens would hold its batch slot for good, as vLLM refuses more than
    `max_model_len`)."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{shown(v)} is not a whole number >= 1")
    if v > units.MAX_TOKENS:
        raise ValueError(f"{shown(v)} is more than {units.MAX_TOKENS} tokens (16M), past any model's context")
    return v


PRFAAS_EXTENSION = ("block_hashes", "input_len", "request_id")  # the body's "prfaas" object (docs/router.md, "HTTP API")


@dataclass(frozen=True)
class PrfaasExtension:
    """The body's ``prfaas`` object, read: a hashed prompt (`block_hashes` with its `input_len`) and/or a `request_id`."""

    block_hashes: list[int] | None = None  # None: the prompt is the body's own
    input_len: int | None = None
    request_id: str | None = None  # None: one is generated

    @classmethod
    def read(cls, v: Any) -> "PrfaasExtension":
        """`v` (the body's ``prfaas``; null is none) read with `Fields`: a mapping of `PRFAAS_EXTENSION` only, whose
        `block_hashes` (`blocks.block_hashes`; a null too is refused, not taken as left out) come with an `input_len`
        (`token_count`) that has a block for each (at most one hash per `BLOCK_TOKENS` tokens), and an `input_len` only
        beside them; a `request_id` of null is generated. Every refusal is a `FieldError` naming ``prfaas.<key>`` and
        what is allowed."""
        try:
            f = Fields(v, "prfaas")
        except FieldError as exc:  # `[]` and `0` passed as no extension until 2026-12-07
            raise FieldError(exc.field, f"{exc.message}; give an object of {', '.join(PRFAAS_EXTENSION)}, or null") from None
        hashes = f.get("block_hashes", blocks.block_hashes, None)
        n = f.get("input_len", token_count, None)
        rid = f.get("request_id", request_id, None)  # (a request_id of 0 or "" became a generated one, without a word)
        f.done()  # a typo (`block_hash`) was ignored, and the prompt served as if the extension were not there
        if not f.has("block_hashes"):
            if f.has("input_len"):
                raise f.error("input_len", "goes with prfaas.block_hashes (a prompt's length is its own)")
            return cls(request_id=rid)
        if hashes is None:  # `Fields` reads a null as a key left out; this one was given, and was refused
            raise f.error("block_hashes", "null is not a list of whole numbers (block hashes); give one, or leave the key out")
        if n is None:
            raise f.error("input_len", f"is required with prfaas.block_hashes: a whole number from 1 to {units.MAX_TOKENS}")
        if len(hashes) > math.ceil(n / BLOCK_TOKENS):
            raise f.error("block_hashes", f"{len(hashes)} hashes for {n} tokens; at most one per {BLOCK_TOKENS} tokens")
        return cls(hashes, n, rid)


def _prompt_fits(tokens: int) -> None:
    """A prompt of at most `units.MAX_TOKENS` tokens, as `prfaas.input_len` and `max_tokens` are: a longer one was
    served, and the workers refused its input_len, so the client got a 502 for its own mistake."""
    if tokens > units.MAX_TOKENS:
        raise BadRequest("prompt", f"{tokens} tokens, more than {units.MAX_TOKENS} (16M), past any model's context")


def parse_completion(body: Any, cfg: RouterConfig) -> Completion:
    """An OpenAI completions body, plus the testbed extension ``"prfaas": {"block_hashes", "input_len",
    "request_id"}`` (`PrfaasExtension`) for hashed prompts without token text."""
    if not isinstance(body, dict):
        raise BadRequest("body", "the body must be a JSON object")
    try:
        ext = PrfaasExtension.read(body.get("prfaas"))
    except FieldError as exc:
        raise BadRequest(exc.field, exc.message) from None
    try:
        max_tokens = token_count(body.get("max_tokens", 16))  # (a null is refused, not the default)
    except ValueError as exc:
        raise BadRequest("max_tokens", str(exc)) from None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    token_ids: list[int] | None = None
    if ext.block_hashes is not None:
        assert ext.input_len is not None
        n, hashes = ext.input_len, ext.block_hashes
    elif isinstance(prompt, str):
        _prompt_fits(len(prompt.split()))  # counted before each word is hashed: 64 MiB of words took 16 s to refuse
        try:
            token_ids = tokenize(prompt, cfg.vocab_size)
        except UnicodeEncodeError:  # JSON's "\ud800": a lone surrogate, not a character
            raise BadRequest("prompt", "is not valid Unicode text (a lone surrogate)") from None
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        _prompt_fits(len(prompt))
        if any(t < 0 or t >= cfg.vocab_size for t in prompt):
            raise BadRequest("prompt", f"token ids must lie in [0, {cfg.vocab_size})")
        token_ids = list(prompt)
    else:
        raise BadRequest("prompt", "give a string, a list of token ids, or prfaas.block_hashes with prfaas.input_len")
    if token_ids is not None:
        if not token_ids:
            raise BadRequest("prompt", "is empty")
        n, hashes = len(token_ids), block_hashes_of(token_ids)
    stream, model = body.get("stream"), body.get("model")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("stream", f"{stream!r} is not true or false")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model", f"{model!r} is not a string")
    rid = ext.request_id or f"cmpl-{uuid.uuid4().hex[:16]}"
    if cfg.compute == "torch" and token_ids is None:
        token_ids = prompt_token_ids(hashes, n, cfg.vocab_size, rid)
    return Completion(rid, n, max_tokens, hashes, token_ids, bool(stream), model or cfg.model)


# ------------------------------------------------------------------------------------------- router


class WorkerFailed(Exception):
    """A worker failed the request or could not be reached; the message is the record's reason."""


class ClientGone(Exception):
    """The client hung up before its first token (`Hangup`): not a worker's fault."""


class Hangup:
    """A streaming client's hang-up before its first token, as `HangupWatch` notices it (from its own thread):
    it aborts the request's decode connection, so the read the request is blocked in returns at once, and
    the request ends as a client that went away (`ClientGone`), its queued prefill cancelled."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._aborts: list[Callable[[], None]] = []

    def set(self) -> None:
        with self._lock:
            self._set, aborts = True, list(self._aborts)
        for abort in aborts:
            abort()

    def is_set(self) -> bool:
        return self._set

    def on_set(self, abort: Callable[[], None]) -> None:
        """Call `abort` when the client hangs up (at once if it already has)."""
        with self._lock:
            if not self._set:
                self._aborts.append(abort)
                return
        abort()


PROBE_RETRY_S = 2.0  # after a probe failed or was refused, the next waits this long


def next_poll_wait_s(confirm_s: float, period_s: float) -> float:
    """The wait to the router's next state poll: `confirm_s` (the policy's `confirm_poll_s`, a confirm poll) when it
    is sooner than `period_s` (`state_poll_s`), else the period. A confirm poll only ever comes sooner:
    `policy.estimator.poll_confirm: 168h` held the router's polls, and so every signal of the control loop, for up
    to a week after a lone saturated poll (2026-12-07)."""
    return min(confirm_s, period_s) if confirm_s > 0 else period_s


@dataclass
class _Instance:
    cfg: PrefillInstanceConfig | DecodeInstanceConfig
    role: str
    cluster: str
    inflight: int = 0
    inflight_tokens: int = 0  # uncached prompt tokens of the requests in flight on it (prefill instances)
    healthy: bool = True
    reported_queue: int = 0
    retransmits: float = 0.0
    congestion: dict[str, float] = field(default_factory=dict)  # its KV senders' TCP_INFO summary (wire units, PrfaaS only)


class Router:
    """Owns the KV manager, the policy, the instance table and the records; `start()` serves HTTP."""

    def __init__(self, config: RouterConfig) -> None:
        self.cfg = config
        self.scale = Scale(config.scale)
        self.log = SchedulerLog()
        self.kv_scheduler = KVConnectorScheduler()  # the KV connector's scheduler side: what each prefill sends, where
        self.prefill = {p.instance: _Instance(p, "prefill", p.cluster) for p in config.prefill}
        self.decode = {d.instance: _Instance(d, "decode", "pd") for d in config.decode}
        self.kv = KVManager({i: p.cluster for i, p in self.prefill.items()}, max_blocks_per_instance=config.max_blocks_per_instance)
        standby = [("prefill", p.instance) for p in config.prefill if p.standby] + [("decode", d.instance) for d in config.decode if d.standby]
        self.policy = build_policy(config.policy, self._states(self.prefill), self._states(self.decode), log=self.log,
                                   capacity_bps=config.wan_capacity_bps, standby=standby,
                                   compressed_kv_ratio=DTYPE_BYTES[COMPRESSED_KV_DTYPE] / DTYPE_BYTES[config.kv_dtype])
        self._lock = threading.Lock()
        self._offloads_started = 0
        self._kv_seen_s = -math.inf  # the last state poll whose PrfaaS senders had KV queued or in flight
        self._snapshot: tuple[tuple[InstanceState, ...], tuple[InstanceState, ...]] | None = None
        self._records: list[dict[str, Any]] = []
        self._inflight_ids: set[str] = set()
        self._counts: dict[tuple[str, str], int] = {}
        self._kv_bytes: dict[str, int] = {}
        self._wan: dict[str, float] = {"egress_bps": 0.0, "capacity_bps": config.wan_capacity_bps, "backlog_bytes": 0.0, "drops": 0.0}
        self._retrans_total = 0.0
        self.truth = GroundTruth()
        self._stop = threading.Event()
        self.registry = new_registry()
        self.histograms = RequestHistograms(self.registry)
        self.registry.register(RouterCollector(self.metric_state))
        self._server: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []
        self.hangups: HangupWatch | None = None  # started with the HTTP server

    # -- lifecycle
    def start(self) -> tuple[str, int]:
        self._server = Server((self.cfg.host, self.cfg.port), make_handler(self), bind_and_activate=False)
        try:
            self._server.server_bind()
            self._server.server_activate()
        except OSError:
            self._server.server_close()
            raise
        server = self._server
        self.hangups = HangupWatch()
        for target, name in ((lambda: server.serve_forever(0.1), "router-http"), (self._poll_loop, "router-poll"),
                             (self._control_loop, "router-control"), (self._probe_loop, "router-probe")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self.address

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None
        return self._server.server_address[0], self._server.server_address[1]

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self.hangups is not None:
            self.hangups.close()

    # -- state for the policy
    @staticmethod
    def _states(table: dict[int, _Instance]) -> tuple[InstanceState, ...]:
        return tuple(InstanceState(i, x.cluster, x.cfg.host, x.inflight, x.healthy, x.inflight_tokens)
                     for i, x in table.items())

    def _cluster_state(self, match: Any) -> ClusterState:
        with self._lock:
            if self._snapshot is None:  # rebuilt only after an in-flight count or health changed
                self._snapshot = (self._states(self.prefill), self._states(self.decode))
            return ClusterState(clock.now_s(), self._snapshot[0], self._snapshot[1], match)

    def _changed(self, inst: _Instance, inflight: int = 0, healthy: bool | None = None, tokens: int = 0) -> None:
        """Every change of what the policy sees goes through here (caller holds the lock). `tokens`: the
        request's uncached tokens, added with its +1 and taken away with its -1 (prefill instances)."""
        if inflight > 0 and inst.cluster == "prfaas" and inst.role == "prefill":
            self._offloads_started += 1  # a probe that overlapped one is not an idle measurement
        if inflight or (healthy is not None and healthy != inst.healthy):
            inst.inflight += inflight
            inst.inflight_tokens += inflight * tokens
            inst.healthy = inst.healthy if healthy is None else healthy
            self._snapshot = None

    def records(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(r) for r in self._records]

    # -- one request
    def decide(self, c: Completion, arrival_s: float) -> Decision:
        match = self.kv.match(c.block_hashes, c.input_len)
        return self.policy.decide(RequestView(c.request_id, c.input_len, c.output_len, arrival_s), self._cluster_state(match))

    def serve(self, c: Completion, hangup: Hangup | None = None) -> Iterator[TokenEvent | dict[str, Any]]:
        """Run one request; yields `TokenEvent`s, and last the record (``{"record": ...}``). Never raises
        for a worker fault: the record says failed, with the reason. `hangup`: set when the client hangs up
        before its first token (the record then says so, as when it goes away later)."""
        arrival = clock.now_s()
        rec: dict[str, Any] = dict.fromkeys(ROUTER_RECORD_COLUMNS)
        rec.update(request_id=c.request_id, arrival_s=arrival, input_len=c.input_len, output_len=c.output_len, status="failed")
        try:
            with self._lock:
                if c.request_id in self._inflight_ids:
                    raise WorkerFailed(f"request id {c.request_id!r} is already in flight")
                self._inflight_ids.add(c.request_id)
            try:
                dec = self.decide(c, arrival)
            except NoInstanceError as exc:
                raise WorkerFailed(str(exc)) from None
            rec.update(route=dec.route, threshold=dec.threshold, cached_len=dec.cached_len, uncached_len=dec.uncached_len,
                       prefill_instance=dec.prefill_instance, decode_instance=dec.decode_instance, route_reason=dec.reason,
                       cache_transfer_tokens=dec.cache_transfer_tokens,
                       kv_dtype=dec.kv_dtype or self.cfg.kv_dtype)
            yield from self._run(c, dec, rec, arrival, hangup or Hangup())
        except WorkerFailed as exc:
            rec["reason"] = str(exc)
        except ClientGone:
            rec.update(status="failed", reason=CLIENT_DISCONNECTED)
        except GeneratorExit:  # the client went away mid-stream (or cut the run's drain: early_stop.drain_settled)
            rec.update(status="failed", reason=CLIENT_DISCONNECTED)
            self._store(rec)
            raise
        finally:
            with self._lock:
                self._inflight_ids.discard(c.request_id)
        self._store(rec)
        yield {"record": rec}

    def _store(self, rec: dict[str, Any]) -> None:
        if rec["finish_s"] is None:
            rec["finish_s"] = clock.now_s()
        if rec["kv_bytes"] is not None:
            rec["kv_bytes_emulated"] = self.scale.emulated_bytes(int(rec["kv_bytes"]))
        for k in ("arrival_s", "prefill_start_s", "prefill_end_s", "transfer_start_s", "transfer_end_s", "first_token_s", "finish_s"):
            if rec[k] is not None:
                rec[k] = float(rec[k]) - clock.run_t0()
        with self._lock:
            self._records.append(rec)
            key = (rec["route"] or "none", rec["status"])
            self._counts[key] = self._counts.get(key, 0) + 1
            if rec["kv_bytes_emulated"]:
                self._kv_bytes[rec["route"]] = self._kv_bytes.get(rec["route"], 0) + rec["kv_bytes_emulated"]
        if rec["prefill_instance"] is not None and rec["prefill_instance"] in self.prefill:
            self.histograms.observe(rec, self.prefill[rec["prefill_instance"]].cluster)

    def _run(self, c: Completion, dec: Decision, rec: dict[str, Any], arrival_s: float, hangup: Hangup) -> Iterator[TokenEvent]:
        p, d = self.prefill[dec.prefill_instance], self.decode[dec.decode_instance]
        with self._lock:
            self._changed(p, +1, tokens=dec.uncached_len)
            self._changed(d, +1)
        prefill_done = threading.Event()
        prefill_result: list[PrefillResult] = []  # set once, by the prefill thread
        conn: http.client.HTTPConnection | None = None
        dsock: socket.socket | None = None
        prefill_started = False

        def prefill_failed() -> str | None:
            """The prefill's failure reason once it has answered with one."""
            if not prefill_done.is_set():
                return None
            res = prefill_result[0] if prefill_result else None
            return None if res is not None and res.ok else ((res.reason if res else None) or "prefill failed")

        def decode_broken(why: str) -> Exception:
            """A decode connection that broke or ended early: the client's hang-up that aborted it, or the decode's fault."""
            if hangup.is_set():
                return ClientGone()
            self._mark_unhealthy(d)
            return WorkerFailed(why)

        try:
            token_ids = tuple(c.token_ids) if self.cfg.compute == "torch" and c.token_ids is not None else None
            dreq = DecodeRequest(c.request_id, c.input_len, c.output_len, token_ids, block_hashes=tuple(c.block_hashes),
                                 arrival_s=arrival_s, request_timeout_s=self.cfg.request_timeout_s,
                                 kv_dtype=dec.kv_dtype)
            conn = self._open(d, "/v1/decode", dreq.to_json())
            dsock = conn.sock
            hangup.on_set(lambda: _abort(conn, dsock))
            try:  # the decode answers at once, saying how much of the prompt's KV it already holds
                resp = conn.getresponse()
                decode_prefix_len = int(resp.getheader(DECODE_PREFIX_HEADER) or 0)
            except (OSError, http.client.HTTPException, ValueError) as exc:
                raise decode_broken(f"decode instance {d.cfg.instance} ({d.cfg.host}:{d.cfg.port}): {_why(exc)}") from None

            def run_prefill() -> None:
                try:
                    prefill_result.append(self._prefill(c, dec, p, d, token_ids, arrival_s, decode_prefix_len))
                except WorkerFailed as exc:
                    prefill_result.append(PrefillResult(c.request_id, "failed", str(exc)))
                finally:
                    with self._lock:
                        self._changed(p, -1, tokens=dec.uncached_len)
                    prefill_done.set()
                    if not prefill_result[0].ok:
                        _abort(conn, dsock)  # unblocks the decode stream below at once

            threading.Thread(target=run_prefill, daemon=True, name=f"prefill-{c.request_id}").start()
            prefill_started = True
            final: FinalEvent | None = None
            source = f"decode instance {d.cfg.instance}"
            try:
                if resp.status != 200:
                    raise WorkerFailed(f"{source}: HTTP {resp.status} {resp.read(300)!r}")
                for raw in _sse_events(resp):
                    ev = decode_event(raw, source)
                    if isinstance(ev, FinalEvent):
                        final = ev
                        break
                    if rec["first_token_s"] is None:
                        rec["first_token_s"] = ev.t_s
                    yield ev
            except FieldError as exc:  # a worker that breaks the protocol fails the request, with the field
                raise WorkerFailed(str(exc)) from None
            except (OSError, http.client.HTTPException, ValueError) as exc:
                if prefill_failed() and not hangup.is_set():
                    raise WorkerFailed(prefill_failed()) from None
                raise decode_broken(f"{source} ({d.cfg.host}:{d.cfg.port}): {_why(exc)}") from None
            if final is None:
                if prefill_failed() and not hangup.is_set():
                    raise WorkerFailed(prefill_failed())
                raise decode_broken(f"{source}: stream ended before its final event")
            if final.ok:  # the KV arrived, so the prefill's answer is (nearly) there
                prefill_done.wait(timeout=min(PREFILL_ANSWER_WAIT_S, self.cfg.request_timeout_s))
            _take_prefill(rec, prefill_result if prefill_done.is_set() else [])
            for k in ("transfer_start_s", "transfer_end_s", "first_token_s", "finish_s", "decode_late_s"):
                if getattr(final, k) is not None and rec.get(k) is None:
                    rec[k] = getattr(final, k)
            if rec["kv_bytes"] is None and final.kv_bytes:
                rec["kv_bytes"] = final.kv_bytes
            rec["finish_s"] = final.finish_s or clock.now_s()
            if not final.ok:
                raise WorkerFailed(f"{source}: {final.reason or 'failed'}")
            if prefill_failed():
                raise WorkerFailed(prefill_failed())
            rec["status"] = "ok"
        except (GeneratorExit, ClientGone):  # the client went away: mid-stream, or before its first token (`Hangup`)
            _abort(conn, dsock)  # the decode stops at once; the wait below is for the prefill's answer only
            if rec["first_token_s"] is not None:
                # the client went away after its first token (the drain cut): the KV arrived, so the prefill's
                # answer is (nearly) there, as on the final event. Its times keep the request out of the queue
                # between prefill start and end (analysis.metrics.queued_series), as when it finishes.
                prefill_done.wait(timeout=min(PREFILL_ANSWER_WAIT_S, self.cfg.request_timeout_s))
            elif prefill_started:
                # it went away before its first token (an early stop, or the drain cut once the requests still
                # waiting cannot move the queue trend): the record ends now, a queued prefill leaves its queue, and
                # the record gets the prefill's times so far, which `queued_series` reads as it would the finished
                # request's; `prefill_cancel` says whether they are known (`analysis.metrics.cut_trend_exact`)
                rec["finish_s"] = clock.now_s()
                rec["prefill_cancel"] = "answered" if prefill_done.is_set() else self._cancel_prefill(p, c.request_id, rec)
                if rec["prefill_cancel"] == NOT_FOUND:  # its answer is on its way (or the worker refuses it, overtaken)
                    prefill_done.wait(timeout=min(PREFILL_ANSWER_WAIT_S, self.cfg.request_timeout_s))
                    rec["prefill_cancel"] = "answered" if prefill_done.is_set() else NOT_FOUND
            _take_prefill(rec, prefill_result if prefill_done.is_set() else [])
            raise
        finally:
            _abort(conn, dsock)
            with self._lock:
                self._changed(d, -1)
                if not prefill_started:
                    self._changed(p, -1, tokens=dec.uncached_len)

    def _prefill(self, c: Completion, dec: Decision, p: _Instance, d: _Instance, token_ids: tuple[int, ...] | None,
                 arrival_s: float, decode_prefix_len: int = 0) -> PrefillResult:
        d_cfg = d.cfg
        assert isinstance(d_cfg, DecodeInstanceConfig)
        plan = self.kv_scheduler.plan(c.request_id, c.input_len, min(dec.cached_len, c.input_len - 1), KVEndpoint(d_cfg.host, d_cfg.kv_port))
        req = PrefillRequest(c.request_id, c.input_len, KVDestination(plan.endpoint.host, plan.endpoint.port, d_cfg.instance),
                             cached_len=plan.first_token, decode_prefix_len=min(decode_prefix_len, c.input_len - 1),
                             block_hashes=tuple(c.block_hashes), prompt_token_ids=token_ids,
                             route=dec.route, arrival_s=arrival_s, request_timeout_s=self.cfg.request_timeout_s,
                             shed_ttft_s=self.cfg.shed_ttft_s, priority=dec.priority,
                             slo_ttft_s=self.cfg.slo_ttft_s, kv_dtype=dec.kv_dtype)
        source = f"prefill instance {p.cfg.instance}"
        try:
            conn = self._open(p, "/v1/prefill", req.to_json())
            try:
                resp = conn.getresponse()
                raw = resp.read()
            finally:
                conn.close()
            if resp.status != 200:
                raise WorkerFailed(f"{source}: HTTP {resp.status} {raw[:300]!r}")
            out = PrefillResult.from_json(json_value(raw), source)
        except FieldError as exc:
            raise WorkerFailed(str(exc)) from None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self._mark_unhealthy(p)
            raise WorkerFailed(f"{source} ({p.cfg.host}:{p.cfg.port}): {_why(exc)}") from None
        if not out.ok:
            raise WorkerFailed(f"{source}: {out.reason or 'failed'}")
        self.kv.add_keys(p.cfg.instance, self.kv.placement_keys(c.block_hashes, c.input_len, self.cfg.compute == "torch"))
        prefill_s = out.own_prefill_s  # its own cost: the time it stood paused while others ran is theirs
        if prefill_s is not None:  # what the prefill computed: the prompt less the worker's own prefix hit
            computed = c.input_len - (out.prefill_cached_len if out.prefill_cached_len is not None else dec.cached_len)
            self.policy.on_prefill(dec.route, computed, prefill_s)
        if dec.route == "prfaas" and out.kv_bytes:  # workers report wire bytes; the policy thinks emulated
            self.policy.on_telemetry(TelemetrySample(clock.now_s(), transfer_uncached_len=dec.uncached_len,
                                                     transfer_kv_bytes=int(self.scale.emulated_bytes(out.kv_bytes)),
                                                     prefill_s=prefill_s, transfer_compressed=dec.compress_kv))
        return out

    def _open(self, inst: _Instance, path: str, body: dict[str, Any]) -> http.client.HTTPConnection:
        """POST `body`; the response is read by the caller. Connect within the connect timeout, then
        allow `request_timeout_s` of silence."""
        conn = http.client.HTTPConnection(inst.cfg.host, inst.cfg.port, timeout=self.cfg.connect_timeout_s)
        try:
            conn.connect()
            conn.sock.settimeout(self.cfg.request_timeout_s)
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        except OSError as exc:
            conn.close()
            self._mark_unhealthy(inst)
            raise WorkerFailed(f"{inst.role} instance {inst.cfg.instance} ({inst.cfg.host}:{inst.cfg.port}): {_why(exc)}") from None
        return conn

    def _cancel_prefill(self, p: _Instance, rid: str, rec: dict[str, Any]) -> str:
        """``POST /v1/prefill/cancel`` to `p` (each step within `CANCEL_TIMEOUT_S`); its times go into `rec`. Returns
        what it found (the record's ``prefill_cancel``): ``dequeued``, ``running``, `NOT_FOUND`, or ``no answer: WHY``
        (the record then lacks the times, and a queue trend that reads it is not called exact)."""
        conn = http.client.HTTPConnection(p.cfg.host, p.cfg.port, timeout=CANCEL_TIMEOUT_S)
        try:
            conn.request("POST", "/v1/prefill/cancel", json.dumps(PrefillCancel(rid).to_json()), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
            if resp.status != 200:
                return f"no answer: HTTP {resp.status}"
            out = PrefillCancelled.from_json(json_value(raw), f"prefill instance {p.cfg.instance}")
        except (OSError, http.client.HTTPException, ValueError, FieldError) as exc:
            return f"no answer: {_why(exc)}"
        finally:
            conn.close()
        for k in ("prefill_start_s", "prefill_end_s"):
            if getattr(out, k) is not None:
                rec[k] = getattr(out, k)
        return NOT_FOUND if not out.found else "dequeued" if out.dequeued else "running"

    def _mark_unhealthy(self, inst: _Instance) -> None:
        with self._lock:
            self._changed(inst, healthy=False)

    # -- telemetry and control
    def on_wan_samples(self, samples: list[Any]) -> None:
        """WAN samples from the run (`POST /v1/telemetry`): every one is checked before any is taken, so a refused
        list leaves the router as it was."""
        for t, vals in [self._wan_reading(s) for s in samples]:
            self._take_wan(t, vals)

    def _wan_reading(self, s: Any) -> tuple[float, dict[str, float]]:
        """One sample's time and readings in emulated units: wire units unless ``units == "emulated"``. Any other
        key is refused, naming it and the allowed ones (`Fields.done`): a typo such as ``capacity_bp`` was ignored,
        and the policy kept the configured capacity while the sender believed it had sent the real one."""
        if not isinstance(s, dict):
            raise BadRequest("body", "a sample must be a JSON object")
        f = Fields(s)

        def reading(v: Any) -> float:
            try:
                return non_negative(v)
            except ValueError:
                raise ValueError(f"{v!r} is not a number >= 0") from None

        def time_s(v: Any) -> float:  # the router's clock (`clock.now_s`, the host's monotonic one): 1e300 was taken
            x = reading(v)
            if abs(x - clock.now_s()) > units.MAX_DURATION_S:
                raise ValueError(f"{v!r} is not a time on the router's clock (within a week of its now, "
                                 f"{clock.now_s():.0f} s)")
            return x

        try:
            to_em = Scale() if f.choice("units", ("wire", "emulated"), "wire") == "emulated" else self.scale
            vals = {}
            for name, convert in (("egress_bps", to_em.emulated_bps), ("capacity_bps", to_em.emulated_bps),
                                  ("backlog_bytes", to_em.emulated_bytes), ("drops", float)):
                v = f.get(name, reading, None)
                if v is not None:
                    vals[name] = convert(v)
                    if not math.isfinite(vals[name]):  # 1e308 wire bit/s times the scale was inf, which the policy read
                        raise f.error(name, f"{v!r} is past any rate or size in emulated units (x the scale {to_em.factor:g})")
            t = f.get("t_s", time_s, None)
            f.done()
        except FieldError as exc:
            raise BadRequest(exc.field, exc.message) from None
        return (clock.now_s() if t is None else t), vals

    def _take_wan(self, t: float, vals: dict[str, float]) -> None:
        with self._lock:
            self._wan.update(vals)
            self._wan["t_s"] = t
            self.truth.on_wan(t, vals.get("egress_bps"), vals.get("capacity_bps"))
        sample = admit(TelemetrySample(t, egress_bps=vals.get("egress_bps"), capacity_bps=vals.get("capacity_bps"),
                                       backlog_bytes=vals.get("backlog_bytes"), drops=vals.get("drops")), self.cfg.policy.signals)
        if sample is not None:  # emulator ground truth: only an oracle policy is told
            self.policy.on_telemetry(sample)

    def _poll_once(self, pool: ThreadPoolExecutor) -> None:
        insts = list(self.prefill.values()) + list(self.decode.values())
        for inst, state in zip(insts, pool.map(self._get_state, insts)):
            with self._lock:
                self._changed(inst, healthy=state is not None)
            if state is None:
                continue
            inst.reported_queue = state.queue_depth
            if inst.role == "prefill":
                self.kv.replace_instance(inst.cfg.instance, state.prefix_blocks)
                cong = state.congestion
                if inst.cluster == "prfaas":
                    self._retrans_total += max(0.0, cong.retransmits - inst.retransmits)
                    inst.retransmits = cong.retransmits
                    inst.congestion = cong.numbers()
        pf = [p for p in self.prefill.values() if p.cluster == "prfaas" and p.congestion]
        wire = lambda key: sum(float(p.congestion.get(key) or 0.0) for p in pf)  # noqa: E731
        goodput = self.scale.emulated_bps(wire("goodput_bps"))  # emulated, as everything the policy sees
        rtts = [float(p.congestion.get("queue_rtt_ms") or 0.0) for p in pf]  # current RTTs of connections with work
        floors = [float(p.congestion["min_rtt_ms"]) for p in pf if p.congestion.get("min_rtt_ms")]
        with self._lock:
            self.truth.on_kv_goodput(goodput)
            if wire("send_queue_bytes") + wire("inflight_bytes") > 0:
                self._kv_seen_s = clock.now_s()
        self.policy.on_telemetry(TelemetrySample(clock.now_s(), retransmits=self._retrans_total,
                                                 send_queue_bytes=self.scale.emulated_bytes(wire("send_queue_bytes")),
                                                 inflight_bytes=self.scale.emulated_bytes(wire("inflight_bytes")), kv_goodput_bps=goodput,
                                                 kv_path_rate_bps=self.scale.emulated_bps(wire("path_rate_bps")),
                                                 rtt_ms=max(rtts, default=0.0), min_rtt_ms=min(floors, default=0.0)))

    def _get_state(self, inst: _Instance) -> WorkerState | None:
        """The worker's state, or None when it did not answer or broke the protocol (it counts as unhealthy)."""
        try:
            conn = http.client.HTTPConnection(inst.cfg.host, inst.cfg.port, timeout=self.cfg.state_timeout_s)
            try:
                conn.request("GET", "/v1/state")
                resp = conn.getresponse()
                if resp.status != 200:
                    return None
                return WorkerState.from_json(json_value(resp.read()), f"{inst.role} instance {inst.cfg.instance} /v1/state")
            finally:
                conn.close()
        except (OSError, http.client.HTTPException, ValueError, FieldError):
            return None

    def _poll_loop(self) -> None:
        with ThreadPoolExecutor(max_workers=min(16, len(self.prefill) + len(self.decode))) as pool:
            wait_s = self.cfg.state_poll_s
            while not self._stop.wait(wait_s):
                self._poll_once(pool)
                wait_s = next_poll_wait_s(self.policy.confirm_poll_s(), self.cfg.state_poll_s)

    def _probe_loop(self) -> None:
        """Active probes (docs/router.md, "An active probe"): when the policy asks for one, a PrfaaS prefill
        instance with nothing in flight sends it to a decode instance, round robin; the answer goes to the
        policy as an observed sample and to the scheduler log as a ``probe`` row."""
        turn = 0
        while not self._stop.wait(self.cfg.state_poll_s):
            nbytes = self.policy.probe_bytes(clock.now_s())
            if nbytes <= 0:
                continue
            with self._lock:  # the policy asked only with no KV committed; prefer an instance with nothing in flight
                pf = sorted((p for p in self.prefill.values() if p.cluster == "prfaas" and p.healthy
                             and ("prefill", p.cfg.instance) in self.policy.active), key=lambda p: p.inflight)
                dec = [d for d in self.decode.values() if d.healthy and ("decode", d.cfg.instance) in self.policy.active]
            if not pf or not dec:
                continue
            turn += 1
            idle = [p for p in pf if p.inflight == pf[0].inflight]
            ans = self.probe(idle[turn % len(idle)], dec[turn % len(dec)], nbytes, self.policy.probe_pace_bps())
            if not (ans and ans.get("ok") is True):  # a worker that cannot probe now: do not ask it every poll
                self._stop.wait(PROBE_RETRY_S)

    def probe(self, inst: _Instance, dest: _Instance, nbytes_emulated: float, pace_bps_emulated: float = 0.0) -> dict[str, Any] | None:
        """One probe from `inst` to `dest`'s KV receiver, paced at `pace_bps_emulated` (0: unpaced); its answer
        (wire units) or None."""
        d = dest.cfg
        assert isinstance(d, DecodeInstanceConfig)
        stop = self.cfg.policy.estimator.fill_stop()  # it ends once the estimator would count it as filled
        req = ProbeRequest(KVDestination(d.host, d.kv_port, d.instance), bytes=max(1, int(self.scale.wire_bytes(nbytes_emulated))),
                           pace_bps=float(self.scale.wire_bps(pace_bps_emulated)),
                           pace_self_paced=self.cfg.policy.estimator.probe_paced is True, **ProbeRequest.stop_fields(stop))
        t0 = clock.now_s()
        with self._lock:
            started = self._offloads_started
        try:
            conn = http.client.HTTPConnection(inst.cfg.host, inst.cfg.port, timeout=self.cfg.state_timeout_s + 3 * req.timeout_s)
            try:
                conn.request("POST", "/v1/probe", json.dumps(req.to_json()), {"Content-Type": "application/json"})
                resp = conn.getresponse()
                ans = json_value(resp.read()) if resp.status == 200 else None
            finally:
                conn.close()
        except (OSError, http.client.HTTPException, ValueError):
            ans = None
        now = clock.now_s()
        num = lambda k: _answer_number(ans.get(k)) if isinstance(ans, dict) else None  # noqa: E731
        ok = isinstance(ans, dict) and ans.get("ok") is True and num("rate_bps") is not None
        with self._lock:  # KV that started or flowed under the probe shared the path: not an idle measurement
            overlapped = self._offloads_started != started or self._kv_seen_s >= t0
        if overlapped and ok:
            ok, ans = False, {**ans, "ok": False, "reason": "KV moved during the probe (not an idle measurement)"}
        # a burst that timed out measured the path too (it got less than its size in `timeout_s`)
        measured = isinstance(ans, dict) and (num("rate_bps") or 0.0) > 0 and (num("bytes") or 0.0) > 0 and not overlapped
        seen = {"probe_bytes": self.scale.emulated_bytes(num("bytes") or 0.0),
                "probe_rate_bps": self.scale.emulated_bps(num("rate_bps") or 0.0), "probe_rtt_ms": num("rtt_ms"),
                "idle_rtt_ms": num("idle_rtt_ms"), "probe_retransmits": num("retransmits")}  # emulated units
        if measured:  # the policy first: whoever sees the log row sees the estimate it led to
            self.policy.on_telemetry(TelemetrySample(now, min_rtt_ms=num("min_rtt_ms"), **seen))
        self.log.add("probe", now, instance=inst.cfg.instance, decode_instance=d.instance, ok=ok, measured=measured,
                     reason=None if ok else str((ans or {}).get("reason") or "no answer"), seconds=now - t0,
                     min_rtt_ms=num("min_rtt_ms"),
                     probe_acked_rate_bps=self.scale.emulated_bps(num("acked_rate_bps") or 0.0),
                     probe_stopped=bool(isinstance(ans, dict) and ans.get("stopped")),
                     probe_pace_bps=0.0 if isinstance(ans, dict) and ans.get("paced") is False else pace_bps_emulated, **seen)
        return ans if isinstance(ans, dict) else None

    def queue_sample(self) -> TelemetrySample:
        def per(xs: list[_Instance]) -> float | None:
            return sum(x.inflight for x in xs) / len(xs) if xs else None

        with self._lock:
            pf = [p for p in self.prefill.values() if p.cluster == "prfaas" and ("prefill", p.cfg.instance) in self.policy.active]
            pdp = [p for p in self.prefill.values() if p.cluster == "pd" and ("prefill", p.cfg.instance) in self.policy.active]
            dec = [d for d in self.decode.values() if ("decode", d.cfg.instance) in self.policy.active]
            return TelemetrySample(clock.now_s(), prfaas_queue_per_instance=per(pf), pdp_queue_per_instance=per(pdp),
                                   decode_queue_per_instance=per(dec), pdp_instances=len(pdp))

    def _control_loop(self) -> None:
        interval = self.cfg.policy.control.interval_s
        last = clock.now_s()
        while not self._stop.wait(interval):
            self.policy.on_telemetry(self.queue_sample())
            now = clock.now_s()
            self.policy.tick(now)
            # how much later than one interval after the last this tick ran: a router the host starves shows here
            # (timing fidelity, `testbed.fidelity.router_timing`)
            self.log_signals(now, tick_late_s=max(0.0, now - last - interval))
            last = now

    def log_signals(self, now_s: float, tick_late_s: float | None = None) -> None:
        """A ``signals`` row: what the policy believes beside the emulator's ground truth."""
        st = self.policy.status()
        with self._lock:
            truth, cap = self.truth.kv_available_bps, self.truth.capacity_bps
        self.log.add("signals", now_s, signals=st["signals"], kv_available_bps=st["kv_available_bps"] or None,
                     truth_kv_available_bps=truth, wan_capacity_bps=cap, queueing_delay_ms=st.get("queueing_delay_ms"),
                     committed_bytes=st.get("committed_bytes"), backlogged=st.get("backlogged"),
                     estimate_evidence=st.get("estimate_evidence"), estimate_age_s=st.get("estimate_age_s"),
                     estimate_sample_bps=st.get("estimate_sample_bps"), rtt_ms=st.get("rtt_ms"),
                     rtt_floor_ms=st.get("rtt_floor_ms"), estimate_t_s=st.get("estimate_t_s"),
                     estimate_backlog_bytes=st.get("estimate_backlog_bytes"), min_rtt_ms=st.get("min_rtt_ms"),
                     tick_late_s=tick_late_s)

    # -- views
    def state(self) -> dict[str, Any]:
        with self._lock:
            inst = [{"role": x.role, "cluster": x.cluster, "instance": i, "host": x.cfg.host, "port": x.cfg.port,
                     "inflight": x.inflight, "inflight_tokens": x.inflight_tokens, "reported_queue": x.reported_queue,
                     "healthy": x.healthy,
                     "active": (x.role, i) in self.policy.active}
                    for table in (self.prefill, self.decode) for i, x in table.items()]
            return {"role": "router", "policy": self.cfg.policy.name, "threshold": _finite(self.policy.threshold),
                    "egress_utilization": self.policy.egress_utilization, "units": "emulated", "scale": self.cfg.scale,
                    "wan": dict(self._wan), "inflight": len(self._inflight_ids), "instances": inst,
                    "requests": [{"route": r, "status": s, "count": n} for (r, s), n in sorted(self._counts.items())]}

    def metric_state(self) -> dict[str, Any]:
        """`state()` plus the counts and policy signals the Prometheus collector exposes."""
        st = self.state()
        rows = self.log.rows()
        with self._lock:
            st["kv_bytes_emulated"] = dict(self._kv_bytes)
        st["decisions"] = {r: sum(1 for x in rows if x["kind"] == "decision" and x.get("route") == r) for r in ("prfaas", "pd")}
        st["threshold_changes"] = sum(1 for x in rows if x["kind"] == "threshold")
        st["role_flips"] = sum(1 for x in rows if x["kind"] == "role_flip")
        st["cached_prefix_keys"] = self.kv.cluster_blocks()
        st.update(self.policy.status())
        return st

    def metrics(self) -> bytes:
        """Prometheus text exposition (`prometheus.CONTENT_TYPE`)."""
        return exposition(self.registry)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _why(exc: BaseException) -> str:
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__



PREFILL_ANSWER_WAIT_S = 5.0  # a request whose KV arrived waits at most this for the prefill's answer (it follows within ms)
CANCEL_TIMEOUT_S = 3.0  # each step of a prefill cancel (`Router._cancel_prefill`): a PrfaaS prefill's crosses the WAN,
# whose queue may be full of KV then; 3 s covers a lost SYN's 1-s retransmission
NOT_FOUND = "not found"  # a prefill cancel's answer: the worker holds no such request (answered, or not come yet)


def _take_prefill(rec: dict[str, Any], result: list[PrefillResult]) -> None:
    """Copy the prefill's answer (its times, KV bytes) into the request's record, once it has come."""
    pres = result[0] if result else None
    if pres is None:
        return
    for k in ("prefill_start_s", "prefill_end_s", "transfer_start_s", "transfer_end_s", "kv_bytes", "wire_bytes", "prefill_late_s",
              "prefill_paused_s"):
        if getattr(pres, k) is not None:
            rec[k] = getattr(pres, k)

def _answer_number(v: Any) -> float | None:
    """A number of a worker's probe answer: a finite one >= 0, else None, as if the answer had left it out (a whole
    number past a float's range, 10**400, was an OverflowError that ended the router's probe thread for the run; NaN
    was a rate the policy took)."""
    try:
        return non_negative(v)
    except ValueError:
        return None


def _abort(conn: http.client.HTTPConnection | None, sock: socket.socket | None = None) -> None:
    """Close a worker connection from any thread (a blocked read returns at once). `sock`: the connection's
    socket as it was when the request was sent (a response that will close takes it over from `conn`)."""
    if conn is None:
        return
    sock = sock or conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    conn.close()


def _sse_events(resp: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    """JSON objects of ``data:`` lines of a server-sent event stream."""
    while True:
        line = resp.readline()
        if not line:
            return
        line = line.strip()
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            obj = json_value(payload)
            if isinstance(obj, dict):
                yield obj


# ------------------------------------------------------------------------------------------- HTTP


def _chunk(c: Completion, created: int, text: str, finish: str | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    out = {"id": c.request_id, "object": "text_completion", "created": created, "model": c.model,
           "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}
    if extra:
        out.update(extra)
    return out


ENDPOINTS = {"GET": ("/v1/models", "/metrics", "/v1/state", "/v1/records", "/v1/scheduler", "/healthz"),
             "POST": ("/v1/completions", "/v1/telemetry")}  # docs/router.md "HTTP API"


def make_handler(router: Router) -> type[BaseHTTPRequestHandler]:
    class Handler(RequestHandler):
        protocol_version = "HTTP/1.0"  # one response per connection; a stream ends when we close
        timeout = router.cfg.request_timeout_s  # for the request line, headers and body (`_body` lifts it after)

        def log_message(self, fmt: str, *args: Any) -> None:  # the records are the log
            return None

        def _send(self, code: int, obj: Any, ctype: str = "application/json") -> None:
            data = obj if isinstance(obj, bytes) else obj.encode() if isinstance(obj, str) else json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, code: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> None:
            self._send(code, {"error": {"message": message, "type": kind, "param": param, "code": None}})

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """The stdlib's own refusals (a method it has no ``do_`` for, a malformed request line) as JSON too."""
            self.close_connection = True
            self._error(code, message or self.responses.get(code, ("error",))[0])

        def _no_path(self, path: str) -> None:
            use = next((m for m, paths in ENDPOINTS.items() if path in paths), None)
            if use is None:
                self._error(404, f"no such path {path}")
            else:
                self._error(405, f"{self.command} is not allowed on {path}; use {use}")

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": router.cfg.model, "object": "model", "created": 0, "owned_by": "prfaas-testbed"}]})
            elif path == "/metrics":
                self._send(200, router.metrics(), CONTENT_TYPE)
            elif path == "/v1/state":
                self._send(200, router.state())
            elif path == "/v1/records":
                self._send(200, router.records())
            elif path == "/v1/scheduler":
                self._send(200, [dict(r, t_s=r["t_s"] - clock.run_t0()) for r in router.log.rows()])
            elif path == "/healthz":
                self._send(200, {"ok": True})
            else:
                self._no_path(path)

        def _body(self) -> Any:
            try:
                return read_json_body(self)
            except BodyError as exc:
                raise BadRequest(exc.field, exc.message, exc.status) from None

        def do_POST(self) -> None:
            path = self.path.split("?")[0]
            try:
                if path == "/v1/completions":
                    self._completion(parse_completion(self._body(), router.cfg))
                elif path == "/v1/telemetry":
                    body = self._body()
                    router.on_wan_samples(body if isinstance(body, list) else [body])
                    self._send(200, {"ok": True})
                else:
                    self._no_path(path)
            except BadRequest as exc:
                self._error(exc.status, f"{exc.param}: {exc}", exc.param)

        def _completion(self, c: Completion) -> None:
            created = int(time.time())
            hangup = Hangup()
            watch = router.hangups if c.stream else None  # until its first token: a write notices a hang-up after it
            if watch is not None:
                watch.watch(self.connection, hangup.set)
            try:
                self._answer(c, created, router.serve(c, hangup))
            finally:
                if watch is not None:
                    watch.unwatch(self.connection)

        def _answer(self, c: Completion, created: int, events: Iterator[TokenEvent | dict[str, Any]]) -> None:
            if not c.stream:
                tokens, rec = [], None
                for ev in events:
                    if isinstance(ev, TokenEvent):
                        tokens.append(ev.token_id)
                    else:
                        rec = ev["record"]
                assert rec is not None
                if rec["status"] != "ok":
                    self._error(502, f"request {c.request_id} failed: {rec['reason']}", kind="worker_error")
                    return
                body = _chunk(c, created, "".join(map(detokenize, tokens)), "length",
                              {"usage": {"prompt_tokens": c.input_len, "completion_tokens": len(tokens),
                                         "total_tokens": c.input_len + len(tokens)},
                               "prfaas": {"route": rec["route"], "cached_len": rec["cached_len"]}})
                self._send(200, body)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            sent = 0
            try:
                for ev in events:
                    if not isinstance(ev, TokenEvent):
                        rec = ev["record"]
                        if rec["status"] == "ok":
                            last = _chunk(c, created, "", "length", {"usage": {"prompt_tokens": c.input_len, "completion_tokens": sent,
                                                                               "total_tokens": c.input_len + sent},
                                                                     "prfaas": {"route": rec["route"], "cached_len": rec["cached_len"]}})
                        else:
                            last = {"error": {"message": f"request {c.request_id} failed: {rec['reason']}", "type": "worker_error",
                                              "param": None, "code": None}}
                        self.wfile.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())
                    else:
                        self.wfile.write(f"data: {json.dumps(_chunk(c, created, detokenize(ev.token_id), None))}\n\n".encode())
                        if sent == 0 and router.hangups is not None:
                            router.hangups.unwatch(self.connection)
                        sent += 1
                    self.wfile.flush()
            except OSError:  # the client went away: closing the generator aborts the worker streams
                events.close()

    return Handler


# --------------------------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.serving.router", description="The PrfaaS router (see docs/router.md).")
    ap.add_argument("--config", required=True, help="JSON file of a RouterConfig")
    ap.add_argument("--out", help="on exit, write scheduler.parquet and router_requests.parquet here")
    args = ap.parse_args(argv)
    try:
        cfg = RouterConfig.load(args.config)
        router = Router(cfg)
        host, port = router.start()
    except (UserError, OSError) as exc:
        print(f"prfaas router: error: {exc}", file=sys.stderr)
        return 2
    print(f"router listening on {host}:{port} policy={cfg.policy.name}", file=sys.stderr, flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    # A stop that hangs past 5 s leaves every thread's stack in the log (the runner SIGKILLs after 10 s:
    # once, at the end of a case-study run, nothing was written and 241 finished requests lost their records).
    faulthandler.dump_traceback_later(5.0)
    if args.out:  # the records first: the runner stops the router after the workload, so they are complete
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        from testbed.atomic import write_parquet

        write_parquet(out / ROUTER_REQUESTS_FILE, router_records_frame(router.records()))
        write_parquet(out / SCHEDULER_FILE, router.log.to_frame())
    router.stop()
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
