"""WAN measurements beside the workload: one-way delay probes and per-flow throughput from a capture.

Probes are UDP datagrams stamped with `testbed.clock.now_s()` (CLOCK_MONOTONIC, the same clock in every
namespace of the host), so receive time minus send time is the true one-way delay across the emulated WAN.
Run the two ends inside hosts with ``python -m traffic.probes recv|send ...``. Captures (tcpdump on a
gateway) are read with scapy and binned into per-flow throughput.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import struct
import sys
from pathlib import Path
from typing import Any

from testbed import clock
from testbed.atomic import write_text
from testbed.validation import output_file_option

MAGIC = b"PRFP"
_FMT = struct.Struct("!4sQd")


def encode_probe(seq: int, sent_s: float, pad_bytes: int = 0) -> bytes:
    return _FMT.pack(MAGIC, seq, sent_s) + b"\0" * pad_bytes


def decode_probe(data: bytes) -> tuple[int, float]:
    """(sequence number, send time in seconds); ValueError for anything that is not a probe."""
    if len(data) < _FMT.size or data[:4] != MAGIC:
        raise ValueError("not a probe datagram")
    _, seq, sent = _FMT.unpack_from(data)
    if not math.isfinite(sent) or sent < 0:  # a NaN send time made a NaN one-way delay in the samples
        raise ValueError("not a probe datagram: its send time is not a clock reading")
    return seq, sent


def send_probes(ip: str, port: int, count: int, interval_s: float, pad_bytes: int = 0) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        start = clock.now_s()
        for seq in range(count):
            delay = start + seq * interval_s - clock.now_s()
            if delay > 0:
                import time

                time.sleep(delay)
            s.sendto(encode_probe(seq, clock.now_s(), pad_bytes), (ip, port))


def receive_probes(port: int, count: int, timeout_s: float, bind_ip: str = "0.0.0.0") -> list[dict[str, float]]:
    """Samples ``{seq, sent_s, recv_s, one_way_delay_s}`` until `count` probes arrived or `timeout_s` of silence."""
    out: list[dict[str, float]] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((bind_ip, port))
        s.settimeout(timeout_s)
        while len(out) < count:
            try:
                data = s.recv(65535)
            except socket.timeout:
                break
            now = clock.now_s()
            try:
                seq, sent = decode_probe(data)
            except ValueError:
                continue
            out.append({"seq": seq, "sent_s": sent, "recv_s": now, "one_way_delay_s": now - sent})
    return out


def pcap_flow_throughput(path: str | Path, interval_s: float = 0.1) -> Any:
    """A capture -> DataFrame ``t_s, src, dst, sport, dport, proto, bytes, bps`` per flow and interval.

    `t_s` is the interval's start from the first packet; bytes are IP lengths (headers included).
    """
    import pandas as pd
    from scapy.layers.inet import IP, TCP, UDP
    from scapy.utils import PcapReader

    rows = []
    with PcapReader(str(path)) as reader:
        for pkt in reader:
            if IP not in pkt:
                continue
            ip = pkt[IP]
            l4 = TCP if TCP in pkt else UDP if UDP in pkt else None
            rows.append((float(pkt.time), ip.src, ip.dst, int(pkt[l4].sport) if l4 else 0, int(pkt[l4].dport) if l4 else 0,
                         int(ip.proto), int(ip.len)))
    cols = ["t_s", "src", "dst", "sport", "dport", "proto", "bytes"]
    df = pd.DataFrame(rows, columns=["time", *cols[1:]])
    if df.empty:
        return pd.DataFrame(columns=[*cols, "bps"])
    df["t_s"] = ((df["time"] - df["time"].min()) // interval_s) * interval_s
    out = df.groupby(["t_s", "src", "dst", "sport", "dport", "proto"], as_index=False)["bytes"].sum()
    out["bps"] = out["bytes"] * 8 / interval_s
    return out[[*cols, "bps"]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m traffic.probes", description="one-way delay probes (run one end in each host)")
    sub = p.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("recv")
    r.add_argument("--port", type=int, default=5399)
    r.add_argument("--count", type=int, default=100)
    r.add_argument("--timeout", type=float, default=5.0, help="seconds of silence before giving up")
    r.add_argument("--out", type=output_file_option, help="JSON Lines file of samples (default: stdout)")
    s = sub.add_parser("send")
    s.add_argument("ip")
    s.add_argument("--port", type=int, default=5399)
    s.add_argument("--count", type=int, default=100)
    s.add_argument("--interval", type=float, default=0.01, help="seconds between probes")
    s.add_argument("--pad", type=int, default=0, help="extra payload bytes")
    args = p.parse_args(argv)
    if args.mode == "send":
        send_probes(args.ip, args.port, args.count, args.interval, args.pad)
        return 0
    samples = receive_probes(args.port, args.count, args.timeout)
    text = "".join(json.dumps(x) + "\n" for x in samples)
    if args.out:
        write_text(args.out, text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
