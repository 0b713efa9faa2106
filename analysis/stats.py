"""Comparisons with confidence: paired bootstrap confidence intervals of a ratio of means (scipy), and the
sentence a report prints for each.

Arms of an experiment share seeds, so run i of arm A and run i of arm B saw the same workload and WAN
schedule: the unit of resampling is the pair, not the run (`scipy.stats.bootstrap(..., paired=True)`).
The ratio is mean(A) / mean(B) over the pairs; its 95% interval is BCa (bias-corrected and
accelerated), or the percentile interval where BCa is undefined (very few pairs). A difference is
significant when the interval excludes 1. Below `MIN_PAIRS` pairs (or values) there is no interval, and a
ratio needs values of at least 0 (docs/experiments.md, "Statistics").
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
from scipy import stats as sps

CONFIDENCE = 0.95
RESAMPLES = 2000
# Fewer pairs (or values, `mean_ci`): no interval at all. With n <= 3 a resample repeats one pair with probability
# n^(1 - n) (1, 1/2, 1/9), above the 2.5% tail, so the interval's ends are the smallest and largest pair's value and
# "significant" means only that every pair points the same way: under no effect 2 / 2^n of experiments (50%, 25%;
# measured 49% and 28% of 200 trials). From 4 pairs the resamples' tails are finer than 2.5%.
MIN_PAIRS = 4
FEW_PAIRS = 10  # below this the bootstrap interval is measurably too narrow (docs/experiments.md, Statistics)


@dataclass(frozen=True)
class Comparison:
    """One metric, arm A against arm B (the keys of comparison.json)."""

    metric: str
    arm_a: str
    arm_b: str
    a: float | None  # mean of A over the pairs
    b: float | None
    ratio: float | None  # a / b
    ci_low: float | None
    ci_high: float | None
    n: int  # pairs with both values finite
    significant: bool
    method: str  # "bca", "percentile", "degenerate" (every pair has the same ratio), "too few pairs", "B's mean is 0" or "negative values"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _ratio_of_means(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(a, axis=axis) / np.mean(b, axis=axis)


def _same(u: np.ndarray, v: np.ndarray) -> bool:
    """Equal up to floating-point rounding, at any scale (np.allclose's default absolute 1e-8 called every value of a
    metric below ~1e-4, a p-value or a lateness in seconds, the same)."""
    return bool(np.allclose(u, v, rtol=1e-12, atol=0.0))


def expanded_confidence(confidence: float, n: int) -> float:
    """The level at which to read a bootstrap interval of `n` values so that it is as wide as a t interval of level
    `confidence` would be: the bootstrap's resamples spread like the values' plug-in deviation, sqrt((n-1)/n) of the
    sample standard deviation, with normal, not Student's t, tails, so it is too narrow with few values (Hesterberg's
    "expanded percentile interval", The American Statistician 69(4), 2015: z' = sqrt(n/(n-1)) t_{n-1}). At 5 values
    the 95% interval is read at 99.8%, at 10 at 98.3%, at 30 at 96.2%."""
    if n < 2:
        return confidence
    t = float(sps.t.ppf(0.5 + confidence / 2, n - 1))
    return float(1.0 - 2.0 * sps.norm.sf(math.sqrt(n / (n - 1)) * t))


def _bootstrap(data: tuple[np.ndarray, ...], statistic: Any, *, paired: bool, confidence: float, resamples: int,
               seed: int) -> tuple[float, float, str]:
    """(low, high, method) of `scipy.stats.bootstrap`: BCa, or the percentile interval where BCa is undefined
    (very few values); NaNs and "failed" when neither gives a finite interval."""
    rng = np.random.default_rng(seed)
    confidence = expanded_confidence(confidence, len(data[0]))
    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # scipy warns on degenerate resamples; we check the interval instead
            res = sps.bootstrap(data, statistic, paired=paired, vectorized=True, confidence_level=confidence,
                                n_resamples=resamples, method=method, random_state=rng)
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
        if math.isfinite(lo) and math.isfinite(hi):
            return lo, hi, method.lower()
    return float("nan"), float("nan"), "failed"


def paired_ratio_ci(a: Sequence[float], b: Sequence[float], *, confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
                    seed: int = 0) -> tuple[float, float, float, str]:
    """(mean(a) / mean(b), low, high, method) with a paired bootstrap interval. `a[i]` and `b[i]` are one pair."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError("a and b must be 1-D and of equal length (one value per pair)")
    if len(x) < MIN_PAIRS:
        raise ValueError(f"need at least {MIN_PAIRS} pairs, got {len(x)}")
    ratio = float(_ratio_of_means(x, y))
    if _same(x * y.mean(), y * x.mean()):  # every pair gives the same ratio: no spread to resample
        return ratio, ratio, ratio, "degenerate"
    lo, hi, method = _bootstrap((x, y), _ratio_of_means, paired=True, confidence=confidence, resamples=resamples, seed=seed)
    return ratio, lo, hi, method


