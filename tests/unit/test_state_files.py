"""Damaged host state files (testbed.net.state, testbed.net.guest): a network's state file, the saved sysctls and
the cached KVM probe, cut short, emptied, hand-edited or of the wrong types, are one line naming the file and what
is wrong, and are handled safely: `prfaas clean` removes a damaged network file and says what it could not clean,
no process is signalled that its pid and start time do not identify, no sysctl value is written that is not a value
/proc/sys gave, and a damaged probe cache is probed again. Nothing here touches the host: the state directory is a
tmp folder, and the bridges, sysctls and signals are recorded, not made."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from testbed.cli import main
from testbed.errors import UserError
from testbed.net import cleanup, emulation, state

DEAD = 2**22 + 1  # beyond pid_max: never a process
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A state directory in tmp, and a host whose bridges, sysctls and signals are recorded only."""
    import testbed.net.delayline as delayline

    rec: dict[str, Any] = {"killed": [], "deleted": [], "written": {}, "bridges": [], "netns": [],
                           "ns": {}, "cookies": {},  # the namespaces' processes (inode: pids), their cookies (pid: cookie)
                           "sysctl": {k: "9" for k in [*state.SYSCTL_SET, *state.SYSCTL_MININET]}}
    monkeypatch.setattr(state, "STATE_DIR", tmp_path / "state")
    monkeypatch.setattr(state, "_warned", set())

    def kill_pids(pids: Any, grace_s: float = 2.0) -> list[int]:
        rec["killed"] += list(pids)
        return list(pids)

    def pids_by_netns(inodes: set[int]) -> dict[int, list[int]]:
        rec["netns"].append(set(inodes))
        return {i: list(rec["ns"][i]) for i in inodes if i in rec["ns"]}

    def delete_bridges(names: list[str]) -> list[str]:
        rec["deleted"] += names
        return list(names)

    def write_sysctl(key: str, value: str) -> bool:
        rec["written"][key] = value
        rec["sysctl"][key] = value
        return True

    monkeypatch.setattr(emulation, "kill_pids", kill_pids)
    monkeypatch.setattr(state, "pids_by_netns", pids_by_netns)
    monkeypatch.setattr(state, "netns_cookie", lambda pid: rec["cookies"].get(pid))
    monkeypatch.setattr(cleanup, "delete_bridges", delete_bridges)
    monkeypatch.setattr(cleanup, "_our_bridges", lambda: list(rec["bridges"]))
    monkeypatch.setattr(delayline, "remove_stale_control_dirs", lambda *a, **kw: 0)
    monkeypatch.setattr(delayline, "cleanup_rules", lambda *a, **kw: 0)
    monkeypatch.setattr(state, "read_sysctl", lambda k: rec["sysctl"].get(k))
    monkeypatch.setattr(state, "write_sysctl", write_sysctl)
    return rec


def good_state(pid: int = DEAD, tag: str = "0abcd", **extra: Any) -> dict[str, Any]:
    return {"owner_pid": pid, "owner_start": 1, "tag": tag, "scenario": "quick", "source": None, "ready": True,
            "run_id": "r1", "run_dir": None, "held_by": None, "bridges": [f"brf{tag}", f"brd{tag}"],
            "hosts": {"pd-d0": {"pid": 1234, "netns_inode": 4026532175, "netns_cookie": 4101, "ip": "10.2.0.11"}}, "processes": [1235],
            "delayline_dirs": ["/dev/shm/prfaas-delayline-q1-abcdefgh"], **extra}


def put(text: str | bytes, pid: int = DEAD, tag: str = "0abcd") -> Path:
    p = state.state_path(pid, tag)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return p


def with_(**changes: Any) -> str:
    d = good_state()
    for k, v in changes.items():
        if "." in k:
            host, key = k.split(".")
            d["hosts"][host][key] = v
        else:
            d[k] = v
    return json.dumps(d)


