"""`prfaas check SCENARIO`: validate a scenario and show what it implies before anything starts.

Everything here is derived from the scenario file and the code that runs it, never measured: the wire
plan of each WAN direction comes from `testbed.net.shaping.plan_shaping` (the qdisc a run would install),
the timeline from `testbed.net.schedule.expand_schedule` (the actions a run would apply), the offered KV
load and Lambda_max from `analysis.throughput_model` (the paper's Eqs. 3-6 on the scenario's clusters).
Warnings name scenarios that cannot show anything (docs/labs.md, "prfaas check").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from testbed import units
from testbed.packet import TCP_MSS_BYTES
from testbed.scale import Scale
from testbed.scenario import DIRECTIONS, Scenario

if TYPE_CHECKING:
    from traffic.request import RequestBatch

FAR_BELOW_CAPACITY = 0.10  # offered KV under 10% of the WAN at every moment: the WAN never matters
OFFLOAD_POLICIES = ("prfaas", "fixed-threshold", "oracle-step", "naive-heterogeneous")
UDP_DATAGRAM_BYTES = TCP_MSS_BYTES  # iperf3's UDP payload: its control connection's MSS (27.6 thousand/s carry 320 Mbps)
# What real-time iperf3 sends on time beside a run, per core of the host (docs/kv.md, session 56, a 2-core VM): the
# case study's 27.6 thousand datagrams/s and val-cross-surge's 48 thousand at scale 100 held (<= 24 thousand a core);
# its 97 thousand at scale 50 did not (48 a core: 42-84% sent, compute 16-23% late). Between the two.
UDP_DATAGRAMS_PER_S_PER_CORE = 30_000


@dataclass(frozen=True)
class DirectionPlan:
    direction: str
    rate_bps: float  # emulated
    wire_rate_bps: float
    delay_s: float
    rtt_s: float
    bdp_wire_bytes: int
    queue_wire_bytes: int
    loss: float


@dataclass(frozen=True)
class Segment:
    """A stretch of the run with one PrfaaS->PD capacity; `offered_kv_bps` is the same in every segment."""

    start_s: float
    end_s: float
    capacity_bps: float  # emulated, PrfaaS -> PD
    cross_bps: float  # mean rate of rate-limited cross traffic PrfaaS -> PD over the segment (emulated)
    utilisation: float | None  # offered KV / (capacity - cross traffic); None without a workload or when none is left
    label: str


@dataclass
class CheckReport:
    name: str
    source: str | None
    scale: float
    scale_source: str
    host_capacity_bps: float
    duration_s: float
    directions: list[DirectionPlan]
    timeline: list[tuple[float, str]]
    segments: list[Segment]
    policy: str | None = None
    threshold_tokens: float | None = None
    arrival_rate_rps: float | None = None
    offload_fraction: float | None = None
    offered_kv_bps: float | None = None  # at the base t, in the dtype the run sends it (float8 under `kv_compression: fp8`)
    offered_kv_model_dtype_bps: float | None = None  # the same in the model's dtype
    offered_kv_compressed_bps: float | None = None  # the same with float8 full-attention KV (`policy.kv_compression`)
    kv_compression: str | None = None
    model: dict[str, Any] | None = None  # Lambda_max at the base t and at the model's t*
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: non-finite numbers (an unbounded Lambda, say) become null."""
        doc = asdict(self)
        doc["timeline"] = [{"at_s": t, "action": a} for t, a in self.timeline]
        return _finite(doc)


