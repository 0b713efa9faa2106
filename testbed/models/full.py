"""The ``full`` model variant: a preset's real compute widths with random weights, so a prefill costs
what the real model's costs (issue 12 item 6).

The cache geometry is the spec's (as ``faithful``); hidden size, query heads, MLA head dims and the MLP or
mixture of experts come from `widths.yaml` (each model's published config). Random weights from a seed;
nothing is downloaded. Two liberties, both about memory, not arithmetic:

- **Experts share weight storage**: expert e computes with weight set ``e % PHYSICAL_EXPERTS``. Routing,
  the tokens each expert gets, and every matmul shape are the real model's, so the FLOPs are; the bytes
  of distinct weights read are not (fewer), which understates time where weight reads dominate (small
  batches on a GPU).
- **Embedding and LM head have `VOCAB_ROWS` rows** (the prompt's tokens are drawn below that); the
  serving prefill computes the last position's logits only, a negligible share of the cost.

A model too large for the host is timed by `time_prefill_per_layer`: one block of each kind is built and
timed at the prompt's length on random activations (a layer's cost does not depend on the values), and the
prefill time is the per-kind times summed over the real layer pattern. `validate_extrapolation` compares
that with a full-depth run where memory allows.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
import yaml
from torch import nn

from testbed.errors import UserError
from testbed.models.layers import Block, make_param
from testbed.models.spec import GQALayer, ModelSpec
from testbed.models.torch_model import HybridModel, Variant, resolve_device

WIDTHS_FILE = Path(__file__).resolve().parent / "widths.yaml"
PHYSICAL_EXPERTS = 8
VOCAB_ROWS = 4096
_KEYS = {"source", "hidden", "vocab", "attention_heads", "mla_nope_dim", "mla_v_dim", "experts", "top_k",
         "expert_mlp", "shared_mlp", "dense_mlp", "dense_layers"}


@dataclass(frozen=True)
class Widths:
    source: str
    hidden: int
    vocab: int
    attention_heads: int
    mla_nope_dim: int = 128
    mla_v_dim: int = 128
    experts: int = 0  # 0: a dense MLP of dense_mlp in every layer
    top_k: int = 0
    expert_mlp: int = 0
    shared_mlp: int = 0
    dense_mlp: int = 0
    dense_layers: int = 0


def load_widths(model: str) -> Widths:
    data = yaml.safe_load(WIDTHS_FILE.read_text()) or {}
    if model not in data:
        raise UserError(f"model.variant: full needs the compute widths of {model!r}, which {WIDTHS_FILE.name} does not have "
                        f"(has: {', '.join(sorted(data))}); add them from the model's config.json")
    entry = data[model]
    unknown = set(entry) - _KEYS
    if unknown:
        raise UserError(f"{WIDTHS_FILE.name}: {model}.{sorted(unknown)[0]}: unknown key; allowed: {', '.join(sorted(_KEYS))}")
    return Widths(**entry)


class MoE(nn.Module):
    """Top-k routed experts (softmax over the chosen k) plus optional shared experts; SwiGLU experts."""

    def __init__(self, hidden: int, w: Widths, n_layers: int, gen: torch.Generator, device: torch.device) -> None:
        super().__init__()
        self.experts, self.top_k = w.experts, w.top_k
        self.gate = make_param(gen, (w.experts, hidden), hidden**-0.5, device)
        n = min(PHYSICAL_EXPERTS, w.experts)
        down = w.expert_mlp**-0.5 / math.sqrt(2 * n_layers)
        self.w_gate = nn.ParameterList([make_param(gen, (w.expert_mlp, hidden), hidden**-0.5, device) for _ in range(n)])
        self.w_up = nn.ParameterList([make_param(gen, (w.expert_mlp, hidden), hidden**-0.5, device) for _ in range(n)])
        self.w_down = nn.ParameterList([make_param(gen, (hidden, w.expert_mlp), down, device) for _ in range(n)])
        self.shared = None
        if w.shared_mlp:
            self.shared = (make_param(gen, (w.shared_mlp, hidden), hidden**-0.5, device),
                           make_param(gen, (w.shared_mlp, hidden), hidden**-0.5, device),
                           make_param(gen, (hidden, w.shared_mlp), w.shared_mlp**-0.5 / math.sqrt(2 * n_layers), device))
            for i, p in enumerate(self.shared):
                self.register_parameter(f"shared_{i}", p)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weights, chosen = (h @ self.gate.T).topk(self.top_k, dim=-1)
        weights = weights.softmax(dim=-1)
        out = torch.zeros_like(h)
        flat = chosen.flatten()
        order = flat.argsort()
        counts = torch.bincount(flat, minlength=self.experts).tolist()
        token_of = order // self.top_k
        start = 0
        n = len(self.w_gate)
        for e, c in enumerate(counts):
            if c == 0:
                continue
            rows = token_of[start:start + c]
            wts = weights.flatten()[order[start:start + c]]
            x = h[rows]
            y = (F.silu(x @ self.w_gate[e % n].T) * (x @ self.w_up[e % n].T)) @ self.w_down[e % n].T
            out.index_add_(0, rows, y * wts[:, None])
            start += c
        if self.shared is not None:
            g, u, d = self.shared
            out = out + (F.silu(h @ g.T) * (h @ u.T)) @ d.T
        return out


class MoEBlock(Block):
    """A `Block` whose MLP is the model's mixture of experts (its dense SwiGLU weights are not allocated)."""

    def __init__(self, mixer: nn.Module, hidden: int, w: Widths, n_layers: int, gen: torch.Generator, device: torch.device) -> None:
        nn.Module.__init__(self)
        self.mixer = mixer
        self.moe = MoE(hidden, w, n_layers, gen, device)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.moe(h)


