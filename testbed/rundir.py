"""The run directory: the one owner of its file names, columns, dtypes and JSON keys, with its writer and loader.

A run directory (docs/serving.md "The run directory") holds:

- ``scenario.yaml``: the scenario as run (overrides, scale and the serving plan written out);
- ``environment.json``: `Environment`, versioned by ``schema_version`` (`ENVIRONMENT_VERSION`);
- ``requests.parquet``: one row per generated request, columns and dtypes `REQUEST_DTYPES`;
- ``link.parquet``: WAN telemetry (`LINK_REQUIRED` plus backend counters);
- ``scheduler.parquet``: the router's scheduler log (`SCHEDULER_COLUMNS` plus per-kind extras);
- ``cross_traffic.parquet`` when the scenario has cross traffic (`CROSS_TRAFFIC_COLUMNS`);
- ``fidelity.json``: the run's timing-fidelity record (`testbed.fidelity.build_record`);
- ``summary.json``: the summary metrics, written by the experiments layer (``experiments.runs``) from
  ``analysis.metrics.summarize``; the runner itself writes raw results only;
- ``task.json``: what a multi-run command asked the run to be (`experiments.engine`: the scenario's data with
  the task's overrides), which a resumed batch compares before it skips the run; a run without one is compared by
  its scenario.yaml (docs/experiments.md, "Resuming").

Every producer (the runner, the router, NET's telemetry, cross traffic) writes through `RunDirWriter` or
the frame builders here, and every reader loads through `load_run_dir`, so a column or key is named in
this module and nowhere else. This module is in the foundation layer: it imports no other package of
the project except `testbed.errors`, `testbed.units`, `testbed.atomic` and `testbed.validation`; pandas is imported
by the functions that need it.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, NamedTuple

from testbed.atomic import make_dirs, write_json, write_parquet, write_text
from testbed.errors import UserError
from testbed.units import MAX_DURATION_S
from testbed.validation import (Fields, boolean, mapping, non_negative, path_is_dir, whole_number, positive_number, read_json,
                                read_yaml, string)

if TYPE_CHECKING:  # pandas is imported where a frame is built: the router and workers start without it
    import pandas as pd

# ------------------------------------------------------------------------------------------ file names

SCENARIO_FILE = "scenario.yaml"
ENVIRONMENT_FILE = "environment.json"
REQUESTS_FILE = "requests.parquet"
LINK_FILE = "link.parquet"
SCHEDULER_FILE = "scheduler.parquet"
SUMMARY_FILE = "summary.json"
CROSS_TRAFFIC_FILE = "cross_traffic.parquet"
TCP_FILE = "tcp.parquet"  # the KV senders' per-connection TCP_INFO samples (testbed.kv.tcplog)
TCP_REQUIRED = ("t_s", "cluster", "prefill_instance", "decode_instance", "sender", "connection", "rtt_us", "min_rtt_us", "cwnd",
                "total_retrans", "bytes_acked", "notsent_bytes", "unacked_bytes", "delivery_rate_bps", "app_limited", "ca_state",
                "backoff")
TCP_LOG_SUFFIX = ".tcp.csv"  # work/<prefill instance>.tcp.csv: a prefill worker's own log, merged into TCP_FILE
FIDELITY_FILE = "fidelity.json"  # the run's timing-fidelity record (testbed.fidelity)
TASK_FILE = "task.json"  # {"scenario", "overrides", "settings"}: what a multi-run command asked for (experiments.engine)
ROUTER_REQUESTS_FILE = "router_requests.parquet"  # the router's own records, merged into requests.parquet
WORK_DIR = "work"  # configs, logs and raw per-process records of a run

RAW_FILES = (SCENARIO_FILE, ENVIRONMENT_FILE, REQUESTS_FILE, LINK_FILE, SCHEDULER_FILE)
REQUIRED_FILES = RAW_FILES + (SUMMARY_FILE,)

# --------------------------------------------------------------------------------------------- columns

FLOAT, INT, STRING, LIST = "float64", "Int64", "string", "object"

# The router's record of a request (router_requests.parquet and the first columns of requests.parquet).
ROUTER_RECORD_COLUMNS = (
    "request_id", "arrival_s", "input_len", "cached_len", "uncached_len", "output_len", "route", "threshold",
    "prefill_instance", "decode_instance", "prefill_start_s", "prefill_end_s", "kv_bytes", "wire_bytes", "kv_bytes_emulated",
    "transfer_start_s", "transfer_end_s", "first_token_s", "finish_s", "status", "reason", "route_reason",
    "cache_transfer_tokens", "prefill_late_s", "decode_late_s", "prefill_paused_s", "kv_dtype", "prefill_cancel",
)
# What the client agent saw of a request (work/client.jsonl).
CLIENT_DISCONNECTED = "client disconnected"  # the router's reason for a request whose client went away mid-stream
CLIENT_COLUMNS = ("client_arrival_s", "client_first_token_s", "client_finish_s", "tokens_received", "client_status",
                  "client_reason", "client_send_late_s", "text")
# From the generated workload.
WORKLOAD_COLUMNS = ("scheduled_arrival_s", "session_id", "block_hashes")

REQUEST_DTYPES: dict[str, str] = {
    "request_id": STRING, "arrival_s": FLOAT, "input_len": INT, "cached_len": INT, "uncached_len": INT, "output_len": INT,
    "route": STRING, "threshold": FLOAT, "prefill_instance": INT, "decode_instance": INT, "prefill_start_s": FLOAT,
    "prefill_end_s": FLOAT, "kv_bytes": INT, "wire_bytes": INT, "kv_bytes_emulated": FLOAT, "transfer_start_s": FLOAT,
    "transfer_end_s": FLOAT, "first_token_s": FLOAT, "finish_s": FLOAT, "status": STRING, "reason": STRING,
    "route_reason": STRING, "cache_transfer_tokens": INT, "prefill_late_s": FLOAT, "decode_late_s": FLOAT,
    "prefill_paused_s": FLOAT,  # of prefill_end_s - prefill_start_s, paused while preempting prefills ran
    "kv_dtype": STRING,  # the dtype the decision routed its full-attention KV to cross in (policy.kv_compression)
    "prefill_cancel": STRING,  # a request whose client hung up before its first token: what its prefill's cancel found
    "client_arrival_s": FLOAT, "client_first_token_s": FLOAT, "client_finish_s": FLOAT, "tokens_received": INT,
    "client_status": STRING, "client_reason": STRING,
    "client_send_late_s": FLOAT,  # how much later than the workload's schedule the client sent it (open loop; since 2026-12-06)
    "text": STRING,
    "scheduled_arrival_s": FLOAT, "session_id": INT, "block_hashes": LIST,  # the prompt's 512-token block ids
}
assert tuple(REQUEST_DTYPES) == ROUTER_RECORD_COLUMNS + CLIENT_COLUMNS + WORKLOAD_COLUMNS


class ColumnRange(NamedTuple):
    """The numbers a numeric column of requests.parquet may hold besides NA: `lo` to `hi`, both included, and whole
    in an Int64 column; `what` names them in `coerce_requests`'s refusal."""

    lo: float
    hi: float
    what: str


