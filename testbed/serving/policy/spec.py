"""The scenario's ``policy:`` section: the policy's name, its threshold and the control constants.

`parse_policy_section` turns the mapping into a frozen `PolicySpec`; `PolicySpec.to_mapping` writes it back
(router config files, scenario.yaml). Constants and why: docs/router.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from testbed import units
from testbed.serving.policy.estimator import MAX_PROBE_HEADROOM, MAX_PROBE_RTTS, EstimatorSpec
from testbed.serving.protocol import PROBE_MAX_BYTES
from testbed.validation import Fields, at_most, boolean, count_up_to, number, whole_number, positive_number

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
    """Short-term control of t (see docs/router.md, "Short-term control of t")."""

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
    drain_horizon_s: float = 4.0  # committed KV beyond a prefill's time is drained from the offload budget over this
    prefill_prior_s: float = 1.0  # PrfaaS prefill time assumed until finished offloads measure it
    slow_tau_s: float = 2.0  # EWMA time constant of the non-KV traffic (egress - KV goodput) and PD-P queue estimates
    latency_aware: bool = False  # keep an offload on an idle PD-P instance when it would finish sooner there


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


POLICY_NAMES = ("prfaas", "fixed-threshold", "homogeneous-pd", "naive-heterogeneous", "all-local", "oracle-step")
# what the policy may measure (docs/router.md, "Signals"): its own side's measurements and the nominal
# line rate (observed); the nominal rate as the capacity, without estimating (provisioned); emulator
# ground truth (oracle, for ablation only)
SIGNAL_MODES = ("observed", "provisioned", "oracle")
PREFILL_PICKS = ("requests", "tokens")  # the least loaded prefill instance: fewest requests, or fewest tokens, in flight
# the order of a PD-P prefill queue: arrival (fcfs), or the requests the base threshold keeps local before those
# a raise of t (or a fallback) moved there (natives-first: docs/router-measurements.md, "Where the dip's excess waits")
PD_QUEUES = ("fcfs", "natives-first")
# the dtype of offloaded requests' full-attention KV on the WAN (docs/router.md, "Adaptive KV precision"): the model's
# (none), float8 e4m3 for every offload (fp8), or float8 only while the prfaas law is under pressure (adaptive)
KV_COMPRESSIONS = ("none", "fp8", "adaptive")
COMPRESSED_KV_DTYPE = "float8_e4m3fn"


@dataclass(frozen=True)
class PolicySpec:
    name: str = "prfaas"
    signals: str = "observed"
    threshold_tokens: int = 8 * 1024  # base t: set it from `prfaas model` (the paper publishes none)
    min_threshold_tokens: int = 1024
    max_threshold_tokens: int = MAX_TOKENS
    abundant_below: float = 0.5  # egress utilisation under which bandwidth counts as abundant
    cross_cluster_cache: bool = False  # abundant rule may use the other cluster's longer prefix
    cache_affinity_slack: int = 2  # prefer the cache-holding instance unless it has this many more in flight
    prefill_pick: str = "requests"  # PREFILL_PICKS: what "least loaded" counts (docs/router.md, "Policies")
    pd_queue: str = "fcfs"  # PD_QUEUES: the order in which a PD-P instance takes its queued prefills
    kv_compression: str = "none"  # KV_COMPRESSIONS: the wire dtype of an offload's full-attention KV
    kv_state_bytes: int = 0  # optional prior for S_kv(l) = state + per_token * l (emulated bytes)
    kv_bytes_per_token: int = 0
    event_threshold_tokens: int | None = None  # `oracle-step` only: t while the shaper's rate is below the line's
    control: ControlSpec = field(default_factory=ControlSpec)
    role_flip: RoleFlipSpec = field(default_factory=RoleFlipSpec)
    estimator: EstimatorSpec = field(default_factory=EstimatorSpec)

    def to_mapping(self) -> dict[str, Any]:
        """The ``policy:`` mapping that parses back to this spec (for config files and scenario.yaml)."""
        c, r, e = self.control, self.role_flip, self.estimator
        return {
            "name": self.name,
            "signals": self.signals,
            "threshold": self.threshold_tokens,
            "min_threshold": self.min_threshold_tokens,
            "max_threshold": self.max_threshold_tokens,
            "abundant_below": self.abundant_below,
            "cross_cluster_cache": self.cross_cluster_cache,
            "cache_affinity_slack": self.cache_affinity_slack,
            "prefill_pick": self.prefill_pick,
            "pd_queue": self.pd_queue,
            "kv_compression": self.kv_compression,
            "kv_state_bytes": f"{self.kv_state_bytes}B",
            "kv_bytes_per_token": f"{self.kv_bytes_per_token}B",
            **({"event_threshold": self.event_threshold_tokens} if self.event_threshold_tokens is not None else {}),
            "control": {
                "interval": f"{c.interval_s}s", "high_utilization": c.high_utilization,
                "low_utilization": c.low_utilization, "target_utilization": c.target_utilization,
                "raise_factor": c.raise_factor, "lower_factor": c.lower_factor,
                "raise_interval": f"{c.raise_interval_s}s", "settle": f"{c.settle_s}s", "hold": f"{c.hold_s}s",
                "utilization_tau": f"{c.utilization_tau_s}s", "queue_high": c.queue_high,
                "queue_low": c.queue_low, "pdp_queue_max": c.pdp_queue_max,
                "congestion_events_per_s": c.congestion_events_per_s,
                "window": f"{c.window_s}s", "min_samples": c.min_samples, "slow_tau": f"{c.slow_tau_s}s",
                "drain_horizon": f"{c.drain_horizon_s}s", "prefill_prior": f"{c.prefill_prior_s}s",
                "latency_aware": c.latency_aware,
            },
            "estimator": {
                "queue_delay": f"{e.queue_delay_ms}ms", "queue_delay_fraction": e.queue_delay_fraction,
                "probe_tau": f"{e.probe_tau_s}s", "rtt_window": f"{e.rtt_window_s}s", "rtt_window_polls": e.rtt_window_polls,
                "saturated_window": f"{e.saturated_window_s}s", "probe_after": f"{e.probe_after_s}s", "probe_bdp": e.probe_bdp,
                "probe_headroom": e.probe_headroom, "probe_max": f"{int(e.probe_max_bytes)}B",
                "full_path_ratio": e.full_path_ratio, "probe_dip_fraction": e.probe_dip_fraction,
                "lone_drop_fraction": e.lone_drop_fraction, "probe_until_filled": e.probe_until_filled,
                "probe_confirm": e.probe_confirm, "probe_paced": "auto" if e.probe_paced is None else e.probe_paced, "poll_confirm": f"{e.poll_confirm_s}s",
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
        min_samples=f.get("min_samples", whole_number, d.min_samples),
        slow_tau_s=f.get("slow_tau", _duration, d.slow_tau_s),
        drain_horizon_s=f.get("drain_horizon", _duration, d.drain_horizon_s),
        prefill_prior_s=f.get("prefill_prior", _duration, d.prefill_prior_s),
        latency_aware=f.get("latency_aware", boolean, d.latency_aware),
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
        bs_max=f.get("bs_max", whole_number, d.bs_max),
        min_prefill=f.get("min_prefill", whole_number, d.min_prefill),
        min_decode=f.get("min_decode", whole_number, d.min_decode),
    )
    f.done()
    if r.decode_load_low >= r.decode_load_high:
        raise f.error("decode_load_low", "must be below decode_load_high")
    if r.bs_max < 1:
        raise f.error("bs_max", "must be >= 1")
    return r


def _auto_or_boolean(v: object) -> bool | None:
    """true, false, or auto (None)."""
    if v == "auto":
        return None
    if not isinstance(v, bool):
        raise ValueError(f"{v!r} is not true, false or auto")
    return v


def _probe_headroom(v: Any) -> float:
    x = number(v)
    if x < 1:
        raise ValueError(f"{v!r} must be >= 1 (a probe sized below the estimate cannot read it)")
    return x


def _probe_max(v: Any) -> int:
    n = units.parse_size_bytes(v)
    if n < 1:
        raise ValueError(f"{v!r} is less than 1B, and a probe carries at least one byte (probe_after: 0s sends no probes)")
    return n


# The bounds and why: `testbed.serving.policy.estimator.MAX_PROBE_RTTS` and `MAX_PROBE_HEADROOM`. `probe_max` (emulated
# bytes) at most the bytes one probe may carry on the wire (`PROBE_MAX_BYTES`), which the wire's share of it (probe_max /
# scale, scale >= 1) then never passes: the worker refused a larger probe, every time.
_PROBE_RTTS_WHY = "more round trips than a probe's 2 s hold on a 2-ms path (estimator.MAX_PROBE_RTTS)"
_probe_bdp = at_most(positive_number, MAX_PROBE_RTTS, "bandwidth-delay products", _PROBE_RTTS_WHY)
_full_path_ratio = at_most(positive_number, MAX_PROBE_RTTS, "", _PROBE_RTTS_WHY)
_probe_headroom_bounded = at_most(_probe_headroom, MAX_PROBE_HEADROOM, "times the estimate",
                                  "past the nominal rate for any estimate above 1% of it (estimator.MAX_PROBE_HEADROOM)")
_probe_max_bounded = at_most(_probe_max, PROBE_MAX_BYTES, "B (2**32 - 1)", "the most one probe may carry on the wire (PROBE_MAX_BYTES)")


def _parse_estimator(f: Fields) -> EstimatorSpec:
    d = EstimatorSpec()
    e = EstimatorSpec(
        queue_delay_ms=f.get("queue_delay", lambda v: 1000.0 * units.parse_duration_s(v, allow_zero=True), d.queue_delay_ms),
        queue_delay_fraction=f.get("queue_delay_fraction", units.parse_fraction, d.queue_delay_fraction),
        probe_tau_s=f.get("probe_tau", _duration, d.probe_tau_s),
        rtt_window_s=f.get("rtt_window", _duration, d.rtt_window_s),
        rtt_window_polls=f.get("rtt_window_polls", count_up_to(10_000, "more polls than a window holds"), d.rtt_window_polls),
        saturated_window_s=f.get("saturated_window", _duration, d.saturated_window_s),
        probe_after_s=f.get("probe_after", lambda v: units.parse_duration_s(v, allow_zero=True), d.probe_after_s),
        probe_bdp=f.get("probe_bdp", _probe_bdp, d.probe_bdp),
        probe_headroom=f.get("probe_headroom", _probe_headroom_bounded, d.probe_headroom),
        probe_max_bytes=f.get("probe_max", _probe_max_bounded, d.probe_max_bytes),
        full_path_ratio=f.get("full_path_ratio", _full_path_ratio, d.full_path_ratio),
        probe_dip_fraction=f.get("probe_dip_fraction", units.parse_fraction, d.probe_dip_fraction),
        lone_drop_fraction=f.get("lone_drop_fraction", units.parse_fraction, d.lone_drop_fraction),
        probe_until_filled=f.get("probe_until_filled", boolean, d.probe_until_filled),
        probe_confirm=f.get("probe_confirm", boolean, d.probe_confirm),
        probe_paced=f.get("probe_paced", _auto_or_boolean, d.probe_paced),
        poll_confirm_s=f.get("poll_confirm", lambda v: units.parse_duration_s(v, allow_zero=True), d.poll_confirm_s),
    )
    f.done()
    return e


def _kv_compression(v: Any) -> str:
    """One of `KV_COMPRESSIONS`; YAML reads a bare ``off`` or ``no`` as false, which means ``none``."""
    if v is False:
        return "none"
    if isinstance(v, bool) or str(v) not in KV_COMPRESSIONS:
        raise ValueError(f"{v!r} is not allowed; use one of: {', '.join(KV_COMPRESSIONS)}")
    return str(v)


def _check_between_bounds(f: Fields, key: str, tokens: int, spec: PolicySpec) -> None:
    if not spec.min_threshold_tokens <= tokens <= spec.max_threshold_tokens:
        raise f.error(key, f"{tokens} tokens must lie between min_threshold ({spec.min_threshold_tokens}) "
                           f"and max_threshold ({spec.max_threshold_tokens})")


def parse_policy_section(f: Fields) -> PolicySpec:
    """The scenario's ``policy:`` section. Example::

        policy: {name: prfaas, threshold: 8K, control: {high_utilization: 90%, hold: 3s}}
    """
    d = PolicySpec()
    name = f.choice("name", POLICY_NAMES, d.name)
    t = f.get("threshold", units.parse_tokens, d.threshold_tokens)
    spec = PolicySpec(
        name=name,
        signals=f.choice("signals", SIGNAL_MODES, d.signals),
        threshold_tokens=t,
        min_threshold_tokens=f.get("min_threshold", units.parse_tokens, min(d.min_threshold_tokens, t)),
        max_threshold_tokens=f.get("max_threshold", units.parse_tokens, max(d.max_threshold_tokens, t)),
        abundant_below=f.get("abundant_below", units.parse_fraction, d.abundant_below),
        cross_cluster_cache=f.get("cross_cluster_cache", boolean, d.cross_cluster_cache),
        cache_affinity_slack=f.get("cache_affinity_slack", whole_number, d.cache_affinity_slack),
        prefill_pick=f.choice("prefill_pick", PREFILL_PICKS, d.prefill_pick),
        pd_queue=f.choice("pd_queue", PD_QUEUES, d.pd_queue),
        kv_compression=f.get("kv_compression", _kv_compression, d.kv_compression),
        kv_state_bytes=f.get("kv_state_bytes", units.parse_size_bytes, d.kv_state_bytes),
        kv_bytes_per_token=f.get("kv_bytes_per_token", units.parse_size_bytes, d.kv_bytes_per_token),
        event_threshold_tokens=f.get("event_threshold", units.parse_tokens, None),
        control=_parse_control(f.section("control")),
        role_flip=_parse_role_flip(f.section("role_flip")),
        estimator=_parse_estimator(f.section("estimator")),
    )
    f.done()
    _check_between_bounds(f, "threshold", spec.threshold_tokens, spec)
    if spec.name == "oracle-step":
        if spec.signals != "oracle":
            raise f.error("signals", f"'{spec.signals}' is not allowed with oracle-step: it reads the shaper's configured rate, "
                                     "which only 'oracle' lets a policy see (an explicit ablation)")
        if spec.event_threshold_tokens is None:
            raise f.error("event_threshold", "is required by oracle-step: the threshold (tokens) while the line runs below its rate")
        _check_between_bounds(f, "event_threshold", spec.event_threshold_tokens, spec)
    elif spec.event_threshold_tokens is not None:
        raise f.error("event_threshold", f"only the oracle-step policy reads it (policy.name is '{spec.name}')")
    if spec.kv_compression == "adaptive" and spec.name != "prfaas":
        raise f.error("kv_compression", f"'adaptive' follows the prfaas control law; policy '{spec.name}' has none "
                                        "(use 'fp8' to compress every offload, or 'none')")
    return spec
