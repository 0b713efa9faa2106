"""What the isolation audit (docs/network.md, "Runs side by side") found in the state files: network
tags are claimed under the lock so that two networks never share bridge names, and a run's networks
are found by its run id or run directory for `prfaas clean RUN_ID` (issue 14)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from testbed.errors import UserError
from testbed.net import state


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(state, "STATE_DIR", tmp_path)
    return tmp_path


def test_a_tag_named_by_a_state_file_live_or_dead_is_not_claimed_again(state_dir: Path):
    state.write_state(state.state_path(111, "0abcd"), {"owner_pid": 111, "tag": "0abcd"})
    assert state.claim_tag("0abcd", set()) == "0abce"
    assert state.claim_tag("12345", set()) == "12345"


def test_a_tag_whose_bridge_exists_is_not_claimed(state_dir: Path):
    assert state.claim_tag("fffff", {"brdfffff", "eth0"}) == "00000"
    assert state.claim_tag("00001", {"brf00001-eth1"}) == "00002"


def test_a_networks_bridges_are_named_once_and_only_they_match_the_pattern_clean_deletes() -> None:
    """`bridge_name` names the topology's switches; `BRIDGE_RE` is what `prfaas clean` and the state files' reader take
    for ours: every name it makes matches, and nothing else does (a port of ours, another tag's length, a capital)."""
    assert state.bridge_names("0abcd") == (state.bridge_name("prfaas", "0abcd"), state.bridge_name("pd", "0abcd")) \
        == ("brf0abcd", "brd0abcd")
    assert all(state.BRIDGE_RE.match(b) for b in state.bridge_names("fffff"))
    for other in ("brf0abcd-eth1", "brx0abcd", "brf0abc", "brf0ABCD", "eth0", "br0"):
        assert not state.BRIDGE_RE.match(other), other


def test_two_claims_under_the_lock_give_two_tags(state_dir: Path):
    tags = []
    for pid in (5, 6):
        with state.locked():
            tag = state.claim_tag("00aaa", set())
            state.write_state(state.state_path(pid, tag), {"owner_pid": pid, "tag": tag})
        tags.append(tag)
    assert tags == ["00aaa", "00aab"]


def test_a_run_is_matched_by_its_id_or_its_directory_only(tmp_path: Path):
    run_dir = tmp_path / "runs" / "quick-1"
    run_dir.mkdir(parents=True)
    data = {"run_id": "quick-1", "run_dir": str(run_dir)}
    assert state.matches_run(data, "quick-1")
    assert state.matches_run(data, str(run_dir))
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path / "runs")
        assert state.matches_run(data, "quick-1/")  # a relative path to the same directory
    finally:
        os.chdir(cwd)
    assert not state.matches_run(data, "quick-12") and not state.matches_run(data, "")
    assert not state.matches_run({"run_id": None, "run_dir": None}, "quick-1")


def test_clean_of_one_run_leaves_other_runs_state_alone(state_dir: Path, tmp_path: Path):
    from testbed.net import cleanup

    ctl = tmp_path / "prfaas-delayline-q0-test"
    ctl.mkdir()
    dead = 2 ** 22 + 1  # beyond pid_max: never alive
    mine = state.state_path(dead, "00001")
    other = state.state_path(dead, "00002")
    state.write_state(mine, {"owner_pid": dead, "tag": "00001", "run_id": "a", "bridges": [], "hosts": {}, "delayline_dirs": [str(ctl)]})
    state.write_state(other, {"owner_pid": dead, "tag": "00002", "run_id": "b", "bridges": [], "hosts": {}})
    rep = cleanup.clean(run="a")
    assert rep.networks == [mine.name] and rep.delayline_leftovers == 1
    assert not mine.exists() and not ctl.exists() and other.exists()
    assert cleanup.clean(run=str(tmp_path)).nothing  # a folder (a run directory whose network is gone): nothing to do
    with pytest.raises(UserError, match="no network names run 'nobody' .*; runs with a network left: b "):
        cleanup.clean(run="nobody")
    assert other.exists()


def test_clean_of_a_run_no_network_names_is_one_line_not_nothing_to_clean(state_dir: Path, tmp_path: Path, capsys, monkeypatch):
    """`prfaas clean TYPO` said "nothing to clean for run TYPO" and exited 0, as for a run already clean. It is refused
    before anything is done (no sysctl restored, no owner stopped with --all), naming the runs that have a network."""
    from testbed.cli import main
    from testbed.net import cleanup

    dead = 2 ** 22 + 1  # beyond pid_max: never alive
    for tag, run in (("00001", "quick-1"), ("00002", None)):  # (a `net up` network names no run)
        state.write_state(state.state_path(dead, tag), {"owner_pid": dead, "tag": tag, "run_id": run, "bridges": [], "hosts": {}})
    monkeypatch.setattr(state, "restore_sysctls_if_last", lambda *a, **kw: pytest.fail("a refused clean must do nothing"))
    for argv in (["clean", "quikc-1"], ["clean", "quikc-1", "--all", "--json"], ["clean", ""]):
        assert main(argv) == 2
        err = capsys.readouterr().err.splitlines()
        assert err == [f"prfaas clean: error: no network names run {argv[1]!r} (as its run id or its run directory), and it "
                       "is no run directory; runs with a network left: quick-1 (a plain `prfaas clean` removes every network "
                       "whose owner is gone)"]
    assert len(list(state_dir.glob("net-*.json"))) == 2
    for p in state_dir.glob("net-*.json"):
        p.unlink()
    with pytest.raises(UserError, match="; no run has a network left "):
        cleanup.clean(run="quick-1")
