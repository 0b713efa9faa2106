"""Scheduling policies of the router: where each request is prefilled, and how the threshold t moves.

One small interface (`Policy`): `decide(request, state) -> Decision` on every arrival, `on_telemetry`
for measurements (WAN samples, queue depths, the transport's congestion signal, finished transfers)
and `tick(now_s)` for the control loop. Policies are registered by name in `POLICIES`; the scenario's
``policy:`` section picks one (`parse_policy_section`). Every decision and every change of t goes
into a `SchedulerLog` (-> scheduler.parquet). The control law and its constants: docs/router.md.
"""

from __future__ import annotations

import math
import operator
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

from testbed import clock, units
from testbed.scenario import Fields, boolean, number, positive_int, positive_number
from testbed.serving.kvmanager import PrefixMatch

MAX_TOKENS = 128 * 1024  # the paper's longest request (truncation point of its length distribution)


# ----------------------------------------------------------------------------------- the policy section


def _factor(v: Any) -> float:
    x = number(v)
    if x <= 1:
        raise ValueError(f"{v!r} must be > 1 (a multiplicative step)")
    return x


def _duration(v: Any) -> float:
    return units.parse_duration_s(v, allow_zero=False)


@dataclass(frozen=True)
class ControlSpec:
    """Short-term control of t (see docs/router.md, "Control law")."""

    interval_s: float = 0.2  # tick period of the control loop
    high_utilization: float = 0.90  # WAN egress utilisation (or predicted demand) that raises t
    low_utilization: float = 0.60  # ... below which t may fall back (hysteresis band 0.6-0.9)
    target_utilization: float = 0.80  # the re-search of t aims the predicted egress demand here
    raise_factor: float = 1.5  # t <- t_fit on pressure, or t * 1.5 without a demand model
    lower_factor: float = 1.25  # t <- max(floor, t / 1.25, t_fit) after a calm hold
    raise_interval_s: float = 0.5  # at most one raise per 0.5 s (lets a raise take effect first)
    settle_s: float = 2.0  # after a raise to the fitted t, the next re-fit waits this long (the backlog drains first)
    hold_s: float = 3.0  # calm this long (and this long since the last change) before lowering
    utilization_tau_s: float = 0.5  # EWMA time constant of the measured utilisation
    queue_high: float = 4.0  # requests in flight per PrfaaS (or PD-P) instance that count as a surge
    queue_low: float = 1.0  # ... and as calm
    pdp_queue_max: float = 0.75  # PD-P requests in flight per instance a raise may lead to (predicted): the cap
    congestion_events_per_s: float = 200.0  # WAN drops + TCP retransmits per second that count as congestion
    window_s: float = 10.0  # arrivals remembered for the re-search of t
    min_samples: int = 10  # arrivals needed in the window before t_fit is trusted
    slow_tau_s: float = 2.0  # EWMA time constant of the non-KV traffic (egress - KV goodput) and PD-P queue estimates


@dataclass(frozen=True)
class RoleFlipSpec:
    """Long-term role flips of PD nodes (prefill <-> decode)."""

    enabled: bool = False
    period_s: float = 30.0
    prefill_queue_high: float = 4.0  # PD-P requests in flight per instance: prefill is the bottleneck
    decode_load_high: float = 0.9  # decode requests in flight per instance / bs_max: decode is the bottleneck
    decode_load_low: float = 0.5
    bs_max: int = 20  # decode batch limit (the paper's DERIVED 20 at 25 ms per step)
    min_prefill: int = 1
    min_decode: int = 1


POLICY_NAMES = ("prfaas", "fixed-threshold", "homogeneous-pd", "naive-heterogeneous", "all-local")


