"""benchmarks/transport_bench.py's verdict (`judge`): the issue's transport target is the lower end of a 95% interval
over >= 5 repetitions, so a setting measured fewer times is reported, not judged; a failed transfer misses at any count."""

from __future__ import annotations

import runpy
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "transport_bench.py"
bench = runpy.run_path(str(SCRIPT), run_name="transport_bench")  # loaded as test_signals_bench loads its benchmark


def setting(reps: int, ci_low: float, failed: int = 0) -> dict:
    return {"loss": "0.1%", "cc": "cubic", "streams": 4, "reps": reps, "mean": ci_low + 0.05, "ci_low": ci_low,
            "ci_high": ci_low + 0.1, "failed": failed}


def test_one_run_is_not_judged_however_good_and_five_are() -> None:
    assert bench["MIN_REPEATS"] == 5 and bench["TARGET_RATIO"] == 0.9
    one_good, five_good, five_low = setting(1, 1.2), setting(5, 0.95), setting(5, 0.85)
    missed, unjudged = bench["judge"]([one_good, five_good, five_low])
    assert missed == [five_low] and unjudged == [one_good]  # one run read "target met" from its single ratio before
    missed, unjudged = bench["judge"]([setting(1, 0.5)])
    assert (missed, len(unjudged)) == ([], 1)  # one low run is not a miss either: it is no interval


def test_a_failed_transfer_misses_at_any_count() -> None:
    failed = setting(1, 1.2, failed=1)
    assert bench["judge"]([failed]) == ([failed], [])
