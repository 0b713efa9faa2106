"""The WAN schedule: the timed actions of `testbed.scenario.expand_schedule` -> a thread that fires them.

The expansion is pure and lives with the scenario (an event with ``for`` becomes a change and a revert;
``down: 3s`` becomes a link-down and a link-up), so the scenario's own checks walk the very timeline a run
fires. The `ScheduleRunner` fires each action at t0 + at_s on the one clock
(`testbed.clock.now_s`), t0 being `Network.start()`. A revert restores the values the changed fields
had just before its event fired (later events keep the fields they changed themselves).

How late an action takes effect (docs/scale-out.md, "How late the WAN schedule fires"): the thread
waits on a timer (no polling period) at a real-time priority, in the WAN control process (its own GIL,
testbed.net.wanctl), so it wakes as late as the host wakes a
sleeper; then `apply` does a few netlink requests (and, for netem changes or link down/up, a `tc` or
`iptables` process). The first netlink request a thread makes costs 8-12 ms more on this 2-core VM
(up to 80 ms on a busy host): pyroute2 sets up per-thread state. So the thread pays that with `warm`
(a read of the qdisc counters) before it waits for its first action, not inside it.
"""

from __future__ import annotations

import threading
from typing import Callable

from testbed import clock
from testbed.net.telemetry import boost_thread_priority
from testbed.scenario import ScheduleAction


class ScheduleRunner:
    """Fires actions on a daemon thread; `stop()` cancels what has not fired yet."""

    def __init__(self, actions: list[ScheduleAction], apply: Callable[[ScheduleAction], None], t0_s: float,
                 warm: Callable[[], None] | None = None,
                 on_fired: Callable[[float, ScheduleAction, float, str | None], None] | None = None) -> None:
        self.actions = actions
        self.apply = apply
        self.warm = warm  # run once on the schedule's thread before the first wait (the per-thread netlink setup)
        self.on_fired = on_fired  # (t_s fired, action, woke late s, error or None), after each action (testbed.net.wanctl)
        self.t0_s = t0_s
        self.fired: list[tuple[float, ScheduleAction]] = []  # (t_s fired, action)
        self.woke_late_s: list[float] = []  # per fired action: how late the thread woke for it (testbed.fidelity)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wan-schedule", daemon=True)

    def start(self) -> "ScheduleRunner":
        if self.actions:
            self._thread.start()
        return self

    def _run(self) -> None:
        boost_thread_priority()
        if self.warm is not None:
            try:
                self.warm()
            except Exception as exc:  # the actions will meet the same error and report it; note this one too
                self.errors.append(f"warm-up: {exc}")
        for action in self.actions:
            wait_s = self.t0_s + action.at_s - clock.now_s()
            if wait_s > 0 and self._stop.wait(wait_s):
                return
            woke_late_s = max(0.0, clock.now_s() - self.t0_s - action.at_s)
            error = None
            try:
                self.apply(action)
            except Exception as exc:  # keep the schedule going; the error is reported by describe()
                error = f"{action.describe()} at {action.at_s:g}s: {exc}"
                self.errors.append(error)
            t_s = clock.now_s() - self.t0_s
            self.woke_late_s.append(woke_late_s)
            self.fired.append((t_s, action))
            if self.on_fired is not None:
                self.on_fired(t_s, action, woke_late_s, error)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
