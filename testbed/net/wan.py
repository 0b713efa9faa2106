"""The WAN: per direction, rate shaping plus delay/jitter/loss on the sending gateway's WAN egress.

Who knows what: `shaping` knows qdiscs, `netem` knows netem, `delayline` knows the NFQUEUE element;
this module picks the backend, puts one `DirectionEmulator` on each gateway and applies schedule
actions to them. Path of a packet from prfaas to pd with the delay line backend:

    prfaas host -> prfaas-gw FORWARD (NFQUEUE: delay, jitter, loss) -> HTB on prfaas-gw-wan (rate, queue)
    -> veth -> pd-gw -> pd host

With netem: netem (delay, jitter, loss) is the egress's root qdisc and the same HTB/TBF and bfifo hang
below it (`netem.SHAPER_PARENT`): delay, then rate and queue.
A link `down` inserts an iptables-legacy DROP rule for the WAN egress in the gateway's namespace
(routes stay in place, so the link comes back exactly as it was).
"""

from __future__ import annotations

import subprocess
import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from testbed.errors import HostError
from testbed.net import netem, shaping
from testbed.scale import Scale
from testbed.scenario import DIRECTIONS, LinkDirectionSpec, Saved, ScheduleAction, WanSpec, schedule_step

Popen = Callable[[list[str]], subprocess.Popen]
DOWN_COMMENT = "prfaas-wan-down"
QUEUE_NUMS = {"prfaas_to_pd": 1, "pd_to_prfaas": 2}


def resolve_backend(requested: str) -> tuple[str, str]:
    """(backend, why). `netem` on a kernel without it is refused before anything starts."""
    ok, reason = netem.netem_available()
    if requested == "netem" and not ok:
        raise HostError(f"wan.backend: netem is not available on this kernel ({reason}); use 'delayline' or 'auto'")
    if requested == "auto":
        return ("netem", f"auto: {reason}") if ok else ("delayline", f"auto: {reason}")
    return requested, f"asked for in the scenario ({reason})"


@dataclass
class GatewayPort:
    """Where one direction leaves: the sending gateway's WAN interface, reached through its namespace."""

    gateway: str
    ifname: str
    netns_path: str  # /proc/PID/ns/net of the gateway's shell
    popen: Popen  # runs argv inside the gateway's namespace


def _run(popen: Popen, argv: list[str], timeout_s: float = 10) -> None:
    proc = popen(argv)
    out, err = proc.communicate(timeout=timeout_s)
    if proc.returncode != 0:
        text = (err or out or b"").decode(errors="replace").strip() if isinstance(err or out, bytes) else str(err or out)
        raise RuntimeError(f"{' '.join(argv)}: exit {proc.returncode}: {text}")


class DirectionEmulator(Protocol):
    plan: shaping.ShapingPlan  # what its shaper holds now

    def start(self) -> None: ...
    def warm(self) -> None: ...
    def update(self, spec: LinkDirectionSpec, plan: shaping.ShapingPlan) -> None: ...
    def sample(self) -> dict[str, Any]: ...
    def stop(self) -> None: ...
    def detach(self) -> None: ...


class _Shaped:
    """The part both backends share: an HTB/TBF plan on the egress, kept in step with the spec. The plan
    is `Wan`'s (`Wan.plan`): a BDP queue depends on both directions' delays, which one direction does not know."""

    parent = shaping.IFACE_ROOT  # where the shaper hangs

    def __init__(self, port: GatewayPort, spec: LinkDirectionSpec, plan: shaping.ShapingPlan) -> None:
        from pyroute2 import IPRoute

        self.port, self.spec, self.plan = port, spec, plan
        self.ipr = IPRoute(netns=port.netns_path)
        self.ifindex = self.ipr.link_lookup(ifname=port.ifname)[0]
        self.lock = threading.Lock()

    def _shape(self) -> None:
        with self.lock:
            shaping.apply_plan(self.ipr, self.ifindex, self.plan, parent=self.parent)

    def _reshape(self, spec: LinkDirectionSpec, plan: shaping.ShapingPlan) -> None:
        with self.lock:
            shaping.update_plan(self.ipr, self.ifindex, plan, parent=self.parent)
        self.plan, self.spec = plan, spec

    def warm(self) -> None:
        """One netlink read from the calling thread, so that its first `update` does not pay pyroute2's
        per-thread setup (testbed.net.schedule)."""
        with self.lock:
            shaping.read_qdisc_stats(self.ipr, self.ifindex)

    def _qdisc_sample(self) -> dict[str, Any]:
        with self.lock:
            st = shaping.read_qdisc_stats(self.ipr, self.ifindex)
        return {
            "tx_bytes": st.tx_bytes, "tx_packets": st.tx_packets, "drops": st.drops, "overlimits": st.overlimits,
            "backlog_bytes": st.backlog_bytes, "backlog_packets": st.backlog_packets,
            "rate_bps": self.plan.rate_bps, "queue_limit_bytes": self.plan.queue_bytes,
        }

    def detach(self) -> None:
        """Let go of an attached direction (`Wan.attached`), leaving its qdiscs as they are."""
        with self.lock:
            self.ipr.close()

    def _close(self) -> None:
        with self.lock:
            try:
                shaping.clear_root(self.ipr, self.ifindex)
            except Exception:
                pass  # the namespace may already be gone
            self.ipr.close()


