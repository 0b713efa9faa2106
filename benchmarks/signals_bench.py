"""Issue 9's benchmark: the PrfaaS law on observed signals across the validation shapes, paired seeds.

Arms (the same scenario, workload and seed; only the policy differs):
  prfaas-observed  policy.name=prfaas, policy.signals=observed (the default: nothing but what the PrfaaS side measures)
  prfaas-oracle    policy.name=prfaas, policy.signals=oracle (told the shaper's rate and the bottleneck's counters)
  fixed-threshold  policy.name=fixed-threshold
  all-local        policy.name=all-local
  fixed-no-event   fixed-threshold with the shape's event taken out (NO_EVENT): the event's own cost. Its
                   long P90 / fixed-threshold's is the ratio a congestion response would reach if it undid
                   the event completely and changed nothing else (reported as "no-event ceiling", not judged)
  oracle-step-Nk   (only when named in --arms) fixed-threshold whose t is N K tokens while the shaper's rate is
                   below the line's (policy oracle-step, oracle only): one raise timed perfectly, reported, not judged
  prfaas-observed-adaptive-kv, fixed-threshold-fp8  (only when named) float8 full-attention KV on the WAN while
                   the law is under pressure, or for every offload (policy.kv_compression): reported, not judged
  prfaas-observed-adaptive-kv-natives-first  (only when named) the first of those with policy.pd_queue=natives-first
Shapes: topologies/val-*.yaml (docs/router.md, "Validation set"; which were used for design is said there).

Per run (`measure`), with the event window = arrivals in [event start, event end) on the schedule clock
(25-50 s in every val-* shape, 50-80 s in case-study) and t_base = the scenario's base threshold:
  long_p90_s   P90 TTFT of requests with input_len > t_base (those fixed-threshold offloads; the same
               requests in every arm, so the ratio is paired request-for-request, not a moving subset)
  short_p90_s  P90 TTFT of requests with input_len <= t_base
  xfer_p90_s   P90 KV transfer time (transfer end - start) of requests offloaded in the window
  slo          fraction of all requests that finished ok with TTFT <= serving.slo.ttft (whole run)
  failed       failed requests (whole run)
  est_mae      the estimator's median relative error in steady periods (summary.json "estimator")
  detect_s     first time after the event's start at which the estimate was below 50% of its value
               just before (dip-like shapes only; None if never)
  fidelity_flags  the run's timing-fidelity flags ("" when none; docs/scale-out.md): shown per run, judged all the same
Requests are timed by the router's stamps, or with --ttft-clock client by the client's (send to first token read,
as vLLM's bench serve times them; the event window then holds the requests the client sent in it).
Ratios (prfaas arm / fixed-threshold, per seed) with a 95% bootstrap CI over seeds of their mean.

Targets (issue 9): long_p90 ratio <= 0.7 with CI upper < 1, xfer_p90 ratio <= 0.7, short_p90 ratio <= 1.3,
no failures, SLO(prfaas) >= SLO(fixed) + 10 pp on the rate drops (DIP_SHAPES) and never below fixed's or
all-local's; estimator median error <= 20%, a 5x dip detected within 2 s (STEP_DIP_SHAPES). Exit 1 if a target is missed.

Run as root: python benchmarks/signals_bench.py [--shapes val-dip,...] [--seeds 1,2,...] [--arms ...]
  [--set KEY=VALUE ...] [--out DIR] [--measure DIR] [--executor local:N] [--ttft-clock router|client]
The runs go through the experiments engine (experiments/engine.py: resumable, any executor); this
script only names the tasks and judges the results.
The full matrix (10 shapes x 5 seeds x 5 arms = 250 runs of ~2 min): the defaults. `--quick`: val-dip,
seeds 1-2, three arms (prfaas-observed, prfaas-oracle, fixed-threshold).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from testbed.rundir import SUMMARY_FILE  # noqa: E402
from testbed.console import wide_console  # noqa: E402
from testbed.errors import UserError  # noqa: E402
from testbed.validation import MAX_SEED, comma_list, path_option, random_seed  # noqa: E402

SHAPES = ("val-dip", "val-staircase", "val-rtt-surge", "val-cross-surge", "val-loss-burst",
          # held out, added after the law's last change (session 25): a slow ramp down and back, a flapping line
          "val-ramp", "val-flap",
          # held out, added in session 30: the dip on a 10 Gbps line, where KV demand exceeds what is left
          "val-thin-line",
          # held out, added in session 31 after that session's law change: a staircase on a 20 Gbps line
          "val-mid-staircase",
          # held out, added in session 43 before any run of it: the dip on a 40 Gbps line
          "val-40g-dip")
# The full-size case study (`--shapes case-study`): the same dip at twice the deployment and rate (there
# the dip binds the PrfaaS prefill queue more than the WAN: docs/router-measurements.md, "Policy comparison on the
# full-size case study"); used for design, not in the default matrix.
EXTRA_SHAPES = ("case-study",)
DIP_SHAPES = ("val-dip", "val-staircase", "val-thin-line", "val-mid-staircase", "val-40g-dip", "case-study")  # a rate drop: judged on SLO attainment against fixed-threshold
STEP_DIP_SHAPES = ("val-dip", "val-thin-line", "val-40g-dip", "case-study")  # one 5x step down: judged on the time to detect it
ARMS = {
    "prfaas-observed": ["policy.name=prfaas", "policy.signals=observed"],
    "prfaas-oracle": ["policy.name=prfaas", "policy.signals=oracle"],
    "fixed-threshold": ["policy.name=fixed-threshold"],
    "all-local": ["policy.name=all-local"],
    "fixed-no-event": ["policy.name=fixed-threshold"],  # + NO_EVENT's overrides for the shape
}
# The clairvoyant single raise (policy `oracle-step`, oracle only): fixed-threshold whose t is T while the
# shaper's rate is below the line's. Swept over T on a rate drop, how far one raise timed perfectly can go
# (docs/router-measurements.md, "How far one raise can go"); reported beside, never judged, not in the default matrix.
STEP_ARMS = {f"oracle-step-{k}k": ["policy.name=oracle-step", "policy.signals=oracle", f"policy.event_threshold={k}K"]
             for k in (24, 28, 32, 40, 48, 64)}
# The same with `policy.pd_queue: natives-first` (PD-P takes what the base threshold keeps local before what a
# raise moved there: docs/router-measurements.md, "Where the dip's excess waits"); reported beside, not in the default matrix.
QUEUE_ARMS = {f"{arm}-natives-first": [*over, "policy.pd_queue=natives-first"]
              for arm, over in (("prfaas-observed", ARMS["prfaas-observed"]), ("oracle-step-32k", STEP_ARMS["oracle-step-32k"]))}
# Float8 KV on the WAN (`policy.kv_compression`: docs/router.md, "Adaptive KV precision"): the law that compresses
# while under pressure, and fixed-threshold that compresses every offload (the cost of the trade taken always);
# reported beside, not in the default matrix.
KV_ARMS = {"prfaas-observed-adaptive-kv": [*ARMS["prfaas-observed"], "policy.kv_compression=adaptive"],
           "fixed-threshold-fp8": [*ARMS["fixed-threshold"], "policy.kv_compression=fp8"]}
# Both: float8 while under pressure, and PD-P serving what the base threshold keeps local first (the raise's cost to
# short requests, which float8 alone leaves: docs/router.md, "Float8 and natives-first together").
KV_ARMS["prfaas-observed-adaptive-kv-natives-first"] = [*KV_ARMS["prfaas-observed-adaptive-kv"], "policy.pd_queue=natives-first"]
DEFAULT_ARMS = tuple(ARMS)
ARMS.update(STEP_ARMS)
ARMS.update(QUEUE_ARMS)
ARMS.update(KV_ARMS)
REPORTED_ARMS = ("prfaas-observed", "prfaas-oracle", "fixed-no-event", *STEP_ARMS, *QUEUE_ARMS, *KV_ARMS)  # compared with fixed-threshold
# What takes each shape's event out: its WAN schedule, or (val-cross-surge) the surging flow, keeping the
# neighbours that run all along.
NO_EVENT = {"val-cross-surge": ["cross_traffic.flows=[{name: vpc-neighbours, protocol: udp, rate: 16Gbps, direction: prfaas_to_pd}]"]}
DEFAULT_NO_EVENT = ["wan.schedule=[]"]
EVENT_S = {"case-study": (50.0, 80.0)}  # on the schedule clock; every val-* shape: DEFAULT_EVENT_S
DEFAULT_EVENT_S = (25.0, 50.0)
TARGETS = {"long_p90": 0.7, "xfer_p90": 0.7, "short_p90": 1.3, "slo_pp": 10.0, "est_mae": 0.20, "detect_s": 2.0}
# The figures compared per seed as ratios, arm / fixed-threshold: (label, measure's key, target)
RATIO_METRICS = (("long P90 TTFT", "long_p90_s", TARGETS["long_p90"]), ("KV transfer P90", "xfer_p90_s", TARGETS["xfer_p90"]),
                 ("short P90 TTFT", "short_p90_s", TARGETS["short_p90"]))


def p90(x: pd.Series) -> float | None:
    x = pd.to_numeric(x, errors="coerce").dropna()
    return float(np.percentile(x, 90)) if len(x) else None


TTFT_CLOCKS = {"router": "arrival_s", "client": "client_arrival_s"}  # whose stamps time a request: its arrival column


def measure(run_dir: Path, ttft_clock: str = "router") -> dict[str, Any]:
    """One run's figures. `ttft_clock`: whose stamps time a request (arrival and first token, and so the event window
    and TTFT): the router's (the default) or the client's, as vLLM's `bench serve` times it; they differ by the
    router's intake, which the run's fidelity figure judges (docs/scale-out.md, "The client and the router's intake")."""
    from analysis.metrics import client_ttft_s, float8_share, ttft_s
    from analysis.rundir import load_run

    run = load_run(run_dir)
    sc = run.scenario
    event = EVENT_S.get(str(sc.get("name")), DEFAULT_EVENT_S)
    from testbed import units

    t_base = float(units.parse_tokens((sc.get("policy") or {}).get("threshold") or "16K"))
    slo = units.parse_duration_s((sc.get("serving") or {}).get("slo", {}).get("ttft", "10s"))
    off = run.schedule_offset_s
    df = run.requests.copy()
    arrival_col = TTFT_CLOCKS[ttft_clock]
    arrival = pd.to_numeric(df[arrival_col], errors="coerce") if arrival_col in df else pd.Series(np.nan, index=df.index)
    df["ttft"] = (ttft_s if ttft_clock == "router" else client_ttft_s)(df)  # aligned on the index: NaN where not known
    ok = df["status"] == "ok"
    win = ok & (arrival >= event[0] + off) & (arrival < event[1] + off)
    long_ = win & (df["input_len"] > t_base)
    short = win & (df["input_len"] <= t_base)
    xfer = pd.to_numeric(df["transfer_end_s"], errors="coerce") - pd.to_numeric(df["transfer_start_s"], errors="coerce")
    est = run.summary.get("estimator") or {}
    return {
        "long_p90_s": p90(df.loc[long_, "ttft"]), "short_p90_s": p90(df.loc[short, "ttft"]),
        "xfer_p90_s": p90(xfer[win & (df["route"] == "prfaas")]),
        "slo": float((ok & (df["ttft"] <= slo)).mean()) if len(df) else None,
        "failed": int((~ok).sum()), "requests": int(len(df)),
        "est_mae": est.get("median_abs_error"), "signals": run.signals,
        "detect_s": detection_s(run.scheduler, event[0] + off),
        "kv_cc": run.summary.get("kv_congestion_control"),  # what the KV connections ran: it moves every figure
        # offloads whose full-attention KV crossed in float8 (policy.kv_compression), whole run and in the window
        "fp8_share": float8_share(df[ok]), "fp8_share_event": float8_share(df[win]),
        # timing fidelity (docs/scale-out.md): a flagged run's figures may be the host's, not the policy's
        "fidelity_flags": str(run.summary.get("fidelity_flags") or ""),
    }


def detection_s(sched: pd.DataFrame, start_s: float) -> float | None:
    """Seconds after `start_s` until the policy's estimate fell below 50% of its last value before it."""
    if "kind" not in sched or "kv_available_bps" not in sched:
        return None
    sig = sched[sched["kind"] == "signals"][["t_s", "kv_available_bps"]].apply(pd.to_numeric, errors="coerce").dropna()
    before = sig[sig["t_s"] < start_s]
    if not len(before):
        return None
    ref = float(before["kv_available_bps"].iloc[-1])
    after = sig[(sig["t_s"] >= start_s) & (sig["kv_available_bps"] < 0.5 * ref)]
    return float(after["t_s"].iloc[0] - start_s) if len(after) else None


