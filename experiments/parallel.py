"""``--executor local:N``: N runs at once on this host, each in its own process.

Each run is a child process (``python -m experiments.parallel TASK_JSON OUTCOME_FILE``) that calls
`experiments.runs.execute`, so every run has its own `PRFAAS_T0`, its own signal handlers and its own
network (the isolation audit, docs/network.md). The host's WAN capacity is shared: each child gets
``PRFAAS_CAPACITY_BPS`` = capacity / N (`ParallelExecutor.run_capacity_bps`), which `scale: auto` scenarios divide
their rates by, and at which `experiments.engine.check_run` checks every run before the first starts. N above
the host's cores is refused, N above `prfaas doctor`'s suggestion is warned about
(`testbed.fidelity.check_parallelism`); every run measures and records its own timing fidelity.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Sequence

from experiments.executor import Executor, OnDone, RunOutcome, RunTask

CHILD_STOP_GRACE_S = 30.0  # a SIGTERMed run tears its network down within this
CANCELLED = "cancelled before it started (the caller gave up: Executor.cancel)"


def task_to_dict(task: RunTask) -> dict[str, Any]:
    return {"key": task.key, "scenario": task.scenario, "overrides": list(task.overrides), "out_dir": str(task.out_dir)}


def task_from_dict(d: dict[str, Any]) -> RunTask:
    return RunTask(key=str(d["key"]), scenario=str(d["scenario"]), overrides=tuple(d["overrides"]), out_dir=Path(d["out_dir"]))


def outcome_to_dict(o: RunOutcome) -> dict[str, Any]:
    return {"task": task_to_dict(o.task), "status": o.status, "error": o.error, "wall_s": o.wall_s, "node": o.node}


def outcome_from_dict(d: dict[str, Any]) -> RunOutcome:
    return RunOutcome(task=task_from_dict(d["task"]), status=str(d["status"]), error=d.get("error"),
                      wall_s=float(d["wall_s"]), node=str(d["node"]))


def failed(task: RunTask, error: str, wall_s: float = 0.0, node: str | None = None) -> RunOutcome:
    return RunOutcome(task=task, status="failed", error=error, wall_s=wall_s, node=node or socket.gethostname())


class ParallelExecutor(Executor):
    """N child processes at a time, one run each."""

    name = "local:N"

    def __init__(self, n: int, *, warn: bool = True) -> None:
        from testbed.fidelity import check_parallelism

        self.n = self.slots = n
        self.name = f"local:{n}"
        message = check_parallelism(n, os.cpu_count() or 1)  # raises UserError beyond the cores
        if message and warn:
            print(f"prfaas: warning: {message}", file=sys.stderr)
        self._children: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._gate = threading.BoundedSemaphore(n)  # `n` runs at once over every caller of `run`
        self._cancelled = False

    def run_capacity_bps(self) -> float:
        """This host's capacity divided by N: each run's share, which its child process is given (`_child_env`) and
        `experiments.engine.check_run` checks ``scale: auto`` at."""
        return super().run_capacity_bps() / self.n

    def _child_env(self) -> dict[str, str]:
        root = str(Path(__file__).resolve().parents[1])
        return {**os.environ, "PRFAAS_CAPACITY_BPS": repr(self.run_capacity_bps()),
                "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}

    def _run_one(self, task: RunTask, env: dict[str, str], mine: set[subprocess.Popen]) -> RunOutcome:
        with self._gate, tempfile.TemporaryDirectory(prefix="prfaas-local-") as tmp:
            result = Path(tmp) / "outcome.json"
            argv = [sys.executable, "-m", "experiments.parallel", json.dumps(task_to_dict(task)), str(result)]
            with self._lock:
                if self._cancelled:
                    return failed(task, CANCELLED)
                p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
                self._children.add(p)
                mine.add(p)
            try:
                out, _ = p.communicate()
            finally:
                with self._lock:
                    self._children.discard(p)
                    mine.discard(p)
            try:
                return outcome_from_dict(json.loads(result.read_text()))
            except (OSError, ValueError, KeyError):
                tail = " | ".join((out or "").strip().splitlines()[-3:])
                return failed(task, f"run process exited with status {p.returncode} without an outcome: {tail}")

    def run(self, tasks: Sequence[RunTask], on_done: OnDone) -> None:
        env = self._child_env()
        mine: set[subprocess.Popen] = set()  # this call's children: another caller's are not ours to stop
        pool = ThreadPoolExecutor(max_workers=self.n, thread_name_prefix="local-run")
        try:
            futures = {pool.submit(self._run_one, t, env, mine): t for t in tasks}
            for fut in as_completed(futures):  # as each run finishes
                task = futures[fut]
                try:
                    outcome = fut.result()
                except Exception as exc:  # a bug here must not lose the other runs
                    outcome = failed(task, f"{type(exc).__name__}: {exc}")
                on_done(outcome)
        finally:
            self._stop_children(mine)
            pool.shutdown(wait=True, cancel_futures=True)

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
        self._stop_children(self._children)

    def _stop_children(self, children: set[subprocess.Popen]) -> None:
        """On an interrupt: SIGTERM every run of `children` still going (each tears its network down), then wait."""
        with self._lock:
            live = [p for p in children if p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        for p in live:
            try:
                p.wait(CHILD_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                p.kill()


def _child_main(argv: list[str]) -> int:
    """Run one task in this process and write its outcome as JSON."""
    from experiments.runs import execute

    task = task_from_dict(json.loads(argv[0]))
    outcome = execute(task, progress=False)
    Path(argv[1]).write_text(json.dumps(outcome_to_dict(outcome)))
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
