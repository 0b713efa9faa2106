"""Multi-turn conversations and shared system prompts, expressed as 512-token block hashes.

A turn's prompt is the previous turn's prompt + the previous answer + a new user message, so every full
block of the previous prompt reappears at the same position with the same id. Ids follow the Mooncake
convention: equal ids at the same position mean an equal prefix up to and including that block.
  - a full block inside a shared system prompt: one id per (prompt, position), shared by all sessions;
  - any other full block: one id per (session, position), stable across the session's turns;
  - the partial last block of a prompt: an id of its own (its content changes with the next turn).
Everything is vectorised over requests (a million requests of ~54 blocks each is ~54M ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from testbed import units
from testbed.validation import Fields, whole_number
from traffic.lengths import Fixed, LengthDist, parse_length
from testbed.blocks import BLOCK_TOKENS


@dataclass(frozen=True)
class SystemPrompts:
    """`count` distinct system prompts of `tokens` each; a share `fraction` of sessions opens with one (uniform pick)."""

    count: int
    tokens: int
    fraction: float = 1.0


@dataclass(frozen=True)
class SessionSpec:
    """Conversations of `turns` turns; each later turn adds the previous answer and `message` new tokens.

    `think_s` (mean, exponential) only orders turns among other sessions' requests: the arrival process
    decides the actual times, so its rate is exactly what the scenario asks for. A conversation ends early
    when a turn would exceed `max_context` tokens.
    """

    turns: LengthDist
    message: LengthDist
    think_s: float = 30.0
    max_context: int = 128 * 1024


@dataclass(frozen=True)
class Conversations:
    """n requests in conversation order: lengths, session ids (-1: none) and the session's system prompt (-1: none)."""

    input_len: np.ndarray
    output_len: np.ndarray
    session_id: np.ndarray
    system_prompt: np.ndarray


def _segment_starts(counts: np.ndarray) -> np.ndarray:
    starts = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    return starts


