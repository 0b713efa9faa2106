"""Summary metrics of a run: the one place TTFT, TPOT, throughput, offload fraction and egress are computed.

The serving plane calls `summarize` to write ``summary.json``; reports call it again on loaded runs, so
a number in a report and in ``summary.json`` always comes from the same code.

Conventions (docs/analysis.md): times in ``requests.parquet`` are seconds from run start; a request is
ok when ``status == "ok"``; it was offloaded when ``route`` starts with ``prfaas``; ``kv_bytes`` are
bytes on the wire (already divided by the scenario's ``scale``), so emulated egress = wire x scale.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from testbed.scale import Scale
from testbed.units import finite_or_none

OFFLOAD_ROUTE_PREFIX = "prfaas"


_num = finite_or_none


def stats(values: Any, quantiles: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """mean and the given percentiles of the finite values (None when there are none)."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    out: dict[str, float | None] = {"mean": float(v.mean()) if v.size else None}
    for q in quantiles:
        out[f"p{q}"] = float(np.percentile(v, q)) if v.size else None
    return out


def ok_mask(df: pd.DataFrame) -> pd.Series:
    return df["status"].astype(str) == "ok"


def cut_mask(df: pd.DataFrame) -> pd.Series:
    """Requests the client cancelled in the run's drain once its verdict was decided (status ``cut``)."""
    from testbed.serving.early_stop import CUT

    return df["status"].astype(str) == CUT


def offloaded_mask(df: pd.DataFrame) -> pd.Series:
    return df["route"].astype(str).str.startswith(OFFLOAD_ROUTE_PREFIX)


def float8_share(df: pd.DataFrame) -> float | None:
    """The share of `df`'s offloaded requests whose full-attention KV crossed the WAN in float8
    (`policy.kv_compression`); None without offloads or for a run recorded before the ``kv_dtype`` column."""
    from testbed.serving.policy.spec import COMPRESSED_KV_DTYPE

    off = df[offloaded_mask(df)] if len(df) and "route" in df else df.iloc[0:0]
    if "kv_dtype" not in off or not len(off):
        return None
    return float((off["kv_dtype"] == COMPRESSED_KV_DTYPE).mean())


def ttft_s(df: pd.DataFrame) -> pd.Series:
    """Time to first token: first token minus arrival."""
    return df["first_token_s"] - df["arrival_s"]


def client_ttft_s(df: pd.DataFrame) -> pd.Series:
    """Time to first token as the client saw it (``client_first_token_s - client_arrival_s``), as vLLM's ``bench
    serve`` measures it: the router's `ttft_s` plus two intra-datacenter hops and the router's intake (docs/scale-out.md,
    "The client and the router's intake"); empty for a frame without the client's columns."""
    if "client_first_token_s" not in df or "client_arrival_s" not in df:
        return pd.Series([], dtype=float)
    return (df["client_first_token_s"] - df["client_arrival_s"]).dropna()


def tpot_s(df: pd.DataFrame) -> pd.Series:
    """Time per output token after the first: (finish - first token) / (output_len - 1); NaN for 1-token outputs."""
    n = (df["output_len"].astype(float) - 1).where(lambda x: x > 0)
    return (df["finish_s"] - df["first_token_s"]) / n


