"""The engine every multi-run command shares (``prfaas experiment``, ``sweep``, ``capacity``): run the
tasks that are not finished yet through an executor, with a progress bar, and say how each went.

Resumable: a task whose run directory already loads completely (`experiments.runs.is_finished`) is
skipped, so an interrupted experiment continues where it stopped. What a resume does with what it finds
(docs/experiments.md, "Resuming"): a run interrupted before its summary is run again; a finished run that no
longer loads, a file where a run directory goes, and a finished run of other settings than its task's
(`rundir.TASK_FILE`, or its scenario.yaml where it has none) are refused before anything runs, and left as they
are. Every multi-run command reads every run it will skip through one function, `finished_tasks`, before its first
new run: `run_tasks` for the tasks it is given, `experiments.capacity.check_resume` for every run of an earlier
search in ``--out``.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from experiments.executor import Executor, RunOutcome, RunTask, SequentialExecutor
from testbed import rundir, units
from testbed.atomic import writable_dir
from testbed.errors import FieldError, UserError
from testbed.validation import path_exists

if TYPE_CHECKING:
    from rich.progress import Progress

    from testbed.scenario import Scenario

SKIPPED = "skipped (finished before)"
FINISHED, TO_RUN = "finished", "to run"


def run_state(out_dir: str | Path) -> str:
    """`FINISHED` when `out_dir` holds a complete run directory; `TO_RUN` when it holds nothing, or a run that
    stopped before its summary was written (the executor removes it and runs it again). A finished run (its
    summary.json is there) that no longer loads -- a damaged file, a run of an older testbed -- and a file (or a
    link to nowhere) where a run directory goes are a `UserError` naming them: they are never removed (before 2026-12-07 a resumed
    experiment deleted such a run and ran it again)."""
    p = Path(out_dir)
    if not path_exists(p) and not os.path.lexists(p):
        return TO_RUN
    if not p.is_dir():  # a file, or a link to nowhere (its run failed at mkdir, and the search read that as a failed rate)
        what = "a link to nowhere" if not path_exists(p) else "not a folder"
        raise UserError(f"{p}: {what}, where this run's directory goes; move it aside (or use another --out)")
    try:
        rundir.load_run_dir(p)
    except UserError as exc:
        if not os.path.lexists(p / rundir.SUMMARY_FILE):  # (a link to nowhere, or a loop, is "there": kept)
            return TO_RUN
        raise UserError(f"{p}: a finished run (it has its {rundir.SUMMARY_FILE}) that no longer loads: {exc}. It is left as "
                        "it is: move it aside (or delete it) to run it again, or use another --out") from None
    return FINISHED


def _as_json(data: Any) -> Any:
    """`data` as JSON reads it back (keys sorted, a value JSON has no type for as its text): the form both sides of a
    settings comparison take."""
    return json.loads(json.dumps(data, default=str, sort_keys=True))


def task_settings(task: RunTask) -> dict[str, Any] | None:
    """What `task` runs: its scenario's data with its overrides (as JSON reads it back), or None where the
    scenario does not load (the run fails and says why)."""
    from testbed.sections import load_scenario

    try:
        raw = load_scenario(task.scenario, list(task.overrides)).raw
    except UserError:
        return None
    return _as_json(raw)


def scenario_as_run(task: RunTask, ran: dict[str, Any]) -> dict[str, Any]:
    """The scenario.yaml a run of `task` writes (`testbed.runner.run`: the scenario's data with the task's overrides,
    its scale and the serving plan's choices written out), as JSON reads it back, to compare with `ran`, the
    scenario.yaml of a finished run that has no task.json. The serving plan needs no host; ``scale: auto`` is taken
    as `ran` resolved it (a task.json records ``auto``, whatever the host resolved)."""
    from testbed.runner.run import resolved_scenario
    from testbed.sections import load_scenario
    from testbed.serving.config import plan_serving

    sc = load_scenario(task.scenario, list(task.overrides))
    raw = resolved_scenario(sc, plan_serving(sc), None if sc.scale == "auto" else float(sc.scale)).raw
    return _as_json({**raw, "scale": ran.get("scale")} if sc.scale == "auto" else raw)


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    """`d`'s leaves by dotted key; an empty mapping is a leaf of its own (flattened away, a key that one side had as
    ``{}`` and the other lacked made a difference no key named)."""
    if not isinstance(d, dict) or (not d and prefix):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def check_same_task(task: RunTask, settings: dict[str, Any] | None) -> None:
    """A finished run skipped for `task` must have run what the task asks: a resume with another spec, other overrides
    or an edited scenario file into the same --out otherwise reported the old runs as the new settings' (until
    2026-12-07). Compared with the run's task.json (`rundir.TASK_FILE`) where it has one; a run without one (run
    alone, interrupted between its summary and its task.json, or from before them) is compared by its scenario.yaml,
    the scenario as it ran, with what a run of the task writes there now (`scenario_as_run`; until 2026-12-07 it was
    taken as it was). A run of other settings is a `UserError` naming it and the first settings that differ."""
    if settings is None:
        return
    record = rundir.read_task(task.out_dir)
    if record is not None:
        was, now, read = record["settings"], settings, ""
    else:
        was = _as_json(rundir.read_run_scenario(task.out_dir))
        now, read = scenario_as_run(task, was), f"; read from its {rundir.SCENARIO_FILE}, as it has no {rundir.TASK_FILE}"
    if was == now:
        return
    was, now = _flat(was), _flat(now)
    diff = [k for k in sorted(set(was) | set(now)) if k not in was or k not in now or was[k] != now[k]]

    def side(d: dict[str, Any], k: str) -> str:
        return repr(d[k]) if k in d else "nothing"  # a key one side lacks, told from a null it has

    shown = "; ".join(f"{k}: {side(was, k)} there, {side(now, k)} now" for k in diff[:3]) + ("; ..." if len(diff) > 3 else "")
    raise UserError(f"{task.out_dir}: holds a finished run of other settings than this one asks for ({shown}{read}); "
                    "use another --out, or move that run aside to run it again")


def finished_tasks(tasks: Sequence[RunTask]) -> list[RunTask]:
    """The tasks whose run directory holds a finished run (`run_state`), each checked to have run what its task asks
    (`check_same_task`: by its task.json, or by its scenario.yaml where it has none): a damaged run, a file where a
    run goes, or a run of other settings is a `UserError` naming it, raised before anything runs and with nothing
    removed."""
    done = []
    for t in tasks:
        if run_state(t.out_dir) == FINISHED:
            check_same_task(t, task_settings(t))
            done.append(t)
    return done


def progress_bar() -> "Progress":
    """The live bar of multi-run commands: a row per batch of runs, with its count and time."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())


