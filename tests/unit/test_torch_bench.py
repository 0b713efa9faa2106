"""benchmarks/torch_bench.py's prefill-speed figure: its fit and the cost of a scenario's own workload."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "torch_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("torch_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_scenario_is_costed_with_its_own_requests(bench) -> None:
    """The workload `prfaas run` would draw (seed, duration), each prompt's prefilled positions costed
    a L + b L^2; a lighter scenario needs fewer cores."""
    from testbed.sections import load_scenario
    from traffic.workload import generate_batch

    fit = {"a_s_per_token": 1e-4, "b_s_per_token2": 2e-8}
    quick = bench.scenario_demand("quick", fit)
    sc = load_scenario("quick")
    lengths = np.asarray(generate_batch(sc.section("workload"), sc.seed, sc.duration_s).input_len, dtype=float) - 1
    want_s = float(np.sum(1e-4 * lengths + 2e-8 * lengths**2))
    assert quick["requests"] == lengths.size > 10
    assert quick["prompt_tokens"] == int(lengths.sum())
    assert quick["prefill_cpu_s"] == pytest.approx(want_s)
    assert quick["cores_needed"] == pytest.approx(want_s / sc.duration_s)
    assert quick["core_tokens_per_s"] == pytest.approx(lengths.sum() / want_s)
    light = bench.scenario_demand("torch-quick", fit)
    assert light["requests"] < quick["requests"] and light["longest"] <= 16 * 1024
    assert light["cores_needed"] < quick["cores_needed"] / 2


def test_the_prefill_speed_fit_recovers_the_measured_times(bench) -> None:
    fig = bench.prefill_speed_figure(lengths=(64, 128, 256))
    assert [p["tokens"] for p in fig["points"]] == [64, 128, 256]
    assert all(p["cpu_s"] > 0 and p["tokens_per_s"] == pytest.approx(p["tokens"] / p["cpu_s"]) for p in fig["points"])
    longest = fig["points"][-1]  # a least-squares fit weighs the longest point most: a loose sanity bound there
    model = fig["a_s_per_token"] * longest["tokens"] + fig["b_s_per_token2"] * longest["tokens"] ** 2
    assert longest["cpu_s"] / 3 < model < longest["cpu_s"] * 3


def test_the_work_model_recovers_its_terms_and_charges_the_prefix_pairs(bench) -> None:
    """Full-prefill times made of a fixed, a per-token and a per-pair part give those parts back, and a
    suffix after a prefix is charged s x p + s^2 / 2 pairs (more than its share of a full prefill's)."""
    lengths = [256, 512, 768, 1024]
    times = [8e-3 + 50e-6 * n + 14e-9 * n * n / 2 for n in lengths]
    m = bench.work_model(lengths, times)
    assert (m.fixed_s, m.per_token_s, m.per_pair_s) == pytest.approx((8e-3, 50e-6, 14e-9), rel=1e-6)
    assert m.fit_error < 1e-9
    assert m.predict_s(256, 768) == pytest.approx(8e-3 + 50e-6 * 256 + 14e-9 * (256 * 768 + 256 * 256 / 2))
    shares = m.as_dict(1024)
    assert shares["fixed_share"] + shares["token_share"] + shares["pair_share"] == pytest.approx(1.0)
    noisy = bench.work_model(lengths, [t - 9e-3 * (n == 256) for n, t in zip(lengths, times)])  # would fit F < 0
    assert noisy.fixed_s == 0.0 and noisy.per_token_s > 0 and noisy.per_pair_s >= 0
    # what "proportional to the uncached tokens" leaves out: at 75% hit the model predicts well above 0.25
    assert m.predict_s(256, 768) / m.predict_s(1024, 0) > 0.25 * 1.2