def print_runs(rows: list[dict[str, Any]], console: Console) -> None:
    """The per-run table, with each run's timing fidelity; a flagged run's reasons under it. Flagged runs are
    judged all the same (as `prfaas capacity` and `prfaas experiment` do): the reader sees which figures to doubt."""
    t = Table(title="per run")
    for c in ("shape", "arm", "seed", "long P90 s", "short P90 s", "xfer P90 s", "SLO", "failed", "est err", "detect s", "signals",
              "timing"):
        t.add_column(c)
    f = lambda x: "-" if x is None or (isinstance(x, float) and not np.isfinite(x)) else f"{x:.2f}"  # noqa: E731
    for r in rows:
        t.add_row(r["shape"], r["arm"], str(r["seed"]), f(r["long_p90_s"]), f(r["short_p90_s"]), f(r["xfer_p90_s"]), f(r["slo"]),
                  str(r["failed"]), f(r["est_mae"]), f(r["detect_s"]), r["signals"], "FLAGGED" if r.get("fidelity_flags") else "ok")
    console.print(t)
    flagged = [r for r in rows if r.get("fidelity_flags")]
    for r in flagged:
        console.print(f"timing fidelity flagged {r['shape']}/{r['arm']}-s{r['seed']}: {r['fidelity_flags']}")
    if flagged:
        console.print(f"{len(flagged)} of {len(rows)} runs flagged for timing fidelity (docs/scale-out.md); judged all the same")


