"""The hybrid prefix cache pool: capacity, LRU of unreferenced entries, transfer cache, the two reuse rules."""

from __future__ import annotations

import random

import pytest
import torch

from testbed.kv.cache import KVCache, LayerKV
from testbed.kv.pool import HybridPrefixPool, PoolFullError, chain_block_hashes

torch.set_num_threads(1)
B = 4  # tokens per block in these tests
GQA_BYTES_PER_TOKEN = 2 * 2 * 3 * 4  # k + v, 2 heads x 3 dims, float32
BLOCK_BYTES = B * GQA_BYTES_PER_TOKEN  # 192
STATE_BYTES = 2 * 3 * 3 * 4  # linear state [2, 3, 3] float32 = 72


def _cache(tokens: int, hybrid: bool, seed: int = 0) -> KVCache:
    """A cache whose values identify (prompt seed, position), so prefix slices are checkable."""
    pos = torch.arange(tokens, dtype=torch.float32)[:, None, None] + 1000 * seed
    layers = [LayerKV(1, "gqa", {"k": pos.expand(tokens, 2, 3).clone(), "v": -pos.expand(tokens, 2, 3).clone()})]
    if hybrid:
        layers.insert(0, LayerKV(0, "linear", {"state": torch.full((2, 3, 3), float(tokens + 1000 * seed))}))
    return KVCache(f"req-{seed}-{tokens}", "toy", tokens, layers)


def _pool(capacity_blocks: float, hybrid: bool = False) -> HybridPrefixPool:
    return HybridPrefixPool(int(capacity_blocks * BLOCK_BYTES), block_tokens=B, hybrid=hybrid)


def test_chained_hashes_depend_on_the_whole_prefix() -> None:
    a, b = chain_block_hashes([1, 2, 3]), chain_block_hashes([9, 2, 3])
    assert a[0] != b[0] and a[1] != b[1] and a[2] != b[2]
    assert chain_block_hashes([1, 2]) == a[:2]


def test_partial_prefix_match_returns_the_common_leading_blocks_with_their_kv() -> None:
    pool = _pool(10)
    pool.insert([1, 2, 3, 4], _cache(16, hybrid=False))
    hit = pool.match([1, 2, 7, 8])
    assert (hit.tokens, hit.blocks, hit.kv_bytes) == (8, 2, 2 * BLOCK_BYTES)
    assert hit.cache is not None and hit.cache.tokens == 8
    assert torch.equal(hit.cache.layers[0].tensors["k"], _cache(16, False).layers[0].tensors["k"][:8])
    assert pool.match([5, 1, 2]).tokens == 0
    assert pool.stats().hit_tokens == 8


def test_match_never_exceeds_max_tokens() -> None:
    pool = _pool(10)
    pool.insert([1, 2, 3], _cache(12, hybrid=False))
    assert pool.match([1, 2, 3], max_tokens=11).tokens == 8  # leave one token to compute


def test_linear_state_is_reused_only_at_a_stored_block_boundary() -> None:
    pool = _pool(20, hybrid=True)
    pool.insert([1, 2, 3], _cache(12, hybrid=True))  # state stored at boundary 3 blocks
    diverging = pool.match([1, 2, 9])
    assert diverging.full_match_blocks == 2 and diverging.tokens == 0 and diverging.cache is None
    exact = pool.match([1, 2, 3, 4])
    assert exact.tokens == 12
    assert exact.cache is not None
    state = exact.cache.layers[0]
    assert state.kind == "linear" and torch.equal(state.tensors["state"], torch.full((2, 3, 3), 12.0))
    assert exact.kv_bytes == 3 * BLOCK_BYTES + STATE_BYTES


def test_cache_not_ending_on_a_boundary_stores_blocks_but_no_state() -> None:
    pool = _pool(20, hybrid=True)
    pool.insert([1, 2, 3, 4], _cache(14, hybrid=True))  # 3.5 blocks: the state is at 14, not a boundary
    hit = pool.match([1, 2, 3, 4])
    assert (hit.full_match_blocks, hit.tokens) == (3, 0)
    assert pool.stats().state_entries == 0
    assert pool.prefix_hashes() == []


def test_dense_model_needs_no_state() -> None:
    pool = _pool(20, hybrid=False)
    pool.insert([1, 2, 3, 4], _cache(14, hybrid=False))
    assert pool.match([1, 2, 3, 4]).tokens == 12
    assert sorted(pool.prefix_hashes()) == sorted(chain_block_hashes([1, 2, 3]))


def test_pool_never_exceeds_capacity_under_a_random_workload() -> None:
    rng = random.Random(5)
    pool = HybridPrefixPool(7 * BLOCK_BYTES + 2 * STATE_BYTES, block_tokens=B, hybrid=True)
    held = []
    for step in range(300):
        hashes = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
        op = rng.random()
        if op < 0.5:
            pool.insert(hashes, _cache(len(hashes) * B, hybrid=True, seed=step))
        elif op < 0.8:
            hit = pool.match(hashes, acquire=rng.random() < 0.3)
            if hit.held:
                held.append(hit)
        elif held:
            pool.release(held.pop(rng.randrange(len(held))))
        else:
            try:
                pool.allocate_transfer(f"t{step}", rng.randrange(1, 3 * BLOCK_BYTES))
                pool.release_transfer(f"t{step}", completed=rng.random() < 0.5)
            except PoolFullError:
                pass
        s = pool.stats()
        assert s.used_bytes <= s.capacity_bytes
        assert s.used_bytes == s.prefix_bytes + s.state_bytes + s.transfer_bytes
    assert pool.stats().peak_used_bytes <= pool.capacity_bytes
    assert pool.stats().evictions > 0


