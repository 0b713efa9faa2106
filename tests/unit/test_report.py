"""Run directories -> metrics, plots and report.html; bad run directories give one clear error; sweeps resume.

Run directories are written by the testbed's own writer (tests/unit/rundir_factory.py); a real run's
directory is checked by tests/integration/test_run_e2e.py.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from rundir_factory import write_run_dir  # noqa: E402

from analysis import metrics, plots  # noqa: E402
from analysis.report import write_report  # noqa: E402
from analysis.rundir import load_run  # noqa: E402
from experiments.executor import Executor, RunOutcome  # noqa: E402
from experiments.sweep import expand, parse_grid, run_sweep  # noqa: E402
from testbed import rundir  # noqa: E402
from testbed.errors import UserError  # noqa: E402


@pytest.fixture
def run_a(tmp_path: Path) -> Path:
    return write_run_dir(tmp_path / "run-a", policy="prfaas", duration_s=30, seed=1)


@pytest.fixture
def run_b(tmp_path: Path) -> Path:
    return write_run_dir(tmp_path / "run-b", policy="fixed-threshold", duration_s=30, seed=2)


def _requests(**cols) -> pd.DataFrame:
    base = {c: [0.0, 0.0, 0.0] for c in rundir.REQUEST_REQUIRED}
    base.update(request_id=["a", "b", "c"], route=["prfaas", "pd-p", "pd-p"], status=["ok", "ok", "failed"])
    base.update(cols)
    return pd.DataFrame(base)


def test_summarize_computes_ttft_tpot_throughput_and_offload_by_hand():
    df = _requests(arrival_s=[0.0, 1.0, 2.0], first_token_s=[1.0, 4.0, np.nan], finish_s=[2.0, 5.0, np.nan],
                   output_len=[11, 21, 5], kv_bytes=[1000, 0, 0])
    s = metrics.summarize(df, None, scale=10, policy="prfaas", model="m", duration_s=4.0)
    assert (s["requests_total"], s["requests_ok"], s["requests_failed"]) == (3, 2, 1)
    assert s["throughput_rps"] == pytest.approx(0.5)
    assert s["ttft_s"]["mean"] == pytest.approx(2.0)  # (1 + 3) / 2
    assert s["ttft_s"]["p50"] == pytest.approx(2.0)
    assert s["tpot_s"]["mean"] == pytest.approx((0.1 + 0.05) / 2)  # 1 s / 10 tokens, 1 s / 20 tokens
    assert s["offload_fraction"] == pytest.approx(1 / 3)
    assert s["egress_gbps"]["mean"] == pytest.approx(1000 * 8 * 10 / 4.0 / 1e9)  # wire bytes x scale over 4 s
    assert s["ttft_short_s"]["mean"] == pytest.approx(3.0)
    assert s["ttft_client_s"]["mean"] is None  # no client columns: not measured


def test_the_client_side_ttft_adds_the_routers_intake_to_the_routers_ttft():
    """As vLLM's bench serve measures it: from the client's send to the first token it read. A request the router took
    in 0.5 s late shows 0.5 s more than its router-side TTFT; a failed request counts in neither."""
    df = _requests(arrival_s=[0.5, 1.0, 2.0], first_token_s=[1.5, 4.0, np.nan], finish_s=[2.0, 5.0, np.nan], output_len=[11, 21, 5],
                   client_arrival_s=[0.0, 0.999, 1.999], client_first_token_s=[1.501, 4.001, np.nan])
    s = metrics.summarize(df, None, scale=1, duration_s=4.0)
    assert s["ttft_s"]["p50"] == pytest.approx(2.0) and s["ttft_client_s"]["p50"] == pytest.approx(2.2515)
    assert metrics.client_ttft_s(df).round(3).tolist() == [1.501, 3.002]


def test_egress_from_link_telemetry_differences_cumulative_bytes():
    link = pd.DataFrame({"t_s": [0.0, 1.0, 2.0], "direction": "prfaas_to_pd", "tx_bytes": [0, 125_000_000, 250_000_000]})
    eg = metrics.egress_series_bps(link, scale=4)
    assert eg.tolist() == pytest.approx([4e9, 4e9])  # 1 Gbit/s on the wire x 4


def test_kv_egress_spreads_each_transfer_over_its_duration():
    df = _requests(arrival_s=[0.0, 0.0, 0.0], finish_s=[4.0, 4.0, 4.0], kv_bytes=[1e9, 5e8, 0],
                   transfer_start_s=[0.0, 1.0, 0.0], transfer_end_s=[2.0, 2.0, 0.0])
    eg = metrics.kv_egress_series_bps(df, scale=2.0)  # only the first request is offloaded
    assert eg.tolist() == pytest.approx([8e9, 8e9, 0.0, 0.0])  # 1 GB x 2 over 2 s = 8 Gbit/s for 2 s


def test_load_run_metrics_match_figures_computed_by_hand_from_the_files(run_a):
    run = load_run(run_a)
    req = pd.read_parquet(run_a / "requests.parquet")  # read here, not through load_run
    ok = req[req["status"] == "ok"]
    ttft = (ok["first_token_s"] - ok["arrival_s"]).to_numpy()
    assert run.metrics["requests_total"] == len(req) and run.metrics["requests_ok"] == len(ok) < len(req)
    assert run.metrics["ttft_s"]["mean"] == pytest.approx(ttft.mean())
    assert run.metrics["ttft_s"]["p90"] == pytest.approx(np.percentile(ttft, 90))
    span_s = req["finish_s"].max() - req["arrival_s"].min()
    kv_bits = req.loc[req["route"] == "prfaas", "kv_bytes"].sum() * 8 * 10  # wire bytes x scale 10
    assert run.metrics["egress_gbps"]["mean"] == pytest.approx(kv_bits / span_s / 1e9)
    assert run.scale == 10.0


def test_report_of_one_run_is_self_contained_and_shows_scenario_and_environment(run_a):
    path = write_report([run_a])
    text = path.read_text()
    assert path == run_a / "report.html"
    assert "synthetic-prfaas" in text and "delayline" in text  # scenario and environment shown
    srcs = re.findall(r'src="([^"]+)"', text)
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert "http://" not in text and "https://" not in text
    assert (run_a / "plots" / "congestion_run.png").stat().st_size > 10_000
    assert (run_a / "plots" / "kv_connections_run.png").stat().st_size > 10_000
    assert "model Lambda_max" in text and "prefix-cache efficiency" in text


def test_comparison_report_has_a_row_per_run_and_the_comparison_plots(run_a, run_b, tmp_path):
    path = write_report([run_a, run_b], tmp_path / "cmp")
    text = path.read_text()
    assert text.count("<tr><td>run-") == 2
    for name in ("policies_across_dip.png", "throughput_vs_p95_ttft.png", "latency_cdfs.png", "congestion_run-a.png", "kv_pushback.png"):
        assert (tmp_path / "cmp" / "plots" / name).exists(), name
    with pytest.raises(UserError, match="--out"):
        write_report([run_a, run_b])


def test_every_plot_labels_both_axes_with_units(run_a, run_b):
    runs = [load_run(run_a), load_run(run_b)]
    figs = {"congestion": plots.congestion_response(runs[0]), "dip": plots.policies_across_dip(runs),
            "pantheon": plots.pantheon_summary(runs), "cdfs": plots.latency_cdfs(runs),
            "pushback": plots.kv_pushback(runs), "kv_connections": plots.kv_connections(runs[0])}
    from analysis import throughput_model as tm
    from testbed.models.profiles import load_profile

    cm = tm.ClusterModel(pd_profile=load_profile("h20"), n_pd=8, kv_bytes=tm.affine_kv_bytes(1.8e8, 17e3), output_len=1024,
                         prfaas_profile=load_profile("h200"), n_prfaas=4, egress_bps=100e9)
    r = tm.search_prfaas_pd(cm, tm.LengthDistribution.truncated_lognormal(9.9, 1, 128, 131072, bins=1024), step_tokens=512)
    figs["lambda_t"] = plots.lambda_vs_threshold(r)
    figs["lambda_split"] = plots.lambda_vs_split(r)
    for name, fig in figs.items():
        assert plots.missing_units(fig) == [], name
        assert any(ax.has_data() for ax in fig.axes), name


def test_missing_units_catches_an_unlabelled_axis():
    fig, ax = plots.plt.subplots()
    ax.plot([0, 1], [0, 1])
    ax.set_xlabel("time (s)")
    ax.set_ylabel("rate")
    assert len(plots.missing_units(fig)) == 1


@pytest.mark.parametrize("damage,match", [
    (lambda d: (d / "summary.json").unlink(), "missing summary.json"),
    (lambda d: (d / "requests.parquet").write_bytes(b"not parquet"), "requests.parquet: not a readable parquet"),
    (lambda d: pd.read_parquet(d / "requests.parquet").drop(columns=["first_token_s"]).to_parquet(d / "requests.parquet"), "missing column.*first_token_s"),
    (lambda d: (d / "environment.json").write_text("{nope"), "environment.json: not valid JSON"),
    (lambda d: (d / "summary.json").write_text(json.dumps({"requests_total": 1})), "summary.json: missing key"),
    (lambda d: (d / "scenario.yaml").write_text("a: [1,"), "scenario.yaml: not valid YAML"),
    (lambda d: (d / "scenario.yaml").write_text(""), "scenario.yaml: empty; the scenario the run ran"),  # read as {} before
    (lambda d: pd.DataFrame({"x": [1]}).to_parquet(d / "link.parquet"), "link.parquet: missing column.*t_s"),
    (lambda d: pd.DataFrame({"t_s": [1.0]}).to_parquet(d / "tcp.parquet"), "tcp.parquet: missing column.*cluster"),
    # a number no run holds: casting tracebacks, or a 1e300-s transfer sized an array by it (2026-12-07)
    (lambda d: _set(d, "input_len", 1e30), r"requests.parquet: column input_len: 1e\+30 \(row 0\) is not a whole number \(int64\)"),
    (lambda d: _set(d, "input_len", 2.5), r"column input_len: 2.5 \(row 0\) is not a whole number"),
    (lambda d: _set(d, "transfer_start_s", 1e300), r"column transfer_start_s: 1e\+300 \(row 0\) is not a time in seconds within a week"),
    (lambda d: pd.read_parquet(d / "requests.parquet").assign(kv_bytes_emulated=float("inf")).to_parquet(d / "requests.parquet"),
     r"column kv_bytes_emulated: inf \(row 0\) is not a finite number"),
    (lambda d: _set(d, "threshold", float("-inf")), r"column threshold: -inf \(row 0\) is not a threshold"),
])
def test_bad_run_directories_give_one_clear_error(run_a, damage, match):
    damage(run_a)
    with pytest.raises(UserError, match=match):
        load_run(run_a)


def _set(d, column, value):
    df = pd.read_parquet(d / "requests.parquet")
    df[column] = df[column].astype(float)
    df.loc[0, column] = value
    df.to_parquet(d / "requests.parquet")


@pytest.mark.parametrize("damage", [
    lambda d: (d / "scenario.yaml").write_text("name: x\nwan: true\npolicy: prfaas\n"),  # AttributeError tracebacks
    lambda d: (d / "scenario.yaml").write_text("name: x\nwan: {rate: 10Gbps, schedule: 0.5}\n"),  # TypeError
    lambda d: _set(d, "arrival_s", float("nan")) or _all_nan(d, "arrival_s"),  # no arrival time: an arange traceback
    lambda d: pd.concat([pd.read_parquet(d / "link.parquet")] * 2).to_parquet(d / "link.parquet"),  # a reindex traceback
])
def test_a_run_with_odd_but_readable_files_still_gets_its_report(run_a, tmp_path, damage):
    """What the loader accepts (the scenario as run is a plain mapping, a time may be missing, a telemetry sample
    repeated) the report draws, without the tracebacks these were before 2026-12-07."""
    damage(run_a)
    assert (write_report([run_a], tmp_path / "rep")).is_file()


def _all_nan(d, column):
    df = pd.read_parquet(d / "requests.parquet")
    df[column] = float("nan")
    df.to_parquet(d / "requests.parquet")


def test_report_of_a_run_directory_no_file_can_name_is_one_line(tmp_path, capsys):
    from testbed.cli import main

    assert main(["report", "x" * 5000]) == 2  # an ENAMETOOLONG traceback before
    assert capsys.readouterr().err.strip().endswith("not a run directory (it does not exist or is not a directory)")


def test_report_command_on_a_missing_directory_prints_one_line_and_exits_2(tmp_path, capsys):
    from testbed.cli import main

    assert main(["report", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a run directory" in err[0]


def test_report_of_a_two_minute_run_renders_within_a_loose_bound(tmp_path):
    d = write_run_dir(tmp_path / "long", duration_s=120, rate_rps=5)
    t0 = time.perf_counter()
    write_report([d])
    assert time.perf_counter() - t0 < 20.0  # loose here (shared CPU); benchmarks/model_bench.py checks the 10 s target


class FakeExecutor(Executor):
    """Stands in for a real executor in this unit test only: writes a synthetic run directory per task."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def run(self, tasks, on_done):
        for t in tasks:
            self.calls.append(t.out_dir.name)
            write_run_dir(t.out_dir, policy=t.overrides[-1], duration_s=10, seed=len(self.calls))
            on_done(RunOutcome(t, "ok", None, 0.0, "test"))


