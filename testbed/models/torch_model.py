"""Runnable hybrid models built from a `ModelSpec`: real forward passes that produce and consume real KV.

Random weights from a seed (nothing is downloaded), CUDA when available else CPU. Two variants:

- ``faithful``: every layer caches exactly the spec's tensors (bytes per token and fixed state equal the
  real model's), while the hidden size, MLP, vocabulary and query heads shrink so it runs on 2 CPU cores.
- ``tiny``: the same layer pattern with every cache dimension shrunk as well (`tiny_spec`), for fast tests.

`HybridModel.spec` is always the geometry the model really caches, so ``spec.kv_bytes(n)`` equals the
bytes of the `KVCache` a prefill of n tokens returns. See docs/models.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from testbed.errors import UserError
from testbed.kv.cache import KVCache, LayerKV
from testbed.models.layers import Block, GQAMixer, LinearMixer, MLAMixer, make_param, rms_norm, torch_dtype
from testbed.models.spec import GQALayer, LayerSpec, LinearLayer, MLALayer, ModelSpec, SWALayer


@dataclass(frozen=True)
class Variant:
    """Sizes of the parts that do not show in the cache."""

    name: str
    hidden: int
    mlp: int
    vocab: int
    q_per_kv: int  # query heads per KV head (GQA/SWA)
    mla_heads: int
    mla_nope_dim: int
    mla_v_dim: int
    chunk_tokens: int  # linear-attention chunk; divides the 512-token prefix-cache block
    shrink_cache: bool


VARIANTS = {
    "faithful": Variant("faithful", hidden=64, mlp=128, vocab=512, q_per_kv=1, mla_heads=2, mla_nope_dim=32, mla_v_dim=32, chunk_tokens=64, shrink_cache=False),
    "tiny": Variant("tiny", hidden=32, mlp=64, vocab=256, q_per_kv=2, mla_heads=2, mla_nope_dim=8, mla_v_dim=8, chunk_tokens=8, shrink_cache=True),
}


class CacheMismatch(ValueError):
    """A KV cache that does not fit the model (wrong layer count, kind, tensor shape or dtype)."""


def _small(d: int) -> int:
    """A cache dimension shrunk 16x, kept even (RoPE) and >= 2."""
    n = max(2, d // 16)
    return n + n % 2


def tiny_spec(spec: ModelSpec) -> ModelSpec:
    """The same layer pattern with every cache dimension shrunk; windows shrink 8x (at least 4)."""

    def shrink(layer: LayerSpec) -> LayerSpec:
        if isinstance(layer, LinearLayer):
            qk = min(layer.qk_heads, 2)
            heads = qk * min(layer.heads // layer.qk_heads, 2)
            return replace(layer, heads=heads, qk_heads=qk, key_dim=_small(layer.key_dim), value_dim=_small(layer.value_dim))
        if isinstance(layer, SWALayer):
            return replace(layer, kv_heads=min(layer.kv_heads, 2), k_head_dim=_small(layer.k_head_dim),
                           v_head_dim=_small(layer.v_head_dim), window=max(4, layer.window // 8))
        if isinstance(layer, GQALayer):
            return replace(layer, kv_heads=min(layer.kv_heads, 2), k_head_dim=_small(layer.k_head_dim), v_head_dim=_small(layer.v_head_dim))
        if isinstance(layer, MLALayer):
            return replace(layer, kv_lora_rank=_small(layer.kv_lora_rank), rope_dim=_small(layer.rope_dim))
        raise TypeError(f"unknown layer kind {layer.kind!r}")

    return replace(spec, name=f"{spec.name}-tiny", layers=tuple(shrink(layer) for layer in spec.layers))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("model.device: cuda was asked for but torch sees no CUDA device; use auto or cpu")
    if device not in ("cpu", "cuda"):
        raise UserError(f"model.device: {device!r} is not allowed; use one of: auto, cpu, cuda")
    return torch.device(device)


class HybridModel(nn.Module):
    """Embedding, the spec's layers (each a mixer + SwiGLU MLP), final norm, LM head. One request at a time."""

    def __init__(self, spec: ModelSpec, variant: Variant, seed: int, device: torch.device, source_spec: ModelSpec) -> None:
        super().__init__()
        self.spec, self.source_spec, self.variant, self.seed, self.device = spec, source_spec, variant, seed, device
        self.vocab_size, self.hidden_size = variant.vocab, variant.hidden
        self.last_logits_only = False  # True: prefill computes only the last position's logits (serving)
        gen = torch.Generator().manual_seed(seed)
        n = len(spec.layers)
        self.embed = make_param(gen, (variant.vocab, variant.hidden), 1.0, device)
        blocks = []
        for i, layer in enumerate(spec.layers):
            if isinstance(layer, LinearLayer):
                mixer: nn.Module = LinearMixer(layer, i, variant.hidden, n, variant.chunk_tokens, spec.kv_dtype,
                                               spec.layer_state_dtype(i), gen, device)
            elif isinstance(layer, GQALayer):
                mixer = GQAMixer(layer, i, variant.hidden, n, variant.q_per_kv, spec.kv_dtype, gen, device)
            else:
                mixer = MLAMixer(layer, i, variant.hidden, n, variant.mla_heads, variant.mla_nope_dim, variant.mla_v_dim,
                                 spec.kv_dtype, gen, device)
            blocks.append(self._block(i, mixer, gen))
        self.blocks = nn.ModuleList(blocks)
        self.lm_head = make_param(gen, (variant.vocab, variant.hidden), variant.hidden**-0.5, device)

    def _block(self, layer_index: int, mixer: nn.Module, gen: torch.Generator) -> nn.Module:
        """The block around one mixer (the `full` variant puts a mixture of experts here)."""
        return Block(mixer, self.variant.hidden, self.variant.mlp, len(self.spec.layers), gen, self.device)

    # ------------------------------------------------------------------------------------ cache

    def check_cache(self, cache: KVCache) -> None:
        """Refuses a cache whose layers, kinds, tensor shapes or dtypes differ from this model's spec."""
        if len(cache.layers) != len(self.spec.layers):
            raise CacheMismatch(f"cache has {len(cache.layers)} layers, model {self.spec.name} has {len(self.spec.layers)}")
        for i, (entry, layer) in enumerate(zip(cache.layers, self.spec.layers)):
            if entry.kind != layer.kind:
                raise CacheMismatch(f"cache layer {i} is {entry.kind!r}, the model's layer {i} is {layer.kind!r}")
            want = self.spec.layer_tensors(i, cache.tokens)
            if tuple(entry.tensors) != tuple(want):
                raise CacheMismatch(f"cache layer {i} ({layer.kind}) has tensors {list(entry.tensors)}, expected {list(want)}")
            for name, ts in want.items():
                got = entry.tensors[name]
                if tuple(got.shape) != ts.shape or got.dtype != torch_dtype(ts.dtype):
                    raise CacheMismatch(
                        f"cache layer {i} ({layer.kind}) tensor {name}: {tuple(got.shape)} {str(got.dtype).removeprefix('torch.')}, "
                        f"expected {ts.shape} {ts.dtype} for {cache.tokens} tokens"
                    )

    def _ids(self, token_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().to(self.device)
        if ids.numel() == 0:
            raise ValueError("prefill needs at least one token")
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"token ids must be within 0..{self.vocab_size - 1} (vocab of the {self.variant.name} variant)")
        return ids

    # -------------------------------------------------------------------------------- forward

    def _run(self, ids: torch.Tensor, cache: KVCache | None, recurrent: bool,
             on_layer: Callable[[LayerKV], None] | None,
             checkpoint_at: int | None = None) -> tuple[torch.Tensor, list[LayerKV], list[LayerKV]]:
        if cache is not None:
            self.check_cache(cache)
        start = cache.tokens if cache is not None else 0
        x = self.embed[ids]
        layers, checkpoint = [], []
        for i, block in enumerate(self.blocks):
            x, kv, ckpt = block.forward(x, start, cache.layers[i] if cache is not None else None, recurrent, checkpoint_at)
            layers.append(kv)
            if ckpt is not None:
                checkpoint.append(ckpt)
            if on_layer is not None:
                on_layer(kv)
        return F.linear(rms_norm(x[-1:] if self.last_logits_only else x), self.lm_head), layers, checkpoint

    @torch.no_grad()
    def prefill(self, token_ids: torch.Tensor | Sequence[int], cache: KVCache | None = None,
                on_layer: Callable[[LayerKV], None] | None = None, request_id: str | None = None) -> tuple[torch.Tensor, KVCache]:
        """Logits ``[T, vocab]`` of the new tokens and a new cache covering prefix + new tokens.

        With `cache` (a prefix hit) it continues from there; `cache` itself is left untouched.
        `on_layer` gets each layer's finished cache entry as soon as that layer is done (layer-wise
        streaming); gqa/mla tensors span all positions, token dimension first, so a sender can slice
        ``[prefix_tokens:]`` without a copy.
        """
        logits, out, _ = self.prefill_checkpointed(token_ids, cache, None, on_layer, request_id)
        return logits, out

    @torch.no_grad()
    def prefill_checkpointed(self, token_ids: torch.Tensor | Sequence[int], cache: KVCache | None, checkpoint_at: int | None,
                             on_layer: Callable[[LayerKV], None] | None = None,
                             request_id: str | None = None) -> tuple[torch.Tensor, KVCache, KVCache | None]:
        """`prefill`, plus the cache as it was after `checkpoint_at` positions (an absolute multiple of the
        linear chunk inside this call; None otherwise): what a hybrid prefix pool stores at a block
        boundary, taken in the same pass. Its gqa/mla tensors are views of the returned cache's."""
        ids = self._ids(token_ids)
        logits, layers, ckpt = self._run(ids, cache, False, on_layer, checkpoint_at)
        rid = request_id if request_id is not None else (cache.request_id if cache is not None else "")
        start = cache.tokens if cache is not None else 0
        checkpoint = None
        if checkpoint_at is not None and len(ckpt) == len(layers):
            checkpoint = KVCache(rid, self.spec.name, checkpoint_at, ckpt)
        return logits, KVCache(rid, self.spec.name, start + ids.numel(), layers), checkpoint

    @torch.no_grad()
    def decode(self, token_id: int, cache: KVCache) -> torch.Tensor:
        """Logits ``[vocab]`` of the next token. Advances `cache` in place: its layer list and token
        count are replaced; tensors it held before are never written to (a pool may share them)."""
        logits, layers, _ = self._run(self._ids([int(token_id)]), cache, True, None)
        cache.layers = layers
        cache.tokens += 1
        return logits[0]

    @torch.no_grad()
    def decode_batch(self, token_ids: Sequence[int], caches: Sequence[KVCache], check: bool = True) -> torch.Tensor:
        """Continuous batching: logits ``[B, vocab]`` of the next token of B requests, each continuing its
        own cache (any lengths), in one pass. Advances every cache in place, as `decode`. `check=False`
        skips `check_cache` for caches this model produced or checked before (a serving loop's later steps)."""
        if len(token_ids) != len(caches) or not caches:
            raise ValueError(f"decode_batch: {len(token_ids)} tokens for {len(caches)} caches")
        for cache in caches if check else ():
            self.check_cache(cache)
        x = self.embed[self._ids(list(token_ids))]
        starts = [c.tokens for c in caches]
        per_layer = []
        for i, block in enumerate(self.blocks):
            x, kvs = block.decode_batch(x, starts, [c.layers[i] for c in caches])
            per_layer.append(kvs)
        for j, cache in enumerate(caches):
            cache.layers = [kvs[j] for kvs in per_layer]
            cache.tokens += 1
        return F.linear(rms_norm(x), self.lm_head)

    def generate(self, token_ids: torch.Tensor | Sequence[int], max_new_tokens: int, cache: KVCache | None = None) -> list[int]:
        """Greedy decoding: the `max_new_tokens` tokens after the prompt (continuing from `cache` if given)."""
        if max_new_tokens <= 0:
            return []
        logits, c = self.prefill(token_ids, cache)
        out = [int(logits[-1].argmax())]
        while len(out) < max_new_tokens:
            out.append(int(self.decode(out[-1], c).argmax()))
        return out


