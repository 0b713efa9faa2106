"""Torch layers of the runnable hybrid models: linear attention, GQA/SWA, MLA, and the MLP block.

Every mixer maps ``x [T, hidden]`` at absolute positions ``start .. start+T-1`` plus the layer's cache
entry from earlier positions (or None) to ``y [T, hidden]``, the layer's new cache entry and, when a
``checkpoint_at`` position falls inside the call, its cache entry as it was at that position (the
hybrid prefix cache's block-boundary entry, captured without a second pass). One
request at a time: no batch dimension, as in `testbed.kv.cache`.

Rule that makes caches exact: whatever a layer caches is rounded to its cache dtype where it is
produced (K, V, latent, RoPE key, conv inputs), and the layer computes with the rounded value. The
linear state is rounded to the state dtype at every absolute chunk boundary (a multiple of
``chunk_tokens``, which divides the 512-token prefix-cache block). A computation resumed from a stored
cache at such a boundary is therefore the same computation as one that never stopped.
"""

from __future__ import annotations

import functools
import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from testbed.kv.cache import LayerKV
from testbed.models.spec import GQALayer, LinearLayer, MLALayer, SWALayer

log = logging.getLogger(__name__)

ROPE_THETA = 10000.0
_ATTN_BLOCK_ELEMS = 1 << 22  # score elements per query block: bounds attention memory at long prompts
_LINEAR_SEGMENT_ELEMS = 1 << 22  # elements of a segment of linear-attention chunks computed at once
_LINEAR_SEGMENT_ACTIVATIONS = 1 << 19  # q/k/v elements of one token segment of a wide linear layer (cache-sized)
# The two linear-attention bounds above are sized for a CPU's caches. On an accelerator a segment is a few dozen
# kernel launches whatever its size, so CPU-sized segments would make a long prefill launch-bound (Kimi's
# faithful layers: a 64-token segment and one chunk per segment); there both bounds are this many times larger
# (a segment's q/k/v 128 MiB and its chunk batch 1 GiB in fp32 at most). Segments resume exactly, so only the
# time changes (docs/models.md, "Segment sizes on an accelerator").
ACCELERATOR_SEGMENT_SCALE = 64


def segment_scale(device: torch.device) -> int:
    """How many times the CPU-sized linear-attention bounds a call on `device` uses (1 on the CPU)."""
    return 1 if device.type == "cpu" else ACCELERATOR_SEGMENT_SCALE


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def make_param(gen: torch.Generator, shape: tuple[int, ...], std: float, device: torch.device) -> nn.Parameter:
    """Random weights drawn on the CPU from `gen`, so CPU and CUDA models from one seed are identical."""
    t = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
    return nn.Parameter(t.to(device), requires_grad=False)


def make_stacked_param(gen: torch.Generator, rows: list[tuple[int, float]], cols: int, device: torch.device) -> nn.Parameter:
    """Weight matrices ``[n_i, cols]`` drawn one after the other with std s_i (the values `make_param` gives
    each), stacked by rows into one, so projections of one input run as one matmul. Drawn into one CPU
    tensor: the device never holds the parts and the whole at once (the full variant's MLPs are large)."""
    t = torch.empty((sum(n for n, _ in rows), cols), dtype=torch.float32)
    at = 0
    for n, std in rows:
        t[at:at + n].normal_(0.0, std, generator=gen)
        at += n
    return nn.Parameter(t.to(device), requires_grad=False)


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dimension, weight-free: one dispatched operation (the fused
    `F.rms_norm`, bit-equal to the written-out form on CPU) instead of five, ~3 per layer on every call."""
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


@functools.lru_cache(maxsize=64)
def _rope_inv_freq(half: int, device: torch.device) -> torch.Tensor:
    return 1.0 / ROPE_THETA ** (torch.arange(half, dtype=torch.float32, device=device) / half)


@functools.lru_cache(maxsize=2)
def _rope_cos_sin(start: int, t: int, half: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[T, half]`` of positions start..start+T-1: the same for every layer of one call, so
    computed once a call instead of once a layer (five operations each). Two entries: one call's (a
    model has one RoPE width), and a long prompt's ``2 x T x half`` floats are not held past the next call."""
    pos = torch.arange(start, start + t, dtype=torch.float32, device=device)
    ang = pos[:, None] * _rope_inv_freq(half, device)[None, :]
    return ang.cos(), ang.sin()


