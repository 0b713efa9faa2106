"""Workload generation benchmark: speed, the paper's length distribution, and trace-replay fidelity.

Targets (issue 5): 1,000,000 requests generated in under 5 s; with a fixed seed the paper's distribution
has mean 27.5K (27,500 tokens) +- 1% and P(L > 19,400) = 0.496 +- 0.005; the bundled Mooncake trace
(tests/data; a missing trace is a missed target) replays with the same per-second arrival counts as its
timestamps. Beside the absolute time it prints the
ratio to a per-request pure-Python generator measured in the same run (timings on a shared machine are noisy).

    .venv/bin/python benchmarks/traffic_bench.py [--quick] [--trace FILE]

Exits 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from traffic.arrivals import Poisson  # noqa: E402
from traffic.lengths import PAPER_INPUT  # noqa: E402
from traffic.sessions import SessionSpec  # noqa: E402
from traffic.lengths import Fixed, Uniform  # noqa: E402
from traffic.stats import per_second_counts  # noqa: E402
from traffic.trace import read_trace  # noqa: E402
from traffic.workload import TraceSource, WorkloadSpec, generate_batch  # noqa: E402
from traffic.arrivals import TraceTimes  # noqa: E402

SEED = 2026
DEFAULT_TRACE = REPO / "tests" / "data" / "mooncake_synthetic_trace.jsonl"


def naive_python(n: int, rate_rps: float, seed: int) -> list[tuple[float, int, int, list[int]]]:
    """The straightforward per-request loop (rejection-sampled log-normal, a hash list per request)."""
    rnd = random.Random(seed)
    t, next_hash, out = 0.0, 0, []
    for _ in range(n):
        t += rnd.expovariate(rate_rps)
        while True:
            x = round(rnd.lognormvariate(9.90, 1.00))
            if 128 <= x <= 128 * 1024:
                break
        blocks = -(-x // 512)
        out.append((t, x, 1024, list(range(next_hash, next_hash + blocks))))
        next_hash += blocks
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="200,000 requests instead of 1,000,000 (time target scaled)")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    args = ap.parse_args(argv)

    n_target = 200_000 if args.quick else 1_000_000
    rate = 1000.0
    spec = WorkloadSpec(arrivals=Poisson(rate))  # the paper's lengths: truncated log-normal, output 1024
    time_limit_s = 5.0 * n_target / 1_000_000

    t0 = time.perf_counter()
    batch = generate_batch(spec, SEED, n_target / rate)
    gen_s = time.perf_counter() - t0
    n = len(batch)

    n_naive = 50_000
    t0 = time.perf_counter()
    naive_python(n_naive, rate, SEED)
    naive_per_req_s = (time.perf_counter() - t0) / n_naive

    t0 = time.perf_counter()
    m = 100_000
    for _, _r in zip(range(m), batch):
        pass
    objects_per_req_s = (time.perf_counter() - t0) / m

    sess = WorkloadSpec(input=Uniform(1000, 20000), output=Fixed(512), arrivals=Poisson(rate),
                        sessions=SessionSpec(turns=Uniform(1, 8), message=Uniform(64, 2048), think_s=20.0))
    t0 = time.perf_counter()
    sb = generate_batch(sess, SEED, n_target / rate)
    sess_s = time.perf_counter() - t0

    mean = float(batch.input_len.mean())
    p_long = float((batch.input_len > 19_400).mean())

    rows: list[tuple[str, str, str, bool | None]] = [
        (f"generate {n:,} requests (paper lengths, Poisson, hashes)", f"{gen_s:.2f} s", f"< {time_limit_s:.1f} s", gen_s < time_limit_s),
        ("  speed-up vs per-request Python loop (same run)", f"{naive_per_req_s * n / gen_s:.1f}x", "", None),
        ("  Request objects, materialised lazily", f"{objects_per_req_s * 1e6:.2f} us each", "", None),
        (f"generate {len(sb):,} multi-turn requests", f"{sess_s:.2f} s", "", None),
        ("mean input length (seed %d)" % SEED, f"{mean:,.0f}", "27,500 +- 1%", abs(mean - 27_500) / 27_500 <= 0.01),
        ("  closed form E[L]", f"{PAPER_INPUT.mean():,.0f}", "", None),
        ("P(L > 19,400)", f"{p_long:.4f}", "0.496 +- 0.005", abs(p_long - 0.496) <= 0.005),
        ("  closed form", f"{PAPER_INPUT.survival(19_400):.4f}", "", None),
    ]
    if args.trace.exists():
        replay = generate_batch(WorkloadSpec(arrivals=TraceTimes(()), trace=TraceSource(str(args.trace))), SEED, None)
        original = np.array([r.arrival_s for r in read_trace(args.trace).requests])
        a, b = per_second_counts(replay.arrival_s), per_second_counts(original)
        same = len(a) == len(b) and bool(np.array_equal(a, b))
        diff = int(np.abs(a - b).sum()) if len(a) == len(b) else math.inf
        rows.append((f"trace replay per-second counts ({len(b)} s, {len(original)} requests)",
                     "identical" if same else f"{diff} off", "identical", same))
    else:
        rows.append((f"trace replay: {args.trace} not found", "not measured", "identical", False))

    _print(rows)
    missed = [r[0].strip() for r in rows if r[3] is False]
    if missed:
        print("MISSED: " + "; ".join(missed))
        return 1
    print("all targets met")
    return 0


def _print(rows: list[tuple[str, str, str, bool | None]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title="traffic benchmark")
        for c in ("measure", "value", "target", "ok"):
            t.add_column(c)
        for name, value, target, ok in rows:
            t.add_row(name, value, target, "" if ok is None else ("yes" if ok else "NO"))
        Console(width=120).print(t)
    except ImportError:
        for r in rows:
            print(" | ".join("" if x is None else str(x) for x in r))


if __name__ == "__main__":
    from testbed.cli import guarded

    sys.exit(guarded(Path(__file__).name, main))
