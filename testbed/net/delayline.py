"""Userspace delay line on NFQUEUE: delay, jitter, loss and a packet limit where the kernel has no netem.

Who knows what: `DelayLineConfig` says what the line does; `DelaySchedule` (pure) decides per packet
whether it is lost, overflows, or when it leaves; `serve` is the child process's hot loop (netlink in,
verdicts out); `DelayLineProcess` is the parent's handle (start, update, stats, stop). `cleanup_rules`
removes the tagged iptables rules a killed line left behind.

Control channel (parent <-> child, both in a private directory, see docs/delayline.md):
- `control`: a FIFO the parent writes JSON lines to (``{"op": "update", "config": {...}}``,
  ``{"op": "stop"}``); EOF (the parent died or closed it) also stops the child.
- `stats`: a 128-byte shared file the child rewrites (seqlock) at most every millisecond and the
  parent reads with one `pread`, so `stats()` costs microseconds.
- `error`: the reason, when the child could not start.

Child: ``python -m testbed.net.delayline run --out-ifname IF --queue-num N --ctl-dir DIR --config JSON``;
``python -m testbed.net.delayline cleanup [--queue-num N]`` removes tagged rules in its namespace.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import dataclasses
import heapq
import json
import math
import mmap
import os
import random
import select
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import TYPE_CHECKING, Callable

from testbed.errors import HostError
from testbed.net.state import DELAYLINE_DIR_PREFIX, delayline_dir_base
from testbed.packet import MTU_BYTES, TCP_IPV4_HEADER_BYTES
from testbed.scenario import JITTER_DISTRIBUTIONS, LinkDirectionSpec, LossSpec

if TYPE_CHECKING:
    from testbed.net.nfqueue import NfQueue

RULE_TAG = "prfaas-delayline"
DEFAULT_LIMIT_PACKETS = 100_000
DEFAULT_RT_PRIORITY = 10  # SCHED_FIFO priority of the child; 0 = normal scheduling
_KERNEL_QUEUE_MARGIN = 4096  # kernel queue maxlen = limit + margin, so our limit (not the kernel's) decides
_NETEM_TABLE_MAX = 32767 / 8192  # netem's distribution tables are int16 scaled by 8192: |sample| <= ~4 sigma
COALESCE_S = 150e-6  # release with a due head what is due this soon after now: fewer wake-ups, <= 0.15 ms early
_MAX_LEAD_S = 0.001  # the timer's learnt lateness (the lead) is capped here
_LEAD_STEP_S = 5e-6  # its step per aimed wake-up: up when the wake-up came after the head's due time, else down
_LAZY_MAX_S = 0.5  # longest sleep without reading the queue: packets read later fail the arrival check below
_STAMP_WINDOW_S = 1.0  # kernel stamps older than this are not used; the clocks' offset is the smallest of 1-2 s
_CTL_POLL_S = 0.001  # while the loop never sleeps (a backlog, a due head), it polls its control fd this often
_STATS = struct.Struct("=QQqqqqqqqdQ")  # seq, state, 7 counters, updated_at (monotonic s), pid
STATE_STARTING, STATE_INSTALLING, STATE_RUNNING, STATE_STOPPED = 0, 1, 2, 3

Popen = Callable[[list[str]], subprocess.Popen]


@dataclass(frozen=True)
class DelayLineConfig:
    """What one direction's delay line does. Times in seconds; jitter follows netem's meaning per distribution."""

    delay_s: float
    jitter_s: float = 0.0
    jitter_distribution: str = "normal"
    reorder: bool = False
    loss: LossSpec = LossSpec()
    limit_packets: int = DEFAULT_LIMIT_PACKETS
    seed: int = 1

    def __post_init__(self) -> None:
        if not (self.delay_s >= 0 and math.isfinite(self.delay_s)):
            raise ValueError(f"delay_s must be a finite number >= 0, not {self.delay_s!r}")
        if not (self.jitter_s >= 0 and math.isfinite(self.jitter_s)):
            raise ValueError(f"jitter_s must be a finite number >= 0, not {self.jitter_s!r}")
        if self.jitter_distribution not in JITTER_DISTRIBUTIONS:
            raise ValueError(f"jitter_distribution must be one of {', '.join(JITTER_DISTRIBUTIONS)}, "
                             f"not {self.jitter_distribution!r}")
        if self.limit_packets < 1:
            raise ValueError(f"limit_packets must be >= 1, not {self.limit_packets!r}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_dict(d: dict) -> "DelayLineConfig":
        return DelayLineConfig(**{**d, "loss": LossSpec(**d.get("loss", {}))})


def build_config(direction: LinkDirectionSpec, seed: int = 1, limit_packets: int | None = None) -> DelayLineConfig:
    """The delay line for one WAN direction. Its packet limit bounds packets held in flight (netem's
    `limit`); the WAN's queue limit belongs to the rate shaper, so it is not used here."""
    return DelayLineConfig(
        delay_s=direction.delay_s,
        jitter_s=direction.jitter_s,
        jitter_distribution=direction.jitter_distribution,
        reorder=direction.reorder,
        loss=direction.loss,
        limit_packets=DEFAULT_LIMIT_PACKETS if limit_packets is None else limit_packets,
        seed=seed,
    )