DAMAGED = [  # (file contents, what the one line must say)
    ("", "empty; a network state file"),
    ("   \n", "empty; a network state file"),
    ('{"owner_pid": 5, "tag": ', "not valid JSON (Expecting value at line 1)"),
    ("not json", "not valid JSON"),
    (b"\xff\xfe{}", "not UTF-8 text"),
    ("[1, 2]", "must be a JSON object, got list"),
    ("null", "must be a JSON object, got NoneType"),
    ("[" * 100_000, "nested too deeply"),
    (with_(owner_pid=-1), "owner_pid: -1 is not a whole number >= 1"),
    (with_(owner_pid=0), "owner_pid: 0 is not a whole number >= 1"),
    (with_(owner_pid="4194305"), "owner_pid: '4194305' is not a whole number >= 1"),
    (with_(owner_pid=True), "owner_pid: True is not a whole number >= 1"),
    (with_(owner_pid=10**30), "owner_pid: a 31-digit number is more than 2147483647, the largest process id"),
    (with_(owner_pid=4.5), "owner_pid: 4.5 is not a whole number >= 1"),
    (json.dumps({"tag": "0abcd"}), "owner_pid: is required"),
    (with_(owner_start=-3), "owner_start: -3 is not a whole number >= 0"),
    (with_(owner_start="123"), "owner_start: '123' is not a whole number >= 0"),
    (with_(tag="zz"), "tag: 'zz' is not a network tag"),
    (with_(tag=12345), "tag: 12345 is not a network tag"),
    (with_(tag="0abce"), "tag: '0abce' is not the one in the file's name ('0abcd')"),
    (with_(owner_pid=DEAD + 1), f"owner_pid: {DEAD + 1} is not the one in the file's name ({DEAD})"),
    (with_(ready="yes"), "ready: 'yes' is not true or false"),
    (with_(run_id=7), "run_id: 7 is not a string"),
    (with_(held_by=["net up"]), "held_by: ['net up'] is not a string"),
    (with_(bridges="brf0abcd"), "bridges: must be a list of bridge names, got str"),
    (with_(bridges=["brf0abcd", "eth0"]), "bridges: item 1: 'eth0' is not the name of one of our bridges"),
    # another network's bridge, a folder outside /dev/shm or the temp folder, the host's init as a host shell: clean and
    # net exec would have acted on them (until 2026-12-07)
    (with_(bridges=["brf0abcd", "brf11111"]), "bridges: 'brf11111' is not named after this network's tag '0abcd'"),
    (with_(delayline_dirs=["/home/x/prfaas-delayline-a"]), "delayline_dirs: item 0: '/home/x/prfaas-delayline-a' is not under /dev/shm"),
    (with_(**{"pd-d0.pid": 1}), "hosts.pd-d0.pid: 1 is not a host shell's pid (>= 2)"),
    (with_(hosts=[1, 2]), "hosts: must be an object, got list"),
    (with_(hosts={"pd-d0": 7}), "hosts.pd-d0: must be a mapping of keys to values, got int"),
    (with_(**{"pd-d0.pid": -1}), "hosts.pd-d0.pid: -1 is not a whole number >= 1"),
    (with_(**{"pd-d0.netns_inode": "4026532175"}), "hosts.pd-d0.netns_inode: '4026532175' is not a whole number >= 1"),
    (with_(**{"pd-d0.netns_cookie": 0}), "hosts.pd-d0.netns_cookie: 0 is not a whole number >= 1"),
    (with_(**{"pd-d0.netns_cookie": 2**64}), "hosts.pd-d0.netns_cookie: 18446744073709551616 is more than 18446744073709551615"),
    (with_(**{"pd-d0.ip": 10}), "hosts.pd-d0.ip: 10 is not a string"),
    (with_(processes=[-1]), "processes: item 0: -1 is not a whole number >= 1"),
    (with_(processes=5), "processes: must be a list of process ids, got int"),
    (with_(delayline_dirs=["/home"]), "delayline_dirs: item 0: '/home' is not a delay line's control directory"),
    (with_(delayline_dirs=["prfaas-delayline-q1-x"]), "is not a delay line's control directory (an absolute path"),
]


@pytest.mark.parametrize("text, said", DAMAGED, ids=[f"{i}-{s[:30]}" for i, (_, s) in enumerate(DAMAGED)])
def test_a_damaged_state_file_is_one_line_naming_it_and_what_is_wrong(host: dict[str, Any], text: str, said: str):
    p = put(text)
    with pytest.raises(UserError) as err:
        state.read_state(p)
    msg = str(err.value)
    assert msg.startswith(f"{p}: ") and said in msg and "\n" not in msg, msg


def test_a_good_state_file_reads_as_written_and_other_keys_are_kept(host: dict[str, Any]):
    d = good_state(t0_s=12.5, backend="delayline", scale=10.0)
    p = put(json.dumps(d))
    assert state.read_state(p) == d
    minimal = put(json.dumps({"owner_pid": DEAD, "tag": "00001"}), tag="00001")  # (what older tests and files hold)
    assert state.read_state(minimal)["hosts"] == {} and state.read_state(minimal)["owner_start"] is None
    older = put(json.dumps(good_state(tag="00002", hosts={"pd-d0": {"pid": 9, "netns_inode": 8, "ip": "10.2.0.11"}})), tag="00002")
    assert state.read_state(older)["hosts"]["pd-d0"]["netns_cookie"] is None  # (written before cookies were recorded)


def test_every_reader_passes_over_a_damaged_file_with_one_warning_once(host: dict[str, Any], capsys: pytest.CaptureFixture[str]):
    bad = put("{", tag="0000a")
    put(json.dumps(good_state()))
    for _ in range(3):
        assert [p.name for p, _ in state.list_states()] == [f"net-{DEAD}-0abcd.json"]
        assert state.live_states() == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"prfaas: warning: {bad}: not valid JSON") and "prfaas clean" in err
    assert state.claim_tag("0000a", set()) == "0000b"  # a damaged file's tag (from its name) is taken


