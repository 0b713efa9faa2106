"""Probe benchmark: what the router's active probe reads on a steady WAN shared with inelastic neighbours.

    sudo python benchmarks/probe_bench.py [--quick] [--scenario val-dip] [--set K=V ...] [--probes 30] [--size-at 0.5,1,2]
                                          [--stop size,filled] [--json PATH]

Brings up the scenario's network with its WAN events taken out (`wan.schedule=[]`), starts its cross
traffic (val-dip: 16 Gbps of UDP neighbours on a 100 Gbps line, scale 50), runs a KV receiver on `pd-d0`
and probes from `prfaas-p0` as the router does (`KVSender.probe` over 4 connections: two one-byte pings,
then a burst of 5 bandwidth-delay products at the rate the neighbours leave), one probe a second.
`--size-at` counts the 5 BDPs at other multiples of the rate left, the sizes taken in turn probe by probe
(`--probes` of each): the router sizes its probe at twice its estimate (`probe_headroom`), and a probe
sized below the rate left reads about the rate it was sized for, not more (a slow start that has not
reached the path's rate when the burst ends), which is why. `--stop` takes the probe's ends in turn too:
`size` sends every byte (the router's probe until 2026-12-04), `filled` ends it once it has filled the
path (`KVSender.probe(stop=FillStop)`, the estimator's defaults: a standing queue of 2 ms and 40% of the
unloaded RTT, 3 x rate x RTT delivered; `probe_until_filled`). `--pace` takes pacing rates in turn too, each a
multiple of the rate the probe is sized for (0: unpaced; a paced probe goes over connections of its own,
capped with `KVSender.pace`, as the router's do since 2026-12-06: `probe_paced`), and `--cc` sets the probe
connections' congestion control (default: the namespace's). Every probe is also judged as the estimator
judges it (`judged filled`: a standing queue at its end above its pings' RTT, and 3 x rate x that RTT
delivered): below the rate left, a probe judged filled is a false dip. `--set wan.rate=20Gbps --size-at 25` probes a
line in a 5x dip with the probe the router sizes before it (5 BDPs at the nominal 100 Gbps). Each probe
reports two readings of the same burst (docs/router.md, "An active probe"):

- `rate_bps`, the probe's rate: the fastest growth of the bytes *delivered* (acknowledged, plus the
  segments SACKed beyond the cumulative ACK) over two unloaded RTTs;
- `acked_rate_bps`, the same rule over the cumulatively acknowledged bytes alone (the rate until
  2026-12-04): when the burst's slow start overruns the queue, a repaired loss releases a window of
  SACKed bytes at once and this reading can exceed the line itself.

Printed side by side, as ratios to the rate left to KV (the line less the neighbours' configured rate,
the ground truth the runs' estimator error is judged against): median, P10, P90, the largest, and how
many probes read more than the line, per size and end, and each end's median seconds and bytes. Target,
for every size at or above the rate left and every end: the
probe's median within +-10% of what is left, and no probe of any size above the line rate (exit status 1
otherwise); a size below it is reported, not judged. Needs root (namespaces, qdiscs).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402

from testbed.console import wide_console  # noqa: E402
from testbed.validation import comma_list, output_file_option  # noqa: E402

KV_PORT = 9000
PROBE_BDP = 5  # the router's probe size (policy estimator `probe_bdp`)
MEDIAN_TOL = 0.10  # the probe's median within this of the rate left
STOPS = ("size", "filled")  # a probe's end: every byte sent, or once it has filled the path
console = wide_console()


def run_sender(host: str, probes: int, plan: list[dict], gap_s: float, cc: str | None) -> int:
    """Probe `probes` times, cycling through `plan` (each: wire `bytes`, `stop`, wire `pace_bps`, 0 for none),
    one JSON line per probe on stdout. Paced probes go over connections of their own, as the router's do."""
    from testbed.kv.transport import KVSender
    from testbed.serving.policy.estimator import EstimatorSpec

    fill = EstimatorSpec().fill_stop()  # the router's, with the estimator's defaults
    with KVSender(host, KV_PORT, connections=4, congestion_control=cc) as tx, \
            KVSender(host, KV_PORT, connections=4, congestion_control=cc) as paced:
        for i in range(probes):
            p = plan[i % len(plan)]
            sender = paced if p["pace_bps"] > 0 else tx
            if p["pace_bps"] > 0:
                sender.pace(p["pace_bps"])
            ans = sender.probe(p["bytes"], pings=2, timeout_s=5.0, stop=fill if p["stop"] == "filled" else None)
            print(json.dumps({"variant": i % len(plan), **{k: ans[k] for k in ("ok", "bytes", "seconds", "rate_bps", "acked_rate_bps",
                                                                   "retransmits", "idle_rtt_ms", "rtt_ms", "stopped")}}), flush=True)
            time.sleep(gap_s)
    return 0


