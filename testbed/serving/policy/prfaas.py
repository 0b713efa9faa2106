"""The `prfaas` policy: length routing with a threshold t that the `PrfaasController` moves, plus the
optional long-term role flips of PD hosts (docs/router.md)."""

from __future__ import annotations

import math
from typing import Any

from testbed import clock
from testbed.serving.policy.base import ClusterState, InstanceState, TelemetrySample
from testbed.serving.policy.baselines import ThresholdPolicy
from testbed.serving.policy.controller import PrfaasController
from testbed.serving.policy.latency import PrefillTimes


class PrfaasPolicy(ThresholdPolicy):
    """The PrfaaS scheduler: `ThresholdPolicy` plus short-term control of t and optional role flips."""

    name = "prfaas"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefill_times = PrefillTimes()  # both clusters' prefill cost: latency-aware offload and the PD-P cap
        self.controller = PrfaasController(self.spec, self.log, self.capacity_bps, self.prefill_times, self.compressed_kv_ratio)
        self._last_flip = clock.now_s()
        self._confirm_polled_t: float | None = None  # the lone bound a confirm poll was made for

    @property
    def threshold(self) -> float:
        return self.controller.t

    @property
    def egress_utilization(self) -> float:
        return self.controller.egress_utilization

    @property
    def congestion_events_per_s(self) -> float:
        return self.controller.congestion_events_per_s

    def bandwidth_scarce(self) -> bool:
        return self.controller.bandwidth_scarce()

    def compress_kv(self) -> bool:
        return self.controller.compresses()

    def status(self) -> dict[str, Any]:
        with self._lock:
            ctl = self.controller
            e = ctl.estimate
            return {"signals": self.spec.signals, "kv_available_bps": ctl.kv_capacity_bps,
                    "congestion_events_per_s": ctl.congestion_events_per_s, "bandwidth_scarce": float(ctl.bandwidth_scarce()),
                    "committed_bytes": ctl.committed_bytes, "queueing_delay_ms": e.queue_delay_ms if e else None,
                    "backlogged": e.backlogged if e else None, "estimate_evidence": e.evidence if e else None,
                    "estimate_age_s": e.age_s if e and math.isfinite(e.age_s) else None,
                    "estimate_sample_bps": e.sample_bps if e else None, "rtt_ms": e.rtt_ms if e else None,
                    "rtt_floor_ms": e.rtt_floor_ms if e else None,
                    # None before the first poll: the constructor's estimate (t_s 0.0) has no poll time on the run's clock
                    "estimate_t_s": e.t_s if e and e.t_s > 0.0 else None,
                    "estimate_backlog_bytes": e.backlog_bytes if e else None, "min_rtt_ms": e.min_rtt_ms if e else None}

    def probe_bytes(self, now_s: float) -> float:
        """A probe when nothing is committed and the estimator has heard nothing from KV for `probe_after`, or
        (`probe_confirm`) its latest upper bound was a lone one held at `lone_drop_fraction`: a second bound
        settles a dip at once, instead of after `probe_after` (docs/router.md, "An active probe", *Confirm*)."""
        with self._lock:
            est, spec = self.controller.estimator, self.spec.estimator
            if est is None or spec.probe_after_s <= 0 or self.controller.committed_bytes > 0:
                return 0.0
            confirm = spec.probe_confirm and est.unconfirmed
            if not confirm and est.evidence_t is not None and now_s - est.evidence_t < spec.probe_after_s:
                return 0.0
            return est.probe_bytes()

    def confirm_poll_s(self) -> float:
        """`poll_confirm` after a lone upper bound, once per bound: with KV committed no probe may confirm it,
        and a real dip repeats at the next poll, so the next poll comes sooner (docs/router-measurements.md, "A confirm poll")."""
        with self._lock:
            est, wait = self.controller.estimator, self.spec.estimator.poll_confirm_s
            if est is None or wait <= 0 or not est.unconfirmed or est.bound_t == self._confirm_polled_t:
                return 0.0
            self._confirm_polled_t = est.bound_t
            return wait

    def probe_pace_bps(self) -> float:
        with self._lock:
            est = self.controller.estimator
            return est.probe_pace_bps() if est is not None else 0.0

    def _note_arrival(self, now_s: float, uncached_prfaas: int, local_len: int) -> None:
        self.controller.note_arrival(now_s, uncached_prfaas, local_len)

    def on_prefill(self, cluster: str, uncached_len: int, seconds: float) -> None:
        with self._lock:
            self.prefill_times.observe(cluster, uncached_len, seconds)

    def _reroute(self, state: ClusterState, cands: list[InstanceState], uncached_pd: int, uncached_prfaas: int,
                 why: str) -> tuple[str, list[InstanceState], str]:
        """Latency-aware offload (`control.latency_aware`): keep the request on an idle PD-P instance when its
        prefill would end sooner there than on the least loaded PrfaaS instance, counting that instance's
        requests in flight and the committed KV that will not have drained by then (docs/router.md). Only
        an idle PD-P instance takes it, so short requests, which only PD-P serves, never queue behind it."""
        if not self.spec.control.latency_aware:
            return "prfaas", cands, why
        idle = [p for p in self.usable(state, "pd") if p.queue_depth == 0]
        if not idle:
            return "prfaas", cands, why
        times, ctl = self.prefill_times, self.controller
        pf = self.least_loaded(cands).queue_depth  # the instance pick_prefill takes (requests or tokens)
        t_pf = times.finish_s("prfaas", pf, uncached_prfaas)
        t_pd = times.finish_s("pd", 0, uncached_pd)
        if t_pf is None or t_pd is None:
            return "prfaas", cands, why
        a = ctl.kv_capacity_bps
        wan_s = ctl.excess_committed_bits() / a if a > 0 else 0.0
        if t_pd >= t_pf + wan_s:
            return "prfaas", cands, why
        return "pd", idle, why + f"; latency-aware: idle PD-P {t_pd:.1f}s < PrfaaS {t_pf:.1f}s + WAN backlog {wan_s:.1f}s"

    def on_telemetry(self, sample: TelemetrySample) -> None:
        with self._lock:
            self.controller.observe(sample)

    def tick(self, now_s: float) -> None:
        with self._lock:
            ctl = self.controller
            sig = ctl.step(now_s)
            self.log.add("control", now_s, threshold=ctl.t, egress_utilization=sig["utilization"],
                         demand_ratio=sig["demand_ratio"], kv_capacity_bps=sig["kv_capacity_bps"],
                         excess_committed_bits=sig["excess_committed_bits"],
                         pdp_cap_threshold=sig.get("pdp_cap"), congestion_events_per_s=ctl.congestion_events_per_s,
                         prfaas_queue=sig["prfaas_queue"], pdp_queue=sig["pdp_queue"], decode_queue=sig["decode_queue"],
                         bandwidth_scarce=ctl.bandwidth_scarce(), compress_kv=ctl.compresses())
            if self.spec.role_flip.enabled and now_s - self._last_flip >= self.spec.role_flip.period_s:
                self._last_flip = now_s
                self._role_flip(now_s)

    def _role_flip(self, now_s: float) -> None:
        """Long term: flip one PD host between prefill and decode when one side is the bottleneck.

        A flip needs a host carrying both a PD-P and a PD-D instance, one of them standby.
        """
        r, q = self.spec.role_flip, self.controller.queues
        decode_load = q["decode"] / r.bs_max
        if q["pdp"] >= r.prefill_queue_high and decode_load <= r.decode_load_low:
            self._flip(now_s, "decode", "prefill", f"PD-P queue {q['pdp']:.1f}/instance, decode load {decode_load:.2f}")
        elif decode_load >= r.decode_load_high and q["pdp"] <= self.spec.control.queue_low:
            self._flip(now_s, "prefill", "decode", f"decode load {decode_load:.2f}, PD-P queue {q['pdp']:.1f}/instance")

    def _flip(self, now_s: float, from_role: str, to_role: str, why: str) -> bool:
        r = self.spec.role_flip
        active_pdp = [k for k in self.active if k[0] == "prefill" and self.clusters.get(k[1]) == "pd"]
        active_dec = [k for k in self.active if k[0] == "decode"]
        if (from_role == "prefill" and len(active_pdp) <= r.min_prefill) or (from_role == "decode" and len(active_dec) <= r.min_decode):
            return False
        for key in sorted(active_pdp if from_role == "prefill" else active_dec):
            host = self.hosts.get(key)
            partner = [k for k, h in self.hosts.items() if h == host and k[0] == to_role and k not in self.active
                       and (to_role == "decode" or self.clusters.get(k[1]) == "pd")]
            if partner:
                self.active.discard(key)
                self.active.add(partner[0])
                self.log.add("role_flip", now_s, reason=f"{host}: {from_role} {key[1]} -> {to_role} {partner[0][1]}: {why}",
                             threshold=self.controller.t)
                return True
        return False