def bootstrap_ci(x: list[float]) -> tuple[float, float, float]:
    """Mean and 95% bootstrap CI of the mean, one value per seed (`analysis.stats.mean_ci`: scipy, BCa).
    A seed without the figure (None or NaN: no such request in its window) is left out; none left: NaNs; fewer than
    `analysis.stats.MIN_PAIRS` left: the mean and NaN bounds (no interval, so no "hi < 1" either)."""
    from analysis.stats import mean_ci

    kept = [float(v) for v in x if v is not None and np.isfinite(v)]
    if not kept:
        return float("nan"), float("nan"), float("nan")
    m, lo, hi, _ = mean_ci(kept)
    return m, lo, hi


def tasks(shapes: list[str], seeds: list[int], arms: list[str], out: Path, extra: list[str]) -> list:
    """One `RunTask` per (shape, seed, arm): seeds outermost within a shape, so every arm of a seed runs
    before the next seed (a cut-short matrix stays paired), in the given order for odd seeds and reversed for
    even ones, as `prfaas experiment` alternates them (docs/experiments.md, "Run order")."""
    from experiments.executor import RunTask

    def overrides(shape: str, arm: str, seed: int) -> tuple[str, ...]:
        no_event = NO_EVENT.get(shape, DEFAULT_NO_EVENT) if arm == "fixed-no-event" else []
        return tuple(ARMS[arm] + no_event + [f"seed={seed}"] + extra)

    return [RunTask(key=f"{shape}/{arm}-s{seed}", scenario=shape, overrides=overrides(shape, arm, seed),
                    out_dir=out / shape / f"{arm}-s{seed}")
            for shape in shapes for seed in seeds for arm in (arms if seed % 2 else arms[::-1])]