def rope(x: torch.Tensor, start: int) -> torch.Tensor:
    """Rotary embedding (rotate-half) of ``x [T, ..., D]`` at positions start..start+T-1."""
    t, d = x.shape[0], x.shape[-1]
    half = d // 2
    cos, sin = _rope_cos_sin(start, t, half, x.device)
    if x.dim() > 2:
        cos, sin = cos.view(t, *([1] * (x.dim() - 2)), half), sin.view(t, *([1] * (x.dim() - 2)), half)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def rope_at(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`rope` of one token per row: ``x [B, ..., D]``, row b at position ``positions[b]`` (a decode batch)."""
    b, d = x.shape[0], x.shape[-1]
    half = d // 2
    ang = (positions.to(torch.float32)[:, None] * _rope_inv_freq(half, x.device)[None, :]).view(b, *([1] * (x.dim() - 2)), half)
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


# The CPU flash-attention kernel behind `scaled_dot_product_attention`, called directly where its
# log-sum-exp is needed: a private aten op, present in the pinned torch. Where a torch lacks it (or its
# signature or outputs changed) the masked path serves, correct but ~1.7x dearer per score; that is
# logged once (`_warn_flash_fallback`) and tests/unit/test_torch_model.py fails on the pinned torch.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_FALLBACK_WARNED = False


@functools.lru_cache(maxsize=16)
def _chunk_masks(chunk_tokens: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions after the query: bool upper triangle, identity) of one linear-attention chunk."""
    return (torch.ones(chunk_tokens, chunk_tokens, dtype=torch.bool, device=device).triu(1),
            torch.eye(chunk_tokens, dtype=dtype, device=device))


def _warn_flash_fallback(reason: str) -> None:
    """One warning per process that the prefix merge lost its fast kernel (the results stay exact)."""
    global _FLASH_FALLBACK_WARNED
    if not _FLASH_FALLBACK_WARNED:
        _FLASH_FALLBACK_WARNED = True
        log.warning("attention: aten._scaled_dot_product_flash_attention_for_cpu %s in torch %s; a prompt continuing a "
                    "cached prefix on CPU takes the masked path (same result, ~1.7x dearer per score; docs/models.md)",
                    reason, torch.__version__)


def _flash_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(output ``[1, H, T, W]``, log-sum-exp ``[1, H, T]``) from the CPU flash kernel, or None (warned once)
    when this torch does not have it, refuses the call, or returns another layout."""
    global _FLASH_CPU
    if _FLASH_CPU is None:
        _warn_flash_fallback("is not available")
        return None
    try:
        o, lse = _FLASH_CPU(q, k, v, 0.0, causal, scale=scale)[:2]
    except (RuntimeError, TypeError, ValueError) as exc:  # a changed signature: never again in this process
        _FLASH_CPU = None
        _warn_flash_fallback(f"failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
        return None
    if o.shape != q.shape[:-1] + v.shape[-1:] or lse.shape != q.shape[:-1]:
        _FLASH_CPU = None
        _warn_flash_fallback(f"returned shapes {tuple(o.shape)} / {tuple(lse.shape)}, not the output / log-sum-exp expected")
        return None
    return o, lse


def _attend_prompt(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, prefix: int, scale: float) -> torch.Tensor | None:
    """Queries that are the last T of the keys, head-major ``[1, H, T, W]`` / ``[1, H, S, W]``: one causal
    call without a prefix; with one, on CPU, the flash kernel on the prefix (unmasked) and on the prompt's
    own part (causal) merged by their log-sum-exps. None where that kernel cannot serve (the caller masks)."""
    if prefix == 0:
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)[0]
    if qh.device.type != "cpu" or qh.dtype not in (torch.float32, torch.float64, torch.bfloat16):
        return None
    pre = _flash_with_lse(qh, kh[:, :, :prefix], vh[:, :, :prefix], False, scale)
    own = _flash_with_lse(qh, kh[:, :, prefix:], vh[:, :, prefix:], True, scale) if pre is not None else None
    if own is None:
        return None
    (o_pre, lse_pre), (o_own, lse_own) = pre, own
    lse = torch.logaddexp(lse_pre, lse_own)
    return (o_pre * (lse_pre - lse).exp()[..., None] + o_own * (lse_own - lse).exp()[..., None])[0]


def short_conv(windows: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """The depthwise causal short conv: ``windows [..., C, K]`` (each output's K inputs, oldest first, a view)
    times the per-channel taps ``[C, K]``, summed: two operations whatever K, bit-equal to K shifted
    multiply-adds (the reduction adds the taps in order)."""
    return (windows * taps).sum(-1)


def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, k_start: int, window: int | None, scale: float) -> torch.Tensor:
    """Causal (optionally sliding-window) attention with grouped heads.

    ``q [T, KV, G, D]`` at positions q_start.., ``k [S, KV, D]``, ``v [S, KV, Dv]`` at positions
    k_start..; a query at p sees keys at p-window < pos <= p. Returns ``[T, KV, G, Dv]``.

    Runs `scaled_dot_product_attention` (the fused, memory-efficient kernel; on CPU the flash kernel,
    which needs one width for q, k and v: narrower ones are zero-padded, which changes no score and no
    output column). Queries that are the last T key positions (a prefill) need no mask: a prompt
    attending only to itself is one causal call (the kernel skips the masked half); one continuing a
    cached prefix is, on CPU, two calls of the flash kernel (the prefix unmasked, its own part causal)
    merged by their log-sum-exps, so it costs what its uncached suffix needs (T x prefix + T^2 / 2 score
    pairs; a boolean mask would cost about 1.7x more per score). Windows, single queries and other
    devices go in query blocks with a boolean mask, the group's heads folded into the query rows so keys
    are never copied per head. Memory stays bounded at long prompts either way.
    """
    t, kvh, g, d = q.shape
    s, dv = k.shape[0], v.shape[-1]
    width = d
    if d != dv:  # padding is needed anyway: a multiple of 8 vectorises best (measured: 16 beats 12)
        width = max(d, dv) + (-max(d, dv)) % 8
    kh, vh = _pad_last(k, width).transpose(0, 1), _pad_last(v, width).transpose(0, 1)  # [KV, S, W]
    qp = _pad_last(q, width)
    prefix = s - t
    if t > 1 and not window and q_start - k_start == prefix:
        qh = qp.reshape(t, kvh * g, width).transpose(0, 1)[None]  # [1, H, T, W]
        kr, vr = (kh.repeat_interleave(g, dim=0), vh.repeat_interleave(g, dim=0)) if g > 1 else (kh, vh)
        o = _attend_prompt(qh, kr[None], vr[None], prefix, scale)
        if o is not None:
            return o[..., :dv].transpose(0, 1).reshape(t, kvh, g, dv)
    qh = qp.permute(1, 2, 0, 3)  # [KV, G, T, W]
    out = q.new_empty((kvh, g, t, dv))
    block = max(1, min(t, _ATTN_BLOCK_ELEMS // max(1, s * g)))
    for b0 in range(0, t, block):
        b1 = min(t, b0 + block)
        hi = q_start + b1 - k_start  # keys after the last query of the block are never visible
        lo = max(0, q_start + b0 - window + 1 - k_start) if window else 0
        rows = qh[:, :, b0:b1].reshape(kvh, g * (b1 - b0), width)  # the group's heads folded into the rows
        mask = None
        if b1 - b0 > 1:  # a single query sees every key in [lo, hi): no mask needed
            qpos = torch.arange(q_start + b0, q_start + b1, device=q.device)
            kpos = torch.arange(k_start + lo, k_start + hi, device=q.device)
            visible = kpos[None, :] <= qpos[:, None]
            if window:
                visible &= kpos[None, :] > qpos[:, None] - window
            mask = visible.repeat(g, 1)  # rows are (head in group, query)
        o = F.scaled_dot_product_attention(rows[None], kh[None, :, lo:hi], vh[None, :, lo:hi], attn_mask=mask, scale=scale)[0]
        out[:, :, b0:b1] = o[..., :dv].view(kvh, g, b1 - b0, dv)
    return out.permute(2, 0, 1, 3)


# --------------------------------------------------------------------------------- linear attention


def linear_attention_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor | None,
    state: torch.Tensor, start: int, chunk_tokens: int, state_dtype: torch.dtype,
    checkpoint_at: int | None = None, checkpoint: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-wise gated delta rule (``beta`` given) or gated linear attention (``beta`` None).

    Head-major inputs: ``q, k [H, T, dk]``, ``v [H, T, dv]``, log-decay ``g [H, T]``, ``beta [H, T]``,
    ``state [H, dk, dv]``. Chunks are aligned to absolute positions. Within a chunk the delta rule's
    sequential updates are folded into a triangular solve (the WY form of DeltaNet / Gated DeltaNet).
    Everything that does not depend on the state entering a chunk (decays, the solve, U and W, the
    intra-chunk scores) is computed for a whole segment of chunks at once (bounded by
    `_LINEAR_SEGMENT_ELEMS`, `segment_scale` times it off the CPU), as flash-linear-attention does; only the chain of states runs chunk by
    chunk and the outputs ``Q e^G S + A V'`` are again batched. The chain is two fused multiply-adds a
    chunk (``V' = U - W S``, ``S = e^G S + Kd^T V'``) when the key width exceeds the chunk, else one
    (``S = M S + B``, ``M = e^G I - Kd^T W``): the extra dk x dk product costs nothing for a small
    state, where the per-operation overhead is the cost (the tiny variant's 8-token chunks). The state is rounded to `state_dtype` at every absolute
    chunk boundary, as the recurrence does. With `checkpoint_at` (an absolute chunk boundary inside the
    call) the state there is appended to `checkpoint` (the hybrid prefix cache's
    block-boundary state). Equals `linear_attention_recurrent` within float rounding (tested).
    """
    h, t, dk = q.shape
    dv = v.shape[-1]
    c = chunk_tokens
    lead = start % c  # the first chunk starts before `start`: those positions are padding
    n_chunks = -(-(lead + t) // c)
    tail = n_chunks * c - lead - t
    if lead or tail:  # padding is neutral: k = 0 writes nothing and log decay 0 keeps the state
        q, k, v = (F.pad(x, (0, 0, lead, tail)) for x in (q, k, v))
        g, beta = F.pad(g, (lead, tail)), (F.pad(beta, (lead, tail)) if beta is not None else None)
    qp, kp, vp = q.reshape(h, n_chunks, c, dk), k.reshape(h, n_chunks, c, dk), v.reshape(h, n_chunks, c, dv)
    gp = g.reshape(h, n_chunks, c)
    bp = beta.reshape(h, n_chunks, c, 1) if beta is not None else None
    upper, eye = _chunk_masks(c, q.device, q.dtype)
    outs = []
    per_chunk = h * (3 * c * c + dk * dk + 3 * c * (dk + dv) + 2 * dk * dv)
    seg = max(1, _LINEAR_SEGMENT_ELEMS * segment_scale(q.device) // per_chunk)
    first_pos = start - lead  # absolute position of the first (padded) chunk
    rounded = state_dtype != torch.float32
    two_step = bp is not None and dk > c
    for n0 in range(0, n_chunks, seg):
        n1 = min(n_chunks, n0 + seg)
        m = n1 - n0
        whole = m == n_chunks  # one segment (short calls): no slicing, no copy of the output
        qc, kc, vc, gc = (qp, kp, vp, gp) if whole else (qp[:, n0:n1], kp[:, n0:n1], vp[:, n0:n1], gp[:, n0:n1])
        bc = bp if whole or bp is None else bp[:, n0:n1]
        kc_t = kc.mT
        cum = gc.cumsum(-1)  # [H, m, c]
        e_cum = cum.exp()[..., None]
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # exp(G_i - G_j), j <= i
        last = cum[..., -1:]
        keep = last.exp()  # [H, m, 1]: the state's decay over the chunk
        kd_t = (kc * (last - cum).exp()[..., None]).mT  # each key decayed to the chunk's end, [H, m, dk, c]
        attn = (qc @ kc_t) * decay
        q_eff = qc * e_cum  # out = Q e^G S + A V'
        u = vc
        if bp is not None:
            kb = kc * bc
            # I + the strict lower triangle: the solve reads nothing else (unit diagonal), so no masking
            inv = torch.linalg.solve_triangular((kb @ kc_t) * decay, eye.expand(h, m, c, c), upper=False, unitriangular=True)
            u, w = inv @ (vc * bc), inv @ (kb * e_cum)
        adds = step = None
        if not two_step:  # S = M S + B with M = e^G I - Kd^T W, B = Kd^T U: one per chunk (a small state: per-op cost dominates)
            adds = kd_t @ u
            if bp is not None:
                step = -(kd_t @ w)
                step.diagonal(dim1=-2, dim2=-1).add_(keep)
                q_eff = q_eff - attn @ w  # out = (Q e^G - A W) S + A U
            else:
                step = keep[..., None]
        states, v_new = _state_chain(state, m, two_step, bp is not None, u, w if two_step else None, kd_t, keep, adds, step,
                                     first_pos + n0 * c, c, start + t, state_dtype if rounded else None, checkpoint_at, checkpoint)
        state = states[m].clone()
        outs.append(q_eff @ states[:m].transpose(0, 1) + attn @ (v_new.transpose(0, 1) if two_step else u))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return out.reshape(h, n_chunks * c, dv)[:, lead:lead + t], state


def _state_chain(state: torch.Tensor, m: int, two_step: bool, delta_rule: bool, u: torch.Tensor, w: torch.Tensor | None,
                 kd_t: torch.Tensor, keep: torch.Tensor, adds: torch.Tensor | None, step: torch.Tensor | None,
                 first_end: int, c: int, last_pos: int, round_to: torch.dtype | None, checkpoint_at: int | None,
                 checkpoint: list[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sequential part of `linear_attention_chunked`: the states entering each of m chunks (``[m + 1, H, dk,
    dv]``, the first is `state`) and, in the two-step form, ``V'`` (``[m, H, c, dv]``). Chunk j ends at absolute
    position ``first_end + (j + 1) c``; states at real boundaries (``<= last_pos``) are rounded to `round_to`,
    and the one at `checkpoint_at` is appended to `checkpoint`. A Python loop as long as the chunk count:
    benchmarks/compile_probe.py wraps it as one opaque operation so a compiled graph does not unroll it."""
    h, dk, dv = state.shape
    states = state.new_empty((m + 1, h, dk, dv))  # states[j]: entering chunk j
    states[0] = state
    sts = states.unbind(0)
    v_new = None
    if two_step:  # V' = U - W S, then S = e^G S + Kd^T V': two multiply-adds a chunk, no dk x dk matrix
        v_new = u.new_empty((m, h, c, dv))
        vns, us, ws, kds, keeps = v_new.unbind(0), u.unbind(1), w.unbind(1), kd_t.unbind(1), keep[..., None].unbind(1)
    else:
        adds_j, steps = adds.unbind(1), step.unbind(1)
    # the sequential chain (unbind makes every chunk's views in one call: indexing costs ~1 us each)
    for j in range(m):
        if two_step:
            torch.baddbmm(us[j], ws[j], sts[j], alpha=-1.0, out=vns[j])  # v - what the state already predicts
            torch.baddbmm(sts[j] * keeps[j], kds[j], vns[j], out=sts[j + 1])
        elif delta_rule:
            torch.baddbmm(adds_j[j], steps[j], sts[j], out=sts[j + 1])
        else:
            torch.addcmul(adds_j[j], sts[j], steps[j], out=sts[j + 1])
        end = first_end + (j + 1) * c
        if end <= last_pos:  # a real chunk boundary (a trailing padded chunk has none)
            if round_to is not None:
                sts[j + 1].copy_(sts[j + 1].to(round_to))
            if checkpoint is not None and end == checkpoint_at:
                checkpoint.append(sts[j + 1].to(round_to or sts[j + 1].dtype, copy=True))
    return states, v_new


def linear_attention_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor | None,
    state: torch.Tensor, start: int, chunk_tokens: int, state_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same layer token by token: the decode path, and the reference the chunked form must equal."""
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))
    for i in range(q.shape[1]):
        state = state * g[:, i].exp()[:, None, None]
        kt = k[:, i]
        if beta is not None:
            mem = torch.einsum("hk,hkv->hv", kt, state)
            delta = (v[:, i] - mem) * beta[:, i, None]
        else:
            delta = v[:, i]
        state = state + kt[:, :, None] * delta[:, None, :]
        out[:, i] = torch.einsum("hk,hkv->hv", q[:, i], state)
        if (start + i + 1) % chunk_tokens == 0:
            state = state.to(state_dtype).float()
    return out, state


class LinearMixer(nn.Module):
    """KDA / Gated DeltaNet (``rule: delta``) or Lightning (``rule: decay``) with an optional short conv.

    Simplification: the decay gate is one scalar per head and token (GDN style); KDA's channel-wise gate
    changes nothing in the cache geometry. q and k are L2-normalised, as in GDN and KDA.
    """

    def __init__(self, spec: LinearLayer, layer_index: int, hidden: int, n_layers: int, chunk_tokens: int,
                 kv_dtype: str, state_dtype: str, gen: torch.Generator, device: torch.device) -> None:
        super().__init__()
        self.spec, self.layer_index, self.chunk_tokens = spec, layer_index, chunk_tokens
        self.kv_dtype, self.state_dtype = torch_dtype(kv_dtype), torch_dtype(state_dtype)
        h, hk, dk, dv = spec.heads, spec.qk_heads, spec.key_dim, spec.value_dim
        self.widths = (hk * dk, hk * dk, h * dv)
        w_qkv = make_param(gen, (sum(self.widths), hidden), hidden**-0.5, device)
        if spec.conv_kernel:
            self.w_conv = make_param(gen, (spec.conv_channels, spec.conv_kernel), spec.conv_kernel**-0.5, device)
        if spec.rule == "delta":  # q/k/v, the decay gate and the write strength: one projection (rows in that order)
            w_decay = make_param(gen, (h, hidden), 0.1 * hidden**-0.5, device)
            w_beta = make_param(gen, (h, hidden), hidden**-0.5, device)
            self.w_in = nn.Parameter(torch.cat((w_qkv, w_decay, w_beta)), requires_grad=False)
            self.in_widths = (sum(self.widths), h, h)
        else:  # Lightning: fixed ALiBi-style decay slope per head
            self.w_in, self.in_widths = w_qkv, (sum(self.widths),)
            slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], dtype=torch.float32)
            self.register_buffer("neg_slopes", -slopes.to(device), persistent=False)
        self.w_o = make_param(gen, (hidden, h * dv), (h * dv) ** -0.5 / math.sqrt(2 * n_layers), device)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(q/k/v before the conv, decay-gate logits, write-strength logits; the last two None for `decay`)."""
        z = F.linear(x, self.w_in)
        if len(self.in_widths) == 1:
            return z, None, None
        return z.split(self.in_widths, dim=-1)

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token-major q, k (L2-normalised, q scaled, repeated to every value head) and v: ``[T, H, d]``."""
        sp = self.spec
        t, h, hk, dk = qkv.shape[0], sp.heads, sp.qk_heads, sp.key_dim
        act = F.silu(qkv)
        qk = act[:, :2 * hk * dk].reshape(t, 2 * hk, dk)  # q and k normalised together (F.normalize, written out)
        qk = qk / torch.linalg.vector_norm(qk, dim=-1, keepdim=True).clamp_min(1e-12)
        q, k, v = qk[:, :hk] * dk**-0.5, qk[:, hk:], act[:, 2 * hk * dk:]
        if h != hk:
            q, k = q.repeat_interleave(h // hk, dim=1), k.repeat_interleave(h // hk, dim=1)
        return q, k, v.reshape(t, h, sp.value_dim)

    def forward(self, x: torch.Tensor, start: int, prev: LayerKV | None, recurrent: bool = False,
                checkpoint_at: int | None = None) -> tuple[torch.Tensor, LayerKV, LayerKV | None]:
        """A long call runs in chunk-aligned token segments whose q/k/v activations stay within
        `_LINEAR_SEGMENT_ACTIVATIONS` elements (cache-sized on the CPU, `segment_scale` times more on an accelerator;
        wide layers only): each segment resumes from
        the previous one's cache entry exactly as from a prefix cache, so the result is the same."""
        t = x.shape[0]
        seg = max(1, _LINEAR_SEGMENT_ACTIVATIONS * segment_scale(x.device) // sum(self.widths) // self.chunk_tokens) * self.chunk_tokens
        if recurrent or t <= seg:
            return self._forward(x, start, prev, recurrent, checkpoint_at)
        ys, kv, ckpt, pos = [], prev, None, start
        while pos < start + t:
            end = min(start + t, (pos // seg + 1) * seg)
            y, kv, got = self._forward(x[pos - start:end - start], pos, kv, False, checkpoint_at)
            ys.append(y)
            ckpt = ckpt if got is None else got
            pos = end
        return torch.cat(ys), kv, ckpt

    def _forward(self, x: torch.Tensor, start: int, prev: LayerKV | None, recurrent: bool,
                 checkpoint_at: int | None) -> tuple[torch.Tensor, LayerKV, LayerKV | None]:
        sp = self.spec
        t = x.shape[0]
        h, dk, dv = sp.heads, sp.key_dim, sp.value_dim
        at = checkpoint_at - start if checkpoint_at is not None and start < checkpoint_at <= start + t else None
        qkv, decay, write = self._project(x)
        conv_state = conv_at = None  # conv_at: the conv inputs at the checkpoint (layers with a short conv)
        if sp.conv_kernel:
            qkv = qkv.to(self.kv_dtype)
            before = prev.tensors["conv"].to(x.device) if prev else qkv.new_zeros((sp.conv_kernel - 1, sp.conv_channels))
            seq = torch.cat((before, qkv), dim=0)
            conv_state = seq[-(sp.conv_kernel - 1):].clone()
            conv_at = seq[at:at + sp.conv_kernel - 1].clone() if at is not None else None
            qkv = short_conv(seq.float().unfold(0, sp.conv_kernel, 1), self.w_conv)  # [T, C, K] windows
        q, k, v = (z.transpose(0, 1).contiguous() for z in self._heads(qkv))
        if sp.rule == "delta":
            g = F.logsigmoid(decay + 3.0).T  # per-token log decay, about -0.05
            beta = torch.sigmoid(write).T
        else:
            g = self.neg_slopes[:, None].expand(h, t)
            beta = None
        state = prev.tensors["state"].to(x.device, torch.float32) if prev else x.new_zeros((h, dk, dv))
        saved: list[torch.Tensor] = []
        if recurrent:
            o, state = linear_attention_recurrent(q, k, v, g, beta, state, start, self.chunk_tokens, self.state_dtype)
        else:
            o, state = linear_attention_chunked(q, k, v, g, beta, state, start, self.chunk_tokens, self.state_dtype,
                                                checkpoint_at, saved if at is not None else None)
        y = F.linear(rms_norm(o.transpose(0, 1)).reshape(t, h * dv), self.w_o)
        tensors = {"state": state.to(self.state_dtype).contiguous()}
        if conv_state is not None:
            tensors["conv"] = conv_state
        ckpt = None
        if saved:
            ckpt = LayerKV(self.layer_index, "linear", {"state": saved[0].contiguous(), **({"conv": conv_at} if conv_at is not None else {})})
        return y, LayerKV(self.layer_index, "linear", tensors), ckpt


    def decode_batch(self, x: torch.Tensor, starts: list[int], prevs: list[LayerKV]) -> tuple[torch.Tensor, list[LayerKV]]:
        """One decode step for B requests (``x [B, hidden]``, request i at position ``starts[i]`` with its own
        cache entry): the projections, the conv and the recurrent state update run on the whole batch."""
        sp = self.spec
        b = x.shape[0]
        h, dv = sp.heads, sp.value_dim
        qkv, decay, write = self._project(x)
        conv_states: list[torch.Tensor | None] = [None] * b
        if sp.conv_kernel:
            qkv = qkv.to(self.kv_dtype)
            before = torch.stack([p.tensors["conv"].to(x.device) for p in prevs])  # [B, K-1, C]
            seq = torch.cat((before, qkv[:, None, :]), dim=1)  # [B, K, C]
            conv_states = [seq[i, 1:].clone() for i in range(b)]
            qkv = short_conv(seq.float().transpose(1, 2), self.w_conv)  # [B, C, K] windows
        q, k, v = self._heads(qkv)
        state = torch.stack([p.tensors["state"].to(x.device, torch.float32) for p in prevs])  # [B, H, dk, dv]
        if sp.rule == "delta":
            state = state * F.logsigmoid(decay + 3.0).exp()[:, :, None, None]
            mem = torch.einsum("bhk,bhkv->bhv", k, state)
            delta = (v - mem) * torch.sigmoid(write)[..., None]
        else:
            state = state * self.neg_slopes.exp()[None, :, None, None]
            delta = v
        state = state + k[..., None] * delta[..., None, :]
        o = torch.einsum("bhk,bhkv->bhv", q, state)
        y = F.linear(rms_norm(o).reshape(b, h * dv), self.w_o)
        out = []
        for i in range(b):
            st = state[i]
            if (starts[i] + 1) % self.chunk_tokens == 0:  # the same rounding as the sequential path
                st = st.to(self.state_dtype).float()
            tensors = {"state": st.to(self.state_dtype).contiguous()}
            if conv_states[i] is not None:
                tensors["conv"] = conv_states[i]
            out.append(LayerKV(self.layer_index, "linear", tensors))
        return y, out


# ---------------------------------------------------------------------------------- attention


class GQAMixer(nn.Module):
    """Full attention with grouped KV heads and RoPE; with a window it is SWA and keeps only the window."""

    def __init__(self, spec: GQALayer, layer_index: int, hidden: int, n_layers: int, q_per_kv: int,
                 kv_dtype: str, gen: torch.Generator, device: torch.device) -> None:
        super().__init__()
        self.spec, self.layer_index, self.q_per_kv = spec, layer_index, q_per_kv
        self.kv_dtype = torch_dtype(kv_dtype)
        self.window = spec.window if isinstance(spec, SWALayer) else None
        kvh, dk, dv = spec.kv_heads, spec.k_head_dim, spec.v_head_dim
        self.w_q = make_param(gen, (kvh * q_per_kv * dk, hidden), hidden**-0.5, device)
        self.w_k = make_param(gen, (kvh * dk, hidden), hidden**-0.5, device)
        self.w_v = make_param(gen, (kvh * dv, hidden), hidden**-0.5, device)
        self.w_o = make_param(gen, (hidden, kvh * q_per_kv * dv), (kvh * q_per_kv * dv) ** -0.5 / math.sqrt(2 * n_layers), device)

    def forward(self, x: torch.Tensor, start: int, prev: LayerKV | None, recurrent: bool = False,
                checkpoint_at: int | None = None) -> tuple[torch.Tensor, LayerKV, LayerKV | None]:
        sp = self.spec
        t = x.shape[0]
        kvh, dk, dv = sp.kv_heads, sp.k_head_dim, sp.v_head_dim
        q = rope(F.linear(x, self.w_q).view(t, kvh, self.q_per_kv, dk), start)
        k = rope(F.linear(x, self.w_k).view(t, kvh, dk), start).to(self.kv_dtype)
        v = F.linear(x, self.w_v).view(t, kvh, dv).to(self.kv_dtype)
        if prev is not None:
            k = torch.cat((prev.tensors["k"].to(x.device), k), dim=0)
            v = torch.cat((prev.tensors["v"].to(x.device), v), dim=0)
        k_start = start + t - k.shape[0]
        o = attend(q, k.float(), v.float(), start, k_start, self.window, dk**-0.5)
        y = F.linear(o.reshape(t, -1), self.w_o)
        ckpt = None
        if checkpoint_at is not None and start < checkpoint_at <= start + t:  # the cache as it was at that position
            hi = checkpoint_at - k_start
            lo = max(0, hi - self.window) if self.window is not None else 0
            ckpt = LayerKV(self.layer_index, sp.kind, {"k": k[lo:hi], "v": v[lo:hi]})
        if self.window is not None and k.shape[0] > self.window:
            k, v = k[-self.window:].clone(), v[-self.window:].clone()
        return y, LayerKV(self.layer_index, sp.kind, {"k": k.contiguous(), "v": v.contiguous()}), ckpt

    def decode_batch(self, x: torch.Tensor, starts: list[int], prevs: list[LayerKV]) -> tuple[torch.Tensor, list[LayerKV]]:
        """One decode step for B requests: projections on the batch, attention per request over its own cache."""
        sp = self.spec
        kvh, dk, dv = sp.kv_heads, sp.k_head_dim, sp.v_head_dim
        qs, ks, vs = (x @ self.w_q.T), (x @ self.w_k.T), (x @ self.w_v.T)
        outs, layers = [], []
        for i, (start, prev) in enumerate(zip(starts, prevs)):
            q = rope(qs[i:i + 1].view(1, kvh, self.q_per_kv, dk), start)
            k = torch.cat((prev.tensors["k"].to(x.device), rope(ks[i:i + 1].view(1, kvh, dk), start).to(self.kv_dtype)), dim=0)
            v = torch.cat((prev.tensors["v"].to(x.device), vs[i:i + 1].view(1, kvh, dv).to(self.kv_dtype)), dim=0)
            outs.append(attend(q, k.float(), v.float(), start, start + 1 - k.shape[0], self.window, dk**-0.5).reshape(1, -1))
            if self.window is not None and k.shape[0] > self.window:
                k, v = k[-self.window:].clone(), v[-self.window:].clone()
            layers.append(LayerKV(self.layer_index, sp.kind, {"k": k.contiguous(), "v": v.contiguous()}))
        return torch.cat(outs) @ self.w_o.T, layers


class MLAMixer(nn.Module):
    """Multi-head latent attention caching only the normalised latent and the shared RoPE key.

    Prefill expands the latent to per-head keys and values; decode (few query tokens) uses the
    absorbed form, attending over the latent directly: the same scores at a fraction of the work.
    """

    ABSORB_MAX_TOKENS = 16

    def __init__(self, spec: MLALayer, layer_index: int, hidden: int, n_layers: int, heads: int, nope_dim: int,
                 v_dim: int, kv_dtype: str, gen: torch.Generator, device: torch.device) -> None:
        super().__init__()
        self.spec, self.layer_index = spec, layer_index
        self.heads, self.nope_dim, self.v_dim = heads, nope_dim, v_dim
        self.kv_dtype = torch_dtype(kv_dtype)
        r, dr = spec.kv_lora_rank, spec.rope_dim
        self.w_q = make_param(gen, (heads * (nope_dim + dr), hidden), hidden**-0.5, device)
        self.w_dkv = make_param(gen, (r, hidden), hidden**-0.5, device)
        self.w_kr = make_param(gen, (dr, hidden), hidden**-0.5, device)
        self.w_uk = make_param(gen, (heads * nope_dim, r), r**-0.5, device)
        self.w_uv = make_param(gen, (heads * v_dim, r), r**-0.5, device)
        self.w_o = make_param(gen, (hidden, heads * v_dim), (heads * v_dim) ** -0.5 / math.sqrt(2 * n_layers), device)

    def forward(self, x: torch.Tensor, start: int, prev: LayerKV | None, recurrent: bool = False,
                checkpoint_at: int | None = None) -> tuple[torch.Tensor, LayerKV, LayerKV | None]:
        t = x.shape[0]
        nh, dn, dvh = self.heads, self.nope_dim, self.v_dim
        r, dr = self.spec.kv_lora_rank, self.spec.rope_dim
        latent = rms_norm(F.linear(x, self.w_dkv)).to(self.kv_dtype)
        k_rope = rope(F.linear(x, self.w_kr), start).to(self.kv_dtype)
        if prev is not None:
            latent = torch.cat((prev.tensors["latent"].to(x.device), latent), dim=0)
            k_rope = torch.cat((prev.tensors["k_rope"].to(x.device), k_rope), dim=0)
        s = latent.shape[0]
        lat, kr = latent.float(), k_rope.float()
        q = F.linear(x, self.w_q).view(t, nh, dn + dr)
        q_nope, q_rope = q[..., :dn], rope(q[..., dn:], start)
        scale = (dn + dr) ** -0.5
        k_start = start + t - s
        if t <= self.ABSORB_MAX_TOKENS:
            q_lat = torch.einsum("thn,hnr->thr", q_nope, self.w_uk.view(nh, dn, r))
            qq = torch.cat((q_lat, q_rope), dim=-1).view(t, 1, nh, r + dr)
            kk = torch.cat((lat, kr), dim=-1).view(s, 1, r + dr)
            o_lat = attend(qq, kk, lat.view(s, 1, r), start, k_start, None, scale).reshape(t, nh, r)
            o = torch.einsum("thr,hvr->thv", o_lat, self.w_uv.view(nh, dvh, r))
        else:
            k_nope = F.linear(lat, self.w_uk).view(s, nh, dn)
            kk = torch.cat((k_nope, kr[:, None, :].expand(s, nh, dr)), dim=-1)
            vv = F.linear(lat, self.w_uv).view(s, nh, dvh)
            qq = torch.cat((q_nope, q_rope), dim=-1).view(t, nh, 1, dn + dr)
            o = attend(qq, kk, vv, start, k_start, None, scale).reshape(t, nh, dvh)
        y = F.linear(o.reshape(t, nh * dvh), self.w_o)
        ckpt = None
        if checkpoint_at is not None and start < checkpoint_at <= start + t:
            ckpt = LayerKV(self.layer_index, "mla", {"latent": latent[:checkpoint_at - k_start], "k_rope": k_rope[:checkpoint_at - k_start]})
        return y, LayerKV(self.layer_index, "mla", {"latent": latent.contiguous(), "k_rope": k_rope.contiguous()}), ckpt

    def decode_batch(self, x: torch.Tensor, starts: list[int], prevs: list[LayerKV]) -> tuple[torch.Tensor, list[LayerKV]]:
        """One decode step for B requests in one pass: the absorbed form over every request's latent cache,
        padded to the longest and masked (each request sees only its own positions)."""
        b = x.shape[0]
        nh, dn, dvh = self.heads, self.nope_dim, self.v_dim
        r, dr = self.spec.kv_lora_rank, self.spec.rope_dim
        pos = torch.tensor(starts, device=x.device)
        latents = rms_norm(x @ self.w_dkv.T).to(self.kv_dtype)
        k_ropes = rope_at(x @ self.w_kr.T, pos).to(self.kv_dtype)
        q = (x @ self.w_q.T).view(b, nh, dn + dr)
        q_lat = torch.einsum("bhn,hnr->bhr", q[..., :dn], self.w_uk.view(nh, dn, r))
        q_rope = rope_at(q[..., dn:], pos)
        layers, lats, krs = [], [], []
        for i, prev in enumerate(prevs):
            latent = torch.cat((prev.tensors["latent"].to(x.device), latents[i:i + 1]), dim=0)
            k_rope = torch.cat((prev.tensors["k_rope"].to(x.device), k_ropes[i:i + 1]), dim=0)
            layers.append(LayerKV(self.layer_index, "mla", {"latent": latent, "k_rope": k_rope}))
            lats.append(latent)
            krs.append(k_rope)
        lat = torch.nn.utils.rnn.pad_sequence(lats, batch_first=True).float()  # [B, S_max, r]
        kr = torch.nn.utils.rnn.pad_sequence(krs, batch_first=True).float()
        lengths = torch.tensor([t.shape[0] for t in lats], device=x.device)
        visible = torch.arange(lat.shape[1], device=x.device)[None, :] < lengths[:, None]  # [B, S_max]
        scores = (torch.einsum("bhr,bsr->bhs", q_lat, lat) + torch.einsum("bhd,bsd->bhs", q_rope, kr)) * (dn + dr) ** -0.5
        p = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(dim=-1)
        o = torch.einsum("bhr,hvr->bhv", torch.einsum("bhs,bsr->bhr", p, lat), self.w_uv.view(nh, dvh, r))
        return o.reshape(b, nh * dvh) @ self.w_o.T, layers


class Block(nn.Module):
    """Pre-norm residual block: mixer, then a SwiGLU MLP."""

    def __init__(self, mixer: nn.Module, hidden: int, mlp: int, n_layers: int, gen: torch.Generator, device: torch.device) -> None:
        super().__init__()
        self.mixer = mixer
        self.w_gate_up = make_stacked_param(gen, [(mlp, hidden**-0.5), (mlp, hidden**-0.5)], hidden, device)  # then halves
        self.w_down = make_param(gen, (hidden, mlp), mlp**-0.5 / math.sqrt(2 * n_layers), device)

    def forward(self, x: torch.Tensor, start: int, prev: LayerKV | None, recurrent: bool = False,
                checkpoint_at: int | None = None) -> tuple[torch.Tensor, LayerKV, LayerKV | None]:
        y, kv, ckpt = self.mixer.forward(rms_norm(x), start, prev, recurrent, checkpoint_at)  # no hooks: skip __call__
        x = x + y
        return x + self.mlp(rms_norm(x)), kv, ckpt

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(h, self.w_gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w_down)

    def decode_batch(self, x: torch.Tensor, starts: list[int], prevs: list[LayerKV]) -> tuple[torch.Tensor, list[LayerKV]]:
        """`forward` for one decode step of B requests (``x [B, hidden]``), each with its own cache entry."""
        y, kvs = self.mixer.decode_batch(rms_norm(x), starts, prevs)
        x = x + y
        return x + self.mlp(rms_norm(x)), kvs
