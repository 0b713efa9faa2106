"""Multi-connection KV transport, the `tcp` KV connector (`testbed.kv.connector`): a prefill worker's
`KVSender` streams frames to a decode worker's `KVReceiver` over N parallel TCP connections.

Sender: each layer is cut into chunk frames (`testbed.kv.wire`) in one shared queue; one writer thread
per connection *pulls* the next frame whenever its socket can take more (TCP_NOTSENT_LOWAT keeps the
kernel from hoarding unsent bytes), so a connection slowed by loss carries less instead of holding up the
rest, and writes header + payload with scatter-gather `sendmsg` straight from tensor memory. The queue
is bounded in bytes (`max_queued_bytes`):
when the WAN is congested, `send_layer` blocks, so the prefill feels the bandwidth wall. `finish` sends
the trailer and waits for the receiver's verdict (an ACK frame), which is when the transfer ends.
A sampler thread reads TCP_INFO (cwnd, RTT, retransmits, bytes acked, unsent bytes) from every
connection; `congestion()` summarises it for the router.

Receiver: one thread per accepted connection decodes frames straight into the destination tensors
(bounded by `WireLimits` and `max_inflight_bytes`), a per-request `KVAssembler` checks chunks, layers
and the whole-transfer digest, and only a verified transfer reaches `on_complete` as usable KV.
A checksum mismatch, a malformed frame, an abort or a timeout ends the request as failed, with a reason.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import threading
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.clock import now_s
from testbed.kv.cache import LAYER_KINDS, KVCache, LayerKV
from testbed.kv.connector.base import KVRecvConnector, KVSendConnector, ReceivedKV, TransferStats
from testbed.kv.wire import (
    DEFAULT_CHUNK_BYTES, Ack, ChecksumError, DataFrame, DataHeader, Frame, FrameDecoder, KVAssembler, Trailer,
    WireError, WireLimits, data_header_bytes, encode_ack, encode_trailer, layer_frames, profile_frames,
    transfer_digest,
)

log = logging.getLogger(__name__)

PROBE_PREFIX = "~probe-"  # request ids of active probes (`KVSender.probe`); a decode worker drops their bytes
PROBE_SAMPLE_S = 0.001  # a probe samples its delivered bytes this often
PROBE_MIN_WINDOW_S = 0.005  # ... and takes their rate over spans of at least this (2 unloaded RTTs when longer)
PROBE_FILLED_WINDOWS = 4  # a probe with `FillStop` ends this many rate windows after its standing queue was first seen
FRESH_ACKED_BYTES = 64 << 10  # a connection's smoothed RTT is current once this much was acknowledged in the last second
# A standing queue: RTT - floor at or above max(STANDING_QUEUE_MS, STANDING_QUEUE_FRACTION x floor) (the
# estimator's default `queue_delay` and `queue_delay_fraction`; a sender's poll judges its connections with it)
STANDING_QUEUE_MS = 2.0
STANDING_QUEUE_FRACTION = 0.4
DEFAULT_CONNECTIONS = 4  # measured: docs/kv.md "Choosing N"
DEFAULT_MAX_QUEUED_BYTES = 32 << 20
DEFAULT_NOTSENT_LOWAT_BYTES = 4 << 20  # per connection: unsent bytes the kernel may hold (docs/kv.md)
MIN_NOTSENT_LOWAT_BYTES = 64 << 10  # the rate-scaled budget (`notsent_s`) never goes below this
# Per connection: hold at most this long of its own delivery rate unsent (between the floor above and
# DEFAULT_NOTSENT_LOWAT_BYTES); measured KV / iperf3 with and without it in docs/kv.md, "Transport under loss".
DEFAULT_NOTSENT_S = 0.02
# A BBR connection stuck after an RTO: BBR (v1) can go on pacing at the few-segment delivery samples of its
# RTO recovery (its bandwidth filter, or its long-term "policer" estimate), retransmitting the rest of
# its window one segment every ~2 s (measured: 6 kbps for 80 s after a 5x dip while its three siblings
# were back at full rate within 3 s; docs/kv.md "A connection stuck after an RTO"). A BBR connection in
# the loss state for STUCK_LOSS_S with data in flight, delivering below STUCK_RATE_SHARE of its own best
# while a sibling on the same path delivers at SIBLING_RATE_SHARE of its own best or more (so the path
# works: not an outage, which every connection waits out alike), gets its congestion control restarted
# (`KVSender._restart_cc`) at 1 s into its stay in the loss state, again at 2, 4, 8 ... s while it stays stuck.
STUCK_LOSS_S = 1.0
STUCK_RATE_SHARE = 0.01
SIBLING_RATE_SHARE = 0.1
TCP_CA_LOSS = 4
IOV_MAX_FRAMES = 64
TCP_INFO_LEN = 232
SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # Linux asm-generic/socket.h; Python does not name it


class TransportError(RuntimeError):
    """The connection to the receiver failed; the message says why."""


@dataclass
class TcpSample:
    t_s: float
    connection: int
    rtt_us: int
    cwnd: int  # segments
    total_retrans: int
    bytes_acked: int
    notsent_bytes: int
    delivery_rate_bps: float
    min_rtt_us: int = 0
    unacked_bytes: int = 0  # segments sent and not yet acknowledged x MSS: in flight
    app_limited: bool = False  # the kernel's delivery-rate sample was limited by the sender, not the path
    ca_state: int = 0  # congestion-avoidance state: 0 open, 1 disorder, 2 CWR, 3 recovery, 4 loss (after an RTO)
    backoff: int = 0  # RTO back-offs of the segment now timing out (0: none)
    lost_segments: int = 0  # segments the kernel counts as lost and not yet retransmitted
    # bytes that reached the receiver: acknowledged cumulatively, plus the segments SACKed beyond the
    # cumulative ACK (x MSS). `bytes_acked` alone counts a segment only when the cumulative ACK passes it,
    # so a repaired hole releases a whole window of SACKed data at once (docs/router.md, "An active probe")
    delivered_bytes: int = 0
    cc_restarts: int = 0  # times the sender restarted this connection's congestion control (`KVSender._watch_loss`)
    cc: str = ""  # the connection's congestion control (TCP_CONGESTION, e.g. "cubic", "bbr"), set by its sender
    mss: int = 0  # the connection's segment size now (tcpi_snd_mss, bytes): what `cwnd` counts in


def tcp_info(sock: socket.socket, connection: int = 0) -> TcpSample | None:
    """Linux `struct tcp_info` fields the testbed uses (offsets from the Linux UAPI header's `struct tcp_info`)."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LEN)
    except OSError:
        return None
    if len(raw) < 168:
        return None
    app_limited = bool(raw[7] & 1)  # tcpi_delivery_rate_app_limited: the bitfield byte after the wscales
    ca_state, backoff = raw[1], raw[4]
    (lost,) = struct.unpack_from("<I", raw, 32)
    (snd_mss,) = struct.unpack_from("<I", raw, 16)
    (unacked,) = struct.unpack_from("<I", raw, 24)
    rtt_us, _, _, cwnd = struct.unpack_from("<IIII", raw, 68)
    (total_retrans,) = struct.unpack_from("<I", raw, 100)
    (bytes_acked,) = struct.unpack_from("<Q", raw, 120)
    notsent, min_rtt_us = struct.unpack_from("<II", raw, 144)
    (delivery_rate,) = struct.unpack_from("<Q", raw, 160)
    (sacked,) = struct.unpack_from("<I", raw, 28)  # tcpi_sacked: segments SACKed beyond the cumulative ACK
    delivered = bytes_acked + sacked * snd_mss
    return TcpSample(now_s(), connection, rtt_us, cwnd, total_retrans, bytes_acked, notsent, 8.0 * delivery_rate,
                     min_rtt_us, unacked * snd_mss, app_limited, ca_state, backoff, lost, delivered, mss=snd_mss)


def ack_rate_bps(series: list[tuple[float, int]], window_s: float) -> float:
    """The highest rate (bit/s) at which a cumulative byte count grew over any span of at least `window_s`
    that starts `window_s` or more after its first growth, in `series` ((t_s, bytes), t ascending): a
    burst's rate once a shaper's token bucket (full after idleness, it passes the first milliseconds
    faster than the rate) has drained, and not lowered by the stragglers of its last round. When no such
    span exists, the rate over all of it (0 with fewer than two samples)."""
    if len(series) < 2:
        return 0.0
    first = next((t for (t, b), (_, b0) in zip(series, [series[0]] + series) if b > b0), series[0][0])
    best, i = 0.0, 0
    for j in range(len(series)):
        while series[i][0] < first + window_s and i < j:
            i += 1
        while i + 1 < j and series[j][0] - series[i + 1][0] >= window_s:
            i += 1
        dt = series[j][0] - series[i][0]
        if series[i][0] >= first + window_s and dt >= window_s:
            best = max(best, 8.0 * (series[j][1] - series[i][1]) / dt)
    if best > 0:
        return best
    dt = series[-1][0] - series[0][0]
    return 8.0 * (series[-1][1] - series[0][1]) / dt if dt > 0 else 0.0


def rate_is_current(acked_last_s_bytes: int, delivery_rate_bps: float) -> bool:
    """A connection's delivery rate is current when its acknowledgements of the last second support it: at
    least FRESH_ACKED_BYTES, or a quarter of a second at that rate (a slow connection's rate is current too; a
    stalled one that got a segment or two through does not vouch for its pre-stall rate)."""
    return acked_last_s_bytes >= min(FRESH_ACKED_BYTES, delivery_rate_bps / 8.0 * 0.25)


def is_standing_queue(excess_ms: float, floor_ms: float, queue_ms: float = STANDING_QUEUE_MS,
                      fraction: float = STANDING_QUEUE_FRACTION) -> bool:
    """Whether an RTT `excess_ms` above the floor `floor_ms` is a standing queue: at least `queue_ms` and
    `fraction` of the floor. The one test of the estimator's polls and probes, a probe's early end and a
    sender's poll (with the estimator's settings, or its defaults)."""
    return excess_ms >= max(queue_ms, fraction * floor_ms)


def standing_queue_us(rtts_us: list[int], floor_us: int) -> int:
    """The standing queue (us) the largest of `rtts_us` carries above `floor_us`, or 0 when it is less than a
    standing queue (`is_standing_queue` with its defaults)."""
    if not rtts_us or floor_us <= 0:
        return 0
    q = max(rtts_us) - floor_us
    return q if is_standing_queue(q / 1000.0, floor_us / 1000.0) else 0


def predates_queue(rtt_us: int, queue_us: int, floor_us: int) -> bool:
    """Whether a connection's smoothed RTT (and with it the delivery rate taken on the same acknowledgements)
    predates the standing queue `queue_us` that its sender's current connections see: it carries less than
    half of it. The connections of one sender share the bottleneck, so a rate measured through the queue
    comes with an RTT that has it (docs/router.md, "Polls at a dip's start")."""
    return queue_us > 0 and rtt_us - floor_us < queue_us / 2


@dataclass(frozen=True)
class FillStop:
    """When an active probe may end before its size (docs/router.md, "An active probe", *Stop*): once it has
    filled the path as the estimator judges a filled probe. A standing queue (the largest RTT of the
    connections carrying it at least `queue_ms`, and `queue_fraction` of the unloaded RTT, above the
    unloaded RTT) stands now and was first seen `PROBE_FILLED_WINDOWS` rate windows ago, and the bytes
    delivered are at least `path_ratio` x rate x unloaded RTT. (Two windows read 0.77-0.79 of the rate
    left in 3 of 10 steady-line probes, four as the whole probe does: docs/router.md, "An active probe", *Stop*.)"""

    queue_ms: float
    queue_fraction: float
    path_ratio: float

    def filled(self, nbytes: float, rate_bps: float, rtt_ms: float, floor_ms: float, unloaded_ms: float) -> bool:
        """Whether a probe of `nbytes` read at `rate_bps` filled the path: an RTT `rtt_ms` at its end that is a
        standing queue above the floor `floor_ms`, and at least `path_ratio` x rate x the unloaded RTT
        `unloaded_ms` delivered (the estimator's judgement of a whole probe, `BandwidthEstimator.probe`, and
        the probe benchmark's). No floor, no RTT or `queue_ms` 0: never."""
        if self.queue_ms <= 0 or rtt_ms <= 0 or floor_ms <= 0:
            return False
        return (is_standing_queue(rtt_ms - floor_ms, floor_ms, self.queue_ms, self.queue_fraction)
                and 8.0 * nbytes >= self.path_ratio * rate_bps * unloaded_ms / 1000.0)


class _FillWatch:
    """`FillStop` applied to one probe's samples: `done(t, rtt_s, delivered)` says whether it may end now."""

    def __init__(self, stop: FillStop, unloaded_s: float, window_s: float) -> None:
        self.stop, self.unloaded_s, self.window_s = stop, unloaded_s, window_s
        self.queue_from: float | None = None
        self.next_check = 0.0

    def done(self, t_s: float, rtt_s: float, delivered: list[tuple[float, int]]) -> bool:
        s = self.stop
        if not is_standing_queue(1000.0 * (rtt_s - self.unloaded_s), 1000.0 * self.unloaded_s, s.queue_ms, s.queue_fraction):
            return False
        self.queue_from = t_s if self.queue_from is None else self.queue_from
        if t_s < max(self.queue_from + PROBE_FILLED_WINDOWS * self.window_s, self.next_check):
            return False
        self.next_check = t_s + self.window_s  # the rate is read over every sample: at most once a window
        rate = ack_rate_bps(delivered, self.window_s)
        unloaded_ms = 1000.0 * self.unloaded_s  # the unloaded RTT is this probe's floor too
        return rate > 0 and s.filled(delivered[-1][1], rate, 1000.0 * rtt_s, unloaded_ms, unloaded_ms)


def _sendmsg_all(sock: socket.socket, buffers: list) -> None:
    bufs = [memoryview(b) for b in buffers]
    while bufs:
        n = sock.sendmsg(bufs)
        while n:
            if n >= bufs[0].nbytes:
                n -= bufs[0].nbytes
                bufs.pop(0)
            else:
                bufs[0] = bufs[0][n:]
                n = 0
        while bufs and bufs[0].nbytes == 0:
            bufs.pop(0)


@dataclass
class _Outgoing:
    request_id: str
    buffers: list
    nbytes: int


@dataclass
class _SendRequest:
    request_id: str
    start_s: float
    records: list[bytes] = field(default_factory=list)
    layers: set[int] = field(default_factory=set)
    kv_bytes: int = 0
    wire_bytes: int = 0
    aborted: bool = False
    verdict: Ack | None = None
    verdict_s: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


class _Connection:
    def __init__(self, index: int, sock: socket.socket) -> None:
        self.index = index
        self.sock = sock
        self.sent_bytes = 0
        self.notsent_lowat_bytes = 0  # the TCP_NOTSENT_LOWAT now set (0: none)
        self.threads: list[threading.Thread] = []
        self.cc_name = b""  # its congestion control (TCP_CONGESTION), read at connect
        self.peak_rate_bps = 0.0  # the best delivery rate this connection has reported
        self.last: TcpSample | None = None  # its latest sample
        self.loss_since_s: float | None = None  # when its current stay in the loss state (after an RTO) began
        self.restart_after_s = float("inf")  # in this stay: the next restart no sooner than this (doubling waits)
        self.cc_restarts = 0


def is_stuck_after_rto(s: TcpSample, loss_since_s: float | None, peak_rate_bps: float, sibling_shares: list[float],
                       stuck_s: float = STUCK_LOSS_S) -> bool:
    """A connection in the loss state (after an RTO) for at least `stuck_s` since `loss_since_s`, with data in
    flight, delivering below `STUCK_RATE_SHARE` of its own best, while a sibling on the same path (out of
    the loss state; `sibling_shares`: their rates as shares of their own best) delivers at
    `SIBLING_RATE_SHARE` of its best or more: a congestion control pacing at its recovery's samples, not a
    slow or dead path, which every connection waits out alike."""
    return (s.ca_state == TCP_CA_LOSS and loss_since_s is not None and s.t_s - loss_since_s >= stuck_s
            and s.unacked_bytes > 0 and s.delivery_rate_bps < STUCK_RATE_SHARE * peak_rate_bps
            and any(share >= SIBLING_RATE_SHARE for share in sibling_shares))


def tcp_sysctl(key: str) -> str | None:
    """`net.ipv4.<key>` of this network namespace (e.g. tcp_congestion_control), whitespace-normalised; None
    when it cannot be read."""
    try:
        return " ".join(Path(f"/proc/sys/net/ipv4/{key}").read_text().split())
    except OSError:
        return None


def paces_itself(congestion_control: str | None) -> bool:
    """Whether TCP congestion control `congestion_control` paces its own sending from a model of the path (BBR),
    so that an active probe over it needs no pacing cap of ours; loss-based ones (cubic, reno) send a slow
    start's bursts at line rate (docs/router.md, "A paced probe", *Under BBR*)."""
    return congestion_control is not None and congestion_control.startswith("bbr")


def congestion_control_refused(name: str) -> str | None:
    """Why this host's kernel refuses TCP congestion control `name` on a socket (as `KVSender` sets it), or
    None when it sets it. Setting it as root loads the kernel's module (tcp_<name>) if it is not loaded."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
        except OSError as e:
            def listed(key: str) -> str:
                value = tcp_sysctl(key)
                return "unknown" if value is None else ", ".join(value.split()) or "none"

            if e.errno == errno.EPERM:  # the kernel has it, but this user may set only the allowed ones
                return (f"{name!r} is not allowed for this user ({e.strerror}); net.ipv4.tcp_allowed_congestion_control "
                        f"lists {listed('tcp_allowed_congestion_control')}, and root may set any the kernel has")
            return (f"{name!r} cannot be set on this host ({e.strerror}: no such congestion control, or its module "
                    f"tcp_{name} is not loaded and only root can load it); available: "
                    f"{listed('tcp_available_congestion_control')}")
    return None


def _connect(host: str, port: int, timeout_s: float, mss_bytes: int | None) -> socket.socket:
    """A TCP connection to (host, port). `mss_bytes` caps its segment size (TCP_MAXSEG, set before the handshake so
    that the SYN announces it too); None leaves the path's (MTU - 52)."""
    if mss_bytes is None:
        return socket.create_connection((host, port), timeout=timeout_s)
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, mss_bytes)
        sock.settimeout(timeout_s)
        sock.connect(addr)
    except OSError:
        sock.close()
        raise
    return sock


