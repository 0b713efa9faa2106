"""Policies: selective offload on the uncached length, cache-aware cluster choice, control of t, baselines."""

from __future__ import annotations

import math

import pytest

from testbed import clock
from testbed.errors import FieldError
from testbed.kv.pool import chain_block_hashes
from testbed.validation import Fields
from testbed.serving.kvmanager import KVManager
from testbed.serving.policy import (
    ClusterState, InstanceState, NoInstanceError, PolicySpec, RequestView, SchedulerLog, TelemetrySample,
    build_policy, parse_policy_section,
)

B = 512
K = 1024
CAP = 100e9
PREFILL = (InstanceState(0, "prfaas", "10.1.0.1"), InstanceState(1, "prfaas", "10.1.0.2"),
           InstanceState(2, "pd", "10.2.0.1"), InstanceState(3, "pd", "10.2.0.2"))
DECODE = (InstanceState(10, "pd", "10.2.0.11"), InstanceState(11, "pd", "10.2.0.12"))


def spec(**kw: object) -> PolicySpec:
    return parse_policy_section(Fields(kw, "policy"))


def make(name: str = "prfaas", prefill=PREFILL, decode=DECODE, standby=(), signals: str = "oracle", **kw: object):
    """Most law tests drive the oracle variant (they push the WAN's capacity); observed mode: test_signals.py."""
    return build_policy(spec(name=name, signals=signals, **kw), prefill, decode, log=SchedulerLog(), capacity_bps=CAP, standby=standby)


def state(kv: KVManager | None = None, hashes=(), input_len: int = 1, prefill=PREFILL, decode=DECODE, now: float | None = None) -> ClusterState:
    kv = kv or KVManager({p.instance: p.cluster for p in PREFILL})
    return ClusterState(clock.now_s() if now is None else now, prefill, decode, kv.match(list(hashes), input_len))


def req(n: int, rid: str = "r") -> RequestView:
    return RequestView(rid, n, 16, 0.0)


# ------------------------------------------------------------------------------ selective offload


@pytest.mark.parametrize("name", ["prfaas", "fixed-threshold"])
def test_uncached_length_above_t_goes_to_prfaas_and_at_or_below_to_pd_p(name: str) -> None:
    pol = make(name, threshold="8K")
    long_ = pol.decide(req(8 * K + 1), state(input_len=8 * K + 1))
    short = pol.decide(req(8 * K), state(input_len=8 * K))
    assert (long_.route, long_.uncached_len, long_.threshold) == ("prfaas", 8 * K + 1, 8 * K)
    assert long_.prefill_instance in (0, 1)
    assert (short.route, short.uncached_len) == ("pd", 8 * K)
    assert short.prefill_instance in (2, 3)
    assert long_.decode_instance in (10, 11)


def test_a_pd_prefix_hit_reduces_the_uncached_length_below_t_and_keeps_the_request_local() -> None:
    kv = KVManager({p.instance: p.cluster for p in PREFILL})
    hashes = list(range(1, 41))  # 40 blocks = 20K tokens
    kv.replace_instance(3, chain_block_hashes(hashes[:30]))  # 15K cached on PD-P instance 3
    pol = make(threshold="8K")
    d = pol.decide(req(40 * B), state(kv, hashes, 40 * B))
    assert (d.route, d.prefill_instance, d.cached_len, d.uncached_len) == ("pd", 3, 30 * B, 10 * B - 0)
    # without the hit the same request is offloaded
    miss = pol.decide(req(40 * B), state(None, hashes, 40 * B))
    assert (miss.route, miss.cached_len, miss.uncached_len) == ("prfaas", 0, 40 * B)


def test_an_offloaded_request_reuses_the_prfaas_prefix_on_the_holding_instance() -> None:
    kv = KVManager({p.instance: p.cluster for p in PREFILL})
    hashes = list(range(100, 180))  # 40K tokens
    kv.replace_instance(1, chain_block_hashes(hashes[:20]))
    d = make(threshold="8K").decide(req(80 * B), state(kv, hashes, 80 * B))
    assert (d.route, d.prefill_instance, d.cached_len, d.uncached_len) == ("prfaas", 1, 20 * B, 60 * B)


def test_a_busy_cache_holder_is_skipped_for_the_least_loaded_instance() -> None:
    kv = KVManager({p.instance: p.cluster for p in PREFILL})
    hashes = list(range(1, 41))
    kv.replace_instance(0, chain_block_hashes(hashes[:4]))
    busy = (InstanceState(0, "prfaas", queue_depth=5), InstanceState(1, "prfaas", queue_depth=0)) + PREFILL[2:]
    d = make(threshold="8K", cache_affinity_slack=2).decide(req(40 * B), state(kv, hashes, 40 * B, prefill=busy))
    assert (d.prefill_instance, d.cached_len) == (1, 0)


@pytest.mark.parametrize("name", ["prfaas", "fixed-threshold", "homogeneous-pd"])
def test_prefill_pick_tokens_avoids_the_instance_with_a_long_prompt_queued(name: str) -> None:
    """Two requests each in flight on both PrfaaS and both PD-P instances: the count ties (the lower id
    wins), but instance 0 and 2 hold a 120K-token prompt each, so `prefill_pick: tokens` takes 1 and 3."""
    loaded = (InstanceState(0, "prfaas", queue_depth=2, tokens_in_flight=120 * K + 900),
              InstanceState(1, "prfaas", queue_depth=2, tokens_in_flight=30 * K),
              InstanceState(2, "pd", queue_depth=2, tokens_in_flight=120 * K),
              InstanceState(3, "pd", queue_depth=2, tokens_in_flight=2 * K))
    for pick, want in (("requests", {0, 2}), ("tokens", {1, 3})):
        pol = make(name, threshold="8K", prefill_pick=pick)
        for n in (40 * K, 2 * K):
            d = pol.decide(req(n), state(input_len=n, prefill=loaded))
            assert d.prefill_instance in want, (pick, n, d)
    with pytest.raises(FieldError, match="prefill_pick"):
        spec(prefill_pick="work")


