"""The one clock: every timestamp in the testbed is `now_s()` (CLOCK_MONOTONIC, shared by all
processes and network namespaces of the host), reported relative to the run's start `t0`."""

from __future__ import annotations

import os
import time

T0_ENV = "PRFAAS_T0"


def now_s() -> float:
    return time.monotonic()


def run_t0() -> float:
    """The run's start, set once by the orchestrator and inherited by every worker through the environment."""
    v = os.environ.get(T0_ENV)
    return float(v) if v else 0.0


def since_start_s(t: float | None = None) -> float:
    return (now_s() if t is None else t) - run_t0()


class Pacer:
    """Sleeps that keep to the time they stand for: what one sleep overshot (a busy host, another thread
    holding the GIL past its 5-ms switch interval) is taken off the next, so a run of sleeps lasts their
    sum, not their sum plus every wake-up's delay. Emulated compute (a profile's prefill, layer by layer,
    and its decode steps) paces with it: on the case study's loaded 2-core host plain sleeps made a 60-layer
    prefill 5-11% longer than its profile at the median (14-38% at P90), and a thread spinning in the same
    process 1.8-2.6x (docs/serving.md, "Emulated compute keeps its profile's time").

    By default only oversleep is owed: time spent between sleeps (handing a layer to a full send path:
    back-pressure) is real and never taken back. With `cadence=True` the time between sleeps is owed too,
    so back-to-back sleeps keep a period (a decode step's time is its whole iteration; the emulator's own
    work between steps, streaming tokens and admitting requests, is part of it). A debt older than
    `forget_s` (the compute sat idle) is dropped, and so is any debt when the caller says it was idle
    (`idle`: a decode loop whose batch ran empty, however short the gap)."""

    def __init__(self, forget_s: float = 1.0, *, cadence: bool = False) -> None:
        self.late_s = 0.0
        self.forget_s = forget_s
        self.cadence = cadence
        self._woke_s: float | None = None

    def idle(self) -> None:
        """The caller had nothing to pace (a decode loop with no request): its next sleep starts afresh,
        owing nothing, however soon it comes."""
        self._woke_s = None
        self.late_s = 0.0

    def sleep(self, seconds: float) -> None:
        start = now_s()
        if self._woke_s is None or start - self._woke_s > self.forget_s:
            self.late_s = 0.0
        elif self.cadence:
            self.late_s += start - self._woke_s
        due = start + seconds - self.late_s
        if due > start:
            time.sleep(due - start)
        self._woke_s = now_s()
        self.late_s = max(0.0, self._woke_s - due)
