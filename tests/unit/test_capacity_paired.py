"""The paired order test of two deployments' capacities (experiments.capacity_paired): McNemar's exact test
on the seeds where exactly one configuration passes, at the geometric mean of their Lambda_max, with runs
judged and placed as the capacity search's. The evaluators are stand-ins with a known edge per seed."""

from __future__ import annotations

import argparse
import math

import pytest

from experiments import capacity_paired as cp
from experiments.capacity import RunVerdict


def _evaluator(edges: dict[int, float], calls: list | None = None):
    """Passes seed s at rates up to edges[s] (a stand-in for real runs)."""

    def evaluate(rate, seeds):
        if calls is not None:
            calls.append((rate, list(seeds)))
        return [RunVerdict(rate, s, rate <= edges[s], 1.0, rate > edges[s], 300, "" if rate <= edges[s] else "grows")
                for s in seeds]

    return evaluate


def test_the_rate_is_the_geometric_mean_to_the_digits_runs_are_named_with():
    assert cp.paired_rate(1.953, 2.157) == 2.052  # sqrt(4.212621) = 2.05247
    assert cp.paired_rate(2.0, 2.0) == 2.0
    with pytest.raises(ValueError, match="must be > 0"):
        cp.paired_rate(0.0, 2.0)


def test_every_seed_on_the_higher_side_orders_them_at_six_seeds_not_five():
    # a heavy draw (seed 1) lowers both edges, so unpaired every-run intervals overlap ([1.35, 2.0] vs
    # [1.9, 2.3]); seed by seed the higher configuration is ~10% above
    low = {1: 1.35, 2: 1.95, 3: 1.98, 4: 1.9, 5: 2.0, 6: 1.93}
    high = {s: e * 1.1 for s, e in low.items()}
    res = cp.paired_order(_evaluator(high), _evaluator(low), 1.9, range(1, 7), ("naive", "homo"))
    # at 1.9 seed 1 fails both (1.35 x 1.1 = 1.485 < 1.9) and every other seed passes both: all concordant
    assert res.higher_passed == [False, True, True, True, True, True]
    assert res.lower_passed == [False, True, True, True, True, True]
    assert (res.higher_only, res.lower_only, res.p_value, res.significant) == (0, 0, None, False)
    assert "no seed where exactly one passed" in res.sentence()
    rate = cp.paired_rate(1.95, 1.95 * 1.1)
    six = cp.paired_order(_evaluator({s: 2.1 for s in range(1, 7)}), _evaluator({s: 1.95 for s in range(1, 7)}), rate,
                          range(1, 7), ("naive", "homo"))
    assert (six.higher_only, six.lower_only) == (6, 0)
    assert six.p_value == pytest.approx(2 / 2 ** 6) and six.significant
    assert six.sentence().startswith("naive sustains more than homo at 2.045 req/s on 6 shared seeds")
    five = cp.paired_order(_evaluator({s: 2.1 for s in range(1, 6)}), _evaluator({s: 1.95 for s in range(1, 6)}), rate,
                           range(1, 6), ("naive", "homo"))
    assert five.p_value == pytest.approx(2 / 2 ** 5) and not five.significant
    assert five.sentence().startswith("no significant difference between naive and homo")


def test_concordant_seeds_say_nothing_and_the_reverse_order_is_not_called_significant():
    seeds = range(1, 9)
    hi = {s: (1.0 if s <= 7 else 3.0) for s in seeds}  # fails at 2.0 on seeds 1-7
    lo = {s: (3.0 if s <= 7 else 1.0) for s in seeds}  # passes at 2.0 on seeds 1-7
    res = cp.paired_order(_evaluator(hi), _evaluator(lo), 2.0, seeds, ("a", "b"))
    assert (res.higher_only, res.lower_only) == (1, 7)
    assert res.p_value == pytest.approx(0.0703125)  # 2 x P(X <= 1), X ~ Bin(8, 1/2) = 2 x 9/256
    assert not res.significant and not res.reversed
    flipped = cp.paired_order(_evaluator({s: 1.0 for s in range(1, 7)}), _evaluator({s: 3.0 for s in range(1, 7)}), 2.0,
                              range(1, 7), ("a", "b"))
    assert flipped.reversed and not flipped.significant
    assert flipped.sentence().startswith("b sustains more than a, against the searches' order")
    both = cp.paired_order(_evaluator({1: 3.0, 2: 3.0}), _evaluator({1: 3.0, 2: 1.0}), 2.0, [1, 2])
    assert (both.higher_only, both.lower_only) == (1, 0) and both.p_value == pytest.approx(1.0)