def test_with_prefill_pick_tokens_a_prefix_holder_keeps_the_request_only_while_the_hit_outweighs_its_queue() -> None:
    """Instance 0 holds 4 blocks of the prompt and has one 120K-token prefill in flight; instance 1 is idle.
    Counting requests (slack 2) the holder keeps it; counting tokens it does only when the hit saves more
    tokens than it has queued beyond the idle instance."""
    kv = KVManager({p.instance: p.cluster for p in PREFILL})
    hashes = list(range(1, 41))
    kv.replace_instance(0, chain_block_hashes(hashes[:4]))
    for queued, pick, want in ((120 * K, "requests", (0, 4 * B)), (120 * K, "tokens", (1, 0)),
                               (4 * B, "tokens", (0, 4 * B)), (4 * B + 1, "tokens", (1, 0))):
        busy = (InstanceState(0, "prfaas", queue_depth=1, tokens_in_flight=queued), InstanceState(1, "prfaas")) + PREFILL[2:]
        d = make(threshold="8K", prefill_pick=pick).decide(req(40 * B), state(kv, hashes, 40 * B, prefill=busy))
        assert (d.prefill_instance, d.cached_len) == want, (queued, pick)


def test_bandwidth_scarce_decides_per_cluster_and_abundant_uses_the_longest_prefix_anywhere() -> None:
    kv = KVManager({p.instance: p.cluster for p in PREFILL})
    hashes = list(range(1, 41))  # 20K tokens
    kv.replace_instance(0, chain_block_hashes(hashes[:36]))  # 18K cached in PrfaaS only
    pol = make(threshold="8K", cross_cluster_cache=True, abundant_below=0.5)
    now = clock.now_s()
    pol.on_telemetry(TelemetrySample(now, egress_bps=0.1 * CAP, capacity_bps=CAP))
    abundant = pol.decide(req(40 * B), state(kv, hashes, 40 * B, now=now))
    assert not abundant.bandwidth_scarce
    assert (abundant.route, abundant.cached_len, abundant.uncached_len, abundant.cache_transfer_tokens) == ("pd", 36 * B, 4 * B, 36 * B)
    pol.on_telemetry(TelemetrySample(now + 5, egress_bps=0.8 * CAP, capacity_bps=CAP))
    scarce = pol.decide(req(40 * B), state(kv, hashes, 40 * B, now=now + 5))
    assert scarce.bandwidth_scarce
    assert (scarce.route, scarce.cached_len, scarce.uncached_len, scarce.cache_transfer_tokens) == ("prfaas", 36 * B, 4 * B, 0)


def test_no_healthy_prfaas_instance_falls_back_to_pd_and_no_decode_instance_is_an_error() -> None:
    sick = (InstanceState(0, "prfaas", healthy=False), InstanceState(1, "prfaas", healthy=False)) + PREFILL[2:]
    d = make(threshold="8K").decide(req(64 * K), state(input_len=64 * K, prefill=sick))
    assert d.route == "pd" and "fallback" in d.reason
    with pytest.raises(NoInstanceError, match="decode"):
        make().decide(req(100), state(input_len=100, decode=(InstanceState(10, "pd", healthy=False),)))


# ---------------------------------------------------------------------------------- control of t


SATURATED = 2.0  # seconds of the line's rate committed (queued and in flight) while the line is saturated


def drive(pol, t0: float, seconds: float, util: float, step: float = 0.1, committed_s: float | None = None,
          **extra: float) -> None:
    """`util` of the line for `seconds`; KV committed (bytes the senders hold) `committed_s` x the line rate,
    by default SATURATED seconds' worth at util >= 1 (beyond the 1 s prefill prior: the harm that lets the
    law step t before it has a demand model) and none below."""
    if committed_s is None:
        committed_s = SATURATED if util >= 1.0 else 0.0
    t = t0
    while t < t0 + seconds - 1e-9:
        t += step
        pol.on_telemetry(TelemetrySample(t, egress_bps=util * CAP, capacity_bps=CAP,
                                         send_queue_bytes=committed_s * CAP / 8, **extra))
        pol.tick(t)


def test_t_rises_within_two_seconds_when_the_line_saturates_and_committed_kv_backs_up() -> None:
    pol = make(threshold="8K")
    t0 = clock.now_s()
    drive(pol, t0, 5.0, 0.3)
    assert pol.threshold == 8 * K
    drive(pol, t0 + 5.0, 2.0, 1.0)
    assert pol.threshold >= 1.5 * 8 * K
    first = pol.log.rows("threshold")[0]
    assert first["t_s"] - (t0 + 5.0) <= 2.0 and "committed KV" in first["reason"] and first["old_threshold"] == 8 * K


def test_without_a_demand_model_a_full_line_whose_kv_drains_within_a_prefill_is_no_reason_to_step_t() -> None:
    """val-thin-line (sessions 30-31): one offload's burst fills a 10 Gbps line, overflows its queue and,
    in observed mode, reads as utilisation ~1 against an estimate made from that same burst. Steps on that
    took t to all-local within 5 s of the start in 2 of 5 seeds; nothing committed was waiting."""
    pol = make(threshold="8K")
    t0 = clock.now_s()
    drive(pol, t0, 3.0, 1.0, committed_s=0.5, drops=0.0)  # half a second of KV committed: drains within the 1 s prior
    assert pol.egress_utilization > 0.9 and pol.threshold == 8 * K and pol.log.rows("threshold") == []
    drive(pol, t0 + 3.0, 0.3, 1.0, committed_s=1.5)  # now it will not: a blind step
    assert pol.threshold == 12 * K and "committed KV 0.5s beyond" in pol.log.rows("threshold")[0]["reason"]


def test_raises_are_rate_limited_to_one_per_raise_interval() -> None:
    pol = make(threshold="8K", control={"raise_interval": "0.5s", "raise_factor": 2})
    t0 = clock.now_s()
    pol.on_telemetry(TelemetrySample(t0, egress_bps=CAP, capacity_bps=CAP, send_queue_bytes=SATURATED * CAP / 8))
    for i in range(5):  # five ticks within 0.4 s
        pol.tick(t0 + 0.1 * i)
    assert pol.threshold == 16 * K and len(pol.log.rows("threshold")) == 1


