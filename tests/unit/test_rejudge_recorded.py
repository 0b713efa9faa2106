"""benchmarks/rejudge_recorded.py: signals_bench rows found anywhere in a recorded JSON, compared as signals_bench does."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest

from testbed.errors import UserError

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "rejudge_recorded.py"
ns = runpy.run_path(str(SCRIPT), run_name="rejudge_recorded")
recorded_rows, rejudge = ns["recorded_rows"], ns["rejudge"]


def row(arm: str, seed: int, long_s: float, slo: float = 0.9, **extra: object) -> dict:
    return {"shape": "case-study", "arm": arm, "seed": seed, "long_p90_s": long_s, "short_p90_s": 2.0, "xfer_p90_s": 2.0,
            "slo": slo, **extra}


def test_rows_are_found_under_any_key_and_filtered_as_text() -> None:
    doc = {"what": "x", "runs": [{"arm": "a", "seed": 1, "long_p90_dip_s": 3.0}],  # not signals_bench's figures
           "bench_rows": {"cubic": [row("fixed-threshold", 1, 2.0, kv_cc="cubic")], "bbr": [row("fixed-threshold", 1, 2.0, kv_cc="bbr")]}}
    assert recorded_rows(doc, {"kv_cc": "cubic"}) == [doc["bench_rows"]["cubic"][0]]
    assert len(recorded_rows(doc, {})) == 2
    assert recorded_rows(doc, {"seed": "1", "kv_cc": "bbr"}) == doc["bench_rows"]["bbr"]


def test_mean_of_per_seed_ratios_or_ratio_of_means_and_slo_in_points() -> None:
    fixed = [row("fixed-threshold", s, v) for s, v in zip(range(1, 6), (10.0, 20.0, 10.0, 20.0, 10.0))]
    arm = [row("prfaas-observed", s, v, slo=0.95) for s, v in zip(range(1, 6), (5.0, 20.0, 5.0, 20.0, 5.0))]
    figures = {key: (n, m) for _, _, key, n, m, _, _ in rejudge(fixed + arm)}
    assert figures["long_p90_s"] == (5, pytest.approx(0.7))  # (0.5 + 1 + 0.5 + 1 + 0.5) / 5
    assert figures["slo_pp"] == (5, pytest.approx(5.0))
    means = {key: m for _, _, key, _, m, _, _ in rejudge(fixed + arm, ratio_of_means=True)}
    assert means["long_p90_s"] == pytest.approx(55 / 70)
    few = rejudge(fixed[:3] + arm[:3])  # below MIN_PAIRS: the figure, no interval
    assert all(math.isnan(lo) and math.isnan(hi) for *_, lo, hi in few)


def test_a_run_found_twice_is_refused() -> None:
    with pytest.raises(UserError, match="rows repeat"):
        rejudge([row("fixed-threshold", 1, 2.0), row("fixed-threshold", 1, 2.1)])
