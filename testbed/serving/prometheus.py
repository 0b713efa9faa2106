"""The router's Prometheus metrics, through `prometheus_client` (docs/serving.md, "Watching a run").

Two kinds: histograms observed once per finished request (`RequestHistograms.observe`: TTFT, TPOT,
queue wait, prefill time, KV transfer time; labels ``route`` and ``cluster``), and values read from
the router's state at scrape time (`RouterCollector`: t, utilisation, WAN sample, the bandwidth
estimate, queues, counts). Each router has its own `CollectorRegistry`, so several routers in one
process (the tests) do not share series. The Grafana dashboard built on these names:
`dashboards/grafana-prfaas.json`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from testbed.serving.protocol import own_prefill_s

__all__ = ["CONTENT_TYPE", "RequestHistograms", "RouterCollector", "exposition", "new_registry"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
LABELS = ("route", "cluster")
# seconds of emulated serving (the testbed's clock); the paper's TTFT range is 0.1-60 s
LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, math.inf)
TPOT_BUCKETS_S = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, math.inf)


def new_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


class RequestHistograms:
    """One histogram per latency of a request; `observe(record)` takes a router record (times in s)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def h(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> Histogram:
            return Histogram(name, doc, LABELS, registry=registry, buckets=buckets)

        self.ttft = h("prfaas_router_ttft_seconds", "Time to first token (arrival at the router -> first token).")
        self.tpot = h("prfaas_router_tpot_seconds", "Time per output token after the first.", TPOT_BUCKETS_S)
        self.queue_wait = h("prfaas_router_queue_wait_seconds", "Arrival at the router -> the prefill worker starts it.")
        self.prefill = h("prfaas_router_prefill_seconds", "Prefill compute time on the worker (less any pause while "
                         "preempting prefills ran).")
        self.kv_transfer = h("prfaas_router_kv_transfer_seconds", "KV transfer time (first frame sent -> verified at decode).")

    def observe(self, rec: dict[str, Any], cluster: str) -> None:
        """A finished ``ok`` record; a latency whose two ends are not both known is not observed."""
        if rec.get("status") != "ok":
            return
        labels = (rec.get("route") or "none", cluster)

        def span(a: str, b: str) -> float | None:
            x, y = rec.get(a), rec.get(b)
            return float(y) - float(x) if x is not None and y is not None and float(y) >= float(x) else None

        for hist, a, b in ((self.ttft, "arrival_s", "first_token_s"), (self.queue_wait, "arrival_s", "prefill_start_s"),
                           (self.kv_transfer, "transfer_start_s", "transfer_end_s")):
            v = span(a, b)
            if v is not None:
                hist.labels(*labels).observe(v)
        if span("prefill_start_s", "prefill_end_s") is not None:
            self.prefill.labels(*labels).observe(max(0.0, own_prefill_s(rec["prefill_start_s"], rec["prefill_end_s"],
                                                                        rec.get("prefill_paused_s")) or 0.0))
        decode = span("first_token_s", "finish_s")
        n = int(rec.get("output_len") or 0)
        if decode is not None and n > 1:
            self.tpot.labels(*labels).observe(decode / (n - 1))


class RouterCollector(Collector):
    """Gauges and counters read from `state()` (the router's `/v1/state` view plus the policy's
    signals) at every scrape, so they cannot drift from what the router reports elsewhere."""

    def __init__(self, state: Callable[[], dict[str, Any]]) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        st = self._state()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=float(value))

        t = st["threshold"]
        yield gauge("prfaas_router_threshold_tokens", "Offload threshold t on the uncached length (+Inf: never offload).",
                    math.inf if t is None else t)
        yield gauge("prfaas_router_egress_utilization", "WAN egress utilisation seen by the policy (EWMA, 0-1).",
                    st["egress_utilization"])
        yield gauge("prfaas_router_bandwidth_scarce", "1 when the policy treats WAN bandwidth as scarce.", st["bandwidth_scarce"])
        yield gauge("prfaas_router_congestion_events_per_s", "WAN drops + PrfaaS TCP retransmits per second (policy's EWMA).",
                    st["congestion_events_per_s"])
        yield gauge("prfaas_router_signals_oracle", "1 when the policy is told emulator ground truth (policy.signals: oracle).",
                    st["signals"] == "oracle")
        yield gauge("prfaas_router_kv_available_bps_emulated", "Bandwidth the policy believes is left for KV, emulated bit/s.",
                    st["kv_available_bps"])
        w = st["wan"]
        yield gauge("prfaas_router_wan_egress_bps_emulated", "Last WAN egress sample (emulator), emulated bit/s.", w["egress_bps"])
        yield gauge("prfaas_router_wan_capacity_bps_emulated", "WAN capacity (emulator), emulated bit/s.", w["capacity_bps"])
        yield gauge("prfaas_router_wan_backlog_bytes_emulated", "WAN queue backlog (emulator), emulated bytes.", w["backlog_bytes"])
        yield CounterMetricFamily("prfaas_router_wan_drops", "WAN packet drops (emulator, cumulative).", value=w["drops"])
        yield gauge("prfaas_router_scale", "Emulated units per wire unit.", st["scale"])
        for name, doc, key in (("prfaas_router_queue_depth", "Requests in flight per worker instance (router's count).", "inflight"),
                               ("prfaas_router_tokens_in_flight", "Uncached prompt tokens of the requests in flight per "
                                "instance, until their prefill answers (router's count; 0 on decode instances).", "inflight_tokens"),
                               ("prfaas_router_worker_queue_depth", "Queue depth reported by the worker's /v1/state.", "reported_queue"),
                               ("prfaas_router_instance_up", "1 when the instance answered its last state poll and is active.", "up")):
            g = GaugeMetricFamily(name, doc, labels=("role", "cluster", "instance"))
            for x in st["instances"]:
                v = float(x["healthy"] and x["active"]) if key == "up" else float(x[key])
                g.add_metric((x["role"], x["cluster"], str(x["instance"])), v)
            yield g
        c = CounterMetricFamily("prfaas_router_requests", "Finished requests by route and status.", labels=("route", "status"))
        for r in st["requests"]:
            c.add_metric((r["route"], r["status"]), r["count"])
        yield c
        yield gauge("prfaas_router_requests_inflight", "Requests in flight.", st["inflight"])
        c = CounterMetricFamily("prfaas_router_kv_bytes_emulated", "KV bytes shipped by finished requests, by route.", labels=("route",))
        for r, v in sorted(st["kv_bytes_emulated"].items()):
            c.add_metric((r,), v)
        yield c
        c = CounterMetricFamily("prfaas_router_decisions", "Routing decisions by route.", labels=("route",))
        for r, v in sorted(st["decisions"].items()):
            c.add_metric((r,), v)
        yield c
        yield CounterMetricFamily("prfaas_router_threshold_changes", "Changes of t by the control loop.", value=st["threshold_changes"])
        yield CounterMetricFamily("prfaas_router_role_flips", "Long-term role flips of PD nodes.", value=st["role_flips"])
        g = GaugeMetricFamily("prfaas_router_cached_prefix_keys", "Prefix hit points known per cluster.", labels=("cluster",))
        for cl, n in sorted(st["cached_prefix_keys"].items()):
            g.add_metric((cl,), n)
        yield g


def exposition(registry: CollectorRegistry) -> bytes:
    """The text format Prometheus scrapes (`CONTENT_TYPE`)."""
    return generate_latest(registry)
