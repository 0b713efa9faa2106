"""NFQUEUE over raw netlink (NETLINK_NETFILTER, subsystem 3), with no library in between.

Why raw: the hot loop of the delay line needs only two facts per packet (its id and its length) and one
batched verdict per release, so encoding and decoding are a few `struct` calls. libnetfilter_queue
bindings are not installable everywhere and parse far more than we need.

Layout of every message: nlmsghdr (len u32, type u16, flags u16, seq u32, pid u32, host order), then
nfgenmsg (family u8, version u8, res_id be16 = queue number), then attributes (len u16, type u16,
payload padded to 4 bytes). NFQUEUE payload integers are big-endian.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import struct

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_VERDICT = 1
NFQNL_MSG_CONFIG = 2
NFQNL_MSG_VERDICT_BATCH = 3

NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLMSG_ERROR = 2
NLMSG_DONE = 3
SOL_NETLINK = 270
SO_TIMESTAMPNS = 35
NETLINK_NO_ENOBUFS = 5

# config attributes
NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQA_CFG_QUEUE_MAXLEN = 3
NFQA_CFG_MASK = 4
NFQA_CFG_FLAGS = 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_CFG_CMD_UNBIND = 2
NFQNL_COPY_NONE = 0
NFQNL_COPY_META = 1
NFQNL_COPY_PACKET = 2
NFQA_CFG_F_FAIL_OPEN = 1
NFQA_CFG_F_GSO = 4

# packet / verdict attributes
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_TIMESTAMP = 4
NFQA_PAYLOAD = 10
NFQA_CAP_LEN = 13

NF_DROP = 0
NF_ACCEPT = 1
NF_QUEUE = 3
NF_VERDICT_QBITS = 16  # NF_QUEUE verdicts carry the target queue number in their upper 16 bits
NF_VERDICT_FLAG_QUEUE_BYPASS = 0x8000  # target queue not bound: accept instead of drop

TYPE_PACKET = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET
TYPE_VERDICT = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_VERDICT
TYPE_VERDICT_BATCH = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_VERDICT_BATCH
TYPE_CONFIG = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_CONFIG

_NLMSGHDR = struct.Struct("=IHHII")
_NFGEN = struct.Struct("!BBH")
_ATTR = struct.Struct("=HH")
_BE32 = struct.Struct("!I")
_TIMESTAMP = struct.Struct("!QQ")
_VERDICT = struct.Struct("=IHHII" + "BBH" + "HH" + "II")  # whole verdict message, fixed size
_VERDICT_LEN = _VERDICT.size  # 16 + 4 + 4 + 8 = 32


class NetlinkError(OSError):
    """The kernel refused a NFQUEUE request (errno from the NLMSG_ERROR reply)."""


def _align4(n: int) -> int:
    return (n + 3) & ~3


def attr(attr_type: int, payload: bytes) -> bytes:
    """One netlink attribute, padded to 4 bytes."""
    raw = _ATTR.pack(_ATTR.size + len(payload), attr_type) + payload
    return raw + b"\0" * (_align4(len(raw)) - len(raw))


def message(msg_type: int, queue_num: int, attrs: bytes, seq: int = 0, flags: int = NLM_F_REQUEST) -> bytes:
    """nlmsghdr + nfgenmsg(AF_UNSPEC, v0, queue) + attributes."""
    body = _NFGEN.pack(socket.AF_UNSPEC, 0, queue_num) + attrs
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), msg_type, flags, seq, 0) + body


def config_bind(queue_num: int, seq: int = 0) -> bytes:
    return message(TYPE_CONFIG, queue_num, attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, 0)),
                   seq, NLM_F_REQUEST | NLM_F_ACK)


def config_unbind(queue_num: int, seq: int = 0) -> bytes:
    return message(TYPE_CONFIG, queue_num, attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_UNBIND, 0)),
                   seq, NLM_F_REQUEST | NLM_F_ACK)


def config_params(queue_num: int, copy_mode: int, copy_range: int, maxlen: int, flags: int, seq: int = 0,
                  ack: bool = True) -> bytes:
    """Copy mode and range, kernel queue length and flags (flags need a mask saying which bits are set)."""
    attrs = (attr(NFQA_CFG_PARAMS, struct.pack("!IB", copy_range, copy_mode))
             + attr(NFQA_CFG_QUEUE_MAXLEN, _BE32.pack(maxlen))
             + attr(NFQA_CFG_FLAGS, _BE32.pack(flags))
             + attr(NFQA_CFG_MASK, _BE32.pack(flags)))
    return message(TYPE_CONFIG, queue_num, attrs, seq, NLM_F_REQUEST | (NLM_F_ACK if ack else 0))


def verdict(queue_num: int, packet_id: int, verdict_code: int, batch: bool = False) -> bytes:
    """A verdict for one packet, or with `batch` for every queued packet with id <= `packet_id`."""
    return _VERDICT.pack(_VERDICT_LEN, TYPE_VERDICT_BATCH if batch else TYPE_VERDICT, NLM_F_REQUEST, 0, 0,
                         socket.AF_UNSPEC, 0, socket.htons(queue_num),
                         12, NFQA_VERDICT_HDR, socket.htonl(verdict_code), socket.htonl(packet_id))


def requeue_verdict(queue_num: int, packet_id: int, to_queue: int) -> bytes:
    """Send one packet on to another queue. A queue bound without NFQA_CFG_F_GSO receives a GSO packet
    cut by the kernel (skb_gso_segment) into its wire packets, each with its own id there."""
    return verdict(queue_num, packet_id, NF_QUEUE | (to_queue << NF_VERDICT_QBITS) | NF_VERDICT_FLAG_QUEUE_BYPASS)


def parse_packets(buf: bytes | bytearray | memoryview, n: int) -> list[tuple[int, int, float]]:
    """(packet id, length in bytes, kernel receive time) of each NFQUEUE packet message in `buf[:n]`.

    The length is NFQA_CAP_LEN when the kernel truncated the copy (always, with a small copy range),
    else the payload length. The receive time is NFQA_TIMESTAMP (CLOCK_REALTIME seconds; present while
    any socket on the host asked for timestamps), else 0.0. Other messages are skipped, error replies
    included: the only ones in the packet stream answer verdicts for packets the kernel already
    flushed (an interface went down), which is no reason to stop.
    """
    out = []
    off = 0
    unpack_hdr = _NLMSGHDR.unpack_from
    unpack_attr = _ATTR.unpack_from
    while off + 16 <= n:
        mlen, mtype = unpack_hdr(buf, off)[:2]
        if mlen < 16 or off + mlen > n:
            break
        if mtype == TYPE_PACKET:
            a = off + 20
            end = off + mlen
            pid = -1
            length = 0
            ts = 0.0
            while a + 4 <= end:
                alen, atype = unpack_attr(buf, a)
                if alen < 4:
                    break
                atype &= 0x3FFF
                if atype == NFQA_PACKET_HDR:
                    pid = _BE32.unpack_from(buf, a + 4)[0]
                elif atype == NFQA_CAP_LEN:
                    length = _BE32.unpack_from(buf, a + 4)[0]
                elif atype == NFQA_PAYLOAD and not length:
                    length = alen - 4
                elif atype == NFQA_TIMESTAMP:
                    sec, usec = _TIMESTAMP.unpack_from(buf, a + 4)
                    ts = sec + usec * 1e-6
                a += (alen + 3) & ~3
            if pid >= 0:
                out.append((pid, length, ts))
        off += (mlen + 3) & ~3
    return out


class NfQueue:
    """A bound NFQUEUE queue: `recv_into` packets, `send` verdicts (several messages per send)."""

    def __init__(self, queue_num: int, maxlen: int, copy_range: int = 1, rcvbuf_bytes: int = 64 << 20,
                 gso: bool = True) -> None:
        """`gso`: GSO packets arrive whole (NFQA_CFG_F_GSO); without it the kernel segments them first."""
        self.queue_num = queue_num
        self.copy_range = copy_range
        self.flags = NFQA_CFG_F_GSO if gso else 0
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            self.sock.bind((0, 0))
            for opt in (getattr(socket, "SO_RCVBUFFORCE", 33), socket.SO_RCVBUF):
                try:
                    self.sock.setsockopt(socket.SOL_SOCKET, opt, rcvbuf_bytes)
                    break
                except OSError:
                    continue
            self.sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
            # Any socket asking for receive timestamps makes the kernel stamp every packet on arrival,
            # so NFQA_TIMESTAMP gives the true arrival time instead of our (later) wake-up time.
            self._stamp_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self._stamp_sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            self.sock.settimeout(5.0)
            self._request(config_bind(queue_num, 1))
            # PACKET mode with a tiny copy range: the kernel copies one byte and reports the full
            # length (NFQA_CAP_LEN); META mode copies nothing but reports no length at all.
            self._request(config_params(queue_num, NFQNL_COPY_PACKET, copy_range, maxlen, self.flags, 2))
        except BaseException:
            self.sock.close()
            if hasattr(self, "_stamp_sock"):
                self._stamp_sock.close()
            raise
        self.sock.setblocking(False)

    def _request(self, msg: bytes) -> None:
        """Send a config request and wait for its ACK; packets arriving meanwhile cannot exist yet."""
        self.sock.send(msg)
        seq = _NLMSGHDR.unpack_from(msg)[3]
        while True:
            data = self.sock.recv(65536)
            off = 0
            while off + 16 <= len(data):
                mlen, mtype, _, mseq, _ = _NLMSGHDR.unpack_from(data, off)
                if mtype == NLMSG_ERROR and mseq == seq:
                    err = struct.unpack_from("=i", data, off + 16)[0]
                    if err:
                        hint = ""
                        if -err in (errno.EBUSY, errno.EPERM):
                            hint = (" (is this queue number already bound by another process?)" if os.geteuid() == 0
                                    else " (binding an NFQUEUE queue needs root or CAP_NET_ADMIN)")
                        raise NetlinkError(-err, f"NFQUEUE queue {self.queue_num}: {os.strerror(-err)}{hint}")
                    return
                off += _align4(max(mlen, 16))

    def set_maxlen(self, maxlen: int) -> None:
        """Raise or lower the kernel queue length while running (no ACK: packets keep flowing)."""
        self.send(config_params(self.queue_num, NFQNL_COPY_PACKET, self.copy_range, maxlen, self.flags, ack=False))

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, data: bytes) -> None:
        while data:
            try:
                self.sock.send(data)
                return
            except BlockingIOError:
                select.select([], [self.sock], [], 0.01)
            except OSError as e:
                if e.errno != errno.EINTR:
                    raise

    def close(self) -> None:
        try:
            self.sock.setblocking(True)
            self.sock.settimeout(0.5)
            self._request(config_unbind(self.queue_num, 3))
        except OSError:
            pass
        self.sock.close()
        self._stamp_sock.close()
