"""Figures from run directories and from the throughput model; each function returns a matplotlib Figure.

Every axis carries a quantity and its unit in brackets (``"TTFT (s)"``); `missing_units` checks that,
and the tests run it on every figure. Rates are in emulated units (wire x scale), as the report says.
Column conventions of ``link.parquet`` / ``scheduler.parquet``: docs/analysis.md.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from analysis.metrics import cut_mask, egress_series_bps, kv_egress_series_bps, offloaded_mask, ok_mask, tpot_s, ttft_s  # noqa: E402
from analysis.rundir import Run  # noqa: E402
from testbed.atomic import make_dirs  # noqa: E402
from testbed import units  # noqa: E402
from testbed.kv.tcplog import CONNECTION  # noqa: E402
from testbed.scale import Scale  # noqa: E402

plt.rcParams.update({"figure.dpi": 100, "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False})
UNIT = re.compile(r"\(.+\)")


def missing_units(fig: plt.Figure) -> list[str]:
    """Axes of `fig` whose x or y label is empty or has no unit in brackets (empty list: all labelled).

    A shared x axis (stacked panels, twin y axes) counts as labelled when one axes of its group carries the label.
    """
    bad = []
    for i, ax in enumerate(fig.axes):
        if not ax.get_visible() or not ax.has_data():
            continue
        xlabels = [a.get_xlabel() for a in ax.get_shared_x_axes().get_siblings(ax)] + [ax.get_xlabel()]
        xlab = next((x for x in xlabels if UNIT.search(x or "")), ax.get_xlabel())
        for which, lab in (("x", xlab), ("y", ax.get_ylabel())):
            if not UNIT.search(lab or ""):
                bad.append(f"axes {i} ({ax.get_title() or 'untitled'}): {which} label {lab!r}")
    return bad


def save(fig: plt.Figure, path: Path) -> Path:
    make_dirs(path.parent)
    fig.savefig(path)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------- run helpers


def dip_windows(scenario: dict[str, Any], offset_s: float = 0.0) -> list[tuple[float, float, str]]:
    """(start_s, end_s, text) of each scheduled WAN change in a resolved scenario.yaml, for shading;
    `offset_s` is when the schedule's clock starts on the run's clock (environment.json ``workload_start_s``)."""
    out = []
    wan = scenario.get("wan") if isinstance(scenario.get("wan"), dict) else {}
    schedule = wan.get("schedule") if isinstance(wan.get("schedule"), list) else []  # (any other shape: nothing to shade)
    duration = _seconds(scenario.get("duration"), 60.0)
    for e in schedule:
        if not isinstance(e, dict) or "at" not in e:
            continue
        start = _seconds(e.get("at"), 0.0)
        length = _seconds(e.get("for") or e.get("down"), duration - start)
        what = ", ".join(f"{k} {e[k]}" for k in ("rate", "delay", "loss") if k in e) or "down"
        out.append((offset_s + start, offset_s + start + length, what))
    return out


def _seconds(v: Any, default: float) -> float:
    if v is None:
        return default
    try:
        return units.parse_duration_s(v)
    except Exception:
        return default


def _shade(ax: plt.Axes, windows: Iterable[tuple[float, float, str]]) -> None:
    for a, b, _ in windows:
        ax.axvspan(a, b, color="tab:red", alpha=0.08, lw=0)


def _bin_s(runs: Sequence[Run]) -> float:
    span = max((float(r.requests["arrival_s"].max()) for r in runs if len(r.requests)), default=60.0)
    return max(0.5, span / 60.0)


def _binned(t: pd.Series, v: pd.Series, width_s: float, how: str) -> pd.Series:
    key = (t // width_s) * width_s + width_s / 2
    g = v.groupby(key)
    return g.quantile(0.9) if how == "p90" else g.sum() if how == "sum" else g.mean()


def _link_dir(link: pd.DataFrame, direction: str = "prfaas_to_pd") -> pd.DataFrame:
    d = link[link["direction"] == direction] if "direction" in link else link
    return d.sort_values("t_s")


# ------------------------------------------------------------------------------------ congestion response


def congestion_response(run: Run) -> plt.Figure:
    """One run: WAN rate and utilisation, backlog and drops, threshold t, offloaded fraction, TTFT by arrival."""
    fig, axes = plt.subplots(5, 1, figsize=(10, 13), sharex=True)
    win = dip_windows(run.scenario, run.schedule_offset_s)
    s = run.scale
    link = _link_dir(run.link)
    ax = axes[0]
    if "rate_bps" in link:
        ax.plot(link["t_s"], Scale(s).emulated_bps(link["rate_bps"]) / 1e9, color="k", ls="--", label="configured rate")
    kv = kv_egress_series_bps(run.requests, s)
    if len(kv):
        ax.plot(kv.index, kv.to_numpy() / 1e9, color="tab:green", drawstyle="steps-mid", label="KV egress (requests)")
    eg = egress_series_bps(run.link, s, window_s=0.5)
    if eg is not None:
        ax.plot(eg.index, eg.to_numpy() / 1e9, color="tab:blue", label="WAN sent (qdisc, KV + cross traffic)")
    sig = run.scheduler[run.scheduler["kind"] == "signals"].sort_values("t_s") if "kind" in run.scheduler else run.scheduler.iloc[0:0]
    for col, style, lab in (("truth_kv_available_bps", dict(color="k", lw=1.0), "left for KV (ground truth)"),
                            ("kv_available_bps", dict(color="tab:red", lw=1.2, ls=":"), f"left for KV ({run.signals} estimate)")):
        if col in sig and sig[col].notna().any():
            v = pd.to_numeric(sig[col], errors="coerce")
            ax.plot(sig["t_s"], v / 1e9, label=lab, **style)
    ax.set_ylabel("WAN PrfaaS->PD (Gbps)")
    ax.set_title(f"WAN rate and egress (emulated units, scale {s:g})")
    if eg is not None and "rate_bps" in link and len(link):
        u = ax.twinx()
        rate = link.drop_duplicates("t_s", keep="last").set_index("t_s")["rate_bps"]  # (a repeated sample: a reindex traceback)
        cfg = Scale(s).emulated_bps(rate.reindex(eg.index, method="nearest"))
        u.plot(eg.index, (eg / cfg.replace(0, np.nan)).to_numpy(), color="tab:orange", alpha=0.6, lw=0.8)
        u.set_ylabel("utilisation (fraction)", color="tab:orange")
        u.set_ylim(0, 1.2)
    ax.legend(loc="lower left", fontsize=8)
    ax = axes[1]
    if "backlog_bytes" in link:
        ax.plot(link["t_s"], link["backlog_bytes"] / 1e6, color="tab:purple", label="queue backlog (wire)")
    ax.set_ylabel("backlog (MB)")
    ax.set_title("WAN queue backlog and drops")
    if "drops" in link and len(link):
        d = ax.twinx()
        d.plot(link["t_s"], link["drops"] - link["drops"].iloc[0], color="tab:red", lw=0.8)
        d.set_ylabel("drops since start (packets)", color="tab:red")
    ax = axes[2]
    sch = run.scheduler.sort_values("t_s")
    sch = sch[["t_s", "threshold"]].dropna() if "threshold" in sch else sch.iloc[0:0]
    if len(sch):
        ax.step(sch["t_s"], sch["threshold"], where="post", color="tab:green")
    elif "threshold" in run.requests and run.requests["threshold"].notna().any():
        ax.plot(run.requests["arrival_s"], run.requests["threshold"], ".", ms=2, color="tab:green")
    ax.set_ylabel("threshold t (tokens)")
    ax.set_title("Offload threshold")
    ax = axes[3]
    req = run.requests
    w = _bin_s([run])
    if len(req):
        frac = _binned(req["arrival_s"], offloaded_mask(req).astype(float), w, "mean")
        ax.plot(frac.index, frac.to_numpy(), drawstyle="steps-mid", color="tab:cyan")
    ax.set_ylim(-0.05, 1.05)
    ax.set_ylabel("offloaded (fraction)")
    ax.set_title(f"Requests routed to PrfaaS, per {w:.1f} s of arrivals")
    ax = axes[4]
    good = req[ok_mask(req)] if len(req) else req
    for name, part, c in (("PrfaaS", good[offloaded_mask(good)] if len(good) else good, "tab:blue"), ("PD-P", good[~offloaded_mask(good)] if len(good) else good, "tab:orange")):
        if len(part):
            ax.plot(part["arrival_s"], ttft_s(part), ".", ms=3, alpha=0.6, color=c, label=name)
    bad = req[~ok_mask(req) & ~cut_mask(req)] if len(req) else req  # a request cut in the drain did not fail
    if len(bad):
        ax.plot(bad["arrival_s"], np.zeros(len(bad)), "x", color="tab:red", label="failed")
    ax.set_ylabel("TTFT (s)")
    ax.set_xlabel("time since run start (s)")
    ax.set_title("TTFT by arrival time")
    if len(req):
        ax.legend(fontsize=8)
    for a in axes:
        _shade(a, win)
    fig.suptitle(f"Congestion response: {run.label}")
    fig.tight_layout()
    return fig


def policies_across_dip(runs: Sequence[Run]) -> plt.Figure:
    """Several runs (policies) on one time axis: P90 TTFT of short requests, offloaded fraction, WAN egress."""
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    w = _bin_s(runs)
    for r in runs:
        off = r.schedule_offset_s
        req = r.requests
        good = req[ok_mask(req)]
        short = good[~offloaded_mask(good)]
        if len(short):
            p90 = _binned(short["arrival_s"] - off, ttft_s(short), w, "p90")
            axes[0].plot(p90.index, p90.to_numpy(), drawstyle="steps-mid", label=r.label)
        if len(req):
            frac = _binned(req["arrival_s"] - off, offloaded_mask(req).astype(float), w, "mean")
            axes[1].plot(frac.index, frac.to_numpy(), drawstyle="steps-mid", label=r.label)
        eg = egress_series_bps(r.link, r.scale, window_s=0.5)
        if eg is not None:
            axes[2].plot(eg.index - off, eg.to_numpy() / 1e9, label=r.label)
    if runs:
        for a in axes:
            _shade(a, dip_windows(runs[0].scenario))
    axes[0].set_ylabel("P90 TTFT, PD-P requests (s)")
    axes[0].set_title(f"Short requests' TTFT per {w:.1f} s of arrivals (shaded: scheduled WAN change)")
    axes[1].set_ylabel("offloaded (fraction)")
    axes[2].set_ylabel("WAN egress (Gbps)")
    axes[2].set_xlabel("time since workload start (s)")
    for a in axes:
        if a.has_data():
            a.legend(fontsize=8)
    fig.tight_layout()
    return fig


def pantheon_summary(runs: Sequence[Run]) -> plt.Figure:
    """Pantheon-style: throughput against P95 TTFT, one point per run; better is up and to the right."""
    fig, ax = plt.subplots(figsize=(7, 5))
    for r in runs:
        good = r.requests[ok_mask(r.requests)]
        if not len(good):
            continue
        p95 = float(np.nanpercentile(ttft_s(good), 95))
        thr = r.metrics.get("throughput_rps") or 0.0
        ax.plot(p95, thr, "o", ms=9)
        ax.annotate(r.label, (p95, thr), textcoords="offset points", xytext=(6, 6), fontsize=8)
    ax.margins(0.25)
    ax.invert_xaxis()
    ax.set_xlabel("P95 TTFT (s, axis reversed: better ->)")
    ax.set_ylabel("throughput (requests/s)")
    ax.set_title("Throughput vs P95 TTFT (one point per run)")
    fig.tight_layout()
    return fig


def latency_cdfs(runs: Sequence[Run]) -> plt.Figure:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    for r in runs:
        good = r.requests[ok_mask(r.requests)]
        for ax, v in ((a, ttft_s(good)), (b, tpot_s(good) * 1e3)):
            x = np.sort(v.dropna().to_numpy())
            if x.size:
                ax.plot(x, np.arange(1, x.size + 1) / x.size, label=r.label)
    a.set_xlabel("TTFT (s)")
    b.set_xlabel("TPOT (ms)")
    for ax, t in ((a, "TTFT CDF"), (b, "TPOT CDF")):
        ax.set_ylabel("fraction of requests (CDF)")
        ax.set_title(t)
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------- the model


def lambda_vs_threshold(result: Any, other: Any = None) -> plt.Figure:
    """Lambda_max against t (best N_p / N_d split at each t) and each stage's limit at the optimal split;
    `other` (the other reading of Eq. 3) is drawn as a thin grey line."""
    g = result.grid
    j = result.n_p
    fig, ax = plt.subplots(figsize=(8, 5))
    t = g.thresholds / 1024
    ax.plot(t, np.nanmax(g.lambda_max, axis=1), color="k", lw=2, label=f"Lambda_max, best split at each t ({result.reading})")
    if other is not None and other.grid is not None:
        ax.plot(other.grid.thresholds / 1024, np.nanmax(other.grid.lambda_max, axis=1), color="gray", lw=1,
                label=f"Lambda_max, {other.reading} reading of Eq. 3")
    with np.errstate(divide="ignore", invalid="ignore"):
        ax.plot(t, g.theta_prfaas[:, j] / g.p, ls="--", label=f"Theta_prfaas / p ({result.n_prfaas} PrfaaS)")
        ax.plot(t, g.theta_pdp[:, j] / (1 - g.p), ls="--", label=f"Theta_pdp / (1-p) (N_p={j})")
    ax.axhline(float(g.theta_pdd[0, j]), ls=":", color="tab:red", label=f"Theta_pdd (N_d={result.n_d})")
    if result.threshold is not None:
        ax.axvline(result.threshold / 1024, color="gray", lw=0.8)
    top = float(np.nanmax(g.lambda_max))
    ax.set_ylim(0, top * 1.6 if top > 0 else 1)
    ax.set_xlabel("threshold t (K tokens, 1K = 1024)")
    ax.set_ylabel("throughput (requests/s)")
    ax.set_title(f"Lambda_max vs threshold ({result.reading} reading of Eq. 3)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def lambda_vs_split(result: Any) -> plt.Figure:
    g = result.grid
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.bar(g.n_p, np.nanmax(g.lambda_max, axis=0), color="tab:blue")
    ax.set_xlabel("PD prefill instances N_p (N_d = rest) (instances)")
    ax.set_ylabel("Lambda_max, best t (requests/s)")
    ax.set_title("Lambda_max vs the N_p / N_d split")
    fig.tight_layout()
    return fig


def kv_pushback(runs: Sequence[Run]) -> plt.Figure:
    """The bandwidth wall in runs: each run's WAN egress against the configured rate, queue backlog, and how
    long offloaded KV transfers take (and wait after prefill ends) by arrival time. A dense model's prefill
    cluster fills the queue and stretches transfers where a hybrid one does not."""
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    for i, r in enumerate(runs):
        c, t0 = f"C{i}", r.schedule_offset_s
        link = _link_dir(r.link)
        eg = egress_series_bps(r.link, r.scale, window_s=0.5)
        if eg is not None:
            axes[0].plot(eg.index - t0, eg.to_numpy() / 1e9, color=c, label=f"{r.label} egress")
        if "rate_bps" in link:
            axes[0].plot(link["t_s"] - t0, Scale(r.scale).emulated_bps(link["rate_bps"]) / 1e9, color=c, ls="--", lw=0.8)
        if "backlog_bytes" in link:
            axes[1].plot(link["t_s"] - t0, link["backlog_bytes"] / 1e6, color=c, label=r.label)
        req = r.requests
        off = req[offloaded_mask(req) & req["transfer_end_s"].notna()]
        if len(off):
            axes[2].plot(off["arrival_s"] - t0, off["transfer_end_s"] - off["transfer_start_s"], ".", ms=3, color=c, label=r.label)
            axes[3].plot(off["arrival_s"] - t0, (off["transfer_end_s"] - off["prefill_end_s"]).clip(lower=0), ".", ms=3, color=c, label=r.label)
    axes[0].set_ylabel("WAN egress (Gbps)")
    axes[0].set_title("KV pushed into one WAN (dashed: configured rate, emulated units)")
    axes[1].set_ylabel("queue backlog, wire (MB)")
    axes[2].set_ylabel("KV transfer time (s)")
    axes[3].set_ylabel("transfer end - prefill end (s)")
    axes[3].set_xlabel("time since workload start (s)")
    for a in axes:
        if a.has_data():
            a.legend(fontsize=8)
    if runs:
        for a in axes:
            _shade(a, dip_windows(runs[0].scenario))
    fig.tight_layout()
    return fig


def kv_connections(run: Run) -> plt.Figure:
    """One run, its KV senders' TCP connections across the WAN (`tcp.parquet`, the PrfaaS cluster's): each
    connection's delivery rate (samples the sender did not limit), congestion window and smoothed RTT against
    the path's minimum (samples in RTO back-off marked), and the retransmits per second over all of them.
    What `ss -ti` would show, over time; rates in emulated units."""
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    tcp = run.tcp[run.tcp["cluster"] == "prfaas"] if run.tcp is not None else pd.DataFrame()
    conns = tcp.groupby(list(CONNECTION)) if len(tcp) else []
    for n, (_, c) in enumerate(conns):
        color = f"C{n % 10}"
        busy = c[(c["unacked_bytes"] > 0) | (c["notsent_bytes"] > 0)]  # between transfers, rate and RTT are stale
        path = busy[~busy["app_limited"]]  # an app-limited rate sample is the sender's pace, not the path's
        axes[0].plot(path["t_s"], Scale(run.scale).emulated_bps(path["delivery_rate_bps"]) / 1e9, ".", ms=2, alpha=0.6, color=color)
        axes[1].step(c["t_s"], c["cwnd"], where="post", lw=0.7, alpha=0.6, color=color)
        axes[2].plot(busy["t_s"], busy["rtt_us"] / 1e3, ".", ms=2, alpha=0.6, color=color)
    if len(tcp):
        axes[0].set_title(f"KV connections across the WAN, one colour each ({len(conns)}); rate and RTT while a connection has bytes to send")
        axes[2].plot(tcp["t_s"], tcp["min_rtt_us"].cummin() / 1e3, color="k", lw=1.0, label="min RTT (kernel)")
        rto = tcp[(tcp["backoff"] > 0) | (tcp["ca_state"] == 4)]
        if len(rto):
            axes[2].plot(rto["t_s"], rto["rtt_us"] / 1e3, "x", ms=4, color="tab:red", label="in RTO back-off / loss state")
        axes[2].legend(loc="upper right", fontsize=8)
        w = _bin_s([run])
        new = conns["total_retrans"].diff().fillna(0).clip(lower=0)  # per connection; a replaced sender counts from 0 (own group)
        retrans = _binned(tcp["t_s"], new, w, "sum") / w
        axes[3].plot(retrans.index, retrans.to_numpy(), drawstyle="steps-mid", color="tab:red")
    else:
        axes[0].set_title("this run has no KV connections across the WAN in tcp.parquet")
    axes[0].set_ylabel("delivery rate (Gbps)")
    axes[1].set_ylabel("cwnd (segments)")
    axes[2].set_ylabel("smoothed RTT (ms)")
    axes[3].set_ylabel("retransmits (1/s)")
    axes[3].set_xlabel("time since run start (s)")
    for a in axes:
        _shade(a, dip_windows(run.scenario, run.schedule_offset_s))
    fig.suptitle(f"KV transport: {run.label}")
    fig.tight_layout()
    return fig
