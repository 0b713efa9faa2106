"""One complete run: network up -> workers and router up in their hosts -> workload -> collect -> down.

`run_scenario` checks the scenario first (nothing starts on bad input), brings up the scenario's
network (`testbed.net.emulation.Network`), starts one worker process per instance on its host, the
router on ``pd-router`` and the client agent (`testbed.serving.loadgen`) on ``pd-client``, relays WAN
telemetry to the router, injects the scenario's faults, shows live progress, and always tears
everything down (``finally``; SIGTERM/SIGHUP become KeyboardInterrupt while the network runs). It then
writes the run directory of docs/serving.md ("Run directory"). Every timestamp is `testbed.clock` time relative to the
network's start (``PRFAAS_T0``, as in link.parquet). The WAN schedule and the faults count from the
workload's start (once every process is up), so a dip at 12 s hits the traffic 12 s in on any host.
"""

from __future__ import annotations

import json
import os
import platform
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed import clock, units
from testbed.errors import HostError
from testbed.scale import Scale
from testbed.scenario import Scenario, dump_scenario
from testbed.serving.config import ROUTER_PORT, Instance, ServingPlan, plan_run

STOP_GRACE_S = 10.0


@dataclass
class _Live:
    """What the progress display and the run loop know, updated by reader threads."""

    total: int = 0
    sent: int = 0
    done: int = 0
    ok: int = 0
    started: bool = False
    start_s: float | None = None  # the workload's start, seconds after PRFAAS_T0
    finished: bool = False
    error: str | None = None
    router: dict[str, Any] = field(default_factory=dict)
    egress_bps: float = 0.0  # emulated, PrfaaS -> PD
    capacity_bps: float = 0.0
    faults: list[str] = field(default_factory=list)


def _python() -> list[str]:
    return [sys.executable, "-m"]


def _env_argv(t0_s: float) -> list[str]:
    """Environment for processes in the hosts (Mininet's popen does not pass ours through)."""
    repo = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(x for x in (repo, os.environ.get("PYTHONPATH", "")) if x)
    return ["env", f"{clock.T0_ENV}={t0_s!r}", "OMP_NUM_THREADS=1", "MKL_NUM_THREADS=1", f"PYTHONPATH={path}",
            "PYTHONUNBUFFERED=1"]


def _worker_config(inst: Instance, plan: ServingPlan, scenario: Scenario, scale: float, work: Path) -> Path:
    from testbed.serving.worker import WorkerConfig

    model = scenario.section("model")
    spec = plan.spec
    cfg = WorkerConfig(
        role=inst.role, instance=inst.index, cluster=inst.cluster, host=inst.host, port=inst.port,
        compute=plan.compute, profile=plan.profile(inst.cluster), model=dict(scenario.raw.get("model") or {}),
        model_source=scenario.source or "", scale=scale, device=model.device, variant=model.variant,
        seed=model.seed if model.seed is not None else scenario.seed, kv_port=inst.kv_port,
        kv_connections=spec.kv_connections, kv_connector=spec.kv_connector, bs_max=spec.bs_max, kv_timeout_s=spec.kv_timeout_s,
        request_timeout_s=spec.request_timeout_s, prefix_pool_bytes=spec.prefix_pool_bytes, ready_file=str(work / f"{inst.name}.ready"),
    )
    path = work / f"{inst.name}.json"
    cfg.save(path)
    return path


def _router_config(plan: ServingPlan, scenario: Scenario, net: Any, scale: float, work: Path) -> Path:
    from testbed.serving.router import DecodeInstanceConfig, PrefillInstanceConfig, RouterConfig

    model = scenario.section("model")
    ip = net.host_ip
    cfg = RouterConfig(
        prefill=tuple(PrefillInstanceConfig(i.cluster, i.index, ip(i.host), i.port) for i in plan.instances if i.role == "prefill"),
        decode=tuple(DecodeInstanceConfig(i.index, ip(i.host), i.port, int(i.kv_port or 0)) for i in plan.instances if i.role == "decode"),
        policy=scenario.section("policy"), port=ROUTER_PORT, wan_capacity_bps=scenario.wan.prfaas_to_pd.rate_bps, scale=scale,
        model=model.name, compute=plan.compute, vocab_size=_vocab_size(plan, model),
        request_timeout_s=plan.spec.request_timeout_s, shed_ttft_s=plan.spec.shed_ttft_s,
    )
    path = work / "router.json"
    cfg.save(path)
    return path