class FullModel(HybridModel):
    """`HybridModel` at the preset's real widths: MoE blocks where the model has experts."""

    def __init__(self, spec: ModelSpec, widths: Widths, seed: int, device: torch.device, source_spec: ModelSpec,
                 source_layers: list[int]) -> None:
        self.widths, self.source_layers = widths, source_layers  # source_layers[i]: layer i's index in the whole model
        super().__init__(spec, full_variant(spec, widths), seed, device, source_spec)
        self.last_logits_only = True

    def _block(self, layer_index: int, mixer: nn.Module, gen: torch.Generator) -> nn.Module:
        w, n = self.widths, len(self.source_spec.layers)
        if w.experts and self.source_layers[layer_index] >= w.dense_layers:
            return MoEBlock(mixer, w.hidden, w, n, gen, self.device)
        return Block(mixer, w.hidden, w.dense_mlp or 4 * w.hidden, n, gen, self.device)


def full_variant(spec: ModelSpec, w: Widths) -> Variant:
    kv_heads = {layer.kv_heads for layer in spec.layers if isinstance(layer, GQALayer)}
    if len(kv_heads) > 1:
        raise UserError(f"model.variant: full: {spec.name} mixes GQA/SWA layers with {sorted(kv_heads)} KV heads; "
                        "one query-heads-per-KV-head ratio is supported")
    q_per_kv = w.attention_heads // kv_heads.pop() if kv_heads else 1
    return Variant("full", hidden=w.hidden, mlp=w.dense_mlp or 4 * w.hidden, vocab=min(w.vocab, VOCAB_ROWS),
                   q_per_kv=max(1, q_per_kv), mla_heads=w.attention_heads, mla_nope_dim=w.mla_nope_dim,
                   mla_v_dim=w.mla_v_dim, chunk_tokens=64, shrink_cache=False)


