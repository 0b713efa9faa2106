"""Benchmark of the userspace NFQUEUE delay line on real namespaces (a - r - b, the line and HTB in r).

Measures, side by side in one run: rate fidelity through delay line + HTB bottleneck (4 iperf3 streams,
10 ms one-way), the highest wire rate held at >= 0.95, the delay line's CPU-seconds per GB, TCP's kernel
min RTT under that load (no packet may leave early), ping RTT min/p50/p99 idle and under an iperf3 flow
at half the rate, jitter (RTT standard deviation) and loss over
>= 20,000 UDP probes. Prints a table, optionally writes JSON, exits 1 when a target is missed.

The measurement functions take an `NsLab` and are importable (benchmarks/wan_fidelity.py uses them):
`measure_throughput`, `measure_rtt`, `measure_loss`, `run_all`.

    sudo .venv/bin/python benchmarks/delayline_bench.py --quick [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testbed.atomic import write_json  # noqa: E402
from testbed.net import shaping  # noqa: E402
from testbed.net.delayline import COALESCE_S, DEFAULT_RT_PRIORITY, DelayLineConfig, DelayLineProcess  # noqa: E402
from testbed.net.nslab import B_ADDR, NsLab  # noqa: E402
from testbed.scenario import LinkDirectionSpec, LossSpec  # noqa: E402
from testbed.units import QueueLimit  # noqa: E402
from testbed.validation import output_file_option  # noqa: E402

RATE_TARGET = 0.95
EARLY_TOLERANCE_MS = 2e3 * COALESCE_S + 0.05  # a min RTT may fall short of 2 x delay by the coalescing window each way
CAPACITY_GOAL_BPS = 8e9


# ------------------------------------------------------------------------------------------- plumbing


@contextmanager
def delay_lines(lab: NsLab, a_to_b: DelayLineConfig, b_to_a: DelayLineConfig,
                rt_priority: int = DEFAULT_RT_PRIORITY) -> Iterator[list[DelayLineProcess]]:
    """Both directions' delay lines in r (queues 20 and 21), always stopped."""
    lines = [DelayLineProcess(lab.popen_in(lab.r), "rb", 20, a_to_b, rt_priority),
             DelayLineProcess(lab.popen_in(lab.r), "ra", 21, b_to_a, rt_priority)]
    try:
        for dl in lines:
            dl.start()
        yield lines
    finally:
        for dl in lines:
            dl.stop()


@contextmanager
def htb_bottleneck(lab: NsLab, rate_bps: float | None, one_way_delay_s: float) -> Iterator[None]:
    """HTB at `rate_bps` with a 1-BDP bfifo on r's interface towards b (testbed.net.shaping's plan)."""
    if rate_bps is None:
        yield
        return
    from pyroute2 import NetNS

    ipr = NetNS(lab.r)
    try:
        idx = ipr.link_lookup(ifname="rb")[0]
        spec = LinkDirectionSpec(rate_bps=rate_bps, delay_s=one_way_delay_s, queue=QueueLimit("bdp", 1.0))
        shaping.apply_plan(ipr, idx, shaping.plan_shaping(spec, shaper="htb"))
        yield
    finally:
        try:
            shaping.clear_root(ipr, idx)
        finally:
            ipr.close()


