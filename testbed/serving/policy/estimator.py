"""Available KV bandwidth from what the PrfaaS senders observe (docs/router.md, "The bandwidth estimator").

Inputs per poll of the PrfaaS workers (summed over them): the path rate of the senders that have work
(TCP_INFO `delivery_rate` summed over their connections; `KVSender.congestion()["path_rate_bps"]`), the
senders' backlog (bytes queued and not yet sent plus bytes in flight), RTT and min RTT, cumulative
retransmits. No emulator figure enters.

Every poll is one of three kinds of evidence, and the estimate moves only as its evidence allows:

- **saturated** (backlogged senders and a standing queue, RTT - floor >= `queue_delay_ms`): the path
  gives the senders no more than they get now, so the estimate *is* the current sample (an upper and a
  lower bound at once); the median of the last three such samples within `saturated_window_s` (of two,
  their mean), because the summed delivery rate of one poll is noisy (val-dip: 0.03-35 Gbps polled
  against 2-6 true); a lone one lowers the estimate at most to half (`lone_drop_fraction`). A dip
  shows within two polls after the queue fills.
- **headroom** (backlogged senders, no standing queue): the senders got `x` without queueing, so the path
  has at least `x` and possibly more. The estimate is at least `x` and grows by a factor e per
  `probe_tau_s` of such polls, up to the nominal line rate: evidence of headroom, not the passing of
  time, is what raises it, and multiplicatively (one poll after a 5x dip adds 10%, not half the gap).
- **none** (nothing backlogged: between transfers, or work queued with no rate measured yet): the
  estimate is **held**. (KV streamed at its prefill's pace is backlogged, a few MB at a time, and so
  counts as headroom: a lower bound that also grows the estimate; docs/router-measurements.md, "Why a 5x dip is
  found late".) Its age (`age_s`, seconds since the last saturated poll) says how
  old the last upper bound is; it never drifts back to the nominal rate on its own (the first version
  relaxed towards it with a 5 s time constant and was 47-50% off between transfers in a dip).

- **probe** (`probe`: an active probe of our own bytes while no KV moves, paced at `probe_pace_bps`,
  docs/router.md "An active probe"): its pings (one-byte transfers while nothing of ours is queued) give the path's **unloaded RTT**,
  and its bulk transfer a delivery rate. A probe that carried at least `full_path_ratio` times what a
  window-limited flow at the rate it got would carry (bytes >= ratio x rate x unloaded RTT) and built a
  standing queue, filled the path: the estimate *is* its rate (like a saturated poll), and later headroom
  polls grow the estimate no higher than that rate for `rtt_window_s`. A smaller probe, or one under which
  no queue stood (loss, or a window left small by a dip, held it back), is a lower bound (headroom, no
  growth).

The RTT floor is the largest of the kernel's min RTT, the minimum RTT polled over `rtt_window_s` (once
the polls span that window; only polls whose backlog is too small to build a standing queue of its own
count) and the smaller unloaded RTT of the last two probes (while the latest is within `rtt_window_s`;
one probe alone sets nothing): a lasting change of the path's delay (a reroute, an RTT surge) stops
counting as queueing at the second probe after it, or after that window without probes. Loss is
reported (retransmits per second) but counts as congestion only together with a queue: random loss on
an unqueued path is not a reason to keep work local.

Units are whatever the caller uses consistently (the router feeds emulated bit/s and bytes).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from testbed.kv.transport import STANDING_QUEUE_FRACTION, STANDING_QUEUE_MS, FillStop, is_standing_queue


@dataclass(frozen=True)
class EstimatorSpec:
    queue_delay_ms: float = STANDING_QUEUE_MS  # RTT - floor at or above this is a standing queue (0: none ever, no probe fills)
    queue_delay_fraction: float = STANDING_QUEUE_FRACTION  # ... or this fraction of the floor, whichever is larger
    probe_tau_s: float = 5.0  # headroom polls grow the estimate by e per this much of their time (up to nominal)
    rtt_window_s: float = 10.0  # the RTT floor forgets samples older than this
    rtt_window_polls: int = 2  # ... and counts the polled minimum only over at least this many clean polls (1 until 2026-12-04)
    min_backlog_bytes: float = 0.0  # backlog above this counts as backlogged
    saturated_window_s: float = 2.0  # a saturated poll sets the estimate to the median of the last 3 within this
    probe_after_s: float = 1.0  # the router probes after this long without KV evidence and nothing committed (0: never)
    probe_bdp: float = 5.0  # a probe's size: this many bandwidth-delay products at the probe's rate and the path's RTT (> 0, <= 1000)
    probe_headroom: float = 2.0  # ... the probe's rate: this multiple of the estimate, at most nominal (1 until 2026-12-04; 1-100)
    probe_max_bytes: float = 2e9  # ... at most this many (emulated) bytes (1 B to protocol.PROBE_MAX_BYTES, 2**32 - 1)
    probe_dip_fraction: float = 1.0  # a lone filled probe lowers the estimate only below this fraction of it (0.5 until 2026-12-04)
    full_path_ratio: float = 3.0  # a probe of >= ratio x rate x RTT bytes (slow start ~2) over a queue filled the path (> 0, <= 1000)
    lone_drop_fraction: float = 0.5  # a lone saturated poll or filled probe lowers the estimate at most to this fraction
    probe_until_filled: bool = True  # a probe ends once it has filled the path (False: it sends its whole size; until 2026-12-04)
    probe_confirm: bool = True  # after a lone upper bound the router probes again at once (False: after probe_after)
    # a probe's connections are paced at probe_headroom x the estimate: None (auto), unless the KV congestion control
    # paces itself (BBR; since 2026-12-06, session 54); True, always (auto until then); False, never (until 2026-12-06)
    probe_paced: bool | None = None
    poll_confirm_s: float = 0.0  # after a lone saturated poll the router polls again this soon, once (0: at its next poll)

    def fill_rule(self) -> FillStop:
        """What a filled probe is (a standing queue under it, and `full_path_ratio` x its rate x the unloaded
        RTT delivered): `BandwidthEstimator.probe`'s judgement, a probe's early end and the probe benchmark's."""
        return FillStop(self.queue_delay_ms, self.queue_delay_fraction, self.full_path_ratio)

    def fill_stop(self) -> FillStop | None:
        """When a probe may end before its size: once it has filled the path as `BandwidthEstimator.probe`
        judges a filled probe (`probe_until_filled`); None, it sends every byte (off, or `queue_delay` 0:
        then no probe ever fills the path)."""
        if not self.probe_until_filled or self.queue_delay_ms <= 0:
            return None
        return self.fill_rule()