@dataclass
class DelayLineStats:
    queued_packets: int
    queued_bytes: int
    forwarded_packets: int
    forwarded_bytes: int
    dropped_loss: int  # wire packets (GSO segments counted one by one)
    dropped_overflow: int
    split_packets: int = 0  # super-packets cut into their segments because some segment was lost


# ----------------------------------------------------------------------------------------- pure parts

_STD_NORMAL = NormalDist()


def jitter_unit_sample(rng: random.Random, distribution: str) -> float:
    """A sample in units of the jitter, with netem's meaning of each distribution.

    normal: N(0, 1); uniform: U(-1, 1) (netem without a table); pareto: iproute2's table, Pareto(a=3)
    shifted to mean 0 and scaled by 4/3; paretonormal: (normal + 3 x pareto) / 4 from one quantile, as
    iproute2's paretonormal table. Table distributions are clipped to +-4 like netem's int16 tables.
    """
    if distribution == "uniform":
        return rng.uniform(-1.0, 1.0)
    if distribution == "normal":
        x = rng.gauss(0.0, 1.0)
    else:
        u = min(max(rng.random(), 1e-12), 1.0 - 1e-12)
        pareto = ((1.0 - u) ** (-1.0 / 3.0) - 1.5) * (4.0 / 3.0)
        if distribution == "pareto":
            x = pareto
        elif distribution == "paretonormal":
            x = (_STD_NORMAL.inv_cdf(u) + 3.0 * min(pareto, _NETEM_TABLE_MAX)) / 4.0
        else:
            raise ValueError(f"unknown jitter distribution {distribution!r}")
    return max(-_NETEM_TABLE_MAX, min(_NETEM_TABLE_MAX, x))


class LossModel:
    """Random loss or netem's Gilbert-Elliott (`gemodel p r 1-h 1-k`), per wire packet: `lost_among(n)` says
    which of the next n wire packets are lost (Gilbert-Elliott: lose by the current state, then move)."""

    def __init__(self, spec: LossSpec, rng: random.Random) -> None:
        self.spec = spec
        self.rng = rng
        self.bad = False
        # random loss: wire packets to pass before the next loss (a geometric draw), so a GSO packet of
        # 45 segments costs one comparison, not 45 draws; the same Bernoulli process per wire packet
        self.gap = self._gap() if spec.model == "random" and spec.rate > 0 else 0

    def _gap(self) -> int:
        p = self.spec.rate
        if p >= 1.0:
            return 0
        return int(math.log(1.0 - self.rng.random()) / math.log1p(-p))

    def lose(self) -> bool:
        """Whether the next wire packet is lost."""
        return bool(self.lost_among(1))

    def lost_among(self, n: int) -> list[int]:
        """Indices (0..n-1) of the next n wire packets that are lost, in order; usually empty."""
        s = self.spec
        if s.model == "random":
            if s.rate <= 0:
                return []
            if self.gap >= n:
                self.gap -= n
                return []
            out = []
            i = self.gap
            while i < n:
                out.append(i)
                i += 1 + self._gap()
            self.gap = i - n
            return out
        r = self.rng.random
        out = []
        for i in range(n):
            if self.bad:
                if r() < s.bad_loss:
                    out.append(i)
                if r() < s.r:
                    self.bad = False
            else:
                if s.good_loss > 0 and r() < s.good_loss:
                    out.append(i)
                if r() < s.p:
                    self.bad = True
        return out


