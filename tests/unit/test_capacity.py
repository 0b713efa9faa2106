"""The capacity search (experiments.capacity) on a fake serving curve: runs are replaced by a known
pass/fail law, so where the search lands and how many runs it spends can be checked exactly."""

from __future__ import annotations

import numpy as np
import pytest

from experiments import capacity


def fake_curve(true_rps: float, noise_rps: float = 0.0, seed: int = 0):
    """A deployment whose good fraction falls below 90% above `true_rps`; near it, each seed sees the
    boundary shifted by up to `noise_rps` (run-to-run noise)."""
    calls = []
    shift = {s: float(np.random.default_rng(seed + s).uniform(-noise_rps, noise_rps)) for s in range(1, 10)}

    def evaluate(rate, seeds):
        calls.append((rate, tuple(seeds)))
        out = []
        for s in seeds:
            good = 0.99 if rate <= true_rps + shift[s] else 0.5
            summary = {"good_fraction": good, "queue": {"growing": rate > true_rps + shift[s]}, "requests_total": 100}
            out.append(capacity.judge(summary, rate, s))
        return out

    return evaluate, calls


@pytest.mark.parametrize("start", [0.3, 2.0, 9.0])
def test_search_brackets_then_bisects_to_within_the_tolerance_of_a_known_capacity(start):
    evaluate, calls = fake_curve(2.5)
    res = capacity.search(evaluate, start, repetitions=2, rel_tol=0.05, max_probes=20)
    assert res.bracketed
    assert 2.5 / 1.05 <= res.lambda_max_rps <= 2.5
    lo, hi = res.ci
    assert lo <= 2.5 < hi and (hi - lo) / lo <= 0.05 + 1e-9
    assert res.runs == sum(len(s) for _, s in calls)
    assert all(len(s) <= 2 for _, s in calls)  # no rate run twice with the same seed


def test_repetitions_near_a_noisy_boundary_widen_the_interval_around_it():
    evaluate, _ = fake_curve(2.0, noise_rps=0.3, seed=4)
    res = capacity.search(evaluate, 1.0, repetitions=3, rel_tol=0.02, max_probes=12)
    lo, hi = res.ci
    assert 1.7 - 1e-9 <= lo <= res.lambda_max_rps <= 2.3 + 1e-9
    assert hi is not None and hi >= res.lambda_max_rps
    assert any(not (p.all_passed or p.all_failed) for p in res.probes) or hi - lo > 0


def test_a_deployment_that_fails_even_at_the_lowest_rate_is_reported_unbracketed():
    evaluate, _ = fake_curve(0.001)
    res = capacity.search(evaluate, 1.0, min_rps=0.1, max_probes=10)
    assert not res.bracketed and res.lambda_max_rps == 0.0


def test_a_run_fails_on_good_fraction_a_growing_queue_or_too_few_requests():
    ok = {"good_fraction": 0.95, "queue": {"growing": False}, "requests_total": 50}
    assert capacity.judge(ok, 1.0, 1).passed
    assert "89% good" in capacity.judge({**ok, "good_fraction": 0.89}, 1.0, 1).reason
    assert "grow" in capacity.judge({**ok, "queue": {"growing": True}}, 1.0, 1).reason
    assert "only 5 requests" in capacity.judge({**ok, "requests_total": 5}, 1.0, 1).reason
    assert "too short to test the queue" in capacity.judge({**ok, "queue": {"growing": None}}, 1.0, 1).reason
