"""The model's forward paths keep every tensor on the model's device (what CUDA needs), checked without a GPU:
on torch's `meta` device a tensor made without ``device=`` (on the CPU) and combined with the model's raises
"Expected all tensors to be on the same device" as it would on CUDA. Shapes only: nothing is computed, and
data-dependent steps (`HybridModel._ids` reads token ids with .min()) are stepped around."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from testbed.kv.cache import KVCache
from testbed.models.torch_model import VARIANTS, HybridModel, tiny_spec

sys.path.insert(0, str(Path(__file__).parent))
from model_factory import HYBRID, small_spec  # noqa: E402

META = torch.device("meta")


class OneDevice(TorchDispatchMode):
    """Fails an operation that mixes the model's meta tensors with tensors elsewhere (a 0-dim CPU tensor, a
    scalar, is allowed: CUDA accepts those too). Not every operation checks devices on meta by itself:
    elementwise ones, `cat` and `where` raise, but matmuls (`@`, `bmm`, `einsum`, `F.linear`, `addmm`) and
    `solve_triangular` pass a CPU operand silently, where CUDA would raise."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        devices = {t.device.type for t in tensors if t.dim() > 0}
        if "meta" in devices and len(devices) > 1:
            shapes = [(t.device.type, tuple(t.shape)) for t in tensors]
            raise AssertionError(f"{func}: tensors on {sorted(devices)} in one operation: {shapes}")
        return func(*args, **kwargs)


def meta_model(variant: str) -> HybridModel:
    spec = small_spec(HYBRID)
    v = VARIANTS[variant]
    return HybridModel(tiny_spec(spec) if v.shrink_cache else spec, v, 0, META, spec).eval()


@pytest.mark.parametrize("variant", ["tiny", "faithful"])
def test_prefill_resume_decode_and_batched_decode_stay_on_the_models_device(variant: str) -> None:
    m = meta_model(variant)
    at = 2 * m.variant.chunk_tokens  # a linear chunk boundary inside the prompt: a checkpoint is taken
    n = at + 5
    with torch.no_grad(), OneDevice():
        logits, layers, ckpt = m._run(torch.zeros(n, dtype=torch.long, device=META), None, False, None, at)
        assert logits.device == META and len(ckpt) == len(layers)
        cache, checkpoint = KVCache("r", m.spec.name, n, layers), KVCache("r", m.spec.name, at, ckpt)
        assert all(t.device == META for layer in layers + ckpt for t in layer.tensors.values())
        m._run(torch.zeros(7, dtype=torch.long, device=META), checkpoint, False, None)  # a prefix hit, resumed
        m._run(torch.zeros(1, dtype=torch.long, device=META), cache, True, None)  # a decode step
        x = m.embed[torch.zeros(2, dtype=torch.long, device=META)]  # decode_batch of two requests, other lengths
        for i, block in enumerate(m.blocks):
            x, kvs = block.decode_batch(x, [n, at], [cache.layers[i], checkpoint.layers[i]])
            assert all(t.device == META for kv in kvs for t in kv.tensors.values())


def test_an_accelerator_runs_a_long_linear_call_in_few_segments_the_cpu_in_cache_sized_ones(monkeypatch) -> None:
    """Kimi's faithful linear layers (q/k/v 12,288 wide): a 4,096-token call on the CPU runs in 64-token segments
    (64 calls, each a few dozen operations), which on a GPU would be kernel launches, not compute; off the CPU
    the bound is `ACCELERATOR_SEGMENT_SCALE` times larger: 2 segments of up to 2,688 tokens."""
    import testbed.models.layers as layers
    from testbed.models.spec import load_model_spec

    spec = load_model_spec("kimi-linear-48b")
    v = VARIANTS["faithful"]
    m = HybridModel(tiny_spec(spec) if v.shrink_cache else spec, v, 0, META, spec).eval()
    mixer = next(b.mixer for b in m.blocks if isinstance(b.mixer, layers.LinearMixer))
    assert sum(mixer.widths) == 12288 and mixer.chunk_tokens == 64
    assert layers.segment_scale(torch.device("cpu")) == 1 and layers.segment_scale(META) == layers.ACCELERATOR_SEGMENT_SCALE
    calls: list[int] = []
    forward = mixer._forward
    monkeypatch.setattr(mixer, "_forward", lambda *a: calls.append(a[1]) or forward(*a))
    x = torch.zeros(4096, m.hidden_size, device=META)
    with torch.no_grad():
        y = mixer(x, 0, None)[0]
        assert calls == [0, 2688] and y.shape == x.shape
        calls.clear()
        monkeypatch.setattr(layers, "segment_scale", lambda device: 1)  # the CPU's sizing
        mixer(x, 0, None)
    assert calls == list(range(0, 4096, 64))


