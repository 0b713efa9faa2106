"""Segmentation offloads (TSO, GSO, GRO) on the network's interfaces: on, unless netem must lose wire packets.

With offloads on (the veth default), a sender's TCP hands its veth super-packets of up to 64 KiB (TSO),
and they cross bridges and gateways whole: the WAN egress sees ~35 wire packets as one skb. netem
decides loss once per skb (it segments a GSO skb only to corrupt it), so "1% loss" would drop 1% of
super-packets: the right share of bytes but ~35x fewer loss events, each a burst, and CUBIC's rate
follows the number of events. With the netem backend and any loss in the WAN (its directions or its
schedule, random or Gilbert-Elliott), `decide_offloads` therefore turns TSO, GSO and GRO off on every
interface of the network: the senders' TCP stacks segment before their veths, nothing merges them
again, and netem sees (and loses) MTU-sized wire packets. The price is per-packet work on every hop
(docs/network.md, "Loss per wire packet on the netem backend"). Loss-free WANs and the delay line
(which loses per wire packet itself, docs/delayline.md) keep offloads on.

`decide_offloads` and `ethtool_argv` are pure; `turn_off` runs `ethtool -K` through the callers' runners
(one per interface's namespace) and fails loudly: a run whose loss silently stayed per super-packet
would be wrong without saying so.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Callable, Iterable

from testbed.errors import HostError
from testbed.scenario import DIRECTIONS, LossSpec, WanSpec

FEATURES = ("tso", "gso", "gro")  # ethtool -K names: build (TSO, GSO) and re-build (GRO) super-packets
Popen = Callable[[list[str]], subprocess.Popen]


@dataclass(frozen=True)
class OffloadDecision:
    on: bool
    reason: str

    def describe(self) -> str:
        """For environment.json's network section, e.g. ``off (loss per wire packet)``."""
        return f"{'on' if self.on else 'off'} ({self.reason})"


def loses(loss: LossSpec) -> bool:
    return loss.mean_rate > 0


def wan_has_loss(wan: WanSpec) -> bool:
    """Any loss in either direction, at the start or in any schedule change."""
    specs = [wan.direction(d).loss for d in DIRECTIONS]
    specs += [v for e in wan.schedule for k, v in e.changes if k == "loss"]
    return any(loses(s) for s in specs)


def decide_offloads(wan: WanSpec, backend: str) -> OffloadDecision:
    if backend != "netem":
        return OffloadDecision(True, f"{backend}: it loses per wire packet itself")
    if not wan_has_loss(wan):
        return OffloadDecision(True, "no loss in the WAN or its schedule")
    return OffloadDecision(False, "loss per wire packet")


def ethtool_argv(ifname: str, on: bool) -> list[str]:
    state = "on" if on else "off"
    return ["ethtool", "-K", ifname, *(w for f in FEATURES for w in (f, state))]


def turn_off(interfaces: Iterable[tuple[Popen, str]], timeout_s: float = 20) -> int:
    """`ethtool -K IF tso off gso off gro off` on each (popen, ifname), all started at once; returns how
    many. Raises HostError naming the first interface that refused."""
    procs = [(ifname, popen(ethtool_argv(ifname, False))) for popen, ifname in interfaces]
    errors = []
    for ifname, p in procs:
        try:
            out, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            errors.append(f"{ifname}: ethtool timed out")
            continue
        if p.returncode != 0:
            text = (err or out or b"")
            text = text.decode(errors="replace") if isinstance(text, bytes) else str(text)
            errors.append(f"{ifname}: exit {p.returncode}: {text.strip()}")
    if errors:
        raise HostError("offloads: cannot turn TSO/GSO/GRO off, so netem would lose whole GSO super-packets "
                        f"instead of wire packets ({len(errors)} interface(s); {errors[0]}); "
                        "install ethtool (bash scripts/bootstrap.sh setup) or use wan.backend: delayline")
    return len(procs)