def _variant(name: str) -> Variant:
    if name not in VARIANTS:
        raise UserError(f"model.variant: {name!r} is not allowed; use one of: {', '.join(VARIANTS)}, full")
    return VARIANTS[name]


def vocab_size(spec: ModelSpec, variant: str) -> int:
    """Token ids a model of this variant accepts are 0 .. vocab_size - 1 (the router draws prompts from it)."""
    if variant == "full":
        from testbed.models.full import full_variant, load_widths

        return full_variant(spec, load_widths(spec.name)).vocab
    return _variant(variant).vocab


def build_model(spec: ModelSpec, variant: str = "tiny", seed: int = 0, device: str = "auto") -> HybridModel:
    """A runnable model of `spec` (``faithful``, ``tiny`` or ``full``: testbed.models.full); the same seed gives
    the same weights."""
    if variant == "full":
        from testbed.models.full import build_full_model

        return build_full_model(spec, seed, device)
    v = _variant(variant)
    geometry = tiny_spec(spec) if v.shrink_cache else spec
    return HybridModel(geometry, v, seed, resolve_device(device), spec).eval()


def synthetic_cache(spec: ModelSpec, tokens: int, request_id: str = "", seed: int = 0,
                    state_dtype: str | None = None, device: str = "cpu") -> KVCache:
    """A cache of the spec's exact shapes and dtypes filled with seeded random values: real bytes for the
    ``profile`` compute mode, where no forward pass runs. Costs time and memory in proportion to its bytes."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for i, layer in enumerate(spec.layers):
        tensors = {}
        for name, ts in spec.layer_tensors(i, tokens, state_dtype).items():
            tensors[name] = torch.empty(ts.shape, dtype=torch.float32).normal_(generator=gen).to(torch_dtype(ts.dtype)).to(device)
        layers.append(LayerKV(i, layer.kind, tensors))
    return KVCache(request_id, spec.name, tokens, layers)
