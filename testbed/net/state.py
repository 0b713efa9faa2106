"""What a running network leaves on the host, written down so that another process can find it.

One JSON file per network in `STATE_DIR` (``/run/prfaas``, tmpfs: gone after a reboot) names its owner
process, its root-namespace bridges, its hosts (shell pid, namespace inode, address) and the
processes it started, and which command holds it (``held_by``: `NET_UP`, or none for a run's, a test's or
calibrate's). `prfaas net exec/down` read it; `prfaas clean` uses it to remove what a killed
run left. Host-wide sysctls are saved once, by the first of our networks to start, in
``sysctl.json``, and restored by the last one to stop, so networks running side by side (several
tests, several users) never restore a value under each other's feet.

Every file here is read through one reader (`read_state`, `read_saved_sysctls`), which checks what it holds: a
damaged file -- empty, cut short, not JSON, a value of the wrong type, a pid that is no process's (hand edits, a
state directory on a disk that lost power) -- is one line naming the file and what is wrong, and nothing is done
from it: no process it names is signalled, no link it names deleted, no sysctl value it holds written. `prfaas
clean` removes such a file and says what it could not clean (`testbed.net.cleanup`); everything else passes it
over with a warning. A process is signalled only when its pid and its start time (``owner_start``) both match.

A host's namespace is recorded by its inode (``netns_inode``), which finds the processes in it, and its cookie
(``netns_cookie``, `netns_cookie`), which proves that the namespace now at that inode is still the recorded one: the
kernel gives a freed namespace's inode to the next namespace created (a container's, another tool's, another network
of ours), but never its cookie.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import re
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from testbed.atomic import make_dirs, write_json
from testbed.errors import HostError, UserError
from testbed.validation import Fields, boolean, count_up_to, mapping, whole_number, read_json, string

STATE_DIR = Path(os.environ.get("PRFAAS_STATE_DIR", "/run/prfaas"))

# Values we need while a network runs: bridged frames must not traverse the host's iptables.
SYSCTL_SET = {
    "net.bridge.bridge-nf-call-iptables": "0",
    "net.bridge.bridge-nf-call-ip6tables": "0",
    "net.bridge.bridge-nf-call-arptables": "0",
}
# Raised by Mininet's fixLimits() on first use; saved so that they are restored too.
SYSCTL_MININET = (
    "fs.file-max", "net.core.wmem_max", "net.core.rmem_max", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem",
    "net.core.netdev_max_backlog", "net.ipv4.neigh.default.gc_thresh1", "net.ipv4.neigh.default.gc_thresh2",
    "net.ipv4.neigh.default.gc_thresh3", "net.ipv4.route.max_size", "kernel.pty.max",
)
SYSCTL_FILE = "sysctl.json"
# What /proc/sys gives for every key above (read_sysctl joins its fields with one space): whole numbers
# ("0", "4096 131072 6291456"). A saved value is written back only when it looks so.
SYSCTL_VALUE_RE = re.compile(r"-?[0-9]{1,20}( -?[0-9]{1,20}){0,7}")
TAG_RE = re.compile(r"[0-9a-f]{5}")  # a network's tag (`claim_tag`): it names the network's bridges and state file
# Our bridges, one per datacenter in the root namespace: "br", the datacenter's letter and the network's tag
# (`bridge_name`; `topologies.two_dc` names its switches with it). BRIDGE_RE tells them from every other link: a state
# file never names another link to delete, and `prfaas clean` deletes no other.
BRIDGE_LETTERS = {"prfaas": "f", "pd": "d"}
_BRIDGE = rf"br[{''.join(BRIDGE_LETTERS.values())}]{TAG_RE.pattern}"
BRIDGE_RE = re.compile(rf"^{_BRIDGE}$")
# A bridge or one of its ports (Mininet names a switch's ports SWITCH-ethN: veths whose other end is in a host's
# namespace); group 1 is the bridge. `prfaas clean` deletes a bridge's ports with it (`testbed.net.cleanup`).
BRIDGE_LINK_RE = re.compile(rf"^({_BRIDGE})(?:-eth[0-9]{{1,5}})?$")
STATE_NAME_RE = re.compile(rf"net-([0-9]{{1,10}})-({TAG_RE.pattern})\.json")  # `state_path`'s names
NET_UP = "net up"  # ``held_by`` of a network `prfaas net up` holds, the only kind `prfaas net down` stops unnamed
DELAYLINE_DIR_PREFIX = "prfaas-delayline-"  # a delay line's control directory (`testbed.net.delayline`)
PID_T_MAX = 2**31 - 1  # pid_t (the kernel's pid_max is at most 2**22)
CLONE_NEWNET = 0x40000000  # <linux/sched.h>
SO_NETNS_COOKIE = 71  # <asm-generic/socket.h>, Linux 5.14
STATE_WHAT = "a network state file (testbed.net.state)"
SYSCTL_WHAT = "the host's sysctls saved before a network started (testbed.net.state)"


def bridge_name(dc: str, tag: str) -> str:
    """The bridge of datacenter `dc` ("prfaas" or "pd") in the network tagged `tag`: brf<tag> or brd<tag>."""
    return f"br{BRIDGE_LETTERS[dc]}{tag}"


def bridge_names(tag: str) -> tuple[str, ...]:
    """Both bridges of the network tagged `tag`."""
    return tuple(bridge_name(dc, tag) for dc in BRIDGE_LETTERS)


def delayline_dir_bases() -> tuple[str, str]:
    """The folders a delay line makes its control directory in, first choice first: /dev/shm (a tmpfs) and, on a
    host without it, the system's temp folder. A line uses the first that is there (`delayline_dir_base`); a state
    file may name a directory under either (`read_state`)."""
    import tempfile

    return "/dev/shm", tempfile.gettempdir()


def delayline_dir_base() -> str:
    """The folder a delay line started on this host makes its control directory in (`delayline_dir_bases`)."""
    shm, temp = delayline_dir_bases()
    return shm if os.path.isdir(shm) else temp


def _sysctl_path(key: str) -> Path:
    return Path("/proc/sys") / key.replace(".", "/")


def read_sysctl(key: str) -> str | None:
    try:
        return " ".join(_sysctl_path(key).read_text().split())
    except OSError:
        return None


def write_sysctl(key: str, value: str) -> bool:
    try:
        _sysctl_path(key).write_text(value)
        return True
    except OSError:
        return False


@contextlib.contextmanager
def locked() -> Iterator[None]:
    """One process at a time changes the state directory (start, stop, clean)."""
    lock = make_dirs(STATE_DIR) / ".lock"
    try:
        fh = open(lock, "a")
    except OSError as exc:
        hint = "; the networks' state needs root: run with sudo" if isinstance(exc, PermissionError) else ""
        raise HostError(f"{lock}: cannot open ({exc.strerror or exc}){hint}") from None
    with fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def process_start_ticks(pid: int) -> int | None:
    """The process's start time (field 22 of /proc/PID/stat): a pid plus this names one process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def is_alive(pid: int, start_ticks: int | None) -> bool:
    return pid > 0 and process_start_ticks(pid) is not None and (start_ticks is None or process_start_ticks(pid) == start_ticks)


