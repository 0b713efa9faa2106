"""``prfaas experiment SPEC.yaml --out DIR``: arms x seeds x repetitions through the engine, then
``DIR/results.parquet`` (one row per run), ``DIR/comparison.json`` (paired bootstrap CIs,
`analysis.stats`) and ``DIR/report.md`` (one sentence per comparison).

Runs go to ``DIR/runs/<arm>/seed<s>-rep<r>/``; a finished run is skipped on the next call (resumable).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from analysis import stats
from experiments.engine import SKIPPED, check_labelled, run_tasks
from experiments.executor import Executor, RunOutcome, RunTask
from experiments.spec import METRICS, ExperimentSpec
from testbed import rundir
from testbed.atomic import make_output_dir, write_json, write_parquet, write_text
from testbed.errors import UserError

RESULTS_FILE = "results.parquet"
COMPARISON_FILE = "comparison.json"
REPORT_FILE = "report.md"
RUN_COLUMNS = ("experiment", "arm", "seed", "repetition", "order", "run_dir", "status", "error", "wall_s", "node")


def flatten(summary: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"ttft_s": {"p50": 1.0}}`` -> ``{"ttft_s.p50": 1.0}``; scalars only (lists are dropped)."""
    out: dict[str, Any] = {}
    for k, v in summary.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        elif v is None or isinstance(v, (bool, int, float, str)):
            out[key] = v
    return out


def results_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per run: `RUN_COLUMNS`, then every summary metric (flattened), for ok and failed runs alike."""
    df = pd.DataFrame(rows)
    for col in RUN_COLUMNS:
        if col not in df:
            df[col] = None
    rest = sorted(c for c in df.columns if c not in RUN_COLUMNS)
    df = df[list(RUN_COLUMNS) + rest]
    for c in rest:  # a column that is numbers in some runs and missing in others stays numeric
        if df[c].map(lambda v: v is None or isinstance(v, (int, float)) and not isinstance(v, bool)).all():
            df[c] = pd.to_numeric(df[c], errors="coerce")
    return df


def run_row(outcome: RunOutcome, out: Path, **labels: Any) -> dict[str, Any]:
    """The results row of one run: its labels, how it went, and its summary when it has one."""
    t = outcome.task
    ok = outcome.status in ("ok", SKIPPED)
    row: dict[str, Any] = {**labels, "run_dir": str(Path(t.out_dir).relative_to(out)) if Path(t.out_dir).is_relative_to(out) else str(t.out_dir),
                           "status": "ok" if ok else "failed", "error": outcome.error, "wall_s": outcome.wall_s or None,
                           "node": outcome.node or None}
    if ok:
        summary = flatten(rundir.read_summary(t.out_dir))
        row.update({k: v for k, v in summary.items() if k not in RUN_COLUMNS})
        row["node"] = row["node"] or summary.get("node")
    return row


def tasks_of(spec: ExperimentSpec, out: Path, executor: Executor | None = None) -> list[tuple[RunTask, dict[str, Any]]]:
    """Every run of the experiment with its labels, in the order they run; every scenario is checked here
    (`engine.check_labelled`, as it will run on `executor`), before anything runs.

    The order is blocked and counterbalanced: one block per (seed, repetition), every arm once in each, in the
    spec's order in the 1st, 3rd, ... block and reversed in the 2nd, 4th, ... So the runs that a comparison
    pairs run next to each other, and over every two blocks each arm's mean position is the same: a drift of
    the host over the experiment (docs/experiments.md, "Run order") falls on every arm alike instead of on
    the arm that ran last. `order` (1, 2, ...) labels each run's place in that plan."""
    tasks = []
    blocks = [(seed, rep) for seed in spec.seeds for rep in range(1, spec.repetitions + 1)]
    for i, (seed, rep) in enumerate(blocks):
        for arm in (spec.arms if i % 2 == 0 else tuple(reversed(spec.arms))):
            overrides = spec.overrides + arm.overrides + (f"seed={seed}",)
            key = f"{arm.name}/seed{seed}-rep{rep}"
            check_labelled(f"arm {arm.name}, seed {seed}", spec.scenario, overrides, out / "runs" / key, executor)
            tasks.append((RunTask(key, spec.scenario, overrides, out / "runs" / key),
                          {"experiment": spec.name, "arm": arm.name, "seed": seed, "repetition": rep,
                           "order": len(tasks) + 1}))
    return tasks


PAIR_KEY = ["seed", "repetition"]  # the runs of two arms that saw the same workload and WAN


def paired(ok: pd.DataFrame, a: str, b: str, *columns: str) -> pd.DataFrame:
    """Arms `a` and `b`'s runs side by side, one row per (seed, repetition) both have: each of `columns` as
    `<column>_a` and `<column>_b`, numbers coerced (a value that is not one becomes NaN)."""
    both = pd.merge(ok[ok["arm"] == a][PAIR_KEY + list(columns)], ok[ok["arm"] == b][PAIR_KEY + list(columns)],
                    on=PAIR_KEY, suffixes=("_a", "_b"))
    for c in both.columns.difference(PAIR_KEY):
        both[c] = pd.to_numeric(both[c], errors="coerce")
    return both


