"""The scheduler log: every decision, change of t, role flip and control step (-> scheduler.parquet)."""

from __future__ import annotations

import threading
from typing import Any

from testbed import clock
from testbed.rundir import SCHEDULER_COLUMNS, scheduler_frame


class SchedulerLog:
    """Every decision, change of t, role flip and control step (the signals the control law saw),
    timestamped with `testbed.clock` (-> scheduler.parquet; ``kind`` says which)."""

    COLUMNS = SCHEDULER_COLUMNS

    def __init__(self) -> None:
        self._rows: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def add(self, kind: str, t_s: float | None = None, **fields: Any) -> None:
        fields["t_s"] = clock.now_s() if t_s is None else t_s
        fields["kind"] = kind
        with self._lock:
            self._rows.append(fields)

    def rows(self, kind: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(r) for r in self._rows if kind is None or r["kind"] == kind]

    def to_frame(self) -> "Any":
        """A pandas DataFrame with every time (`t_s`, and any field named ``*_t_s``, such as a signals row's
        `estimate_t_s`, the time of the poll it shows) relative to the run's start (`clock.run_t0()`)."""
        t0 = clock.run_t0()
        return scheduler_frame([{**r, **{k: float(v) - t0 for k, v in r.items() if (k == "t_s" or k.endswith("_t_s")) and v is not None}}
                                for r in self.rows()])
