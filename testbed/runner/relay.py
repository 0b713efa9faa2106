"""The telemetry relay: NET's WAN samples (PrfaaS -> PD) -> the client agent's stdin -> the router's
/v1/telemetry (wire units), and the emulated egress shown in the live view."""

from __future__ import annotations

import json
import queue
import threading
from typing import Any

from testbed import clock
from testbed.runner.live import LiveState
from testbed.scale import Scale


class TelemetryRelay:
    """A bounded queue and its own writer thread keep a slow router from stalling NET's sampler: when
    the queue is full the newest sample is dropped (the next follows within 50 ms)."""

    def __init__(self, live: LiveState, scale: Scale) -> None:
        self.live, self.scale = live, scale
        self.samples: queue.Queue = queue.Queue(maxsize=64)
        self.stdin: Any = None

    def attach(self, stdin: Any) -> None:
        self.stdin = stdin
        threading.Thread(target=self._write, daemon=True, name="telemetry-relay").start()

    def __call__(self, s: dict[str, Any]) -> None:
        if s.get("direction") != "prfaas_to_pd":
            return
        cap = float(s.get("rate_bps") or 0.0) if s.get("link_up", True) else 0.0
        self.live.egress_bps = self.scale.emulated_bps(float(s.get("achieved_bps") or 0.0))
        self.live.capacity_bps = self.scale.emulated_bps(cap)
        sample = {"t_s": clock.now_s(), "egress_bps": float(s.get("achieved_bps") or 0.0), "capacity_bps": cap,
                  "backlog_bytes": float(s.get("backlog_bytes") or 0.0), "drops": float(s.get("drops") or 0.0)}
        try:
            self.samples.put_nowait(sample)
        except queue.Full:
            pass

    def _write(self) -> None:
        while self.stdin is not None:
            try:
                sample = self.samples.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                self.stdin.write(json.dumps(sample) + "\n")
                self.stdin.flush()
            except (OSError, ValueError, AttributeError):
                return

    def close(self) -> None:
        self.stdin = None
