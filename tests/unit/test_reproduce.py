"""`prfaas reproduce case-study` without runs: the deployments it measures match the model's, and the
plan and ratio intervals it reports are computed as documented (experiments/reproduce.py)."""

from __future__ import annotations

import pytest

from experiments import reproduce


def test_each_configuration_runs_the_models_instance_split_and_the_quick_plan_fits_20_minutes():
    sc, model = reproduce.model_results(reproduce.STEADY + reproduce.QUICK)
    lit = model["literal"]
    ov = reproduce.configuration_overrides(lit)
    pf = lit["prfaas_pd"]
    assert f"serving.instances.pd_prefill={pf['n_p']}" in ov["prfaas_pd"]
    assert f"policy.threshold={int(pf['threshold'])}" in ov["prfaas_pd"]
    homo = lit["homogeneous_pd"]
    assert homo["n_p"] + homo["n_d"] == pf["n_prfaas"] + pf["n_p"] + pf["n_d"]  # equal instance (GPU) count
    assert "serving.instances.prfaas_prefill=0" in ov["homogeneous_pd"]
    plan = reproduce.planned_wall_s(sc, True, 3)
    assert plan["run_s"] == pytest.approx(45 + reproduce.RUN_OVERHEAD_S + 128 * reproduce.DECODE_STEP_S)
    assert plan["typical_s"] <= 20 * 60 < plan["worst_s"]


def test_the_ratio_interval_spans_both_measured_intervals():
    a, b = {"ci": [3.0, 3.6]}, {"ci": [2.0, 2.4]}
    assert reproduce.ratio_interval(a, b) == pytest.approx([3.0 / 2.4, 3.6 / 2.0])
    assert reproduce.ratio_interval({"ci": [3.0, None]}, b) == pytest.approx([1.25, None])


def test_quick_decides_a_marginal_end_by_2_runs_and_full_by_a_majority_of_3(monkeypatch, tmp_path):
    seen = []

    def fake_measure(scenario, overrides, out, **kw):
        seen.append(kw)
        return {"lambda_max_rps": 1.0, "ci": [1.0, 1.1], "runs": 1, "bracketed": True, "probes": [],
                "ci_dose_response": {"ci": [None, None]}, "flagged_runs": []}

    monkeypatch.setattr("experiments.capacity.measure_capacity", fake_measure)
    for quick, reps in ((True, 2), (False, 3)):
        seen.clear()
        doc = reproduce.reproduce_case_study(tmp_path / str(quick), quick=quick, progress=False)
        assert {kw["repetitions"] for kw in seen} == {reps} and doc["scenario"]["search"]["repetitions"] == reps
    seen.clear()
    reproduce.reproduce_case_study(tmp_path / "x", quick=True, repetitions=5, progress=False)
    assert {kw["repetitions"] for kw in seen} == {5}


def test_a_rate_measured_above_the_models_fluid_bound_is_named():
    model = {"literal": {"a": {"lambda_max": 2.5}, "b": {"lambda_max": 3.0}, "c": {"lambda_max": 2.0}},
             "mean": {"a": {"lambda_max": 2.4}, "b": {"lambda_max": 3.2}, "c": {"lambda_max": 2.0}}}
    measured = {"a": {"lambda_max_rps": 3.0}, "b": {"lambda_max_rps": 3.1}, "c": {"lambda_max_rps": None}}
    # a: above both readings; b: above the literal but not the mean reading (within the model's own ambiguity)
    assert reproduce.above_model(measured, model) == {"a": pytest.approx(1.2)}


