"""What turning TSO/GSO/GRO off costs (testbed/net/offloads.py: the netem backend with loss does it).

One path of real namespaces, a - r - b (testbed.net.nslab): iperf3 from a to b, forwarded by r, with
offloads on (the veth default) and off on all four veth ends (what `offloads.turn_off` does to every
interface of a lossy netem network), side by side in one run: unshaped (the host's ceiling) and through
an HTB bottleneck (`--rate`, testbed.net.shaping) at which both should hold the rate. Reports goodput
and the host's CPU-seconds per GB delivered (all processes: /proc/stat busy time, so iperf3's own
copying is in it for both). No netem here (it runs where the kernel has none); netem's per-packet
enqueue/dequeue would add to the "off" figure. No target: it prints the ratios; exit 1 only when a
measurement failed.

    sudo .venv/bin/python benchmarks/offload_cost.py [--quick] [--rate 1Gbps] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.delayline_bench import _iperf3, htb_bottleneck  # noqa: E402
from testbed.net import offloads  # noqa: E402
from testbed.net.nslab import NsLab  # noqa: E402
from testbed.units import parse_rate_bps  # noqa: E402
from testbed.validation import output_file_option  # noqa: E402


def _busy_s() -> float:
    """Busy CPU time of the whole host, in seconds (user, nice, system, irq, softirq of all CPUs)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def measure(lab: NsLab, rate_bps: float | None, duration_s: float, streams: int) -> dict:
    with htb_bottleneck(lab, rate_bps, 0.001) if rate_bps else nullcontext():
        t0, c0 = time.monotonic(), _busy_s()
        data = _iperf3(lab, streams, duration_s)
        wall_s, cpu_s = time.monotonic() - t0, _busy_s() - c0
    if "error" in data:
        return {"error": str(data["error"])}
    received = data["end"]["sum_received"]
    gb = received["bytes"] / 1e9
    return {"goodput_bps": received["bits_per_second"], "cpu_s_per_gb": cpu_s / gb if gb else float("nan"),
            "cpu_busy_share": cpu_s / wall_s, "retransmits": data["end"]["sum_sent"].get("retransmits", 0)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 s per point instead of 8 s")
    p.add_argument("--rate", default="1Gbps", help="the HTB bottleneck's wire rate (default 1Gbps)")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--json", type=output_file_option)
    a = p.parse_args(argv)
    try:
        rate_bps = parse_rate_bps(a.rate)
    except ValueError as exc:
        print(f"--rate: {exc}", file=sys.stderr)
        return 2
    duration_s = 3 if a.quick else 8
    results: dict[str, dict] = {}
    for state in ("on", "off"):
        with NsLab(prefix=f"ofc-{state}") as lab:
            if state == "off":
                offloads.turn_off([(lab.popen_in(lab.a), "a0"), (lab.popen_in(lab.r), "ra"),
                                   (lab.popen_in(lab.r), "rb"), (lab.popen_in(lab.b), "b0")])
            for point, rate in (("unshaped", None), (a.rate, rate_bps)):
                results[f"{point}, offloads {state}"] = r = measure(lab, rate, duration_s, a.streams)
                print(f"{point:>9}, offloads {state:>3}: " + (r["error"] if "error" in r else
                      f"{r['goodput_bps'] / 1e9:6.2f} Gbps, {r['cpu_s_per_gb']:5.2f} CPU-s/GB, "
                      f"host busy {r['cpu_busy_share']:.2f} CPUs, {r['retransmits']} retransmits"), flush=True)
    failed = [k for k, v in results.items() if "error" in v]
    if not failed:
        for point in ("unshaped", a.rate):
            on, off = results[f"{point}, offloads on"], results[f"{point}, offloads off"]
            print(f"{point}: off / on goodput {off['goodput_bps'] / on['goodput_bps']:.2f}, "
                  f"CPU per GB {off['cpu_s_per_gb'] / on['cpu_s_per_gb']:.2f}x")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    from testbed.cli import guarded

    sys.exit(guarded(Path(__file__).name, main))
