"""Profile-mode compute timing (testbed.serving.compute.ProfileCompute with the worker's lateness rule): a
host stall while requests decode is owed and repaid, an empty batch owes nothing, and a request's
`decode_late_s` is its first-to-last token time past the profile's steps between them, whatever the
pacer forgave; a prefill's debt outlives a long wait between its layers. Unit: time is a fake clock."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from testbed import clock
from testbed.serving.compute import ProfileCompute
from testbed.serving.worker import WorkerConfig, stream_late_s


class FakeClock:
    def __init__(self) -> None:
        self.t = 50.0

    def now_s(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    c = FakeClock()
    monkeypatch.setattr(clock, "now_s", c.now_s)
    monkeypatch.setattr(clock.time, "sleep", c.sleep)
    return c


def decode_compute() -> ProfileCompute:
    return ProfileCompute(WorkerConfig(role="decode", instance=0, cluster="pd", host="lo", port=0, compute="profile",
                                       model={"name": "paper-1t-hybrid", "compute": "profile"},
                                       profile="h20-paper-1t-hybrid", scale=1.0))


def test_a_stall_while_decoding_is_repaid_and_an_empty_batch_owes_nothing(fake: FakeClock) -> None:
    comp = decode_compute()
    slots = [SimpleNamespace(request_id=f"r{i}", emitted=0) for i in range(4)]
    step = float(comp.profile.decode_step_s(4))
    comp.decode_step(slots)
    t_first, due_first = fake.t, comp.decode_due_s
    for k in range(20):
        if k == 5:
            fake.t += 0.3  # the host stalled the decode loop for 300 ms (more than the old 0.2-s forgetting)
        comp.decode_step(slots)
    assert comp.decode_due_s - due_first == pytest.approx(20 * step)
    # repaid: the 20 steps after the first token took their profile time, not 300 ms more (before this
    # rule the pacer forgot any gap over 0.2 s, and the stall stayed in the stream, unrecorded)
    assert 0.3 < 20 * step
    assert fake.t - t_first == pytest.approx(20 * step)
    assert stream_late_s(t_first, due_first, fake.t, comp.decode_due_s) == pytest.approx(0.0, abs=1e-9)
    comp.decode_idle()  # no request for a while, then one: a full step, nothing owed
    fake.t += 0.05
    t0 = fake.t
    comp.decode_step(slots[:1])
    assert fake.t - t0 == pytest.approx(float(comp.profile.decode_step_s(1)))


def test_what_the_pacer_cannot_repay_is_the_request_s_lateness(fake: FakeClock) -> None:
    comp = decode_compute()
    slots = [SimpleNamespace(request_id="r0", emitted=0)]
    step = float(comp.profile.decode_step_s(1))
    comp.decode_step(slots)
    t_first, due_first = fake.t, comp.decode_due_s
    for _ in range(10):
        fake.t += step * 1.5  # every iteration's own work already takes 1.5 steps: no sleep can absorb it
        comp.decode_step(slots)
    took = fake.t - t_first
    assert took == pytest.approx(10 * step * 1.5)
    assert stream_late_s(t_first, due_first, fake.t, comp.decode_due_s) == pytest.approx(10 * step * 0.5)


def test_a_prefill_repays_its_debt_after_a_long_wait_between_layers(fake: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill paused for 1.5 s (preempted, or blocked on a full send path) right after a layer the host
    overslept by 50 ms still lasts its profile's time plus the pause: the debt is repaid after the pause,
    not forgotten (a pacer's default forgets debts older than 1 s)."""
    from testbed.serving.compute import PrefillPlan

    comp = ProfileCompute(WorkerConfig(role="prefill", instance=0, cluster="prfaas", host="lo", port=0, compute="profile",
                                       model={"name": "paper-1t-hybrid", "compute": "profile"},
                                       profile="h200-paper-1t-hybrid", scale=1.0))
    sleeps = {"n": 0, "paused": False}
    exact = fake.sleep

    def sleep(s: float) -> None:
        sleeps["n"] += 1
        exact(s + (0.050 if sleeps["n"] == 5 else 0.0))

    def on_layer(layer) -> None:  # type: ignore[no-untyped-def]
        if sleeps["n"] >= 5 and not sleeps["paused"]:
            sleeps["paused"] = True
            fake.t += 1.5

    monkeypatch.setattr(clock.time, "sleep", sleep)
    start = fake.t
    out = comp.prefill("r1", PrefillPlan(32_768), None, on_layer)
    assert sleeps["paused"]
    assert fake.t - start == pytest.approx(comp.prefill_time_s(32_768, 0) + 1.5)
    assert out.late_s == pytest.approx(0.0)