def resolve_scenario_ref(ref: str) -> str:
    """A scenario file as an absolute path (so a task can run from any working directory); a ready
    scenario's name stays a name."""
    p = Path(ref)
    return str(p.resolve()) if p.suffix in (".yaml", ".yml") or p.exists() else ref


def check_labelled(label: str, scenario: str, overrides: Sequence[str], out_dir: Path | None = None,
                   executor: Executor | None = None) -> "Scenario":
    """`check_run` of one run of a multi-run command, whose refusal begins with `label` (``arm prfaas, seed 1``, ``grid
    point wan.rate=nan``): the field alone named the scenario file, not which arm or grid point set the value."""
    try:
        return check_run(scenario, overrides, out_dir, executor)
    except UserError as exc:
        raise UserError(f"{label}: {exc}") from None


def check_run(scenario: str, overrides: Sequence[str], out_dir: Path | None = None, executor: Executor | None = None) -> "Scenario":
    """The scenario with `overrides`, checked as `prfaas run` checks it before anything starts (the file, then
    `plan_serving`: the sections together; then each congestion control the kernel must set,
    `testbed.serving.config.congestion_controls`: the KV's and each TCP cross-traffic flow's), and its WAN's shaping at
    every step of the schedule and at the start as ``prfaas check`` plans it (`analysis.scenario_check.check_wan_plans`).
    A multi-run command checks every run this way before its first, so a bad arm or grid point is refused in one line
    instead of failing an hour in (a schedule step whose queue is past tc's 32-bit byte limit failed each run when the run applied it,
    and one at the start as the run's network was built, until 2026-12-07). A run already finished in `out_dir`
    (which a resumed batch skips) is checked as a file only: it ran, and re-reading it must not depend on any host's
    kernel. The kernel asked and the capacity ``scale: auto`` is resolved at (its wire rates and its WAN's shaping
    checked) are those of every host the run may land on (`Executor.run_hosts`; default: one run alone on this host,
    its whole capacity): with ``--executor local:N`` the N runs share the host, each resolving at capacity / N; with
    ``--executor ray`` each node is asked, and nodes that would resolve ``scale: auto`` differently are refused, as
    their runs would not be comparable."""
    from analysis.scenario_check import check_wan_plans
    from testbed.sections import load_scenario
    from testbed.serving.config import congestion_controls, plan_serving

    sc = load_scenario(scenario, list(overrides))
    if out_dir is not None and run_state(out_dir) == FINISHED:
        return sc
    ccs = congestion_controls(sc, plan_serving(sc))
    if sc.scale != "auto":
        check_wan_plans(sc, float(sc.scale))  # a number: the same on every host
        if not ccs:
            return sc  # nothing a host decides
    hosts = (executor or SequentialExecutor()).run_hosts(tuple(dict.fromkeys(cc for _, cc in ccs)))
    scales: dict[str, float] = {}
    for host in hosts:
        where = "" if host.name == "this host" else f" (on {host.name})"
        refused = dict(host.cc_refused)
        for name, cc in ccs:
            if cc in refused:
                raise FieldError(name, refused[cc] + where, sc.source)
        if sc.scale == "auto":  # resolved as the run will resolve it (`Network`, in the executor's process)
            try:
                scales[host.name] = sc.resolve_scale(host.capacity_bps).factor
            except FieldError as exc:
                raise FieldError(exc.field, exc.message + where, exc.source) from None
            try:
                check_wan_plans(sc, scales[host.name])
            except UserError as exc:
                raise UserError(f"{exc}{where}") from None
    if len(set(scales.values())) > 1:
        said = ", ".join(f"{h.name}: {units.format_rate(h.capacity_bps)}, scale {scales[h.name]:g}" for h in hosts)
        raise FieldError("scale", f"'auto' resolves differently on the hosts the runs may land on ({said}), so their runs "
                         "would not be comparable; give every node the same PRFAAS_CAPACITY_BPS, or set a number "
                         "(--set scale=N)", sc.source)
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
    done = {t.key for t in finished_tasks(tasks)}  # everything is checked before the first run starts
    outcomes = {t.key: RunOutcome(task=t, status=SKIPPED, error=None, wall_s=0.0, node="") for t in tasks if t.key in done}
    todo = [t for t in tasks if t.key not in done]
    settings = {t.key: task_settings(t) for t in todo}  # now: a scenario file edited while the runs go is not what they ran
    for folder in sorted({Path(t.out_dir).parent for t in todo}):
        writable_dir(folder)  # a file in the way or a read-only disk: one line now, not every run failing
    lock = threading.Lock()
    shared = isinstance(progress, Progress)
    bar = progress if shared else (progress_bar() if progress else None)
    with bar if bar is not None and not shared else nullcontext():
        task_id = bar.add_task(label, total=len(tasks), completed=len(tasks) - len(todo)) if bar is not None else None

        def on_done(outcome: RunOutcome) -> None:
            t = outcome.task
            if outcome.status == "ok" and settings.get(t.key) is not None and Path(t.out_dir).is_dir():
                rundir.RunDirWriter(t.out_dir).task({"scenario": t.scenario, "overrides": list(t.overrides), "settings": settings[t.key]})
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
