"""``prfaas capacity SCENARIO``: Lambda_max, the highest Poisson arrival rate the deployment sustains
under its SLOs, measured on the wire.

A run at rate r **passes** when (docs/experiments.md, "Capacity"):

- at least `GOOD_FRACTION` (90%) of its requests are good: ok and within every SLO of the scenario's
  ``serving.slo`` (TTFT and TPOT), as goodput is defined by vLLM's ``bench serve --goodput`` and
  DistServe; failed and unanswered requests count as not good;
- the requests in flight do not grow over the run (`analysis.metrics.queue_trend`, a trend test);
- it served at least `MIN_REQUESTS` requests and lasted long enough for the trend test (5 in-flight
  samples after warm-up; a floor on the sample, as MLPerf's loadgen has a minimum query count and
  duration), else it is too short to judge and fails.

The search brackets (doubling or halving from the start rate, one run per rate), then bisects the
bracket (geometric midpoints) with `repetitions` runs per rate, seeds 1..R shared by every rate (paired);
a rate passes when the majority of its repetitions pass. It stops when the bracket is narrower than
`rel_tol` or after `max_probes` rates. ``lambda_max_rps`` is the highest passing rate; ``ci`` is
[the highest rate at which every repetition passed, the lowest rate at which every repetition failed]:
the boundary lies between (not a bootstrap interval: each probe is a whole real-time run).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

GOOD_FRACTION = 0.9
MIN_REQUESTS = 20


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


@dataclass
class CapacityResult:
    lambda_max_rps: float
    ci: tuple[float, float | None]
    runs: int
    probes: list[Probe] = field(default_factory=list)
    bracketed: bool = True  # False: even the lowest rate tried failed, or the highest passed

    def to_json(self) -> dict[str, Any]:
        return {"lambda_max_rps": self.lambda_max_rps, "ci": list(self.ci), "runs": self.runs, "bracketed": self.bracketed,
                "probes": [{"rate_rps": p.rate_rps, "passed": p.passed, "runs": [asdict(r) for r in p.runs]} for p in self.probes]}


def judge(summary: dict[str, Any], rate_rps: float, seed: int, run_dir: str = "") -> RunVerdict:
    """A run's verdict from its summary.json (`GOOD_FRACTION`, the queue trend, `MIN_REQUESTS`)."""
    good = summary.get("good_fraction")
    growing = (summary.get("queue") or {}).get("growing")
    n = int(summary.get("requests_total") or 0)
    reasons = []
    if n < MIN_REQUESTS:
        reasons.append(f"only {n} requests (< {MIN_REQUESTS}): run longer")
    if good is None:
        reasons.append("no SLO figures in the summary")
    elif good < GOOD_FRACTION:
        reasons.append(f"{good:.0%} good (< {GOOD_FRACTION:.0%})")
    if growing:
        reasons.append("requests in flight grow over the run")
    elif growing is None:
        reasons.append("too short to test the queue's trend (fewer than 5 in-flight samples after warm-up): run longer")
    return RunVerdict(rate_rps, seed, not reasons, good, growing, n, "; ".join(reasons), run_dir)


Evaluate = Callable[[float, Sequence[int]], list[RunVerdict]]


