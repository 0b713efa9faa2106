"""One run as the experiments layer sees it: the runner writes raw results, then `summarize_run_dir`
computes ``summary.json`` with `analysis.metrics.summarize` (so no lower layer imports analysis)."""

from __future__ import annotations

import socket
import time
import traceback
from pathlib import Path
from typing import Any

from testbed import rundir
from testbed.errors import HostError, UserError
from testbed.scenario import Scenario


def summarize_run_dir(path: str | Path) -> dict[str, Any]:
    """Compute and write ``summary.json`` of a raw run directory; returns the summary."""
    from analysis.metrics import summarize
    from testbed.fidelity import load_record, summary_fields
    from testbed.kv.tcplog import busy_state
    from testbed.serving.policy import PolicySpec

    data = rundir.load_run_dir(path, require_summary=False)
    policy = data.scenario.get("policy") or {}
    slo = _slo(data)
    summary = summarize(data.requests, data.link, scale=float(data.environment.scale), policy=str(policy.get("name", "")),
                        model=str(data.environment.compute.get("model") or ""), duration_s=None, scheduler=data.scheduler,
                        slo_ttft_s=slo[0] if slo else None, slo_tpot_s=slo[1] if slo else None,
                        compute=data.environment.compute.get("mode"), hybrid=data.environment.compute.get("hybrid"))
    summary["signals"] = policy.get("signals") or PolicySpec.signals  # "oracle" runs were told the emulator's ground truth
    summary["compute"] = data.environment.compute.get("mode")
    kv_cc = data.environment.backends.get("kv_congestion_control")  # what the KV connections ran (a list; None: unknown)
    summary["kv_congestion_control"] = ",".join(kv_cc) if kv_cc else None
    summary["kv_cc_restarts"] = data.environment.backends.get("kv_cc_restarts")  # the stuck-connection watchdog's restarts
    summary["kv_transport"] = busy_state(data.tcp)  # windows and RTO recovery of the busy KV connections
    if data.environment.extra.get(rundir.RUN_ERROR):
        summary[rundir.RUN_ERROR] = data.environment.extra[rundir.RUN_ERROR]
    req = data.requests
    failed = req.loc[req["status"] == "failed", "reason"] if "reason" in req else req.iloc[:0]
    if len(failed):  # the commonest first, so a run that failed says why at a glance
        summary["failure_reasons"] = {str(k): int(v) for k, v in failed.astype("string").fillna("no reason recorded")
                                      .value_counts().head(5).items()}
    record = load_record(Path(path))
    if record is not None:  # the run's timing fidelity: flagged runs say so in every report
        summary.update(summary_fields(record))
    rundir.RunDirWriter(path).summary(summary)
    return summary


def _slo(data: rundir.RunData) -> tuple[float, float] | None:
    """The run's SLOs (the ``serving`` section of its scenario as run, defaults where it names none), or
    None when that section does not parse (a synthetic run directory)."""
    from testbed.serving.config import parse_serving_section
    from testbed.validation import Fields

    try:
        spec = parse_serving_section(Fields(data.scenario.get("serving"), "serving", str(data.path / rundir.SCENARIO_FILE)))
    except UserError:
        return None
    return spec.slo.ttft_s, spec.slo.tpot_s


def run_once(scenario: Scenario, out_dir: str | Path, *, progress: bool = True) -> Path:
    """Run `scenario` into `out_dir` and summarise it: the complete run directory."""
    from testbed.runner.run import run_scenario

    try:
        out = run_scenario(scenario, Path(out_dir), progress=progress)
        summarize_run_dir(out)
    except KeyboardInterrupt as exc:  # said by the command's last line (`cli.guarded`): the folder is no run yet
        if Path(out_dir).is_dir() and not (Path(out_dir) / rundir.SUMMARY_FILE).exists():
            exc.add_note(f"{out_dir} is incomplete (no {rundir.SUMMARY_FILE}); `prfaas report` refuses it, and the same "
                         "command with --out runs it again")
        raise
    return out


def is_finished(path: str | Path) -> bool:
    """Whether `path` holds a complete, loadable run directory (what a resumed experiment skips)."""
    try:
        rundir.load_run_dir(path)
    except UserError:
        return False
    return True


def execute(task: "Any", *, progress: bool = False) -> "Any":
    """Run one `executor.RunTask` to completion on this host and say how it went (`executor.RunOutcome`).
    The scenario is loaded here, from the task's reference and overrides, so a task can travel to another
    process or node as plain data. A run that fails is an outcome with the reason, not an exception."""
    from experiments.executor import RunOutcome
    from testbed.sections import load_scenario

    t0 = time.monotonic()
    out = Path(task.out_dir)
    try:
        if out.exists():
            import shutil

            shutil.rmtree(out)  # a partial run of an interrupted experiment
        out.parent.mkdir(parents=True, exist_ok=True)
        run_once(load_scenario(task.scenario, list(task.overrides)), out, progress=progress)
        status, error = ("ok", None) if is_finished(out) else ("failed", "incomplete run directory")
    except (UserError, HostError) as exc:
        status, error = "failed", str(exc)
    except Exception as exc:  # a bug in one run must not lose the others; the trace goes with the outcome
        status, error = "failed", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"
    return RunOutcome(task=task, status=status, error=error, wall_s=time.monotonic() - t0, node=socket.gethostname())
