"""The engine every multi-run command shares (``prfaas experiment``, ``sweep``, ``capacity``): run the
tasks that are not finished yet through an executor, with a progress bar, and say how each went.

Resumable: a task whose run directory already loads completely (`experiments.runs.is_finished`) is
skipped, so an interrupted experiment continues where it stopped.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from experiments.executor import Executor, RunOutcome, RunTask, SequentialExecutor
from experiments.runs import is_finished

if TYPE_CHECKING:
    from rich.progress import Progress

    from testbed.scenario import Scenario

SKIPPED = "skipped (finished before)"


def progress_bar() -> "Progress":
    """The live bar of multi-run commands: a row per batch of runs, with its count and time."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())


def resolve_scenario_ref(ref: str) -> str:
    """A scenario file as an absolute path (so a task can run from any working directory); a ready
    scenario's name stays a name."""
    p = Path(ref)
    return str(p.resolve()) if p.suffix in (".yaml", ".yml") or p.exists() else ref


def check_run(scenario: str, overrides: Sequence[str], out_dir: Path | None = None) -> "Scenario":
    """The scenario with `overrides`, checked as `prfaas run` checks it before anything starts (the file, then
    `plan_run`: the sections together, and a KV congestion control this host's kernel must set). A multi-run
    command checks every run this way before its first, so a bad arm or grid point is refused in one line
    instead of failing an hour in. A run already finished in `out_dir` (which a resumed batch skips) is
    checked as a file only: it ran, and re-reading it must not depend on this host's kernel. (With
    `--executor ray` the kernel asked is the driver's, not each node's; `scale: auto` is resolved at this host's whole
    capacity, so with `local:N`, whose runs share it, a run can still resolve a larger scale and refuse it.)"""
    from testbed.sections import load_scenario
    from testbed.serving.config import plan_run

    sc = load_scenario(scenario, list(overrides))
    if out_dir is None or not is_finished(out_dir):
        plan_run(sc)
        if sc.scale == "auto":  # resolved as a run alone on this host resolves it (`Network`): its wire rates checked
            from testbed.net.emulation import host_capacity_bps

            sc.resolve_scale(host_capacity_bps()[0])
    return sc


def run_tasks(tasks: Sequence[RunTask], executor: Executor | None = None, *, label: str = "runs",
              progress: "bool | Progress" = True) -> dict[str, RunOutcome]:
    """Run every task not finished before; returns the outcome per task key (skipped ones have status
    `SKIPPED`). `progress`: a bar of its own (True), none (False), or a row in a live `rich` Progress that
    several callers share (callers in other threads: `experiments.reproduce` runs searches at once), removed
    when these tasks are done."""
    from contextlib import nullcontext

    from rich.progress import Progress

    keys = [t.key for t in tasks]
    if len(set(keys)) != len(keys):
        raise ValueError("task keys must be unique")
    outcomes: dict[str, RunOutcome] = {}
    todo = []
    for t in tasks:
        if is_finished(t.out_dir):
            outcomes[t.key] = RunOutcome(task=t, status=SKIPPED, error=None, wall_s=0.0, node="")
        else:
            todo.append(t)
    lock = threading.Lock()
    shared = isinstance(progress, Progress)
    bar = progress if shared else (progress_bar() if progress else None)
    with bar if bar is not None and not shared else nullcontext():
        task_id = bar.add_task(label, total=len(tasks), completed=len(tasks) - len(todo)) if bar is not None else None

        def on_done(outcome: RunOutcome) -> None:
            with lock:
                outcomes[outcome.task.key] = outcome
                if bar is not None:
                    bar.update(task_id, advance=1, description=f"{label}: {outcome.task.key} {outcome.status}")

        try:
            if todo:
                (executor or SequentialExecutor()).run(todo, on_done)
        finally:
            if shared and task_id is not None:
                bar.remove_task(task_id)
    missing = [t.key for t in todo if t.key not in outcomes]
    if missing:
        raise RuntimeError(f"the executor returned without an outcome for {', '.join(missing)}")
    return {k: outcomes[k] for k in keys}