def test_losses_on_a_busy_line_refit_t_with_a_demand_model_and_never_step_it_blind() -> None:
    """Retransmits at utilisation 0.7 (inside the hysteresis band): before a demand model exists they are
    no reason for a blind x1.5 step (val-thin-line: one offload's burst overflows a 10 Gbps line's queue,
    and such steps took t to all-local in 3 s); with a model they re-run the fit, which raises t only as
    far as the predicted demand needs."""
    pol = make(threshold="8K", kv_bytes_per_token="1MB", control={"congestion_events_per_s": 100})
    t0, n = clock.now_s(), 0

    def lossy(start: float, ticks: int, cap: float) -> None:
        nonlocal n
        for i in range(1, ticks + 1):  # 50 retransmits per 0.1 s = 500/s
            n += 1
            pol.on_telemetry(TelemetrySample(start + 0.1 * i, egress_bps=0.7 * cap, capacity_bps=cap, retransmits=50.0 * n))
            pol.tick(start + 0.1 * i)

    lossy(t0, 30, CAP)
    assert pol.congestion_events_per_s > 400 and pol.egress_utilization > 0.6
    assert pol.threshold == 8 * K and pol.log.rows("threshold") == []  # no model: no blind step on losses
    for i, l in enumerate([2 * K, 4 * K, 8 * K, 16 * K, 32 * K] * 8):  # 40 arrivals over 10 s
        pol.decide(req(l, f"r{i}"), state(input_len=l, now=t0 + 3 + 0.25 * i))
    now = t0 + 13
    demand = pol.controller.predicted_demand_bps(8 * K, now)
    cap = demand / 0.85  # the demand at t is 0.85 x the capacity: above the 0.8 target, below the 0.9 trigger
    lossy(now, 5, cap)
    assert pol.threshold == 16 * K  # dropping the 16K arrivals brings the demand to 0.85 x 32/48 < 0.8
    assert "congestion" in pol.log.rows("threshold")[0]["reason"] and "fits" in pol.log.rows("threshold")[0]["reason"]


def test_losses_of_a_lone_transfer_on_a_mostly_idle_link_do_not_raise_t() -> None:
    """TCP fills a drop-tail queue and loses packets even when the link is idle on average."""
    pol = make(threshold="8K", control={"congestion_events_per_s": 100})
    t0 = clock.now_s()
    for i in range(1, 31):
        t = t0 + 0.1 * i
        pol.on_telemetry(TelemetrySample(t, egress_bps=0.2 * CAP, capacity_bps=CAP, drops=100.0 * i))  # 1000/s
        pol.tick(t)
    assert pol.congestion_events_per_s > 500 and pol.threshold == 8 * K


def test_t_rises_when_the_prfaas_queue_surges() -> None:
    pol = make(threshold="8K", control={"queue_high": 4})
    t0 = clock.now_s()
    pol.on_telemetry(TelemetrySample(t0, prfaas_queue_per_instance=6.0))
    pol.tick(t0)
    assert pol.threshold == 12 * K and "queue" in pol.log.rows("threshold")[0]["reason"]


def test_t_falls_back_to_base_only_after_a_calm_hold_and_not_inside_the_hysteresis_band() -> None:
    pol = make(threshold="8K", control={"hold": "3s", "high_utilization": 0.9, "low_utilization": 0.6})
    t0 = clock.now_s()
    drive(pol, t0, 2.0, 1.0)
    drive(pol, t0 + 2.0, 2.0, 0.75)  # the utilisation EWMA (tau 0.5 s) settles into the band
    raised = pol.threshold
    assert raised > 8 * K
    drive(pol, t0 + 4.0, 8.0, 0.75)  # inside the band: hold t
    assert pol.threshold == raised
    drive(pol, t0 + 12.0, 2.0, 0.1)  # calm, but shorter than the hold (the EWMA needs ~1 s to drop too)
    assert pol.threshold == raised
    drive(pol, t0 + 14.0, 60.0, 0.1)
    assert pol.threshold == 8 * K  # back to base, never below it
    lowers = [r for r in pol.log.rows("threshold") if r["reason"].startswith("lower")]
    assert len(lowers) >= 2 and all(b["t_s"] - a["t_s"] >= 3.0 - 1e-9 for a, b in zip(lowers, lowers[1:]))
    assert min(r["threshold"] for r in pol.log.rows("threshold")) == 8 * K


def test_the_re_search_jumps_t_to_the_smallest_value_whose_predicted_demand_fits() -> None:
    pol = make(threshold="1K", min_threshold="1K", kv_bytes_per_token="1MB", control={"min_samples": 10, "target_utilization": 0.8})
    t0 = clock.now_s()
    lengths = [2 * K, 4 * K, 8 * K, 16 * K, 32 * K] * 2  # one arrival per second for 10 s
    for i, n in enumerate(lengths):
        pol.decide(req(n, f"r{i}"), state(input_len=n, now=t0 + i))
    now = t0 + 10
    span = now - t0
    demand = lambda t: sum(n * 1e6 * 8 for n in lengths if n > t) / span  # noqa: E731
    fit = pol.controller.fit_threshold(0.8 * demand(0), now)
    assert fit == 8 * K  # keeping the 2K, 4K and 8K requests local is just enough
    assert demand(fit) <= 0.8 * demand(0) < demand(4 * K)
    pol.controller.capacity_bps = demand(0) / 2.0  # a dip: target 40% of the demand
    pol.on_telemetry(TelemetrySample(now, egress_bps=pol.controller.capacity_bps))
    pol.tick(now)
    assert pol.threshold == pol.controller.fit_threshold(0.8 * pol.controller.capacity_bps, now) == 32 * K  # 64/124 of demand > 40%


# ------------------------------------------------------------------------------------- baselines


def test_fixed_threshold_never_moves_t_under_pressure() -> None:
    pol = make("fixed-threshold", threshold="8K")
    drive(pol, clock.now_s(), 5.0, 1.0)
    assert pol.threshold == 8 * K and pol.log.rows("threshold") == []


def test_oracle_step_switches_t_with_the_shaper_rate_and_back_and_logs_each_switch() -> None:
    pol = make("oracle-step", threshold="16K", event_threshold="48K")
    t0 = clock.now_s()
    at = lambda n: pol.decide(req(n), state(input_len=n)).route  # noqa: E731
    pol.on_telemetry(TelemetrySample(t0, capacity_bps=CAP, egress_bps=0.5 * CAP))
    assert pol.threshold == 16 * K and at(32 * K) == "prfaas"
    pol.on_telemetry(TelemetrySample(t0 + 1, retransmits=5.0))  # no rate in the sample: t holds
    pol.on_telemetry(TelemetrySample(t0 + 2, capacity_bps=0.2 * CAP))
    assert pol.threshold == 48 * K and at(32 * K) == "pd" and at(48 * K + 1) == "prfaas"
    pol.on_telemetry(TelemetrySample(t0 + 3, capacity_bps=0.995 * CAP))  # the shaper's rounding of the line's rate
    assert pol.threshold == 16 * K
    rows = pol.log.rows("threshold")
    assert [(r["old_threshold"], r["threshold"]) for r in rows] == [(16 * K, 48 * K), (48 * K, 16 * K)]
    assert "oracle-step: shaper rate 20 Gbps < line rate 100 Gbps" in rows[0]["reason"]