WHOLE = ColumnRange(0.0, math.nextafter(2.0**63, 0.0), "a whole number (int64) >= 0")
SECONDS = ColumnRange(0.0, MAX_DURATION_S, f"a time in seconds within a week (0 to {MAX_DURATION_S:g})")
# Each numeric column's range, from what its writer can produce. Counts and bytes: lengths, the workers' byte counts,
# tokens the client counted. Instance indices: plan_instances numbers them from 0; a request no instance took has NA
# (the router's record starts all None), as has one without a session (traffic.request: the batch's -1 is None).
# Times: clock.now_s() (CLOCK_MONOTONIC, one clock for every process of the run's host) less PRFAAS_T0, set before
# any process of the run starts, or the workload's own schedule from 0; durations (*_late_s, prefill_paused_s) are
# clamped at 0 or summed from elapsed times (clock.Pacer, worker.stream_late_s, loadgen). The threshold: the policy's
# t, >= 0, or inf where it never offloads (all-local, homogeneous-pd).
REQUEST_RANGES: dict[str, ColumnRange] = {
    **dict.fromkeys(("input_len", "cached_len", "uncached_len", "output_len", "prefill_instance", "decode_instance",
                     "kv_bytes", "wire_bytes", "cache_transfer_tokens", "tokens_received", "session_id"), WHOLE),
    **dict.fromkeys((c for c in REQUEST_DTYPES if c.endswith("_s")), SECONDS),
    "threshold": ColumnRange(0.0, math.inf, "a threshold (a number of tokens >= 0, or inf: never offload)"),
    "kv_bytes_emulated": ColumnRange(0.0, sys.float_info.max, "a finite number >= 0"),
}
assert set(REQUEST_RANGES) == {c for c, d in REQUEST_DTYPES.items() if d in (INT, FLOAT)}

