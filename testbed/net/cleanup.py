"""`prfaas clean`: remove what a killed run left behind, and nothing that belongs to anyone else.

What a network leaves when its Python process is SIGKILLed: its gateways' delay-line processes (and any
iperf3 or worker started in its hosts), which keep their namespaces alive with the veths, the
NFQUEUE and DROP iptables rules inside them; the two bridges in the root namespace; its state file;
the sysctls it changed. The state file (testbed.net.state) names all of it: processes are found by
the inode of their network namespace, so only processes inside our namespaces are signalled.
Bridges named like ours (``br[fd]XXXXX``) that no live network claims are removed too.

`clean(run=RUN_ID)` (``prfaas clean RUN_ID``) removes only the network(s) of one run -- its run id or
its run directory, as recorded in the state file -- and leaves every other network, live or dead, and
the host-wide leftovers (unclaimed bridges, stale delay-line directories) to a plain `prfaas clean`.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.net import state

BRIDGE_RE = re.compile(r"^br[fd][0-9a-f]{5}$")


@dataclass
class CleanReport:
    networks: list[str] = field(default_factory=list)  # state files removed
    processes: list[int] = field(default_factory=list)
    bridges: list[str] = field(default_factory=list)
    sysctls: dict[str, str] = field(default_factory=dict)
    skipped_live: list[str] = field(default_factory=list)
    delayline_leftovers: int = 0  # stale delay-line control directories and root-namespace NFQUEUE rules

    def as_dict(self) -> dict[str, Any]:
        return {"networks": self.networks, "processes": self.processes, "bridges": self.bridges,
                "sysctls_restored": self.sysctls, "live_networks_kept": self.skipped_live,
                "delayline_leftovers": self.delayline_leftovers}

    @property
    def nothing(self) -> bool:
        return not (self.networks or self.processes or self.bridges or self.sysctls or self.delayline_leftovers)


def _delete_bridges(names: list[str]) -> list[str]:
    from pyroute2 import IPRoute

    removed = []
    with IPRoute() as ipr:
        for name in names:
            if ipr.link_lookup(ifname=name):
                ipr.link("del", ifname=name)
                removed.append(name)
    return removed


def _our_bridges() -> list[str]:
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        return [l.get_attr("IFLA_IFNAME") for l in ipr.get_links() if BRIDGE_RE.match(l.get_attr("IFLA_IFNAME") or "")]


def remove_network(path: Path, data: dict[str, Any], report: CleanReport) -> None:
    """Kill everything inside the network's namespaces, delete its bridges and its state file."""
    from testbed.net.emulation import kill_pids

    inodes = {int(h["netns_inode"]) for h in data.get("hosts", {}).values() if h.get("netns_inode")}
    report.processes += kill_pids(state.pids_in_netns(inodes))
    report.bridges += _delete_bridges(list(data.get("bridges", [])))
    for d in data.get("delayline_dirs", []):
        if Path(d).name.startswith("prfaas-delayline-") and Path(d).is_dir():
            shutil.rmtree(d, ignore_errors=True)
            report.delayline_leftovers += 1
    path.unlink(missing_ok=True)
    report.networks.append(path.name)


def clean(*, include_live: bool = False, run: str | None = None) -> CleanReport:
    """Remove networks whose owner is gone (all of ours with `include_live`), then restore sysctls if
    none is left. With `run`, only that run's networks (see the module's docstring)."""
    from testbed.net.emulation import kill_pids

    report = CleanReport()
    if include_live:  # outside the lock: a SIGTERMed owner tears itself down, which takes the lock
        kill_pids([int(d["owner_pid"]) for _, d in state.live_states() if run is None or state.matches_run(d, run)], grace_s=15)
    with state.locked():
        for path, data in state.list_states():
            if run is not None and not state.matches_run(data, run):
                continue
            if state.owner_alive(data):
                report.skipped_live.append(f"{data.get('scenario')} (pid {data.get('owner_pid')}, tag {data.get('tag')})")
                continue
            remove_network(path, data, report)
        if run is not None:
            report.sysctls = state.restore_sysctls_if_last(exclude=None)
            return report
        claimed = {b for _, d in state.live_states() for b in d.get("bridges", [])}
        report.bridges += _delete_bridges([b for b in _our_bridges() if b not in claimed])
        report.sysctls = state.restore_sysctls_if_last(exclude=None)
    from testbed.net.delayline import cleanup_rules, remove_stale_control_dirs

    report.delayline_leftovers = remove_stale_control_dirs() + cleanup_rules()
    return report
