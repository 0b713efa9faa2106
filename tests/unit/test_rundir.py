"""The run directory's one owner (`testbed.rundir`): what the writer writes, the loader reads back with
the declared dtypes; a wrong environment.json schema is refused with one line."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from rundir_factory import synthetic_environment, write_run_dir  # noqa: E402

from testbed import rundir  # noqa: E402
from testbed.errors import UserError  # noqa: E402


def test_written_run_directory_loads_back_with_declared_dtypes_and_environment(tmp_path):
    d = write_run_dir(tmp_path / "r", scale=8.0, seed=3)
    data = rundir.load_run_dir(d)
    assert data.environment == synthetic_environment(8.0)
    assert data.environment.schema_version == rundir.ENVIRONMENT_VERSION
    for col in data.requests:
        assert str(data.requests[col].dtype) == rundir.REQUEST_DTYPES[col], col
    assert data.summary is not None and data.summary["requests_total"] == len(data.requests)
    assert json.loads((d / rundir.ENVIRONMENT_FILE).read_text())["schema_version"] == rundir.ENVIRONMENT_VERSION


def test_coerce_requests_turns_strings_and_none_into_typed_columns():
    df = rundir.coerce_requests(pd.DataFrame({"request_id": ["a", "b"], "kv_bytes": ["12", None], "arrival_s": [1, None]}))
    assert str(df["kv_bytes"].dtype) == "Int64" and df["kv_bytes"].iloc[0] == 12 and pd.isna(df["kv_bytes"].iloc[1])
    assert str(df["arrival_s"].dtype) == "float64" and pd.isna(df["arrival_s"].iloc[1])
    assert str(df["request_id"].dtype) == "string"


@pytest.mark.parametrize("column,damage,says", [
    ("arrival_s", lambda c: c.astype(str).where(c.index != 1, "x"), "column arrival_s: 'x' (row 1) is not a number"),  # was NA
    ("input_len", lambda c: c.astype(str).where(c.index != 1, "many"),  # was NA without a word, then int(NA) in the report
     "column input_len: 'many' (row 1) is not a number"),
    ("input_len", lambda c: c.astype(object).where(c.index != 1, None), "column input_len: row 1 has none (every request has one)"),
    ("block_hashes", lambda c: [7] * len(c), "column block_hashes: 7 (row 0) is not a list of whole numbers"),  # was a TypeError
    ("block_hashes", lambda c: [["a"]] * len(c), "column block_hashes: ['a'] (row 0) is not a list of whole numbers"),
])
def test_a_requests_column_that_holds_no_number_is_refused_naming_it(tmp_path, column, damage, says):
    d = write_run_dir(tmp_path / "r")
    df = pd.read_parquet(d / rundir.REQUESTS_FILE)
    df[column] = damage(df[column] if column in df else df["input_len"])
    df.to_parquet(d / rundir.REQUESTS_FILE)
    with pytest.raises(UserError) as exc:
        rundir.load_run_dir(d)
    assert str(exc.value) == f"{d / rundir.REQUESTS_FILE}: {says}"


@pytest.mark.parametrize("change,match", [
    (lambda e: e.pop("schema_version"), "schema_version None is not supported"),
    (lambda e: e.update(schema_version=99), "schema_version 99"),
    (lambda e: e.update(schema_version=True), "schema_version True is not supported"),  # true == 1: read as version 1
    (lambda e: e.pop("scale"), "missing key.*scale"),
    (lambda e: e.update(egress_utilisation=1), "unknown key.*egress_utilisation"),
])
def test_environment_of_another_shape_is_refused_naming_the_key(tmp_path, change, match):
    d = write_run_dir(tmp_path / "r")
    env = json.loads((d / rundir.ENVIRONMENT_FILE).read_text())
    change(env)
    (d / rundir.ENVIRONMENT_FILE).write_text(json.dumps(env))
    with pytest.raises(UserError, match=match):
        rundir.load_run_dir(d)


def test_raw_run_without_summary_loads_only_when_asked(tmp_path):
    d = write_run_dir(tmp_path / "r")
    (d / rundir.SUMMARY_FILE).unlink()
    assert rundir.load_run_dir(d, require_summary=False).summary is None
    with pytest.raises(UserError, match="missing summary.json"):
        rundir.load_run_dir(d)


def test_writer_refuses_a_requests_frame_without_the_required_columns(tmp_path):
    with pytest.raises(ValueError, match="first_token_s"):
        rundir.RunDirWriter(tmp_path).requests(pd.DataFrame({"request_id": ["a"]}))


def test_a_write_that_fails_midway_leaves_the_old_file_whole_and_no_temporary(tmp_path, monkeypatch):
    """Every file of a run directory is written atomically: a parquet write that dies half-way (the disk fills
    after some bytes) and a summary that is not JSON leave the run's earlier files intact and no temporary."""
    d = write_run_dir(tmp_path / "r", scale=8.0, seed=3)
    before = (d / rundir.SCHEDULER_FILE).read_bytes()
    summary = (d / rundir.SUMMARY_FILE).read_text()

    def half_written(self, path, **kwargs):
        Path(path).write_bytes(b"PAR1 half a file")
        raise OSError("No space left on device")

    w = rundir.RunDirWriter(d)
    with monkeypatch.context() as m:
        m.setattr(pd.DataFrame, "to_parquet", half_written)
        with pytest.raises(UserError, match=r"scheduler.parquet: cannot write this file \(No space left on device\)"):
            w.scheduler(pd.DataFrame({"t_s": [0.0, 1.0]}))
    with pytest.raises(TypeError):
        w.summary({**{k: 1 for k in rundir.SUMMARY_KEYS}, (1, 2): 0})  # a tuple key: not JSON, whatever `default` says
    assert (d / rundir.SCHEDULER_FILE).read_bytes() == before and (d / rundir.SUMMARY_FILE).read_text() == summary
    assert not [p.name for p in d.iterdir() if p.name.endswith(".tmp")]
    assert rundir.load_run_dir(d).summary is not None


