"""One request of a workload, as every part of the testbed sees it.

Prompts are sequences of 512-token block hashes (the Mooncake trace representation): two requests
whose `block_hashes` share a leading run share that many blocks of reusable prefix, so cache hits
are computable anywhere (router, prefix pools, analysis) without carrying token text.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_TOKENS = 512


@dataclass(frozen=True)
class Request:
    request_id: str
    arrival_s: float  # seconds from the start of the workload
    input_len: int  # prompt tokens
    output_len: int  # tokens to decode
    block_hashes: tuple[int, ...] = ()  # one per BLOCK_TOKENS of prompt (the last may be partial)
    session_id: int | None = None  # multi-turn conversation this request belongs to

    def prompt_token_ids(self, vocab_size: int) -> list[int]:
        """Deterministic token ids derived from the block hashes, so equal prefixes give equal tokens."""
        import random

        out: list[int] = []
        for i in range(0, self.input_len, BLOCK_TOKENS):
            h = self.block_hashes[i // BLOCK_TOKENS] if i // BLOCK_TOKENS < len(self.block_hashes) else hash((self.request_id, i))
            rng = random.Random(h)
            out.extend(rng.randrange(vocab_size) for _ in range(min(BLOCK_TOKENS, self.input_len - i)))
        return out
