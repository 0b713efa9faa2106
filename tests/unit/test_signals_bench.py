"""benchmarks/signals_bench.py's verdict: only the prfaas-observed arm is judged (against fixed-threshold of
the same seeds), so a run of other arms alone judges nothing and must not read as "all targets met"."""

from __future__ import annotations

import runpy
from pathlib import Path

from rich.console import Console

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "signals_bench.py"
compare = runpy.run_path(str(SCRIPT), run_name="signals_bench")["compare"]  # loaded as test_compile_probe loads its benchmark


def row(arm: str, seed: int, long_s: float, slo: float = 1.0) -> dict:
    return {"shape": "val-rtt-surge", "arm": arm, "seed": seed, "long_p90_s": long_s, "short_p90_s": 1.0, "xfer_p90_s": 1.0,
            "slo": slo, "failed": 0, "est_mae": None, "detect_s": None, "signals": "observed"}


def test_other_arms_alone_judge_nothing() -> None:
    rows = [row(arm, s, 5.0) for arm in ("fixed-threshold", "prfaas-oracle", "all-local") for s in (1, 2, 3)]
    assert compare(rows, Console(quiet=True)) == (True, 0)


def test_the_observed_arm_is_judged_against_fixed_threshold_of_the_same_seeds() -> None:
    fixed = [row("fixed-threshold", s, 10.0) for s in (1, 2, 3)]
    better = [row("prfaas-observed", s, 5.0) for s in (1, 2, 3)]  # long P90 ratio 0.5, transfer and short 1.0
    ok, judged = compare(fixed + better, Console(quiet=True))
    assert judged == 4 and not ok  # transfer P90 ratio 1.0 > 0.7
    unpaired = [row("prfaas-observed", s, 5.0) for s in (4, 5)]
    assert compare(fixed + unpaired, Console(quiet=True)) == (True, 0)


bench = runpy.run_path(str(SCRIPT), run_name="signals_bench")


def test_the_no_event_arm_runs_each_shape_without_its_event_and_is_not_judged(tmp_path: Path) -> None:
    from testbed.sections import load_scenario

    todo = {t.key: t for t in bench["tasks"](list(bench["SHAPES"]) + ["case-study"], [3], ["fixed-threshold", "fixed-no-event"], tmp_path, [])}
    for shape in (*bench["SHAPES"], "case-study"):
        base = load_scenario(shape, list(todo[f"{shape}/fixed-threshold-s3"].overrides))
        cut = load_scenario(shape, list(todo[f"{shape}/fixed-no-event-s3"].overrides))
        assert cut.seed == base.seed == 3 and cut.raw["policy"] == base.raw["policy"]
        assert cut.raw["wan"].get("schedule") in (None, []), shape
        # what stays: the rate, the neighbours that run all along; what goes: an event in time
        assert cut.raw["wan"]["rate"] == base.raw["wan"]["rate"]
        flows = cut.raw["cross_traffic"]["flows"]
        assert [f["name"] for f in flows] == ["vpc-neighbours"] and not any("start" in f for f in flows), shape
        differs = base.raw["wan"].get("schedule") or len(base.raw["cross_traffic"]["flows"]) > 1
        assert differs, f"{shape} has no event for the no-event arm to take out"
    rows = [row(arm, s, long_s) for arm, long_s in (("fixed-threshold", 10.0), ("fixed-no-event", 8.0)) for s in (1, 2, 3)]
    assert compare(rows, Console(quiet=True)) == (True, 0)


def test_results_cover_every_finished_run_under_the_directory_whichever_invocation_made_it(tmp_path: Path) -> None:
    """Session 30: `--arms prfaas-observed` alone rewrote results.json with that arm only, dropping the
    fixed-threshold runs an earlier invocation had made in the same directory (the pairs it is judged by)."""
    from testbed.rundir import SUMMARY_FILE

    for name in ("val-thin-line/fixed-threshold-s1", "val-thin-line/prfaas-observed-s1", "val-thin-line/fixed-no-event-s12",
                 "val-dip/prfaas-observed-s2"):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / SUMMARY_FILE).write_text("{}")
    (tmp_path / "val-dip/prfaas-observed-s3").mkdir()  # unfinished: no summary
    (tmp_path / "notes/prfaas-observed-s1").mkdir(parents=True)  # not a shape
    (tmp_path / "notes/prfaas-observed-s1" / SUMMARY_FILE).write_text("{}")
    found = [(shape, arm, seed) for shape, arm, seed, _ in bench["completed"](tmp_path)]
    assert found == [("val-dip", "prfaas-observed", 2), ("val-thin-line", "fixed-no-event", 12),
                     ("val-thin-line", "fixed-threshold", 1), ("val-thin-line", "prfaas-observed", 1)]


