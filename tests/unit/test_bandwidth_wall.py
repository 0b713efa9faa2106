"""The bandwidth wall: published Phi_kv with our specs' bytes, Eq. 2 cluster egress, and a real measured prefill."""

from __future__ import annotations

import pytest

from analysis import bandwidth_wall as bw
from analysis.plots import missing_units


def test_implied_dense_prefill_latencies_match_the_derived_values():
    t = bw.published_table().set_index(["model", "tokens"])["implied_prefill_s"]
    for l, want in zip(bw.LENGTHS, (0.42, 0.51, 1.11, 5.57)):
        assert t[("minimax-m2.5", l)] == pytest.approx(want, abs=0.01)
    for l, want in zip(bw.LENGTHS, (0.38, 0.56, 1.51, 9.39)):
        assert t[("qwen3-235b", l)] == pytest.approx(want, abs=0.01)
    # Table 5 publishes KV size and latency: the preset (a fit to its KV sizes) gives back 0.44 .. 7.40 s within 2.5%
    for l, want in zip(bw.LENGTHS, (0.44, 0.72, 1.84, 7.40)):
        assert t[("paper-1t-hybrid", l)] == pytest.approx(want, rel=0.025)


def test_eq2_cluster_egress_reproduces_the_papers_512_gpu_estimates():
    c = bw.cluster_table(512, 32768).set_index("model")["egress_gbps"]
    assert c["minimax-m2.5"] == pytest.approx(3800, rel=0.02)
    assert c["qwen3-235b"] == pytest.approx(2100, rel=0.02)
    assert c["ring-2.5-1t"] == pytest.approx(170, rel=0.03)
    assert bw.cluster_egress("x", 2.0, gpus=16, gpus_per_instance=8).egress_gbps == 4.0


def test_profile_curve_phi_is_kv_bytes_over_prefill_time():
    d = bw.profile_curve("paper-1t-hybrid", "h200-paper-1t-hybrid", [1024, 131072])
    assert d["phi_gbps"].tolist() == pytest.approx((d["kv_bytes"] * 8 / d["prefill_s"] / 1e9).tolist())
    assert d["phi_gbps"].iloc[0] == pytest.approx(3.61, rel=0.03)


def test_measured_prefill_times_a_real_model_and_counts_the_bytes_it_produced():
    import torch

    torch.set_num_threads(1)
    from testbed.models.spec import load_model_spec
    from testbed.models.torch_model import tiny_spec

    d = bw.measure("minimax-m2.5", [16, 32], variant="tiny", device="cpu")
    assert (d["prefill_s"] > 0).all()
    spec = tiny_spec(load_model_spec("minimax-m2.5"))
    assert d["kv_bytes"].tolist() == [spec.kv_bytes(16).total_bytes, spec.kv_bytes(32).total_bytes]
    assert "measured here" in d["source"].iloc[0]


def test_wall_figure_has_units_and_both_link_lines():
    fig = bw.wall_figure(bw.published_table(), [bw.profile_curve("minimax-m2.5", "h200-minimax-m2.5", [1024, 4096])])
    assert missing_units(fig) == []
    ys = {round(l.get_ydata()[0], 3) for ax in fig.axes for l in ax.get_lines() if len(set(l.get_ydata())) == 1}
    assert {10.0, 100.0} <= ys


def test_wall_command_prints_json_and_writes_the_figure(tmp_path, capsys):
    import json

    from testbed.cli import main

    assert main(["wall", "--json", "--plots", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {r["model"] for r in doc["published"]} >= {"minimax-m2.5", "paper-1t-hybrid"}
    assert (tmp_path / "bandwidth_wall.png").stat().st_size > 10_000
    assert main(["wall", "--measure", "minimax-m2.5", "--lengths", "8,x"]) == 2
    assert "--lengths" in capsys.readouterr().err


def test_measured_table_keeps_every_label_whole_and_its_columns_aligned():
    """A 58-character cut made "... faithful on NVIDIA H200" read "... on NVIDIA H20", another chip (2026-12-07)."""
    import pandas as pd

    from analysis.bandwidth_wall import LENGTHS, format_measured_table

    rows = [{"profile": "kimi-faithful-h200", "model": "kimi-linear-48b", "variant": "faithful", "chip": "NVIDIA H200",
             "tokens": n, "phi_gbps": 2.0 + i, "how": "measured", "published_phi_gbps": 1.0 + i,
             "published_source": "paper Table 3, 8xH200, SGLang v0.5.9"} for i, n in enumerate(LENGTHS)]
    lines = format_measured_table(pd.DataFrame(rows)).splitlines()
    assert lines[1].startswith("kimi-faithful-h200: kimi-linear-48b faithful on NVIDIA H200 ")
    assert lines[1].split()[-len(LENGTHS):] == ["2", "3", "4", "5"] and lines[2].split()[-len(LENGTHS):] == ["1", "2", "3", "4"]
    assert len({len(ln) for ln in lines}) == 1  # header and rows end at the same column
