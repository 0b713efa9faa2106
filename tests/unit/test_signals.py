"""Observed signals: the bandwidth estimator on synthetic traces, the oracle gate, the law on observed signals."""

from __future__ import annotations

import dataclasses
import pytest

from testbed import clock
from testbed.validation import FieldError, Fields
from testbed.serving.policy import InstanceState, RequestView, SchedulerLog, TelemetrySample, build_policy, parse_policy_section
from testbed.serving.policy.estimator import BandwidthEstimator, EstimatorSpec
from testbed.serving.policy.signals import ORACLE_FIELDS, GroundTruth, admit

G = 1e9
POLL_S = 0.5


def trace(est: BandwidthEstimator, t0: float, t1: float, goodput, rtt_ms, backlog=lambda t: 50e6, retrans=lambda t: 0.0):
    """Feed polls every 0.5 s from t0 to t1; the goodput a poll reports is the 1 s trailing mean of the
    path rate (as `KVSender.congestion` computes it)."""
    out = []
    t = t0
    while t <= t1 + 1e-9:
        mean = (goodput(t) + goodput(t - 0.5)) / 2.0
        out.append(est.update(t, mean, backlog(t), rtt_ms(t), 10.0, retrans(t)))
        t += POLL_S
    return out


def test_a_5x_step_down_is_detected_within_2s_and_then_tracked_within_20pct() -> None:
    est = BandwidthEstimator(10 * G)
    rate = lambda t: 10 * G if t < 10 else 2 * G  # noqa: E731
    rtt = lambda t: 10.5 if t < 10 else 30.0  # noqa: E731  (the bottleneck queue fills at the dip)
    # transfers with gaps before the dip (the backlog drains every 4 s), then backlogged all through it: a
    # queue under a backlog that never drained does not become the floor (test_a_queue_under_a_backlog_...)
    drains = lambda t: 0.0 if t < 9.6 and round(t * 2) % 8 == 0 else 50e6  # noqa: E731
    out = trace(est, 0.0, 19.5, rate, rtt, backlog=drains)
    pre = [e.available_bps for e in out if 5 <= e.t_s < 10]
    assert all(abs(x - 10 * G) <= 0.2 * 10 * G for x in pre)
    detect = min(e.t_s for e in out if e.t_s >= 10 and e.available_bps < 0.5 * 10 * G)
    assert detect - 10.0 <= 2.0
    steady = [e.available_bps for e in out if e.t_s >= 13]
    assert all(abs(x - 2 * G) <= 0.2 * 2 * G for x in steady)
    at_dip = next(e for e in out if e.t_s == 11.0)
    assert at_dip.congested and at_dip.queue_delay_ms == pytest.approx(30.0 - 10.5)


def test_a_tiny_probe_tau_grows_the_estimate_to_its_ceiling_instead_of_overflowing() -> None:
    """`policy.estimator.probe_tau: 1us` passed every check and made exp() overflow at the next headroom poll
    (an OverflowError in replay-estimator; in a live router, in its control loop)."""
    est = BandwidthEstimator(10 * G, EstimatorSpec(probe_tau_s=1e-6))
    est.update(0.0, 1 * G, 50e6, 10.0, 10.0)
    est.estimate = dataclasses.replace(est.estimate, available_bps=1 * G)
    est._value = 1 * G
    assert est.update(7.0, 1 * G, 50e6, 10.0, 10.0).available_bps == 10 * G  # at the nominal ceiling, no traceback


def test_a_step_up_is_followed_as_soon_as_the_backlogged_senders_get_more() -> None:
    est = BandwidthEstimator(10 * G)
    rate = lambda t: 2 * G if t < 10 else 10 * G  # noqa: E731
    rtt = lambda t: 30.0 if t < 10 else 10.5  # noqa: E731
    out = trace(est, 0.0, 14.0, rate, rtt)
    assert abs(next(e for e in out if e.t_s == 9.5).available_bps - 2 * G) <= 0.2 * 2 * G
    assert min(e.t_s for e in out if e.available_bps >= 0.9 * 10 * G) <= 11.0


def test_a_cross_traffic_surge_without_a_rate_change_shows_as_less_bandwidth_for_kv() -> None:
    """The line stays at 10 Gbps; 7 Gbps of inelastic neighbours arrive at t = 10: KV gets 3."""
    est, truth = BandwidthEstimator(10 * G), GroundTruth(tau_s=0.5)
    kv = lambda t: 9.5 * G if t < 10 else 3 * G  # noqa: E731
    out = []
    for i in range(40):  # to 19.5 s: within rtt_window of the surge (see the step-down test)
        t = 0.5 * i
        goodput = (kv(t) + kv(t - 0.5)) / 2.0
        out.append(est.update(t, goodput, 50e6, 10.5 if t < 10 else 25.0, 10.0))
        truth.on_kv_goodput(goodput)
        truth.on_wan(t, egress_bps=10 * G, capacity_bps=10 * G)
    assert min(e.t_s for e in out if e.t_s >= 10 and e.available_bps < 5 * G) - 10 <= 2.0
    assert truth.kv_available_bps == pytest.approx(3 * G, rel=0.05)
    assert abs(out[-1].available_bps - truth.kv_available_bps) <= 0.2 * truth.kv_available_bps


def test_loss_without_a_queue_is_not_congestion_and_does_not_lower_the_estimate() -> None:
    est = BandwidthEstimator(10 * G)
    out = trace(est, 0.0, 10.0, lambda t: 9 * G, lambda t: 10.3, retrans=lambda t: 500.0 * t)
    assert all(not e.congested for e in out)
    assert out[-1].retransmits_per_s == pytest.approx(500.0)
    assert all(e.available_bps >= 0.85 * 9 * G for e in out[2:])


