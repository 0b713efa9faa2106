"""`prfaas clean`: remove what a killed run left behind, and nothing that belongs to anyone else.

What a network leaves when its Python process is SIGKILLed: its gateways' delay-line processes (and any
iperf3 or worker started in its hosts), which keep their namespaces alive with the veths, the
NFQUEUE and DROP iptables rules inside them; the two bridges in the root namespace; its state file;
the sysctls it changed. The state file (testbed.net.state) names all of it: processes are found by
the inode of their network namespace and signalled only when that namespace is provably the recorded
one -- its cookie is the one recorded (`state.netns_cookie`) -- and no live network of ours records
the inode: the kernel gives a freed namespace's inode to the next one created, which may be anyone's.
Processes in a namespace that has another cookie now are someone else's and left alone, silently. A
file that records no cookie (written before cookies were, or on a kernel older than 5.14) cannot
prove its namespaces: the processes found in them are not signalled but listed, one line, for the
user to check (`ps -o pid,netns,args`) and kill by hand. Bridges named like ours (``br[fd]XXXXX``)
that no live network claims are removed too, and with every bridge its ports (``br[fd]XXXXX-ethN``), which a
namespace the kernel keeps after its processes would keep (`delete_bridges`).

`clean(run=RUN_ID)` (``prfaas clean RUN_ID``) removes only the network(s) of one run -- its run id or
its run directory, as recorded in the state file -- and leaves every other network, live or dead, and
the host-wide leftovers (unclaimed bridges, stale delay-line directories) to a plain `prfaas clean`.
`clean(network=PATH)` (`prfaas net down`) removes only the network of that state file, in the same way.

A damaged state file (`state.read_state` refuses it) is acted on by its name only: a plain `prfaas clean` removes
it unless the pid in its name runs (it may be a live network's: kept, and its bridges claimed), and says what it
could not clean -- the processes in that network's namespaces, which the file no longer names. Nothing it holds
is acted on. With `--all`, a live owner is stopped only when its pid and start time both match the file.
"""

from __future__ import annotations

import errno
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.errors import UserError
from testbed.net import state
from testbed.validation import path_is_dir


@dataclass
class CleanReport:
    networks: list[str] = field(default_factory=list)  # state files removed
    processes: list[int] = field(default_factory=list)
    bridges: list[str] = field(default_factory=list)
    sysctls: dict[str, str] = field(default_factory=dict)
    skipped_live: list[str] = field(default_factory=list)
    delayline_leftovers: int = 0  # stale delay-line control directories and root-namespace NFQUEUE rules
    damaged: list[str] = field(default_factory=list)  # damaged state files removed: what wrong, what of theirs is left
    not_cleaned: list[str] = field(default_factory=list)  # what was left, one line each: the file and why

    def as_dict(self) -> dict[str, Any]:
        return {"networks": self.networks, "processes": self.processes, "bridges": self.bridges,
                "sysctls_restored": self.sysctls, "live_networks_kept": self.skipped_live,
                "delayline_leftovers": self.delayline_leftovers, "damaged_state_files_removed": self.damaged,
                "not_cleaned": self.not_cleaned}

    @property
    def nothing(self) -> bool:
        return not (self.networks or self.processes or self.bridges or self.sysctls or self.delayline_leftovers)


def delete_bridges(names: list[str]) -> list[str]:
    """Delete the bridges `names` and their ports (`state.BRIDGE_LINK_RE`) in the root namespace; returns the bridges
    of which a link was deleted. A port is deleted by its name, not only unplugged with its bridge: a host's namespace
    can outlive its processes (the kernel keeps it while an orphaned socket still closes), and its veth pair with it:
    after `prfaas run` was SIGKILLed mid-workload, three ports were still there 2 minutes after `prfaas clean`
    (docs/network.md, "What a kill leaves")."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    removed: list[str] = []
    with IPRoute() as ipr:
        for link in ipr.get_links():
            m = state.BRIDGE_LINK_RE.match(link.get_attr("IFLA_IFNAME") or "")
            if m is None or m[1] not in names:
                continue
            try:
                ipr.link("del", index=link["index"])
            except NetlinkError as exc:
                if exc.code != errno.ENODEV:  # gone meanwhile (its namespace went)
                    raise
            if m[1] not in removed:
                removed.append(m[1])
    return removed


def _our_bridges() -> list[str]:
    """Every bridge of ours that has a link in the root namespace: itself or a port (`state.BRIDGE_LINK_RE`)."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        found = (state.BRIDGE_LINK_RE.match(link.get_attr("IFLA_IFNAME") or "") for link in ipr.get_links())
        return sorted({m[1] for m in found if m})


def remove_network(path: Path, data: dict[str, Any], report: CleanReport, live_inodes: frozenset[int]) -> None:
    """Kill everything inside the network's namespaces that are provably still its own (see the module's docstring;
    `live_inodes`: those of our live networks, never touched), delete its bridges and its state file."""
    from testbed.net.emulation import kill_pids

    cookies = {h["netns_inode"]: h["netns_cookie"] for h in data["hosts"].values() if h["netns_inode"]}  # (`state.read_state`'s)
    proven: list[int] = []
    unproven: list[int] = []
    for inode, pids in state.pids_by_netns(set(cookies) - live_inodes).items():
        now = next((c for pid in pids if (c := state.netns_cookie(pid)) is not None), None)
        if cookies[inode] is None or now is None:
            unproven += pids
        elif now == cookies[inode]:
            proven += pids
    report.processes += kill_pids(proven)
    if unproven:
        report.not_cleaned.append(
            f"{path}: left {len(unproven)} process(es) in namespaces it records (pid {', '.join(map(str, sorted(unproven)))}), "
            "not signalled: the kernel reuses a freed namespace's inode, and nothing proves these are still its own (it "
            "records no namespace cookie -- a file written before they were, or on a kernel older than 5.14 -- or their "
            "cookie could not be read); check them with `ps -o pid,netns,args -p PID` and kill those that are its")
    report.bridges += delete_bridges(list(data.get("bridges", [])))
    for d in data.get("delayline_dirs", []):
        if Path(d).name.startswith(state.DELAYLINE_DIR_PREFIX) and Path(d).is_dir():
            shutil.rmtree(d, ignore_errors=True)
            report.delayline_leftovers += 1
    if data.get("held_by") == state.NET_UP:  # a detached `net up`'s log, which its clean stop would have removed
        state.net_up_log(data["owner_pid"]).unlink(missing_ok=True)
    path.unlink(missing_ok=True)
    report.networks.append(path.name)