def test_the_report_names_a_configuration_measured_above_the_model(monkeypatch, tmp_path, capsys):
    import argparse

    from experiments import commands

    ci = {"ci": [None, None]}
    doc = {"wall_s": 950.0, "above_model": {"naive_heterogeneous": 1.3225},
           "measured": {k: {"lambda_max_rps": x, "ci": [x, x * 1.15], "ci_dose_response": ci, "runs": 3}
                        for k, x in (("prfaas_pd", 3.681), ("homogeneous_pd", 2.577), ("naive_heterogeneous", 3.328))},
           "model": {k: {"lambda_max_rps": x, "lambda_max_rps_mean_reading": x}
                     for k, x in (("prfaas_pd", 4.234), ("homogeneous_pd", 2.577), ("naive_heterogeneous", 2.516))},
           "measured_ratio_vs_homogeneous": {}, "measured_ratio_interval": {},
           "model_ratio_vs_homogeneous": {r: {"prfaas_pd": 1.64, "homogeneous_pd": 1.0, "naive_heterogeneous": 0.98} for r in ("literal", "mean")},
           "paper_ratio_vs_homogeneous": reproduce.PAPER_RATIOS, "paired": []}
    monkeypatch.setattr(reproduce, "reproduce_case_study", lambda *a, **kw: doc)
    args = argparse.Namespace(only="prfaas_pd,homogeneous_pd,naive_heterogeneous", repetitions=None, out=str(tmp_path), quick=True,
                              executor="local", json=False, no_early_stop=False, paired=0, paired_from=None)
    assert commands.cmd_reproduce(args) == 0
    out = capsys.readouterr().out
    assert "note: naive_heterogeneous measured 1.32x the model's fluid bound" in out and "run the full one" in out
    assert "note: prfaas_pd" not in out and "note: homogeneous_pd" not in out
    assert "timing fidelity flagged" not in out  # (this document has no flagged runs: written before they were recorded)
    doc["measured"]["homogeneous_pd"]["flagged_runs"] = [{"rate_rps": 2.577, "seed": 2, "passed": False, "fidelity_flags": "late sleeps"}]
    assert commands.cmd_reproduce(args) == 0
    out = capsys.readouterr().out
    assert "homogeneous_pd: timing fidelity flagged for 1 run(s)" in out and "2.577 req/s seed 2 (fail): late sleeps" in out


def test_a_second_document_in_the_same_directory_keeps_the_first_beside_it(tmp_path):
    import json
    import os

    assert reproduce.write_document(tmp_path / "d", {"wall_s": 4536.0, "measured": {"a": 1}}) is None
    path = tmp_path / "d" / "reproduce.json"
    os.utime(path, (1764680000, 1764680000))  # 2025-12-02T12:53:20Z
    kept = reproduce.write_document(tmp_path / "d", {"wall_s": 12.0, "paired": []})
    assert kept == tmp_path / "d" / "reproduce-20251202T125320Z.json"
    assert json.loads(kept.read_text()) == {"wall_s": 4536.0, "measured": {"a": 1}}  # the first invocation's wall time survives
    assert json.loads(path.read_text()) == {"wall_s": 12.0, "paired": []}
    os.utime(path, (1764680000, 1764680000))  # the same second again: a suffix, never an overwrite
    assert reproduce.write_document(tmp_path / "d", {"x": 3}).name == "reproduce-20251202T125320Z-1.json"
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [
        "reproduce-20251202T125320Z-1.json", "reproduce-20251202T125320Z.json", "reproduce.json"]


def test_a_reproduction_made_in_parts_reports_its_whole_time_and_only_for_the_same_scenario(tmp_path):
    import json

    sc = {"overrides": ["a=1"], "quick": False}
    reproduce.write_document(tmp_path, {"scenario": sc, "wall_s": 3000.0, "paired_wall_s": 0.0})
    second = {"scenario": sc, "wall_s": 1300.0, "paired_wall_s": 1290.0}  # the searches resumed, then the paired test
    reproduce.write_document(tmp_path, second)
    assert second["wall_s_all_invocations"] == 4300.0 and second["paired_wall_s_all_invocations"] == 1290.0
    third = {"scenario": sc, "wall_s": 10.0, "paired_wall_s": 5.0}  # a sum of sums, not of the last two only
    reproduce.write_document(tmp_path, third)
    assert (third["wall_s_all_invocations"], third["paired_wall_s_all_invocations"]) == (4310.0, 1295.0)
    assert json.loads((tmp_path / "reproduce.json").read_text())["wall_s_all_invocations"] == 4310.0
    other = {"scenario": {"overrides": ["a=2"], "quick": True}, "wall_s": 900.0}  # another variant: not one reproduction
    reproduce.write_document(tmp_path, other)
    assert "wall_s_all_invocations" not in other