def judged_filled(row: dict) -> bool:
    """Whether the estimator (its defaults) takes this probe as one that filled the path (`FillStop.filled`, as
    `BandwidthEstimator.probe` judges it), so that a reading below the estimate lowers it: below the rate left, a
    false dip. The probe's pings' RTT stands for both the estimator's floor and the unloaded RTT (on a line
    whose RTT the estimator has seen at rest, its floor is that RTT)."""
    from testbed.serving.policy.estimator import EstimatorSpec

    idle = row.get("idle_rtt_ms") or 0.0
    return row["rate_bps"] > 0 and EstimatorSpec().fill_rule().filled(row["bytes"], row["rate_bps"], row["rtt_ms"], idle, idle)


def summarize(values_bps: list[float], left_bps: float, line_bps: float) -> dict[str, float]:
    """Ratios of the readings to the rate left: median, P10, P90, max; and how many exceed the line."""
    r = np.asarray(values_bps, float) / left_bps
    return {"median": float(np.median(r)), "p10": float(np.percentile(r, 10)), "p90": float(np.percentile(r, 90)),
            "max": float(r.max()), "above_line": int((np.asarray(values_bps) > line_bps).sum()), "n": int(r.size)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", default="val-dip", help="a scenario with a WAN line and inelastic cross traffic")
    ap.add_argument("--probes", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="10 probes of each size")
    ap.add_argument("--size-at", default="1", help="comma-separated multiples of the rate left at which a probe's "
                    "5 BDPs are counted, taken in turn (default 1)")
    ap.add_argument("--stop", default="size", help="comma-separated ends of a probe, taken in turn: size (every "
                    "byte), filled (once it has filled the path)")
    ap.add_argument("--pace", default="0", help="comma-separated pacing rates, taken in turn, each a multiple of the "
                    "rate the probe is sized for (0: unpaced, the default; the router paces at probe_headroom x its estimate, "
                    "its sizing rate unless that was capped at the nominal rate)")
    ap.add_argument("--cc", default=None, help="the probe connections' congestion control (default: the namespace's)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V",
                    help="a scenario override, as for prfaas run (e.g. wan.rate=20Gbps)")
    ap.add_argument("--gap", type=float, default=1.0, help="seconds between probes")
    ap.add_argument("--json", type=output_file_option, help="write the per-probe readings and the summary here")
    ap.add_argument("--role", default="driver", help=argparse.SUPPRESS)
    ap.add_argument("--host", help=argparse.SUPPRESS)
    ap.add_argument("--plan", default="[]", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.role == "sender":
        return run_sender(a.host, a.probes, json.loads(a.plan), a.gap, a.cc)
    if a.quick:
        a.probes = 10
    try:
        size_at = [float(v) for v in comma_list(a.size_at, "--size-at", "0.5,1,2")]
    except ValueError:
        size_at = []
    if not size_at or any(not 0 < v <= 50 for v in size_at) or len(set(size_at)) != len(size_at):
        console.print(f"--size-at {a.size_at!r}: distinct multiples of the rate left in (0, 50], e.g. 0.5,1,2")
        return 2
    stops = comma_list(a.stop, "--stop", "size,filled")
    if not stops or any(v not in STOPS for v in stops) or len(set(stops)) != len(stops):
        console.print(f"--stop {a.stop!r}: distinct ends of a probe from {', '.join(STOPS)}, e.g. size,filled")
        return 2
    try:
        paces = [float(v) for v in comma_list(a.pace, "--pace", "0,1,2")]
    except ValueError:
        paces = []
    if not paces or any(not 0 <= v <= 50 for v in paces) or len(set(paces)) != len(paces):
        console.print(f"--pace {a.pace!r}: distinct multiples in [0, 50] of the rate a probe is sized for (0: unpaced), e.g. 0,1,2")
        return 2

    import os

    if os.geteuid() != 0:
        console.print("probe_bench needs root (network namespaces, qdiscs): run it with sudo")
        return 2
    from testbed.net.emulation import Network
    from testbed.sections import load_scenario
    from traffic.cross import CrossTraffic

    from testbed.errors import UserError

    try:
        sc = load_scenario(a.scenario, ["wan.schedule=[]", *a.overrides])
    except UserError as e:
        console.print(f"probe_bench: {e}")
        return 2
    cross_spec = sc.section("cross_traffic")
    line_bps = float(sc.wan.prfaas_to_pd.rate_bps)
    flows = cross_spec.flows if cross_spec is not None else ()
    steady = [f for f in flows if f.protocol == "udp" and f.pattern == "constant" and f.start_s == 0 and f.stop_s is None]
    if len(steady) != len(flows):
        console.print(f"{a.scenario}: probe_bench needs cross traffic of steady UDP flows only (the rate they leave is then known)")
        return 2
    neighbours_bps = sum(f.rate_bps or 0.0 for f in steady if f.src.startswith("prfaas-"))
    left_bps = line_bps - neighbours_bps
    rows: list[dict] = []
    with Network(sc) as net:
        scale = net.scale
        rtt_s = sc.wan.rtt_s
        sizes = [int(scale.wire_bytes(PROBE_BDP * m * left_bps / 8 * rtt_s)) for m in size_at]
        variants = [{"size_at": m, "stop": stop, "pace": f} for stop in stops for f in paces for m in size_at]
        plan = [{"bytes": sizes[size_at.index(v["size_at"])], "stop": v["stop"],
                 "pace_bps": scale.wire_bps(v["pace"] * v["size_at"] * left_bps)} for v in variants]
        cross = CrossTraffic(cross_spec.scaled(scale), net.popen, net.host_ip) if cross_spec is not None else None
        me = [sys.executable, str(Path(__file__).resolve())]
        rx = net.popen("pd-d0", [sys.executable, str(Path(__file__).resolve().parent / "transport_bench.py"), "--role", "receiver",
                                 "--port", str(KV_PORT)], stdout=subprocess.PIPE, text=True)
        tx = None
        try:
            assert rx.stdout is not None and rx.stdout.readline().strip() == "ready", "KV receiver did not start"
            if cross is not None:
                cross.start()
                time.sleep(2.0)  # the neighbours' first second
            total = a.probes * len(variants)
            tx = net.popen("prfaas-p0", me + ["--role", "sender", "--host", net.host_ip("pd-d0"), "--probes", str(total),
                                              "--plan", json.dumps(plan), "--gap", str(a.gap)] + (["--cc", a.cc] if a.cc else []),
                           stdout=subprocess.PIPE, text=True)
            assert tx.stdout is not None
            with Progress(console=console, transient=True) as progress:
                task = progress.add_task(f"probes on {a.scenario}'s steady WAN", total=total)
                for line in tx.stdout:
                    row = json.loads(line)
                    rows.append({**row, **variants[row["variant"]], "judged_filled": judged_filled(row),
                                 "rate_bps": scale.emulated_bps(row["rate_bps"]), "acked_rate_bps": scale.emulated_bps(row["acked_rate_bps"])})
                    progress.advance(task)
            tx.wait(timeout=30 + 5 * total)
        finally:
            if tx is not None and tx.poll() is None:
                tx.kill()
            if cross is not None:
                cross.stop()
            rx.send_signal(signal.SIGTERM)
            try:
                rx.wait(timeout=10)
            except subprocess.TimeoutExpired:
                rx.kill()
    ok = [r for r in rows if r["ok"] and r["rate_bps"] > 0]
    if not ok:
        console.print(f"no probe measured a rate ({len(rows)} answered)")
        return 1
    res = {}
    for v in variants:
        mine = [r for r in ok if (r["size_at"], r["stop"], r["pace"]) == (v["size_at"], v["stop"], v["pace"])]
        if mine:
            res[f"{v['size_at']:g}/{v['stop']}/{v['pace']:g}"] = {
                **v, "delivered": summarize([r["rate_bps"] for r in mine], left_bps, line_bps),
                "acked": summarize([r["acked_rate_bps"] for r in mine], left_bps, line_bps),
                "median_seconds": float(np.median([r["seconds"] for r in mine])),
                "median_emulated_bytes": float(np.median([r["bytes"] for r in mine])) * float(scale.factor),
                "stopped": sum(bool(r.get("stopped")) for r in mine), "judged_filled": sum(r["judged_filled"] for r in mine)}
    t = Table(title=f"probes on {a.scenario}: line {line_bps / 1e9:g} Gbps, neighbours {neighbours_bps / 1e9:g} Gbps, "
                    f"left {left_bps / 1e9:g} Gbps; readings / left" + (f"; {a.cc}" if a.cc else ""))
    for c in ("size (5 BDPs at)", "end", "paced at", "emulated MB sized / sent", "median s", "reading", "median", "P10", "P90",
              "max", "above the line", "judged filled"):
        t.add_column(c)
    for r in res.values():
        mb = sizes[size_at.index(r["size_at"])] * float(scale.factor) / 1e6
        end = f"{r['stop']} ({r['stopped']} ended early)" if r["stop"] == "filled" else r["stop"]
        pace = f"{r['pace'] * r['size_at']:g} x left" if r["pace"] > 0 else "-"
        for name, s in (("delivered bytes (the probe's rate)", r["delivered"]), ("acknowledged bytes (until 2026-12-04)", r["acked"])):
            t.add_row(f"{r['size_at']:g} x left", end, pace, f"{mb:.0f} / {r['median_emulated_bytes'] / 1e6:.0f}",
                      f"{r['median_seconds']:.3f}", name, f"{s['median']:.3f}", f"{s['p10']:.3f}", f"{s['p90']:.3f}",
                      f"{s['max']:.3f}", f"{s['above_line']} of {s['n']}", f"{r['judged_filled']} of {s['n']}")
    console.print(t)
    passed = judge([(r["size_at"], r["delivered"]) for r in res.values()])
    console.print(f"target: for sizes at or above the rate left, median within +-{MEDIAN_TOL:.0%} of it; no probe above "
                  f"the line: {'met' if passed else 'NOT met'}")
    if a.json:
        a.json.write_text(json.dumps({"scenario": a.scenario, "line_bps": line_bps, "neighbours_bps": neighbours_bps,
                                      "left_bps": left_bps, "size_at": size_at, "stops": stops, "paces": paces, "cc": a.cc,
                                      "overrides": a.overrides,
                                      "probe_bytes_wire": sizes,
                                      "scale": float(scale.factor), "summary": res,
                                      "probes": rows, "passed": passed}, indent=1))
    return 0 if passed else 1


def judge(delivered: list[tuple[float, dict[str, float]]]) -> bool:
    """The target over the summaries of delivered readings, each with its size (a multiple of the rate
    left): no probe above the line, and for each size at or above the rate left the median within MEDIAN_TOL."""
    return (all(s["above_line"] == 0 for _, s in delivered)
            and all(abs(s["median"] - 1.0) <= MEDIAN_TOL for m, s in delivered if m >= 1))


if __name__ == "__main__":
    from testbed.cli import guarded

    sys.exit(guarded(Path(__file__).name, main))
