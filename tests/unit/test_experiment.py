"""Experiment specs and the engine (experiments.spec, experiments.experiment) with a stand-in executor
that writes synthetic run directories through the real writer; the real runs: tests/integration/test_experiment.py."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from rundir_factory import write_run_dir, write_scenario_as_run  # noqa: E402

from experiments.executor import Executor, RunOutcome, make_executor  # noqa: E402
from experiments.experiment import run_experiment  # noqa: E402
from experiments.spec import parse_spec  # noqa: E402
from testbed.errors import UserError  # noqa: E402

SPEC = {"name": "t", "scenario": "quick", "set": {"duration": "20s"}, "arms": {"fast": {"policy.name": "prfaas"},
        "slow": {"policy.name": "fixed-threshold"}}, "seeds": 3, "baseline": "slow", "metrics": ["throughput_rps", "ttft_s.p50"]}


class Synthetic(Executor):
    """Stands in for running: arm "fast" gets twice the request rate of arm "slow" on the same seed."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    def run(self, tasks, on_done):
        for t in tasks:
            self.ran.append(t.key)
            seed = int(t.overrides[-1].split("=")[1])
            write_run_dir(t.out_dir, policy=t.key.split("/")[0], seed=seed, duration_s=20,
                          rate_rps=(10.0 if t.key.startswith("fast") else 5.0) + seed)
            on_done(RunOutcome(t, "ok", None, 0.1, "test"))


def test_spec_reads_arms_seeds_and_pairs_and_names_bad_fields():
    spec = parse_spec(SPEC, "s.yaml")
    assert [a.name for a in spec.arms] == ["fast", "slow"] and spec.seeds == (1, 2, 3) and spec.overrides == ("duration=20s",)
    assert spec.pairs() == [("fast", "slow")]
    for bad, match in [({"arms": {}}, "arms"), ({"seeds": [1, 1]}, "seeds.*repeat"), ({"baseline": "x"}, "baseline"),
                       ({"repetitions": 0}, "repetitions"), ({"colour": 1}, "colour.*unknown key")]:
        with pytest.raises(UserError, match=match):
            parse_spec({**SPEC, **bad}, "s.yaml")


@pytest.mark.parametrize("scenario", ["", [1, 2], 5, True])
def test_a_spec_scenario_that_is_no_name_is_refused_naming_the_field(scenario):
    """`scenario` was read with `str`: '' became the spec's folder ("cannot read (Is a directory)", neither the spec nor
    the field named) and [1, 2] the scenario "[1, 2]" (fuzzing pass 5, 2026-12-08)."""
    with pytest.raises(UserError) as exc:
        parse_spec({**SPEC, "scenario": scenario}, "s.yaml", Path("/tmp"))
    assert str(exc.value) == f"s.yaml: scenario: {scenario!r} is not a non-empty string"


def test_a_metric_that_is_no_summary_figure_is_refused_naming_the_figure_it_resembles():
    """`ttft_p90` was accepted and left out of comparison.json without a word, after every run had run."""
    with pytest.raises(UserError) as exc:
        parse_spec({**SPEC, "metrics": ["throughput_rps", "ttft_p90"]}, "s.yaml")
    assert str(exc.value).startswith("s.yaml: metrics: 'ttft_p90' is not a figure of a run's summary; did you mean ttft_s.p90")
    with pytest.raises(UserError, match="named twice"):
        parse_spec({**SPEC, "metrics": ["ttft_s.p90", "ttft_s.p90"]}, "s.yaml")
    assert parse_spec({**SPEC, "metrics": ["fidelity_rate_ratio", "queue.growing"]}).metrics == ("fidelity_rate_ratio", "queue.growing")


def test_the_metrics_a_spec_may_name_are_the_figures_of_a_runs_summary(tmp_path):
    """`spec.METRICS` against what a run's summary holds, flattened as results.parquet holds it: every number or
    true/false figure (the timing fidelity's too) is a metric, and every metric is such a figure."""
    from experiments.experiment import flatten
    from experiments.runs import summarize_run_dir
    from experiments.spec import METRICS
    from testbed.fidelity import summary_fields

    figures = {**flatten(summarize_run_dir(write_run_dir(tmp_path / "r"))), **summary_fields({"ok": True, "cpus": 2})}
    texts = {"compute", "model", "policy", "signals", "kv_congestion_control", "egress_gbps.source", "wan_gbps.source",
             "estimator.signals", "prefix_cache.hybrid", "fidelity_flags", "node", "early_stop", "drain_cut"}
    assert {k for k, v in figures.items() if isinstance(v, str)} <= texts  # figures that are words are no metric
    assert set(METRICS) == set(figures) - texts


