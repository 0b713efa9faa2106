"""analysis.metrics.prefix_cache: a run's prefix hits against the ideal of its workload, the ideal counted
two ways (any full block, or only where a hybrid model's state was stored), checked against a brute
force written from the rules and on the first minute of Mooncake's conversation trace (issue 10 item 4)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from analysis.metrics import model_is_hybrid, prefix_cache
from traffic.trace import read_trace

BLOCK = 512
# the conversation trace's first 30 and 60 s: requests with a hit under the two ideals (all but the first
# burst's 10 requests under the any-block ideal)
SHARES = ((30.0, 77 / 87, 61 / 87), (60.0, 152 / 162, 136 / 162))


def frame(rows: list[tuple[float, int, list[int]]], cached: list[int] | None = None) -> pd.DataFrame:
    """(arrival_s, input_len, block ids) per request, nothing cached unless `cached` says so."""
    return pd.DataFrame({"arrival_s": [a for a, _, _ in rows], "input_len": [n for _, n, _ in rows],
                         "block_hashes": [ids for _, _, ids in rows], "cached_len": cached or [0] * len(rows)})


def brute_force(rows: list[tuple[float, int, list[int]]], torch: bool = False) -> tuple[list[int], list[int]]:
    """Per request in arrival order, the blocks an ideal cache would hit: (any full block, only up to a
    boundary where an earlier prompt stored its state). Written from the rules, without hashing or the
    pool: a prompt that arrived strictly earlier left the full blocks its prefill computed (input // 512;
    torch: (input - 1) // 512) and a state at their end; a later one reuses at most (input - 1) // 512
    blocks, the ids equal position by position from the first."""
    rows = sorted(rows, key=lambda r: r[0])
    anywhere, at_state = [], []
    for t, n, ids in rows:
        done = [list(p[:(m - 1 if torch else m) // BLOCK]) for a, m, p in rows if a < t]
        limit = (n - 1) // BLOCK

        def common(prev: list[int]) -> int:
            k = 0
            while k < min(limit, len(prev)) and prev[k] == ids[k]:
                k += 1
            return k

        anywhere.append(max((common(p) for p in done), default=0))
        at_state.append(max((len(p) for p in done if 0 < len(p) <= limit and common(p) == len(p)), default=0))
    return anywhere, at_state


def test_a_hybrid_prefix_is_reusable_only_up_to_a_boundary_where_an_earlier_prompt_stored_its_state() -> None:
    rows = [
        (0.0, 3 * BLOCK + 100, [1, 2, 3, 4]),  # leaves blocks 1-2-3 and a state after 3
        (1.0, 2 * BLOCK + 7, [1, 2, 9]),  # shares 1-2, no state there yet: 0 for a hybrid; leaves one after 2
        (2.0, 4 * BLOCK + 1, [1, 2, 3, 8, 5]),  # shares 1-2-3 and the state after 3: 3 blocks either way
        (3.0, 2 * BLOCK, [1, 2]),  # exactly 2 blocks: reuses only 1 (the last token is computed); no state after 1
        (4.0, 3 * BLOCK + 1, [1, 2, 6, 7]),  # shares 1-2, where the prompts at 1.0 and 3.0 left a state: 2 either way
        (5.0, 2 * BLOCK + 5, [1, 11, 12]),  # shares block 1 only: a state there only if the prompt at 3.0 left it
    ]
    cached = [0, 0, 3 * BLOCK, 0, 0, 0]
    out = prefix_cache(frame(rows, cached), hybrid=True)
    inputs = sum(n for _, n, _ in rows)
    assert brute_force(rows) == ([0, 2, 3, 1, 2, 1], [0, 0, 3, 0, 2, 0])
    assert out["ideal_hit_requests"] == pytest.approx(5 / 6) and out["ideal_hit_tokens"] == pytest.approx(9 * BLOCK / inputs)
    assert out["ideal_checkpoint_hit_requests"] == pytest.approx(2 / 6)
    assert out["ideal_checkpoint_hit_tokens"] == pytest.approx(5 * BLOCK / inputs)
    assert out["hit_requests"] == pytest.approx(1 / 6) and out["hit_tokens"] == pytest.approx(3 * BLOCK / inputs)
    assert out["efficiency"] == pytest.approx(3 / 5) and out["hybrid"] is True  # against the checkpoint ideal
    dense = prefix_cache(frame(rows, cached), hybrid=False)
    assert dense["efficiency"] == pytest.approx(3 / 9)  # a full-attention model could have reused 9 blocks
    assert prefix_cache(frame(rows), hybrid=None)["efficiency"] == 0.0  # unknown model: the any-block ideal
    # torch computes all but the last token: the 2-block prompt at 3.0 leaves 1 block and its state there
    assert brute_force(rows, torch=True) == ([0, 2, 3, 1, 2, 1], [0, 0, 3, 0, 2, 1])
    torch = prefix_cache(frame(rows), hybrid=True, compute="torch")
    assert torch["ideal_hit_requests"] == pytest.approx(5 / 6) and torch["ideal_hit_tokens"] == pytest.approx(9 * BLOCK / inputs)
    assert torch["ideal_checkpoint_hit_requests"] == pytest.approx(3 / 6)
    assert torch["ideal_checkpoint_hit_tokens"] == pytest.approx(6 * BLOCK / inputs)


def test_requests_that_arrive_together_do_not_reuse_each_others_prefix() -> None:
    """A trace's burst arrives at one instant: no request of it can use another's prefill, whatever their
    order in the file; the next burst can use all of them."""
    rows = [(0.0, 2 * BLOCK + 10, [7, 8, 9]), (0.0, 2 * BLOCK + 20, [7, 8, 5]), (0.0, BLOCK + 3, [7, 4]),
            (3.0, 2 * BLOCK + 30, [7, 8, 6])]
    assert brute_force(rows) == ([0, 0, 0, 2], [0, 0, 0, 2])
    for order in ([0, 1, 2, 3], [2, 1, 0, 3], [3, 0, 2, 1]):
        out = prefix_cache(frame([rows[i] for i in order]), hybrid=True)
        assert out["ideal_hit_requests"] == out["ideal_checkpoint_hit_requests"] == pytest.approx(1 / 4)
        assert out["ideal_checkpoint_hit_tokens"] == pytest.approx(2 * BLOCK / sum(n for _, n, _ in rows))


def test_the_first_minute_of_mooncakes_conversation_trace_hits_one_shared_block_in_almost_every_request(test_data: Path) -> None:
    """Issue 10's example: in the conversation trace every request opens with the same 512-token block, so
    an ideal cache hits it in nearly every request after the first burst (the trace's requests come in
    bursts every 3 s, each burst at one instant). A hybrid model can reuse it only where an earlier prompt
    ended its full blocks there (a prompt of 512-1023 tokens), so its ideal is lower. Both as the brute
    force counts them."""
    reqs = read_trace(test_data / "mooncake_conversation_trace_60s.jsonl").requests
    assert len(reqs) == 162 and sum(r.block_hashes[0] == 0 for r in reqs) == 162  # one shared first block
    assert len({r.arrival_s for r in reqs}) == 20  # in 20 bursts
    for horizon_s, share, share_hybrid in SHARES:
        rows = [(r.arrival_s, r.input_len, list(r.block_hashes)) for r in reqs if r.arrival_s < horizon_s]
        anywhere, at_state = brute_force(rows)
        out = prefix_cache(frame(rows), hybrid=True)
        inputs = sum(n for _, n, _ in rows)
        assert out["ideal_hit_requests"] == pytest.approx(sum(k > 0 for k in anywhere) / len(rows))
        assert out["ideal_hit_tokens"] == pytest.approx(sum(anywhere) * BLOCK / inputs)
        assert out["ideal_checkpoint_hit_requests"] == pytest.approx(sum(k > 0 for k in at_state) / len(rows))
        assert out["ideal_checkpoint_hit_tokens"] == pytest.approx(sum(at_state) * BLOCK / inputs)
        assert out["ideal_hit_requests"] == pytest.approx(share)
        assert out["ideal_checkpoint_hit_requests"] == pytest.approx(share_hybrid)
        assert out["ideal_hit_tokens"] < 0.05  # one block of prompts of ~12K tokens: few tokens
        assert out["hit_requests"] == 0.0 and out["efficiency"] == 0.0


def test_which_models_keep_state_decides_the_ideal() -> None:
    assert model_is_hybrid("paper-1t-hybrid") is True and model_is_hybrid("mimo-v2-flash") is True  # KDA + MLA; SWA + GQA
    assert model_is_hybrid("llama-3.1-70b") is False and model_is_hybrid("deepseek-v3") is False  # GQA, MLA
    assert model_is_hybrid("") is None and model_is_hybrid("no-such-model") is None


def test_a_run_shows_its_prefix_hits_against_the_ideal_of_its_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`prfaas run`'s printed summary and the report's table put the achieved share beside the model's
    ideal; a run without prefixes to reuse prints nothing about them."""
    import json

    from analysis.report import prefix_cell
    from experiments import commands
    from testbed.rundir import SUMMARY_KEYS

    pc = {"hit_requests": 0.37, "ideal_hit_requests": 0.938, "ideal_checkpoint_hit_requests": 0.84, "hybrid": True,
          "efficiency": 0.3596}
    base = {k: None for k in SUMMARY_KEYS} | {"requests_ok": 162, "requests_failed": 0, "requests_total": 162}
    for name, summary in (("hybrid", {**base, "prefix_cache": pc}), ("dense", {**base, "prefix_cache": {**pc, "hybrid": False}}),
                          ("none", {**base, "prefix_cache": {**pc, "ideal_hit_requests": 0.0}})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
        commands._print_summary(tmp_path / name)
    out = capsys.readouterr().out.splitlines()
    lines = [x for x in out if "prefix cache" in x]
    assert lines == ["  prefix cache: 37% of requests hit (an ideal cache: 84% for this hybrid model, 94% for full attention); "
                     "efficiency (tokens) 0.36 (docs/analysis.md)",
                     "  prefix cache: 37% of requests hit (an ideal cache: 94%); efficiency (tokens) 0.36 (docs/analysis.md)"]
    assert prefix_cell(pc) == "37% of 84%" and prefix_cell({**pc, "hybrid": None}) == "37% of 94%"
    assert prefix_cell({}) == "-"


def test_what_a_prefill_leaves_in_its_pool_by_compute_mode() -> None:
    from testbed.serving.kvmanager import prefilled_blocks

    assert [prefilled_blocks(n, False) for n in (1, 511, 512, 1023, 1024, 1025)] == [0, 0, 1, 1, 2, 2]
    assert [prefilled_blocks(n, True) for n in (1, 511, 512, 1023, 1024, 1025)] == [0, 0, 0, 1, 1, 2]  # torch: k x 512 leaves k - 1