def test_clean_removes_a_damaged_file_of_a_dead_owner_and_says_what_it_could_not_clean(host: dict[str, Any]):
    bad = put(with_(owner_pid=-1, tag="0abcd"))
    good = put(json.dumps(good_state(tag="00002")), tag="00002")
    host["bridges"] = ["brf0abcd", "brd0abcd", "brf00002", "brd00002"]
    rep = cleanup.clean()
    assert not bad.exists() and not good.exists()
    assert sorted(rep.networks) == sorted([bad.name, good.name])
    assert host["killed"] == [] and host["netns"] == [{4026532175}]  # only the good file's namespaces are looked in
    assert set(host["deleted"]) == set(host["bridges"])  # the damaged one's bridges go with the unclaimed ones
    assert len(rep.damaged) == 1 and rep.damaged[0].startswith(f"{bad}: owner_pid: -1 is not a whole number >= 1; removed it")
    assert "processes in its network's namespaces" in rep.damaged[0] and rep.not_cleaned == []


def namespaces(**inodes: int | None) -> dict[str, dict[str, Any]]:
    """A state file's hosts, one per namespace: {host: cookie} for the inodes 100, 101, ...; a None cookie is left out
    (as a file written before cookies were recorded)."""
    return {name: {"pid": 1000 + i, "netns_inode": 100 + i, "ip": f"10.2.0.{10 + i}", **({"netns_cookie": c} if c else {})}
            for i, (name, c) in enumerate(inodes.items())}


def test_clean_signals_a_genuine_leftover_and_not_a_namespace_that_took_a_recorded_inode(host: dict[str, Any]):
    """The kernel gives a freed namespace's inode to the next one created: only a namespace whose cookie is the one
    recorded is the network's own. Another's (a container's, another tool's) is left alone, and nothing is said."""
    put(json.dumps(good_state(hosts=namespaces(d0=7, gw=8))))
    host["ns"] = {100: [500, 501], 101: [600]}
    host["cookies"] = {500: 7, 501: 7, 600: 99}  # 101 is another namespace now: its cookie is not the recorded 8
    rep = cleanup.clean()
    assert host["killed"] == [500, 501] and rep.processes == [500, 501] and rep.not_cleaned == []


def test_clean_never_signals_processes_in_a_live_network_of_ours(host: dict[str, Any]):
    me = os.getpid()
    live = put(json.dumps(good_state(pid=me, owner_start=state.process_start_ticks(me), hosts=namespaces(d0=7, gw=8))), pid=me)
    put(json.dumps(good_state(tag="00001", hosts=namespaces(d0=7, gw=None))), tag="00001")  # dead ones that recorded
    put(json.dumps(good_state(tag="00002", hosts=namespaces(d0=None))), tag="00002")  # its inodes (and even its cookie)
    host["ns"] = {100: [500], 101: [600]}
    host["cookies"] = {500: 7, 600: 8}
    rep = cleanup.clean()
    assert host["killed"] == [] and rep.not_cleaned == [] and live.exists() and len(rep.networks) == 2
    assert host["netns"] == [set(), set()]  # not even looked in


@pytest.mark.parametrize("recorded, now", [(None, 7), (7, None)], ids=["no-cookie-recorded", "cookie-unreadable"])
def test_clean_signals_nothing_it_cannot_prove_and_says_so_in_one_line(host: dict[str, Any], capsys: pytest.CaptureFixture[str],
                                                                       recorded: int | None, now: int | None):
    """A file written before cookies were recorded (or on a kernel older than 5.14), or a namespace whose cookie
    cannot be read: its processes are listed, not signalled; the rest of the network is removed; exit status 1."""
    for argv in (["clean"], ["clean", "--json"]):
        p = put(json.dumps(good_state(hosts=namespaces(d0=recorded))))
        host["ns"] = {100: [502, 501]}
        host["cookies"] = {501: now, 502: now}
        assert main(argv) == 1 and host["killed"] == [] and not p.exists()
        out, err = capsys.readouterr()
        line = (f"{p}: left 2 process(es) in namespaces it records (pid 501, 502), not signalled: the kernel reuses a freed "
                "namespace's inode, and nothing proves these are still its own (it records no namespace cookie -- a file "
                "written before they were, or on a kernel older than 5.14 -- or their cookie could not be read); check "
                "them with `ps -o pid,netns,args -p PID` and kill those that are its")
        if argv == ["clean"]:
            assert out.startswith("removed: 1 network(s), 0 process(es)") and err == f"prfaas: not cleaned: {line}\n"
        else:
            assert json.loads(out)["not_cleaned"] == [line] and err == ""