# The columns analysis needs; a requests.parquet without one of them does not load.
REQUEST_REQUIRED = (
    "request_id", "arrival_s", "input_len", "cached_len", "output_len", "route", "threshold",
    "prefill_start_s", "prefill_end_s", "kv_bytes", "transfer_start_s", "transfer_end_s",
    "first_token_s", "finish_s", "status",
)
TORCH_ONLY_REQUEST_COLUMNS = ("text",)  # the streamed tokens; kept only in torch compute mode

LINK_REQUIRED = ("t_s",)  # plus direction, tx_bytes, rate_bps, backlog_bytes, drops, ... (docs/network.md)

SCHEDULER_COLUMNS = (
    "t_s", "kind", "request_id", "route", "prefill_instance", "decode_instance", "input_len",
    "cached_len", "uncached_len", "cached_pd", "cached_prfaas", "threshold", "old_threshold",
    "egress_utilization", "bandwidth_scarce", "demand_ratio", "kv_capacity_bps", "pdp_cap_threshold",
    "congestion_events_per_s", "prfaas_queue",
    "pdp_queue", "decode_queue", "reason", "priority", "compress_kv",
    # signals rows (one per control tick): the policy's belief beside the emulator's ground truth
    "signals", "kv_available_bps", "truth_kv_available_bps", "wan_capacity_bps", "queueing_delay_ms",
    "committed_bytes", "backlogged", "excess_committed_bits",
    "tick_late_s",  # how late the control loop ran this tick (timing fidelity: testbed.fidelity.router_timing)
)
SCHEDULER_REQUIRED = ("t_s",)
SCHEDULER_TEXT_COLUMNS = ("kind", "request_id", "route", "reason", "signals", "estimate_evidence", "bandwidth_scarce",
                          "compress_kv", "backlogged", "measured", "ok", "probe_stopped")  # words and true/false: every other column is numbers
LINK_TEXT_COLUMNS = ("direction", "link_up")
TCP_TEXT_COLUMNS = ("cluster", "cc")  # tcp.parquet: words ...
TCP_BOOL_COLUMNS = ("app_limited",)  # ... and true/false; every other column is numbers
CROSS_TRAFFIC_TEXT_COLUMNS = ("flow", "protocol", "src", "dst")

CROSS_TRAFFIC_COLUMNS = ("t_s", "flow", "protocol", "src", "dst", "period", "interval_s", "bytes", "achieved_bps",
                         "configured_bps", "lost_packets", "packets", "jitter_ms")

# summary.json: keys every summary has (analysis.metrics.summarize writes more).
SUMMARY_KEYS = ("requests_total", "requests_ok", "requests_failed", "throughput_rps", "ttft_s", "tpot_s",
                "offload_fraction", "egress_gbps", "scale", "policy", "model")


def _figure(v: Any) -> float:
    """A summary figure: a number; NaN and infinity stand for "not measured" (a run with no finished request)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{v!r} is not a number")
    return float(v)


# What the readers of summaries (report, capacity's verdicts, the experiment's results) take from them, and its
# type; null is "not measured" for each. A hand-edited or damaged summary was a TypeError traceback in the report
# (`duration_s: {}`) before 2026-12-07; now it is one line naming the key.
def _fraction(v: Any) -> float:
    """A share of requests: a number from 0 to 1, or NaN ("not measured", as `_figure`). A good_fraction of 5 was a
    ValueError traceback in a capacity search's verdict (its binomial interval) on resume (2026-12-07)."""
    x = _figure(v)
    if not (0.0 <= x <= 1.0 or x != x):
        raise ValueError(f"{v!r} is not a fraction (a number from 0 to 1)")
    return x


