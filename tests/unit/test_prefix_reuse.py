"""Prefix reuse in torch mode (issue 12 item 1): a prefill resumes from its pool's block-boundary cache
(linear state + full-attention KV) and computes only the suffix; the decode is sent only what it lacks.
Tokens and tensors equal those of a full prefill; profile mode charges the same bytes."""

from __future__ import annotations

import time

import pytest
import torch

from testbed.kv.pool import HybridPrefixPool
from testbed.models.spec import load_model_spec
from testbed.models.torch_model import build_model
from testbed.serving.compute import (PrefillPlan, ProfileCompute, TorchCompute, delta_layer_bytes, join_prefix)
from testbed.serving.worker import WorkerConfig

BLOCK = 512


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def worker_cfg(name: str, compute: str = "torch", variant: str = "tiny") -> WorkerConfig:
    return WorkerConfig(role="prefill", instance=0, cluster="prfaas", host="lo", port=0, compute=compute,
                        model={"name": name, "compute": compute, "variant": variant}, variant=variant, seed=3,
                        device="cpu", profile="h200-paper-1t-hybrid", scale=1.0)


# linear+MLA state; SWA window + GQA; Lightning linear layers without a short conv (their checkpoint once raised
# UnboundLocalError: the conv inputs at the checkpoint exist only where there is a conv)
@pytest.mark.parametrize("name", ["kimi-linear-48b", "mimo-v2-flash", "ring-2.5-1t"])
def test_the_block_boundary_checkpoint_equals_a_prefill_that_stopped_there(name: str) -> None:
    model = build_model(load_model_spec(name), "tiny", seed=1, device="cpu")
    ids = prompt(40, model.vocab_size, 0)
    _, whole, ckpt = model.prefill_checkpointed(ids, None, 32)
    _, stopped = model.prefill(ids[:32])
    assert ckpt is not None and ckpt.tokens == 32 and whole.tokens == 40
    for a, b in zip(ckpt.layers, stopped.layers):
        assert a.kind == b.kind and list(a.tensors) == list(b.tensors)
        for k in a.tensors:
            assert a.tensors[k].shape == b.tensors[k].shape and torch.equal(a.tensors[k], b.tensors[k]), (a.kind, k)
    if any(layer.kind == "linear" for layer in model.spec.layers):  # linear state exists only at chunk boundaries
        assert model.prefill_checkpointed(ids, None, 30)[2] is None


def run_prefill(comp: TorchCompute, plan: PrefillPlan, ids: list[int]):
    layers = []
    out = comp.prefill("r", plan, ids, layers.append)
    return out, layers


