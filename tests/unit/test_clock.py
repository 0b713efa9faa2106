"""testbed.clock.Pacer: a run of sleeps lasts their sum (oversleep is owed to the next one), the time
between sleeps is never taken back, and a debt is forgotten after an idle gap."""

from __future__ import annotations

import threading
import time

import pytest

from testbed import clock


class OversleepingClock:
    """A fake of this module's time: each sleep lasts `over_s` longer than asked (a busy host)."""

    def __init__(self, over_s: float) -> None:
        self.t, self.over_s, self.asked = 100.0, over_s, []

    def now_s(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.asked.append(s)
        self.t += s + self.over_s


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> OversleepingClock:
    c = OversleepingClock(over_s=0.004)
    monkeypatch.setattr(clock, "now_s", c.now_s)
    monkeypatch.setattr(clock.time, "sleep", c.sleep)
    return c


def test_sixty_sleeps_last_their_sum_plus_one_oversleep(fake: OversleepingClock) -> None:
    p = clock.Pacer()
    start = fake.t
    for _ in range(60):
        p.sleep(0.010)
    assert fake.t - start == pytest.approx(0.600 + 0.004)  # plain sleeps: 0.600 + 60 x 0.004 = 0.840
    assert fake.asked[0] == pytest.approx(0.010) and fake.asked[1:] == pytest.approx([0.006] * 59)


def test_time_between_sleeps_is_real_and_not_taken_back(fake: OversleepingClock) -> None:
    p = clock.Pacer()
    start = fake.t
    p.sleep(0.010)
    fake.t += 0.300  # a hand-over to a full send path blocked: back-pressure, it counts
    p.sleep(0.010)
    assert fake.t - start == pytest.approx(0.020 + 0.300 + 0.004)


def test_with_cadence_the_work_between_sleeps_is_part_of_the_period(fake: OversleepingClock) -> None:
    p = clock.Pacer(forget_s=0.2, cadence=True)
    start = fake.t
    for _ in range(10):
        p.sleep(0.025)
        fake.t += 0.003  # streaming the step's tokens, admitting requests: inside a decode step's 25 ms
    assert fake.t - start == pytest.approx(10 * 0.025 + 0.004 + 0.003)  # the last step's oversleep and work only
    fake.t += 0.5  # idle: the next step is a full one
    fresh = fake.t
    p.sleep(0.025)
    assert fake.t - fresh == pytest.approx(0.025 + 0.004)


def test_a_debt_larger_than_a_sleep_carries_on_and_an_idle_gap_forgets_it(fake: OversleepingClock) -> None:
    fake.over_s = 0.0
    p = clock.Pacer(forget_s=0.2)
    p.sleep(0.010)
    p.late_s = 0.025  # the host stalled the last wake-up by 25 ms
    p.sleep(0.010)
    p.sleep(0.010)  # owed 25 ms: two sleeps skipped, 5 ms still owed
    assert fake.asked == pytest.approx([0.010]) and p.late_s == pytest.approx(0.005)
    p.sleep(0.010)
    assert fake.asked[-1] == pytest.approx(0.005)
    p.late_s = 0.050
    fake.t += 0.5  # idle longer than forget_s: the compute was not running late, it was not running
    p.sleep(0.010)
    assert fake.asked[-1] == pytest.approx(0.010)


def test_with_a_thread_holding_the_gil_a_paced_run_keeps_its_time() -> None:
    """Real sleeps: a thread spinning in the same process makes each wake-up wait up to the GIL's 5-ms
    switch interval; 60 plain 10-ms sleeps then took 1.4-2.2x their sum here. Loose bound: a sanity check."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        p = clock.Pacer()
        start = time.monotonic()
        for _ in range(60):
            p.sleep(0.010)
        took = time.monotonic() - start
    finally:
        stop.set()
        t.join()
    assert 0.600 <= took < 0.600 * 1.15 + 0.030, took


def test_idle_forgets_a_debt_however_soon_the_next_sleep_comes(fake: OversleepingClock) -> None:
    fake.over_s = 0.0
    p = clock.Pacer(forget_s=5.0, cadence=True)
    p.sleep(0.025)
    fake.t += 0.300  # a stall while busy: owed (no idle gap long enough to forget it)
    p.sleep(0.025)
    assert len(fake.asked) == 1  # nothing slept: the stall is repaid first
    assert p.late_s == pytest.approx(0.275)
    p.idle()  # the caller had nothing to pace
    p.sleep(0.025)
    assert fake.asked[-1] == pytest.approx(0.025) and p.late_s == pytest.approx(0.0)
