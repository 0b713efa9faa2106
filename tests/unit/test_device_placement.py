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