@pytest.mark.parametrize("earlier", ["{not json", "", "null", "[1, 2]", '{"scenario": null, "wall_s": 5}',
                                     '{"scenario": {"overrides": ["a=1"]}, "wall_s": "long"}',
                                     '{"scenario": {"overrides": ["a=1"]}, "wall_s": 5, "paired_wall_s": "x"}'])
def test_an_earlier_file_that_is_not_a_reproduction_is_kept_and_the_new_document_is_written(tmp_path, earlier):
    import json

    (tmp_path / "reproduce.json").write_text(earlier)
    doc = {"scenario": {"overrides": ["a=1"]}, "wall_s": 7.0, "paired_wall_s": 0.0}
    kept = reproduce.write_document(tmp_path, doc)
    assert kept is not None and kept.read_text() == earlier  # kept as it was
    assert json.loads((tmp_path / "reproduce.json").read_text()) == doc and "wall_s_all_invocations" not in doc


class SlotsExecutor:
    """A stand-in executor for the reproduction's driver: it only has slots and records a cancel."""

    name = "stand-in"

    def __init__(self, slots: int) -> None:
        self.slots, self.cancelled = slots, False

    def cancel(self) -> None:
        self.cancelled = True


def fake_capacity(doc_rps: float = 1.0):
    return {"lambda_max_rps": doc_rps, "ci": [doc_rps, doc_rps * 1.1], "runs": 1, "bracketed": True, "probes": [],
            "ci_dose_response": {"ci": [None, None]}, "flagged_runs": []}


def test_with_a_slot_per_configuration_the_three_searches_run_side_by_side(monkeypatch, tmp_path):
    import threading

    barrier = threading.Barrier(3, timeout=10)  # broken (and the test failed) unless all three searches are in at once
    seen = {}

    def fake_measure(scenario, overrides, out, **kw):
        barrier.wait()
        seen[out.name] = kw
        return fake_capacity()

    monkeypatch.setattr("experiments.capacity.measure_capacity", fake_measure)
    doc = reproduce.reproduce_case_study(tmp_path, quick=True, executor=SlotsExecutor(3), progress=False)
    assert set(seen) == set(reproduce.CONFIGURATIONS) and doc["searches_at_once"] == 3
    assert {kw["parallel"] for kw in seen.values()} == {1}  # each search one run at a time: no speculative repetition
    assert {kw["label"] for kw in seen.values()} == set(reproduce.CONFIGURATIONS)  # progress rows say whose rate it is
    one = reproduce.planned_wall_s(reproduce.model_results(reproduce.STEADY + reproduce.QUICK)[0], True, 3,
                                   reproduce.SEARCH[True]["repetitions"])  # one after another
    assert doc["plan"]["typical_s"] == pytest.approx(one["typical_s"] / 3)


def test_slots_beyond_the_configurations_go_to_each_searchs_repetitions_and_one_slot_keeps_them_in_turn():
    assert reproduce.searches_at_once(SlotsExecutor(7), 3) == (3, 2)
    assert reproduce.searches_at_once(SlotsExecutor(2), 3) == (2, 1)
    assert reproduce.searches_at_once(SlotsExecutor(4), 1) == (1, 4)
    assert reproduce.searches_at_once(None, 3) == (1, 1)


def test_one_slot_runs_the_searches_one_after_another_in_order(monkeypatch, tmp_path):
    import threading

    order = []

    def fake_measure(scenario, overrides, out, **kw):
        order.append((out.name, threading.current_thread() is threading.main_thread(), kw["parallel"], kw["label"]))
        return fake_capacity()

    monkeypatch.setattr("experiments.capacity.measure_capacity", fake_measure)
    doc = reproduce.reproduce_case_study(tmp_path, quick=True, progress=False)
    assert order == [(k, True, 1, "capacity") for k in reproduce.CONFIGURATIONS] and doc["searches_at_once"] == 1


def test_a_search_that_fails_beside_the_others_cancels_the_executors_runs_and_is_raised(monkeypatch, tmp_path):
    import threading

    ex = SlotsExecutor(3)
    stopped = threading.Event()

    def fake_measure(scenario, overrides, out, **kw):
        if out.name == "homogeneous_pd":
            raise RuntimeError("the homogeneous search broke")
        for _ in range(200):  # a long search: it returns once the executor is cancelled
            if ex.cancelled:
                stopped.set()
                return fake_capacity()
            threading.Event().wait(0.05)
        return fake_capacity()

    monkeypatch.setattr("experiments.capacity.measure_capacity", fake_measure)
    with pytest.raises(RuntimeError, match="homogeneous search broke"):
        reproduce.reproduce_case_study(tmp_path, quick=True, executor=ex, progress=False)
    assert ex.cancelled and stopped.is_set()


