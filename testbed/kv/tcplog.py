"""Per-connection TCP state of the KV senders, kept as a time series (the run directory's `tcp.parquet`).

The router sees the senders' TCP_INFO only as one summary per worker and poll (`congestion` in
`/v1/state`, `scheduler.parquet`'s signal rows). What each connection did (which one stalled in
retransmission timeouts, whose cwnd collapsed, how its delivery rate moved) is what `ss -ti` shows a
network engineer, and what a reading of a transport regression rests on. A prefill worker given a
`tcp_log` path appends every KV connection's samples (`testbed.kv.transport.TcpSample`, one per
connection per sampler tick, 0.1 s) to a CSV file; the run's collection merges the workers' files into
`tcp.parquet` (docs/serving.md, "The run directory").

Only samples that say something are kept: a connection with bytes unsent or in flight (a connection
stalled in RTO back-off is kept at every tick: its `backoff` and `ca_state` say so), or whose
acknowledged bytes or retransmits moved since its last kept sample (so the sample that ends a transfer
is kept), and each connection's first. An idle connection repeats its last state every tick and is not
written again. The sampler thread only appends to a buffer; a writer thread of the log's own writes it
out every `flush_s` and at `close()`, so a worker killed without a chance to close loses at most that
last second. A write that fails (a full disk) turns the log off with one message on stderr and never
reaches the sender: its sampling, which the router's signal depends on, carries on.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from testbed.clock import run_t0
from testbed.kv.transport import TcpSample
from testbed.rundir import TCP_BOOL_COLUMNS, TCP_TEXT_COLUMNS

SAMPLE_FIELDS = tuple(f.name for f in dataclasses.fields(TcpSample))
# tcp.parquet. `sender`: the how-many-th sender this prefill worker made to that decode worker (0 first; a
# broken one is replaced and its connections' counters start again). Rates and bytes: wire units (x scale: emulated).
COLUMNS = ("cluster", "prefill_instance", "decode_instance", "sender") + SAMPLE_FIELDS
FLOAT_COLUMNS = ("t_s", "delivery_rate_bps")
CONNECTION = ("cluster", "prefill_instance", "decode_instance", "sender", "connection")  # one TCP connection's rows


def cc_restarts(tcp: Any) -> int | None:
    """How many times the senders restarted a KV connection's congestion control in a run
    (`KVSender._watch_loss`), from its `tcp.parquet` frame: each connection's count is cumulative in its
    samples, so its last is its total. None for a frame from before the count was logged (2026-12-05)."""
    if "cc_restarts" not in tcp:
        return None
    return int(tcp.groupby(list(CONNECTION))["cc_restarts"].max().sum()) if len(tcp) else 0


LOSS_STATE = 4  # TCP_CA_Loss: the connection is recovering from a retransmission timeout


def busy_state(tcp: Any) -> dict[str, Any] | None:
    """How the KV connections fared while they had work (bytes unsent or in flight), from a run's `tcp.parquet`
    frame: `busy_samples` (one per connection per sampler tick, 0.1 s), `loss_state_share` (the share of those in
    the loss state after an RTO, `ca_state` 4), the congestion window at its median and 10th percentile
    (`cwnd_p50_segments`, `cwnd_p10_segments`) and the segment size it counts in (`mss_p50_bytes`; None in a
    frame from before it was logged). A window of a few segments cannot raise three duplicate ACKs after a
    loss, so such a loss waits out an RTO; and at scale S a wire connection holds 1/S of the segments that the
    emulated line's would. (On the case study the windows were not what set its two modes: docs/kv.md, "Two
    modes of the case study under CUBIC, and what set them".) None without busy samples."""
    if tcp is None or not len(tcp):
        return None
    busy = tcp[(tcp["unacked_bytes"] > 0) | (tcp["notsent_bytes"] > 0)]
    if not len(busy):
        return None
    mss = busy["mss"][busy["mss"] > 0] if "mss" in busy else busy.iloc[:0]  # logged since 2026-12-06
    return {"busy_samples": int(len(busy)), "loss_state_share": float((busy["ca_state"] == LOSS_STATE).mean()),
            "cwnd_p50_segments": float(busy["cwnd"].median()), "cwnd_p10_segments": float(busy["cwnd"].quantile(0.1)),
            "mss_p50_bytes": float(mss.median()) if len(mss) else None}