# Bounds of the probe's fields (`policy.estimator`; `probe_bdp: 1.0e+308`, `full_path_ratio: 1.0e+308`, `probe_headroom:
# 1e10` and `probe_max: 1e30B` were taken, 2026-12-07). A probe sends `probe_bdp` bandwidth-delay products at its rate,
# about that many round trips, and counts as filled after `full_path_ratio` of them; the router gives a probe 2 s
# (`ProbeRequest.timeout_s`), which 1000 round trips of even a 2-ms path fill: a larger count is a probe that always times
# out, or never fills.
MAX_PROBE_RTTS = 1000.0
# A probe is paced at `probe_headroom` x the estimate, not capped at the nominal rate: 100 x is past the nominal rate for
# any estimate above 1% of it, so more is no different, and at most 100 x 1000 Tbps (`units.MAX_RATE_BPS`) stays inside the
# kernel's 64-bit pacing rate. 1e10 x a 100-Gbps estimate (1e21 bit/s) was a struct.error in the worker's
# `KVSender.pace`, and 1e308 x any estimate an infinite pace that the worker refuses: every probe failed, unseen.
MAX_PROBE_HEADROOM = 100.0

SATURATED, HEADROOM, NONE = "saturated", "headroom", "none"
MAX_GROWTH_EXPONENT = 50.0  # e**50 times any estimate is past every nominal rate (then capped at the ceiling)


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
    backlog_bytes: float = 0.0  # this poll's backlog and the kernel's min RTT (inputs, logged for replay:
    min_rtt_ms: float = 0.0  # analysis/replay.py)


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
        self._clean_ts: deque[float] = deque()  # times of the clean polls in the window (`rtt_window_polls`)
        self._saturated: deque[tuple[float, float]] = deque(maxlen=3)  # the latest saturated polls' samples
        self._idle_rtts: deque[tuple[float, float]] = deque(maxlen=2)  # (t_s, unloaded RTT ms) of the latest probes
        self._full: tuple[float, float] | None = None  # (t_s, rate) of the latest probe that filled the path
        self.evidence_t: float | None = None  # time of the latest saturated or headroom poll or probe
        self.unconfirmed = False  # the latest upper bound was a lone one, held at `lone_drop_fraction` (`probe_confirm`)
        self.bound_t: float | None = None  # time of the latest upper bound (saturated poll or filled probe)
        self.estimate = Estimate(0.0, self._value, False, 0.0, 0.0, False)

    def _floor(self, t_s: float, rtt_ms: float, min_rtt_ms: float, clean: bool) -> float:
        """The RTT floor; `rtt_ms` joins the window only when `clean`: polled under a backlog too small to
        build a standing queue of its own (`_clean`)."""
        s = self.spec
        if min_rtt_ms > 0:
            self._min_rtt_ms = min(self._min_rtt_ms, min_rtt_ms)
        if rtt_ms > 0 and clean:
            while self._rtts and self._rtts[-1][1] >= rtt_ms:  # monotone deque: the window's minimum first
                self._rtts.pop()
            self._rtts.append((t_s, rtt_ms))
            self._clean_ts.append(t_s)
            self._first_rtt_t = t_s if self._first_rtt_t is None else self._first_rtt_t
        while self._rtts and self._rtts[0][0] < t_s - s.rtt_window_s:
            self._rtts.popleft()
        while self._clean_ts and self._clean_ts[0] < t_s - s.rtt_window_s:
            self._clean_ts.popleft()
        kernel = self._min_rtt_ms if math.isfinite(self._min_rtt_ms) else 0.0
        # the polled minimum replaces the kernel's only once it covers a whole window (a queue that already
        # stands at the first poll is still a queue), and only over `rtt_window_polls` clean polls: one alone
        # may carry a queue of someone else's (val-thin-line seed 3: a lone 19.2-ms poll, the kernel's minimum
        # 9.0, became the floor for 5 s and hid a 5x dip's queue for 3.3 s), as one probe alone sets nothing
        full = (self._first_rtt_t is not None and t_s - self._first_rtt_t >= s.rtt_window_s
                and len(self._clean_ts) >= s.rtt_window_polls)
        floor = max(kernel, self._rtts[0][1]) if self._rtts and full else kernel
        idle = self._unloaded_rtt_ms(t_s)
        return max(floor, idle) if idle else floor  # measured with nothing of ours queued: no queue of ours in it

    def _clean(self, backlog_bytes: float, min_rtt_ms: float) -> bool:
        """Whether a poll's RTT measures the path, not a queue of ours: its whole backlog, queued at the
        bottleneck at the estimated rate, would add less than a standing queue (`queue_delay_fraction` of
        the floor). Under a larger backlog every RTT may carry our own queue (val-thin-line: 3-5 GB committed
        through a 25-s dip; after 10 s its 12-ms queue became the floor, the polls turned to headroom and
        the estimate grew back to the nominal 10 Gbps while 0.7 were left); a paced stream's few MB, or
        the tail of a transfer, are clean on a fast path, so a lasting delay step is still learnt."""
        base_ms = self.estimate.rtt_floor_ms or (min(self._min_rtt_ms, min_rtt_ms or math.inf))
        if not math.isfinite(base_ms) or base_ms <= 0:
            return False
        return 8.0 * backlog_bytes <= self.spec.queue_delay_fraction * base_ms / 1000.0 * self._value

    def _unloaded_rtt_ms(self, t_s: float) -> float:
        """The smaller unloaded RTT of the last two probes while the latest is within `rtt_window` (0: none
        fresh, or only one probe so far): one probe that met a queue of someone else's, our own KV starting
        under it, or a busy host, does not raise the floor alone, also when the probe before it is older than
        the window (docs/router.md, "An active probe", *Unloaded RTT*)."""
        if len(self._idle_rtts) < 2 or t_s - self._idle_rtts[-1][0] > self.spec.rtt_window_s:
            return 0.0
        return min(r for _, r in self._idle_rtts)

    def _queue(self, rtt_ms: float, floor: float) -> tuple[float, bool]:
        s = self.spec
        qdelay = max(rtt_ms - floor, 0.0) if rtt_ms > 0 and floor > 0 else 0.0
        return qdelay, s.queue_delay_ms > 0 and is_standing_queue(qdelay, floor, s.queue_delay_ms, s.queue_delay_fraction)

    def _ceiling(self, t_s: float) -> float:
        """How far headroom polls may grow the estimate: the rate of a recent probe that filled the path,
        else the nominal rate."""
        if self._full is not None and t_s - self._full[0] <= self.spec.rtt_window_s:
            return min(self._full[1], self.nominal_bps)
        return self.nominal_bps

    def update(self, t_s: float, goodput_bps: float, backlog_bytes: float, rtt_ms: float = 0.0, min_rtt_ms: float = 0.0,
               retransmits: float | None = None) -> Estimate:
        s = self.spec
        dt = 0.0 if self._last_t is None else max(t_s - self._last_t, 0.0)
        self._last_t = t_s
        floor = self._floor(t_s, rtt_ms, min_rtt_ms, self._clean(backlog_bytes, min_rtt_ms))
        qdelay, queue = self._queue(rtt_ms, floor)
        rate = 0.0
        if retransmits is not None:
            if self._retrans is not None and t_s > self._retrans[0]:
                inc = retransmits - self._retrans[1] if retransmits >= self._retrans[1] else retransmits
                rate = inc / (t_s - self._retrans[0])
            self._retrans = (t_s, retransmits)
        x = min(max(goodput_bps, 0.0), self.nominal_bps)
        backlogged = backlog_bytes > s.min_backlog_bytes and x > 0  # work queued but no rate measured yet: no information
        if backlogged and queue:
            evidence, self._value, self._saturated_t = SATURATED, self._from_above(t_s, x), t_s
        elif backlogged:
            evidence, self.unconfirmed = HEADROOM, False
            # the exponent capped: the ceiling bounds the growth anyway, and a probe_tau of 1 us overflowed exp()
            grown = self._value * math.exp(min(dt / s.probe_tau_s, MAX_GROWTH_EXPONENT)) if dt > 0 else self._value
            grown = max(self._value, min(grown, self._ceiling(t_s)))
            self._value = min(max(grown, x), self.nominal_bps)
        else:
            evidence = NONE
        if evidence != NONE:
            self.evidence_t = t_s
        return self._publish(t_s, backlogged, qdelay, rate, evidence, x, rtt_ms, floor, backlog_bytes, min_rtt_ms)

    def probe(self, t_s: float, nbytes: float, rate_bps: float, rtt_ms: float, idle_rtt_ms: float | None = None,
              min_rtt_ms: float = 0.0) -> Estimate:
        """One active probe: `nbytes` sent while no KV moved, delivered at `rate_bps` (TCP's delivery rate of
        the connections that carried it), RTT `rtt_ms` at its end; `idle_rtt_ms` the round trip of its pings.
        Without a standing queue under it the path did not push back (loss, or a window still small after a
        dip's losses, limited TCP): a lower bound. Its retransmits therefore decide nothing (the router logs
        them)."""
        s = self.spec
        # the queue under it is judged on the floor known before it: its end RTT carries its own burst, and
        # its pings may have met the very queue it is to find (two probes in a dip would make that queue the
        # floor); its pings join the floor for the polls after it
        floor = self._floor(t_s, rtt_ms, min_rtt_ms, False)
        qdelay, _ = self._queue(rtt_ms, floor)
        if idle_rtt_ms is not None and idle_rtt_ms > 0:
            self._idle_rtts.append((t_s, idle_rtt_ms))
        x = min(max(rate_bps, 0.0), self.nominal_bps)
        retrans = self.estimate.retransmits_per_s
        if x <= 0 or nbytes <= 0:
            return self._publish(t_s, False, qdelay, retrans, NONE, x, rtt_ms, floor, 0.0, min_rtt_ms)
        # filled: the path pushed back. Its size against its rate says the rate is not slow start's alone, and
        # a standing queue under it says the window was not the limit either (a dip's losses leave windows
        # small: docs/router.md, "An active probe", *Read*)
        filled = s.fill_rule().filled(nbytes, x, rtt_ms, floor, idle_rtt_ms or floor)
        # a filled probe below the estimate is an upper bound (`_from_above`: a lone one lowers the estimate
        # at most to half) when below probe_dip_fraction of it (1: always; 0.5, a dip only, until 2026-12-04,
        # when its rate read the acknowledged bytes: docs/router.md, "Delivered, not acknowledged") or when it
        # confirms another upper bound of the last saturated_window_s; one at or above the estimate is the
        # estimate, and it caps the headroom polls' growth for rtt_window as well
        if filled and (x >= self._value or x < s.probe_dip_fraction * self._value or self._bounds(t_s)):
            if x < self._value:
                value = self._from_above(t_s, x)
            else:
                self._saturated.append((t_s, x))
                value, self.unconfirmed = x, False
            self._value, self._saturated_t, self._full = value, t_s, (t_s, x)
            evidence = SATURATED
        else:
            self._value, evidence, self.unconfirmed = max(self._value, x), HEADROOM, False
        self.evidence_t = t_s
        return self._publish(t_s, True, qdelay, retrans, evidence, x, rtt_ms, floor, 0.0, min_rtt_ms)

    def _from_above(self, t_s: float, x: float) -> float:
        """The estimate after an upper bound `x` (a saturated poll or a filled probe), from the upper bounds
        of the last `saturated_window_s` (at most three): three, their median; two, their mean; one alone may
        lower the estimate at most to `lone_drop_fraction` of it. One poll's summed delivery rate can be a
        slow-start or app-limited sample (case study, seed 1, before the dip: a lone 0.23 Gbps poll against
        81 true set the estimate to 0.23 and the law raised t to 62K, flooding PD-P); a real dip repeats at
        the next poll, and two low bounds move the estimate all the way."""
        self._saturated.append((t_s, x))
        self.bound_t = t_s
        recent = sorted(self._bounds(t_s))
        self.unconfirmed = False
        if len(recent) >= 3:
            return recent[len(recent) // 2]
        if len(recent) == 2:
            return (recent[0] + recent[1]) / 2.0
        held = self.spec.lone_drop_fraction * self._value
        self.unconfirmed = x < held  # the bound says less than the estimate may fall to: a second one settles it
        return max(x, min(self._value, held))

    def _bounds(self, t_s: float) -> list[float]:
        """The upper bounds (saturated polls, filled probes) of the last `saturated_window_s`, at most three."""
        return [v for t, v in self._saturated if t_s - t <= self.spec.saturated_window_s]

    def probe_bytes(self) -> float:
        """The next probe's size (emulated bytes): `probe_bdp` bandwidth-delay products at `probe_headroom`
        times the estimate (at most the nominal rate) and the path's RTT (the latest unloaded RTT, else the
        floor), at most `probe_max_bytes`. A burst reads at most about the rate it was sized for (slow start
        has not reached more when it ends), so a probe sized to the estimate can only confirm an estimate
        below the truth (docs/router.md, "An active probe", *Size*); at twice the estimate one probe undoes
        a lone halving."""
        s = self.spec
        rtt_ms = max(self.estimate.rtt_floor_ms, self._idle_rtts[-1][1] if self._idle_rtts else 0.0) or 10.0
        rate_bps = min(s.probe_headroom * self._value, self.nominal_bps)  # (the estimate never exceeds nominal)
        return min(s.probe_max_bytes, s.probe_bdp * rate_bps / 8.0 * rtt_ms / 1000.0)

    def probe_pace_bps(self) -> float:
        """The rate the next probe's connections are paced at (`probe_paced`; 0: unpaced): `probe_headroom` times
        the estimate, not capped at the nominal rate. Pacing spreads each round of the burst's slow start over
        its round trip, so a queue stands under the probe only where the path gives less than the probe sends.
        Unpaced on CUBIC, 9% of the probes counted as filled in steady periods had read less than half of what
        was left, still in slow start, with an RTT at their end inflated by their own bursts or a delayed ACK
        (docs/router.md, "An active probe", "A paced probe")."""
        return self.spec.probe_headroom * self._value if self.spec.probe_paced is not False else 0.0

    def _publish(self, t_s: float, backlogged: bool, qdelay: float, retrans: float, evidence: str, x: float,
                 rtt_ms: float, floor: float, backlog_bytes: float, min_rtt_ms: float) -> Estimate:
        age = t_s - self._saturated_t if self._saturated_t is not None else math.inf
        self.estimate = Estimate(t_s, self._value, backlogged, qdelay, retrans, evidence == SATURATED, evidence, age, x,
                                 rtt_ms, floor, backlog_bytes, min_rtt_ms)
        return self.estimate
