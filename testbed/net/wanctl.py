"""The WAN control process: the schedule and the telemetry sampler of a running WAN, in a process of their own.

Why not threads of the runner: CPython runs one thread of a process at a time (the GIL). The schedule's and
the sampler's threads had a real-time priority, but a thread that wakes must first take the GIL from
whichever of the runner's normal threads holds it (the live view, the relays, the cross-traffic readers),
and a normal thread that holds it waits for a CPU behind every real-time process of the host. With the
UDP neighbours at SCHED_RR 5 (traffic/cross.py) the 2-core VM's case-study runs lost telemetry for up
to 1.2 s at a time (50-ms samples, 12-19 gaps over 0.2 s in every such run, against 0-3 at nice 0) and
the schedule fired 0.57 and 0.69 s late in 2 runs of 10 (docs/scale-out.md). Here both threads run in a
child whose every thread has SCHED_RR 10 and whose GIL no normal thread shares, so they wake when the
host wakes a real-time sleeper.

The child drives the same kernel objects as the runner's `Wan` (`Wan.attached`: its own netlink sockets
into the gateways' namespaces, the delay lines' control files, `tc` and `iptables` through `nsenter`).
The runner's `Wan` keeps what it started and tears it down; each side tells the other of every change it
makes (`Wan.on_change`, `WanState`), so a test or benchmark that changes the WAN directly still sees it
in telemetry. The child is `python -m testbed.net.wanctl FD`, not a `multiprocessing` spawn, which would
run the user's own script again in the child unless it guards its top level with `__main__`. Messages go
over a socket pair between the runner and its own child (`multiprocessing.connection.Connection`:
pickled, nothing from the network). If the runner dies, the child sees the socket close and exits.

Parent side: `WanControl` holds the telemetry rows and listeners (`WanControl.telemetry`, the surface of
`testbed.net.telemetry.Telemetry`) and what the schedule fired (`WanControl.schedule`, that of
`testbed.net.schedule.ScheduleRunner`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

from testbed import pythonpath
from testbed.errors import HostError
from testbed.net.schedule import ScheduleRunner
from testbed.net.telemetry import Telemetry, write_rows
from testbed.net.wan import Wan, WanHandoff
from testbed.scenario import DIRECTIONS, ScheduleAction

RT_PRIORITY = 10  # the delay lines' priority (testbed.net.delayline), above the neighbours' 5 (traffic/cross.py)
START_TIMEOUT_S = 30.0
SYNC_TIMEOUT_S = 5.0


def _child_main(conn: Any, handoff: WanHandoff, t0_s: float, period_s: float) -> None:
    """The WAN control process: sample, fire the schedule when told, report both, until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the runner, which stops us
    try:  # this thread's policy is inherited by the threads it starts: none waits behind a normal one for the GIL
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(RT_PRIORITY))
    except OSError:
        pass  # best effort, as for the threads themselves (testbed.net.telemetry.boost_thread_priority)
    lock = threading.Lock()

    def send(msg: tuple) -> None:
        with lock:
            try:
                conn.send(msg)
            except (OSError, ValueError):
                pass  # the runner is gone; the main loop sees it too

    try:
        wan = Wan.attached(handoff)
        telemetry = Telemetry(wan.sample, DIRECTIONS, t0_s=t0_s, scale=handoff.scale, period_s=period_s, keep_rows=False)
        telemetry.add_listener(lambda row: send(("row", row)))
        telemetry.start()
    except Exception as exc:
        send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    send(("ready",))
    schedule: ScheduleRunner | None = None

    def fired(t_s: float, action: ScheduleAction, woke_late_s: float, error: str | None) -> None:
        send(("fired", t_s, action, woke_late_s, error, wan.state()))

    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            op = msg[0]
            if op == "schedule":  # (op, actions, t0_s): replaces the schedule running now
                if schedule is not None:
                    schedule.stop()
                send(("schedule_started",))
                schedule = ScheduleRunner(msg[1], wan.apply, msg[2], warm=wan.warm, on_fired=fired).start()
            elif op == "schedule_stop":
                if schedule is not None:
                    schedule.stop()
                    schedule = None
            elif op == "adopt":
                wan.adopt(msg[1])
            elif op == "sync":
                send(("synced", msg[1]))
            elif op == "stop":
                break
    finally:
        if schedule is not None:
            schedule.stop()
        telemetry.stop()
        send(("done", telemetry.errors))
        wan.detach()


class TelemetryFeed:
    """The runner's view of the child's telemetry: the rows as they come, and listeners called with each."""

    def __init__(self, control: "WanControl") -> None:
        self._control = control
        self.rows: list[dict[str, Any]] = []
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        self.errors = 0

    def add_listener(self, fn: Callable[[dict[str, Any]], None]) -> None:
        self.listeners.append(fn)

    def stop(self) -> None:
        self._control.stop()

    def write_parquet(self, path: Path) -> Path:
        return write_rows(self.rows, path)


