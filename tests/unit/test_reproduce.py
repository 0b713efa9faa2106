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
                "ci_dose_response": {"ci": [None, None]}}

    monkeypatch.setattr("experiments.capacity.measure_capacity", fake_measure)
    for quick, reps in ((True, 2), (False, 3)):
        seen.clear()
        doc = reproduce.reproduce_case_study(tmp_path / str(quick), quick=quick, progress=False)
        assert {kw["repetitions"] for kw in seen} == {reps} and doc["scenario"]["search"]["repetitions"] == reps
    seen.clear()
    reproduce.reproduce_case_study(tmp_path / "x", quick=True, repetitions=5, progress=False)
    assert {kw["repetitions"] for kw in seen} == {5}