def test_sweep_runs_every_grid_point_then_resumes_without_rerunning(tmp_path):
    calls = []
    fake_runner = FakeExecutor(calls)

    scen = "quick"  # a whole scenario: every point is checked as a run would check it (experiments.engine.check_run)
    grid = ["wan.rate=10Gbps,20Gbps", "seed=1,2"]
    man = run_sweep(scen, grid, tmp_path / "sw", executor=fake_runner, report=False)
    assert len(calls) == 4 and all(v["status"] == "ok" for v in man["points"].values())
    assert "wan.rate=20Gbps,seed=2" in man["points"]
    # an interrupted point (no summary.json) is rerun; finished ones are skipped
    (tmp_path / "sw" / "points" / "wan.rate=10Gbps,seed=1" / "summary.json").unlink()
    calls.clear()
    man = run_sweep(scen, grid, tmp_path / "sw", executor=fake_runner)
    assert calls == ["wan.rate=10Gbps,seed=1"]
    assert (tmp_path / "sw" / "report.html").read_text().count("<tr><td>") == 4
    assert sum(v["status"].startswith("skipped") for v in man["points"].values()) == 3
    res = pd.read_parquet(tmp_path / "sw" / "results.parquet")
    assert len(res) == 4 and (res["status"] == "ok").all() and set(res["grid.seed"]) == {"1", "2"}
    assert res.set_index("arm").loc["wan.rate=10Gbps,seed=1", "requests_total"] == load_run(tmp_path / "sw" / "points" / "wan.rate=10Gbps,seed=1").metrics["requests_total"]