def state_path(owner_pid: int, tag: str) -> Path:
    return STATE_DIR / f"net-{owner_pid}-{tag}.json"


def net_up_log(owner_pid: int) -> Path:
    """The log of the network `prfaas net up --detach` started, named after its owner (the detached process, the
    state file's ``owner_pid``): its clean stop removes it, and `prfaas clean` after a SIGKILL."""
    return STATE_DIR / f"net-up-{owner_pid}.log"


def write_state(path: Path, data: dict[str, Any]) -> None:
    write_json(path, data, indent=1)


# ------------------------------------------------------------------------------------------ reading the files

_pid = count_up_to(PID_T_MAX, "the largest process id (pid_t)")
_inode = count_up_to(2**64 - 1, "the largest inode number")
_cookie = count_up_to(2**64 - 1, "the largest namespace cookie")


def _tag(v: Any) -> str:
    if not isinstance(v, str) or not TAG_RE.fullmatch(v):
        raise ValueError(f"{v!r} is not a network tag (5 hex digits in lower case, e.g. 0abcd)")
    return v


def _list_of(read: Any, what: str) -> Any:
    def parse(v: Any) -> list[Any]:
        if not isinstance(v, list):
            raise ValueError(f"must be a list of {what}, got {type(v).__name__}")
        for i, x in enumerate(v):
            try:
                read(x)
            except ValueError as exc:
                raise ValueError(f"item {i}: {exc}") from None
        return list(v)

    return parse


def _bridge(v: Any) -> str:
    if not isinstance(v, str) or not BRIDGE_RE.match(v):
        raise ValueError(f"{v!r} is not the name of one of our bridges (brf or brd and the network's tag, e.g. brf0abcd)")
    return v


