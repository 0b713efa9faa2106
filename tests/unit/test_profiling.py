"""`prfaas profile` (issue 12 item 5) and the `full` variant (item 6): a measured profile is written in the
profiles' format, reads back to the same curves, names its fit error, and a scenario can use it; the full
variant's mixture of experts routes as specified and its per-layer extrapolation covers the layer pattern."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from testbed.cli import main as cli_main
from testbed.models import full
from testbed.models.profiles import load_profile
from testbed.models.profiling import (Measurement, ProfilePlan, fit_decode, fit_errors, measured_phi,
                                      profile_document, write_profile)
from testbed.models.spec import load_model_spec
from testbed.models.torch_model import tiny_spec
from testbed.sections import load_scenario
from testbed.serving.config import plan_run

C0, C1, C2 = 0.05, 2e-4, 3e-8  # an exact quadratic: the fit must find it


def synthetic(plan: ProfilePlan) -> Measurement:
    m = Measurement(plan, "cpu", "test chip")
    m.prefill = [(n, C0 + C1 * n + C2 * n * n) for n in (128, 256, 512, 1024)]
    m.decode = [(b, c, 0.002 + 0.003 * b + 1e-6 * c) for c in (128, 1024) for b in (1, 2, 4, 8)]
    m.kv_bytes = [(n, 1000 * n) for n in (128, 256, 512, 1024)]
    return m


def test_a_measured_profile_round_trips_through_the_profile_loader(tmp_path: Path) -> None:
    plan = ProfilePlan("kimi-linear-48b", "faithful")
    prof = write_profile(profile_document(synthetic(plan), "mine"), tmp_path / "mine.yaml")
    assert prof.name == "mine" and prof.model == "kimi-linear-48b" and prof.chip == "test chip"
    assert np.allclose(prof.coefficients, (C0, C1, C2), rtol=1e-3)
    assert prof.points_tokens == (128.0, 256.0, 512.0, 1024.0)
    ctx = 1024  # the median of two contexts is the second
    assert prof.decode is not None and prof.decode.max_batch == 8
    assert prof.decode.step_s == pytest.approx(0.002 + 1e-6 * ctx, rel=1e-3) and prof.decode.per_sequence_s == pytest.approx(0.003, rel=1e-3)
    meas = prof.extra["measured"]
    assert meas["variant"] == "faithful" and meas["base_model"] == "kimi-linear-48b"
    assert meas["prefill_fit_error"]["max_rel"] < 1e-3 and meas["decode_fit_error"]["max_rel"] < 1e-3
    assert len(prof.extra["decode_points"]) == 8
    again = load_profile(str(tmp_path / "mine.yaml"))
    assert again.coefficients == prof.coefficients and again.decode == prof.decode


def test_fit_error_is_the_relative_residual_at_the_points() -> None:
    err = fit_errors([1, 2], [1.0, 2.0], (0.0, 1.1))  # fitted 1.1 and 2.2: +10% at both
    assert err["rms_rel"] == pytest.approx(0.1) and err["max_rel"] == pytest.approx(0.1)
    step, per, ctx, e = fit_decode([(1, 64, 0.01), (2, 64, 0.02), (4, 64, 0.04)])  # sequential decode: a line through 0
    assert ctx == 64 and per == pytest.approx(0.01) and 0 < step < 1e-5 and e["max_rel"] < 1e-3


def test_a_concave_fit_falls_back_to_a_line_so_extrapolation_stays_positive() -> None:
    from testbed.models.profiling import fit_prefill_robust

    coeffs, degree = fit_prefill_robust([(64, 2.77), (128, 3.78), (256, 5.24)])  # measured: flattening
    assert degree == 1 and coeffs[1] > 0
    assert fit_prefill_robust([(n, C0 + C1 * n + C2 * n * n) for n in (128, 256, 512)])[1] == 2


def test_a_scenario_can_name_a_measured_profile(tmp_path: Path) -> None:
    path = tmp_path / "gpu.yaml"
    write_profile(profile_document(synthetic(ProfilePlan("paper-1t-hybrid")), "gpu"), path)
    p = plan_run(load_scenario("quick", [f"serving.profiles.prfaas={path}"]))
    assert dict(p.profiles)["prfaas"] == str(path)
    scenario = tmp_path / "mine.yaml"  # a path relative to the scenario file
    scenario.write_text((Path(__file__).resolve().parents[2] / "topologies" / "quick.yaml").read_text())
    p = plan_run(load_scenario(str(scenario), ["serving.profiles.prfaas=gpu.yaml"]))
    assert dict(p.profiles)["prfaas"] == str(path)


def test_measured_phi_uses_the_geometry_that_ran_and_flags_extrapolation(tmp_path: Path) -> None:
    prof = write_profile(profile_document(synthetic(ProfilePlan("kimi-linear-48b", "tiny")), "t"), tmp_path / "t.yaml")
    rows = measured_phi(prof, (1024, 2048, 8192))
    spec = tiny_spec(load_model_spec("kimi-linear-48b"))
    t1k = C0 + C1 * 1024 + C2 * 1024**2
    assert rows[0]["how"] == "measured" and rows[0]["phi_gbps"] == pytest.approx(spec.kv_bytes(1024).total_bytes * 8 / t1k / 1e9, rel=1e-4)
    assert rows[1]["how"] == "curve" and rows[2]["how"] == "extrapolated"


def test_prfaas_profile_measures_a_reduced_depth_model_and_wall_prints_it_beside_table_3(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cpu.yaml"
    rc = cli_main(["profile", "--model", "kimi-linear-48b", "--variant", "tiny", "--device", "cpu", "--depth", "4",
                   "--lengths", "16,32,64", "--batches", "1,2", "--repeats", "1", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "fit error: rms" in text and f"wrote {out}" in text
    prof = load_profile(str(out))
    spec = tiny_spec(dataclasses.replace(load_model_spec("kimi-linear-48b"), layers=load_model_spec("kimi-linear-48b").layers[:4]))
    meas = prof.extra["measured"]
    assert meas["depth"] == 4 and meas["kv_bytes"] == [[n, spec.kv_bytes(n).total_bytes] for n in (16, 32, 64)]
    assert all(s > 0 for s in prof.points_s) and len(prof.extra["decode_points"]) == 4  # 2 batches x 2 contexts
    assert cli_main(["wall", "--measured", str(out)]) == 0
    wall = capsys.readouterr().out
    assert "cpu: kimi-linear-48b tiny" in wall and "1.19" in wall and "4.88" in wall  # Table 3, Kimi Linear


@pytest.mark.parametrize("argv, field", [(["--variant", "huge"], "--variant"), (["--device", "tpu"], "--device"),
                                         (["--lengths", "1,abc"], "--lengths"), (["--layers", "some"], "--layers")])
def test_bad_profile_options_are_one_line_and_exit_2(argv: list[str], field: str, tmp_path: Path, capsys) -> None:
    rc = cli_main(["profile", "--model", "kimi-linear-48b", "--out", str(tmp_path / "x.yaml"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and field in err and "Traceback" not in err


def test_a_seed_torch_cannot_take_is_refused_when_the_options_are_read(tmp_path: Path, capsys, monkeypatch) -> None:
    """torch.manual_seed takes seeds below 2**64: `--seed 18446744073709551616` was a traceback once the model was built."""
    from testbed.models import commands

    monkeypatch.setattr(commands, "run_profile", lambda args: pytest.fail("a refused --seed must not start profiling"))
    with pytest.raises(SystemExit) as exit_:
        cli_main(["profile", "--model", "kimi-linear-48b", "--out", str(tmp_path / "x.yaml"), "--seed", str(2**64)])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == ("prfaas profile: error: argument --seed: 18446744073709551616 is not a "
                                                                "seed; use a whole number from 0 to 4294967295 (2**32 - 1)")


SMALL = full.Widths(source="test", hidden=64, vocab=1000, attention_heads=4, mla_nope_dim=16, mla_v_dim=16,
                    experts=6, top_k=2, expert_mlp=32, shared_mlp=16, dense_mlp=96, dense_layers=1)


@pytest.fixture
def small_widths(monkeypatch):
    monkeypatch.setattr(full, "load_widths", lambda name: SMALL)


def test_the_mixture_of_experts_routes_each_token_to_its_top_k_experts(small_widths) -> None:
    gen = torch.Generator().manual_seed(0)
    moe = full.MoE(64, SMALL, 4, gen, torch.device("cpu"))
    h = torch.randn(10, 64, generator=gen)
    weights, chosen = (h @ moe.gate.T).topk(2, dim=-1)
    weights = weights.softmax(-1)
    want = torch.zeros_like(h)
    for t in range(10):
        for j in range(2):
            e = int(chosen[t, j]) % len(moe.w_gate)
            x = h[t:t + 1]
            want[t] += weights[t, j] * ((torch.nn.functional.silu(x @ moe.w_gate[e].T) * (x @ moe.w_up[e].T)) @ moe.w_down[e].T)[0]
    g, u, d = moe.shared
    want += (torch.nn.functional.silu(h @ g.T) * (h @ u.T)) @ d.T
    assert torch.allclose(moe(h), want, atol=1e-5)


def test_the_full_variant_caches_the_specs_exact_bytes_and_times_every_layer_kind(small_widths) -> None:
    spec = load_model_spec("kimi-linear-48b")
    m = full.build_full_model(spec, seed=0, device="cpu", depth=4)  # kda, kda, kda, mla
    assert isinstance(m.blocks[0], full.Block) and not isinstance(m.blocks[0], full.MoEBlock)  # dense_layers = 1
    assert all(isinstance(b, full.MoEBlock) for b in m.blocks[1:])
    _, cache = m.prefill(list(range(70)))
    assert cache.nbytes == m.spec.kv_bytes(70).total_bytes
    sub = dataclasses.replace(spec, layers=spec.layers[:4])
    total, per = full.time_prefill_per_layer(sub, 32, device="cpu")
    assert {(t.kind, t.layers) for t in per} == {("linear+dense", 1), ("linear", 2), ("mla", 1)}
    assert total == pytest.approx(sum(t.layers * t.seconds for t in per)) and total > 0
    step, per_d = full.time_decode_per_layer(sub, 48, device="cpu")
    assert step > 0 and sum(t.layers for t in per_d) == 4


def test_per_layer_timing_times_the_block_alone_not_the_drawing_of_its_input(small_widths, monkeypatch) -> None:
    """The timed callable runs the block only: drawing a [tokens, hidden] input on the CPU (and copying it to a
    GPU) inside it once added ~0.2 s at 8K tokens to every layer kind's time, more than a GPU's layer takes."""
    spec = load_model_spec("kimi-linear-48b")
    sub = dataclasses.replace(spec, layers=spec.layers[:4])
    timed = []

    def fake_time(fn, repeats, device, clock=None):
        def refuse(*args, **kwargs):
            raise AssertionError("an input was drawn inside the timed region")

        with monkeypatch.context() as m:
            for name in ("randn", "rand", "randint"):
                m.setattr(torch, name, refuse)
            fn()
        timed.append(fn)
        return 1.0

    monkeypatch.setattr(full, "_time", fake_time)
    total, per = full.time_prefill_per_layer(sub, 16, device="cpu")
    assert len(timed) == len(per) == 3 and total == 4.0
    step, per_d = full.time_decode_per_layer(sub, 16, device="cpu")
    assert len(timed) == 6 and step == 4.0


def test_full_variant_needs_published_widths() -> None:
    from testbed.errors import UserError

    with pytest.raises(UserError, match="widths.yaml"):
        full.load_widths("paper-1t-hybrid")


def test_a_decode_step_is_timed_after_one_untimed_step() -> None:
    """The first step of a batch pays for first launches; it is run and not counted (with one step it would
    be the figure)."""
    from testbed.models.profiling import decode_step_time_s

    t = [0.0]

    class Model:
        calls = 0

        def decode_batch(self, tokens, caches, check=True):
            self.calls += 1
            t[0] += 5.0 if self.calls == 1 else 1.0  # the first step takes 5 s of the fake clock, later ones 1 s

    m = Model()
    assert decode_step_time_s(m, [object(), object()], 7, 1, lambda: None, lambda: t[0]) == 1.0
    assert m.calls == 2


def test_a_cpu_clock_is_refused_on_a_gpu() -> None:
    from testbed.errors import UserError
    from testbed.models.profiling import clock_for

    plan = ProfilePlan(model="kimi-linear-48b", clock="cpu")
    with pytest.raises(UserError, match="--clock: cpu .* on a CUDA device use wall or auto"):
        clock_for(plan, "cuda")
    assert clock_for(plan, "cpu")[0] == "cpu" and clock_for(dataclasses.replace(plan, clock="auto"), "cuda")[0] == "wall"


def test_a_measured_profile_that_is_not_utf8_is_one_user_error(tmp_path: Path) -> None:
    from testbed.errors import UserError
    from testbed.models.profiles import measured_profile

    bad = tmp_path / "m.csv"
    bad.write_bytes(b"tokens,prefill_s\n\xff,1\n")
    with pytest.raises(UserError, match=r"m.csv: not UTF-8 text \(at byte offset 17\); a measured profile"):
        measured_profile(bad)


@pytest.mark.parametrize("change,match", [
    ({"depth": "four"}, r"measured.depth: 'four' is not a whole number >= 1"),
    ({"variant": "huge"}, r"measured.variant: 'huge' is not allowed; use one of: faithful, tiny, full"),
    ({"base_model": None}, r"measured.base_model: is required"),
])
def test_a_measured_section_the_wall_cannot_read_is_one_line_naming_the_key(tmp_path: Path, change, match) -> None:
    """`prfaas wall --measured` read `measured.depth: four` into a comparison (a TypeError traceback, 2026-12-07)."""
    import yaml

    from testbed.errors import UserError
    from testbed.models.profiles import load_profile

    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "docs/measured-profiles/kimi-tiny-cpu.yaml").read_text())
    doc["measured"].update(change)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(UserError, match=match):
        measured_phi(load_profile(str(tmp_path / "p.yaml")), (1024,))


def test_a_profile_of_a_spec_file_names_the_specs_model_and_reads_back(tmp_path: Path) -> None:
    """`prfaas profile --model my/spec.yaml` wrote `model: my/spec.yaml`, refused when it read the file back (not a plain
    name), after the whole measurement."""
    spec = tmp_path / "specs" / "mine.yaml"
    spec.parent.mkdir()
    spec.write_text("name: my-hybrid\nlayers: [{kind: mla, kv_lora_rank: 4, rope_dim: 2}]\n")
    prof = write_profile(profile_document(synthetic(ProfilePlan(str(spec))), "p"), tmp_path / "p.yaml")
    assert prof.model == "my-hybrid" and prof.extra["measured"]["base_model"] == str(spec)  # wall --measured reloads it