def _iperf3(lab: NsLab, streams: int, duration_s: float, rate_bps: float | None = None) -> dict:
    """iperf3 a -> b; the report carries `kernel_min_rtt_ms`: each connection's kernel min RTT (`ss`,
    read 0.5 s before the end; iperf3's own min_rtt is the smallest smoothed RTT, queue included)."""
    server = lab.popen_in(lab.b)(["iperf3", "-s", "-1"])
    client = None
    try:
        time.sleep(0.3)
        args = ["iperf3", "-c", B_ADDR, "-t", f"{duration_s:g}", "-P", str(streams), "-J", "-O", "1"]
        if rate_bps:
            args += ["-b", f"{int(rate_bps / streams)}"]
        client = lab.popen_in(lab.a)(args)
        time.sleep(max(0.0, 1.0 + duration_s - 0.5))  # -O 1: the run lasts 1 + duration_s
        ss = lab.sh(lab.a, "ss", "-tin", "dst", B_ADDR, check=False).stdout
        out, err = client.communicate(timeout=duration_s + 60)
        try:
            report = json.loads(out)
        except ValueError:  # iperf3 failed: report zero throughput, which fails the target visibly
            return {"error": (err or out).decode(errors="replace")[-300:]}
        report["kernel_min_rtt_ms"] = _min_rtts_ms(ss)
        return report
    finally:
        for p in (client, server):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def _min_rtts_ms(ss_output: str) -> list[float]:
    """The kernel min RTT of every connection in `ss -tin` output (iperf3's control connection included:
    a packet of it that left early is a fault too)."""
    return [float(x) for x in re.findall(r"minrtt:([\d.]+)", ss_output)]


def _ping_rtts_ms(lab: NsLab, count: int, interval_s: float) -> list[float]:
    r = lab.sh(lab.a, "ping", "-n", "-c", str(count), "-i", f"{interval_s:g}", "-W", "2", B_ADDR,
               check=False, timeout=count * interval_s + 30)
    return [float(x) for x in re.findall(r"time=([\d.]+) ms", r.stdout)]


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))] if s else float("nan")


# --------------------------------------------------------------------------------------- measurements


@dataclass
class ThroughputResult:
    configured_bps: float | None  # HTB wire rate; None = unshaped (the delay line's own ceiling)
    one_way_delay_s: float
    rt_priority: int
    achieved_bps: float
    ratio: float | None
    forwarded_bytes: int
    delayline_cpu_s: float
    cpu_s_per_gb: float  # user + system of both lines per GB forwarded a -> b
    user_cpu_s_per_gb: float  # the lines' own (Python) work; system time includes kernel forwarding
    retransmits: int
    tcp_min_rtt_ms: float  # the smallest kernel min RTT of the run's connections: a packet that left early shows here

    @property
    def min_rtt_ok(self) -> bool:
        return self.tcp_min_rtt_ms >= 2e3 * self.one_way_delay_s - EARLY_TOLERANCE_MS


def measure_throughput(lab: NsLab, rate_bps: float | None, one_way_delay_s: float = 0.010, streams: int = 4,
                       duration_s: float = 5.0, rt_priority: int = DEFAULT_RT_PRIORITY) -> ThroughputResult:
    """iperf3 `streams` a -> b through both delay lines and (unless None) an HTB bottleneck at `rate_bps`."""
    cfg = DelayLineConfig(delay_s=one_way_delay_s)
    with delay_lines(lab, cfg, cfg, rt_priority) as lines, htb_bottleneck(lab, rate_bps, one_way_delay_s):
        cpu0 = sum(dl.cpu_s() for dl in lines)
        user0 = sum(dl.cpu_s(user_only=True) for dl in lines)
        fwd0 = lines[0].stats().forwarded_bytes
        res = _iperf3(lab, streams, duration_s)
        cpu = sum(dl.cpu_s() for dl in lines) - cpu0
        user = sum(dl.cpu_s(user_only=True) for dl in lines) - user0
        fwd = lines[0].stats().forwarded_bytes - fwd0
    end = res.get("end", {})
    achieved = end.get("sum_received", {}).get("bits_per_second", 0.0)
    retrans = end.get("sum_sent", {}).get("retransmits", 0)
    return ThroughputResult(rate_bps, one_way_delay_s, rt_priority, achieved, achieved / rate_bps if rate_bps else None,
                            fwd, cpu, cpu / (fwd / 1e9) if fwd else float("nan"),
                            user / (fwd / 1e9) if fwd else float("nan"), retrans,
                            min(res.get("kernel_min_rtt_ms") or [float("nan")]))


