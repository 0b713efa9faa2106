"""The case study across a WAN dip: PrfaaS vs a fixed threshold on the 1T hybrid, and the dense wall.

Three real runs (root, namespaces, workers and router in the hosts; profile compute):
  1. `case-study` with policy `prfaas`,
  2. `case-study` with policy `fixed-threshold` (same workload, WAN, dip, cross traffic),
  3. `case-study-dense` with policy `prfaas`.
Definitions (docs/serving.md, "Benchmark: the case study across the dip"):
  short request = input_len <= the scenario's base threshold t_base (PD-P under both policies);
  offloaded = routed to PrfaaS; windows by arrival: pre-dip = [workload start + 10 s warm-up, dip start),
  dip = [dip start, dip end); transfer time = transfer end - prefill end (the part of the KV transfer
  that prefill does not hide).
Targets (issues 4 and 11), each printed with its numbers:
  - prfaas raises t within 2 s of the dip's start;
  - prfaas beats the fixed threshold: P90 TTFT of the requests arriving in the dip (the same arrivals
    under both policies: same workload seed) <= fixed-threshold's;
  - no request fails in any run;
  - prfaas: short requests' P90 TTFT in the dip <= 1.5x pre-dip;
  - fixed-threshold degrades: offloaded requests' P90 TTFT in the dip >= 1.5x pre-dip (and the
    transfer times and WAN backlog that cause it are printed beside prfaas's);
  - dense: KV egress demand at the base t above the capacity left for KV (line minus cross traffic)
    over the pre-dip and dip windows (pre-dip alone it is at ~1x, the hybrid's at ~0.1x), and KV
    delivery times (arrival -> transfer end) growing: median in the dip >= 2x the median of the
    first 10 s (empty queues). With bounded send buffers the wall backs up into the
    PrfaaS queues, so the part of the transfer after prefill grows less than the wait for a PrfaaS
    instance that can send.

`--quick`: 80 s of traffic, the dip at 30 s for 30 s (as long as the full run's), 256 output tokens (about 2.5 minutes per run).
Run as root: `python benchmarks/case_study.py [--quick] [--out DIR] [--only KEY,...]`; exits 1 if a
target is missed. `--measure DIR` re-reads the run directories of an earlier invocation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from analysis.metrics import egress_series_bps, offloaded_mask, ttft_s  # noqa: E402
from testbed.rundir import REQUESTS_FILE, SCENARIO_FILE, load_run_dir  # noqa: E402
from testbed.scale import Scale  # noqa: E402
from testbed.sections import load_scenario  # noqa: E402
from testbed.validation import comma_list, path_option  # noqa: E402

RAISE_WITHIN_S = 2.0
SHORT_P90_RATIO = 1.5
FIXED_DEGRADES_RATIO = 1.5
WALL_DEMAND_FRACTION = 1.0
WALL_TRANSFER_GROWTH = 2.0
PRFAAS_OVER_FIXED_P90 = 1.0  # P90 TTFT of the dip's arrivals (same arrivals under both policies)
MAX_FAILED = 0  # requests that did not complete, in any run
WARMUP_S = 10.0  # arrivals in the first seconds see empty queues: not "pre-dip" steady state
QUICK = ["duration=80s", "wan.schedule=[{at: 30s, rate: 20Gbps, for: 30s, direction: prfaas_to_pd}]", "workload.output=256"]
RUNS = {
    "hybrid-prfaas": ("case-study", ["policy.name=prfaas"]),
    "hybrid-fixed": ("case-study", ["policy.name=fixed-threshold"]),
    "dense-prfaas": ("case-study-dense", ["policy.name=prfaas"]),
}


def p90(x: pd.Series) -> float:
    x = x.dropna()
    return float(np.percentile(x, 90)) if len(x) else float("nan")


def med(x: pd.Series) -> float:
    x = x.dropna()
    return float(np.median(x)) if len(x) else float("nan")


def ratio(a: float, b: float) -> float:
    return a / b if b and np.isfinite(b) and b > 0 else float("inf")


def measure(run: Path) -> dict[str, Any]:
    """Every figure the checks and the table use, from one run directory."""
    data = load_run_dir(run, require_summary=False)
    req, sched, link = data.requests, data.scheduler, data.link
    sc = load_scenario(str(run / SCENARIO_FILE))
    scale = Scale(float(sc.scale))
    start = float(data.environment.workload_start_s or 0.0)
    ev = next(e for e in sc.wan.schedule if any(k == "rate_bps" for k, _ in e.changes))
    dip0, dip1 = start + ev.at_s, start + ev.at_s + float(ev.for_s or 0.0)
    dip_rate = float(dict(ev.changes)["rate_bps"])
    cap = sc.wan.prfaas_to_pd.rate_bps
    cross = sum(float(f.rate_bps or 0.0) for f in sc.section("cross_traffic").flows if f.src.startswith("prfaas")) \
        if "cross_traffic" in sc.raw else 0.0  # configured (offered) rate of the cross traffic towards PD
    base_t = sc.section("policy").threshold_tokens

    ok = req[req["status"] == "ok"].copy()
    ok["ttft"] = ttft_s(ok)
    ok["transfer"] = ok["transfer_end_s"] - ok["prefill_end_s"]
    pre = ok[(ok["arrival_s"] >= start + WARMUP_S) & (ok["arrival_s"] < dip0)]
    dip = ok[(ok["arrival_s"] >= dip0) & (ok["arrival_s"] < dip1)]
    short = lambda d: d[d["input_len"] <= base_t]  # noqa: E731
    off = lambda d: d[offloaded_mask(d)]  # noqa: E731

    th = sched[sched["kind"] == "threshold"]
    raises = th[(th["t_s"] >= dip0) & (th["threshold"] > th["old_threshold"])] if "old_threshold" in th else th.iloc[:0]
    ctl = sched[sched["kind"] == "control"]
    t_max_dip = float(ctl[(ctl["t_s"] >= dip0) & (ctl["t_s"] < dip1)]["threshold"].max()) if len(ctl) else float(base_t)

    w = link[link["direction"] == "prfaas_to_pd"]
    backlog = lambda a, b: w[(w["t_s"] >= a) & (w["t_s"] < b)]["backlog_bytes"].astype(float).pipe(scale.emulated_bytes)  # noqa: E731
    egress = egress_series_bps(link, scale)
    pre_egress = egress[(egress.index >= start + WARMUP_S) & (egress.index < dip0)] if egress is not None else pd.Series([], dtype=float)

    # KV demand at the base threshold: the KV bytes (emulated) of the arrivals whose uncached length
    # exceeds t_base (offloaded at t_base, whatever the policy did), per second of the window;
    # capacity left for KV: the line's rate minus the configured cross traffic
    allr = req.assign(kv_em=scale.emulated_bytes(req["kv_bytes"].fillna(0).astype(float)))
    allr = allr[allr["uncached_len"].fillna(allr["input_len"]) > base_t]
    demand_gbps = lambda a, b: float(allr[(allr["arrival_s"] >= a) & (allr["arrival_s"] < b)]["kv_em"].sum()) * 8 / (b - a) / 1e9  # noqa: E731
    offs = off(ok).sort_values("arrival_s")
    half = len(offs) // 2
    halves = lambda col: (float(np.median(offs[col].iloc[:half])), float(np.median(offs[col].iloc[half:]))) if half else (float("nan"),) * 2  # noqa: E731
    deliv = off(ok).assign(d=lambda x: x["transfer_end_s"] - x["arrival_s"])
    deliv_in = lambda a, b: med(deliv[(deliv["arrival_s"] >= a) & (deliv["arrival_s"] < b)]["d"])  # noqa: E731
    return {
        "policy": sc.section("policy").name, "model": sc.section("model").name, "scale": scale.factor,
        "requests": len(req), "failed": int((req["status"] != "ok").sum()),
        "base_t": base_t, "t_max_dip": t_max_dip,
        "raise_after_dip_s": float(raises["t_s"].min() - dip0) if len(raises) else float("inf"),
        "n_short_pre": len(short(pre)), "n_short_dip": len(short(dip)),
        "all_p90_pre_s": p90(pre["ttft"]), "all_p90_dip_s": p90(dip["ttft"]),
        "short_p90_pre_s": p90(short(pre)["ttft"]), "short_p90_dip_s": p90(short(dip)["ttft"]),
        "off_p90_pre_s": p90(off(pre)["ttft"]), "off_p90_dip_s": p90(off(dip)["ttft"]),
        "off_share_pre": len(off(pre)) / max(len(pre), 1), "off_share_dip": len(off(dip)) / max(len(dip), 1),
        "transfer_med_pre_s": med(off(pre)["transfer"]), "transfer_med_dip_s": med(off(dip)["transfer"]),
        "transfer_p90_pre_s": p90(off(pre)["transfer"]), "transfer_p90_dip_s": p90(off(dip)["transfer"]),
        "backlog_mean_pre_mb": float(backlog(start + WARMUP_S, dip0).mean() / 1e6),
        "backlog_max_dip_mb": float(backlog(dip0, dip1).max() / 1e6), "backlog_mean_dip_mb": float(backlog(dip0, dip1).mean() / 1e6),
        "egress_p99_pre_fraction": float(np.percentile(pre_egress, 99)) / cap if len(pre_egress) else float("nan"),
        "demand_pre_gbps": demand_gbps(start + WARMUP_S, dip0), "demand_dip_gbps": demand_gbps(dip0, dip1),
        "kv_capacity_pre_gbps": (cap - cross) / 1e9, "kv_capacity_dip_gbps": max(dip_rate - cross, 0.0) / 1e9,
        "demand_run_gbps": demand_gbps(start + WARMUP_S, dip1),
        "kv_capacity_run_gbps": ((cap - cross) * (dip0 - start - WARMUP_S) + max(dip_rate - cross, 0.0) * (dip1 - dip0)) / (dip1 - start - WARMUP_S) / 1e9,
        "transfer_med_first_s": halves("transfer")[0], "transfer_med_second_s": halves("transfer")[1],
        "delivered_med_start_s": deliv_in(start, start + WARMUP_S), "delivered_med_pre_s": deliv_in(start + WARMUP_S, dip0),
        "delivered_med_dip_s": deliv_in(dip0, dip1),
    }


def report(results: dict[str, dict[str, Any]], title: str) -> bool:
    """Print the side-by-side table and the checks; True when every target holds."""
    con = Console(width=140)
    h, f = results.get("hybrid-prfaas"), results.get("hybrid-fixed")
    side = Table(title=f"Across the dip (pre-dip -> dip, arrivals by window) -- {title}")
    side.add_column("figure")
    hybrid = [(k, r) for k, r in (("prfaas", h), ("fixed-threshold", f)) if r]
    for k, _ in hybrid:
        side.add_column(k)
    rows = [
        ("first raise of t after the dip starts", lambda r: f"{r['raise_after_dip_s']:.2f} s" if np.isfinite(r["raise_after_dip_s"]) else "none"),
        ("t: base -> highest in the dip", lambda r: f"{r['base_t']:.0f} -> {r['t_max_dip']:.0f}"),
        ("short (input <= base t) P90 TTFT", lambda r: f"{r['short_p90_pre_s']:.2f} -> {r['short_p90_dip_s']:.2f} s "
         f"({ratio(r['short_p90_dip_s'], r['short_p90_pre_s']):.2f}x; n={r['n_short_pre']}/{r['n_short_dip']})"),
        ("all requests P90 TTFT", lambda r: f"{r['all_p90_pre_s']:.2f} -> {r['all_p90_dip_s']:.2f} s ({ratio(r['all_p90_dip_s'], r['all_p90_pre_s']):.2f}x)"),
        ("offloaded P90 TTFT", lambda r: f"{r['off_p90_pre_s']:.2f} -> {r['off_p90_dip_s']:.2f} s ({ratio(r['off_p90_dip_s'], r['off_p90_pre_s']):.2f}x)"),
        ("offloaded share of arrivals", lambda r: f"{r['off_share_pre']:.0%} -> {r['off_share_dip']:.0%}"),
        ("transfer time median (after prefill)", lambda r: f"{r['transfer_med_pre_s']:.2f} -> {r['transfer_med_dip_s']:.2f} s "
         f"({ratio(r['transfer_med_dip_s'], r['transfer_med_pre_s']):.1f}x)"),
        ("transfer time P90", lambda r: f"{r['transfer_p90_pre_s']:.2f} -> {r['transfer_p90_dip_s']:.2f} s"),
        ("WAN egress backlog (emulated)", lambda r: f"mean {r['backlog_mean_pre_mb']:.0f} MB -> mean {r['backlog_mean_dip_mb']:.0f}, max {r['backlog_max_dip_mb']:.0f} MB"),
        ("KV demand at base t / capacity left for KV", lambda r: f"{r['demand_pre_gbps']:.1f} / {r['kv_capacity_pre_gbps']:.0f} -> "
         f"{r['demand_dip_gbps']:.1f} / {r['kv_capacity_dip_gbps']:.0f} Gbps"),
        ("failed requests", lambda r: f"{r['failed']} of {r['requests']}"),
    ]
    for name, fmt in rows:
        side.add_row(name, *[fmt(r) for _, r in hybrid])
    if h and f:
        side.add_row("short P90 TTFT in the dip, prfaas / fixed-threshold",
                     f"{ratio(h['short_p90_dip_s'], f['short_p90_dip_s']):.2f}x (what the raise costs PD-P)", "")
    if hybrid:
        con.print(side)
    d = results.get("dense-prfaas")
    if d:
        dense = Table(title="Dense counterpart (MiniMax-M2.5 geometry), prfaas policy")
        dense.add_column("figure")
        dense.add_column("measured")
        dense.add_row("KV demand at base t, pre-dip / capacity left for KV (line - cross traffic)",
                      f"{d['demand_pre_gbps']:.1f} / {d['kv_capacity_pre_gbps']:.0f} Gbps ({ratio(d['demand_pre_gbps'], d['kv_capacity_pre_gbps']):.2f}x)")
        dense.add_row("... in the dip", f"{d['demand_dip_gbps']:.1f} / {d['kv_capacity_dip_gbps']:.0f} Gbps")
        dense.add_row("... over both windows (capacity time-averaged)", f"{d['demand_run_gbps']:.1f} / {d['kv_capacity_run_gbps']:.1f} Gbps "
                      f"({ratio(d['demand_run_gbps'], d['kv_capacity_run_gbps']):.2f}x)")
        dense.add_row("p99 egress before the dip / line", f"{d['egress_p99_pre_fraction']:.2f}")
        dense.add_row("transfer time (after prefill) median, 1st -> 2nd half of the offloads",
                      f"{d['transfer_med_first_s']:.2f} -> {d['transfer_med_second_s']:.2f} s "
                      f"({ratio(d['transfer_med_second_s'], d['transfer_med_first_s']):.1f}x)")
        dense.add_row("KV delivery time (arrival -> transfer end) median: first 10 s -> pre-dip -> dip",
                      f"{d['delivered_med_start_s']:.2f} -> {d['delivered_med_pre_s']:.2f} -> {d['delivered_med_dip_s']:.2f} s "
                      f"({ratio(d['delivered_med_dip_s'], d['delivered_med_start_s']):.1f}x)")
        dense.add_row("t: base -> highest in the dip", f"{d['base_t']:.0f} -> {d['t_max_dip']:.0f}")
        dense.add_row("failed requests", f"{d['failed']} of {d['requests']}")
        con.print(dense)

    checks = []
    if h:
        checks += [
            ("prfaas raises t after the dip starts", f"{h['raise_after_dip_s']:.2f} s", f"<= {RAISE_WITHIN_S} s", h["raise_after_dip_s"] <= RAISE_WITHIN_S),
            ("prfaas: short P90 TTFT dip / pre-dip", f"{ratio(h['short_p90_dip_s'], h['short_p90_pre_s']):.2f}x", f"<= {SHORT_P90_RATIO}x",
             ratio(h["short_p90_dip_s"], h["short_p90_pre_s"]) <= SHORT_P90_RATIO),
        ]
    if f:
        fr = ratio(f["off_p90_dip_s"], f["off_p90_pre_s"])
        checks.append(("fixed-threshold degrades: offloaded P90 TTFT dip / pre-dip", f"{fr:.2f}x", f">= {FIXED_DEGRADES_RATIO}x", fr >= FIXED_DEGRADES_RATIO))
    if h and f:
        pf = ratio(h["all_p90_dip_s"], f["all_p90_dip_s"])
        checks.append(("prfaas vs fixed-threshold: P90 TTFT of the dip's arrivals", f"{pf:.2f}x ({h['all_p90_dip_s']:.2f} / {f['all_p90_dip_s']:.2f} s)",
                       f"<= {PRFAAS_OVER_FIXED_P90}x", pf <= PRFAAS_OVER_FIXED_P90))
    if d:
        g = ratio(d["delivered_med_dip_s"], d["delivered_med_start_s"])
        checks += [
            ("dense: KV demand at base t / capacity left for KV (pre-dip + dip)", f"{ratio(d['demand_run_gbps'], d['kv_capacity_run_gbps']):.2f}",
             f">= {WALL_DEMAND_FRACTION}", ratio(d["demand_run_gbps"], d["kv_capacity_run_gbps"]) >= WALL_DEMAND_FRACTION),
            ("dense: KV delivery time, dip / first 10 s (median)", f"{g:.1f}x", f">= {WALL_TRANSFER_GROWTH}x", g >= WALL_TRANSFER_GROWTH),
        ]
    for key, r in results.items():
        checks.append((f"{key}: failed requests", f"{r['failed']} of {r['requests']}", f"<= {MAX_FAILED}", r["failed"] <= MAX_FAILED))
    table = Table(title=f"Targets -- {title}")
    for col in ("check", "measured", "target", "ok"):
        table.add_column(col)
    for name, got, want, passed in checks:
        table.add_row(name, got, want, "yes" if passed else "NO")
    con.print(table)
    return all(c[3] for c in checks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="80 s of traffic, a 30 s dip at 30 s, 256 output tokens")
    ap.add_argument("--out", type=path_option, metavar="DIR", default=f"runs/case-study-bench-{time.strftime('%Y%m%d-%H%M%S')}")
    ap.add_argument("--only", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    ap.add_argument("--measure", type=path_option, metavar="DIR", help="only measure the run directories under DIR (no new runs)")
    args = ap.parse_args()
    keys = comma_list(args.only, "--only", ",".join(RUNS))
    bad = [k for k in keys if k not in RUNS]
    if bad:
        print(f"case_study: error: --only: unknown {bad}; choose from {list(RUNS)}", file=sys.stderr)
        return 2
    if args.measure:
        out = Path(args.measure)
        keys = [k for k in keys if (out / k / REQUESTS_FILE).exists()]
    else:
        from experiments.engine import check_run
        from experiments.runs import run_once

        out = Path(args.out)
        quick = QUICK if args.quick else []
        scenarios = {k: check_run(RUNS[k][0], quick + RUNS[k][1]) for k in keys}  # all checked first, as prfaas run checks
        for key, sc in scenarios.items():
            print(f"== {key}", flush=True)
            run_once(sc, out / key, progress=sys.stdout.isatty())
    results = {k: measure(out / k) for k in keys}
    (out / "case_study.json").write_text(json.dumps(results, indent=1))
    ok = report(results, f"{'re-measured' if args.measure else 'quick' if args.quick else 'full'} runs in {out}; profile compute")
    return 0 if ok else 1


if __name__ == "__main__":
    from testbed.cli import guarded

    sys.exit(guarded(Path(__file__).name, main))