def _delayline_dir(v: Any) -> str:
    """A delay line's control directory: made by `tempfile.mkdtemp` under one of `delayline_dir_bases`
    (`testbed.net.delayline`), so anywhere else is not ours (`prfaas clean` removes these folders; until 2026-12-07 any
    absolute path named prfaas-delayline-... was taken, /home/x/prfaas-delayline-a included)."""
    if not isinstance(v, str) or not os.path.isabs(v) or "\0" in v or not Path(v).name.startswith(DELAYLINE_DIR_PREFIX):
        raise ValueError(f"{v!r} is not a delay line's control directory (an absolute path named {DELAYLINE_DIR_PREFIX}...)")
    bases = delayline_dir_bases()
    if not any(Path(v).parent.is_relative_to(base) for base in bases):
        raise ValueError(f"{v!r} is not under {' or '.join(bases)}, where delay lines make their directories")
    return v


def _host_pid(v: Any) -> int:
    """A host's shell: a child of the run's, never the host's init (pid 1 without a cookie made `net exec` enter the
    root namespace)."""
    pid = _pid(v)
    if pid < 2:
        raise ValueError(f"{pid} is not a host shell's pid (>= 2)")
    return pid


def read_state(path: Path) -> dict[str, Any]:
    """A network's state file, checked: the owner (``owner_pid`` >= 1, ``owner_start`` its start time or absent),
    the tag and the bridges named after it, the command holding it (``held_by``: None in a file written before it was
    recorded), the hosts (shell ``pid``, ``netns_inode``, ``netns_cookie``: None in a
    file written before cookies were recorded, ``ip``), the processes and the delay lines' directories, each of its
    type; other keys are kept as they are (nothing acts on them). A
    damaged file is a `UserError` naming it and what is wrong (`testbed.validation.read_json`, `Fields`)."""
    data = read_json(path, STATE_WHAT)
    if not isinstance(data, dict):
        raise UserError(f"{path}: must be a JSON object, got {type(data).__name__}; {STATE_WHAT} is expected")
    f = Fields(data, "", str(path))
    out = dict(data)
    out.update(owner_pid=f.get("owner_pid", _pid), owner_start=f.get("owner_start", whole_number, None), tag=f.get("tag", _tag),
               scenario=f.get("scenario", string, ""), source=f.get("source", string, None), ready=f.get("ready", boolean, False),
               run_id=f.get("run_id", string, None), run_dir=f.get("run_dir", string, None), held_by=f.get("held_by", string, None),
               bridges=f.get("bridges", _list_of(_bridge, "bridge names"), []),
               processes=f.get("processes", _list_of(_pid, "process ids"), []),
               delayline_dirs=f.get("delayline_dirs", _list_of(_delayline_dir, "directories"), []))
    hosts = {}
    for name, h in f.get("hosts", mapping, {}).items():
        hf = Fields(h, f"hosts.{name}", str(path))
        hosts[name] = {"pid": hf.get("pid", _host_pid), "netns_inode": hf.get("netns_inode", _inode, None),
                       "netns_cookie": hf.get("netns_cookie", _cookie, None), "ip": hf.get("ip", string, None)}
    out["hosts"] = hosts
    named = name_parts(path)
    for key, in_name in zip(("owner_pid", "tag"), named or ()):
        if out[key] != in_name:
            raise f.error(key, f"{out[key]!r} is not the one in the file's name ({in_name!r}): a state file is named "
                               "net-<owner_pid>-<tag>.json")
    foreign = [b for b in out["bridges"] if b not in bridge_names(out["tag"])]
    if foreign:  # another network's bridge: `prfaas clean` would have deleted it
        raise f.error("bridges", f"{foreign[0]!r} is not named after this network's tag {out['tag']!r} (brf or brd + tag)")
    return out


def name_parts(path: Path) -> tuple[int, str] | None:
    """(owner pid, tag) of a state file's name (`state_path`'s net-<owner pid>-<tag>.json), or None for another name."""
    named = STATE_NAME_RE.fullmatch(path.name)
    return (int(named[1]), named[2]) if named else None


@dataclass(frozen=True)
class DamagedState:
    """A state file that `read_state` refused: what is wrong (`problem`, one line naming the file), and what its
    name still says (`state_path`'s net-<owner pid>-<tag>.json)."""

    path: Path
    problem: str

    @property
    def pid(self) -> int | None:
        return (name_parts(self.path) or (None, None))[0]

    @property
    def tag(self) -> str | None:
        return (name_parts(self.path) or (None, None))[1]

    def maybe_live(self) -> bool:
        """Is the pid in the file's name a running process? Then the file may be a live network's (its start time
        cannot be read to tell): it is kept, and counted as running."""
        return self.pid is not None and is_alive(self.pid, None)