def _request_count(v: Any) -> int:
    """A count of a run's requests: a whole number from 0 to 2**53 (where a float, a good fraction times it, is exact:
    ``requests_total: 10**30`` made a capacity verdict's binomial test a ValueError traceback, 2026-12-07)."""
    n = whole_number(v)
    if n > 2**53:
        raise ValueError(f"a {len(str(n))}-digit number is more requests than a run holds (at most 2**53)")
    return n


SUMMARY_FIELDS = {"requests_total": _request_count, "requests_ok": _request_count, "requests_failed": _request_count,
                  "throughput_rps": _figure, "offload_fraction": _figure, "duration_s": _figure, "good_fraction": _fraction,
                  "scale": _figure, "ttft_s": mapping, "tpot_s": mapping, "egress_gbps": mapping, "queue": mapping,
                  "policy": string, "model": string, "signals": string, "label": string, "fidelity_ok": boolean,
                  "fidelity_flags": string, "early_stop": string}
# The queue trend's figures a capacity verdict reads (`experiments.capacity.judge`, `analysis.metrics.queue_trend`):
# ``growing: "no"`` was read as growing (a failed run), ``p_value: "x"`` a TypeError traceback on resume.
QUEUE_FIELDS = {"growing": boolean, "p_value": _figure, "growth": _figure, "samples": whole_number}


# what every generated request has (the collection writes them from the workload): a row without one is no request
REQUEST_NOT_NA = ("request_id", "input_len", "output_len")


