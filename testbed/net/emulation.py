"""`Network`: one scenario's two datacenters and WAN, up and running on this host, and torn down again.

It builds the Mininet topology (topologies/two_dc.py), gives every host its address and route, turns
the gateways into routers, sets the host sysctls a run needs (restored afterwards), starts the WAN
(testbed.net.wan), its schedule and telemetry (in a process of their own, testbed.net.wanctl), and writes a state file (testbed.net.state) so that
`prfaas net exec/down/clean` can act on it from another process. `stop()` always tears everything
down, whatever failed before; SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread while a
network runs, so `with Network(...)` cleans up on Ctrl-C, `kill` and a closed terminal alike.

Scale: wire rate = emulated rate / scale. `scale: auto` picks the smallest S that keeps every scheduled
WAN rate / S within the host's capacity: `PRFAAS_CAPACITY_BPS` if set, else `DEFAULT_CAPACITY_BPS`
(5 Gbps: what a 2-core host's delay line holds with margin; see docs/network.md).
"""

from __future__ import annotations

import atexit
import math
import os
import platform
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

from testbed import clock, units
from testbed.errors import HostError, UserError
from testbed.interrupts import raise_keyboard_interrupt
from testbed.net import offloads, shaping, state
from testbed.net.telemetry import DEFAULT_PERIOD_S
from testbed.net.wan import GatewayPort, Wan, resolve_backend
from testbed.net.wanctl import ScheduleFeed, TelemetryFeed, WanControl
from testbed.scale import Scale
from testbed.scenario import DIRECTIONS, Scenario, expand_schedule
from testbed.validation import shown

DEFAULT_CAPACITY_BPS = 5e9
HOST_TCP_MEM = "4096 131072 67108864"  # per-namespace TCP buffers: room for a 10 Gbps x 40 ms BDP
_counter = iter(range(1, 1 << 20))


CAPACITY_ENV = "PRFAAS_CAPACITY_BPS"


def host_capacity_bps() -> tuple[float, str]:
    """This host's WAN capacity and where it came from: `CAPACITY_ENV` if set, else `DEFAULT_CAPACITY_BPS`. The variable
    is bits per second (``5e9``, as `experiments.parallel` writes it) or a rate with its unit (``5Gbps``), read as every
    rate is (`units.parse_rate_bps`: 8 Kbps to 1000 Tbps); anything else is one line naming it. A bare ``float()`` read
    it until 2026-12-07: ``fast`` was a ValueError traceback in `prfaas check`, and ``nan`` passed."""
    v = os.environ.get(CAPACITY_ENV)
    if not v:
        return DEFAULT_CAPACITY_BPS, "default (5 Gbps)"
    try:
        bare = float(v)
    except ValueError:
        bare = math.nan
    try:  # a bare number is bits per second
        return units.parse_rate_bps(f"{v.strip()}bps" if math.isfinite(bare) else v), CAPACITY_ENV
    except ValueError:  # the rate reader's words quoted '-1bps', which no one typed, and spoke of the wire's shaping
        raise UserError(f"{CAPACITY_ENV}={shown(v)} is not this host's WAN capacity: give bits per second (e.g. 5e9) or a "
                        "rate with its unit (e.g. 5Gbps), from 8 Kbps to 1000 Tbps; unset, 5 Gbps") from None


def _new_tag() -> str:
    return f"{(os.getpid() * 31 + next(_counter)) & 0xFFFFF:05x}"