def test_between_transfers_the_estimate_is_held_with_its_age_not_reset_to_the_nominal_rate() -> None:
    est = BandwidthEstimator(10 * G)
    trace(est, 0.0, 5.0, lambda t: 2 * G, lambda t: 30.0)  # a dip: backlogged, a standing queue
    assert est.estimate.available_bps == pytest.approx(2 * G, rel=0.05) and est.estimate.evidence == "saturated"
    idle = trace(est, 5.5, 15.5, lambda t: 0.5 * G, lambda t: 10.2, backlog=lambda t: 0.0)
    assert all(e.available_bps == pytest.approx(2 * G, rel=0.05) and e.evidence == "none" for e in idle)
    assert idle[-1].age_s == pytest.approx(10.5)  # how old the last upper bound is


def test_headroom_polls_raise_the_estimate_and_application_limited_samples_never_lower_it() -> None:
    """After a dip, transfers that get 3 Gbps without queueing say: at least 3, maybe more; the estimate
    grows by e per probe_tau of such polls up to the nominal rate, and it is never pulled below what was seen."""
    est = BandwidthEstimator(10 * G)
    trace(est, 0.0, 5.0, lambda t: 2 * G, lambda t: 30.0)
    out = trace(est, 5.5, 25.5, lambda t: 3 * G, lambda t: 10.2)
    assert all(e.evidence == "headroom" and e.available_bps >= 3 * G for e in out)
    assert out[1].available_bps <= 1.25 * 3 * G  # one poll after the dip: +10%, not half the gap to 10 Gbps
    assert out[-1].available_bps == 10 * G  # 20 s of headroom polls: x e^4, capped at the nominal rate
    before = out[-1].available_bps
    slow = trace(est, 26.0, 30.0, lambda t: 0.4 * G, lambda t: 10.2)  # slow start / prefill-paced: a lower bound
    assert all(e.available_bps >= before for e in slow)


