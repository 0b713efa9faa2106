"""`analysis.metrics.queue_trend`: the capacity search's "queues do not grow" test, on synthetic runs
whose queues are known (a FIFO prefill stage of `servers` servers, then a fixed-length decode)."""

from __future__ import annotations

import heapq

import numpy as np
import pandas as pd
import pytest

from analysis.metrics import queue_trend, queued_series


def fifo_run(rate_rps: float, service_s: float, decode_s: float, duration_s: float, seed: int, servers: int = 1,
             late_service_factor: float = 1.0) -> pd.DataFrame:
    """Poisson arrivals into `servers` FIFO servers (exponential service, mean `service_s`, times
    `late_service_factor` for arrivals in the second half: longer prompts, the same rate); the first
    token follows the prefill by 40 ms, then a decode of `decode_s` (unbounded slots)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate_rps, int(rate_rps * duration_s * 1.5) + 10))
    arrivals = arrivals[arrivals < duration_s]
    free = [0.0] * servers
    start, end = np.empty_like(arrivals), np.empty_like(arrivals)
    for i, a in enumerate(arrivals):
        s = max(heapq.heappop(free), a)
        mean = service_s * (late_service_factor if a > duration_s / 2 else 1.0)
        start[i], end[i] = s, s + rng.exponential(mean)
        heapq.heappush(free, end[i])
    return pd.DataFrame({"arrival_s": arrivals, "prefill_start_s": start, "prefill_end_s": end,
                         "first_token_s": end + 0.04, "finish_s": end + 0.04 + decode_s, "output_len": 1024})


def test_queued_counts_prefill_queue_and_waits_after_prefill_not_requests_being_served() -> None:
    df = pd.DataFrame({"arrival_s": [0.0, 1.0, 2.0, 3.0], "prefill_start_s": [0.0, 2.5, np.nan, 3.0],
                       "prefill_end_s": [0.5, 3.5, np.nan, 3.1], "first_token_s": [0.6, 4.0, np.nan, 3.2],
                       "finish_s": [30.0, 34.0, np.nan, 33.0], "output_len": [8, 8, 8, 8]})
    t, n = queued_series(df, 1.0)
    assert list(t) == [0.0, 1.0, 2.0, 3.0]
    # t=0: #0 prefilling (not queued); t=1: #1 in the prefill queue; t=2: #1 and #2 (never served);
    # t=3: #1 prefilling, #2 still waiting, #3 prefilling
    assert list(n) == [0.0, 1.0, 2.0, 1.0]


SEEDS = range(40)


def flagged(**run: float) -> float:
    """Share of `SEEDS` whose run the test calls growing (each run is 150 s with 27-s decodes)."""
    return float(np.mean([queue_trend(fifo_run(decode_s=27.0, duration_s=150.0, seed=s, **run))["growing"] is True
                          for s in SEEDS]))


def test_a_stable_queue_with_long_decodes_is_judged_and_rarely_called_growing() -> None:
    # The full reproduction's case (docs/experiments.md): every request lives ~30 s because of its
    # 1024-token answer, so in-flight samples one lifetime apart left 4 in a 150-s run ("too short").
    q = queue_trend(fifo_run(rate_rps=2.8, service_s=0.25, decode_s=27.0, duration_s=150.0, seed=1))
    assert q["samples"] >= 30 and q["growing"] is not None
    assert flagged(rate_rps=2.8, service_s=0.25) <= 0.1  # utilisation 0.7


def test_an_overloaded_prefill_queue_is_mostly_judged_growing() -> None:
    # Offered 2.8 req/s to a server of 2.5 req/s: the queue grows ~0.3 requests a second.
    assert flagged(rate_rps=2.8, service_s=0.4) >= 0.5
    q = queue_trend(fifo_run(rate_rps=2.8, service_s=0.4, decode_s=27.0, duration_s=150.0, seed=1))
    assert q["growing"] is True and 0.1 < q["slope_per_s"] < 1.0


def test_longer_prompts_late_in_a_stable_run_are_not_a_growing_queue() -> None:
    # Nine servers at utilisation 0.33, then 0.6 (prompts 1.8x longer): more requests are being
    # served, hardly any waits. Counting them (the backlog before the first token) called this
    # "growing" in a measured homogeneous-PD run at 63% of its capacity (docs/experiments.md).
    late = dict(rate_rps=1.33, service_s=2.25, servers=9, late_service_factor=1.8)
    assert flagged(**late) <= 0.05
    df = fifo_run(decode_s=27.0, duration_s=150.0, seed=1, **late)
    served = (df["prefill_start_s"] <= 120.0) & (df["prefill_end_s"] > 120.0)
    early = (df["prefill_start_s"] <= 40.0) & (df["prefill_end_s"] > 40.0)
    assert served.sum() > early.sum()  # the confound is there: more in service late


def test_the_sample_step_is_the_median_ttft_and_never_below_1_s() -> None:
    slow = fifo_run(rate_rps=0.5, service_s=1.6, decode_s=1.0, duration_s=400.0, seed=4)
    q = queue_trend(slow)
    median_ttft = float((slow["first_token_s"] - slow["arrival_s"]).median())
    assert median_ttft > 1.0 and q["step_s"] == pytest.approx(median_ttft)
    assert queue_trend(fifo_run(2.0, 0.01, 27.0, 60.0, 5))["step_s"] == 1.0


def test_a_run_too_short_for_five_samples_is_undecided() -> None:
    q = queue_trend(fifo_run(rate_rps=2.0, service_s=0.1, decode_s=27.0, duration_s=5.0, seed=6))
    assert q["samples"] < 5 and q["growing"] is None


def test_a_drain_cut_leaves_the_queue_trend_as_it_was() -> None:
    """The drain cut (testbed.serving.early_stop) ends the requests still decoding once every request has its
    first token: their status becomes ``cut`` and their finish moves up; the router keeps their prefill
    times. The trend must read none of what changed, or a cut could move a verdict."""
    for seed, rate in ((1, 2.0), (2, 4.5), (3, 5.5)):  # stable, near the edge, overloaded
        df = fifo_run(rate, 0.2, 26.0, 150.0, seed).assign(status="ok")
        cut_at = float(df["first_token_s"].max()) + 1.0
        decoding = df["finish_s"] > cut_at
        cut = df.assign(status=np.where(decoding, "cut", "ok"), finish_s=np.where(decoding, cut_at, df["finish_s"]))
        assert decoding.sum() > 20
        assert queue_trend(cut) == queue_trend(df)
        # what the cut must not lose: without the prefill times a cut request counts as queued through its prefill
        lost = cut.assign(prefill_start_s=np.where(decoding, np.nan, cut["prefill_start_s"]),
                          prefill_end_s=np.where(decoding, np.nan, cut["prefill_end_s"]))
        assert queued_series(lost, 1.0)[1].sum() > queued_series(cut, 1.0)[1].sum()


def _cut_at(df: pd.DataFrame, t_s: float) -> pd.DataFrame:
    """`df` as the drain cut at `t_s` records it: requests unfinished then are ``cut`` and end then; those without
    a first token by then have none, and keep only the prefill times already past (the router's cancel)."""
    open_ = df["finish_s"] > t_s
    waiting = df["first_token_s"] > t_s
    return df.assign(status=np.where(open_, "cut", "ok"), finish_s=np.where(open_, t_s, df["finish_s"]),
                     first_token_s=df["first_token_s"].where(~waiting),
                     prefill_start_s=df["prefill_start_s"].where(df["prefill_start_s"] <= t_s),
                     prefill_end_s=df["prefill_end_s"].where(df["prefill_end_s"] <= t_s),
                     prefill_cancel=np.where(waiting, np.where(df["prefill_start_s"] <= t_s, "running", "dequeued"), None))


def _trend(df: pd.DataFrame) -> dict:
    return {k: v for k, v in queue_trend(df).items() if k != "cut_exact"}


def _client_settles_at(df: pd.DataFrame, seed: int, step_s: float = 0.1) -> float | None:
    """The first time after the last arrival at which the client agent's rule (`EarlyStop.step_settled`) holds,
    on client-side times that lie outside the router's by up to 0.4 s (within `MARGIN_S`)."""
    from testbed.serving.early_stop import EarlyStop

    rng = np.random.default_rng(seed)
    arr = df["arrival_s"].to_numpy() - rng.uniform(0, 0.4, len(df))  # the client sends before the router sees it
    first = df["first_token_s"].to_numpy() + rng.uniform(0, 0.4, len(df))  # and sees the first token after
    finish = df["finish_s"].to_numpy() + 0.01
    for t in np.arange(float(arr.max()), float(finish.max()), step_s):
        e = EarlyStop(total=len(df), ttft_s=1e6, tpot_s=1e6, stop_below=0.9)
        for i in np.flatnonzero(finish <= t):
            e.finish(arr[i], first[i], 1024, finish[i], ok=True)
        flight = [(arr[i], first[i] if first[i] <= t else None, 1024) for i in np.flatnonzero(finish > t)]
        if flight and e.step_settled(flight, float(t)):
            return float(t)
    return None


def test_a_drain_cut_before_the_last_first_tokens_leaves_the_queue_trend_as_it_was() -> None:
    """The drain cut may end requests still waiting for their first token once they cannot move the trend's
    step (`EarlyStop.step_settled`); with the prefill times the router's cancel returns, the trend is the
    uncut run's -- stable, near the edge and overloaded -- and the cut comes before the last first token where
    the queue grew. Cut sooner (only past the last arrival), the median step, and so the trend, would move."""
    saved, waiting = [], 0
    for seed, rate, servers in ((1, 2.0, 1), (2, 4.5, 1), (3, 5.5, 1), (4, 11.0, 2), (6, 6.0, 1)):
        df = fifo_run(rate, 0.2, 26.0, 150.0, seed, servers=servers).assign(status="ok")
        t = _client_settles_at(df, seed)
        assert t is not None
        cut = _cut_at(df, t)
        assert _trend(cut) == _trend(df), (seed, rate)
        saved.append(float(df["first_token_s"].max()) - t)
        waiting += int(cut["first_token_s"].isna().sum() > 5)  # it cut requests still waiting
        assert queue_trend(cut)["cut_exact"] is (True if cut["first_token_s"].isna().any() else None)
    assert waiting >= 3 and max(saved) > 5.0, (waiting, saved)
    # a stable run whose last requests wait less than its median TTFT (> 1 s): cut at once, the step would move
    slow = fifo_run(rate_rps=0.5, service_s=1.6, decode_s=26.0, duration_s=150.0, seed=4).assign(status="ok")
    last = float(slow["arrival_s"].max())
    early = queue_trend(_cut_at(slow, last + 0.05))
    assert early["step_s"] != queue_trend(slow)["step_s"] and early["cut_exact"] is False  # and the record says so
    t = _client_settles_at(slow, 4)
    assert t is not None and t > float(slow["first_token_s"].max())  # the rule waited for every first token
    assert queue_trend(_cut_at(slow, t)) == queue_trend(slow)


def test_a_cut_whose_exactness_the_records_cannot_show_is_called_not_exact() -> None:
    """`cut_exact` is False, so the capacity search repeats the rate (`experiments.capacity.judge`), when a cut record
    lacks its prefill times (the cancel got no answer), or the router noticed a hang-up before its last arrival."""
    from experiments.capacity import judge

    df = fifo_run(6.0, 0.2, 26.0, 150.0, 6).assign(status="ok")
    t = _client_settles_at(df, 6)
    cut = _cut_at(df, t)
    assert queue_trend(cut)["cut_exact"] is True
    lost = cut.assign(prefill_cancel=cut["prefill_cancel"].where(cut["prefill_cancel"].isna(), "no answer: timed out"))
    assert queue_trend(lost)["cut_exact"] is False
    late = cut.assign(arrival_s=cut["arrival_s"].where(cut["arrival_s"] < cut["arrival_s"].max(), t + 1.0))
    assert queue_trend(late)["cut_exact"] is False
    summary = {"good_fraction": 1.0, "requests_total": 1000}
    for q, decisive in ((queue_trend(cut), True), (queue_trend(lost), False)):
        q = {**q, "growing": False, "p_value": 0.5}
        assert judge({**summary, "queue": q}, 6.0, 1).decisive is decisive
