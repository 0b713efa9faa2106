"""Prompts as token blocks (`testbed.blocks`): the tokens of a torch-mode prompt are reproducible."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from testbed.blocks import BLOCK_TOKENS, prompt_token_ids

SNIPPET = ("import json; from testbed.blocks import prompt_token_ids; "
           "print(json.dumps(prompt_token_ids([11, 22], 3 * 512 + 100, 50_000, 'req-7')))")


def _in_subprocess(hash_seed: str) -> list[int]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run([sys.executable, "-c", SNIPPET], env=env, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_tokens_beyond_the_given_hashes_are_the_same_in_processes_with_different_hash_seeds() -> None:
    a, b = _in_subprocess("1"), _in_subprocess("2")
    assert len(a) == 3 * BLOCK_TOKENS + 100 and a == b
    assert a == prompt_token_ids([11, 22], 3 * BLOCK_TOKENS + 100, 50_000, "req-7")  # and in this process
    assert all(0 <= t < 50_000 for t in a)


def test_equal_hashes_give_equal_blocks_and_the_unhashed_tail_depends_on_the_request() -> None:
    x = prompt_token_ids([5, 6], 4 * BLOCK_TOKENS, 1000, "r1")
    y = prompt_token_ids([5, 6], 4 * BLOCK_TOKENS, 1000, "r2")
    assert x[:2 * BLOCK_TOKENS] == y[:2 * BLOCK_TOKENS]
    assert x[2 * BLOCK_TOKENS:] != y[2 * BLOCK_TOKENS:]
    assert x[2 * BLOCK_TOKENS:3 * BLOCK_TOKENS] != x[3 * BLOCK_TOKENS:]  # each position its own seed
