"""The bandwidth wall: KV throughput of one prefill instance, Phi_kv(l) = S_kv(l) / T_prefill(l) (Eq. 1), and the
egress of a prefill cluster, B_out = (N / P) Phi_kv(L_avg) (Eq. 2), against link capacity.

Three sources, each labelled in every table and figure: the paper's published Phi_kv (Tables 3 and 5),
the compute profiles (fitted curves, `testbed.models.profiles`) with the models' exact KV bytes, and
prefill measured here on the runnable torch models (real timing, the bytes of the cache they produced).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pandas as pd

from testbed.models.profiles import load_profile

LENGTHS = (1024, 8192, 32768, 131072)
# Paper Table 3 (8xH200, SGLang v0.5.9) and Table 5 (internal 1T hybrid): Phi_kv in Gbps at LENGTHS.
PUBLISHED_PHI_GBPS: dict[str, tuple[tuple[float, ...], str, str]] = {
    "kimi-linear-48b": ((1.19, 2.29, 3.87, 4.88), "hybrid", "Table 3"),
    "mimo-v2-flash": ((0.82, 2.85, 4.66, 4.71), "hybrid", "Table 3"),
    "qwen3.5-397b": ((4.13, 6.28, 8.25, 7.47), "hybrid", "Table 3"),
    "ring-2.5-1t": ((7.27, 4.47, 2.59, 1.46), "hybrid", "Table 3"),
    "minimax-m2.5": ((4.94, 32.87, 59.93, 47.82), "dense", "Table 3"),
    "qwen3-235b": ((4.12, 22.42, 33.35, 21.50), "dense", "Table 3"),
    "paper-1t-hybrid": ((3.61, 3.59, 3.19, 2.62), "hybrid", "Table 5"),
}
# Profiles whose prefill curve gives Phi_kv(l) for any l (model preset -> profile).
PROFILE_CURVES = {"paper-1t-hybrid": "h200-paper-1t-hybrid", "minimax-m2.5": "h200-minimax-m2.5", "qwen3-235b": "h200-qwen3-235b"}
LINKS_GBPS = (10.0, 100.0)


def kv_bytes(model: str, tokens: Any) -> np.ndarray:
    """Exact KV bytes (bf16) of `model` at each length, from its spec (the one place that knows geometry)."""
    from testbed.models.spec import load_model_spec

    spec = load_model_spec(model)
    return np.array([spec.kv_bytes(int(t)).total_bytes for t in np.atleast_1d(tokens)], dtype=float)


def published_table() -> pd.DataFrame:
    """The paper's Phi_kv with the KV bytes of our specs and the prefill time they imply (S_kv / Phi_kv)."""
    rows = []
    for model, (phis, kind, source) in PUBLISHED_PHI_GBPS.items():
        b = kv_bytes(model, LENGTHS)
        for l, phi, nb in zip(LENGTHS, phis, b):
            rows.append({"model": model, "kind": kind, "tokens": l, "kv_bytes": nb, "phi_gbps": phi,
                         "implied_prefill_s": nb * 8 / (phi * 1e9), "source": f"paper {source}, 8xH200"})
    return pd.DataFrame(rows)


def profile_curve(model: str, profile: str, tokens: Any) -> pd.DataFrame:
    """Phi_kv(l) = S_kv(l) / T(l) from a compute profile's fitted prefill curve."""
    prof = load_profile(profile)
    l = np.asarray(tokens, dtype=float)
    t = np.asarray(prof.prefill_time_s(l))
    b = kv_bytes(model, l)
    return pd.DataFrame({"model": model, "tokens": l, "kv_bytes": b, "prefill_s": t, "phi_gbps": b * 8 / t / 1e9,
                         "source": f"profile {prof.name} ({prof.chip})"})