_warned: set[str] = set()


def warn_damaged(damaged: list[DamagedState], *, quiet: bool = False) -> None:
    """One line on stderr per damaged state file, once per process (`quiet`: the caller reports them itself)."""
    for d in damaged:
        if d.problem not in _warned:
            _warned.add(d.problem)
            if not quiet:
                print(f"prfaas: warning: {d.problem} (a damaged network state file, passed over; `prfaas clean` removes it)",
                      file=sys.stderr)


def scan_states(*, warn: bool = False) -> tuple[list[tuple[Path, dict[str, Any]]], list[DamagedState]]:
    """(every state file that reads, as `read_state` gives it; every damaged one, with `warn` also warned about:
    `warn_damaged`). A file removed while it is read (its network stopped) is neither."""
    good, damaged = [], []
    for p in sorted(STATE_DIR.glob("net-*.json")) if STATE_DIR.is_dir() else []:
        try:
            good.append((p, read_state(p)))
        except UserError as exc:
            if os.path.lexists(p):
                damaged.append(DamagedState(p, str(exc)))
    if warn:
        warn_damaged(damaged)
    return good, damaged


def claim_tag(preferred: str, existing_links: set[str]) -> str:
    """Call under `locked()`: `preferred`, or the next free 5-hex-digit tag, free meaning no state file
    (live or left by a killed run, or damaged: its name gives its tag) names it and no root-namespace link
    carries it. Tags name the bridges (``br[fd]TAG``), so two networks started at once never share one."""
    good, damaged = scan_states(warn=True)
    taken = {str(d.get("tag")) for _, d in good} | {d.tag for d in damaged if d.tag}
    value = int(preferred, 16)
    for _ in range(1 << 20):
        tag = f"{value:05x}"
        if tag not in taken and not any(name.startswith(bridge_names(tag)) for name in existing_links):
            return tag
        value = (value + 1) & 0xFFFFF
    raise RuntimeError("no free network tag: run `prfaas clean`")


def matches_run(data: dict[str, Any], run: str) -> bool:
    """Does the network of state `data` belong to run `run` (its run id, or its run directory's path)?"""
    if not run:
        return False
    if str(data.get("run_id") or "") == run:
        return True
    run_dir = data.get("run_dir")
    return bool(run_dir) and os.path.realpath(run) == os.path.realpath(str(run_dir))


def list_states() -> list[tuple[Path, dict[str, Any]]]:
    """Every state file that reads (`read_state`); a damaged one is warned about (`warn_damaged`) and passed over."""
    return scan_states(warn=True)[0]


def owner_alive(data: dict[str, Any]) -> bool:
    return is_alive(int(data.get("owner_pid", -1)), data.get("owner_start"))


def owner_identified(data: dict[str, Any]) -> bool:
    """Is the network's owner running, known by its pid and its start time both? Only then is it signalled (a
    file without ``owner_start`` names a pid that another process may have taken since)."""
    return data.get("owner_start") is not None and owner_alive(data)


def live_states(exclude: Path | None = None) -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p, d in list_states() if p != exclude and owner_alive(d)]


def others_running(exclude: Path | None) -> bool:
    """Does a network other than `exclude`'s run: a state file whose owner lives, or a damaged one whose name's pid
    runs (it may be a live network's)?"""
    good, damaged = scan_states(warn=True)
    return any(p != exclude and owner_alive(d) for p, d in good) or any(d.path != exclude and d.maybe_live() for d in damaged)


def _sysctl_value(v: Any) -> str:
    if not isinstance(v, str) or not SYSCTL_VALUE_RE.fullmatch(v):
        raise ValueError(f"{v!r} is not a value read from /proc/sys (a string of whole numbers separated by spaces)")
    return v