@dataclass(frozen=True)
class PolicySpec:
    name: str = "prfaas"
    threshold_tokens: int = 8 * 1024  # base t: set it from `prfaas model` (the paper publishes none)
    min_threshold_tokens: int = 1024
    max_threshold_tokens: int = MAX_TOKENS
    abundant_below: float = 0.5  # egress utilisation under which bandwidth counts as abundant
    cross_cluster_cache: bool = False  # abundant rule may use the other cluster's longer prefix
    cache_affinity_slack: int = 2  # prefer the cache-holding instance unless it has this many more in flight
    kv_state_bytes: int = 0  # optional prior for S_kv(l) = state + per_token * l (emulated bytes)
    kv_bytes_per_token: int = 0
    control: ControlSpec = field(default_factory=ControlSpec)
    role_flip: RoleFlipSpec = field(default_factory=RoleFlipSpec)

    def to_mapping(self) -> dict[str, Any]:
        """The ``policy:`` mapping that parses back to this spec (for config files and scenario.yaml)."""
        c, r = self.control, self.role_flip
        return {
            "name": self.name,
            "threshold": self.threshold_tokens,
            "min_threshold": self.min_threshold_tokens,
            "max_threshold": self.max_threshold_tokens,
            "abundant_below": self.abundant_below,
            "cross_cluster_cache": self.cross_cluster_cache,
            "cache_affinity_slack": self.cache_affinity_slack,
            "kv_state_bytes": f"{self.kv_state_bytes}B",
            "kv_bytes_per_token": f"{self.kv_bytes_per_token}B",
            "control": {
                "interval": f"{c.interval_s}s", "high_utilization": c.high_utilization,
                "low_utilization": c.low_utilization, "target_utilization": c.target_utilization,
                "raise_factor": c.raise_factor, "lower_factor": c.lower_factor,
                "raise_interval": f"{c.raise_interval_s}s", "settle": f"{c.settle_s}s", "hold": f"{c.hold_s}s",
                "utilization_tau": f"{c.utilization_tau_s}s", "queue_high": c.queue_high,
                "queue_low": c.queue_low, "pdp_queue_max": c.pdp_queue_max,
                "congestion_events_per_s": c.congestion_events_per_s,
                "window": f"{c.window_s}s", "min_samples": c.min_samples, "slow_tau": f"{c.slow_tau_s}s",
            },
            "role_flip": {
                "enabled": r.enabled, "period": f"{r.period_s}s", "prefill_queue_high": r.prefill_queue_high,
                "decode_load_high": r.decode_load_high, "decode_load_low": r.decode_load_low,
                "bs_max": r.bs_max, "min_prefill": r.min_prefill, "min_decode": r.min_decode,
            },
        }


def _parse_control(f: Fields) -> ControlSpec:
    d = ControlSpec()
    frac = units.parse_fraction
    c = ControlSpec(
        interval_s=f.get("interval", _duration, d.interval_s),
        high_utilization=f.get("high_utilization", frac, d.high_utilization),
        low_utilization=f.get("low_utilization", frac, d.low_utilization),
        target_utilization=f.get("target_utilization", frac, d.target_utilization),
        raise_factor=f.get("raise_factor", _factor, d.raise_factor),
        lower_factor=f.get("lower_factor", _factor, d.lower_factor),
        raise_interval_s=f.get("raise_interval", _duration, d.raise_interval_s),
        settle_s=f.get("settle", _duration, d.settle_s),
        hold_s=f.get("hold", _duration, d.hold_s),
        utilization_tau_s=f.get("utilization_tau", _duration, d.utilization_tau_s),
        queue_high=f.get("queue_high", positive_number, d.queue_high),
        queue_low=f.get("queue_low", number, d.queue_low),
        pdp_queue_max=f.get("pdp_queue_max", positive_number, d.pdp_queue_max),
        congestion_events_per_s=f.get("congestion_events_per_s", positive_number, d.congestion_events_per_s),
        window_s=f.get("window", _duration, d.window_s),
        min_samples=f.get("min_samples", positive_int, d.min_samples),
        slow_tau_s=f.get("slow_tau", _duration, d.slow_tau_s),
    )
    f.done()
    if c.low_utilization >= c.high_utilization:
        raise f.error("low_utilization", f"{c.low_utilization:g} must be below high_utilization {c.high_utilization:g} (the hysteresis band)")
    if not c.low_utilization <= c.target_utilization <= c.high_utilization:
        raise f.error("target_utilization", f"{c.target_utilization:g} must lie between low_utilization and high_utilization")
    if not 0 <= c.queue_low < c.queue_high:
        raise f.error("queue_low", f"{c.queue_low:g} must be >= 0 and below queue_high {c.queue_high:g}")
    return c


def _parse_role_flip(f: Fields) -> RoleFlipSpec:
    d = RoleFlipSpec()
    frac = units.parse_fraction
    r = RoleFlipSpec(
        enabled=f.get("enabled", boolean, d.enabled),
        period_s=f.get("period", _duration, d.period_s),
        prefill_queue_high=f.get("prefill_queue_high", positive_number, d.prefill_queue_high),
        decode_load_high=f.get("decode_load_high", frac, d.decode_load_high),
        decode_load_low=f.get("decode_load_low", frac, d.decode_load_low),
        bs_max=f.get("bs_max", positive_int, d.bs_max),
        min_prefill=f.get("min_prefill", positive_int, d.min_prefill),
        min_decode=f.get("min_decode", positive_int, d.min_decode),
    )
    f.done()
    if r.decode_load_low >= r.decode_load_high:
        raise f.error("decode_load_low", "must be below decode_load_high")
    if r.bs_max < 1:
        raise f.error("bs_max", "must be >= 1")
    return r