def test_an_arm_cannot_set_its_own_seed_and_a_value_stays_what_the_spec_wrote():
    for where in ({"set": {"duration": "20s", "seed": 7}}, {"arms": {**SPEC["arms"], "odd": {"seed": None}}},
                  {"arms": {**SPEC["arms"], "odd": ["policy.name=prfaas", "seed=3"]}}):
        with pytest.raises(UserError, match=r"\.seed: each run's seed comes from the spec's seeds:"):
            parse_spec({**SPEC, **where}, "s.yaml")
    spec = parse_spec({**SPEC, "set": {"name": "a: b", "workload.output": 128, "policy.threshold": "16K",
                                       "serving.slo": {"ttft": "30s"}, "cross_traffic": None}})
    from testbed.scenario import apply_overrides

    assert apply_overrides({}, list(spec.overrides)) == {"name": "a: b", "workload": {"output": 128}, "policy": {"threshold": "16K"},
                                                         "serving": {"slo": {"ttft": "30s"}}, "cross_traffic": None}


def test_an_experiments_seeds_are_read_as_a_scenarios_seed_is():
    assert parse_spec({**SPEC, "seeds": [0, 2**32 - 1]}).seeds == (0, 2**32 - 1)
    for seeds, says in (([1, 10**400], "a 401-digit number is not a seed"), ([1, 2**32], "4294967296 is not a seed")):
        with pytest.raises(UserError) as exc:
            parse_spec({**SPEC, "seeds": seeds}, "s.yaml")
        assert str(exc.value) == f"s.yaml: seeds: {says}; use a whole number from 0 to 4294967295 (2**32 - 1)"


RUNS_WHY = "the most runs one command may plan (validation.MAX_RUNS: about a week of one-minute runs)"


def test_an_experiment_plans_at_most_10000_runs():
    """`seeds: 100000000` built a 10^8-seed list, then checked each of its 2 x 10^8 runs' scenario (hours) before the
    first run; `repetitions` had no bound either (validation.MAX_RUNS)."""
    import time

    assert len(parse_spec({**SPEC, "seeds": 5000}).seeds) == 5000  # 2 arms x 5000 seeds: 10000 runs
    t0 = time.monotonic()
    for bad, says in (({"seeds": 10**8}, f"seeds: 100000000 is more than 10000, {RUNS_WHY}"),
                      ({"seeds": 10**30}, f"seeds: a 31-digit number is more than 10000, {RUNS_WHY}"),
                      ({"repetitions": 10001}, f"repetitions: 10001 is more than 10000, {RUNS_WHY}"),
                      ({"seeds": 5001}, f"seeds: 2 arm(s) x 5001 seed(s) x 1 repetition(s) make 10002 runs, more than 10000, "
                                        f"{RUNS_WHY}; use fewer, or split the experiment"),
                      ({"seeds": [1, 2], "repetitions": 2501}, f"repetitions: 2 arm(s) x 2 seed(s) x 2501 repetition(s) make "
                                                               f"10004 runs, more than 10000, {RUNS_WHY}; use fewer, or split the experiment")):
        with pytest.raises(UserError) as exc:
            parse_spec({**SPEC, **bad}, "s.yaml")
        assert str(exc.value) == f"s.yaml: {says}"
    assert time.monotonic() - t0 < 5.0


