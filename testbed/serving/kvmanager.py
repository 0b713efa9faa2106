"""Global KV cache manager: which prefixes each cluster and prefill instance can serve a hit from.

Prompts are chains of 512-token block hashes (`testbed.blocks.BLOCK_TOKENS`, Mooncake's
representation). The manager and the workers' prefix pools agree on one key per block boundary,
`testbed.kv.pool.chain_block_hashes` (key_i names the whole prefix up to block i), so "instance X
holds key_i" means "X can reuse the first i+1 blocks". The manager is fed two ways: the workers'
``/v1/state`` ``prefix_blocks`` (their hit points; authoritative, they replace what the manager
believed about that instance) and the router's own placements (a prefill that succeeded and ended on
a block boundary leaves its last block's key on that instance until the next state report).

Why a bitmask per key: matching a request is one dict lookup per block for all instances at once,
independent of how many prefixes are cached, which keeps a routing decision well under 200 us with
tens of thousands of cached prefixes (benchmarks/router_bench.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterable, Mapping, NamedTuple, Sequence

from testbed.kv.pool import chain_block_hashes
from testbed.blocks import BLOCK_TOKENS

CLUSTERS = ("prfaas", "pd")


class ClusterMatch(NamedTuple):
    """The best prefix hit inside one cluster: its length and the instances holding all of it."""

    cluster: str
    cached_len: int  # tokens of the request already cached on the best instance(s)
    instances: tuple[int, ...]  # prefill instances holding that whole prefix (empty on a miss)


class PrefixMatch(NamedTuple):
    """Prefix-match information for every cluster, computed on arrival (the paper's l_pd, l_prfaas).
    (NamedTuples here and in the policy: they are built on every decision and cost a fraction of a
    frozen dataclass.)"""

    input_len: int
    clusters: Mapping[str, ClusterMatch]

    def cached_len(self, cluster: str) -> int:
        m = self.clusters.get(cluster)
        return m.cached_len if m else 0

    def holders(self, cluster: str) -> tuple[int, ...]:
        m = self.clusters.get(cluster)
        return m.instances if m else ()


def reusable_blocks(input_len: int, block_tokens: int = BLOCK_TOKENS) -> int:
    """Full blocks that may be reused: a partial last block never is, and at least one token is always
    computed (the last position's logits come from a forward pass), as in vLLM's prefix cache."""
    return max(0, (input_len - 1) // block_tokens)


def full_blocks(input_len: int, block_tokens: int = BLOCK_TOKENS) -> int:
    """Full blocks a finished prefill leaves in the instance's prefix pool."""
    return max(0, input_len // block_tokens)


def prefilled_blocks(input_len: int, last_token_to_decode: bool, block_tokens: int = BLOCK_TOKENS) -> int:
    """Full blocks a prefill computes, and so leaves in its pool (with a hybrid model's state at their end):
    every token of the prompt in profile mode; torch mode leaves the last token to the decode
    (`last_token_to_decode`), so a prompt of exactly k blocks leaves k - 1."""
    return full_blocks(input_len - 1 if last_token_to_decode else input_len, block_tokens)


class KVManager:
    """Prefix metadata of all prefill instances; thread-safe (the router's handler threads share it)."""

    def __init__(
        self,
        instances: Mapping[int, str],
        block_tokens: int = BLOCK_TOKENS,
        max_blocks_per_instance: int = 1 << 20,
    ) -> None:
        for inst, cluster in instances.items():
            if cluster not in CLUSTERS:
                raise ValueError(f"instance {inst}: cluster {cluster!r} is not one of {', '.join(CLUSTERS)}")
        self.block_tokens = block_tokens
        self.max_blocks_per_instance = max_blocks_per_instance
        self._cluster_of = dict(instances)
        self._bit = {inst: 1 << i for i, inst in enumerate(sorted(instances))}
        self._inst_of_bit = {b: inst for inst, b in self._bit.items()}
        self._cluster_mask = {c: 0 for c in CLUSTERS}
        for inst, c in instances.items():
            self._cluster_mask[c] |= self._bit[inst]
        self._holders: dict[int, int] = {}  # block hash -> bitmask of instances holding it
        self._blocks: dict[int, OrderedDict[int, None]] = {inst: OrderedDict() for inst in instances}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ updates

    def replace_instance(self, instance: int, keys: Iterable[int]) -> None:
        """The instance's hit points now (``/v1/state`` ``prefix_blocks``: chained keys)."""
        new = OrderedDict.fromkeys(int(h) for h in keys)
        with self._lock:
            bit = self._bit[instance]
            old = self._blocks[instance]
            for h in old:
                if h not in new:
                    self._clear(h, bit)
            for h in new:
                if h not in old:
                    self._holders[h] = self._holders.get(h, 0) | bit
            self._blocks[instance] = new
            self._evict(instance)

    def add_keys(self, instance: int, keys: Iterable[int]) -> None:
        """A placement by the router: the instance now holds these chained keys (most recent last)."""
        with self._lock:
            bit = self._bit[instance]
            blocks = self._blocks[instance]
            for h in keys:
                h = int(h)
                if h in blocks:
                    blocks.move_to_end(h)
                else:
                    blocks[h] = None
                    self._holders[h] = self._holders.get(h, 0) | bit
            self._evict(instance)

    def forget_instance(self, instance: int) -> None:
        """A dead instance's pool is gone."""
        self.replace_instance(instance, ())

    def _clear(self, h: int, bit: int) -> None:
        m = self._holders.get(h, 0) & ~bit
        if m:
            self._holders[h] = m
        else:
            self._holders.pop(h, None)

    def _evict(self, instance: int) -> None:
        blocks = self._blocks[instance]
        bit = self._bit[instance]
        while len(blocks) > self.max_blocks_per_instance:
            h, _ = blocks.popitem(last=False)
            self._clear(h, bit)

    # ------------------------------------------------------------------ queries

    def match(self, block_hashes: Sequence[int], input_len: int) -> PrefixMatch:
        """Longest cached prefix of the request in every cluster, and the instances that hold it."""
        n = min(len(block_hashes), reusable_blocks(input_len, self.block_tokens))
        keys = chain_block_hashes(block_hashes[:n]) if n else []
        return self.match_keys(keys, input_len)

    def match_keys(self, keys: Sequence[int], input_len: int) -> PrefixMatch:
        """`match` on already chained keys: the deepest key each cluster holds wins."""
        holders = self._holders
        todo = {c: m for c, m in self._cluster_mask.items() if m}
        found: dict[str, tuple[int, int]] = {}
        for i in range(len(keys) - 1, -1, -1):
            m = holders.get(keys[i])
            if not m:
                continue
            for c, cm in list(todo.items()):
                hit = m & cm
                if hit:
                    found[c] = (i + 1, hit)
                    del todo[c]
            if not todo:
                break
        out = {}
        for c in CLUSTERS:
            depth, mask = found.get(c, (0, 0))
            insts = tuple(inst for bit, inst in self._inst_of_bit.items() if mask & bit)
            out[c] = ClusterMatch(c, depth * self.block_tokens, insts)
        return PrefixMatch(input_len, out)

    def placement_keys(self, block_hashes: Sequence[int], input_len: int, last_token_to_decode: bool = False) -> list[int]:
        """What a finished prefill surely leaves behind: the key of its last block when the blocks it computed
        end where the prompt ends (a hit point in dense and hybrid pools alike: a hybrid pool stores its
        linear/SWA state only there). Otherwise nothing: a guessed hit would be a phantom the router routes
        by until the next state report adds what the pool really holds. Torch mode leaves the last token to
        the decode (`last_token_to_decode`, `prefilled_blocks`), so its prefills never end on a block
        boundary: a prompt of exactly k blocks leaves k - 1, not the k-th this would have claimed."""
        n = prefilled_blocks(input_len, last_token_to_decode, self.block_tokens)
        if n == 0 or n * self.block_tokens != input_len or len(block_hashes) < n:
            return []
        return chain_block_hashes(block_hashes[:n])[-1:]

    def blocks_held(self, instance: int) -> int:
        return len(self._blocks[instance])

    def cluster_blocks(self) -> dict[str, int]:
        """Distinct blocks cached per cluster (for /metrics)."""
        with self._lock:
            return {c: sum(1 for m in self._holders.values() if m & self._cluster_mask[c]) for c in CLUSTERS}
