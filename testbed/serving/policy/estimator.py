"""Available KV bandwidth from what the PrfaaS senders observe (docs/router.md, "The bandwidth estimator").

Inputs per poll of the PrfaaS workers (summed over them): the path rate of the senders that have work
(TCP_INFO `delivery_rate` summed over their connections; `KVSender.congestion()["path_rate_bps"]`), the
senders' backlog (bytes queued and not yet sent plus bytes in flight), RTT and min RTT, cumulative
retransmits. No emulator figure enters.

Every poll is one of three kinds of evidence, and the estimate moves only as its evidence allows:

- **saturated** (backlogged senders and a standing queue, RTT - floor >= `queue_delay_ms`): the path
  gives the senders no more than they get now, so the estimate *is* the current sample (an upper and a
  lower bound at once). A dip shows within the poll after the queue fills.
- **headroom** (backlogged senders, no standing queue): the senders got `x` without queueing, so the path
  has at least `x` and possibly more. The estimate is at least `x` and grows by a factor e per
  `probe_tau_s` of such polls, up to the nominal line rate: evidence of headroom, not the passing of
  time, is what raises it, and multiplicatively (one poll after a 5x dip adds 10%, not half the gap).
- **none** (nothing backlogged: between transfers, or KV streamed at the prefill's pace below one
  window): the estimate is **held**. Its age (`age_s`, seconds since the last saturated poll) says how
  old the last upper bound is; it never drifts back to the nominal rate on its own (the first version
  relaxed towards it with a 5 s time constant and was 47-50% off between transfers in a dip).

The RTT floor is the larger of the kernel's min RTT and the minimum RTT polled over `rtt_window_s` (once
the polls span that window): a lasting change of the path's delay (a reroute) stops counting as queueing
after that window. Loss is
reported (retransmits per second) but counts as congestion only together with a queue: random loss on
an unqueued path is not a reason to keep work local.

Units are whatever the caller uses consistently (the router feeds emulated bit/s and bytes).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class EstimatorSpec:
    queue_delay_ms: float = 2.0  # RTT - floor at or above this is a standing queue (0 disables)
    queue_delay_fraction: float = 0.25  # ... or this fraction of the floor, whichever is larger
    probe_tau_s: float = 5.0  # headroom polls grow the estimate by e per this much of their time (up to nominal)
    rtt_window_s: float = 10.0  # the RTT floor forgets samples older than this
    min_backlog_bytes: float = 0.0  # backlog above this counts as backlogged


SATURATED, HEADROOM, NONE = "saturated", "headroom", "none"


@dataclass(frozen=True)
class Estimate:
    t_s: float
    available_bps: float
    backlogged: bool
    queue_delay_ms: float
    retransmits_per_s: float
    congested: bool  # standing queue while backlogged
    evidence: str = NONE  # what this poll said: SATURATED, HEADROOM or NONE (the estimate held)
    age_s: float = math.inf  # seconds since the last saturated poll (inf: never measured from above)
    sample_bps: float = 0.0  # this poll's input rate (logged, so recorded runs can be replayed)
    rtt_ms: float = 0.0
    rtt_floor_ms: float = 0.0


class BandwidthEstimator:
    """Feed `update` with each poll's sums; read `estimate` (the latest `Estimate`)."""

    def __init__(self, nominal_bps: float, spec: EstimatorSpec | None = None) -> None:
        if nominal_bps <= 0:
            raise ValueError(f"nominal_bps {nominal_bps!r} must be > 0 (the line rate from the scenario)")
        self.nominal_bps = float(nominal_bps)
        self.spec = spec or EstimatorSpec()
        self._value = float(nominal_bps)
        self._last_t: float | None = None
        self._saturated_t: float | None = None
        self._retrans: tuple[float, float] | None = None
        self._min_rtt_ms = math.inf  # the kernel's (lifetime) min RTT
        self._rtts: deque[tuple[float, float]] = deque()  # (t_s, polled RTT) for the windowed floor
        self._first_rtt_t: float | None = None
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
            self._first_rtt_t = t_s if self._first_rtt_t is None else self._first_rtt_t
        kernel = self._min_rtt_ms if math.isfinite(self._min_rtt_ms) else 0.0
        # the polled minimum replaces the kernel's only once it covers a whole window: a queue that already
        # stands at the first poll is still a queue
        full = self._first_rtt_t is not None and t_s - self._first_rtt_t >= s.rtt_window_s
        floor = max(kernel, self._rtts[0][1]) if self._rtts and full else kernel
        qdelay = max(rtt_ms - floor, 0.0) if rtt_ms > 0 and floor > 0 else 0.0
        rate = 0.0
        if retransmits is not None:
            if self._retrans is not None and t_s > self._retrans[0]:
                inc = retransmits - self._retrans[1] if retransmits >= self._retrans[1] else retransmits
                rate = inc / (t_s - self._retrans[0])
            self._retrans = (t_s, retransmits)
        queue = s.queue_delay_ms > 0 and qdelay >= max(s.queue_delay_ms, s.queue_delay_fraction * floor)
        x = min(max(goodput_bps, 0.0), self.nominal_bps)
        backlogged = backlog_bytes > s.min_backlog_bytes and x > 0  # work queued but no rate measured yet: no information
        if backlogged and queue:
            evidence, self._value, self._saturated_t = SATURATED, x, t_s
        elif backlogged:
            evidence = HEADROOM
            grown = self._value * math.exp(dt / s.probe_tau_s) if dt > 0 else self._value
            self._value = min(max(grown, x), self.nominal_bps)
        else:
            evidence = NONE
        age = t_s - self._saturated_t if self._saturated_t is not None else math.inf
        self.estimate = Estimate(t_s, self._value, backlogged, qdelay, rate, evidence == SATURATED, evidence, age, x,
                                 rtt_ms, floor)
        return self.estimate