def egress_series_bps(link: pd.DataFrame | None, scale: Scale | float = 1.0, direction: str = "prfaas_to_pd", window_s: float = 0.0) -> pd.Series | None:
    """Emulated WAN rate (bit/s) through the PrfaaS->PD qdisc (KV and any cross traffic), from differenced
    cumulative ``tx_bytes`` (or ``tx_bps``) in ``link.parquet``; with `window_s`, averaged over windows that long."""
    if link is None or link.empty or "t_s" not in link:
        return None
    d = link[link["direction"] == direction] if "direction" in link else link
    d = d.sort_values("t_s")
    to_em = Scale.of(scale).emulated_bps
    if "tx_bytes" in d and len(d) > 1:
        t = d["t_s"].to_numpy(float)
        b = d["tx_bytes"].to_numpy(float)
        if window_s > 0:
            idx = np.unique(np.searchsorted(t, np.arange(t[0], t[-1] + window_s, window_s)).clip(0, len(t) - 1))
            t, b = t[idx], b[idx]
        dt = np.diff(t)
        ok = dt > 0
        return pd.Series(to_em((np.diff(b) * 8 / np.where(ok, dt, 1))[ok]), index=t[1:][ok])
    if "tx_bps" in d:
        return pd.Series(to_em(d["tx_bps"].to_numpy(float)), index=d["t_s"].to_numpy(float)).dropna()
    return None


def kv_egress_series_bps(requests: pd.DataFrame, scale: Scale | float = 1.0, bin_s: float = 1.0) -> pd.Series:
    """Emulated KV egress (bit/s) of offloaded requests per `bin_s` bin: each transfer's ``kv_bytes`` spread
    evenly over [transfer_start_s, transfer_end_s]. Cross traffic is not in it (see `egress_series_bps`)."""
    df = requests[offloaded_mask(requests)] if len(requests) else requests
    df = df.dropna(subset=["transfer_start_s", "transfer_end_s", "kv_bytes"]) if len(df) else df
    if not len(df):
        return pd.Series([], dtype=float)
    s = df["transfer_start_s"].to_numpy(float)
    dur = np.maximum(df["transfer_end_s"].to_numpy(float) - s, 1e-9)
    bits = Scale.of(scale).emulated_bytes(df["kv_bytes"].to_numpy(float)) * 8
    lo = float(np.nanmin([requests["arrival_s"].min(), s.min()]))  # (no arrival time at all: NaN, an arange traceback)
    hi = max(float(np.nanmax(requests["finish_s"].to_numpy(float))) if requests["finish_s"].notna().any() else 0.0, float((s + dur).max()))
    edges = np.arange(lo, hi + bin_s, bin_s)
    done = (bits / dur) * np.clip(edges[:, None] - s[None, :], 0, dur[None, :])  # bits sent by each edge
    return pd.Series(np.diff(done.sum(axis=1)) / bin_s, index=edges[:-1] + bin_s / 2)


def estimator_error(scheduler: pd.DataFrame | None, steady_window_s: float = 2.0, steady_band: float = 0.1) -> dict[str, Any]:
    """How far the policy's available-bandwidth belief was from the emulator's ground truth.

    From the scheduler log's ``signals`` rows (one per control tick): relative error |belief - truth| /
    truth; "steady" rows are those whose truth stayed within +-`steady_band` of its value over the
    surrounding +-`steady_window_s` (transients after a WAN event are judged by detection time, not
    here). ``signals`` is the run's mode (``oracle`` runs are labelled by it).
    """
    empty = {"signals": None, "samples": 0, "steady_samples": 0, "median_abs_error": None, "p90_abs_error": None}
    if scheduler is None or "kind" not in scheduler or "truth_kv_available_bps" not in scheduler:
        return empty
    sig = scheduler[scheduler["kind"] == "signals"].sort_values("t_s")
    mode = str(sig["signals"].dropna().iloc[0]) if "signals" in sig and sig["signals"].notna().any() else None
    sig = sig[["t_s", "kv_available_bps", "truth_kv_available_bps"]].apply(pd.to_numeric, errors="coerce").dropna()
    sig = sig[sig["truth_kv_available_bps"] > 0]
    if not len(sig):
        return {**empty, "signals": mode}
    t = sig["t_s"].to_numpy()
    truth = sig["truth_kv_available_bps"].to_numpy()
    err = np.abs(sig["kv_available_bps"].to_numpy() - truth) / truth
    steady = np.array([
        bool(np.all(np.abs(truth[(t >= x - steady_window_s) & (t <= x + steady_window_s)] - v) <= steady_band * v))
        for x, v in zip(t, truth)
    ])
    e = err[steady]
    return {"signals": mode, "samples": int(len(err)), "steady_samples": int(len(e)),
            "median_abs_error": float(np.median(e)) if len(e) else None,
            "p90_abs_error": float(np.percentile(e, 90)) if len(e) else None}