def test_a_run_that_ended_early_says_why_in_its_summary_and_exits_non_zero(tmp_path, monkeypatch, capsys):
    from dataclasses import replace

    from experiments import commands
    from experiments.runs import summarize_run_dir

    d = write_run_dir(tmp_path / "r", seed=4)
    data = rundir.load_run_dir(d)
    req = data.requests.copy()
    req["status"] = ["failed"] * 3 + ["ok"] * (len(req) - 3)
    req["reason"] = ["decode failed: x", "decode failed: x", None] + [None] * (len(req) - 3)
    w = rundir.RunDirWriter(d)
    w.requests(req)
    old = summarize_run_dir(d)
    assert old["kv_congestion_control"] is None and old["kv_cc_restarts"] is None  # a run from before the record: not known
    w.environment(replace(data.environment, extra={rundir.RUN_ERROR: "the router exited (status 1): boom"},
                          backends={**data.environment.backends, "kv_congestion_control": ["cubic"], "kv_cc_restarts": 2}))
    summary = summarize_run_dir(d)
    assert summary["kv_congestion_control"] == "cubic" and summary["kv_cc_restarts"] == 2
    assert summary[rundir.RUN_ERROR] == "the router exited (status 1): boom"
    assert summary["failure_reasons"] == {"decode failed: x": 2, "no reason recorded": 1}
    assert rundir.read_summary(d)["failure_reasons"] == summary["failure_reasons"]

    def fake_run_once(scenario, out, progress=True):  # the run itself needs root and namespaces
        shutil.copytree(d, out)
        return out

    monkeypatch.setattr("experiments.runs.run_once", fake_run_once)
    monkeypatch.setattr(commands, "_run_report", lambda out: None)
    capsys.readouterr()
    args = commands.argparse.Namespace(scenario="quick", overrides=[], out=str(tmp_path / "new"), no_progress=True)
    assert commands.cmd_run(args) == 1
    out = capsys.readouterr().out
    assert "failed x2: decode failed: x" in out and "the run ended early: the router exited (status 1): boom" in out
    assert "policy prfaas, KV over TCP cubic)" in out
    assert "KV connections stuck after an RTO: congestion control restarted 2 times" in out
    w.environment(data.environment)  # the same run without the error: exit 0
    summarize_run_dir(d)
    args.out = str(tmp_path / "again")
    assert commands.cmd_run(args) == 0


