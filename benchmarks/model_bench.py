"""Analysis benchmarks: the case study's grid search (target < 2 s) and the report of a 2-minute run (target < 10 s).

    .venv/bin/python benchmarks/model_bench.py [--quick] [--run RUN_DIR]

Without --run the report is rendered from a run directory built to the documented contract
(tests/unit/rundir_factory.py, 120 s at 5 requests/s); with --run, from a real run. Side by side it times
a per-point Python loop over part of the same grid, so the vectorisation speed-up is a ratio measured
in one run. Exits 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from analysis import throughput_model as tm  # noqa: E402


def best_of(n: int, fn) -> float:
    out = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def loop_search(cm: tm.ClusterModel, dist: tm.LengthDistribution, thresholds: np.ndarray) -> float:
    """The same Eqs. 3-6 one (t, N_p) point at a time: the reference the vectorised search is compared with."""
    best = 0.0
    for t in thresholds:
        for n in range(cm.n_pd + 1):
            best = max(best, float(tm.stage_throughputs(cm, dist, [t], [n]).lambda_max[0, 0]))
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one repetition, a smaller loop sample")
    ap.add_argument("--run", help="a real run directory to render instead of the contract-built one")
    args = ap.parse_args()
    reps = 1 if args.quick else 3
    cm, homo, dist = tm.paper_case_study()
    search_s = best_of(reps, lambda: (tm.evaluate(cm, homo, dist, "literal"), tm.evaluate(cm, homo, dist, "mean")))
    grid = tm.threshold_grid(dist)
    sample = grid[:: (64 if args.quick else 16)]
    loop_s = best_of(1, lambda: loop_search(cm, dist, sample)) * len(grid) / len(sample)
    vec_s = best_of(reps, lambda: tm.search_prfaas_pd(cm, dist, "literal"))

    from analysis.report import write_report

    with tempfile.TemporaryDirectory() as tmp:
        if args.run:
            run_dir = Path(args.run)
            out = Path(tmp) / "report"
        else:
            sys.path.insert(0, str(REPO / "tests" / "unit"))
            from rundir_factory import write_run_dir

            run_dir = write_run_dir(Path(tmp) / "run", duration_s=120, rate_rps=5)
            out = None
        report_s = best_of(1 if args.quick else 2, lambda: write_report([run_dir], out))

    rows = [
        ("case-study search, 3 configs x 2 readings", search_s, 2.0, f"{len(grid)} thresholds x {cm.n_pd + 1} splits"),
        ("report of a 2-minute run", report_s, 10.0, str(args.run or "contract-built run directory")),
    ]
    print(f"{'benchmark':45s} {'seconds':>9s} {'target':>8s}  status  note")
    ok = True
    for name, s, target, note in rows:
        good = s < target
        ok &= good
        print(f"{name:45s} {s:9.3f} {'< ' + format(target, 'g'):>8s}  {'ok' if good else 'MISSED':6s}  {note}")
    print(f"\nPrfaaS-PD grid search: vectorised {vec_s * 1e3:.1f} ms vs per-point loop {loop_s * 1e3:.0f} ms (extrapolated from "
          f"{len(sample)} of {len(grid)} thresholds): {loop_s / vec_s:.0f}x")
    return 0 if ok else 1


if __name__ == "__main__":
    from testbed.cli import guarded

    sys.exit(guarded(Path(__file__).name, main))
