"""What a running network leaves on the host, written down so that another process can find it.

One JSON file per network in `STATE_DIR` (``/run/prfaas``, tmpfs: gone after a reboot) names its owner
process, its root-namespace bridges, its hosts (shell pid, namespace inode, address) and the
processes it started. `prfaas net exec/down` read it; `prfaas clean` uses it to remove what a killed
run left. Host-wide sysctls are saved once, by the first of our networks to start, in
``sysctl.json``, and restored by the last one to stop, so networks running side by side (several
tests, several users) never restore a value under each other's feet.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path
from typing import Any, Iterator

from testbed.atomic import write_json

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
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / ".lock", "w") as fh:
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


def write_state(path: Path, data: dict[str, Any]) -> None:
    write_json(path, data, indent=1)


def claim_tag(preferred: str, existing_links: set[str]) -> str:
    """Call under `locked()`: `preferred`, or the next free 5-hex-digit tag, free meaning no state file
    (live or left by a killed run) names it and no root-namespace link carries it. Tags name the
    bridges (``br[fd]TAG``), so two networks started at once never share one."""
    taken = {str(d.get("tag")) for _, d in list_states()}
    value = int(preferred, 16)
    for _ in range(1 << 20):
        tag = f"{value:05x}"
        if tag not in taken and not any(name.startswith(("brf" + tag, "brd" + tag)) for name in existing_links):
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
    out = []
    for p in sorted(STATE_DIR.glob("net-*.json")) if STATE_DIR.exists() else []:
        try:
            out.append((p, json.loads(p.read_text())))
        except (OSError, ValueError):
            continue
    return out


def owner_alive(data: dict[str, Any]) -> bool:
    return is_alive(int(data.get("owner_pid", -1)), data.get("owner_start"))


def live_states(exclude: Path | None = None) -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p, d in list_states() if p != exclude and owner_alive(d)]


def save_and_set_sysctls() -> dict[str, str]:
    """Call under `locked()` before a network starts. Returns what was set."""
    saved_file = STATE_DIR / "sysctl.json"
    if not saved_file.exists():  # else: saved by a network still running, or by a killed one (true originals)
        keys = list(SYSCTL_SET) + list(SYSCTL_MININET)
        saved = {k: v for k in keys if (v := read_sysctl(k)) is not None}
        write_state(saved_file, saved)
    done = {}
    for k, v in SYSCTL_SET.items():
        if read_sysctl(k) is not None and write_sysctl(k, v):
            done[k] = v
    return done


def restore_sysctls_if_last(exclude: Path | None) -> dict[str, str]:
    """Call under `locked()` after a network stopped: the last one out restores the saved values."""
    saved_file = STATE_DIR / "sysctl.json"
    if live_states(exclude=exclude) or not saved_file.exists():
        return {}
    try:
        saved = json.loads(saved_file.read_text())
    except (OSError, ValueError):
        saved = {}
    restored = {k: v for k, v in saved.items() if read_sysctl(k) != v and write_sysctl(k, v)}
    saved_file.unlink(missing_ok=True)
    return restored


def netns_inode(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def pids_in_netns(inodes: set[int]) -> list[int]:
    """Every process whose network namespace is one of `inodes` (never the root namespace's)."""
    root = netns_inode(1)
    inodes = {i for i in inodes if i and i != root}
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            if netns_inode(int(entry.name)) in inodes:
                out.append(int(entry.name))
    return out
