"""The global KV cache manager: longest prefix per cluster, holders, updates from workers and placements."""

from __future__ import annotations

from testbed.kv.pool import HybridPrefixPool, chain_block_hashes
from testbed.serving.kvmanager import KVManager, reusable_blocks

B = 512
INSTANCES = {0: "prfaas", 1: "prfaas", 2: "pd", 3: "pd"}


def keys(hashes: list[int]) -> list[int]:
    return chain_block_hashes(hashes)


def test_a_miss_reports_nothing_cached_in_any_cluster() -> None:
    kv = KVManager(INSTANCES)
    kv.replace_instance(0, keys([1, 2, 3]))
    m = kv.match([9, 8, 7, 6], 4 * B)
    assert m.cached_len("prfaas") == 0 and m.cached_len("pd") == 0
    assert m.holders("prfaas") == () and m.holders("pd") == ()


def test_shared_leading_blocks_give_a_hit_on_the_holding_instance_only() -> None:
    kv = KVManager(INSTANCES)
    kv.replace_instance(1, keys([1, 2, 3, 4]))
    m = kv.match([1, 2, 3, 50, 51], 5 * B)
    assert m.cached_len("prfaas") == 3 * B
    assert m.holders("prfaas") == (1,)
    assert m.cached_len("pd") == 0


def test_same_block_hash_after_a_different_prefix_is_not_a_hit() -> None:
    kv = KVManager(INSTANCES)
    kv.replace_instance(2, keys([1, 2, 3]))
    # block 2 and 3 equal, but the first block differs: chained keys differ, no reuse
    assert kv.match([9, 2, 3, 4], 4 * B).cached_len("pd") == 0


def test_at_least_one_token_is_left_to_compute() -> None:
    kv = KVManager(INSTANCES)
    kv.replace_instance(2, keys([1, 2]))
    assert reusable_blocks(2 * B) == 1
    assert kv.match([1, 2], 2 * B).cached_len("pd") == B  # the whole prompt cached: one block recomputed
    assert kv.match([1, 2, 3], 2 * B + 1).cached_len("pd") == 2 * B


def test_deepest_holder_wins_within_a_cluster_and_clusters_are_independent() -> None:
    kv = KVManager(INSTANCES)
    kv.replace_instance(2, keys([1, 2]))
    kv.replace_instance(3, keys([1, 2, 3, 4]))
    kv.replace_instance(0, keys([1]))
    m = kv.match([1, 2, 3, 4, 5, 6], 6 * B)
    assert (m.cached_len("pd"), m.holders("pd")) == (4 * B, (3,))
    assert (m.cached_len("prfaas"), m.holders("prfaas")) == (1 * B, (0,))


def test_a_state_report_replaces_what_the_manager_believed() -> None:
    kv = KVManager(INSTANCES)
    kv.replace_instance(2, keys([1, 2, 3]))
    assert kv.match([1, 2, 3, 4], 4 * B).cached_len("pd") == 3 * B
    kv.replace_instance(2, keys([7]))  # the pool evicted the old chain
    assert kv.match([1, 2, 3, 4], 4 * B).cached_len("pd") == 0
    kv.forget_instance(2)
    assert kv.match([7, 8], 2 * B).cached_len("pd") == 0


def test_a_placement_makes_the_next_request_with_that_prefix_hit() -> None:
    kv = KVManager(INSTANCES)
    first = [5, 6, 7, 8]
    kv.add_keys(1, kv.placement_keys(first, 4 * B))
    m = kv.match(first + [9], 5 * B)
    assert m.cached_len("prfaas") == 4 * B and m.holders("prfaas") == (1,)


def test_a_torch_prefill_of_whole_blocks_places_nothing_since_it_leaves_its_last_block_to_the_decode() -> None:
    """Torch mode leaves a prompt's last token to the decode: a prompt of exactly 4 blocks leaves 3 in the pool,
    so the 4th is not claimed (it was, as a phantom hit, until 2026-12-06)."""
    kv = KVManager(INSTANCES)
    assert kv.placement_keys([5, 6, 7, 8], 4 * B, last_token_to_decode=True) == []
    assert kv.placement_keys([5, 6, 7, 8], 4 * B) == kv.placement_keys([5, 6, 7, 8, 9], 4 * B)  # profile: the 4th block's key
    assert len(kv.placement_keys([5, 6, 7, 8], 4 * B)) == 1


def test_a_prompt_ending_inside_a_block_places_nothing_so_no_phantom_hit_is_claimed() -> None:
    """A hybrid pool keeps a reusable state only at the prompt's end; mid-block ends leave no hit point."""
    kv = KVManager(INSTANCES)
    assert kv.placement_keys([5, 6, 7, 8, 9], 4 * B + 100) == []
    pool = HybridPrefixPool(10**9, store_tensors=False, full_bytes_per_token=100, state_bytes=10_000)
    pool.insert([5, 6, 7, 8, 9], tokens=4 * B + 100)
    assert pool.match([5, 6, 7, 8, 9, 10], max_tokens=6 * B).tokens == 0


def test_least_recently_added_keys_are_evicted_beyond_the_cap() -> None:
    kv = KVManager(INSTANCES, max_blocks_per_instance=2)
    kv.add_keys(2, [101, 102, 103])
    assert kv.blocks_held(2) == 2
    assert kv.match_keys([101], B + 1).cached_len("pd") == 0
    assert kv.match_keys([103], B + 1).cached_len("pd") == B


def test_hits_agree_with_a_workers_hybrid_prefix_pool() -> None:
    """The manager reads the pool's hit points; a hybrid pool only has one where a state was stored."""
    pool = HybridPrefixPool(10**9, store_tensors=False, full_bytes_per_token=100, state_bytes=10_000)
    pool.insert([1, 2, 3], tokens=3 * B)
    kv = KVManager(INSTANCES)
    kv.replace_instance(3, pool.prefix_hashes())
    for prompt, n in (([1, 2, 3, 4], 4 * B), ([1, 2, 9], 3 * B), ([1, 2, 3], 3 * B + 10)):
        assert kv.match(prompt, n).cached_len("pd") == pool.match(prompt, max_tokens=n - 1).tokens
