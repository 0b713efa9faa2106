"""`prfaas calibrate`: configured vs achieved WAN figures on this host, measured across the real WAN.

Rate: multi-stream iperf3 (TCP) from a PrfaaS host to a PD host and back (``-R``), its goodput counted from
the receiving interface's frames in wire time (since 2026-12-07; iperf3's own sum over-read). RTT: ping with
10 ms spacing, p50/p99/std from every reply. Loss: a UDP iperf3 burst (tens of thousands of datagrams
in about a second) per direction. Every figure is given on the wire and in emulated units (x scale).
The same measuring functions serve `benchmarks/wan_fidelity.py`.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from testbed.errors import HostError
from testbed.packet import ETHERNET_HEADER_BYTES, GOODPUT_MAX

IPERF_PORT = 5201
RATE_OMIT_S = 1  # slow start left out of the TCP rate: iperf3 runs -t ceil(RATE_OMIT_S + duration), at most 86400
_TIME_RE = re.compile(r"time=([0-9]+(?:\.[0-9]+)?) ms")  # not "time=1.2.3 ms" (a float() traceback)


@dataclass(frozen=True)
class RttStats:
    count: int
    replies: int
    p50_s: float
    p99_s: float
    mean_s: float
    std_s: float
    iqr_std_s: float = float("nan")  # (p75 - p25) / 1.349: the spread of a normal, blind to a few host stalls

    @property
    def loss(self) -> float:
        return 1 - self.replies / self.count if self.count else 0.0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]


def parse_ping_rtts_s(text: str) -> list[float]:
    return [float(m) / 1e3 for m in _TIME_RE.findall(text)]


def measure_rtt(net: Any, src: str, dst: str, *, count: int = 200, interval_s: float = 0.01) -> RttStats:
    out = net.run(src, ["ping", "-n", "-c", str(count), "-i", f"{interval_s:g}", "-W", "2", net.host_ip(dst)], timeout_s=count * interval_s + 30)
    rtts = parse_ping_rtts_s(out.stdout)
    if not rtts:
        return RttStats(count, 0, float("nan"), float("nan"), float("nan"), float("nan"))
    return RttStats(count, len(rtts), percentile(rtts, 50), percentile(rtts, 99), statistics.fmean(rtts),
                    statistics.pstdev(rtts), (percentile(rtts, 75) - percentile(rtts, 25)) / 1.349)


class IperfServer:
    """An iperf3 server in a host, for as long as the `with` block lasts; `cpu`: pinned to that CPU."""

    def __init__(self, net: Any, host: str, port: int = IPERF_PORT, cpu: int | None = None) -> None:
        self.net, self.host, self.port, self.cpu = net, host, port, cpu

    def __enter__(self) -> "IperfServer":
        pin = [] if self.cpu is None else ["taskset", "-c", str(self.cpu)]
        self.proc = self.net.popen(self.host, [*pin, "iperf3", "-s", "-p", str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # wait until it listens
            r = self.net.run(self.host, ["ss", "-Hltn", f"sport = :{self.port}"], timeout_s=5)
            if r.stdout.strip():
                return self
            time.sleep(0.05)
        raise HostError(f"iperf3 server on {self.host} did not start")

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()


def _iperf(net: Any, src: str, dst: str, args: list[str], timeout_s: float, port: int) -> dict[str, Any]:
    try:
        r = net.run(src, ["iperf3", "-J", "-c", net.host_ip(dst), "-p", str(port), *args], timeout_s=timeout_s)
    except subprocess.TimeoutExpired:  # killed by net.run; a traceback until 2026-12-07
        raise HostError(f"iperf3 from {src} to {dst} did not finish within {timeout_s:g} s") from None
    try:
        data = json.loads(r.stdout)
    except ValueError:
        raise HostError(f"iperf3 from {src} to {dst} failed: {(r.stderr or r.stdout).strip()[:200]}") from None
    if "error" in data:
        raise HostError(f"iperf3 from {src} to {dst}: {data['error']}")
    return data


FLOW_START_BYTES = 64 * 1024  # more than iperf3's control messages: the first data has arrived


@dataclass(frozen=True)
class FrameSample:
    time_s: float
    rx_bytes: int
    rx_packets: int


class ReceivedFrames:
    """A host's interface counters (`Network.rx_counters`: frames with their Ethernet headers, counted when the previous
    hop sends them, before this host's TCP work), sampled every `period_s` in a thread while in a ``with``: the WAN as
    its far end receives it, in wire time, independent of the shaper whose rate is judged and of the receiver's reads.
    `steady_rate_bps` turns the samples into a rate."""

    def __init__(self, net: Any, host: str, period_s: float = 0.02) -> None:
        self.net, self.host, self.period_s = net, host, period_s
        self.samples: list[FrameSample] = []
        self.error: Exception | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rx-frames-{host}", daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                t_a = time.monotonic()
                nbytes, npackets = self.net.rx_counters(self.host)
                self.samples.append(FrameSample((t_a + time.monotonic()) / 2, nbytes, npackets))
                self._stop.wait(self.period_s)
        except Exception as exc:  # raised in the with's thread, at its end
            self.error = exc

    def __enter__(self) -> "ReceivedFrames":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None and exc[0] is None:
            raise HostError(f"reading {self.host}'s interface counters: {self.error}")


def steady_rate_bps(samples: list[FrameSample], *, omit_s: float, duration_s: float, header_bytes: int = 0) -> float:
    """Bit rate received from `omit_s` after the flow's first data to `duration_s` later, cut short at the last
    sample before the flow stopped arriving (never an idle tail, not even one sampling period of it). Whole frames
    by default (the wire rate, the unit of the configured rate); with `header_bytes` taken off every frame (Ethernet,
    IP, TCP with options) the TCP payload, its goodput: a GSO frame carries one header for many segments, as its
    payload shows."""
    base = samples[0].rx_bytes
    start = next((s.time_s for s in samples if s.rx_bytes - base >= FLOW_START_BYTES), None)
    if start is None:
        raise HostError("iperf3 carried no data")
    # the last sample while data still arrived: one taken after the flow stopped would add idle time to the window
    end = max((s.time_s for s in samples if s.rx_bytes < samples[-1].rx_bytes - FLOW_START_BYTES), default=start)
    window = [s for s in samples if start + omit_s <= s.time_s <= min(start + omit_s + duration_s, end)]
    if len(window) < 2:
        raise HostError(f"the flow lasted too little after its {omit_s:g} s omit to measure a rate")
    a, b = window[0], window[-1]
    return (b.rx_bytes - a.rx_bytes - header_bytes * (b.rx_packets - a.rx_packets)) * 8 / (b.time_s - a.time_s)


def measure_rate_bps(net: Any, src: str, dst: str, *, streams: int = 4, duration_s: float = 5, omit_s: float = RATE_OMIT_S,
                     reverse: bool = False, port: int = IPERF_PORT) -> float:
    """Achieved TCP goodput on the wire (receiver side), `omit_s` of slow start left out (`measure_rates_bps`'s first)."""
    return measure_rates_bps(net, src, dst, streams=streams, duration_s=duration_s, omit_s=omit_s, reverse=reverse, port=port)[0]


def measure_rates_bps(net: Any, src: str, dst: str, *, streams: int = 4, duration_s: float = 5, omit_s: float = RATE_OMIT_S,
                      reverse: bool = False, port: int = IPERF_PORT) -> tuple[float, float]:
    """(TCP goodput, link rate) on the wire at the receiver, over one iperf3 run and one window, `omit_s` of slow start
    left out: the link rate counts whole frames (the unit of the configured rate), the goodput their TCP payload.

    Counted from the receiving interface's frames in wire time (`ReceivedFrames`), not from iperf3's reads: on a
    loaded host the receiver's reads (and its kernel's TCP counters) lag the wire by up to tens of MB, and iperf3
    counts what was unread when its omit ended inside the measured seconds (docs/network.md, "TCP goodput
    over-read", 2026-12-07). Headers per frame: Ethernet, and the receiving interface's MTU (`Network.mtu_bytes`,
    read in its namespace before iperf3 starts) less the connection's MSS.
    """
    receiver = src if reverse else dst
    mtu_bytes = net.mtu_bytes(receiver)
    run_s = math.ceil(omit_s + duration_s)  # iperf3 reads -t as a whole number of seconds
    with ReceivedFrames(net, receiver) as rx:
        data = _iperf(net, src, dst, ["-P", str(streams), "-t", str(run_s)] + (["-R"] if reverse else []), run_s + 30, port)
        time.sleep(0.1)
    header_bytes = ETHERNET_HEADER_BYTES + mtu_bytes - int(data["start"]["tcp_mss_default"])
    return (steady_rate_bps(rx.samples, omit_s=omit_s, duration_s=duration_s, header_bytes=header_bytes),
            steady_rate_bps(rx.samples, omit_s=omit_s, duration_s=duration_s))


def measure_udp_loss(net: Any, src: str, dst: str, *, datagrams: int = 20000, rate_bps: float = 200e6,
                     size_bytes: int = 1200, reverse: bool = False, port: int = IPERF_PORT) -> tuple[int, int]:
    """(lost, sent) of a UDP burst of about `datagrams` packets."""
    duration_s = datagrams * size_bytes * 8 / rate_bps
    # -k: exactly `datagrams` packets. -w 8M: a receive buffer that absorbs the delay line's batched
    # releases, so that only the WAN loses packets.
    args = ["-u", "-b", f"{int(rate_bps)}", "-l", str(size_bytes), "-k", str(datagrams), "-w", "8M"] + (["-R"] if reverse else [])
    try:
        data = _iperf(net, src, dst, args, 3 * duration_s + 30, port)
    except HostError:  # iperf3's control connection is occasionally reset on a saturated host: one retry
        time.sleep(0.5)
        data = _iperf(net, src, dst, args, 3 * duration_s + 30, port)
    s = data["end"]["sum"]
    return int(s["lost_packets"]), int(s["packets"])


def measure_udp_reordering(net: Any, src: str, dst: str, *, datagrams: int = 2000, rate_bps: float = 10e6,
                           size_bytes: int = 1000, port: int = IPERF_PORT) -> tuple[int, int]:
    """(out of order, received) of a UDP burst that flows from `dst` to `src`, as its receiver counts them.

    iperf3 counts out-of-order datagrams only at the receiver and does not send that count back: the
    client's JSON of a normal (client -> server) test says 0 whatever happened (its streams are marked
    `"sender": true`; `end.sum` has no such field at all). So the burst runs reversed (-R): the client
    in `src` receives, and its own per-stream counters are the receiver's.

    On a multi-CPU host the path itself reorders now and then, jitter or not: packets that leave a qdisc
    on different CPUs enter the next veth's per-CPU backlogs and may be processed out of order. Pin the
    sending server (`IperfServer(..., cpu=0)`) to keep that to the odd packet.
    """
    args = ["-u", "-R", "-b", f"{int(rate_bps)}", "-l", str(size_bytes), "-k", str(datagrams), "-w", "4M"]
    streams = _iperf(net, src, dst, args, 3 * datagrams * size_bytes * 8 / rate_bps + 30, port)["end"]["streams"]
    if not streams or any(st["udp"].get("sender", True) for st in streams):
        raise HostError(f"iperf3 from {src} to {dst}: no receiver-side UDP counters in its report")
    return (sum(int(st["udp"]["out_of_order"]) for st in streams),
            sum(int(st["udp"]["packets"]) - int(st["udp"]["lost_packets"]) for st in streams))


@dataclass(frozen=True)
class DirectionCalibration:
    direction: str
    configured_wire_bps: float
    achieved_wire_bps: float
    configured_emulated_bps: float
    achieved_emulated_bps: float
    rate_ratio: float
    configured_loss: float
    measured_loss: float
    udp_datagrams: int


@dataclass(frozen=True)
class Calibration:
    backend: str
    scale: float
    streams: int
    duration_s: float
    configured_rtt_s: float
    rtt_p50_s: float
    rtt_p99_s: float
    rtt_std_s: float
    ping_loss: float
    directions: list[DirectionCalibration]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def calibrate(net: Any, *, streams: int = 4, duration_s: float = 5, pings: int = 200, datagrams: int = 20000,
              progress: Any = None) -> Calibration:
    """Measure the running network `net` (a testbed.net.emulation.Network)."""
    src, dst = net.scenario.topology.prfaas.host_names()[0], "pd-d0"
    wan = net.scenario.wan
    step = progress or (lambda msg: None)
    step("ping across the WAN")
    rtt = measure_rtt(net, src, dst, count=pings)
    dirs = []
    with IperfServer(net, dst):
        for name, reverse in (("prfaas_to_pd", False), ("pd_to_prfaas", True)):
            spec = wan.direction(name)
            step(f"iperf3 {streams} streams, {name}")
            achieved = measure_rate_bps(net, src, dst, streams=streams, duration_s=duration_s, reverse=reverse)
            step(f"UDP loss probe, {name}")
            lost, sent = measure_udp_loss(net, src, dst, datagrams=datagrams, reverse=reverse,
                                          rate_bps=min(200e6, net.scale.wire_bps(spec.rate_bps) / 4))
            wire = net.scale.wire_bps(spec.rate_bps)
            dirs.append(DirectionCalibration(name, wire, achieved, spec.rate_bps, net.scale.emulated_bps(achieved), achieved / wire,
                                             spec.loss.mean_rate, lost / sent if sent else float("nan"), sent))
    return Calibration(net.backend, net.scale.factor, streams, duration_s, wan.rtt_s,
                       rtt.p50_s, rtt.p99_s, rtt.std_s, rtt.loss, dirs)


def print_table(cal: Calibration, console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    from testbed.units import format_duration, format_rate

    console = console or Console()
    t = Table(title=f"WAN calibration (backend {cal.backend}, scale {cal.scale:g}: emulated = wire x {cal.scale:g})")
    for col in ("direction", "configured (wire)", "TCP goodput (wire)", f"ratio (max {GOODPUT_MAX:.3f})", "loss configured", "loss measured"):
        t.add_column(col, justify="right")
    for d in cal.directions:
        t.add_row(d.direction,
                  f"{format_rate(d.configured_emulated_bps)} ({format_rate(d.configured_wire_bps)})",
                  f"{format_rate(d.achieved_emulated_bps)} ({format_rate(d.achieved_wire_bps)})",
                  f"{d.rate_ratio:.3f}", f"{d.configured_loss:.3%}", f"{d.measured_loss:.3%} of {d.udp_datagrams}")
    console.print(t)
    console.print(f"RTT configured {format_duration(cal.configured_rtt_s)}: p50 {format_duration(cal.rtt_p50_s)}, "
                  f"p99 {format_duration(cal.rtt_p99_s)}, std {format_duration(cal.rtt_std_s)}, ping loss {cal.ping_loss:.2%}")