def test_sweep_refuses_a_bad_grid_and_bad_points_before_running(tmp_path):
    with pytest.raises(UserError, match="key=v1,v2"):
        parse_grid(["wan.rate"])
    with pytest.raises(UserError, match="twice"):
        parse_grid(["seed=1", "seed=2"])
    with pytest.raises(UserError, match="value '1' given twice"):  # two points, one run directory (was a ValueError traceback)
        parse_grid(["seed=1,2,1"])
    for gap in ("seed=1,,2", "seed=1,2,", "seed=,1"):  # `seed=1,,2` ran seeds 1 and 2 without a word
        with pytest.raises(UserError, match="an empty value"):
            parse_grid([gap])
    with pytest.raises(UserError, match="at least one value"):
        parse_grid(["seed="])
    assert len(expand(parse_grid(["a=1,2,3", "b=x,y"]))) == 6
    ran = []
    with pytest.raises(UserError, match="wan.rate"):
        run_sweep("quick", ["wan.rate=10Gbps,fast"], tmp_path / "sw", executor=FakeExecutor(ran))
    # a point that only the sections together refuse (plan_run), as `prfaas run` would, also before any runs
    with pytest.raises(UserError, match="serving.kv_congestion_control: 'nosuchcc' cannot be set on this host"):
        run_sweep("quick", ["serving.kv_congestion_control=null,nosuchcc"], tmp_path / "sw", executor=FakeExecutor(ran))
    scen = tmp_path / "net-only.yaml"  # no model, workload or policy: nothing a run could serve
    scen.write_text("name: s\nwan: {rate: 10Gbps}\n")
    with pytest.raises(UserError, match="model: is required for a run"):
        run_sweep(str(scen), ["wan.rate=10Gbps,20Gbps"], tmp_path / "sw", executor=FakeExecutor(ran))
    assert ran == []


