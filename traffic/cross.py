"""Background (cross) traffic on the WAN: iperf3 TCP and UDP flows between the datacenters' ``*-x*`` hosts.

Each flow runs in periods (constant: one period; on/off: repeating; schedule: a list of rate changes).
Every period starts a one-off iperf3 server on the receiving host and a client on the sending host, both
writing JSON logs; the receiver's per-interval report is the flow's achieved throughput. Processes are
started through an injected ``popen(host, argv)`` (the emulated network's, or a test's namespaces) and
addresses come from ``host_ip(host)``, so this module never touches namespaces itself. `stop()` (also on
leaving a ``with`` block) ends every process and writes ``cross_traffic.parquet``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import subprocess
import tempfile
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from testbed import clock, units
from testbed.rundir import CROSS_TRAFFIC_FILE, cross_traffic_frame
from testbed.scale import Scale
from testbed.errors import FieldError
from testbed.scenario import DIRECTIONS, Scenario, WireRate
from testbed.validation import Fields, congestion_control, count_up_to, path_name, text

PROTOCOLS = ("tcp", "udp")
PATTERNS = ("constant", "onoff", "schedule")
HOST_RE = re.compile(r"^(prfaas|pd)-x\d+$")
BASE_PORT = 5301
SERVER_READY_S = 0.25
# A UDP flow's socket buffers (iperf3 -w, which the client also hands to the server): this long of the flow at its
# rate, within these bounds. The default receive buffer (net.core.rmem_default, 208 KiB) holds ~5 ms of a 320-Mbps
# flow, so a receiver that waits a few ms for a CPU on a busy host drops datagrams that the WAN delivered, and iperf3
# counts them as lost (docs/traffic.md, "Loss the WAN did not cause"). The ceiling stays within net.core.rmem_max
# as Mininet raises it (16 MiB).
UDP_BUFFER_S = 0.1
UDP_BUFFER_BYTES = (1 << 20, 8 << 20)
# iperf3's scheduling: the neighbours stand for other tenants' machines, whose sending does not wait for this
# host's CPU. At nice 0 a 320-Mbps UDP sender on a busy 2-core host sent 50-75% of its rate for whole dips, and
# at nice -10 40-72%; with SCHED_RR 5 on both ends it sent its rate with no receive-buffer drop (docs/traffic.md,
# "Neighbours that send what they are configured to"). Below the delay line's and the WAN control process's 10
# (testbed.net.wanctl: in the runner's own threads, the schedule waited behind these for the runner's GIL).
# Where a real-time priority is refused, nice -10.
RT_PRIORITY = 5
NICE = -10
# A client's own timer (iperf3 -t, whole seconds) is only a backstop, this long past its period's end: a period ends
# when the runner sends SIGTERM at its end time, the same path every time. With -t at the period's length the two
# ends raced: a client whose timer ran out a few ms before the SIGTERM was in its end-of-test exchange with the server
# when the signal came, and in one val-cross-surge run (scale 50, 2026-12-06) the server then wrote no report at all.
CLIENT_BACKSTOP_S = 2
IPERF3_MAX_T_S = 86400  # the longest -t iperf3 accepts (a period without an end runs until stop())
# The most streams a flow may have: iperf3's -P maximum, 128 ("number of parallel streams too large (maximum = 128)",
# iperf 3.12; MAX_STREAMS in its source). `streams: 1000` passed the scenario reader and its client exited at once.
IPERF3_MAX_STREAMS = 128
# The most periods a flow may start in a run: 10,000, each a new iperf3 server and client (`CrossTraffic._run_period`).
# `on: 1us, off: 1us` planned 15 million pairs of processes in a 30-s run, and `prfaas check` took 22 s to count them
# (1ns: hours) and, for a UDP flow without `stop`, exhausted memory listing its endless periods (2026-12-07).
MAX_PERIODS = 10_000
IPERF3_MAX_INTERVAL_S = 60.0  # iperf3's MAX_INTERVAL: the longest -i


@dataclass(frozen=True)
class RatePeriod:
    start_s: float  # from the start of the cross traffic
    end_s: float | None  # None: until stop()
    rate_bps: float | None  # None: unlimited (TCP only)


@dataclass(frozen=True)
class FlowSpec:
    name: str
    protocol: str = "tcp"
    src: str = "prfaas-x0"
    dst: str = "pd-x0"
    rate_bps: float | None = None  # UDP: required; TCP: an optional cap (iperf3 -b)
    streams: int = 1
    pattern: str = "constant"
    start_s: float = 0.0
    stop_s: float | None = None
    on_s: float = 0.0
    off_s: float = 0.0
    schedule: tuple[tuple[float, float | None], ...] = ()  # (at_s, rate_bps or None = off)
    congestion: str | None = None  # TCP congestion control (iperf3 -C), e.g. cubic, bbr

    def periods_until(self, end_s: float) -> Iterator[RatePeriod]:
        """The active periods that start before `end_s` (a run's duration): finitely many, on/off or not."""
        return itertools.takewhile(lambda p: p.start_s < end_s, self.periods())

    def periods(self) -> Iterator[RatePeriod]:
        """The flow's active periods in time order (endless for an on/off flow without `stop_s`)."""
        stop = self.stop_s
        if self.pattern == "constant":
            yield RatePeriod(self.start_s, stop, self.rate_bps)
        elif self.pattern == "onoff":
            t = self.start_s
            while stop is None or t < stop:
                end = t + self.on_s if stop is None else min(t + self.on_s, stop)
                yield RatePeriod(t, end, self.rate_bps)
                t += self.on_s + self.off_s
        else:
            for i, (at, rate) in enumerate(self.schedule):
                end = self.schedule[i + 1][0] if i + 1 < len(self.schedule) else stop
                if rate is not None and (stop is None or at < stop):
                    yield RatePeriod(at, end if stop is None or end is None else min(end, stop), rate)


@dataclass(frozen=True)
class CrossTrafficSpec:
    flows: tuple[FlowSpec, ...] = ()
    interval_s: float = 1.0  # iperf3 report interval (the resolution of the throughput record)

    def scaled(self, scale: Scale | float) -> "CrossTrafficSpec":
        """The wire version of an emulated-units spec: every rate divided by the scenario's `scale`."""
        to_wire = Scale.of(scale).wire_bps

        def div(r: float | None) -> float | None:
            return None if r is None else to_wire(r)

        flows = tuple(replace(f, rate_bps=div(f.rate_bps), schedule=tuple((at, div(r)) for at, r in f.schedule)) for f in self.flows)
        return replace(self, flows=flows)

    def open_loop_udp(self, base_port: int = BASE_PORT) -> list[tuple[str, str, int]]:
        """(sending host, receiving host, server port) of each UDP flow, as `CrossTraffic` numbers their ports:
        constant-rate senders, which the WAN's delay does not pace (`testbed.net.emulation.Network.pass_open_loop_udp`)."""
        return [(f.src, f.dst, port) for f, port in zip(self.flows, self.ports(base_port)) if f.protocol == "udp"]

    def ports(self, base_port: int = BASE_PORT) -> list[int]:
        """Each flow's iperf3 server port, in the order of `flows` (the one numbering of them)."""
        return [base_port + i for i in range(len(self.flows))]


stream_count = count_up_to(IPERF3_MAX_STREAMS, "the most parallel streams iperf3 runs (-P)")  # a flow's `streams`, calibrate's --streams


def _host(v: Any) -> str:
    if not isinstance(v, str) or not HOST_RE.match(v):
        raise ValueError(f"{v!r} is not a cross-traffic host; use prfaas-x<i> or pd-x<i>")
    return v


def _rate_or_off(v: Any) -> float | None:
    return None if v in ("off", 0, "0") else units.parse_rate_bps(v)


def _read_flow(f: Fields, index: int) -> FlowSpec:
    name = f.get("name", lambda v: path_name(text(v), "its iperf3 logs <name>.<period>.server.json"), f"flow{index}")
    protocol = f.choice("protocol", PROTOCOLS, "tcp")
    direction = f.choice("direction", DIRECTIONS, "prfaas_to_pd")
    default_src, default_dst = ("prfaas-x0", "pd-x0") if direction == "prfaas_to_pd" else ("pd-x0", "prfaas-x0")
    src, dst = f.get("src", _host, default_src), f.get("dst", _host, default_dst)
    if src.split("-")[0] == dst.split("-")[0]:
        raise f.error("dst", f"{src} and {dst} are in the same datacenter; cross traffic crosses the WAN")
    pattern = f.choice("pattern", PATTERNS, "constant")
    rate = f.get("rate", units.parse_rate_bps, None)
    sched: list[tuple[float, float | None]] = []
    for e in f.items("schedule"):
        sched.append((e.get("at", units.parse_duration_s), e.get("rate", _rate_or_off)))
        e.done()
    spec = FlowSpec(
        name=name, protocol=protocol, src=src, dst=dst, rate_bps=rate,
        streams=f.get("streams", stream_count, 1),
        pattern=pattern,
        start_s=f.get("start", units.parse_duration_s, 0.0),
        stop_s=f.get("stop", lambda v: units.parse_duration_s(v, allow_zero=False), None),
        on_s=f.get("on", lambda v: units.parse_duration_s(v, allow_zero=False), 0.0),
        off_s=f.get("off", lambda v: units.parse_duration_s(v, allow_zero=False), 0.0),
        schedule=tuple(sched),
        congestion=f.get("congestion", congestion_control, None),
    )
    if pattern == "onoff" and (spec.on_s <= 0 or spec.off_s <= 0):
        raise f.error("on", "an on/off flow needs both on and off durations, e.g. on: 5s, off: 5s")
    if pattern != "onoff" and (f.has("on") or f.has("off")):
        raise f.error("on", "on/off durations need pattern: onoff")
    if pattern == "schedule":
        if not sched:
            raise f.error("schedule", "pattern: schedule needs entries like {at: 10s, rate: 2Gbps} (rate: off pauses)")
        if any(b[0] < a[0] for a, b in zip(sched, sched[1:])):
            raise f.error("schedule", "entries must be in time order")
    elif sched:
        raise f.error("schedule", "a schedule needs pattern: schedule")
    if protocol == "udp" and pattern != "schedule" and rate is None:
        raise f.error("rate", "a UDP flow needs a rate (UDP has no congestion control), e.g. rate: 1Gbps")
    if protocol == "udp" and spec.congestion:
        raise f.error("congestion", "only TCP flows have a congestion-control algorithm")
    if spec.stop_s is not None and spec.stop_s <= spec.start_s:
        raise f.error("stop", f"{spec.stop_s:g}s must be after start {spec.start_s:g}s")
    f.done()
    return spec


def parse_cross_traffic_section(f: Fields) -> CrossTrafficSpec:
    """The scenario's ``cross_traffic:`` mapping -> `CrossTrafficSpec` (see docs/scenario-workload.md)."""
    flows = tuple(_read_flow(ff, i) for i, ff in enumerate(f.items("flows")))
    names = [fl.name for fl in flows]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise f.error("flows", f"two flows are named {dup!r}; names must be unique")
    # iperf3's -i is from 0.1 to 60 s ("invalid report interval (min = 0.1, max = 60 seconds)"): `interval: 1h` passed
    # `prfaas check` and every iperf3 of the run exited at once (2026-12-07)
    spec = CrossTrafficSpec(flows, f.get("interval", lambda v: units.parse_duration_s(
        v, allow_zero=False, most_s=IPERF3_MAX_INTERVAL_S, most="60s, the longest report interval iperf3 takes (-i)"), 1.0))
    if spec.interval_s < 0.1:
        raise f.error("interval", "iperf3 reports at most every 0.1s")
    f.done()
    return spec


def cross_traffic_rates(spec: CrossTrafficSpec) -> list[WireRate]:
    """Every flow's rates, named by field: what the scenario's `scale` divides onto the wire (`Section.rates`), each
    shared by the flow's `streams` (iperf3 -b is a stream's rate: `iperf3_client_argv`)."""
    rates = [WireRate(f"cross_traffic.flows[{i}].rate", f.rate_bps, f.streams, f"cross_traffic.flows[{i}].streams")
             for i, f in enumerate(spec.flows) if f.rate_bps is not None]
    return rates + [WireRate(f"cross_traffic.flows[{i}].schedule[{j}].rate", r, f.streams, f"cross_traffic.flows[{i}].streams")
                    for i, f in enumerate(spec.flows) for j, (_, r) in enumerate(f.schedule) if r is not None]


def check_cross_traffic(scenario: Scenario) -> None:
    """Every flow's endpoints are hosts of the topology (``prfaas-x<i>`` needs topology.prfaas.cross > i): a flow on
    a host the topology lacks passed `prfaas check` and failed the run once its network was up. A flow starts within
    the run (as `wan.schedule`'s entries, its schedule's entries fall inside it), and starts at most `MAX_PERIODS`
    periods in it."""
    spec: CrossTrafficSpec = scenario.section("cross_traffic")
    duration = scenario.duration_s
    for i, flow in enumerate(spec.flows):
        name = f"cross_traffic.flows[{i}]"
        if flow.pattern != "schedule" and flow.start_s >= duration:  # it never ran, without a word
            raise FieldError(f"{name}.start", f"{flow.start_s:g}s is not before the end of the run (duration {duration:g}s): "
                             "the flow would never start", scenario.source)
        for j, (at, _) in enumerate(flow.schedule):
            if at > duration:
                raise FieldError(f"{name}.schedule[{j}].at", f"{at:g}s is after the end of the run (duration {duration:g}s)",
                                 scenario.source)
        if sum(1 for _ in itertools.islice(flow.periods_until(duration), MAX_PERIODS + 1)) > MAX_PERIODS:
            each = f"more than {MAX_PERIODS:,} periods in the run ({duration:g}s), each a new iperf3 server and client"
            if flow.pattern == "schedule":  # its entries are its periods; it has no on and off
                raise FieldError(f"{name}.schedule", f"starts {each}; give at most {MAX_PERIODS:,} entries", scenario.source)
            raise FieldError(f"{name}.on", f"on {flow.on_s:g}s, off {flow.off_s:g}s start {each}; lengthen on and off",
                             scenario.source)
        for end, host in (("src", flow.src), ("dst", flow.dst)):
            dc, index = host.split("-x")
            have = scenario.topology.datacenter(dc).cross_hosts
            if int(index) >= have:
                hosts = f" or use {', '.join(f'{dc}-x{k}' for k in range(have))}" if have else ""
                raise FieldError(f"cross_traffic.flows[{i}].{end}", f"{host} is not a host of the topology: topology.{dc}.cross "
                                 f"is {have}; raise it{hosts}", scenario.source)


def iperf3_client_argv(flow: FlowSpec, ip: str, port: int, duration_s: float, rate_bps: float | None, interval_s: float, log: Path) -> list[str]:
    """A client for a period of `duration_s`, which the runner ends at its end time (`CLIENT_BACKSTOP_S`)."""
    seconds = min(max(1, math.ceil(duration_s)) + CLIENT_BACKSTOP_S, IPERF3_MAX_T_S)
    argv = ["iperf3", "-c", ip, "-p", str(port), "-t", str(seconds), "-i", f"{interval_s:g}",
            "-J", "--logfile", str(log)]
    if flow.protocol == "udp":
        argv += ["-u", "-w", str(udp_buffer_bytes(rate_bps, flow.streams))]
    if rate_bps is not None:  # the flow's rate; iperf3 applies -b to each of its -P streams
        argv += ["-b", str(int(rate_bps / flow.streams))]
    if flow.streams > 1:
        argv += ["-P", str(flow.streams)]
    if flow.congestion:
        argv += ["-C", flow.congestion]
    return argv


def boost_priority(pid: int) -> str:
    """Give process `pid` (an iperf3 just started) SCHED_RR `RT_PRIORITY`, else nice `NICE`; best effort. Returns
    "realtime", "nice" or "none" (both refused, or no process)."""
    if pid <= 0:
        return "none"
    try:
        os.sched_setscheduler(pid, os.SCHED_RR, os.sched_param(RT_PRIORITY))
        return "realtime"
    except OSError:
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, pid, NICE)
        return "nice"
    except OSError:
        return "none"