class DelayLineEmulator(_Shaped):
    """HTB/TBF (rate, queue) + the userspace NFQUEUE delay line (delay, jitter, loss) of testbed.net.delayline."""

    def __init__(self, port: GatewayPort, spec: LinkDirectionSpec, plan: shaping.ShapingPlan, queue_num: int, seed: int,
                 attach_dir: str | None = None) -> None:
        """`attach_dir`: drive the delay line that another process started there (testbed.net.wanctl)."""
        super().__init__(port, spec, plan)
        from testbed.net import delayline

        self.delayline_mod = delayline
        self.seed = seed
        config = delayline.build_config(spec, seed)
        self.line = (delayline.DelayLineProcess.attach(attach_dir, port.ifname, queue_num, config) if attach_dir
                     else delayline.DelayLineProcess(port.popen, port.ifname, queue_num, config))

    def start(self) -> None:
        self._shape()
        self.line.start()

    def update(self, spec: LinkDirectionSpec, plan: shaping.ShapingPlan) -> None:
        self._reshape(spec, plan)
        config = self.delayline_mod.build_config(spec, self.seed)
        if config != self.line.config:  # a queue re-sized for the other direction's delay leaves the line as it is
            self.line.update(config)

    def sample(self) -> dict[str, Any]:
        out = self._qdisc_sample()
        try:
            st = self.line.stats()
            out.update(
                delayline_queued_packets=st.queued_packets, delayline_queued_bytes=st.queued_bytes,
                delayline_forwarded_packets=st.forwarded_packets, delayline_dropped_loss=st.dropped_loss,
                delayline_dropped_overflow=st.dropped_overflow,
            )
        except Exception:
            pass  # a sample without the delay line's counters is still a sample
        return out

    def stop(self) -> None:
        try:
            self.line.stop()
        finally:
            self._close()

    def detach(self) -> None:
        """Let go of an attached direction, leaving its qdiscs and delay line running (the handle closes its files)."""
        try:
            self.line.stop()
        finally:
            super().detach()


class NetemEmulator(_Shaped):
    """netem (delay, jitter, loss) as the egress's root qdisc, the HTB/TBF plan (rate, queue) as its child."""

    parent = netem.SHAPER_PARENT

    def start(self) -> None:
        plan = netem.plan_netem(self.spec, self.plan)
        with self.lock:
            shaping.clear_root(self.ipr, self.ifindex)
        _run(self.port.popen, netem.netem_tc_argv(self.port.ifname, plan, command="add"))
        self._shape()
        self.table = plan.table

    def update(self, spec: LinkDirectionSpec, shaped: shaping.ShapingPlan) -> None:
        plan = netem.plan_netem(spec, shaped)  # its limit follows the queue
        if netem.needs_recreate(self.table, plan):  # all of it again (the shaper goes with netem)
            self.plan, self.spec = shaped, spec
            self.start()
            return
        self._reshape(spec, shaped)
        _run(self.port.popen, netem.netem_tc_argv(self.port.ifname, plan, command="change"))
        if plan.table is not None or plan.jitter_s > 0:
            self.table = plan.table

    def sample(self) -> dict[str, Any]:
        return self._qdisc_sample()

    def stop(self) -> None:
        self._close()


