"""The scheduler log: every decision, change of t, role flip and control step (-> scheduler.parquet)."""

from __future__ import annotations

import threading
from typing import Any

from testbed import clock


class SchedulerLog:
    """Every decision, change of t, role flip and control step (the signals the control law saw),
    timestamped with `testbed.clock` (-> scheduler.parquet; ``kind`` says which)."""

    COLUMNS = (
        "t_s", "kind", "request_id", "route", "prefill_instance", "decode_instance", "input_len",
        "cached_len", "uncached_len", "cached_pd", "cached_prfaas", "threshold", "old_threshold",
        "egress_utilization", "bandwidth_scarce", "demand_ratio", "kv_capacity_bps", "pdp_cap_threshold",
        "congestion_events_per_s", "prfaas_queue",
        "pdp_queue", "decode_queue", "reason",
        # signals rows (one per control tick): the policy's belief beside the emulator's ground truth
        "signals", "kv_available_bps", "truth_kv_available_bps", "wan_capacity_bps", "queueing_delay_ms",
        "committed_bytes", "backlogged", "excess_committed_bits",
    )

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
        """A pandas DataFrame, `t_s` relative to the run's start (`clock.run_t0()`)."""
        import pandas as pd

        rows = self.rows()
        cols = list(self.COLUMNS) + sorted({k for r in rows for k in r} - set(self.COLUMNS))
        df = pd.DataFrame(rows, columns=cols)
        df["t_s"] = df["t_s"].astype(float) - clock.run_t0()
        return df