@dataclass
class RttResult:
    one_way_delay_s: float
    jitter_s: float
    load_bps: float | None
    samples: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    std_ms: float
    expected_ms: float  # 2 x one-way delay
    min_ms: float

    @property
    def p50_ok(self) -> bool:
        return abs(self.p50_ms - self.expected_ms) <= 0.2 + 0.01 * self.expected_ms

    @property
    def p99_ok(self) -> bool:
        return abs(self.p99_ms - self.expected_ms) <= 1.0 + 0.02 * self.expected_ms

    @property
    def min_ok(self) -> bool:
        """No probe left early (jitter lets them, by design; this judges only lines without it)."""
        return self.jitter_s > 0 or self.min_ms >= self.expected_ms - EARLY_TOLERANCE_MS


def measure_rtt(lab: NsLab, one_way_delay_s: float, jitter_s: float = 0.0, count: int = 300, interval_s: float = 0.01,
                load_bps: float | None = None, wire_rate_bps: float | None = None) -> RttResult:
    """Ping RTT across delay lines in both directions (jitter, normal, on a -> b only, so the RTT's standard
    deviation should equal `jitter_s`); with `load_bps` an iperf3 flow at that rate runs meanwhile through an
    HTB bottleneck at `wire_rate_bps`."""
    fwd = DelayLineConfig(delay_s=one_way_delay_s, jitter_s=jitter_s)
    with delay_lines(lab, fwd, DelayLineConfig(delay_s=one_way_delay_s)), \
            htb_bottleneck(lab, wire_rate_bps if load_bps else None, one_way_delay_s):
        load = None
        if load_bps:
            server = lab.popen_in(lab.b)(["iperf3", "-s", "-1"])
            time.sleep(0.3)
            load = lab.popen_in(lab.a)(["iperf3", "-c", B_ADDR, "-t", f"{count * interval_s + 3:g}",
                                        "-b", str(int(load_bps))])
            time.sleep(1.5)  # past slow start
        try:
            rtts = _ping_rtts_ms(lab, count, interval_s)
        finally:
            if load is not None:
                load.kill()
                load.wait()
                server.kill()
                server.wait()
    return RttResult(one_way_delay_s, jitter_s, load_bps, len(rtts), _pct(rtts, 0.5), _pct(rtts, 0.99),
                     statistics.fmean(rtts) if rtts else float("nan"),
                     statistics.pstdev(rtts) if len(rtts) > 1 else float("nan"), 2e3 * one_way_delay_s,
                     min(rtts, default=float("nan")))


@dataclass
class LossResult:
    configured: float
    probes: int
    received: int
    measured: float
    delayline_dropped: int

    @property
    def ok(self) -> bool:
        return abs(self.measured - self.configured) <= 0.2 * self.configured


def measure_loss(lab: NsLab, loss_rate: float, probes: int = 20_000, pps: float = 20_000,
                 one_way_delay_s: float = 0.005, seed: int = 1) -> LossResult:
    """UDP probes a -> b through a delay line with random loss `loss_rate`; loss = 1 - received / sent."""
    cfg = DelayLineConfig(delay_s=one_way_delay_s, loss=LossSpec("random", loss_rate), seed=seed)
    with delay_lines(lab, cfg, DelayLineConfig(delay_s=one_way_delay_s)) as lines:
        probe = lab.udp_probe(probes, pps)
        dropped = lines[0].stats().dropped_loss
    return LossResult(loss_rate, probes, probe.received, probe.loss, dropped)


# ---------------------------------------------------------------------------------------------- run