def mean_ci(x: Sequence[float], *, confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
            seed: int = 0) -> tuple[float, float, float, str]:
    """(mean, low, high, method): the mean of `x` with a bootstrap interval, one value per seed (e.g. each
    seed's ratio or difference of two arms, so the seed is the unit resampled). BCa, or the percentile
    interval where BCa is undefined; "degenerate" when every value is the same; NaNs and "too few values" with
    fewer than `MIN_PAIRS`."""
    a = np.asarray(x, dtype=float)
    if a.ndim != 1 or not len(a) or not np.isfinite(a).all():
        raise ValueError("x must be a non-empty 1-D sequence of finite values (one per seed)")
    m = float(a.mean())
    if len(a) < MIN_PAIRS:
        return m, float("nan"), float("nan"), "too few values"
    if _same(a, np.full_like(a, a[0])):
        return m, m, m, "degenerate"
    lo, hi, method = _bootstrap((a,), np.mean, paired=False, confidence=confidence, resamples=resamples, seed=seed)
    return m, lo, hi, method


def compare(metric: str, arm_a: str, arm_b: str, a: Sequence[float], b: Sequence[float], *, seed: int = 0) -> Comparison:
    """A against B on `metric` from paired values (pairs with a missing or non-finite value are dropped). A ratio
    of means says which arm is higher only for values of at least 0 (two negative means of ratio 2 have A the
    lower), so a metric with a value below 0 gets no ratio ("negative values")."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    n = int(len(x))
    mean_a = float(x.mean()) if n else None
    mean_b = float(y.mean()) if n else None
    if (x < 0).any() or (y < 0).any():
        return Comparison(metric, arm_a, arm_b, mean_a, mean_b, None, None, None, n, False, "negative values")
    if n < MIN_PAIRS or not mean_b:
        ratio = mean_a / mean_b if n and mean_b else None
        return Comparison(metric, arm_a, arm_b, mean_a, mean_b, ratio, None, None, n, False,
                          "too few pairs" if n < MIN_PAIRS else "B's mean is 0")
    ratio, lo, hi, method = paired_ratio_ci(x, y, seed=seed)
    ok = math.isfinite(lo) and math.isfinite(hi)
    significant = bool(ok and (lo > 1.0 or hi < 1.0))
    if method == "degenerate":  # every pair the same ratio: nothing to resample, so judge the n pairs by the sign test
        significant = significant and sign_test_p(n) < 1.0 - CONFIDENCE
    return Comparison(metric, arm_a, arm_b, mean_a, mean_b, ratio, lo if ok else None, hi if ok else None, n, significant,
                      method)


def sign_test_p(n: int) -> float:
    """Two-sided p of n pairs that all point the same way under no effect (scipy's exact binomial test): 2 / 2^n. A
    "degenerate" comparison (every pair the same ratio, e.g. an arm whose value is 0 in every run) was significant from
    4 pairs, its interval [r, r]; the sign test needs 6 (p = 0.031)."""
    return float(sps.binomtest(n, n, 0.5).pvalue)


def synthetic_pairs(rng: np.random.Generator, n: int, effect: float) -> tuple[np.ndarray, np.ndarray]:
    """n paired runs with a known ratio of means: a shared run-to-run factor (a seed's workload, log-normal 0.3) and
    independent noise per arm (log-normal 0.15); E[a] / E[b] == `effect` exactly. The generator of every coverage
    figure in docs/experiments.md ("Statistics"), of `tests/unit/test_stats.py` and `experiments_bench.py --stats-only`."""
    x = rng.lognormal(0.0, 0.3, n) * 2.0
    return effect * x * rng.lognormal(0.0, 0.15, n), x * rng.lognormal(0.0, 0.15, n)


def coverage(pairs: int, trials: int = 200, effect: float = 1.25) -> float:
    """The share of `trials` seeded experiments of `pairs` synthetic pairs (`synthetic_pairs`, trial t drawn from seed
    1000 + t) whose `paired_ratio_ci` covers the true ratio `effect`."""
    hit = 0
    for t in range(trials):
        a, b = synthetic_pairs(np.random.default_rng(1000 + t), pairs, effect)
        _, lo, hi, _ = paired_ratio_ci(a, b, seed=t)
        hit += lo <= effect <= hi
    return hit / trials


def sentence(c: Comparison, higher_is_better: bool | None) -> str:
    """"A is better than B on M (ratio r, 95% CI [lo, hi])" or "no significant difference"; for a metric
    without a direction, "A is higher/lower than B"."""
    if c.ratio is None or c.ci_low is None or c.ci_high is None:
        return f"{c.arm_a} vs {c.arm_b} on {c.metric}: no interval ({c.method}, n = {c.n})"
    ci = f"ratio {c.ratio:.3g}, {CONFIDENCE:.0%} CI [{c.ci_low:.3g}, {c.ci_high:.3g}], n = {c.n}"
    if not c.significant:
        return f"{c.arm_a} vs {c.arm_b} on {c.metric}: no significant difference ({ci})"
    a_higher = c.ci_low > 1.0
    if higher_is_better is None:
        return f"{c.arm_a} is {'higher' if a_higher else 'lower'} than {c.arm_b} on {c.metric} ({ci})"
    better = a_higher == higher_is_better
    return f"{c.arm_a} is {'better' if better else 'worse'} than {c.arm_b} on {c.metric} ({ci})"


ORDER_MIN_PAIRS = 3  # pairs needed on each side of an order check (fewer: no test)
ORDER_P = 0.05


@dataclass(frozen=True)
class OrderCheck:
    """Whether the paired ratio A / B moved with which arm ran first in its block (docs/experiments.md, "Run order")."""

    metric: str
    arm_a: str
    arm_b: str
    ratio_a_first: float  # mean(a) / mean(b) over the pairs where A ran first
    n_a_first: int
    ratio_b_first: float
    n_b_first: int
    p: float  # two-sided Mann-Whitney U of the pairs' log ratios, A first against B first

    @property
    def suspected(self) -> bool:
        return self.p < ORDER_P

    def text(self) -> str:
        return (f"{self.arm_a} / {self.arm_b} on {self.metric} was {self.ratio_a_first:.3g} when {self.arm_a} ran first "
                f"(n = {self.n_a_first}) and {self.ratio_b_first:.3g} when {self.arm_b} ran first (n = {self.n_b_first}); "
                f"Mann-Whitney p = {self.p:.2g}")


def order_check(metric: str, arm_a: str, arm_b: str, a: Sequence[float], b: Sequence[float],
                a_first: Sequence[bool]) -> OrderCheck | None:
    """The paired values of A and B split by which ran first; None with fewer than `ORDER_MIN_PAIRS` usable pairs
    (finite, positive) on either side. A run order that changes the result (the host drifting over the
    experiment, a run leaving state behind for the next) shows as a difference between the two sides; in a
    counterbalanced plan it cancels in the mean ratio but widens its interval."""
    x, y, first = np.asarray(a, dtype=float), np.asarray(b, dtype=float), np.asarray(a_first, dtype=bool)
    keep = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    x, y, first = x[keep], y[keep], first[keep]
    if first.sum() < ORDER_MIN_PAIRS or (~first).sum() < ORDER_MIN_PAIRS:
        return None
    log_ratio = np.log(x / y)
    p = float(sps.mannwhitneyu(log_ratio[first], log_ratio[~first], alternative="two-sided").pvalue)
    return OrderCheck(metric, arm_a, arm_b, float(x[first].mean() / y[first].mean()), int(first.sum()),
                      float(x[~first].mean() / y[~first].mean()), int((~first).sum()), p)
