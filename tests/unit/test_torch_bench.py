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