@pytest.mark.parametrize("name", ["kimi-linear-48b", "mimo-v2-flash"])
def test_a_prefill_resumed_from_the_pool_sends_what_a_full_prefill_sends_and_decodes_the_same_tokens(name: str) -> None:
    comp = TorchCompute(worker_cfg(name))
    vocab = comp.model.vocab_size
    shared = prompt(BLOCK, vocab, 1)
    a = shared + prompt(90, vocab, 2)
    b = shared + prompt(150, vocab, 3)
    pool = HybridPrefixPool(1 << 30, BLOCK, store_tensors=True, hybrid=comp.model.spec.kv_bytes(BLOCK).fixed_state_bytes > 0
                            or comp.model.spec.kv_bytes(BLOCK).window_bytes > 0)
    hashes_a, hashes_b = [7, 8], [7, 9]
    out_a, _ = run_prefill(comp, PrefillPlan(len(a), 0, 0, BLOCK), a)
    pool.insert(hashes_a, out_a.checkpoint)
    hit = pool.match(hashes_b, max_tokens=len(b) - 1, acquire=True)
    assert hit.tokens == BLOCK and hit.cache is not None
    resumed, resumed_layers = run_prefill(comp, PrefillPlan(len(b), BLOCK, 0, None, hit.cache), b)
    full, full_layers = run_prefill(comp, PrefillPlan(len(b)), b)
    pool.release(hit)
    assert resumed.tokens == full.tokens == len(b) - 1
    for x, y in zip(resumed_layers, full_layers):
        for k in x.tensors:
            assert x.tensors[k].shape == y.tensors[k].shape
            assert torch.allclose(x.tensors[k].float(), y.tensors[k].float(), atol=2e-2, rtol=0), (x.kind, k)
    # the decode: its own pool holds the shared block, so it is sent only the rest and joins the two
    dpool = HybridPrefixPool(1 << 30, BLOCK, store_tensors=True, hybrid=False)
    dpool.insert(hashes_a, join_prefix(None, _cache(out_a.tokens, run_prefill(comp, PrefillPlan(len(a)), a)[1])))
    dhit = dpool.match(hashes_b, max_tokens=len(b) - 1)
    assert dhit.tokens == BLOCK
    _, delta_layers = run_prefill(comp, PrefillPlan(len(b), BLOCK, BLOCK, None, hit.cache), b)
    joined = join_prefix(dhit.cache, _cache(len(b) - 1, delta_layers))
    sent = sum(layer.nbytes for layer in delta_layers)
    assert sent == comp.model.spec.kv_bytes(len(b) - 1).total_bytes - BLOCK * comp.model.spec.full_attention_bytes_per_token
    assert greedy(comp.model, b[-1], joined, 6) == greedy(comp.model, b[-1], _cache(len(b) - 1, full_layers), 6)


def greedy(model, first: int, cache, n: int) -> list[int]:
    """The decode worker's tokens from a received cache (the prompt's last token is its first input)."""
    out = [int(model.decode(first, cache).argmax())]
    while len(out) < n:
        out.append(int(model.decode(out[-1], cache).argmax()))
    return out


def _cache(tokens: int, layers):
    from testbed.kv.cache import KVCache

    return KVCache("r", "m", tokens, list(layers))


def test_join_prefix_refuses_a_delta_that_does_not_continue_the_prefix() -> None:
    comp = TorchCompute(worker_cfg("kimi-linear-48b"))
    ids = prompt(40, comp.model.vocab_size, 5)
    _, layers = run_prefill(comp, PrefillPlan(40, 0, 16), ids)
    with pytest.raises(ValueError, match="positions received after a 0-token decode prefix"):
        join_prefix(None, _cache(39, layers))


@pytest.mark.parametrize("name", ["kimi-linear-48b", "mimo-v2-flash", "minimax-m2.5"])
def test_delta_bytes_are_the_full_attention_bytes_after_the_decode_prefix_plus_every_state(name: str) -> None:
    spec = load_model_spec(name)
    total, held = 9000, 4096
    sizes = delta_layer_bytes(spec, total, held, 1.0)
    assert sum(sizes) == spec.kv_bytes(total).total_bytes - held * spec.full_attention_bytes_per_token
    assert sum(delta_layer_bytes(spec, total, held, 10.0)) == round(sum(sizes) / 10.0)
    assert delta_layer_bytes(spec, total, 0, 1.0) == [spec.layer_bytes(i, total) for i in range(len(spec.layers))]


def test_profile_mode_charges_the_uncached_compute_time_and_the_bytes_the_decode_lacks() -> None:
    comp = ProfileCompute(worker_cfg("paper-1t-hybrid", compute="profile"))
    spec = comp.spec
    sent: list = []
    plan = PrefillPlan(2048, 1024, 512)
    t0 = time.monotonic()
    comp.prefill("p", plan, None, sent.append)
    took = time.monotonic() - t0
    want_s = comp.profile.prefill_time_s(2048, 1024)
    assert want_s < comp.profile.prefill_time_s(2048, 0)
    assert want_s * 0.97 <= took < want_s + 3.0  # a sleep is never shorter; loose bound above for a loaded host
    assert sum(x.nbytes for x in sent) == spec.kv_bytes(2048).total_bytes - 512 * spec.full_attention_bytes_per_token