class TcpLog:
    """Appends the TCP samples of one worker's KV connections to a CSV file (see the module's docstring).
    Times are written on the run's clock (seconds after `t0`, as every file of a run directory)."""

    def __init__(self, path: str | Path, cluster: str, prefill_instance: int, flush_s: float = 1.0) -> None:
        self.path = Path(path)
        self.cluster, self.prefill_instance = cluster, prefill_instance
        self.flush_s = flush_s
        self.t0_s = run_t0()
        self.error: str | None = None  # why the log stopped writing, if it did
        self._lock = threading.Lock()  # the buffer and `_last`
        self._write_lock = threading.Lock()  # the file
        self._rows: list[tuple[Any, ...]] = []
        self._last: dict[tuple[int, int, int], tuple[int, int]] = {}  # (decode, sender, connection) -> (bytes_acked, total_retrans) kept
        self._closed = threading.Event()
        self._file = open(self.path, "a", newline="")
        self._writer = csv.writer(self._file)
        if self._file.tell() == 0:
            self._writer.writerow(COLUMNS)
            self._file.flush()
        self._thread = threading.Thread(target=self._flush_loop, name="tcp-log", daemon=True)
        self._thread.start()

    def record(self, decode_instance: int, sender: int, s: TcpSample) -> bool:
        """Keep `s` (a sample of connection `s.connection` of this worker's `sender`-th sender to
        `decode_instance`) if it says something; True if kept. Never raises."""
        key = (decode_instance, sender, s.connection)
        moved = (s.bytes_acked, s.total_retrans)
        with self._lock:
            if self._closed.is_set() or self.error is not None:
                return False
            if self._last.get(key) == moved and not (s.unacked_bytes or s.notsent_bytes):
                return False
            self._last[key] = moved
            row = dataclasses.replace(s, t_s=s.t_s - self.t0_s)
            self._rows.append((self.cluster, self.prefill_instance, decode_instance, sender)
                              + tuple(int(v) if isinstance(v, bool) else v for v in dataclasses.astuple(row)))
        return True

    def flush(self) -> None:
        """Write what is buffered now."""
        with self._lock:
            rows, self._rows = self._rows, []
        if not rows:
            return
        with self._write_lock:
            if self._file.closed or self.error is not None:
                return
            try:
                self._writer.writerows(rows)
                self._file.flush()
            except (OSError, ValueError) as e:
                self.error = f"{self.path}: {e}"
                print(f"tcp log stopped: {self.error}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Write what is buffered and close the file; later samples are not kept."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
        self._thread.join(timeout=5.0)
        self.flush()
        with self._write_lock:
            try:
                self._file.close()
            except OSError:
                pass

    def _flush_loop(self) -> None:
        while not self._closed.wait(self.flush_s):
            self.flush()


def read_tcp_logs(paths: Iterable[Path]) -> Any:
    """The workers' CSV files as one frame (columns `COLUMNS`, sorted by time); empty with those columns when
    there are none. A line that cannot be read is left out: one cut by a killed worker or a failed write
    (with the row written straight after the cut, which lands on the same line) or holding a value that
    is not a number. Nothing else is lost, and a damaged log never costs the run its other files."""
    import pandas as pd

    header = ",".join(COLUMNS)
    frames = []
    for p in sorted(paths):
        try:
            lines = Path(p).read_text(errors="replace").split("\n")
        except OSError:
            continue
        if not lines or lines[0].rstrip("\r") != header:
            continue
        complete = [x for x in lines[1:-1] if x.count(",") == len(COLUMNS) - 1]  # lines[-1]: after the last newline
        if not complete:
            continue
        df = pd.read_csv(io.StringIO("\n".join(complete)), names=list(COLUMNS), header=None, dtype=str)
        for c in COLUMNS:
            if c not in TCP_TEXT_COLUMNS:
                df[c] = pd.to_numeric(df[c], errors="coerce")
        df["cc"] = df["cc"].fillna("")  # not read (a sample from a sender without the name): unknown, kept
        df = df.replace([float("inf"), float("-inf")], float("nan")).dropna()
        if len(df):
            frames.append(df)
    if not frames:
        return pd.DataFrame({c: pd.Series(dtype=_dtype(c)) for c in COLUMNS})
    df = pd.concat(frames, ignore_index=True).sort_values("t_s", kind="stable").reset_index(drop=True)
    return df.astype({c: _dtype(c) for c in COLUMNS})


def _dtype(column: str) -> str:
    return "object" if column in TCP_TEXT_COLUMNS else "bool" if column in TCP_BOOL_COLUMNS else "float64" if column in FLOAT_COLUMNS else "int64"
