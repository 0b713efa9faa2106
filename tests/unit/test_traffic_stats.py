"""Workload statistics: the infinite-cache prefix reuse on a hand-made trace, and the bundled trace."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from traffic.stats import arrival_stats, reusable_tokens, trace_stats
from traffic.trace import read_trace

# (timestamp ms, input_length, hash_ids); the file lists B before A but A arrives first.
HAND = [
    (1000, 1300, [1, 2, 9]),     # B: full blocks 1, 2 both seen in A -> 1024
    (0, 1536, [1, 2, 3]),        # A: nothing seen before -> 0
    (2000, 2048, [1, 5, 3, 4]),  # C: 1 seen; 5 not -> stop (3 under 1,5 is a new chain) -> 512
    (3000, 1024, [2, 3]),        # D: id 2 was seen only at position 1, not as a first block -> 0
    (4000, 1100, [1, 2, 9]),     # E: full blocks 1, 2 -> 1024 (its 9 is partial, never counted)
    (5000, 1536, [1, 2, 9]),     # F: 9 was only ever a partial block, so not cached -> 1024
]
EXPECTED_REUSE = [1024, 0, 512, 0, 1024, 1024]


def hand_trace(tmp_path: Path) -> Path:
    p = tmp_path / "hand.jsonl"
    p.write_text("".join(f'{{"timestamp": {t}, "input_length": {n}, "output_length": 10, "hash_ids": {h}}}\n' for t, n, h in HAND))
    return p


def test_prefix_reuse_on_a_hand_made_trace(tmp_path: Path) -> None:
    reqs = read_trace(hand_trace(tmp_path)).requests
    assert reusable_tokens(reqs).tolist() == EXPECTED_REUSE
    st = trace_stats(reqs)
    assert st.input_tokens == 1300 + 1536 + 2048 + 1024 + 1100 + 1536
    assert st.reusable_tokens == 3584
    assert st.hit_ratio == pytest.approx(3584 / 8544)


def test_arrival_stats_per_second_and_cv() -> None:
    a = arrival_stats(np.array([0.1, 0.2, 0.3, 1.5, 3.9]))
    assert a.per_second.max == 3 and a.per_second.min == 0  # seconds 0..3: 3, 1, 0, 1
    assert a.per_second.mean == pytest.approx(5 / 4)
    assert a.mean_rps == pytest.approx(4 / 3.8)


def test_bundled_trace_stats(mooncake_trace: Path) -> None:
    st = trace_stats(read_trace(mooncake_trace).requests)
    assert st.requests == 3993
    assert st.input_len.mean == pytest.approx(15_325, abs=1)  # the README's figures
    assert st.output_len.mean == pytest.approx(149, abs=0.5)
    assert st.arrivals.duration_s == pytest.approx(1022.025)
    assert st.arrivals.interarrival_cv == pytest.approx(1.0, abs=0.05)  # Poisson arrivals
    assert 0.6 < st.hit_ratio < 0.7  # multi-turn reuse: 0.6504 with full-block, chain-exact matching
    assert st.reusable_tokens % 512 == 0