def search(evaluate: Evaluate, start_rps: float, *, repetitions: int = 2, rel_tol: float = 0.1, max_probes: int = 10,
           min_rps: float = 0.01, max_rps: float = 1e4) -> CapacityResult:
    """Bracket from `start_rps`, then bisect; `evaluate(rate, seeds)` runs one run per seed at `rate`."""
    probes: dict[float, Probe] = {}

    def probe(rate: float, reps: int) -> Probe:
        rate = float(f"{rate:.4g}")
        p = probes.setdefault(rate, Probe(rate, []))
        have = {r.seed for r in p.runs}
        todo = [s for s in range(1, reps + 1) if s not in have]
        if todo:
            p.runs.extend(evaluate(rate, todo))
        return p

    lo: float | None = None
    hi: float | None = None
    r = start_rps
    while len(probes) < max_probes:  # bracket: one run per rate
        if probe(r, 1).passed:
            lo = r
            if hi is not None or r * 2 > max_rps:
                break
            r *= 2
        else:
            hi = r
            if lo is not None or r / 2 < min_rps:
                break
            r /= 2
    if lo is None or hi is None:
        best = max((p.rate_rps for p in probes.values() if p.passed), default=0.0)
        return _result(probes, best, bracketed=False)
    probe(lo, repetitions)  # the bracket's ends get their repetitions too
    probe(hi, repetitions)
    lo, hi = _bracket(probes)
    while hi is not None and lo > 0 and (hi - lo) / lo > rel_tol and len(probes) < max_probes:
        mid = math.sqrt(lo * hi)
        probe(mid, repetitions)
        lo, hi = _bracket(probes)
    return _result(probes, lo, bracketed=hi is not None and lo > 0)


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


def check_scenario(scenario: str, overrides: Sequence[str]) -> Any:
    """The scenario, refused unless its arrivals are a Poisson process (the rate is what the search sets)."""
    from testbed.errors import UserError
    from testbed.sections import load_scenario
    from traffic.arrivals import Poisson

    sc = load_scenario(scenario, list(overrides) + [rate_override(1.0)])
    wl = sc.section("workload")
    if not isinstance(getattr(wl, "arrivals", None), Poisson) or wl.arrivals.steps:
        raise UserError("workload.arrivals: prfaas capacity needs {process: poisson, rate: ...} without steps "
                        "(the search sets the rate)")
    return sc


def wire_evaluator(scenario: str, overrides: Sequence[str], out: Path, executor: Any = None, progress: bool = True) -> Evaluate:
    """`evaluate` that really runs: one run per seed at the rate, through the experiment engine (resumable
    under ``OUT/probes/``), judged from each run's summary."""
    from experiments.engine import resolve_scenario_ref, run_tasks
    from experiments.executor import RunTask
    from testbed import rundir

    ref = resolve_scenario_ref(scenario)

    def evaluate(rate: float, seeds: Sequence[int]) -> list[RunVerdict]:
        tasks = [RunTask(f"rate={rate:.4g}/seed{s}", ref, tuple(overrides) + (rate_override(rate), f"seed={s}"),
                         out / "probes" / f"rate={rate:.4g}" / f"seed{s}") for s in seeds]
        outcomes = run_tasks(tasks, executor, label=f"capacity {rate:.4g} req/s", progress=progress)
        verdicts = []
        for t, s in zip(tasks, seeds):
            o = outcomes[t.key]
            if o.status == "failed":
                verdicts.append(RunVerdict(rate, s, False, None, None, 0, f"run failed: {o.error}", str(t.out_dir)))
            else:
                verdicts.append(judge(rundir.read_summary(t.out_dir), rate, s, str(t.out_dir)))
        return verdicts

    return evaluate


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


def measure_capacity(scenario: str, overrides: Sequence[str], out: str | Path, *, repetitions: int = 2, rel_tol: float = 0.1,
                     max_probes: int = 8, start_rps: float | None = None, executor: Any = None, progress: bool = True) -> dict[str, Any]:
    """Lambda_max of `scenario` with `overrides`, measured; the --json document of ``prfaas capacity``."""
    sc = check_scenario(scenario, overrides)
    start = start_rps or model_start_rps(sc)
    res = search(wire_evaluator(scenario, overrides, Path(out), executor, progress), start, repetitions=repetitions,
                 rel_tol=rel_tol, max_probes=max_probes)
    slo = sc.section("serving").slo
    return {**res.to_json(), "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "good_fraction": GOOD_FRACTION,
                                     "min_requests": MIN_REQUESTS},
            "scenario": {"name": sc.name, "source": scenario, "overrides": list(overrides)}, "start_rps": start,
            "units": "emulated (requests/s are the same on the wire)"}
