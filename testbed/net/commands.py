"""Subcommands of the network area: doctor, net up/exec/down, clean, calibrate."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from testbed.atomic import write_json
from testbed.errors import HostError, UserError
from testbed.net.calibrate import RATE_OMIT_S
from testbed.validation import at_most, option, output_file_option, positive_number
from traffic.cross import IPERF3_MAX_T_S, stream_count

DETACHED_ENV = "PRFAAS_NET_DETACHED"  # set for the process `prfaas net up --detach` starts: its log is `state.net_up_log`
DETACH_START_TIMEOUT_S = 120.0  # for a detached network to come up
DETACH_STOP_TIMEOUT_S = 60.0  # for an unwanted detached network's teardown (`_stop_detached`)


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("doctor", help="what this host supports and which WAN backend a run would use")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_doctor)

    net = sub.add_parser("net", help="bring up only the network of a scenario, run commands in its hosts, tear it down")
    nsub = net.add_subparsers(dest="net_command", metavar="{up,exec,down}")
    up = nsub.add_parser("up", help="bring up the two datacenters and the WAN (Ctrl-C or `prfaas net down` ends it)")
    up.add_argument("scenario", help="scenario file or ready scenario name (e.g. net-default)")
    up.add_argument("--detach", action="store_true", help="return once the network is up; it runs until `prfaas net down`")
    up.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a scenario field, e.g. wan.rate=20Gbps")
    up.add_argument("--telemetry", type=output_file_option, metavar="FILE", help="write the WAN telemetry (parquet) here when the network stops")
    up.set_defaults(func=cmd_net_up)
    ex = nsub.add_parser("exec", help="run a command inside a host of the running network: net exec HOST -- CMD...")
    ex.add_argument("host", help="a host of the network, e.g. pd-d0 or prfaas-p0 (`prfaas net up` lists them)")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...", help="the command to run in that host's namespace")
    ex.add_argument("--id", dest="net_id", help="which network (tag or owner pid) when several run")
    ex.set_defaults(func=cmd_net_exec)
    down = nsub.add_parser("down", help="tear down the network `prfaas net up` holds (another command's only when named with --id)")
    down.add_argument("--id", dest="net_id", help="which network (tag or owner pid) when several run")
    down.set_defaults(func=cmd_net_down)
    net.set_defaults(func=lambda a: (net.print_help(), 2)[1])

    c = sub.add_parser("clean", help="remove what a crashed or killed run left behind (namespaces, bridges, processes, sysctls)")
    c.add_argument("run", nargs="?", metavar="RUN_ID", help="only this run's leftovers: its run id or run directory (environment.json's run_id)")
    c.add_argument("--all", action="store_true", help="also stop networks whose owner process is still running")
    c.add_argument("--json", action="store_true", help="print what was removed and what was left as JSON")
    c.set_defaults(func=cmd_clean)

    cal = sub.add_parser("calibrate", help="configured vs achieved WAN rate, RTT and loss on this host")
    cal.add_argument("scenario", nargs="?", default="net-default", help="scenario file or ready scenario name (default net-default)")
    cal.add_argument("--json", dest="json_file", type=output_file_option, metavar="FILE", help="write the figures as JSON")
    cal.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a scenario field, e.g. wan.rate=20Gbps")
    cal.add_argument("--streams", type=option(stream_count, whole=True), default=4, help="iperf3 -P (1 to 128; default 4)")
    # iperf3 runs -t ceil(omit + duration), at most its own limit: a larger one was passed to iperf3, which refused it
    # in the middle of the calibration (86400 did, as -t 86401, from 2026-12-07's -t without -O until the same day)
    longest_s = IPERF3_MAX_T_S - RATE_OMIT_S
    cal.add_argument("--duration", type=option(at_most(positive_number, longest_s, "s", f"iperf3's longest run ({IPERF3_MAX_T_S} s) "
                                                       f"less the {RATE_OMIT_S} s omit")), default=5.0,
                     help=f"seconds per iperf3 run (at most {longest_s}: iperf3's own limit less the {RATE_OMIT_S} s of slow start left out)")
    cal.set_defaults(func=cmd_calibrate)


# ------------------------------------------------------------------------------------------------ doctor


def cmd_doctor(args: argparse.Namespace) -> int:
    from testbed.net import doctor

    rep = doctor.report()
    if args.json:
        print(json.dumps(rep, indent=1))
    else:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"prfaas doctor: kernel {rep['kernel']}, {rep['cpus']} CPUs")
        t.add_column("check")
        t.add_column("")
        t.add_column("detail")
        for c in rep["checks"]:
            mark = "[green]ok[/]" if c["ok"] else ("[red]missing[/]" if c["required"] else "[yellow]absent[/]")
            t.add_row(c["name"], mark, c["detail"])
        con = Console()
        con.print(t)
        con.print(f"WAN backend a run would use (wan.backend: auto): [bold]{rep['backend_auto']}[/]")
        par = rep["parallelism"]
        con.print(f"parallel runs this host keeps time for: [bold]--executor local:{par['suggested']}[/] "
                  f"({par['cpus']} cores, about {par['cores_per_run']:g} per run; capacity {par['capacity_bps'] / 1e9:g} Gbps "
                  f"from {par['capacity_source']}, shared by parallel runs)")
        if rep["missing"]:
            con.print(f"[red]not ready:[/] {', '.join(rep['missing'])}")
        con.print(f"next: {rep['next']}", highlight=False, markup=False, soft_wrap=True)
    return 0 if rep["ready"] else 1


# -------------------------------------------------------------------------------------------------- net


def _describe_table(desc: dict[str, Any]) -> Any:
    from rich.table import Table

    from testbed.units import format_bytes, format_duration, format_rate

    t = Table(title=f"WAN: backend {desc['backend']} ({desc['backend_reason']}), shaper {desc['shaper']}, scale {desc['scale']:g} ({desc['scale_source']}), "
              f"offloads {desc['offloads']}")
    for col in ("direction", "rate emulated (wire)", "delay", "jitter", "loss", "queue (wire)"):
        t.add_column(col)
    for name, d in desc["directions"].items():
        t.add_row(name, f"{format_rate(d['rate_emulated_bps'])} ({format_rate(d['rate_wire_bps'])})", format_duration(d["delay_s"]),
                  f"{format_duration(d['jitter_s'])} {d['jitter_distribution']}" if d["jitter_s"] else "-",
                  f"{d['loss_mean']:.3%} {d['loss_model']}", f"{d['queue']} ({format_bytes(d['queue_wire_bytes'])})")
    return t


def cmd_net_up(args: argparse.Namespace) -> int:
    from testbed.sections import load_scenario

    scenario = load_scenario(args.scenario, args.overrides)  # refuses bad input before anything starts
    if args.detach:
        return _detach(args)
    from rich.console import Console

    from testbed.net import state
    from testbed.net.emulation import Network

    con = Console()
    with con.status("bringing up the network"):
        net = Network(scenario, telemetry_path=args.telemetry, held_by=state.NET_UP).start()
    try:
        con.print(_describe_table(net.describe()))
        hosts = ", ".join(f"{h} {ip}" for h, ip in sorted(net.addresses.items()))
        con.print(f"hosts: {hosts}")
        con.print("up. `prfaas net exec HOST -- CMD` from another terminal; Ctrl-C or `prfaas net down` ends it.")
        sys.stdout.flush()
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        net.stop()
        if os.environ.pop(DETACHED_ENV, None) and not net.teardown_errors:  # a clean stop leaves no log behind
            state.net_up_log(os.getpid()).unlink(missing_ok=True)
    return 0


def _detach(args: argparse.Namespace) -> int:
    """Start `prfaas net up` in a process of its own session and return once its network is up. Stopped here (SIGTERM,
    its teardown waited for) when this command ends first: Ctrl-C while it came up said "interrupted; cleaned up" and
    left the network running, held by the detached process."""
    from testbed.cli import USER_ERROR_EXIT
    from testbed.net import state

    argv = [sys.executable, "-m", "testbed.cli", "net", "up", str(args.scenario)]
    for o in args.overrides:
        argv += ["--set", o]
    if args.telemetry:
        argv += ["--telemetry", str(args.telemetry.resolve())]
    state.STATE_DIR.mkdir(parents=True, exist_ok=True)
    starting = state.net_up_log(os.getpid())  # this process's name for it until the detached process runs
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
    env[DETACHED_ENV] = "1"
    with open(starting, "w") as fh:
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    log = state.net_up_log(child.pid)
    os.replace(starting, log)
    try:
        deadline = time.monotonic() + DETACH_START_TIMEOUT_S
        while time.monotonic() < deadline:
            for _, d in state.list_states():
                if d.get("owner_pid") == child.pid and d.get("ready"):
                    print(f"network {d['tag']} up (pid {child.pid}; log {log}); `prfaas net down` ends it")
                    return 0
            if child.poll() is not None:
                lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
                said = lines[-1].removeprefix("prfaas net up: error: ") if lines else f"net up exited with status {child.returncode}"
                if child.returncode == USER_ERROR_EXIT:  # its one line says it all; the log goes (`_stop_detached`)
                    raise UserError(said)
                raise HostError(f"{said} (the detached net up's whole output: {log})")  # kept: it was left unnamed
            time.sleep(0.1)
        raise HostError(f"the network did not come up within {DETACH_START_TIMEOUT_S:g} s (log {log})")
    except BaseException:
        _stop_detached(child, log)
        raise


def _stop_detached(child: subprocess.Popen, log: Path) -> None:
    """SIGTERM to a detached `net up` that is not wanted (still starting, or failed), and wait for its teardown; its log
    goes when it ended as asked (interrupted, cleaned up) or on a user error (exit 2, its line already said); after any
    other failure it stays, named in the refusal."""
    if child.poll() is None:
        child.terminate()
    try:
        child.wait(timeout=DETACH_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return  # still tearing down: `prfaas net down --id TAG` or `prfaas clean` ends it
    from testbed.cli import INTERRUPTED_EXIT, USER_ERROR_EXIT

    if child.returncode in (INTERRUPTED_EXIT, USER_ERROR_EXIT):  # it ended as asked, or on a user error whose one line was passed on
        log.unlink(missing_ok=True)


def _find_network(net_id: str | None, *, net_up_only: bool = False) -> dict[str, Any]:
    """The one running network named by ``--id`` (its tag or owner pid), or the only one running. With `net_up_only`
    and no ``--id``, only a network `prfaas net up` holds is a candidate: another is a run's or a test's, whose owner
    a SIGTERM would end (`prfaas net down` ended a test suite's run, 2026-12-07)."""
    from testbed.net import state

    alive = [d for _, d in state.live_states()]
    if net_id:
        alive = [d for d in alive if net_id in (str(d.get("tag")), str(d.get("owner_pid")))]
    live = [d for d in alive if d.get("ready")]
    if net_id and alive and not live:  # it said "no network is running with id X" of one coming up
        raise UserError(f"network {_describe_network(alive[0])} is still coming up; run this again once `prfaas net up` "
                        "says it is up (or stop that command: its Ctrl-C stops what it started)")
    others = []
    if net_up_only and not net_id:
        others = [d for d in live if d.get("held_by") != state.NET_UP]
        live = [d for d in live if d.get("held_by") == state.NET_UP]
    if not live and others:
        ids = ", ".join(_describe_network(d) for d in others)
        raise UserError(f"no network from `prfaas net up` is running; running: {ids}, held by another command (a run, "
                        f"a test, calibrate, or a `prfaas net up` started before 2026-12-07, which did not record it), "
                        f"which stopping its network would end; stop that command, or name the "
                        f"network with --id to stop it here")
    if not live:
        raise UserError("no network is running" + (f" with id {net_id}" if net_id else "") + " (start one with `prfaas net up SCENARIO --detach`)")
    if len(live) > 1:
        ids = ", ".join(_describe_network(d) for d in live)
        raise UserError(f"several networks run: {ids}; choose one with --id")
    return live[0]


def _describe_network(d: dict[str, Any]) -> str:
    run = f", run {d['run_id']}" if d.get("run_id") else ""
    return f"{d['tag']} ({d.get('scenario')}{run}, pid {d['owner_pid']})"


def cmd_net_exec(args: argparse.Namespace) -> int:
    from testbed.net import state

    cmd = list(args.cmd)
    while cmd[:1] == ["--id"] and len(cmd) >= 2:  # `net exec HOST --id X -- CMD`: the remainder swallowed it
        args.net_id, cmd = cmd[1], cmd[2:]
    cmd = cmd[1:] if cmd[:1] == ["--"] else cmd
    if not cmd:
        raise UserError("give a command after --, e.g. prfaas net exec pd-d0 -- ip addr")
    d = _find_network(args.net_id)
    hosts = d.get("hosts", {})
    if args.host not in hosts:
        raise UserError(f"no host {args.host!r}; hosts: {', '.join(sorted(hosts))}")
    pid, cookie = hosts[args.host]["pid"], hosts[args.host].get("netns_cookie")
    # the host's shell is the way into its namespace: where it has gone (the network stopping), its pid may be another
    # process's, and mnexec would run CMD in that process's namespace, the host's own one if it is in the root namespace
    if cookie is not None and state.netns_cookie(pid) != cookie:
        raise HostError(f"host {args.host}'s shell (pid {pid}) is no longer in the namespace the network "
                        f"recorded; network {d['tag']} is stopping or was killed (`prfaas net down`, `prfaas clean`)")
    return subprocess.call(["mnexec", "-a", str(pid), *cmd])


def cmd_net_down(args: argparse.Namespace) -> int:
    from testbed.net import cleanup, state

    d = _find_network(args.net_id, net_up_only=True)
    pid = int(d["owner_pid"])
    if d.get("owner_start") is None:
        raise UserError(f"network {d['tag']}: its state file records no start time of its owner (owner_start), so pid {pid} "
                        f"cannot be told from another process that took the number; stop the network from its terminal, or "
                        f"`kill {pid}` once you are sure it is it, then `prfaas clean`")
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:  # it ended meanwhile
        pass
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and state.is_alive(pid, d.get("owner_start")):
        time.sleep(0.1)
    if state.is_alive(pid, d.get("owner_start")):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    _print_clean_notes(cleanup.clean(network=state.state_path(pid, d["tag"])))  # its own leftovers only
    print(f"network {d['tag']} down")
    return 0


def cmd_clean(args: argparse.Namespace) -> int:
    """Exit status 1 when something was left that `clean` would have removed (`CleanReport.not_cleaned`: a damaged
    state file that may be a live network's, an owner it cannot identify, saved sysctls it could not restore), each
    said in one line on stderr; else 0."""
    from testbed.net import cleanup

    rep = cleanup.clean(include_live=args.all, run=args.run)
    if args.json:
        print(json.dumps(rep.as_dict(), indent=1))
    elif rep.nothing:
        print("nothing to clean" + (f" for run {args.run}" if args.run else "")
              + (f"; still running: {'; '.join(rep.skipped_live)} (use --all to stop them)" if rep.skipped_live and not args.all else ""))
    else:
        leftovers = f", delay-line leftovers {rep.delayline_leftovers}" if rep.delayline_leftovers else ""  # dirs, rules
        print(f"removed: {len(rep.networks)} network(s), {len(rep.processes)} process(es), bridges {rep.bridges or '-'}"
              f"{leftovers}, restored sysctls {rep.sysctls or '-'}")
    if not args.json:
        _print_clean_notes(rep)
    return 1 if rep.not_cleaned else 0


def _print_clean_notes(rep: Any) -> None:
    """What `clean` removed of a damaged state file and what it left (`CleanReport`), a line each on stderr."""
    for line in rep.damaged:
        print(f"prfaas: note: {line}", file=sys.stderr)
    for line in rep.not_cleaned:
        print(f"prfaas: not cleaned: {line}", file=sys.stderr)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from testbed.net.calibrate import calibrate, print_table
    from testbed.net.emulation import Network
    from testbed.sections import load_scenario

    scenario = load_scenario(args.scenario, args.overrides)  # --json: output_file_option, before the network
    con = Console()
    with con.status("bringing up the network") as status:
        with Network(scenario) as net:
            cal = calibrate(net, streams=args.streams, duration_s=args.duration, progress=lambda m: status.update(m))
            desc = net.describe()
    print_table(cal, con)
    if args.json_file:
        write_json(args.json_file, {"calibration": cal.as_dict(), "network": desc}, indent=1)
        con.print(f"wrote {args.json_file}")
    return 0
