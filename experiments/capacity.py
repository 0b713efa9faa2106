"""``prfaas capacity SCENARIO``: Lambda_max, the highest Poisson arrival rate the deployment sustains
under its SLOs, measured on the wire.

A run at rate r **passes** when (docs/experiments.md, "Capacity"):

- at least `GOOD_FRACTION` (90%) of its requests are good: ok and within every SLO of the scenario's
  ``serving.slo`` (TTFT and TPOT), as goodput is defined by vLLM's ``bench serve --goodput`` and
  DistServe; failed and unanswered requests count as not good;
- the requests waiting in a queue do not grow over the run (`analysis.metrics.queue_trend`, a trend test);
- it served at least `MIN_REQUESTS` requests and lasted long enough for the trend test (5 queue
  samples after warm-up; a floor on the sample, as MLPerf's loadgen has a minimum query count and
  duration), else it is too short to judge and fails.

The search brackets from the start rate (an exponential search), bisects the bracket (geometric
midpoints), and decides every rate it tries when it first tries it: one run, plus the repetitions
(seeds 1..R shared by every rate: paired) that can still change the majority when that run was not
decisive. A rate passes when the majority of its runs pass. It stops when the bracket is narrower than
`rel_tol`, or after `max_probes` rates. ``lambda_max_rps`` is the highest passing rate; ``ci`` is
[the highest rate at which every repetition passed, the lowest rate at which every repetition failed]:
the boundary of every workload draw lies between (not a bootstrap interval: each probe is a whole
real-time run); the search steps outward until it has both ends. ``ci_dose_response`` is a confidence
interval of the majority's edge from the same runs (`experiments.capacity_ci`: a logistic curve of
pass/fail on log(rate), profile likelihood).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from analysis.metrics import queue_trend_inconclusive
from testbed.serving.early_stop import CONFIDENCE, good_tests
from testbed.serving.early_stop import good_fraction_interval as count_interval

if TYPE_CHECKING:
    from experiments.executor import RunTask

GOOD_FRACTION = 0.9
MIN_REQUESTS = 20
# A bracket wider than the tolerance by less than this share of it is closed: floating-point noise
# (a (1 + tol)^2 bracket bisected at its geometric midpoint is exactly tol wide, give or take 1e-16).
# Rates are rounded to 4 digits (they name run directories), which can leave a bracket wider than that:
# 3.201 .. 3.681 .. 4.234 is 15.02% for a 15% tolerance, 2.822 .. 3.048 is 8.009% for 8%. Such a bracket
# is closed: 1% of the tolerance is the rounding, not the resolution, and one more rate costs 1-3
# whole runs (until 2026-12-01 it was bisected again: ROUNDING was 1e-3).
ROUNDING = 1e-2
# The finest tolerance: 0.1%. Rates are tried to 4 significant digits (they name run directories), two neighbours
# 0.01-0.1% apart, so a bracket narrower than 0.1% may have no rate left between its ends: `--tolerance 0.000001`
# bisected 3.0 .. 3.001 by trying 3.0 again, forever, with no run (2026-12-07). From 0.1% up, a bracket still open
# (wider than the tolerance plus `ROUNDING`) always has a 4-digit rate inside.
MIN_TOLERANCE = 1e-3
# The coarsest tolerance: 1 (100%), a bracket whose ends are a factor of 2 apart; a wider one places Lambda_max nowhere
# in particular, and the search's steps, (1 + tol)^2k, overflowed a float past ~1e154 (`--tolerance 1e308`: an
# OverflowError traceback once the output folder was made, 2026-12-08).
MAX_TOLERANCE = 1.0


@dataclass(frozen=True)
class RunVerdict:
    rate_rps: float
    seed: int
    passed: bool
    good_fraction: float | None
    queue_growing: bool | None
    requests: int
    reason: str  # why it failed ("" when it passed)
    run_dir: str = ""
    decisive: bool = False  # clearly on one side of the boundary: no repetition needed (`is_decisive`)
    fidelity_flags: str = ""  # why the run's timing fidelity was flagged ("" when it was not): reported, not judged


@dataclass
class Probe:
    rate_rps: float
    runs: list[RunVerdict]

    @property
    def passed(self) -> bool:
        return sum(r.passed for r in self.runs) * 2 > len(self.runs)

    @property
    def all_passed(self) -> bool:
        return all(r.passed for r in self.runs)

    @property
    def all_failed(self) -> bool:
        return not any(r.passed for r in self.runs)

    @property
    def settled(self) -> bool:
        """No more runs needed here: one decisive run (`search`)."""
        return len(self.runs) == 1 and self.runs[0].decisive

    def runs_to_decide(self, repetitions: int) -> int:
        """How many more runs (of `repetitions` at most) can still change this rate's majority verdict:
        0 once it is settled, the repetitions are done, or the majority is out of reach of the runs left.
        The fewest that could decide it are asked for: after a marginal fail at 3 repetitions, one more
        run decides a second fail, and only a pass then needs the third."""
        if self.settled:
            return 0
        passes = sum(r.passed for r in self.runs)
        fails = len(self.runs) - passes
        left = repetitions - len(self.runs)
        need_pass = repetitions // 2 + 1 - passes  # a strict majority of the repetitions
        need_fail = (repetitions + 1) // 2 - fails  # a tie (even repetitions) is a fail
        if left <= 0 or need_pass <= 0 or need_fail <= 0:
            return 0
        return min(need_pass, need_fail, left)


@dataclass
class CapacityResult:
    lambda_max_rps: float
    ci: tuple[float, float | None]
    runs: int
    probes: list[Probe] = field(default_factory=list)
    bracketed: bool = True  # False: even the lowest rate tried failed, or the highest passed

    def to_json(self) -> dict[str, Any]:
        from experiments.capacity_ci import probes_interval

        return {"lambda_max_rps": self.lambda_max_rps, "ci": list(self.ci), "runs": self.runs, "bracketed": self.bracketed,
                "ci_dose_response": probes_interval(self.probes).to_json(),
                "flagged_runs": [{"rate_rps": r.rate_rps, "seed": r.seed, "passed": r.passed, "fidelity_flags": r.fidelity_flags}
                                 for p in self.probes for r in p.runs if r.fidelity_flags],
                "probes": [{"rate_rps": p.rate_rps, "passed": p.passed, "runs": [asdict(r) for r in p.runs]} for p in self.probes]}


def judge(summary: dict[str, Any], rate_rps: float, seed: int, run_dir: str = "") -> RunVerdict:
    """A run's verdict from its summary.json (`GOOD_FRACTION`, the queue trend, `MIN_REQUESTS`)."""
    good = summary.get("good_fraction")  # (`rundir.read_summary` checked the types: a fraction, NaN or None)
    good = None if good is None or math.isnan(good) else good
    growing = (summary.get("queue") or {}).get("growing")
    n = int(summary.get("requests_total") or 0)
    reasons = []
    if n < MIN_REQUESTS:
        reasons.append(f"only {n} requests (< {MIN_REQUESTS}): run longer")
    if good is None:
        reasons.append("no SLO figures in the summary")
    elif good < GOOD_FRACTION:
        reasons.append(f"{good:.0%} good (< {GOOD_FRACTION:.0%})")
    stopped = summary.get("early_stop")
    if stopped:
        reasons.insert(0, str(stopped))
    if growing:
        reasons.append("the requests waiting in a queue grow over the run")
    elif growing is None and not stopped:
        reasons.append("too short to test the queue's trend (fewer than 5 queue samples after warm-up): run longer")
    passed = not reasons
    flags = str(summary.get("fidelity_flags") or "unknown") if summary.get("fidelity_ok") is False else ""
    return RunVerdict(rate_rps, seed, passed, good, growing, n, "; ".join(reasons), run_dir,
                      is_decisive(passed, good, n, growing, bool(stopped), queue_trend_inconclusive(summary.get("queue"))
                                  or (summary.get("queue") or {}).get("cut_exact") is False),
                      fidelity_flags=flags)


