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
