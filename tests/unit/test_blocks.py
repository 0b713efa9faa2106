"""Prompts as token blocks (`testbed.blocks`): the tokens of a torch-mode prompt are reproducible; a block-hash list
read from input has one reader."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from testbed.blocks import BLOCK_TOKENS, HASH_RANGE, block_hashes, prompt_token_ids

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


def test_a_block_hash_list_is_whole_numbers_in_the_signed_64_bit_range() -> None:
    ids = [0, 5, -7, *HASH_RANGE]
    out = block_hashes(ids)
    assert out == ids and out is not ids  # a copy: the caller's list is not kept
    assert block_hashes([]) == []


@pytest.mark.parametrize("value, message", [
    ("x", "must be a list of whole numbers (block hashes), got str"),
    ((1, 2), "must be a list of whole numbers (block hashes), got tuple"),
    ({"a": 1}, "must be a list of whole numbers (block hashes), got dict"),
    ([1, True], "must be a list of whole numbers (block hashes); item 1 is True"),
    ([1.0], "must be a list of whole numbers (block hashes); item 0 is 1.0"),
    ([1, "2"], "must be a list of whole numbers (block hashes); item 1 is '2'"),
    ([1, None], "must be a list of whole numbers (block hashes); item 1 is None"),
    ([1, 2**63], "an id is outside the signed 64-bit range (-2^63 to 2^63 - 1) that block hashes take: item 1 is "
                 "9223372036854775808"),
    ([-(2**63) - 1], "an id is outside the signed 64-bit range (-2^63 to 2^63 - 1) that block hashes take: item 0 is "
                     "-9223372036854775809"),
    ([10**400], "an id is outside the signed 64-bit range (-2^63 to 2^63 - 1) that block hashes take: item 0 is a "
                "401-digit number"),  # not its 401 digits
])
def test_a_bad_block_hash_list_is_refused_saying_what_is_allowed(value: object, message: str) -> None:
    with pytest.raises(ValueError) as e:
        block_hashes(value)
    assert str(e.value) == message


def test_the_router_and_a_trace_refuse_a_block_hash_list_in_the_same_words() -> None:
    """`blocks.block_hashes` is the one reader: a client's ``prfaas.block_hashes`` and a trace line's ``hash_ids``."""
    from testbed.serving.router import BadRequest, RouterConfig, parse_completion
    from traffic.trace import TraceLineError, parse_line

    for bad in ([1, "x"], [2**64], "1,2"):
        with pytest.raises(ValueError) as want:
            block_hashes(bad)
        with pytest.raises(BadRequest) as got:
            parse_completion({"prfaas": {"block_hashes": bad, "input_len": 2 * BLOCK_TOKENS}}, RouterConfig((), ()))
        assert (got.value.param, str(got.value)) == ("prfaas.block_hashes", str(want.value))
        line = json.dumps({"timestamp": 0, "input_length": 2 * BLOCK_TOKENS, "output_length": 1, "hash_ids": bad})
        with pytest.raises(TraceLineError) as got_line:
            parse_line(line, 3, "r")
        assert str(got_line.value) == f"line 3, field 'hash_ids': {want.value}"