def test_oracle_step_sees_no_rate_outside_oracle_mode_and_refuses_to_run_there() -> None:
    with pytest.raises(FieldError) as err:
        spec(name="oracle-step", signals="observed", event_threshold="48K")
    assert err.value.field == "policy.signals" and "oracle" in str(err.value)
    with pytest.raises(FieldError) as err:
        spec(name="oracle-step", signals="oracle")
    assert err.value.field == "policy.event_threshold" and "required" in str(err.value)
    with pytest.raises(FieldError) as err:
        spec(name="fixed-threshold", event_threshold="48K")
    assert err.value.field == "policy.event_threshold" and "oracle-step" in str(err.value)
    with pytest.raises(FieldError) as err:
        spec(name="oracle-step", signals="oracle", event_threshold="512")
    assert err.value.field == "policy.event_threshold"
    s = spec(name="oracle-step", signals="oracle", threshold="16K", event_threshold="32K")
    assert parse_policy_section(Fields(s.to_mapping(), "policy")) == s and s.event_threshold_tokens == 32 * K


def test_natives_first_puts_what_a_raise_moved_to_pd_p_behind_what_the_base_threshold_keeps_there() -> None:
    for queue, moved_priority in (("natives-first", 1), ("fcfs", 0)):
        pol = make("oracle-step", threshold="16K", event_threshold="48K", pd_queue=queue)
        pol.on_telemetry(TelemetrySample(clock.now_s(), capacity_bps=0.2 * CAP))  # the dip: t = 48K
        native, moved, offloaded = (pol.decide(req(n), state(input_len=n)) for n in (8 * K, 32 * K, 64 * K))
        assert [d.route for d in (native, moved, offloaded)] == ["pd", "pd", "prfaas"]
        assert (native.priority, moved.priority, offloaded.priority) == (0, moved_priority, 0)
        rows = pol.log.rows("decision")
        assert [r["priority"] for r in rows] == [0, moved_priority, 0] and "above the base t=16384" in rows[1]["reason"]
    d = make("fixed-threshold", threshold="16K", pd_queue="natives-first").decide(req(8 * K), state(input_len=8 * K))
    assert (d.route, d.priority) == ("pd", 0)
    with pytest.raises(FieldError) as err:
        spec(pd_queue="sjf")
    assert err.value.field == "policy.pd_queue" and "natives-first" in str(err.value)
    s = spec(pd_queue="natives-first")
    assert parse_policy_section(Fields(s.to_mapping(), "policy")) == s


def test_homogeneous_pd_and_all_local_never_offload_and_naive_heterogeneous_always_does() -> None:
    for name in ("homogeneous-pd", "all-local"):
        d = make(name).decide(req(128 * K), state(input_len=128 * K))
        assert (d.route, d.threshold) == ("pd", math.inf) and d.prefill_instance in (2, 3)
    d = make("naive-heterogeneous").decide(req(100), state(input_len=100))
    assert (d.route, d.threshold) == ("prfaas", 0.0) and d.prefill_instance in (0, 1)


def test_homogeneous_pd_fails_rather_than_use_prfaas_when_pd_p_is_down() -> None:
    sick = PREFILL[:2] + (InstanceState(2, "pd", healthy=False), InstanceState(3, "pd", healthy=False))
    with pytest.raises(NoInstanceError):
        make("homogeneous-pd").decide(req(100), state(input_len=100, prefill=sick))


# ------------------------------------------------------------------------------------ role flips


def test_a_pd_host_flips_from_decode_to_prefill_when_prefill_is_the_bottleneck() -> None:
    prefill = PREFILL[:2] + (InstanceState(2, "pd", "10.2.0.1"), InstanceState(3, "pd", "10.2.0.11"))
    pol = make(prefill=prefill, standby=[("prefill", 3)], role_flip={"enabled": True, "period": "10s", "prefill_queue_high": 4})
    assert ("prefill", 3) not in pol.active
    t0 = clock.now_s()
    pol.on_telemetry(TelemetrySample(t0, pdp_queue_per_instance=8.0, decode_queue_per_instance=2.0))
    pol.tick(t0 + 11)
    assert ("prefill", 3) in pol.active and ("decode", 10) not in pol.active
    flip = pol.log.rows("role_flip")
    assert len(flip) == 1 and "10.2.0.11: decode 10 -> prefill 3" in flip[0]["reason"]
    d = pol.decide(req(100), state(input_len=100, prefill=prefill))
    assert d.decode_instance == 11


# ---------------------------------------------------------------------------------- the section


@pytest.mark.parametrize(
    "section, field",
    [
        ({"name": "best-effort"}, "policy.name"),
        ({"threshold": "12 apples"}, "policy.threshold"),
        ({"threshold": "16K", "max_threshold": "8K"}, "policy.threshold"),
        ({"control": {"low_utilization": 0.95}}, "policy.control.low_utilization"),
        ({"control": {"raise_factor": 0.5}}, "policy.control.raise_factor"),
        ({"control": {"hold": 3}}, "policy.control.hold"),
        ({"control": {"speed": 1}}, "policy.control.speed"),
        ({"role_flip": {"enabled": "yes"}}, "policy.role_flip.enabled"),
        ({"estimator": {"probe_headroom": 0.5}}, "policy.estimator.probe_headroom"),
        ({"thresold": "8K"}, "policy.thresold"),
    ],
)
def test_a_bad_policy_section_names_the_field(section: dict, field: str) -> None:
    with pytest.raises(FieldError) as err:
        parse_policy_section(Fields(section, "policy"))
    assert err.value.field == field


def test_the_section_round_trips_through_its_mapping() -> None:
    s = spec(name="prfaas", threshold="16K", control={"hold": "5s", "high_utilization": "95%"}, role_flip={"enabled": True})
    assert parse_policy_section(Fields(s.to_mapping(), "policy")) == s
    assert s.threshold_tokens == 16 * K and s.control.hold_s == 5.0 and s.control.high_utilization == 0.95


