"""Collecting a run's raw results into its run directory (`testbed.rundir`): requests.parquet from the
generated workload, the router's records and what the client saw; the router's scheduler log; cross
traffic; the KV senders' per-connection TCP samples (tcp.parquet); environment.json; the timing-fidelity record (fidelity.json, `testbed.fidelity`). Summaries are not computed here (``experiments.runs`` does that)."""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
from pathlib import Path
from typing import Any

from testbed import rundir
from testbed.fidelity import with_client, with_compute, with_cross, with_router
from testbed.kv.pool import state_bytes
from testbed.kv.tcplog import cc_restarts, read_tcp_logs
from testbed.scenario import Scenario
from testbed.serving.config import ServingPlan
from testbed.serving.early_stop import CUT


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def requests_frame(requests: list[Any], router_rows: list[dict[str, Any]], client_rows: list[dict[str, Any]]) -> Any:
    """One row per generated request: the router's record, what the client saw, and a failed row with
    the reason for a request that never got an answer; a request the client cut in the drain has status
    ``cut`` (the router saw a client that went away). Dtypes: `testbed.rundir.REQUEST_DTYPES`."""
    import pandas as pd

    by_router = {str(r["request_id"]): r for r in router_rows}
    by_client = {str(r["request_id"]): r for r in client_rows}
    rows = []
    for req in requests:
        rid = req.request_id
        row = dict.fromkeys(rundir.ROUTER_RECORD_COLUMNS)
        row.update(request_id=rid, input_len=req.input_len, output_len=req.output_len, status="failed")
        row.update({k: v for k, v in by_router.get(rid, {}).items() if v is not None})
        c = by_client.get(rid)
        if c is not None:
            row.update({k: v for k, v in c.items() if k != "request_id" and k != "route"})
            if row.get("arrival_s") is None:
                row["arrival_s"] = c["client_arrival_s"]
            if rid not in by_router:
                row["reason"] = c.get("client_reason") or "the router kept no record"
            if c.get("client_status") == CUT and (rid not in by_router or row.get("reason") in (None, rundir.CLIENT_DISCONNECTED)):
                # the client ended it in the drain (early_stop.drain_settled); a failure the router saw stays one
                row["status"], row["reason"] = CUT, c.get("client_reason")
        elif rid not in by_router:
            row["reason"] = "not sent before the run ended"
        row["scheduled_arrival_s"] = req.arrival_s
        row["session_id"] = req.session_id
        row["block_hashes"] = [int(h) for h in req.block_hashes]
        rows.append(row)
    return rundir.coerce_requests(pd.DataFrame(rows))


def environment(plan: ServingPlan, scenario: Scenario, scale: float, env_info: dict[str, Any],
                kv_cc: list[str] | None = None, kv_cc_restarts: int | None = None) -> rundir.Environment:
    """environment.json of a run: host, backends, calibration, compute, network, instances, serving.
    `kv_cc`: the congestion controls the KV connections ran (tcp.parquet's `cc`); `kv_cc_restarts`: how
    many times the senders restarted one (`tcplog.cc_restarts`); None: not known."""
    import torch

    from testbed.net.emulation import host_capacity_bps

    cap, cap_source = host_capacity_bps()
    model = scenario.section("model")
    return rundir.Environment(
        host={"hostname": socket.gethostname(), "cpus": os.cpu_count(), "python": platform.python_version(),
              "platform": platform.platform()},
        kernel=platform.release(),
        backends={"wan": (env_info.get("network") or {}).get("backend"), "shaper": scenario.wan.shaper,
                  "torch": torch.__version__, "cuda": torch.cuda.is_available(),
                  "kv_congestion_control": kv_cc or None, "kv_cc_restarts": kv_cc_restarts},
        calibration={"capacity_bps": cap, "capacity_source": cap_source, "wan_rtt": env_info.get("rtt")},
        compute={"mode": plan.compute, "profiles": dict(plan.profiles) if plan.compute == "profile" else None,
                 "model": model.name, "hybrid": state_bytes(model.spec) > 0,  # a prefix is reusable only at a stored state
                 "variant": model.variant if plan.compute == "torch" else None,
                 "device": model.device if plan.compute == "torch" else None},
        scale=scale,
        run_id=env_info.get("run_id"),
        workload_start_s=env_info.get("workload_start_s"),
        network=env_info.get("network"),
        instances=[{"role": i.role, "instance": i.index, "cluster": i.cluster, "host": i.host, "port": i.port,
                    "kv_port": i.kv_port} for i in plan.instances],
        serving={"bs_max": plan.spec.bs_max, "kv_connections": plan.spec.kv_connections,
                 "kv_congestion_control": plan.spec.kv_congestion_control, "kv_mss_bytes": plan.spec.kv_mss_bytes,
                 "kv_timeout_s": plan.spec.kv_timeout_s, "request_timeout_s": plan.spec.request_timeout_s},
        extra={rundir.RUN_ERROR: env_info["error"]} if env_info.get("error") else {},
    )


def collect(out: rundir.RunDirWriter, plan: ServingPlan, scenario: Scenario, requests: list[Any], scale: float,
            env_info: dict[str, Any]) -> None:
    """Write the run's raw files (everything but summary.json) from its work directory."""
    import pandas as pd

    from testbed.serving.policy import SchedulerLog

    work = out.work
    router_dir = work / "router"
    router_file = router_dir / rundir.ROUTER_REQUESTS_FILE
    router_rows = pd.read_parquet(router_file).to_dict("records") if router_file.exists() else []
    df = requests_frame(requests, router_rows, read_jsonl(work / "client.jsonl"))
    out.requests(df, keep_text=plan.compute == "torch")
    cross = pd.read_parquet(work / rundir.CROSS_TRAFFIC_FILE) if (work / rundir.CROSS_TRAFFIC_FILE).exists() else None
    if cross is not None:
        out.cross_traffic(cross)
    sched = router_dir / rundir.SCHEDULER_FILE
    sched_df = pd.read_parquet(sched) if sched.exists() else SchedulerLog().to_frame()
    out.scheduler(sched_df)
    tcp_logs = list(work.glob(f"*{rundir.TCP_LOG_SUFFIX}"))
    kv_cc: list[str] = []
    restarts: int | None = None
    if tcp_logs:
        try:
            tcp = read_tcp_logs(tcp_logs)
            kv_cc = sorted(set(tcp["cc"]) - {""})
            out.tcp(tcp)
        except Exception as e:  # telemetry: the run's other files matter more; the CSV files stay in work/
            print(f"tcp.parquet not written ({e}); the samples stay in {work}/*{rundir.TCP_LOG_SUFFIX}", file=sys.stderr)
        else:
            for p in tcp_logs:  # merged (tcp.parquet is written whole or not at all): one copy of the samples
                p.unlink()
            try:
                restarts = cc_restarts(tcp)
            except Exception as e:  # a count for the summary: never worth the run's other files
                print(f"KV congestion-control restarts not counted ({e})", file=sys.stderr)
    if not (out.path / rundir.LINK_FILE).exists():  # NET writes it when the network stops
        out.link(None)
    out.environment(environment(plan, scenario, scale, env_info, kv_cc, restarts))
    if env_info.get("fidelity") is not None:  # judged again with the compute's own timing, the client's sending and the
        # router's intake, what the neighbours sent and the router's ticks
        rec = with_client(with_compute(env_info["fidelity"], df), df)
        out.fidelity(with_router(with_cross(rec, cross, env_info.get("cross_traffic_errors"), env_info.get("cross_traffic_notes")), sched_df))
