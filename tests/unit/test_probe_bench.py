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


def test_the_benchmark_judges_a_probe_filled_exactly_when_a_fresh_estimator_takes_it_as_an_upper_bound() -> None:
    """`judged_filled` is the estimator's own rule (`EstimatorSpec.fill_rule`), with the probe's pings' RTT as
    floor and unloaded RTT: over a grid of sizes and end RTTs on a 10-ms path, a probe is judged filled
    exactly when an estimator whose floor is that RTT takes it as saturated evidence."""
    from testbed.serving.policy.estimator import BandwidthEstimator

    G, seen = 1e9, set()
    for nbytes in (5e6, 14e6, 15e6, 16e6, 40e6):
        for rtt_ms in (10.0, 13.9, 14.0, 20.0):
            est = BandwidthEstimator(100 * G)
            e = est.probe(1.0, nbytes, 4 * G, rtt_ms, 10.0, 10.0)
            judged = probe_bench.judged_filled({"bytes": nbytes, "rate_bps": 4 * G, "rtt_ms": rtt_ms, "idle_rtt_ms": 10.0})
            assert judged == (e.evidence == "saturated"), (nbytes, rtt_ms)
            seen.add(judged)
    assert seen == {True, False}
    assert not probe_bench.judged_filled({"bytes": 40e6, "rate_bps": 0.0, "rtt_ms": 20.0, "idle_rtt_ms": 10.0})
    assert not probe_bench.judged_filled({"bytes": 40e6, "rate_bps": 4 * G, "rtt_ms": 20.0, "idle_rtt_ms": None})