def wire_packets(length: int, mtu_bytes: int = MTU_BYTES) -> int:
    """How many wire packets an IP packet of `length` bytes becomes: 1 up to the MTU; a GSO/TSO super-packet
    is cut into segments of (MTU - headers) payload bytes each, every one with its own headers. Exact for
    Linux TCP over IPv4 with timestamps (the default); TCP without them counts one too many. A count that is
    off costs no bias: the segments the kernel really cuts each get their own draw, a draw for a segment
    that does not exist is discarded (`DelaySchedule.admit_segments`)."""
    if length <= mtu_bytes:
        return 1
    payload = mtu_bytes - TCP_IPV4_HEADER_BYTES
    return -(-(length - TCP_IPV4_HEADER_BYTES) // payload)


ADMITTED, LOST, OVERFLOW, SPLIT = 0, 1, 2, 3


class DelaySchedule:
    """When each packet leaves: arrival + delay + jitter sample, never before the packet ahead of it
    unless `reorder`; lost and over-limit packets are refused at arrival (netem drops at enqueue).

    Loss is per wire packet: a GSO/TSO super-packet of k segments gets k loss decisions. When none is
    lost it travels whole; when some are, `admit` answers SPLIT, the caller has the kernel cut it into its
    segments (NFQUEUE re-queue to the segment queue) and hands them to `admit_segments`, which drops
    exactly the lost ones and schedules the rest at the super-packet's arrival time, in its place."""

    def __init__(self, config: DelayLineConfig, mtu_bytes: int = MTU_BYTES) -> None:
        self.rng = random.Random(config.seed)
        self.config = config
        self.mtu_bytes = mtu_bytes
        self.loss = LossModel(config.loss, self.rng)
        self._split: tuple[float, list[int], int] | None = None  # (arrival, lost indices, wire packets drawn)
        self.fifo: collections.deque[tuple[float, int, int]] = collections.deque()
        self.heap: list[tuple[float, int, int]] = []
        self.last_due_s = 0.0
        self.queued_bytes = 0
        self.forwarded_packets = 0
        self.forwarded_bytes = 0
        self.dropped_loss = 0
        self.dropped_overflow = 0
        self.split_packets = 0

    def update(self, config: DelayLineConfig) -> None:
        """New parameters apply to packets arriving from now on; held packets keep their times.
        The random stream continues (no reseed) so a run stays reproducible across updates."""
        if config.loss != self.config.loss:
            self.loss = LossModel(config.loss, self.rng)
        if config.reorder != self.config.reorder:
            for item in self.fifo:
                heapq.heappush(self.heap, item)
            self.fifo.clear()
            if not config.reorder:  # in order again: the held packets in arrival (id) order, none due before the
                # one ahead (the batch verdict accepts every id up to the last), and new ones after them
                for due, pid, length in sorted(self.heap, key=lambda item: item[1]):
                    self.last_due_s = max(self.last_due_s, due)
                    self.fifo.append((self.last_due_s, pid, length))
                self.heap.clear()
        self.config = config

    @property
    def queued_packets(self) -> int:
        return len(self.fifo) + len(self.heap)

    def admit(self, now_s: float, packet_id: int, length: int) -> int:
        """ADMITTED (scheduled), LOST or OVERFLOW (the caller drops it), or SPLIT: a super-packet some of
        whose wire packets are lost; the caller passes its segments to `admit_segments` next."""
        c = self.config
        if len(self.fifo) + len(self.heap) >= c.limit_packets:
            self.dropped_overflow += 1
            return OVERFLOW
        n = 1 if length <= self.mtu_bytes else wire_packets(length, self.mtu_bytes)
        lost = self.loss.lost_among(n)
        if lost:
            if n == 1:
                self.dropped_loss += 1
                return LOST
            self._split = (now_s, lost, n)
            self.split_packets += 1
            return SPLIT
        self._schedule(now_s, packet_id, length)
        return ADMITTED

    def admit_segments(self, segments: list[tuple[int, int]]) -> list[int]:
        """The segments (id, length) of the super-packet `admit` answered SPLIT for, in order; returns the
        ids to drop (lost, or over the limit). A segment count other than the one drawn for (a protocol
        with other headers) is reconciled: extra segments get their own draws, missing ones their none."""
        if self._split is None:
            raise RuntimeError("admit_segments without a preceding SPLIT")
        arrival, lost, drawn = self._split
        self._split = None
        if len(segments) > drawn:
            lost = lost + [drawn + i for i in self.loss.lost_among(len(segments) - drawn)]
        lost_set = set(lost)
        drop = []
        for i, (pid, length) in enumerate(segments):
            if i in lost_set:
                self.dropped_loss += 1
                drop.append(pid)
            elif len(self.fifo) + len(self.heap) >= self.config.limit_packets:
                self.dropped_overflow += 1
                drop.append(pid)
            else:
                self._schedule(arrival, pid, length)
        return drop

    def _schedule(self, now_s: float, packet_id: int, length: int) -> None:
        c = self.config
        delay = c.delay_s
        if c.jitter_s:
            delay += c.jitter_s * jitter_unit_sample(self.rng, c.jitter_distribution)
            if delay < 0.0:
                delay = 0.0
        due = now_s + delay
        if c.reorder:
            heapq.heappush(self.heap, (due, packet_id, length))
        else:
            if due < self.last_due_s:
                due = self.last_due_s
            self.last_due_s = due
            self.fifo.append((due, packet_id, length))
        self.queued_bytes += length

    def next_due_s(self) -> float | None:
        if self.fifo:
            return self.fifo[0][0]
        if self.heap:
            return self.heap[0][0]
        return None

    def release(self, now_s: float, coalesce_s: float = 0.0) -> list[int]:
        """Ids of packets due at `now_s`, in release order. When the head is due, packets due within
        `coalesce_s` after `now_s` go with it (one verdict); the head itself is never released early, so
        no packet leaves more than `coalesce_s` before its time and none of the first in a burst does."""
        due = self.next_due_s()
        if due is None or due > now_s:
            return []
        now_s += coalesce_s
        out = []
        fifo = self.fifo
        while fifo and fifo[0][0] <= now_s:
            _, pid, length = fifo.popleft()
            out.append(pid)
            self.queued_bytes -= length
            self.forwarded_bytes += length
        heap = self.heap
        while heap and heap[0][0] <= now_s:
            _, pid, length = heapq.heappop(heap)
            out.append(pid)
            self.queued_bytes -= length
            self.forwarded_bytes += length
        self.forwarded_packets += len(out)
        return out

    def stats(self) -> DelayLineStats:
        return DelayLineStats(self.queued_packets, self.queued_bytes, self.forwarded_packets,
                              self.forwarded_bytes, self.dropped_loss, self.dropped_overflow, self.split_packets)


class StampClock:
    """The kernel's receive stamps (CLOCK_REALTIME) on the monotonic clock the schedule runs on.

    The offset between the clocks is read after every receive, but a packet may have been stamped before
    a realtime step (NTP, a VM's clock sync) and read after it: converted with the new offset, a forward
    step of d would make it due d early, and TCP's min RTT would keep that. So the offset used is the
    smallest read over the last `window_s` to `2 * window_s`: after a step a packet can be late by at
    most the step, for at most that long, and never early. A reading only errs upwards (realtime is read
    after monotonic), so the smallest is also the closest, and one taken across a preemption between the
    two reads (which made its batch early by the preemption) is outvoted; stamps older than the window
    are not used (`arrival_s`)."""

    def __init__(self, window_s: float = _STAMP_WINDOW_S) -> None:
        self.window_s = window_s
        self._bucket_start_s = -math.inf
        self._previous_s = math.inf  # the smallest offset of the previous bucket
        self._current_s = math.inf  # ... and of this one

    def offset_s(self, mono_s: float, realtime_s: float) -> float:
        """Record one reading of both clocks (monotonic first); the offset to subtract from a stamp."""
        off = realtime_s - mono_s
        if mono_s - self._bucket_start_s >= self.window_s:
            self._previous_s, self._current_s, self._bucket_start_s = self._current_s, off, mono_s
        elif off < self._current_s:
            self._current_s = off
        return min(self._previous_s, self._current_s)

    def arrival_s(self, stamp_s: float, offset_s: float, now_s: float) -> tuple[float, bool]:
        """(arrival on the monotonic clock, stamped?): the stamp converted when it is in (now - window, now],
        else now (no stamp, or one the clocks cannot place)."""
        if stamp_s:
            arrival = stamp_s - offset_s
            if now_s - self.window_s < arrival <= now_s:
                return arrival, True
        return now_s, False


# --------------------------------------------------------------------------------- iptables rules


def iptables_binary() -> str:
    """iptables-legacy where installed: NFQUEUE via the nft `queue` expression is absent on these kernels."""
    return "iptables-legacy" if shutil.which("iptables-legacy") else "iptables"


def rule_spec(out_ifname: str, queue_num: int) -> list[str]:
    return ["FORWARD", "-o", out_ifname, "-m", "comment", "--comment", RULE_TAG,
            "-j", "NFQUEUE", "--queue-num", str(queue_num), "--queue-bypass"]


def udp_pass_rule(out_ifname: str, src_ip: str, dport: int) -> list[str]:
    """An ACCEPT for one UDP flow ahead of the NFQUEUE rule: its datagrams go straight to the shaper, undelayed.
    Tagged like the NFQUEUE rule, so `cleanup_rules` removes it with the rest."""
    return ["-o", out_ifname, "-p", "udp", "-s", src_ip, "-m", "udp", "--dport", str(dport),
            "-m", "comment", "--comment", RULE_TAG, "-j", "ACCEPT"]


def nfqueue_rule_number(listing: str, out_ifname: str) -> int | None:
    """The 1-based position in FORWARD (`iptables -S FORWARD` output) of the NFQUEUE rule for `out_ifname`."""
    rules = [shlex.split(line) for line in listing.splitlines() if line.startswith("-A FORWARD ")]
    for i, tokens in enumerate(rules, start=1):
        if "NFQUEUE" in tokens and "-o" in tokens and tokens[tokens.index("-o") + 1] == out_ifname:
            return i
    return None


def _iptables(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([iptables_binary(), "-w", "10", *args], capture_output=True, text=True, timeout=30)


def install_rule(out_ifname: str, queue_num: int) -> None:
    r = _iptables(["-A", *rule_spec(out_ifname, queue_num)])
    if r.returncode != 0:
        raise HostError(f"delay line: iptables could not add the NFQUEUE rule on {out_ifname}: {r.stderr.strip()}")


def _tagged_rules(queue_num: int | None) -> list[list[str]]:
    r = _iptables(["-S", "FORWARD"])
    rules = []
    for line in r.stdout.splitlines():
        tokens = shlex.split(line)
        if RULE_TAG not in tokens or not tokens or tokens[0] != "-A":
            continue
        if queue_num is not None and ("--queue-num" not in tokens
                                      or tokens[tokens.index("--queue-num") + 1] != str(queue_num)):
            continue
        rules.append(tokens[1:])
    return rules


def cleanup_local_rules(queue_num: int | None = None) -> int:
    """Remove tagged delay-line rules in this process's network namespace; returns how many."""
    removed = 0
    for spec in _tagged_rules(queue_num):
        if _iptables(["-D", *spec]).returncode == 0:
            removed += 1
    return removed


def remove_stale_control_dirs(base: str | None = None, min_age_s: float = 60.0) -> int:
    """Remove control directories whose line is gone (parent and child both SIGKILLed) from `base`, by default the
    folder this host's lines make them in (`state.delayline_dir_base`); for `prfaas clean`. Directories younger than
    `min_age_s` are kept: their line may still be starting."""
    removed = 0
    for d in Path(base or delayline_dir_base()).glob(f"{DELAYLINE_DIR_PREFIX}q*"):
        try:
            if time.time() - d.stat().st_mtime < min_age_s:
                continue
        except OSError:
            continue
        try:
            fd = os.open(d / "stats", os.O_RDONLY)
            try:
                pid = _STATS.unpack(os.pread(fd, _STATS.size, 0))[-1]
            finally:
                os.close(fd)
        except (OSError, struct.error):
            pid = 0
        if pid and Path(f"/proc/{pid}").exists():
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed += 1
    return removed


def _child_argv(*args: str) -> list[str]:
    from testbed import pythonpath

    return ["env", f"PYTHONPATH={pythonpath()}", sys.executable, "-m", "testbed.net.delayline", *args]


def cleanup_rules(popen: Popen | None = None, queue_num: int | None = None) -> int:
    """Remove tagged rules (all, or one queue's) in the namespace `popen` runs in (here when None).

    Returns the number removed (-1 when run through a `popen` whose stdout is not a pipe)."""
    if popen is None:
        return cleanup_local_rules(queue_num)
    args = ["cleanup"] + ([] if queue_num is None else ["--queue-num", str(queue_num)])
    p = popen(_child_argv(*args))
    try:
        out, _ = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise HostError("delay line: cleanup of iptables rules did not finish in 60 s")
    if out is None:
        return -1
    text = out.decode() if isinstance(out, bytes) else out
    try:
        return int(text.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return -1


# ------------------------------------------------------------------------------------- stats file


def _write_stats(buf: memoryview, seq: int, state: int, s: DelaySchedule) -> int:
    """Seqlock write: odd sequence while writing, even when done; returns the new sequence."""
    _STATS.pack_into(buf, 0, seq + 1, state, s.queued_packets, s.queued_bytes, s.forwarded_packets,
                     s.forwarded_bytes, s.dropped_loss, s.dropped_overflow, s.split_packets, time.monotonic(),
                     os.getpid())
    struct.pack_into("=Q", buf, 0, seq + 2)
    return seq + 2


def read_stats_file(fd: int) -> tuple[int, DelayLineStats]:
    """(state, stats) from the child's stats file; retries while the child is mid-write."""
    seq_of = struct.Struct("=Q")
    state, counters = STATE_STARTING, [0] * 7
    for _ in range(100):
        before = os.pread(fd, 8, 0)
        raw = os.pread(fd, _STATS.size, 0)
        if len(raw) < _STATS.size:
            break
        _, state, *counters, _, _ = _STATS.unpack(raw)
        seq = seq_of.unpack(before)[0]
        if seq % 2 == 0 and os.pread(fd, 8, 0) == before:
            break
    return state, DelayLineStats(*counters)


# ------------------------------------------------------------------------------------ child process


def _set_timer_slack(ns: int) -> None:
    """Shrink the kernel's timer slack (default 50 us) so select() wakes close to the due time."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(29, ctypes.c_ulong(ns), 0, 0, 0)  # PR_SET_TIMERSLACK
    except (OSError, AttributeError):
        pass


def _set_realtime(priority: int) -> None:
    """SCHED_FIFO, so a busy host delays our wake-ups by microseconds, not a scheduler tick (netem runs in
    softirq context; this is the userspace analogue). The loop blocks in select, so it cannot hog a CPU,
    and the kernel's RT throttling bounds it anyway."""
    if priority > 0:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
        except (OSError, AttributeError):
            pass


SEGMENT_QUEUE_OFFSET = 1 << 15  # the segment queue of line N is N + this
SEGMENT_KEY = 1 << 32  # schedule keys of segments: their segment-queue id plus this (NFQUEUE ids are 32-bit)
_ID_MASK = SEGMENT_KEY - 1


def segment_queue_num(queue_num: int) -> int:
    """The queue a line's split super-packets come back on, cut into their segments."""
    if not 0 <= queue_num < SEGMENT_QUEUE_OFFSET:
        raise ValueError(f"queue_num must be in 0..{SEGMENT_QUEUE_OFFSET - 1}, not {queue_num}")
    return queue_num + SEGMENT_QUEUE_OFFSET


def interface_mtu_bytes(ifname: str) -> int:
    """The MTU of `ifname` in this network namespace (SIOCGIFMTU; /sys may show another namespace's)."""
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sk:
        req = struct.pack("16si", ifname.encode()[:15], 0)
        return struct.unpack("16si", fcntl.ioctl(sk, 0x8921, req))[1]  # SIOCGIFMTU


def release_runs(released: list[int]) -> list[tuple[bool, list[int]]]:
    """Released schedule keys -> runs of consecutive keys of one queue, in release order: (segments?, ids).
    Verdicts go out run by run, so a split super-packet's segments leave exactly in their place."""
    runs: list[tuple[bool, list[int]]] = []
    for k in released:
        seg = k >= SEGMENT_KEY
        if not runs or runs[-1][0] != seg:
            runs.append((seg, []))
        runs[-1][1].append(k - SEGMENT_KEY if seg else k)
    return runs


def _accept_mixed(q: "NfQueue", qs: "NfQueue", released: list[int], reorder: bool, segments_held: bool = True) -> int:
    """Accept verdicts for released keys of both queues, run by run; returns how many were segments.
    With no segment held (`segments_held` False, the usual case) every key is the main queue's: one run,
    without scanning the keys."""
    from testbed.net import nfqueue

    n_segments = 0
    for seg, ids in release_runs(released) if segments_held else [(False, released)]:
        sock = qs if seg else q
        n_segments += len(ids) if seg else 0
        if reorder:
            sock.send(b"".join(nfqueue.verdict(sock.queue_num, i, nfqueue.NF_ACCEPT) for i in ids))
        else:  # in order: every packet of this queue up to the run's last is due
            sock.send(nfqueue.verdict(sock.queue_num, ids[-1], nfqueue.NF_ACCEPT, batch=True))
    return n_segments


def _let_all_go(q: "NfQueue", last_id: int, buf: bytearray) -> None:
    """Accept what we hold and what is still in the socket, rather than have unbind drop it."""
    from testbed.net import nfqueue

    try:
        while True:
            n = q.sock.recv_into(buf)
            for pid, _, _ in nfqueue.parse_packets(buf, n):
                last_id = pid
    except OSError:
        pass
    if last_id >= 0:
        try:
            q.send(nfqueue.verdict(q.queue_num, last_id, nfqueue.NF_ACCEPT, batch=True))
        except OSError:
            pass


def serve(out_ifname: str, queue_num: int, config: DelayLineConfig, ctl_dir: Path, rt_priority: int = 0) -> None:
    """The child: bind the queue, install the rule, run the hot loop until told to stop, clean up."""
    from testbed.net import nfqueue

    stats_fd = os.open(ctl_dir / "stats", os.O_RDWR)
    os.ftruncate(stats_fd, 128)
    stats_map = mmap.mmap(stats_fd, 128)
    stats_buf = memoryview(stats_map)
    schedule = DelaySchedule(config)
    seq = _write_stats(stats_buf, 0, STATE_STARTING, schedule)

    stop = False
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.set_wakeup_fd(wake_w)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    ctl_fd = os.open(ctl_dir / "control", os.O_RDONLY | os.O_NONBLOCK)
    _set_timer_slack(1000)
    _set_realtime(rt_priority)

    seg_queue = segment_queue_num(queue_num)
    q = nfqueue.NfQueue(queue_num, config.limit_packets + _KERNEL_QUEUE_MARGIN)
    try:  # its own socket: a split's segments are read right after the re-queue, ahead of later packets
        qs = nfqueue.NfQueue(seg_queue, config.limit_packets + _KERNEL_QUEUE_MARGIN, gso=False)
    except BaseException:
        q.close()
        raise
    schedule.mtu_bytes = interface_mtu_bytes(out_ifname)
    buf = bytearray(65536)
    last_seg_id = -1
    held_segments = 0  # segments scheduled and not yet released (their verdicts go to the segment queue)

    def split(pid: int) -> list[bytes]:
        """Have the kernel cut super-packet `pid` into its segments; schedule them; the drop verdicts."""
        nonlocal last_seg_id, held_segments
        q.send(nfqueue.requeue_verdict(queue_num, pid, seg_queue))
        segments = []
        while True:
            try:
                n = qs.sock.recv_into(buf)
            except (BlockingIOError, InterruptedError):
                break
            for sid, slen, _ in nfqueue.parse_packets(buf, n):
                last_seg_id = sid
                segments.append((sid | SEGMENT_KEY, slen))
        lost = schedule.admit_segments(segments)
        held_segments += len(segments) - len(lost)
        return [nfqueue.verdict(seg_queue, k & _ID_MASK, nfqueue.NF_DROP) for k in lost]
    rule_installed = False
    orphaned = False
    last_id = -1  # ids grow by one per packet (mod 2^32; the kernel's batch compare is wrap-safe)
    try:
        seq = _write_stats(stats_buf, seq, STATE_INSTALLING, schedule)
        install_rule(out_ifname, queue_num)
        rule_installed = True
        seq = _write_stats(stats_buf, seq, STATE_RUNNING, schedule)
        sock = q.sock
        qfd = q.fileno()
        recv_into = sock.recv_into
        parse = nfqueue.parse_packets
        verdict = nfqueue.verdict
        admit = schedule.admit
        now_fn = time.monotonic
        stamps = StampClock()
        stamp_offset, stamp_arrival = stamps.offset_s, stamps.arrival_s
        ctl_pending = b""
        last_stats_s = 0.0
        dirty = False
        # The timer's median lateness, learnt: aim the wake-up this much before the head is due. An aimed
        # wake-up that comes early waits for the due time in a busy loop (`early`; at most the lead, once
        # per aimed wake-up): the head never leaves early (netem's rule). A head due within the lead of now
        # is slept to (late by the timer's lateness), so busy waits never chain on dense traffic.
        lead_s = 0.0
        early = False
        watch_all = [qfd, ctl_fd, wake_r]
        watch_ctl = [ctl_fd, wake_r]
        stamped = False  # the last packets carried kernel arrival times
        backlog = False  # the last drain stopped at its batch size: more is waiting
        ctl_polled_s = 0.0
        while not stop:
            due = schedule.next_due_s()
            now = now_fn()
            aimed = False
            if due is None:
                timeout = None
            elif early or due <= now:
                timeout = 0.0
            elif due - now > lead_s:
                timeout, aimed = due - now - lead_s, True
            else:
                timeout = due - now
            if dirty and (timeout is None or timeout > 0.001 or now - last_stats_s >= 0.001):
                seq = _write_stats(stats_buf, seq, STATE_RUNNING, schedule)
                last_stats_s = now
                dirty = False
            if backlog or timeout == 0:
                ready = [qfd]
                if now - ctl_polled_s >= _CTL_POLL_S:  # an update or stop is not starved by a busy line
                    ctl_polled_s = now
                    ready += select.select(watch_ctl, [], [], 0)[0]
            else:
                # In order, a new packet is never due before the ones held, and the kernel stamped its
                # arrival: no need to wake for it before the head is due (batching, fewer wake-ups).
                lazy = due is not None and stamped and not schedule.config.reorder
                if lazy and timeout is not None and timeout > _LAZY_MAX_S:
                    timeout, aimed = _LAZY_MAX_S, False
                ready = select.select(watch_ctl if lazy else watch_all, [], [], timeout)[0]
                woke = now_fn()
                if aimed and woke >= now + timeout:  # the aimed wake-up's time came: was it after the head's due?
                    early = woke < due
                    lead_s = min(_MAX_LEAD_S, max(0.0, lead_s + (-_LEAD_STEP_S if early else _LEAD_STEP_S)))
            if qfd in ready or not ready:
                drops = []
                backlog = True
                for _ in range(512):
                    try:
                        n = recv_into(buf)
                    except (BlockingIOError, InterruptedError):
                        backlog = False
                        break
                    except OSError as e:  # ENOBUFS is off; anything else is fatal
                        raise HostError(f"delay line: netlink receive failed: {e}") from e
                    now = now_fn()
                    rt_offset = stamp_offset(now, time.time())
                    for pid, length, ts in parse(buf, n):
                        last_id = pid
                        arrival, stamped = stamp_arrival(ts, rt_offset, now)
                        result = admit(arrival, pid, length)
                        if result == SPLIT:
                            seg_drops = split(pid)
                            if seg_drops:
                                qs.send(b"".join(seg_drops))
                        elif result != ADMITTED:
                            drops.append(verdict(queue_num, pid, nfqueue.NF_DROP))
                    dirty = True
                if drops:
                    q.send(b"".join(drops))
                released = schedule.release(now_fn(), COALESCE_S)
                if released or schedule.next_due_s() is None:
                    early = False
                if released:
                    dirty = True
                    held_segments -= _accept_mixed(q, qs, released, schedule.config.reorder, bool(held_segments))
            if ctl_fd in ready:
                chunk = os.read(ctl_fd, 65536)
                if not chunk:  # every writer closed: the parent is gone, so nobody else cleans its directory
                    orphaned = True
                    break
                ctl_pending += chunk
                while b"\n" in ctl_pending:
                    line, ctl_pending = ctl_pending.split(b"\n", 1)
                    msg = json.loads(line)
                    if msg.get("op") == "stop":
                        stop = True
                    elif msg.get("op") == "update":
                        new = DelayLineConfig.from_dict(msg["config"])
                        if new.limit_packets != schedule.config.limit_packets:
                            q.set_maxlen(new.limit_packets + _KERNEL_QUEUE_MARGIN)
                            qs.set_maxlen(new.limit_packets + _KERNEL_QUEUE_MARGIN)
                        schedule.update(new)
                        dirty = True
            if wake_r in ready:
                try:
                    os.read(wake_r, 512)
                except BlockingIOError:
                    pass
    finally:
        if rule_installed:
            cleanup_local_rules(queue_num)
        _let_all_go(q, last_id, buf)
        _let_all_go(qs, last_seg_id, buf)
        q.close()
        qs.close()
        schedule.fifo.clear()
        schedule.heap.clear()
        schedule.queued_bytes = 0
        _write_stats(stats_buf, seq, STATE_STOPPED, schedule)
        if orphaned:
            shutil.rmtree(ctl_dir, ignore_errors=True)


def _child_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.net.delayline")
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run one delay line in this network namespace")
    run.add_argument("--out-ifname", required=True)
    run.add_argument("--queue-num", type=int, required=True)
    run.add_argument("--ctl-dir", type=Path, required=True)
    run.add_argument("--config", required=True, help="DelayLineConfig as JSON")
    run.add_argument("--rt-priority", type=int, default=0, help="SCHED_FIFO priority (0: normal scheduling)")
    clean = sub.add_parser("cleanup", help="remove tagged delay-line rules in this network namespace")
    clean.add_argument("--queue-num", type=int, default=None)
    args = ap.parse_args(argv)
    if args.cmd == "cleanup":
        print(cleanup_local_rules(args.queue_num))
        return 0
    try:
        serve(args.out_ifname, args.queue_num, DelayLineConfig.from_dict(json.loads(args.config)), args.ctl_dir,
              args.rt_priority)
    except Exception as e:  # the parent reads the reason from the error file
        (args.ctl_dir / "error").write_text(f"{type(e).__name__}: {e}")
        print(f"delay line: {e}", file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------------- parent handle


class DelayLineProcess:
    """One delay line child in a namespace, driven through its control FIFO and stats file."""

    def __init__(self, popen: Popen, out_ifname: str, queue_num: int, config: DelayLineConfig,
                 rt_priority: int = DEFAULT_RT_PRIORITY) -> None:
        self.popen = popen
        self.rt_priority = rt_priority
        self.out_ifname = out_ifname
        self.queue_num = queue_num
        self.config = config
        self.proc: subprocess.Popen | None = None
        self._ctl_dir: Path | None = None
        self._ctl_fd = -1
        self._stats_fd = -1
        self._last = DelayLineStats(0, 0, 0, 0, 0, 0, 0)
        self._attached = False

    @classmethod
    def attach(cls, ctl_dir: str, out_ifname: str, queue_num: int, config: DelayLineConfig) -> "DelayLineProcess":
        """A handle on a delay line that another process started (the WAN control process,
        testbed.net.wanctl): it sends updates and reads stats through the same files, and neither owns
        nor stops the child."""
        def no_popen(argv: list[str]) -> subprocess.Popen:
            raise HostError(f"delay line on {out_ifname}: an attached handle starts no process")

        line = cls(no_popen, out_ifname, queue_num, config)
        line._attached = True
        line._ctl_dir = Path(ctl_dir)
        line._ctl_fd = os.open(line._ctl_dir / "control", os.O_WRONLY | os.O_NONBLOCK)
        line._stats_fd = os.open(line._ctl_dir / "stats", os.O_RDONLY)
        return line

    def start(self, timeout_s: float = 15.0) -> None:
        self._ctl_dir = Path(tempfile.mkdtemp(prefix=f"{DELAYLINE_DIR_PREFIX}q{self.queue_num}-", dir=delayline_dir_base()))
        os.mkfifo(self._ctl_dir / "control", 0o600)
        self._ctl_fd = os.open(self._ctl_dir / "control", os.O_RDWR | os.O_NONBLOCK)
        (self._ctl_dir / "stats").write_bytes(b"\0" * 128)
        self._stats_fd = os.open(self._ctl_dir / "stats", os.O_RDONLY)
        argv = _child_argv("run", "--out-ifname", self.out_ifname, "--queue-num", str(self.queue_num),
                           "--ctl-dir", str(self._ctl_dir), "--config", self.config.to_json(),
                           "--rt-priority", str(self.rt_priority))
        try:
            self.proc = self.popen(argv)
        except OSError as e:
            self.stop()
            raise HostError(f"delay line on {self.out_ifname}: could not run {argv[0]}: {e}") from e
        deadline = time.monotonic() + timeout_s
        while True:
            state, _ = read_stats_file(self._stats_fd)
            if state == STATE_RUNNING:
                return
            if self.proc.poll() is not None or state == STATE_STOPPED:
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
                reason = self._child_error()
                self.stop()
                raise HostError(f"delay line on {self.out_ifname} (queue {self.queue_num}) did not start: {reason}")
            if time.monotonic() > deadline:
                self.stop()
                raise HostError(f"delay line on {self.out_ifname} (queue {self.queue_num}) "
                                f"did not start within {timeout_s:g} s")
            time.sleep(0.01)

    def _child_error(self) -> str:
        err = self._ctl_dir / "error" if self._ctl_dir else None
        if err and err.exists():
            return err.read_text().strip()
        if self.proc is not None and self.proc.stderr is not None and self.proc.poll() is not None:
            text = self.proc.stderr.read()
            text = text.decode(errors="replace") if isinstance(text, bytes) else text
            if text.strip():
                return text.strip().splitlines()[-1]
        return f"exited with status {self.proc.poll() if self.proc else '?'}"

    def _send(self, msg: dict) -> None:
        data = (json.dumps(msg) + "\n").encode()
        os.write(self._ctl_fd, data)

    def update(self, config: DelayLineConfig) -> None:
        """Apply new delay/jitter/loss/limit to packets arriving from now on (the WAN schedule calls this)."""
        running = (read_stats_file(self._stats_fd)[0] == STATE_RUNNING if self._attached
                   else self.proc is not None and self.proc.poll() is None)
        if not running:
            raise HostError(f"delay line on {self.out_ifname} is not running")
        self._send({"op": "update", "config": dataclasses.asdict(config)})
        self.config = config

    def stats(self) -> DelayLineStats:
        if self._stats_fd < 0:
            return self._last
        _, self._last = read_stats_file(self._stats_fd)
        return self._last

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def control_dir(self) -> Path | None:
        return self._ctl_dir

    def cpu_s(self, user_only: bool = False) -> float:
        """CPU seconds the child has used (0 when gone). System time includes the kernel forwarding each
        verdict triggers (reinjection, veth, even the next hop's TCP work), which runs in our syscall;
        `user_only` is the delay line's own Python work."""
        if self.proc is None:
            return 0.0
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        ticks = int(fields[11]) + (0 if user_only else int(fields[12]))
        return ticks / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        """Stop the child (control message, then SIGTERM, then SIGKILL) and make sure its rule is gone.
        An attached handle only lets go of its files."""
        if self._attached:
            for fd in (self._ctl_fd, self._stats_fd):
                if fd >= 0:
                    os.close(fd)
            self._ctl_fd = self._stats_fd = -1
            self._ctl_dir = None
            return
        p = self.proc
        if p is not None and p.poll() is None:
            try:
                self._send({"op": "stop"})
            except OSError:
                pass
            for sig, wait_s in ((None, 3.0), (signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
                if sig is not None:
                    try:
                        p.send_signal(sig)
                    except ProcessLookupError:
                        pass
                try:
                    p.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if p is not None:
            for stream in (p.stdout, p.stderr, p.stdin):
                if stream is not None:
                    stream.close()
            state = read_stats_file(self._stats_fd)[0] if self._stats_fd >= 0 else STATE_STARTING
            if state in (STATE_INSTALLING, STATE_RUNNING):  # killed before its own cleanup ran
                cleanup_rules(self.popen, self.queue_num)
        if self._stats_fd >= 0:
            self._last = read_stats_file(self._stats_fd)[1]
            os.close(self._stats_fd)
            self._stats_fd = -1
        if self._ctl_fd >= 0:
            os.close(self._ctl_fd)
            self._ctl_fd = -1
        if self._ctl_dir is not None:
            shutil.rmtree(self._ctl_dir, ignore_errors=True)
            self._ctl_dir = None
        self.proc = None


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