def coerce_requests(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with every known column cast to its `REQUEST_DTYPES` dtype. A value that is not a number in a numeric
    column (text), a number outside its column's `REQUEST_RANGES` (no run writes one), NA in `REQUEST_NOT_NA` or a
    `block_hashes` entry that is not a list of whole numbers is a `ValueError` naming the column and row: a count,
    byte count or index below 0, not whole or past int64; a time or duration below 0 or beyond a week; a negative
    threshold; an infinity but +inf as a `threshold`. NA is allowed elsewhere. Before 2026-12-07 these were casting
    tracebacks, or a 1e300-s transfer asked the report for an array of that many seconds (and text became NA
    without a word until session 65, failing later in the analysis)."""
    import numpy as np

    df = df.copy()
    for col in REQUEST_NOT_NA:
        if col in df and df[col].isna().any():
            raise ValueError(f"column {col}: row {int(np.flatnonzero(df[col].isna().to_numpy())[0])} has none (every "
                             "request has one)")
    for col, dtype in REQUEST_DTYPES.items():
        if col not in df:
            continue
        if dtype == LIST:
            _check_lists(df[col], col)
            continue
        if dtype == STRING:
            df[col] = df[col].astype(STRING)
            continue
        num = numbers(df[col], f"column {col}").astype(float)
        x = num.to_numpy()
        lo, hi, what = REQUEST_RANGES[col]
        bad = ~np.isnan(x) & ~((lo <= x) & (x <= hi) & ((x == np.round(x)) if dtype == INT else True))
        if bad.any():
            raise ValueError(f"column {col}: {float(x[bad][0])!r} (row {int(np.flatnonzero(bad)[0])}) is not {what}")
        df[col] = num if dtype == FLOAT else num.astype(INT)
    return df


def numbers(column: pd.Series, where: str) -> pd.Series:
    """`column` as numbers (NA stays NA); a value that is text or anything else not a number is a `ValueError`
    naming `where`, the value and its row (`pd.to_numeric(errors="coerce")` made it NA without a word)."""
    import numpy as np
    import pandas as pd

    if pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column):
        return column
    num = pd.to_numeric(column, errors="coerce")
    bad = (column.notna() & num.isna()).to_numpy()
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{where}: {column.iloc[i]!r} (row {i}) is not a number")
    return num


def _check_lists(column: pd.Series, col: str) -> None:
    """Each entry of a list column (`block_hashes`) is NA or a list of whole numbers."""
    import numpy as np

    for i, v in enumerate(column):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        if not isinstance(v, (list, tuple, np.ndarray)) or not all(
                isinstance(h, (int, np.integer)) and not isinstance(h, bool) for h in v):
            shown = v.tolist() if isinstance(v, np.ndarray) else v  # parquet reads a list back as an array
            raise ValueError(f"column {col}: {shown!r} (row {i}) is not a list of whole numbers")


def empty_link_frame() -> pd.DataFrame:
    import pandas as pd

    return pd.DataFrame({"t_s": pd.Series([], dtype=FLOAT), "direction": pd.Series([], dtype=STRING)})


def link_frame(rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """NET's telemetry samples as link.parquet rows, ordered by time and direction."""
    import pandas as pd

    frame = pd.DataFrame(list(rows))
    if frame.empty:
        return empty_link_frame()
    return frame.sort_values(["t_s", "direction"], kind="stable")


def scheduler_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Scheduler-log rows (``t_s`` already on the run's clock) with `SCHEDULER_COLUMNS` first."""
    import pandas as pd

    cols = list(SCHEDULER_COLUMNS) + sorted({k for r in rows for k in r} - set(SCHEDULER_COLUMNS))
    df = pd.DataFrame(rows, columns=cols)
    df["t_s"] = df["t_s"].astype(float)
    return df


def router_records_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    import pandas as pd

    return pd.DataFrame(records, columns=list(ROUTER_RECORD_COLUMNS))


def cross_traffic_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    import pandas as pd

    return pd.DataFrame(rows, columns=list(CROSS_TRAFFIC_COLUMNS)).sort_values(["t_s", "flow"], ignore_index=True)


# ----------------------------------------------------------------------------------- environment.json

ENVIRONMENT_VERSION = 1
RUN_ERROR = "run_error"  # in environment.json's extra and summary.json: why the run ended early (the router exited, its deadline)
T0_NOTE = "all times are seconds after the network's start (PRFAAS_T0); the WAN schedule and faults count from workload_start_s"


@dataclass
class Environment:
    """environment.json: where and how a run ran. Nested parts are plain JSON objects whose keys are
    documented in docs/serving.md; the top-level keys and `schema_version` are this class's fields."""

    host: dict[str, Any]  # hostname, cpus, python, platform
    kernel: str
    backends: dict[str, Any]  # wan, shaper, torch, cuda
    calibration: dict[str, Any]  # capacity_bps, capacity_source, wan_rtt
    compute: dict[str, Any]  # mode, profiles, model, variant, device
    scale: float
    run_id: str | None  # keys the run's host-global resources (docs/scale-out.md)
    workload_start_s: float | None
    network: dict[str, Any] | None  # NET's description of the emulated network
    instances: list[dict[str, Any]]
    serving: dict[str, Any]
    t0: str = T0_NOTE
    extra: dict[str, Any] = field(default_factory=dict)  # additions by later issues (e.g. fidelity records)
    schema_version: int = ENVIRONMENT_VERSION

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = ENVIRONMENT_FILE) -> "Environment":
        version = data.get("schema_version")
        if isinstance(version, bool) or version != ENVIRONMENT_VERSION:  # (true == 1 in Python)
            raise UserError(f"{where}: schema_version {version!r} is not supported (this testbed reads version "
                            f"{ENVIRONMENT_VERSION}; a run from an older testbed lacks the key)")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in data and n not in ("t0", "extra")]
        if missing:
            raise UserError(f"{where}: missing key(s) {', '.join(missing)}")
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise UserError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(names)}")
        f = Fields(data, "", where)  # each key's type (a `compute: "x"` was an AttributeError traceback before 2026-12-07)
        for key in ("host", "backends", "calibration", "compute", "serving"):
            f.get(key, mapping)
        f.get("kernel", string)
        f.get("scale", positive_number)
        f.get("instances", lambda v: v if isinstance(v, list) else _not(v, "a list"))
        for key, read in (("run_id", string), ("workload_start_s", non_negative), ("network", mapping), ("t0", string), ("extra", mapping)):
            f.get(key, read, None)
        return cls(**{n: data[n] for n in names if n in data})


# ----------------------------------------------------------------------------------------------- writer