def _vocab_size(plan: ServingPlan, model: Any) -> int:
    """The router derives prompt token ids from block hashes; in torch mode they must fit the model."""
    if plan.compute != "torch":
        return 32000
    from testbed.models.torch_model import vocab_size

    return vocab_size(model.spec, model.variant)


def _write_requests(requests: list[Any], path: Path) -> None:
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps({"request_id": r.request_id, "arrival_s": r.arrival_s, "input_len": r.input_len,
                                "output_len": r.output_len, "block_hashes": [int(h) for h in r.block_hashes]}) + "\n")


class _Processes:
    """The run's processes by name, with their logs; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, net: Any, logs: Path, t0_s: float) -> None:
        self.net, self.logs, self.t0_s = net, logs, t0_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.files: list[Any] = []

    def start(self, name: str, host: str, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")
        self.files.append(log)
        kwargs.setdefault("stdout", log)
        kwargs.setdefault("stderr", log if kwargs["stdout"] is log else log)
        p = self.net.popen(host, _env_argv(self.t0_s) + argv, **kwargs)
        self.procs[name] = p
        return p

    def log_tail(self, name: str, lines: int = 5) -> str:
        try:
            return " | ".join((self.logs / f"{name}.log").read_text().strip().splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, names: list[str] | None = None, grace_s: float = STOP_GRACE_S) -> None:
        chosen = [n for n in (names or list(self.procs)) if n in self.procs]
        for n in chosen:
            if self.procs[n].poll() is None:
                try:
                    self.procs[n].send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = clock.now_s() + grace_s
        for n in chosen:
            try:
                self.procs[n].wait(max(0.1, deadline - clock.now_s()))
            except subprocess.TimeoutExpired:
                self.procs[n].kill()
                self.procs[n].wait(5)

    def close(self) -> None:
        self.stop()
        for f in self.files:
            f.close()


def _wait_ready(procs: _Processes, plan: ServingPlan, work: Path, timeout_s: float) -> None:
    deadline = clock.now_s() + timeout_s
    pending = {i.name for i in plan.instances}
    while pending:
        for name in list(pending):
            if (work / f"{name}.ready").exists():
                pending.discard(name)
            elif procs.procs[name].poll() is not None:
                raise HostError(f"worker {name} exited at start (status {procs.procs[name].returncode}): {procs.log_tail(name)}")
        if pending and clock.now_s() > deadline:
            raise HostError(f"workers not ready within {timeout_s:g}s: {', '.join(sorted(pending))} "
                            f"(raise serving.timeouts.startup on a slow host); last log: {procs.log_tail(sorted(pending)[0])}")
        if pending:
            threading.Event().wait(0.1)


def _read_agent(stdout: Any, live: _Live) -> None:
    for line in stdout:
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        kind = msg.get("kind")
        if kind == "progress":
            live.sent, live.done, live.ok = msg["sent"], msg["done"], msg["ok"]
            live.router = msg.get("router") or live.router
        elif kind == "started":
            live.start_s = float(msg["t_s"])
            live.started = True
        elif kind == "finished":
            live.sent, live.done, live.ok, live.finished = msg["sent"], msg["done"], msg["ok"], True
        elif kind == "error":
            live.error = msg.get("message")


class _TelemetryRelay:
    """NET's WAN samples (PrfaaS -> PD) -> the client agent's stdin -> the router's /v1/telemetry (wire
    units). A bounded queue and its own writer thread keep a slow router from stalling NET's sampler:
    when the queue is full the newest sample is dropped (the next follows within 50 ms)."""

    def __init__(self, live: _Live, scale: Scale) -> None:
        self.live, self.scale = live, scale
        self.samples: queue.Queue = queue.Queue(maxsize=64)
        self.stdin: Any = None

    def attach(self, stdin: Any) -> None:
        self.stdin = stdin
        threading.Thread(target=self._write, daemon=True, name="telemetry-relay").start()

    def __call__(self, s: dict[str, Any]) -> None:
        if s.get("direction") != "prfaas_to_pd":
            return
        cap = float(s.get("rate_bps") or 0.0) if s.get("link_up", True) else 0.0
        self.live.egress_bps = self.scale.emulated_bps(float(s.get("achieved_bps") or 0.0))
        self.live.capacity_bps = self.scale.emulated_bps(cap)
        sample = {"t_s": clock.now_s(), "egress_bps": float(s.get("achieved_bps") or 0.0), "capacity_bps": cap,
                  "backlog_bytes": float(s.get("backlog_bytes") or 0.0), "drops": float(s.get("drops") or 0.0)}
        try:
            self.samples.put_nowait(sample)
        except queue.Full:
            pass

    def _write(self) -> None:
        while self.stdin is not None:
            try:
                sample = self.samples.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                self.stdin.write(json.dumps(sample) + "\n")
                self.stdin.flush()
            except (OSError, ValueError, AttributeError):
                return

    def close(self) -> None:
        self.stdin = None


def _progress_table(live: _Live, t_s: float, scenario: Scenario, plan: ServingPlan, scale: float) -> Any:
    from rich.table import Table

    r = live.router or {}
    table = Table(title=f"prfaas run {scenario.name}  ({plan.compute} compute, scale {scale:g})", show_header=False)
    if live.start_s is None:
        table.add_row("t", f"{t_s:6.1f} s: starting workers, router and client")
    else:
        table.add_row("t", f"{t_s - live.start_s:6.1f} s of {scenario.duration_s:g} s of workload")
    table.add_row("requests", f"{live.done} done ({live.ok} ok, {live.done - live.ok} failed) / {live.sent} sent / {live.total}")
    table.add_row("WAN egress", f"{units.format_rate(live.egress_bps)} of {units.format_rate(live.capacity_bps)} (emulated)")
    t = r.get("threshold")
    table.add_row("policy", f"{r.get('policy', '?')}   threshold t = {f'{t:,.0f} tokens' if t is not None else 'inf'}")
    queues = {}
    for x in r.get("instances", []):
        key = f"{x['cluster']}-{x['role']}"
        queues[key] = queues.get(key, 0) + int(x.get("inflight") or 0)
    table.add_row("in flight", "  ".join(f"{k}: {v}" for k, v in sorted(queues.items())) or "-")
    if live.faults:
        table.add_row("faults", "; ".join(live.faults))
    return table


def run_scenario(scenario: Scenario, out_dir: Path, *, progress: bool = True, run_id: str | None = None) -> Path:
    """Run one scenario and write its run directory; returns `out_dir`. Raises `UserError` on bad input
    (before anything starts) and `HostError` when the host cannot run it."""
    from testbed.net.emulation import Network
    from traffic.workload import generate

    plan = plan_run(scenario)
    if os.geteuid() != 0:
        raise HostError("prfaas run needs root (network namespaces, qdiscs): run it with sudo")
    spec = plan.spec
    workload = scenario.section("workload")
    requests = generate(workload, scenario.seed, scenario.duration_s)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir / "work"
    if work.exists():
        shutil.rmtree(work)
    (work / "logs").mkdir(parents=True)
    _write_requests(requests, work / "requests.jsonl")
    live = _Live(total=len(requests))
    env_info: dict[str, Any] = {}
    from testbed.fidelity import RunFidelity

    run_id = run_id or out_dir.resolve().name
    with Network(scenario, telemetry_path=out_dir / "link.parquet", run_id=run_id, run_dir=out_dir) as net:
        scale = float(net.scale)
        resolved = _resolved(scenario.with_scale(scale), plan)
        (out_dir / "scenario.yaml").write_text(dump_scenario(resolved))
        t0 = float(net.t0_s or clock.now_s())
        old_t0 = os.environ.get(clock.T0_ENV)
        os.environ[clock.T0_ENV] = repr(t0)  # inherited by every process of the run
        if getattr(net, "schedule", None) is not None:
            net.schedule.stop()  # restarted at the workload's start (_restart_schedule)
        procs = _Processes(net, work / "logs", t0)
        relay = _TelemetryRelay(live, net.scale)
        cross: list[Any] = []
        fidelity = RunFidelity(net, work / "timing-probe.json")
        try:
            calibration = _measure_rtt(net, fidelity, plan)
            for inst in plan.instances:
                cfg = _worker_config(inst, plan, scenario, scale, work)
                procs.start(inst.name, inst.host, _python() + ["testbed.serving.worker", "--role", inst.role, "--config", str(cfg)])
            _wait_ready(procs, plan, work, spec.startup_timeout_s)
            rcfg = _router_config(plan, scenario, net, scale, work)
            procs.start("router", "pd-router", _python() + ["testbed.serving.router", "--config", str(rcfg), "--out", str(work / "router")])
            agent_cfg = work / "loadgen.json"
            closed = workload.closed_loop
            agent_cfg.write_text(json.dumps({
                "router_host": net.host_ip("pd-router"), "router_port": ROUTER_PORT, "requests_file": str(work / "requests.jsonl"),
                "out_file": str(work / "client.jsonl"), "model": scenario.section("model").name,
                "request_timeout_s": spec.request_timeout_s, "startup_timeout_s": spec.startup_timeout_s,
                "closed_users": closed.users if closed else 0, "think_s": closed.think_s if closed else 1.0,
                "duration_s": scenario.duration_s, "seed": scenario.seed}))
            agent = procs.start("loadgen", "pd-client", _python() + ["testbed.serving.loadgen", "--config", str(agent_cfg)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            relay.attach(agent.stdin)
            threading.Thread(target=_read_agent, args=(agent.stdout, live), daemon=True).start()
            net.add_telemetry_listener(relay)

            def on_start(start_abs_s: float) -> None:
                _restart_schedule(net, scenario, start_abs_s)
                fidelity.workload_started()
                procs.start("timing-probe", "pd-client", fidelity.probe.argv())
                if scenario.section("cross_traffic") is not None:
                    from traffic.cross import CrossTraffic

                    cross.append(CrossTraffic(scenario.section("cross_traffic").scaled(scale), net.popen, net.host_ip, out_dir=work))
                    cross[-1].start()

            _drive(scenario, plan, procs, live, agent, t0, scale, progress, on_start)
            procs.stop(["timing-probe"], grace_s=2.0)
            fidelity.workload_ended()
            env_info = {"network": net.describe(), "workload_start_s": live.start_s, "rtt": calibration,
                        "run_id": run_id, "fidelity": fidelity.record()}
        finally:
            relay.close()
            for c in cross:
                c.stop()
            procs.stop(["loadgen"], grace_s=2.0)
            procs.stop(["router"])  # the router writes scheduler.parquet on SIGTERM
            procs.close()
            if old_t0 is None:
                os.environ.pop(clock.T0_ENV, None)
            else:
                os.environ[clock.T0_ENV] = old_t0
    _collect(out_dir, work, resolved, plan, requests, scale, env_info)
    if live.error and not live.started:
        raise HostError(f"the run did not start its workload: {live.error} (logs: {work / 'logs'})")
    return out_dir


def _measure_rtt(net: Any, fidelity: Any, plan: ServingPlan) -> dict[str, Any] | None:
    """Configured vs measured WAN round trip (20 pings, decode host -> a PrfaaS prefill host) and
    PrfaaS -> PD goodput on the idle network, before any worker starts: the run's own check that the
    emulated WAN is what was asked (testbed.fidelity)."""
    dst = next((i.host for i in plan.instances if i.role == "decode"), None)
    src = next((i.host for i in plan.instances if i.cluster == "prfaas"), None)
    if src is None or dst is None:
        return None
    w = fidelity.measure_wan(src, dst)
    return {"path": w["path"], "configured_s": w["configured_rtt_s"], "p50_s": w["rtt_p50_s"], "p99_s": w["rtt_p99_s"],
            "replies": w["ping_replies"], "count": w["pings"]}


def _resolved(scenario: Scenario, plan: ServingPlan) -> Scenario:
    """The scenario as run: overrides applied, `scale` and the serving plan's choices (compute mode,
    profiles, instance counts) written out, so the file parses back to the same run."""
    from dataclasses import replace

    raw = dict(scenario.raw)
    serving = dict(raw.get("serving") or {})
    serving["compute"] = plan.compute
    serving["profiles"] = dict(plan.profiles)
    serving["instances"] = {role: sum(1 for i in plan.instances if (i.cluster, i.role) == key)
                            for role, key in (("prfaas_prefill", ("prfaas", "prefill")), ("pd_prefill", ("pd", "prefill")),
                                              ("pd_decode", ("pd", "decode")))}
    raw["serving"] = serving
    return replace(scenario, raw=raw)


def _restart_schedule(net: Any, scenario: Scenario, start_s: float) -> None:
    """Run the scenario's WAN schedule from the workload's start (absolute `testbed.clock` time)."""
    from testbed.net.schedule import ScheduleRunner, expand_schedule

    if net.wan is not None and scenario.wan.schedule:
        net.schedule = ScheduleRunner(expand_schedule(scenario.wan.schedule), net.wan.apply, start_s).start()


def _drive(scenario: Scenario, plan: ServingPlan, procs: _Processes, live: _Live, agent: subprocess.Popen,
           t0: float, scale: float, progress: bool, on_start: Any) -> None:
    """Wait for the workload to finish (or the run's deadline), firing faults (timed from the workload's
    start) and refreshing progress."""
    from contextlib import nullcontext

    from rich.live import Live

    spec = plan.spec
    faults = sorted(spec.faults, key=lambda f: f.at_s)
    deadline = t0 + scenario.duration_s + spec.startup_timeout_s + spec.drain_s + spec.request_timeout_s
    display = Live(_progress_table(live, 0.0, scenario, plan, scale), refresh_per_second=4, transient=False) if progress else nullcontext()
    with display:
        started = False
        while agent.poll() is None:
            now = clock.now_s()
            if live.start_s is not None and not started:
                started = True
                on_start(t0 + live.start_s)
            while started and faults and now - t0 - live.start_s >= faults[0].at_s:
                f = faults.pop(0)
                name = f"{f.role}{f.instance}"
                p = procs.procs.get(name)
                if p is not None and p.poll() is None:
                    p.kill()
                live.faults.append(f"{f.action} {name} at {now - t0:.1f}s (workload {now - t0 - live.start_s:.1f}s)")
            router = procs.procs.get("router")
            if router is not None and router.poll() is not None:
                live.error = f"the router exited (status {router.returncode}): {procs.log_tail('router')}"
                break
            if now > deadline:
                live.error = live.error or f"run deadline ({deadline - t0:.0f}s after start) reached; stopping"
                break
            if progress:
                display.update(_progress_table(live, now - t0, scenario, plan, scale))
            threading.Event().wait(0.25)
    if live.error and not live.finished:
        print(f"prfaas run: {live.error}", file=sys.stderr)


# ----------------------------------------------------------------------------------------------- collect


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def requests_frame(requests: list[Any], router_rows: list[dict[str, Any]], client_rows: list[dict[str, Any]]) -> Any:
    """One row per generated request: the router's record, what the client saw, and a failed row with
    the reason for a request that never got an answer."""
    import pandas as pd

    from testbed.serving.router import RECORD_COLUMNS

    by_router = {str(r["request_id"]): r for r in router_rows}
    by_client = {str(r["request_id"]): r for r in client_rows}
    rows = []
    for req in requests:
        rid = req.request_id
        row = dict.fromkeys(RECORD_COLUMNS)
        row.update(request_id=rid, input_len=req.input_len, output_len=req.output_len, status="failed")
        row.update({k: v for k, v in by_router.get(rid, {}).items() if v is not None})
        c = by_client.get(rid)
        if c is not None:
            row.update({k: v for k, v in c.items() if k != "request_id" and k != "route"})
            if row.get("arrival_s") is None:
                row["arrival_s"] = c["client_arrival_s"]
            if rid not in by_router:
                row["reason"] = c.get("client_reason") or "the router kept no record"
        elif rid not in by_router:
            row["reason"] = "not sent before the run ended"
        row["scheduled_arrival_s"] = req.arrival_s
        row["session_id"] = req.session_id
        rows.append(row)
    df = pd.DataFrame(rows)
    for col in ("arrival_s", "prefill_start_s", "prefill_end_s", "transfer_start_s", "transfer_end_s", "first_token_s",
                "finish_s", "threshold", "client_arrival_s", "client_first_token_s", "client_finish_s", "scheduled_arrival_s"):
        if col in df:
            df[col] = pd.to_numeric(df[col], errors="coerce").astype(float)
    for col in ("cached_len", "uncached_len", "kv_bytes", "wire_bytes", "prefill_instance", "decode_instance",
                "tokens_received", "cache_transfer_tokens", "session_id"):
        if col in df:
            df[col] = pd.to_numeric(df[col], errors="coerce").astype("Int64")
    for col in ("route", "status", "reason", "route_reason", "client_status", "client_reason", "text"):
        if col in df:
            df[col] = df[col].astype("string")
    return df


def _environment(plan: ServingPlan, scenario: Scenario, scale: float, env_info: dict[str, Any]) -> dict[str, Any]:
    import torch

    from testbed.net.emulation import host_capacity_bps

    cap, cap_source = host_capacity_bps()
    model = scenario.section("model")
    return {
        "host": {"hostname": socket.gethostname(), "cpus": os.cpu_count(), "python": platform.python_version(),
                 "platform": platform.platform()},
        "kernel": platform.release(),
        "backends": {"wan": env_info.get("network", {}).get("backend"), "shaper": scenario.wan.shaper,
                     "torch": torch.__version__, "cuda": torch.cuda.is_available()},
        "calibration": {"capacity_bps": cap, "capacity_source": cap_source, "wan_rtt": env_info.get("rtt")},
        "compute": {"mode": plan.compute, "profiles": dict(plan.profiles) if plan.compute == "profile" else None,
                    "model": model.name, "variant": model.variant if plan.compute == "torch" else None,
                    "device": model.device if plan.compute == "torch" else None},
        "scale": scale,
        "run_id": env_info.get("run_id"),
        "t0": "all times are seconds after the network's start (PRFAAS_T0); the WAN schedule and faults count from workload_start_s",
        "workload_start_s": env_info.get("workload_start_s"),
        "network": env_info.get("network"),
        "instances": [{"role": i.role, "instance": i.index, "cluster": i.cluster, "host": i.host, "port": i.port,
                       "kv_port": i.kv_port} for i in plan.instances],
        "serving": {"bs_max": plan.spec.bs_max, "kv_connections": plan.spec.kv_connections,
                    "kv_timeout_s": plan.spec.kv_timeout_s, "request_timeout_s": plan.spec.request_timeout_s},
    }


def _collect(out_dir: Path, work: Path, scenario: Scenario, plan: ServingPlan, requests: list[Any], scale: float,
             env_info: dict[str, Any]) -> None:
    import pandas as pd

    from analysis.metrics import summarize
    from testbed.serving.policy import SchedulerLog

    router_dir = work / "router"
    router_rows = pd.read_parquet(router_dir / "router_requests.parquet").to_dict("records") if (router_dir / "router_requests.parquet").exists() else []
    df = requests_frame(requests, router_rows, _read_jsonl(work / "client.jsonl"))
    if plan.compute != "torch" and "text" in df:
        df = df.drop(columns=["text"])
    df.to_parquet(out_dir / "requests.parquet", index=False)
    if (work / "cross_traffic.parquet").exists():
        shutil.copy(work / "cross_traffic.parquet", out_dir / "cross_traffic.parquet")
    sched = router_dir / "scheduler.parquet"
    if sched.exists():
        shutil.copy(sched, out_dir / "scheduler.parquet")
    else:
        SchedulerLog().to_frame().to_parquet(out_dir / "scheduler.parquet")
    link = pd.read_parquet(out_dir / "link.parquet") if (out_dir / "link.parquet").exists() else None
    if link is None:
        pd.DataFrame({"t_s": pd.Series([], dtype=float), "direction": pd.Series([], dtype="string")}).to_parquet(out_dir / "link.parquet")
    (out_dir / "environment.json").write_text(json.dumps(_environment(plan, scenario, scale, env_info), indent=1, default=str))
    scheduler = pd.read_parquet(out_dir / "scheduler.parquet")
    summary = summarize(df, link, scale=scale, policy=scenario.section("policy").name, model=scenario.section("model").name,
                        duration_s=None, scheduler=scheduler)
    summary["signals"] = scenario.section("policy").signals  # "oracle" runs were told the emulator's ground truth
    summary["compute"] = plan.compute
    from testbed.fidelity import FIDELITY_FILE, summary_fields

    record = env_info.get("fidelity")
    if record is not None:
        (out_dir / FIDELITY_FILE).write_text(json.dumps(record, indent=1, default=str))
        summary.update(summary_fields(record))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
