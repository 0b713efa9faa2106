"""A throwaway line of three network namespaces, a - r - b, for testing and benchmarking WAN elements.

`r` routes between two veth links; a WAN element (delay line, shaper) goes on r's interfaces. Every
name carries a unique prefix, every process started through the lab is tracked, and `close()` kills
them and deletes the namespaces, so a test or benchmark leaves nothing behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

A_ADDR, R_A_ADDR, R_B_ADDR, B_ADDR = "10.201.1.1", "10.201.1.2", "10.201.2.2", "10.201.2.1"


_UDP_RECEIVER = """
import select, socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
s.bind(("0.0.0.0", 5299))
print("ready", flush=True)
n = inversions = 0
top = -1
while select.select([s], [], [], 2.0 if n else 30.0)[0]:
    seq = int.from_bytes(s.recv(2048)[:8], "big")
    n += 1
    if seq < top:
        inversions += 1
    top = max(top, seq)
print(n, inversions, flush=True)
"""

_UDP_SENDER = """
import socket, sys, time
n, pps, dst = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
t0 = time.monotonic()
for i in range(n):
    s.sendto(i.to_bytes(8, "big") + bytes(56), (dst, 5299))
    if i % 100 == 99:
        lag = t0 + (i + 1) / pps - time.monotonic()
        if lag > 0:
            time.sleep(lag)
"""


@dataclass(frozen=True)
class ProbeResult:
    sent: int
    received: int
    reordered: int  # probes that arrived after a probe sent later

    @property
    def loss(self) -> float:
        return 1 - self.received / self.sent


class NsLab:
    """Namespaces `{prefix}-a`, `-r`, `-b`; links a0<->ra (10.201.1.0/24) and rb<->b0 (10.201.2.0/24)."""

    def __init__(self, prefix: str | None = None, tcp_buffer_bytes: int = 64 << 20) -> None:
        self.prefix = prefix or f"dlt-{os.getpid()}"
        self.a, self.r, self.b = (f"{self.prefix}-{n}" for n in "arb")
        self.tcp_buffer_bytes = tcp_buffer_bytes
        self.procs: list[subprocess.Popen] = []
        self.created: list[str] = []

    def __enter__(self) -> "NsLab":
        try:
            self.setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def sh(self, ns: str | None, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        cmd = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
        return r

    def setup(self) -> None:
        for ns in (self.a, self.r, self.b):
            self.sh(None, "ip", "netns", "add", ns)
            self.created.append(ns)
            self.sh(ns, "ip", "link", "set", "lo", "up")
        self.sh(None, "ip", "link", "add", "a0", "netns", self.a, "type", "veth", "peer", "name", "ra", "netns", self.r)
        self.sh(None, "ip", "link", "add", "rb", "netns", self.r, "type", "veth", "peer", "name", "b0", "netns", self.b)
        for ns, ifname, addr in ((self.a, "a0", A_ADDR), (self.r, "ra", R_A_ADDR),
                                 (self.r, "rb", R_B_ADDR), (self.b, "b0", B_ADDR)):
            self.sh(ns, "ip", "addr", "add", f"{addr}/24", "dev", ifname)
            self.sh(ns, "ip", "link", "set", ifname, "up")
        self.sh(self.a, "ip", "route", "add", "default", "via", R_A_ADDR)
        self.sh(self.b, "ip", "route", "add", "default", "via", R_B_ADDR)
        self.sh(self.r, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for ns in (self.a, self.b):  # per-namespace sysctls: room for a WAN's bandwidth-delay product
            buf = self.tcp_buffer_bytes
            self.sh(ns, "sysctl", "-qw", f"net.ipv4.tcp_rmem=4096 131072 {buf}", f"net.ipv4.tcp_wmem=4096 131072 {buf}")

    def popen_in(self, ns: str) -> Callable[[list[str]], subprocess.Popen]:
        """A `popen(argv)` that runs argv inside `ns` (stdout/stderr piped) and tracks the process."""

        def popen(argv: list[str]) -> subprocess.Popen:
            p = subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            self.procs.append(p)
            return p

        return popen

    def udp_probe(self, probes: int, pps: float) -> ProbeResult:
        """Numbered 64-byte UDP probes a -> b at `pps`: how many arrived and how many out of order."""
        recv = self.popen_in(self.b)([sys.executable, "-c", _UDP_RECEIVER])
        try:
            if recv.stdout.readline().strip() != b"ready":
                raise RuntimeError(f"UDP probe receiver did not start: {recv.stderr.read().decode()[-300:]}")
            self.sh(self.a, sys.executable, "-c", _UDP_SENDER, str(probes), str(pps), B_ADDR, timeout=probes / pps + 60)
            out, _ = recv.communicate(timeout=60)
            received, reordered = (int(x) for x in out.split()[-2:])
        finally:
            if recv.poll() is None:
                recv.kill()
                recv.wait()
        return ProbeResult(probes, received, reordered)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            for s in (p.stdout, p.stderr):
                if s is not None:
                    s.close()
        for ns in self.created:
            for pid in self.sh(None, "ip", "netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            self.sh(None, "ip", "netns", "del", ns, check=False)
        self.created.clear()