def test_the_root_namespace_and_our_own_are_never_looked_in():
    own = state.netns_inode(os.getpid())
    assert own is not None and state.pids_by_netns({own}) == {} and state.pids_in_netns({own}) == []


def test_a_namespace_cookie_is_read_without_moving_the_caller():
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        ours = int.from_bytes(s.getsockopt(socket.SOL_SOCKET, state.SO_NETNS_COOKIE, 8), sys.byteorder)
    assert state.netns_cookie(os.getpid()) == (ours if os.geteuid() == 0 else None)  # (joining a namespace needs root)
    assert state.netns_cookie(DEAD) is None
    fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)  # an open namespace: read from it, whatever its pid does
    try:
        assert state.netns_cookie_of_fd(fd) == state.netns_cookie(os.getpid())
    finally:
        os.close(fd)
    with open(os.devnull) as not_a_namespace:
        assert state.netns_cookie_of_fd(not_a_namespace.fileno()) is None
    # and the caller's threads stayed where they were
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        assert int.from_bytes(s.getsockopt(socket.SOL_SOCKET, state.SO_NETNS_COOKIE, 8), sys.byteorder) == ours


def test_clean_keeps_a_damaged_file_whose_names_pid_runs_and_its_bridges(host: dict[str, Any]):
    me = os.getpid()
    bad = put("", pid=me, tag="0beef")
    host["bridges"] = ["brf0beef", "brd0beef", "brf0dead"]
    rep = cleanup.clean(include_live=True)
    assert bad.exists() and host["killed"] == [] and host["deleted"] == ["brf0dead"]
    assert rep.not_cleaned == [f"{bad}: empty; a network state file (testbed.net.state) is expected; kept: pid {me}, which "
                               "its name gives, is running, so it may be a live network's (`prfaas clean` removes it once "
                               "that process is gone; delete it by hand if that process is no network's)"]


def test_clean_of_one_run_leaves_a_damaged_file_and_says_so(host: dict[str, Any]):
    bad = put("[]")
    rep = cleanup.clean(run="r1")
    assert bad.exists() and rep.networks == []
    assert rep.not_cleaned == [f"{bad}: must be a JSON object, got list; {state.STATE_WHAT} is expected; left: a damaged state file cannot be matched to "
                               "run r1 (a plain `prfaas clean` removes it)"]


def test_clean_all_stops_only_an_owner_its_pid_and_start_time_identify(host: dict[str, Any]):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ticks = state.process_start_ticks(child.pid)
        put(json.dumps(good_state(pid=child.pid, tag="00001", owner_start=None)), pid=child.pid, tag="00001")
        put(json.dumps(good_state(pid=child.pid, tag="00002", owner_start=ticks + 1)), pid=child.pid, tag="00002")  # pid reused
        put(with_(owner_pid=-1), pid=child.pid, tag="00003")  # a negative pid: os.kill(-1) signals every process
        rep = cleanup.clean(include_live=True)
        assert host["killed"] == []
        assert [n for n in rep.not_cleaned if "owner_start" in n] == [
            f"{state.state_path(child.pid, '00001')}: kept: its owner, pid {child.pid}, runs, but the file records no start "
            "time (owner_start) to tell it from another process that took the pid, so it was not stopped"]
        assert state.state_path(child.pid, "00001").exists() and not state.state_path(child.pid, "00002").exists()
        assert state.state_path(child.pid, "00003").exists()  # damaged, and its name's pid runs: kept
        put(json.dumps(good_state(pid=child.pid, tag="00004", owner_start=ticks)), pid=child.pid, tag="00004")
        cleanup.clean(include_live=True)
        assert host["killed"] == [child.pid]
    finally:
        child.kill()
        child.wait()


SYSCTLS = [  # (sysctl.json, what is restored, what the lines say)
    ("", {}, ["empty; the host's sysctls saved before a network started (testbed.net.state) is expected; no sysctl restored"]),
    ('{"fs.file-max": "1', {}, ["not valid JSON"]),
    ('["fs.file-max", "1"]', {}, ["must be a JSON object of sysctl names to values, got list; no sysctl restored"]),
    (json.dumps({"fs.file-max": "100", "kernel.core_pattern": "|/bin/sh"}), {"fs.file-max": "100"},
     ["kernel.core_pattern: not a sysctl the testbed saves; allowed: net.bridge.bridge-nf-call-iptables"]),
    (json.dumps({"fs.file-max": 100, "net.core.rmem_max": "200"}), {"net.core.rmem_max": "200"},
     ["fs.file-max: 100 is not a value read from /proc/sys (a string of whole numbers separated by spaces); not restored"]),
    (json.dumps({"net.ipv4.tcp_rmem": "4096 131072 6291456", "fs.file-max": "1; reboot", "kernel.pty.max": ""}),
     {"net.ipv4.tcp_rmem": "4096 131072 6291456"}, ["fs.file-max: '1; reboot' is not a value", "kernel.pty.max: '' is not a value"]),
    (json.dumps({"fs.file-max": None, "net.core.wmem_max": ["1"]}), {}, ["fs.file-max: None is not a value", "net.core.wmem_max: ['1']"]),
]


