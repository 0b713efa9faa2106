"""The capacity search (experiments.capacity) on a fake serving curve: runs are replaced by a known
pass/fail law, so where the search lands and how many runs it spends can be checked exactly."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.metrics import queue_trend_inconclusive
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


def graded_curve(true_rps: float, marginal_below: float = 0.9, flip: dict | None = None):
    """Good fraction 0.99 well below `true_rps`, 0.92 (a marginal pass on 100 requests) between
    `marginal_below` x true and true, 0.5 above; `flip` {(rate, seed): good} overrides single runs."""
    calls = []

    def evaluate(rate, seeds):
        calls.append((rate, tuple(seeds)))
        out = []
        for s in seeds:
            good = 0.99 if rate <= marginal_below * true_rps else 0.92 if rate <= true_rps else 0.5
            good = (flip or {}).get((rate, s), good)
            out.append(capacity.judge({"good_fraction": good, "queue": {"growing": False}, "requests_total": 100}, rate, s))
        return out

    return evaluate, calls


def test_a_start_within_the_first_step_of_the_edge_costs_two_bracketing_rates_and_one_bisection():
    evaluate, calls = graded_curve(2.5, marginal_below=1.0)  # every pass is decisive here
    res = capacity.search(evaluate, 2.7, repetitions=2, rel_tol=0.15, max_probes=8)
    assert [r for r, _ in calls] == [2.7, pytest.approx(2.7 / 1.15 ** 2, rel=1e-3), pytest.approx(2.7 / 1.15, rel=1e-3)]
    assert res.runs == 3 and res.bracketed
    lo, hi = res.ci
    assert lo <= 2.5 < hi and (hi - lo) / lo <= 0.15 + 1e-3


def test_a_poor_start_brackets_with_growing_steps():
    evaluate, calls = graded_curve(1.0, marginal_below=1.0)
    res = capacity.search(evaluate, 8.0, repetitions=2, rel_tol=0.15, max_probes=12)
    rates = [r for r, _ in calls]
    assert rates[:4] == [8.0] + [pytest.approx(8 / 1.15 ** e, rel=1e-3) for e in (2, 6, 12)]
    assert res.bracketed and res.ci[0] <= 1.0 < res.ci[1] and (res.ci[1] - res.ci[0]) / res.ci[0] <= 0.15 + 1e-3
    assert len(rates) == 5 + 3  # 5 rates bracket an 8x miss (steps 1.15^2, ^4, ^6, ^8), 3 bisections close 1.15^8


def test_only_a_rate_whose_first_run_was_marginal_is_repeated():
    evaluate, calls = graded_curve(2.5, marginal_below=0.8)  # rates in (2.0, 2.5] pass with 92%: marginal
    res = capacity.search(evaluate, 2.7, repetitions=2, rel_tol=0.15, max_probes=8)
    lo, hi = res.ci
    assert 2.0 < lo <= 2.5 < hi
    for p in res.probes:  # decided when first tried: a decisive first run alone, a marginal one with seed 2
        assert len(p.runs) == (1 if p.runs[0].decisive else 2), p
    assert res.probes[-1].rate_rps == 2.7 and len(res.probes[-1].runs) == 1  # the decisive 50% fail
    assert any(len(p.runs) == 2 for p in res.probes)


def test_a_repetition_that_fails_the_lower_end_moves_the_edge_down():
    rate = float(f"{2.7 / 1.15:.4g}")  # the first bisection point, a marginal pass with seed 1
    evaluate, calls = graded_curve(2.5, marginal_below=0.8, flip={(rate, 2): 0.5})
    res = capacity.search(evaluate, 2.7, repetitions=2, rel_tol=0.15, max_probes=8)
    assert res.lambda_max_rps < rate  # 1 of 2 runs is not a majority: the rate fails
    assert res.ci[1] == 2.7  # not every run failed at `rate`: the interval's top stays at the last all-fail rate
    assert res.bracketed and (rate, (2,)) in calls


def test_a_run_stopped_early_fails_decisively_and_says_why():
    summary = {"good_fraction": 0.3, "queue": {"growing": None}, "requests_total": 120,
               "early_stop": "stopped early: 13 of 120 requests already missed an SLO, so fewer than 90% can be good"}
    v = capacity.judge(summary, 3.0, 1)
    assert not v.passed and v.decisive
    assert v.reason.startswith("stopped early: 13 of 120") and "too short" not in v.reason


@pytest.mark.parametrize("good,n,passed,decisive", [(0.99, 100, True, True), (0.93, 100, True, False), (0.93, 2000, True, True),
                                                   (0.88, 100, False, False), (0.5, 100, False, True)])
def test_a_run_is_decisive_when_the_binomial_interval_of_its_good_fraction_clears_the_bar(good, n, passed, decisive):
    v = capacity.judge({"good_fraction": good, "queue": {"growing": False}, "requests_total": n}, 1.0, 1)
    assert (v.passed, v.decisive) == (passed, decisive)
    lo, hi = capacity.good_fraction_interval(good, n)
    assert lo < good < hi


def test_a_run_that_fails_only_on_its_growing_queue_is_marginal():
    v = capacity.judge({"good_fraction": 0.99, "queue": {"growing": True}, "requests_total": 100}, 1.0, 1)
    assert not v.passed and not v.decisive  # SLOs hold, the queue grows: at the edge


def test_a_bracket_the_tolerance_wide_up_to_the_rates_rounding_is_closed():
    evaluate, calls = graded_curve(2.5, marginal_below=1.0)
    capacity.search(evaluate, 2.7, repetitions=2, rel_tol=0.15, max_probes=8)  # 2.7 / 1.15^2, then 2.7 / 1.15
    assert len(calls) == 3
    # the quick model's start: 4.2336 fails, 3.201 passes, the midpoint 3.681 passes: 15.02% wide, closed
    evaluate, calls = graded_curve(3.8, marginal_below=1.0)
    res = capacity.search(evaluate, 4.233622, repetitions=2, rel_tol=0.15, max_probes=8)
    assert [r for r, _ in calls] == [4.234, 3.201, 3.681] and res.ci == (3.681, 4.234)
    # ... while a bracket 2% of the tolerance wider is bisected again (the rule is the rounding only)
    evaluate, calls = graded_curve(1.1, marginal_below=1.0)
    res = capacity.search(evaluate, 1.0 * 1.0 / (1.15 ** 2) * (1.15 ** 2), repetitions=2, rel_tol=0.1505 / 1.0102, max_probes=8)
    assert (res.ci[1] - res.ci[0]) / res.ci[0] <= 0.1505 / 1.0102 * 1.01


def seed_edges_curve(edges: dict[int, float]):
    """Each seed has its own edge (its workload draw): below it a run passes decisively; from it up to
    1.4x it the SLOs hold but the queue grows (a marginal fail, as the full reproduction's seed 1 at
    homogeneous PD's 1.435-1.808 req/s); above that it fails decisively."""
    calls = []

    def evaluate(rate, seeds):
        calls.append((rate, tuple(seeds)))
        out = []
        for s in seeds:
            edge = edges[s]
            good, growing = (0.99, False) if rate < edge else (0.99, True) if rate < 1.4 * edge else (0.5, True)
            out.append(capacity.judge({"good_fraction": good, "queue": {"growing": growing}, "requests_total": 200}, rate, s))
        return out

    return evaluate, calls


def test_with_three_repetitions_one_unlucky_seed_does_not_set_the_edge():
    edges = {1: 1.4, 2: 1.9, 3: 1.9}  # seed 1 alone is unlucky
    evaluate, calls = seed_edges_curve(edges)
    three = capacity.search(evaluate, 2.1, repetitions=3, rel_tol=0.08, max_probes=10)
    assert 1.9 / 1.08 <= three.lambda_max_rps < 1.9  # the majority's edge, within the tolerance
    evaluate, _ = seed_edges_curve(edges)
    two = capacity.search(evaluate, 2.1, repetitions=2, rel_tol=0.08, max_probes=10)
    assert two.lambda_max_rps < 1.4  # a 1-1 tie is a fail: seed 1 sets the edge


def test_a_rate_runs_only_the_repetitions_that_can_change_its_verdict():
    evaluate, calls = seed_edges_curve({1: 1.0, 2: 1.0, 3: 5.0})
    res = capacity.search(evaluate, 1.1, repetitions=3, rel_tol=0.15, max_probes=8)
    by_rate = {p.rate_rps: [r.seed for r in p.runs] for p in res.probes}
    assert by_rate[1.1] == [1, 2]  # two marginal fails of three: seed 3 cannot change the verdict
    assert all(len(seeds) == 1 for seeds in calls for seeds in [seeds[1]])  # one run per call: the fewest that can decide
    evaluate, calls = seed_edges_curve({1: 1.0, 2: 5.0, 3: 5.0})
    res = capacity.search(evaluate, 1.1, repetitions=3, rel_tol=0.15, max_probes=8)
    assert {p.rate_rps: [r.seed for r in p.runs] for p in res.probes}[1.1] == [1, 2, 3]  # 1-1 after two: the third decides
    assert res.lambda_max_rps >= 1.1


def test_with_two_repetitions_a_marginal_fail_is_not_repeated_because_a_tie_would_fail_too():
    evaluate, calls = seed_edges_curve({1: 1.0, 2: 5.0})
    res = capacity.search(evaluate, 1.1, repetitions=2, rel_tol=0.15, max_probes=8)
    assert {p.rate_rps: len(p.runs) for p in res.probes}[1.1] == 1 and res.lambda_max_rps < 1.1


def test_when_the_rates_run_out_the_ends_of_the_bracket_are_still_decided_by_their_majority():
    evaluate, calls = seed_edges_curve({1: 1.4, 2: 1.9, 3: 1.9})
    res = capacity.search(evaluate, 2.1, repetitions=3, rel_tol=0.08, max_probes=4)
    assert len(res.probes) == 4  # no fifth rate
    lo, hi = capacity._bracket({p.rate_rps: p for p in res.probes})
    by_rate = {p.rate_rps: p for p in res.probes}
    assert by_rate[lo].runs_to_decide(3) == 0 and (hi is None or by_rate[hi].runs_to_decide(3) == 0)
    assert res.lambda_max_rps >= 1.4  # seed 1's marginal fails alone did not set the edge


def test_with_two_slots_a_marginal_rates_remaining_repetitions_run_together():
    evaluate, calls = seed_edges_curve({1: 1.0, 2: 5.0, 3: 5.0})
    res = capacity.search(evaluate, 1.1, repetitions=3, rel_tol=0.15, max_probes=8, parallel=2)
    assert calls[0] == (1.1, (1, 2)) and (1.1, (3,)) in calls  # two runs at once, then the third that decides
    assert {p.rate_rps: len(p.runs) for p in res.probes}[1.1] == 3 and res.lambda_max_rps >= 1.1


def test_an_executors_slots_reach_the_search(monkeypatch):
    from experiments.executor import SequentialExecutor
    from experiments.parallel import ParallelExecutor

    monkeypatch.setattr("os.cpu_count", lambda: 8)  # local:2 is refused on a 1-core host
    assert SequentialExecutor().slots == 1
    assert ParallelExecutor(2, warn=False).slots == 2


def test_the_interval_is_searched_outward_until_every_draw_passes_below_and_fails_above():
    evaluate, calls = seed_edges_curve({1: 1.4, 2: 1.9, 3: 1.9})  # the full reproduction's homogeneous PD, in shape
    res = capacity.search(evaluate, 2.1, repetitions=3, rel_tol=0.08, max_probes=7)
    runs = {p.rate_rps: [r.seed for r in p.runs] for p in res.probes}
    # 2.1 fails decisively; 1.8 (seed 1 marginal) is decided by the majority at once; the midpoint
    # 1.944 fails 2-0; the bracket is 8% wide; then one step of 1.08^4 below finds a rate where seed 1 passes
    assert runs == {2.1: [1], 1.8: [1, 2, 3], 1.944: [1, 2], 1.323: [1]}
    assert res.lambda_max_rps == 1.8 and res.ci == (1.323, 1.944) and res.runs == 7  # 1.944: both its runs failed


def test_a_pass_whose_queue_trend_is_inconclusive_is_not_decisive():
    # Kendall says the queue grows, the Theil-Sen interval (5 samples) still reaches zero: passed, but repeat it
    base = {"good_fraction": 0.99, "requests_total": 157}
    hint = {"growing": False, "p_value": 0.042, "growth": 19.5, "samples": 5}
    v = capacity.judge({**base, "queue": hint}, 3.328, 1)
    assert v.passed and not v.decisive and v.reason == ""
    assert capacity.judge({**base, "queue": {**hint, "p_value": 0.2}}, 3.328, 1).decisive  # no sign of growth
    assert capacity.judge({**base, "queue": {**hint, "growth": 0.5}}, 3.328, 1).decisive  # less than one request
    assert capacity.judge({**base, "queue": {"growing": False}}, 3.328, 1).decisive  # a flat queue has no p-value
    assert not queue_trend_inconclusive({**hint, "growing": True})  # growing is a fail, not a hint


def test_a_run_flagged_for_timing_fidelity_keeps_its_verdict_and_is_named_in_the_result():
    ok = {"good_fraction": 0.99, "queue": {"growing": False}, "requests_total": 400}
    flagged = {**ok, "fidelity_ok": False, "fidelity_flags": "WAN goodput 0.84 of the configured rate (tolerance >= 0.85)"}
    a, b = capacity.judge(ok, 2.0, 1), capacity.judge(flagged, 2.0, 2)
    assert (a.passed, a.decisive, a.fidelity_flags) == (True, True, "")
    assert (b.passed, b.decisive) == (True, True) and b.fidelity_flags.startswith("WAN goodput 0.84")
    assert capacity.judge({**ok, "fidelity_ok": None}, 2.0, 1).fidelity_flags == ""  # not measured is not flagged
    res = capacity.CapacityResult(2.0, (2.0, None), 2, [capacity.Probe(2.0, [a, b])], bracketed=False)
    doc = res.to_json()
    assert doc["flagged_runs"] == [{"rate_rps": 2.0, "seed": 2, "passed": True, "fidelity_flags": b.fidelity_flags}]
    lines = capacity.flagged_lines(doc["flagged_runs"], "prfaas_pd")
    assert lines[0].startswith("prfaas_pd: timing fidelity flagged for 1 run(s)") and "2 req/s seed 2 (pass): WAN goodput 0.84" in lines[1]
    assert capacity.flagged_lines([]) == []


def test_the_capacity_command_refuses_a_non_finite_or_non_positive_option_before_any_run(tmp_path, capsys) -> None:
    """`--tolerance nan` passed the `> 0` check and started probes; `--start -5` and `--start inf` were tracebacks."""
    from testbed.cli import main

    for opt, bad, why in (("--tolerance", "nan", "is not a number"), ("--tolerance", "inf", "is not a number"),
                          ("--start", "-5", "must be > 0"), ("--start", "inf", "is not a number"),
                          ("--start", "0", "must be > 0"), ("--repetitions", "0", "is not a whole number >= 1"),
                          ("--max-probes", "1.5", "is not a whole number"),
                          # (1 + tol)^2k overflowed a float: an OverflowError traceback once the folder was made
                          ("--tolerance", "1e308", "is more than 1: a bracket's ends a factor of 2 apart is the widest "
                                                   "that places Lambda_max; use 0.001 to 1")):
        with pytest.raises(SystemExit) as exit_:
            main(["capacity", "quick", opt, bad, "--out", str(tmp_path / "c")])
        assert exit_.value.code == 2
        shown = repr(bad) if bad == "1.5" else bad  # text that is not a whole number is quoted, as typed
        assert capsys.readouterr().err.strip() == f"prfaas capacity: error: argument {opt}: {shown} {why}"
    assert not (tmp_path / "c").exists()  # refused before its folder, let alone a run


def test_a_tolerance_finer_than_the_rates_four_digits_stops_instead_of_trying_one_rate_forever():
    """Rates are tried to 4 significant digits: with rel_tol 1e-6 the bracket 3.0 .. 3.001 was bisected at 3.0005,
    which rounds to 3.0, tried already: the loop never ended, with no run (2026-12-07)."""
    import signal

    def hung(*a):
        raise AssertionError("the search tried one rate forever")

    evaluate, calls = fake_curve(3.00005)
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    try:
        res = capacity.search(evaluate, 3.0, repetitions=1, rel_tol=1e-6, max_probes=500)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert res.lambda_max_rps == 3.0 and res.ci[1] == 3.001
    assert capacity.tolerance(0.001) == 0.001
    with pytest.raises(ValueError) as exc:
        capacity.tolerance(0.0001)
    assert str(exc.value) == ("0.0001 is below 0.001: rates are tried to 4 significant digits, 0.01-0.1% apart, so no rate may "
                              "be left between a narrower bracket's ends; use 0.001 or more")


def test_the_capacity_command_plans_at_most_10000_runs_before_its_folder(tmp_path, capsys, monkeypatch) -> None:
    """--repetitions and --max-probes had no bound: a search may try every rate with all its repetitions
    (`capacity.worst_runs`), and --tolerance below the rates' resolution never ended (validation.MAX_RUNS)."""
    from testbed.cli import main

    def must_not_run(*a, **kw):
        raise AssertionError("a refused search must not start")

    monkeypatch.setattr(capacity, "measure_capacity", must_not_run)
    why = "the most runs one command may plan (validation.MAX_RUNS: about a week of one-minute runs)"
    for opts, says in ((["--repetitions", "10001"], f"prfaas capacity: error: argument --repetitions: 10001 is more than 10000, {why}"),
                       (["--max-probes", "10**30"], "prfaas capacity: error: argument --max-probes: '10**30' is not a whole number"),
                       (["--max-probes", str(10**30)], f"prfaas capacity: error: argument --max-probes: a 31-digit number is more "
                                                       f"than 10000, {why}"),
                       (["--tolerance", "1e-6"], "prfaas capacity: error: argument --tolerance: 1e-6 is below 0.001: rates are "
                                                 "tried to 4 significant digits, 0.01-0.1% apart, so no rate may be left between a "
                                                 "narrower bracket's ends; use 0.001 or more"),
                       (["--max-probes", "5000", "--repetitions", "2"], f"prfaas capacity: error: --max-probes 5000 --repetitions 2: up to "
                                                                         f"5006 rates (5000 and 6 outward for the interval) x 2 "
                                                                         f"repetitions make 10012 runs, more than 10000, {why}")):
        try:
            rc = main(["capacity", "quick", *opts, "--out", str(tmp_path / "c")])
        except SystemExit as exc:
            rc = exc.code
        assert rc == 2 and capsys.readouterr().err.strip() == says
    assert capacity.worst_runs(8, 3) == 42 and capacity.check_search_size(1660, 6) == 9996
    assert not (tmp_path / "c").exists()
