"""Prompts as chains of fixed-size token blocks: the unit of prefix reuse everywhere.

A prompt of N tokens is ceil(N / BLOCK_TOKENS) blocks (the last may be partial), each named by a hash
id (Mooncake traces) or a chained hash of its tokens (the router). Two prompts share a reusable
prefix of k full blocks when their first k ids agree. Traces, the router, the global KV manager, the
workers' prefix pools and the analysis all count in these blocks, so the size is defined once here.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Sequence

from testbed.validation import shown

BLOCK_TOKENS = 512  # Mooncake's block size (its traces' hash_ids are one per 512 tokens)
HASH_RANGE = (-(2**63), 2**63 - 1)  # a block's hash id: signed 64-bit (numpy int64, as `RequestBatch` keeps them)


def block_hashes(v: Any) -> list[int]:
    """A prompt's block hashes read from input, as a `validation.Fields` reader: a list of whole numbers (not
    booleans) in `HASH_RANGE`, copied; anything else is a ValueError saying what is allowed (the caller names the
    field). The one reader of a block-hash list a user or client gives: a trace line's ``hash_ids``
    (`traffic.trace.parse_line`) and a completion's ``prfaas.block_hashes`` (`testbed.serving.router`). How many
    hashes a prompt takes is the caller's: a trace line needs exactly one per block, a request at most that."""
    if not isinstance(v, list):
        raise ValueError(f"must be a list of whole numbers (block hashes), got {type(v).__name__}")
    bad = next((i for i, h in enumerate(v) if isinstance(h, bool) or not isinstance(h, int)), None)
    if bad is not None:
        raise ValueError(f"must be a list of whole numbers (block hashes); item {bad} is {shown(v[bad])}")
    if v and not HASH_RANGE[0] <= min(v) <= max(v) <= HASH_RANGE[1]:
        bad = next(i for i, h in enumerate(v) if not HASH_RANGE[0] <= h <= HASH_RANGE[1])
        raise ValueError(f"an id is outside the signed 64-bit range (-2^63 to 2^63 - 1) that block hashes take: item {bad} "
                         f"is {shown(v[bad])}")
    return list(v)


def prompt_token_ids(block_hashes: Sequence[int], input_len: int, vocab_size: int, request_id: str) -> list[int]:
    """Token ids for a prompt known only by its block hashes (torch compute mode): each block's tokens
    are drawn from a generator seeded by its hash, so equal prefixes give equal tokens. Blocks beyond
    the given hashes are seeded by a stable hash of (request_id, position) -- not Python's `hash()`,
    which is salted per process (PYTHONHASHSEED) -- so the same request gives the same tokens in every
    process and run."""
    out: list[int] = []
    for i in range(0, input_len, BLOCK_TOKENS):
        h = block_hashes[i // BLOCK_TOKENS] if i // BLOCK_TOKENS < len(block_hashes) else _stable_seed(request_id, i)
        rng = random.Random(h)
        out.extend(rng.randrange(vocab_size) for _ in range(min(BLOCK_TOKENS, input_len - i)))
    return out


def _stable_seed(request_id: str, position: int) -> int:
    """A seed for (request_id, position) that is the same in every process (blake2b, like the router's tokeniser)."""
    return int.from_bytes(hashlib.blake2b(f"{request_id}\0{position}".encode(), digest_size=8).digest(), "little")
