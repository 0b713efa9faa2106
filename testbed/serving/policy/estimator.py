"""Available KV bandwidth from what the PrfaaS senders observe (docs/router.md, "The bandwidth estimator").

Inputs per poll of the PrfaaS workers (summed over them): the path rate of the senders that have work
(TCP_INFO `delivery_rate` summed over their connections; the kernel keeps the last sample that was not
application-limited, so layer-wise streaming at the prefill's pace does not read as a slow path;
`KVSender.congestion()["path_rate_bps"]`), the senders' backlog (bytes queued and not yet sent plus bytes in flight), RTT and min RTT,
cumulative retransmits. No emulator figure enters. The estimate:

- while the senders are **backlogged**, what they get acknowledged is what the path gives them: the
  estimate is the maximum of those samples over `window_s` (a max filter, as BBR's bottleneck
  bandwidth: one low sample from a pause between transfers does not pull it down);
- when a **standing queue** shows (RTT - min RTT >= `queue_delay_ms`) while backlogged, the path is
  saturated now: the max filter restarts from the current sample, so a dip shows within one poll
  after the queue fills rather than after `window_s`;
- while **not backlogged** (application-limited) a sample is only a lower bound: the estimate keeps
  its value and relaxes towards the nominal line rate with time constant `probe_tau_s` (optimism that
  lets t fall back after a dip; a wrong guess re-creates the queue, which the rule above catches);
- the RTT floor is the larger of the kernel's min RTT and the minimum RTT polled over `rtt_window_s`:
  a lasting change of the path's delay (a reroute) stops counting as queueing after that window;
- **loss** is reported (retransmits per second) but counts as congestion only together with a queue:
  random loss on an idle path is not a reason to keep work local.

Units are whatever the caller uses consistently (the router feeds emulated bit/s and bytes).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class EstimatorSpec:
    window_s: float = 2.0  # max filter over backlogged goodput samples
    queue_delay_ms: float = 2.0  # RTT - min RTT at or above this is a standing queue (0 disables)
    queue_delay_fraction: float = 0.25  # ... or this fraction of min RTT, whichever is larger
    probe_tau_s: float = 5.0  # while application-limited, relax towards the nominal rate
    rtt_window_s: float = 10.0  # the RTT floor forgets samples older than this
    min_backlog_bytes: float = 0.0  # backlog above this counts as backlogged


@dataclass(frozen=True)
class Estimate:
    t_s: float
    available_bps: float
    backlogged: bool
    queue_delay_ms: float
    retransmits_per_s: float
    congested: bool  # standing queue while backlogged


class BandwidthEstimator:
    """Feed `update` with each poll's sums; read `estimate` (the latest `Estimate`)."""

    def __init__(self, nominal_bps: float, spec: EstimatorSpec | None = None) -> None:
        if nominal_bps <= 0:
            raise ValueError(f"nominal_bps {nominal_bps!r} must be > 0 (the line rate from the scenario)")
        self.nominal_bps = float(nominal_bps)
        self.spec = spec or EstimatorSpec()
        self._max: deque[tuple[float, float]] = deque()  # (t_s, backlogged goodput sample)
        self._value = float(nominal_bps)
        self._last_t: float | None = None
        self._retrans: tuple[float, float] | None = None
        self._min_rtt_ms = math.inf  # the kernel's (lifetime) min RTT
        self._rtts: deque[tuple[float, float]] = deque()  # (t_s, polled RTT) for the windowed floor
        self.estimate = Estimate(0.0, self._value, False, 0.0, 0.0, False)

    def update(self, t_s: float, goodput_bps: float, backlog_bytes: float, rtt_ms: float = 0.0, min_rtt_ms: float = 0.0,
               retransmits: float | None = None) -> Estimate:
        s = self.spec
        dt = 0.0 if self._last_t is None else max(t_s - self._last_t, 0.0)
        self._last_t = t_s
        if min_rtt_ms > 0:
            self._min_rtt_ms = min(self._min_rtt_ms, min_rtt_ms)
        if rtt_ms > 0:
            while self._rtts and self._rtts[-1][1] >= rtt_ms:  # monotone deque: the window's minimum first
                self._rtts.pop()
            self._rtts.append((t_s, rtt_ms))
            while self._rtts[0][0] < t_s - s.rtt_window_s:
                self._rtts.popleft()
        kernel = self._min_rtt_ms if math.isfinite(self._min_rtt_ms) else 0.0
        floor = max(kernel, self._rtts[0][1]) if self._rtts else kernel
        qdelay = max(rtt_ms - floor, 0.0) if rtt_ms > 0 and floor > 0 else 0.0
        rate = 0.0
        if retransmits is not None:
            if self._retrans is not None and t_s > self._retrans[0]:
                inc = retransmits - self._retrans[1] if retransmits >= self._retrans[1] else retransmits
                rate = inc / (t_s - self._retrans[0])
            self._retrans = (t_s, retransmits)
        backlogged = backlog_bytes > s.min_backlog_bytes
        queue = s.queue_delay_ms > 0 and qdelay >= max(s.queue_delay_ms, s.queue_delay_fraction * floor)
        x = min(max(goodput_bps, 0.0), self.nominal_bps)
        if backlogged and x <= 0:  # work queued but no rate measured yet: no information
            backlogged = False
        if backlogged:
            if queue:
                self._max.clear()  # saturated now: what we get now is what is available
            self._max.append((t_s, x))
            while self._max and self._max[0][0] < t_s - s.window_s:
                self._max.popleft()
            self._value = max(v for _, v in self._max)
        else:
            self._max.clear()
            a = 1.0 - math.exp(-dt / s.probe_tau_s) if dt > 0 else 0.0
            self._value = max(self._value + a * (self.nominal_bps - self._value), x)
        self.estimate = Estimate(t_s, self._value, backlogged, qdelay, rate, backlogged and queue)
        return self.estimate