def test_an_experiments_name_is_a_plain_name_as_a_scenarios(tmp_path):
    """`name` was read with `str`: `name: [1, 2]` ran as experiment "[1, 2]", `name: {a: 1}` as "{'a': 1}"; and without
    `name:` the spec file's name was used unchecked."""
    from experiments.spec import load_spec

    assert parse_spec({**SPEC, "name": 7}).name == "7" and parse_spec({k: v for k, v in SPEC.items() if k != "name"}, "d/p.yaml").name == "p"
    for name, says in (([1, 2], "[1, 2] is not a non-empty string"), ({"a": 1}, "{'a': 1} is not a non-empty string"),
                       ("", "'' is not a non-empty string"), (True, "True is not a non-empty string"),
                       ("a/b", "'a/b' is not a plain name (it names the experiment in results.parquet and report.md); use letters, "
                               "digits, '-', '_' or '.', without '/'")):
        with pytest.raises(UserError) as exc:
            parse_spec({**SPEC, "name": name}, "s.yaml")
        assert str(exc.value) == f"s.yaml: name: {says}"
    long = tmp_path / ("e" * 240 + ".yaml")
    long.write_text(json.dumps({k: v for k, v in SPEC.items() if k != "name"}))
    with pytest.raises(UserError) as exc:
        load_spec(long)
    assert str(exc.value) == (f"{long}: name: not given, and the file's name cannot stand for it: 'eeeeeeeeeeeeeeeeeeeeeeee'... is "
                              "240 bytes long; a name is at most 200 bytes (it names the experiment in results.parquet and "
                              "report.md, and a file or directory name is at most 255); add name: <a plain name> to the file")


def test_an_arm_name_is_at_most_200_bytes_as_it_names_a_directory():
    """An arm's runs go to DIR/runs/<arm>/: a 300-character arm name was an OSError at the first run."""
    assert parse_spec({**SPEC, "arms": {"a" * 200: {}}, "baseline": None}).arms[0].name == "a" * 200
    with pytest.raises(UserError) as exc:
        parse_spec({**SPEC, "arms": {"a" * 201: {}}, "baseline": None}, "s.yaml")
    assert str(exc.value) == ("s.yaml: arms: 'aaaaaaaaaaaaaaaaaaaaaaaa'... is 201 bytes long; a name is at most 200 bytes (it names its "
                              "runs' directory DIR/runs/<arm>, and a file or directory name is at most 255)")


def test_experiment_writes_one_row_per_run_and_paired_comparisons_then_resumes(tmp_path):
    ex = Synthetic()
    res = run_experiment(parse_spec({**SPEC, "seeds": 4}), tmp_path / "e", ex, progress=False)  # 4: the fewest with an interval
    df = pd.read_parquet(res["results"])
    assert len(df) == 8 and set(df["arm"]) == {"fast", "slow"} and (df["status"] == "ok").all()
    assert {"run_dir", "seed", "repetition", "throughput_rps", "ttft_s.p50", "prefix_cache.ideal_hit_tokens"} <= set(df.columns)
    comp = json.loads(res["comparison"].read_text())
    assert [c["metric"] for c in comp] == ["throughput_rps", "ttft_s.p50"]
    thr = comp[0]
    assert set(thr) >= {"metric", "arm_a", "arm_b", "a", "b", "ratio", "ci_low", "ci_high", "n", "significant"}
    assert (thr["arm_a"], thr["arm_b"], thr["n"]) == ("fast", "slow", 4)
    by_arm = df.groupby("arm")["throughput_rps"].mean()
    assert thr["ratio"] == pytest.approx(by_arm["fast"] / by_arm["slow"])
    assert thr["ci_low"] <= thr["ratio"] <= thr["ci_high"]
    assert "fast" in res["report"].read_text() and "fewer than 10 pairs" in res["report"].read_text()
    ex.ran.clear()
    run_experiment(parse_spec({**SPEC, "seeds": 4}), tmp_path / "e", ex, progress=False)
    assert ex.ran == []  # every run finished before: nothing reruns


def test_unknown_executor_is_refused_in_one_line():
    with pytest.raises(UserError, match="unknown executor.*local"):
        make_executor("cluster")


def test_an_arm_a_run_would_refuse_is_refused_before_the_first_run(tmp_path):
    """Checked as `prfaas run` checks it (plan_run), not only as a file: a setting the host's kernel refuses
    (or that only the sections together refuse) stops the whole experiment in one line before any arm has run."""
    ex = Synthetic()
    spec = {**SPEC, "arms": {**SPEC["arms"], "odd-tcp": {"serving.kv_congestion_control": "nosuchcc"}}}
    with pytest.raises(UserError, match="serving.kv_congestion_control: 'nosuchcc' cannot be set on this host"):
        run_experiment(parse_spec(spec), tmp_path / "e", ex, progress=False)
    assert ex.ran == [] and not (tmp_path / "e" / "runs").exists()


