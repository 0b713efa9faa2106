"""WAN telemetry: a sampler thread (default every 50 ms, i.e. 20 Hz) per direction, kept in memory,
handed to listeners as it comes and written as one parquet time series (`link.parquet`).

Each sample: ``t_s`` (since Network.start, on the one clock), ``direction``, the root qdisc's
``tx_bytes``, ``tx_packets``, ``drops``, ``overlimits``, ``backlog_bytes``, ``backlog_packets``, the
configured wire rate ``rate_bps`` and emulated ``rate_emulated_bps``, ``achieved_bps`` (wire, from the
byte delta since the previous sample) and ``achieved_emulated_bps`` (x scale), ``link_up``,
``delay_s``, ``loss``, ``queue_limit_bytes`` and, with the delay line, its ``delayline_*`` counters.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable

from testbed import clock
from testbed.scale import Scale

DEFAULT_PERIOD_S = 0.05
Listener = Callable[[dict[str, Any]], None]


def boost_thread_priority(priority: int = 10) -> bool:
    """Give the calling thread a real-time (SCHED_RR) priority, best effort.

    Why: the sampler and the schedule sleep almost always, but on a 2-core host saturated by iperf3 and
    the delay line a normal thread waits hundreds of ms for a CPU, which would blur 50 ms samples and
    late schedule steps. Both threads only wake briefly, so they cannot starve anything."""
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_RR, os.sched_param(priority))
        return True
    except (OSError, AttributeError):
        return False


class Telemetry:
    def __init__(self, sample: Callable[[str], dict[str, Any]], directions: tuple[str, ...], *, t0_s: float, scale: Scale | float,
                 period_s: float = DEFAULT_PERIOD_S, keep_rows: bool = True) -> None:
        """`keep_rows=False`: hand each sample to the listeners only (the WAN control process, whose runner keeps them)."""
        self._sample = sample
        self.keep_rows = keep_rows
        self.directions = directions
        self.t0_s, self.scale, self.period_s = t0_s, Scale.of(scale), period_s
        self.rows: list[dict[str, Any]] = []
        self.listeners: list[Listener] = []
        self.errors = 0
        self._last: dict[str, tuple[float, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wan-telemetry", daemon=True)

    def add_listener(self, fn: Listener) -> None:
        self.listeners.append(fn)

    def start(self) -> "Telemetry":
        self.sample_once()
        self._thread.start()
        return self

    def sample_once(self) -> list[dict[str, Any]]:
        out = []
        for d in self.directions:
            try:
                s = self._sample(d)
            except Exception:
                self.errors += 1
                continue
            t = clock.now_s()
            s["t_s"] = t - self.t0_s
            s["direction"] = d
            prev = self._last.get(d)
            dt = t - prev[0] if prev else 0.0
            s["achieved_bps"] = (s["tx_bytes"] - prev[1]) * 8 / dt if prev and dt > 0 else 0.0
            s["achieved_emulated_bps"] = self.scale.emulated_bps(s["achieved_bps"])
            self._last[d] = (t, s["tx_bytes"])
            if self.keep_rows:
                self.rows.append(s)
            out.append(s)
            for fn in list(self.listeners):
                try:
                    fn(dict(s))
                except Exception:
                    self.errors += 1
        return out

    def _run(self) -> None:
        boost_thread_priority()
        next_t = clock.now_s() + self.period_s
        while not self._stop.wait(max(0.0, next_t - clock.now_s())):
            self.sample_once()
            next_t += self.period_s
            if next_t < clock.now_s():  # fell behind (busy host): skip, do not burst
                next_t = clock.now_s() + self.period_s

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def write_parquet(self, path: Path) -> Path:
        return write_rows(self.rows, path)


def write_rows(rows: list[dict[str, Any]], path: Path) -> Path:
    """Telemetry rows -> `link.parquet` at `path`."""
    from testbed.atomic import write_parquet
    from testbed.rundir import link_frame

    return write_parquet(path, link_frame(rows))
