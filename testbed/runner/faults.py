"""Fault injection: the scenario's faults (``serving.faults``), timed from the workload's start, fired
against the run's processes."""

from __future__ import annotations

from typing import Any, Sequence


class FaultInjector:
    """Holds the faults not fired yet; `fire_due` kills the processes whose time has come."""

    def __init__(self, faults: Sequence[Any]) -> None:
        self.pending = sorted(faults, key=lambda f: f.at_s)

    def fire_due(self, workload_s: float, procs: dict[str, Any], run_s: float) -> list[str]:
        """Fire every fault due at `workload_s` seconds into the workload (`run_s` after PRFAAS_T0);
        returns one line per fault fired, for the live view."""
        fired = []
        while self.pending and workload_s >= self.pending[0].at_s:
            f = self.pending.pop(0)
            name = f"{f.role}{f.instance}"
            p = procs.get(name)
            if p is not None and p.poll() is None:
                p.kill()
            fired.append(f"{f.action} {name} at {run_s:.1f}s (workload {workload_s:.1f}s)")
        return fired
