"""KV that went through the wire format (and the prefix pool) decodes exactly like the KV that did not."""

from __future__ import annotations

import threading

import pytest
import torch

from testbed.kv.cache import KVCache
from testbed.kv.pool import HybridPrefixPool
from testbed.kv.transport import KVReceiver, KVSender, ReceivedKV
from testbed.kv.wire import decode_transfer, encode_cache
from testbed.models.spec import GQALayer, LinearLayer, MLALayer, ModelSpec, SWALayer
from testbed.models.torch_model import build_model

torch.set_num_threads(1)

LIN = LinearLayer(heads=2, key_dim=8, value_dim=8, qk_heads=2, conv_kernel=4)
GQA = GQALayer(kv_heads=2, k_head_dim=8, v_head_dim=8)
MLA = MLALayer(kv_lora_rank=16, rope_dim=4)
SWA = SWALayer(kv_heads=2, k_head_dim=8, v_head_dim=8, window=12)
SPECS = {
    "linear": (LIN, LIN),
    "gqa": (GQA, GQA),
    "mla": (MLA, MLA),
    "swa": (SWA, SWA),
    "hybrid": (LIN, SWA, LIN, MLA, LIN, GQA),
}
BLOCK = 16  # prefix-cache block in these tests (a multiple of the tiny variant's linear chunk of 8)


def _model(layers: tuple, variant: str = "faithful") -> torch.nn.Module:
    """faithful keeps the geometry above; tiny has a linear chunk of 8 tokens, which divides BLOCK."""
    return build_model(ModelSpec("toy", tuple(layers)), variant, seed=1, device="cpu")


def _prompt(model, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.vocab_size, (n,), generator=g).tolist()


def _greedy(model, cache: KVCache, first: int, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    tokens, logits = [first], []
    for _ in range(steps):
        out = model.decode(tokens[-1], cache)
        logits.append(out)
        tokens.append(int(out.argmax()))
    return tokens, logits


@pytest.mark.parametrize("mix", list(SPECS))
def test_decoding_from_deserialised_kv_is_bit_identical(mix: str) -> None:
    model = _model(SPECS[mix])
    logits, cache = model.prefill(_prompt(model, 29), request_id="r1")
    received = decode_transfer(b"".join(encode_cache(cache, chunk_bytes=512)))
    assert isinstance(received, KVCache)
    first = int(logits[-1].argmax())
    want_tokens, want_logits = _greedy(model, cache, first, 6)
    got_tokens, got_logits = _greedy(model, received, first, 6)
    assert got_tokens == want_tokens
    for a, b in zip(want_logits, got_logits):
        assert torch.equal(a, b)


def test_hybrid_kv_that_crossed_tcp_decodes_identically() -> None:
    model = _model(SPECS["hybrid"])
    logits, cache = model.prefill(_prompt(model, 40), request_id="tcp-1")
    done = threading.Event()
    got: dict[str, ReceivedKV] = {}

    def on_complete(rid: str, r: ReceivedKV) -> None:
        got[rid] = r
        done.set()

    with KVReceiver("127.0.0.1", 0, on_complete) as rx, KVSender("127.0.0.1", rx.port, connections=3, chunk_bytes=1024) as tx:
        for layer in cache.layers:
            tx.send_layer("tcp-1", layer)
        assert tx.finish("tcp-1", tokens=cache.tokens, model=cache.model).ok
        assert done.wait(10)
    r = got["tcp-1"]
    assert r.ok and r.cache is not None
    first = int(logits[-1].argmax())
    assert _greedy(model, r.cache, first, 5)[0] == _greedy(model, cache, first, 5)[0]


def _block_hashes(tokens: list[int]) -> list[int]:
    return [hash(tuple(tokens[i:i + BLOCK])) for i in range(0, len(tokens) - BLOCK + 1, BLOCK)]


def test_prefill_resumed_from_a_pool_hit_equals_a_full_prefill() -> None:
    model = _model(SPECS["hybrid"], "tiny")
    prompt = _prompt(model, 3 * BLOCK + 7)
    full_logits, full_cache = model.prefill(prompt)
    pool = HybridPrefixPool(1 << 24, block_tokens=BLOCK)
    _, boundary_cache = model.prefill(prompt[:2 * BLOCK])  # the state at a block boundary
    pool.insert(_block_hashes(prompt), boundary_cache)
    hit = pool.match(_block_hashes(prompt), max_tokens=len(prompt) - 1)
    assert hit.tokens == 2 * BLOCK and hit.cache is not None
    resumed_logits, resumed_cache = model.prefill(prompt[hit.tokens:], cache=hit.cache)
    assert torch.allclose(resumed_logits, full_logits[hit.tokens:], atol=1e-4)
    first = int(full_logits[-1].argmax())
    assert _greedy(model, resumed_cache, first, 5)[0] == _greedy(model, full_cache, first, 5)[0]


def test_hit_without_a_linear_state_at_its_boundary_is_not_used() -> None:
    model = _model(SPECS["hybrid"], "tiny")
    prompt = _prompt(model, 3 * BLOCK + 7)
    pool = HybridPrefixPool(1 << 24, block_tokens=BLOCK)
    _, cache = model.prefill(prompt[:2 * BLOCK])
    pool.insert(_block_hashes(prompt), cache)  # blocks 0-1, state only at the end of block 1
    other = prompt[:BLOCK] + _prompt(model, 2 * BLOCK + 7, seed=9)  # shares block 0 only
    hit = pool.match(_block_hashes(other), max_tokens=len(other) - 1)
    assert hit.full_match_blocks == 1 and hit.tokens == 0 and hit.cache is None
    # Why the rule exists: block 0's KV with the only stored state (from token 32) gives wrong logits.
    wrong = pool.match(_block_hashes(prompt)).cache
    assert wrong is not None
    for layer in wrong.layers:
        if layer.kind in ("gqa", "mla"):
            for name in layer.tensors:
                layer.tensors[name] = layer.tensors[name][:BLOCK]
    wrong.tokens = BLOCK
    good, _ = model.prefill(other)
    bad, _ = model.prefill(other[BLOCK:], cache=wrong)
    assert not torch.allclose(bad, good[BLOCK:], atol=1e-3)