def parse_policy_section(f: Fields) -> PolicySpec:
    """The scenario's ``policy:`` section. Example::

        policy: {name: prfaas, threshold: 8K, control: {high_utilization: 90%, hold: 3s}}
    """
    d = PolicySpec()
    name = f.choice("name", POLICY_NAMES, d.name)
    t = f.get("threshold", units.parse_tokens, d.threshold_tokens)
    spec = PolicySpec(
        name=name,
        threshold_tokens=t,
        min_threshold_tokens=f.get("min_threshold", units.parse_tokens, min(d.min_threshold_tokens, t)),
        max_threshold_tokens=f.get("max_threshold", units.parse_tokens, max(d.max_threshold_tokens, t)),
        abundant_below=f.get("abundant_below", units.parse_fraction, d.abundant_below),
        cross_cluster_cache=f.get("cross_cluster_cache", boolean, d.cross_cluster_cache),
        cache_affinity_slack=f.get("cache_affinity_slack", positive_int, d.cache_affinity_slack),
        kv_state_bytes=f.get("kv_state_bytes", units.parse_size_bytes, d.kv_state_bytes),
        kv_bytes_per_token=f.get("kv_bytes_per_token", units.parse_size_bytes, d.kv_bytes_per_token),
        control=_parse_control(f.section("control")),
        role_flip=_parse_role_flip(f.section("role_flip")),
    )
    f.done()
    if not spec.min_threshold_tokens <= spec.threshold_tokens <= spec.max_threshold_tokens:
        raise f.error(
            "threshold",
            f"{spec.threshold_tokens} tokens must lie between min_threshold ({spec.min_threshold_tokens}) "
            f"and max_threshold ({spec.max_threshold_tokens})",
        )
    return spec


# ------------------------------------------------------------------------------- what a policy sees


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


@dataclass(frozen=True)
class TelemetrySample:
    """A measurement; fields that a source does not measure stay None.

    WAN (pushed by the run, emulated units): egress_bps, capacity_bps (0: the link is down), backlog_bytes,
    drops (cumulative).
    Transport (router polls PrfaaS prefill workers): retransmits (cumulative), send_queue_bytes,
    kv_goodput_bps (emulated: the KV the PrfaaS senders got acknowledged per second, summed).
    Queues (router, every tick): requests in flight per instance of each pool, and of decode.
    A finished offload: transfer_uncached_len and transfer_kv_bytes (fits S_kv(l)).
    """

    t_s: float
    egress_bps: float | None = None
    capacity_bps: float | None = None
    backlog_bytes: float | None = None
    drops: float | None = None
    retransmits: float | None = None
    send_queue_bytes: float | None = None
    kv_goodput_bps: float | None = None
    prfaas_queue_per_instance: float | None = None
    pdp_queue_per_instance: float | None = None
    decode_queue_per_instance: float | None = None
    transfer_uncached_len: int | None = None
    transfer_kv_bytes: int | None = None


_LOAD = operator.attrgetter("queue_depth", "instance")
_QUEUE = operator.attrgetter("queue_depth")


class NoInstanceError(RuntimeError):
    """No healthy instance can take the request; the router fails it with this reason."""


# ------------------------------------------------------------------------------------ scheduler log


class SchedulerLog:
    """Every decision, change of t, role flip and control step (the signals the control law saw),
    timestamped with `testbed.clock` (-> scheduler.parquet; ``kind`` says which)."""

    COLUMNS = (
        "t_s", "kind", "request_id", "route", "prefill_instance", "decode_instance", "input_len",
        "cached_len", "uncached_len", "cached_pd", "cached_prfaas", "threshold", "old_threshold",
        "egress_utilization", "bandwidth_scarce", "demand_ratio", "kv_capacity_bps", "pdp_cap_threshold",
        "congestion_events_per_s", "prfaas_queue",
        "pdp_queue", "decode_queue", "reason",
    )

    def __init__(self) -> None:
        self._rows: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def add(self, kind: str, t_s: float | None = None, **fields: Any) -> None:
        fields["t_s"] = clock.now_s() if t_s is None else t_s
        fields["kind"] = kind
        with self._lock:
            self._rows.append(fields)

    def rows(self, kind: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(r) for r in self._rows if kind is None or r["kind"] == kind]

    def to_frame(self) -> "Any":
        """A pandas DataFrame, `t_s` relative to the run's start (`clock.run_t0()`)."""
        import pandas as pd

        rows = self.rows()
        cols = list(self.COLUMNS) + sorted({k for r in rows for k in r} - set(self.COLUMNS))
        df = pd.DataFrame(rows, columns=cols)
        df["t_s"] = df["t_s"].astype(float) - clock.run_t0()
        return df


