"""Conversations and shared system prompts as block hashes."""

from __future__ import annotations

import numpy as np

from traffic.lengths import Fixed, Uniform
from testbed.blocks import BLOCK_TOKENS
from traffic.sessions import SessionSpec, SystemPrompts, assign_block_hashes, build_conversations
from traffic.stats import reusable_tokens
from traffic.workload import WorkloadSpec, generate_batch
from traffic.arrivals import Poisson


def multi_turn_batch(system: SystemPrompts | None = SystemPrompts(count=3, tokens=1500)):
    spec = WorkloadSpec(input=Uniform(1000, 9000), output=Fixed(300), arrivals=Poisson(20.0),
                        sessions=SessionSpec(turns=Uniform(2, 5), message=Uniform(100, 900), think_s=5.0),
                        system_prompts=system)
    return generate_batch(spec, 11, 200.0)


def test_each_turn_extends_the_previous_prompt_and_answer() -> None:
    b = multi_turn_batch()
    reqs = list(b)
    by_session: dict[int, list] = {}
    for r in reqs:
        by_session.setdefault(r.session_id, []).append(r)
    multi = [v for v in by_session.values() if len(v) > 1]
    assert len(multi) > 100
    for turns in multi:
        for prev, cur in zip(turns, turns[1:]):
            assert prev.arrival_s <= cur.arrival_s  # turns stay in order
            grown = cur.input_len - prev.input_len - prev.output_len
            assert 100 <= grown <= 900  # previous answer + a new message
            full = prev.input_len // BLOCK_TOKENS
            assert cur.block_hashes[:full] == prev.block_hashes[:full]  # every full block reappears
            if prev.input_len % BLOCK_TOKENS:
                assert cur.block_hashes[full] != prev.block_hashes[full]  # the partial one changed


def test_later_turns_reuse_exactly_the_previous_turns_full_blocks() -> None:
    b = multi_turn_batch(system=None)  # (a shared system prompt can add blocks other sessions cached)
    reuse = reusable_tokens(b)
    reqs = list(b)
    last: dict[int, int] = {}
    checked = 0
    for i, r in enumerate(reqs):
        if r.session_id in last:
            prev = reqs[last[r.session_id]]
            assert reuse[i] == (prev.input_len // BLOCK_TOKENS) * BLOCK_TOKENS
            checked += 1
        last[r.session_id] = i
    assert checked > 100


def test_system_prompt_blocks_are_shared_across_sessions_and_nothing_else() -> None:
    n = 6
    input_len = np.array([4000, 4000, 4000, 700, 5000, 3000])
    session = np.arange(n)
    system = np.array([0, 0, 1, 0, -1, 1])
    offs, ids = assign_block_hashes(input_len, session, system, system_tokens=1100)  # 2 full system blocks
    h = [ids[offs[i]:offs[i + 1]].tolist() for i in range(n)]
    assert h[0][:2] == h[1][:2] and h[0][2] != h[1][2]
    assert h[2][:2] == h[5][:2] != h[0][:2]
    assert h[3][0] == h[0][0] and len(h[3]) == 2  # 700 tokens: one full system block, then a partial one
    assert h[3][1] != h[0][1]
    assert not set(h[4]) & set(sum(h[:4] + h[5:], []))  # no system prompt: all ids its own
    assert [len(x) for x in h] == [-(-x // 512) for x in input_len]


def test_single_turn_without_system_prompts_has_no_reuse() -> None:
    conv = build_conversations(np.random.default_rng(0), 500, Uniform(100, 5000), Fixed(10), None, None, 10.0)
    offs, ids = assign_block_hashes(conv.input_len, conv.session_id, conv.system_prompt)
    assert len(np.unique(ids)) == len(ids)