def read_saved_sysctls(path: Path) -> tuple[dict[str, str], list[str]]:
    """(the saved sysctls that may be written back, one line per entry that may not): keys of `SYSCTL_SET` and
    `SYSCTL_MININET` only, values as /proc/sys gave them (`SYSCTL_VALUE_RE`). A file that is not a JSON object is
    a `UserError` naming it."""
    data = read_json(path, SYSCTL_WHAT)
    if not isinstance(data, dict):
        raise UserError(f"{path}: must be a JSON object of sysctl names to values, got {type(data).__name__}")
    allowed = list(SYSCTL_SET) + list(SYSCTL_MININET)
    f = Fields(data, "", str(path))
    saved, problems = {}, []
    for key in data:
        if key not in allowed:
            problems.append(str(f.error(str(key), f"not a sysctl the testbed saves; allowed: {', '.join(allowed)}")))
            continue
        try:
            saved[key] = _sysctl_value(data[key])
        except ValueError as exc:  # (`Fields.get` would read a null as absent)
            problems.append(str(f.error(key, str(exc))))
    return saved, problems


def _saved_sysctls(path: Path, problems: list[str] | None) -> dict[str, str]:
    """`read_saved_sysctls`, its problems added to `problems` (printed as warnings when None); {} for a damaged file."""
    try:
        saved, bad = read_saved_sysctls(path)
        bad = [f"{line}; not restored" for line in bad]
    except UserError as exc:
        saved, bad = {}, [f"{exc}; no sysctl restored from it"]
    for line in bad:
        if problems is None:
            print(f"prfaas: warning: {line}", file=sys.stderr)
        else:
            problems.append(line)
    return saved


def save_and_set_sysctls() -> dict[str, str]:
    """Call under `locked()` before a network starts. Returns what was set."""
    saved_file = STATE_DIR / SYSCTL_FILE
    if not saved_file.exists():  # else: saved by a network still running, or by a killed one (true originals)
        keys = list(SYSCTL_SET) + list(SYSCTL_MININET)
        saved = {k: v for k in keys if (v := read_sysctl(k)) is not None}
        write_state(saved_file, saved)
    done = {}
    for k, v in SYSCTL_SET.items():
        if read_sysctl(k) is not None and write_sysctl(k, v):
            done[k] = v
    return done


def restore_sysctls_if_last(exclude: Path | None, problems: list[str] | None = None) -> dict[str, str]:
    """Call under `locked()` after a network stopped: the last one out restores the saved values (those
    `read_saved_sysctls` takes; what it refuses is added to `problems`, or printed as a warning), and removes the file."""
    saved_file = STATE_DIR / SYSCTL_FILE
    if others_running(exclude) or not os.path.lexists(saved_file):
        return {}
    saved = _saved_sysctls(saved_file, problems)
    restored = {k: v for k, v in saved.items() if read_sysctl(k) != v and write_sysctl(k, v)}
    try:
        saved_file.unlink(missing_ok=True)
    except OSError:  # a folder in its place: said by the reader above
        pass
    return restored


def netns_inode(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def netns_cookie(pid: int) -> int | None:
    """The cookie of the process's network namespace (SO_NETNS_COOKIE, Linux >= 5.14): unlike its inode, never given
    to another namespace until the host reboots. None when it cannot be read (the process is gone or a zombie, an
    older kernel). A caller that holds the namespace open reads it from that (`netns_cookie_of_fd`): a pid may
    end and be given to another process between two reads, an open namespace stays the one opened."""
    try:
        ns = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return netns_cookie_of_fd(ns)
    finally:
        os.close(ns)


def netns_cookie_of_fd(ns_fd: int) -> int | None:
    """The cookie of the network namespace open at `ns_fd` (`netns_cookie`). Read by a thread that joins the
    namespace and ends (the caller's own threads stay where they are); None when it cannot be read."""
    got: list[int] = []

    def read() -> None:
        if ctypes.CDLL(None, use_errno=True).setns(ns_fd, CLONE_NEWNET) == 0:
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                got.append(int.from_bytes(s.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE, 8), sys.byteorder))

    reader = threading.Thread(target=read, name=f"netns-cookie-fd{ns_fd}")
    reader.start()
    reader.join()
    return got[0] if got else None


def pids_by_netns(inodes: set[int]) -> dict[int, list[int]]:
    """{inode: the processes in it} for every namespace of `inodes` that holds one, never the root namespace nor this
    process's own (pid 1's namespace may be unreadable, in a container)."""
    ours = {netns_inode(1), netns_inode(os.getpid())}
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            ino = netns_inode(int(entry.name))
            if ino in inodes and ino not in ours:
                out.setdefault(ino, []).append(int(entry.name))
    return out


def pids_in_netns(inodes: set[int]) -> list[int]:
    """Every process whose network namespace is one of `inodes` (`pids_by_netns`)."""
    return [pid for pids in pids_by_netns(inodes).values() for pid in pids]