class RunDirWriter:
    """Writes the files of one run directory; each method writes one file in its documented form, atomically
    (`testbed.atomic`: a run killed while it writes leaves the old file or none, never a part)."""

    def __init__(self, path: str | Path) -> None:
        self.path = make_dirs(path)

    @property
    def work(self) -> Path:
        return self.path / WORK_DIR

    def scenario(self, text: str) -> Path:
        return write_text(self.path / SCENARIO_FILE, text)

    def environment(self, env: Environment) -> Path:
        return write_json(self.path / ENVIRONMENT_FILE, env.to_json(), indent=1, default=str)

    def requests(self, df: pd.DataFrame, *, keep_text: bool = True) -> Path:
        missing = [c for c in REQUEST_REQUIRED if c not in df]
        if missing:
            raise ValueError(f"requests frame lacks column(s) {', '.join(missing)}")
        df = coerce_requests(df)
        if not keep_text:
            df = df.drop(columns=[c for c in TORCH_ONLY_REQUEST_COLUMNS if c in df])
        return self._parquet(REQUESTS_FILE, df)

    def link(self, df: pd.DataFrame | None) -> Path:
        return self._parquet(LINK_FILE, empty_link_frame() if df is None else df)

    def scheduler(self, df: pd.DataFrame) -> Path:
        return self._parquet(SCHEDULER_FILE, df)

    def cross_traffic(self, df: pd.DataFrame) -> Path:
        return self._parquet(CROSS_TRAFFIC_FILE, df)

    def tcp(self, df: pd.DataFrame) -> Path:
        return self._parquet(TCP_FILE, df)

    def fidelity(self, record: Mapping[str, Any]) -> Path:
        return write_json(self.path / FIDELITY_FILE, dict(record), indent=1, default=str)

    def task(self, record: Mapping[str, Any]) -> Path:
        return write_json(self.path / TASK_FILE, dict(record), indent=1, default=str)

    def summary(self, summary: Mapping[str, Any]) -> Path:
        absent = [k for k in SUMMARY_KEYS if k not in summary]
        if absent:
            raise ValueError(f"summary lacks key(s) {', '.join(absent)}")
        return write_json(self.path / SUMMARY_FILE, dict(summary), indent=1, default=str)

    def _parquet(self, name: str, df: pd.DataFrame) -> Path:
        return write_parquet(self.path / name, df)


# ----------------------------------------------------------------------------------------------- loader


@dataclass
class RunData:
    """Every file of a run directory, read and checked."""

    path: Path
    scenario: dict[str, Any]
    environment: Environment
    requests: pd.DataFrame
    link: pd.DataFrame
    scheduler: pd.DataFrame
    summary: dict[str, Any] | None  # None when the run has not been summarised yet
    cross_traffic: pd.DataFrame | None = None
    tcp: pd.DataFrame | None = None  # TCP_FILE; None for a run without KV senders' samples (or from before them)


def _read_parquet(path: Path, required: tuple[str, ...]) -> pd.DataFrame:
    import pandas as pd

    try:
        df = pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises several types for a damaged file
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise UserError(f"{path}: not a readable parquet file ({type(exc).__name__}: {first})") from None
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise UserError(f"{path}: missing column(s) {', '.join(missing)}; present: {', '.join(map(str, df.columns)) or '(none)'}")
    return df


def _numeric(df: pd.DataFrame, path: Path, text: tuple[str, ...], bools: tuple[str, ...] = ()) -> pd.DataFrame:
    """A telemetry frame (link, scheduler, tcp, cross traffic) whose columns but `text` and `bools` hold numbers (NA
    allowed), whose `bools` hold true/false, and whose `t_s` is a time in every row: one that does not is a `UserError`
    naming the file, column and row. A hand-edited or damaged file was a traceback in the report (a NaN `t_s`: numpy's
    arange; text in `tx_bytes`, `rtt_us` or `app_limited`)."""
    import numpy as np

    df = df.copy()
    try:
        for col in df.columns:
            if col in bools:
                bad = [i for i, v in enumerate(df[col]) if not isinstance(v, (bool, np.bool_))]
                if bad:
                    raise ValueError(f"column {col}: {df[col].iloc[bad[0]]!r} (row {bad[0]}) is not true or false")
            elif col not in text:
                df[col] = numbers(df[col], f"column {col}")
    except ValueError as exc:
        raise UserError(f"{path}: {exc}") from None
    t = df["t_s"].to_numpy(dtype=float)
    bad = ~np.isfinite(t) | (np.abs(t) > MAX_DURATION_S)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise UserError(f"{path}: column t_s: {float(t[i])!r} (row {i}) is not a time in seconds (within a week of the run's start)")
    return df