def test_a_long_grids_point_folders_fit_a_file_name_and_resume(tmp_path):
    """A point's folder was named by all its overrides with no cap: a long grid died on OSError "File name too long"
    at its first run. Past 200 bytes (`validation.MAX_NAME_BYTES`) the name is cut and ends in a hash of the full
    overrides; a name that fits is unchanged, so a sweep begun before resumes into its points."""
    from experiments.sweep import SweepPoint

    fits = SweepPoint(("name=" + "a" * 186, "seed=1"))  # 200 characters: as before
    assert fits.name == "name=" + "a" * 186 + ",seed=1" and SweepPoint(("wan.rate=10Gbps", "seed=2")).name == "wan.rate=10Gbps,seed=2"
    calls = []
    grid = ["name=" + "a" * 200, "wan.delay=0.01" + "0" * 40 + "s", "seed=1,2"]  # the folder names were 267 bytes
    man = run_sweep("quick", grid, tmp_path / "sw", executor=FakeExecutor(calls), report=False)
    names = sorted(man["points"])
    assert len(names) == 2 and all(len(n.encode()) == 200 and re.fullmatch("name=a{178}~[0-9a-f]{16}", n) for n in names)
    assert names[0] != names[1] and sorted(p.name for p in (tmp_path / "sw" / "points").iterdir()) == names
    assert sorted(tuple(v["overrides"]) for v in man["points"].values()) == [(*grid[:2], "seed=1"), (*grid[:2], "seed=2")]
    assert json.loads((tmp_path / "sw" / "sweep.json").read_text())["points"] == man["points"]  # the full overrides, kept
    calls.clear()
    man = run_sweep("quick", grid, tmp_path / "sw", executor=FakeExecutor(calls), report=False)  # resumed: the same folders
    assert calls == [] and sorted(man["points"]) == names and all(v["status"].startswith("skipped") for v in man["points"].values())
    with pytest.raises(UserError) as exc:  # two points, one folder name
        expand(parse_grid(["workload.trace=a/b.jsonl,a_b.jsonl"]))
    assert str(exc.value) == ("--grid: points 'workload.trace=a/b.jsonl' and 'workload.trace=a_b.jsonl' would share the folder "
                              "points/workload.trace=a_b.jsonl; give values that differ in letters, digits or _.=+-")