def _remove_damaged(d: state.DamagedState, run: str | None, report: CleanReport) -> None:
    """A damaged state file: removed when nothing says it is a live network's (see the module's docstring)."""
    if run is not None:
        report.not_cleaned.append(f"{d.problem}; left: a damaged state file cannot be matched to run {run} "
                                  "(a plain `prfaas clean` removes it)")
        return
    if d.maybe_live():
        report.not_cleaned.append(f"{d.problem}; kept: pid {d.pid}, which its name gives, is running, so it may be a live "
                                  "network's (`prfaas clean` removes it once that process is gone; delete it by hand if "
                                  "that process is no network's)")
        return
    try:
        d.path.unlink()
    except FileNotFoundError:
        return
    except OSError as exc:
        report.not_cleaned.append(f"{d.problem}; could not remove it ({exc.strerror or exc})")
        return
    report.networks.append(d.path.name)
    report.damaged.append(f"{d.problem}; removed it, but not the processes in its network's namespaces, which it no "
                          "longer names (find any with `ps -e -o pid,netns,args`)")


def _check_run(run: str, good: list[tuple[Path, dict[str, Any]]], damaged: list[state.DamagedState]) -> None:
    """`run` (``prfaas clean RUN_ID``) when a state file names it, a damaged one might, or it is a folder (a run
    directory whose network is gone: nothing to clean, rightly); else a `UserError` naming the runs that have a network
    left. ``prfaas clean TYPO`` said "nothing to clean for run TYPO" and exited 0, as for a run already clean."""
    if any(state.matches_run(data, run) for _, data in good) or damaged or (run.strip() and path_is_dir(run)):
        return
    runs = sorted({str(data.get("run_id") or data.get("run_dir")) for _, data in good if data.get("run_id") or data.get("run_dir")})
    left = f"runs with a network left: {', '.join(runs)}" if runs else "no run has a network left"
    raise UserError(f"no network names run {run!r} (as its run id or its run directory), and it is no run directory; "
                    f"{left} (a plain `prfaas clean` removes every network whose owner is gone)")


def clean(*, include_live: bool = False, run: str | None = None, network: Path | None = None) -> CleanReport:
    """Remove networks whose owner is gone (all of ours with `include_live`), then restore sysctls if
    none is left. With `run`, only that run's networks (see the module's docstring); a `run` no network names that is
    no run directory either is a `UserError` (`_check_run`), before anything is done. With `network` (a state file's
    path, `state.state_path`), only that network, and no other's file or resources: `prfaas net down` cleaned every
    dead network's leftovers after stopping its own."""
    from testbed.net.emulation import kill_pids

    def chosen(path: Path, data: dict[str, Any]) -> bool:
        return (run is None or state.matches_run(data, run)) and (network is None or path == network)

    report = CleanReport()
    if run is not None:
        _check_run(run, *state.scan_states())
    if include_live:  # outside the lock: a SIGTERMed owner tears itself down, which takes the lock
        good, _ = state.scan_states()
        kill_pids([d["owner_pid"] for p, d in good if chosen(p, d) and state.owner_identified(d)],
                  grace_s=15)
    with state.locked():
        good, damaged = state.scan_states()
        state.warn_damaged(damaged, quiet=True)  # reported below
        alive = {path: state.owner_alive(data) for path, data in good}
        live_inodes = frozenset(h["netns_inode"] for path, data in good if alive[path] for h in data["hosts"].values()
                                if h["netns_inode"])
        for path, data in good:
            if not chosen(path, data):
                continue
            if alive[path]:
                report.skipped_live.append(f"{data.get('scenario')} (pid {data.get('owner_pid')}, tag {data.get('tag')})")
                if include_live:  # not stopped above: its owner cannot be told from a process that took its pid
                    report.not_cleaned.append(f"{path}: kept: its owner, pid {data['owner_pid']}, runs, but the file records "
                                              "no start time (owner_start) to tell it from another process that took the "
                                              "pid, so it was not stopped")
                continue
            remove_network(path, data, report, live_inodes)
        for d in damaged:
            if network is None or d.path == network:
                _remove_damaged(d, run, report)
        if run is not None or network is not None:
            report.sysctls = state.restore_sysctls_if_last(exclude=None, problems=report.not_cleaned)
            return report
        live, damaged = state.scan_states()
        claimed = {b for _, d in live if state.owner_alive(d) for b in d["bridges"]}
        claimed |= {b for d in damaged if d.maybe_live() and d.tag for b in state.bridge_names(d.tag)}
        report.bridges += delete_bridges([b for b in _our_bridges() if b not in claimed])
        report.sysctls = state.restore_sysctls_if_last(exclude=None, problems=report.not_cleaned)
    from testbed.net.delayline import cleanup_rules, remove_stale_control_dirs

    report.delayline_leftovers = remove_stale_control_dirs() + cleanup_rules()
    return report