# ---------------------------------------------------------------------------------------- policies


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
    ) -> None:
        self.spec = spec
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

    def tick(self, now_s: float) -> None:
        return None

    @property
    def threshold(self) -> float:
        return math.inf

    @property
    def egress_utilization(self) -> float:
        return 0.0

    # -- shared helpers
    def usable(self, state: ClusterState, cluster: str) -> list[InstanceState]:
        return [p for p in state.prefill if p.cluster == cluster and p.healthy and ("prefill", p.instance) in self.active]

    def pick_prefill(self, state: ClusterState, cluster: str, cached_len: int, holders: tuple[int, ...],
                     cands: list[InstanceState] | None = None) -> tuple[InstanceState, int]:
        """Cache-affine instance of the cluster: the least loaded holder of the prefix, unless it has
        `cache_affinity_slack` more requests in flight than the least loaded instance (then no hit)."""
        cands = self.usable(state, cluster) if cands is None else cands
        if not cands:
            raise NoInstanceError(f"no healthy {cluster} prefill instance")
        least = min(cands, key=_LOAD)
        if cached_len:
            hold = [p for p in cands if p.instance in holders]
            if hold:
                best = min(hold, key=_LOAD)
                if best.queue_depth <= least.queue_depth + self.spec.cache_affinity_slack:
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
                threshold: float, reason: str, transfer: int = 0, scarce: bool = True) -> Decision:
        d = self.pick_decode(state)
        dec = Decision(cluster, p.instance, d.instance, req.input_len - cached, cached, threshold, reason, transfer, scarce)
        self.log.add(
            "decision", state.now_s, request_id=req.request_id, route=dec.route, prefill_instance=dec.prefill_instance,
            decode_instance=dec.decode_instance, input_len=req.input_len, cached_len=dec.cached_len,
            uncached_len=dec.uncached_len, cached_pd=state.match.cached_len("pd"),
            cached_prfaas=state.match.cached_len("prfaas"), threshold=threshold,
            egress_utilization=self.egress_utilization, bandwidth_scarce=scarce, reason=reason,
        )
        return dec


class ThresholdPolicy(Policy):
    """Selective offload on the uncached length with a fixed t (the `fixed-threshold` baseline).

    Cluster choice follows the paper: bandwidth scarce -> decide per cluster (l - l_pd <= t -> PD-P,
    else PrfaaS with its own hit); abundant (and `cross_cluster_cache`) -> l_prefix = max(l_pd,
    l_prfaas) decides, the longer prefix moving to the chosen cluster. This baseline always sees
    bandwidth as scarce (it measures nothing).
    """

    name = "fixed-threshold"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._t = float(self.spec.threshold_tokens)

    @property
    def threshold(self) -> float:
        return self._t

    def bandwidth_scarce(self) -> bool:
        return True

    def decide(self, req: RequestView, state: ClusterState) -> Decision:
        with self._lock:
            return self._decide(req, state)

    def _decide(self, req: RequestView, state: ClusterState) -> Decision:
        t = self._t
        l_total, m = req.input_len, state.match
        l_pd, l_pf = m.cached_len("pd"), m.cached_len("prfaas")
        scarce = self.bandwidth_scarce()
        per_cluster = scarce or not self.spec.cross_cluster_cache
        if per_cluster:
            local = l_total - l_pd <= t
            why = f"l-l_pd={l_total - l_pd} {'<=' if local else '>'} t={t:.0f}" + ("" if local else f"; l-l_prfaas={l_total - l_pf}")
        else:
            l_prefix = max(l_pd, l_pf)
            local = l_total - l_prefix <= t
            why = f"abundant: l-l_prefix={l_total - l_prefix} {'<=' if local else '>'} t={t:.0f}"
        cluster = "pd" if local else "prfaas"
        cands = self.usable(state, cluster)
        if not cands:
            alt = self.usable(state, _other(cluster))
            if alt:
                why += f"; fallback: no healthy {cluster} prefill instance"
                cluster, cands = _other(cluster), alt
        p, cached = self.pick_prefill(state, cluster, m.cached_len(cluster), m.holders(cluster), cands)
        transfer = 0
        if not per_cluster:
            other = m.cached_len(_other(cluster))
            if other > cached:
                transfer = other - cached
                cached = other
                why += f"; prefix {transfer} tokens from {_other(cluster)} cluster"
        self._note_arrival(state.now_s, l_total - l_pf, l_total - cached if cluster == "pd" else 0)
        return self._finish(req, state, cluster, p, cached, t, why, transfer, scarce)

    def _note_arrival(self, now_s: float, uncached_prfaas: int, local_len: int) -> None:
        return None


def _other(cluster: str) -> str:
    return "pd" if cluster == "prfaas" else "prfaas"