@dataclass
class BenchResult:
    rate: list[ThroughputResult] = field(default_factory=list)
    capacity: list[ThroughputResult] = field(default_factory=list)
    rtt: list[RttResult] = field(default_factory=list)
    jitter: list[RttResult] = field(default_factory=list)
    loss: list[LossResult] = field(default_factory=list)

    def held_capacity_bps(self) -> float:
        ok = [t.configured_bps for t in self.capacity + self.rate if t.ratio is not None and t.ratio >= RATE_TARGET]
        return max(ok, default=0.0)

    def failures(self) -> list[str]:
        out = [f"rate {t.configured_bps / 1e9:g} Gbps: {t.ratio:.3f} < {RATE_TARGET}"
               for t in self.rate if t.ratio < RATE_TARGET]
        out += [f"{_gbps(t.configured_bps)} Gbps: TCP min RTT {t.tcp_min_rtt_ms:.3f} ms on a "
                f"{2e3 * t.one_way_delay_s:g} ms path" for t in self.rate + self.capacity if not t.min_rtt_ok]
        for r in self.rtt:
            tag = f"RTT {r.expected_ms:g} ms {'loaded' if r.load_bps else 'idle'}"
            if not r.p50_ok:
                out.append(f"{tag}: p50 {r.p50_ms:.2f} ms")
            if not r.p99_ok:
                out.append(f"{tag}: p99 {r.p99_ms:.2f} ms")
            if not r.min_ok:
                out.append(f"{tag}: min {r.min_ms:.2f} ms")
        out += [f"jitter {j.jitter_s * 1e3:g} ms: RTT std {j.std_ms:.3f} ms" for j in self.jitter
                if abs(j.std_ms - j.jitter_s * 1e3) > 0.2 * j.jitter_s * 1e3]
        out += [f"loss {l.configured:.1%}: measured {l.measured:.3%}" for l in self.loss if not l.ok]
        return out


def run_all(quick: bool = False, progress: object = None) -> BenchResult:
    """Every measurement of this benchmark in one lab (namespaces always removed)."""
    dur = 4.0 if quick else 10.0
    res = BenchResult()
    steps: list = []
    for rate in (0.5e9, 1e9, 2e9, 5e9):
        steps.append(("rate", lambda lab, rate=rate: measure_throughput(lab, rate, 0.010, 4, dur)))
    for rate in ((8e9,) if quick else (8e9, 10e9)):
        steps.append(("capacity", lambda lab, rate=rate: measure_throughput(lab, rate, 0.010, 4, dur)))
    steps.append(("capacity", lambda lab: measure_throughput(lab, None, 0.010, 4, dur)))
    steps.append(("capacity", lambda lab: measure_throughput(lab, None, 0.010, 4, dur, rt_priority=0)))
    for d in ((0.010,) if quick else (0.005, 0.010, 0.025, 0.050)):
        steps.append(("rtt", lambda lab, d=d: measure_rtt(lab, d, count=300)))
        steps.append(("rtt", lambda lab, d=d: measure_rtt(lab, d, count=300, load_bps=0.5e9, wire_rate_bps=1e9)))
    for j in ((0.002,) if quick else (0.001, 0.002, 0.005)):
        steps.append(("jitter", lambda lab, j=j: measure_rtt(lab, 0.010, jitter_s=j, count=500)))
    for p in (0.001, 0.01, 0.05):
        probes = max(20_000, int(100 / p))  # >= 100 expected losses keeps +-20% at 2 sigma
        steps.append(("loss", lambda lab, p=p, probes=probes: measure_loss(lab, p, probes)))
    with NsLab() as lab:
        for i, (kind, fn) in enumerate(steps):
            if progress:
                progress(i, len(steps), kind)
            getattr(res, kind).append(fn(lab))
    return res


def _gbps(bps: float | None) -> str:
    return "unshaped" if bps is None else f"{bps / 1e9:g}"


