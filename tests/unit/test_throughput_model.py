"""The throughput model (Eqs. 3-8): hand-computed cases, the optimum's balance, moments against scipy."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import integrate, stats

from analysis import throughput_model as tm
from testbed.errors import UserError
from testbed.models.profiles import ComputeProfile, DecodeProfile

LINEAR = ComputeProfile("lin", "X", "m", (1.0, 0.001, 0.0))  # T(l) = 1 + l/1000 s
QUAD = ComputeProfile("quad", "X", "m", (0.0, 0.0, 1e-6))  # T(l) = l^2 / 1e6 s
DECODE = DecodeProfile(step_s=0.05, max_batch=10)
PD = ComputeProfile("pd", "Y", "m", (1.0, 0.002, 0.0), decode=DECODE)  # T(l) = 1 + l/500 s
KV = tm.affine_kv_bytes(1e6, 1e3)  # 1 MB + 1 kB per token
TWO_POINT = tm.LengthDistribution(np.array([1000.0, 3000.0]), np.array([0.5, 0.5]))


def cluster(**kw) -> tm.ClusterModel:
    base = dict(pd_profile=PD, n_pd=4, kv_bytes=KV, output_len=100, prfaas_profile=LINEAR, n_prfaas=2, egress_bps=1e12)
    return tm.ClusterModel(**(base | kw))


def test_stage_throughputs_match_hand_computed_values_for_a_two_point_distribution():
    g = tm.stage_throughputs(cluster(), TWO_POINT, [2000], [1, 2], "literal")
    assert g.p[0] == pytest.approx(0.5)
    assert g.l_long[0] == pytest.approx(3000) and g.l_short[0] == pytest.approx(1000)
    # Eq. 3: 2 / T(3000) = 2 / 4 = 0.5; Eq. 4: N_p / T_pd(1000) = N_p / 3; Eq. 5: N_d * 10 / (0.05 * 100) = 2 N_d
    assert g.theta_prfaas[0, 0] == pytest.approx(0.5)
    assert g.theta_pdp[0].tolist() == pytest.approx([1 / 3, 2 / 3])
    assert g.theta_pdd[0].tolist() == pytest.approx([6.0, 4.0])
    # Eq. 6: min(0.5 / 0.5, (N_p/3) / 0.5, Theta_pdd)
    assert g.lambda_max[0].tolist() == pytest.approx([2 / 3, 1.0])


def test_egress_caps_theta_prfaas_when_the_link_is_slower_than_compute():
    # S_kv(3000) = 4 MB = 32 Mbit; at 8 Mbit/s the link moves 0.25 requests/s < compute 0.5
    cm = cluster(egress_bps=8e6)
    g = tm.stage_throughputs(cm, TWO_POINT, [2000], [2], "literal")
    assert g.theta_prfaas[0, 0] == pytest.approx(0.25)
    r = tm.search_prfaas_pd(cm, TWO_POINT, step_tokens=500)
    assert r.egress_gbps <= 8e6 / 1e9 * (1 + 1e-9)


def test_literal_and_mean_readings_differ_by_jensen_for_a_convex_profile():
    dist = tm.LengthDistribution(np.array([100.0, 1000.0, 3000.0]), np.array([0.2, 0.4, 0.4]))
    cm = cluster(prfaas_profile=QUAD)
    lit = tm.stage_throughputs(cm, dist, [500], [2], "literal")
    mean = tm.stage_throughputs(cm, dist, [500], [2], "mean")
    # long side {1000, 3000} equally likely: T(2000) = 4 s vs E[T] = (1 + 9) / 2 = 5 s
    assert lit.theta_prfaas[0, 0] == pytest.approx(2 / 4)
    assert mean.theta_prfaas[0, 0] == pytest.approx(2 / 5)
    # PD-P is linear: both readings agree there
    assert lit.theta_pdp[0, 0] == pytest.approx(mean.theta_pdp[0, 0])


def test_homogeneous_pd_picks_the_best_split_of_its_instances():
    r = tm.homogeneous_pd(cluster(prfaas_profile=None, n_prfaas=0), TWO_POINT)
    # every request local: Theta_pdp = N_p / T_pd(2000) = N_p / 5; Theta_pdd = 2 N_d; best of N_p = 0..4
    cands = [min(n / 5, 2 * (4 - n)) for n in range(5)]
    assert r.lambda_max == pytest.approx(max(cands))
    assert r.offload_fraction == 0 and r.theta_prfaas is None and r.egress_gbps == 0


def test_naive_heterogeneous_sends_everything_to_prfaas_and_decodes_on_all_pd_instances():
    r = tm.naive_heterogeneous(cluster(), TWO_POINT)
    assert r.offload_fraction == 1.0 and r.n_p == 0 and r.n_d == 4
    assert r.theta_prfaas == pytest.approx(2 / 3.0)  # 2 / T(E[L] = 2000) = 2 / 3
    assert r.lambda_max == pytest.approx(2 / 3.0)
    assert r.egress_gbps == pytest.approx(2 / 3.0 * KV(2000) * 8 / 1e9)


def test_exhaustive_search_finds_the_global_maximum_of_the_grid():
    cm = cluster()
    r = tm.search_prfaas_pd(cm, TWO_POINT, step_tokens=100)
    assert r.lambda_max == pytest.approx(np.nanmax(r.grid.lambda_max))
    brute = max(tm.stage_throughputs(cm, TWO_POINT, [t], [n]).lambda_max[0, 0] for t in range(0, 3001, 100) for n in range(5))
    assert r.lambda_max == pytest.approx(brute)


def _case_study():
    try:
        return tm.paper_case_study()
    except (ImportError, UserError):  # documented fallback, tests only: the DERIVED fit of Table 5's KV sizes
        return tm.paper_case_study(tm.affine_kv_bytes(172 * 2**20, 16.7 * 1024))


@pytest.mark.parametrize("reading", tm.READINGS)
def test_case_study_optimum_balances_eq7_and_eq8_within_grid_resolution(reading):
    cm, _, dist = _case_study()
    r = tm.search_prfaas_pd(cm, dist, reading, step_tokens=64)
    g, i, j = r.grid, int(np.searchsorted(r.grid.thresholds, r.threshold)), r.n_p
    a = g.theta_prfaas[:, j] / g.p
    b = g.theta_pdp[:, j] / (1 - g.p)
    # Eq. 7: the two sides cross between neighbouring thresholds
    step_change = max(abs(a[i + 1] - a[i - 1]), abs(b[i + 1] - b[i - 1]))
    assert abs(a[i] - b[i]) <= step_change
    # Eq. 8: prefill supply lies between the decode capacity of N_d - 1 and N_d instances
    supply = r.theta_prfaas + r.theta_pdp
    assert cm.theta_pdd(r.n_d - 1) <= supply <= cm.theta_pdd(r.n_d)
    assert r.lambda_max == pytest.approx(min(r.theta_prfaas / r.offload_fraction, r.theta_pdp / (1 - r.offload_fraction), r.theta_pdd))


def test_case_study_prfaas_beats_both_baselines_and_fits_the_100gbps_link():
    cm, homo, dist = _case_study()
    res = tm.evaluate(cm, homo, dist)
    assert res["prfaas_pd"].lambda_max > res["naive_heterogeneous"].lambda_max > res["homogeneous_pd"].lambda_max
    assert 0 < res["prfaas_pd"].egress_gbps < 100
    assert res["homogeneous_pd"].n_p + res["homogeneous_pd"].n_d == 12


def _trunc_lognormal(mu=9.9, sigma=1.0, lo=128, hi=131072):
    d = stats.lognorm(sigma, scale=math.exp(mu))
    z = d.cdf(hi) - d.cdf(lo)
    return d, z, lo, hi


@pytest.mark.parametrize("t", [512, 4096, 19400, 65536])
def test_p_l_long_l_short_match_numerical_integration(t):
    d, z, lo, hi = _trunc_lognormal()
    dist = tm.LengthDistribution.truncated_lognormal(9.9, 1.0, lo, hi)
    p, short, long = dist.split([t])
    p_ref = (d.cdf(hi) - d.cdf(t)) / z
    short_ref = integrate.quad(lambda x: x * d.pdf(x), lo, t, limit=200)[0] / (d.cdf(t) - d.cdf(lo))
    long_ref = integrate.quad(lambda x: x * d.pdf(x), t, hi, limit=200)[0] / (d.cdf(hi) - d.cdf(t))
    assert p[0] == pytest.approx(p_ref, rel=1e-3)
    assert short[0] == pytest.approx(short_ref, rel=1e-3)
    assert long[0] == pytest.approx(long_ref, rel=1e-3)


def test_mean_prefill_time_over_long_requests_matches_numerical_integration():
    d, z, lo, hi = _trunc_lognormal()
    dist = tm.LengthDistribution.truncated_lognormal(9.9, 1.0, lo, hi)
    prof = ComputeProfile("h", "H200", "m", (0.389, 4.107e-5, 9.476e-11))
    t = 19400
    _, _, mean_t = dist.split([t], prof.prefill_time_s(dist.lengths))
    ref = integrate.quad(lambda x: prof.prefill_time_s(x) * d.pdf(x), t, hi, limit=200)[0] / (d.cdf(hi) - d.cdf(t))
    assert mean_t[0] == pytest.approx(ref, rel=1e-3)
    assert dist.mean == pytest.approx(integrate.quad(lambda x: x * d.pdf(x), lo, hi, limit=200)[0] / z, rel=1e-4)


def test_bad_inputs_are_refused_with_a_clear_error():
    with pytest.raises(UserError, match="reading"):
        tm.stage_throughputs(cluster(), TWO_POINT, [1], [1], "median")
    with pytest.raises(UserError, match="at least 2 PD instances"):
        tm.search_prfaas_pd(cluster(n_pd=1), TWO_POINT)
    with pytest.raises(UserError, match="PrfaaS profile"):
        tm.search_prfaas_pd(cluster(prfaas_profile=None), TWO_POINT)
    with pytest.raises(UserError):
        tm.LengthDistribution.from_samples([])


def test_model_command_prints_one_json_section_per_configuration(capsys):
    from testbed.cli import main

    assert main(["model", "--paper-case-study", "--json", "--step", "256"]) == 0
    doc = json.loads(capsys.readouterr().out)
    pd = doc["prfaas_pd"]
    for key in ("threshold", "offload_fraction", "theta_prfaas", "theta_pdp", "theta_pdd", "lambda_max", "egress_gbps"):
        assert isinstance(pd[key], float), key
    assert pd["lambda_max"] == pytest.approx(min(pd["theta_prfaas"] / pd["offload_fraction"], pd["theta_pdp"] / (1 - pd["offload_fraction"]), pd["theta_pdd"]))
    assert doc["homogeneous_pd"]["offload_fraction"] == 0
    assert doc["naive_heterogeneous"]["offload_fraction"] == 1
    assert pd["other_reading"]["reading"] == "mean"


def test_model_command_refuses_a_bad_step(capsys):
    from testbed.cli import main

    # nan, inf: were a numpy traceback and a hang; 0.001 ran out of memory (a grid point per thousandth of a token)
    for bad, why in (("0", "0 is not a whole number >= 1"), ("nan", "'nan' is not a whole number"),
                     ("inf", "'inf' is not a whole number"), ("0.001", "'0.001' is not a whole number")):
        with pytest.raises(SystemExit) as exit_:
            main(["model", "--paper-case-study", "--step", bad])
        assert exit_.value.code == 2
        assert capsys.readouterr().err.strip() == f"prfaas model: error: argument --step: {why}"


def test_model_refuses_set_without_a_scenario(capsys):
    """The paper's case study has fixed inputs: `--set` was ignored there, exit 0."""
    from testbed.cli import main

    assert main(["model", "--paper-case-study", "--set", "wan.rate=20Gbps"]) == 2
    assert "--set wan.rate=20Gbps: overrides a scenario, so it goes with --scenario" in capsys.readouterr().err