class PrfaasPolicy(ThresholdPolicy):
    """The PrfaaS scheduler: `ThresholdPolicy` plus short-term control of t and optional role flips."""

    name = "prfaas"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        c = self.spec.control
        self._u_ewma = 0.0
        self._u_last_t: float | None = None
        self._egress_bps = 0.0
        self._backlog_bytes = 0.0
        self._event_rates: dict[str, float] = {}  # EWMA per second of WAN drops and of TCP retransmits
        self._counters: dict[str, tuple[float, float]] = {}  # name -> (t_s, last cumulative value)
        self._queues = {"prfaas": 0.0, "pdp": 0.0, "decode": 0.0}
        self._pdp_slow: float | None = None  # EWMA of the PD-P queue (tau slow_tau): the cap's load estimate
        self._kv_goodput: tuple[float, float] | None = None  # (t_s, KV goodput of the PrfaaS senders, bps)
        self._non_kv_bps = 0.0  # EWMA of egress - KV goodput: traffic on the line that is not our KV
        self._slow_last: dict[str, float] = {}
        self._arrivals: deque[tuple[float, int, int]] = deque()  # (t_s, uncached w.r.t. PrfaaS, PD-P tokens or 0)
        self._fit = [0.0] * 5  # n, sum l, sum b, sum l^2, sum l*b of finished offloads
        self._last_raise = -math.inf
        self._last_change = -math.inf
        self._calm_since: float | None = None
        self._last_flip = clock.now_s()
        self.t_base = float(self.spec.threshold_tokens)
        self.window_s = c.window_s

    # -- measurements
    @property
    def egress_utilization(self) -> float:
        return self._u_ewma

    def bandwidth_scarce(self) -> bool:
        return self._u_ewma >= self.spec.abundant_below or self._t > self.t_base

    @property
    def congestion_events_per_s(self) -> float:
        return sum(self._event_rates.values())

    @property
    def non_kv_bps(self) -> float:
        """Traffic on the PrfaaS -> PD line that is not KV (cross traffic): EWMA of egress - KV goodput."""
        return self._non_kv_bps

    @property
    def kv_capacity_bps(self) -> float:
        """The capacity left for KV: link capacity minus the non-KV traffic measured on it."""
        return max(self.capacity_bps - self._non_kv_bps, 0.0)

    def _slow(self, name: str, t_s: float, old: float | None, x: float) -> float:
        """EWMA with time constant `slow_tau`, per signal."""
        last = self._slow_last.get(name)
        self._slow_last[name] = t_s
        if old is None or last is None:
            return x
        return old + (1.0 - math.exp(-max(t_s - last, 0.0) / self.spec.control.slow_tau_s)) * (x - old)

    def _note_arrival(self, now_s: float, uncached_prfaas: int, local_len: int) -> None:
        self._arrivals.append((now_s, uncached_prfaas, local_len))
        while self._arrivals and self._arrivals[0][0] < now_s - self.window_s:
            self._arrivals.popleft()

    def _rate(self, name: str, t_s: float, value: float) -> float | None:
        """Per-second increase of a cumulative counter (a decrease counts as a reset)."""
        prev = self._counters.get(name)
        self._counters[name] = (t_s, value)
        if prev is None or t_s <= prev[0]:
            return None
        inc = value - prev[1] if value >= prev[1] else value
        return inc / (t_s - prev[0])

    def on_telemetry(self, s: TelemetrySample) -> None:
        with self._lock:
            tau = self.spec.control.utilization_tau_s
            link_down = s.capacity_bps is not None and s.capacity_bps <= 0
            if s.capacity_bps and s.capacity_bps > 0:
                self.capacity_bps = s.capacity_bps
            if link_down or (s.egress_bps is not None and self.capacity_bps > 0):
                self._egress_bps = s.egress_bps or 0.0
                u = 1.5 if link_down else min(self._egress_bps / self.capacity_bps, 1.5)  # a down link is saturated
                if self._u_last_t is None:
                    self._u_ewma = u
                else:
                    a = 1.0 - math.exp(-max(s.t_s - self._u_last_t, 0.0) / tau)
                    self._u_ewma += a * (u - self._u_ewma)
                self._u_last_t = s.t_s
                if self._kv_goodput is not None and s.t_s - self._kv_goodput[0] <= 2.0 and not link_down:
                    x = max(self._egress_bps - self._kv_goodput[1], 0.0)
                    self._non_kv_bps = self._slow("non_kv", s.t_s, self._non_kv_bps, x)
            if s.kv_goodput_bps is not None:
                self._kv_goodput = (s.t_s, s.kv_goodput_bps)
            if s.backlog_bytes is not None:
                self._backlog_bytes = s.backlog_bytes
            for name in ("drops", "retransmits"):  # WAN samples and worker polls arrive separately
                v = getattr(s, name)
                r = self._rate(name, s.t_s, v) if v is not None else None
                if r is not None:
                    self._event_rates[name] = 0.5 * self._event_rates.get(name, 0.0) + 0.5 * r
            for key, attr in (("prfaas", "prfaas_queue_per_instance"), ("pdp", "pdp_queue_per_instance"),
                              ("decode", "decode_queue_per_instance")):
                v = getattr(s, attr)
                if v is not None:
                    self._queues[key] = v
            if s.pdp_queue_per_instance is not None:
                self._pdp_slow = self._slow("pdp", s.t_s, self._pdp_slow, s.pdp_queue_per_instance)
            if s.transfer_uncached_len is not None and s.transfer_kv_bytes is not None:
                l, b = float(s.transfer_uncached_len), float(s.transfer_kv_bytes)
                for i, x in enumerate((1.0, l, b, l * l, l * b)):
                    self._fit[i] += x

    def kv_bytes_model(self) -> Callable[[float], float] | None:
        """S_kv(l) in emulated bytes: least squares over finished offloads, else the spec's prior."""
        n, sl, sb, sll, slb = self._fit
        if n >= 2 and n * sll - sl * sl > 1e-9 * max(1.0, sll):
            b = (n * slb - sl * sb) / (n * sll - sl * sl)
            a = (sb - b * sl) / n
            if b >= 0:
                return lambda l: max(a + b * l, 0.0)
        if n >= 1:
            per = sb / max(sl, 1.0)
            return lambda l: per * l
        if self.spec.kv_bytes_per_token or self.spec.kv_state_bytes:
            return lambda l: self.spec.kv_state_bytes + self.spec.kv_bytes_per_token * l
        return None

    def _recent(self, now_s: float) -> tuple[list[int], float]:
        """Uncached lengths (w.r.t. PrfaaS) of the arrivals in the window, and the time they span."""
        recent = [(ts, l) for ts, l, _ in self._arrivals if ts >= now_s - self.window_s]
        span = max(now_s - recent[0][0], 1.0) if recent else 1.0
        return [l for _, l in recent], span

    def predicted_demand_bps(self, t: float, now_s: float) -> float | None:
        """KV egress the recent arrivals would need at threshold t (emulated bit/s), or None if unknown."""
        size = self.kv_bytes_model()
        arr, span = self._recent(now_s)
        if size is None or len(arr) < self.spec.control.min_samples:
            return None
        return sum(size(l) for l in arr if l > t) * 8.0 / span

    def fit_threshold(self, target_bps: float, now_s: float) -> float | None:
        """The re-search of t: the smallest t whose predicted egress demand fits `target_bps`."""
        size = self.kv_bytes_model()
        arr, span = self._recent(now_s)
        arr.sort()
        if size is None or len(arr) < self.spec.control.min_samples:
            return None
        demand = sum(size(l) for l in arr) * 8.0 / span
        if demand <= target_bps:
            return 0.0
        for l in arr:  # raising t to l keeps every request of length <= l local
            demand -= size(l) * 8.0 / span
            if demand <= target_bps:
                return float(l)
        return float(arr[-1])

    def pdp_cap(self, now_s: float) -> float:
        """The largest t a raise may set without the PD-P queue exceeding `pdp_queue_max` (predicted).

        A raise keeps the arrivals with t < l <= t' local. Their PD-P work is estimated in tokens (the
        length; prefill time grows at least linearly, and the fixed overhead per request is left out,
        which overestimates the added load: conservative), scaled from the measured PD-P queue:
        q(t') = q * W(t') / W_pd, W(x) = sum of the window's lengths <= x, W_pd = the tokens the window's
        arrivals actually sent to PD-P (under the t of their time: the queue q reflects those, so right
        after a raise, before the queue shows it, W_pd is still small and the cap stays tight).
        Without enough arrivals only the measured queue limits (q >= pdp_queue_max: no raise). q is the
        slow EWMA, or half the latest sample if higher (a surge shows before the EWMA catches up), at
        least 0.1.
        """
        c, hi = self.spec.control, float(self.spec.max_threshold_tokens)
        if self._pdp_slow is None:  # PD-P never measured (no PD-P pool): nothing to protect
            return hi
        q = max(self._pdp_slow, self._queues["pdp"] * 0.5, 0.1)  # per instance; a floor for an idle pool
        if q >= c.pdp_queue_max:
            return self._t
        arr, _ = self._recent(now_s)
        if len(arr) < c.min_samples:
            return hi
        arr.sort()
        w_pd = sum(lp for ts, _, lp in self._arrivals if ts >= now_s - self.window_s)
        budget = c.pdp_queue_max / q * max(w_pd, float(arr[0]))  # W(t') allowed
        cap, w = self._t, sum(l for l in arr if l <= self._t)
        if w > budget:
            return self._t
        for l in arr:
            if l <= self._t:
                continue
            w += l
            if w > budget:
                return cap
            cap = float(l)
        return hi

    # -- control
    def signals(self, now_s: float) -> dict[str, Any]:
        c = self.spec.control
        demand = self.predicted_demand_bps(self._t, now_s)
        kv_cap = self.kv_capacity_bps
        ratio = (demand / kv_cap if kv_cap > 0 else math.inf) if demand is not None and self.capacity_bps > 0 else None
        return {
            "utilization": self._u_ewma,
            "demand_ratio": ratio,  # predicted KV demand at t / the capacity left for KV
            "kv_capacity_bps": kv_cap,
            # a lone bulk transfer drops packets too (TCP probing a drop-tail queue): loss means congestion
            # only while the link is busy on average
            "congested": self.congestion_events_per_s >= c.congestion_events_per_s and self._u_ewma >= c.low_utilization,
            "prfaas_queue": self._queues["prfaas"],
            "pdp_queue": self._queues["pdp"],
            "pdp_queue_slow": self._pdp_slow or 0.0,
            "decode_queue": self._queues["decode"],
        }

    def tick(self, now_s: float) -> None:
        with self._lock:
            sig = self._control(now_s)
            self.log.add("control", now_s, threshold=self._t, egress_utilization=sig["utilization"],
                         demand_ratio=sig["demand_ratio"], kv_capacity_bps=sig["kv_capacity_bps"],
                         pdp_cap_threshold=sig.get("pdp_cap"), congestion_events_per_s=self.congestion_events_per_s,
                         prfaas_queue=sig["prfaas_queue"], pdp_queue=sig["pdp_queue"], decode_queue=sig["decode_queue"],
                         bandwidth_scarce=self.bandwidth_scarce())
            if self.spec.role_flip.enabled and now_s - self._last_flip >= self.spec.role_flip.period_s:
                self._last_flip = now_s
                self._role_flip(now_s)

    def _control(self, now_s: float) -> dict[str, Any]:
        """One step of the control law (docs/router.md); returns the signals it used."""
        c, s = self.spec.control, self.signals(now_s)
        ratio = s["demand_ratio"]
        lo, hi = float(self.spec.min_threshold_tokens), float(self.spec.max_threshold_tokens)
        target = c.target_utilization * s["kv_capacity_bps"]
        pressure = []
        if s["utilization"] >= c.high_utilization:
            pressure.append(f"egress utilisation {s['utilization']:.2f} >= {c.high_utilization:g}")
        if ratio is not None and ratio >= c.high_utilization:
            pressure.append(f"predicted KV demand {ratio:.2f} x the {s['kv_capacity_bps'] / 1e9:.1f} Gbps left for KV")
        if s["congested"]:
            pressure.append(f"congestion {self.congestion_events_per_s:.0f} drops+retransmits/s")
        if s["prfaas_queue"] >= c.queue_high:
            pressure.append(f"PrfaaS queue {s['prfaas_queue']:.1f}/instance")
        pdp_overloaded = s["pdp_queue_slow"] >= 2.0 * c.pdp_queue_max and self._t > self.t_base
        if pdp_overloaded and now_s - self._last_change >= c.hold_s:
            # an earlier raise (or a burst) overloaded PD-P: give back the raise step by step; short
            # requests' TTFT is what PD-P queues cost
            self._calm_since = None
            new = max(self.t_base, self._t / c.lower_factor)
            self._set_t(now_s, new, f"lower: PD-P queue {s['pdp_queue_slow']:.1f}/instance >= {2.0 * c.pdp_queue_max:g}")
            return s
        if pressure:
            self._calm_since = None
            since = now_s - self._last_raise
            fit = self.fit_threshold(target, now_s)
            cap = s["pdp_cap"] = self.pdp_cap(now_s)
            if fit is not None:  # the re-search: straight to the t whose demand fits, re-fitted every settle s
                if fit <= self._t or since < c.settle_s:
                    return s
                new, how = fit, "to the t whose predicted KV demand fits"
            elif since >= c.raise_interval_s:  # no demand model yet: blind steps
                new, how = max(self._t, 512.0) * c.raise_factor, f"x{c.raise_factor:g}"
            else:
                return s
            new = min(hi, new)
            if new > cap:
                new, how = cap, how + f", capped at {cap:.0f} by the PD-P queue ({s['pdp_queue_slow']:.2f}/instance)"
            if new > self._t:
                self._set_t(now_s, new, f"raise {how}: " + "; ".join(pressure))
                self._last_raise = now_s
            return s
        calm = s["utilization"] <= c.low_utilization and s["prfaas_queue"] <= c.queue_low and (ratio is None or ratio <= c.low_utilization)
        if not calm:
            self._calm_since = None
            return s
        if self._calm_since is None:
            self._calm_since = now_s
        if now_s - self._calm_since < c.hold_s or now_s - self._last_change < c.hold_s:
            return s
        pdp_surge = s["pdp_queue"] >= c.queue_high
        floor = lo if pdp_surge else self.t_base
        if self._t > floor:
            fit = self.fit_threshold(target, now_s) or 0.0
            pdp_loaded = s["pdp_queue_slow"] >= c.pdp_queue_max  # the raise costs PD-P now: give it all back
            new = max(floor, fit if pdp_loaded else self._t / c.lower_factor, fit)
            if new < self._t:
                why = (f"PD-P queue {s['pdp_queue']:.1f}/instance with WAN calm" if pdp_surge
                       else f"calm for {c.hold_s:g}s" + (f", PD-P queue {s['pdp_queue_slow']:.2f}/instance" if pdp_loaded else ""))
                self._set_t(now_s, new, f"lower: {why} (utilisation {s['utilization']:.2f})")
        elif self._t < self.t_base and s["pdp_queue"] <= c.queue_low:
            self._set_t(now_s, min(self.t_base, self._t * c.lower_factor), "restore towards base: PD-P queue calm")
        return s

    def _set_t(self, now_s: float, new: float, reason: str) -> None:
        old, self._t = self._t, float(new)
        self._last_change = now_s
        self.log.add("threshold", now_s, threshold=self._t, old_threshold=old,
                     egress_utilization=self._u_ewma, bandwidth_scarce=self.bandwidth_scarce(), reason=reason)

    def _role_flip(self, now_s: float) -> None:
        """Long term: flip one PD host between prefill and decode when one side is the bottleneck.

        A flip needs a host carrying both a PD-P and a PD-D instance, one of them standby.
        """
        r, q = self.spec.role_flip, self._queues
        decode_load = q["decode"] / r.bs_max
        if q["pdp"] >= r.prefill_queue_high and decode_load <= r.decode_load_low:
            self._flip(now_s, "decode", "prefill", f"PD-P queue {q['pdp']:.1f}/instance, decode load {decode_load:.2f}")
        elif decode_load >= r.decode_load_high and q["pdp"] <= self.spec.control.queue_low:
            self._flip(now_s, "prefill", "decode", f"decode load {decode_load:.2f}, PD-P queue {q['pdp']:.1f}/instance")

    def _flip(self, now_s: float, from_role: str, to_role: str, why: str) -> bool:
        r = self.spec.role_flip
        active_pdp = [k for k in self.active if k[0] == "prefill" and self.clusters.get(k[1]) == "pd"]
        active_dec = [k for k in self.active if k[0] == "decode"]
        if (from_role == "prefill" and len(active_pdp) <= r.min_prefill) or (from_role == "decode" and len(active_dec) <= r.min_decode):
            return False
        for key in sorted(active_pdp if from_role == "prefill" else active_dec):
            host = self.hosts.get(key)
            partner = [k for k, h in self.hosts.items() if h == host and k[0] == to_role and k not in self.active
                       and (to_role == "decode" or self.clusters.get(k[1]) == "pd")]
            if partner:
                self.active.discard(key)
                self.active.add(partner[0])
                self.log.add("role_flip", now_s, reason=f"{host}: {from_role} {key[1]} -> {to_role} {partner[0][1]}: {why}",
                             threshold=self._t)
                return True
        return False