@dataclass(frozen=True)
class WanState:
    """What changes while a WAN runs: each direction's spec, shaping plan and link state, and netem's table."""

    current: dict[str, LinkDirectionSpec]
    plans: dict[str, shaping.ShapingPlan]
    link_up: dict[str, bool]
    tables: dict[str, Any]


@dataclass(frozen=True)
class WanHandoff:
    """Everything another process needs to drive a running WAN (testbed.net.wanctl): the scenario's WAN,
    where each direction leaves (gateway, interface, namespace path), its delay line's control directory,
    and the state now. Plain data, handed to our own child process."""

    spec: WanSpec
    ports: dict[str, tuple[str, str, str]]
    backend: str
    seed: int
    scale: Scale
    line_dirs: dict[str, str]
    state: WanState


def nsenter_popen(netns_path: str) -> Popen:
    """Runs argv in the namespace at `netns_path` (for a process that has no Mininet node to ask)."""
    def popen(argv: list[str]) -> subprocess.Popen:
        return subprocess.Popen(["nsenter", f"--net={netns_path}", "--", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    return popen


class Wan:
    """Both directions of the WAN; `apply(action)` is what the schedule calls."""

    def __init__(self, spec: WanSpec, ports: dict[str, GatewayPort], *, scale: Scale, backend: str, seed: int) -> None:
        self.spec, self.ports, self.scale, self.backend, self.seed = spec, ports, scale, backend, seed
        self.current = {d: spec.direction(d) for d in DIRECTIONS}
        self.link_up = {d: True for d in DIRECTIONS}
        self.saved: Saved = {}
        self.emulators: dict[str, DirectionEmulator] = {}
        self.applied: list[str] = []
        self.on_change: Callable[[WanState], None] | None = None  # told of every change made here (testbed.net.wanctl)

    def state(self) -> WanState:
        return WanState(dict(self.current), {d: em.plan for d, em in self.emulators.items()}, dict(self.link_up),
                        {d: getattr(em, "table", None) for d, em in self.emulators.items()})

    def handoff(self) -> WanHandoff:
        """What the WAN control process needs to drive this WAN, started here (testbed.net.wanctl)."""
        ports = {d: (p.gateway, p.ifname, p.netns_path) for d, p in self.ports.items()}
        line_dirs = {d: str(line.control_dir) for d, em in self.emulators.items()
                     if (line := getattr(em, "line", None)) is not None and line.control_dir is not None}
        return WanHandoff(self.spec, ports, self.backend, self.seed, self.scale, line_dirs, self.state())

    @classmethod
    def attached(cls, h: WanHandoff) -> "Wan":
        """A WAN that another process started, driven from this one: `apply` and `sample` act on the same
        kernel objects and delay lines; `stop` lets go of them and leaves them running."""
        ports = {d: GatewayPort(gw, ifname, ns, nsenter_popen(ns)) for d, (gw, ifname, ns) in h.ports.items()}
        wan = cls(h.spec, ports, scale=h.scale, backend=h.backend, seed=h.seed)
        for d in DIRECTIONS:
            spec, plan = h.state.current[d], h.state.plans[d]
            if h.backend == "netem":
                em: DirectionEmulator = NetemEmulator(ports[d], spec, plan)
                em.table = h.state.tables[d]  # type: ignore[attr-defined]
            else:
                em = DelayLineEmulator(ports[d], spec, plan, QUEUE_NUMS[d], h.seed + QUEUE_NUMS[d], attach_dir=h.line_dirs[d])
            wan.emulators[d] = em
        wan.adopt(h.state)
        return wan

    def adopt(self, state: WanState) -> None:
        """Take `state` as this WAN's own, changing nothing in the kernel (another process made the change)."""
        self.current, self.link_up = dict(state.current), dict(state.link_up)
        for d, em in self.emulators.items():
            em.plan, em.spec = state.plans[d], state.current[d]  # type: ignore[attr-defined]
            if state.tables.get(d) is not None:
                em.table = state.tables[d]  # type: ignore[attr-defined]

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self.state())

    def plan(self, direction: str, current: dict[str, LinkDirectionSpec] | None = None) -> shaping.ShapingPlan:
        """The shaping plan of `direction` for the current specs (or `current`): its rate, and a queue
        given relative to the BDP sized from that rate and the round trip of both directions' delays."""
        return shaping.plan_wan_direction(self.spec, current or self.current, direction, self.scale)

    def start(self) -> None:
        for d in DIRECTIONS:
            port, spec, plan = self.ports[d], self.current[d], self.plan(d)
            if self.backend == "netem":
                em: DirectionEmulator = NetemEmulator(port, spec, plan)
            else:
                em = DelayLineEmulator(port, spec, plan, QUEUE_NUMS[d], self.seed + QUEUE_NUMS[d])
            self.emulators[d] = em
            em.start()

    def pass_open_loop_udp(self, direction: str, src_ip: str, dport: int) -> bool:
        """Let one open-loop UDP flow (a constant-bit-rate neighbour, `traffic.cross`) skip the delay line but not the
        shaper, where skipping changes nothing it does to the WAN: with the delay-line backend, on a direction that at
        every point of the schedule only delays (`WanSpec.only_delays`). A datagram's delay does not change when a
        constant-rate sender sends the next one, so the shaper sees the same stream, and the delay line no longer
        spends a core's fraction on copying it through userspace (docs/traffic.md, "Neighbours and the delay line").
        Returns whether the flow now skips the line."""
        if self.backend == "netem" or not self.spec.only_delays(direction):
            return False
        from testbed.net import delayline

        port, binary = self.ports[direction], delayline.iptables_binary()
        proc = port.popen([binary, "-w", "10", "-S", "FORWARD"])
        out, _ = proc.communicate(timeout=10)
        n = delayline.nfqueue_rule_number(out.decode() if isinstance(out, bytes) else str(out), port.ifname)
        if n is None:
            raise HostError(f"delay line on {port.ifname}: no NFQUEUE rule to put the UDP flow to port {dport} ahead of")
        _run(port.popen, [binary, "-w", "10", "-I", "FORWARD", str(n), *delayline.udp_pass_rule(port.ifname, src_ip, dport)])
        return True

    def control_dirs(self) -> list[str]:
        """The delay lines' control directories (none with netem)."""
        return [str(d) for em in self.emulators.values() if (d := getattr(getattr(em, "line", None), "control_dir", None))]

    def set_direction(self, direction: str, spec: LinkDirectionSpec) -> None:
        """Apply a new spec to one direction. A delay change also changes the round trip, so the other
        direction's queue is re-sized too when it is given relative to the BDP (`1bdp`)."""
        current = {**self.current, direction: spec}
        for d in DIRECTIONS:
            plan = self.plan(d, current)
            if d == direction or plan != self.emulators[d].plan:
                self.emulators[d].update(current[d], plan)
                self.current[d] = current[d]
        self._changed()

    def set_link_up(self, direction: str, up: bool) -> None:
        if self.link_up[direction] == up:
            return
        port = self.ports[direction]
        op = "-I" if not up else "-D"
        rule = ["FORWARD", *(["1"] if op == "-I" else []), "-o", port.ifname, "-m", "comment", "--comment", DOWN_COMMENT, "-j", "DROP"]
        _run(port.popen, ["iptables-legacy", "-w", op, *rule])
        self.link_up[direction] = up
        self._changed()

    def warm(self) -> None:
        """Ready the calling thread to `apply` without a first-call cost (`ScheduleRunner(warm=...)`)."""
        for em in self.emulators.values():
            em.warm()

    def apply(self, action: ScheduleAction) -> None:
        """Install one step of the schedule (`testbed.scenario.schedule_step`: what a change or revert sets)."""
        if action.kind in ("down", "up"):
            for d in action.directions:
                self.set_link_up(d, action.kind == "up")
        for d, spec in schedule_step(self.current, self.saved, action).items():
            self.set_direction(d, spec)
        self.applied.append(action.describe())

    def sample(self, direction: str) -> dict[str, Any]:
        out = self.emulators[direction].sample()
        out["link_up"] = self.link_up[direction]
        out["rate_emulated_bps"] = self.current[direction].rate_bps
        out["delay_s"] = self.current[direction].delay_s
        out["loss"] = self.current[direction].loss.mean_rate
        return out

    def detach(self) -> None:
        """Let go of an attached WAN (`attached`) without changing it."""
        for em in self.emulators.values():
            try:
                em.detach()
            except Exception:
                pass  # the namespace may already be gone
        self.emulators.clear()

    def stop(self) -> None:
        errors = []
        for d, em in list(self.emulators.items()):
            try:
                em.stop()
            except Exception as exc:
                errors.append(f"{d}: {exc}")
        self.emulators.clear()
        if errors:
            raise RuntimeError("; ".join(errors))