def flagged_lines(flagged: Sequence[dict[str, Any]], name: str = "") -> list[str]:
    """Lines that name a search's runs whose timing fidelity was flagged (``flagged_runs``): their verdicts
    stand (a flag is reported, not judged), but they may carry the host's interference (docs/scale-out.md,
    "Timing fidelity"), as in `prfaas experiment`'s report."""
    if not flagged:
        return []
    who = f"{name}: " if name else ""
    return [f"{who}timing fidelity flagged for {len(flagged)} run(s); their verdicts may include this host's interference "
            "(docs/scale-out.md):"] + [f"  {r['rate_rps']:.4g} req/s seed {r['seed']} ({'pass' if r['passed'] else 'fail'}): "
                                       f"{r['fidelity_flags']}" for r in flagged]


def good_fraction_interval(good_fraction: float, requests: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Clopper-Pearson interval of a run's good fraction (its requests as binomial trials); the client's
    drain cut reads the same interval (`testbed.serving.early_stop.good_tests`)."""
    return count_interval(int(round(good_fraction * requests)), requests, confidence)


def is_decisive(passed: bool, good: float | None, requests: int, growing: bool | None, stopped: bool,
                inconclusive: bool = False) -> bool:
    """Is one run enough at this rate? A run stopped early has certainly failed. Otherwise the good
    fraction's 95% binomial interval must lie wholly on the run's side of `GOOD_FRACTION` (MLPerf's early
    stopping bounds its tail estimate the same way), and a pass needs a queue that does not grow; a run
    that fails only because its queue grows while its SLOs still hold is at the edge (marginal), and so
    is a pass whose queue trend is `inconclusive` (`queue_trend_inconclusive`): the quick reproduction with
    paced compute passed two configurations above the model's fluid bound on 5-6 samples with Kendall p
    0.006-0.042 and 12-20 requests of growth (docs/analysis.md, docs/experiments.md rule 3). `judge` also passes
    a trend whose drain cut the records cannot show exact (``queue.cut_exact`` false) as `inconclusive`."""
    if stopped:
        return True
    if good is None or requests < MIN_REQUESTS:
        return False
    _, above, below = good_tests(int(round(good * requests)), requests, GOOD_FRACTION)  # the tests the drain cut keeps
    if passed:
        return above and growing is False and not inconclusive
    return below


Evaluate = Callable[[float, Sequence[int]], list[RunVerdict]]


def search(evaluate: Evaluate, start_rps: float, *, repetitions: int = 3, rel_tol: float = 0.1, max_probes: int = 10,
           min_rps: float = 0.01, max_rps: float = 1e4, parallel: int = 1) -> CapacityResult:
    """Bracket from `start_rps`, bisect, then bound the interval; `evaluate(rate, seeds)` runs one run
    per seed at `rate`.

    Every rate is decided when it is first tried: one run (seed 1), and when that run is not decisive
    (`is_decisive`), the repetitions that can still change its majority (seeds 2..R, shared by every
    rate: paired; `Probe.runs_to_decide`). So the bracket never moves on a verdict that a repetition
    would overturn: a marginal fail of one unlucky draw does not send the bisection below the edge,
    where every further rate would be marginal again.

    Bracketing takes growing steps: (1 + rel_tol)^2, then ^4, ^6, ... away from the start, so a start
    within (1 + rel_tol)^2 of the edge (the throughput model's prediction) brackets it with two rates
    and needs one bisection, and a start m steps off costs m + 1 rates and about log2(2m) bisections.
    Bisection (geometric midpoints) continues until (hi - lo) / lo <= rel_tol, or `max_probes` rates.
    Then the interval's ends: when no rate at or below the edge passed in every run (or none above it
    failed in every run), the search steps outward from the bracket, (1 + rel_tol)^4, then ^6, ... (at
    most `INTERVAL_STEPS` rates a side), until one did: the interval bounds the spread over workload
    draws and does not need the edge's resolution. `parallel` (the executor's slots): up to that many
    of a rate's runs are asked for at once.
    """
    probes: dict[float, Probe] = {}

    def probe(rate: float) -> Probe:
        rate = float(f"{rate:.4g}")
        p = probes.setdefault(rate, Probe(rate, []))
        while (n := p.runs_to_decide(repetitions) if p.runs else 1) > 0:
            have = {r.seed for r in p.runs}
            todo = [s for s in range(1, max(repetitions, 1) + 1) if s not in have]
            p.runs.extend(evaluate(rate, todo[:max(n, parallel)]))
        return p

    lo: float | None = None
    hi: float | None = None
    r, k = start_rps, 1
    while len(probes) < max_probes:  # bracket: growing steps
        step = (1 + rel_tol) ** (2 * k)
        if probe(r).passed:
            lo = r
            if hi is not None or r * step > max_rps:
                break
            r *= step
        else:
            hi = r
            if lo is not None or r / step < min_rps:
                break
            r /= step
        k += 1
    if lo is None or hi is None:
        best = max((p.rate_rps for p in probes.values() if p.passed), default=0.0)
        return _result(probes, best, bracketed=False)
    lo, hi = _bracket(probes)
    while hi is not None and (hi - lo) / lo > rel_tol * (1 + ROUNDING) and len(probes) < max_probes:
        tried = len(probes)
        probe(math.sqrt(lo * hi))
        lo, hi = _bracket(probes)
        if len(probes) == tried:  # the midpoint rounds to an end (`MIN_TOLERANCE`): nothing is left to try
            break
    _bound_interval(probes, probe, lo, hi, rel_tol, min_rps, max_rps)
    return _result(probes, lo, bracketed=hi is not None and lo > 0)


INTERVAL_STEPS = 3  # rates a side to find the interval's end (steps (1 + tol)^4, ^6, ^8: down to 0.54x)


def tolerance(v: Any) -> float:
    """A search's relative tolerance (``--tolerance``): a number from `MIN_TOLERANCE` to `MAX_TOLERANCE`."""
    from testbed.validation import positive_number

    x = positive_number(v)
    if x < MIN_TOLERANCE:
        raise ValueError(f"{v!r} is below {MIN_TOLERANCE:g}: rates are tried to 4 significant digits, 0.01-0.1% apart, so "
                         f"no rate may be left between a narrower bracket's ends; use {MIN_TOLERANCE:g} or more")
    if x > MAX_TOLERANCE:
        raise ValueError(f"{v!r} is more than {MAX_TOLERANCE:g}: a bracket's ends a factor of 2 apart is the widest that "
                         f"places Lambda_max; use {MIN_TOLERANCE:g} to {MAX_TOLERANCE:g}")
    return x