def _segmented_cumsum(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Running sums that restart at every segment."""
    csum = np.cumsum(values)
    starts = _segment_starts(counts)
    return csum - np.repeat(csum[starts] - values[starts], counts)


def _within(counts: np.ndarray, total: int | None = None) -> np.ndarray:
    """0, 1, ..., counts[i]-1 for every segment, concatenated."""
    total = int(counts.sum()) if total is None else total
    return np.arange(total, dtype=np.int64) - np.repeat(_segment_starts(counts), counts)


def build_conversations(rng: np.random.Generator, n: int, input_dist: LengthDist, output_dist: LengthDist,
                        sessions: SessionSpec | None, system: SystemPrompts | None, horizon_s: float) -> Conversations:
    """Draw n requests. Without `sessions` every request is its own single-turn session (session_id -1)."""
    if sessions is None:
        sys_of = _pick_system(rng, n, system)
        return Conversations(input_dist.sample(rng, n), output_dist.sample(rng, n), np.full(n, -1, dtype=np.int64), sys_of)
    parts: list[tuple[np.ndarray, ...]] = []
    kept = 0
    first_session = 0
    per_session = max(sessions.turns.mean(), 1.0)
    while kept < n:
        s = int((n - kept) / per_session * 1.2) + 16
        turns = np.maximum(sessions.turns.sample(rng, s), 1)
        total = int(turns.sum())
        sid = np.repeat(np.arange(s, dtype=np.int64), turns)
        t = _within(turns, total)
        out = output_dist.sample(rng, total)
        inc = sessions.message.sample(rng, total)
        inc[1:] += out[:-1]  # a later turn carries the previous answer...
        first = t == 0
        inc[first] = input_dist.sample(rng, s)  # ...the first turn is an ordinary prompt
        length = _segmented_cumsum(inc, turns)
        gaps = rng.exponential(sessions.think_s, total)
        gaps[first] = rng.random(s) * horizon_s
        virt = _segmented_cumsum(gaps, turns)
        keep = length <= sessions.max_context
        keep[first] = True  # a first turn longer than the cap is the input distribution's business
        sys_of = _pick_system(rng, s, system)[sid]
        parts.append((virt[keep], length[keep], out[keep], sid[keep] + first_session, sys_of[keep]))
        kept += int(keep.sum())
        first_session += s
    virt, length, out, sid, sys_of = (np.concatenate(c) for c in zip(*parts))
    order = np.argsort(virt, kind="stable")[:n]
    return Conversations(length[order], out[order], sid[order], sys_of[order])


def _pick_system(rng: np.random.Generator, s: int, system: SystemPrompts | None) -> np.ndarray:
    if system is None or system.count == 0:
        return np.full(s, -1, dtype=np.int64)
    pick = rng.integers(0, system.count, size=s, dtype=np.int64)
    pick[rng.random(s) >= system.fraction] = -1
    return pick


def assign_block_hashes(input_len: np.ndarray, session_id: np.ndarray, system_prompt: np.ndarray,
                        system_tokens: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """CSR (offsets, ids) of every request's block hashes; see the module docstring for the id rules."""
    n = len(input_len)
    if n and input_len.min() < 1:
        raise ValueError("every request needs at least 1 input token")
    n_blocks = -(-input_len // BLOCK_TOKENS)
    full = input_len // BLOCK_TOKENS
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(n_blocks, out=offsets[1:])
    # Sessions: a request without a session is a session of its own (keyed by its row).
    key = np.where(session_id >= 0, session_id, -1 - np.arange(n, dtype=np.int64))
    uniq, inv = np.unique(key, return_inverse=True)
    span = np.zeros(len(uniq), dtype=np.int64)
    np.maximum.at(span, inv, full)
    sys_full = (system_tokens // BLOCK_TOKENS) if system_tokens else 0
    n_sys = int(system_prompt.max() + 1) if n and system_prompt.max() >= 0 else 0
    session_base = n_sys * sys_full + _segment_starts(span)
    partial_base = n_sys * sys_full + int(span.sum())
    # ids run +1 along each request from its session's base: a cumulative sum of ones with a jump at each
    # request's first block (one pass over ~54M ids for a million paper-length requests; int32 when it fits).
    dtype = np.int32 if partial_base + n < np.iinfo(np.int32).max else np.int64
    first = session_base[inv]
    jump = first.copy()
    jump[1:] -= first[:-1] + n_blocks[:-1] - 1
    ids = np.ones(int(offsets[-1]), dtype=dtype)
    ids[offsets[:-1]] = jump
    np.cumsum(ids, dtype=dtype, out=ids)
    has_partial = (input_len % BLOCK_TOKENS) != 0
    rows = np.flatnonzero(has_partial)
    ids[offsets[rows + 1] - 1] = partial_base + rows
    if sys_full and n_sys:
        in_sys = np.where(system_prompt >= 0, np.minimum(full, sys_full), 0)
        pos = np.repeat(offsets[:-1], in_sys) + _within(in_sys)
        ids[pos] = np.repeat(system_prompt * sys_full, in_sys) + _within(in_sys)
    return offsets, ids


def parse_sessions(value: Any, path: str, source: str | None = None) -> SessionSpec:
    f = Fields(value, path, source)
    spec = SessionSpec(
        turns=f.get("turns", lambda v: parse_length(v, f.name("turns"), source)),
        message=f.get("message", lambda v: parse_length(v, f.name("message"), source), Fixed(256)),
        think_s=f.get("think", lambda v: units.parse_duration_s(v, allow_zero=False), 30.0),
        max_context=f.get("max_context", units.parse_tokens, 128 * 1024),
    )
    f.done()
    return spec


def parse_system_prompts(value: Any, path: str, source: str | None = None) -> SystemPrompts:
    f = Fields(value, path, source)
    spec = SystemPrompts(f.get("count", whole_number, 1), f.get("tokens", units.parse_tokens), f.get("fraction", units.parse_fraction, 1.0))
    f.done()
    return spec
