"""The hybrid prefix cache pool of one worker: one byte budget, three kinds of entry.

- *Prefix blocks*: full-attention KV (gqa, mla) of one `block_tokens` block, keyed by the chained hash
  of the prompt's blocks up to it, so two prompts share exactly their common leading blocks.
- *State entries*: the request-level linear-attention and SWA state at a block boundary, keyed by the
  chained hash of the block that ends there. The state summarises the whole prefix, so it is reusable
  only when a later prompt matches exactly up to that boundary.
- *Transfer-cache allocations*: the KV of a prefill that is being shipped, held until the transfer
  completes or aborts.

A hit is the longest prefix usable under both rules: all its blocks present and, for a model with
linear/SWA layers, a state entry at its end. Unreferenced entries are evicted least-recently-used first
(tails before heads, so chains shrink from the end); referenced entries and transfers never are.
In metadata-only mode (`store_tensors=False`, the profile compute mode) only bytes are accounted.
"""

from __future__ import annotations

import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import xxhash

from testbed.blocks import BLOCK_TOKENS
from testbed.kv.cache import FULL_KINDS, KVCache, LayerKV  # FULL_KINDS grow with the prompt: stored per block (token dim 0)
STATE_KINDS = ("linear", "swa")  # fixed per request: stored per block boundary
_PAIR = struct.Struct("<QQ")
_MASK64 = (1 << 64) - 1


class KVGeometry(Protocol):
    """What the pool needs of a model's cache geometry (`testbed.models.spec.ModelSpec` is one): bytes of
    full-attention KV per token, and the request's KV at a token count (``fixed_state_bytes``,
    ``window_bytes``). A protocol, so the KV layer does not import the models layer."""

    @property
    def full_attention_bytes_per_token(self) -> int: ...

    def kv_bytes(self, tokens: int, state_dtype: str | None = None) -> Any: ...


def state_bytes(spec: KVGeometry, block_tokens: int = BLOCK_TOKENS, state_dtype: str | None = None) -> int:
    """Bytes of one state entry (the linear-attention and SWA state at a block boundary); 0 for a model of
    full attention only, whose prefix is reusable at every block, where a hybrid one's is reusable only
    where a state was stored."""
    at_block = spec.kv_bytes(block_tokens, state_dtype)
    return at_block.fixed_state_bytes + at_block.window_bytes


class PoolFullError(RuntimeError):
    """Not enough unreferenced capacity for a transfer-cache allocation."""


def chain_block_hashes(block_hashes: Sequence[int]) -> list[int]:
    """key_i = xxh3-64(key_{i-1} || hash_i): a block's key names its whole prefix (what the pool and the
    global KV cache manager agree on)."""
    out: list[int] = []
    key = 0
    pack, digest, mask = _PAIR.pack, xxhash.xxh3_64_intdigest, _MASK64  # locals: this runs on every routing decision
    for h in block_hashes:
        key = digest(pack(key, int(h) & mask))
        out.append(key)
    return out


@dataclass
class PrefixHit:
    tokens: int  # reusable prefix length (a multiple of block_tokens)
    cache: KVCache | None  # that prefix's KV (tensor mode), None on a miss or in metadata mode
    blocks: int  # blocks in the hit
    full_match_blocks: int  # leading blocks present by the full-attention rule alone (>= blocks)
    kv_bytes: int  # bytes of the hit (blocks + state)
    held: tuple[tuple[bool, int], ...] = ()  # (is_state, key) referenced by match(acquire=True); see release()


@dataclass
class PoolStats:
    capacity_bytes: int
    used_bytes: int
    prefix_bytes: int
    state_bytes: int
    transfer_bytes: int
    peak_used_bytes: int
    blocks: int
    state_entries: int
    transfers: int
    lookups: int
    lookup_tokens: int
    hit_tokens: int
    evictions: int
    evicted_bytes: int
    transfers_completed: int
    transfers_aborted: int

    @property
    def occupancy(self) -> float:
        return self.used_bytes / self.capacity_bytes if self.capacity_bytes else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "occupancy": self.occupancy}