def test_seeds_are_checked_and_a_verdict_for_another_seed_is_refused():
    with pytest.raises(ValueError, match="none twice"):
        cp.paired_order(_evaluator({1: 2.0}), _evaluator({1: 2.0}), 2.0, [1, 1])
    with pytest.raises(ValueError, match="at least one"):
        cp.paired_order(_evaluator({}), _evaluator({}), 2.0, [])

    def wrong(rate, seeds):
        return [RunVerdict(rate, s + 1, True, 1.0, False, 300, "") for s in seeds]

    with pytest.raises(ValueError, match="other seeds"):
        cp.paired_order(wrong, _evaluator({1: 2.0}), 2.0, [1])


def test_reproduce_pairs_the_configurations_adjacent_by_lambda_max_with_the_searches_overrides(monkeypatch, tmp_path):
    from experiments import reproduce

    edges = {"homogeneous_pd": 1.95, "naive_heterogeneous": 2.15, "prfaas_pd": 3.05}
    calls: dict[str, list] = {k: [] for k in edges}
    made = []

    def fake_wire(scenario, overrides, out, executor=None, progress=True):
        name = out.name
        made.append((name, list(overrides)))
        return _evaluator({s: edges[name] for s in range(1, 7)}, calls[name])

    monkeypatch.setattr("experiments.capacity.wire_evaluator", fake_wire)
    measured = {k: {"lambda_max_rps": v} for k, v in edges.items()}
    overrides = {k: [f"x={k}"] for k in edges}
    docs = reproduce.paired_orders(measured, ["duration=150s"], overrides, tmp_path, list(range(1, 7)), progress=False)
    assert [(d["lower"], d["higher"]) for d in docs] == [("homogeneous_pd", "naive_heterogeneous"),
                                                          ("naive_heterogeneous", "prfaas_pd")]
    assert docs[0]["rate_rps"] == round(math.sqrt(1.95 * 2.15), 3) and docs[1]["rate_rps"] == round(math.sqrt(2.15 * 3.05), 3)
    assert calls["homogeneous_pd"] == [(docs[0]["rate_rps"], [1, 2, 3, 4, 5, 6])]
    assert all(d["higher_only"] == 6 and d["significant"] for d in docs)
    # each configuration's runs are judged like its search's: early stop, then the search's overrides
    assert ("homogeneous_pd", ["serving.slo.stop_below=0.9", "duration=150s", "x=homogeneous_pd"]) in made
    # a configuration without a Lambda_max is left out; one configuration has no pair
    measured["naive_heterogeneous"]["lambda_max_rps"] = None
    assert [(d["lower"], d["higher"]) for d in reproduce.paired_orders(measured, [], overrides, tmp_path, [1, 2], progress=False)] == [
        ("homogeneous_pd", "prfaas_pd")]


def test_the_seeds_are_ones_the_searches_did_not_run_and_fewer_than_six_are_refused():
    assert cp.fresh_seeds(3, 6) == [4, 5, 6, 7, 8, 9]  # the full variant's searches ran seeds 1..3
    assert cp.fresh_seeds(2, 8) == list(range(3, 11))
    assert cp.fresh_seeds(3, 12, first=10) == list(range(10, 22))  # a second test, after the first one's seeds 4..9
    with pytest.raises(ValueError, match="first seed 3: the searches ran seeds 1..3"):
        cp.fresh_seeds(3, 6, first=3)
    with pytest.raises(ValueError, match="at least 6 .* cannot reach p < 0.05"):
        cp.fresh_seeds(3, 5)
    assert cp.fresh_seeds(3, 6, first=2**32 - 6)[-1] == 2**32 - 1  # the last seed any reader takes (`validation.MAX_SEED`)
    with pytest.raises(ValueError) as exc:
        cp.fresh_seeds(3, 6, first=2**32 - 5)
    assert str(exc.value) == ("seeds 4294967291..4294967296: a seed is at most 4294967295 (2**32 - 1, `validation.MAX_SEED`); "
                              "start at 4294967290 or lower")