class KVSender(KVSendConnector):
    """Streams KV to one decode worker's receiver over `connections` TCP connections (the `tcp` connector's sender)."""

    def __init__(self, host: str, port: int, connections: int = DEFAULT_CONNECTIONS, *,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
                 connect_timeout_s: float = 10.0, ack_timeout_s: float = 300.0,
                 sample_interval_s: float = 0.1, on_sample: Callable[[TcpSample], None] | None = None,
                 notsent_lowat_bytes: int | None = DEFAULT_NOTSENT_LOWAT_BYTES,
                 congestion_control: str | None = None, notsent_s: float | None = DEFAULT_NOTSENT_S,
                 mss_bytes: int | None = None) -> None:
        if connections < 1:
            raise ValueError(f"connections: must be >= 1, got {connections}")
        self.host, self.port = host, port
        self.chunk_bytes = chunk_bytes
        self.max_queued_bytes = max_queued_bytes
        self.ack_timeout_s = ack_timeout_s
        self.sample_interval_s = sample_interval_s
        self.on_sample = on_sample
        self.notsent_s = notsent_s if notsent_lowat_bytes else None
        self.max_notsent_lowat_bytes = notsent_lowat_bytes or 0
        self._cond = threading.Condition()
        self._queued_bytes = 0  # queued + being written: what max_queued_bytes bounds
        self._queue: deque[_Outgoing] = deque()
        self._requests: dict[str, _SendRequest] = {}
        self._broken: str | None = None
        self._closed = False
        self._profile_buffer = memoryview(os.urandom(chunk_bytes))  # random: nothing on the path can compress it
        self._profile_checksums: dict[int, int] = {}
        self.samples: deque[TcpSample] = deque(maxlen=4096)
        self._conns: list[_Connection] = []
        try:
            for i in range(connections):
                sock = _connect(host, port, connect_timeout_s, mss_bytes)
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if congestion_control:  # e.g. "cubic" or "bbr"; default: the namespace's sysctl
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion_control.encode())
                c = _Connection(i, sock)
                c.cc_name = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0", 1)[0]
                if notsent_lowat_bytes:
                    self._set_lowat(c, notsent_lowat_bytes)
                self._conns.append(c)
        except OSError as e:
            for c in self._conns:
                c.sock.close()
            raise TransportError(f"connect to {host}:{port}: {e}") from e
        for c in self._conns:
            for target, name in ((self._writer, "w"), (self._reader, "r")):
                t = threading.Thread(target=target, args=(c,), name=f"kv-send-{name}{c.index}", daemon=True)
                c.threads.append(t)
                t.start()
        self._sampler = threading.Thread(target=self._sample_loop, name="kv-tcpinfo", daemon=True)
        self._sampler.start()

    @property
    def connections(self) -> int:
        return len(self._conns)

    # ------------------------------------------------------------ public API

    def send_layer(self, request_id: str, layer: LayerKV) -> None:
        """Queue one layer (blocks while `max_queued_bytes` are already queued: back-pressure).
        The layer's tensors must not change until `finish` returns: they are sent without copying."""
        self._send_frames(request_id, layer.layer_index, layer_frames(request_id, layer, self.chunk_bytes))

    def send_bytes(self, request_id: str, layer_index: int, kind: str, nbytes: int) -> None:
        """Profile mode: `nbytes` of real bytes for one layer, framed and checksummed like real KV."""
        frames = profile_frames(request_id, layer_index, kind, nbytes, self._profile_buffer,
                                self._profile_checksums, self.chunk_bytes)
        self._send_frames(request_id, layer_index, frames)

    def finish(self, request_id: str, tokens: int = 0, model: str = "", timeout_s: float | None = None) -> TransferStats:
        """Send the trailer and wait for the receiver's verdict; the stats say ok or why not."""
        with self._cond:
            req = self._requests.get(request_id) or _SendRequest(request_id, now_s())
            self._requests[request_id] = req
        trailer = Trailer(request_id, model, tokens, len(req.layers), len(req.records), req.kv_bytes,
                          transfer_digest(req.records))
        raw = encode_trailer(trailer)
        req.wire_bytes += len(raw)
        reason: str | None = None
        try:
            self._enqueue(_Outgoing(request_id, [raw], len(raw)))
            if not req.done.wait(self.ack_timeout_s if timeout_s is None else timeout_s):
                reason = "timed out waiting for the receiver's verdict"
        except TransportError as e:
            reason = str(e)
        with self._cond:
            self._requests.pop(request_id, None)
            if reason is None and req.verdict is None:
                reason = self._broken or "connection lost"
        verdict = req.verdict
        ok = reason is None and verdict is not None and verdict.ok
        if reason is None and verdict is not None and not verdict.ok:
            reason = verdict.reason or "rejected by the receiver"
        return TransferStats(request_id, ok, reason, req.kv_bytes, req.wire_bytes, len(req.records), req.start_s,
                             req.verdict_s or now_s(), len(self._conns))

    def abort(self, request_id: str, reason: str = "aborted by sender") -> None:
        """Drop what is still queued for a request and tell the receiver to free it."""
        with self._cond:
            req = self._requests.pop(request_id, None)
            if req is None:
                return
            req.aborted = True
            kept = deque(o for o in self._queue if o.request_id != request_id)
            self._queued_bytes -= sum(o.nbytes for o in self._queue) - sum(o.nbytes for o in kept)
            self._queue = kept
            self._cond.notify_all()
        raw = encode_ack(Ack(request_id, False, reason, abort=True))
        try:
            self._enqueue(_Outgoing(request_id, [raw], len(raw)), force=True)
        except TransportError:
            pass
        req.done.set()

    def congestion(self) -> dict[str, Any]:
        """The router's congestion signal: retransmits, RTT, cwnd, queued bytes and achieved rate."""
        now = self.tcp_infos()
        with self._cond:
            queued = self._queued_bytes
        window = [s for s in list(self.samples) if s.t_s >= now_s() - 1.0]  # a copy: the sampler thread appends
        first: dict[int, TcpSample] = {}
        for s in window:
            first.setdefault(s.connection, s)
        # bytes each connection with work got acknowledged in the last second (those without a sample then: none)
        acked = {s.connection: s.bytes_acked - first[s.connection].bytes_acked for s in now
                 if (s.notsent_bytes or s.unacked_bytes) and s.connection in first}
        # RTT of the connections with work whose smoothed RTT is current (acknowledged >= FRESH_ACKED_BYTES in
        # the last second): an idle connection's RTT is its last one, and a connection that just resumed
        # still carries the queue of its previous burst (or of a probe)
        busy = [s for s in now if acked.get(s.connection, -1) >= FRESH_ACKED_BYTES]
        # a connection whose RTT predates the queue the others see now was last measured before it: at a dip's
        # start its rate is the pre-dip one (val-dip seed 4: 10.2-ms RTTs with 19-Gbps rates beside 15-21 ms)
        floor_us = min((s.min_rtt_us for s in now if s.min_rtt_us > 0), default=0)
        queue_us = standing_queue_us([s.rtt_us for s in busy], floor_us)
        stale = {s.connection for s in now if predates_queue(s.rtt_us, queue_us, floor_us)}
        busy = [s for s in busy if s.connection not in stale]
        goodput = 0.0
        if now and window:
            total = sum(s.bytes_acked - first[s.connection].bytes_acked for s in now if s.connection in first)
            dt = max(s.t_s for s in now) - min(first[c].t_s for c in first)
            goodput = 8 * total / dt if dt > 0 else 0.0
        return {
            "retransmits": sum(s.total_retrans for s in now),
            "rtt_ms": (sum(s.rtt_us for s in now) / len(now) / 1000.0) if now else 0.0,
            "queue_rtt_ms": (sum(s.rtt_us for s in busy) / len(busy) / 1000.0) if busy else 0.0,  # 0: none current
            "min_rtt_ms": (min(s.min_rtt_us for s in now) / 1000.0) if now else 0.0,
            "cwnd": sum(s.cwnd for s in now),
            "send_queue_bytes": queued + sum(s.notsent_bytes for s in now),
            "inflight_bytes": sum(s.unacked_bytes for s in now),
            "delivery_rate_bps": sum(s.delivery_rate_bps for s in now if not s.app_limited),
            "goodput_bps": goodput,
            # the path's rate as TCP measures it (the kernel keeps the last delivery-rate sample that was not
            # application-limited), summed over the connections that have work now: KV is
            # streamed as prefill produces it, so acked bytes per second measure the prefill, not the path
            # connections without bytes unsent or in flight are left out: their last rate may predate a dip;
            # so are those with work whose rate its own deliveries of the last second do not support (`current`):
            # a connection stalled in a deep dip (retransmission timeouts) keeps its pre-dip rate (val-thin-line
            # seed 5: polls summed to the full 10 Gbps for 8 s while 0.7 Gbps were left)
            # and so are those whose RTT predates the queue the busy ones see (`predates_queue`)
            "path_rate_bps": sum(s.delivery_rate_bps for s in now
                                 if s.connection in acked and s.connection not in stale
                                 and rate_is_current(acked[s.connection], s.delivery_rate_bps)),
            "connections": len(self._conns),
            "broken": self._broken,
        }

    def pace(self, rate_bps: float | None) -> None:
        """Cap every connection's sending rate at its share of `rate_bps` (wire bit/s; None or 0: no cap) with
        SO_MAX_PACING_RATE. The first cap turns on the kernel's own TCP pacing for good (no fq qdisc needed),
        which spreads every window over its round trip instead of sending it in a burst: a KV sender never
        calls this, only a sender kept for probes (docs/router.md, "An active probe", "A paced probe")."""
        per = int(rate_bps / 8.0 / len(self._conns)) if rate_bps else 0
        value = per if per > 0 else (1 << 64) - 1  # ~0: no cap
        for c in self._conns:
            c.sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("Q", value))

    def probe(self, nbytes: int, pings: int = 2, timeout_s: float = 2.0, stop: FillStop | None = None) -> dict[str, Any]:
        """Measure the path with our own bytes (docs/router.md, "An active probe"): `pings` one-byte
        transfers, whose round trip (first byte queued to the receiver's verdict) while nothing else of ours
        is queued is the path's unloaded RTT (plus both ends' processing), then one transfer of `nbytes`
        whose delivered bytes (`TcpSample.delivered_bytes`: acknowledged or SACKed, counted when they arrived)
        are sampled every millisecond: `rate_bps` is the highest rate at which they grew over two unloaded
        RTTs (at least 5 ms) starting two unloaded RTTs after the first (`ack_rate_bps`); `acked_rate_bps`, the
        same rule over the cumulatively acknowledged bytes, is beside it for comparison. Request ids start with `PROBE_PREFIX` and a random tag (senders of other workers probe the
        same receiver); a decode worker drops what arrives under them. Call it only while no KV is queued.
        With `stop`, the burst ends as soon as it has filled the path (`FillStop`): the rest of its bytes are
        dropped from the queue, the receiver is told to forget it, and `bytes` is what had been delivered
        (`stopped: True`)."""
        tag = uuid.uuid4().hex[:12]
        rtts = []
        for i in range(pings):
            t0 = now_s()
            ping = self._probe_one(f"{PROBE_PREFIX}{tag}.{i}", 1, timeout_s)
            if ping is not None and ping.ok:
                rtts.append(1000.0 * (now_s() - t0))
        before = self.sent_bytes_by_connection()
        infos0 = {s.connection: s for s in self.tcp_infos()}
        done: dict[str, TransferStats] = {}
        rid = f"{PROBE_PREFIX}{tag}"
        bulk = threading.Thread(target=lambda: done.update(stats=self._probe_one(rid, nbytes, timeout_s)),
                                name="kv-probe", daemon=True)
        window_s = max(2 * min(rtts) / 1000.0 if rtts else 0.0, PROBE_MIN_WINDOW_S)
        filled = _FillWatch(stop, min(rtts) / 1000.0, window_s) if stop is not None and rtts else None
        t0 = now_s()
        series: list[tuple[float, int]] = [(t0, 0)]  # from the start: a burst acknowledged within one sample still has a rate
        acked: list[tuple[float, int]] = [(t0, 0)]  # the cumulative ACK's count, reported beside (before 2026-12-04 the rate)
        stopped = False
        if nbytes > 0:
            bulk.start()
            while bulk.is_alive():
                now, t = self.tcp_infos(), now_s()
                pairs = [(s, infos0[s.connection]) for s in now if s.connection in infos0]
                series.append((t, sum(s.delivered_bytes - s0.delivered_bytes for s, s0 in pairs)))
                acked.append((t, sum(s.bytes_acked - s0.bytes_acked for s, s0 in pairs)))
                busy = [s.rtt_us for s, s0 in pairs if s.bytes_acked > s0.bytes_acked or s.unacked_bytes > 0]
                if filled is not None and filled.done(t, max(busy, default=0) / 1e6, series):
                    stopped = True
                    self.abort(rid, "probe ended: it filled the path")
                    bulk.join(timeout_s)
                    break
                bulk.join(PROBE_SAMPLE_S)
        took = now_s() - t0
        stats = done.get("stats")
        used = [c for c, b, a in zip(self._conns, before, self.sent_bytes_by_connection()) if a > b]
        infos = self.tcp_infos(used)
        if stopped:
            ok, reason, sent = True, None, series[-1][1]
        else:
            ok, reason, sent = stats is not None and stats.ok, stats.reason if stats is not None else None, nbytes if stats is not None else 0
        return {"ok": ok, "reason": reason, "bytes": sent, "seconds": took, "stopped": stopped,
                "rate_bps": ack_rate_bps(series, window_s), "acked_rate_bps": ack_rate_bps(acked, window_s),
                "delivery_rate_bps": sum(s.delivery_rate_bps for s in infos),
                "rtt_ms": max((s.rtt_us for s in infos), default=0) / 1000.0,
                "min_rtt_ms": min((s.min_rtt_us for s in infos), default=0) / 1000.0,
                "idle_rtt_ms": min(rtts) if rtts else None, "connections": len(infos), "samples": len(series),
                "retransmits": sum(s.total_retrans - infos0[s.connection].total_retrans for s in infos if s.connection in infos0)}

    def _probe_one(self, request_id: str, nbytes: int, timeout_s: float) -> TransferStats | None:
        self.send_bytes(request_id, 0, LAYER_KINDS[0], nbytes)
        with self._cond:
            if request_id not in self._requests:  # aborted while queueing (the probe filled the path): no trailer
                return None
        stats = self.finish(request_id, timeout_s=timeout_s)
        if not stats.ok:
            self.abort(request_id, stats.reason or "probe failed")
        return stats

    def tcp_infos(self, conns: list[_Connection] | None = None) -> list[TcpSample]:
        """TCP_INFO of `conns` (default: every connection) now; a connection the kernel cannot read is left out."""
        return [s for s in (tcp_info(c.sock, c.index) for c in (self._conns if conns is None else conns)) if s is not None]

    def sent_bytes_by_connection(self) -> list[int]:
        """Bytes each connection has taken from the queue so far (how the pull model spread the load): a
        frame is this connection's from then on, and every frame of a transfer is counted once `finish` returns."""
        with self._cond:
            return [c.sent_bytes for c in self._conns]

    def close(self) -> None:
        """Close every connection and stop the threads (queued frames are dropped)."""
        with self._cond:
            self._closed = True
            self._broken = self._broken or "sender closed"
            for req in self._requests.values():
                req.done.set()
            self._cond.notify_all()
        for c in self._conns:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.sock.close()
        for c in self._conns:
            for t in c.threads:
                if t is not threading.current_thread():
                    t.join(timeout=5)
        self._sampler.join(timeout=5)

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals

    def _request(self, request_id: str) -> _SendRequest:
        with self._cond:
            if self._broken:
                raise TransportError(f"KV sender to {self.host}:{self.port}: {self._broken}")
            req = self._requests.get(request_id)
            if req is None:
                req = self._requests[request_id] = _SendRequest(request_id, now_s())
            return req

    def _send_frames(self, request_id: str, layer_index: int, frames: list[Frame]) -> None:
        req = self._request(request_id)
        req.layers.add(layer_index)
        for f in frames:
            if req.aborted:  # `abort` dropped the rest (a probe that filled the path ends so)
                return
            req.records.append(f.record)
            req.kv_bytes += f.payload.nbytes
            req.wire_bytes += f.wire_bytes
            self._enqueue(_Outgoing(request_id, [f.header, f.payload], f.wire_bytes))

    def _enqueue(self, item: _Outgoing, force: bool = False) -> None:
        with self._cond:
            while (not force and self._queued_bytes > 0
                   and self._queued_bytes + item.nbytes > self.max_queued_bytes and not self._broken):
                self._cond.wait()
            if self._broken:
                raise TransportError(f"KV sender to {self.host}:{self.port}: {self._broken}")
            self._queue.append(item)
            self._queued_bytes += item.nbytes
            self._cond.notify_all()

    def _fail(self, reason: str) -> None:
        with self._cond:
            if self._broken is None:
                self._broken = reason
                log.warning("KV sender to %s:%s failed: %s", self.host, self.port, reason)
            for req in self._requests.values():
                req.done.set()
            self._cond.notify_all()

    def _writer(self, c: _Connection) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._broken:
                    self._cond.wait()
                if self._broken:
                    return
                batch = [self._queue.popleft()]  # pull: a connection takes work only when it can send
                size = batch[0].nbytes
                # with `notsent_s` a batch is also held to the connection's unsent budget: a frame popped here
                # is committed to this connection as surely as one in its socket
                limit = min(self.chunk_bytes, c.notsent_lowat_bytes) if self.notsent_s else self.chunk_bytes
                while self._queue and size + self._queue[0].nbytes <= limit and len(batch) < IOV_MAX_FRAMES:
                    size += self._queue[0].nbytes
                    batch.append(self._queue.popleft())
                # counted when taken, not after sendmsg returns: the receiver's verdict can arrive (and `finish`
                # return) before this thread runs again, and a count that trails it missed the last batch
                c.sent_bytes += size
            try:
                _sendmsg_all(c.sock, [b for item in batch for b in item.buffers])
            except OSError as e:
                self._fail(f"connection {c.index}: send failed: {e}")
                return
            with self._cond:
                self._queued_bytes -= size
                self._cond.notify_all()

    def _reader(self, c: _Connection) -> None:
        decoder = FrameDecoder(WireLimits(max_frame_bytes=0))  # the receiver only ever sends ACK frames
        try:
            while True:
                n = c.sock.recv_into(decoder.next_buffer())
                if n == 0:
                    raise TransportError(f"connection {c.index}: closed by the receiver")
                item = decoder.advance(n)
                if isinstance(item, Ack):
                    with self._cond:
                        req = self._requests.get(item.request_id)
                    if req is not None:
                        req.verdict, req.verdict_s = item, now_s()
                        req.done.set()
                elif item is not None:
                    raise WireError(f"connection {c.index}: unexpected frame from the receiver")
        except (OSError, WireError, TransportError) as e:
            if not self._closed:
                self._fail(str(e))

    def _set_lowat(self, c: _Connection, nbytes: int) -> None:
        try:
            c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, nbytes)
        except OSError:  # closing
            return
        c.notsent_lowat_bytes = nbytes

    def _rescale_lowat(self, c: _Connection, s: TcpSample) -> None:
        """`notsent_s`: let a connection hold only that long of its own delivery rate unsent, so a
        connection slowed by loss does not hoard the frames that decide when a transfer completes while
        the others run dry (docs/kv.md "Transport under loss"). Changed only when off by more than 25%."""
        if not self.notsent_s or s.delivery_rate_bps <= 0:
            return
        want = int(min(max(s.delivery_rate_bps / 8 * self.notsent_s, MIN_NOTSENT_LOWAT_BYTES), self.max_notsent_lowat_bytes))
        if abs(want - c.notsent_lowat_bytes) > 0.25 * c.notsent_lowat_bytes:
            self._set_lowat(c, want)

    def notsent_lowat_by_connection(self) -> list[int]:
        """The TCP_NOTSENT_LOWAT each connection has now (bytes; 0: none)."""
        return [c.notsent_lowat_bytes for c in self._conns]

    def _watch_loss(self, c: _Connection, s: TcpSample) -> None:
        """Restart the congestion control of a BBR connection stuck after an RTO (`is_stuck_after_rto`), at
        1, 2, 4 ... s into its stay in the loss state. Other algorithms are left alone: the stall was seen
        under BBR, and restarting CUBIC would only throw its window history away. `s` gets the count."""
        c.peak_rate_bps = max(c.peak_rate_bps, s.delivery_rate_bps)
        c.last = s
        if s.ca_state != TCP_CA_LOSS:
            c.loss_since_s, c.restart_after_s = None, float("inf")
        elif c.loss_since_s is None:
            c.loss_since_s, c.restart_after_s = s.t_s, s.t_s + STUCK_LOSS_S
        siblings = [o.last.delivery_rate_bps / o.peak_rate_bps for o in self._conns
                    if o is not c and o.last is not None and o.last.ca_state != TCP_CA_LOSS and o.peak_rate_bps > 0]
        if (c.cc_name.startswith(b"bbr") and s.t_s >= c.restart_after_s
                and is_stuck_after_rto(s, c.loss_since_s, c.peak_rate_bps, siblings)):
            assert c.loss_since_s is not None
            c.restart_after_s = s.t_s + (s.t_s - c.loss_since_s)  # double the time in the loss state
            if self._restart_cc(c):
                log.warning("KV connection %d to %s:%d: stuck in RTO recovery for %.1f s at %.0f bit/s (best %.3g, RTO "
                            "back-off %d); congestion control restarted", c.index, self.host, self.port,
                            s.t_s - c.loss_since_s, s.delivery_rate_bps, c.peak_rate_bps, s.backoff)
        s.cc_restarts = c.cc_restarts

    def _restart_cc(self, c: _Connection) -> bool:
        """Re-initialise a connection's congestion control (its model of the path, not its data): Linux
        re-initialises it on a change of TCP_CONGESTION and ignores a change to the same one, so switch away
        and back. BBR then starts over from the current window and RTT (its startup) instead of its stale
        bandwidth filter. False when the socket refuses (closing)."""
        name = c.cc_name
        other = b"cubic" if name == b"reno" else b"reno"
        try:
            c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, other)
        except OSError:
            return False
        c.cc_restarts += 1
        try:
            c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name)
        except OSError as e:  # not allowed back (or closing): the connection goes on under the other one
            if not self._closed:
                log.warning("KV connection %d: could not set %s back after a restart (%s); it stays on %s",
                            c.index, name.decode(), e, other.decode())
            c.cc_name = other
        return True

    def _sample_loop(self) -> None:
        while not self._closed:
            for c in self._conns:
                s = tcp_info(c.sock, c.index)
                if s is not None:
                    self._rescale_lowat(c, s)
                    self._watch_loss(c, s)
                    s.cc = c.cc_name.decode(errors="replace")
                    self.samples.append(s)
                    if self.on_sample is not None:
                        try:
                            self.on_sample(s)
                        except Exception:  # telemetry must not stop the sampling the router's signal rests on
                            log.exception("on_sample failed; this sender's samples are no longer handed on")
                            self.on_sample = None
            with self._cond:
                self._cond.wait_for(lambda: self._closed, timeout=self.sample_interval_s)


