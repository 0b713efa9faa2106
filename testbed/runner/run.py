"""One complete run: network up -> workers and router up in their hosts -> workload -> collect -> down.

`run_scenario` checks the scenario first (nothing starts on bad input), brings up the scenario's
network (`testbed.net.emulation.Network`), starts one worker process per instance on its host, the
router on ``pd-router`` and the client agent (`testbed.serving.loadgen`) on ``pd-client``
(`testbed.runner.supervisor`), relays WAN telemetry to the router (`testbed.runner.relay`), injects the
scenario's faults (`testbed.runner.faults`), shows live progress (`testbed.runner.live`), and always
tears everything down (``finally``). It then writes the raw run directory (`testbed.runner.collect`,
`testbed.rundir`). Every timestamp is `testbed.clock` time relative to the network's start
(``PRFAAS_T0``, as in link.parquet). The WAN schedule and the faults count from the workload's start
(once every process is up), so a dip at 12 s hits the traffic 12 s in on any host.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from testbed import clock, rundir
from testbed.errors import HostError
from testbed.runner import configs
from testbed.runner.collect import collect
from testbed.runner.faults import FaultInjector
from testbed.runner.live import LiveState, progress_table, read_agent
from testbed.runner.relay import TelemetryRelay
from testbed.runner.supervisor import Processes, python_module, wait_ready
from testbed.scenario import Scenario, dump_scenario
from testbed.serving.config import ServingPlan, plan_run


def run_scenario(scenario: Scenario, out_dir: Path, *, progress: bool = True, run_id: str | None = None) -> Path:
    """Run one scenario and write its raw run directory (no summary.json: ``experiments.runs.run_once``
    adds it); returns `out_dir`. `run_id` (default: the run directory's name) keys the run's host-global
    resources (docs/scale-out.md). Raises `UserError` on bad input (before anything starts) and
    `HostError` when the host cannot run it."""
    from testbed.fidelity import RunFidelity
    from testbed.net.emulation import Network
    from traffic.workload import generate

    plan = plan_run(scenario)
    if os.geteuid() != 0:
        raise HostError("prfaas run needs root (network namespaces, qdiscs): run it with sudo")
    spec = plan.spec
    requests = generate(scenario.section("workload"), scenario.seed, scenario.duration_s)
    out = rundir.RunDirWriter(out_dir)
    work = out.work
    if work.exists():
        shutil.rmtree(work)
    (work / "logs").mkdir(parents=True)
    configs.write_requests(requests, work / "requests.jsonl")
    live = LiveState(total=len(requests))
    env_info: dict[str, Any] = {}
    run_id = run_id or out.path.resolve().name
    with Network(scenario, telemetry_path=out.path / rundir.LINK_FILE, run_id=run_id, run_dir=out.path) as net:
        scale = float(net.scale)
        resolved = resolved_scenario(scenario, plan, scale)
        out.scenario(dump_scenario(resolved))
        t0 = float(net.t0_s or clock.now_s())
        old_t0 = os.environ.get(clock.T0_ENV)
        os.environ[clock.T0_ENV] = repr(t0)  # inherited by every process of the run
        if getattr(net, "schedule", None) is not None:
            net.schedule.stop()  # restarted at the workload's start (_restart_schedule)
        procs = Processes(net, work / "logs", t0)
        relay = TelemetryRelay(live, net.scale)
        cross: list[Any] = []
        fidelity = RunFidelity(net, work / "timing-probe.json")
        try:
            calibration = _measure_rtt(net, fidelity, plan)
            if scenario.section("cross_traffic") is not None:  # before any traffic (CrossTraffic numbers the same ports)
                for src, dst, port in scenario.section("cross_traffic").open_loop_udp():
                    net.pass_open_loop_udp(src, dst, port)
            for inst in plan.instances:
                cfg = configs.worker_config(inst, plan, scenario, scale, work)
                procs.start(inst.name, inst.host, python_module() + ["testbed.serving.worker", "--role", inst.role, "--config", str(cfg)])
            wait_ready(procs, plan, work, spec.startup_timeout_s)
            rcfg = configs.router_config(plan, scenario, net, scale, work)
            procs.start("router", "pd-router", python_module() + ["testbed.serving.router", "--config", str(rcfg), "--out", str(work / "router")])
            agent_cfg = configs.loadgen_config(plan, scenario, net, work)
            agent = procs.start("loadgen", "pd-client", python_module() + ["testbed.serving.loadgen", "--config", str(agent_cfg)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            relay.attach(agent.stdin)
            threading.Thread(target=read_agent, args=(agent.stdout, live), daemon=True).start()
            net.add_telemetry_listener(relay)

            def on_start(start_abs_s: float) -> None:
                _restart_schedule(net, scenario, start_abs_s)
                fidelity.workload_started()
                procs.start("timing-probe", "pd-client", fidelity.probe.argv())
                if scenario.section("cross_traffic") is not None:
                    from traffic.cross import CrossTraffic

                    cross.append(CrossTraffic(scenario.section("cross_traffic").scaled(scale), net.popen, net.host_ip, out_dir=work))
                    cross[-1].start()

            title = f"prfaas run {scenario.name}  ({plan.compute} compute, scale {scale:g})"
            _drive(scenario, plan, procs, live, agent, t0, title if progress else None, on_start)
            procs.stop(["timing-probe"], grace_s=2.0)
            fidelity.workload_ended()
            env_info = {"network": net.describe(), "workload_start_s": live.start_s, "rtt": calibration,
                        "run_id": run_id, "fidelity": fidelity.record(), "error": live.error}
        finally:
            relay.close()
            for c in cross:
                c.stop()
            env_info["cross_traffic_errors"] = [e for c in cross for e in c.errors]  # judged by timing fidelity
            env_info["cross_traffic_notes"] = [n for c in cross for n in c.notes]
            procs.stop(["loadgen"], grace_s=2.0)
            procs.stop(["router"])  # the router writes scheduler.parquet on SIGTERM
            procs.close()
            if old_t0 is None:
                os.environ.pop(clock.T0_ENV, None)
            else:
                os.environ[clock.T0_ENV] = old_t0
    collect(out, plan, resolved, requests, scale, env_info)
    if live.error and not live.started:
        raise HostError(f"the run did not start its workload: {live.error} (logs: {work / 'logs'})")
    return out.path


def _measure_rtt(net: Any, fidelity: Any, plan: ServingPlan) -> dict[str, Any] | None:
    """Configured vs measured WAN round trip (20 pings, decode host -> a PrfaaS prefill host) and
    PrfaaS -> PD goodput on the idle network, before any worker starts: the run's own check that the
    emulated WAN is what was asked (testbed.fidelity)."""
    dst = next((i.host for i in plan.instances if i.role == "decode"), None)
    src = next((i.host for i in plan.instances if i.cluster == "prfaas"), None)
    if src is None or dst is None:
        fidelity.no_wan("no PrfaaS prefill instance: this deployment sends no KV across the WAN")
        return None
    w = fidelity.measure_wan(src, dst)
    return {"path": w["path"], "configured_s": w["configured_rtt_s"], "p50_s": w["rtt_p50_s"], "p99_s": w["rtt_p99_s"],
            "replies": w["ping_replies"], "count": w["pings"]}


def resolved_scenario(scenario: Scenario, plan: ServingPlan, scale: float | None) -> Scenario:
    """The scenario as run: overrides applied, `scale` (the factor the run's host resolved; None keeps the scenario's
    own, ``auto`` included) and the serving plan's choices (compute mode, profiles, instance counts) written out, so
    the file parses back to the same run. The one writer of a run's scenario.yaml, which a resume compares a run
    without task.json against (`experiments.engine.scenario_as_run`)."""
    from dataclasses import replace

    if scale is not None:
        scenario = scenario.with_scale(scale)
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
    from testbed.scenario import expand_schedule

    if net.schedule is not None and scenario.wan.schedule:
        net.schedule.start(expand_schedule(scenario.wan.schedule), start_s)


def _drive(scenario: Scenario, plan: ServingPlan, procs: Processes, live: LiveState, agent: subprocess.Popen,
           t0: float, title: str | None, on_start: Callable[[float], None]) -> None:
    """Wait for the workload to finish (or the run's deadline), firing faults (timed from the workload's
    start) and refreshing the live view (none when `title` is None)."""
    from contextlib import nullcontext

    from rich.live import Live

    spec = plan.spec
    faults = FaultInjector(spec.faults)
    deadline = t0 + scenario.duration_s + spec.startup_timeout_s + spec.drain_s + spec.request_timeout_s

    def view(t_s: float) -> Any:
        return progress_table(live, t_s, title or "", scenario.duration_s)

    display = Live(view(0.0), refresh_per_second=4, transient=False) if title is not None else nullcontext()
    with display:
        started = False
        while agent.poll() is None:
            now = clock.now_s()
            if live.start_s is not None and not started:
                started = True
                on_start(t0 + live.start_s)
            if started:
                live.faults.extend(faults.fire_due(now - t0 - live.start_s, procs.procs, now - t0))
            router = procs.procs.get("router")
            if router is not None and router.poll() is not None:
                live.error = f"the router exited (status {router.returncode}): {procs.log_tail('router')}"
                break
            if now > deadline:
                live.error = live.error or f"run deadline ({deadline - t0:.0f}s after start) reached; stopping"
                break
            if title is not None:
                display.update(view(now - t0))
            threading.Event().wait(0.25)
    if live.error and not live.finished:
        print(f"prfaas run: {live.error}", file=sys.stderr)
