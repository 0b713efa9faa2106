"""benchmarks/probe_bench.py's summary of probe readings (the network part needs root: run the benchmark)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("probe_bench", Path(__file__).resolve().parents[2] / "benchmarks" / "probe_bench.py")
assert spec is not None and spec.loader is not None
probe_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe_bench)


def test_readings_are_summarised_as_ratios_to_the_rate_left_and_counted_above_the_line() -> None:
    readings = [70e9, 80e9, 84e9, 90e9, 120e9]  # a line of 100 Gbps with 84 left
    s = probe_bench.summarize(readings, 84e9, 100e9)
    assert s["median"] == pytest.approx(1.0)
    assert s["max"] == pytest.approx(120 / 84)
    assert s["p10"] == pytest.approx((70 + 0.4 * 10) / 84)
    assert (s["above_line"], s["n"]) == (1, 5)


def test_the_target_judges_sizes_at_or_above_the_rate_left_and_the_line_for_every_size() -> None:
    good, low = {"median": 0.97, "above_line": 0}, {"median": 0.55, "above_line": 0}
    assert probe_bench.judge([(1.0, good), (2.0, good), (0.5, low)])  # a probe sized below the rate left: reported only
    assert not probe_bench.judge([(1.0, good), (2.0, low)])
    assert not probe_bench.judge([(1.0, good), (0.5, {"median": 0.5, "above_line": 1})])
