"""Paired bootstrap confidence intervals (analysis.stats): coverage of a known effect, significance
and the report's sentences."""

from __future__ import annotations

import numpy as np
import pytest

from analysis import stats


def test_paired_bootstrap_interval_covers_a_known_ratio_at_least_93_percent_of_200_trials():
    covered = 0
    for trial in range(200):
        a, b = stats.synthetic_pairs(np.random.default_rng(1000 + trial), 30, 1.25)
        _, lo, hi, method = stats.paired_ratio_ci(a, b, seed=trial)
        assert method == "bca"
        covered += lo <= 1.25 <= hi
    assert covered / 200 >= 0.93, covered


def test_with_five_pairs_the_expanded_interval_covers_near_its_level_and_rarely_calls_no_effect_significant():
    """At 5 pairs the plain BCa interval covered 81% and called 17% of experiments without an effect significant
    (session 68, these trials); read at `expanded_confidence` it is as wide as a t interval would be."""
    covered = false_alarms = 0
    for trial in range(200):
        a, b = stats.synthetic_pairs(np.random.default_rng(1000 + trial), 5, 1.25)
        _, lo, hi, _ = stats.paired_ratio_ci(a, b, seed=trial)
        covered += lo <= 1.25 <= hi
        false_alarms += stats.compare("m", "A", "B", *stats.synthetic_pairs(np.random.default_rng(90000 + trial), 5, 1.0), seed=trial).significant
    assert covered / 200 >= 0.87 and false_alarms / 200 <= 0.10, (covered, false_alarms)  # 89.5% and 6.5% measured


def test_the_expanded_level_is_a_t_intervals_width_and_tends_to_the_nominal_one():
    assert stats.expanded_confidence(0.95, 5) == pytest.approx(0.99809, abs=1e-5)
    assert stats.expanded_confidence(0.95, 10) == pytest.approx(0.98290, abs=1e-5)
    assert stats.expanded_confidence(0.95, 30) == pytest.approx(0.96249, abs=1e-5)
    assert 0.95 < stats.expanded_confidence(0.95, 1000) < 0.951


def test_pairing_narrows_the_interval_against_treating_runs_as_independent():
    a, b = stats.synthetic_pairs(np.random.default_rng(7), 12, 1.1)
    _, lo, hi, _ = stats.paired_ratio_ci(a, b)
    _, ulo, uhi, _ = stats.paired_ratio_ci(a, np.random.default_rng(3).permutation(b))  # pairs broken
    assert hi - lo < 0.75 * (uhi - ulo)


def test_compare_says_better_worse_or_no_significant_difference():
    rng = np.random.default_rng(5)
    a, b = stats.synthetic_pairs(rng, 20, 1.5)
    c = stats.compare("throughput_rps", "A", "B", a, b)
    assert c.significant and c.ci_low > 1 and c.n == 20
    assert stats.sentence(c, True).startswith("A is better than B on throughput_rps (ratio 1.")
    assert stats.sentence(c, False).startswith("A is worse than B")
    x = np.linspace(1.0, 3.0, 12)
    same = stats.compare("ttft_s.p50", "A", "B", x, x[::-1])  # equal means, pairs in opposite order
    assert not same.significant and "no significant difference" in stats.sentence(same, False)


