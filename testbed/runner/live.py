"""The live view of a run: what the run loop and the progress display know, fed by the client agent's
JSON lines (``testbed.serving.loadgen`` on stdout) and by the telemetry relay."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable

from testbed import units


@dataclass
class LiveState:
    """Updated by reader threads; read by the run loop and `progress_table`."""

    total: int = 0
    sent: int = 0
    done: int = 0
    ok: int = 0
    started: bool = False
    start_s: float | None = None  # the workload's start, seconds after PRFAAS_T0
    finished: bool = False
    error: str | None = None
    router: dict[str, Any] = field(default_factory=dict)
    egress_bps: float = 0.0  # emulated, PrfaaS -> PD
    capacity_bps: float = 0.0
    faults: list[str] = field(default_factory=list)


def read_agent(stdout: Iterable[str], live: LiveState) -> None:
    """Fold the client agent's progress lines into `live` until its stdout closes."""
    for line in stdout:
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        kind = msg.get("kind")
        if kind == "progress":
            live.sent, live.done, live.ok = msg["sent"], msg["done"], msg["ok"]
            live.router = msg.get("router") or live.router
        elif kind == "started":
            live.start_s = float(msg["t_s"])
            live.started = True
        elif kind == "finished":
            live.sent, live.done, live.ok, live.finished = msg["sent"], msg["done"], msg["ok"], True
        elif kind == "error":
            live.error = msg.get("message")


def progress_table(live: LiveState, t_s: float, title: str, duration_s: float) -> Any:
    """A rich table of the run's state at `t_s` seconds after PRFAAS_T0."""
    from rich.table import Table

    r = live.router or {}
    table = Table(title=title, show_header=False)
    if live.start_s is None:
        table.add_row("t", f"{t_s:6.1f} s: starting workers, router and client")
    else:
        table.add_row("t", f"{t_s - live.start_s:6.1f} s of {duration_s:g} s of workload")
    table.add_row("requests", f"{live.done} done ({live.ok} ok, {live.done - live.ok} failed) / {live.sent} sent / {live.total}")
    table.add_row("WAN egress", f"{units.format_rate(live.egress_bps)} of {units.format_rate(live.capacity_bps)} (emulated)")
    t = r.get("threshold")
    table.add_row("policy", f"{r.get('policy', '?')}   threshold t = {f'{t:,.0f} tokens' if t is not None else 'inf'}")
    queues: dict[str, int] = {}
    for x in r.get("instances", []):
        key = f"{x['cluster']}-{x['role']}"
        queues[key] = queues.get(key, 0) + int(x.get("inflight") or 0)
    table.add_row("in flight", "  ".join(f"{k}: {v}" for k, v in sorted(queues.items())) or "-")
    if live.faults:
        table.add_row("faults", "; ".join(live.faults))
    return table