def test_the_scheduler_log_frame_holds_decisions_and_threshold_changes_with_times() -> None:
    pol = make(threshold="8K")
    t0 = clock.now_s()
    pol.decide(req(64 * K, "a"), state(input_len=64 * K, now=t0))
    drive(pol, t0, 1.0, 1.0)
    df = pol.log.to_frame()
    assert list(df["kind"]).count("decision") == 1 and (df["kind"] == "threshold").sum() >= 1
    row = df[df["kind"] == "decision"].iloc[0]
    assert (row["request_id"], row["route"], row["uncached_len"]) == ("a", "prfaas", 64 * K)
    assert df["t_s"].is_monotonic_increasing
    control = df[df["kind"] == "control"]
    assert len(control) == 10 and control["egress_utilization"].iloc[-1] > 0.8 and control["threshold"].iloc[-1] == pol.threshold


def test_wan_drops_and_transport_retransmits_add_up_to_congestion() -> None:
    pol = make(threshold="8K", control={"congestion_events_per_s": 200})
    t0 = clock.now_s()
    for i in range(1, 21):  # 120 drops/s from the WAN samples and 120 retransmits/s from the worker polls
        t = t0 + 0.1 * i
        pol.on_telemetry(TelemetrySample(t, egress_bps=CAP, capacity_bps=CAP, drops=12.0 * i,
                                         send_queue_bytes=SATURATED * CAP / 8))
        pol.on_telemetry(TelemetrySample(t + 0.05, retransmits=12.0 * i))
    assert 200 <= pol.congestion_events_per_s <= 260
    pol.tick(t0 + 2.1)
    assert pol.threshold == 12 * K and "congestion" in pol.log.rows("threshold")[0]["reason"]


def test_a_wan_outage_counts_as_saturation_not_as_calm() -> None:
    pol = make(threshold="8K")
    t0 = clock.now_s()
    drive(pol, t0, 2.0, 0.3)
    for i in range(1, 11):  # link down: the run reports capacity 0 and no egress; the KV in flight stays
        pol.on_telemetry(TelemetrySample(t0 + 2 + 0.1 * i, egress_bps=0.0, capacity_bps=0.0, send_queue_bytes=1e6))
        pol.tick(t0 + 2 + 0.1 * i)
    assert pol.threshold > 8 * K and pol.controller.capacity_bps == CAP


def test_with_a_demand_model_t_jumps_to_the_fit_once_and_stays_there_while_the_backlog_drains() -> None:
    """The old law stepped x1.5 beyond the fit when pressure outlasted 2 s (t overshot to 36K-55K in the
    case study and overloaded PD-P); with a demand model t only ever goes to the fitted value."""
    pol = make(threshold="1K", min_threshold="1K", kv_bytes_per_token="1MB", control={"settle": "2s", "raise_interval": "0.5s"})
    t0 = clock.now_s()
    for i, n in enumerate([2 * K, 4 * K, 8 * K, 16 * K, 32 * K] * 8):  # 40 arrivals over the last 10 s
        pol.decide(req(n, f"r{i}"), state(input_len=n, now=t0 + 0.25 * i))
    now = t0 + 10
    pol.controller.capacity_bps = 1e12  # ample capacity: the link is saturated (u = 1) but the demand fits 0.8 x C
    assert pol.controller.fit_threshold(0.8e12, now) == 0.0
    for k in range(20):
        pol.on_telemetry(TelemetrySample(now + 0.1 * k, egress_bps=1e12))
        pol.tick(now + 0.1 * k)
    assert pol.threshold == 1 * K and pol.log.rows("threshold") == []  # nothing to shed: no raise at all
    pol.controller.capacity_bps = 1e11  # a dip: the demand no longer fits 80 Gbps
    fit = pol.controller.fit_threshold(0.8e11, now + 2)
    for k in range(20, 60):  # 4 s of saturation (the transfers admitted before the raise drain)
        pol.on_telemetry(TelemetrySample(now + 0.1 * k, egress_bps=1e11))
        pol.tick(now + 0.1 * k)
    assert fit == 32 * K and pol.threshold == fit and len(pol.log.rows("threshold")) == 1


def test_the_capacity_left_for_kv_is_the_link_minus_the_measured_non_kv_traffic() -> None:
    """12 Gbps of cross traffic on a 20 Gbps line leave 8 Gbps for KV: t is fitted to 0.8 x 8 Gbps."""
    cap = 20e9
    pol = build_policy(spec(name="prfaas", signals="oracle", threshold="1K", min_threshold="1K", kv_bytes_per_token="150KB",
                            control={"slow_tau": "1s"}), PREFILL, DECODE, log=SchedulerLog(), capacity_bps=cap)
    t0 = clock.now_s()
    for k in range(1, 101):  # 10 s: KV gets 5 Gbps acknowledged, the line carries 17 Gbps (u = 0.85 < 0.9)
        t = t0 - 10 + 0.1 * k
        pol.on_telemetry(TelemetrySample(t, kv_goodput_bps=5e9))
        pol.on_telemetry(TelemetrySample(t, egress_bps=17e9, capacity_bps=cap))
    assert pol.controller.non_kv_bps == pytest.approx(12e9, rel=1e-3) and pol.controller.kv_capacity_bps == pytest.approx(8e9, rel=1e-3)
    lengths = [K, 2 * K, 4 * K, 8 * K] * 5  # 20 arrivals over 10 s
    for i, n in enumerate(lengths):
        pol.decide(req(n, f"r{i}"), state(input_len=n, now=t0 + 0.5 * i))
    now = t0 + 10
    demand = lambda t: sum(n * 150e3 * 8 for n in lengths if n > t) / 10.0  # noqa: E731
    assert demand(K) == pytest.approx(pol.controller.predicted_demand_bps(K, now))
    assert demand(K) / 8e9 >= 0.9 > 17e9 / cap  # pressure from D(t) / capacity left for KV, not from u
    pol.tick(now)
    # the smallest t with D(t) <= 0.8 x 8 Gbps: 8.6 Gbps at 1K, 7.4 at 2K, 4.9 at 4K
    assert demand(4 * K) <= 6.4e9 < demand(2 * K)
    assert pol.threshold == 4 * K
    row = pol.log.rows("threshold")[0]
    assert "left for KV" in row["reason"] and row["old_threshold"] == K


