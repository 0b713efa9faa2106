"""What a policy may see: the three signal modes and the boundary that enforces them (docs/router.md,
"Signals by what can be observed").

- ``observed`` (default): what the PrfaaS side owns and measures (its KV senders' TCP_INFO, its own
  transfers, the router's queues), plus the nominal line rate from the scenario;
- ``provisioned``: the same, with the nominal line rate taken as the capacity (no estimator);
- ``oracle``: also the emulator's WAN samples (the shaper's configured rate, the bottleneck's egress,
  backlog and drops). These exist only in emulation; this mode is for ablation and is labelled so in
  every run record and report.

`admit` is the one gate: every sample the router hands to a policy passes through it.
"""

from __future__ import annotations

import dataclasses
import math

from testbed.serving.policy.base import TelemetrySample

ORACLE_FIELDS = ("egress_bps", "capacity_bps", "backlog_bytes", "drops")


def admit(sample: TelemetrySample, mode: str) -> TelemetrySample | None:
    """`sample` as a policy in `mode` may see it: oracle fields removed unless ``oracle``; None when
    nothing is left to see."""
    if mode == "oracle":
        return sample
    if all(getattr(sample, f) is None for f in ORACLE_FIELDS):
        return sample
    kept = dataclasses.replace(sample, **dict.fromkeys(ORACLE_FIELDS))
    return None if all(getattr(kept, f.name) is None for f in dataclasses.fields(kept) if f.name != "t_s") else kept


class GroundTruth:
    """The emulator's answer to "how much bandwidth is left for KV" (for logs and plots, never for a
    policy outside ``oracle`` mode): the shaper's configured rate minus the traffic on the bottleneck
    that is not KV (its egress counter minus the KV goodput the senders measured), the latter
    smoothed with time constant `tau_s`. With inelastic cross traffic (the testbed's UDP neighbours)
    this is the rate left after cross traffic."""

    def __init__(self, tau_s: float = 1.0) -> None:
        self.tau_s = tau_s
        self.capacity_bps: float | None = None
        self._non_kv_bps: float | None = None
        self._kv_goodput_bps = 0.0
        self._last_t: float | None = None

    def on_kv_goodput(self, goodput_bps: float) -> None:
        self._kv_goodput_bps = goodput_bps

    def on_wan(self, t_s: float, egress_bps: float | None, capacity_bps: float | None) -> None:
        if capacity_bps is not None:
            self.capacity_bps = capacity_bps
        if egress_bps is None:
            return
        x = max(egress_bps - self._kv_goodput_bps, 0.0)
        if self._non_kv_bps is None or self._last_t is None:
            self._non_kv_bps = x
        else:
            a = 1.0 - math.exp(-max(t_s - self._last_t, 0.0) / self.tau_s)
            self._non_kv_bps += a * (x - self._non_kv_bps)
        self._last_t = t_s

    @property
    def kv_available_bps(self) -> float | None:
        if self.capacity_bps is None:
            return None
        return max(self.capacity_bps - (self._non_kv_bps or 0.0), 0.0)