def print_tables(res: BenchResult) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=120)
    t = Table(title="Rate through delay line + HTB (4 streams, 10 ms one-way)")
    for c in ("wire Gbps", "line sched", "achieved Gbps", "ratio", "retransmits", "line CPU s/GB", "line user s/GB",
              "TCP min RTT ms"):
        t.add_column(c, justify="right")
    for r in res.rate + res.capacity:
        t.add_row(_gbps(r.configured_bps), f"FIFO {r.rt_priority}" if r.rt_priority else "normal",
                  f"{r.achieved_bps / 1e9:.3f}", "-" if r.ratio is None else f"{r.ratio:.3f}",
                  str(r.retransmits), f"{r.cpu_s_per_gb:.3f}", f"{r.user_cpu_s_per_gb:.3f}",
                  f"{r.tcp_min_rtt_ms:.3f}" + ("" if r.min_rtt_ok else " early"))
    con.print(t)
    cap = res.held_capacity_bps()
    unshaped = {bool(r.rt_priority): r.achieved_bps for r in res.capacity if r.configured_bps is None}
    con.print(f"capacity: highest wire rate held at >= {RATE_TARGET}: {cap / 1e9:g} Gbps "
              f"(goal >= {CAPACITY_GOAL_BPS / 1e9:g}); unshaped ceiling at 20 ms RTT: "
              f"{unshaped.get(True, 0) / 1e9:.2f} Gbps (SCHED_FIFO lines), "
              f"{unshaped.get(False, 0) / 1e9:.2f} Gbps (normal scheduling)")
    t = Table(title="Ping RTT vs 2 x one-way delay (target p50 within 0.2 ms + 1%, p99 within 1 ms + 2%, "
                    f"min no more than {EARLY_TOLERANCE_MS} ms short)")
    for c in ("2 x delay ms", "load", "n", "min ms", "p50 ms", "p99 ms", "min ok", "p50 ok", "p99 ok"):
        t.add_column(c, justify="right")
    for r in res.rtt:
        t.add_row(f"{r.expected_ms:g}", "idle" if not r.load_bps else f"{r.load_bps / 1e9:g} Gbps", str(r.samples),
                  f"{r.min_ms:.3f}", f"{r.p50_ms:.3f}", f"{r.p99_ms:.3f}", str(r.min_ok), str(r.p50_ok),
                  str(r.p99_ok))
    con.print(t)
    t = Table(title="Jitter (normal, a->b only, 10 ms): RTT std vs configured (target within 20%)")
    for c in ("jitter ms", "RTT std ms", "ratio", "mean RTT ms"):
        t.add_column(c, justify="right")
    for j in res.jitter:
        t.add_row(f"{j.jitter_s * 1e3:g}", f"{j.std_ms:.3f}", f"{j.std_ms / (j.jitter_s * 1e3):.3f}",
                  f"{j.mean_ms:.3f}")
    con.print(t)
    t = Table(title="Loss over UDP probes (target within +-20% relative)")
    for c in ("configured", "probes", "measured", "delay-line drops", "ok"):
        t.add_column(c, justify="right")
    for l in res.loss:
        t.add_row(f"{l.configured:.2%}", str(l.probes), f"{l.measured:.3%}", str(l.delayline_dropped), str(l.ok))
    con.print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short runs, one delay and one jitter value")
    ap.add_argument("--json", type=output_file_option, help="write all figures to this JSON file")
    args = ap.parse_args(argv)
    from rich.progress import Progress

    with Progress(transient=True) as prog:
        task = prog.add_task("delay-line benchmark", total=None)

        def progress(i: int, n: int, kind: str) -> None:
            prog.update(task, total=n, completed=i, description=f"delay-line benchmark: {kind}")

        res = run_all(args.quick, progress)
    print_tables(res)
    if args.json:
        write_json(args.json, asdict(res), indent=2)
    fails = res.failures()
    for f in fails:
        print(f"MISSED: {f}")
    return 1 if fails else 0


if __name__ == "__main__":
    from testbed.cli import guarded

    sys.exit(guarded(Path(__file__).name, main))
