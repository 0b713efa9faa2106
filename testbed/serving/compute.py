"""Compute backends of the workers, one small interface with two real implementations.

Both take a `PrefillPlan`: the prefix the prefill worker's own pool holds (`cached_len`, resumed from,
not recomputed) and the prefix the decode worker already holds (`send_from`, SGLang's
``decode_prefix_len``: full-attention KV before it is not sent; linear/SWA state always is).

- `ProfileCompute`: prefill takes the hardware profile's time for (input, cached) tokens, spread evenly
  over the layers; each layer then emits real bytes of the model spec's size for what the decode lacks
  (`delta_layer_bytes`) divided by `scale` (the wire carries them, framed and checksummed). A decode
  step takes the profile's step time for the batch.
- `TorchCompute`: a real forward pass of the scenario's model (random weights, fixed seed, CUDA when
  present) over the uncached suffix only, continuing from the pool's block-boundary cache; each layer's
  KV is emitted as soon as that layer has run, so it is on the wire while later layers compute. The
  prompt's last token is not prefilled: it is the decode's first input, so the decode worker produces
  the first token from the KV it received (the same greedy tokens as a local prefill + decode of the
  whole prompt).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from testbed.clock import Pacer
from testbed.kv.cache import FULL_KINDS
from testbed.scale import Scale
from testbed.validation import Fields

DECODE_FORGET_S = 5.0  # a decode pacer's debt is dropped after this long without a step (a safety; idleness resets it)


@dataclass(frozen=True)
class ProfileLayer:
    """Profile mode's stand-in for a layer's KV: `nbytes` real bytes on the wire, no tensors."""

    layer_index: int
    kind: str
    nbytes: int


@dataclass(frozen=True)
class PrefillPlan:
    """What one prefill computes and sends."""

    input_len: int
    cached_len: int = 0  # prefix resumed from the prefill pool (its block-boundary cache), not recomputed
    send_from: int = 0  # the decode already holds full-attention KV of positions < send_from
    checkpoint_at: int | None = None  # block boundary whose cache the pool keeps for later prompts
    prefix: Any = None  # torch: the pool hit's KVCache covering cached_len positions
    kv_dtype: str | None = None  # the full-attention KV's dtype on the wire (`policy.kv_compression`); None: the model's

    @property
    def uncached_len(self) -> int:
        return self.input_len - self.cached_len


@dataclass
class PrefillOutput:
    tokens: int  # positions the whole KV covers (the decode's cache length after the transfer)
    checkpoint: Any = None  # torch: the KVCache at plan.checkpoint_at, for the pool
    # profile mode: seconds the prefill ran past its profile's time plus back-pressure, the lateness its last
    # paced sleep could not repay (`clock.Pacer.late_s`; the run's timing fidelity, testbed.fidelity); None in torch mode
    late_s: float | None = None


class Compute(Protocol):
    def prefill(self, request_id: str, plan: PrefillPlan, prompt_token_ids: list[int] | None,
                on_layer: Callable[[Any], None]) -> PrefillOutput:
        """Compute one prefill, handing each layer's KV (what the decode lacks) to `on_layer` as it is done."""
        ...

    def admit(self, slot: Any) -> None:
        """Check one request's received KV (`slot.kv`) against the model, on the thread that waited for it,
        before it queues for the batch: a cache that does not fit fails its own request, not the batch it
        would have joined. Raises ValueError naming what does not fit."""
        ...

    def place(self, slot: Any) -> None:
        """Put an admitted request's KV where the decode computes (torch: the model's device) as it joins
        the batch, so that device memory holds at most the batch's caches, not the queue's."""
        ...

    def decode_step(self, slots: list[Any]) -> list[int]: ...

    @property
    def decode_due_s(self) -> float | None:
        """Profile mode: the profile's time of every decode step so far, summed (what the steps should have
        taken; a request's stream is late by its first-to-last token time less the growth of this over it);
        None in torch mode, whose compute is real."""
        ...

    def decode_idle(self) -> None:
        """The decode loop had no request: nothing is owed from before (profile mode's pacing)."""
        ...


def load_model_section(cfg: Any) -> Any:
    """The scenario's ``model:`` section, re-read from the worker config with its own parser."""
    from testbed.models.spec import parse_model_section

    return parse_model_section(Fields(cfg.model, "model", cfg.model_source or None))


def wire_layer_bytes(spec: Any, uncached_len: int, scale: Scale | float) -> list[int]:
    """Bytes each layer puts on the wire for `uncached_len` new tokens: the spec's exact bytes / scale,
    rounded so that the layers add up to round(total / scale)."""
    return delta_layer_bytes(spec, uncached_len, 0, scale)


