"""What a policy sees (`RequestView`, `ClusterState`, `TelemetrySample`), what it returns (`Decision`),
and the `Policy` interface with the instance choice every policy shares."""

from __future__ import annotations

import math
import operator
import threading
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

from testbed.serving.kvmanager import PrefixMatch
from testbed.serving.policy.log import SchedulerLog
from testbed.serving.policy.spec import COMPRESSED_KV_DTYPE, PolicySpec


class RequestView(NamedTuple):
    request_id: str
    input_len: int
    output_len: int
    arrival_s: float


class InstanceState(NamedTuple):
    """One worker instance as the router sees it now (a NamedTuple: built per decision, must be cheap)."""

    instance: int
    cluster: str  # "prfaas" | "pd"
    host: str = ""
    queue_depth: int = 0  # requests the router has in flight on it
    healthy: bool = True
    tokens_in_flight: int = 0  # their uncached prompt tokens (prefill instances; the router's own count)


class ClusterState(NamedTuple):
    now_s: float
    prefill: tuple[InstanceState, ...]
    decode: tuple[InstanceState, ...]
    match: PrefixMatch


class Decision(NamedTuple):
    route: str  # "prfaas" | "pd"
    prefill_instance: int
    decode_instance: int
    uncached_len: int
    cached_len: int
    threshold: float  # t at decision time (inf: never offload, 0: always offload)
    reason: str
    cache_transfer_tokens: int = 0  # abundant rule: prefix tokens that would come from the other cluster
    bandwidth_scarce: bool = True
    priority: int = 0  # the prefill queue's order: lowest first, FCFS among equals (`policy.pd_queue`)
    compress_kv: bool = False  # an offload whose full-attention KV crosses the WAN in float8 (`policy.kv_compression`)

    @property
    def kv_dtype(self) -> str | None:
        """The dtype the request's full-attention KV crosses in when it is not the model's (float8), else None."""
        return COMPRESSED_KV_DTYPE if self.compress_kv else None


@dataclass(frozen=True)
class TelemetrySample:
    """A measurement; fields that a source does not measure stay None. Emulated units throughout.

    Which fields a policy may see depends on `policy.signals` (`signals.ORACLE_FIELDS`, docs/router.md
    "Signals"). Oracle (the emulator's WAN samples, only in ``oracle`` mode): egress_bps, capacity_bps
    (0: the link is down), backlog_bytes, drops (cumulative).
    Observed (the router polls the PrfaaS prefill workers across the WAN; TCP_INFO of their KV
    senders, summed): retransmits (cumulative), send_queue_bytes (queued + not yet sent),
    inflight_bytes (sent, not acknowledged), kv_goodput_bps (acknowledged per second, 1 s),
    kv_path_rate_bps (TCP's delivery rate, summed over the connections of senders that have work now), rtt_ms (peak
    over workers), min_rtt_ms (the kernel's min RTT, lowest over workers).
    Queues (router, every tick): requests in flight per instance of each pool, and of decode; the number of
    active PD-P prefill instances.
    A finished offload (router): transfer_uncached_len and transfer_kv_bytes (fit S_kv(l)), prefill_s, and
    transfer_compressed (its full-attention KV crossed in float8: it goes to the compressed fit).
    An active probe (router, observed: our own bytes while no KV moves): probe_bytes, probe_rate_bps (TCP's
    delivery rate of the connections that carried it), probe_rtt_ms (at its end), probe_retransmits (during
    it; logged, no verdict input), idle_rtt_ms (its pings' round trip while nothing of ours was queued).
    """

    t_s: float
    egress_bps: float | None = None
    capacity_bps: float | None = None
    backlog_bytes: float | None = None
    drops: float | None = None
    retransmits: float | None = None
    send_queue_bytes: float | None = None
    inflight_bytes: float | None = None
    kv_goodput_bps: float | None = None
    kv_path_rate_bps: float | None = None
    rtt_ms: float | None = None
    min_rtt_ms: float | None = None
    prfaas_queue_per_instance: float | None = None
    pdp_queue_per_instance: float | None = None
    pdp_instances: int | None = None
    decode_queue_per_instance: float | None = None
    transfer_uncached_len: int | None = None
    transfer_kv_bytes: int | None = None
    prefill_s: float | None = None
    transfer_compressed: bool | None = None
    probe_bytes: float | None = None
    probe_rate_bps: float | None = None
    probe_rtt_ms: float | None = None
    probe_retransmits: float | None = None
    idle_rtt_ms: float | None = None


