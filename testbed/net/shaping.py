"""Rate shaping of one WAN direction: a pure plan from the scenario, applied over netlink (pyroute2).

`plan_shaping` turns a `LinkDirectionSpec` + scale into a `ShapingPlan` (wire rate, burst, queue limit),
with no side effects so it is unit-tested. `apply_plan` / `update_plan` put the plan on an interface of
a Mininet host through an `IPRoute` bound to that host's network namespace, and `read_qdisc_stats`
reads the root qdisc's counters back for telemetry.

Why these numbers (docs/network.md has the measurements):
- burst = 1 ms worth of the wire rate, but at least two 64 KiB GSO super-packets: a burst below one
  GSO packet stalls TSO traffic, and Mininet's fixed 15 KB burst is what caps TCLink near 85%.
- queue = the scenario's limit (bytes, packets x MTU or a multiple of the BDP), at least one GSO packet.
- HTB: one class (1:10, default) with rate = ceil and a bfifo leaf (10:) holding the queue limit;
  quantum 200000 (the kernel's "big quantum" bound) so r2q never matters.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pyroute2.netlink.rtnl.tcmsg import plugins as _tc_plugins

from testbed.errors import UserError
from testbed.scale import Scale
from testbed.scenario import LinkDirectionSpec

MTU_BYTES = 1500
GSO_MAX_BYTES = 65536
BURST_TIME_S = 1e-3
MIN_BURST_BYTES = 2 * GSO_MAX_BYTES
MIN_QUEUE_BYTES = GSO_MAX_BYTES + MTU_BYTES
HTB_QUANTUM_BYTES = 200_000
TBF_MAX_RATE_BPS = 8 * (2**32 - 1)  # pyroute2's TBF has no 64-bit rate attribute

# pyroute2 ships no bfifo module; bfifo's options are pfifo's (struct tc_fifo_qopt { u32 limit; }).
_tc_plugins.setdefault("bfifo", _tc_plugins["pfifo"])

ROOT_HANDLE = 0x10000  # 1:
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
    return ShapingPlan(shaper, rate_bps, burst_bytes_for(rate_bps), queue)


def with_rate(plan: ShapingPlan, direction: LinkDirectionSpec, *, scale: Scale | float, rtt_s: float | None) -> ShapingPlan:
    """The plan after a schedule change of the direction (rate, hence burst and a BDP queue, follow)."""
    new = plan_shaping(direction, shaper=plan.shaper, scale=scale, rtt_s=rtt_s)
    return replace(plan, rate_bps=new.rate_bps, burst_bytes=new.burst_bytes, queue_bytes=new.queue_bytes)


# ------------------------------------------------------------------------------------- netlink requests


def netlink_requests(plan: ShapingPlan, *, leaf: bool = True) -> list[tuple[str, str, int, dict[str, Any]]]:
    """The pyroute2 ``tc(command, kind, handle, **kwargs)`` calls that install the plan (ifindex added later).

    With ``leaf=False`` the HTB class gets no bfifo: the netem backend puts netem there instead.
    """
    rate_Bps = int(plan.rate_bps / 8)
    if plan.shaper == "tbf":
        return [("add", "tbf", ROOT_HANDLE, {"rate": rate_Bps, "burst": plan.burst_bytes, "limit": plan.queue_bytes})]
    reqs: list[tuple[str, str, int, dict[str, Any]]] = [
        ("add", "htb", ROOT_HANDLE, {"default": 0x10, "r2q": 1000}),
        ("add-class", "htb", CLASS_HANDLE, {"parent": ROOT_HANDLE, "rate": rate_Bps, "ceil": rate_Bps, "burst": plan.burst_bytes, "cburst": plan.burst_bytes, "quantum": HTB_QUANTUM_BYTES}),
    ]
    if leaf:
        reqs.append(("add", "bfifo", LEAF_HANDLE, {"parent": CLASS_HANDLE, "limit": plan.queue_bytes}))
    return reqs


def update_requests(plan: ShapingPlan, *, leaf: bool = True) -> list[tuple[str, str, int, dict[str, Any]]]:
    """The calls that change a running plan in place (no packets lost, no qdisc re-created)."""
    out = []
    for cmd, kind, handle, kw in netlink_requests(plan, leaf=leaf):
        if kind == "htb" and cmd == "add":
            continue  # the root keeps its parameters
        out.append(({"add": "replace" if kind == "bfifo" else "change", "add-class": "change-class"}[cmd], kind, handle, kw))
    return out


def apply_plan(ipr: Any, ifindex: int, plan: ShapingPlan, *, leaf: bool = True) -> None:
    """Replace whatever root qdisc the interface had with the plan. `ipr` is a pyroute2 IPRoute."""
    clear_root(ipr, ifindex)
    for cmd, kind, handle, kw in netlink_requests(plan, leaf=leaf):
        ipr.tc(cmd, kind, ifindex, handle, **kw)


def update_plan(ipr: Any, ifindex: int, plan: ShapingPlan, *, leaf: bool = True) -> None:
    for cmd, kind, handle, kw in update_requests(plan, leaf=leaf):
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
    """Counters of the root qdisc: what left the interface (bytes, packets) and what the queue holds."""

    tx_bytes: int
    tx_packets: int
    drops: int
    overlimits: int
    backlog_bytes: int
    backlog_packets: int


def read_qdisc_stats(ipr: Any, ifindex: int) -> QdiscStats:
    for msg in ipr.get_qdiscs(index=ifindex):
        if msg.get("parent") != 0xFFFFFFFF:
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
