"""Runs after the other network tests: nothing of ours is left on the host."""

import subprocess

from testbed.net import cleanup, state


def test_no_namespace_bridge_state_or_process_is_left():
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.strip() == ""
    live = state.live_states()
    claimed = {b for _, d in live for b in d.get("bridges", [])}
    assert set(cleanup._our_bridges()) <= claimed
    dead = [p.name for p, d in state.list_states() if not state.owner_alive(d)]
    assert dead == []
    ours = subprocess.run(["pgrep", "-f", "testbed.net.delayline run"], capture_output=True, text=True).stdout.split()
    live_inodes = {h["netns_inode"] for _, d in live for h in d.get("hosts", {}).values()}
    assert [p for p in ours if state.netns_inode(int(p)) not in live_inodes] == []
