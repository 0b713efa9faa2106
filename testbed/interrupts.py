"""SIGTERM and SIGHUP as KeyboardInterrupt, as Ctrl-C: a process stopped from outside still runs its
`finally` blocks and context managers, and tears down what it built (a network's namespaces and qdiscs,
a test's fixtures)."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def raise_keyboard_interrupt(signals: tuple[int, ...] = SIGNALS) -> dict[int, Any]:
    """Make `signals` raise KeyboardInterrupt in this process's main thread; returns the handlers they
    replace (none when called from another thread, where Python cannot install handlers). A child forked
    later (pyroute2's netns helper, a test's fork) inherits the handler; it dies as by default instead."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    owner = os.getpid()

    def interrupt(signum: int, frame: Any) -> None:
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    return {sig: signal.signal(sig, interrupt) for sig in signals}