def worst_runs(max_probes: int, repetitions: int) -> int:
    """The most runs a search makes: each rate it may try (`max_probes`, then `INTERVAL_STEPS` a side outward for the
    interval) with all of its repetitions."""
    return (max_probes + 2 * INTERVAL_STEPS) * repetitions


def check_search_size(max_probes: int, repetitions: int) -> int:
    """`worst_runs`, refused (ValueError, `validation.planned_runs`) past `validation.MAX_RUNS`."""
    from testbed.validation import planned_runs

    return planned_runs(worst_runs(max_probes, repetitions), f"up to {max_probes + 2 * INTERVAL_STEPS} rates ({max_probes} and "
                        f"{2 * INTERVAL_STEPS} outward for the interval) x {repetitions} repetitions")


def _bound_interval(probes: dict[float, Probe], probe: Callable[[float], Probe], lo: float, hi: float | None,
                    rel_tol: float, min_rps: float, max_rps: float) -> None:
    """Step outward from the bracket until a rate at or below `lo` passed in every run and one above it
    failed in every run (`_result`'s interval), `INTERVAL_STEPS` rates a side at most."""
    for k in range(2, 2 + INTERVAL_STEPS):
        if any(p.all_passed for r, p in probes.items() if r <= lo):
            break
        r = min(x for x, p in probes.items() if x <= lo and p.passed) / (1 + rel_tol) ** (2 * k)
        if r < min_rps:
            break
        probe(r)
    for k in range(2, 2 + INTERVAL_STEPS):
        if hi is None or any(p.all_failed for r, p in probes.items() if r > lo):
            break
        r = max(x for x, p in probes.items() if x > lo and not p.passed) * (1 + rel_tol) ** (2 * k)
        if r > max_rps:
            break
        probe(r)