def completed(out: Path) -> list[tuple[str, str, int, Path]]:
    """Every finished run under `out` (shape, arm, seed, directory), whichever invocation made it: an
    invocation with fewer arms or seeds adds to results.json instead of replacing what an earlier one
    measured (which then left the pairs it needs out)."""
    found = []
    for summary in sorted(out.glob(f"*/*-s*/{SUMMARY_FILE}")):
        d = summary.parent
        arm, _, seed = d.name.rpartition("-s")
        if d.parent.name in SHAPES + EXTRA_SHAPES and arm in ARMS and seed.isdigit():
            found.append((d.parent.name, arm, int(seed), d))
    return found


def seed_ratios(arm: pd.DataFrame, fixed: pd.DataFrame, key: str) -> list[float]:
    """`key` of `arm` over fixed-threshold's, per seed both ran (both frames indexed by seed), where both have it."""
    def usable(v: Any) -> bool:
        return v is not None and bool(np.isfinite(v)) and v != 0

    return [arm.at[s, key] / fixed.at[s, key] for s in sorted(set(arm.index) & set(fixed.index))
            if usable(arm.at[s, key]) and usable(fixed.at[s, key])]


def slo_differences(arm: pd.DataFrame, other: pd.DataFrame) -> list[float]:
    """`arm`'s TTFT-SLO attainment less `other`'s, in percentage points, per seed both ran (both frames indexed by seed)."""
    return [100 * (arm.at[s, "slo"] - other.at[s, "slo"]) for s in sorted(set(arm.index) & set(other.index))]