def test_a_raise_is_capped_where_the_predicted_pd_p_queue_reaches_pdp_queue_max() -> None:
    pol = make(threshold="1K", min_threshold="1K", kv_bytes_per_token="1MB", control={"pdp_queue_max": 1.0, "slow_tau": "1s"})
    t0 = clock.now_s()
    lengths = [K, 2 * K, 4 * K, 8 * K, 16 * K] * 4  # 20 arrivals
    for i, n in enumerate(lengths):
        pol.decide(req(n, f"r{i}"), state(input_len=n, now=t0 + 0.5 * i))
    now = t0 + 10
    pol.on_telemetry(TelemetrySample(now, pdp_queue_per_instance=0.25))
    # PD-P work in tokens: W(1K) = 4K; q(t') = 0.25 * W(t') / 4K <= 1 -> W(t') <= 16K: the 2K arrivals (W = 12K)
    # fit, the first 4K one (W = 16K) just fits, the second (20K) does not, and a raise to 4K keeps all four
    assert pol.controller.pdp_cap(now) == 2 * K
    pol.controller.capacity_bps = 1e9  # a deep dip: the fit would keep everything local
    assert pol.controller.fit_threshold(0.8e9, now) == 16 * K
    pol.on_telemetry(TelemetrySample(now, egress_bps=1e9))
    pol.tick(now)
    assert pol.threshold == 2 * K and "capped at 2048 by the PD-P queue" in pol.log.rows("threshold")[0]["reason"]
    pol.on_telemetry(TelemetrySample(now + 0.1, pdp_queue_per_instance=1.2))
    pol.on_telemetry(TelemetrySample(now + 5, pdp_queue_per_instance=1.2))
    assert pol.controller.pdp_cap(now + 5) == 2 * K  # PD-P at its limit: no further raise, whatever the WAN says


def test_an_overloaded_pd_p_pool_gives_a_raise_back_towards_base_after_the_hold() -> None:
    pol = make(threshold="8K", control={"pdp_queue_max": 1.0, "hold": "3s", "slow_tau": "1s"})
    t0 = clock.now_s()
    drive(pol, t0, 0.3, 1.0)  # no demand model: one blind raise to 12K
    assert pol.threshold == 12 * K
    for k in range(1, 71):  # 7 s with 3 requests in flight per PD-P instance, the WAN still saturated
        t = t0 + 0.3 + 0.1 * k
        pol.on_telemetry(TelemetrySample(t, egress_bps=CAP, capacity_bps=CAP, pdp_queue_per_instance=3.0))
        pol.tick(t)
    assert pol.threshold == 8 * K  # back to base (12K / 1.25 = 9.6K, then the floor), never below it
    lowers = [r for r in pol.log.rows("threshold") if r["reason"].startswith("lower: PD-P queue")]
    assert lowers and lowers[0]["t_s"] - pol.log.rows("threshold")[0]["t_s"] >= 3.0 - 1e-9


def test_without_cross_cluster_cache_the_per_cluster_rule_holds_even_when_bandwidth_is_abundant() -> None:
    kv = KVManager({p.instance: p.cluster for p in PREFILL})
    hashes = list(range(1, 41))
    kv.replace_instance(0, chain_block_hashes(hashes[:36]))  # the long prefix sits in PrfaaS only
    pol = make(threshold="8K", cross_cluster_cache=False)
    now = clock.now_s()
    pol.on_telemetry(TelemetrySample(now, egress_bps=0.1 * CAP, capacity_bps=CAP))
    d = pol.decide(req(40 * B), state(kv, hashes, 40 * B, now=now))
    assert not d.bandwidth_scarce
    assert (d.route, d.cached_len, d.cache_transfer_tokens) == ("prfaas", 36 * B, 0)


def test_a_pd_host_flips_from_prefill_to_decode_when_decode_is_the_bottleneck() -> None:
    prefill = PREFILL[:2] + (InstanceState(2, "pd", "10.2.0.1"), InstanceState(3, "pd", "10.2.0.2"))
    decode = DECODE + (InstanceState(12, "pd", "10.2.0.2"),)
    pol = make(prefill=prefill, decode=decode, standby=[("decode", 12)],
               role_flip={"enabled": True, "period": "10s", "bs_max": 10, "decode_load_high": 0.9})
    t0 = clock.now_s()
    pol.on_telemetry(TelemetrySample(t0, pdp_queue_per_instance=0.0, decode_queue_per_instance=9.5))
    pol.tick(t0 + 5)
    assert ("decode", 12) not in pol.active  # not before the period
    pol.tick(t0 + 11)
    assert ("decode", 12) in pol.active and ("prefill", 3) not in pol.active
    assert pol.decide(req(100), state(input_len=100, prefill=prefill, decode=decode)).prefill_instance == 2
    pol.on_telemetry(TelemetrySample(t0 + 12, decode_queue_per_instance=9.5))
    pol.tick(t0 + 22)  # the last active PD-P instance is never flipped away (min_prefill 1)
    assert ("prefill", 2) in pol.active and len(pol.log.rows("role_flip")) == 1


def test_once_the_wan_is_calm_a_loaded_pd_p_pool_gets_the_whole_raise_back_in_one_step() -> None:
    pol = make(threshold="8K", control={"pdp_queue_max": 0.75, "hold": "3s", "slow_tau": "1s"})
    t0 = clock.now_s()
    drive(pol, t0, 0.3, 1.0)  # no demand model: one blind raise to 12K
    assert pol.threshold == 12 * K
    drive(pol, t0 + 0.3, 8.0, 0.1, pdp_queue_per_instance=1.0)  # WAN calm, PD-P at 1.0 > 0.75 (but < 2 x 0.75)
    lowers = [r for r in pol.log.rows("threshold") if r["reason"].startswith("lower")]
    assert len(lowers) == 1 and (lowers[0]["old_threshold"], lowers[0]["threshold"]) == (12 * K, 8 * K)
    assert "PD-P queue 1.00/instance" in lowers[0]["reason"]