def test_intermittent_transfers_in_a_dip_keep_the_error_within_20pct() -> None:
    """The drift the first version had: transfers of 1 s every 4 s in a 5x dip; between them nothing is
    backlogged. Median |error| over the dip after detection <= 20% (the issue's steady-period target),
    detection within 2 s of the dip's start (the first transfer starts with it)."""
    est = BandwidthEstimator(10 * G)
    busy = lambda t: ((t - 10.0) % 4.0) < 1.0  # noqa: E731  (transfers at 10-11, 14-15, ...: one starts with the dip)
    out = trace(est, 0.0, 40.0, lambda t: 9 * G if t < 10 else 2 * G, lambda t: 10.3 if t < 10 or not busy(t) else 25.0,
                backlog=lambda t: 50e6 if busy(t) else 0.0)
    detect = min(e.t_s for e in out if e.t_s >= 10 and e.available_bps < 0.5 * 9 * G)
    assert detect - 10.0 <= 2.0
    errors = sorted(abs(e.available_bps - 2 * G) / (2 * G) for e in out if e.t_s >= detect)
    assert errors[len(errors) // 2] <= 0.2
    # held, not drifting back to 10 Gbps between transfers; the first transfer's two polls (5.5 Gbps, the
    # trailing mean across the dip's start, then 2) set their mean, 3.75, until the next transfer
    assert max(abs(e.available_bps - 2 * G) / (2 * G) for e in out if e.t_s >= 14.0) <= 0.2


def test_a_lasting_rtt_increase_stops_counting_as_queueing_after_the_rtt_window() -> None:
    """Transfers with gaps between them (the backlog drains every 4 s): the polled minimum is the path's delay."""
    est = BandwidthEstimator(10 * G)
    drains = lambda t: 0.0 if round(t * 2) % 8 == 0 else 50e6  # noqa: E731
    out = trace(est, 0.0, 25.0, lambda t: 9 * G, lambda t: 10.2 if t < 5 else 80.0, backlog=drains)
    assert next(e for e in out if e.t_s == 6.0).queue_delay_ms > 60
    assert out[-1].queue_delay_ms < 1.0 and out[-1].available_bps >= 0.8 * 9 * G


def test_a_queue_under_a_backlog_that_never_drains_stays_a_queue_past_the_rtt_window() -> None:
    """val-thin-line: 3-5 GB of KV committed through a 25-s dip to 0.7 of 10 Gbps. Every RTT polled under
    that backlog may carry its own queue, so after rtt_window the queue must not become the floor (it did:
    the polls turned to headroom and grew the estimate back to 10 Gbps in 12 s); nor after the backlog
    drains for one poll (a drained poll has no RTT of its own: the next polls are queued again)."""
    est = BandwidthEstimator(10 * G)
    rate = lambda t: 8 * G if t < 10 else 0.7 * G  # noqa: E731
    rtt = lambda t: 10.5 if t < 10 else 23.0  # noqa: E731
    backlog = lambda t: 0.0 if t < 9 else 3e9  # noqa: E731  (transfers with gaps until 9 s, then never drained)
    out = trace(est, 0.0, 40.0, rate, rtt, backlog=backlog)
    late = [e for e in out if e.t_s >= 25.0]
    assert all(e.congested and e.queue_delay_ms > 10.0 for e in late)
    assert all(abs(e.available_bps - 0.7 * G) <= 0.2 * 0.7 * G for e in late)
    est.update(40.5, 0.0, 0.0, 0.0, 10.0, 0.0)  # drained for one poll: no connection busy, no RTT
    after = trace(est, 41.0, 52.0, lambda t: 0.7 * G, lambda t: 23.0, backlog=lambda t: 3e9)
    assert all(e.rtt_floor_ms == pytest.approx(10.0) and e.congested for e in after)
    assert abs(after[-1].available_bps - 0.7 * G) <= 0.2 * 0.7 * G


def test_a_delay_step_under_a_paced_stream_that_never_drains_is_learnt_within_the_rtt_window() -> None:
    """val-rtt-surge's case with KV streamed at its prefill's pace: a few MB always queued or in flight (the
    backlog never reaches 0) on an 84 Gbps path whose delay steps from 10 to 80 ms. So small a backlog cannot
    build a standing queue of its own at that rate, so its RTTs measure the path: after rtt_window the new
    delay is the floor and the estimate is back at the line rate."""
    est = BandwidthEstimator(84 * G)
    paced = lambda t: 4 * G if round(t * 2) % 2 else 40 * G  # noqa: E731  (app-limited polls and layer bursts)
    out = [est.update(i * 0.5, paced(i * 0.5), 5e6, 10.5 if i * 0.5 < 10 else 80.5, 10.0) for i in range(81)]
    assert next(e for e in out if e.t_s == 10.5).congested  # the step reads as a queue at first ...
    late = [e for e in out if e.t_s >= 25.0]
    assert all(not e.congested and e.rtt_floor_ms == pytest.approx(80.5) for e in late)  # ... then as the path
    assert all(e.available_bps >= 0.8 * 84 * G for e in late)


# ------------------------------------------------------------------------------------ the oracle gate


def test_admit_strips_every_oracle_field_unless_the_mode_is_oracle() -> None:
    full = TelemetrySample(1.0, egress_bps=1.0, capacity_bps=2.0, backlog_bytes=3.0, drops=4.0, kv_goodput_bps=5.0)
    for mode in ("observed", "provisioned"):
        seen = admit(full, mode)
        assert seen is not None and seen.kv_goodput_bps == 5.0
        assert all(getattr(seen, f) is None for f in ORACLE_FIELDS)
        assert admit(TelemetrySample(1.0, capacity_bps=2.0), mode) is None
    assert admit(full, "oracle") == full
    assert set(ORACLE_FIELDS) <= {f.name for f in dataclasses.fields(TelemetrySample)}


# ------------------------------------------------------------------------------ the law on observed signals

PREFILL = (InstanceState(0, "prfaas", "10.1.0.1"), InstanceState(1, "pd", "10.2.0.1"), InstanceState(2, "pd", "10.2.0.2"))
DECODE = (InstanceState(10, "pd", "10.2.0.11"),)
K = 1024


def observed_policy(**kw: object):
    spec = parse_policy_section(Fields({"name": "prfaas", "threshold": "1K", "min_threshold": "1K", "kv_bytes_per_token": "150KB",
                                        "signals": "observed", **kw}, "policy"))
    return build_policy(spec, PREFILL, DECODE, log=SchedulerLog(), capacity_bps=20 * G)


def feed_arrivals(pol, t0: float) -> None:
    from testbed.serving.kvmanager import KVManager
    from testbed.serving.policy import ClusterState

    kv = KVManager({p.instance: p.cluster for p in PREFILL})
    for i, n in enumerate([K, 2 * K, 4 * K, 8 * K] * 5):  # 20 arrivals over 10 s: 1.8 GB/s at t = 1K -> ~14.7 Gbps
        pol.decide(RequestView(f"r{i}", n, 16, t0 + 0.5 * i), ClusterState(t0 + 0.5 * i, PREFILL, DECODE, kv.match([], n)))


def test_observed_dip_raises_t_to_fit_the_estimated_bandwidth_without_any_capacity_sample() -> None:
    pol = observed_policy()
    t0 = clock.now_s() - 20
    feed_arrivals(pol, t0)
    now = t0 + 10
    for i in range(8):  # the senders are backlogged, a queue builds, they get 4 Gbps
        pol.on_telemetry(TelemetrySample(now + 0.25 * i, kv_goodput_bps=4 * G, send_queue_bytes=1e6, inflight_bytes=1e6,
                                         rtt_ms=30.0, min_rtt_ms=10.0))
    assert pol.controller.kv_capacity_bps == pytest.approx(4 * G)
    pol.tick(now + 2)
    assert pol.threshold > K
    demand = pol.controller.predicted_demand_bps(pol.threshold, now + 2)
    assert demand <= 0.8 * 4 * G


def test_committed_kv_beyond_a_prefill_time_is_priced_and_calm_waits_for_it_to_drain() -> None:
    pol = observed_policy(control={"prefill_prior": "1s", "drain_horizon": "4s"})
    t0 = clock.now_s() - 20
    feed_arrivals(pol, t0)
    now = t0 + 10
    # 10 Gbps available, 5 GB committed: 40 Gbit, 10 drain under a prefill, 30 Gbit excess -> 7.5 Gbps of the budget
    for i in range(4):
        pol.on_telemetry(TelemetrySample(now + 0.25 * i, kv_goodput_bps=10 * G, send_queue_bytes=4e9, inflight_bytes=1e9,
                                         rtt_ms=30.0, min_rtt_ms=10.0))
    sig = pol.controller.signals(now + 1)
    assert sig["excess_committed_bits"] == pytest.approx(40e9 - 10e9, rel=1e-6)
    pol.tick(now + 1)
    assert pol.controller.predicted_demand_bps(pol.threshold, now + 1) <= 0.8 * 10 * G - 30e9 / 4 + 1
    assert any("committed KV" in r["reason"] for r in pol.log.rows("threshold"))


def test_at_low_arrival_rates_the_demand_model_does_not_vanish_between_arrivals() -> None:
    """1 request every 1.3 s: a 10 s window holds 7-8, fewer than min_samples (10); the law keeps the last
    10 instead of falling back to blind x1.5 steps whenever the window runs short."""
    from testbed.serving.kvmanager import KVManager
    from testbed.serving.policy import ClusterState

    pol = observed_policy()
    kv = KVManager({p.instance: p.cluster for p in PREFILL})
    t0 = clock.now_s() - 60
    known = []
    for i in range(40):
        t = t0 + 1.3 * i
        pol.decide(RequestView(f"r{i}", 4 * K, 16, t), ClusterState(t, PREFILL, DECODE, kv.match([], 4 * K)))
        known.append(pol.controller.predicted_demand_bps(0.0, t + 1.0) is not None)
    assert not any(known[:9]) and all(known[9:])
    # the rate it predicts is the arrivals' own: 10 x S_kv(4K) over the ~11.7 s they span (+1 s to now)
    assert pol.controller.predicted_demand_bps(0.0, t0 + 1.3 * 39) == pytest.approx(10 * 150e3 * 4 * K * 8 / (1.3 * 9), rel=0.01)


def test_provisioned_mode_takes_the_nominal_rate_as_the_capacity_and_ignores_the_emulator() -> None:
    pol = observed_policy(signals="provisioned")
    t = clock.now_s()
    pol.on_telemetry(TelemetrySample(t, egress_bps=19 * G, capacity_bps=2 * G, drops=1e6))
    pol.on_telemetry(TelemetrySample(t + 0.5, kv_goodput_bps=5 * G, kv_path_rate_bps=6 * G, send_queue_bytes=1e6,
                                     rtt_ms=30.0, min_rtt_ms=10.0))
    c = pol.controller
    assert c.estimator is None and c.kv_capacity_bps == 20 * G and c.capacity_bps == 20 * G
    assert c.egress_utilization == pytest.approx(5 / 20)
    assert pol.status()["signals"] == "provisioned"


# ------------------------------------------------------------------------------ active probes (synthetic)


def probing_trace(est: BandwidthEstimator, t0: float, t1: float, busy, kv_rate, rtt_ms, remainder, idle_rtt_ms,
                  queue_ms=lambda t: 0.0, sizes=None, sized_reach=False):
    """Polls every 0.5 s; while `busy(t)` the KV senders are backlogged at `kv_rate(t)` with RTT `rtt_ms(t)`;
    while idle for `probe_after`, a probe as the router sends it: `est.probe_bytes()` delivered at the path's
    `remainder(t)` when that many bytes fill it (>= 3 BDPs at the remainder), else at what slow start reaches
    (bytes / 2 per unloaded RTT; with `sized_reach`, as measured by `benchmarks/probe_bench.py --size-at`:
    the rate its `probe_bdp` BDPs were counted at), its pings measuring `idle_rtt_ms(t)` and its end the RTT
    plus `queue_ms(t)`."""
    out, t = [], t0
    while t <= t1 + 1e-9:
        if busy(t):
            out.append(est.update(t, kv_rate(t), 50e6, rtt_ms(t), 10.0))
        elif est.evidence_t is None or t - est.evidence_t >= est.spec.probe_after_s:
            n = est.probe_bytes()
            if sizes is not None:
                sizes.append((t, n))
            rtt_s = idle_rtt_ms(t) / 1000.0
            reach = 8 * n / est.spec.probe_bdp / rtt_s if sized_reach else 8 * n / 2 / rtt_s
            rate = remainder(t) if 8 * n >= 3 * remainder(t) * rtt_s and not sized_reach else min(reach, remainder(t))
            out.append(est.probe(t, n, rate, idle_rtt_ms(t) + queue_ms(t), idle_rtt_ms(t), 10.0))
        else:
            out.append(est.update(t, 0.0, 0.0, rtt_ms(t), 10.0))
        t += POLL_S
    return out


def test_a_probe_that_fills_the_path_beside_inelastic_neighbours_measures_the_remainder() -> None:
    """100 Gbps line, 16 Gbps of inelastic neighbours: KV (bursts of 1 s every 4 s at 25 Gbps, no queue) never
    shows the 84 left; a probe that fills the path (a standing queue under it) does, and the estimate comes
    down to it at the first such probe and stays there. A probe under which no queue stood is a lower bound:
    the estimate stays at the nominal rate. (Until 2026-12-04 a filled probe was believed only below half the
    estimate: its rate, read from the acknowledged bytes, spread 9-168 Gbps on val-dip; read from the
    delivered bytes it is 75-88: `benchmarks/probe_bench.py`, docs/router.md "Delivered, not acknowledged".)"""
    busy = lambda t: (t % 4.0) < 1.0  # noqa: E731
    args = dict(busy=busy, kv_rate=lambda t: 25 * G, rtt_ms=lambda t: 10.3, remainder=lambda t: 84 * G,
                idle_rtt_ms=lambda t: 10.6)
    queued = probing_trace(BandwidthEstimator(100 * G), 0.0, 40.0, queue_ms=lambda t: 6.0, **args)
    first = min(e.t_s for e in queued if e.evidence == "saturated")
    assert first <= 2.0 and all(e.available_bps == pytest.approx(84 * G) for e in queued if e.t_s >= first)
    no_queue = probing_trace(BandwidthEstimator(100 * G), 0.0, 40.0, queue_ms=lambda t: 3.0, **args)
    assert all(e.available_bps == 100 * G for e in no_queue)
    assert sum(e.evidence == "headroom" and e.sample_bps == 84 * G for e in no_queue) >= 5  # the probes: lower bounds
    old = BandwidthEstimator(100 * G, EstimatorSpec(probe_dip_fraction=0.5))  # the rule before 2026-12-04
    assert all(e.available_bps == 100 * G for e in probing_trace(old, 0.0, 40.0, queue_ms=lambda t: 6.0, **args))


def test_a_5x_dip_that_starts_while_no_kv_moves_is_found_by_the_next_probe_within_2s() -> None:
    est = BandwidthEstimator(100 * G)
    dip = lambda t: 10.0 <= t < 30.0  # noqa: E731
    out = probing_trace(est, 0.0, 29.5, busy=lambda t: False, kv_rate=lambda t: 0.0, rtt_ms=lambda t: 10.3,
                        remainder=lambda t: 4 * G if dip(t) else 84 * G, idle_rtt_ms=lambda t: 10.4,
                        queue_ms=lambda t: 10.0 if dip(t) else 2.0)
    pre = next(e for e in reversed(out) if e.t_s < 10).available_bps
    detect = min(e.t_s for e in out if e.t_s >= 10 and e.available_bps < 0.5 * pre)
    assert detect - 10.0 <= 2.0
    assert all(abs(e.available_bps - 4 * G) <= 0.2 * 4 * G for e in out if e.t_s >= detect)


def test_after_a_dip_probes_grow_back_to_the_remainder_without_flooding_the_dipped_path() -> None:
    """A probe is sized to the estimate (5 BDPs): in the dip it stays small, and after it a probe that slow
    start limits is only a lower bound (headroom), so the estimate climbs probe by probe, not at once."""
    est, sizes = BandwidthEstimator(100 * G), []
    out = probing_trace(est, 0.0, 40.0, busy=lambda t: False, kv_rate=lambda t: 0.0, rtt_ms=lambda t: 10.3,
                        remainder=lambda t: 4 * G if t < 10 else 84 * G, idle_rtt_ms=lambda t: 10.4,
                        queue_ms=lambda t: 10.0 if t < 10 else 0.0, sizes=sizes)
    assert all(e.available_bps <= 1.2 * 4 * G for e in out if 1 <= e.t_s < 10)
    # the first probe: 5 BDPs at the nominal rate and, before any RTT is known, 10 ms (625 MB); in the dip 5 x 4 Gbps x 10.4 ms
    assert sizes[0][1] == pytest.approx(5 * 100 * G / 8 * 0.010, rel=0.01)
    # (the second probe, after a lone filled probe halved the estimate, at twice that: the nominal rate)
    assert sizes[1][1] == pytest.approx(5 * 100 * G / 8 * 0.0104, rel=0.01)
    assert all(n == pytest.approx(5 * 2 * 4 * G / 8 * 0.0104, rel=0.01) for t, n in sizes[2:] if t < 10)
    later = [e for e in out if e.t_s >= 10]
    assert any(e.evidence == "headroom" for e in later)  # slow-start-limited probes: lower bounds
    assert min(e.t_s for e in later if e.available_bps >= 0.8 * 84 * G) - 10 <= 12.0
    assert abs(out[-1].available_bps - 84 * G) <= 0.1 * 84 * G


def test_a_probe_sized_above_the_estimate_corrects_an_estimate_below_the_truth() -> None:
    """val-rtt-surge seed 1 (2026-12-04): a KV poll met a probe's queue and halved the estimate (88 -> 44 with
    84 left); a burst reads at most about the rate it was sized for, and slow start's last rounds queue even
    then, so probes sized to the estimate (`probe_headroom` 1) counted as filled and held it there. Sized at
    twice the estimate, the next probe reads the remainder and the estimate is back within 10%."""
    args = dict(busy=lambda t: False, kv_rate=lambda t: 0.0, rtt_ms=lambda t: 10.3, remainder=lambda t: 84 * G,
                idle_rtt_ms=lambda t: 10.4, queue_ms=lambda t: 4.0, sized_reach=True)
    runs = {}
    for headroom in (2.0, 1.0):
        est = BandwidthEstimator(100 * G, EstimatorSpec(probe_headroom=headroom))
        probing_trace(est, 0.0, 5.0, **args)
        assert abs(est.estimate.available_bps - 84 * G) <= 0.1 * 84 * G  # sized at the nominal rate: right
        low = est.update(5.5, 20 * G, 50e6, 25.0, 10.0)  # the poll that met a probe's queue
        assert low.evidence == "saturated" and low.available_bps == pytest.approx(0.5 * 84 * G, rel=0.1)
        runs[headroom] = probing_trace(est, 6.0, 20.0, **args)
    first = next(e for e in runs[2.0] if e.evidence != "none")
    assert abs(first.available_bps - 84 * G) <= 0.1 * 84 * G
    assert first.t_s <= 6.5 and all(abs(e.available_bps - 84 * G) <= 0.1 * 84 * G for e in runs[2.0] if e.t_s >= first.t_s)
    assert all(e.available_bps <= 0.55 * 84 * G for e in runs[1.0])  # the failure: confirmed, not corrected


def test_an_rtt_step_without_a_rate_change_is_no_dip_once_a_probe_measured_the_new_unloaded_rtt() -> None:
    """The path's delay goes 10 -> 80 ms at t = 10 while no KV moves; the line and its 84 Gbps remainder are
    unchanged. KV after it gets a window-limited rate (1/8, growing) at 80 ms: without the probe's
    unloaded RTT that reads as a standing queue (the old behaviour: a false dip for rtt_window)."""
    busy = lambda t: (t % 4.0) < 1.0  # noqa: E731  (the step at t = 10 falls in an idle gap)
    args = dict(busy=busy, kv_rate=lambda t: 25 * G if t < 10 else min(3 * G * (1 + (t - 10) / 2), 25 * G),
                rtt_ms=lambda t: 10.3 if t < 10 else 80.5, remainder=lambda t: 84 * G,
                idle_rtt_ms=lambda t: 10.4 if t < 10 else 80.4)
    out = probing_trace(BandwidthEstimator(100 * G), 0.0, 30.0, **args)
    pre = next(e for e in reversed(out) if e.t_s < 10).available_bps
    assert all(e.available_bps >= 0.5 * pre for e in out if e.t_s >= 10)
    assert all(e.evidence != "saturated" or e.sample_bps >= 0.5 * pre for e in out if e.t_s >= 10)
    old = dataclasses.replace(BandwidthEstimator(1.0).spec, probe_after_s=0.0)
    blind = BandwidthEstimator(100 * G, old)
    seen = trace(blind, 0.0, 20.0, lambda t: 25 * G if t < 10 else 3 * G, lambda t: 10.3 if t < 10 else 80.5)
    assert min(e.available_bps for e in seen if e.t_s >= 10) < 0.5 * 100 * G  # what the probe prevents


def test_a_probe_slowed_by_loss_without_a_queue_is_a_lower_bound_not_a_dip() -> None:
    """Random loss (no standing queue) holds a probe's TCP to 20 Gbps on a path with 84 left: that is TCP's
    loss response, not the path's capacity, so the estimate is not lowered; with a queue it would be. (A
    probe's retransmits are no input: the queue under it decides.)"""
    est = BandwidthEstimator(100 * G)
    probing_trace(est, 0.0, 10.0, busy=lambda t: False, kv_rate=lambda t: 0.0, rtt_ms=lambda t: 10.3,
                  remainder=lambda t: 84 * G, idle_rtt_ms=lambda t: 10.4, queue_ms=lambda t: 3.0)
    pre = est.estimate.available_bps
    lossy = est.probe(11.0, est.probe_bytes(), 20 * G, 10.6, 10.4, 10.0)
    assert lossy.evidence == "headroom" and lossy.available_bps == pre and not lossy.congested
    kv = est.update(11.5, 25 * G, 50e6, 10.3, 10.0, retransmits=500.0)
    assert not kv.congested and kv.available_bps == pre
    overflow = est.probe(12.0, est.probe_bytes(), 20 * G, 16.0, 10.4, 10.0)  # a queue stood: a dip
    assert overflow.evidence == "saturated" and overflow.available_bps == 0.5 * pre  # alone: at most halves
    again = est.probe(12.5, est.probe_bytes(), 20 * G, 16.0, 10.4, 10.0)
    assert again.evidence == "saturated" and again.available_bps == 20 * G  # confirmed: the mean of the two


def test_one_outlying_saturated_poll_does_not_move_the_estimate_the_median_of_three_does() -> None:
    """In a dip the summed delivery rate of one poll ranged 0.03-35 Gbps against 2-6 true (val-dip seed 1):
    a saturated poll sets the estimate to the median of the last three within 2 s."""
    est = BandwidthEstimator(100 * G)
    for t, x in ((0.0, 4 * G), (0.5, 4.4 * G), (1.0, 35 * G), (1.5, 3.8 * G), (2.0, 0.03 * G)):
        e = est.update(t, x, 50e6, 25.0, 10.0)
        assert e.evidence == "saturated"
        assert t == 0.0 or 3.5 * G <= e.available_bps <= 4.5 * G, (t, e.available_bps)
    assert est.update(6.0, 20 * G, 50e6, 25.0, 10.0).available_bps == 20 * G  # older than 2 s: forgotten


def test_a_lone_saturated_poll_far_below_the_estimate_only_halves_it_and_a_second_confirms() -> None:
    """Recorded on the case study (seed 1, 30.5 s, before the dip): one saturated poll of 0.23 Gbps against
    ~81 true, the estimate at 74 Gbps; nothing else saturated within 2 s. It used to set the estimate to
    0.23 (the law then raised t to 62K and PD-P queued). Now it halves it; a real dip repeats at the next
    poll, and then the estimate follows."""
    est = BandwidthEstimator(100 * G)
    est.update(0.0, 74 * G, 50e6, 10.4, 10.2)  # headroom: 74 Gbps without a queue (the estimate stays nominal)
    lone = est.update(5.0, 0.23 * G, 56e6, 15.8, 10.4)
    assert lone.evidence == "saturated" and lone.available_bps == pytest.approx(50 * G)
    assert est.update(10.0, 70 * G, 50e6, 10.4, 10.2).available_bps >= 70 * G  # headroom again: no harm done
    dip = BandwidthEstimator(100 * G)
    dip.update(0.0, 74 * G, 50e6, 10.4, 10.2)
    first, second = dip.update(5.0, 6 * G, 50e6, 25.0, 10.2), dip.update(5.5, 6 * G, 50e6, 25.0, 10.2)
    assert first.available_bps == pytest.approx(50 * G) and second.available_bps == pytest.approx(6 * G)


def test_a_probe_held_back_by_a_small_window_after_a_dip_is_a_lower_bound_not_a_second_dip() -> None:
    """Case study, seed 3, 4 s after the dip: the PrfaaS connections' windows were still small from the dip's
    losses (cwnd 120-208 packets), and a probe of 140 MB got 4.2 Gbps at an RTT of 11.85 ms against 11.9
    unloaded, on a path with 84 Gbps left. Its bytes are 22 x its rate x RTT, so the size rule alone read it
    as filling the path and halved the estimate (12.7 -> 6.3 Gbps); no queue stood, so it is a lower bound.
    The same probe with a standing queue under it is a dip, as before."""
    def after_dip() -> BandwidthEstimator:
        est = BandwidthEstimator(100 * G)
        for t in (66.0, 67.0):  # two probes before the dip: their pings (11.9 ms) are the floor until 77 s
            est.probe(t, 625e6, 80 * G, 11.9, 11.9, 9.0)
        for i, t in enumerate((70.0, 70.5, 71.0)):
            est.update(t, (12.0 + 0.7 * i) * G, 50e6, 20.0, 9.0)  # the dip: saturated polls, ~12.7 Gbps
        for t in (71.5, 72.0, 72.5, 73.0):
            est.update(t, 0.0, 0.0, 0.0, 9.0)  # KV drained: the estimate holds
        return est
    est = after_dip()
    before = est.estimate.available_bps
    assert before == pytest.approx(12.7 * G, rel=0.01) and est.estimate.rtt_floor_ms == pytest.approx(11.9)
    small_window = est.probe(74.0, 140e6, 4.24 * G, 11.85, 11.9, 9.0)
    assert small_window.evidence == "headroom" and small_window.available_bps == before
    est = after_dip()
    queued = est.probe(74.0, 140e6, 4.24 * G, 11.9 + 8.0, 11.9, 9.0)  # the same burst, 8 ms of queue under it
    assert queued.evidence == "saturated" and queued.available_bps == pytest.approx(before / 2)


def test_one_probe_after_a_long_busy_stretch_does_not_raise_the_floor_alone() -> None:
    """Case study, seed 2: KV kept the senders busy for longer than `rtt_window` with no probe, then one probe's
    pings, slowed by the busy host, read 21.7 ms on a 10.3-ms path, 2 s before the dip. Counted alone it set
    the floor to 21.7 ms for 10 s, the dip's RTTs of 14-30 ms read as headroom, and the dip was found after
    11.6 s. The probe before it (pings 11.1 ms, 30 s earlier) still counts against it: the floor stays the
    path's, and the dip's second and third polls (queued) find it. A second probe whose pings agree does
    move the floor, for the polls after it (`test_an_rtt_step_...`)."""
    est = BandwidthEstimator(100 * G)
    est.probe(4.0, 625e6, 90 * G, 13.9, 11.1, 10.3)
    for i in range(60):  # 30 s of KV: backlogged, no queue, no probe
        est.update(5.0 + 0.5 * i, 40 * G, 50e6, 10.8, 10.3)
    est.probe(34.9, 408e6, 27.9 * G, 16.4, 21.7, 10.3)
    dip = [est.update(37.0 + 0.6 * i, x, 267e6, r, 10.3) for i, (x, r) in enumerate(((3.3 * G, 14.4), (13.3 * G, 29.9),
                                                                                      (14.4 * G, 23.2)))]
    # 14.4 ms is 3.3 ms over the floor, under the 40% threshold; the two polls after it queue 12-19 ms
    assert [e.evidence for e in dip] == ["headroom", "saturated", "saturated"]
    assert all(e.rtt_floor_ms == pytest.approx(11.1) for e in dip)  # the smaller of the two probes' pings
    assert dip[2].available_bps == pytest.approx(13.85 * G)
    # a second probe whose pings agree (and, as a probe is judged on the floor before it, finds this one's
    # queue) moves the floor for the polls after it: that is how an RTT surge is learnt
    confirm = est.probe(40.0, 100e6, 12 * G, 22.5, 21.9, 10.3)
    assert confirm.evidence == "saturated" and confirm.rtt_floor_ms == pytest.approx(11.1)
    assert est.update(40.5, 12 * G, 267e6, 22.5, 10.3).rtt_floor_ms == pytest.approx(21.7)


def test_one_clean_poll_alone_in_the_rtt_window_does_not_become_the_floor() -> None:
    """val-thin-line seed 3 (2026-12-04): KV kept the senders queued for 10 s but for one poll whose small
    backlog (3.7 MB) passed as clean while its RTT (19.2 ms) still carried a queue (the kernel's minimum: 9.0 ms).
    Once the clean polls before it left the window it was the window's minimum alone: the floor rose to 19.2 ms,
    a 5x dip's 21-ms RTTs read as headroom, and the dip was found after 3.9 s instead of 0.9 s. A windowed
    minimum counts over `rtt_window_polls` (2) clean polls, as one probe's pings alone set nothing."""

    def run(spec: EstimatorSpec) -> list:
        est = BandwidthEstimator(10 * G, spec)
        for i in range(25):  # 0-12 s: transfers with gaps, clean polls at the path's delay
            est.update(0.5 * i, 8 * G, 1e6, 10.1, 9.0)
        for i in range(26):  # 12.5-25 s: queued KV, one clean poll (18 s) still carrying a queue
            t = 12.5 + 0.5 * i
            est.update(t, 8 * G, 3.7e6 if t == 18.0 else 200e6, 19.2 if t == 18.0 else 16.0, 9.0)
        return [est.update(25.5 + 0.5 * i, 1 * G, 300e6, 21.0, 9.0) for i in range(4)]  # a 5x dip

    dip = run(EstimatorSpec())
    assert all(e.rtt_floor_ms == pytest.approx(9.0) for e in dip)  # one clean poll in the window: the kernel's
    assert [e.evidence for e in dip] == ["saturated"] * 4 and dip[1].available_bps < 0.5 * 8 * G
    old = run(EstimatorSpec(rtt_window_polls=1))  # the rule before: the lone poll is the floor
    assert all(e.rtt_floor_ms == pytest.approx(19.2) and e.evidence == "headroom" for e in old)


def test_a_lone_filled_probe_held_at_half_asks_for_a_confirming_probe_at_once() -> None:
    """A 5x dip met by one filled probe: the lone bound may only halve the estimate (exactly the detection
    bar), so the policy asks for the next probe at the next look instead of after `probe_after`; the second
    bound settles the dip. With `probe_confirm: false` (the rule before 2026-12-04) it waits `probe_after`."""
    def probe(pol, t: float, rate_bps: float) -> None:
        pol.on_telemetry(TelemetrySample(t, probe_bytes=500e6, probe_rate_bps=rate_bps, probe_rtt_ms=20.0, idle_rtt_ms=10.5,
                                         min_rtt_ms=10.0))

    for confirm in (True, False):
        pol = observed_policy(estimator={"probe_confirm": confirm})
        est = pol.controller.estimator
        probe(pol, 1.0, 19 * G)  # the line as it was: 19 of the nominal 20 left
        probe(pol, 10.0, 19 * G)
        assert est.estimate.available_bps == pytest.approx(19 * G) and not est.unconfirmed
        assert pol.probe_bytes(10.5) == 0.0  # fresh evidence, nothing to confirm: wait probe_after
        probe(pol, 13.0, 4 * G)  # the dip: a filled probe at a fifth
        assert est.estimate.available_bps == pytest.approx(9.5 * G) and est.unconfirmed
        asked = pol.probe_bytes(13.5)
        assert (asked > 0) is confirm
        if confirm:
            assert asked == pytest.approx(est.probe_bytes())  # sized at twice the halved estimate
            probe(pol, 13.5, 4 * G)
            assert est.estimate.available_bps == pytest.approx(4 * G) and not est.unconfirmed  # two bounds: the mean
            assert pol.probe_bytes(14.0) == 0.0
        else:
            assert pol.probe_bytes(14.0) > 0  # probe_after (1 s) since the last probe


def test_a_lone_saturated_poll_asks_for_the_next_poll_sooner_once() -> None:
    """`poll_confirm`: KV queued behind a 5x dip gives one saturated poll, which alone may only halve the
    estimate; the policy asks the router for its next poll after `poll_confirm` instead of its period, once
    for that bound; the second saturated poll settles the dip and asks nothing. Off (0, the default): never."""
    def poll(pol, t: float, rate_bps: float, rtt_ms: float) -> None:
        pol.on_telemetry(TelemetrySample(t, kv_goodput_bps=rate_bps, kv_path_rate_bps=rate_bps, send_queue_bytes=50e6,
                                         inflight_bytes=10e6, rtt_ms=rtt_ms, min_rtt_ms=10.0))

    for wait in ("0.1s", "0s"):
        pol = observed_policy(estimator={"poll_confirm": wait})
        est = pol.controller.estimator
        poll(pol, 1.0, 19 * G, 16.0)  # the line as it was, saturated: 19 of the nominal 20
        poll(pol, 3.6, 19 * G, 16.0)
        assert est.estimate.available_bps == pytest.approx(19 * G) and pol.confirm_poll_s() == 0.0
        poll(pol, 6.2, 4 * G, 40.0)  # the dip: alone, held at half
        assert est.estimate.available_bps == pytest.approx(9.5 * G) and est.unconfirmed
        assert pol.confirm_poll_s() == (0.1 if wait == "0.1s" else 0.0)
        assert pol.confirm_poll_s() == 0.0  # once per bound
        poll(pol, 6.35, 4 * G, 40.0)
        assert est.estimate.available_bps == pytest.approx(4 * G) and not est.unconfirmed  # two bounds: the mean
        assert pol.confirm_poll_s() == 0.0
    assert EstimatorSpec().poll_confirm_s == 0.0
    with pytest.raises(FieldError, match="poll_confirm"):
        parse_policy_section(Fields({"name": "prfaas", "estimator": {"poll_confirm": "-1s"}}, "policy"))

def test_the_polled_floors_poll_count_is_a_count_from_1_to_10000() -> None:
    """0 and a 20-digit count were taken (session 65's fuzzing pass)."""
    for bad, says in ((0, "0 is not a whole number >= 1"), (10**20, "is more than 10000, more polls than a window holds")):
        with pytest.raises(FieldError, match=says):
            parse_policy_section(Fields({"name": "prfaas", "estimator": {"rtt_window_polls": bad}}, "policy"))
    assert parse_policy_section(Fields({"name": "prfaas", "estimator": {"rtt_window_polls": 3}}, "policy")).estimator.rtt_window_polls == 3


def test_a_bound_that_does_not_reach_the_lone_cap_needs_no_confirmation() -> None:
    """A filled probe a little below the estimate lowers it all the way (within `lone_drop_fraction`): nothing
    is held back, so nothing asks for a second probe; neither does a probe that read more than the estimate."""
    est = BandwidthEstimator(100 * G)
    est.probe(1.0, 700e6, 84 * G, 16.0, 10.5, 10.0)
    assert est.estimate.available_bps == pytest.approx(84 * G) and not est.unconfirmed
    est.probe(4.0, 700e6, 30 * G, 16.0, 10.5, 10.0)  # a lone bound below half of 84: held at 42
    assert est.estimate.available_bps == pytest.approx(42 * G) and est.unconfirmed
    est.probe(4.5, 700e6, 80 * G, 16.0, 10.5, 10.0)  # the next one read more: the path has it
    assert not est.unconfirmed


def test_the_probe_settings_are_parsed_and_a_bad_one_is_named() -> None:
    spec = parse_policy_section(Fields({"name": "prfaas", "estimator": {"probe_until_filled": False, "probe_confirm": False,
                                                                        "probe_paced": False}}, "policy"))
    assert spec.estimator.probe_until_filled is False and spec.estimator.probe_confirm is False and spec.estimator.probe_paced is False
    assert EstimatorSpec().probe_until_filled and EstimatorSpec().probe_confirm and EstimatorSpec().probe_paced is None  # auto
    for v, want in (("auto", None), (True, True)):
        assert parse_policy_section(Fields({"name": "prfaas", "estimator": {"probe_paced": v}}, "policy")).estimator.probe_paced is want
    with pytest.raises(FieldError, match=r"policy\.estimator\.probe_paced.*true, false or auto"):
        parse_policy_section(Fields({"name": "prfaas", "estimator": {"probe_paced": "yes"}}, "policy"))
    stop = EstimatorSpec().fill_stop()  # the estimator's own test of a filled probe, sent with every probe
    assert stop is not None and (stop.queue_ms, stop.queue_fraction, stop.path_ratio) == (2.0, 0.4, 3.0)
    assert EstimatorSpec(probe_until_filled=False).fill_stop() is None
    assert EstimatorSpec(queue_delay_ms=0.0).fill_stop() is None  # no standing queue ever: no probe fills the path
    with pytest.raises(Exception, match=r"policy\.estimator\.probe_until_filled"):
        parse_policy_section(Fields({"name": "prfaas", "estimator": {"probe_until_filled": "sometimes"}}, "policy"))


def test_a_probe_is_paced_at_twice_the_estimate_past_the_nominal_rate_and_unpaced_when_told() -> None:
    """The pace is `probe_headroom` x the estimate and is not capped at the nominal rate as the probe's size is:
    at the nominal estimate a probe paced at the nominal rate would build a queue on a line with 84 of 100
    left only at 16% of its rate and end before it stood (docs/router.md, "An active probe", "A paced probe")."""
    est = BandwidthEstimator(100 * G)
    assert est.probe_pace_bps() == pytest.approx(200 * G)  # the probe's size is 5 BDPs at 100, its pace 200
    est.probe(1.0, 700e6, 21 * G, 16.0, 10.5, 10.0)  # a lone bound: held at half
    est.probe(1.5, 700e6, 21 * G, 16.0, 10.5, 10.0)  # confirmed
    assert est.estimate.available_bps == pytest.approx(21 * G) and est.probe_pace_bps() == pytest.approx(42 * G)
    assert BandwidthEstimator(100 * G, EstimatorSpec(probe_paced=False)).probe_pace_bps() == 0.0
    pol = observed_policy()
    assert pol.probe_pace_bps() == pytest.approx(40 * G)  # twice the nominal 20 Gbps before any measurement
