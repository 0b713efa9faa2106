"""`analysis.metrics.queue_trend`: the capacity search's "queues do not grow" test, on synthetic runs
whose queues are known (a single-server FIFO prefill stage, then a fixed-length decode)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis.metrics import backlog_series, queue_trend


def fifo_run(rate_rps: float, service_s: float, decode_s: float, duration_s: float, seed: int) -> pd.DataFrame:
    """Poisson arrivals into one FIFO server (exponential service, mean `service_s`); the first token
    leaves the server, then a decode of `decode_s` (no queue: unbounded slots)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate_rps, int(rate_rps * duration_s * 1.5)))
    arrivals = arrivals[arrivals < duration_s]
    first = np.empty_like(arrivals)
    free = 0.0
    for i, a in enumerate(arrivals):
        free = max(free, a) + rng.exponential(service_s)
        first[i] = free
    return pd.DataFrame({"arrival_s": arrivals, "first_token_s": first, "finish_s": first + decode_s,
                         "output_len": 1024})


def test_backlog_counts_requests_between_arrival_and_first_token_and_unanswered_ones_stay() -> None:
    df = pd.DataFrame({"arrival_s": [0.0, 1.0, 2.0, 3.0], "first_token_s": [0.5, 4.0, np.nan, 3.2],
                       "finish_s": [30.0, 34.0, np.nan, 33.0], "output_len": [8, 8, 8, 8]})
    t, n = backlog_series(df, 1.0)
    assert list(t) == [0.0, 1.0, 2.0, 3.0]
    # t=0: #0 waits; t=1: #0 answered at 0.5, #1 waits; t=2: #1 and #2; t=3: #1, #2, #3
    assert list(n) == [1.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_stable_queue_with_long_decodes_is_judged_not_growing_in_150_s(seed: int) -> None:
    # The full reproduction's case (docs/experiments.md): every request lives ~30 s because of its
    # 1024-token answer, so in-flight samples one lifetime apart left 4 in a 150-s run ("too short").
    # The backlog before the first token is sampled one TTFT apart and judged.
    q = queue_trend(fifo_run(rate_rps=2.8, service_s=0.25, decode_s=27.0, duration_s=150.0, seed=seed))
    assert q["samples"] >= 30
    assert q["growing"] is False


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_an_overloaded_prefill_queue_is_judged_growing(seed: int) -> None:
    # Offered 2.8 req/s to a server of 2.5 req/s: the backlog grows ~0.3 requests a second.
    q = queue_trend(fifo_run(rate_rps=2.8, service_s=0.4, decode_s=27.0, duration_s=150.0, seed=seed))
    assert q["growing"] is True
    assert 0.1 < q["slope_per_s"] < 1.0


def test_the_sample_step_is_the_median_ttft_and_never_below_1_s() -> None:
    slow = fifo_run(rate_rps=0.5, service_s=1.6, decode_s=1.0, duration_s=400.0, seed=4)
    q = queue_trend(slow)
    median_ttft = float((slow["first_token_s"] - slow["arrival_s"]).median())
    assert median_ttft > 1.0 and q["step_s"] == pytest.approx(median_ttft)
    assert queue_trend(fifo_run(2.0, 0.01, 27.0, 60.0, 5))["step_s"] == 1.0


def test_a_run_too_short_for_five_samples_is_undecided() -> None:
    q = queue_trend(fifo_run(rate_rps=2.0, service_s=0.1, decode_s=27.0, duration_s=5.0, seed=6))
    assert q["samples"] < 5 and q["growing"] is None