@pytest.mark.parametrize("text, restored, said", SYSCTLS)
def test_saved_sysctls_restore_only_values_proc_sys_gave_for_keys_the_testbed_saves(host: dict[str, Any], text: str,
                                                                                     restored: dict[str, str], said: list[str]):
    f = state.STATE_DIR / state.SYSCTL_FILE
    f.parent.mkdir(parents=True)
    f.write_text(text)
    rep = cleanup.clean()
    assert host["written"] == restored and rep.sysctls == restored and not f.exists()
    assert len(rep.not_cleaned) == len(said)
    for line, want in zip(rep.not_cleaned, said):
        assert line.startswith(f"{f}: ") and want in line and "\n" not in line, line


def test_a_network_stopping_last_warns_of_a_damaged_sysctl_file_in_one_line(host: dict[str, Any], capsys: pytest.CaptureFixture[str]):
    f = state.STATE_DIR / state.SYSCTL_FILE
    f.parent.mkdir(parents=True)
    f.write_text('{"net.core.rmem_max": 5}')
    assert state.restore_sysctls_if_last(exclude=None) == {} and host["written"] == {}
    assert capsys.readouterr().err == (f"prfaas: warning: {f}: net.core.rmem_max: 5 is not a value read from /proc/sys (a "
                                       "string of whole numbers separated by spaces); not restored\n")


def test_a_damaged_file_whose_pid_runs_keeps_the_saved_sysctls_for_the_last_one_out(host: dict[str, Any]):
    f = state.STATE_DIR / state.SYSCTL_FILE
    put("{", pid=os.getpid())
    f.write_text(json.dumps({"fs.file-max": "100"}))
    assert state.restore_sysctls_if_last(exclude=None) == {} and f.exists()