def _bracket(probes: dict[float, Probe]) -> tuple[float, float | None]:
    """Highest passing rate below the lowest failing rate above it."""
    passing = sorted(r for r, p in probes.items() if p.passed)
    lo = passing[-1] if passing else 0.0
    failing = sorted(r for r, p in probes.items() if not p.passed and r > lo)
    return lo, failing[0] if failing else None


def _result(probes: dict[float, Probe], lam: float, bracketed: bool) -> CapacityResult:
    all_pass = [r for r, p in probes.items() if p.all_passed and r <= lam]
    all_fail = [r for r, p in probes.items() if p.all_failed and r > lam]
    ci = (max(all_pass, default=0.0), min(all_fail, default=None))
    return CapacityResult(lam, ci, sum(len(p.runs) for p in probes.values()),
                          sorted(probes.values(), key=lambda p: p.rate_rps), bracketed)


# ------------------------------------------------------------------------------------- on the wire


def rate_override(rate_rps: float) -> str:
    return f"workload.arrivals.rate={rate_rps:.6g}/s"


def check_scenario(scenario: str, overrides: Sequence[str], executor: Any = None) -> Any:
    """The scenario, refused unless a run would take it (`check_run`, as it will run on `executor`: ``scale: auto``
    at a run's share of the host under ``local:N``) and its arrivals are a Poisson process (the rate is what the
    search sets)."""
    from experiments.engine import check_run
    from testbed.errors import UserError
    from traffic.arrivals import Poisson

    sc = check_run(scenario, list(overrides) + [rate_override(1.0)], executor=executor)
    wl = sc.section("workload")
    if not isinstance(getattr(wl, "arrivals", None), Poisson) or wl.arrivals.steps:
        raise UserError("workload.arrivals: prfaas capacity needs {process: poisson, rate: ...} without steps "
                        "(the search sets the rate)")
    stop_below = sc.section("serving").slo.stop_below
    if stop_below is not None and stop_below != GOOD_FRACTION:  # the early stop and the drain cut keep judge's verdict at its bar only
        raise UserError(f"serving.slo.stop_below: {stop_below:g}; prfaas capacity judges at {GOOD_FRACTION:g} and sets it "
                        "itself (leave it unset, or use --no-early-stop)")
    return sc