def test_the_single_raise_arms_are_reported_not_judged_and_plotted_with_their_intervals(tmp_path: Path) -> None:
    todo = {t.key: t for t in bench["tasks"](["val-40g-dip"], [2], ["oracle-step-48k"], tmp_path, [])}
    assert ("policy.name=oracle-step", "policy.signals=oracle", "policy.event_threshold=48K") == todo["val-40g-dip/oracle-step-48k-s2"].overrides[:3]
    assert "oracle-step-48k" not in bench["DEFAULT_ARMS"]  # not in the default matrix
    rows = [row(arm, s, long_s) | {"shape": "val-40g-dip"}
            for arm, long_s in (("fixed-threshold", 10.0), ("oracle-step-24k", 8.0), ("oracle-step-48k", 6.0)) for s in (1, 2, 3)]
    assert compare(rows, Console(quiet=True)) == (True, 0)
    (path,) = bench["plot_steps"](rows, tmp_path)
    assert path.name == "steps-val-40g-dip.png" and path.stat().st_size > 10_000
    assert bench["plot_steps"]([r for r in rows if "step" not in r["arm"]], tmp_path) == []


def test_the_natives_first_arms_add_the_pd_queue_to_their_arm_and_are_reported_not_judged(tmp_path: Path) -> None:
    todo = {t.key: t for t in bench["tasks"](["val-40g-dip"], [4], list(bench["QUEUE_ARMS"]), tmp_path, [])}
    assert todo["val-40g-dip/prfaas-observed-natives-first-s4"].overrides[:3] == (
        "policy.name=prfaas", "policy.signals=observed", "policy.pd_queue=natives-first")
    assert todo["val-40g-dip/oracle-step-32k-natives-first-s4"].overrides[:4] == (
        "policy.name=oracle-step", "policy.signals=oracle", "policy.event_threshold=32K", "policy.pd_queue=natives-first")
    assert not set(bench["QUEUE_ARMS"]) & set(bench["DEFAULT_ARMS"])
    (tmp_path / "val-40g-dip/prfaas-observed-natives-first-s4").mkdir(parents=True)  # the arm's name parses back from its directory
    (tmp_path / "val-40g-dip/prfaas-observed-natives-first-s4/summary.json").write_text("{}")
    assert [(arm, seed) for _, arm, seed, _ in bench["completed"](tmp_path)] == [("prfaas-observed-natives-first", 4)]
    rows = [row(arm, s, 5.0) for arm in ("fixed-threshold", "prfaas-observed-natives-first") for s in (1, 2, 3)]
    assert compare(rows, Console(quiet=True)) == (True, 0)


def test_each_shapes_table_names_the_congestion_control_its_kv_ran() -> None:
    console = Console(record=True, width=200)
    rows = [{**row(arm, s, 5.0), "kv_cc": cc} for arm in ("fixed-threshold", "prfaas-observed") for s, cc in ((1, "cubic"), (2, "bbr"))]
    compare(rows, console)
    assert "(KV over TCP bbr + cubic; MIXED: these pairs compare different transports)" in console.export_text()
    console = Console(record=True, width=200)
    compare([{**r, "kv_cc": "cubic"} for r in rows], console)
    assert "(KV over TCP cubic)" in console.export_text()
    console = Console(record=True, width=200)
    compare([{**r, "kv_cc": None} for r in rows], console)  # runs from before the record
    assert "(KV over TCP not recorded)" in console.export_text()


def test_a_seed_without_a_figure_is_left_out_of_its_mean_not_a_crash() -> None:
    fixed = [row("fixed-threshold", s, 10.0) for s in (1, 2, 3)]
    arm = [row("prfaas-observed", s, 5.0) for s in (1, 2)] + [{**row("prfaas-observed", 3, 5.0), "long_p90_s": None, "slo": None}]
    console = Console(record=True, width=200)
    ok, judged = compare(fixed + arm, console)  # seed 3 had no long request in its window
    assert judged == 4 and not ok
    text = console.export_text()
    assert "long P90 TTFT" in text and "│ 2 " in text  # two seeds' long ratio, the third left out


def test_a_set_the_host_refuses_stops_the_bench_before_its_first_run(tmp_path: Path, monkeypatch) -> None:
    import sys

    import pytest

    from testbed.errors import UserError

    monkeypatch.setattr(sys, "argv", ["signals_bench.py", "--shapes", "val-dip", "--seeds", "1", "--arms", "fixed-threshold",
                                      "--set", "serving.kv_congestion_control=nosuchcc", "--out", str(tmp_path / "b")])
    with pytest.raises(UserError, match="serving.kv_congestion_control: 'nosuchcc' cannot be set on this host"):
        bench["main"]()
    assert not (tmp_path / "b").exists()