def test_prfaas_clean_prints_what_it_could_not_clean_and_exits_1(host: dict[str, Any], capsys: pytest.CaptureFixture[str]):
    put("{", pid=os.getpid(), tag="0abcd")
    dead = put("", tag="00001")
    assert main(["clean"]) == 1
    out, err = capsys.readouterr()
    assert out == "removed: 1 network(s), 0 process(es), bridges -, restored sysctls -\n"
    lines = err.splitlines()
    assert len(lines) == 2 and "Traceback" not in err
    assert lines[0].startswith(f"prfaas: note: {dead}: empty;") and lines[1].startswith("prfaas: not cleaned: ") and "kept: pid" in lines[1]
    assert main(["clean", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["networks"] == [] and len(doc["not_cleaned"]) == 1


def test_clean_removes_the_log_of_a_sigkilled_detached_net_up_and_no_other(host: dict[str, Any]):
    """`prfaas net up --detach` logs to net-up-<owner pid>.log, which its clean stop removes; after a SIGKILL the state
    file's owner names it. It stayed after `prfaas clean` (then named after the pid of the command that detached)."""
    put(json.dumps(good_state(held_by=state.NET_UP)))
    put(json.dumps(good_state(pid=DEAD + 1, tag="00002")), pid=DEAD + 1, tag="00002")  # a run's network: it has no log
    logs = [state.net_up_log(DEAD), state.net_up_log(DEAD + 1), state.net_up_log(DEAD + 2)]
    for log in logs:
        log.write_text("network 0abcd up\n")
    rep = cleanup.clean()
    assert len(rep.networks) == 2 and [log.exists() for log in logs] == [False, True, True]


def test_prfaas_clean_says_the_delay_line_leftovers_it_removed(host: dict[str, Any], capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch):
    """A stale control directory and a root-namespace NFQUEUE rule removed were "removed: 0 network(s), 0 process(es),
    bridges -, restored sysctls -", which reads as nothing removed."""
    import testbed.net.delayline as delayline

    monkeypatch.setattr(delayline, "remove_stale_control_dirs", lambda *a, **kw: 2)
    monkeypatch.setattr(delayline, "cleanup_rules", lambda *a, **kw: 1)
    assert main(["clean"]) == 0
    assert capsys.readouterr().out == "removed: 0 network(s), 0 process(es), bridges -, delay-line leftovers 3, restored sysctls -\n"


def test_a_delay_lines_control_directory_is_recorded_before_its_process_starts(host: dict[str, Any], tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch):
    """A run SIGKILLed while its WAN started left the delay line's directory unnamed in its state file (written once the
    WAN was up), and `prfaas clean RUN_ID` left it. The gateway's popen now records it before the process starts."""
    import testbed.net.delayline as delayline
    from testbed.errors import HostError
    from testbed.sections import load_scenario

    monkeypatch.setattr(delayline, "delayline_dir_base", lambda: str(tmp_path))
    net = emulation.Network(load_scenario("quick", []))
    net._state_file, net._state = state.state_path(DEAD, "0abcd"), good_state(delayline_dirs=[])
    state.write_state(net._state_file, net._state)
    recorded: list[list[str]] = []

    class Gateway:
        def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen:
            recorded.append(state.read_state(net._state_file)["delayline_dirs"])
            raise OSError("no process in a unit test")

    line = delayline.DelayLineProcess(net._gateway_popen(Gateway()), "prfaas-gw-wan", 1, delayline.DelayLineConfig(delay_s=0.005))
    net.wan = type("Wan", (), {"control_dirs": lambda self: [str(line.control_dir)] if line.control_dir else []})()
    with pytest.raises(HostError, match="could not run"):
        line.start()
    assert len(recorded) == 1 and len(recorded[0]) == 1 and Path(recorded[0][0]).parent == tmp_path
    assert Path(recorded[0][0]).name.startswith(f"{state.DELAYLINE_DIR_PREFIX}q1-") and not Path(recorded[0][0]).exists()


def test_net_exec_and_down_pass_over_a_damaged_file_in_one_warning(host: dict[str, Any], capsys: pytest.CaptureFixture[str]):
    bad = put('{"owner_pid": "x"}')
    for argv in (["net", "down"], ["net", "exec", "pd-d0", "--", "true"]):
        state._warned.clear()
        assert main(argv) == 2
        err = capsys.readouterr().err.splitlines()
        assert err[0].startswith(f"prfaas: warning: {bad}: owner_pid: 'x' is not a whole number >= 1")
        assert err[1].startswith(f"prfaas {argv[0]} {argv[1]}: error: no network is running") and len(err) == 2


def test_net_down_signals_no_owner_its_file_cannot_identify(host: dict[str, Any], capsys: pytest.CaptureFixture[str]):
    me = os.getpid()
    put(json.dumps(good_state(pid=me, owner_start=None, held_by=state.NET_UP)), pid=me)
    assert main(["net", "down"]) == 2  # (it would have been a SIGTERM to this test's process)
    err = capsys.readouterr().err
    assert err.startswith("prfaas net down: error: network 0abcd: its state file records no start time") and err.count("\n") == 1


def test_net_down_stops_only_a_net_up_network_unless_another_is_named(host: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]):
    """`prfaas net down` SIGTERMs its network's owner: a run's (or a test's: the owner is the test process) was taken as
    "the running network", and a user's `net down` ended a test suite beside it (2026-12-07). Unnamed, only a network
    `prfaas net up` holds is stopped; another is named and stopped only with --id."""
    import testbed.net.commands as commands

    signalled: list[tuple[int, int]] = []
    monkeypatch.setattr(state, "is_alive", lambda pid, start: pid not in [p for p, _ in signalled])
    monkeypatch.setattr(commands.os, "kill", lambda pid, sig: signalled.append((pid, sig)))
    run_pid, up_pid = DEAD + 1, DEAD + 2
    put(json.dumps(good_state(pid=run_pid, tag="0aaaa", bridges=["brf0aaaa", "brd0aaaa"])), pid=run_pid, tag="0aaaa")
    assert main(["net", "down"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("prfaas net down: error: no network from `prfaas net up` is running; running: 0aaaa (quick, run r1, "
                          f"pid {run_pid})") and "--id" in err and err.count("\n") == 1
    assert signalled == []
    put(json.dumps(good_state(pid=up_pid, tag="0bbbb", run_id=None, held_by=state.NET_UP,
                              bridges=["brf0bbbb", "brd0bbbb"])), pid=up_pid, tag="0bbbb")
    assert main(["net", "down"]) == 0
    assert signalled == [(up_pid, commands.signal.SIGTERM)] and "network 0bbbb down" in capsys.readouterr().out
    assert main(["net", "down", "--id", "0aaaa"]) == 0  # named: the user means it
    assert signalled[1:] == [(run_pid, commands.signal.SIGTERM)]


def test_net_down_cleans_its_own_network_and_leaves_every_other_networks_leftovers(
        host: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """`prfaas net down --id X` ended with a plain clean: another dead network's processes, bridges, delay-line
    directory and state file went too, a damaged file and unclaimed bridges with them. It cleans network X only, as
    `clean` would that one; `prfaas clean` is the command that clears everything dead."""
    import tempfile

    import testbed.net.commands as commands
    import testbed.net.delayline as delayline

    signalled: list[int] = []
    host_wide: list[str] = []
    monkeypatch.setattr(state, "is_alive", lambda pid, start: pid == up_pid and pid not in signalled)
    monkeypatch.setattr(commands.os, "kill", lambda pid, sig: signalled.append(pid))
    monkeypatch.setattr(delayline, "remove_stale_control_dirs", lambda *a, **kw: host_wide.append("dirs") or 0)
    monkeypatch.setattr(delayline, "cleanup_rules", lambda *a, **kw: host_wide.append("rules") or 0)
    up_pid, dead_pid = DEAD + 2, DEAD + 1
    dirs = [tempfile.mkdtemp(prefix=f"{state.DELAYLINE_DIR_PREFIX}q{i}-", dir=tempfile.gettempdir()) for i in (1, 2)]
    try:
        ours = put(json.dumps(good_state(pid=up_pid, tag="0bbbb", run_id=None, held_by=state.NET_UP, bridges=["brf0bbbb", "brd0bbbb"],
                                         hosts={"pd-d0": {"pid": 1234, "netns_inode": 11, "netns_cookie": 4101, "ip": "10.2.0.11"}},
                                         delayline_dirs=[dirs[0]])), pid=up_pid, tag="0bbbb")
        other = put(json.dumps(good_state(pid=dead_pid, tag="0aaaa", bridges=["brf0aaaa", "brd0aaaa"],
                                          hosts={"pd-d0": {"pid": 2234, "netns_inode": 22, "netns_cookie": 4202, "ip": "10.2.0.11"}},
                                          delayline_dirs=[dirs[1]])), pid=dead_pid, tag="0aaaa")
        damaged = put("", pid=DEAD + 5, tag="0eeee")
        state.net_up_log(up_pid).write_text("network 0bbbb up\n")
        host["ns"] = {11: [500], 22: [600]}
        host["cookies"] = {500: 4101, 600: 4202}
        host["bridges"] = ["brf0bbbb", "brd0bbbb", "brf0aaaa", "brd0aaaa", "brf0ffff"]  # 0ffff: claimed by no file
        assert main(["net", "down", "--id", "0bbbb"]) == 0
        assert signalled == [up_pid] and host["killed"] == [500] and host["netns"] == [{11}]
        assert host["deleted"] == ["brf0bbbb", "brd0bbbb"] and host_wide == []
        assert not ours.exists() and not state.net_up_log(up_pid).exists() and not Path(dirs[0]).exists()
        assert other.exists() and damaged.exists() and Path(dirs[1]).is_dir()
        rep = cleanup.clean()  # the plain clean still removes the rest
        assert not other.exists() and not damaged.exists() and not Path(dirs[1]).exists() and host["killed"] == [500, 600]
        assert rep.bridges[:2] == ["brf0aaaa", "brd0aaaa"] and "brf0ffff" in rep.bridges and host_wide == ["dirs", "rules"]
    finally:
        for d in dirs:
            if Path(d).is_dir():
                os.rmdir(d)


def test_net_down_of_a_network_still_coming_up_says_so(host: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]):
    """`net down --id TAG` of a network whose `net up` has not yet said it is up said "no network is running with id
    TAG" (session 68's kill campaign); it is named as coming up, and nothing is signalled."""
    import testbed.net.commands as commands

    signalled: list[tuple[int, int]] = []
    monkeypatch.setattr(state, "is_alive", lambda pid, start: True)
    monkeypatch.setattr(commands.os, "kill", lambda pid, sig: signalled.append((pid, sig)))
    put(json.dumps(good_state(pid=DEAD + 3, tag="0cccc", ready=False, held_by=state.NET_UP)), pid=DEAD + 3, tag="0cccc")
    for argv in (["net", "down", "--id", "0cccc"], ["net", "exec", "--id", "0cccc", "pd-d0", "--", "true"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"prfaas {argv[0]} {argv[1]}: error: network 0cccc (quick, run r1, pid {DEAD + 3}) is still "
                              "coming up;") and err.count("\n") == 1, err
    assert main(["net", "down", "--id", "0dddd"]) == 2
    assert "no network is running with id 0dddd" in capsys.readouterr().err
    assert signalled == []


def test_net_down_names_an_older_net_up_among_the_networks_it_will_not_stop_unnamed(
        host: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """A `prfaas net up` older than 2026-12-07 wrote no held_by: refused as another command's (its file cannot tell),
    the refusal says so, and --id stops it."""
    import testbed.net.commands as commands

    signalled: list[int] = []
    monkeypatch.setattr(state, "is_alive", lambda pid, start: pid not in signalled)
    monkeypatch.setattr(commands.os, "kill", lambda pid, sig: signalled.append(pid))
    old = good_state(pid=DEAD + 1, tag="0aaaa", run_id=None, bridges=["brf0aaaa", "brd0aaaa"])
    del old["held_by"]
    assert state.read_state(put(json.dumps(old), pid=DEAD + 1, tag="0aaaa"))["held_by"] is None
    assert main(["net", "down"]) == 2 and signalled == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "or a `prfaas net up` started before 2026-12-07, which did not record it" in err, err
    assert main(["net", "down", "--id", "0aaaa"]) == 0 and signalled == [DEAD + 1]


def test_prfaas_state_dir_is_honoured_by_the_command(tmp_path: Path):
    """As a user runs it: PRFAAS_STATE_DIR names the directory; `clean RUN` touches nothing host-wide."""
    (tmp_path / f"net-{DEAD}-0abcd.json").write_text('{"owner_pid": -5}')
    env = {**os.environ, "PRFAAS_STATE_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "clean", "some-run"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr == (f"prfaas: not cleaned: {tmp_path}/net-{DEAD}-0abcd.json: owner_pid: -5 is not a whole number >= 1; "
                        "left: a damaged state file cannot be matched to run some-run (a plain `prfaas clean` removes it)\n")
    assert r.stdout == "nothing to clean for run some-run\n"


def test_an_unusable_state_directory_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "f").write_text("")
    monkeypatch.setattr(state, "STATE_DIR", tmp_path / "f")
    with pytest.raises(UserError, match="cannot create this folder"):
        with state.locked():
            pass


# ----------------------------------------------------------------------------------- the guest's probe cache


GUEST_CACHE = [
    ("", "empty"),
    ('{"accel": "kvm"', "not valid JSON"),
    ('"kvm"', "must be a JSON object, got str"),
    ('{"boot_id": "b", "kernel": "k", "qemu": "q", "why": "w"}', "accel: is required"),
    ('{"boot_id": "b", "kernel": "k", "qemu": "q", "accel": "kvm -drive file=/etc/shadow", "why": "w"}', "accel: 'kvm -drive"),
    ('{"boot_id": 5, "kernel": "k", "qemu": "q", "accel": "kvm", "why": "w"}', "boot_id: 5 is not a string"),
    ('{"boot_id": "b", "kernel": "k", "qemu": "q", "accel": "kvm", "why": null}', "why: is required"),
    ('{"boot_id": "b", "kernel": "k", "qemu": "q", "accel": "kvm", "why": ["w"]}', "why: ['w'] is not a non-empty string"),
]


@pytest.mark.parametrize("text, said", GUEST_CACHE)
def test_a_damaged_guest_probe_cache_is_probed_again_and_written_anew(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str], text: str, said: str):
    from testbed.net import guest

    cache = tmp_path / "guest-accel.json"
    cache.write_text(text.replace('"b"', '"boot"'))
    monkeypatch.setattr(guest, "ACCEL_CACHE", cache)
    monkeypatch.setattr(guest, "_boot_id", lambda: "boot")
    monkeypatch.setattr(guest.os, "access", lambda *a: True)
    monkeypatch.setattr(guest.shutil, "which", lambda name: "q")
    probes = []

    def run_guest(spec: Any, argv: list[str], **kw: Any) -> Any:
        probes.append(argv)
        return guest.GuestResult(0, "kvm", 1.0, 2.0, "", "", "")

    monkeypatch.setattr(guest, "run_guest", run_guest)
    spec = guest.GuestSpec(guest.Kernel(Path("k"), "6.1"), accel="auto")
    assert guest.choose_accel(spec, "auto") == ("kvm", "a KVM probe boot finished in 2.0 s") and probes == [["true"]]
    err = capsys.readouterr().err
    assert err.startswith(f"guest-kernel: warning: {cache}: ") and said in err and err.endswith("; probing again\n")
    assert err.count("\n") == 1
    assert guest.read_accel_cache(cache) == {"boot_id": "boot", "kernel": "k", "qemu": "q", "accel": "kvm",
                                             "why": "a KVM probe boot finished in 2.0 s"}
    assert guest.choose_accel(spec, "auto")[1].endswith("(cached for this host boot)") and len(probes) == 1


def test_net_exec_enters_a_host_only_while_its_shell_is_in_the_recorded_namespace(host: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                                                               capsys: pytest.CaptureFixture[str]):
    """`net exec` reaches a host through its shell's pid; once the shell is gone that pid may be another process's, and
    mnexec would run the command in that process's namespace. The recorded namespace cookie must still be the pid's."""
    import testbed.net.commands as commands

    me = os.getpid()
    put(json.dumps(good_state(pid=me, owner_start=state.process_start_ticks(me))), pid=me)
    calls: list[list[str]] = []
    monkeypatch.setattr(commands.subprocess, "call", lambda argv: calls.append(argv) or 0)
    host["cookies"][1234] = 4101  # the shell is where the network recorded it
    assert main(["net", "exec", "pd-d0", "--", "ip", "addr"]) == 0
    assert calls == [["mnexec", "-a", "1234", "ip", "addr"]]
    for now in (9999, None):  # pid 1234 is now in another namespace, or no process at all
        host["cookies"][1234] = now
        assert main(["net", "exec", "pd-d0", "--", "ip", "addr"]) != 0
        err = capsys.readouterr().err
        assert err.startswith("prfaas net exec: error: host pd-d0's shell (pid 1234) is no longer in the namespace") and err.count("\n") == 1
    assert len(calls) == 1