_LOAD = operator.attrgetter("queue_depth", "instance")
_TOKEN_LOAD = operator.attrgetter("tokens_in_flight", "queue_depth", "instance")
_QUEUE = operator.attrgetter("queue_depth")


class NoInstanceError(RuntimeError):
    """No healthy instance can take the request; the router fails it with this reason."""


class Policy:
    """The interface, plus instance choice shared by all policies.

    `prefill` / `decode` list every configured instance; `standby` ones (started for role flips) begin
    inactive. Only active and healthy instances receive requests.
    """

    name = "base"

    def __init__(
        self,
        spec: PolicySpec,
        prefill: Sequence[InstanceState],
        decode: Sequence[InstanceState],
        log: SchedulerLog | None = None,
        capacity_bps: float = 0.0,
        standby: Sequence[tuple[str, int]] = (),
        compressed_kv_ratio: float = 0.5,
    ) -> None:
        self.spec = spec
        self.compressed_kv_ratio = compressed_kv_ratio  # float8 / the model's KV dtype, bytes per element
        self.log = log or SchedulerLog()
        self.capacity_bps = capacity_bps
        self._lock = threading.RLock()
        self.active: set[tuple[str, int]] = {("prefill", p.instance) for p in prefill} | {("decode", d.instance) for d in decode}
        self.active -= set(standby)
        self.hosts = {("prefill", p.instance): p.host for p in prefill} | {("decode", d.instance): d.host for d in decode}
        self.clusters = {p.instance: p.cluster for p in prefill}
        self._rr = 0

    # -- the interface
    def decide(self, req: RequestView, state: ClusterState) -> Decision:
        raise NotImplementedError

    def on_telemetry(self, sample: TelemetrySample) -> None:
        return None

    def on_prefill(self, cluster: str, uncached_len: int, seconds: float) -> None:
        """A prefill finished on `cluster` (the router's timestamps): `uncached_len` tokens in `seconds`."""
        return None

    def tick(self, now_s: float) -> None:
        return None

    @property
    def threshold(self) -> float:
        return math.inf

    @property
    def egress_utilization(self) -> float:
        return 0.0

    def bandwidth_scarce(self) -> bool:
        return True

    def compress_kv(self) -> bool:
        """Does an offload decided now send its full-attention KV in float8? `policy.kv_compression`: ``fp8``
        always; ``adaptive`` only while the prfaas law is under pressure (`PrfaasPolicy`)."""
        return self.spec.kv_compression == "fp8"

    def probe_bytes(self, now_s: float) -> float:
        """Emulated bytes of an active probe the router should send now (docs/router.md, "An active
        probe"); 0: none (only the `prfaas` policy in observed mode probes)."""
        return 0.0

    def probe_pace_bps(self) -> float:
        """Emulated bit/s the probe's connections are paced at; 0: unpaced (docs/router.md, "An active probe", "A paced probe")."""
        return 0.0

    def confirm_poll_s(self) -> float:
        """Seconds to the router's next state poll when sooner than its period is wanted (a lone saturated poll
        to confirm: docs/router-measurements.md, "A confirm poll"); 0: the period."""
        return 0.0

    def status(self) -> dict[str, Any]:
        """What the policy believes now, for metrics and /v1/state: ``signals`` (the mode it sees),
        ``kv_available_bps`` (bandwidth left for KV, emulated; 0 when it does not estimate it),
        ``congestion_events_per_s``, ``bandwidth_scarce``."""
        return {"signals": self.spec.signals, "kv_available_bps": 0.0, "congestion_events_per_s": 0.0,
                "bandwidth_scarce": float(self.bandwidth_scarce())}

    # -- shared helpers
    def usable(self, state: ClusterState, cluster: str) -> list[InstanceState]:
        return [p for p in state.prefill if p.cluster == cluster and p.healthy and ("prefill", p.instance) in self.active]

    def least_loaded(self, cands: list[InstanceState]) -> InstanceState:
        """The least loaded of `cands` by `prefill_pick`: fewest requests in flight, or fewest uncached tokens."""
        return min(cands, key=_TOKEN_LOAD if self.spec.prefill_pick == "tokens" else _LOAD)

    def pick_prefill(self, state: ClusterState, cluster: str, cached_len: int, holders: tuple[int, ...],
                     cands: list[InstanceState] | None = None) -> tuple[InstanceState, int]:
        """Cache-affine instance of the cluster: the least loaded holder of the prefix, unless it is busier
        than the least loaded instance by more than `cache_affinity_slack` requests or, with `prefill_pick:
        tokens`, by more tokens in flight than the hit saves (then the least loaded, without the hit)."""
        cands = self.usable(state, cluster) if cands is None else cands
        if not cands:
            raise NoInstanceError(f"no healthy {cluster} prefill instance")
        least = self.least_loaded(cands)
        if cached_len:
            hold = [p for p in cands if p.instance in holders]
            if hold:
                best = self.least_loaded(hold)
                if self.spec.prefill_pick == "tokens":
                    keep = best.tokens_in_flight - least.tokens_in_flight <= cached_len
                else:
                    keep = best.queue_depth <= least.queue_depth + self.spec.cache_affinity_slack
                if keep:
                    return best, cached_len
        return least, 0

    def pick_decode(self, state: ClusterState) -> InstanceState:
        cands = [d for d in state.decode if d.healthy and ("decode", d.instance) in self.active]
        if not cands:
            raise NoInstanceError("no healthy decode instance")
        self._rr = k = (self._rr + 1) % len(cands)
        return min(cands[k:] + cands[:k], key=_QUEUE)  # round robin among the least loaded

    def fixed_route(self, req: RequestView, state: ClusterState, cluster: str, threshold: float, reason: str) -> Decision:
        """Route to one cluster regardless of length; fails if that cluster has no instance."""
        cached = state.match.cached_len(cluster)
        p, cached = self.pick_prefill(state, cluster, cached, state.match.holders(cluster))
        return self._finish(req, state, cluster, p, cached, threshold, reason)

    def _finish(self, req: RequestView, state: ClusterState, cluster: str, p: InstanceState, cached: int,
                threshold: float, reason: str, transfer: int = 0, scarce: bool = True, priority: int = 0) -> Decision:
        d = self.pick_decode(state)
        compress = cluster == "prfaas" and self.compress_kv()
        dec = Decision(cluster, p.instance, d.instance, req.input_len - cached, cached, threshold, reason, transfer, scarce, priority,
                       compress)
        self.log.add(
            "decision", state.now_s, request_id=req.request_id, route=dec.route, prefill_instance=dec.prefill_instance,
            decode_instance=dec.decode_instance, input_len=req.input_len, cached_len=dec.cached_len,
            uncached_len=dec.uncached_len, cached_pd=state.match.cached_len("pd"),
            cached_prfaas=state.match.cached_len("prfaas"), threshold=threshold,
            egress_utilization=self.egress_utilization, bandwidth_scarce=scarce, reason=reason, priority=priority,
            compress_kv=compress,
        )
        return dec



def other_cluster(cluster: str) -> str:
    return "pd" if cluster == "prfaas" else "prfaas"
