"""Compute profiles: fitted curves reproduce their sources; measured profiles load; bad files are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from testbed.errors import UserError
from testbed.models.profiles import available_profiles, load_profile

TABLE5 = {1024: 0.44, 8192: 0.72, 32768: 1.84, 131072: 7.40}


def test_h200_profile_reproduces_table5_and_the_derived_quadratic():
    p = load_profile("h200-paper-1t-hybrid")
    for l, t in TABLE5.items():
        assert p.prefill_time_s(l) == pytest.approx(t, abs=0.015)
    assert p.coefficients == pytest.approx((0.389, 4.107e-5, 9.476e-11), rel=2e-3)
    assert "Table 5" in p.provenance and p.chip == "H200"


def test_h20_profile_passes_through_both_calibration_points():
    p = load_profile("h20-paper-1t-hybrid")
    assert p.prefill_time_s(10200) == pytest.approx(1.83, abs=1e-9)
    assert p.prefill_time_s(27500) == pytest.approx(4.27, abs=1e-9)
    assert p.decode_step_s(20) == pytest.approx(0.025) and p.max_batch == 20
    assert "ASSUMPTION" in p.provenance


def test_short_names_h200_and_h20_are_the_case_study_profiles():
    assert load_profile("h200").name == "h200-paper-1t-hybrid"
    assert load_profile("h20").name == "h20-paper-1t-hybrid"


@pytest.mark.parametrize("model,profile,phis", [
    ("minimax-m2.5", "h200-minimax-m2.5", (4.94, 32.87, 59.93, 47.82)),
    ("qwen3-235b", "h200-qwen3-235b", (4.12, 22.42, 33.35, 21.50)),
])
def test_dense_h200_profiles_give_back_table3_phi_with_the_spec_bytes(model, profile, phis):
    from testbed.models import spec as spec_mod

    spec = spec_mod.load_model_spec(model)
    p = load_profile(profile)
    for l, phi in zip((1024, 8192, 32768, 131072), phis):
        got = spec.kv_bytes(l).total_bytes * 8 / p.prefill_time_s(l) / 1e9
        assert got == pytest.approx(phi, rel=0.05)


@pytest.mark.parametrize("dense", ["minimax-m2.5", "qwen3-235b"])
def test_h20_dense_profiles_scale_h200_by_the_hybrids_calibration_ratio(dense):
    h200, h20 = load_profile("h200-paper-1t-hybrid"), load_profile("h20-paper-1t-hybrid")
    ratio = np.mean([h20.prefill_time_s(l) / h200.prefill_time_s(l) for l in (10200, 27500)])
    a, b = load_profile(f"h200-{dense}"), load_profile(f"h20-{dense}")
    for l in (1024, 32768):
        assert b.prefill_time_s(l) / a.prefill_time_s(l) == pytest.approx(ratio, rel=1e-3)


def test_cached_prefix_only_charges_the_increment():
    p = load_profile("h200-paper-1t-hybrid")
    c0, c1, c2 = p.coefficients
    full, inc = p.prefill_time_s(32768), p.prefill_time_s(32768, cached_tokens=8192)
    assert full - inc == pytest.approx(c1 * 8192 + c2 * 8192**2)
    assert inc > c0
    arr = p.prefill_time_s(np.array([1024, 8192]), np.array([0, 1024]))
    assert arr.shape == (2,) and arr[1] < p.prefill_time_s(8192)
    with pytest.raises(UserError, match="cached_tokens"):
        p.prefill_time_s(100, cached_tokens=200)


def test_decode_outside_the_batch_limit_and_prefill_only_profiles_are_refused():
    with pytest.raises(UserError, match="max_batch"):
        load_profile("h20").decode_step_s(21)
    with pytest.raises(UserError, match="no decode data"):
        load_profile("h200").decode_step_s(1)


def test_measured_csv_and_json_profiles_fit_their_points(tmp_path):
    csv = tmp_path / "cpu.csv"
    csv.write_text("tokens,prefill_s\n128,0.2\n256,0.3\n512,0.6\n1024,1.5\n")
    p = load_profile(str(csv))
    assert np.abs(p.fit_residuals_s()).max() < 0.1
    assert "measured" in p.provenance and str(csv) in p.provenance
    js = tmp_path / "gpu.json"
    js.write_text(json.dumps({"chip": "H100", "prefill": [[1000, 0.5], [2000, 0.9]], "decode": {"step_s": 0.02, "max_batch": 8}}))
    q = load_profile(str(js))
    assert q.chip == "H100" and q.prefill_time_s(1500) == pytest.approx(0.7)
    assert q.decode_step_s(8) == pytest.approx(0.02)


@pytest.mark.parametrize("text,match", [
    ("tokens,seconds\n1,2\n", "tokens,prefill_s"),
    ("tokens,prefill_s\n128,abc\n", "line 2"),
    ("tokens,prefill_s\n1000,2.0\n2000,0.1\n", "not positive"),
])
def test_bad_measured_files_are_refused_with_the_reason(tmp_path, text, match):
    f = tmp_path / "bad.csv"
    f.write_text(text)
    with pytest.raises(UserError, match=match):
        load_profile(str(f))


def test_unknown_profile_lists_the_ready_ones(tmp_path):
    with pytest.raises(UserError, match="h200-paper-1t-hybrid"):
        load_profile("nope")
    y = tmp_path / "x.yaml"
    y.write_text("name: x\nprefill: {points: [[1, 2]]}\nspeed: 3\n")
    with pytest.raises(UserError, match="speed: unknown key"):
        load_profile(str(y))
    assert {"h200-paper-1t-hybrid", "h20-paper-1t-hybrid", "h20-minimax-m2.5", "h200-qwen3-235b"} <= set(available_profiles())


def test_a_profile_that_is_missing_or_of_another_kind_gets_one_line_naming_what_is_allowed(tmp_path) -> None:
    with pytest.raises(UserError, match="no such file, and not a ready profile .*h200"):
        load_profile(tmp_path / "none.yaml")
    txt = tmp_path / "hostname.txt"
    txt.write_text("vm\n")
    with pytest.raises(UserError, match=r"ends in \.yaml or \.yml .* this one ends in '\.txt'"):
        load_profile(txt)


H20 = {"name": "p", "chip": "H20", "model": "m", "prefill": {"points": [[10200, 1.83], [27500, 4.27]]},
       "decode": {"step_s": 0.025, "max_batch": 20}}


@pytest.mark.parametrize("change,match", [
    ({"gpus_per_instance": float("inf")}, "p.yaml: gpus_per_instance: inf is not a whole number >= 1"),
    ({"gpus_per_instance": 5000}, "gpus_per_instance: 5000 is more than 1024"),
    ({"prefill": {"points": [[float("inf"), 1.83], [27500, 4.27]]}}, r"prefill.points: point 1: inf is not a number of tokens"),
    ({"prefill": {"points": [[None, 1.83], [27500, 4.27]]}}, r"prefill.points: point 1: None is not a number of tokens"),
    ({"prefill": {"points": [[10200, 1.83], [float("nan"), 4.27]]}}, r"prefill.points: point 2: nan is not a number of tokens"),
    ({"prefill": {"points": [[10200, 10**400], [27500, 4.27]]}}, r"prefill.points: point 1: a 401-digit number is out of range"),
    ({"prefill": {"points": [[10**30, 1.0], [27500, 4.27]]}}, r"point 1: tokens 1000000000000000000000000000000 is not within 1..16777216"),
    ({"prefill": {"points": [[10200, 1e30], [27500, 4.27]]}}, r"point 1: 1e\+30 is more than a week"),
    ({"prefill": {"points": [[1, 2, 3]]}}, r"point 1: \[1, 2, 3\] is not a \[tokens, seconds\] pair"),
    ({"prefill": {"points": [[10200, 1.83], [27500, 4.27]], "degree": "x"}}, r"prefill.degree: 'x' is not 0, 1 or 2"),
    ({"prefill": {"points": [[10200, 1.83], [27500, 4.27]], "degree": 2}}, r"p.yaml: prefill fit of degree 2 needs points at 3 lengths or more, got 2"),
    ({"prefill": {"points": [[1000, 1.0], [1000, 2.0], [1000, 3.0]], "degree": 1}}, r"degree 1 needs points at 2 lengths or more, got 1"),
    ({"decode": {"step_s": float("nan"), "max_batch": 20}}, r"decode.step_s: nan is not a number"),
    ({"decode": {"step_s": 0.025, "max_batch": float("inf")}}, r"decode.max_batch: inf is not a whole number >= 1"),
    ({"decode": {"step_s": 0.025, "max_batch": 10**400}}, r"decode.max_batch: a 401-digit number is more than 65536"),
    ({"decode": {"step_s": 0.025, "max_batch": 2.7}}, r"decode.max_batch: 2.7 is not a whole number >= 1"),
    ({"decode": {"step_s": 0.025, "speed": 1}}, r"decode.speed: unknown key"),
    ({"scaled_from": {"profile": "h200", "factor": "x"}}, r"scaled_from.factor: 'x' is not a number"),
    ({"scaled_from": {"profile": "p.yaml", "factor": 1.0}, "prefill": None}, r"p.yaml: scaled_from.profile: 'p.yaml' is scaled from itself"),
    ({"scaled_from": {"profile": "h200", "factor": 1e300}}, r"p.yaml: scaled_from.factor: 1e\+300 x the 0.44-s point of h200-paper-1t-hybrid: "
                                                             r".* is more than a week"),  # a profile of 1e299-s prefills
    ({"measured": [1, 2]}, r"measured: must be an object, got list"),
    ({"name": float("inf")}, r"p.yaml: name: inf is not a non-empty string"),
    ({"chip": 10**400}, r"p.yaml: chip: '1000.*'... is 401 bytes long; a name is at most 200 bytes"),
])
def test_a_profile_file_past_its_limits_is_one_line_naming_the_field(tmp_path, monkeypatch, change, match):
    """NaN, inf, 1e400 or a word in a number, a `scaled_from` loop or a degree that is not 0-2 were tracebacks
    (LinAlgError, OverflowError, RecursionError, TypeError) or read as is (decode.step_s: .nan) before 2026-12-07."""
    import yaml

    monkeypatch.chdir(tmp_path)
    data = {k: v for k, v in {**H20, **change}.items() if v is not None}
    if "scaled_from" in change:
        data.pop("prefill", None)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(UserError, match=match):
        load_profile("p.yaml")


@pytest.mark.parametrize("name,text,match", [
    ("m.csv", "tokens,prefill_s\nnan,0.5\n2048,0.9\n", r"m.csv: line 2: tokens and prefill_s must be numbers \(nan is not a number of tokens\)"),
    ("m.csv", "tokens,prefill_s\n1e400,0.5\n2048,0.9\n", r"line 2: .*inf is not a number of tokens"),
    ("m.csv", "tokens,prefill_s\n", r"m.csv: a measured CSV needs a header with columns tokens,prefill_s and a row under it"),
    ("m.csv", "tokens,prefill_s,batch_size\n,,4\n", r"m.csv: no row has both tokens and prefill_s"),
    ("m.json", '{"prefill": [[NaN, 0.5], [2048, 0.9]]}', r"m.json: prefill: point 1: nan is not a number of tokens"),
    ("m.json", '{"prefill": [[1024, 0.5], [2048, 0.9]], "decode": {"step_s": "fast"}}', r"m.json: decode.step_s: 'fast' is not a number"),
    ("m.json", b'{"prefill": [[1024, 0.5]], "chip": "caf\xe9"}', r"m.json: not UTF-8 text"),
])
def test_a_measured_file_past_its_limits_is_one_line_naming_the_line_or_field(tmp_path, name, text, match):
    """(as above; a NaN length reached the least-squares fit, a LinAlgError traceback)"""
    f = tmp_path / name
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(UserError, match=match):
        load_profile(str(f))


def test_repeated_lengths_fit_a_curve_of_the_lengths_there_are(tmp_path):
    """Three points at one length were fitted with a quadratic (numpy's RankWarning on stderr, a curve of noise)."""
    import warnings

    f = tmp_path / "m.csv"
    f.write_text("tokens,prefill_s\n1000,1.0\n1000,1.2\n2000,2.0\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = load_profile(str(f))
    assert len(p.coefficients) == 2 and p.prefill_time_s(1000) == pytest.approx(1.1)