def test_the_summary_carries_the_busy_kv_connections_windows_and_a_run_prints_their_rto_recovery(tmp_path, capsys):
    from experiments import commands
    from experiments.runs import summarize_run_dir
    from testbed.kv.tcplog import COLUMNS

    d = write_run_dir(tmp_path / "r", seed=4)
    assert summarize_run_dir(d)["kv_transport"]["loss_state_share"] == 0.0  # the factory's connections never took an RTO
    capsys.readouterr()
    commands._print_summary(d)
    assert "KV connections:" not in capsys.readouterr().out  # nothing to note
    rows = [{**dict.fromkeys(COLUMNS, 0), "cluster": "prfaas", "cc": "cubic", "t_s": 0.1 * i, "rtt_us": 10_000,
             "delivery_rate_bps": 1e6, "app_limited": False, "unacked_bytes": 1448 * cwnd, "cwnd": cwnd, "ca_state": ca}
            for i, (cwnd, ca) in enumerate([(3, 4), (5, 4), (8, 0), (12, 0)])]
    rundir.RunDirWriter(d).tcp(pd.DataFrame(rows, columns=list(COLUMNS)))
    kt = summarize_run_dir(d)["kv_transport"]
    assert kt["busy_samples"] == 4 and kt["loss_state_share"] == 0.5 and kt["cwnd_p50_segments"] == 6.5
    capsys.readouterr()
    commands._print_summary(d)
    assert "KV connections: 50% of their busy time recovering from an RTO, cwnd p50 6 segments" in capsys.readouterr().out


def test_a_run_prints_what_prfaas_check_warns_of_before_it_starts(tmp_path, monkeypatch, capsys):
    """`prfaas run val-cross-surge` on a 2-core host: the neighbours' datagram rate is beyond the host (the check's
    warning) before the run's minutes are spent, not only in the flags afterwards."""
    import shutil

    from analysis import scenario_check
    from experiments import commands

    d = write_run_dir(tmp_path / "r", seed=4)
    monkeypatch.setattr(scenario_check.os, "cpu_count", lambda: 2)
    started = []
    monkeypatch.setattr("experiments.runs.run_once", lambda scenario, out, progress=True: started.append(out) or shutil.copytree(d, out))
    monkeypatch.setattr(commands, "_run_report", lambda out: None)
    args = commands.argparse.Namespace(scenario="val-cross-surge", overrides=[], out=str(tmp_path / "new"), no_progress=True)
    commands.cmd_run(args)
    err = capsys.readouterr().err
    assert started and "warning: cross_traffic: the UDP flows send 97 thousand datagrams/s" in err
    args = commands.argparse.Namespace(scenario="val-cross-surge", overrides=["scale=100"], out=str(tmp_path / "new2"), no_progress=True)
    commands.cmd_run(args)
    assert "cross_traffic:" not in capsys.readouterr().err


@pytest.mark.parametrize("name,content,match", [
    ("summary.json", b"\xc7\x00 not text", r"summary.json: not UTF-8 text \(at byte offset 0\); a run directory's summary.json is expected"),
    ("environment.json", b"[" * 100000, r"environment.json: not a run directory's environment.json \(JSON nested too deeply\)"),
    ("summary.json", b'{"a": ', r"summary.json: not valid JSON \(Expecting value at line 1\)"),
    ("summary.json", b'{"a": 1' + b"0" * 5000 + b"}", r"summary.json: not a run directory's summary.json \(a number of more than 4300 digits\)"),
])
def test_a_damaged_json_file_of_a_run_is_one_line_naming_it(tmp_path, name, content, match):
    """Not UTF-8 or nested too deeply was a UnicodeDecodeError / RecursionError traceback from every reader of run
    directories (`prfaas report`, a resumed experiment, `prfaas lab check`) before 2026-12-07."""
    d = write_run_dir(tmp_path / "r")
    (d / name).write_bytes(content)
    with pytest.raises(UserError, match=match):
        rundir.load_run_dir(d)


