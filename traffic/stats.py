"""What a workload looks like: counts, length and arrival-rate statistics, and its prefix reuse.

`hit_ratio` is the share of input tokens an infinite prefix cache with 512-token blocks could reuse:
requests are taken in arrival order; a block counts when it is full and its whole chain of preceding
hashes (itself included) was seen, as a full block, in an earlier request. Partial last blocks are never
cached or reused (prefix-cache blocks must be full, as in the paper's hybrid pool).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable

import numpy as np

from testbed.blocks import BLOCK_TOKENS
from traffic.request import Request, RequestBatch


@dataclass(frozen=True)
class Summary:
    mean: float
    std: float
    min: float
    p50: float
    p90: float
    p99: float
    max: float

    @staticmethod
    def of(values: np.ndarray) -> "Summary":
        if len(values) == 0:
            return Summary(*(float("nan"),) * 7)
        v = np.asarray(values, dtype=float)
        p50, p90, p99 = np.percentile(v, [50, 90, 99])
        return Summary(float(v.mean()), float(v.std()), float(v.min()), float(p50), float(p90), float(p99), float(v.max()))


@dataclass(frozen=True)
class ArrivalStats:
    duration_s: float  # first to last arrival
    mean_rps: float  # (requests - 1) / duration
    per_second: Summary  # arrivals in each whole second [k, k+1) from the first second to the last
    interarrival_cv: float  # 1 for Poisson; > 1 bursty


@dataclass(frozen=True)
class TraceStats:
    requests: int
    input_len: Summary
    output_len: Summary
    arrivals: ArrivalStats
    input_tokens: int
    reusable_tokens: int
    hit_ratio: float
    sessions: int  # distinct conversations (0 when requests carry none)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _as_batch(requests: RequestBatch | Iterable[Request]) -> RequestBatch:
    return requests if isinstance(requests, RequestBatch) else RequestBatch.from_requests(requests)


def reusable_tokens(requests: RequestBatch | Iterable[Request]) -> np.ndarray:
    """Per request (in the given row order), the tokens an infinite 512-token-block prefix cache would hit."""
    b = _as_batch(requests)
    order = np.argsort(b.arrival_s, kind="stable")
    full = (b.input_len // BLOCK_TOKENS).tolist()
    offs = b.hash_offsets.tolist()
    flat = b.hashes.tolist()
    nodes: dict[tuple[int, int], int] = {}
    hits = np.zeros(len(b), dtype=np.int64)
    for r in order.tolist():
        node, hit, start = 0, 0, offs[r]
        matching = True
        for h in flat[start:start + full[r]]:
            key = (node, h)
            child = nodes.get(key)
            if child is None:
                matching = False
                child = len(nodes) + 1
                nodes[key] = child
            elif matching:
                hit += 1
            node = child
        hits[r] = hit * BLOCK_TOKENS
    return hits


def arrival_stats(arrival_s: np.ndarray) -> ArrivalStats:
    t = np.sort(np.asarray(arrival_s, dtype=float))
    if len(t) == 0:
        return ArrivalStats(0.0, 0.0, Summary.of(t), float("nan"))
    duration = float(t[-1] - t[0])
    first = np.floor(t[0])
    counts = np.bincount(np.floor(t - first).astype(np.int64))
    gaps = np.diff(t)
    cv = float(gaps.std() / gaps.mean()) if len(gaps) and gaps.mean() > 0 else float("nan")
    return ArrivalStats(duration, (len(t) - 1) / duration if duration > 0 else 0.0, Summary.of(counts), cv)


def per_second_counts(arrival_s: np.ndarray) -> np.ndarray:
    """Arrivals in each second [k, k+1) from second 0 to the last arrival's second."""
    t = np.asarray(arrival_s, dtype=float)
    return np.bincount(np.floor(t).astype(np.int64)) if len(t) else np.zeros(0, dtype=np.int64)


def trace_stats(requests: RequestBatch | Iterable[Request]) -> TraceStats:
    b = _as_batch(requests)
    reuse = int(reusable_tokens(b).sum())
    total = int(b.input_len.sum())
    sessions = int(len(np.unique(b.session_id[b.session_id >= 0])))
    return TraceStats(
        requests=len(b),
        input_len=Summary.of(b.input_len),
        output_len=Summary.of(b.output_len),
        arrivals=arrival_stats(b.arrival_s),
        input_tokens=total,
        reusable_tokens=reuse,
        hit_ratio=reuse / total if total else 0.0,
        sessions=sessions,
    )
