"""A confidence interval for Lambda_max from the runs a capacity search already made (no extra runs).

Model (a dose-response curve, the LD50 of toxicology with the arrival rate as the dose): every run is a
Bernoulli trial, pass or fail, with

    logit P(pass | rate) = slope * (log(edge) - log(rate)),   slope >= 0,

so P(pass) falls with the rate and is 1/2 at ``edge``: the rate where a majority of workload draws
passes, the majority rule's edge that ``lambda_max_rps`` approximates from below. The point estimate is
the logistic regression's (statsmodels GLM, Binomial) -b0 / b1 on log(rate), and the 95% interval is the
**profile likelihood** interval of the edge: the edges whose profile deviance

    D(edge) = 2 * (max loglik - max over slope >= 0 of loglik(edge, slope))

is at most the 95% quantile of F(1, runs - 2) (`critical_deviance`; Wilks' chi2(1) = 3.84 is the
large-sample limit, and it under-covers at a search's 4-10 runs: measured, docs/experiments.md). Why
the profile and not Fieller's interval or the delta method: both are Wald intervals that assume the
slope's estimate is normal, which a handful of runs at adaptively chosen rates does not give, and both
are undefined under separation; the profile needs neither, is invariant to whether the edge is
parametrised by its rate or its log, and is defined for every data set, the separated ones included.

Small data:

- **Separation** (every pass at a lower rate than every fail, the usual case of a steep curve): the
  slope's estimate is infinite, every edge in [highest pass, lowest fail] maximises the likelihood and
  ``edge_rps`` is None (with both outcomes at one rate, the edge is that rate). The profile is still
  defined (a finite slope trades the runs on the wrong side of an edge outside the gap against the
  rest), so the interval extends past the gap by what the runs' number and spacing allow, not the gap
  alone, which is no confidence interval (it covered the edge in 25-52% of the synthetic searches);
  with fewer than 6 runs it is unbounded (D is at most 2 * runs * ln 2 there, below the F quantile).
- **One-sided data** (every run passed, or every run failed): no edge; one end of the interval is open
  (None) and ``bracketed`` is False.
- **No decreasing trend** (the fitted slope is <= 0): no edge, both ends open.
- **Paired seeds**: not modelled (docs/experiments.md, "A confidence interval for Lambda_max"): with 3
  seeds, seeds 2-3 run only at marginal rates, neither a seed random effect's variance nor fixed seed
  effects are estimable; a seed effect widens the pooled curve instead (a shallower slope, a wider
  profile), and the synthetic coverage study measures what it costs.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

import numpy as np
from scipy import optimize, special, stats

CONFIDENCE = 0.95
# The profile maximises over log(slope) in this range (slope per unit log rate): e^12 makes a step at
# any rate spacing a search produces (its rates differ by >= 0.01%: 4 significant digits), e^-12 is flat.
LOG_SLOPE_RANGE = (-12.0, 12.0)
LOG_SLOPE_STEP = 0.25
# How far below the lowest rate / above the highest the interval's ends are sought before they count
# as open (the profile's limit there is that of a constant P(pass)).
SEARCH_FACTOR = 1e3


@dataclass(frozen=True)
class EdgeInterval:
    """The dose-response estimate of the rate where P(pass) = 1/2, with its 95% profile-likelihood interval."""

    edge_rps: float | None  # the MLE; None under separation (any rate in [highest pass, lowest fail]) or without an edge
    ci: tuple[float | None, float | None]  # None: that end is open (the data do not bound it)
    slope: float | None  # d logit P(pass) / d log(rate), negated; inf under separation
    runs: int
    separated: bool  # every pass below every fail (ties at one rate included): the slope's MLE is infinite
    bracketed: bool  # both ends of the interval are finite
    method: str  # "profile likelihood" or why there is none
    note: str

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ci"] = list(self.ci)
        if d["slope"] is not None and math.isinf(d["slope"]):
            d["slope"] = None  # JSON has no infinity; `separated` says it
        return d


def _profile_loglik(log_edge: float, x: np.ndarray, s: np.ndarray) -> float:
    """max over slope >= 0 of the log-likelihood with the edge at exp(log_edge); `s` is +1 for a pass,
    -1 for a fail, `x` the log rates. A grid over log(slope) (concave in the slope: one maximum), then
    a bounded Brent search around the best point of the grid."""
    d = s * (log_edge - x)
    grid = np.arange(LOG_SLOPE_RANGE[0], LOG_SLOPE_RANGE[1] + 1e-9, LOG_SLOPE_STEP)
    ll = special.log_expit(np.exp(grid)[:, None] * d[None, :]).sum(axis=1)
    i = int(np.argmax(ll))

    def neg(log_slope: float) -> float:
        return -float(special.log_expit(math.exp(log_slope) * d).sum())

    res = optimize.minimize_scalar(neg, bounds=(grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]), method="bounded",
                                   options={"xatol": 1e-4})
    flat = len(x) * math.log(0.5)  # slope 0: P(pass) = 1/2 everywhere
    return max(-float(res.fun), float(ll[i]), flat)


def critical_deviance(runs: int, confidence: float = CONFIDENCE) -> float:
    """The profile deviance that bounds the interval: the F(1, runs - 2) quantile, the small-sample
    reference for a profile interval of a two-parameter curve, not Wilks' chi2(1) (3.84), which a
    search's 4-10 runs at adaptively chosen rates do not reach: measured on synthetic serving curves,
    the chi2 interval covered the true edge in only 68-93% of trials (docs/experiments.md). Fewer than
    3 runs: infinite (no interval)."""
    return float(stats.f.ppf(confidence, 1, runs - 2)) if runs > 2 else math.inf


def _glm_fit(x: np.ndarray, passed: np.ndarray) -> tuple[float, float, float]:
    """(intercept, slope on log rate, log-likelihood) of the logistic regression (statsmodels)."""
    import statsmodels.api as sm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = sm.GLM(passed.astype(float), sm.add_constant(x, has_constant="add"), family=sm.families.Binomial()).fit()
    b0, b1 = (float(v) for v in fit.params)
    return b0, b1, float(fit.llf)


def edge_interval(rates_rps: Sequence[float], passed: Sequence[bool], confidence: float = CONFIDENCE) -> EdgeInterval:
    """The rate where P(pass) = 1/2 and its profile-likelihood interval, from runs (rate, pass) at any rates."""
    x = np.log(np.asarray(rates_rps, dtype=float))
    y = np.asarray(passed, dtype=bool)
    n = len(x)
    if n == 0:
        return EdgeInterval(None, (None, None), None, 0, False, False, "none", "no runs")
    s = np.where(y, 1.0, -1.0)
    crit = critical_deviance(n, confidence)
    has_pass, has_fail = bool(y.any()), bool((~y).any())
    top_pass = float(x[y].max()) if has_pass else -math.inf
    low_fail = float(x[~y].min()) if has_fail else math.inf
    separated = top_pass <= low_fail
    edge: float | None = None
    slope: float | None
    if not (has_pass and has_fail):
        best, slope = 0.0, None  # the likelihood tends to 1 as the edge leaves the data on the runs' side
        note = f"not bracketed: every run {'passed' if has_pass else 'failed'}"
    elif separated:
        best, slope = 0.0, math.inf
        if top_pass == low_fail:  # quasi-complete: both outcomes at one rate, the step's P(pass) there is their share
            edge, tied = math.exp(top_pass), y[x == top_pass]
            best = float(stats.binom.logpmf(tied.sum(), len(tied), tied.mean()))
            best -= float(np.log(special.comb(len(tied), tied.sum())))
        note = (f"separated: every pass at or below {math.exp(top_pass):.4g} req/s, every fail at or above "
                f"{math.exp(low_fail):.4g}; the slope's estimate is infinite")
    else:
        b0, b1, best = _glm_fit(x, y)
        if b1 >= 0:
            return EdgeInterval(None, (None, None), None, n, False, False, "none",
                                "no decreasing trend: passes are not more frequent at lower rates")
        edge, slope = math.exp(-b0 / b1), -b1
        best = max(best, _profile_loglik(-b0 / b1, x, s))
        note = ""

    def dev(log_edge: float) -> float:
        return 2.0 * (best - _profile_loglik(log_edge, x, s)) - crit

    if edge is not None and separated:  # quasi-complete: the likelihood's sup is at the step whose P(pass) at the tied
        # rate is the share that passed there, an edge a hair off that rate (at the steepest slope the profile tries),
        # not at the rate itself (P = 1/2 there): from there the profile was below the F quantile, a zero-width interval
        centre = top_pass + float(special.logit(np.clip(tied.mean(), 1e-9, 1 - 1e-9))) / math.exp(LOG_SLOPE_RANGE[1])
    elif edge is not None:
        centre = math.log(edge)
    elif has_pass and has_fail:
        centre = 0.5 * (top_pass + low_fail)
    else:
        centre = top_pass if has_pass else low_fail
    span = math.log(SEARCH_FACTOR)

    def end(far: float) -> float | None:
        if dev(far) < 0:
            return None
        if dev(centre) >= 0:  # cannot happen at the MLE or in a gap; a guard for the one-sided centre
            return math.exp(centre)
        return math.exp(optimize.brentq(dev, *sorted((centre, far)), xtol=1e-6))

    lo, hi = end(float(x.min()) - span), end(float(x.max()) + span)
    return EdgeInterval(edge, (lo, hi), slope, n, separated, lo is not None and hi is not None and has_pass and has_fail,
                        "profile likelihood", note)


def runs_of(probes: Iterable[Any]) -> tuple[list[float], list[bool]]:
    """(rates, passed) of every run of a search's probes (`capacity.Probe` objects or their JSON dicts)."""
    rates, passed = [], []
    for p in probes:
        rate = p["rate_rps"] if isinstance(p, dict) else p.rate_rps
        for r in (p["runs"] if isinstance(p, dict) else p.runs):
            rates.append(float(rate))
            passed.append(bool(r["passed"] if isinstance(r, dict) else r.passed))
    return rates, passed


def probes_interval(probes: Iterable[Any], confidence: float = CONFIDENCE) -> EdgeInterval:
    """`edge_interval` over every run of a search (`CapacityResult.probes`, or ``capacity.json``'s ``probes``)."""
    return edge_interval(*runs_of(probes), confidence=confidence)