class Network:
    """The network of a scenario. ``with Network(sc) as net: net.run("pd-p0", ["ping", ...])``."""

    def __init__(self, scenario: Scenario, *, scale: Scale | float | None = None, telemetry_path: Path | None = None,
                 telemetry_period_s: float = DEFAULT_PERIOD_S, run_id: str | None = None, run_dir: Path | None = None,
                 held_by: str | None = None) -> None:
        self.scenario = scenario
        self.run_id = run_id  # recorded in the state file: `prfaas clean RUN_ID` removes this network only
        self.held_by = held_by  # the command holding it, recorded: `prfaas net down` stops only `net up`'s (`NET_UP`)
        self.run_dir = Path(run_dir).resolve() if run_dir is not None else None
        self.scale: Scale
        if scale is not None:
            self.scale, self.scale_source = Scale.of(scale), "given to Network()"
        elif scenario.scale == "auto":
            cap, where = host_capacity_bps()
            self.scale, self.scale_source = scenario.resolve_scale(cap), f"auto, capacity {cap / 1e9:g} Gbps from {where}"
        else:
            self.scale, self.scale_source = scenario.resolve_scale(0.0), "scenario"
        self.telemetry_path = telemetry_path
        self.telemetry_period_s = telemetry_period_s
        self.tag = _new_tag()
        self.t0_s: float | None = None
        self.net: Any = None
        self.wan: Wan | None = None
        self.control: WanControl | None = None  # the schedule and telemetry, in their own process
        self.schedule: ScheduleFeed | None = None
        self.telemetry: TelemetryFeed | None = None
        self.backend, self.backend_reason = "", ""
        self.offloads: offloads.OffloadDecision | None = None
        self.addresses: dict[str, str] = {}
        self.datacenters: dict[str, str] = {}  # host -> "prfaas" | "pd" (`topologies.two_dc.addressing`)
        self.udp_undelayed: list[str] = []  # open-loop UDP flows that skip the delay line (`pass_open_loop_udp`)
        self._listeners: list[Callable[[dict], None]] = []
        self._procs: list[subprocess.Popen] = []
        self._state_file: Path | None = None
        self._netns_inodes: set[int] = set()
        self._netns_fds: list[int] = []  # our namespaces, held open until stop() ends: their inodes stay ours
        self._old_handlers: dict[int, Any] = {}
        self._stopped = False
        self._lock = threading.Lock()
        self.teardown_errors: list[str] = []

    # ---------------------------------------------------------------------------------------- lifecycle

    def __enter__(self) -> "Network":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> "Network":
        if os.geteuid() != 0:
            raise HostError("the network needs root (network namespaces, qdiscs): run with sudo")
        self.backend, self.backend_reason = resolve_backend(self.scenario.wan.backend)
        for d in DIRECTIONS:  # refuse impossible shaping before anything exists
            shaping.plan_shaping(self.scenario.wan.direction(d), shaper=self.scenario.wan.shaper, scale=self.scale)
        self._install_signal_handlers()
        atexit.register(self.stop)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        from mininet.link import Link
        from mininet.log import setLogLevel
        from mininet.net import Mininet
        from mininet.util import fixLimits

        from topologies.two_dc import NetlinkBridge, TwoDatacenterTopo, addressing, gateway_name

        setLogLevel("warning")
        topo_spec = self.scenario.topology
        addr = addressing(topo_spec)
        self.addresses, self.datacenters = addr.ips, addr.datacenter
        with state.locked():
            self.tag = state.claim_tag(self.tag, _root_links())
            self._state_file = state.state_path(os.getpid(), self.tag)
            self._state = {
                "owner_pid": os.getpid(), "owner_start": state.process_start_ticks(os.getpid()), "tag": self.tag,
                "scenario": self.scenario.name, "source": self.scenario.source, "ready": False,
                "run_id": self.run_id, "run_dir": str(self.run_dir) if self.run_dir else None, "held_by": self.held_by,
                "bridges": list(state.bridge_names(self.tag)), "hosts": {}, "processes": [],
                "delayline_dirs": [],
            }
            state.write_state(self._state_file, self._state)
            self.sysctls_set = state.save_and_set_sysctls()
            # Mininet raises these limits once per process (Mininet.init); a network stopped earlier in this
            # process restored them, so raise them again for this one (saved above, restored by the last out).
            fixLimits()
        self.net = Mininet(topo=TwoDatacenterTopo(topo_spec, tag=self.tag), switch=NetlinkBridge, controller=None,
                           link=Link, build=False, waitConnected=False)
        self.net.build()
        for h in self.net.hosts:  # record namespaces at once, so that clean can find (inode) and know (cookie) them
            self._netns_fds.append(os.open(f"/proc/{h.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC))
            ino = os.fstat(self._netns_fds[-1]).st_ino
            self._netns_inodes.add(ino)
            self._state["hosts"][h.name] = {"pid": h.pid, "netns_inode": ino, "netns_cookie": state.netns_cookie_of_fd(self._netns_fds[-1]),
                                            "ip": self.addresses.get(h.name)}
        state.write_state(self._state_file, self._state)
        self.net.start()
        for h in self.net.hosts:
            h.cmd(f"sysctl -qw net.ipv4.tcp_rmem='{HOST_TCP_MEM}' net.ipv4.tcp_wmem='{HOST_TCP_MEM}'")
        if topo_spec.lan_rate_bps:
            self._shape_lan(topo_spec.lan_rate_bps)
        self.offloads = offloads.decide_offloads(self.scenario.wan, self.backend)
        if not self.offloads.on:
            offloads.turn_off(self._interfaces())
        from topologies.two_dc import SUBNETS, WAN_IPS, wan_ifname

        ports = {}
        for dc, peer, direction in (("prfaas", "pd", "prfaas_to_pd"), ("pd", "prfaas", "pd_to_prfaas")):
            gw = self.net.get(gateway_name(dc))
            gw.cmd("sysctl -qw net.ipv4.ip_forward=1")
            out = gw.cmd(f"ip route replace {SUBNETS[peer]} via {WAN_IPS[peer]} dev {wan_ifname(dc)}")
            if out.strip():
                raise HostError(f"route on {gw.name}: {out.strip()}")
            ports[direction] = GatewayPort(gw.name, wan_ifname(dc), f"/proc/{gw.pid}/ns/net", self._gateway_popen(gw))
        self.wan = Wan(self.scenario.wan, ports, scale=self.scale, backend=self.backend, seed=self.scenario.seed)
        try:
            self.wan.start()
        finally:
            self._record_delayline_dirs()
        self.t0_s = clock.now_s()
        control = WanControl(self.wan, t0_s=self.t0_s, period_s=self.telemetry_period_s)
        for fn in self._listeners:
            control.telemetry.add_listener(fn)
        self.control = control.start()
        self.telemetry, self.schedule = control.telemetry, control.schedule
        self.schedule.start(expand_schedule(self.scenario.wan.schedule), self.t0_s)
        self._state.update(ready=True, t0_s=self.t0_s, processes=self._tracked_pids(), backend=self.backend, scale=self.scale.factor)
        state.write_state(self._state_file, self._state)

    def _shape_lan(self, rate_bps: float) -> None:
        """`topology.lan_rate`: both ends of every intra-datacenter link (host egress, bridge-port egress)."""
        from pyroute2 import IPRoute

        from testbed.scenario import LinkDirectionSpec
        from testbed.units import QueueLimit

        plan = shaping.plan_shaping(LinkDirectionSpec(rate_bps=rate_bps, queue=QueueLimit("packets", 1000)), scale=self.scale)
        with IPRoute() as root:
            for link in self.net.links:
                for intf in (link.intf1, link.intf2):
                    if intf.node in self.net.switches:
                        shaping.apply_plan(root, root.link_lookup(ifname=intf.name)[0], plan)
                    elif not intf.name.endswith("-wan"):
                        with IPRoute(netns=f"/proc/{intf.node.pid}/ns/net") as ipr:
                            shaping.apply_plan(ipr, ipr.link_lookup(ifname=intf.name)[0], plan)

    def _interfaces(self) -> list[tuple[Callable[[list[str]], subprocess.Popen], str]]:
        """Every interface of the network with a runner in its namespace: hosts' and gateways' ends,
        and the bridge ports in the root namespace."""
        def root(argv: list[str]) -> subprocess.Popen:
            return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

        def inside(node: Any) -> Callable[[list[str]], subprocess.Popen]:
            return lambda argv: node.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

        out = []
        for link in self.net.links:
            for intf in (link.intf1, link.intf2):
                out.append((root if intf.node in self.net.switches else inside(intf.node), intf.name))
        return out

    def _gateway_popen(self, gw: Any) -> Callable[[list[str]], subprocess.Popen]:
        def popen(argv: list[str]) -> subprocess.Popen:
            self._record_delayline_dirs()  # a delay line makes its control directory, then starts its process here
            p = gw.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            self._procs.append(p)
            return p

        return popen

    def _record_delayline_dirs(self) -> None:
        """Write the delay lines' control directories to the state file when they changed, so that `prfaas clean`
        removes them after a SIGKILL. Recorded before a gateway starts a process: a run SIGKILLed while its WAN started
        left a directory the file did not name (the file was written once the WAN was up), which `prfaas clean RUN_ID`
        never removed."""
        dirs = self.wan.control_dirs() if self.wan is not None else []
        if self._state_file is not None and dirs != self._state["delayline_dirs"]:
            self._state["delayline_dirs"] = dirs
            state.write_state(self._state_file, self._state)

    def stop(self) -> None:
        """Tear everything down; safe to call twice and after a failed start."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        errors = self.teardown_errors

        def step(name: str, fn: Callable[[], Any]) -> None:
            try:
                fn()
            except BaseException as exc:  # keep tearing down; report at the end
                errors.append(f"{name}: {exc}")

        if self.schedule:
            step("schedule", self.schedule.stop)
        if self.telemetry:
            step("telemetry", self.telemetry.stop)
            if self.telemetry_path:
                step("telemetry file", lambda: self.telemetry.write_parquet(self.telemetry_path))
        if self.wan:
            step("wan", self.wan.stop)
        step("processes", self._kill_processes)
        if self.net is not None:
            step("mininet", self.net.stop)
        step("leftover processes", self._kill_processes)
        step("bridges", self._delete_bridges)
        if self._state_file:
            def release() -> None:
                with state.locked():
                    state.restore_sysctls_if_last(exclude=self._state_file)
                    self._state_file.unlink(missing_ok=True)

            step("state", release)
        while self._netns_fds:  # the namespaces go, and their inodes may be another's from now on
            os.close(self._netns_fds.pop())
        self._restore_signal_handlers()
        try:
            atexit.unregister(self.stop)
        except Exception:
            pass

    def _tracked_pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.poll() is None]

    def _kill_processes(self) -> None:
        """Every process we started, and every process still inside one of our namespaces."""
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            for stream in (p.stdout, p.stderr, p.stdin):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass
        shells = {h.shell.pid for h in self.net.hosts if getattr(h, "shell", None)} if self.net else set()
        kill_pids(p for p in state.pids_in_netns(self._netns_inodes) if p not in shells)

    def _delete_bridges(self) -> None:
        from testbed.net.cleanup import delete_bridges

        delete_bridges(self._state.get("bridges", []) if hasattr(self, "_state") else [])

    def _install_signal_handlers(self) -> None:
        self._old_handlers.update(raise_keyboard_interrupt())

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    # ------------------------------------------------------------------------------------------ access

    def _node(self, host: str) -> Any:
        if self.net is None or self._stopped:
            raise HostError("the network is not running")
        try:
            return self.net.get(host)
        except KeyError:
            raise HostError(f"no host {host!r}; hosts: {', '.join(sorted(self.addresses))}") from None

    def host_ip(self, host: str) -> str:
        if host not in self.addresses:
            raise HostError(f"no host {host!r}; hosts: {', '.join(sorted(self.addresses))}")
        return self.addresses[host]

    def hosts(self) -> list[str]:
        return sorted(self.addresses)

    def pass_open_loop_udp(self, src_host: str, dst_host: str, dport: int) -> bool:
        """Let the constant-rate UDP flow from `src_host` to `dst_host`:`dport` skip the delay line where that changes
        nothing it does to the WAN (`Wan.pass_open_loop_udp`); recorded in `describe()`. Returns whether it skips."""
        if self.wan is None:
            raise HostError("the network is not running")
        src_ip, _ = self.host_ip(src_host), self.host_ip(dst_host)  # hosts of this network, or the error naming them
        src_dc, dst_dc = self.datacenters[src_host], self.datacenters[dst_host]
        if src_dc == dst_dc:
            return False  # within one datacenter: no WAN on its path
        if self.wan.pass_open_loop_udp(f"{src_dc}_to_{dst_dc}", src_ip, dport):
            self.udp_undelayed.append(f"{src_host} -> {dst_host}:{dport}")
            return True
        return False

    def rx_counters(self, host: str) -> tuple[int, int]:
        """(bytes, packets) received on the host's interface (its kernel counters: frames with their Ethernet header,
        the unit of the configured rate). Read at the receiver, they measure the WAN independently of the
        shaper's own counters (`testbed.net.calibrate.ReceivedFrames`)."""
        node = self._node(host)
        ifname = node.defaultIntf().name
        for line in Path(f"/proc/{node.pid}/net/dev").read_text().splitlines()[2:]:
            name, _, counters = line.partition(":")
            if name.strip() == ifname:
                fields = counters.split()
                return int(fields[0]), int(fields[1])
        raise HostError(f"{host}: interface {ifname} not in /proc/{node.pid}/net/dev")

    def mtu_bytes(self, host: str) -> int:
        """The MTU of the host's interface, read inside its namespace by `ip link` (/sys/class/net shows the root
        namespace's interfaces, not the host's)."""
        ifname = self._node(host).defaultIntf().name
        try:
            r = self.run(host, ["ip", "-o", "link", "show", "dev", ifname], timeout_s=10)
        except subprocess.TimeoutExpired:
            raise HostError(f"{host}: `ip link show dev {ifname}` did not answer within 10 s") from None
        m = re.search(r" mtu (\d+) ", r.stdout)
        if r.returncode or m is None:
            raise HostError(f"{host}: no MTU of {ifname} in `ip link`: {(r.stderr or r.stdout).strip()[:200] or 'no output'}")
        return int(m.group(1))

    def popen(self, host: str, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        """Start argv inside the host's namespace (its own session); stopped at the latest by stop()."""
        kwargs.setdefault("stdout", None)
        kwargs.setdefault("stderr", None)
        p = self._node(host).popen(list(argv), **kwargs)
        self._procs.append(p)
        return p

    def run(self, host: str, argv: list[str], timeout_s: float = 30) -> subprocess.CompletedProcess:
        p = self.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise
        return subprocess.CompletedProcess(argv, p.returncode, out, err)

    def namespace_pids(self) -> list[int]:
        """Every process inside this network's hosts (gateways included)."""
        return state.pids_in_netns(self._netns_inodes)

    def add_telemetry_listener(self, fn: Callable[[dict], None]) -> None:
        self._listeners.append(fn)
        if self.telemetry:
            self.telemetry.add_listener(fn)

    def since_start_s(self) -> float:
        return clock.now_s() - (self.t0_s or clock.now_s())

    def describe(self) -> dict[str, Any]:
        """For environment.json: how the WAN was emulated, in emulated units with the wire figures beside."""
        from testbed.net.netem import netem_available

        wan = self.scenario.wan
        dirs = {}
        for d in DIRECTIONS:
            spec = wan.direction(d)
            plan = shaping.plan_shaping(spec, shaper=wan.shaper, scale=self.scale, rtt_s=wan.rtt_s)
            dirs[d] = {
                "rate_emulated_bps": spec.rate_bps, "rate_wire_bps": plan.rate_bps, "delay_s": spec.delay_s,
                "jitter_s": spec.jitter_s, "jitter_distribution": spec.jitter_distribution, "reorder": spec.reorder,
                "loss_mean": spec.loss.mean_rate, "loss_model": spec.loss.model, "queue": str(spec.queue),
                "queue_wire_bytes": plan.queue_bytes, "burst_wire_bytes": plan.burst_bytes,
            }
        return {
            "backend": self.backend, "backend_reason": self.backend_reason, "shaper": wan.shaper,
            "scale": self.scale.factor, "scale_source": self.scale_source, "netem_available": netem_available()[0],
            "offloads": self.offloads.describe() if self.offloads else "on (not started)",
            "kernel": platform.release(), "directions": dirs,
            "schedule": [a.describe() + f" @ {a.at_s:g}s" for a in expand_schedule(wan.schedule)],
            "schedule_fired": [f"{t:.3f}s {a.describe()}" for t, a in (self.schedule.fired if self.schedule else [])],
            "schedule_errors": list(self.schedule.errors) if self.schedule else [],
            "telemetry_period_s": self.telemetry_period_s, "hosts": dict(self.addresses),
            "udp_undelayed": list(self.udp_undelayed),
        }


def _root_links() -> set[str]:
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        return {str(link.get_attr("IFLA_IFNAME")) for link in ipr.get_links()}


def kill_pids(pids: Any, grace_s: float = 2.0) -> list[int]:
    """SIGTERM, then SIGKILL whatever is left after `grace_s`."""
    pids = list(pids)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if state.process_start_ticks(p) is not None and not _is_zombie(p)]
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