def measure(model: str, lengths: Sequence[int], variant: str = "faithful", device: str = "auto", seed: int = 0,
            repeats: int = 1, progress: Any = None) -> pd.DataFrame:
    """Prefill timed on this machine's torch model of `model` (real forward passes, the bytes of the cache it made).

    The fastest of `repeats` runs after one warm-up is kept. The ``faithful`` variant keeps every cache
    dimension of the real model, so kv_bytes are the real model's; compute is far smaller, so Phi_kv is not.
    """
    import torch

    from testbed.models.spec import load_model_spec
    from testbed.models.torch_model import build_model

    spec = load_model_spec(model)
    m = build_model(spec, variant, seed, device)
    dev = next(m.parameters()).device if any(True for _ in m.parameters()) else torch.device("cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(seed)
    m.prefill(torch.randint(0, 200, (16,), generator=gen))  # warm-up
    rows = []
    for n in lengths:
        ids = torch.randint(0, 200, (int(n),), generator=gen)
        best, nbytes = float("inf"), 0
        for _ in range(max(1, repeats)):
            sync()
            t0 = time.perf_counter()
            _, cache = m.prefill(ids)
            sync()
            best = min(best, time.perf_counter() - t0)
            nbytes = cache.nbytes
        rows.append({"model": model, "tokens": int(n), "kv_bytes": float(nbytes), "prefill_s": best, "phi_gbps": nbytes * 8 / best / 1e9,
                     "source": f"measured here: torch {variant} variant on {dev.type}, threads {torch.get_num_threads()}"})
        if progress is not None:
            progress()
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class ClusterEgress:
    model: str
    gpus: int
    gpus_per_instance: int
    l_avg_tokens: int
    phi_gbps: float
    egress_gbps: float  # Eq. 2


def cluster_egress(model: str, phi_gbps: float, gpus: int = 512, gpus_per_instance: int = 8, l_avg_tokens: int = 32768) -> ClusterEgress:
    """Eq. 2: B_out = (N / P) * Phi_kv(L_avg)."""
    return ClusterEgress(model, gpus, gpus_per_instance, l_avg_tokens, phi_gbps, gpus / gpus_per_instance * phi_gbps)


def cluster_table(gpus: int = 512, l_avg_tokens: int = 32768) -> pd.DataFrame:
    """Eq. 2 for every published model at L_avg (interpolated in log-length between published points)."""
    rows = []
    for model, (phis, kind, _) in PUBLISHED_PHI_GBPS.items():
        phi = float(np.interp(np.log2(l_avg_tokens), np.log2(LENGTHS), phis))
        e = cluster_egress(model, phi, gpus, 8, l_avg_tokens)
        rows.append({"model": model, "kind": kind, "gpus": gpus, "l_avg_tokens": l_avg_tokens, "phi_gbps": phi, "egress_gbps": e.egress_gbps,
                     **{f"fits_{int(c)}gbps": e.egress_gbps <= c for c in LINKS_GBPS}})
    return pd.DataFrame(rows)


def wall_figure(published: pd.DataFrame, curves: Sequence[pd.DataFrame] = (), measured: pd.DataFrame | None = None, gpus: int = 512) -> Any:
    """Phi_kv vs length (hybrid solid, dense dashed) with 10 and 100 Gbps lines; right: Eq. 2 cluster egress."""
    from analysis.plots import plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    kinds = dict((m, k) for m, (_, k, _) in PUBLISHED_PHI_GBPS.items())
    for i, (model, d) in enumerate(published.groupby("model", sort=False)):
        ls = "-" if kinds.get(model) == "hybrid" else "--"
        a.plot(d["tokens"], d["phi_gbps"], ls, marker="o", color=f"C{i}", label=f"{model} ({kinds.get(model)}, {d['source'].iloc[0]})")
        b.plot(d["tokens"], d["phi_gbps"] * gpus / 8, ls, marker="o", color=f"C{i}", label=model)
    for c in curves:
        a.plot(c["tokens"], c["phi_gbps"], ":", color="gray", lw=1)
    if measured is not None and len(measured):
        for model, d in measured.groupby("model", sort=False):
            a.plot(d["tokens"], d["phi_gbps"], "x-", ms=7, label=f"{model} measured here ({d['source'].iloc[0].split(': ')[-1]})")
    for ax in (a, b):
        for cap, c in zip(LINKS_GBPS, ("tab:red", "darkred")):
            ax.axhline(cap, color=c, lw=1.2, ls="-.")
            ax.annotate(f"{cap:g} Gbps link", (1024, cap), textcoords="offset points", xytext=(2, 3), fontsize=8, color=c)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prefill length l (tokens, log2)")
    a.set_ylabel("Phi_kv per 8-GPU instance (Gbps)")
    a.set_title("Eq. 1: KV throughput of one prefill instance (dotted: profile fits)")
    b.set_ylabel(f"cluster egress B_out, {gpus} GPUs (Gbps)")
    b.set_title(f"Eq. 2: egress of a {gpus}-GPU prefill cluster, all requests of length l")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    return fig


def measured_profiles_table(paths: Sequence[str]) -> pd.DataFrame:
    """One row per (profile, length in LENGTHS): the Phi_kv a `prfaas profile` measurement implies (S_kv of
    the geometry that ran over its prefill time) beside the paper's published value for the same model."""
    from testbed.models.profiling import measured_phi

    rows = []
    for path in paths:
        prof = load_profile(path)
        meas = prof.extra.get("measured") or {}
        published = PUBLISHED_PHI_GBPS.get(str(meas.get("base_model")))
        for i, r in enumerate(measured_phi(prof, LENGTHS)):
            rows.append({"profile": prof.name, "model": meas.get("base_model"), "variant": meas.get("variant"),
                         "layers": meas.get("layers"), "chip": prof.chip, "tokens": r["tokens"], "kv_bytes": r["kv_bytes"],
                         "prefill_s": r["prefill_s"], "phi_gbps": r["phi_gbps"], "how": r["how"],
                         "published_phi_gbps": published[0][i] if published else None,
                         "published_source": f"paper {published[2]}, 8xH200, SGLang v0.5.9" if published else None})
    return pd.DataFrame(rows)


def format_measured_table(t: pd.DataFrame) -> str:
    """Rows: each profile and the published line of its model; columns: LENGTHS."""
    mark = {"measured": "", "curve": "~", "extrapolated": "*"}
    rows = []  # (label, values): a label is never cut, which made "NVIDIA H200" read "NVIDIA H20", another chip (2026-12-07)
    for (name, model, variant, chip), g in t.groupby(["profile", "model", "variant", "chip"], sort=False):
        g = g.set_index("tokens")
        rows.append((f"{name}: {model} {variant} on {chip}",
                     "".join(f"{g.loc[n, 'phi_gbps']:>10.4g}{mark[g.loc[n, 'how']]:1}" for n in LENGTHS)))
        if g["published_phi_gbps"].notna().all():
            rows.append((f"  published ({g.iloc[0].published_source})",
                         "".join(f"{g.loc[n, 'published_phi_gbps']:>10.4g} " for n in LENGTHS)))
    width = max([58, *(len(label) for label, _ in rows)])
    return "\n".join([f"{'source':<{width}}" + "".join(f"{n // 1024:>10}K" for n in LENGTHS),
                      *(f"{label:<{width}}{values}" for label, values in rows)])