def test_the_cli_refuses_a_paired_test_it_cannot_run_before_any_run(monkeypatch, tmp_path):
    from experiments import commands, reproduce
    from testbed.errors import UserError

    def must_not_run(*a, **kw):
        raise AssertionError("a refused --paired must not start the reproduction")

    monkeypatch.setattr(reproduce, "reproduce_case_study", must_not_run)
    args = argparse.Namespace(only="homogeneous_pd", repetitions=None, out=str(tmp_path), quick=True, executor="local",
                              json=False, no_early_stop=False, paired=6, paired_from=None)
    with pytest.raises(UserError, match="--paired 6: the order test needs two configurations, --only names 1"):
        commands.cmd_reproduce(args)
    args.only = "homogeneous_pd,homogeneous_pd"
    with pytest.raises(UserError, match="--only names 1"):
        commands.cmd_reproduce(args)
    args.paired, args.paired_from, args.only = 6, 2, "homogeneous_pd,prfaas_pd"  # quick searches ran seeds 1..2
    with pytest.raises(UserError, match=r"--paired-from 2: first seed 2: the searches ran seeds 1..2; .* \(from 3\)"):
        commands.cmd_reproduce(args)
    args.paired, args.paired_from = 0, 10
    with pytest.raises(UserError, match="--paired-from 10: .* add --paired N"):
        commands.cmd_reproduce(args)


def _bench_main():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "experiments_bench.py"
    spec = importlib.util.spec_from_file_location("experiments_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.main


@pytest.mark.parametrize("given, says", [
    ("5", "5 seeds: at least 6 (with fewer, McNemar's exact test cannot reach p < 0.05 even when every seed is discordant); "
          "or 0 for no paired test"),
    ("-1", "-1 is not a seed count; use 0 (no paired test) or 6 to 10000 seeds"),
    ("six", "'six' is not a whole number"),
    (str(10**30), "a 31-digit number is more than 10000, the most runs one command may plan (validation.MAX_RUNS: about a "
                  "week of one-minute runs)"),
])
def test_prfaas_reproduce_and_the_benchmark_read_paired_n_with_one_reader_and_refuse_alike(given, says, tmp_path, capsys, monkeypatch):
    """`benchmarks/experiments_bench.py --paired` was argparse's `type=int` and its own call of `check_seed_count`,
    a copy of `prfaas reproduce --paired`'s: both read N with `capacity_paired.paired_seed_count` now, and a bad N is
    one line naming the option, before anything runs or any folder is made."""
    from experiments import reproduce
    from testbed.cli import main

    monkeypatch.setattr(reproduce, "reproduce_case_study", lambda *a, **kw: pytest.fail("a refused --paired must not start"))
    monkeypatch.chdir(tmp_path)
    for prog, run in (("prfaas reproduce", lambda: main(["reproduce", "case-study", "--quick", "--paired", given])),
                      ("experiments_bench.py", lambda: _bench_main()(["--quick", "--out", str(tmp_path / "b"), "--paired", given]))):
        with pytest.raises(SystemExit) as exit_:
            run()
        assert exit_.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"{prog}: error: argument --paired: {says}"
    assert not any(tmp_path.iterdir())


def test_the_benchmark_refuses_a_paired_test_past_max_runs_before_its_coverage_as_reproduce_does(monkeypatch, tmp_path, capsys):
    """A `--paired N` that `prfaas reproduce` refuses by the runs it plans (`reproduce.check_planned_runs`) is
    refused by the benchmark in the same words when the options are read, not by a ValueError traceback from the
    library after the bootstrap coverage."""
    monkeypatch.setattr("analysis.stats.paired_ratio_ci", lambda *a, **kw: pytest.fail("refused before the coverage"))
    with pytest.raises(SystemExit) as exit_:
        _bench_main()(["--quick", "--out", str(tmp_path / "b"), "--paired", "3000"])
    assert exit_.value.code == 2 and not (tmp_path / "b").exists()
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "experiments_bench.py: error: --quick --paired 3000: 3 searches of at most 22 runs and a paired test of 3000 seeds x "
        "2 configurations x 2 pair(s) make 12066 runs, more than 10000, the most runs one command may plan "
        "(validation.MAX_RUNS: about a week of one-minute runs)")


def test_paired_0_is_no_paired_test_in_both_entry_points_and_six_to_max_runs_are_seed_counts(monkeypatch, tmp_path):
    """`--paired 0` is the default spelled out: no paired test (docs/experiments.md, "Paired order"), in `prfaas
    reproduce` and in the benchmark alike; a count from 6 to 10,000 is read as it is."""
    from experiments import reproduce
    from testbed.cli import main

    assert [cp.paired_seed_count(n) for n in (0, 6, 10_000)] == [0, 6, 10_000]
    for bad in (True, 1.0, "6", 3, 10_001):
        with pytest.raises(ValueError):
            cp.paired_seed_count(bad)
    seen: list = []

    class Started(Exception):
        pass

    def stop(out, **kw):  # where the reproduction would start: what it was asked for
        seen.append(kw["paired_seeds"])
        raise Started

    monkeypatch.setattr(reproduce, "reproduce_case_study", stop)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Started):
        main(["reproduce", "case-study", "--quick", "--out", str(tmp_path / "r"), "--paired", "0"])
    monkeypatch.setattr("analysis.stats.paired_ratio_ci", lambda a, b, seed: (None, 0.0, 2.0, None))  # the coverage: instant
    with pytest.raises(Started):
        _bench_main()(["--quick", "--out", str(tmp_path / "b"), "--paired", "0"])
    assert seen == [0, 0]