class CountsOnHost(OneDevice):
    """`OneDevice`, plus the one data-dependent step of the MoE's routing: `bincount` (whose `.tolist()` sizes each
    expert's rows) answers with real counts on the CPU -- every token's k choices spread over the first experts --
    so the routing, gathers and `index_add_` that follow run on meta shapes."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.bincount.default:
            flat, minlength = args[0], (kwargs or {}).get("minlength", args[2] if len(args) > 2 else 0)
            counts = torch.zeros(max(minlength, 1), dtype=torch.long)
            counts[: min(3, len(counts))] += flat.numel() // min(3, len(counts))
            counts[0] += flat.numel() - int(counts.sum())
            return counts
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_the_full_variants_moe_blocks_stay_on_the_models_device() -> None:
    """The `full` variant's mixture of experts (routed experts, shared expert, the leading dense-MLP layer) on meta:
    prefill, a decode step and a batched decode, as above."""
    from testbed.models.full import FullModel, MoE, MoEBlock, Widths

    spec = small_spec(HYBRID)
    w = Widths(source="test", hidden=32, vocab=128, attention_heads=4, experts=6, top_k=2, expert_mlp=16, shared_mlp=16,
               dense_mlp=48, dense_layers=1)
    m = FullModel(spec, w, 0, META, spec, list(range(len(spec.layers)))).eval()
    kinds = [type(b).__name__ for b in m.blocks]
    assert kinds[0] == "Block" and all(isinstance(b, MoEBlock) for b in m.blocks[1:])
    assert all(isinstance(b.moe, MoE) and b.moe.shared is not None for b in m.blocks[1:])
    n = 9
    with torch.no_grad(), CountsOnHost():
        logits, layers, _ = m._run(torch.zeros(n, dtype=torch.long, device=META), None, False, None)
        assert logits.device == META and all(t.device == META for layer in layers for t in layer.tensors.values())
        cache = KVCache("r", m.spec.name, n, layers)
        m._run(torch.zeros(1, dtype=torch.long, device=META), cache, True, None)
        x = m.embed[torch.zeros(2, dtype=torch.long, device=META)]
        for i, block in enumerate(m.blocks):
            x, kvs = block.decode_batch(x, [n + 1, n + 1], [cache.layers[i], cache.layers[i]])
        assert x.device == META


def test_a_cpu_tensor_inside_the_moe_is_caught(monkeypatch) -> None:
    """The check above can fail: an MoE that builds its output on the CPU (no ``device=``) is refused."""
    from testbed.models.full import MoE, Widths

    w = Widths(source="test", hidden=32, vocab=128, attention_heads=4, experts=6, top_k=2, expert_mlp=16)
    moe = MoE(32, w, 4, torch.Generator().manual_seed(0), META)
    monkeypatch.setattr(torch, "zeros_like", lambda h: torch.zeros(h.shape, dtype=h.dtype))  # on the CPU
    with torch.no_grad(), CountsOnHost(), pytest.raises(AssertionError, match="tensors on \\['cpu', 'meta'\\]"):
        moe(torch.zeros(5, 32, device=META))