def _read_json(path: Path) -> dict[str, Any]:
    data = read_json(path, f"a run directory's {path.name}")
    if not isinstance(data, dict):
        raise UserError(f"{path}: must be a JSON object")
    return data


def read_summary(path: str | Path) -> dict[str, Any]:
    """summary.json of a run directory, checked for `SUMMARY_KEYS`."""
    p = Path(path) / SUMMARY_FILE
    if not p.is_file():
        raise UserError(f"{Path(path)}: no {SUMMARY_FILE} (the run was not summarised)")
    summary = _read_json(p)
    absent = [k for k in SUMMARY_KEYS if k not in summary]
    if absent:
        raise UserError(f"{p}: missing key(s) {', '.join(absent)}")
    f = Fields(summary, "", str(p))
    for key, read in SUMMARY_FIELDS.items():
        f.get(key, read, None)
    queue = Fields(summary.get("queue"), "queue", str(p))
    for key, read in QUEUE_FIELDS.items():
        queue.get(key, read, None)
    return summary


def _not(v: Any, what: str) -> Any:
    raise ValueError(f"must be {what}, got {type(v).__name__}")


def read_run_scenario(path: str | Path) -> dict[str, Any]:
    """scenario.yaml of a run directory (`SCENARIO_FILE`): the scenario as run, a mapping (what a resume compares
    with its task where the run has no task.json, `experiments.engine.check_same_task`)."""
    p = Path(path) / SCENARIO_FILE
    scenario = read_yaml(p, "the scenario the run ran (the run writes it)")
    if not isinstance(scenario, dict):
        raise UserError(f"{p}: must be a mapping")
    return scenario


def read_task(path: str | Path) -> dict[str, Any] | None:
    """task.json of a run directory (`TASK_FILE`), or None where the run has none (run alone, or before 2026-12-07)."""
    p = Path(path) / TASK_FILE
    if not p.exists():
        return None
    data = _read_json(p)
    if not isinstance(data.get("settings"), dict):
        raise UserError(f"{p}: no settings mapping (a task record holds scenario, overrides and settings)")
    return data


def load_run_dir(path: str | Path, *, require_summary: bool = True) -> RunData:
    """Read and check every file of a run directory. Every problem is a `UserError` naming the directory,
    the file and what is wrong."""
    p = Path(path)
    if not path_is_dir(p):
        raise UserError(f"{p}: not a run directory (it does not exist or is not a directory)")
    needed = REQUIRED_FILES if require_summary else RAW_FILES
    missing = [f for f in needed if not (p / f).is_file()]
    if missing:
        raise UserError(f"{p}: not a complete run directory: missing {', '.join(missing)} (a run writes {', '.join(needed)})")
    scenario = read_run_scenario(p)
    environment = Environment.from_json(_read_json(p / ENVIRONMENT_FILE), str(p / ENVIRONMENT_FILE))
    summary = read_summary(p) if (p / SUMMARY_FILE).is_file() or require_summary else None
    try:
        requests = coerce_requests(_read_parquet(p / REQUESTS_FILE, REQUEST_REQUIRED))
    except ValueError as exc:
        raise UserError(f"{p / REQUESTS_FILE}: {exc}") from None
    link = _numeric(_read_parquet(p / LINK_FILE, LINK_REQUIRED), p / LINK_FILE, LINK_TEXT_COLUMNS)
    scheduler = _numeric(_read_parquet(p / SCHEDULER_FILE, SCHEDULER_REQUIRED), p / SCHEDULER_FILE, SCHEDULER_TEXT_COLUMNS)
    cross = (_numeric(_read_parquet(p / CROSS_TRAFFIC_FILE, ("t_s",)), p / CROSS_TRAFFIC_FILE, CROSS_TRAFFIC_TEXT_COLUMNS)
             if (p / CROSS_TRAFFIC_FILE).is_file() else None)
    tcp = (_numeric(_read_parquet(p / TCP_FILE, TCP_REQUIRED), p / TCP_FILE, TCP_TEXT_COLUMNS, TCP_BOOL_COLUMNS)
           if (p / TCP_FILE).is_file() else None)
    return RunData(p, scenario, environment, requests, link, scheduler, summary, cross, tcp)
