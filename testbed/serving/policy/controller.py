"""The PrfaaS controller: short-term control of the threshold t from measurements.

It owns what the law knows (utilisation EWMA, non-KV traffic, congestion event rates, queues, the
S_kv(l) fit and the window of recent arrivals) and the law itself (`step`). It does not route: the
`prfaas` policy asks it for t on every decision and feeds it every `TelemetrySample`. Not thread-safe
on its own: the policy's lock serialises calls. The law and its constants: docs/router.md.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Callable

from testbed.serving.policy.base import TelemetrySample
from testbed.serving.policy.estimator import BandwidthEstimator, Estimate
from testbed.serving.policy.latency import PrefillTimes
from testbed.serving.policy.linefit import LineFit
from testbed.serving.policy.log import SchedulerLog
from testbed.serving.policy.signals import admit
from testbed.serving.policy.spec import PolicySpec


STALE_WINDOWS = 6  # arrivals older than this many windows never inform the demand model


class PrfaasController:
    """Measurements in (`observe`, `note_arrival`), changes of t out (`step`, logged)."""

    def __init__(self, spec: PolicySpec, log: SchedulerLog, capacity_bps: float,
                 prefill_times: PrefillTimes | None = None, compressed_kv_ratio: float = 0.5) -> None:
        c = spec.control
        self.spec, self.log, self.capacity_bps = spec, log, capacity_bps
        self.mode = spec.signals
        self.nominal_bps = capacity_bps  # the scenario's line rate (provisioned): known in every mode
        e = spec.estimator
        self.estimator = BandwidthEstimator(capacity_bps, e) if self.mode == "observed" and capacity_bps > 0 else None
        self._committed_bytes = 0.0  # KV the PrfaaS senders hold: queued, not yet sent, and in flight
        self._prefill_s: float | None = None  # EWMA of the PrfaaS prefill time (s), from finished offloads
        self.t = self.t_base = float(spec.threshold_tokens)
        self.window_s = c.window_s
        self._u_ewma = 0.0
        self._u_last_t: float | None = None
        self._egress_bps = 0.0
        self._link_down = False  # oracle: the latest WAN sample said capacity 0 (A is 0 until one says otherwise)
        self._backlog_bytes = 0.0
        self._event_rates: dict[str, float] = {}  # EWMA per second of WAN drops and of TCP retransmits
        self._counters: dict[str, tuple[float, float]] = {}  # name -> (t_s, last cumulative value)
        self._queues = {"prfaas": 0.0, "pdp": 0.0, "decode": 0.0}
        self._pdp_slow: float | None = None  # EWMA of the PD-P queue (tau slow_tau): the cap's load estimate
        self._pdp_instances = 0  # active PD-P prefill instances (the router's count)
        self.prefill_times = prefill_times if prefill_times is not None else PrefillTimes()  # PD-P's cost per prefill
        self._kv_goodput: tuple[float, float] | None = None  # (t_s, KV goodput of the PrfaaS senders, bps)
        self._non_kv_bps = 0.0  # EWMA of egress - KV goodput: traffic on the line that is not our KV
        self._slow_last: dict[str, float] = {}
        self._arrivals: deque[tuple[float, int, int]] = deque()  # (t_s, uncached w.r.t. PrfaaS, PD-P tokens or 0)
        self._fit = LineFit()  # S_kv(l): emulated KV bytes against uncached length, of finished offloads
        self._fit_compressed = LineFit()  # the same, of offloads whose full-attention KV crossed in float8
        self.compressed_kv_ratio = compressed_kv_ratio  # float8 / the model's KV dtype, bytes per element
        self.compressing = False  # `kv_compression: adaptive`: new offloads send float8 (docs/router.md)
        self._last_raise = -math.inf
        self._last_change = -math.inf
        self._calm_since: float | None = None

    # -- measurements
    @property
    def egress_utilization(self) -> float:
        return self._u_ewma

    @property
    def queues(self) -> dict[str, float]:
        """Requests in flight per active instance: ``prfaas``, ``pdp``, ``decode`` (latest samples)."""
        return self._queues

    def bandwidth_scarce(self) -> bool:
        return self._u_ewma >= self.spec.abundant_below or self.t > self.t_base

    @property
    def congestion_events_per_s(self) -> float:
        return sum(self._event_rates.values())

    @property
    def non_kv_bps(self) -> float:
        """Traffic on the PrfaaS -> PD line that is not KV (cross traffic): EWMA of egress - KV goodput."""
        return self._non_kv_bps

    @property
    def kv_capacity_bps(self) -> float:
        """A: the bandwidth left for KV. Oracle: the shaper's rate minus the non-KV traffic measured on
        the bottleneck (0 while the link is down); observed: the estimator's; provisioned: the nominal
        line rate."""
        if self.mode == "oracle":
            return 0.0 if self._link_down else max(self.capacity_bps - self._non_kv_bps, 0.0)
        if self.estimator is not None:
            return self.estimator.estimate.available_bps
        return self.nominal_bps

    @property
    def estimate(self) -> Estimate | None:
        return self.estimator.estimate if self.estimator is not None else None

    @property
    def committed_bytes(self) -> float:
        return self._committed_bytes

    def excess_committed_bits(self) -> float:
        """Committed KV that will not have drained by the time a new offload finishes its prefill:
        max(0, 8 x committed - A x prefill time). It delays every new offload whatever t becomes."""
        prefill_s = self._prefill_s if self._prefill_s is not None else self.spec.control.prefill_prior_s
        return max(0.0, 8.0 * self._committed_bytes - self.kv_capacity_bps * prefill_s)

    def _utilization(self, t_s: float, u: float) -> None:
        if self._u_last_t is None:
            self._u_ewma = u
        else:
            a = 1.0 - math.exp(-max(t_s - self._u_last_t, 0.0) / self.spec.control.utilization_tau_s)
            self._u_ewma += a * (u - self._u_ewma)
        self._u_last_t = t_s

    def _slow(self, name: str, t_s: float, old: float | None, x: float) -> float:
        """EWMA with time constant `slow_tau`, per signal."""
        last = self._slow_last.get(name)
        self._slow_last[name] = t_s
        if old is None or last is None:
            return x
        return old + (1.0 - math.exp(-max(t_s - last, 0.0) / self.spec.control.slow_tau_s)) * (x - old)

    def note_arrival(self, now_s: float, uncached_prfaas: int, local_len: int) -> None:
        self._arrivals.append((now_s, uncached_prfaas, local_len))
        keep = self.spec.control.min_samples  # at low rates the window keeps the last min_samples arrivals
        while self._arrivals and (self._arrivals[0][0] < now_s - STALE_WINDOWS * self.window_s
                                  or (self._arrivals[0][0] < now_s - self.window_s and len(self._arrivals) > keep)):
            self._arrivals.popleft()

    def _rate(self, name: str, t_s: float, value: float) -> float | None:
        """Per-second increase of a cumulative counter (a decrease counts as a reset)."""
        prev = self._counters.get(name)
        self._counters[name] = (t_s, value)
        if prev is None or t_s <= prev[0]:
            return None
        inc = value - prev[1] if value >= prev[1] else value
        return inc / (t_s - prev[0])

    def observe(self, sample: TelemetrySample) -> None:
        """One measurement (any `TelemetrySample`; fields it lacks leave the state alone). Fields the
        mode may not see are dropped here too (`signals.admit`), whatever the caller passed."""
        s = admit(sample, self.mode)
        if s is None:
            return
        link_down = s.capacity_bps is not None and s.capacity_bps <= 0
        if s.capacity_bps is not None:
            self._link_down = link_down
        if s.capacity_bps and s.capacity_bps > 0:
            self.capacity_bps = s.capacity_bps
        if link_down or (s.egress_bps is not None and self.capacity_bps > 0):
            self._egress_bps = s.egress_bps or 0.0
            self._utilization(s.t_s, 1.5 if link_down else min(self._egress_bps / self.capacity_bps, 1.5))  # a down link is saturated
            if self._kv_goodput is not None and s.t_s - self._kv_goodput[0] <= 2.0 and not link_down:
                x = max(self._egress_bps - self._kv_goodput[1], 0.0)
                self._non_kv_bps = self._slow("non_kv", s.t_s, self._non_kv_bps, x)
        if s.send_queue_bytes is not None or s.inflight_bytes is not None:
            self._committed_bytes = (s.send_queue_bytes or 0.0) + (s.inflight_bytes or 0.0)
        if s.kv_goodput_bps is not None and self.mode != "oracle":
            if self.estimator is not None:  # the path's rate: KV is streamed as prefill makes it, goodput measures that
                sample = s.kv_path_rate_bps if s.kv_path_rate_bps is not None else s.kv_goodput_bps
                self.estimator.update(s.t_s, sample, self._committed_bytes, s.rtt_ms or 0.0,
                                      s.min_rtt_ms or 0.0, s.retransmits)
            a = self.kv_capacity_bps
            self._utilization(s.t_s, min(s.kv_goodput_bps / a, 1.5) if a > 0 else 1.5)
        if s.probe_rate_bps is not None and self.estimator is not None:
            self.estimator.probe(s.t_s, s.probe_bytes or 0.0, s.probe_rate_bps, s.probe_rtt_ms or 0.0, s.idle_rtt_ms,
                                 s.min_rtt_ms or 0.0)
        if s.prefill_s is not None:
            self._prefill_s = self._slow("prefill", s.t_s, self._prefill_s, s.prefill_s)
        if s.kv_goodput_bps is not None:
            self._kv_goodput = (s.t_s, s.kv_goodput_bps)
        if s.backlog_bytes is not None:
            self._backlog_bytes = s.backlog_bytes
        for name in ("drops", "retransmits"):  # WAN samples and worker polls arrive separately
            v = getattr(s, name)
            r = self._rate(name, s.t_s, v) if v is not None else None
            if r is not None:
                self._event_rates[name] = 0.5 * self._event_rates.get(name, 0.0) + 0.5 * r
        for key, attr in (("prfaas", "prfaas_queue_per_instance"), ("pdp", "pdp_queue_per_instance"),
                          ("decode", "decode_queue_per_instance")):
            v = getattr(s, attr)
            if v is not None:
                self._queues[key] = v
        if s.pdp_instances is not None:
            self._pdp_instances = s.pdp_instances
        if s.pdp_queue_per_instance is not None:
            self._pdp_slow = self._slow("pdp", s.t_s, self._pdp_slow, s.pdp_queue_per_instance)
        if s.transfer_uncached_len is not None and s.transfer_kv_bytes is not None:
            fit = self._fit_compressed if s.transfer_compressed else self._fit
            fit.add(float(s.transfer_uncached_len), float(s.transfer_kv_bytes))

    def compresses(self) -> bool:
        """Do new offloads send their full-attention KV in float8 (`policy.kv_compression`)?"""
        mode = self.spec.kv_compression
        return mode == "fp8" or (mode == "adaptive" and self.compressing)

    def kv_bytes_model(self, compressed: bool | None = None) -> Callable[[float], float] | None:
        """S_kv(l) in emulated bytes of what new offloads send (`compressed`: float8; None: as `compresses`):
        least squares over finished offloads of that kind, else the spec's prior. A float8 size never
        measured yet is the model-dtype line with its per-token slope times `compressed_kv_ratio` (float8
        shrinks the full-attention KV, which grows with the tokens; the fixed linear state crosses as it is;
        for a model with sliding-window layers below their window this shrinks a little too much, since
        window positions also grow per token and stay in the model's dtype, until float8 transfers are fitted)."""
        if compressed is None:
            compressed = self.compresses()
        prior = ((float(self.spec.kv_state_bytes), float(self.spec.kv_bytes_per_token))
                 if self.spec.kv_bytes_per_token or self.spec.kv_state_bytes else None)
        if not compressed:
            model = self._fit.model()
            if model is not None:
                return model
            return None if prior is None else (lambda l: prior[0] + prior[1] * l)
        line = self._fit_compressed.line()
        if line is not None:
            a, b = line
            return lambda l: max(a + b * l, 0.0)
        line = self._fit.line() or prior
        if line is not None:
            a, b = line
            r = self.compressed_kv_ratio
            return lambda l: max(a + r * b * l, 0.0)
        # one float8 transfer (proportional), else the model dtype's own model unshrunk: an overestimate (the
        # law raises a little more than needed) rather than none (blind x1.5 steps the moment it compressed)
        return self._fit_compressed.model() or self._fit.model()

    def _recent(self, now_s: float) -> tuple[list[tuple[float, int, int]], float]:
        """The arrivals in the window (t_s, uncached length w.r.t. PrfaaS, PD-P tokens or 0), and the time
        they span. When the window holds fewer than `min_samples`, the last `min_samples` arrivals (up to
        STALE_WINDOWS windows old): at 1 req/s a 10 s window holds ~10, and a model that appears and
        vanishes with each arrival made the law alternate between the fit and blind x1.5 steps."""
        recent = [a for a in self._arrivals if a[0] >= now_s - self.window_s]
        if len(recent) < self.spec.control.min_samples:
            recent = list(self._arrivals)[-self.spec.control.min_samples:]
        span = max(now_s - recent[0][0], 1.0) if recent else 1.0
        return recent, span

    def _recent_lengths(self, now_s: float) -> tuple[list[int], float]:
        recent, span = self._recent(now_s)
        return [l for _, l, _ in recent], span

    def predicted_demand_bps(self, t: float, now_s: float, compressed: bool | None = None) -> float | None:
        """KV egress the recent arrivals would need at threshold t (emulated bit/s), or None if unknown;
        `compressed` as `kv_bytes_model`."""
        size = self.kv_bytes_model(compressed)
        arr, span = self._recent_lengths(now_s)
        if size is None or len(arr) < self.spec.control.min_samples:
            return None
        return sum(size(l) for l in arr if l > t) * 8.0 / span

    def fit_threshold(self, target_bps: float, now_s: float) -> float | None:
        """The re-search of t: the smallest t whose predicted egress demand fits `target_bps`."""
        size = self.kv_bytes_model()
        arr, span = self._recent_lengths(now_s)
        arr.sort()
        if size is None or len(arr) < self.spec.control.min_samples:
            return None
        demand = sum(size(l) for l in arr) * 8.0 / span
        if demand <= target_bps:
            return 0.0
        for l in arr:  # raising t to l keeps every request of length <= l local
            demand -= size(l) * 8.0 / span
            if demand <= target_bps:
                return float(l)
        return float(arr[-1])

    def pdp_cap(self, now_s: float) -> float:
        """The largest t a raise may set without PD-P's load exceeding `pdp_queue_max` (predicted).

        A raise keeps the arrivals with t < l <= t' local. PD-P's load after it is predicted from offered
        work against service (docs/router.md, "The PD-P cap"): the load now, the larger of the measured
        queue (slow EWMA, or half the latest sample) and the window's PD-P work / (span x instances), plus
        the work the raise adds, each moved arrival costing what a PD-P prefill of its length costs
        (`PrefillTimes.service_model`, a line fitted to PD-P's finished prefills). Until that cost is known,
        the older rule that scales the measured queue by the tokens moved (`_pdp_cap_by_tokens`). With the
        measured queue at `pdp_queue_max` already, or fewer than `min_samples` arrivals, as before: no
        raise, and only the measured queue limits.
        """
        c, hi = self.spec.control, float(self.spec.max_threshold_tokens)
        if self._pdp_slow is None:  # PD-P never measured (no PD-P pool): nothing to protect
            return hi
        q = max(self._pdp_slow, self._queues["pdp"] * 0.5)  # per instance
        if q >= c.pdp_queue_max:
            return self.t
        arrivals, span = self._recent(now_s)
        if len(arrivals) < c.min_samples:
            return hi
        cost = self.prefill_times.service_model("pd")
        if cost is None or self._pdp_instances <= 0:
            return self._pdp_cap_by_tokens(now_s, max(q, 0.1), [l for _, l, _ in arrivals])
        per = 1.0 / (span * self._pdp_instances)  # a second of PD-P work in the window, per instance
        # PD-P's load at the current t: every arrival t keeps local now, including those an earlier t
        # offloaded (right after a raise the queue shows none of them yet)
        offered = per * sum(cost(lp if lp > 0 else l) for _, l, lp in arrivals if lp > 0 or l <= self.t)
        load = max(q, offered)
        if load >= c.pdp_queue_max:
            return self.t
        moved = [l for _, l, lp in arrivals if l > self.t and lp == 0]  # offloaded now
        return self._largest_raise(moved, load, c.pdp_queue_max, lambda l: per * cost(l))

    def _pdp_cap_by_tokens(self, now_s: float, q: float, arr: list[int]) -> float:
        """The cap before PD-P's cost is measured: q(t') = q x W(t') / W_pd, W(x) = the window's lengths <= x,
        W_pd = the tokens the window's arrivals sent to PD-P (q is at least 0.1: a floor for an idle pool)."""
        w_pd = sum(lp for ts, _, lp in self._arrivals if ts >= now_s - self.window_s)
        budget = self.spec.control.pdp_queue_max / q * max(w_pd, float(min(arr)))  # W(t') allowed
        w = float(sum(l for l in arr if l <= self.t))
        if w > budget:
            return self.t
        return self._largest_raise([l for l in arr if l > self.t], w, budget, float)

    def _largest_raise(self, moved: list[int], used: float, limit: float, cost: Callable[[float], float]) -> float:
        """The largest length in `moved` a raise may set with `used` plus the cost of every arrival up to and
        including that length within `limit` (a raise to l keeps every arrival of length <= l local, so all
        arrivals of one length count together); t when none fits, max_threshold when all do."""
        moved, cap = sorted(moved), self.t
        for i, l in enumerate(moved):
            used += cost(l)
            if used > limit:
                return cap
            if i + 1 == len(moved) or moved[i + 1] != l:
                cap = float(l)
        return float(self.spec.max_threshold_tokens)

    # -- control
    def signals(self, now_s: float) -> dict[str, Any]:
        c = self.spec.control
        demand = self.predicted_demand_bps(self.t, now_s)
        kv_cap = self.kv_capacity_bps
        ratio = (demand / kv_cap if kv_cap > 0 else math.inf) if demand is not None and self.capacity_bps > 0 else None
        excess = self.excess_committed_bits()
        return {
            "utilization": self._u_ewma,
            "excess_committed_bits": excess,
            "demand_ratio": ratio,  # predicted KV demand at t / the capacity left for KV
            "kv_capacity_bps": kv_cap,
            # a lone bulk transfer drops packets too (TCP probing a drop-tail queue): loss means congestion
            # only while the link is busy on average
            "congested": self.congestion_events_per_s >= c.congestion_events_per_s and self._u_ewma >= c.low_utilization,
            "prfaas_queue": self._queues["prfaas"],
            "pdp_queue": self._queues["pdp"],
            "pdp_queue_slow": self._pdp_slow or 0.0,
            "decode_queue": self._queues["decode"],
        }

    def step(self, now_s: float) -> dict[str, Any]:
        """One step of the control law (docs/router.md); returns the signals it used."""
        c, s = self.spec.control, self.signals(now_s)
        ratio = s["demand_ratio"]
        lo, hi = float(self.spec.min_threshold_tokens), float(self.spec.max_threshold_tokens)
        excess = s["excess_committed_bits"]
        # what new offloads may use: the target share of A, less what drains the committed excess
        # within drain_horizon (it delays every new offload whatever t becomes; a raise cannot undo it)
        target = max(c.target_utilization * s["kv_capacity_bps"] - excess / c.drain_horizon_s, 0.0)
        pressure = []
        if excess > 0:
            pressure.append(f"committed KV {excess / max(s['kv_capacity_bps'], 1.0):.1f}s beyond a prefill's time to drain")
        if s["utilization"] >= c.high_utilization:
            pressure.append(f"egress utilisation {s['utilization']:.2f} >= {c.high_utilization:g}")
        if ratio is not None and ratio >= c.high_utilization:
            pressure.append(f"predicted KV demand {ratio:.2f} x the {s['kv_capacity_bps'] / 1e9:.1f} Gbps left for KV")
        if s["congested"]:
            pressure.append(f"congestion {self.congestion_events_per_s:.0f} drops+retransmits/s")
        if s["prfaas_queue"] >= c.queue_high:
            pressure.append(f"PrfaaS queue {s['prfaas_queue']:.1f}/instance")
        pdp_overloaded = s["pdp_queue_slow"] >= 2.0 * c.pdp_queue_max and self.t > self.t_base
        if pdp_overloaded and now_s - self._last_change >= c.hold_s:
            # an earlier raise (or a burst) overloaded PD-P: give back the raise step by step; short
            # requests' TTFT is what PD-P queues cost
            self._calm_since = None
            new = max(self.t_base, self.t / c.lower_factor)
            self._set_t(now_s, new, f"lower: PD-P queue {s['pdp_queue_slow']:.1f}/instance >= {2.0 * c.pdp_queue_max:g}")
            return s
        if pressure:
            self._calm_since = None
            if self.spec.kv_compression == "adaptive" and not self.compressing:
                # the cheaper response first: float8 shrinks every new offload's KV at once, and the raise
                # below is then fitted to the smaller sizes (docs/router.md, "Adaptive KV precision")
                self._set_compressing(now_s, True, "compress: " + "; ".join(pressure))
            since = now_s - self._last_raise
            fit = self.fit_threshold(target, now_s)
            cap = s["pdp_cap"] = self.pdp_cap(now_s)
            if fit is not None:  # the re-search: straight to the t whose demand fits, re-fitted every settle s
                if fit <= self.t or since < c.settle_s:
                    return s
                new, how = fit, "to the t whose predicted KV demand fits"
            elif since >= c.raise_interval_s and (excess > 0 or s["prfaas_queue"] >= c.queue_high):
                # no demand model yet: blind steps, only on the harm a raise relieves (committed KV that
                # will not drain within a new offload's prefill, or a PrfaaS queue); a busy, full or lossy
                # line alone delays no offload, and one offload's burst makes all three on a thin line
                # (val-thin-line: x1.5 steps on them took t to all-local within 5 s of the start)
                new, how = max(self.t, 512.0) * c.raise_factor, f"x{c.raise_factor:g}"
            else:
                return s
            new = min(hi, new)
            if new > cap:
                new, how = cap, how + f", capped at {cap:.0f} by the PD-P queue ({s['pdp_queue_slow']:.2f}/instance)"
            if new > self.t:
                self._set_t(now_s, new, f"raise {how}: " + "; ".join(pressure))
                self._last_raise = now_s
            return s
        calm = excess <= 0 and s["utilization"] <= c.low_utilization and s["prfaas_queue"] <= c.queue_low and (ratio is None or ratio <= c.low_utilization)
        if not calm:
            self._calm_since = None
            return s
        if self._calm_since is None:
            self._calm_since = now_s
        if now_s - self._calm_since < c.hold_s or now_s - self._last_change < c.hold_s:
            return s
        if self.compressing and self.t <= self.t_base:
            # the raise given back first (it costs short requests their TTFT); then the model's dtype again,
            # once its own predicted demand is calm too (the hysteresis: on at pressure, off below low_utilization)
            full = self.predicted_demand_bps(self.t, now_s, compressed=False)
            kv_cap = s["kv_capacity_bps"]
            if full is None or (kv_cap > 0 and full / kv_cap <= c.low_utilization):
                ratio_txt = "unknown" if full is None else f"{full / kv_cap:.2f}"
                self._set_compressing(now_s, False, f"uncompress: calm for {c.hold_s:g}s, predicted KV demand in the model's "
                                                    f"dtype {ratio_txt} x the capacity left for KV")
                return s
        pdp_surge = s["pdp_queue"] >= c.queue_high
        floor = lo if pdp_surge else self.t_base
        if self.t > floor:
            fit = self.fit_threshold(target, now_s) or 0.0
            pdp_loaded = s["pdp_queue_slow"] >= c.pdp_queue_max  # the raise costs PD-P now: give it all back
            new = max(floor, fit if pdp_loaded else self.t / c.lower_factor, fit)
            if new < self.t:
                why = (f"PD-P queue {s['pdp_queue']:.1f}/instance with WAN calm" if pdp_surge
                       else f"calm for {c.hold_s:g}s" + (f", PD-P queue {s['pdp_queue_slow']:.2f}/instance" if pdp_loaded else ""))
                self._set_t(now_s, new, f"lower: {why} (utilisation {s['utilization']:.2f})")
        elif self.t < self.t_base and s["pdp_queue"] <= c.queue_low:
            self._set_t(now_s, min(self.t_base, self.t * c.lower_factor), "restore towards base: PD-P queue calm")
        return s

    def _set_compressing(self, now_s: float, on: bool, reason: str) -> None:
        self.compressing = on
        self.log.add("kv_compression", now_s, compress_kv=on, threshold=self.t, egress_utilization=self._u_ewma, reason=reason)

    def _set_t(self, now_s: float, new: float, reason: str) -> None:
        old, self.t = self.t, float(new)
        self._last_change = now_s
        self.log.add("threshold", now_s, threshold=self.t, old_threshold=old,
                     egress_utilization=self._u_ewma, bandwidth_scarce=self.bandwidth_scarce(), reason=reason)