def build_full_model(spec: ModelSpec, seed: int = 0, device: str = "auto", depth: int | None = None,
                     layers: list[int] | None = None) -> FullModel:
    """The full-width model of `spec`: all layers, the first `depth`, or the listed layer indices (reduced
    depth for CPU tests and per-layer timing). Its `source_spec` is the whole model."""
    w = load_widths(spec.name)
    keep = list(range(len(spec.layers)))[:depth] if layers is None else layers
    sub = replace(spec, layers=tuple(spec.layers[i] for i in keep))
    return FullModel(sub, w, seed, resolve_device(device), spec, keep).eval()


@dataclass(frozen=True)
class LayerTiming:
    kind: str  # "linear", "mla", "gqa", "swa", with "+dense" for a dense-MLP layer of an MoE model
    layers: int  # how many layers of the model are of this kind
    seconds: float  # one layer's forward at the prompt's length (fastest of the repeats)


def layer_kinds(spec: ModelSpec, w: Widths) -> dict[str, list[int]]:
    """Layer indices of each timing kind (mixer kind, and dense vs expert MLP)."""
    out: dict[str, list[int]] = {}
    for i, layer in enumerate(spec.layers):
        dense = w.experts and i < w.dense_layers
        out.setdefault(layer.kind + ("+dense" if dense else ""), []).append(i)
    return out


def time_prefill_per_layer(spec: ModelSpec, tokens: int, seed: int = 0, device: str = "auto", repeats: int = 1,
                           clock: Callable[[], float] = time.perf_counter) -> tuple[float, list[LayerTiming]]:
    """Prefill time of the whole model at `tokens`, extrapolated from one timed block of each kind:
    sum over kinds of (layers of that kind x one block's time), plus embedding, final norm and the last
    position's logits (timed on a one-block model). Returns (seconds, per-kind timings)."""
    w = load_widths(spec.name)
    timings = []
    for kind, idx in layer_kinds(spec, w).items():
        m = build_full_model(spec, seed, device, layers=[idx[0]])
        # the input is drawn (on the CPU) and copied to the device before the clock starts: only the block is timed
        x = torch.randn(tokens, w.hidden, generator=torch.Generator().manual_seed(seed)).to(m.device)
        s = _time(lambda: m.blocks[0](x, 0, None), repeats, m.device, clock)
        timings.append(LayerTiming(kind, len(idx), s))
        del m, x
    return sum(t.layers * t.seconds for t in timings), timings


def _time(fn: Callable[[], Any], repeats: int, device: torch.device, clock: Callable[[], float] = time.perf_counter) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    with torch.inference_mode():
        fn()  # warm-up
        for _ in range(max(1, repeats)):
            sync()
            t0 = clock()
            fn()
            sync()
            best = min(best, clock() - t0)
    return best


def time_decode_per_layer(spec: ModelSpec, context: int, seed: int = 0, device: str = "auto",
                          repeats: int = 1, clock: Callable[[], float] = time.perf_counter) -> tuple[float, list[LayerTiming]]:
    """One request's decode step at `context` cached positions, extrapolated like the prefill: one block of
    each kind steps one token over a cache entry of that layer's exact geometry (random values)."""
    from testbed.kv.cache import LayerKV
    from testbed.models.layers import torch_dtype

    w = load_widths(spec.name)
    timings = []
    for kind, idx in layer_kinds(spec, w).items():
        m = build_full_model(spec, seed, device, layers=[idx[0]])
        gen = torch.Generator().manual_seed(seed)
        prev = LayerKV(0, spec.layers[idx[0]].kind, {
            name: torch.empty(ts.shape, dtype=torch.float32).normal_(generator=gen).to(torch_dtype(ts.dtype)).to(m.device)
            for name, ts in spec.layer_tensors(idx[0], context).items()})
        x = torch.randn(1, w.hidden, generator=gen).to(m.device)
        s = _time(lambda: m.blocks[0](x, context, prev, True), repeats, m.device, clock)
        timings.append(LayerTiming(kind, len(idx), s))
        del m
    return sum(t.layers * t.seconds for t in timings), timings
