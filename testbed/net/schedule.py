"""The WAN schedule: scenario events -> timed actions (with reverts) -> a thread that fires them.

`expand_schedule` is pure: an event with ``for`` becomes a change and a revert; ``down: 3s`` becomes a
link-down and a link-up. The `ScheduleRunner` fires each action at t0 + at_s on the one clock
(`testbed.clock.now_s`), t0 being `Network.start()`. A revert restores the values the changed fields
had just before its event fired (later events keep the fields they changed themselves).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from testbed import clock
from testbed.net.telemetry import boost_thread_priority
from testbed.scenario import ScheduleEvent


@dataclass(frozen=True)
class ScheduleAction:
    at_s: float
    event_index: int
    directions: tuple[str, ...]
    kind: str  # "change" | "revert" | "down" | "up"
    changes: tuple[tuple[str, Any], ...] = ()

    def describe(self) -> str:
        what = ", ".join(f"{k}={_fmt(v)}" for k, v in self.changes) if self.changes else ""
        return f"{self.kind} {'+'.join(self.directions)} {what}".strip()


def _fmt(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def expand_schedule(events: tuple[ScheduleEvent, ...] | list[ScheduleEvent]) -> list[ScheduleAction]:
    """Events -> actions in time order; at equal times, the scenario's order is kept."""
    actions: list[ScheduleAction] = []
    for i, e in enumerate(events):
        if e.down_s:
            actions.append(ScheduleAction(e.at_s, i, e.directions, "down"))
            actions.append(ScheduleAction(e.at_s + e.down_s, i, e.directions, "up"))
        if e.changes:
            actions.append(ScheduleAction(e.at_s, i, e.directions, "change", e.changes))
            if e.for_s is not None:
                actions.append(ScheduleAction(e.at_s + e.for_s, i, e.directions, "revert", e.changes))
    return sorted(actions, key=lambda a: a.at_s)


class ScheduleRunner:
    """Fires actions on a daemon thread; `stop()` cancels what has not fired yet."""

    def __init__(self, actions: list[ScheduleAction], apply: Callable[[ScheduleAction], None], t0_s: float) -> None:
        self.actions = actions
        self.apply = apply
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
        for action in self.actions:
            wait_s = self.t0_s + action.at_s - clock.now_s()
            if wait_s > 0 and self._stop.wait(wait_s):
                return
            self.woke_late_s.append(max(0.0, clock.now_s() - self.t0_s - action.at_s))
            try:
                self.apply(action)
            except Exception as exc:  # keep the schedule going; the error is reported by describe()
                self.errors.append(f"{action.describe()} at {action.at_s:g}s: {exc}")
            self.fired.append((clock.now_s() - self.t0_s, action))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
