"""Early stopping (`testbed.serving.early_stop`): the rule on its own (the client agent applying it is
tested in test_loadgen.py)."""

from __future__ import annotations

from testbed.serving.early_stop import MARGIN_S, EarlyStop


def test_a_request_counts_as_missed_only_when_no_later_event_can_save_it():
    e = EarlyStop(total=10, ttft_s=1.0, tpot_s=0.03, stop_below=0.9)
    assert not e.request_missed(0.0, None, 100, now_s=1.0 + MARGIN_S)  # waiting, within the SLO + margin
    assert e.request_missed(0.0, None, 100, now_s=1.0 + MARGIN_S + 0.01)  # no first token: TTFT can only grow
    assert e.request_missed(0.0, 1.6, 100, now_s=1.7)  # first token too late
    assert not e.request_missed(0.0, 0.5, 101, now_s=0.5 + MARGIN_S + 3.0)  # 3 s for 100 tokens = 30 ms: still possible
    assert e.request_missed(0.0, 0.5, 101, now_s=0.5 + MARGIN_S + 3.1)  # even finishing now would be 31 ms per token
    assert e.request_missed(0.0, 0.5, 101, now_s=0.6, failed=True)


def test_the_run_stops_once_fewer_than_the_bar_can_still_be_good():
    e = EarlyStop(total=20, ttft_s=1.0, tpot_s=0.03, stop_below=0.9)
    e.finish(0.0, 0.2, 2, 0.3, ok=False)
    e.finish(0.0, 0.2, 2, 0.3, ok=True)
    assert e.missed == 1
    assert e.decide([(0.0, None, 2)], now_s=5.0) is None  # 2 of 20 missed: 18 (90%) can still be good
    reason = e.decide([(0.0, None, 2), (1.0, None, 2)], now_s=5.0)
    assert reason == "stopped early: 3 of 20 requests already missed an SLO, so fewer than 90% can be good"


def test_a_finished_request_is_certainly_good_only_within_every_slo_with_the_margin():
    e = EarlyStop(total=10, ttft_s=1.0, tpot_s=0.03, stop_below=0.9)
    assert e.request_good(0.0, 1.0, 101, finish_s=1.0 + 3.0 - MARGIN_S)  # 30 ms per token with the margin added
    assert not e.request_good(0.0, 1.0, 101, finish_s=1.0 + 3.0 - MARGIN_S + 0.01)  # within the margin: unknown
    assert not e.request_good(0.0, 1.01, 101, finish_s=1.5)  # first token after the TTFT SLO
    assert not e.request_good(0.0, None, 1, finish_s=1.5)
    e.finish(0.0, 0.5, 101, 2.0, ok=True)
    e.finish(0.0, 0.5, 101, 2.0, ok=False)  # failed: never good
    assert (e.good, e.missed) == (1, 1)


def test_the_drain_is_cut_only_when_every_request_has_its_first_token_and_the_good_tests_agree():
    e = EarlyStop(total=20, ttft_s=1.0, tpot_s=1.0, stop_below=0.9, good=18)
    flight = [(5.0, 5.2, 100), (5.1, 5.3, 100)]
    assert e.drain_settled(flight, now_s=6.0).startswith("drain cut: every request has its first token and 18 of 20")
    assert e.drain_settled(flight[:1] + [(5.1, None, 100)], now_s=6.0) is None  # one still waits: the queue is not final
    assert e.drain_settled([], now_s=6.0) is None  # nothing left to cut
    e.good = 17  # 85% certain, 100% possible: the decoding requests decide the pass
    assert e.drain_settled(flight + [(5.2, 5.4, 100)], now_s=6.0) is None


def test_requests_without_a_first_token_are_cut_only_once_they_cannot_move_the_median_ttft():
    """`step_settled`: the queue trend's step is max(1 s, median TTFT); a request still waiting may be cut once its
    wait, less two margins, is past the TTFT at the upper median rank of all, which a known TTFT must hold."""
    e = EarlyStop(total=6, ttft_s=4.0, tpot_s=1.0, stop_below=0.9)  # the three in flight are already past the TTFT SLO
    for ttft in (2.0, 3.0, 4.0):
        e.finish(0.0, ttft, 100, 50.0, ok=True)
    flight = [(10.0, 15.0, 100), (20.0, None, 100), (21.0, None, 100)]  # last arrival 21 s
    # n = 6 TTFTs, the upper median rank 3: the known ones are 2, 3, 4, 5, so it is 5 s
    assert not e.step_settled(flight, now_s=21.0 + 2 * MARGIN_S)  # within two margins of the last arrival
    assert not e.step_settled(flight, now_s=21.0 + 5.0 + 2 * MARGIN_S)  # the last one's wait, less the margins, is 5 s
    assert e.step_settled(flight, now_s=21.0 + 5.01 + 2 * MARGIN_S)
    assert e.drain_settled(flight, now_s=30.0).startswith(
        "drain cut: the 2 still without a first token cannot move the median TTFT, which fixes the queue trend, and 3 of 6")
    assert not e.step_settled(flight + [(21.0, None, 100)] * 2, now_s=100.0)  # most still wait: the median is unknown
    fast = EarlyStop(total=4, ttft_s=30.0, tpot_s=1.0, stop_below=0.9, ttfts_s=[0.2, 0.3, 0.4])
    assert fast.step_settled([(21.0, None, 100)], now_s=21.0 + 2 * MARGIN_S + 0.01)  # median <= 1 s: the step is 1 s


def test_a_cut_drain_never_changes_the_capacity_verdict():
    """Whenever the cut fires, `experiments.capacity.judge` gives the same verdict (pass, decisive) on the
    run's recorded summary (the cut requests not good) as on any way the cut requests could have ended."""
    import random

    from experiments.capacity import GOOD_FRACTION, judge

    rng = random.Random(7)
    fired = held = 0
    for _ in range(400):
        n = rng.randint(20, 600)
        flying = rng.randint(1, max(1, n // 12))
        missed = rng.randint(0, max(0, (n - flying) // 8))
        good = rng.randint(max(0, n - flying - missed - n // 20), n - flying - missed)  # the rest: the margin band
        e = EarlyStop(total=n, ttft_s=30.0, tpot_s=0.03, stop_below=GOOD_FRACTION, good=good, missed=missed)
        if e.drain_settled([(0.0, 1.0, 1024)] * flying, now_s=2.0) is None:
            held += 1
            continue
        fired += 1
        for growing in (False, True):
            queue = {"growing": growing, "p_value": 0.5, "growth": 0.0}
            recorded = judge({"good_fraction": good / n, "requests_total": n, "queue": queue}, 1.0, 1)
            for k in range(good, n - missed + 1):  # every final count the cut requests allow
                final = judge({"good_fraction": k / n, "requests_total": n, "queue": queue}, 1.0, 1)
                assert (final.passed, final.decisive) == (recorded.passed, recorded.decisive), (n, good, missed, flying, k)
    assert fired > 50 and held > 50, (fired, held)  # both branches exercised