# ================================================================================================ receiver

ACCEPT_RETRY_S = 0.05  # the first pause after a failed accept (doubled up to 1 s while it keeps failing)


@dataclass
class _RecvRequest:
    request_id: str
    assembler: KVAssembler
    first_frame_s: float
    last_s: float
    wire_bytes: int = 0
    trailer: Trailer | None = None
    trailer_conn: _RecvConn | None = None
    failed: str | None = None
    # the connections its data frames came on while in flight: one that closes fails the request (`KVReceiver._conn_loop`);
    # cleared when the request fails (`_fail`: a failed request is held until its trailer or the timeout, and must not keep
    # a closed connection's scratch buffer alive), so a long-lived connection keeps nothing of the transfers it carried
    conns: set[_RecvConn] = field(default_factory=set)


class _RecvConn:
    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.send_lock = threading.Lock()
        self.scratch = bytearray(0)
        self.thread: threading.Thread | None = None

    def scratch_view(self, nbytes: int) -> memoryview:
        if len(self.scratch) < nbytes:
            self.scratch = bytearray(nbytes)
        return memoryview(self.scratch)[:nbytes]

    def send(self, raw: bytes) -> None:
        with self.send_lock:
            try:
                self.sock.sendall(raw)
            except OSError:
                pass


class KVReceiver(KVRecvConnector):
    """Accepts KV senders on (bind_host, port) and hands each verified transfer to `on_complete` (the `tcp` connector's receiver)."""

    def __init__(self, bind_host: str, port: int, on_complete: Callable[[str, ReceivedKV], None], *,
                 limits: WireLimits = WireLimits(), max_inflight_bytes: int = 16 << 30,
                 request_timeout_s: float = 300.0, max_connections: int = 1024, max_inflight_requests: int = 4096) -> None:
        self.bind_host = bind_host
        self.port = port
        self.on_complete = on_complete
        self.limits = limits
        self.max_inflight_bytes = max_inflight_bytes
        self.request_timeout_s = request_timeout_s
        self.max_connections = max_connections  # more at once are closed as they come (each holds a thread)
        self.max_inflight_requests = max_inflight_requests  # transfers begun and not ended; more are refused
        self._lock = threading.Lock()
        self._requests: dict[str, _RecvRequest] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()  # recent ids: late frames of these are discarded
        self._conns: list[_RecvConn] = []
        self._closed = threading.Event()
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self.protocol_errors: list[str] = []
        self.connections_accepted = 0

    def start(self) -> KVReceiver:
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((self.bind_host, self.port))
        ls.listen(64)
        self.port = ls.getsockname()[1]
        self._listener = ls
        for target, name in ((self._accept_loop, "kv-accept"), (self._janitor, "kv-janitor")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def close(self) -> None:
        """Stop accepting, close every connection, fail what is still incomplete, join the threads."""
        self._closed.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.sock.close()
        for t in self._threads + [c.thread for c in conns if c.thread]:
            if t is not threading.current_thread():
                t.join(timeout=5)
        with self._lock:
            pending = [r.request_id for r in self._requests.values() if r.failed is None]
        for rid in pending:
            self._fail(rid, "receiver closed before the transfer completed")

    def __enter__(self) -> KVReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def inflight_bytes(self) -> int:
        with self._lock:
            return sum(r.assembler.allocated_bytes for r in self._requests.values())

    # ------------------------------------------------------------ internals

    def _accept_loop(self) -> None:
        """Accept senders until closed. A failed accept (out of file descriptors, EMFILE) or a connection that cannot
        be set up is logged and retried with a growing pause (at most 1 s): the first version returned, and the
        receiver stopped accepting for good without a word. More than `max_connections` at once are closed."""
        assert self._listener is not None
        pause_s, failing = ACCEPT_RETRY_S, False
        while not self._closed.is_set():
            try:
                sock, addr = self._listener.accept()
            except OSError as e:
                if self._closed.is_set():
                    return
                if not failing:
                    log.warning("KV receiver on port %s: accept failed (%s); retrying", self.port, e)
                failing = True
                self._closed.wait(pause_s)
                pause_s = min(2 * pause_s, 1.0)
                continue
            if failing:
                log.warning("KV receiver on port %s: accepting again", self.port)
            pause_s, failing = ACCEPT_RETRY_S, False
            conn = _RecvConn(sock, f"{addr[0]}:{addr[1]}")
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns.append(conn)
                    self.connections_accepted += 1
            try:
                if full:
                    raise OSError(f"{self.max_connections} connections open already")
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.thread = threading.Thread(target=self._conn_loop, args=(conn,), name=f"kv-recv-{conn.peer}", daemon=True)
                conn.thread.start()
            except (OSError, RuntimeError) as e:  # RuntimeError: no thread can be started
                log.warning("KV receiver: refusing connection %s: %s", conn.peer, e)
                sock.close()
                with self._lock:
                    if conn in self._conns:
                        self._conns.remove(conn)

    def _open_request(self, rid: str) -> _RecvRequest:
        """The one place a request begins on this receiver (its first data frame, or a trailer with none before it),
        under the lock: past `max_inflight_requests` transfers begun and not ended it raises `WireError`, which closes
        the connection whose frame opened it, as a malformed frame does (a flood of ids, each holding its bookkeeping
        outside the byte budget)."""
        if len(self._requests) >= self.max_inflight_requests:
            raise WireError(f"request {rid!r}: {self.max_inflight_requests} transfers in flight already")
        req = self._requests[rid] = _RecvRequest(rid, KVAssembler(rid, self.limits), now_s(), now_s())
        return req

    def _sink(self, conn: _RecvConn, h: DataHeader) -> memoryview:
        with self._lock:
            req = self._requests.get(h.request_id)
            if req is None and h.request_id not in self._finished:
                req = self._open_request(h.request_id)
            if req is None or req.failed:
                return conn.scratch_view(h.length)
            req.conns.add(conn)
            req.last_s = now_s()
            try:
                parts = req.assembler.reserve(h)  # checked and counted here; allocated below, without the lock
                total = sum(r.assembler.allocated_bytes for r in self._requests.values())
                if total > self.max_inflight_bytes:
                    raise WireError(f"receive budget: {total} bytes in flight exceeds {self.max_inflight_bytes}")
            except WireError as e:
                failed = str(e)
            else:
                failed = None
        if failed is not None:
            self._fail(h.request_id, failed)
            return conn.scratch_view(h.length)
        # a new tensor's pages are faulted in at once (`alloc_tensor`: 1 GiB took 13.6 s on the 2-core VM), which under
        # the lock stalled every other connection's frames; a request failed meanwhile just drops it
        view = parts.allocate()
        with self._lock:
            alive = self._requests.get(h.request_id) is req and not req.failed
        if view is None or not alive:
            return conn.scratch_view(h.length)
        return view[h.offset:h.offset + h.length]

    def _conn_loop(self, conn: _RecvConn) -> None:
        decoder = FrameDecoder(self.limits, lambda h: self._sink(conn, h))
        try:
            while not self._closed.is_set():
                n = conn.sock.recv_into(decoder.next_buffer())
                if n == 0:
                    if not decoder.idle:
                        raise WireError("stream: connection closed in the middle of a frame")
                    return
                try:
                    item = decoder.advance(n)
                except ChecksumError as e:
                    self._fail(e.header.request_id, str(e))
                    continue
                if isinstance(item, DataFrame):
                    self._on_data(conn, item)
                elif isinstance(item, Trailer):
                    self._on_trailer(conn, item)
                elif isinstance(item, Ack) and item.abort:
                    self._fail(item.request_id, item.reason or "aborted by sender", notify_sender=False)
        except WireError as e:
            self.protocol_errors.append(f"{conn.peer}: {e}")
            log.warning("KV receiver: dropping connection %s: %s", conn.peer, e)
        except OSError:
            pass
        finally:
            try:
                conn.sock.close()
            except OSError:
                pass
            with self._lock:
                if conn in self._conns:
                    self._conns.remove(conn)
                # a sender whose connection fails fails as a whole (`KVSender._fail`), so a transfer that had frames on
                # this one cannot complete: fail it now and free its tensors, not after `request_timeout_s` (a header
                # that announced 1 GiB, then a close, held that memory for 300 s)
                orphans = [r.request_id for r in self._requests.values()
                           if conn in r.conns and r.failed is None] if not self._closed.is_set() else []
            for rid in orphans:
                self._fail(rid, f"connection {conn.peer} closed before the transfer completed")

    def _on_data(self, conn: _RecvConn, frame: DataFrame) -> None:
        h = frame.header
        with self._lock:
            req = self._requests.get(h.request_id)
            if req is None or req.failed:
                return
            try:
                req.assembler.add(frame)
            except WireError as e:
                failed = str(e)
            else:
                req.wire_bytes += data_header_bytes(h.request_id) + h.length
                req.last_s = now_s()
                failed = None
        if failed:
            self._fail(h.request_id, failed)
        else:
            self._maybe_complete(h.request_id)

    def _on_trailer(self, conn: _RecvConn, trailer: Trailer) -> None:
        rid = trailer.request_id
        with self._lock:
            req = self._requests.get(rid)
            if req is None and rid not in self._finished:  # a transfer with no data frames at all
                req = self._open_request(rid)
            if req is not None:
                req.trailer, req.trailer_conn = trailer, conn
                req.wire_bytes += len(encode_trailer(trailer))
        if req is None:  # finished, failed or timed out before: never leave the sender waiting
            conn.send(encode_ack(Ack(rid, False, f"request id {rid!r} already ended on this receiver "
                                                 "(timed out, aborted, or reused)")))
            return
        failed = req.failed
        if failed:
            self._fail(rid, failed)  # now the sender can be told
        else:
            self._maybe_complete(rid)

    def _maybe_complete(self, rid: str) -> None:
        with self._lock:
            req = self._requests.get(rid)
            if req is None or req.trailer is None or req.failed:
                return
            if len(req.assembler.records) < req.trailer.frame_count:
                return
            del self._requests[rid]
            self._mark_finished(rid)
        try:
            result = req.assembler.finish(req.trailer)
        except WireError as e:
            with self._lock:
                self._requests[rid] = req
            self._fail(rid, str(e))
            return
        cache = result if isinstance(result, KVCache) else None
        kv_bytes = cache.nbytes if cache is not None else int(result)
        out = ReceivedKV(rid, True, None, cache, kv_bytes, req.wire_bytes, len(req.assembler.records),
                         req.first_frame_s, now_s(), req.trailer.model, req.trailer.tokens)
        self._deliver(rid, out)
        assert req.trailer_conn is not None
        req.trailer_conn.send(encode_ack(Ack(rid, True)))

    def _fail(self, rid: str, reason: str, notify_sender: bool = True) -> None:
        """Mark a request failed (once), tell the decode worker now and the sender once its trailer is in."""
        with self._lock:
            req = self._requests.get(rid)
            if req is None:
                if notify_sender or rid in self._finished:
                    return
                # an abort that overtook every data frame: it opens no request (nothing of it is in flight), only
                # remembers the id so late frames are discarded
                self._mark_finished(rid)
            else:
                first = req.failed is None
                req.failed = req.failed or reason
                req.assembler.parts.clear()  # free the partial tensors now
                req.assembler.allocated_bytes = 0
                req.conns.clear()  # and the connections: a failed one is no orphan, and a closed one's scratch is freed
                tell_sender = req.trailer_conn if (notify_sender and req.trailer is not None) else None
                if tell_sender is not None or not notify_sender:
                    del self._requests[rid]
                    self._mark_finished(rid)
        if req is None:
            t = now_s()
            self._deliver(rid, ReceivedKV(rid, False, reason, None, 0, 0, 0, t, t))
            return
        if first:
            self._deliver(rid, ReceivedKV(rid, False, reason, None, 0, req.wire_bytes, len(req.assembler.records),
                                          req.first_frame_s, now_s()))
        if tell_sender is not None:
            tell_sender.send(encode_ack(Ack(rid, False, req.failed or reason)))

    def _mark_finished(self, rid: str) -> None:
        self._finished[rid] = None
        if len(self._finished) > 4096:
            self._finished.popitem(last=False)

    def _deliver(self, rid: str, result: ReceivedKV) -> None:
        try:
            self.on_complete(rid, result)
        except Exception:  # the worker's callback must not kill the receive thread
            log.exception("KV receiver: on_complete(%s) raised", rid)

    def _janitor(self) -> None:
        while not self._closed.wait(0.5):
            cutoff = now_s() - self.request_timeout_s
            with self._lock:
                stale = [r for r in self._requests.values() if r.last_s < cutoff]
            for r in stale:
                got = r.assembler.payload_bytes
                want = r.trailer.payload_bytes if r.trailer else None
                self._fail(r.request_id, f"timed out after {self.request_timeout_s:g} s with {got} of "
                                         f"{want if want is not None else 'unknown'} bytes", notify_sender=True)
                with self._lock:  # give up on it entirely
                    if self._requests.get(r.request_id) is r:
                        del self._requests[r.request_id]
                        self._mark_finished(r.request_id)
