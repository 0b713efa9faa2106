"""Replay a recorded run's observed signals through the bandwidth estimator, with other settings.

``prfaas replay-estimator RUN_DIR... [--set policy.estimator.KEY=VALUE ...] [--json]``

Every ``signals`` row of a run's ``scheduler.parquet`` carries the estimator's inputs of that control tick
(`estimate_sample_bps`, `rtt_ms`; since 2026-12-04 also `estimate_t_s`, `estimate_backlog_bytes` and
`min_rtt_ms`, the poll's own time, backlog and kernel min RTT), and every ``probe`` row
a probe's answer (`probe_bytes`, `probe_rate_bps`, `probe_rtt_ms`, `idle_rtt_ms`). Fed in time order to
a fresh `BandwidthEstimator` built from the run's own scenario (plus the overrides), they give the
estimate the run would have had, which is scored against the emulator's ground truth like the run's
summary (`analysis.metrics.estimator_error`: median relative error in steady periods).

The replay is **open loop**: the probes' sizes and readings, when they ran, and every decision of the
policy are those recorded; a change that would have sized a probe differently, or routed other work
over the WAN, is not replayed. So it is a design aid, to try a rule on many recorded runs in seconds,
not a measurement: a rule is judged by live runs (`benchmarks/signals_bench.py`, paired seeds). Its
fidelity shows in the replay with no overrides, which should give back the recorded error. Runs
recorded before 2026-12-04 lack the poll's own time, backlog and min RTT: a signals row (every control
tick) repeats the latest poll's inputs, so consecutive rows with the same inputs count as one poll,
the committed bytes of the row stand for the backlog and the lowest polled RTT so far for the kernel's
minimum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.metrics import estimator_error
from testbed.errors import UserError
from testbed.serving.policy.estimator import BandwidthEstimator, EstimatorSpec


@dataclass(frozen=True)
class Replay:
    run_dir: Path
    frame: pd.DataFrame  # t_s, truth_kv_available_bps, recorded_bps, replayed_bps (the signals rows)
    recorded: dict[str, Any]  # estimator_error of the recorded estimate
    replayed: dict[str, Any]  # ... of the replayed one


def replay_frame(scheduler: pd.DataFrame, nominal_bps: float, spec: EstimatorSpec) -> pd.DataFrame:
    """The signals rows of `scheduler` with the estimate a fresh estimator (`spec`) gives on the recorded
    polls and probes, replayed in the order of their own times (`replayed_bps` beside `recorded_bps`)."""
    need = {"kind", "t_s", "estimate_sample_bps", "committed_bytes", "rtt_ms", "kv_available_bps", "truth_kv_available_bps"}
    missing = sorted(need - set(scheduler.columns))
    if missing:
        raise UserError(f"scheduler.parquet has no {', '.join(missing)}: not a run of the observed estimator "
                        "(policy.signals: observed, recorded since 2026-12-01)")
    rows = scheduler[scheduler["kind"].isin(["signals", "probe"])].sort_values("t_s", kind="stable")
    signals = rows[rows["kind"] == "signals"]
    events = sorted(_polls(rows, nominal_bps) + _probes(rows), key=lambda e: e[0])
    est, k, out = BandwidthEstimator(nominal_bps, spec), 0, []
    for r in signals.itertuples(index=False):
        while k < len(events) and events[k][0] <= r.t_s:
            t, kind, args = events[k]
            (est.update if kind == "poll" else est.probe)(t, *args)
            k += 1
        out.append({"t_s": float(r.t_s), "truth_kv_available_bps": _num(r.truth_kv_available_bps),
                    "recorded_bps": _num(r.kv_available_bps), "replayed_bps": est.estimate.available_bps})
    return pd.DataFrame(out, columns=["t_s", "truth_kv_available_bps", "recorded_bps", "replayed_bps"])


def _polls(rows: pd.DataFrame, nominal_bps: float) -> list[tuple[float, str, tuple]]:
    """(time, "poll", update's arguments after the time) of each KV poll. Since 2026-12-04 a signals row
    names its poll (`estimate_t_s`; one whose time is a probe's repeats what the probe published).
    Before, a signals row (every control tick) repeats the latest poll's inputs, so consecutive rows with
    the same inputs are one poll at the first row's time, a row whose rate is the probe's just before it
    is that probe, the row's committed bytes stand for the backlog and the lowest polled RTT so far for
    the kernel's minimum."""
    exact = "estimate_t_s" in rows.columns and rows["estimate_t_s"].notna().any()
    probe_t = set(rows.loc[rows["kind"] == "probe", "t_s"].astype(float))
    out: list[tuple[float, str, tuple]] = []
    last: tuple | None = None
    probed: float | None = None  # the rate of a probe since the last signals row
    kernel_min = math.inf
    for r in rows.itertuples(index=False):
        if r.kind == "probe":
            probed = _num(r.probe_rate_bps) if _measured(r) else probed
            continue
        rtt = _num(r.rtt_ms)
        if exact:
            if pd.isna(r.estimate_t_s) or r.estimate_t_s < 0:
                # no poll yet: the estimator's initial estimate (logged at minus the run's start time, i.e. the
                # host's uptime, until 2026-12-06) is no poll, and replaying it put hours between two polls
                continue
            t, backlog, min_rtt = _num(r.estimate_t_s), _num(r.estimate_backlog_bytes), _num(r.min_rtt_ms)
            key: tuple = (t,)
            from_probe = t in probe_t
        else:
            kernel_min = min(kernel_min, rtt) if rtt > 0 else kernel_min
            t, backlog, min_rtt = float(r.t_s), _num(r.committed_bytes), kernel_min if math.isfinite(kernel_min) else 0.0
            key = (r.estimate_sample_bps, r.rtt_ms, r.committed_bytes, r.estimate_evidence)
            from_probe = probed is not None and _num(r.estimate_sample_bps) == min(probed, nominal_bps)
        if key != last and not from_probe and r.estimate_evidence is not None:
            out.append((t, "poll", (_num(r.estimate_sample_bps), backlog, rtt, min_rtt)))
        last, probed = key, None
    return out


def _probes(rows: pd.DataFrame) -> list[tuple[float, str, tuple]]:
    """(time, "probe", probe's arguments after the time) of each probe the policy was given: one that
    measured a rate with no KV moving under it (`measured` since 2026-12-04; before, read from its row)."""
    out: list[tuple[float, str, tuple]] = []
    min_rtt = 0.0
    for r in rows.itertuples(index=False):
        if r.kind == "signals":
            min_rtt = _num(getattr(r, "min_rtt_ms", 0.0)) or min_rtt
        elif _measured(r):
            out.append((float(r.t_s), "probe", (_num(r.probe_bytes), _num(r.probe_rate_bps), _num(r.probe_rtt_ms),
                                                _num(r.idle_rtt_ms) or None, _num(getattr(r, "min_rtt_ms", 0.0)) or min_rtt)))
    return out


def _measured(r: Any) -> bool:
    m = getattr(r, "measured", None)
    if m is not None and pd.notna(m):
        return bool(m)
    reason = getattr(r, "reason", None)
    return (_num(r.probe_rate_bps) > 0 and _num(r.probe_bytes) > 0
            and not (isinstance(reason, str) and reason.startswith("KV moved")))


def _num(v: Any) -> float:
    return float(v) if v is not None and pd.notna(v) else 0.0


def _score(frame: pd.DataFrame, column: str) -> dict[str, Any]:
    f = frame.rename(columns={column: "kv_available_bps"})[["t_s", "kv_available_bps", "truth_kv_available_bps"]]
    return estimator_error(f.assign(kind="signals"))


def replay_run(run_dir: Path, overrides: list[str]) -> Replay:
    """Replay one run directory with `overrides` (``policy.estimator.KEY=VALUE``) on its own scenario."""
    from testbed.sections import load_scenario

    from testbed import rundir

    run_dir = Path(run_dir)
    bad = [o for o in overrides if not o.startswith("policy.estimator.")]
    if bad:
        raise UserError(f"--set {bad[0]!r}: only policy.estimator.KEY=VALUE can be replayed (the rest of the run is recorded)")
    data = rundir.load_run_dir(run_dir, require_summary=False)  # the one loader: a damaged file is one line naming it
    sc = load_scenario(str(run_dir / rundir.SCENARIO_FILE), overrides)
    if sc.section("policy") is None:  # an AttributeError traceback before 2026-12-07
        raise UserError(f"{run_dir / rundir.SCENARIO_FILE}: no policy section: not a run of the observed estimator "
                        "(policy.signals: observed)")
    spec = sc.section("policy").estimator
    frame = replay_frame(data.scheduler, float(sc.wan.prfaas_to_pd.rate_bps), spec)
    if frame.empty:
        raise UserError(f"{run_dir}: no signals rows (not a run of the observed estimator)")
    return Replay(run_dir, frame, _score(frame, "recorded_bps"), _score(frame, "replayed_bps"))