def probe_task(ref: str, overrides: Sequence[str], out: Path, rate: float, seed: int) -> "RunTask":
    """The run of a search at `rate` with `seed`, into ``OUT/probes/rate=R/seedS``: R is the rate to 4 significant
    digits, and the run is given that rate, so its folder's name says exactly what it ran (`check_resume` rebuilds
    the task from the name). `ref`: the scenario (`engine.resolve_scenario_ref`); `overrides`: the search's
    (`capacity_overrides`)."""
    from experiments.executor import RunTask

    name = f"rate={rate:.4g}"
    return RunTask(f"{name}/seed{seed}", ref, tuple(overrides) + (rate_override(float(name[5:])), f"seed={seed}"),
                   out / "probes" / name / f"seed{seed}")


def wire_evaluator(scenario: str, overrides: Sequence[str], out: Path, executor: Any = None, progress: Any = True,
                   label: str = "capacity") -> Evaluate:
    """`evaluate` that really runs: one run per seed at the rate (`probe_task`), through the experiment engine
    (resumable under ``OUT/probes/``), judged from each run's summary. `progress`: as `experiments.engine.run_tasks`'s;
    `label` names the progress row."""
    from experiments.engine import resolve_scenario_ref, run_tasks
    from testbed import rundir

    ref = resolve_scenario_ref(scenario)

    def evaluate(rate: float, seeds: Sequence[int]) -> list[RunVerdict]:
        tasks = [probe_task(ref, overrides, out, rate, s) for s in seeds]
        outcomes = run_tasks(tasks, executor, label=f"{label} {rate:.4g} req/s", progress=progress)
        verdicts = []
        for t, s in zip(tasks, seeds):
            o = outcomes[t.key]
            if o.status == "failed":
                verdicts.append(RunVerdict(rate, s, False, None, None, 0, f"run failed: {o.error}", str(t.out_dir)))
            else:
                verdicts.append(judge(rundir.read_summary(t.out_dir), rate, s, str(t.out_dir)))
        return verdicts

    return evaluate


def _named_rate(name: str) -> float | None:
    """The rate of a ``rate=R`` folder as `probe_task` names it; None for any other name (no search reads it)."""
    try:
        rate = float(name.removeprefix("rate="))
    except ValueError:
        return None
    return rate if name == f"rate={rate:.4g}" else None


