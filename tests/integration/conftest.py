"""Integration fixtures: after the last integration test, nothing of ours may be left on the host.

`nothing_left_behind` is session-scoped and autouse, so its check runs when the session's integration
tests are all done, whatever their order or selection; a leftover fails the session (an error at the
teardown of the last test). tests/conftest.py checks namespaces once more when the session ends.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from testbed.net import cleanup, state

# Processes the testbed starts; none may outlive the test that started it.
OUR_PROCESSES = ("testbed.net.delayline", "testbed.serving.worker", "testbed.serving.router", "testbed.serving.loadgen", "iperf3 -s")


def _ours(pid: str, pattern: str) -> bool:
    """A Python process of the testbed counts only when this interpreter runs it (another checkout's tests
    on the same host are not ours); iperf3 has no such mark and always counts."""
    if pattern.startswith("iperf3"):
        return True
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return False  # gone meanwhile
    return argv0 == sys.executable


def leftovers() -> list[str]:
    """What the tests left on the host: namespaces, unclaimed bridges, state files of dead owners, our
    processes outside a live network, NFQUEUE rules in the root namespace."""
    out = []
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    if ns:
        out.append(f"network namespaces: {ns}")
    live = state.live_states()
    claimed = {b for _, d in live for b in d.get("bridges", [])}
    if unclaimed := sorted(set(cleanup._our_bridges()) - claimed):
        out.append(f"bridges no live network claims: {unclaimed}")
    if dead := [p.name for p, d in state.list_states() if not state.owner_alive(d)]:
        out.append(f"state files of networks whose owner died: {dead}")
    live_inodes = {h["netns_inode"] for _, d in live for h in d.get("hosts", {}).values()}
    for pattern in OUR_PROCESSES:
        pids = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
        if stray := [p for p in pids if _ours(p, pattern) and state.netns_inode(int(p)) not in live_inodes]:
            out.append(f"processes matching {pattern!r}: {stray}")
    if "NFQUEUE" in subprocess.run(["iptables-legacy", "-S"], capture_output=True, text=True).stdout:
        out.append("NFQUEUE rules in the root namespace's iptables")
    return out


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind() -> Iterator[None]:
    yield
    left = leftovers()
    assert not left, "left behind by the integration tests:\n" + "\n".join(left)