def udp_buffer_bytes(rate_bps: float | None, streams: int = 1) -> int:
    """The socket buffers of each stream of a UDP flow (iperf3 -w): `UDP_BUFFER_S` of the stream's share of the flow's
    rate, within `UDP_BUFFER_BYTES` (the ceiling where the rate is not known)."""
    lo, hi = UDP_BUFFER_BYTES
    if rate_bps is None:
        return hi
    return int(min(max(rate_bps / max(streams, 1) * UDP_BUFFER_S / 8, lo), hi))


def iperf3_server_argv(port: int, interval_s: float, log: Path) -> list[str]:
    return ["iperf3", "-s", "-1", "-p", str(port), "-i", f"{interval_s:g}", "-J", "--logfile", str(log)]


def parse_iperf3_intervals(text: str) -> list[dict[str, float]]:
    """Per-interval sums from an iperf3 JSON log (also one cut short by a signal); [] if unreadable."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return []
    out, last_end = [], -1.0
    for iv in doc.get("intervals", []):
        s = iv.get("sum", {})
        if s.get("seconds", 0) < 1e-3 or s.get("end", 0) <= last_end:
            continue  # iperf3 repeats the last interval, with ~0 s, when a test is cut short
        last_end = s["end"]
        out.append({"end_s": float(s["end"]), "seconds": float(s["seconds"]), "bytes": float(s.get("bytes", 0)),
                    "bits_per_second": float(s.get("bits_per_second", 0)), "lost_packets": float(s.get("lost_packets", math.nan)),
                    "packets": float(s.get("packets", math.nan)), "jitter_ms": float(s.get("jitter_ms", math.nan))})
    return out


class CrossTraffic:
    """Runs a `CrossTrafficSpec` from `start()` to `stop()`; `records()` is the achieved throughput."""

    def __init__(self, spec: CrossTrafficSpec, popen: Callable[[str, list[str]], subprocess.Popen],
                 host_ip: Callable[[str], str], out_dir: str | Path | None = None, base_port: int = BASE_PORT) -> None:
        self.spec = spec
        self._popen = popen
        self._host_ip = host_ip
        self._tmp = None if out_dir else tempfile.TemporaryDirectory(prefix="prfaas-cross-")
        self.out_dir = Path(out_dir) if out_dir else Path(self._tmp.name)  # type: ignore[union-attr]
        self.log_dir = self.out_dir / "cross_traffic_logs"
        self._base_port = base_port
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._procs: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._rows: list[dict[str, Any]] = []
        self.errors: list[str] = []  # a flow that did not run, or whose record is missing: the run is flagged
        self.notes: list[str] = []  # what may make a flow fall short (recorded; its sent rate is judged instead)
        self._t0 = 0.0
        self._stopped = False

    def __enter__(self) -> "CrossTraffic":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._t0 = clock.now_s()
        ips = {f.name: self._host_ip(f.dst) for f in self.spec.flows}  # fail before starting anything
        for flow, port in zip(self.spec.flows, self.spec.ports(self._base_port)):
            t = threading.Thread(target=self._run_flow, args=(flow, ips[flow.name], port), name=f"cross-{flow.name}", daemon=True)
            self._threads.append(t)
            t.start()

    def _spawn(self, host: str, argv: list[str]) -> subprocess.Popen:
        p = self._popen(host, argv)
        with self._lock:
            self._procs.add(p)
        if boost_priority(getattr(p, "pid", 0)) != "realtime":
            self.notes.append(f"{argv[0]} on {host} runs without a real-time priority (SCHED_RR {RT_PRIORITY} refused): "
                               "on a busy host the flow may send less than its rate (docs/traffic.md)")
        return p

    def _end(self, p: subprocess.Popen, grace_s: float) -> bool:
        """Wait up to `grace_s` for `p`, then SIGTERM (SIGKILL after 2 s); True when it had to be ended."""
        ended = False
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            ended = True
            p.terminate()
            try:
                p.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        with self._lock:
            self._procs.discard(p)
        return ended

    def _run_flow(self, flow: FlowSpec, ip: str, port: int) -> None:
        for k, period in enumerate(flow.periods()):
            if self._stop.wait(max(0.0, self._t0 + period.start_s - SERVER_READY_S - clock.now_s())):
                return
            try:
                self._run_period(flow, ip, port, k, period)
            except Exception as exc:  # a failing flow is recorded, never takes the run down
                self.errors.append(f"{flow.name} period {k}: {exc}")

    def _run_period(self, flow: FlowSpec, ip: str, port: int, k: int, period: RatePeriod) -> None:
        """One server/client pair; the server starts SERVER_READY_S before the period so the client finds it."""
        srv_log, cli_log = self.log_dir / f"{flow.name}.{k}.server.json", self.log_dir / f"{flow.name}.{k}.client.json"
        end_abs = None if period.end_s is None else self._t0 + period.end_s
        srv = self._spawn(flow.dst, iperf3_server_argv(port, self.spec.interval_s, srv_log))
        cli, ended = None, False
        try:
            if self._stop.wait(max(SERVER_READY_S / 2, self._t0 + period.start_s - clock.now_s())):
                return
            dur = 24 * 3600.0 if end_abs is None else max(end_abs - clock.now_s(), 0.5)
            launched = clock.now_s()
            cli = self._spawn(flow.src, iperf3_client_argv(flow, ip, port, dur, period.rate_bps, self.spec.interval_s, cli_log))
            while cli.poll() is None and not self._stop.is_set() and (end_abs is None or clock.now_s() < end_abs):
                self._stop.wait(0.05)
        finally:
            if cli is not None:
                ended = self._end(cli, 0.0)  # the period is over (or stop()): iperf3 still reports on SIGTERM
            self._end(srv, 3.0)
        if cli is not None and not ended and cli.returncode != 0:
            self.errors.append(f"{flow.name} period {k}: iperf3 client exited with {cli.returncode}")
        self._record(flow, k, period, launched - self._t0, srv_log, srv.returncode)

    def _record(self, flow: FlowSpec, k: int, period: RatePeriod, launched_s: float, srv_log: Path, srv_rc: int | None) -> None:
        text = srv_log.read_text() if srv_log.exists() else ""
        rows = [{"t_s": launched_s + iv["end_s"], "flow": flow.name, "protocol": flow.protocol, "src": flow.src, "dst": flow.dst,
                 "period": k, "interval_s": iv["seconds"], "bytes": iv["bytes"], "achieved_bps": iv["bits_per_second"],
                 "configured_bps": math.nan if period.rate_bps is None else period.rate_bps, "lost_packets": iv["lost_packets"],
                 "packets": iv["packets"], "jitter_ms": iv["jitter_ms"]} for iv in parse_iperf3_intervals(text)]
        if not rows:
            self.errors.append(f"{flow.name} period {k}: no throughput report in {srv_log} (the iperf3 server's exit status: {srv_rc})")
        with self._lock:
            self._rows.extend(rows)

    def stop(self) -> None:
        """End every flow now (idempotent) and write the record."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10.0)
        with self._lock:
            left = list(self._procs)
        for p in left:
            self._end(p, 0.0)
        self.write(self.out_dir / CROSS_TRAFFIC_FILE)

    def records(self) -> "Any":
        """A pandas DataFrame: one row per flow and report interval (t_s is from `start()`)."""
        with self._lock:
            rows = list(self._rows)
        return cross_traffic_frame(rows)

    def write(self, path: str | Path) -> Path:
        from testbed.atomic import write_parquet

        return write_parquet(path, self.records())

    def achieved_bps(self) -> dict[str, float]:
        """Mean achieved throughput per flow over its reported intervals (bytes / seconds)."""
        df = self.records()
        if df.empty:
            return {f.name: 0.0 for f in self.spec.flows}
        g = df.groupby("flow")[["bytes", "interval_s"]].sum()
        return {f.name: float(g.loc[f.name, "bytes"] * 8 / g.loc[f.name, "interval_s"]) if f.name in g.index else 0.0 for f in self.spec.flows}
