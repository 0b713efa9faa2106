"""``prfaas sweep``: a grid of scenario variations (e.g. WAN rate x delay x policy x seed).

Each point runs into ``OUT/points/<key=value,...>/`` (`SweepPoint.name`) through the experiment engine (`experiments.engine`,
any executor); a point whose run directory loads cleanly is finished and skipped on the next call, so an
interrupted sweep resumes where it stopped. Every point's scenario is validated before the first run
starts. The sweep ends with one comparison report in ``OUT/report.html`` and ``OUT/results.parquet``
(one row per point, the same form as an experiment's, `experiments.experiment.results_frame`).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.engine import SKIPPED, check_labelled, resolve_scenario_ref, run_tasks
from experiments.executor import Executor, RunTask
from testbed.atomic import make_output_dir, write_json, write_parquet
from testbed.errors import UserError
from testbed.validation import MAX_NAME_BYTES, comma_list, planned_runs


HASH_CHARS = 16  # hex digits of a long point name's hash (64 bits)


@dataclass(frozen=True)
class SweepPoint:
    overrides: tuple[str, ...]  # "key=value" in grid order

    @property
    def name(self) -> str:
        """The point's folder name under OUT/points/: its overrides joined with ',', every other character than
        letters, digits and ``_.=,+-`` as '_'. One longer than `validation.MAX_NAME_BYTES` (a long grid's: the folder
        was an OSError "File name too long" at the first run) keeps its first bytes and ends in '~' and a hash of
        the full overrides, which sweep.json keeps beside it; a name that fits is as it always was, so a sweep begun
        before still finds its points."""
        name = re.sub(r"[^A-Za-z0-9_.=,+-]", "_", ",".join(self.overrides))  # ASCII: one byte a character
        if len(name) <= MAX_NAME_BYTES:
            return name
        digest = hashlib.sha256("\n".join(self.overrides).encode("utf-8", "surrogatepass")).hexdigest()[:HASH_CHARS]
        return f"{name[:MAX_NAME_BYTES - HASH_CHARS - 1]}~{digest}"  # '~' is never in a name that fits


def parse_grid(items: list[str]) -> list[tuple[str, list[str]]]:
    """``["wan.rate=10Gbps,20Gbps", "seed=1,2"]`` -> [("wan.rate", ["10Gbps", "20Gbps"]), ("seed", ["1", "2"])]."""
    if not items:
        raise UserError("give at least one --grid key=v1,v2,...")
    out = []
    for it in items:
        if "=" not in it:
            raise UserError(f"--grid {it!r}: use key=v1,v2,... e.g. --grid wan.rate=10Gbps,20Gbps")
        key, vals = (x.strip() for x in it.split("=", 1))
        if not key:
            raise UserError(f"--grid {it!r}: needs a key and at least one value")
        values = comma_list(vals, f"--grid {key}")  # `seed=1,,2` ran seeds 1 and 2 without a word
        if key in (k for k, _ in out):
            raise UserError(f"--grid: key {key!r} given twice")
        if len(set(values)) < len(values):  # two points with the same overrides would be one run directory
            twice = next(v for v in values if values.count(v) > 1)
            raise UserError(f"--grid {it!r}: value {twice!r} given twice")
        out.append((key, values))
    try:  # before the points are listed: a grid of 10^10 points was built whole
        planned_runs(math.prod(len(v) for _, v in out), " x ".join(f"{len(v)} {k} values" for k, v in out))
    except ValueError as exc:
        raise UserError(f"--grid: {exc}; use fewer values") from None
    return out


def expand(grid: list[tuple[str, list[str]]]) -> list[SweepPoint]:
    """Every point of the grid, in order; two whose folder names are one (values that differ only in characters a name
    turns into '_', such as 'a/b' and 'a_b') are refused: one run directory would hold both."""
    points = [SweepPoint(tuple(f"{k}={v}" for k, v in zip((k for k, _ in grid), combo))) for combo in itertools.product(*(v for _, v in grid))]
    seen: dict[str, SweepPoint] = {}
    for p in points:
        other = seen.setdefault(p.name, p)
        if other is not p:
            raise UserError(f"--grid: points {','.join(other.overrides)!r} and {','.join(p.overrides)!r} would share the folder "
                            f"points/{p.name}; give values that differ in letters, digits or _.=+-")
    return points


def run_sweep(scenario: str, grid_items: list[str], out_dir: str | Path, base_overrides: list[str] | None = None,
              executor: Executor | None = None, report: bool = True) -> dict[str, Any]:
    """Run every grid point not yet finished; returns the manifest (also written to ``OUT/sweep.json``)."""
    grid = parse_grid(grid_items)
    points = expand(grid)
    out = Path(out_dir)
    checked = make_output_dir(out, lambda: [check_labelled(f"grid point {','.join(p.overrides)}", scenario, list(base_overrides or []) + list(p.overrides),
                                                           out / "points" / p.name, executor) for p in points])  # every point is checked before anything runs, or its folder is made
    ref = resolve_scenario_ref(scenario)
    tasks = [RunTask(p.name, ref, tuple(base_overrides or []) + p.overrides, out / "points" / p.name) for p in points]
    outcomes = run_tasks(tasks, executor, label="sweep")
    manifest: dict[str, Any] = {"scenario": scenario, "grid": dict(grid), "base_overrides": base_overrides or [], "points": {}}
    for p in points:
        o = outcomes[p.name]
        status = o.status if o.status in ("ok", SKIPPED) else f"failed: {o.error}"
        manifest["points"][p.name] = {"overrides": list(p.overrides), "status": status}
    from experiments.experiment import RESULTS_FILE, results_frame, run_row

    # the sweep is named by its scenario's name (the first point's, should --grid vary it), as `prfaas run` names its run
    # directory: the file's stem, used before, was unchecked -- a name that is not UTF-8 text failed results.parquet's
    # write after every run
    rows = [run_row(outcomes[p.name], out.resolve(), experiment=f"sweep {checked[0].name}", arm=p.name, order=i + 1,
                    **{f"grid.{k}": v.split("=", 1)[1] for k, v in zip((k for k, _ in grid), p.overrides)}) for i, p in enumerate(points)]
    write_parquet(out / RESULTS_FILE, results_frame(rows))
    manifest["results"] = str(out / RESULTS_FILE)
    done = [out / "points" / n for n, v in manifest["points"].items() if v["status"] in ("ok", SKIPPED)]
    if report and done:
        from analysis.report import write_report

        manifest["report"] = str(write_report(done, out))
    write_json(out / "sweep.json", manifest, indent=2)
    return manifest