def test_right_after_a_raise_the_cap_counts_only_the_pd_p_work_actually_routed() -> None:
    """The queue lags a raise: until the arrivals routed under the new t show in it, the cap stays at t."""
    pol = make(threshold="1K", min_threshold="1K", kv_bytes_per_token="1MB", control={"pdp_queue_max": 1.0})
    t0 = clock.now_s()
    lengths = [K, 2 * K, 4 * K, 8 * K, 16 * K] * 4
    for i, n in enumerate(lengths):
        pol.decide(req(n, f"r{i}"), state(input_len=n, now=t0 + 0.5 * i))
    now = t0 + 10
    pol.on_telemetry(TelemetrySample(now, pdp_queue_per_instance=0.25))
    assert pol.controller.pdp_cap(now) == 2 * K  # W_pd = 4 x 1K routed to PD-P: budget 16K tokens
    pol.controller.t = 4.0 * K  # as if just raised: the window's arrivals were still routed under t = 1K
    assert pol.controller.pdp_cap(now) == 4 * K  # W(4K) = 28K > 16K already: no further raise on a stale queue


def test_before_pd_p_cost_is_known_a_raise_to_a_length_is_capped_only_if_every_arrival_of_that_length_fits() -> None:
    pol = make(threshold="1K", min_threshold="1K", kv_bytes_per_token="1MB", control={"pdp_queue_max": 0.75})
    t0 = clock.now_s()
    for i, n in enumerate([K] * 10 + [40 * K] * 2):  # 10K tokens on PD-P
        pol.decide(req(n, f"r{i}"), state(input_len=n, now=t0 + 0.5 * i))
    now = t0 + 6
    pol.on_telemetry(TelemetrySample(now, pdp_queue_per_instance=0.1))
    # budget 0.75 / 0.1 x 10K = 75K tokens: one 40K arrival fits (50K), both do not (90K), and a raise to
    # 40K keeps both local (review of d2b2840: it returned 40K)
    assert pol.controller.pdp_cap(now) == 1 * K


def _pd_p_measured(pol, now: float, queue: float) -> None:
    """PD-P's prefills cost 0.4 s + 0.1 ms per token (five finished prefills), two PD-P instances, `queue`
    requests in flight per instance now."""
    for l in (K, 2 * K, 4 * K, 8 * K, 16 * K):
        pol.on_prefill("pd", l, 0.4 + 1e-4 * l)
    pol.on_telemetry(TelemetrySample(now, pdp_queue_per_instance=queue, pdp_instances=2))


def test_with_pd_p_cost_measured_the_cap_adds_each_moved_request_s_prefill_to_pd_p_s_offered_load() -> None:
    pol = make(threshold="1K", min_threshold="1K", kv_bytes_per_token="1MB", control={"pdp_queue_max": 0.6})
    t0 = clock.now_s()
    for i, n in enumerate([K, 2 * K, 4 * K, 8 * K, 16 * K] * 4):  # 20 arrivals over 10 s; only the 1K ones on PD-P
        pol.decide(req(n, f"r{i}"), state(input_len=n, now=t0 + 0.5 * i))
    now = t0 + 9.5 + 0.5
    _pd_p_measured(pol, now, 0.05)
    # offered: 4 x (0.4 + 0.1024) s / (10 s x 2 instances) = 0.100; + 4 x 2K (0.030 each) = 0.221, + 4 x 4K
    # (0.040 each) = 0.383; the 8K ones add 0.061 each: three fit (0.566) the fourth does not (0.627 > 0.6),
    # and a raise to 8K would keep all four local
    assert pol.controller.pdp_cap(now) == 4 * K
    # right after that raise, before PD-P's queue shows it: the arrivals it keeps local (offloaded under
    # the old t) count as PD-P's load now, so the cap does not let a second raise through (review of d2b2840:
    # it returned 8K here, then 128K at t = 8K)
    pol.controller.t = 4.0 * K
    assert pol.controller.pdp_cap(now) == 4 * K
    pol.controller.t = 8.0 * K
    assert pol.controller.pdp_cap(now) == 8 * K
    pol.controller.t = 1.0 * K
    pol.on_telemetry(TelemetrySample(now + 0.1, pdp_queue_per_instance=1.0))
    pol.on_telemetry(TelemetrySample(now + 5, pdp_queue_per_instance=1.0))
    assert pol.controller.pdp_cap(now + 5) == 1 * K  # measured above 0.6 already: no raise


def test_a_momentarily_idle_pd_p_pool_does_not_open_the_cap_when_its_offered_work_keeps_it_busy() -> None:
    """val-thin-line (session 30): caught at 0.11 requests per instance, the old cap (the queue scaled by the
    tokens moved) let a raise to 52.7K through, which tripled PD-P's load; the offered work says otherwise."""
    pol = make(threshold="4K", min_threshold="1K", kv_bytes_per_token="1MB", control={"pdp_queue_max": 0.75})
    t0 = clock.now_s()
    for i, n in enumerate([K, 2 * K, 4 * K, 8 * K, 16 * K] * 4):  # 1K-4K on PD-P: 0.383 of 2 instances' time
        pol.decide(req(n, f"r{i}"), state(input_len=n, now=t0 + 0.5 * i))
    now = t0 + 10
    pol.on_telemetry(TelemetrySample(now, pdp_queue_per_instance=0.1))
    assert pol.controller.pdp_cap(now) == 128 * K  # the old rule, before PD-P's cost is known: all local
    _pd_p_measured(pol, now, 0.1)
    assert pol.controller.pdp_cap(now) == 8 * K  # 0.383 + 4 x 0.061 = 0.627; one 16K more is 0.729, two 0.831


# ------------------------------------------------------------------------------ latency-aware offload


def _learned(pol, pf_s_per_token: float = 50e-6, pd_s_per_token: float = 100e-6) -> None:
    """Three finished prefills per cluster of 20K tokens: PrfaaS 1 s each, PD-P 2 s each (H200 vs H20-like)."""
    for _ in range(3):
        pol.on_prefill("prfaas", 20 * K, 20 * K * pf_s_per_token)
        pol.on_prefill("pd", 20 * K, 20 * K * pd_s_per_token)


def loaded(prfaas_depth: int, pd_depths: tuple[int, int] = (0, 0)) -> tuple[InstanceState, ...]:
    return (InstanceState(0, "prfaas", "10.1.0.1", prfaas_depth), InstanceState(1, "prfaas", "10.1.0.2", prfaas_depth),
            InstanceState(2, "pd", "10.2.0.1", pd_depths[0]), InstanceState(3, "pd", "10.2.0.2", pd_depths[1]))


