"""Emulated compute keeps its profile's time: a profile-mode prefill (ProfileCompute, the case study's
60-layer model and H200 profile) timed against the profile, with the layers' sleeps paced
(`testbed.clock.Pacer`, what the workers use) and, side by side in the same run, plain per-layer
sleeps (what they used before). Each on a quiet process and with a thread spinning beside it (a worker's
KV sender or token streamer holding the GIL; on a loaded 2-core host the scheduler does the same).

Target: paced took / profile, median over the repeats, <= 1.05 in both conditions (docs/serving.md,
"Emulated compute keeps its profile's time"). Run: `python benchmarks/pacing_bench.py [--repeats N]`;
exit 1 when the target is missed. No root, no network.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.table import Table  # noqa: E402

from testbed.serving.compute import PrefillPlan, ProfileCompute  # noqa: E402
from testbed.serving.worker import WorkerConfig  # noqa: E402
from testbed.console import wide_console  # noqa: E402

TARGET = 1.05
LENGTHS = (8192, 32768)


def plain_prefill(comp: ProfileCompute, plan: PrefillPlan) -> None:
    """The old pacing: one plain sleep per layer."""
    layer_s = comp.prefill_time_s(plan.input_len, plan.cached_len) / len(comp.spec.layers)
    for _ in comp.spec.layers:
        time.sleep(layer_s)


def spin(stop: threading.Event) -> None:
    while not stop.is_set():
        pass


def timed(fn, comp: ProfileCompute, length: int) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    fn(comp, PrefillPlan(length))
    return (time.monotonic() - start) / comp.prefill_time_s(length, 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    cfg = WorkerConfig(role="prefill", instance=0, cluster="prfaas", host="lo", port=0, compute="profile",
                       model={"name": "paper-1t-hybrid", "compute": "profile"}, profile="h200-paper-1t-hybrid", scale=50.0)
    comp = ProfileCompute(cfg)
    paced = lambda c, plan: c.prefill("bench", plan, None, lambda layer: None)  # noqa: E731
    table = Table(min_width=100, title="profile-mode prefill: took / profile time, median (min-max) over the repeats")
    for col in ("condition", "prompt tokens", "profile s", "plain sleeps", "paced (Pacer)", f"paced <= {TARGET}"):
        table.add_column(col)
    ok = True
    for spinning in (False, True):
        stop = threading.Event()
        spinner = threading.Thread(target=spin, args=(stop,), daemon=True)
        if spinning:
            spinner.start()
        try:
            for length in LENGTHS:
                plain, pace = [], []
                for _ in range(a.repeats):  # interleaved: the same host conditions for both
                    plain.append(timed(plain_prefill, comp, length))
                    pace.append(timed(paced, comp, length))
                met = statistics.median(pace) <= TARGET
                ok &= met
                f = lambda xs: f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"  # noqa: E731
                table.add_row("a thread spinning" if spinning else "quiet", str(length), f"{comp.prefill_time_s(length, 0):.2f}",
                              f(plain), f(pace), "yes" if met else "NO")
        finally:
            stop.set()
            if spinning:
                spinner.join()
    wide_console().print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    from testbed.cli import guarded

    sys.exit(guarded(Path(__file__).name, main))