def test_a_refused_paired_test_leaves_no_folder_behind(monkeypatch, tmp_path):
    """The output folder was made before the paired checks: a refused --paired-from left an empty
    runs/reproduce-case-study-<time> (or the --out folder) behind."""
    from experiments import commands, reproduce
    from testbed.errors import UserError

    monkeypatch.setattr(reproduce, "reproduce_case_study", lambda *a, **kw: pytest.fail("a refused --paired must not start the reproduction"))
    monkeypatch.chdir(tmp_path)
    for out in (None, str(tmp_path / "named")):
        args = argparse.Namespace(only="homogeneous_pd,prfaas_pd", repetitions=None, out=out, quick=True, executor="local",
                                  json=False, no_early_stop=False, paired=6, paired_from=2)  # quick searches ran seeds 1..2
        with pytest.raises(UserError) as exc:
            commands.cmd_reproduce(args)
        assert str(exc.value) == ("--paired-from 2: first seed 2: the searches ran seeds 1..2; a paired test needs seeds they did "
                                  "not run (from 3)")
        args.paired_from = None
        args.only = "homogeneous_pd"
        with pytest.raises(UserError) as exc:
            commands.cmd_reproduce(args)
        assert str(exc.value) == "--paired 6: the order test needs two configurations, --only names 1"
        assert list(tmp_path.iterdir()) == []


def test_a_paired_from_past_the_largest_seed_is_refused_when_the_options_are_read(tmp_path, capsys, monkeypatch):
    from experiments import reproduce
    from testbed.cli import main

    def must_not_run(*a, **kw):
        raise AssertionError("a refused --paired-from must not start the reproduction")

    monkeypatch.setattr(reproduce, "reproduce_case_study", must_not_run)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["reproduce", "case-study", "--paired", "6", "--paired-from", str(10**30)])
    assert exit_.value.code == 2 and not any(tmp_path.iterdir())
    assert capsys.readouterr().err.strip().splitlines()[-1] == ("prfaas reproduce: error: argument --paired-from: a 31-digit number is "
                                                                "not a seed; use a whole number from 0 to 4294967295 (2**32 - 1)")


def test_the_report_prints_each_paired_order_in_words_from_the_json(monkeypatch, tmp_path, capsys):
    import json

    from experiments import commands, reproduce

    res = cp.paired_order(_evaluator({s: 2.2 for s in range(4, 10)}), _evaluator({s: 1.9 for s in range(4, 10)}), 2.05,
                          cp.fresh_seeds(3, 6), ("naive_heterogeneous", "homogeneous_pd"))
    doc = {"wall_s": 60.0, "above_model": {}, "measured": {}, "measured_ratio_vs_homogeneous": {}, "measured_ratio_interval": {},
           "model": {k: {"lambda_max_rps": 1.0, "lambda_max_rps_mean_reading": 1.0} for k in reproduce.CONFIGURATIONS},
           "model_ratio_vs_homogeneous": {r: {k: 1.0 for k in reproduce.CONFIGURATIONS} for r in ("literal", "mean")},
           "paper_ratio_vs_homogeneous": reproduce.PAPER_RATIOS, "paired": json.loads(json.dumps([res.to_json()]))}
    monkeypatch.setattr(reproduce, "reproduce_case_study", lambda *a, **kw: doc)
    args = argparse.Namespace(only="homogeneous_pd,naive_heterogeneous", repetitions=None, out=str(tmp_path), quick=False,
                              executor="local", json=False, no_early_stop=False, paired=6, paired_from=None)
    assert commands.cmd_reproduce(args) == 0
    out = capsys.readouterr().out
    assert ("paired: naive_heterogeneous sustains more than homogeneous_pd at 2.05 req/s on 6 shared seeds: only "
            "naive_heterogeneous passed on 6, only homogeneous_pd on 0 (McNemar exact p = 0.0312)") in out
    assert "note:" not in out  # the only test of this pair in the directory
    # a second look at the same pair (an earlier test on seeds 10..15 kept in the directory): Bonferroni
    earlier = {**res.to_json(), "seeds": list(range(10, 16)), "p_value": 0.25}
    (tmp_path / "reproduce-20261202T120000Z.json").write_text(json.dumps({"paired": [earlier]}))
    assert commands.cmd_reproduce(args) == 0
    assert ("note: 2 paired tests of this pair in " + str(tmp_path) + " (the others: seeds 10..15, p = 0.25): an order "
            "holds over them only where a test's p < 0.05 / 2 = 0.025 (Bonferroni)") in capsys.readouterr().out


