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