def compare(rows: list[dict[str, Any]], console: Console) -> tuple[bool, int]:
    """(every judged target met, how many targets were judged): only the prfaas-observed arm is judged,
    against fixed-threshold (and all-local) of the same seeds; the oracle and no-event arms are reported
    beside it (fixed-no-event's ratios are the event's cost to fixed-threshold: the ceiling above)."""
    df = pd.DataFrame(rows)
    ok, judged = True, 0
    for shape, g in df.groupby("shape"):
        ccs = sorted({x for x in g["kv_cc"] if isinstance(x, str)}) if "kv_cc" in g else []
        t = Table(title=f"{shape}: prfaas / fixed-threshold per seed, mean and 95% bootstrap CI over seeds"
                        f" (KV over TCP {' + '.join(ccs) or 'not recorded'}"
                        + ("; MIXED: these pairs compare different transports)" if len(ccs) > 1 else ")"))
        for c in ("arm", "metric", "seeds", "ratio mean", "95% CI", "target", "met"):
            t.add_column(c)
        fixed = g[g["arm"] == "fixed-threshold"].set_index("seed")
        local = g[g["arm"] == "all-local"].set_index("seed")
        for arm in REPORTED_ARMS:
            judge = arm == "prfaas-observed"  # the others are reported, not judged
            a = g[g["arm"] == arm].set_index("seed")
            seeds = sorted(set(a.index) & set(fixed.index))
            if not seeds:
                continue
            for metric, key, target in RATIO_METRICS:
                r = seed_ratios(a, fixed, key)
                if not r:
                    continue
                m, lo, hi = bootstrap_ci(r)
                met = m <= target and (key != "long_p90_s" or hi < 1.0)
                ok &= met or not judge
                judged += judge
                t.add_row(arm, metric, str(len(r)), f"{m:.2f}", f"[{lo:.2f}, {hi:.2f}]", f"<= {target}", "yes" if met else "NO")
            d = slo_differences(a, fixed)
            m, lo, hi = bootstrap_ci(d)
            need = TARGETS["slo_pp"] if shape in DIP_SHAPES else 0.0
            met = m >= need
            ok &= met or not judge
            judged += judge
            t.add_row(arm, "SLO - fixed (pp)", str(len(d)), f"{m:+.1f}", f"[{lo:+.1f}, {hi:+.1f}]", f">= {need:+g}", "yes" if met else "NO")
            d = slo_differences(a, local) if arm != "fixed-no-event" else []
            if d:
                m, lo, hi = bootstrap_ci(d)
                ok &= m >= 0 or not judge
                t.add_row(arm, "SLO - all-local (pp)", str(len(d)), f"{m:+.1f}", f"[{lo:+.1f}, {hi:+.1f}]", ">= +0", "yes" if m >= 0 else "NO")
            fails = int(a["failed"].sum())
            ok &= fails == 0 or not judge
            t.add_row(arm, "failed requests", str(len(a)), str(fails), "", "0", "yes" if fails == 0 else "NO")
        obs = g[g["arm"] == "prfaas-observed"]
        if len(obs) and obs["est_mae"].notna().any():
            e = [x for x in obs["est_mae"] if x is not None and np.isfinite(x)]
            m, lo, hi = bootstrap_ci(e)
            ok &= m <= TARGETS["est_mae"]
            judged += 1
            t.add_row("prfaas-observed", "estimator median error", str(len(e)), f"{m:.2f}", f"[{lo:.2f}, {hi:.2f}]", "<= 0.20", "yes" if m <= TARGETS["est_mae"] else "NO")
        if shape in STEP_DIP_SHAPES and len(obs):
            det = [x for x in obs["detect_s"]]
            met = all(x is not None and x <= TARGETS["detect_s"] for x in det)
            ok &= met
            judged += 1
            t.add_row("prfaas-observed", "5x dip detected after (s)", str(len(det)), ", ".join("never" if x is None else f"{x:.2f}" for x in det), "", "<= 2", "yes" if met else "NO")
        console.print(t)
    return ok, judged