def test_least_recently_used_unreferenced_blocks_are_evicted_first() -> None:
    pool = _pool(3)
    for h in (1, 2, 3):
        pool.insert([h], _cache(B, hybrid=False, seed=h))
    pool.match([1])  # 1 is now the most recent
    pool.insert([4], _cache(B, hybrid=False, seed=4))
    assert pool.match([2]).tokens == 0  # 2 was least recently used
    assert all(pool.match([h]).tokens == B for h in (1, 3, 4))
    assert pool.stats().evictions == 1


def test_tails_are_evicted_before_heads_of_a_chain() -> None:
    pool = _pool(3)
    pool.insert([1, 2, 3], _cache(3 * B, hybrid=False))
    pool.insert([9], _cache(B, hybrid=False, seed=9))
    assert pool.match([1, 2, 3]).tokens == 2 * B


def test_referenced_blocks_are_never_evicted() -> None:
    pool = _pool(2)
    pool.insert([1, 2], _cache(2 * B, hybrid=False))
    hit = pool.match([1, 2], acquire=True)
    assert pool.insert([7], _cache(B, hybrid=False, seed=7)) == 0  # no room: everything is referenced
    with pytest.raises(PoolFullError):
        pool.allocate_transfer("t", BLOCK_BYTES)
    assert pool.match([1, 2]).tokens == 2 * B
    pool.release(hit)
    assert pool.insert([7], _cache(B, hybrid=False, seed=7)) == 1
    assert pool.stats().evictions == 1


def test_state_and_tail_go_before_the_head_under_pressure() -> None:
    pool = HybridPrefixPool(3 * BLOCK_BYTES + STATE_BYTES, block_tokens=B, hybrid=True)
    pool.insert([1, 2], _cache(2 * B, hybrid=True))
    assert len(pool.prefix_hashes()) == 1
    pool.insert([5, 6], _cache(2 * B, hybrid=True, seed=5))  # needs 2 blocks + state: evicts state, then block 2
    s = pool.stats()
    assert (s.blocks, s.state_entries, s.evictions) == (3, 1, 2)
    assert pool.match([1, 2]).full_match_blocks == 1
    assert pool.prefix_hashes() == [chain_block_hashes([5, 6])[-1]]


def test_every_advertised_prefix_hash_is_a_usable_hit() -> None:
    rng = random.Random(11)
    pool = HybridPrefixPool(6 * BLOCK_BYTES + 2 * STATE_BYTES, block_tokens=B, hybrid=True)
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(1, 5))] for _ in range(60)]
    for i, hashes in enumerate(prompts):
        pool.insert(hashes, _cache(len(hashes) * B, hybrid=True, seed=i))
        advertised = set(pool.prefix_hashes())
        for p in prompts[:i + 1]:
            chain = chain_block_hashes(p)
            hit = pool.match(p)
            expected = max((k + 1 for k, h in enumerate(chain) if h in advertised), default=0)
            assert hit.blocks == expected


def test_transfer_cache_is_freed_on_completion_and_on_abort() -> None:
    pool = _pool(4)
    pool.insert([1, 2], _cache(2 * B, hybrid=False))
    pool.allocate_transfer("done", 3 * BLOCK_BYTES)  # evicts one prefix block to fit
    assert pool.stats().transfer_bytes == 3 * BLOCK_BYTES and pool.stats().evictions == 1
    pool.release_transfer("done", completed=True)
    pool.allocate_transfer("aborted", 4 * BLOCK_BYTES)
    pool.release_transfer("aborted", completed=False)
    s = pool.stats()
    assert (s.transfer_bytes, s.transfers, s.transfers_completed, s.transfers_aborted) == (0, 0, 1, 1)
    with pytest.raises(PoolFullError):
        pool.allocate_transfer("huge", 5 * BLOCK_BYTES)


def test_metadata_only_mode_accounts_bytes_without_tensors() -> None:
    pool = HybridPrefixPool(10_000, block_tokens=B, store_tensors=False, full_bytes_per_token=100, state_bytes=500)
    pool.insert([1, 2, 3], tokens=3 * B)
    hit = pool.match([1, 2, 3, 4])
    assert (hit.tokens, hit.cache, hit.kv_bytes) == (3 * B, None, 3 * 400 + 500)
    assert pool.stats().used_bytes == 1700
    assert pool.stats().occupancy == pytest.approx(0.17)


def test_pool_for_a_model_spec_charges_its_geometry() -> None:
    from testbed.models import spec as spec_mod

    spec = spec_mod.load_model_spec("kimi-linear-48b")
    pool = HybridPrefixPool.for_spec(spec, capacity_bytes=1 << 30, store_tensors=False)
    pool.insert(list(range(4)), tokens=4 * 512)
    assert pool.stats().used_bytes == spec.kv_bytes(4 * 512).total_bytes