def good_mask(df: pd.DataFrame, slo_ttft_s: float, slo_tpot_s: float) -> pd.Series:
    """Good requests (goodput, as vLLM's ``bench serve --goodput`` and DistServe): ok, and meeting every SLO,
    TTFT and TPOT (a one-token answer has no TPOT and meets that SLO)."""
    tpot = tpot_s(df)
    return ok_mask(df) & (ttft_s(df) <= slo_ttft_s) & (tpot.isna() | (tpot <= slo_tpot_s))


def queued_series(df: pd.DataFrame, step_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Requests waiting in a queue every `step_s` from the first to the last arrival: arrived and not yet
    prefilling (a prefill queue), or prefilled and still without a first token (the KV send queue, decode
    admission). Requests being prefilled are not counted: their number is bounded by the servers and
    their time by their length, so a stretch of longer prompts raises it with no queue growing. A request
    with no prefill start waits until its first token; one that never got a first token stays queued."""
    arr, start, end, first = (df[c].to_numpy(float) if c in df else np.full(len(df), np.nan)
                              for c in ("arrival_s", "prefill_start_s", "prefill_end_s", "first_token_s"))
    if "client_first_token_s" in df:
        first = np.where(np.isfinite(first), first, df["client_first_token_s"].to_numpy(float))
    keep = np.isfinite(arr)
    if keep.sum() < 2:
        return np.array([]), np.array([])
    arr, start, end, first = arr[keep], start[keep], end[keep], first[keep]
    first = np.where(np.isfinite(first), first, np.inf)
    start = np.where(np.isfinite(start), start, first)
    t = np.arange(arr.min(), arr.max() + 1e-9, step_s)

    def between(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.searchsorted(np.sort(a), t, "right") - np.searchsorted(np.sort(b), t, "right")

    done = np.isfinite(end)
    return t, (between(arr, start) + between(end[done], first[done])).astype(float)


TREND_ALPHA = 0.05  # the queue trend's one-sided level (Kendall's tau); the Theil-Sen interval is the two-sided 95% one
TREND_MIN_GROWTH = 1.0  # requests: a fitted growth over the window below this is no growth


def queue_trend(df: pd.DataFrame, warmup_fraction: float = 0.1, alpha: float = TREND_ALPHA) -> dict[str, Any]:
    """Do the requests waiting in a queue grow over the run? A trend test, not a threshold.

    Every queue of the serving path lies before the first token (prefill queue, KV send queue, decode
    admission: a decode batch is bounded by BS_max, so an overloaded decode stage shows up as requests
    waiting for a slot); `queued_series` counts them, not the requests being served. Requests *in
    flight* would also count decodes, whose fixed length (a 1024-token answer is ~27 s) says nothing
    about a queue and stretched the sample step; requests *in service* rise with a stretch of long
    prompts in a stable deployment (docs/experiments.md, "Capacity", rule 2). The queue is sampled every
    max(1 s, median TTFT) -- consecutive samples closer than a request's wait share most requests, and
    that autocorrelation would make any test over-confident -- over the arrivals after a warm-up
    (`warmup_fraction` of the span). It grows when Kendall's tau is positive with one-sided p < `alpha`, the
    Theil-Sen slope's 95% interval lies above zero and its growth over the window is at least one request.
    A request the drain cut ended before its first token counts in the median as longer than every known TTFT
    (`testbed.serving.early_stop.EarlyStop.step_settled`); ``cut_exact`` says whether the result is then
    certainly the uncut run's (`cut_trend_exact`; None: no such request).
    """
    waiting = _cut_waiting(df)
    out = _queue_trend(df, warmup_fraction, alpha, waiting, beyond=True)
    return {**out, "cut_exact": cut_trend_exact(df, waiting, out, lambda: _queue_trend(df, warmup_fraction, alpha, waiting, beyond=False))}


def _cut_waiting(df: pd.DataFrame) -> pd.Series:
    """Requests the drain cut ended before their first token (neither the router nor the client saw one)."""
    if not len(df) or "status" not in df or "first_token_s" not in df:
        return pd.Series(False, index=df.index)
    w = cut_mask(df) & df["first_token_s"].isna()
    return w & df["client_first_token_s"].isna() if "client_first_token_s" in df else w


CANCEL_KNOWN = ("dequeued", "running", "answered", "not found")  # `prefill_cancel` values whose record has the prefill times


def cut_trend_exact(df: pd.DataFrame, waiting: pd.Series, trend: dict[str, Any], dropped: Any) -> bool | None:
    """Is the queue trend of a run whose drain cut ended requests before their first token (`waiting`) certainly the
    uncut run's? Checked on the router's own clock, not the client's margins: (1) each such record has its prefill's
    times (``prefill_cancel`` in `CANCEL_KNOWN`); (2) the router noticed each hang-up (its ``finish_s``) after its
    last arrival, so their first tokens, had they come, came after the series' last sample; (3) the median TTFT, with
    theirs at least ``finish_s - arrival_s``, falls on a known one (or at most the 1-s floor), so it is the same
    wherever theirs end; (4) had they all failed instead (dropped from the median: `dropped()`), the verdict the
    capacity search reads (growing, and `queue_trend_inconclusive`) is the same. None when nothing was so cut."""
    from testbed.serving.early_stop import step_fixed

    if not waiting.any():
        return None
    w = df[waiting]
    if "prefill_cancel" not in df or not w["prefill_cancel"].isin(CANCEL_KNOWN).all():
        return False
    if not (w["finish_s"] > df["arrival_s"].max()).all():
        return False
    if not step_fixed(ttft_s(df).dropna().tolist(), (w["finish_s"] - w["arrival_s"]).tolist()):
        return False
    alt = dropped()
    return bool(alt["growing"] == trend["growing"] and queue_trend_inconclusive(alt) == queue_trend_inconclusive(trend))


def _queue_trend(df: pd.DataFrame, warmup_fraction: float, alpha: float, waiting: pd.Series, beyond: bool) -> dict[str, Any]:
    from scipy import stats as sps

    from testbed.serving.early_stop import STEP_FLOOR_S

    empty = {"samples": 0, "step_s": None, "slope_per_s": None, "slope_low_per_s": None, "growth": None,
             "kendall_tau": None, "p_value": None, "growing": None}
    if not len(df):
        return empty
    ttft = ttft_s(df) if "first_token_s" in df else pd.Series([], dtype=float)
    if beyond and waiting.any():
        ttft = ttft.mask(waiting, np.inf)
    ttft = ttft.dropna()
    median = float(ttft.median()) if len(ttft) else STEP_FLOOR_S
    if not np.isfinite(median):  # more cut before a first token than answered: not a cut the client makes
        median = float(ttft[np.isfinite(ttft)].median()) if np.isfinite(ttft).any() else STEP_FLOOR_S
    step = max(STEP_FLOOR_S, median)
    t, n = queued_series(df, step)
    if t.size:
        keep = t >= t.min() + warmup_fraction * (t.max() - t.min())
        t, n = t[keep], n[keep]
    if t.size < 5:
        return {**empty, "samples": int(t.size), "step_s": step}
    if np.all(n == n[0]):
        return {**empty, "samples": int(t.size), "step_s": step, "slope_per_s": 0.0, "slope_low_per_s": 0.0,
                "growth": 0.0, "growing": False}
    slope, _, low, _ = sps.theilslopes(n, t, 0.95)
    tau = sps.kendalltau(t, n, alternative="greater")
    growth = float(slope * (t.max() - t.min()))
    growing = bool(tau.pvalue < alpha and low > 0 and growth >= TREND_MIN_GROWTH)
    return {"samples": int(t.size), "step_s": step, "slope_per_s": float(slope), "slope_low_per_s": float(low),
            "growth": growth, "kendall_tau": float(tau.statistic), "p_value": float(tau.pvalue), "growing": growing}


def queue_trend_inconclusive(queue: dict[str, Any] | None) -> bool:
    """A `queue_trend` result not called growing although Kendall's test says it grows (one-sided p <
    `TREND_ALPHA`, a fitted growth of at least `TREND_MIN_GROWTH`): only the Theil-Sen interval, too wide on
    a few samples, reaches zero. Reads a summary's ``queue`` dict, so recorded runs are judged alike."""
    q = queue or {}
    p, growth = q.get("p_value"), q.get("growth")
    return not q.get("growing") and p is not None and p < TREND_ALPHA and growth is not None and growth >= TREND_MIN_GROWTH