def plot_steps(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """Per shape with oracle-step arms, ``steps-<shape>.png``: each arm's mean ratio to fixed-threshold of
    long against short requests' P90 TTFT in the event window (95% bootstrap CIs over seeds), the
    single-raise sweep joined in order of its T, beside the prfaas arms and the issue's target corner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df, written = pd.DataFrame(rows), []
    for shape, g in df.groupby("shape"):
        if not set(g["arm"]) & set(STEP_ARMS):
            continue
        fixed = g[g["arm"] == "fixed-threshold"].set_index("seed")
        fig, ax = plt.subplots(figsize=(6.4, 4.8))
        sweep = []
        for arm in REPORTED_ARMS:
            a = g[g["arm"] == arm].set_index("seed")
            pts = []
            for key in ("short_p90_s", "long_p90_s"):
                r = seed_ratios(a, fixed, key)
                pts.append(bootstrap_ci(r) if r else None)
            if None in pts:
                continue
            (sx, sl, sh), (lx, ll, lh) = pts
            ax.errorbar(sx, lx, xerr=[[sx - sl], [sh - sx]], yerr=[[lx - ll], [lh - lx]], fmt="o" if arm in STEP_ARMS else "s",
                        capsize=3, label=f"{arm} (n={len(a)})")
            if arm in STEP_ARMS:
                sweep.append((sx, lx))
        if len(sweep) > 1:
            ax.plot(*zip(*sweep), color="grey", lw=0.8, zorder=0)
        ax.plot(1.0, 1.0, "k*", ms=10, label="fixed-threshold (1, 1)")
        ax.axhline(TARGETS["long_p90"], color="red", ls="--", lw=0.8, label="issue 9's targets (long 0.7, short 1.3)")
        ax.axvline(TARGETS["short_p90"], color="red", ls="--", lw=0.8)
        ax.axhline(1.0, color="black", lw=0.5)
        ax.axvline(1.0, color="black", lw=0.5)
        ax.set(xlabel="short requests' P90 TTFT / fixed-threshold's", ylabel="long requests' P90 TTFT / fixed-threshold's",
               title=f"{shape}: one raise timed by the oracle, swept over t (event window)")
        ax.legend(fontsize=7)
        path = out / f"steps-{shape}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--seeds", default="1,2,3,4,5")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"of {', '.join(ARMS)}")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override every run's scenario")
    ap.add_argument("--out", type=path_option, metavar="DIR", default="runs/signals-bench")
    ap.add_argument("--measure", type=path_option, metavar="DIR", help="only re-read the run directories under DIR")
    ap.add_argument("--executor", default="local", help="experiments executor: local, local:N, ray:ADDR (docs/experiments.md)")
    ap.add_argument("--quick", action="store_true", help="val-dip, seeds 1-2, prfaas-observed/prfaas-oracle/fixed-threshold")
    ap.add_argument("--ttft-clock", choices=tuple(TTFT_CLOCKS), default="router",
                    help="time requests by the router's stamps (default) or the client's, as vLLM's bench serve does")
    a = ap.parse_args()
    console = wide_console()
    if a.quick:
        a.shapes, a.seeds, a.arms = "val-dip", "1,2", "prfaas-observed,prfaas-oracle,fixed-threshold"
    shapes, arms = comma_list(a.shapes, "--shapes"), comma_list(a.arms, "--arms")
    try:
        seeds = [random_seed(int(s)) for s in comma_list(a.seeds, "--seeds", "1,2,3")]
    except ValueError:  # `int('x')`'s traceback before
        raise UserError(f"--seeds {a.seeds!r}: give seeds separated by commas, whole numbers from 0 to {MAX_SEED}, e.g. 1,2,3") from None
    for name, allowed in ((shapes, SHAPES + EXTRA_SHAPES), (arms, tuple(ARMS))):
        bad = [x for x in name if x not in allowed]
        if bad:
            print(f"error: {bad[0]!r} is not one of: {', '.join(allowed)}", file=sys.stderr)
            return 2
    out = Path(a.measure or a.out)
    todo = tasks(shapes, seeds, arms, out, a.set)
    if not a.measure:  # the experiments engine: resumable, any executor
        from experiments.engine import check_run, run_tasks
        from experiments.executor import make_executor

        executor = make_executor(a.executor)
        for t in todo:  # every run checked as prfaas run checks it, before the first (a --set the host refuses: one line)
            check_run(t.scenario, t.overrides, t.out_dir, executor)  # scale: auto at a run's share under local:N

        for key, o in run_tasks(todo, executor, label="signals bench").items():
            if o.status == "failed":
                console.print(f"[red]{key} failed[/]: {o.error}")
    rows = [{"shape": shape, "arm": arm, "seed": seed, **measure(d, a.ttft_clock)} for shape, arm, seed, d in completed(out)]
    (out / ("results.json" if a.ttft_clock == "router" else f"results-{a.ttft_clock}.json")).write_text(json.dumps(rows, indent=1, default=str))
    print_runs(rows, console)
    ok, judged = compare(rows, console)
    for path in plot_steps(rows, out):
        console.print(f"single-raise sweep: {path}")
    if not judged:  # e.g. --arms prfaas-oracle,all-local: a report, not a verdict
        console.print("no target judged: targets are judged on the prfaas-observed arm against fixed-threshold of the same seeds")
        return 0
    console.print("all targets met" if ok else "[red]targets missed (see NO above)[/]")
    return 0 if ok else 1


if __name__ == "__main__":
    from testbed.cli import guarded

    sys.exit(guarded(Path(__file__).name, main))