def test_a_sweep_grid_plans_at_most_10000_runs():
    """The grid's points were listed whole with no bound (200 x 100 x 100 values: 2 million points, each then checked
    as a run before the first one ran); at most validation.MAX_RUNS."""
    many = ",".join(str(i) for i in range(200))
    assert len(expand(parse_grid([f"seed={many}", "b=" + ",".join(f"x{i}" for i in range(50))]))) == 10000
    with pytest.raises(UserError) as exc:
        parse_grid([f"seed={many}", "b=" + ",".join(f"x{i}" for i in range(100)), "c=" + ",".join(f"y{i}" for i in range(100))])
    assert str(exc.value) == ("--grid: 200 seed values x 100 b values x 100 c values make 2000000 runs, more than 10000, the most "
                              "runs one command may plan (validation.MAX_RUNS: about a week of one-minute runs); use fewer values")


def test_reports_label_a_prfaas_run_told_the_oracle_signals(tmp_path):
    from analysis.report import summary_rows
    from analysis.rundir import load_run

    labels = {}
    for mode in ("observed", "oracle"):
        d = tmp_path / mode
        write_run_dir(d, policy="prfaas", duration_s=5.0)
        s = json.loads((d / "summary.json").read_text())
        s["signals"] = mode
        (d / "summary.json").write_text(json.dumps(s))
        run = load_run(d)
        labels[mode] = (run.label, summary_rows([run], [{}])[1][0][1])
    assert "ORACLE" not in labels["observed"][0] and "ORACLE" not in labels["observed"][1]
    assert "[ORACLE signals]" in labels["oracle"][0] and "[ORACLE signals]" in labels["oracle"][1]