def prefix_cache(df: pd.DataFrame, hybrid: bool | None = None, compute: str | None = None) -> dict[str, Any]:
    """Achieved prefix-cache hits against the ideal of the workload: one infinite cache shared by every
    instance, into which every request puts what its prefill leaves the moment it arrives.

    ``hit_requests``: share of requests with a cached prefix; ``hit_tokens``: cached / input tokens;
    ``ideal_*`` the same under the ideal cache at any full block (a partial block is never reused, and a
    prompt's last token always computed: `testbed.serving.kvmanager.reusable_blocks`), what a model of
    full attention could reach; ``ideal_checkpoint_*`` under the same cache for a hybrid model: a prefix
    is reusable only up to a block boundary where an earlier prompt's linear/SWA state was stored, and
    the pool stores one per prompt, at the last block boundary its prefill computed. Both replay the
    requests through `HybridPrefixPool` itself (metadata mode, unbounded), dense and hybrid, so they
    follow its rules exactly; what a prefill leaves depends on the `compute` mode (``torch`` computes all
    but the prompt's last token, profile mode charges every one). Requests arriving at the same time
    (a trace's burst) are concurrent: none reuses another's prefix. ``efficiency`` = hit_tokens / the
    ideal of the run's model (`hybrid`: the checkpoint ideal; False or None, unknown: the other).
    docs/analysis.md, "Prefix-cache efficiency".
    """
    out: dict[str, Any] = {"hit_requests": None, "hit_tokens": None, "ideal_hit_requests": None, "ideal_hit_tokens": None,
                           "ideal_checkpoint_hit_requests": None, "ideal_checkpoint_hit_tokens": None, "hybrid": hybrid,
                           "efficiency": None}
    if not len(df) or "cached_len" not in df:
        return out
    inputs = float(df["input_len"].astype(float).sum())
    cached = df["cached_len"].astype(float).fillna(0.0)
    out["hit_requests"] = float((cached > 0).mean())
    out["hit_tokens"] = float(cached.sum()) / inputs if inputs else None
    if "block_hashes" not in df:
        return out
    col = "scheduled_arrival_s" if "scheduled_arrival_s" in df else "arrival_s"
    groups = [[([int(h) for h in hashes] if hashes is not None else [], int(n))
               for hashes, n in zip(g["block_hashes"], g["input_len"])]
              for _, g in df.sort_values(col, kind="stable").groupby(col, sort=True, dropna=False)]
    for key, state in (("ideal", False), ("ideal_checkpoint", True)):
        hits, tokens = _ideal_hits(groups, state, compute == "torch")
        out[f"{key}_hit_requests"] = hits / len(df)
        out[f"{key}_hit_tokens"] = tokens / inputs if inputs else None
    ideal = model_ideal(out, "tokens")
    if ideal and out["hit_tokens"] is not None:
        out["efficiency"] = out["hit_tokens"] / ideal
    return out


