"""Arrival processes: rates, dispersion and shapes within stated statistical tolerances."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.errors import FieldError
from traffic.arrivals import ClosedLoop, MarkovModulated, OnOff, Poisson, RateStep, TraceTimes, parse_arrivals


def counts(t: np.ndarray, duration_s: float, window_s: float = 1.0) -> np.ndarray:
    return np.bincount((t // window_s).astype(int), minlength=int(duration_s / window_s))[: int(duration_s / window_s)]


def test_poisson_rate_exponential_gaps_and_unit_dispersion() -> None:
    t = Poisson(50.0).times(np.random.default_rng(1), 2000.0)
    assert np.all(np.diff(t) >= 0) and t.min() >= 0 and t.max() < 2000
    assert len(t) / 2000 == pytest.approx(50.0, rel=0.01)  # sd of the count is 0.3%
    gaps = np.diff(t)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.02)  # exponential: CV 1
    c = counts(t, 2000)
    assert c.var() / c.mean() == pytest.approx(1.0, abs=0.1)  # index of dispersion 1


def test_rate_steps_and_ramps_follow_the_schedule() -> None:
    p = Poisson(10.0, (RateStep(100.0, 40.0), RateStep(200.0, 0.0, ramp_s=100.0)))
    t = p.times(np.random.default_rng(2), 300.0)
    c = counts(t, 300, 100.0)
    assert c[0] / 100 == pytest.approx(10, rel=0.1)
    assert c[1] / 100 == pytest.approx(40, rel=0.05)
    assert c[2] / 100 == pytest.approx(20, rel=0.07)  # linear ramp 40 -> 0: mean 20
    assert p.mean_rate_rps(300.0) == pytest.approx((1000 + 4000 + 2000) / 300)


def test_onoff_is_silent_when_off_and_keeps_the_mean_rate() -> None:
    p = OnOff(100.0, on_s=2.0, off_s=8.0, exponential=False)
    t = p.times(np.random.default_rng(3), 2000.0)
    assert len(t) / 2000 == pytest.approx(p.mean_rate_rps(), rel=0.03)  # 20/s
    phase = np.sort(t % 10.0)  # fixed 10 s cycle: every arrival falls in one 2 s arc of the cycle
    circular_gaps = np.diff(np.concatenate([phase, [phase[0] + 10.0]]))
    assert 7.95 < circular_gaps.max() < 8.001  # float rounding of the cycle starts


def test_mmpp_mean_rate_and_burst_factor() -> None:
    p = MarkovModulated(20.0, burst_factor=4.0, burst_fraction=0.1, burst_s=2.0)
    hi, lo = p.rates_rps
    assert hi == 80.0 and lo == pytest.approx(20 * (1 - 0.4) / 0.9)
    t = p.times(np.random.default_rng(4), 20_000.0)
    assert len(t) / 20_000 == pytest.approx(20.0, rel=0.03)
    c = counts(t, 20_000)
    assert c.var() / c.mean() > 5  # far burstier than Poisson (index of dispersion 1)
    assert np.percentile(c, 99.5) > 60  # seconds inside bursts run near 4x the mean


def test_mmpp_with_burst_factor_one_is_poisson() -> None:
    t = MarkovModulated(20.0, 1.0).times(np.random.default_rng(5), 5000.0)
    c = counts(t, 5000)
    assert c.var() / c.mean() == pytest.approx(1.0, abs=0.1)


def test_closed_loop_offline_rate_is_users_over_think_time() -> None:
    p = ClosedLoop(users=8, think_s=2.0)
    t = p.times(np.random.default_rng(6), 1000.0)
    assert len(t) / 1000 == pytest.approx(4.0, rel=0.04)
    assert p.after(np.random.default_rng(0), 10.0) > 10.0


def test_trace_times_scale() -> None:
    p = TraceTimes((0.0, 1.0, 2.0, 3.0), time_scale=0.5)
    assert p.times(np.random.default_rng(0), 1.4).tolist() == [0.0, 0.5, 1.0]


def test_parse_arrivals_forms_and_errors() -> None:
    assert parse_arrivals({"rate": "120/min"}, "w.arrivals") == Poisson(2.0)
    p = parse_arrivals({"process": "poisson", "rate": 1, "steps": [{"at": "10s", "rate": 5, "ramp": "5s"}]}, "w.arrivals")
    assert p.steps == (RateStep(10.0, 5.0, 5.0),)
    assert parse_arrivals({"process": "closed", "users": 4, "think": "1s"}, "w.arrivals") == ClosedLoop(4, 1.0)
    with pytest.raises(FieldError, match=r"w.arrivals.burst_factor: 20 x burst_fraction 0.1 exceeds 1"):
        parse_arrivals({"process": "mmpp", "rate": 1, "burst_factor": 20}, "w.arrivals")
    with pytest.raises(FieldError, match=r"w.arrivals.process: 'weibull' is not allowed"):
        parse_arrivals({"process": "weibull"}, "w.arrivals")
    with pytest.raises(FieldError, match=r"w.arrivals.steps\[1\].at"):
        parse_arrivals({"rate": 1, "steps": [{"at": "10s", "rate": 2}, {"at": "5s", "rate": 3}]}, "w.arrivals")