def test_a_finished_run_is_checked_as_a_file_only_so_a_resumed_batch_does_not_ask_this_hosts_kernel(tmp_path):
    """The runs of arm "odd" finished (on a host that could set its congestion control); resuming the batch here
    runs only what is missing and reads them back, whatever this host's kernel says of the name."""
    spec = parse_spec({**SPEC, "arms": {"odd": {"serving.kv_congestion_control": "nosuchcc"}, "slow": {"policy.name": "fixed-threshold"}}})
    for seed in spec.seeds:  # as a run of the arm writes them (no task.json: compared by their scenario.yaml)
        run = write_run_dir(tmp_path / "e" / "runs" / "odd" / f"seed{seed}-rep1", policy="odd", seed=seed, duration_s=20, rate_rps=9.0)
        write_scenario_as_run(run, "quick", [*spec.overrides, *spec.arms[0].overrides, f"seed={seed}"])
    ex = Synthetic()
    res = run_experiment(spec, tmp_path / "e", ex, progress=False)
    assert sorted(ex.ran) == ["slow/seed1-rep1", "slow/seed2-rep1", "slow/seed3-rep1"]
    assert len(pd.read_parquet(res["results"])) == 6


def test_arms_alternate_within_each_seed_block_and_each_run_records_its_place(tmp_path):
    """Blocked and counterbalanced: a pair's two runs run next to each other, and the arm that runs first alternates
    from seed to seed, so a drift of the host over the experiment does not fall on one arm."""
    ex = Synthetic()
    res = run_experiment(parse_spec(SPEC), tmp_path / "e", ex, progress=False)
    assert ex.ran == ["fast/seed1-rep1", "slow/seed1-rep1", "slow/seed2-rep1", "fast/seed2-rep1",
                      "fast/seed3-rep1", "slow/seed3-rep1"]
    df = pd.read_parquet(res["results"]).set_index("run_dir")
    assert [int(df.loc[f"runs/{k}", "order"]) for k in ex.ran] == [1, 2, 3, 4, 5, 6]
    assert "Run order" not in res["report"].read_text()  # no order effect planted: none reported


class SecondIsSlower(Synthetic):
    """Stands in for a host that drifts within a block: whichever arm runs second in its seed block gets 0.7x the
    request rate it would have had."""

    def run(self, tasks, on_done):
        seen: set[int] = set()
        for t in tasks:
            self.ran.append(t.key)
            seed = int(t.overrides[-1].split("=")[1])
            rate = (10.0 if t.key.startswith("fast") else 5.0) + seed
            write_run_dir(t.out_dir, policy=t.key.split("/")[0], seed=seed, duration_s=20,
                          rate_rps=rate * (0.7 if seed in seen else 1.0))
            seen.add(seed)
            on_done(RunOutcome(t, "ok", None, 0.1, "test"))


def test_a_ratio_that_moves_with_the_run_order_is_reported(tmp_path):
    res = run_experiment(parse_spec({**SPEC, "seeds": 8}), tmp_path / "e", SecondIsSlower(), progress=False)
    text = res["report"].read_text()
    assert "Run order:" in text
    line = next(x for x in text.splitlines() if x.startswith("- fast / slow on throughput_rps"))
    # fast first: fast full rate, slow at 0.7x -> ratio above the true one; slow first: the other way
    assert "when fast ran first (n = 4)" in line and "when slow ran first (n = 4)" in line


def test_a_scenario_that_cannot_be_a_file_name_is_refused_naming_the_field(tmp_path):
    """A NUL byte in `scenario` was a ValueError traceback from Path.resolve (2026-12-07)."""
    with pytest.raises(UserError, match=r"s.yaml: scenario: 'a\\x00b.yaml' is not a file name \(embedded null byte\)"):
        parse_spec({**SPEC, "scenario": "a\x00b.yaml"}, "s.yaml", tmp_path)


