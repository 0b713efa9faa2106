"""``prfaas sweep``: a grid of scenario variations (e.g. WAN rate x delay x policy x seed) run one after another.

Each point runs into ``OUT/points/<key=value,...>/``; a point whose run directory loads cleanly is finished
and skipped on the next call, so an interrupted sweep resumes where it stopped. Every point's scenario is
validated before the first run starts. The sweep ends with one comparison report in ``OUT/report.html``.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from testbed.errors import UserError
from testbed.scenario import Scenario
from testbed.sections import load_scenario

Runner = Callable[[Scenario, Path], Path]


@dataclass(frozen=True)
class SweepPoint:
    overrides: tuple[str, ...]  # "key=value" in grid order

    @property
    def name(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.=,+-]", "_", ",".join(self.overrides))


def parse_grid(items: list[str]) -> list[tuple[str, list[str]]]:
    """``["wan.rate=10Gbps,20Gbps", "seed=1,2"]`` -> [("wan.rate", ["10Gbps", "20Gbps"]), ("seed", ["1", "2"])]."""
    if not items:
        raise UserError("sweep: give at least one --grid key=v1,v2,...")
    out = []
    for it in items:
        if "=" not in it:
            raise UserError(f"--grid {it!r}: use key=v1,v2,... e.g. --grid wan.rate=10Gbps,20Gbps")
        key, vals = it.split("=", 1)
        values = [v.strip() for v in vals.split(",") if v.strip()]
        if not key.strip() or not values:
            raise UserError(f"--grid {it!r}: needs a key and at least one value")
        if key.strip() in (k for k, _ in out):
            raise UserError(f"--grid: key {key.strip()!r} given twice")
        out.append((key.strip(), values))
    return out


def expand(grid: list[tuple[str, list[str]]]) -> list[SweepPoint]:
    return [SweepPoint(tuple(f"{k}={v}" for k, v in zip((k for k, _ in grid), combo))) for combo in itertools.product(*(v for _, v in grid))]


def is_finished(point_dir: Path) -> bool:
    from analysis.rundir import load_run

    try:
        load_run(point_dir)
    except UserError:
        return False
    return True


def default_runner(scenario: Scenario, out_dir: Path) -> Path:
    from testbed.run import run_scenario

    return run_scenario(scenario, out_dir)


def run_sweep(scenario: str, grid_items: list[str], out_dir: str | Path, base_overrides: list[str] | None = None,
              runner: Runner | None = None, report: bool = True) -> dict[str, Any]:
    """Run every grid point not yet finished; returns the manifest (also written to ``OUT/sweep.json``)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    grid = parse_grid(grid_items)
    points = expand(grid)
    out = Path(out_dir)
    scenarios = {p.name: load_scenario(scenario, list(base_overrides or []) + list(p.overrides)) for p in points}
    run = runner or default_runner
    manifest: dict[str, Any] = {"scenario": scenario, "grid": dict(grid), "base_overrides": base_overrides or [], "points": {}}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        task = bar.add_task("sweep", total=len(points))
        for p in points:
            pdir = out / "points" / p.name
            if is_finished(pdir):
                manifest["points"][p.name] = {"overrides": list(p.overrides), "status": "skipped (finished before)"}
            else:
                bar.update(task, description=f"running {p.name}")
                if pdir.exists():
                    shutil.rmtree(pdir)  # a partial run of an interrupted sweep
                pdir.parent.mkdir(parents=True, exist_ok=True)
                try:
                    run(scenarios[p.name], pdir)
                    status = "ok" if is_finished(pdir) else "incomplete run directory"
                except UserError as exc:
                    status = f"failed: {exc}"
                manifest["points"][p.name] = {"overrides": list(p.overrides), "status": status}
            bar.advance(task)
    out.mkdir(parents=True, exist_ok=True)
    done = [out / "points" / n for n, v in manifest["points"].items() if v["status"] == "ok" or v["status"].startswith("skipped")]
    if report and done:
        from analysis.report import write_report

        manifest["report"] = str(write_report(done, out))
    (out / "sweep.json").write_text(json.dumps(manifest, indent=2))
    return manifest