def model_ideal(pc: dict[str, Any], unit: str) -> float | None:
    """The ideal of the run's model in a `prefix_cache` result, per ``requests`` or ``tokens``: the
    checkpoint ideal for a hybrid model, the any-block ideal otherwise (and when it is not known)."""
    return pc.get(f"ideal_checkpoint_hit_{unit}") if pc.get("hybrid") else pc.get(f"ideal_hit_{unit}")


def _ideal_hits(groups: list[list[tuple[list[int], int]]], hybrid: bool, last_token_to_decode: bool) -> tuple[int, int]:
    """(requests with a hit, tokens hit) replaying arrival groups (block hashes, input_len) through one
    unbounded metadata-mode `HybridPrefixPool`: each request matches as a worker does (at most input - 1
    tokens), then each group's prompts leave their blocks (and a hybrid pool its state at their end) as the
    worker's `_done` inserts them. The whole hour of Mooncake's conversation trace (12,031 requests) takes
    ~2.3 s on the 2-core VM."""
    from testbed.blocks import BLOCK_TOKENS
    from testbed.kv.pool import HybridPrefixPool
    from testbed.serving.kvmanager import prefilled_blocks

    pool = HybridPrefixPool(1 << 62, BLOCK_TOKENS, store_tensors=False, full_bytes_per_token=1, state_bytes=1, hybrid=hybrid)
    hits = tokens = 0
    for group in groups:
        found = [pool.match(hashes, max_tokens=n - 1).tokens for hashes, n in group]
        hits, tokens = hits + sum(t > 0 for t in found), tokens + sum(found)
        for hashes, n in group:
            pool.insert(hashes, tokens=prefilled_blocks(n, last_token_to_decode) * BLOCK_TOKENS)
    return hits, tokens


