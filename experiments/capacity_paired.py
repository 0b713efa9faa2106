"""Which of two deployments sustains more load, paired by workload draw (docs/experiments.md, "Paired order").

Two capacity searches give each configuration an interval that holds the spread of its edge over workload
draws (`experiments.capacity`: every run passed below, every run failed above). A draw that is heavy for
one configuration is usually heavy for the other too (the case study's seed 1 asks 1.7x the prefill work
in its second half: measured, docs/analysis.md), so two configurations a few percent apart can have
overlapping intervals although, draw by draw, one sustains more than the other. Claims are paired here as
everywhere else (docs/experiments.md): both configurations run at one rate on the same seeds (the same
arrivals and prompts), and only the seeds where exactly one of them passes say anything about the order:

- ``higher_only``: the configuration measured higher passes and the other fails;
- ``lower_only``: the reverse.

Under the null hypothesis that neither sustains more, each such discordant seed is a fair coin:
McNemar's exact test, a two-sided binomial test of ``higher_only`` of ``higher_only + lower_only`` at 1/2
(`scipy.stats.binomtest`). Concordant seeds (both pass, both fail) carry no information on the order.
With every discordant seed on one side, 6 are needed for p < 0.05 (p = 2 / 2^n: 0.0625 at 5, 0.031 at 6),
so fewer than `MIN_SEEDS` are refused. Draws heavy for both configurations are concordant whatever the
order, so a clear order is found with probability P(Binomial(N, 1 - c) >= 6) for a share c of them:
~0.9 at N = 10 with c = 1/4 (docs/experiments.md, "How many seeds").

The seeds are **fresh**: the searches that measured the two Lambda_max, and so named which is higher,
ran seeds 1..R; the test runs R + 1 .. R + N (`fresh_seeds`). On the searches' own draws a configuration
that happened to suit them would be favoured twice, once in being named higher and again in the test
(with 3 of 6 seeds reused, up to 4x the test's false-positive rate).

The rate is the geometric mean of the two measured Lambda_max (`paired_rate`): between the two edges,
where a run of the lower configuration should fail and one of the higher should pass if they differ; at
either configuration's own Lambda_max one of the two is marginal by construction. (Measured: when the
searches' draws are heavier than typical, both edges on fresh draws lie above it and many seeds pass
both; docs/experiments.md, "Paired order".) Each run is judged exactly as the search judges it
(`capacity.judge`), with the search's overrides (early stop included), and lands beside the search's runs
(``OUT/<configuration>/probes/rate=R/seedS``), so an interrupted test resumes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

from experiments.capacity import RunVerdict
from testbed.validation import MAX_RUNS, MAX_SEED, run_count

Evaluate = Callable[[float, Sequence[int]], list[RunVerdict]]
ALPHA = 0.05
MIN_SEEDS = 6  # the fewest seeds with which the two-sided exact test can reach p < ALPHA (2 / 2^6 = 0.031)


def check_seed_count(n: int) -> None:
    """Refuse a seed count with which no order could ever be significant (ValueError naming the floor)."""
    if n < MIN_SEEDS:
        raise ValueError(f"{n} seeds: at least {MIN_SEEDS} (with fewer, McNemar's exact test cannot reach p < {ALPHA} "
                         "even when every seed is discordant)")


def paired_seed_count(v: Any) -> int:
    """The ``--paired N`` of `prfaas reproduce` and of benchmarks/experiments_bench.py (one reader, so both refuse
    alike, as one line naming the option): 0, the default, runs no paired test (as omitting the option does, and as
    vLLM's ``--num-warmups 0`` runs no warm-up); else a seed count from `MIN_SEEDS` (`check_seed_count`) to
    `validation.MAX_RUNS` (`validation.run_count`). 1 to 5 are refused: with them no order can be significant."""
    if v == 0 and isinstance(v, int) and not isinstance(v, bool):
        return 0
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{v!r} is not a seed count; use 0 (no paired test) or {MIN_SEEDS} to {MAX_RUNS} seeds")
    try:
        check_seed_count(v)
    except ValueError as exc:
        raise ValueError(f"{exc}; or 0 for no paired test") from None
    return run_count(v)


def fresh_seeds(search_repetitions: int, n: int, first: int | None = None) -> list[int]:
    """Seeds the searches did not run (they ran 1..`search_repetitions`): `n` of them from `first` (default
    the next one). A second test of the same pair starts after the seeds of the first (`--paired-from`): new
    draws, not the first test extended; still a second look, judged with the first at ALPHA / 2
    (docs/experiments.md, "A second test of the same pair")."""
    check_seed_count(n)
    first = search_repetitions + 1 if first is None else first
    if first <= search_repetitions:
        raise ValueError(f"first seed {first}: the searches ran seeds 1..{search_repetitions}; a paired test needs "
                         f"seeds they did not run (from {search_repetitions + 1})")
    if first + n - 1 > MAX_SEED:
        raise ValueError(f"seeds {first}..{first + n - 1}: a seed is at most {MAX_SEED} (2**32 - 1, `validation.MAX_SEED`); "
                         f"start at {MAX_SEED - n + 1} or lower")
    return list(range(first, first + n))


def paired_rate(lambda_low_rps: float, lambda_high_rps: float) -> float:
    """The rate both configurations run at: the geometric mean of their Lambda_max, to 4 digits (the
    digits a probe's run directory is named with)."""
    if not (lambda_low_rps > 0 and lambda_high_rps > 0):
        raise ValueError(f"Lambda_max {lambda_low_rps!r}, {lambda_high_rps!r}: both must be > 0")
    return float(f"{math.sqrt(lambda_low_rps * lambda_high_rps):.4g}")


@dataclass(frozen=True)
class PairedOrder:
    higher: str  # the configuration with the higher measured Lambda_max
    lower: str
    rate_rps: float
    seeds: list[int]
    higher_passed: list[bool]
    lower_passed: list[bool]
    higher_only: int  # seeds where the higher passes and the lower fails
    lower_only: int  # the reverse
    p_value: float | None  # McNemar's exact test, two-sided (None: no discordant seed)
    significant: bool  # p < ALPHA and the higher passes more often: the order holds, paired
    reversed: bool  # p < ALPHA and the lower passes more often: paired runs contradict the searches' order
    higher_runs: list[dict[str, Any]]
    lower_runs: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def sentence(self) -> str:
        """The result in words, as the experiment report says it."""
        n = self.higher_only + self.lower_only
        where = f"at {self.rate_rps:.4g} req/s on {len(self.seeds)} shared seeds"
        if n == 0:
            return f"{self.higher} vs {self.lower} {where}: no seed where exactly one passed, so no order can be read"
        verdict = (f"{self.higher} sustains more than {self.lower}" if self.significant
                   else f"{self.lower} sustains more than {self.higher}, against the searches' order" if self.reversed
                   else f"no significant difference between {self.higher} and {self.lower}")
        return (f"{verdict} {where}: only {self.higher} passed on {self.higher_only}, only {self.lower} on "
                f"{self.lower_only} (McNemar exact p = {self.p_value:.3g})")


def mcnemar_exact(higher_only: int, lower_only: int) -> float | None:
    """Two-sided exact McNemar p-value of the discordant counts (None when there are none)."""
    from scipy.stats import binomtest

    n = higher_only + lower_only
    return None if n == 0 else float(binomtest(higher_only, n, 0.5, alternative="two-sided").pvalue)


def paired_order(evaluate_higher: Evaluate, evaluate_lower: Evaluate, rate_rps: float, seeds: Sequence[int],
                 names: tuple[str, str] = ("higher", "lower")) -> PairedOrder:
    """Run both configurations at `rate_rps` on `seeds` and test the order; `names` = (higher, lower)."""
    seeds = [int(s) for s in seeds]
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds {seeds!r}: give at least one, none twice")
    hi, lo = evaluate_higher(rate_rps, seeds), evaluate_lower(rate_rps, seeds)
    if [v.seed for v in hi] != seeds or [v.seed for v in lo] != seeds:
        raise ValueError("an evaluator returned verdicts for other seeds than it was asked")
    hp, lp = [v.passed for v in hi], [v.passed for v in lo]
    b = sum(h and not l for h, l in zip(hp, lp))
    c = sum(l and not h for h, l in zip(hp, lp))
    p = mcnemar_exact(b, c)
    apart = p is not None and p < ALPHA
    return PairedOrder(names[0], names[1], rate_rps, seeds, hp, lp, b, c, p, apart and b > c, apart and c > b,
                       [asdict(v) for v in hi], [asdict(v) for v in lo])
