"""The configuration files a run hands its processes (worker, router, client agent, the workload)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from testbed import rundir
from testbed.scenario import Scenario
from testbed.serving.config import ROUTER_PORT, Instance, ServingPlan


def write_requests(requests: list[Any], path: Path) -> None:
    """The generated workload as JSON lines, read by the client agent."""
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps({"request_id": r.request_id, "arrival_s": r.arrival_s, "input_len": r.input_len,
                                "output_len": r.output_len, "block_hashes": [int(h) for h in r.block_hashes]}) + "\n")


def worker_config(inst: Instance, plan: ServingPlan, scenario: Scenario, scale: float, work: Path) -> Path:
    from testbed.serving.worker import WorkerConfig

    model = scenario.section("model")
    spec = plan.spec
    cfg = WorkerConfig(
        role=inst.role, instance=inst.index, cluster=inst.cluster, host=inst.host, port=inst.port,
        compute=plan.compute, profile=plan.profile(inst.cluster), model=dict(scenario.raw.get("model") or {}),
        model_source=scenario.source or "", scale=scale, device=model.device, variant=model.variant,
        seed=model.seed if model.seed is not None else scenario.seed, kv_port=inst.kv_port,
        kv_connections=spec.kv_connections, kv_connector=spec.kv_connector,
        kv_congestion_control=spec.kv_congestion_control, kv_mss_bytes=spec.kv_mss_bytes, bs_max=spec.bs_max, kv_timeout_s=spec.kv_timeout_s,
        request_timeout_s=spec.request_timeout_s, prefix_pool_bytes=spec.prefix_pool_bytes, ready_file=str(work / f"{inst.name}.ready"),
        tcp_log=str(work / f"{inst.name}{rundir.TCP_LOG_SUFFIX}") if inst.role == "prefill" else None,
    )
    path = work / f"{inst.name}.json"
    cfg.save(path)
    return path


def router_config(plan: ServingPlan, scenario: Scenario, net: Any, scale: float, work: Path) -> Path:
    from testbed.serving.router import DecodeInstanceConfig, PrefillInstanceConfig, RouterConfig

    model = scenario.section("model")
    ip = net.host_ip
    cfg = RouterConfig(
        prefill=tuple(PrefillInstanceConfig(i.cluster, i.index, ip(i.host), i.port) for i in plan.instances if i.role == "prefill"),
        decode=tuple(DecodeInstanceConfig(i.index, ip(i.host), i.port, int(i.kv_port or 0)) for i in plan.instances if i.role == "decode"),
        policy=scenario.section("policy"), port=ROUTER_PORT, wan_capacity_bps=scenario.wan.prfaas_to_pd.rate_bps, scale=scale,
        model=model.name, compute=plan.compute, kv_dtype=model.spec.kv_dtype, vocab_size=_vocab_size(plan, model),
        request_timeout_s=plan.spec.request_timeout_s, shed_ttft_s=plan.spec.shed_ttft_s, slo_ttft_s=plan.spec.slo.ttft_s,
    )
    path = work / "router.json"
    cfg.save(path)
    return path


def loadgen_config(plan: ServingPlan, scenario: Scenario, net: Any, work: Path) -> Path:
    spec = plan.spec
    closed = scenario.section("workload").closed_loop
    path = work / "loadgen.json"
    path.write_text(json.dumps({
        "router_host": net.host_ip("pd-router"), "router_port": ROUTER_PORT, "requests_file": str(work / "requests.jsonl"),
        "out_file": str(work / "client.jsonl"), "model": scenario.section("model").name,
        "request_timeout_s": spec.request_timeout_s, "startup_timeout_s": spec.startup_timeout_s,
        "closed_users": closed.users if closed else 0, "think_s": closed.think_s if closed else 1.0,
        "duration_s": scenario.duration_s, "seed": scenario.seed,
        "slo_ttft_s": spec.slo.ttft_s, "slo_tpot_s": spec.slo.tpot_s, "stop_below": spec.slo.stop_below}))
    return path


def _vocab_size(plan: ServingPlan, model: Any) -> int:
    """The router derives prompt token ids from block hashes; in torch mode they must fit the model."""
    if plan.compute != "torch":
        return 32000
    from testbed.models.torch_model import vocab_size

    return vocab_size(model.spec, model.variant)