class ScheduleFeed:
    """The runner's view of the child's schedule: what fired (synchronised with the child when read)."""

    def __init__(self, control: "WanControl") -> None:
        self._control = control
        self._fired: list[tuple[float, ScheduleAction]] = []
        self.woke_late_s: list[float] = []
        self.errors: list[str] = []

    @property
    def fired(self) -> list[tuple[float, ScheduleAction]]:
        self._control.sync()
        return list(self._fired)

    def start(self, actions: list[ScheduleAction], t0_s: float) -> "ScheduleFeed":
        """Fire `actions` at t0_s + at_s (absolute `testbed.clock` time), replacing the schedule running now."""
        self._control.send(("schedule", actions, t0_s))
        self._control.sync()  # the old schedule's last reports are in, and these lists were reset
        return self

    def stop(self) -> None:
        self._control.send(("schedule_stop",))

    def _reset(self) -> None:
        self._fired, self.woke_late_s, self.errors = [], [], []


class WanControl:
    """Starts the WAN control process for `wan` (already started here) and relays what it reports."""

    def __init__(self, wan: Wan, *, t0_s: float, period_s: float) -> None:
        self.wan, self.t0_s, self.period_s = wan, t0_s, period_s
        self.telemetry = TelemetryFeed(self)
        self.schedule = ScheduleFeed(self)
        self.pid: int | None = None
        self._proc: Any = None
        self._conn: Any = None
        self._send_lock = threading.Lock()
        self._ready = threading.Event()
        self._done = threading.Event()
        self._synced = threading.Condition()
        self._sync_seen = 0
        self._sync_next = 0
        self._failure: str | None = None
        self._stopped = False

    def start(self) -> "WanControl":
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": pythonpath()}
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "testbed.net.wanctl", str(theirs.fileno())],
                                          pass_fds=(theirs.fileno(),), env=env)
        except OSError as e:
            raise HostError(f"WAN control process did not start: {e}") from e
        finally:
            theirs.close()
        self.pid = self._proc.pid
        self._conn = Connection(ours.detach())
        self.send((self.wan.handoff(), self.t0_s, self.period_s))
        threading.Thread(target=self._read, name="wan-control-reader", daemon=True).start()
        if not self._ready.wait(START_TIMEOUT_S) or self._failure is not None:
            why = self._failure or f"no word from it within {START_TIMEOUT_S:g} s"
            self.stop()
            raise HostError(f"WAN control process did not start: {why}")
        self.wan.on_change = lambda state: self.send(("adopt", state))
        return self

    def send(self, msg: tuple) -> None:
        with self._send_lock:
            if self._stopped:
                return
            try:
                self._conn.send(msg)
            except (OSError, ValueError):
                pass  # the child is gone; stop() reports nothing more

    def sync(self) -> None:
        """Wait until every report the child sent before now has been handled here (at most SYNC_TIMEOUT_S)."""
        if self._stopped or self._proc is None or self._proc.poll() is not None:
            return
        with self._synced:
            self._sync_next += 1
            token = self._sync_next
        self.send(("sync", token))
        with self._synced:
            self._synced.wait_for(lambda: self._sync_seen >= token or self._done.is_set(), timeout=SYNC_TIMEOUT_S)

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            op = msg[0]
            if op == "row":
                self.telemetry.rows.append(msg[1])
                for fn in list(self.telemetry.listeners):
                    try:
                        fn(dict(msg[1]))
                    except Exception:
                        self.telemetry.errors += 1
            elif op == "fired":
                _, t_s, action, woke_late_s, error, state = msg
                self.schedule._fired.append((t_s, action))
                self.schedule.woke_late_s.append(woke_late_s)
                if error:
                    self.schedule.errors.append(error)
                self.wan.adopt(state)
            elif op == "schedule_started":
                self.schedule._reset()
            elif op == "synced":
                with self._synced:
                    self._sync_seen = max(self._sync_seen, msg[1])
                    self._synced.notify_all()
            elif op == "ready":
                self._ready.set()
            elif op == "failed":
                self._failure = msg[1]
                self._ready.set()
            elif op == "done":
                self.telemetry.errors += msg[1]
                break
        died = not self._stopped and self._ready.is_set() and self._failure is None
        if died:  # gone without being told: no more samples, and no more actions
            try:
                self._proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
            self.schedule.errors.append(f"the WAN control process ended during the run (exit code {self._proc.returncode}): "
                                        "no telemetry and no schedule action after that")
        self._done.set()
        with self._synced:
            self._synced.notify_all()
        self._ready.set()

    def stop(self) -> None:
        """Stop sampling and the schedule; wait for the child's last reports, then for the child."""
        self.wan.on_change = None
        self.send(("stop",))
        with self._send_lock:
            self._stopped = True
        if self._proc is None:
            return
        self._done.wait(10)
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=5)
        try:
            self._conn.close()
        except OSError:
            pass


def _main(argv: list[str]) -> int:
    """`python -m testbed.net.wanctl FD`: FD is our end of the socket pair; the first message is the handoff."""
    conn = Connection(int(argv[0]))
    try:
        handoff, t0_s, period_s = conn.recv()
    except (EOFError, OSError):
        return 1
    _child_main(conn, handoff, t0_s, period_s)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