def test_a_configuration_named_twice_is_measured_once(monkeypatch, tmp_path):
    seen = []

    def fake_measure(scenario, overrides, out, **kw):
        seen.append(out.name)
        return fake_capacity()

    monkeypatch.setattr("experiments.capacity.measure_capacity", fake_measure)
    doc = reproduce.reproduce_case_study(tmp_path, quick=True, only=("prfaas_pd", "prfaas_pd"), executor=SlotsExecutor(3), progress=False)
    assert seen == ["prfaas_pd"] and list(doc["measured"]) == ["prfaas_pd"] and doc["executor_slots"] == 3


def test_every_configuration_is_checked_before_the_first_search_starts(monkeypatch, tmp_path):
    from testbed.errors import UserError

    searched, checked = [], []

    def check(scenario, overrides, executor=None):
        checked.append(overrides)
        if len(checked) == 2:  # the second configuration is one a run would refuse
            raise UserError("serving.kv_congestion_control: refused")

    monkeypatch.setattr("experiments.capacity.check_scenario", check)
    monkeypatch.setattr("experiments.capacity.measure_capacity", lambda *a, **kw: searched.append(a))
    with pytest.raises(UserError, match="refused"):
        reproduce.reproduce_case_study(tmp_path / "r", quick=True, progress=False)
    assert searched == [] and len(checked) == 2
    assert all(ov[0] == "serving.slo.stop_below=0.9" for ov in checked)  # what the searches run: early stop included


def test_a_reproduction_plans_at_most_10000_runs_before_its_folder(monkeypatch, tmp_path):
    """`--repetitions` had no bound and `--paired 100000000` built a 10^8-seed list before any check of its size: a
    reproduction's searches at worst plus its paired test are at most validation.MAX_RUNS."""
    import argparse

    from experiments import commands
    from testbed.errors import UserError

    def must_not_run(*a, **kw):
        raise AssertionError("a refused reproduction must not start")

    library = reproduce.reproduce_case_study
    monkeypatch.setattr(reproduce, "reproduce_case_study", must_not_run)
    monkeypatch.setattr(reproduce, "paired_test_seeds", must_not_run)
    monkeypatch.setattr("experiments.capacity.measure_capacity", must_not_run)
    why = "the most runs one command may plan (validation.MAX_RUNS: about a week of one-minute runs)"
    assert reproduce.check_planned_runs(True, None, 3, 0) == 66  # 3 searches of (5 + 6) rates x 2 runs
    assert reproduce.check_planned_runs(False, None, 3, 2000) == 3 * 39 + 8000
    for quick, reps, paired, says in (
            (True, 500, 0, f"--quick --repetitions 500: 3 searches of at most 5500 runs make 16500 runs, more than 10000, {why}"),
            (False, None, 2500, f"the full variant --paired 2500: 3 searches of at most 39 runs and a paired test of 2500 seeds x 2 "
                                f"configurations x 2 pair(s) make 10117 runs, more than 10000, {why}"),
            (True, None, 10**30, f"--quick --paired {10**30}: 3 searches of at most 22 runs and a paired test of {10**30} seeds x 2 "
                                 f"configurations x 2 pair(s) make a 31-digit number runs, more than 10000, {why}")):
        args = argparse.Namespace(only="prfaas_pd,homogeneous_pd,naive_heterogeneous", repetitions=reps, out=str(tmp_path / "r"),
                                  quick=quick, executor="local", json=False, no_early_stop=False, paired=paired, paired_from=None)
        with pytest.raises(UserError) as exc:
            commands.cmd_reproduce(args)
        assert str(exc.value) == says
    with pytest.raises(ValueError, match="make 10117 runs"):  # a caller of the library is refused alike, before the seeds' list
        library(tmp_path / "r", paired_seeds=2500, progress=False)
    assert not (tmp_path / "r").exists()