class HomogeneousPDPolicy(Policy):
    """Baseline: one PD cluster serves everything; PrfaaS instances, if configured, are never used."""

    name = "homogeneous-pd"

    def decide(self, req: RequestView, state: ClusterState) -> Decision:
        with self._lock:
            return self.fixed_route(req, state, "pd", math.inf, "homogeneous-pd: no PrfaaS cluster")


class AllLocalPolicy(Policy):
    """Baseline: the PrfaaS cluster exists but t = infinity, so every prefill stays on PD-P."""

    name = "all-local"

    def decide(self, req: RequestView, state: ClusterState) -> Decision:
        with self._lock:
            return self.fixed_route(req, state, "pd", math.inf, "all-local: t = inf")


class NaiveHeterogeneousPolicy(Policy):
    """Baseline: every prefill on PrfaaS (no length routing), every PD node decodes."""

    name = "naive-heterogeneous"

    def decide(self, req: RequestView, state: ClusterState) -> Decision:
        with self._lock:
            return self.fixed_route(req, state, "prfaas", 0.0, "naive-heterogeneous: all prefill on PrfaaS")


POLICIES: dict[str, type[Policy]] = {
    "prfaas": PrfaasPolicy,
    "fixed-threshold": ThresholdPolicy,
    "homogeneous-pd": HomogeneousPDPolicy,
    "naive-heterogeneous": NaiveHeterogeneousPolicy,
    "all-local": AllLocalPolicy,
}
assert set(POLICIES) == set(POLICY_NAMES)


def build_policy(
    spec: PolicySpec,
    prefill: Sequence[InstanceState],
    decode: Sequence[InstanceState],
    log: SchedulerLog | None = None,
    capacity_bps: float = 0.0,
    standby: Sequence[tuple[str, int]] = (),
) -> Policy:
    """The registered policy of `spec.name`."""
    return POLICIES[spec.name](spec, prefill, decode, log=log, capacity_bps=capacity_bps, standby=standby)