def check_resume(out: str | Path, scenario: str, overrides: Sequence[str]) -> int:
    """Every run a search of `scenario` with `overrides` (the search's: `capacity_overrides`) resumed in `out` may read,
    checked now as the experiment engine checks a run it skips (`experiments.engine.finished_tasks`) -- which it does
    only when the search reaches the run's rate, hours of runs in (and in `prfaas reproduce`, after other
    configurations' searches). Each run's task is rebuilt from its folder's name (``OUT/probes/rate=R/seedS``:
    `probe_task`), so one `UserError` before the first run refuses a finished run that no longer loads, a file or a
    link to nowhere where a run's folder (or ``OUT``, ``probes``, a rate's folder) goes, and a finished run whose
    task.json records other settings (another ``--set``, ``--quick`` against full, an edited scenario file). Folders
    named otherwise are passed over: no search reads them. Returns the finished runs found."""
    import os
    import re

    from experiments.engine import finished_tasks, resolve_scenario_ref
    from testbed.errors import UserError

    out, ref, tasks = Path(out), resolve_scenario_ref(scenario), []
    probes = out / "probes"
    try:
        for folder in (out, probes):
            if os.path.lexists(folder) and not folder.is_dir():
                raise UserError(f"{folder}: not a folder, where a capacity search's runs go; move it aside (or use another --out)")
        for folder in sorted(probes.iterdir()) if probes.is_dir() else []:
            rate = _named_rate(folder.name)
            if rate is None:
                continue
            if not folder.is_dir():
                raise UserError(f"{folder}: not a folder, where the runs of a rate go; move it aside (or use another --out)")
            tasks += [probe_task(ref, overrides, out, rate, int(run.name[4:])) for run in sorted(folder.iterdir())
                      if re.fullmatch(r"seed(0|[1-9][0-9]*)", run.name)]
        return len(finished_tasks(tasks))
    except OSError as exc:  # a folder that cannot be listed
        raise UserError(f"{exc.filename or out}: cannot read this folder ({exc.strerror or exc})") from None


def model_start_rps(sc: Any) -> float:
    """Where the search starts: the throughput model's Lambda_max for the scenario's policy, or the
    scenario's own rate when the model cannot say."""
    from analysis import throughput_model as tm
    from testbed.errors import UserError

    try:
        cm, _, dist, _ = tm.cluster_model_from_scenario(sc)
        name = sc.section("policy").name
        if name in ("homogeneous-pd", "all-local"):
            return float(tm.homogeneous_pd(cm, dist).lambda_max)
        if name == "naive-heterogeneous":
            return float(tm.naive_heterogeneous(cm, dist).lambda_max)
        return float(tm.search_prfaas_pd(cm, dist, step_tokens=256).lambda_max)
    except (UserError, ValueError, AttributeError):
        return float(sc.section("workload").arrivals.rate_rps)


def capacity_overrides(overrides: Sequence[str], early_stop: bool = True) -> list[str]:
    """The overrides every run of a search gets: the caller's, after early stopping (``serving.slo.stop_below``
    = `GOOD_FRACTION`) unless it is off. Anything that runs beside a search (`experiments.capacity_paired`)
    uses the same, so its runs are judged alike and land beside the search's."""
    return ([f"serving.slo.stop_below={GOOD_FRACTION}"] if early_stop else []) + list(overrides)


def measure_capacity(scenario: str, overrides: Sequence[str], out: str | Path, *, repetitions: int = 3, rel_tol: float = 0.1,
                     max_probes: int = 8, start_rps: float | None = None, executor: Any = None, progress: Any = True,
                     early_stop: bool = True, parallel: int | None = None, label: str = "capacity",
                     checked: Any = None) -> dict[str, Any]:
    """Lambda_max of `scenario` with `overrides`, measured; the --json document of ``prfaas capacity``.
    `early_stop`: every probe ends as soon as it cannot pass (``serving.slo.stop_below`` = `GOOD_FRACTION`).
    `parallel`: the runs of a rate asked for at once (`search`; default: the executor's slots), less where
    other searches share the executor (`experiments.reproduce`); `progress` and `label` as `wire_evaluator`'s.
    `checked`: what `check_scenario` gave for this scenario, these overrides and `executor`, when the caller
    checked it and the runs already in `out` (`check_resume`) before it made the output folder, as the CLI and
    `reproduce` do; without it both are checked here, before the first run."""
    overrides = capacity_overrides(overrides, early_stop)
    if checked is None:
        sc = check_scenario(scenario, overrides, executor)
        check_resume(out, scenario, overrides)
    else:
        sc = checked
    start = start_rps or model_start_rps(sc)
    res = search(wire_evaluator(scenario, overrides, Path(out), executor, progress, label), start, repetitions=repetitions,
                 rel_tol=rel_tol, max_probes=max_probes, parallel=parallel or getattr(executor, "slots", 1))
    slo = sc.section("serving").slo
    return {**res.to_json(), "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "good_fraction": GOOD_FRACTION,
                                     "min_requests": MIN_REQUESTS, "early_stop": slo.stop_below is not None},
            "scenario": {"name": sc.name, "source": scenario, "overrides": list(overrides)}, "start_rps": start,
            "units": "emulated (requests/s are the same on the wire)"}
