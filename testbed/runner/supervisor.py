"""The supervisor: starts the run's processes in their hosts with the run's environment, waits for the
workers to be ready, and stops every process (SIGTERM, then SIGKILL) with its log kept."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from testbed import clock
from testbed.errors import HostError
from testbed.serving.config import ServingPlan

STOP_GRACE_S = 10.0


def python_module() -> list[str]:
    """argv prefix that runs a module of this project with this interpreter."""
    return [sys.executable, "-m"]


def env_argv(t0_s: float) -> list[str]:
    """Environment for processes in the hosts (Mininet's popen does not pass ours through)."""
    from testbed import pythonpath

    return ["env", f"{clock.T0_ENV}={t0_s!r}", "OMP_NUM_THREADS=1", "MKL_NUM_THREADS=1", f"PYTHONPATH={pythonpath()}",
            "PYTHONUNBUFFERED=1"]


class Processes:
    """The run's processes by name, with their logs; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, net: Any, logs: Path, t0_s: float) -> None:
        self.net, self.logs, self.t0_s = net, logs, t0_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.files: list[Any] = []

    def start(self, name: str, host: str, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")
        self.files.append(log)
        kwargs.setdefault("stdout", log)
        kwargs.setdefault("stderr", log)
        p = self.net.popen(host, env_argv(self.t0_s) + argv, **kwargs)
        self.procs[name] = p
        return p

    def log_tail(self, name: str, lines: int = 5) -> str:
        try:
            return " | ".join((self.logs / f"{name}.log").read_text().strip().splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, names: list[str] | None = None, grace_s: float = STOP_GRACE_S) -> None:
        chosen = [n for n in (names or list(self.procs)) if n in self.procs]
        for n in chosen:
            if self.procs[n].poll() is None:
                try:
                    self.procs[n].send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = clock.now_s() + grace_s
        for n in chosen:
            try:
                self.procs[n].wait(max(0.1, deadline - clock.now_s()))
            except subprocess.TimeoutExpired:
                self.procs[n].kill()
                self.procs[n].wait(5)

    def close(self) -> None:
        self.stop()
        for f in self.files:
            f.close()


def wait_ready(procs: Processes, plan: ServingPlan, work: Path, timeout_s: float) -> None:
    """Until every worker has written its ready file; a worker that exits first is a `HostError`."""
    deadline = clock.now_s() + timeout_s
    pending = {i.name for i in plan.instances}
    while pending:
        for name in list(pending):
            if (work / f"{name}.ready").exists():
                pending.discard(name)
            elif procs.procs[name].poll() is not None:
                raise HostError(f"worker {name} exited at start (status {procs.procs[name].returncode}): {procs.log_tail(name)}")
        if pending and clock.now_s() > deadline:
            raise HostError(f"workers not ready within {timeout_s:g}s: {', '.join(sorted(pending))} "
                            f"(raise serving.timeouts.startup on a slow host); last log: {procs.log_tail(sorted(pending)[0])}")
        if pending:
            threading.Event().wait(0.1)
