"""benchmarks/signals_bench.py's verdict: only the prfaas-observed arm is judged (against fixed-threshold of
the same seeds), so a run of other arms alone judges nothing and must not read as "all targets met"."""

from __future__ import annotations

import runpy
from pathlib import Path

from rich.console import Console

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "signals_bench.py"
compare = runpy.run_path(str(SCRIPT), run_name="signals_bench")["compare"]  # loaded as test_compile_probe loads its benchmark


def row(arm: str, seed: int, long_s: float, slo: float = 1.0) -> dict:
    return {"shape": "val-rtt-surge", "arm": arm, "seed": seed, "long_p90_s": long_s, "short_p90_s": 1.0, "xfer_p90_s": 1.0,
            "slo": slo, "failed": 0, "est_mae": None, "detect_s": None, "signals": "observed"}


def test_other_arms_alone_judge_nothing() -> None:
    rows = [row(arm, s, 5.0) for arm in ("fixed-threshold", "prfaas-oracle", "all-local") for s in (1, 2, 3)]
    assert compare(rows, Console(quiet=True)) == (True, 0)


def test_the_observed_arm_is_judged_against_fixed_threshold_of_the_same_seeds() -> None:
    fixed = [row("fixed-threshold", s, 10.0) for s in (1, 2, 3)]
    better = [row("prfaas-observed", s, 5.0) for s in (1, 2, 3)]  # long P90 ratio 0.5, transfer and short 1.0
    ok, judged = compare(fixed + better, Console(quiet=True))
    assert judged == 4 and not ok  # transfer P90 ratio 1.0 > 0.7
    unpaired = [row("prfaas-observed", s, 5.0) for s in (4, 5)]
    assert compare(fixed + unpaired, Console(quiet=True)) == (True, 0)
