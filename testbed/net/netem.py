"""netem: delay, jitter, loss in the kernel, where the kernel has `sch_netem`.

`plan_netem` is pure (unit-tested everywhere); `netem_tc_argv` turns the plan into the `tc` command
that makes netem the root qdisc of the WAN egress (handle 2:); the shaper of `testbed.net.shaping`
(HTB or TBF, handle 1:, with its bfifo queue) hangs below it, at netem's class 2:1 (`SHAPER_PARENT`).
A packet is delayed (and maybe lost) first, then queued and sent at the wire rate: the scenario's
queue is the bfifo's byte limit, as with the delay line, and queueing adds to the delay. (With netem
as HTB's leaf, netem's tfifo was the queue: 1000 packets or more, GSO packets counted as one, and a
queued packet waited max(delay, queueing) instead of their sum.) `tc` is used here, not pyroute2,
because pyroute2's netem module cannot express delay distributions, the Gilbert-Elliott loss model or
netem's `rate` (all needed here).

In-order jitter: netem's tfifo sorts packets by their send time, so plain jitter reorders. When
`reorder` is false and there is jitter, the plan sets netem's own `rate` to the wire rate: netem then
schedules each packet after the previous one (time_to_send = max(own, previous) + serialisation),
which keeps order (tc-netem(8), "rate"). With `reorder: true` the rate is left out and tfifo reorders.

Live changes use `tc qdisc change` (same qdisc, the packets in it kept). netem keeps any option a change
leaves out, so every option is always given (`rate 0bit` switches netem's rate off); the one that cannot
be given is "no table": going from a distribution table (normal, pareto, ...) back to uniform jitter
re-creates the qdisc (`needs_recreate`), losing what it held at that moment.

Limit: netem's `limit` is in packets and must hold every packet being delayed, so that it is never
what drops: limit = (rate x (delay + 4 jitter) + queue bytes) / MTU, at least 1000 (the queue bytes
are a margin: the queue itself is the shaper's bfifo, below netem).

`netem_available()` asks the kernel: it tries to add a netem qdisc to `lo` inside a throwaway network
namespace (`unshare --net`), which disappears with the process.
"""

from __future__ import annotations

import functools
import math
import shutil
import subprocess
from dataclasses import dataclass

from testbed.net.shaping import ShapingPlan
from testbed.packet import MTU_BYTES
from testbed.scenario import LinkDirectionSpec, LossSpec

MIN_LIMIT_PACKETS = 1000
NETEM_HANDLE = "2:"  # netem, the root qdisc of the WAN egress
SHAPER_PARENT = 0x20001  # 2:1, netem's class: where the shaper (handle 1:) hangs


@dataclass(frozen=True)
class NetemPlan:
    delay_s: float
    jitter_s: float
    distribution: str
    loss: LossSpec
    limit_packets: int
    rate_bps: float | None  # set only to keep jittered packets in order
    reorder: bool

    def tc_options(self) -> list[str]:
        """netem's options as tc(8) words."""
        opts = ["limit", str(self.limit_packets), "delay", _usec(self.delay_s)]
        if self.jitter_s > 0:
            opts.append(_usec(self.jitter_s))
            if self.distribution != "uniform":  # netem's jitter is uniform unless a table is named
                opts += ["distribution", self.distribution]
        if self.loss.model == "random" and self.loss.rate > 0:
            opts += ["loss", "random", _pct(self.loss.rate)]
        elif self.loss.model == "gilbert-elliott" and self.loss.p > 0:
            opts += ["loss", "gemodel", _pct(self.loss.p), _pct(self.loss.r), _pct(self.loss.bad_loss), _pct(self.loss.good_loss)]
        # Always given: `tc qdisc change` keeps a netem option that is left out (the kernel only sets
        # attributes present in the message), so in-order jitter followed by `reorder: true` or no
        # jitter would keep the old rate. "0bit" switches netem's rate off.
        opts += ["rate", f"{int(self.rate_bps)}bit" if self.rate_bps else "0bit"]
        return opts

    @property
    def table(self) -> str | None:
        """The delay distribution table this plan loads into the kernel (None: netem's uniform jitter)."""
        return self.distribution if self.jitter_s > 0 and self.distribution != "uniform" else None


def _usec(seconds: float) -> str:
    return f"{seconds * 1e6:.0f}us"


def _pct(fraction: float) -> str:
    return f"{fraction * 100:.6g}%"


def plan_netem(direction: LinkDirectionSpec, shaping: ShapingPlan) -> NetemPlan:
    in_flight_bytes = shaping.rate_bps / 8 * (direction.delay_s + 4 * direction.jitter_s)
    limit = max(MIN_LIMIT_PACKETS, math.ceil((in_flight_bytes + shaping.queue_bytes) / MTU_BYTES))
    keep_order = direction.jitter_s > 0 and not direction.reorder
    return NetemPlan(
        delay_s=direction.delay_s,
        jitter_s=direction.jitter_s,
        distribution=direction.jitter_distribution,
        loss=direction.loss,
        limit_packets=limit,
        rate_bps=shaping.rate_bps if keep_order else None,
        reorder=direction.reorder,
    )


def needs_recreate(loaded_table: str | None, new: NetemPlan) -> bool:
    """A change to uniform jitter while a distribution table is loaded: `change` cannot unload it."""
    return loaded_table is not None and new.jitter_s > 0 and new.table is None


def netem_tc_argv(ifname: str, plan: NetemPlan, *, command: str = "add") -> list[str]:
    """``tc qdisc add|change dev IF root handle 2: netem ...`` (netem as the root, the shaper below it)."""
    return ["tc", "qdisc", command, "dev", ifname, "root", "handle", NETEM_HANDLE, "netem", *plan.tc_options()]


@functools.lru_cache(maxsize=1)
def netem_available() -> tuple[bool, str]:
    """(available, reason). Tries netem on `lo` of a throwaway namespace; needs root and unshare."""
    if not shutil.which("unshare") or not shutil.which("tc"):
        return False, "cannot probe: unshare or tc is missing"
    try:
        r = subprocess.run(
            ["unshare", "--net", "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
            capture_output=True, text=True, timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"cannot probe: {exc}"
    if r.returncode == 0:
        return True, "sch_netem present"
    err = (r.stderr or r.stdout).strip().splitlines()
    return False, f"kernel refused netem: {err[0] if err else 'exit ' + str(r.returncode)}"
