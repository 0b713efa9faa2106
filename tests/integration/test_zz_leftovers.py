"""Runs after the other integration tests (file order): nothing of ours is left on the host.
`tests/conftest.py` checks the same once more when the whole session ends."""

import subprocess

from testbed.net import cleanup, state

# Processes the testbed starts; none may outlive the test that started it.
OUR_PROCESSES = ("testbed.net.delayline", "testbed.serving.worker", "testbed.serving.router", "testbed.serving.loadgen", "iperf3 -s")


def test_no_namespace_bridge_state_or_process_is_left():
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.strip() == ""
    live = state.live_states()
    claimed = {b for _, d in live for b in d.get("bridges", [])}
    assert set(cleanup._our_bridges()) <= claimed
    dead = [p.name for p, d in state.list_states() if not state.owner_alive(d)]
    assert dead == []
    live_inodes = {h["netns_inode"] for _, d in live for h in d.get("hosts", {}).values()}
    for pattern in OUR_PROCESSES:
        pids = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
        assert [p for p in pids if state.netns_inode(int(p)) not in live_inodes] == [], pattern


def test_no_nfqueue_rule_is_left_in_the_root_namespace():
    rules = subprocess.run(["iptables-legacy", "-S"], capture_output=True, text=True).stdout
    assert "NFQUEUE" not in rules
