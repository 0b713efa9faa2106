"""Per-connection TCP state of the KV senders, kept as a time series (the run directory's `tcp.parquet`).

The router sees the senders' TCP_INFO only as one summary per worker and poll (`congestion` in
`/v1/state`, `scheduler.parquet`'s signal rows). What each connection did (which one stalled in
retransmission timeouts, whose cwnd collapsed, how its delivery rate moved) is what `ss -ti` shows a
network engineer, and what a reading of a transport regression rests on. A prefill worker given a
`tcp_log` path appends every KV connection's samples (`testbed.kv.transport.TcpSample`, one per
connection per sampler tick, 0.1 s) to a CSV file; the run's collection merges the workers' files into
`tcp.parquet` (docs/serving.md, "The run directory").

Only samples that say something are kept: a connection with bytes unsent or in flight, or whose
acknowledged bytes or retransmits moved since its last kept sample (so the sample that ends a transfer
is kept), and each connection's first. An idle connection repeats its last state every tick and is not
written again. Rows are buffered and written at most every `flush_s`, off the sampler's path.
"""

from __future__ import annotations

import csv
import dataclasses
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from testbed.clock import now_s
from testbed.kv.transport import TcpSample

SAMPLE_FIELDS = tuple(f.name for f in dataclasses.fields(TcpSample))
COLUMNS = ("cluster", "prefill_instance", "decode_instance") + SAMPLE_FIELDS  # tcp.parquet; rates and bytes: wire units (x scale: emulated)


class TcpLog:
    """Appends the TCP samples of one worker's KV connections to a CSV file (see the module's docstring)."""

    def __init__(self, path: str | Path, cluster: str, prefill_instance: int, flush_s: float = 1.0) -> None:
        self.path = Path(path)
        self.cluster, self.prefill_instance = cluster, prefill_instance
        self.flush_s = flush_s
        self._lock = threading.Lock()
        self._rows: list[tuple[Any, ...]] = []
        self._last: dict[tuple[int, int], tuple[int, int]] = {}  # (decode instance, connection) -> (bytes_acked, total_retrans) kept
        self._flushed_s = now_s()
        self._file = open(self.path, "a", newline="")
        self._writer = csv.writer(self._file)
        if self._file.tell() == 0:
            self._writer.writerow(COLUMNS)

    def record(self, decode_instance: int, s: TcpSample) -> bool:
        """Keep `s` (a sample of connection `s.connection` to `decode_instance`) if it says something; True if kept."""
        key = (decode_instance, s.connection)
        moved = (s.bytes_acked, s.total_retrans)
        with self._lock:
            if self._file.closed:
                return False
            if self._last.get(key) == moved and not (s.unacked_bytes or s.notsent_bytes):
                return False
            self._last[key] = moved
            self._rows.append((self.cluster, self.prefill_instance, decode_instance) + tuple(int(v) if isinstance(v, bool) else v for v in dataclasses.astuple(s)))
            if s.t_s - self._flushed_s >= self.flush_s:
                self._flush_locked(s.t_s)
        return True

    def flush(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._flush_locked(now_s())

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._flush_locked(now_s())
                self._file.close()

    def _flush_locked(self, t_s: float) -> None:
        self._writer.writerows(self._rows)
        self._file.flush()
        self._rows.clear()
        self._flushed_s = t_s


def read_tcp_logs(paths: Iterable[Path]) -> Any:
    """The workers' CSV files as one frame (columns `COLUMNS`, sorted by time); empty with those columns when
    there are none. A file cut short by a killed worker loses its last, partial line, nothing else."""
    import io

    import pandas as pd

    frames = []
    for p in sorted(paths):
        try:
            text = Path(p).read_text()
        except OSError:
            continue
        text = text[: text.rfind("\n") + 1]  # a line without its newline was cut mid-write
        if not text.startswith(",".join(COLUMNS) + "\n"):
            continue
        df = pd.read_csv(io.StringIO(text)).dropna()
        if len(df):
            frames.append(df)
    if not frames:
        return pd.DataFrame({c: pd.Series(dtype=_dtype(c)) for c in COLUMNS})
    df = pd.concat(frames, ignore_index=True).sort_values("t_s", kind="stable").reset_index(drop=True)
    return df.astype({c: _dtype(c) for c in COLUMNS})


def _dtype(column: str) -> str:
    return {"cluster": "object", "app_limited": "bool", "t_s": "float64", "delivery_rate_bps": "float64"}.get(column, "int64")