def test_the_arms_of_a_seed_run_together_and_their_order_alternates_from_seed_to_seed(tmp_path) -> None:
    tasks = runpy.run_path(str(SCRIPT), run_name="signals_bench")["tasks"]
    keys = [t.key for t in tasks(["val-dip"], [1, 2, 3], ["fixed-threshold", "prfaas-observed"], tmp_path, [])]
    assert keys == ["val-dip/fixed-threshold-s1", "val-dip/prfaas-observed-s1", "val-dip/prfaas-observed-s2",
                    "val-dip/fixed-threshold-s2", "val-dip/fixed-threshold-s3", "val-dip/prfaas-observed-s3"]


def test_each_runs_timing_fidelity_is_shown_and_a_flagged_runs_reason_printed() -> None:
    """Session 57: the case study's router ran seconds late for 36 runs and the bench's tables never said so. A run's
    fidelity flags now reach its row and the output (judged all the same, as `prfaas capacity` does)."""
    console = Console(record=True, width=250)
    rows = [row("fixed-threshold", 1, 10.0), {**row("prfaas-observed", 1, 5.0),
            "fidelity_flags": "the router's control loop ticked 1.20 s late at p99 (tolerance 0.2 s)"}]
    bench["print_runs"](rows, console)
    text = console.export_text()
    assert text.count("FLAGGED") == 1 and text.count(" ok ") >= 1
    assert "timing fidelity flagged val-rtt-surge/prfaas-observed-s1: the router's control loop ticked 1.20 s late" in text
    assert "1 of 2 runs flagged for timing fidelity" in text
    quiet = Console(record=True, width=250)
    bench["print_runs"]([row("fixed-threshold", 1, 10.0)], quiet)
    assert "flagged" not in quiet.export_text()


def test_the_client_clock_times_requests_by_the_clients_stamps(tmp_path: Path) -> None:
    """`--ttft-clock client` (session 59): TTFT from the client's send to the first token it read, as vLLM's bench serve
    times a request. A client that saw every first token 0.5 s after the router sent it reads every TTFT 0.5 s longer;
    a run without the client's columns has no such figure, not a crash."""
    import pandas as pd
    import pytest

    from testbed.rundir import REQUESTS_FILE
    from tests.unit.rundir_factory import write_run_dir

    d = write_run_dir(tmp_path / "run", duration_s=60, rate_rps=8, dip=None)
    router = bench["measure"](d)
    df = pd.read_parquet(d / REQUESTS_FILE)
    df["client_arrival_s"], df["client_first_token_s"] = df["arrival_s"], df["first_token_s"] + 0.5
    df.to_parquet(d / REQUESTS_FILE)
    assert bench["measure"](d) == router  # the router's clock (the default) does not read the client's columns
    client = bench["measure"](d, "client")
    assert client["long_p90_s"] == pytest.approx(router["long_p90_s"] + 0.5)
    assert client["short_p90_s"] == pytest.approx(router["short_p90_s"] + 0.5)
    assert client["xfer_p90_s"] == pytest.approx(router["xfer_p90_s"]) and client["slo"] <= router["slo"]
    gone = df.drop(columns=["client_arrival_s", "client_first_token_s"])
    gone.to_parquet(d / REQUESTS_FILE)
    assert bench["measure"](d, "client")["long_p90_s"] is None


def test_the_long_p90_target_needs_an_interval_below_1_which_three_seeds_do_not_give() -> None:
    """Three seeds' ratios (0.5 each) were a zero-width interval [0.50, 0.50], read as "hi < 1": met on nothing."""
    def long_row(seeds: range) -> str:
        rows = [row("fixed-threshold", s, 10.0) for s in seeds] + [row("prfaas-observed", s, 5.0) for s in seeds]
        console = Console(record=True, width=200)
        compare(rows, console)
        return next(x for x in console.export_text().splitlines() if "long P90 TTFT" in x)

    three = long_row(range(1, 4))
    assert "[0.50, 0.50]" not in three and three.rstrip(" │").endswith("NO")  # no interval (rich shows "[nan, nan]" as nothing)
    four = long_row(range(1, 5))  # four seeds, every ratio 0.5: degenerate, and below 1
    assert "[0.50, 0.50]" in four and four.rstrip(" │").endswith("yes")