@pytest.mark.parametrize("name,change,match", [
    ("summary.json", {"duration_s": {}}, r"summary.json: duration_s: must be an object|summary.json: duration_s: \{\} is not a number"),
    ("summary.json", {"requests_total": "many"}, r"summary.json: requests_total: 'many' is not a whole number >= 0"),
    ("summary.json", {"ttft_s": 3}, r"summary.json: ttft_s: must be an object, got int"),
    ("summary.json", {"fidelity_ok": "yes"}, r"summary.json: fidelity_ok: 'yes' is not true or false"),
    ("environment.json", {"compute": "profile"}, r"environment.json: compute: must be an object, got str"),
    ("environment.json", {"scale": "ten"}, r"environment.json: scale: 'ten' is not a number"),
    ("environment.json", {"workload_start_s": -1}, r"environment.json: workload_start_s: -1 must be >= 0"),
    ("environment.json", {"instances": {}}, r"environment.json: instances: must be a list, got dict"),
])
def test_a_summary_or_environment_value_of_the_wrong_type_is_one_line_naming_the_key(tmp_path, name, change, match):
    """Hand-edited or damaged values were TypeError / AttributeError tracebacks in `prfaas report` and the lab checks
    (`duration_s: {}`, `compute: "profile"`) before 2026-12-07; NaN stays a summary's "not measured"."""
    d = write_run_dir(tmp_path / "r")
    data = json.loads((d / name).read_text())
    (d / name).write_text(json.dumps({**data, "throughput_rps": float("nan")} if name == "summary.json" else data))
    assert rundir.load_run_dir(d).summary is not None
    (d / name).write_text(json.dumps({**data, **change}))
    with pytest.raises(UserError, match=match):
        rundir.load_run_dir(d)


def test_an_infinite_threshold_is_a_policy_that_never_offloads():
    """all-local and homogeneous-pd record t = inf on every request: read as it is (the finiteness check of 2026-12-07
    refused it, and every all-local run failed at collection)."""
    df = rundir.coerce_requests(pd.DataFrame({"request_id": ["a"], "threshold": [float("inf")]}))
    assert df["threshold"].iloc[0] == float("inf")


def _real_looking_requests():
    """Three rows as a run writes them: an offload, a local request (no KV crossed: NA bytes, +inf threshold of a
    policy that never offloads) and one that failed before any instance took it (NA everywhere the router kept none)."""
    na = None
    return pd.DataFrame({
        "request_id": ["r0", "r1", "r2"], "arrival_s": [0.0, 1.25, 2.5], "input_len": [8192, 512, 100],
        "cached_len": [512, 0, na], "uncached_len": [7680, 512, na], "output_len": [64, 16, 8], "route": ["prfaas", "pd", na],
        "threshold": [4096.0, float("inf"), na], "prefill_instance": [0, 1, na], "decode_instance": [0, 0, na],
        "prefill_start_s": [0.01, 1.3, na], "prefill_end_s": [0.5, 1.4, na], "kv_bytes": [10_000_000, na, na],
        "wire_bytes": [10_100_000, na, na], "kv_bytes_emulated": [8e7, na, na], "transfer_start_s": [0.1, na, na],
        "transfer_end_s": [0.6, na, na], "first_token_s": [0.7, 1.45, na], "finish_s": [1.5, 1.9, 2.5],
        "status": ["ok", "ok", "failed"], "cache_transfer_tokens": [0, 0, na], "prefill_late_s": [0.0, 0.002, na],
        "decode_late_s": [0.01, 0.0, na], "prefill_paused_s": [na, 0.05, na], "client_arrival_s": [0.0, 1.25, 2.5],
        "client_first_token_s": [0.71, 1.46, na], "client_finish_s": [1.51, 1.91, 2.51], "tokens_received": [64, 16, 0],
        "client_send_late_s": [0.0, 0.001, na], "scheduled_arrival_s": [0.0, 1.25, 2.5], "session_id": [3, na, na],
        "block_hashes": [[1, 2], [3], []],
    })