@dataclass
class _Entry:
    key: int
    nbytes: int
    parent: int | None = None  # blocks: the previous block's key
    layers: list[LayerKV] | None = None  # blocks: full-attention slices; states: linear/swa layers
    refs: int = 0
    children: set[int] = field(default_factory=set)
    is_state: bool = False


class HybridPrefixPool:
    """Prefix cache + transfer cache of one worker, within `capacity_bytes` (thread-safe)."""

    def __init__(self, capacity_bytes: int, block_tokens: int = BLOCK_TOKENS, store_tensors: bool = True, *,
                 full_bytes_per_token: int = 0, state_bytes: int = 0, hybrid: bool | None = None) -> None:
        if capacity_bytes < 0 or block_tokens <= 0:
            raise ValueError(f"capacity_bytes must be >= 0 and block_tokens > 0, got {capacity_bytes}, {block_tokens}")
        self.capacity_bytes = capacity_bytes
        self.block_tokens = block_tokens
        self.store_tensors = store_tensors
        self.full_bytes_per_token = full_bytes_per_token  # metadata mode: bytes per token of full attention
        self.state_bytes = state_bytes  # metadata mode: linear + SWA state bytes per request
        self.hybrid = hybrid if hybrid is not None else (None if store_tensors else state_bytes > 0)
        self.model = ""
        self._lru: OrderedDict[tuple[bool, int], _Entry] = OrderedDict()  # (is_state, key) -> entry
        self._transfers: dict[str, tuple[int, KVCache | None]] = {}
        self._lock = threading.RLock()
        self._used = {"prefix": 0, "state": 0, "transfer": 0}
        self._peak = 0
        self._counts = dict(lookups=0, lookup_tokens=0, hit_tokens=0, evictions=0, evicted_bytes=0,
                            transfers_completed=0, transfers_aborted=0)

    @classmethod
    def for_spec(cls, spec: KVGeometry, capacity_bytes: int, block_tokens: int = BLOCK_TOKENS, store_tensors: bool = True,
                 state_dtype: str | None = None) -> HybridPrefixPool:
        """A pool for one model: in metadata mode it charges the spec's bytes per block and per state."""
        state = state_bytes(spec, block_tokens, state_dtype)
        return cls(capacity_bytes, block_tokens, store_tensors, full_bytes_per_token=spec.full_attention_bytes_per_token,
                   state_bytes=state, hybrid=state > 0)

    # ---------------------------------------------------------------- accounting

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def _charge(self, part: str, nbytes: int) -> None:
        self._used[part] += nbytes
        self._peak = max(self._peak, self.used_bytes)
        assert self.used_bytes <= self.capacity_bytes, "pool over capacity"

    def _make_room(self, nbytes: int) -> bool:
        """Evict least-recently-used unreferenced entries until `nbytes` fit; False if they cannot."""
        if nbytes > self.capacity_bytes:
            return False
        while self.used_bytes + nbytes > self.capacity_bytes:
            victim = next((e for e in self._lru.values() if e.refs == 0), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, e: _Entry) -> None:
        """Remove an entry; a block takes its descendants and the state at its boundary with it
        (they are unreachable without it)."""
        if not e.is_state:
            for child in list(e.children):
                if (False, child) in self._lru:
                    self._evict(self._lru[(False, child)])
            state = self._lru.get((True, e.key))
            if state is not None:
                self._evict(state)
            parent = self._lru.get((False, e.parent)) if e.parent is not None else None
            if parent is not None:
                parent.children.discard(e.key)
        del self._lru[(e.is_state, e.key)]
        self._used["state" if e.is_state else "prefix"] -= e.nbytes
        self._counts["evictions"] += 1
        self._counts["evicted_bytes"] += e.nbytes

    def _touch(self, e: _Entry) -> None:
        self._lru.move_to_end((e.is_state, e.key))

    # ---------------------------------------------------------------- prefix cache

    def _usable_blocks(self, keys: Sequence[int]) -> tuple[int, int]:
        full = 0
        while full < len(keys) and (False, keys[full]) in self._lru:
            full += 1
        if not self.hybrid:
            return full, full
        usable = full
        while usable > 0 and (True, keys[usable - 1]) not in self._lru:
            usable -= 1
        return usable, full

    def match(self, block_hashes: Sequence[int], max_tokens: int | None = None, acquire: bool = False) -> PrefixHit:
        """The longest reusable prefix of a prompt (at most `max_tokens`, e.g. input_len - 1 so one token
        is left to compute). With `acquire`, its entries are referenced until `release(hit)`."""
        with self._lock:
            n = len(block_hashes)
            if max_tokens is not None:
                n = min(n, max(0, max_tokens) // self.block_tokens)
            keys = chain_block_hashes(block_hashes[:n])
            usable, full = self._usable_blocks(keys)
            self._counts["lookups"] += 1
            self._counts["lookup_tokens"] += n * self.block_tokens
            self._counts["hit_tokens"] += usable * self.block_tokens
            entries = [self._lru[(False, k)] for k in keys[:usable]]
            state = self._lru.get((True, keys[usable - 1])) if usable and self.hybrid else None
            for e in ([state] if state else []) + entries[::-1]:  # heads most recent: tails evicted first
                self._touch(e)
                if acquire:
                    e.refs += 1
            held = tuple((e.is_state, e.key) for e in entries) + (((True, state.key),) if state else ())
            kv_bytes = sum(e.nbytes for e in entries) + (state.nbytes if state else 0)
            cache = self._build_cache(entries, state, usable) if self.store_tensors and usable else None
            return PrefixHit(usable * self.block_tokens, cache, usable, full, kv_bytes,
                             held if acquire else ())

    def release(self, hit: PrefixHit) -> None:
        """Drop the references `match(acquire=True)` took."""
        with self._lock:
            for slot in hit.held:
                e = self._lru.get(slot)
                if e is not None and e.refs > 0:
                    e.refs -= 1
            hit.held = ()

    def _build_cache(self, blocks: list[_Entry], state: _Entry | None, usable: int) -> KVCache:
        import torch  # only tensor-mode pools need it; the router imports this module for its hashing

        layers: list[LayerKV] = []
        assert blocks[0].layers is not None
        for j, first in enumerate(blocks[0].layers):
            tensors = {name: torch.cat([b.layers[j].tensors[name] for b in blocks], dim=0)  # type: ignore[index]
                       for name in first.tensors}
            layers.append(LayerKV(first.layer_index, first.kind, tensors))
        if state is not None and state.layers is not None:
            layers += [LayerKV(s.layer_index, s.kind, {n: t.clone() for n, t in s.tensors.items()}) for s in state.layers]
        layers.sort(key=lambda layer: layer.layer_index)
        return KVCache("prefix-hit", self.model, usable * self.block_tokens, layers)

    def insert(self, block_hashes: Sequence[int], cache: KVCache | None = None, *, tokens: int | None = None) -> int:
        """Store a prompt's full blocks (and, if the cache ends exactly on a block boundary, its linear/SWA
        state there). Tensor mode needs `cache`; metadata mode needs `tokens`. Returns blocks newly stored.

        A hybrid prefix is only reusable where a state was stored, so a worker that wants hits inserts the
        cache as it was at the last block boundary of the prompt."""
        with self._lock:
            if self.store_tensors:
                if cache is None:
                    raise ValueError("insert: tensor mode needs the KVCache")
                tokens = cache.tokens
                self.model = cache.model
                has_state = any(layer.kind in STATE_KINDS for layer in cache.layers)
                self.hybrid = has_state if self.hybrid is None else self.hybrid
            elif tokens is None:
                raise ValueError("insert: metadata mode needs tokens")
            n = min(tokens // self.block_tokens, len(block_hashes))
            keys = chain_block_hashes(block_hashes[:n])
            pinned: list[_Entry] = []
            stored = 0
            try:
                for i, key in enumerate(keys):
                    e = self._lru.get((False, key))
                    if e is None:
                        layers = self._block_layers(cache, i) if self.store_tensors else None
                        nbytes = sum(layer.nbytes for layer in layers) if layers is not None else self.full_bytes_per_token * self.block_tokens
                        if not self._make_room(nbytes):
                            break
                        parent = keys[i - 1] if i else None
                        e = _Entry(key, nbytes, parent, layers)
                        self._lru[(False, key)] = e
                        if parent is not None:
                            self._lru[(False, parent)].children.add(key)
                        self._charge("prefix", nbytes)
                        stored += 1
                    e.refs += 1
                    pinned.append(e)
                complete = len(pinned) == n and n > 0 and tokens == n * self.block_tokens
                if self.hybrid and complete and (True, keys[-1]) not in self._lru:
                    self._insert_state(keys[-1], cache)
                for e in [self._lru.get((True, keys[-1])) if keys else None] + pinned[::-1]:
                    if e is not None:
                        self._touch(e)
            finally:
                for e in pinned:
                    e.refs -= 1
            return stored

    def _block_layers(self, cache: KVCache | None, i: int) -> list[LayerKV]:
        assert cache is not None
        lo, hi = i * self.block_tokens, (i + 1) * self.block_tokens
        out = []
        for layer in cache.layers:
            if layer.kind in FULL_KINDS:
                for name, t in layer.tensors.items():
                    if t.shape[0] != cache.tokens:
                        raise ValueError(f"insert: layer {layer.layer_index} {name} has {t.shape[0]} positions, cache says {cache.tokens}")
                out.append(LayerKV(layer.layer_index, layer.kind, {n: t[lo:hi].clone() for n, t in layer.tensors.items()}))
        return out

    def _insert_state(self, key: int, cache: KVCache | None) -> None:
        if self.store_tensors:
            assert cache is not None
            layers = [LayerKV(layer.layer_index, layer.kind, {n: t.clone() for n, t in layer.tensors.items()})
                      for layer in cache.layers if layer.kind in STATE_KINDS]
            nbytes = sum(layer.nbytes for layer in layers)
        else:
            layers, nbytes = None, self.state_bytes
        if self._make_room(nbytes):
            self._lru[(True, key)] = _Entry(key, nbytes, layers=layers, is_state=True)
            self._charge("state", nbytes)

    def prefix_hashes(self) -> list[int]:
        """Chained keys at which this pool can serve a hit (for the global KV cache manager): every block
        for a dense model, only block boundaries with a stored state for a hybrid one."""
        with self._lock:
            return [key for is_state, key in self._lru if is_state == bool(self.hybrid)]

    # ---------------------------------------------------------------- transfer cache

    def allocate_transfer(self, request_id: str, kv_bytes: int, cache: KVCache | None = None) -> None:
        """Hold `kv_bytes` for the tail of a prefill being shipped, evicting unreferenced prefix blocks
        if needed; raises `PoolFullError` when even that is not enough."""
        with self._lock:
            if request_id in self._transfers:
                raise ValueError(f"allocate_transfer: {request_id} already holds a transfer allocation")
            if not self._make_room(kv_bytes):
                raise PoolFullError(f"transfer cache: {kv_bytes} bytes for {request_id} do not fit "
                                    f"({self.used_bytes} of {self.capacity_bytes} used, referenced or in transfer)")
            self._transfers[request_id] = (kv_bytes, cache if self.store_tensors else None)
            self._charge("transfer", kv_bytes)

    def release_transfer(self, request_id: str, completed: bool = True) -> None:
        """Free a transfer's allocation when it completed or was aborted (unknown ids are ignored)."""
        with self._lock:
            held = self._transfers.pop(request_id, None)
            if held is None:
                return
            self._used["transfer"] -= held[0]
            self._counts["transfers_completed" if completed else "transfers_aborted"] += 1

    def stats(self) -> PoolStats:
        with self._lock:
            states = sum(1 for is_state, _ in self._lru if is_state)
            return PoolStats(self.capacity_bytes, self.used_bytes, self._used["prefix"], self._used["state"],
                             self._used["transfer"], self._peak, len(self._lru) - states, states,
                             len(self._transfers), **self._counts)
