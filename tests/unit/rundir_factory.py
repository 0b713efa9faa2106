"""Builds synthetic run directories through the testbed's own writer (`testbed.rundir.RunDirWriter`), for
testing the analysis code: the files have exactly the shape real runs write, because the same code
writes them.

The numbers are synthetic but consistent (a request's TTFT >= its prefill, offloaded requests carry KV
bytes, telemetry is cumulative); they are test inputs, never results.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from experiments.runs import summarize_run_dir
from testbed.kv.tcplog import COLUMNS
from testbed.rundir import Environment, RunDirWriter


def synthetic_environment(scale: float, workload_start_s: float = 0.0) -> Environment:
    return Environment(
        host={"hostname": "synthetic", "cpus": 2, "python": "3", "platform": "synthetic"}, kernel="synthetic",
        backends={"wan": "delayline", "shaper": "htb", "torch": None, "cuda": False},
        calibration={"capacity_bps": 10e9, "capacity_source": "synthetic", "wan_rtt": None},
        compute={"mode": "profile", "profiles": None, "model": "paper-1t-hybrid", "variant": None, "device": None},
        scale=scale, run_id="synthetic", workload_start_s=workload_start_s, network=None, instances=[], serving={},
    )


def write_run_dir(out: Path, *, policy: str = "prfaas", duration_s: float = 30.0, rate_rps: float = 5.0, seed: int = 1,
                  scale: float = 10.0, threshold: int = 19400, dip: tuple[float, float] | None = (10.0, 20.0)) -> Path:
    rng = np.random.default_rng(seed)
    w = RunDirWriter(out)
    n = max(2, int(rng.poisson(rate_rps * duration_s)))
    arrival = np.sort(rng.uniform(0, duration_s, n))
    inp = np.clip(rng.lognormal(9.9, 1.0, n), 128, 131072).astype(int)
    cached = (rng.uniform(0, 0.3, n) * inp).astype(int)
    unc = inp - cached
    offload = unc > threshold if policy != "homogeneous-pd" else np.zeros(n, bool)
    route = np.where(offload, "prfaas", "pd-p")
    pre = np.where(offload, 0.39 + 4.1e-5 * unc + 9.5e-11 * unc**2, 0.39 + 1.41e-4 * unc)
    pstart = arrival + rng.uniform(0.001, 0.05, n)
    pend = pstart + pre
    kv = np.where(offload, (172 * 2**20 + 17101 * unc) / scale, 0).astype(np.int64)
    in_dip = (arrival > dip[0]) & (arrival < dip[1]) if dip else np.zeros(n, bool)
    xfer = np.where(offload, kv * 8 / np.where(in_dip, 2e9, 10e9), 0.001)
    tstart = pend - 0.1 * pre
    tend = np.maximum(pend, tstart + xfer)
    first = tend + 0.025
    out_len = np.full(n, 64)
    finish = first + 0.025 * (out_len - 1) * rng.uniform(1.0, 1.2, n)
    status = np.where(rng.uniform(size=n) < 0.02, "failed", "ok")
    w.requests(pd.DataFrame({
        "request_id": [f"r{i}" for i in range(n)], "arrival_s": arrival, "input_len": inp, "cached_len": cached,
        "uncached_len": unc, "output_len": out_len, "route": route, "threshold": threshold, "prefill_start_s": pstart,
        "prefill_end_s": pend, "kv_bytes": kv, "transfer_start_s": tstart, "transfer_end_s": tend, "first_token_s": first,
        "finish_s": finish, "status": status, "scheduled_arrival_s": arrival, "session_id": np.arange(n) % 7,
    }))
    t = np.arange(0, duration_s, 0.1)
    rate = np.where(dip and (t > dip[0]) & (t < dip[1]), 2e9, 10e9) / scale if dip else np.full(t.size, 10e9 / scale)
    tx = np.cumsum(rate / 8 * 0.1 * rng.uniform(0.3, 0.95, t.size))
    w.link(pd.DataFrame({"t_s": t, "direction": "prfaas_to_pd", "rate_bps": rate, "tx_bytes": tx.astype(np.int64),
                         "backlog_bytes": (rng.uniform(0, 1, t.size) * (rate < 5e8) * 3e6).astype(np.int64),
                         "drops": np.cumsum(rng.poisson(0.2, t.size))}))
    w.scheduler(pd.DataFrame({"t_s": t[::10], "kind": "control",
                              "threshold": np.where((t[::10] > 11) & (t[::10] < 21), threshold * 2, threshold),
                              "egress_utilization": rng.uniform(0.3, 1.0, t[::10].size)}))
    w.tcp(_tcp_samples(rng, tstart[offload], tend[offload], kv[offload], scale, in_dip[offload]))
    scen = {"name": f"synthetic-{policy}", "seed": seed, "scale": scale, "duration": f"{duration_s}s",
            "wan": {"rate": "10Gbps", "delay": "10ms", "schedule": [{"at": f"{dip[0]}s", "rate": "2Gbps", "for": f"{dip[1] - dip[0]}s"}] if dip else []},
            "policy": {"name": policy}}
    w.scenario(yaml.safe_dump(scen))
    w.environment(synthetic_environment(scale))
    summarize_run_dir(out)
    return out


def write_scenario_as_run(out: Path, scenario: str, overrides: list[str] | tuple[str, ...], *, auto_scale: float = 10.0) -> Path:
    """A run directory's scenario.yaml replaced with the one a real run of `scenario` with `overrides` writes
    (`testbed.runner.run.run_scenario`: the overrides applied, its scale and the serving plan's choices written out;
    `auto_scale`: what ``scale: auto`` resolved to on the run's host)."""
    from testbed.runner.run import resolved_scenario
    from testbed.scenario import dump_scenario
    from testbed.sections import load_scenario
    from testbed.serving.config import plan_serving

    sc = load_scenario(scenario, list(overrides))
    RunDirWriter(out).scenario(dump_scenario(resolved_scenario(sc, plan_serving(sc), auto_scale if sc.scale == "auto" else float(sc.scale))))
    return out


def _tcp_samples(rng: np.random.Generator, start_s: np.ndarray, end_s: np.ndarray, kv_bytes: np.ndarray, scale: float,
                 in_dip: np.ndarray, connections: int = 4) -> pd.DataFrame:
    """tcp.parquet of the offloaded transfers: every 0.1 s of each, per connection, its share of the bytes
    acknowledged so far (cumulative per connection across transfers), a longer RTT and more retransmits in the dip."""
    rows, acked, retrans = [], np.zeros(connections, np.int64), np.zeros(connections, np.int64)
    for s, e, b, dip in zip(start_s, end_s, kv_bytes, in_dip):
        ts = np.append(np.arange(s, e, 0.1), e)
        for c in range(connections):
            share = b // connections
            for i, t in enumerate(ts):
                frac = (i + 1) / len(ts)
                rows.append(("prfaas", 0, 0, 0, float(t), c, int((30 if dip else 10) * 1000 * rng.uniform(1, 1.3)), int(rng.integers(10, 400)),
                             int(retrans[c] + i * (5 if dip else 0.2)), int(acked[c] + frac * share), 0, 8e9 / scale * rng.uniform(0.5, 1),
                             10_000, int((1 - frac) * share), False, 0, 0, 0, int(acked[c] + frac * share), 0, "cubic", 1448))
            acked[c] += share
            retrans[c] += int((len(ts) - 1) * (5 if dip else 0.2))
    return pd.DataFrame(rows, columns=list(COLUMNS)).sort_values("t_s", kind="stable").reset_index(drop=True)