def _finished(tmp_path: Path) -> Path:
    run_experiment(parse_spec(SPEC), tmp_path / "e", Synthetic(), progress=False)
    return tmp_path / "e" / "runs" / "fast" / "seed2-rep1"


def test_a_finished_run_that_no_longer_loads_is_refused_and_kept_not_run_again(tmp_path):
    """Resume policy (docs/experiments.md, "Resuming"): a run with its summary.json that does not load (damaged, or
    of an older testbed) was deleted and run again; it is kept as it is and the resume stops before any run."""
    run = _finished(tmp_path)
    (run / "summary.json").write_bytes(b"\xc7garbage")
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    ex = Synthetic()
    with pytest.raises(UserError, match=r"seed2-rep1: a finished run \(it has its summary.json\) that no longer loads: .*summary.json: "
                                        r"not UTF-8 text .*left as it is: move it aside"):
        run_experiment(parse_spec(SPEC), tmp_path / "e", ex, progress=False)
    assert ex.ran == [] and {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    (run / "summary.json").unlink()
    (run / "summary.json").symlink_to("summary.json")  # a loop: there, though it cannot be read
    with pytest.raises(UserError, match=r"seed2-rep1: a finished run .* no longer loads"):
        run_experiment(parse_spec(SPEC), tmp_path / "e", ex, progress=False)
    assert ex.ran == []


def test_a_run_that_stopped_before_its_summary_runs_again(tmp_path):
    run = _finished(tmp_path)
    (run / "summary.json").unlink()
    (run / "requests.parquet").write_bytes(b"PAR1")  # cut off mid-run
    ex = Synthetic()
    run_experiment(parse_spec(SPEC), tmp_path / "e", ex, progress=False)
    assert ex.ran == ["fast/seed2-rep1"]


def test_a_resume_with_other_settings_is_refused_instead_of_reusing_the_old_runs(tmp_path):
    """Each run records what it was asked to run (task.json); another spec, other overrides or an edited scenario
    into the same --out reported the old runs as the new settings' until 2026-12-07."""
    run = _finished(tmp_path)
    assert json.loads((run / "task.json").read_text())["settings"]["policy"]["name"] == "prfaas"
    ex = Synthetic()
    other = {**SPEC, "arms": {"fast": {"policy.name": "fixed-threshold"}, "slow": {"policy.name": "fixed-threshold"}}}
    with pytest.raises(UserError, match=r"runs/fast/seed1-rep1: holds a finished run of other settings than this one asks for "
                                        r"\(policy.name: 'prfaas' there, 'fixed-threshold' now\); use another --out"):
        run_experiment(parse_spec(other), tmp_path / "e", ex, progress=False)
    with pytest.raises(UserError, match=r"duration: '20s' there, '25s' now"):
        run_experiment(parse_spec({**SPEC, "set": {"duration": "25s"}}), tmp_path / "e", ex, progress=False)
    assert ex.ran == []
    run_experiment(parse_spec({**SPEC, "seeds": 4}), tmp_path / "e", ex, progress=False)  # more seeds: the same settings
    assert sorted(ex.ran) == ["fast/seed4-rep1", "slow/seed4-rep1"]


def test_a_finished_run_without_task_json_is_compared_by_its_scenario_yaml_and_refused_on_other_settings(tmp_path):
    """Resume policy (docs/experiments.md, "Resuming"): a finished run without a task.json (run before it existed, run
    alone, or stopped between its summary and its task.json) was reused whatever it ran. It is compared now by the
    scenario it ran (its scenario.yaml) with what a run of its task writes there: the same is skipped, anything else
    refused before any run, naming the run and the settings that differ, and kept as it is."""
    from experiments.engine import finished_tasks
    from experiments.executor import RunTask

    run = _finished(tmp_path)
    (run / "task.json").unlink()  # its scenario.yaml: the synthetic run's own, not quick's
    kept = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    ex = Synthetic()
    with pytest.raises(UserError) as exc:
        run_experiment(parse_spec(SPEC), tmp_path / "e", ex, progress=False)
    assert str(exc.value).startswith(f"{run}: holds a finished run of other settings than this one asks for (")
    assert str(exc.value).endswith("; ...; read from its scenario.yaml, as it has no task.json); use another --out, or move "
                                   "that run aside to run it again")
    assert ex.ran == [] and {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == kept
    for r in (tmp_path / "e" / "runs").glob("*/seed*-rep1"):  # every run as a real run of its task writes it, none with task.json
        (r / "task.json").unlink(missing_ok=True)
        arm, seed = r.parent.name, int(r.name[4])
        write_scenario_as_run(r, "quick", ["duration=20s", f"policy.name={SPEC['arms'][arm]['policy.name']}", f"seed={seed}"])
    res = run_experiment(parse_spec(SPEC), tmp_path / "e", ex, progress=False)  # the same settings: skipped, read back
    assert ex.ran == [] and len(pd.read_parquet(res["results"])) == 6
    with pytest.raises(UserError, match=r"runs/fast/seed1-rep1: holds a finished run of other settings than this one asks for "
                                        r"\(duration: '20s' there, '25s' now; read from its scenario.yaml, as it has no task.json\)"):
        run_experiment(parse_spec({**SPEC, "set": {"duration": "25s"}}), tmp_path / "e", ex, progress=False)
    with pytest.raises(UserError, match=r"\(serving.instances.pd_decode: 2 there, 1 now; serving.instances.pd_prefill: 2 there, "
                                        r"1 now; serving.instances.prfaas_prefill: 2 there, 1 now; read from its scenario.yaml"):
        run_experiment(parse_spec({**SPEC, "set": {"duration": "20s", "serving.instances": None}}), tmp_path / "e", ex,
                       progress=False)  # the serving plan's choices (one instance per host now) the run wrote out: compared too
    assert ex.ran == []
    # scale: auto is taken as the run resolved it on its host, as a task.json records "auto" whatever it resolved to
    auto = RunTask("k", "quick", ("scale=auto",), write_scenario_as_run(write_run_dir(tmp_path / "auto"), "quick", ["scale=auto"], auto_scale=7))
    assert finished_tasks([auto]) == [auto]
    with pytest.raises(UserError, match=r"\(scale: 7.0 there, 10.0 now; read from its scenario.yaml"):
        finished_tasks([RunTask("k", "quick", (), auto.out_dir)])


def test_a_refused_resume_names_a_setting_that_is_only_on_one_side(tmp_path):
    """A setting one side has and the other lacks (an empty mapping, or a null, where the other has no key: a
    scenario.yaml written otherwise) is a difference, and the refusal names it: it said "other settings (; read
    from its scenario.yaml, ...)" naming none, as the settings were compared flattened, where such a key vanished."""
    import yaml

    from experiments.engine import finished_tasks
    from experiments.executor import RunTask

    run = write_scenario_as_run(write_run_dir(tmp_path / "r"), "quick", ["seed=1"])
    task = RunTask("k", "quick", ("seed=1",), run)
    assert finished_tasks([task]) == [task]
    ran = yaml.safe_load((run / "scenario.yaml").read_text())
    for extra, said in (({"faults": {}}, "faults: {} there, nothing now"), ({"faults": None}, "faults: None there, nothing now")):
        (run / "scenario.yaml").write_text(yaml.safe_dump({**ran, **extra}, sort_keys=False))
        with pytest.raises(UserError) as exc:
            finished_tasks([task])
        assert f"other settings than this one asks for ({said}; read from its scenario.yaml" in str(exc.value)


def test_a_file_where_a_run_or_its_folder_goes_is_refused_before_any_run(tmp_path):
    run = _finished(tmp_path)
    shutil.rmtree(run)
    run.write_text("x")
    ex = Synthetic()
    with pytest.raises(UserError, match=r"seed2-rep1: not a folder, where this run's directory goes; move it aside"):
        run_experiment(parse_spec(SPEC), tmp_path / "e", ex, progress=False)
    run.unlink()
    shutil.rmtree(tmp_path / "e" / "runs" / "slow")
    (tmp_path / "e" / "runs" / "slow").write_text("x")
    with pytest.raises(UserError, match=r"runs/slow: cannot create this folder"):
        run_experiment(parse_spec(SPEC), tmp_path / "e", ex, progress=False)
    assert ex.ran == []