def test_a_real_looking_frame_with_na_and_an_infinite_threshold_passes():
    df = rundir.coerce_requests(_real_looking_requests())
    assert df["threshold"].iloc[1] == float("inf") and pd.isna(df["kv_bytes"].iloc[1]) and pd.isna(df["prefill_instance"].iloc[2])
    assert all(str(df[c].dtype) == rundir.REQUEST_DTYPES[c] for c in df)


@pytest.mark.parametrize("column,value,what", [
    ("kv_bytes", -1, "a whole number"), ("wire_bytes", -5, "a whole number"), ("input_len", -1, "a whole number"),
    ("cached_len", -1, "a whole number"), ("uncached_len", -1, "a whole number"), ("output_len", -1, "a whole number"),
    ("tokens_received", -1, "a whole number"), ("cache_transfer_tokens", -1, "a whole number"),
    ("prefill_instance", -1, "a whole number"), ("decode_instance", -1, "a whole number"), ("session_id", -1, "a whole number"),
    ("arrival_s", -0.5, "a time in seconds"), ("client_arrival_s", -0.5, "a time in seconds"),
    ("scheduled_arrival_s", -1.0, "a time in seconds"), ("prefill_paused_s", -0.1, "a time in seconds"),
    ("prefill_late_s", -0.1, "a time in seconds"), ("decode_late_s", -0.1, "a time in seconds"),
    ("client_send_late_s", -0.1, "a time in seconds"), ("finish_s", 1e7, "a time in seconds"),
    ("threshold", -1.0, "a threshold"), ("threshold", float("-inf"), "a threshold"),
    ("kv_bytes_emulated", -1.0, "a finite number >= 0"), ("kv_bytes_emulated", float("inf"), "a finite number >= 0"),
    ("input_len", 2.5, "a whole number"), ("input_len", 2.0**63, "a whole number"),
])
def test_a_number_outside_its_columns_range_is_one_line_naming_the_column_and_row(column, value, what):
    """Negative counts, bytes, indices, times and durations: no writer produces one (2026-12-07 refused only non-whole
    numbers, infinities and times beyond a week)."""
    df = _real_looking_requests()
    df[column] = df[column].astype(object)
    df.loc[1, column] = value
    with pytest.raises(ValueError, match=rf"^column {column}: {re.escape(repr(float(value)))} \(row 1\) is not {what}[^\n]*$"):
        rundir.coerce_requests(df)


def test_every_whole_number_column_is_a_count_or_index_from_0():
    """(rundir asserts at import that every numeric column has exactly one range.)"""
    assert all(rundir.REQUEST_RANGES[c] == rundir.WHOLE for c, d in rundir.REQUEST_DTYPES.items() if d == rundir.INT)


@pytest.mark.parametrize("file,column,value,says", [
    (rundir.LINK_FILE, "t_s", float("nan"), "column t_s: nan (row 1) is not a time in seconds"),  # was numpy's arange in the report
    (rundir.LINK_FILE, "tx_bytes", "lots", "column tx_bytes: 'lots' (row 1) is not a number"),
    (rundir.TCP_FILE, "rtt_us", "slow", "column rtt_us: 'slow' (row 1) is not a number"),
    (rundir.TCP_FILE, "app_limited", "no", "column app_limited: 'no' (row 0) is not true or false"),  # was a TypeError
    (rundir.SCHEDULER_FILE, "t_s", "soon", "column t_s: 'soon' (row 1) is not a number"),  # was a ValueError in replay-estimator
])
def test_a_telemetry_column_that_holds_no_number_is_refused_naming_it(tmp_path, file, column, value, says):
    d = write_run_dir(tmp_path / "r")
    df = pd.read_parquet(d / file)
    assert len(df) > 1 and column in df
    if column == "app_limited":
        df[column] = value  # the whole column words: parquet keeps a column one type
    elif isinstance(value, str):
        df[column] = df[column].astype(str)
        df.loc[df.index[1], column] = value
    else:
        df.loc[df.index[1], column] = value
    df.to_parquet(d / file)
    with pytest.raises(UserError) as exc:
        rundir.load_run_dir(d)
    assert str(exc.value).startswith(f"{d / file}: {says}")