def model_is_hybrid(model: str) -> bool | None:
    """Whether `model` (a preset's name or a model file) keeps linear/SWA state, so that its prefix cache can
    reuse a prefix only where a state was stored; None when it cannot be read (a run of another version)."""
    from testbed.errors import UserError
    from testbed.kv.pool import state_bytes
    from testbed.models.spec import load_model_spec

    if not model:
        return None
    try:
        return state_bytes(load_model_spec(model)) > 0
    except (UserError, OSError, ValueError):
        return None


def summarize(requests: pd.DataFrame, link: pd.DataFrame | None = None, *, scale: Scale | float = 1.0, policy: str = "",
              model: str = "", duration_s: float | None = None, scheduler: pd.DataFrame | None = None,
              slo_ttft_s: float | None = None, slo_tpot_s: float | None = None, compute: str | None = None,
              hybrid: bool | None = None) -> dict[str, Any]:
    """The ``summary.json`` document of one run (keys of docs/serving.md "Run directory", plus a few more).

    Throughput counts ok requests over `duration_s` (default: first arrival to last finish). A request cut
    in the drain (status ``cut``, ``requests_cut``) is neither ok nor failed: its TTFT counts in the TTFT
    figures, and it is not good, so ``good_fraction`` is then a lower bound (the cut fired only where the
    verdict is the same at either bound: docs/experiments.md, "The drain cut").
    ``egress_gbps``: KV of offloaded requests (``kv_bytes`` x `scale`, 1 s bins, `kv_egress_series_bps`);
    ``wan_gbps``: everything the PrfaaS->PD WAN qdisc sent (KV + cross traffic), from link telemetry.
    `compute` (the run's compute mode) and `hybrid` (whether its model keeps linear/SWA state; None: looked
    up by `model`'s name) decide the prefix cache's ideal (`prefix_cache`).
    """
    df = requests
    total = int(len(df))
    ok = ok_mask(df) if total else pd.Series([], dtype=bool)
    cut = cut_mask(df) if total else pd.Series([], dtype=bool)
    good = df[ok]
    first = df[ok | cut]  # a request cut in the drain has its first token: its TTFT counts, its TPOT is unknown
    if duration_s is None:
        span = (_num(df["finish_s"].max()) or 0.0) - (_num(df["arrival_s"].min()) or 0.0) if total else 0.0
        duration_s = span if span > 0 else None
    ttft = ttft_s(first) if len(first) else pd.Series([], dtype=float)
    tpot = tpot_s(good) if len(good) else pd.Series([], dtype=float)
    off = offloaded_mask(df) if total else pd.Series([], dtype=bool)
    wire = float(df.loc[off, "kv_bytes"].fillna(0).sum()) if total else 0.0
    kv = kv_egress_series_bps(df, scale) if total else pd.Series([], dtype=float)
    eg = {"mean": Scale.of(scale).emulated_bytes(wire) * 8 / duration_s / 1e9 if duration_s else None,
          "p99": float(np.percentile(kv, 99)) / 1e9 if len(kv) else None, "source": "requests kv_bytes x scale, 1 s bins"}
    wan = egress_series_bps(link, scale)
    wan_stats = ({"mean": float(wan.mean()) / 1e9, "p99": float(np.percentile(wan, 99)) / 1e9, "source": "link.parquet tx_bytes x scale"}
                 if wan is not None and len(wan) else {"mean": None, "p99": None, "source": "no link telemetry"})
    short = first[~offloaded_mask(first)] if len(first) else first
    n_good = int(good_mask(df, slo_ttft_s, slo_tpot_s).sum()) if slo_ttft_s is not None and slo_tpot_s is not None and total else None
    return {
        "requests_total": total,
        "requests_ok": int(ok.sum()),
        "requests_failed": int(total - ok.sum() - cut.sum()),
        "requests_cut": int(cut.sum()),
        "duration_s": duration_s,
        "throughput_rps": len(good) / duration_s if duration_s else None,
        "output_tokens_per_s": float(good["output_len"].sum()) / duration_s if duration_s and len(good) else None,
        "ttft_s": stats(ttft),
        "ttft_short_s": stats(ttft_s(short)) if len(short) else stats([]),
        "ttft_client_s": stats(client_ttft_s(first)) if len(first) else stats([]),
        "tpot_s": {k: v for k, v in stats(tpot, (50, 90)).items()},
        "offload_fraction": float(off.mean()) if total else None,
        "kv_float8_fraction": float8_share(df),  # of the offloads: float8 KV on the WAN (policy.kv_compression)
        "kv_wire_bytes_offloaded": wire,
        "egress_gbps": eg,
        "wan_gbps": wan_stats,
        "scale": Scale.of(scale).factor,
        "policy": policy,
        "model": model,
        "estimator": estimator_error(scheduler),
        "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s},
        "good_fraction": n_good / total if n_good is not None and total else None,
        "goodput_rps": n_good / duration_s if n_good is not None and duration_s else None,
        "queue": queue_trend(df),
        "prefix_cache": prefix_cache(df, model_is_hybrid(model) if hybrid is None else hybrid, compute),
        "early_stop": early_stop(df),
        "drain_cut": drain_cut(df),
    }


def _client_stop(df: pd.DataFrame, prefix: str) -> str | None:
    if "client_reason" not in df or not len(df):
        return None
    reasons = df["client_reason"].dropna().astype(str)
    hit = reasons[reasons.str.startswith(prefix)]
    return str(hit.iloc[0]).split(" (")[0] if len(hit) else None


def early_stop(df: pd.DataFrame) -> str | None:
    """The client's reason when it ended the run early (`testbed.serving.early_stop`), else None."""
    from testbed.serving.early_stop import EARLY_STOP_PREFIX

    return _client_stop(df, EARLY_STOP_PREFIX)


def drain_cut(df: pd.DataFrame) -> str | None:
    """The client's reason when it cut the run's drain (`testbed.serving.early_stop.EarlyStop.drain_settled`), else None."""
    from testbed.serving.early_stop import DRAIN_CUT_PREFIX

    return _client_stop(df, DRAIN_CUT_PREFIX)
