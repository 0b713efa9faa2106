"""Router decision latency with 10,000 cached prefixes in the global KV cache manager.

One decision = what `Router.decide` does on arrival: chain the request's block hashes, prefix-match
every cluster in the KV manager, snapshot the instances, and let the `prfaas` policy decide (the
decision is logged, as in a run). Target: p99 <= 200 us. Side by side, in the same run, a naive
matcher that scans each instance's key set, to show what the bitmask index buys.

Workload: the case study's 4 PrfaaS + 8 PD-P instances; cached prefixes and requests with the
paper's truncated log-normal input lengths (mu 9.90, sigma 1.00, [128, 128K]); half of the requests
extend a cached prefix. Run: `python benchmarks/router_bench.py [--quick]`.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.progress import track  # noqa: E402
from rich.table import Table  # noqa: E402

from testbed.kv.pool import chain_block_hashes  # noqa: E402
from testbed.serving.kvmanager import reusable_blocks  # noqa: E402
from testbed.serving.policy import PolicySpec  # noqa: E402
from testbed.serving.router import Completion, DecodeInstanceConfig, PrefillInstanceConfig, Router, RouterConfig  # noqa: E402
from testbed.blocks import BLOCK_TOKENS  # noqa: E402
from testbed.console import wide_console  # noqa: E402

TARGET_P99_US = 200.0


def length(rng: random.Random) -> int:
    while True:
        n = int(rng.lognormvariate(9.90, 1.00))
        if 128 <= n <= 128 * 1024:
            return n


def build(prefixes: int, rng: random.Random) -> tuple[Router, list[list[int]]]:
    prefill = tuple(PrefillInstanceConfig("prfaas" if i < 4 else "pd", i, f"10.0.0.{i + 1}", 8100 + i) for i in range(12))
    decode = tuple(DecodeInstanceConfig(j, f"10.2.0.{j + 20}", 8200 + j, 9000 + j) for j in range(8))
    router = Router(RouterConfig(prefill, decode, PolicySpec(name="prfaas", threshold_tokens=8192)))
    chains: list[list[int]] = []
    held: dict[int, list[int]] = {i: [] for i in range(12)}
    for _ in track(range(prefixes), description="caching prefixes", transient=True):
        hashes = [rng.getrandbits(63) for _ in range(max(1, length(rng) // BLOCK_TOKENS))]
        chains.append(hashes)
        held[rng.randrange(12)].extend(chain_block_hashes(hashes))
    for inst, keys in held.items():
        router.kv.replace_instance(inst, keys)
    router._naive_sets = {inst: set(keys) for inst, keys in held.items()}  # type: ignore[attr-defined]
    return router, chains


def requests(n: int, chains: list[list[int]], rng: random.Random) -> list[Completion]:
    out = []
    for i in range(n):
        total = length(rng)
        blocks = -(-total // BLOCK_TOKENS)
        if rng.random() < 0.5:
            base = rng.choice(chains)
            keep = rng.randint(1, len(base))
            hashes = base[:keep] + [rng.getrandbits(63) for _ in range(max(0, blocks - keep))]
            total = max(total, keep * BLOCK_TOKENS + 1)
        else:
            hashes = [rng.getrandbits(63) for _ in range(blocks)]
        out.append(Completion(f"r{i}", total, 1024, hashes, None, False, "prfaas"))
    return out


def naive_match(sets: dict[int, set[int]], c: Completion) -> int:
    keys = chain_block_hashes(c.block_hashes[:reusable_blocks(c.input_len)])
    best = 0
    for s in sets.values():
        for i in range(len(keys) - 1, best - 1, -1):
            if keys[i] in s:
                best = i + 1
                break
    return best


def _timed(router: Router, c: Completion) -> int:
    t0 = time.perf_counter_ns()
    router.decide(c, 0.0)
    return time.perf_counter_ns() - t0


def percentiles(xs_ns: list[int]) -> dict[str, float]:
    xs = sorted(x / 1000.0 for x in xs_ns)
    q = lambda p: xs[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
    return {"mean": statistics.fmean(xs), "p50": q(0.50), "p90": q(0.90), "p99": q(0.99), "max": xs[-1]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2,000 decisions instead of 20,000")
    ap.add_argument("--prefixes", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    n = 2_000 if args.quick else 20_000
    router, chains = build(args.prefixes, rng)
    reqs = requests(n, chains, rng)
    keys_total = sum(router.kv.blocks_held(i) for i in range(12))
    # One pass per path over the same requests, so that no path runs on caches another one warmed.
    timings: dict[str, list[int]] = {"router decision (match + policy)": [], "KV match only": [], "naive per-instance scan": []}
    cpu: list[int] = []
    hits = 0
    for c in track(reqs, description="deciding", transient=True):
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        dec = router.decide(c, 0.0)
        t1 = time.perf_counter_ns()
        cpu.append(time.thread_time_ns() - c0)
        timings["router decision (match + policy)"].append(t1 - t0)
        hits += dec.cached_len > 0
    best: list[int] = []
    for c in track(reqs, description="matching", transient=True):
        t0 = time.perf_counter_ns()
        m = router.kv.match(c.block_hashes, c.input_len)
        timings["KV match only"].append(time.perf_counter_ns() - t0)
        best.append(max(m.cached_len("pd"), m.cached_len("prfaas")) // BLOCK_TOKENS)
    agree = 0
    for c, b in zip(track(reqs, description="naive scan", transient=True), best):
        t0 = time.perf_counter_ns()
        naive = naive_match(router._naive_sets, c)  # type: ignore[attr-defined]
        timings["naive per-instance scan"].append(time.perf_counter_ns() - t0)
        agree += b == naive
    stats = {k: percentiles(v) for k, v in timings.items()}
    stats["router decision, thread CPU time"] = percentiles(cpu)
    con = wide_console()
    table = Table(title=f"Router decision latency: {args.prefixes:,} cached prefixes ({keys_total:,} block keys), 12 prefill instances, {n:,} requests")
    table.add_column("path")
    for col in ("mean", "p50", "p90", "p99", "max"):
        table.add_column(f"{col} (us)", justify="right")
    for k, s in stats.items():
        table.add_row(k, *(f"{s[c]:.1f}" for c in ("mean", "p50", "p90", "p99", "max")))
    con.print(table)
    floor = Table(title="Decision cost by prompt length, cache misses (min of 5 repeats: the cost without preemption, warm caches)")
    floor.add_column("blocks (x512 tokens)", justify="right")
    floor.add_column("median (us)", justify="right")
    floor.add_column("p90 (us)", justify="right")
    for blocks in (16, 64, 128, 256):
        mins = []
        for i in range(100 if args.quick else 300):
            c = Completion(f"len{blocks}-{i}", blocks * BLOCK_TOKENS, 1024, [rng.getrandbits(63) for _ in range(blocks)], None, False, "prfaas")
            best = min(_timed(router, c) for _ in range(5))
            mins.append(best / 1000.0)
        mins.sort()
        floor.add_row(str(blocks), f"{mins[len(mins) // 2]:.1f}", f"{mins[int(0.9 * len(mins))]:.1f}")
    con.print(floor)
    p99 = stats["router decision (match + policy)"]["p99"]
    ratio = stats["naive per-instance scan"]["p99"] / max(stats["KV match only"]["p99"], 1e-9)
    con.print(f"requests with a prefix hit used: {hits}/{n}; bitmask index agrees with the naive scan on {agree}/{n}")
    con.print(f"naive scan p99 / bitmask match p99 = {ratio:.2f}x (same run, same requests)")
    ok = p99 <= TARGET_P99_US and agree == n
    con.print(f"target: decision p99 (wall clock) <= {TARGET_P99_US:.0f} us -> {p99:.1f} us: {'MET' if ok else 'MISSED'}")
    cpu_p99 = stats["router decision, thread CPU time"]["p99"]
    if not ok and cpu_p99 <= TARGET_P99_US:
        con.print(f"note: the decision's own CPU time p99 is {cpu_p99:.1f} us; the wall-clock tail is time spent "
                  "preempted by other processes (load average now {:.1f}): rerun on a quiet machine".format(os.getloadavg()[0]))
    return 0 if ok else 1


if __name__ == "__main__":
    from testbed.cli import guarded

    sys.exit(guarded(Path(__file__).name, main))