def _finite(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return None if isinstance(v, float) and not math.isfinite(v) else v


def direction_plans(sc: Scenario, scale: float) -> list[DirectionPlan]:
    """Each direction's plan at the start, as a run's WAN plans it (`shaping.plan_wan_direction`)."""
    from testbed.net.shaping import plan_wan_direction

    rtt_s, base = sc.wan.rtt_s, {d: sc.wan.direction(d) for d in DIRECTIONS}
    out = []
    for d in DIRECTIONS:
        spec = base[d]
        plan = plan_wan_direction(sc.wan, base, d, scale)
        bdp = int(plan.rate_bps / 8 * rtt_s)
        out.append(DirectionPlan(d, spec.rate_bps, plan.rate_bps, spec.delay_s, rtt_s, bdp, plan.queue_bytes, spec.loss.mean_rate))
    return out


def check_schedule_queues(sc: Scenario, scale: float) -> None:
    """Every step of the schedule planned as a run's WAN plans it (`shaping.plan_wan_direction`), so a change to a
    queue past tc's 32-bit byte limit (a longer delay or a higher rate under a BDP-sized queue) is refused here, not
    when the run applies it (2026-12-07); the base state is `direction_plans`'."""
    from testbed.errors import UserError
    from testbed.net.shaping import plan_wan_direction
    from testbed.scenario import DIRECTIONS, walk_schedule

    for a, step, current in walk_schedule(sc.wan.schedule, {d: sc.wan.direction(d) for d in DIRECTIONS}):
        for d in DIRECTIONS if step else ():  # a delay change re-sizes the other direction's BDP queue too
            try:
                plan_wan_direction(sc.wan, current, d, scale)
            except UserError as exc:
                raise UserError(f"{exc} (at {a.at_s:g}s of wan.schedule: {describe_action(a)}, {d})") from None


def check_wan_plans(sc: Scenario, scale: float) -> list[DirectionPlan]:
    """The WAN's shaping planned at `scale` as a run plans it, refused in ``prfaas check``'s words: every step of the
    schedule (`check_schedule_queues`: a queue past tc's byte limit names the step), then the start; returns the
    start's plans (`direction_plans`). ``prfaas check`` and every multi-run command (`experiments.engine.check_run`, at
    each host's scale) plan it here."""
    check_schedule_queues(sc, scale)
    return direction_plans(sc, scale)


def describe_action(a: Any) -> str:
    """A schedule action in the scenario's units: ``change prfaas_to_pd rate 1 Gbps``."""
    fmt = {"rate_bps": lambda v: f"rate {units.format_rate(v)}", "delay_s": lambda v: f"delay {units.format_duration(v)}",
           "jitter_s": lambda v: f"jitter {units.format_duration(v)}", "loss": lambda v: f"loss {v.model} (mean {v.mean_rate:.3%})"}
    what = ", ".join(fmt.get(k, lambda v, k=k: f"{k} {v}")(v) for k, v in a.changes)
    return " ".join(x for x in (a.kind if a.kind != "revert" else "back from", "+".join(a.directions), what) if x)


def capacity_segments(sc: Scenario) -> list[tuple[float, float, float, str]]:
    """(start_s, end_s, PrfaaS->PD emulated rate, what changed) over the run, from the schedule's actions, stepped as
    a run steps them (`testbed.scenario.walk_schedule`)."""
    from testbed.scenario import DIRECTIONS, walk_schedule

    up = True
    cuts: list[tuple[float, float, str]] = [(0.0, sc.wan.prfaas_to_pd.rate_bps, "base")]
    for a, _, current in walk_schedule(sc.wan.schedule, {d: sc.wan.direction(d) for d in DIRECTIONS}):
        if "prfaas_to_pd" not in a.directions:
            continue
        if a.kind in ("down", "up"):  # one down at a time per direction (`_check_windows`)
            up = a.kind == "up"
        cuts.append((a.at_s, current["prfaas_to_pd"].rate_bps if up else 0.0, describe_action(a)))
    segs = []
    for i, (t, r, what) in enumerate(cuts):
        end = cuts[i + 1][0] if i + 1 < len(cuts) else sc.duration_s
        if end > t:
            segs.append((t, end, r, what))
    return segs


def cross_traffic_bps(sc: Scenario, start_s: float, end_s: float) -> float:
    """Mean emulated rate of the rate-limited cross-traffic flows leaving the PrfaaS datacenter over [start, end).
    Elastic TCP flows (no rate) take a share of whatever is left and are not counted."""
    spec = sc.section("cross_traffic")
    if spec is None or end_s <= start_s:
        return 0.0
    bits = 0.0
    for flow in spec.flows:
        if not flow.src.startswith("prfaas"):
            continue
        for p in flow.periods():
            if p.start_s >= end_s:
                break
            overlap = min(end_s, math.inf if p.end_s is None else p.end_s) - max(start_s, p.start_s)
            if overlap > 0 and p.rate_bps is not None:
                bits += p.rate_bps * overlap
    return bits / (end_s - start_s)


def udp_datagrams_per_s_peak(sc: Scenario, scale: float) -> float:
    """The most UDP datagrams per second that the cross traffic's rate-limited UDP flows send at once on the wire."""
    spec = sc.section("cross_traffic")
    if spec is None:
        return 0.0
    # the run's periods only: an on/off flow without `stop` has endless ones (listing them exhausted memory, 2026-12-07)
    periods = [p for f in spec.flows if f.protocol == "udp" for p in f.periods_until(sc.duration_s) if p.rate_bps]
    # a sweep over starts and ends, an end before a start at the same time (a period is [start, end))
    changes = sorted([(p.start_s, p.rate_bps) for p in periods] + [(p.end_s, -p.rate_bps) for p in periods if p.end_s is not None])
    peak_bps = now = 0.0
    for _, delta in changes:
        now += delta
        peak_bps = max(peak_bps, now)
    return peak_bps / scale / (UDP_DATAGRAM_BYTES * 8)


def _arrival_rate_rps(sc: Scenario, workload: Any, batch: "RequestBatch | None") -> float | None:
    """The mean arrival rate the run offers; a trace replay (at its own times or new ones): the requests it
    sends within the run's duration (`batch`) over that duration (a trace runs out, `max_requests` stops it);
    None for a closed loop (the rate follows completions)."""
    if workload.closed_loop is not None:
        return None
    if batch is not None:
        return len(batch.arrival_s) / sc.duration_s
    return float(workload.arrivals.mean_rate_rps())


def check_scenario(sc: Scenario) -> CheckReport:
    """Every derived figure of a parsed scenario (no network, no processes)."""
    from testbed.net.emulation import host_capacity_bps

    cap_bps, cap_src = host_capacity_bps()
    scale = sc.resolve_scale(cap_bps).factor
    if sc.scale == "auto":
        scale_src = f"auto (host capacity {units.format_rate(cap_bps)} from {cap_src})"
    else:
        scale_src = "scenario"
    from testbed.scenario import expand_schedule

    rep = CheckReport(sc.name, sc.source, scale, scale_src, cap_bps, sc.duration_s, check_wan_plans(sc, scale),
                      [(a.at_s, describe_action(a)) for a in expand_schedule(sc.wan.schedule)], [])
    _load(sc, rep)
    for start, end, rate, what in capacity_segments(sc):
        cross = cross_traffic_bps(sc, start, end)
        left = rate - cross
        util = rep.offered_kv_bps / left if rep.offered_kv_bps is not None and left > 0 else None
        rep.segments.append(Segment(start, end, rate, cross, util, what))
    _warn(sc, rep)
    return rep


def _load(sc: Scenario, rep: CheckReport) -> None:
    """Offered KV at the base threshold and the model's Lambda_max (serving scenarios only), and a warning when a
    torch-mode run's model lines take another model's profiles (`_profiles_of_another_model`)."""
    policy, workload = sc.section("policy"), sc.section("workload")
    if sc.section("model") is None or policy is None or workload is None:
        return
    from analysis import throughput_model as tm
    from traffic.workload import generate_batch

    rep.policy = policy.name
    # a trace replay's requests within the run, drawn once for the arrival rate and the model's lengths (twice before)
    batch = generate_batch(workload, sc.seed, sc.duration_s) if workload.trace is not None else None
    rep.arrival_rate_rps = _arrival_rate_rps(sc, workload, batch)
    cm, _homo, dist, _inputs = tm.cluster_model_from_scenario(sc, batch)
    t = {"naive-heterogeneous": 0.0}.get(policy.name, float(policy.threshold_tokens))
    rep.threshold_tokens = t if policy.name in OFFLOAD_POLICIES else None
    p, _, kv_long = dist.split([t], cm.kv_bytes(dist.lengths))
    rep.offload_fraction = float(p[0]) if policy.name in OFFLOAD_POLICIES else 0.0
    if rep.arrival_rate_rps is not None:
        kv = float(kv_long[0]) if rep.offload_fraction > 0 else 0.0
        rep.offered_kv_bps = rep.offered_kv_model_dtype_bps = rep.arrival_rate_rps * rep.offload_fraction * kv * 8
        if policy.kv_compression != "none" and rep.offload_fraction > 0:
            from testbed.serving.policy.spec import COMPRESSED_KV_DTYPE

            _, _, kv_c = dist.split([t], tm.spec_kv_bytes(sc.section("model").spec, COMPRESSED_KV_DTYPE)(dist.lengths))
            rep.offered_kv_compressed_bps = rep.arrival_rate_rps * rep.offload_fraction * float(kv_c[0]) * 8
            rep.kv_compression = policy.kv_compression
            if policy.kv_compression == "fp8":  # every offload: the float8 figure is what the line carries
                rep.offered_kv_bps = rep.offered_kv_compressed_bps
    if cm.n_prfaas >= 1 and cm.n_pd >= 2:
        at_t = tm.at_threshold(cm, dist, t)
        best = tm.search_prfaas_pd(cm, dist, step_tokens=256.0)
        rep.model = {"lambda_max_at_base_t_rps": at_t.lambda_max, "bottleneck_at_base_t": at_t.bottleneck,
                     "t_star_tokens": best.threshold, "lambda_max_at_t_star_rps": best.lambda_max,
                     "bottleneck_at_t_star": best.bottleneck, "reading": "literal"}
    other_model = _profiles_of_another_model(sc, rep, cm)
    if other_model:
        rep.warnings.append(other_model)


def _profiles_of_another_model(sc: Scenario, rep: CheckReport, cm: Any) -> str | None:
    """A torch-mode run computes its own model, but the model lines (Lambda_max, t*) take their times from the
    profiles: a warning when those are another model's (a profile-mode scenario of them is refused, `check_model`)."""
    from testbed.serving.config import compute_mode

    model = sc.section("model")
    if not rep.model or compute_mode(sc) != "torch":
        return None
    other = cm.profiles_not_of(model.spec.name)
    if not other:
        return None
    said = " and ".join(f"profile {p.name!r} of model {p.model!r} (serving.profiles.{c})" for c, p in other)
    return (f"the model lines (Lambda_max, t*) use {said}, while the run computes model {model.spec.name!r} on torch: "
            f"another model's times at this model's KV bytes (name profiles of {model.spec.name!r} for this run's figures)")


def _warn(sc: Scenario, rep: CheckReport) -> None:
    w = rep.warnings
    wire_max = Scale(rep.scale).wire_bps(sc.wan.max_rate_bps)
    if wire_max > rep.host_capacity_bps:
        w.append(f"scale {rep.scale:g}: the wire would carry {units.format_rate(wire_max)}, more than this host's capacity "
                 f"{units.format_rate(rep.host_capacity_bps)}; the shaper, not the scenario, would set the rate (raise scale)")
    dgrams, cores = udp_datagrams_per_s_peak(sc, rep.scale), os.cpu_count() or 1
    if dgrams > UDP_DATAGRAMS_PER_S_PER_CORE * cores:
        w.append(f"cross_traffic: the UDP flows send {dgrams / 1e3:.0f} thousand datagrams/s on the wire at their peak (scale "
                 f"{rep.scale:g}), more than this host's {cores} core(s) keep on time beside a run (at most {UDP_DATAGRAMS_PER_S_PER_CORE / 1e3:.0f} "
                 f"thousand a core: a 2-core host kept 24 a core and not 48); the neighbours would fall short and the run be "
                 f"flagged (raise scale)")
    workload = sc.section("workload")
    if workload is not None and workload.trace is not None and workload.trace.skip_bad:
        from traffic.workload import trace_data

        data = trace_data(workload.trace)  # only `prfaas traffic stats` said how many were skipped (2026-12-07)
        if data.skipped:
            w.append(f"workload.trace: skip_bad skipped {data.skipped} bad line(s) of {data.path}, the first: {data.problems[0]}; "
                     f"{len(data.requests)} request(s) kept (prfaas traffic stats --skip-bad FILE lists the reasons)")
    rtt = rep.directions[0].rtt_s
    for i, e in enumerate(sc.wan.schedule):
        length = e.down_s or e.for_s
        if length is not None and length < rtt:
            w.append(f"wan.schedule[{i}]: lasts {units.format_duration(length)}, shorter than the RTT "
                     f"{units.format_duration(rtt)}; no sender can react to it")
    if rep.offered_kv_bps is not None and rep.segments:
        utils = [s.utilisation for s in rep.segments if s.utilisation is not None]
        if utils and len(utils) == len(rep.segments) and max(utils) < FAR_BELOW_CAPACITY:
            w.append(f"offered KV {units.format_rate(rep.offered_kv_bps)} stays under {FAR_BELOW_CAPACITY:.0%} of the WAN capacity left for it, "
                     f"even at its lowest ({max(utils):.0%}): the WAN never binds (raise the arrival rate or lower the threshold)")
    if rep.model and rep.arrival_rate_rps is not None and rep.arrival_rate_rps > rep.model["lambda_max_at_base_t_rps"]:
        w.append(f"arrival rate {rep.arrival_rate_rps:g}/s is above the model's Lambda_max {rep.model['lambda_max_at_base_t_rps']:.3g}/s "
                 f"at the base t ({rep.model['bottleneck_at_base_t']} binds): queues grow for the whole run")


# ------------------------------------------------------------------------------------------------ output


def format_report(rep: CheckReport) -> str:
    f = units.format_rate
    lines = [f"scenario {rep.name} ({rep.source}): valid", f"  duration {units.format_duration(rep.duration_s)}, scale {rep.scale:g} ({rep.scale_source})", "WAN per direction (wire = emulated / scale; BDP over the RTT):"]
    for d in rep.directions:
        lines.append(f"  {d.direction:13s} {f(d.rate_bps):>10s} -> wire {f(d.wire_rate_bps):>10s}  delay {units.format_duration(d.delay_s)}"
                     f"  RTT {units.format_duration(d.rtt_s)}  BDP {units.format_bytes(d.bdp_wire_bytes)}  queue {units.format_bytes(d.queue_wire_bytes)}"
                     f"  loss {d.loss:.3%}")
    lines.append("schedule:" if rep.timeline else "schedule: none (the WAN stays as configured)")
    for t, what in rep.timeline:
        lines.append(f"  {t:8.1f} s  {what}")
    if rep.policy is not None:
        t = "-" if rep.threshold_tokens is None else f"{rep.threshold_tokens:g} tokens"
        rate = "closed loop" if rep.arrival_rate_rps is None else f"{rep.arrival_rate_rps:g} req/s"
        lines.append(f"load: policy {rep.policy}, base t {t}, arrivals {rate}, offload fraction {rep.offload_fraction:.3f}")
        if rep.kv_compression == "adaptive" and rep.offered_kv_compressed_bps is not None:
            lines.append(f"  offered KV with float8 full-attention KV (policy.kv_compression: adaptive, while the law is under "
                         f"pressure): {f(rep.offered_kv_compressed_bps)}")
        if rep.offered_kv_bps is not None:
            dtype = (f" in float8 (policy.kv_compression: fp8; {f(rep.offered_kv_model_dtype_bps)} in the model's dtype)"
                     if rep.kv_compression == "fp8" else "")
            lines.append(f"  offered KV (emulated) {f(rep.offered_kv_bps)}{dtype}; against the PrfaaS->PD capacity left by cross traffic:")
    if rep.segments and rep.offered_kv_bps is None:  # the capacity alone, under its own heading (it stood headless, 2026-12-07)
        why = "no serving sections" if rep.policy is None else "a closed-loop workload has no fixed rate"
        lines.append(f"{'' if rep.policy is None else '  '}PrfaaS->PD capacity left by cross traffic ({why}: no offered KV load):")
    for s in rep.segments:
        util = "" if rep.offered_kv_bps is None else f"  offered/left {'-' if s.utilisation is None else f'{s.utilisation:.0%}'}"
        cross = f" - cross {f(s.cross_bps)}" if s.cross_bps else ""
        lines.append(f"  {s.start_s:8.1f}-{s.end_s:<8.1f} s  capacity {f(s.capacity_bps)}{cross}{util}  ({s.label})")
    if rep.model:
        m = rep.model
        lines.append(f"model (Eqs. 3-6, {m['reading']}): Lambda_max {m['lambda_max_at_base_t_rps']:.3g} req/s at the base t ({m['bottleneck_at_base_t']} binds); "
                     f"t* {m['t_star_tokens']:g} tokens gives {m['lambda_max_at_t_star_rps']:.3g} req/s ({m['bottleneck_at_t_star']})"
                     + ("" if rep.arrival_rate_rps is None else f"; offered {rep.arrival_rate_rps:g} req/s"))
    for w in rep.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def register(sub: "argparse._SubParsersAction") -> None:
    c = sub.add_parser("check", help="validate a scenario and print its derived figures (wire rates, BDPs, load vs capacity, Lambda_max); starts nothing")
    c.add_argument("scenario", metavar="SCENARIO", help="scenario file or ready scenario name")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="scenario override, e.g. wan.rate=20Gbps")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.set_defaults(func=cmd_check)


def cmd_check(args: argparse.Namespace) -> int:
    from testbed.sections import load_scenario

    rep = check_scenario(load_scenario(args.scenario, args.set))
    if args.json:
        json.dump(rep.to_dict(), sys.stdout, indent=1, default=str, allow_nan=False)
        sys.stdout.write("\n")
    else:
        print(format_report(rep))
    return 0