def test_latency_aware_keeps_an_offload_on_an_idle_pd_p_instance_when_its_prefill_ends_sooner_there() -> None:
    """32K tokens: PrfaaS 1.6 s of prefill behind 3 in flight (3 x 1 s) = 4.6 s; an idle PD-P instance 3.3 s."""
    pol = make("prfaas", threshold="16K", control={"latency_aware": True})
    _learned(pol)
    d = pol.decide(req(32 * K), state(input_len=32 * K, prefill=loaded(3, (1, 0))))
    assert (d.route, d.prefill_instance) == ("pd", 3) and "latency-aware" in d.reason
    # one in flight on PrfaaS (2.6 s) beats the idle PD-P instance (3.3 s): offloaded as the threshold says
    assert pol.decide(req(32 * K), state(input_len=32 * K, prefill=loaded(1))).route == "prfaas"
    # no idle PD-P instance: offloaded however loaded PrfaaS is (short requests never queue behind it)
    assert pol.decide(req(32 * K), state(input_len=32 * K, prefill=loaded(9, (1, 1)))).route == "prfaas"


def test_latency_aware_is_off_by_default_and_needs_a_learned_model_of_both_clusters() -> None:
    off = make("prfaas", threshold="16K")
    _learned(off)
    assert off.decide(req(32 * K), state(input_len=32 * K, prefill=loaded(3))).route == "prfaas"
    fresh = make("prfaas", threshold="16K", control={"latency_aware": True})
    for _ in range(2):  # two prefills per cluster: not yet a model
        fresh.on_prefill("prfaas", 20 * K, 1.0)
        fresh.on_prefill("pd", 20 * K, 2.0)
    assert fresh.decide(req(32 * K), state(input_len=32 * K, prefill=loaded(3))).route == "prfaas"
    fixed = make("fixed-threshold", threshold="16K", control={"latency_aware": True})
    _learned(fixed)  # the fixed-threshold baseline never reroutes
    assert fixed.decide(req(32 * K), state(input_len=32 * K, prefill=loaded(3))).route == "prfaas"


def test_prefill_times_learn_seconds_per_token_and_per_prefill_by_cluster() -> None:
    from testbed.serving.policy.latency import PrefillTimes

    t = PrefillTimes()
    for n, s in ((10 * K, 0.5), (20 * K, 1.0), (40 * K, 2.0)):
        t.observe("prfaas", n, s)
    assert t.finish_s("prfaas", 0, 30 * K) == pytest.approx(1.5)  # 50 us per token
    assert t.finish_s("prfaas", 2, 0) == pytest.approx(2 * 0.88)  # EWMA 0.2 of 0.5, 1.0, 2.0 s per prefill
    assert t.finish_s("pd", 0, 30 * K) is None
    t.observe("prfaas", 0, 1.0)  # nothing computed: ignored
    t.observe("prfaas", 10, -1.0)
    assert t.finish_s("prfaas", 0, 30 * K) == pytest.approx(1.5)


@pytest.mark.parametrize("field, value, words", [
    # 2026-12-07: each was taken (probe_bdp, probe_headroom, full_path_ratio, probe_max) or said only half of it
    ("probe_bdp", 1e308, r"1e\+308 is more than 1000 bandwidth-delay products, more round trips than a probe's 2 s hold"),
    ("probe_bdp", 0, r"0 must be > 0"),
    ("full_path_ratio", 1e308, r"1e\+308 is more than 1000, more round trips than a probe's 2 s hold"),
    ("full_path_ratio", -1, r"-1 must be > 0"),
    ("probe_headroom", 1e10, r"10000000000.0 is more than 100 times the estimate, past the nominal rate"),
    ("probe_headroom", 0, r"0 must be >= 1 \(a probe sized below the estimate cannot read it\)"),  # was "0 must be > 0"
    ("probe_max", "1e12B", r"'1e12B' is more than 4294967295 B \(2\*\*32 - 1\), the most one probe may carry on the wire"),
    ("probe_max", "1e30B", r"'1e30B' is more than 8EiB \(2\*\*63 - 1 bytes\), past any memory or disk"),  # any size's bound first
    ("probe_max", "0B", r"'0B' is less than 1B, and a probe carries at least one byte \(probe_after: 0s sends no probes\)"),
    ("probe_max", "0.4B", r"'0.4B' is less than 1B"),
    ("probe_max", -1, r"-1 must not be negative; use a number with a unit"),  # was "-1 has no size unit"
    ("probe_after", -1, r"-1 must not be negative; use a number with a unit"),
    ("probe_bdp", "1e308", r"'1e308' is text, not a number \(YAML reads a number with an exponent only with a '.' and a "
                           r"sign: write 1.0e\+308\)"),  # YAML's reading of `probe_bdp: 1e308`; was "'1e308' is not a number"
    ("probe_bdp", float("inf"), r"inf is not a number"),
    ("probe_headroom", "abc", r"'abc' is not a number"),
])
def test_the_estimators_probe_fields_are_bounded_in_one_line_naming_the_field(field: str, value: object, words: str) -> None:
    with pytest.raises(FieldError, match=rf"^policy\.estimator\.{field}: {words}") as err:
        parse_policy_section(Fields({"name": "prfaas", "estimator": {field: value}}, "policy"))
    assert "\n" not in str(err.value)


def test_the_estimators_probe_fields_take_their_bounds() -> None:
    from testbed.serving.policy.estimator import BandwidthEstimator
    from testbed.serving.protocol import PROBE_MAX_BYTES

    s = parse_policy_section(Fields({"name": "prfaas", "estimator": {"probe_bdp": 1000, "full_path_ratio": 1000, "probe_headroom": 100,
                                                                       "probe_max": f"{PROBE_MAX_BYTES}B"}}, "policy"))
    e = BandwidthEstimator(1e15, s.estimator)  # the highest nominal rate a scenario may give
    assert e.probe_pace_bps() / 8 < 2**64 and e.probe_bytes() <= PROBE_MAX_BYTES  # the kernel's pacing rate; one probe's bytes
    assert parse_policy_section(Fields(s.to_mapping(), "policy")) == s


def test_a_confirm_poll_is_never_later_than_the_routers_poll_period() -> None:
    """`poll_confirm: 168h` held the router's next state poll for a week after a lone saturated poll (2026-12-07)."""
    from testbed.serving.router import next_poll_wait_s

    assert next_poll_wait_s(0.0, 0.5) == 0.5 and next_poll_wait_s(0.1, 0.5) == 0.1
    assert next_poll_wait_s(168 * 3600.0, 0.5) == 0.5
