"""Rate shaping of one WAN direction: a pure plan from the scenario, applied over netlink (pyroute2).

`plan_shaping` turns a `LinkDirectionSpec` + scale into a `ShapingPlan` (wire rate, burst, queue limit),
with no side effects so it is unit-tested. `apply_plan` / `update_plan` put the plan on an interface of
a Mininet host through an `IPRoute` bound to that host's network namespace, and `read_qdisc_stats`
reads the shaper qdisc's counters (handle 1:) back for telemetry.

Why these numbers (docs/network.md has the measurements):
- burst = 1 ms worth of the wire rate, but at least two 64 KiB GSO super-packets: a burst below one
  GSO packet stalls TSO traffic, and Mininet's fixed 15 KB burst is what caps TCLink near 85%.
- queue = the scenario's limit (bytes, packets x MTU or a multiple of the BDP), at least one GSO packet.
- HTB: one class (1:10, default) with rate = ceil and a bfifo leaf (10:) holding the queue limit;
  quantum 200000 (the kernel's "big quantum" bound) so r2q never matters.
- The shaper (HTB 1: or TBF 1:) is the interface's root qdisc, or, with the netem backend, the child
  of netem's class (`parent`): delay first, then the rate and the queue, as with the delay line.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pyroute2.netlink.rtnl.tcmsg import plugins as _tc_plugins

from testbed import units
from testbed.errors import UserError
from testbed.packet import MTU_BYTES
from testbed.scale import Scale
from testbed.scenario import LinkDirectionSpec, WanSpec

GSO_MAX_BYTES = 65536
BURST_TIME_S = 1e-3
MIN_BURST_BYTES = 2 * GSO_MAX_BYTES
MIN_QUEUE_BYTES = GSO_MAX_BYTES + MTU_BYTES
HTB_QUANTUM_BYTES = 200_000
TBF_MAX_RATE_BPS = 8 * (2**32 - 1)  # pyroute2's TBF has no 64-bit rate attribute

# pyroute2 ships no bfifo module; bfifo's options are pfifo's (struct tc_fifo_qopt { u32 limit; }).
_tc_plugins.setdefault("bfifo", _tc_plugins["pfifo"])

IFACE_ROOT = 0xFFFFFFFF  # TC_H_ROOT: the interface's root qdisc
ROOT_HANDLE = 0x10000  # 1: (the shaper's own qdisc, wherever it hangs)
CLASS_HANDLE = 0x10010  # 1:10
LEAF_HANDLE = 0x100000  # 10:


@dataclass(frozen=True)
class ShapingPlan:
    """What the egress qdisc of one WAN direction does, in wire units."""

    shaper: str  # "htb" | "tbf"
    rate_bps: float  # wire rate = emulated rate / scale
    burst_bytes: int
    queue_bytes: int

    def describe(self) -> dict[str, Any]:
        return {"shaper": self.shaper, "rate_bps": self.rate_bps, "burst_bytes": self.burst_bytes, "queue_bytes": self.queue_bytes}


def burst_bytes_for(rate_bps: float) -> int:
    """1 ms of the rate, at least two GSO packets."""
    return max(int(rate_bps / 8 * BURST_TIME_S), MIN_BURST_BYTES)


def plan_shaping(direction: LinkDirectionSpec, *, shaper: str = "htb", scale: Scale | float = 1.0,
                 rtt_s: float | None = None) -> ShapingPlan:
    """The qdisc plan for one direction. `rtt_s` is the round trip the BDP refers to (`WanSpec.rtt_s`;
    default 2 x this direction's delay)."""
    if shaper not in ("htb", "tbf"):
        raise UserError(f"wan.shaper: {shaper!r} is not allowed; use one of: htb, tbf")
    scale = Scale.of(scale)
    rate_bps = scale.wire_bps(direction.rate_bps)
    if shaper == "tbf" and rate_bps > TBF_MAX_RATE_BPS:
        raise UserError(f"wan.shaper: tbf supports wire rates up to {TBF_MAX_RATE_BPS / 1e9:.1f} Gbps here; use htb or a larger scale")
    queue = max(direction.queue_bytes(scale, rtt_s), MIN_QUEUE_BYTES)
    if queue > units.MAX_QUEUE_BYTES:  # a BDP multiple is bounded as written (1000bdp), its bytes only here: 1000bdp of a 1-s
        # delay passed `prfaas check` as a 116-GiB queue, which tc refuses once the network is being built (2026-12-07)
        raise UserError(f"wan.queue: {units.format_bytes(queue)} on the wire ({direction.queue.value:g} {direction.queue.kind} "
                        f"at {rate_bps / 1e9:g} Gbps on the wire and a {direction.bdp_rtt_s(rtt_s) * 1e3:g} ms round "
                        f"trip), more than {units.MAX_QUEUE_BYTES} bytes (4 GiB - 1), the most a queue's byte limit holds (tc's "
                        f"is 32-bit); use a smaller queue, or a larger scale")
    return ShapingPlan(shaper, rate_bps, burst_bytes_for(rate_bps), queue)


def plan_wan_direction(wan: WanSpec, current: dict[str, LinkDirectionSpec], direction: str, scale: Scale | float) -> ShapingPlan:
    """The plan of `direction` with the WAN's directions at `current` (a step of its schedule): its rate, and a queue
    given relative to the BDP sized from that rate and the round trip of both directions' current delays. The one
    definition: `testbed.net.wan.Wan.plan` installs it, `prfaas check` checks every step of the schedule with it."""
    rtt_s = replace(wan, **current).rtt_s
    return plan_shaping(current[direction], shaper=wan.shaper, scale=scale, rtt_s=rtt_s)


# ------------------------------------------------------------------------------------- netlink requests


def netlink_requests(plan: ShapingPlan, *, parent: int = IFACE_ROOT) -> list[tuple[str, str, int, dict[str, Any]]]:
    """The pyroute2 ``tc(command, kind, handle, **kwargs)`` calls that install the plan (ifindex added later).

    `parent`: where the shaper hangs: the interface's root, or netem's class (the netem backend).
    """
    rate_Bps = int(plan.rate_bps / 8)
    at = {} if parent == IFACE_ROOT else {"parent": parent}
    if plan.shaper == "tbf":
        return [("add", "tbf", ROOT_HANDLE, {**at, "rate": rate_Bps, "burst": plan.burst_bytes, "limit": plan.queue_bytes})]
    return [
        ("add", "htb", ROOT_HANDLE, {**at, "default": 0x10, "r2q": 1000}),
        ("add-class", "htb", CLASS_HANDLE, {"parent": ROOT_HANDLE, "rate": rate_Bps, "ceil": rate_Bps, "burst": plan.burst_bytes, "cburst": plan.burst_bytes, "quantum": HTB_QUANTUM_BYTES}),
        ("add", "bfifo", LEAF_HANDLE, {"parent": CLASS_HANDLE, "limit": plan.queue_bytes}),
    ]


def update_requests(plan: ShapingPlan, *, parent: int = IFACE_ROOT) -> list[tuple[str, str, int, dict[str, Any]]]:
    """The calls that change a running plan in place (no packets lost, no qdisc re-created)."""
    out = []
    for cmd, kind, handle, kw in netlink_requests(plan, parent=parent):
        if kind == "htb" and cmd == "add":
            continue  # the root keeps its parameters
        out.append(({"add": "replace" if kind == "bfifo" else "change", "add-class": "change-class"}[cmd], kind, handle, kw))
    return out


def apply_plan(ipr: Any, ifindex: int, plan: ShapingPlan, *, parent: int = IFACE_ROOT) -> None:
    """Install the plan. At the root it replaces whatever root qdisc the interface had; under a parent
    (netem's class) that parent must exist. `ipr` is a pyroute2 IPRoute."""
    if parent == IFACE_ROOT:
        clear_root(ipr, ifindex)
    for cmd, kind, handle, kw in netlink_requests(plan, parent=parent):
        ipr.tc(cmd, kind, ifindex, handle, **kw)


def update_plan(ipr: Any, ifindex: int, plan: ShapingPlan, *, parent: int = IFACE_ROOT) -> None:
    for cmd, kind, handle, kw in update_requests(plan, parent=parent):
        ipr.tc(cmd, kind, ifindex, handle, **kw)


def clear_root(ipr: Any, ifindex: int) -> None:
    from pyroute2.netlink.exceptions import NetlinkError

    try:
        ipr.tc("del", index=ifindex, handle=0, parent=0xFFFFFFFF)
    except NetlinkError as exc:
        if exc.code not in (2, 22):  # ENOENT / EINVAL: nothing to delete (default qdisc)
            raise


@dataclass(frozen=True)
class QdiscStats:
    """Counters of the shaper's qdisc (handle 1:, the root unless netem sits above it): what left the
    interface (bytes, packets) and what the queue holds (netem's packets in flight are not in it)."""

    tx_bytes: int
    tx_packets: int
    drops: int
    overlimits: int
    backlog_bytes: int
    backlog_packets: int


def read_qdisc_stats(ipr: Any, ifindex: int) -> QdiscStats:
    for msg in ipr.get_qdiscs(index=ifindex):
        if msg.get("handle") != ROOT_HANDLE:
            continue
        stats2 = msg.get_attr("TCA_STATS2")
        basic = stats2.get_attr("TCA_STATS_BASIC") if stats2 else None
        queue = stats2.get_attr("TCA_STATS_QUEUE") if stats2 else None
        return QdiscStats(
            tx_bytes=int(basic["bytes"]) if basic else 0,
            tx_packets=int(basic["packets"]) if basic else 0,
            drops=int(queue["drops"]) if queue else 0,
            overlimits=int(queue["overlimits"]) if queue else 0,
            backlog_bytes=int(queue["backlog"]) if queue else 0,
            backlog_packets=int(queue["qlen"]) if queue else 0,
        )
    return QdiscStats(0, 0, 0, 0, 0, 0)