def test_too_few_pairs_and_identical_ratios_are_handled_without_an_exception():
    c = stats.compare("m", "A", "B", [1.0, np.nan], [2.0, 1.0])
    assert c.n == 1 and c.ci_low is None and not c.significant and c.method == "too few pairs"
    d = stats.compare("m", "A", "B", [2.0, 4.0, 6.0, 8.0, 10.0, 12.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert (d.ratio, d.ci_low, d.ci_high, d.method, d.significant) == (2.0, 2.0, 2.0, "degenerate", True)


def test_a_degenerate_comparison_is_significant_only_when_the_sign_test_of_its_pairs_is():
    """Every pair the same ratio (an arm at 0 in every run: `requests_failed`) was significant from 4 pairs; 4 or 5 pairs
    that all point one way happen under no effect 12.5% and 6.25% of the time (two-sided), so it takes 6."""
    for n, significant in ((4, False), (5, False), (6, True)):
        c = stats.compare("requests_failed", "A", "B", [0.0] * n, [1.0 + i for i in range(n)])
        assert (c.method, c.ratio, c.significant) == ("degenerate", 0.0, significant), n
    assert stats.sign_test_p(6) == pytest.approx(0.03125)
    with pytest.raises(ValueError):
        stats.paired_ratio_ci([1.0, 2.0], [1.0])


def test_two_or_three_pairs_get_no_interval_as_it_would_be_their_range_and_call_half_of_no_effects_significant():
    """With n <= 3 pairs the bootstrap interval is the smallest to the largest pair's ratio, so "significant" meant
    only "every pair points the same way": 2 / 2^n of experiments without any effect."""
    false_positives = {2: 0, 3: 0}
    for n in false_positives:
        for trial in range(100):
            a, b = stats.synthetic_pairs(np.random.default_rng(90_000 + trial), n, 1.0)  # no effect
            c = stats.compare("m", "A", "B", a, b, seed=trial)
            false_positives[n] += c.significant
            assert (c.ci_low, c.ci_high, c.method) == (None, None, "too few pairs") and c.ratio == pytest.approx(a.mean() / b.mean())
    assert false_positives == {2: 0, 3: 0}  # 49 and 28 of 100 before
    same = stats.compare("m", "A", "B", [2.0, 4.0, 6.0], [1.0, 2.0, 3.0])  # three identical ratios: no certainty either
    assert not same.significant and same.method == "too few pairs"
    assert stats.sentence(same, True) == "A vs B on m: no interval (too few pairs, n = 3)"
    four = stats.compare("m", "A", "B", *stats.synthetic_pairs(np.random.default_rng(7), 4, 1.25))
    assert four.method == "bca" and four.ci_low is not None  # from 4 pairs: an interval


def test_an_interval_does_not_depend_on_the_metrics_unit():
    """A metric below ~1e-4 (a p-value, a lateness in seconds) was called "degenerate": a zero-width interval, significant."""
    a, b = stats.synthetic_pairs(np.random.default_rng(4), 12, 1.0)
    ref = stats.compare("m", "A", "B", a, b)
    assert ref.method == "bca" and not ref.significant
    for unit in (1e-4, 1e-6, 1e6):
        c = stats.compare("m", "A", "B", a * unit, b * unit)
        assert (c.method, c.significant) == ("bca", False)
        assert (c.ratio, c.ci_low, c.ci_high) == pytest.approx((ref.ratio, ref.ci_low, ref.ci_high), rel=1e-6)
    small = np.random.default_rng(5).lognormal(0.0, 0.2, 10)
    _, lo, hi, method = stats.mean_ci(small * 1e-9)
    assert method == "bca" and (lo, hi) == pytest.approx(tuple(v * 1e-9 for v in stats.mean_ci(small)[1:3]), rel=1e-6)


def test_a_metric_with_negative_values_gets_no_ratio_rather_than_the_wrong_direction():
    """mean(A) = -2, mean(B) = -1: the ratio is 2, yet A is the lower; it read "A is higher than B"."""
    rng = np.random.default_rng(2)
    a, b = -2.0 * rng.lognormal(0.0, 0.05, 8), -1.0 * rng.lognormal(0.0, 0.05, 8)
    c = stats.compare("queue.growth", "A", "B", a, b)
    assert (c.ratio, c.ci_low, c.ci_high, c.significant, c.method) == (None, None, None, False, "negative values")
    assert c.a == pytest.approx(a.mean()) and c.b == pytest.approx(b.mean())
    assert stats.sentence(c, None) == "A vs B on queue.growth: no interval (negative values, n = 8)"
    assert stats.compare("m", "A", "B", [1.0, 2.0, 0.0, 1.5], [1.0, 1.0, 1.0, 1.0]).method == "bca"  # zeros are fine


def test_a_zero_denominator_nan_and_inf_give_no_interval_without_an_exception():
    c = stats.compare("m", "A", "B", [1.0, 2.0, 1.5, 1.2], [0.0] * 4)
    assert (c.ratio, c.ci_low, c.significant, c.method) == (None, None, False, "B's mean is 0")
    d = stats.compare("m", "A", "B", [1.0, np.nan, np.inf, 2.0, 1.1, 0.9, 1.3], [1.0, 1.0, 1.0, np.inf, 1.0, 1.1, 1.2])
    assert d.n == 4 and d.method == "bca"  # the pairs with a NaN or an infinity are dropped, the rest compared


def test_the_mean_of_per_seed_values_gets_a_bootstrap_interval_that_covers_it_in_most_of_200_trials():
    covered = 0
    for trial in range(200):  # 10 seeds' ratios, lognormal around 0.8: the shape of signals_bench's figures
        x = np.random.default_rng(5000 + trial).lognormal(0.0, 0.2, 10) * 0.8
        m, lo, hi, method = stats.mean_ci(x, seed=trial)
        assert method == "bca" and lo < m < hi
        covered += lo <= 0.8 * np.exp(0.02) <= hi
    assert covered / 200 >= 0.9, covered  # 0.935 measured; BCa on 10 values covers a little under 95%


def test_mean_ci_of_identical_values_is_degenerate_and_bad_input_is_refused():
    assert stats.mean_ci([0.7] * 4) == (pytest.approx(0.7), pytest.approx(0.7), pytest.approx(0.7), "degenerate")
    m, lo, hi, method = stats.mean_ci([1.2])  # one value was a zero-width "interval" that signals_bench judged (hi < 1)
    assert m == 1.2 and np.isnan(lo) and np.isnan(hi) and method == "too few values"
    assert stats.mean_ci([0.5, 0.6, 0.55])[3] == "too few values"
    for bad in ([], [1.0, float("nan")]):
        with pytest.raises(ValueError):
            stats.mean_ci(bad)


def test_the_order_check_sees_a_ratio_that_moves_with_the_run_order_and_nothing_in_noise():
    from analysis.stats import order_check

    rng = np.random.default_rng(3)
    base = rng.lognormal(0.0, 0.3, 12)  # the seeds' shared factor
    first = np.array([True, False] * 6)
    a = base * 1.1 * rng.lognormal(0.0, 0.02, 12)
    b = base * rng.lognormal(0.0, 0.02, 12)
    plain = order_check("m", "a", "b", a, b, first)
    assert plain is not None and not plain.suspected and plain.n_a_first == plain.n_b_first == 6
    # whichever arm runs second in its block reads 1.4x: B when A runs first, A when B does
    moved = order_check("m", "a", "b", a * np.where(first, 1.0, 1.4), b * np.where(first, 1.4, 1.0), first)
    assert moved is not None and moved.suspected and moved.p < 0.01
    assert moved.ratio_a_first == pytest.approx(1.1 / 1.4, rel=0.05) and moved.ratio_b_first == pytest.approx(1.1 * 1.4, rel=0.05)
    assert order_check("m", "a", "b", a[:5], b[:5], first[:5]) is None  # 3 and 2: too few on one side