def test_model_plots_into_a_path_that_cannot_be_a_folder_is_one_line(tmp_path, capsys):
    from testbed.cli import main

    (tmp_path / "file").write_text("x")
    assert main(["model", "--paper-case-study", "--plots", str(tmp_path / "file" / "plots")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"prfaas model: error: {tmp_path / 'file' / 'plots'}: cannot create this folder (Not a directory); "
                   f"{tmp_path / 'file'} is a file where a folder goes: move it aside (or use another folder)"]


def test_case_study_scenario_file_gives_the_same_model_as_the_builtin_case_study():
    from testbed.sections import load_scenario

    cm, homo, dist, inputs = tm.cluster_model_from_scenario(load_scenario("case-study"))
    assert (cm.n_prfaas, cm.n_pd, homo.n_pd, cm.egress_bps) == (4, 8, 12, 100e9)
    ref_cm, ref_homo, ref_dist = tm.paper_case_study()
    a = tm.evaluate(cm, homo, dist, step_tokens=256)
    b = tm.evaluate(ref_cm, ref_homo, ref_dist, step_tokens=256)
    for k in a:
        assert a[k].lambda_max == pytest.approx(b[k].lambda_max, rel=1e-9), k
    assert "h200-paper-1t-hybrid" in inputs["prfaas"]


def test_fixed_threshold_is_evaluated_at_that_threshold_with_the_best_split():
    r = tm.at_threshold(cluster(), TWO_POINT, 2000)
    assert r.threshold == 2000 and r.offload_fraction == pytest.approx(0.5)
    assert r.lambda_max == pytest.approx(1.0)  # N_p = 2: min(0.5 / 0.5, (2/3) / 0.5, 4)
    assert r.lambda_max <= tm.search_prfaas_pd(cluster(), TWO_POINT, step_tokens=100).lambda_max


def test_bottleneck_names_the_egress_when_the_link_limits_prfaas():
    slow = tm.naive_heterogeneous(cluster(egress_bps=8e6), TWO_POINT)
    fast = tm.naive_heterogeneous(cluster(), TWO_POINT)
    assert (slow.bottleneck, fast.bottleneck) == ("egress", "prfaas")
    assert slow.theta_prfaas == pytest.approx(8e6 / (8 * KV(2000)))


def test_a_scenarios_kv_bytes_are_its_model_sections_spec_file_and_state_dtype(tmp_path, monkeypatch):
    """A spec file beside the scenario was loaded again by name from the current folder ("not a preset and no such
    file" in prfaas check and prfaas model), and model.state_dtype was lost (bf16 state bytes for a float32 run)."""
    import shutil

    from testbed.models.spec import PRESETS_DIR
    from testbed.sections import load_scenario

    shutil.copy(PRESETS_DIR / "paper-1t-hybrid.yaml", tmp_path / "hybrid.yaml")
    scenario = tmp_path / "s.yaml"
    scenario.write_text((Path(tm.__file__).resolve().parents[1] / "topologies" / "quick.yaml").read_text())
    monkeypatch.chdir(tmp_path.parent)
    sc = load_scenario(str(scenario), ["model.name=hybrid.yaml", "model.state_dtype=float32"])
    cm = tm.cluster_model_from_scenario(sc)[0]
    spec = sc.section("model").spec
    assert spec.state_dtype == "float32"
    assert float(cm.kv_bytes(4096)) == pytest.approx(spec.kv_bytes(4096).total_bytes)