def compare_arms(results: pd.DataFrame, spec: ExperimentSpec) -> list[stats.Comparison]:
    """Every metric of the spec, for every pair of `spec.pairs()`, paired on (seed, repetition)."""
    ok = results[results["status"] == "ok"]
    out = []
    for metric in spec.metrics:
        if metric not in ok:
            continue
        for i, (a, b) in enumerate(spec.pairs()):
            both = paired(ok, a, b, metric)
            out.append(stats.compare(metric, a, b, both[f"{metric}_a"].to_numpy(float), both[f"{metric}_b"].to_numpy(float),
                                     seed=i))
    return out


def order_checks(results: pd.DataFrame, spec: ExperimentSpec) -> list[stats.OrderCheck]:
    """Every metric of every pair of `spec.pairs()`: did the ratio move with which arm ran first in its block
    (`stats.order_check`)? Needs the `order` column; results without it (written before 2026-12-06) give none."""
    ok = results[results["status"] == "ok"]
    if "order" not in ok or ok["order"].isna().any():
        return []
    out = []
    for metric in spec.metrics:
        if metric not in ok:
            continue
        for a, b in spec.pairs():
            both = paired(ok, a, b, metric, "order")
            check = stats.order_check(metric, a, b, both[f"{metric}_a"].to_numpy(float), both[f"{metric}_b"].to_numpy(float),
                                      (both["order_a"] < both["order_b"]).to_numpy(bool))
            if check is not None:
                out.append(check)
    return out


def report_text(spec: ExperimentSpec, results: pd.DataFrame, comparisons: list[stats.Comparison]) -> str:
    n_ok = int((results["status"] == "ok").sum())
    lines = [f"# Experiment {spec.name}", "",
             f"Scenario `{spec.scenario}`; arms {', '.join(a.name for a in spec.arms)}; seeds {list(spec.seeds)}; "
             f"{spec.repetitions} repetition(s); {n_ok} of {len(results)} runs ok.", "",
             f"Paired bootstrap {stats.CONFIDENCE:.0%} confidence intervals of the ratio of means (arm A / arm B), "
             "pairs = runs with the same seed and repetition (analysis/stats.py).", ""]
    few = sorted({c.n for c in comparisons if c.n < stats.FEW_PAIRS})
    if few:
        lines += [f"Note: comparisons with fewer than {stats.FEW_PAIRS} pairs (n = {', '.join(map(str, few))}) have intervals "
                  "that are too narrow (docs/experiments.md, Statistics); read them as indicative only.", ""]
    lines += [f"- {stats.sentence(c, METRICS.get(c.metric))}" for c in comparisons]
    lines += order_lines(order_checks(results, spec))
    lines += fidelity_lines(results)
    failed = results[results["status"] != "ok"]
    if len(failed):
        lines += ["", "Failed runs (left out of the comparisons):"] + [f"- {r.run_dir}: {r.error}" for r in failed.itertuples()]
    return "\n".join(lines) + "\n"


def order_lines(checks: list[stats.OrderCheck]) -> list[str]:
    """The comparisons whose ratio moved with the run order (p < `stats.ORDER_P`), with both sides' ratios."""
    suspected = [c for c in checks if c.suspected]
    if not suspected:
        return []
    return (["", f"Run order: {len(suspected)} of {len(checks)} comparisons changed with which arm ran first in its seed "
             "block (arms alternate, so the mean ratio is balanced, but the runs depend on their order: the host drifted, "
             "or a run left state behind; docs/experiments.md, \"Run order\"):"] + [f"- {c.text()}" for c in suspected])


def fidelity_lines(results: pd.DataFrame) -> list[str]:
    """The runs whose timing fidelity was flagged (testbed.fidelity), with why: their figures may carry
    the host's interference (docs/scale-out.md)."""
    if "fidelity_ok" not in results:
        return []
    flagged = results[(results["status"] == "ok") & (results["fidelity_ok"] == False)]  # noqa: E712 (None = not measured)
    if not len(flagged):
        return []
    return (["", f"Timing fidelity flagged for {len(flagged)} run(s); their figures may include this host's interference "
             "(docs/scale-out.md):"] + [f"- {r.run_dir} (node {r.node}): {r.fidelity_flags}" for r in flagged.itertuples()])


def run_experiment(spec: ExperimentSpec, out_dir: str | Path, executor: Executor | None = None, *,
                   progress: bool = True) -> dict[str, Any]:
    """Run every run not finished yet; write results.parquet, comparison.json and report.md."""
    out = Path(out_dir).resolve()
    labelled = make_output_dir(out, lambda: tasks_of(spec, out, executor))  # every run checked before the folder is made
    outcomes = run_tasks([t for t, _ in labelled], executor, label=f"experiment {spec.name}", progress=progress)
    results = results_frame([run_row(outcomes[t.key], out, **labels) for t, labels in labelled])
    write_parquet(out / RESULTS_FILE, results)
    comparisons = compare_arms(results, spec)
    write_json(out / COMPARISON_FILE, [c.to_json() for c in comparisons], indent=1)
    text = report_text(spec, results, comparisons)
    write_text(out / REPORT_FILE, text)
    if results["status"].eq("ok").sum() == 0:
        raise UserError(f"experiment {spec.name}: every run failed (first: {results['error'].iloc[0]}); see {out / REPORT_FILE}")
    return {"results": out / RESULTS_FILE, "comparison": out / COMPARISON_FILE, "report": out / REPORT_FILE,
            "runs": len(results), "failed": int((results["status"] != "ok").sum()), "text": text}
