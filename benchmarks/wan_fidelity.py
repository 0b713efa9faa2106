"""WAN fidelity of the testbed's network (delay-line backend on hosts without netem), side by side in one run.

Targets (issue 2): rate received/configured >= 0.95 (counted by the receiver's interface, not the shaper)
with 4 iperf3 streams at 0.5, 1, 2, 5 Gbps wire and
10 ms one way, Mininet TCLink at 1 Gbps printed beside it; RTT p50 within 0.2 ms + 1% and p99 within
1 ms + 2% of 2 x delay for 5-50 ms, idle and under a flow at half the rate; RTT std within 20% of the
configured jitter; loss within +-20% of 0.1%, 1%, 5%; the highest wire rate held at >= 0.95 at 20 ms
RTT and the delay line's CPU cost per GB; a 5 -> 1 Gbps step visible in telemetry within 100 ms, with
traffic flowing before it.

    sudo .venv/bin/python benchmarks/wan_fidelity.py [--quick] [--json FILE]

Prints one table; exits 1 when a target is missed. Method notes (docs/network.md, "Fidelity"): the
half-rate flow is paced at the socket (iperf3 -b alone catches up at the full link rate after slow
start and fills the 1-BDP queue); each RTT row prints the link rate and largest queue seen meanwhile;
a missed RTT or capacity point is run once more and both runs are printed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.table import Table  # noqa: E402

from testbed.atomic import write_json  # noqa: E402
from testbed.net.calibrate import IperfServer, measure_rates_bps, measure_rtt, measure_udp_loss  # noqa: E402
from testbed.net.emulation import Network  # noqa: E402
from testbed.packet import GOODPUT_MAX  # noqa: E402
from testbed.scenario import DIRECTIONS, LossSpec  # noqa: E402
from testbed.sections import parse_scenario  # noqa: E402
from testbed.console import wide_console  # noqa: E402
from testbed.validation import output_file_option  # noqa: E402

SRC, DST = "prfaas-p0", "pd-d0"
rows: list[dict] = []


def record(target: str, configured: str, measured: str, criterion: str, ok: bool | None) -> None:
    rows.append({"target": target, "configured": configured, "measured": measured, "criterion": criterion, "ok": ok})


def scenario(rate: str, delay: str, schedule: list | None = None) -> object:
    return parse_scenario({"name": "wan-fidelity", "scale": 1, "duration": "600s",
                           "topology": {"prfaas": {"prefill": 1, "cross": 0}, "pd": {"prefill": 0, "decode": 1, "cross": 0}},
                           "wan": {"backend": "auto", "rate": rate, "delay": delay, "queue": "1bdp", "schedule": schedule or []}})


def set_both(net: Network, **changes: object) -> None:
    for d in DIRECTIONS:
        net.wan.set_direction(d, replace(net.wan.current[d], **changes))


def set_one(net: Network, direction: str, **changes: object) -> None:
    net.wan.set_direction(direction, replace(net.wan.current[direction], **changes))


def timed_rate(net: Network, g: float, duration_s: float, port: int = 5201) -> tuple[float, float, float]:
    """(TCP goodput, link rate at the receiver, link rate at the shaper) in bps, over the iperf3 run after
    its 1 s omit. The judged link rate is counted by the receiver's interface (frames incl. Ethernet
    headers, the unit the configured rate is in), from the same samples and window as the goodput
    (`calibrate.measure_rates_bps`; it ran a second sampler of its own until session 68); the shaper's own tx counter
    (telemetry rows) is printed beside it."""
    t_a = net.since_start_s()
    good, link = measure_rates_bps(net, SRC, DST, streams=4, duration_s=duration_s, omit_s=1, port=port)
    t_b = net.since_start_s()
    window = [r["achieved_bps"] for r in net.telemetry.rows
              if r["direction"] == "prfaas_to_pd" and t_a + 1.3 <= r["t_s"] <= t_b - 0.3]
    return good, link, (sum(window) / len(window) if window else float("nan"))


def bench_rate(net: Network, rates_gbps: list[float], duration_s: float) -> None:
    set_both(net, delay_s=0.010)
    with IperfServer(net, DST):
        for g in rates_gbps:
            set_both(net, rate_bps=g * 1e9)
            good, link, shaper = timed_rate(net, g, duration_s)
            ratio = link / (g * 1e9)
            record("rate, 4 streams, 10 ms one way", f"{g:g} Gbps",
                   f"received {link / 1e9:.3f} Gbps (ratio {ratio:.3f}; shaper's counter {shaper / 1e9:.3f}); "
                   f"goodput {good / 1e9:.3f} ({good / g / 1e9:.3f}, max {GOODPUT_MAX:.3f})",
                   ">= 0.95 (goal 0.97)", ratio >= 0.95)


def bench_tclink(duration_s: float) -> None:
    """Plain Mininet: two hosts joined by TCLink(bw=1000), the way Mininet users shape a link."""
    from mininet.link import TCLink
    from mininet.log import setLogLevel
    from mininet.net import Mininet

    setLogLevel("critical")
    net = Mininet(controller=None, build=False, waitConnected=False)
    try:
        h1 = net.addHost("tcl1", ip="10.9.0.1/24")
        h2 = net.addHost("tcl2", ip="10.9.0.2/24")
        net.addLink(h1, h2, cls=TCLink, bw=1000)
        net.build()
        net.start()
        srv = h2.popen(["iperf3", "-s", "-1"])
        time.sleep(0.5)
        out = h1.cmd(f"iperf3 -J -c 10.9.0.2 -P 4 -t {duration_s:g} -O 1")
        srv.wait(timeout=30)
        bps = json.loads(out)["end"]["sum_received"]["bits_per_second"]
        record("rate: Mininet TCLink (reference, no delay)", "1 Gbps", f"goodput {bps / 1e9:.3f} Gbps (ratio {bps / 1e9:.3f})",
               "compare with our goodput at 1 Gbps (0.85 measured before)", None)
    finally:
        net.stop()


def _delay_ok(measured_s: float, expected_s: float, abs_s: float, rel: float) -> bool:
    return abs(measured_s - expected_s) <= abs_s + rel * expected_s


# A flow at half the rate: iperf3's -b alone only holds the *average* at 500 Mbit/s; a TCP flow that fell
# behind in slow start (a long RTT) then catches up at the full link rate and fills the 1-BDP queue
# (measured: 12.5 MB backlog, RTT 200 ms for 0.8 s at 2 x 50 ms). --fq-rate paces the socket itself
# (SO_MAX_PACING_RATE; TCP's internal pacing, no fq qdisc needed), so the flow never exceeds half the rate.
HALF_RATE_FLOW = ["-b", "500M", "--fq-rate", "500M"]
PING_INTERVAL_S = 0.005


def _window(net: Network, t_a: float, t_b: float) -> tuple[float, int]:
    """(mean link rate in bps, largest shaper backlog in bytes) of prfaas_to_pd between two network times."""
    w = [r for r in net.telemetry.rows if r["direction"] == "prfaas_to_pd" and t_a <= r["t_s"] <= t_b]
    if not w:
        return float("nan"), 0
    return sum(r["achieved_bps"] for r in w) / len(w), max(r["backlog_bytes"] for r in w)


def _rtt_point(net: Network, load: bool, pings: int) -> tuple[object, str]:
    """One ping run (idle, or under a half-rate flow), and what the flow and the queue did meanwhile."""
    flow = None
    if load:
        flow = net.popen(SRC, ["iperf3", "-c", net.host_ip(DST), *HALF_RATE_FLOW, "-t", "600"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.5)
    t_a = net.since_start_s()
    try:
        rtt = measure_rtt(net, SRC, DST, count=pings, interval_s=PING_INTERVAL_S)
    finally:
        if flow:
            flow.kill()
            flow.wait()
    rate_bps, backlog = _window(net, t_a + 0.1, net.since_start_s())
    time.sleep(0.3)
    return rtt, f"link {rate_bps / 1e9:.2f} Gbps, queue max {backlog / 1e3:.0f} kB, {rtt.replies} pings"


def bench_delay(net: Network, delays_ms: list[float], pings: int) -> None:
    """p50 and p99 of one ping run per point; a point that misses is measured once more and both runs are
    printed (a loaded shared host can stall one run; the target is not relaxed)."""
    set_both(net, rate_bps=1e9)
    with IperfServer(net, DST):
        for d_ms in delays_ms:
            set_both(net, delay_s=d_ms / 1e3)
            expected = 2 * d_ms / 1e3
            for load in (False, True):
                def ok(r: object) -> tuple[bool, bool]:
                    return (_delay_ok(r.p50_s, expected, 0.2e-3, 0.01), _delay_ok(r.p99_s, expected, 1e-3, 0.02))

                rtt, what_flow = _rtt_point(net, load, pings)
                note = ""
                if not all(ok(rtt)):
                    first = rtt
                    rtt, what_flow = _rtt_point(net, load, pings)
                    note = f" (2nd run; 1st: p50 {first.p50_s * 1e3:.3f}, p99 {first.p99_s * 1e3:.3f} ms)"
                ok50, ok99 = ok(rtt)
                what = f"RTT {'under a paced 0.5 Gbps flow' if load else 'idle'}"
                record(f"{what}, p50", f"2 x {d_ms:g} ms", f"{rtt.p50_s * 1e3:.3f} ms{note}", "+-(0.2 ms + 1%)", ok50)
                record(f"{what}, p99", f"2 x {d_ms:g} ms", f"{rtt.p99_s * 1e3:.3f} ms ({what_flow})", "+-(1 ms + 2%)", ok99)


def bench_jitter(net: Network, pings: int) -> None:
    set_both(net, delay_s=0.020, rate_bps=1e9)
    for dist in ("normal", "uniform"):
        set_one(net, "prfaas_to_pd", jitter_s=0.002, jitter_distribution=dist)
        rtt = measure_rtt(net, SRC, DST, count=pings, interval_s=0.01)
        # netem's meaning: normal -> sigma = jitter; uniform -> +-jitter, sigma = jitter / sqrt(3)
        sigma = 0.002 if dist == "normal" else 0.002 / 3 ** 0.5
        record(f"jitter ({dist}), RTT std", f"{sigma * 1e3:.3f} ms", f"{rtt.std_s * 1e3:.3f} ms", "within 20%", abs(rtt.std_s - sigma) <= 0.2 * sigma)
    set_one(net, "prfaas_to_pd", jitter_s=0.0)


def bench_loss(net: Network, quick: bool) -> None:
    set_both(net, delay_s=0.010, rate_bps=1e9)
    with IperfServer(net, DST, port=5302):
        for p in (0.001, 0.01, 0.05):
            probes = 20000 if quick else max(20000, int(100 / p))
            set_one(net, "prfaas_to_pd", loss=LossSpec("random", p))
            lost, sent = measure_udp_loss(net, SRC, DST, datagrams=probes, rate_bps=200e6, port=5302)
            m = lost / sent if sent else float("nan")
            record("loss (random), UDP probes", f"{p:.1%}", f"{m:.3%} ({lost}/{sent})", "+-20% relative, >= 20000 probes",
                   abs(m - p) <= 0.2 * p and sent >= 20000)
    set_one(net, "prfaas_to_pd", loss=LossSpec())


CAPACITY_GOAL_GBPS = 8.0


def _capacity_point(net: Network, g: float, duration_s: float) -> tuple[float, float, float]:
    """(goodput bps, link bps received, delay-line CPU-s per GB) at wire rate `g` Gbps."""
    em = net.wan.emulators["prfaas_to_pd"]
    line = getattr(em, "line", None)
    cpu0 = line.cpu_s() if line else 0.0
    b0 = em.sample()["tx_bytes"]
    good, link, _ = timed_rate(net, g, duration_s, port=5303)
    gb = (em.sample()["tx_bytes"] - b0) / 1e9
    cpu = (line.cpu_s() - cpu0) if line else float("nan")
    return good, link, cpu / gb if gb else float("nan")


def bench_capacity(net: Network, rates_gbps: list[float], duration_s: float) -> None:
    """Rates upwards until one is not held. A missed point is run once more (4 BBR streams at 20 ms RTT
    sometimes settle ~30% low for a whole run on a shared host); both runs are printed."""
    set_both(net, delay_s=0.010)
    best = 0.0
    cost = float("nan")
    with IperfServer(net, DST, port=5303):
        for g in rates_gbps:
            set_both(net, rate_bps=g * 1e9)
            good, link, per_gb = _capacity_point(net, g, duration_s)
            note = ""
            if link / (g * 1e9) < 0.95:
                note = f" (2nd run; 1st: ratio {link / (g * 1e9):.3f})"
                good, link, per_gb = _capacity_point(net, g, duration_s)
            ratio = link / (g * 1e9)
            # Up to the goal every step must hold; above it the search only looks for the ceiling, and
            # the step that is not held is how the ceiling is found, not a missed target.
            above = g > CAPACITY_GOAL_GBPS
            record("capacity: rate at 20 ms RTT", f"{g:g} Gbps",
                   f"received {link / 1e9:.3f} Gbps (ratio {ratio:.3f}), goodput {good / 1e9:.3f}; delay line {per_gb:.2f} CPU-s/GB{note}",
                   ">= 0.95 holds" + (" (search above the goal: reported)" if above else ""),
                   True if ratio >= 0.95 else (None if above else False))
            if ratio >= 0.95:
                best, cost = g, per_gb
            else:
                break
    record("capacity: highest wire rate held", f"goal >= {CAPACITY_GOAL_GBPS:g} Gbps", f"{best:g} Gbps, {cost:.2f} CPU-s per GB forwarded",
           f">= {CAPACITY_GOAL_GBPS:g} Gbps", best >= CAPACITY_GOAL_GBPS)


STEP_SEEN_BPS = 1.5e9  # telemetry at or below this (after the step to 1 Gbps) shows the step


def bench_schedule(duration_s: float) -> None:
    step_at = 2.0
    sc = scenario("5Gbps", "10ms", [{"at": f"{step_at}s", "rate": "1Gbps"}])
    with Network(sc, telemetry_period_s=0.02) as net:
        with IperfServer(net, DST, port=5304):
            net.run(SRC, ["iperf3", "-c", net.host_ip(DST), "-p", "5304", "-P", "4", "-t", f"{step_at + duration_s:g}"], timeout_s=60)
        rows_ = [r for r in net.telemetry.rows if r["direction"] == "prfaas_to_pd"]
    after = [r for r in rows_ if r["t_s"] >= step_at]
    seen = next((r["t_s"] for r in after if r["achieved_bps"] <= STEP_SEEN_BPS and r["rate_bps"] == 1e9), None)
    before = [r["achieved_bps"] for r in rows_ if step_at - 0.6 < r["t_s"] < step_at - 0.1]
    before_bps = sum(before) / len(before) if before else 0.0
    lat = (seen - step_at) if seen is not None else float("inf")
    # An idle link "shows" any step at once: the step counts only when the flow carried at least twice
    # the detection level before it.
    record("schedule: 5 -> 1 Gbps step in telemetry", f"at {step_at:g} s",
           f"visible after {lat * 1e3:.0f} ms (before: {before_bps / 1e9:.2f} Gbps)",
           f"<= 100 ms, with >= {2 * STEP_SEEN_BPS / 1e9:g} Gbps before the step", lat <= 0.1 and before_bps >= 2 * STEP_SEEN_BPS)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs, fewer points")
    ap.add_argument("--json", type=output_file_option, help="write the rows as JSON")
    args = ap.parse_args()
    q = args.quick
    dur = 3.0 if q else 6.0
    con = wide_console()
    t0 = time.monotonic()
    with con.status("wan fidelity") as status:
        with Network(scenario("1Gbps", "10ms")) as net:
            backend = net.backend
            status.update("rate")
            bench_rate(net, [0.5, 1, 2, 5], dur)
            status.update("delay")
            bench_delay(net, [5, 20] if q else [5, 20, 50], 300 if q else 1000)
            status.update("jitter")
            bench_jitter(net, 300 if q else 1000)
            status.update("loss")
            bench_loss(net, q)
            status.update("capacity")
            bench_capacity(net, [2, 5, 8] if q else [2, 5, 6, 8, 10], dur)
        status.update("Mininet TCLink")
        bench_tclink(dur)
        status.update("schedule")
        bench_schedule(1.5)
    t = Table(title=f"WAN fidelity, backend {backend}, scale 1 (wire = emulated), {time.monotonic() - t0:.0f} s{' (quick)' if q else ''}")
    for col in ("target", "configured", "measured", "criterion", "ok"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["target"], r["configured"], r["measured"], r["criterion"],
                  "-" if r["ok"] is None else ("[green]yes[/]" if r["ok"] else "[red]MISSED[/]"))
    con.print(t)
    if args.json:
        write_json(args.json, {"backend": backend, "quick": q, "rows": rows}, indent=1)
    missed = [r for r in rows if r["ok"] is False]
    if missed:
        con.print(f"[red]{len(missed)} target(s) missed[/]")
    return 1 if missed else 0


if __name__ == "__main__":
    from testbed.cli import guarded

    sys.exit(guarded(Path(__file__).name, main))
