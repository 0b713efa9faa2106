"""analysis/replay.py: a recorded run's signals replayed through the estimator give back its estimate."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from analysis.replay import replay_frame
from testbed.errors import UserError
from testbed.serving.policy.estimator import BandwidthEstimator, EstimatorSpec

G = 1e9


def recorded(spec: EstimatorSpec) -> pd.DataFrame:
    """A run as the router logs it: KV polls every 0.5 s (a 5x dip at 10-20 s, backlogged at 25 Gbps with a queue
    in it), a probe at 3 s, and a signals row every 0.2 s repeating the latest estimate."""
    est, rows, t_poll, t, n = BandwidthEstimator(100 * G, spec), [], 0.0, 0.0, 0
    for i in range(150):
        t = round(0.2 * i, 3)
        if t >= t_poll:  # (no two polls read the same, as in a run)
            dip, n = 10 <= t < 20, n + 1
            est.update(t, (18 if dip else 25) * G + n * 1e6, 40e6, (30.0 if dip else 10.3) + n * 1e-3, 10.0)
            t_poll += 0.5
        if t == 3.0:
            est.probe(t, 600e6, 84 * G, 16.0, 10.4, 10.0)
            rows.append({"kind": "probe", "t_s": t, "ok": True, "probe_bytes": 600e6, "probe_rate_bps": 84 * G,
                         "probe_rtt_ms": 16.0, "idle_rtt_ms": 10.4})
        e = est.estimate
        rows.append({"kind": "signals", "t_s": t + 0.01, "kv_available_bps": e.available_bps,
                     "truth_kv_available_bps": 20 * G if 10 <= t < 20 else 84 * G, "estimate_sample_bps": e.sample_bps,
                     "committed_bytes": 0.0, "rtt_ms": e.rtt_ms, "estimate_evidence": e.evidence, "estimate_t_s": e.t_s,
                     "estimate_backlog_bytes": e.backlog_bytes, "min_rtt_ms": e.min_rtt_ms})
    return pd.DataFrame(rows)


def test_a_replay_with_the_runs_own_settings_gives_back_its_estimate_and_other_settings_another() -> None:
    spec = EstimatorSpec()
    rec = recorded(spec)
    same = replay_frame(rec, 100 * G, spec)
    assert len(same) == (rec["kind"] == "signals").sum()
    assert same["replayed_bps"].tolist() == pytest.approx(same["recorded_bps"].tolist())
    assert same["recorded_bps"].min() < 0.5 * 84 * G  # the dip moved it: the comparison is not of constants
    other = replay_frame(rec, 100 * G, dataclasses.replace(spec, lone_drop_fraction=0.9, saturated_window_s=0.1))
    first = same.index[same["t_s"] > 10.0][0]  # the dip's first poll: alone, it halves; at 90%, it takes 10%
    assert same["replayed_bps"][first] == pytest.approx(0.5 * same["replayed_bps"][first - 1])
    assert other["replayed_bps"][first] == pytest.approx(0.9 * other["replayed_bps"][first - 1])


@pytest.mark.parametrize("before_first_poll", [None, -9000.0])
def test_signals_rows_before_the_first_poll_are_no_poll_whatever_the_hosts_uptime(before_first_poll: float | None) -> None:
    """Before its first poll a signals row shows the estimator's initial estimate: logged with no poll time now,
    and until 2026-12-06 at minus the run's start on the monotonic clock (the host's uptime, here 2.5 h). Replayed
    as a poll, it put 9,000 s between it and the first real poll: exp(9000 / probe_tau) overflowed."""
    spec = EstimatorSpec()
    rec = recorded(spec)
    first = {"kind": "signals", "t_s": 0.005, "kv_available_bps": 100 * G, "truth_kv_available_bps": 84 * G,
             "estimate_sample_bps": 0.0, "committed_bytes": 0.0, "rtt_ms": 0.0, "estimate_evidence": "none",
             "estimate_t_s": before_first_poll, "estimate_backlog_bytes": 0.0, "min_rtt_ms": 0.0}
    with_initial = pd.concat([pd.DataFrame([first]), rec], ignore_index=True)
    out = replay_frame(with_initial, 100 * G, spec)
    assert out["replayed_bps"].tolist() == pytest.approx(out["recorded_bps"].tolist())


def test_runs_recorded_before_the_poll_inputs_were_logged_replay_one_poll_per_repeated_row() -> None:
    spec = EstimatorSpec()
    old = recorded(spec).drop(columns=["estimate_t_s", "estimate_backlog_bytes", "min_rtt_ms"])
    old["committed_bytes"] = 40e6  # the backlog the run logged
    rep = replay_frame(old, 100 * G, spec)
    err = (rep["replayed_bps"] / rep["recorded_bps"] - 1).abs()
    assert err.median() <= 0.01  # row times stand for poll times


def test_a_log_without_the_estimators_inputs_is_a_user_error() -> None:
    with pytest.raises(UserError, match="estimate_sample_bps"):
        replay_frame(pd.DataFrame({"kind": ["signals"], "t_s": [0.0]}), 100 * G, EstimatorSpec())


def test_the_scheduler_log_puts_a_signals_rows_poll_time_on_the_runs_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    from testbed import clock
    from testbed.serving.policy.log import SchedulerLog

    monkeypatch.setenv(clock.T0_ENV, "1000.0")
    log = SchedulerLog()
    log.add("signals", 1003.5, estimate_t_s=1003.25, kv_available_bps=1.0)
    log.add("signals", 1003.7, estimate_t_s=None, kv_available_bps=1.0)
    f = log.to_frame()
    assert f["t_s"].tolist() == pytest.approx([3.5, 3.7])
    assert f["estimate_t_s"].iloc[0] == pytest.approx(3.25) and pd.isna(f["estimate_t_s"].iloc[1])


def test_a_run_directory_is_read_by_the_one_loader(tmp_path) -> None:
    """A damaged scheduler.parquet was pyarrow's traceback, a scenario without a policy an AttributeError (2026-12-07)."""
    import sys
    from pathlib import Path

    import yaml

    sys.path.insert(0, str(Path(__file__).parent))
    from rundir_factory import write_run_dir

    from analysis.replay import replay_run

    d = write_run_dir(tmp_path / "r")
    (d / "scheduler.parquet").write_bytes(b"PAR1 cut off")
    with pytest.raises(UserError, match=r"r/scheduler.parquet: not a readable parquet file"):
        replay_run(d, [])
    d = write_run_dir(tmp_path / "s")
    sc = yaml.safe_load((d / "scenario.yaml").read_text())
    sc.pop("policy")
    (d / "scenario.yaml").write_text(yaml.safe_dump(sc))
    with pytest.raises(UserError, match=r"s/scenario.yaml: no policy section: not a run of the observed estimator"):
        replay_run(d, [])
