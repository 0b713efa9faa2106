"""One checker per lab: recompute every answer from the student's own runs, then compare.

A checker takes the answers (a mapping) and the run directories by name (``runs/<name>``) and returns one
`Verdict` per question. Serving runs (labs 2-5) are read with `analysis.rundir.load_run`, the project's
run-directory loader, and their metrics come from `analysis.metrics`; lab 1's measurement folders (iperf3
JSON, ping output, `prfaas check --json`) are read here. Nothing is compared with a number fixed in the
repository except physics: a BDP or a queue's drain time from the configured rate and delay.
Tolerances are stated in each verdict and in labs/INSTRUCTORS.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from labs.answers import Verdict, choice, interval, lookup, number
from testbed.errors import UserError

Checker = Callable[[dict[str, Any], dict[str, Path]], list[Verdict]]


def _need_runs(runs: dict[str, Path], at_least: int, lab: int) -> None:
    if len(runs) < at_least:
        raise UserError(f"lab {lab}: needs at least {at_least} run directories, got {len(runs)} "
                        f"({', '.join(runs) or 'none'}); list them under `runs:` in the answers file or give them on the command line")


def _load_runs(runs: dict[str, Path]) -> dict[str, Any]:
    from analysis.rundir import load_run

    return {name: load_run(path) for name, path in runs.items()}


# ------------------------------------------------------------------------------------- lab 1: queues


@dataclass(frozen=True)
class QueueMeasurement:
    """One folder of lab 1: the configured WAN (`prfaas check --json`), iperf3 and ping across it."""

    wire_rate_bps: float
    rtt_s: float
    queue_bytes: int
    goodput_bps: float
    rtt_idle_s: float  # median
    rtt_loaded_s: float  # median, pings sent while iperf3 ran


def read_queue_measurement(path: Path) -> QueueMeasurement:
    """One measurement folder, every file and field read by `testbed.validation`'s readers: a missing, damaged or
    hand-edited file is one line naming it and the field (a KeyError, ZeroDivisionError or UnicodeDecodeError
    traceback before 2026-12-07)."""
    from testbed.net.calibrate import parse_ping_rtts_s
    from testbed.validation import Fields, non_negative, positive_number, read_json, read_text

    def file(name: str) -> Path:
        f = path / name
        if not f.is_file():
            raise UserError(f"{path}: missing {name} (the handout's measure.sh writes check.json, iperf3.json, ping-idle.txt, ping-loaded.txt)")
        return f

    where = file("check.json")
    check = Fields(read_json(where, "the output of `prfaas check --json`"), "", str(where))
    check.mark_read(*check.data)  # the rest of `prfaas check`'s figures are not needed here
    f = next((x for x in check.items("directions") if x.data.get("direction") == "prfaas_to_pd"), None)
    if f is None:
        raise UserError(f"{where}: directions: no entry with direction prfaas_to_pd (as `prfaas check --json` writes it)")
    wire_rate_bps, rtt_s = f.get("wire_rate_bps", positive_number), f.get("rtt_s", positive_number)
    queue_bytes = f.get("queue_wire_bytes", positive_number)  # (a 401-digit count was an OverflowError in the drain time)
    if queue_bytes > 2.0**53:  # 1e308 was one too (its drain time overflowed a float)
        raise f.error("queue_wire_bytes", f"{queue_bytes:g} is not a queue `prfaas check` reports (at most 2**53 bytes)")
    queue_bytes = int(queue_bytes)
    where = file("iperf3.json")
    iperf = Fields(read_json(where, "the output of `iperf3 -J`"), "", str(where))
    goodput = iperf.section("end").section("sum_received").get("bits_per_second", non_negative)
    rtts = {}
    for kind in ("idle", "loaded"):
        name = f"ping-{kind}.txt"
        r = parse_ping_rtts_s(read_text(file(name), "the output of ping"))
        if not r:
            raise UserError(f"{path / name}: no ping replies in it")
        rtts[kind] = float(np.median(r))
    return QueueMeasurement(wire_rate_bps, rtt_s, queue_bytes, goodput, rtts["idle"], rtts["loaded"])


def check_lab1(answers: dict[str, Any], runs: dict[str, Path]) -> list[Verdict]:
    _need_runs(runs, 2, 1)
    m = {name: read_queue_measurement(p) for name, p in runs.items()}
    first = next(iter(m.values()))
    bdp = first.wire_rate_bps / 8 * first.rtt_s  # physics: configured rate x configured RTT
    out = [number(answers, "bdp_bytes", bdp, rel=0.02, unit=" B", source="configured rate x RTT (physics)")]
    for name, q in m.items():
        k = f"runs.{name}"
        drain_ms = q.queue_bytes * 8 / q.wire_rate_bps * 1e3
        out += [
            number(answers, f"{k}.queue_delay_ms", drain_ms, rel=0.05, unit=" ms", source="configured queue bytes / wire rate (physics)"),
            number(answers, f"{k}.goodput_mbps", q.goodput_bps / 1e6, rel=0.05, unit=" Mbit/s", source=f"{runs[name]}/iperf3.json"),
            number(answers, f"{k}.rtt_idle_ms", q.rtt_idle_s * 1e3, rel=0.10, abs_=1.0, unit=" ms", source="ping-idle.txt (median)"),
            number(answers, f"{k}.rtt_loaded_ms", q.rtt_loaded_s * 1e3, rel=0.10, abs_=2.0, unit=" ms", source="ping-loaded.txt (median)"),
            number(answers, f"{k}.queue_fill", (q.rtt_loaded_s - q.rtt_idle_s) * 1e3 / drain_ms, rel=0.0, abs_=0.15,
                   source="(loaded - idle RTT) / queue delay"),
        ]
    top = max(q.goodput_bps for q in m.values())
    best = min((n for n, q in m.items() if q.goodput_bps >= 0.9 * top), key=lambda n: m[n].rtt_loaded_s)
    out.append(choice(answers, "best_queue", best, rule="lowest loaded RTT among runs within 90% of the best goodput"))
    return out


# ------------------------------------------------------------------------------- serving-run helpers


def offloaded_ok(run: Any) -> Any:
    from analysis.metrics import offloaded_mask, ok_mask

    df = run.requests
    return df[offloaded_mask(df) & ok_mask(df)]


def phi_kv_gbps(run: Any) -> float:
    """Median over offloaded requests of emulated KV bytes / prefill time (the paper's Phi_kv, per instance)."""
    df = offloaded_ok(run)
    dur = (df["prefill_end_s"] - df["prefill_start_s"]).astype(float)
    v = (df["kv_bytes"].astype(float) * run.scale * 8 / dur.where(dur > 0)).dropna()
    if not len(v):
        raise UserError(f"{run.path}: no offloaded request finished, so Phi_kv cannot be measured (lower the threshold?)")
    return float(np.median(v)) / 1e9


def kv_wait_p90_s(run: Any) -> float:
    """p90 over offloaded requests of transfer end - prefill end: how long KV waited for the WAN after prefill."""
    df = offloaded_ok(run)
    v = (df["transfer_end_s"] - df["prefill_end_s"]).astype(float).dropna()
    return float(np.percentile(v, 90)) if len(v) else 0.0


def wan_rate_gbps(run: Any) -> float:

    return run.parsed_scenario().wan.prfaas_to_pd.rate_bps / 1e9


def _metric(run: Any, *keys: str) -> float:
    v: Any = run.metrics
    for k in keys:
        v = v.get(k) if isinstance(v, dict) else None
    if v is None or not math.isfinite(float(v)):
        raise UserError(f"{run.path}: no {'.'.join(keys)} in this run (no request finished?)")
    return float(v)


# ------------------------------------------------------------------------------ lab 2: the wall


def check_lab2(answers: dict[str, Any], runs: dict[str, Path]) -> list[Verdict]:
    _need_runs(runs, 2, 2)
    loaded = _load_runs(runs)
    out = []
    util = {}
    for name, run in loaded.items():
        k = f"runs.{name}"
        df = offloaded_ok(run)
        kv_mb = float(df["kv_bytes"].astype(float).mean()) * run.scale / 1e6 if len(df) else 0.0
        eg = _metric(run, "egress_gbps", "mean")
        util[name] = eg / wan_rate_gbps(run)
        out += [
            number(answers, f"{k}.kv_mb_per_request", kv_mb, rel=0.05, unit=" MB", source="requests.parquet kv_bytes x scale, offloaded"),
            number(answers, f"{k}.phi_kv_gbps", phi_kv_gbps(run), rel=0.10, unit=" Gbps", source="KV bytes / prefill time, median"),
            number(answers, f"{k}.egress_gbps", eg, rel=0.10, unit=" Gbps", source="summary egress_gbps.mean"),
            number(answers, f"{k}.wan_utilisation", util[name], rel=0.10, abs_=0.02, source="egress / configured WAN rate"),
            number(answers, f"{k}.kv_wait_p90_s", kv_wait_p90_s(run), rel=0.15, abs_=0.05, unit=" s", source="transfer end - prefill end, p90"),
        ]
    out.append(choice(answers, "hits_the_wall", max(util, key=util.get), rule="the run with the highest WAN utilisation"))
    return out


# --------------------------------------------------------------------------- lab 3: choosing t


def run_threshold(run: Any) -> float:
    """The threshold the router applied (median over the run's requests; constant under fixed-threshold)."""
    t = run.requests["threshold"].astype(float).dropna()
    if not len(t):
        raise UserError(f"{run.path}: requests.parquet records no threshold")
    return float(t.median())


def model_t_star(run: Any) -> float:
    from analysis import throughput_model as tm

    cm, _, dist, _ = tm.cluster_model_from_scenario(run.parsed_scenario())
    return float(tm.search_prfaas_pd(cm, dist).threshold)


def check_lab3(answers: dict[str, Any], runs: dict[str, Path]) -> list[Verdict]:
    _need_runs(runs, 3, 3)
    loaded = _load_runs(runs)
    out = []
    ttft, thr = {}, {}
    for name, run in loaded.items():
        k = f"runs.{name}"
        ttft[name] = _metric(run, "ttft_s", "p90")
        thr[name] = _metric(run, "throughput_rps")
        out += [number(answers, f"{k}.threshold_tokens", run_threshold(run), rel=0.0, abs_=0.5, source="requests.parquet threshold"),
                number(answers, f"{k}.ttft_p90_s", ttft[name], rel=0.10, abs_=0.05, unit=" s", source="requests.parquet"),
                number(answers, f"{k}.throughput_rps", thr[name], rel=0.05, unit=" req/s", source="requests.parquet")]
    top = max(thr.values())
    best = min((n for n in loaded if thr[n] >= 0.95 * top), key=lambda n: ttft[n])
    out.append(number(answers, "best_threshold_tokens", run_threshold(loaded[best]), rel=0.0, abs_=0.5,
                      source=f" run {best} (lowest TTFT p90 among runs within 95% of the best throughput)"))
    first = next(iter(loaded.values()))
    out.append(number(answers, "model_t_star_tokens", model_t_star(first), rel=0.05, abs_=256, source=" the throughput model on your scenario"))
    return out


# ------------------------------------------------------------------ lab 4: congestion response


def dip_window_s(run: Any) -> tuple[float, float]:
    """[start, end) of the scenario's first timed WAN change, on the run's clock."""

    sc = run.parsed_scenario()
    for e in sc.wan.schedule:
        length = e.down_s or e.for_s
        if length:
            return run.schedule_offset_s + e.at_s, run.schedule_offset_s + e.at_s + length
    raise UserError(f"{run.path}: the scenario has no timed WAN change (a dip with `for:`)")


def ttft_p90_in_dip_s(run: Any) -> float:
    """p90 TTFT of requests that arrived during the dip; a failed request counts as infinitely slow."""
    from analysis.metrics import ok_mask, ttft_s

    lo, hi = dip_window_s(run)
    df = run.requests[(run.requests["arrival_s"] >= lo) & (run.requests["arrival_s"] < hi)]
    if not len(df):
        raise UserError(f"{run.path}: no request arrived during the dip [{lo:.1f}, {hi:.1f}) s")
    v = ttft_s(df).where(ok_mask(df), np.inf).astype(float).to_numpy()
    if np.isnan(v).any():  # an ok request with no first token: a NaN p90, which check_lab4 would call failures
        raise UserError(f"{run.path}: {int(np.isnan(v).sum())} ok request(s) in the dip have no first_token_s in requests.parquet")
    return float(np.percentile(v, 90, method="higher"))


def paired_ci95(diffs: list[float]) -> tuple[float, float, float]:
    """(mean, low, high) of the mean of paired differences, Student t with n - 1 degrees of freedom. The differences
    are at least two and finite (`check_lab4` refuses fewer pairs and an infinite p90 by run, before): else a
    ValueError, not numpy's RuntimeWarnings and a NaN interval."""
    from scipy import stats

    x = np.asarray(diffs, dtype=float)
    if x.size < 2 or not np.isfinite(x).all():
        raise ValueError(f"paired_ci95: needs at least two finite differences, got {diffs!r}")
    half = float(stats.t.ppf(0.975, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
    return float(x.mean()), float(x.mean() - half), float(x.mean() + half)


LAB4_POLICIES = ("prfaas", "fixed-threshold")


def check_lab4(answers: dict[str, Any], runs: dict[str, Path]) -> list[Verdict]:
    _need_runs(runs, 4, 4)
    loaded = _load_runs(runs)
    by: dict[str, dict[int, float]] = {}
    names: dict[tuple[str, int], str] = {}
    for name, run in loaded.items():
        sc = run.parsed_scenario()
        pol = str(getattr(sc.section("policy"), "name", None))
        if (pol, sc.seed) in names:  # one was kept, unsaid (an experiment's repetitions: 2, 2026-12-07)
            raise UserError(f"lab 4: runs {names[pol, sc.seed]} and {name} are both {pol} with seed {sc.seed}; the pairs are "
                            "by seed, so give one run per policy and seed (name the runs to check: prfaas lab check 4 RUN_DIR ...)")
        by.setdefault(pol, {})[sc.seed] = ttft_p90_in_dip_s(run)
        names[pol, sc.seed] = name
    if set(by) != set(LAB4_POLICIES):
        raise UserError(f"lab 4: the runs must be of policies prfaas and fixed-threshold; got {', '.join(sorted(by))}")
    # Both refused before any mean: seeds run under one policy only were a mean of nothing (numpy's "Mean of empty
    # slice" and "invalid value encountered in scalar divide" printed above the refusal), an infinite p90 an inf - inf
    # in the interval ("invalid value encountered in subtract"), 2026-12-07.
    seeds = sorted(set(by["prfaas"]) & set(by["fixed-threshold"]))
    if len(seeds) < 2:
        ran = "; ".join(f"{pol} seeds {sorted(by[pol])}" for pol in LAB4_POLICIES)
        raise UserError(f"lab 4: a confidence interval needs at least two seeds run under both policies; got {ran} "
                        f"({len(seeds)} in common)")
    infinite = [names[pol, s] for s in seeds for pol in LAB4_POLICIES if not math.isfinite(by[pol][s])]
    if infinite:
        one = len(infinite) == 1
        raise UserError(f"lab 4: more than 10% of the requests in the dip failed in run{'' if one else 's'} {', '.join(infinite)}, "
                        f"so {'its' if one else 'their'} p90 TTFT is infinite; see the handout")
    out = [number(answers, f"ttft_p90_dip_s.{pol}", float(np.mean([by[pol][s] for s in seeds])), rel=0.10, abs_=0.05, unit=" s",
                  source=f" the mean over seeds {seeds}") for pol in LAB4_POLICIES]
    mean, lo, hi = paired_ci95([by["fixed-threshold"][s] - by["prfaas"][s] for s in seeds])
    out.append(interval(answers, "difference_ci95_s", (lo, hi), rel=0.10, abs_=0.05, unit=" s",
                        source=f" fixed - prfaas, paired by seed ({len(seeds)} pairs, Student t)"))
    verdict = "yes" if lo > 0 else ("no" if hi < 0 else "unclear")
    out.append(choice(answers, "prfaas_better", verdict, rule="yes: the CI is above 0; no: below; unclear: it holds 0"))
    return out


# ---------------------------------------------------------------------------------- lab 5: break it


RECOVERY_GRACE_S = 5.0


def fault_end_s(run: Any) -> float:
    """When the run's fault (WAN schedule entry or worker fault) is over, on the run's clock."""

    sc = run.parsed_scenario()
    ends = [e.at_s + (e.down_s or e.for_s or 0.0) for e in sc.wan.schedule]
    serving = sc.section("serving")
    ends += [f.at_s for f in (serving.faults if serving else ())]
    if not ends:
        raise UserError(f"{run.path}: the scenario injects nothing (no wan.schedule, no serving.faults)")
    return run.schedule_offset_s + max(ends)


def main_failure_reasons(run: Any) -> tuple[str, ...]:
    """The most common `reason` among failed requests (all of them when several tie); ("none",) when none failed."""
    from analysis.metrics import ok_mask

    df = run.requests[~ok_mask(run.requests)]
    if not len(df):
        return ("none",)
    if "reason" not in df:
        return ("unknown",)
    counts = df["reason"].fillna("unknown").astype(str).value_counts()
    return tuple(str(r) for r, n in counts.items() if n == counts.iloc[0])


def recovered(run: Any) -> str:
    from analysis.metrics import ok_mask

    after = run.requests[run.requests["arrival_s"] >= fault_end_s(run) + RECOVERY_GRACE_S]
    if not len(after):
        raise UserError(f"{run.path}: no request arrived {RECOVERY_GRACE_S:g} s after the fault ended; make the run longer")
    return "yes" if float(ok_mask(after).mean()) >= 0.9 else "no"


def check_lab5(answers: dict[str, Any], runs: dict[str, Path]) -> list[Verdict]:
    _need_runs(runs, 3, 5)
    out = []
    for name, run in _load_runs(runs).items():
        k = f"runs.{name}"
        out += [number(answers, f"{k}.requests_ok", _metric(run, "requests_ok"), rel=0.0, source="requests.parquet"),
                number(answers, f"{k}.requests_failed", _metric(run, "requests_failed"), rel=0.0, source="requests.parquet"),
                number(answers, f"{k}.ttft_p99_s", _metric(run, "ttft_s", "p99"), rel=0.10, abs_=0.05, unit=" s", source="requests.parquet"),
                choice(answers, f"{k}.main_failure_reason", main_failure_reasons(run), rule="the most common reason of failed requests"),
                choice(answers, f"{k}.recovered", recovered(run),
                       rule=f">= 90% ok among requests arriving {RECOVERY_GRACE_S:g} s after the fault ended")]
    return out


CHECKERS: dict[int, Checker] = {1: check_lab1, 2: check_lab2, 3: check_lab3, 4: check_lab4, 5: check_lab5}


def run_name(key: Any, source: str | None = None) -> str:
    """A key of the answers' ``runs:``, the name of a folder under the answers file's runs/: plain names (`path_name`'s:
    no '\\' or NUL, not '.' or '..', at most `MAX_NAME_BYTES` bytes each) joined by '/', as the checker names the runs
    it finds (``prfaas/seed1-rep1`` from `prfaas experiment`). Else one `FieldError` naming ``runs`` (`source`: the
    answers file): ``../../etc``, ``/etc`` or ``''`` was joined to runs/ as it stood, and the check read that folder."""
    from testbed.validation import MAX_NAME_BYTES, FieldError, plain_name

    name = str(key)
    try:
        for part in name.split("/"):
            plain_name(part, "a run folder")
    except ValueError:
        raise FieldError("runs", f"{name[:60]!r} is not a run name; a run is a folder under runs/, named as plain names "
                                 "joined by '/' (q1, prfaas/seed1-rep1): no '..', '.', empty part, leading '/' or '\\', "
                                 f"each at most {MAX_NAME_BYTES} bytes", source) from None
    return name


def run_names(answers: dict[str, Any], source: str | None = None) -> list[str]:
    """The answers' ``runs:`` keys, each a `run_name` (`source`: the answers file, for the refusal); none where ``runs:``
    is blank. A ``runs:`` that is not a mapping (``runs: [q1, q4]``) is refused: it was passed over, and the check
    read every run folder below runs/ instead of the ones named."""
    from testbed.validation import FieldError

    runs = lookup(answers, "runs")
    if runs is None:
        return []
    if not isinstance(runs, dict):
        raise FieldError("runs", f"must be a mapping of run folders to their answers (runs: {{q1: {{...}}}}), got "
                                 f"{type(runs).__name__}", source)
    return [run_name(k, source) for k in runs]