def delta_layer_bytes(spec: Any, total_tokens: int, send_from: int, scale: Scale | float,
                      full_attention_dtype: str | None = None) -> list[int]:
    """Bytes each layer puts on the wire when the decode already holds `send_from` positions: the
    full-attention part of the positions after it (in `full_attention_dtype` when given: float8 under
    `policy.kv_compression`) plus every fixed/window state, / scale, rounded so the layers add up to
    round(total / scale)."""

    scale = Scale.of(scale)
    out, cum, sent = [], 0, 0
    for i, layer in enumerate(spec.layers):
        held = spec.layer_bytes(i, send_from, full_attention_dtype=full_attention_dtype) if layer.kind in FULL_KINDS and send_from > 0 else 0
        cum += spec.layer_bytes(i, total_tokens, full_attention_dtype=full_attention_dtype) - held
        target = int(round(scale.wire_bytes(cum)))
        out.append(target - sent)
        sent = target
    return out


def _pseudo_token(request_id: str, index: int, vocab: int = 32000) -> int:
    digest = hashlib.blake2s(f"{request_id}:{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % vocab


class ProfileCompute:
    def __init__(self, cfg: Any) -> None:
        from testbed.models.profiles import load_profile

        self.section = load_model_section(cfg)
        self.spec = self.section.spec
        self.profile = load_profile(cfg.profile)
        self.scale = Scale.of(cfg.scale)
        self.role = cfg.role
        # back-to-back steps: one per profile step time. A host stall while requests are decoding is owed and
        # repaid by the next steps (it is not idleness: the first version forgot any gap over 0.2 s, and two
        # case-study runs at once on 2 cores then decoded 9.5% past the profile on average, unrecorded,
        # docs/serving.md); only an empty batch forgets (`decode_idle`)
        self._decode_pacer = Pacer(forget_s=DECODE_FORGET_S, cadence=True)
        self._decode_due_s = 0.0

    def prefill_time_s(self, input_len: int, cached_len: int) -> float:
        return float(self.profile.prefill_time_s(input_len, cached_len))

    def prefill(self, request_id: str, plan: PrefillPlan, prompt_token_ids: list[int] | None,
                on_layer: Callable[[Any], None]) -> PrefillOutput:
        layer_s = self.prefill_time_s(plan.input_len, plan.cached_len) / len(self.spec.layers)
        sizes = delta_layer_bytes(self.spec, plan.input_len, min(plan.send_from, plan.input_len - 1), self.scale, plan.kv_dtype)
        # the layers' sleeps add up to the profile's time; a full send path's wait, or a pause while preempting
        # prefills run, adds to it. A debt is never forgotten: a gap inside one prefill is a wait, not idleness
        pacer = Pacer(forget_s=math.inf)
        for i, (layer, nbytes) in enumerate(zip(self.spec.layers, sizes)):
            pacer.sleep(layer_s)  # this layer's share of the profile's prefill time
            if nbytes > 0:
                on_layer(ProfileLayer(i, layer.kind, nbytes))
        return PrefillOutput(plan.input_len, late_s=pacer.late_s)

    def admit(self, slot: Any) -> None:
        return None  # the KV is a byte count the transport verified: nothing more to check

    def place(self, slot: Any) -> None:
        return None

    def decode_step(self, slots: list[Any]) -> list[int]:
        step_s = float(self.profile.decode_step_s(min(len(slots), self.profile.max_batch)))
        self._decode_due_s += step_s
        self._decode_pacer.sleep(step_s)
        return [_pseudo_token(s.request_id, s.emitted) for s in slots]

    @property
    def decode_due_s(self) -> float | None:
        return self._decode_due_s

    def decode_idle(self) -> None:
        self._decode_pacer.idle()


class TorchCompute:
    def __init__(self, cfg: Any) -> None:
        import torch

        from testbed.models.torch_model import build_model

        torch.set_num_threads(max(1, int(__import__("os").environ.get("OMP_NUM_THREADS", "1"))))
        self.section = load_model_section(cfg)
        device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = device
        self.model = build_model(self.section.spec, cfg.variant, cfg.seed, device)
        self.model.last_logits_only = True  # the prefill's logits are never used: the decode makes the first token
        self.torch = torch
        self.decode_due_s: float | None = None  # real compute: nothing to keep time with

    def prefill(self, request_id: str, plan: PrefillPlan, prompt_token_ids: list[int] | None,
                on_layer: Callable[[Any], None]) -> PrefillOutput:
        input_len = plan.input_len
        if not prompt_token_ids or len(prompt_token_ids) != input_len:
            raise ValueError(f"torch mode needs prompt_token_ids of length input_len ({input_len})")
        if input_len < 2:
            raise ValueError("torch mode needs at least 2 prompt tokens (the last one is the decode's first input)")
        start = plan.prefix.tokens if plan.prefix is not None else 0
        if start != plan.cached_len or start >= input_len - 1:
            raise ValueError(f"prefix cache covers {start} positions, plan says {plan.cached_len} of {input_len - 1}")
        send_from = max(0, min(plan.send_from, input_len - 1))

        def emit(layer: Any) -> None:
            cut = delta_layer(layer, send_from)
            if plan.kv_dtype is not None:
                cut = cast_full_attention(cut, plan.kv_dtype)
            on_layer(cut if self.device == "cpu" else _to_cpu(cut, self.torch))  # on CPU: already host memory

        with self.torch.inference_mode():
            _, cache, checkpoint = self.model.prefill_checkpointed(
                list(prompt_token_ids[start:-1]), plan.prefix, plan.checkpoint_at, on_layer=emit, request_id=request_id)
        return PrefillOutput(cache.tokens, checkpoint)

    def decode_idle(self) -> None:
        return None  # real compute keeps no time

    def admit(self, slot: Any) -> None:
        self.model.check_cache(slot.kv)  # shapes and dtypes: the same on any device

    def place(self, slot: Any) -> None:
        slot.kv = _cache_to(slot.kv, self.device, self.torch)

    def decode_step(self, slots: list[Any]) -> list[int]:
        """One token for each request in the batch: one batched pass (`HybridModel.decode_batch`), each
        request on its own cache, which `admit` checked and `place` put on the device before it joined."""
        with self.torch.inference_mode():
            for s in slots:
                if s.next_input is None:  # first step: the prompt's last token
                    s.next_input = int(s.req.prompt_token_ids[-1])
            logits = self.model.decode_batch([s.next_input for s in slots], [s.kv for s in slots], check=False)
            out = [int(t) for t in self.torch.argmax(logits, dim=-1).tolist()]
        for s, tok in zip(slots, out):
            s.next_input = tok
        return out


def delta_layer(layer: Any, send_from: int) -> Any:
    """The part of a finished layer the decode lacks: full-attention positions from `send_from` on (a view,
    token dimension first), fixed and window state whole."""
    from testbed.kv.cache import LayerKV

    if send_from <= 0 or layer.kind not in FULL_KINDS:
        return layer
    return LayerKV(layer.layer_index, layer.kind, {k: t[send_from:] for k, t in layer.tensors.items()})


def cast_full_attention(layer: Any, dtype: str) -> Any:
    """`layer` with its full-attention tensors (gqa, mla: what grows with the tokens) in `dtype`, its fixed
    and window state as they are (a recurrent state accumulates every token's rounding error). Into float8,
    values beyond its finite range saturate at it, as vLLM's ``--kv-cache-dtype fp8`` with its default
    scale of 1.0 stores them (float8_e4m3fn has no infinity: an unclamped cast makes NaN). The same
    function casts a received layer back to the model's dtype. docs/router.md, "Adaptive KV precision"."""
    import torch

    from testbed.kv.cache import LayerKV

    if layer.kind not in FULL_KINDS:
        return layer
    want = getattr(torch, dtype)
    out = {}
    for name, t in layer.tensors.items():
        if t.dtype != want and want.is_floating_point and want.itemsize == 1:
            lim = torch.finfo(want).max
            t = t.clamp(-lim, lim)
        out[name] = t.to(want)
    return LayerKV(layer.layer_index, layer.kind, out)


def restore_kv_dtype(cache: Any, dtype: str) -> Any:
    """The decode side of `cast_full_attention`: a received cache whose full-attention tensors crossed in
    another dtype, with them back in the model's `dtype` (what its pool, its prefix and its decode hold)."""
    from testbed.kv.cache import KVCache

    return KVCache(cache.request_id, cache.model, cache.tokens, [cast_full_attention(layer, dtype) for layer in cache.layers])


def join_prefix(prefix: Any, delta: Any) -> Any:
    """The decode side: its pool's full-attention prefix (`prefix`, may be None) followed by the received
    `delta` (as `delta_layer` cut it); raises ValueError when they do not add up to the delta's length."""
    from testbed.kv.cache import KVCache, LayerKV

    import torch

    held = prefix.tokens if prefix is not None else 0
    full = {layer.layer_index: layer for layer in prefix.layers} if prefix is not None else {}
    layers = []
    for layer in delta.layers:
        if layer.kind in FULL_KINDS:
            n = next(iter(layer.tensors.values())).shape[0]
            if held + n != delta.tokens:
                raise ValueError(f"layer {layer.layer_index}: {n} positions received after a {held}-token decode prefix, "
                                 f"the transfer covers {delta.tokens}")
            if held:
                before = full[layer.layer_index].tensors
                layer = LayerKV(layer.layer_index, layer.kind, {k: torch.cat((before[k], t), dim=0) for k, t in layer.tensors.items()})
        layers.append(layer)
    return KVCache(delta.request_id, delta.model, delta.tokens, layers)


def _to_cpu(layer: Any, torch: Any) -> Any:
    """The wire sends host memory (the prefill never writes a finished layer again: no copy is needed on CPU)."""
    from testbed.kv.cache import LayerKV

    return LayerKV(layer.layer_index, layer.kind, {k: t.detach().to("cpu").contiguous() for k, t in layer.tensors.items()})


def _cache_to(cache: Any, device: str, torch: Any) -> Any:
    if device == "cpu" or cache is None:
        return cache
    for layer in cache.layers:
        layer.tensors = {k: t.to(device) for k, t in layer.tensors.items()}
    return cache


def make_compute(cfg: Any) -> Compute:
    return TorchCompute(cfg) if cfg.compute == "torch" else ProfileCompute(cfg)

