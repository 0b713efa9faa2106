"""The comparison policies: a fixed threshold t, its clairvoyant step (oracle only), and the three without
length routing."""

from __future__ import annotations

import math
from typing import Any

from testbed.serving.policy.base import (
    ClusterState, Decision, InstanceState, Policy, RequestView, TelemetrySample, other_cluster,
)


class ThresholdPolicy(Policy):
    """Selective offload on the uncached length with a fixed t (the `fixed-threshold` baseline).

    Cluster choice follows the paper: bandwidth scarce -> decide per cluster (l - l_pd <= t -> PD-P,
    else PrfaaS with its own hit); abundant (and `cross_cluster_cache`) -> l_prefix = max(l_pd,
    l_prfaas) decides, the longer prefix moving to the chosen cluster. This baseline always sees
    bandwidth as scarce (it measures nothing).
    """

    name = "fixed-threshold"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._t = float(self.spec.threshold_tokens)

    @property
    def threshold(self) -> float:
        return self._t

    def bandwidth_scarce(self) -> bool:
        return True

    def decide(self, req: RequestView, state: ClusterState) -> Decision:
        with self._lock:
            return self._decide(req, state)

    def _decide(self, req: RequestView, state: ClusterState) -> Decision:
        t = self.threshold
        l_total, m = req.input_len, state.match
        l_pd, l_pf = m.cached_len("pd"), m.cached_len("prfaas")
        scarce = self.bandwidth_scarce()
        per_cluster = scarce or not self.spec.cross_cluster_cache
        if per_cluster:
            local = l_total - l_pd <= t
            why = f"l-l_pd={l_total - l_pd} {'<=' if local else '>'} t={t:.0f}" + ("" if local else f"; l-l_prfaas={l_total - l_pf}")
        else:
            l_prefix = max(l_pd, l_pf)
            local = l_total - l_prefix <= t
            why = f"abundant: l-l_prefix={l_total - l_prefix} {'<=' if local else '>'} t={t:.0f}"
        cluster = "pd" if local else "prfaas"
        cands = self.usable(state, cluster)
        if cluster == "prfaas" and cands:
            cluster, cands, why = self._reroute(state, cands, l_total - l_pd, l_total - l_pf, why)
        if not cands:
            alt = self.usable(state, other_cluster(cluster))
            if alt:
                why += f"; fallback: no healthy {cluster} prefill instance"
                cluster, cands = other_cluster(cluster), alt
        p, cached = self.pick_prefill(state, cluster, m.cached_len(cluster), m.holders(cluster), cands)
        transfer = 0
        if not per_cluster:
            other = m.cached_len(other_cluster(cluster))
            if other > cached:
                transfer = other - cached
                cached = other
                why += f"; prefix {transfer} tokens from {other_cluster(cluster)} cluster"
        self._note_arrival(state.now_s, l_total - l_pf, l_total - cached if cluster == "pd" else 0)
        # moved to PD-P by a raise of t (or a fallback or the latency-aware rule): above the base threshold
        moved = cluster == "pd" and l_total - l_pd > self.spec.threshold_tokens
        if moved:
            why += f"; above the base t={self.spec.threshold_tokens}"
        priority = int(moved and self.spec.pd_queue == "natives-first")
        return self._finish(req, state, cluster, p, cached, t, why, transfer, scarce, priority)

    def _note_arrival(self, now_s: float, uncached_prfaas: int, local_len: int) -> None:
        return None

    def _reroute(self, state: ClusterState, cands: list[InstanceState], uncached_pd: int, uncached_prfaas: int,
                 why: str) -> tuple[str, list[InstanceState], str]:
        """A last look at an offload (the `prfaas` policy's latency-aware rule); here: offload it."""
        return "prfaas", cands, why


STEP_BELOW = 0.99  # a rate counts as "below the line's" under 99% of it (the shaper and the scale round rates)


class OracleStepPolicy(ThresholdPolicy):
    """Comparison, oracle only (`oracle-step`, `signals: oracle`): fixed-threshold plus one clairvoyant step.
    t is `event_threshold` while the shaper's configured PrfaaS -> PD rate (the emulator's WAN sample) is
    below the provisioned line rate, the scenario's threshold otherwise; it switches at the first sample
    that carries the change (one telemetry period). No deployment knows that rate; swept over
    `event_threshold`, these runs show how far one raise, sized and timed perfectly, can go on a rate drop
    (docs/router-measurements.md, "How far one raise can go")."""

    name = "oracle-step"

    def on_telemetry(self, sample: TelemetrySample) -> None:
        if sample.capacity_bps is None or self.spec.event_threshold_tokens is None:
            return
        with self._lock:
            below = sample.capacity_bps < STEP_BELOW * self.capacity_bps
            t = float(self.spec.event_threshold_tokens if below else self.spec.threshold_tokens)
            if t != self._t:
                self.log.add("threshold", sample.t_s, threshold=t, old_threshold=self._t, egress_utilization=0.0,
                             bandwidth_scarce=True, reason=f"oracle-step: shaper rate {sample.capacity_bps / 1e9:.3g} Gbps "
                                                           f"{'<' if below else '>='} line rate {self.capacity_bps / 1e9:.3g} Gbps")
                self._t = t



class HomogeneousPDPolicy(Policy):
    """Baseline: one PD cluster serves everything; PrfaaS instances, if configured, are never used."""

    name = "homogeneous-pd"

    def decide(self, req: RequestView, state: ClusterState) -> Decision:
        with self._lock:
            return self.fixed_route(req, state, "pd", math.inf, "homogeneous-pd: no PrfaaS cluster")


class AllLocalPolicy(Policy):
    """Baseline: the PrfaaS cluster exists but t = infinity, so every prefill stays on PD-P."""

    name = "all-local"

    def decide(self, req: RequestView, state: ClusterState) -> Decision:
        with self._lock:
            return self.fixed_route(req, state, "pd", math.inf, "all-local: t = inf")


class NaiveHeterogeneousPolicy(Policy):
    """Baseline: every prefill on PrfaaS (no length routing), every PD node decodes."""

    name = "naive-heterogeneous"

    def decide(self, req: RequestView, state: ClusterState) -> Decision:
        with self._lock:
            return self.fixed_route(req, state, "prfaas", 0.0, "naive-heterogeneous: all prefill on PrfaaS")