def test_reproduce_runs_the_test_on_the_seeds_after_its_searches_and_refuses_too_few_before_them(monkeypatch, tmp_path):
    from experiments import reproduce

    searched, seen = [], []

    def fake_measure(scenario, overrides, out, **kw):
        searched.append(kw["repetitions"])
        return {"lambda_max_rps": 2.0, "ci": [2.0, 2.2], "runs": 1, "bracketed": True, "probes": [],
                "ci_dose_response": {"ci": [None, None]}, "flagged_runs": []}

    monkeypatch.setattr("experiments.capacity.measure_capacity", fake_measure)
    monkeypatch.setattr(reproduce, "paired_orders", lambda measured, base, ov, out, seeds, *a: seen.append(seeds) or [])
    for quick, first in ((False, 4), (True, 3)):  # full searches run seeds 1..3, quick ones 1..2
        doc = reproduce.reproduce_case_study(tmp_path / str(quick), quick=quick, progress=False, paired_seeds=6)
        assert seen[-1] == list(range(first, first + 6)) and doc["paired"] == [] and doc["paired_wall_s"] >= 0
    reproduce.reproduce_case_study(tmp_path / "from", progress=False, paired_seeds=6, paired_from=10)
    assert seen[-1] == list(range(10, 16))
    searched.clear()
    with pytest.raises(ValueError, match="at least 6"):
        reproduce.reproduce_case_study(tmp_path / "x", progress=False, paired_seeds=5)
    with pytest.raises(ValueError, match="first seed 2"):
        reproduce.reproduce_case_study(tmp_path / "x", progress=False, paired_seeds=6, paired_from=2)
    with pytest.raises(ValueError, match="paired_from 10: .* no paired test is asked for"):
        reproduce.reproduce_case_study(tmp_path / "x", progress=False, paired_from=10)
    assert searched == []


def test_a_paired_test_that_would_extend_or_partly_reuse_an_earlier_one_in_the_directory_is_refused(monkeypatch, tmp_path):
    import json

    from experiments import commands, reproduce
    from testbed.errors import UserError

    first = {"lower": "naive_heterogeneous", "higher": "prfaas_pd", "seeds": list(range(4, 10))}
    (tmp_path / "reproduce-20261202T120000Z.json").write_text(json.dumps({"paired": [first]}))
    only = ("prfaas_pd", "naive_heterogeneous")
    (tmp_path / "reproduce.json").write_text("{not json")  # it may record a test: refused, not passed over
    with pytest.raises(UserError, match=r"reproduce.json: not valid JSON \(Expecting property name"):
        reproduce.check_paired_seeds_unused(tmp_path, only, list(range(4, 10)))
    (tmp_path / "reproduce.json").unlink()
    reproduce.check_paired_seeds_unused(tmp_path, only, list(range(4, 10)))  # the same test again: resumed, allowed
    reproduce.check_paired_seeds_unused(tmp_path, only, list(range(10, 22)))  # a new test on new draws
    reproduce.check_paired_seeds_unused(tmp_path, ("homogeneous_pd", "naive_heterogeneous"), list(range(4, 16)))  # another pair
    with pytest.raises(ValueError, match=r"seeds 4..15 overlap the paired test of prfaas_pd and naive_heterogeneous on seeds "
                                         r"4..9 \(reproduce-20261202T120000Z.json\).*--paired-from 16"):
        reproduce.check_paired_seeds_unused(tmp_path, only, list(range(4, 16)))  # the first test extended

    def must_not_run(*a, **kw):
        raise AssertionError("a refused --paired must not start the reproduction")

    monkeypatch.setattr(reproduce, "reproduce_case_study", must_not_run)
    args = argparse.Namespace(only="prfaas_pd,naive_heterogeneous", repetitions=None, out=str(tmp_path), quick=False,
                              executor="local", json=False, no_early_stop=False, paired=12, paired_from=None)
    with pytest.raises(UserError, match=r"--paired 12: seeds 4..15 overlap .*\(--paired-from 16\)"):
        commands.cmd_reproduce(args)
    args.paired_from = 8
    with pytest.raises(UserError, match="--paired-from 8: seeds 8..19 overlap"):
        commands.cmd_reproduce(args)
