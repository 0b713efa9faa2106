"""Per-request latency-aware offload (`policy.control.latency_aware`, `prfaas` only; docs/router.md).

What each cluster's prefill costs, learned from the router's own timestamps of finished prefills
(observed: a deployment has them): per cluster, an EWMA of the seconds per uncached token and of the
seconds per prefill. From them, the expected time to a request's prefill end on an instance with `depth`
requests in flight: ``depth x seconds per prefill + uncached tokens x seconds per token``. And what one
prefill of l tokens occupies an instance of a cluster (`service_model`, the PD-P cap's cost of a raise): a
least-squares line ``a + b l`` over every finished prefill of the cluster (the fixed cost per request
and the cost per token, which an EWMA of seconds per token mixes up: short prefills inflate it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from testbed.serving.policy.linefit import LineFit

ALPHA = 0.2  # EWMA weight of a new prefill (about the last 5-10 prefills of the cluster)
MIN_PREFILLS = 3  # finished prefills of a cluster before its model is used


@dataclass
class _Cluster:
    n: int = 0
    s_per_token: float = 0.0
    s_per_prefill: float = 0.0
    line: LineFit = field(default_factory=LineFit)


class PrefillTimes:
    """Feed `observe` with every finished prefill; `finish_s` predicts (None until a cluster has `MIN_PREFILLS`)."""

    def __init__(self) -> None:
        self._c: dict[str, _Cluster] = {}

    def observe(self, cluster: str, uncached_len: int, seconds: float) -> None:
        if uncached_len <= 0 or seconds <= 0:
            return
        c = self._c.setdefault(cluster, _Cluster())
        c.line.add(float(uncached_len), seconds)
        per_token = seconds / uncached_len
        if c.n == 0:
            c.s_per_token, c.s_per_prefill = per_token, seconds
        else:
            c.s_per_token += ALPHA * (per_token - c.s_per_token)
            c.s_per_prefill += ALPHA * (seconds - c.s_per_prefill)
        c.n += 1

    def finish_s(self, cluster: str, depth: int, uncached_len: int) -> float | None:
        """Expected seconds from now to the prefill's end on an instance of `cluster` with `depth` in flight."""
        c = self._c.get(cluster)
        if c is None or c.n < MIN_PREFILLS:
            return None
        return depth * c.s_per_prefill + uncached_len * c.s_per_token

    def service_model(self, cluster: str) -> Callable[[float], float] | None:
        """Seconds one prefill of l uncached tokens occupies an instance of `cluster`, as a function of l: the
        fitted line (None before `MIN_PREFILLS` prefills; with one length only or a slope < 0, the mean
        seconds per token x l, which overestimates long prefills: the safe side for the cap)."""
        c = self._c.get(cluster)
        if c is None or c.n < MIN_PREFILLS:
            return None
        return c.line.model()
