"""The scenario's network schema and the reader of a scenario file; every error names the field.

The network part (``topology``, ``wan``, ``scale``) is defined here, with `Scenario`, the object every
layer receives. Other sections (``model``, ``workload``, ``policy``, ``serving``, ``cross_traffic``)
belong to the packages that use them: `read_scenario` takes them as `Section` values (key, parser,
optional cross-section check), and `testbed.sections` lists them all and loads whole scenarios
(`load_scenario`, `parse_scenario`). This module imports none of them: it sits below the packages
that own sections. The validation toolkit (`Fields`, number readers) is `testbed.validation`.
See docs/scenario.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import yaml

from testbed import units
from testbed.errors import FieldError, UserError
from testbed.scale import Scale
from testbed.validation import (REQUIRED, Fields, at_most, boolean, load_yaml, name_or_stem, number, path_exists, shown, whole_number, random_seed,
                                read_yaml, shown, yaml_problem)

# --------------------------------------------------------------------------------------------- network

JITTER_DISTRIBUTIONS = ("normal", "uniform", "pareto", "paretonormal")
LOSS_MODELS = ("random", "gilbert-elliott")
BACKENDS = ("auto", "netem", "delayline")
SHAPERS = ("htb", "tbf")
DIRECTIONS = ("prfaas_to_pd", "pd_to_prfaas")
DATACENTERS = ("prfaas", "pd")


@dataclass(frozen=True)
class LossSpec:
    """Random loss (`rate`) or a Gilbert-Elliott two-state burst model (netem ``gemodel p r 1-h 1-k``)."""

    model: str = "random"
    rate: float = 0.0  # random: probability a packet is lost
    p: float = 0.0  # GE: P(good -> bad)
    r: float = 1.0  # GE: P(bad -> good)
    bad_loss: float = 1.0  # GE: loss probability in the bad state (1 - h)
    good_loss: float = 0.0  # GE: loss probability in the good state (1 - k)

    @property
    def mean_rate(self) -> float:
        if self.model == "random":
            return self.rate
        pi_bad = self.p / (self.p + self.r) if self.p + self.r > 0 else 0.0
        return pi_bad * self.bad_loss + (1 - pi_bad) * self.good_loss


def parse_loss(v: Any, path: str = "wan.loss", source: str | None = None) -> LossSpec:
    if not isinstance(v, dict):
        return LossSpec("random", units.parse_fraction(v))
    f = Fields(v, path, source)
    model = f.choice("model", LOSS_MODELS, "random")
    if model == "random":
        spec = LossSpec("random", f.get("rate", units.parse_fraction, 0.0))
    else:
        spec = LossSpec(
            "gilbert-elliott",
            p=f.get("p", units.parse_fraction),
            r=f.get("r", units.parse_fraction),
            bad_loss=f.get("bad_loss", units.parse_fraction, 1.0),
            good_loss=f.get("good_loss", units.parse_fraction, 0.0),
        )
        if spec.p > 0 and spec.r == 0:
            raise FieldError(f"{path}.r", "must be > 0 when p > 0, or the link stays in the bad state forever", source)
    f.done()
    return spec


@dataclass(frozen=True)
class LinkDirectionSpec:
    """One direction of the WAN, in emulated units (before dividing by `scale`)."""

    rate_bps: float
    delay_s: float = 0.0
    jitter_s: float = 0.0
    jitter_distribution: str = "normal"
    reorder: bool = False
    loss: LossSpec = field(default_factory=LossSpec)
    queue: units.QueueLimit = field(default_factory=lambda: units.QueueLimit("bdp", 1.0))

    def queue_bytes(self, scale: Scale | float = 1.0, rtt_s: float | None = None) -> int:
        """Queue limit in bytes on the wire; the BDP uses the round-trip time (`bdp_rtt_s`)."""
        return self.queue.to_bytes(Scale.of(scale).wire_bps(self.rate_bps), self.bdp_rtt_s(rtt_s))

    def bdp_rtt_s(self, rtt_s: float | None = None) -> float:
        """The round trip a BDP-sized queue refers to: `rtt_s` (`WanSpec.rtt_s`), or 2 x this direction's delay when
        the direction stands alone; at least 1 ms."""
        return max(2 * self.delay_s if rtt_s is None else rtt_s, 1e-3)


_DIRECTION_KEYS = ("rate", "delay", "jitter", "jitter_distribution", "reorder", "loss", "queue")
# The longest one-way delay or jitter a WAN direction takes. No path on Earth is a tenth of it (a geostationary hop is
# ~0.27 s), so a larger value is a typo; the delay line failed on 1000h with an internal struct error (2026-12-06).
MAX_WAN_DELAY_S = 10.0


def wan_delay_s(v: object) -> float:
    """A WAN delay or jitter: a duration up to `MAX_WAN_DELAY_S`."""
    return units.parse_duration_s(v, most_s=MAX_WAN_DELAY_S, most=f"{MAX_WAN_DELAY_S:g}s, the most a WAN direction's delay or jitter may be")


def _read_direction(f: Fields, base: LinkDirectionSpec | None) -> LinkDirectionSpec:
    d = base or LinkDirectionSpec(rate_bps=0.0)
    out = LinkDirectionSpec(
        rate_bps=f.get("rate", units.parse_rate_bps, d.rate_bps if base else REQUIRED),
        delay_s=f.get("delay", wan_delay_s, d.delay_s),
        jitter_s=f.get("jitter", wan_delay_s, d.jitter_s),
        jitter_distribution=f.choice("jitter_distribution", JITTER_DISTRIBUTIONS, d.jitter_distribution),
        reorder=f.get("reorder", boolean, d.reorder),
        loss=f.get("loss", lambda v: parse_loss(v, f.name("loss"), f.source), d.loss),
        queue=f.get("queue", units.parse_queue, d.queue),
    )
    if out.jitter_s > out.delay_s and not out.reorder:
        raise f.error(
            "jitter",
            f"{units.format_duration(out.jitter_s)} is larger than the delay {units.format_duration(out.delay_s)}; "
            "with in-order delivery jitter must be <= delay (or set reorder: true)",
        )
    return out


@dataclass(frozen=True)
class ScheduleEvent:
    """A change of the WAN at time `at_s` (seconds from network start).

    `changes` maps a direction field (``rate_bps``, ``delay_s``, ``jitter_s``, ``loss``) to its new value;
    `down_s` takes the link down for that long; `for_s` reverts the changes after that long.
    """

    at_s: float
    directions: tuple[str, ...] = DIRECTIONS
    changes: tuple[tuple[str, Any], ...] = ()
    down_s: float = 0.0
    for_s: float | None = None


@dataclass(frozen=True)
class ScheduleAction:
    at_s: float
    event_index: int
    directions: tuple[str, ...]
    kind: str  # "change" | "revert" | "down" | "up"
    changes: tuple[tuple[str, Any], ...] = ()

    def describe(self) -> str:
        what = ", ".join(f"{k}={_fmt(v)}" for k, v in self.changes) if self.changes else ""
        return f"{self.kind} {'+'.join(self.directions)} {what}".strip()


def _fmt(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def expand_schedule(events: Sequence[ScheduleEvent]) -> list[ScheduleAction]:
    """Events -> actions in time order; at equal times, the scenario's order is kept (an entry's down, up,
    change, revert in that order). The one timeline: `testbed.net.schedule.ScheduleRunner` fires it,
    `prfaas check` draws it and `_check_scheduled_jitter` walks it."""
    actions: list[ScheduleAction] = []
    for i, e in enumerate(events):
        if e.down_s:
            actions.append(ScheduleAction(e.at_s, i, e.directions, "down"))
            actions.append(ScheduleAction(e.at_s + e.down_s, i, e.directions, "up"))
        if e.changes:
            actions.append(ScheduleAction(e.at_s, i, e.directions, "change", e.changes))
            if e.for_s is not None:
                actions.append(ScheduleAction(e.at_s + e.for_s, i, e.directions, "revert", e.changes))
    return sorted(actions, key=lambda a: a.at_s)


Saved = dict[tuple[int, str], dict[str, Any]]  # (entry index, direction) -> the values its change found


def schedule_step(current: dict[str, "LinkDirectionSpec"], saved: Saved, action: ScheduleAction) -> dict[str, "LinkDirectionSpec"]:
    """The new spec of each direction a change or revert `action` sets, from `current` (a down or up sets none). A
    change records in `saved` the values it replaces; its revert restores those, not the base values: a revert after
    an earlier change without `for` goes back to that change's values. The one definition of the schedule's state:
    `testbed.net.wan.Wan.apply` installs each step, `prfaas check` draws the capacity the steps leave
    (`capacity_segments`, which reverted to the base rate until 2026-12-07) and `_check_scheduled_jitter` checks each."""
    out: dict[str, LinkDirectionSpec] = {}
    for d in action.directions:
        if action.kind == "change":
            saved[(action.event_index, d)] = {k: getattr(current[d], k) for k, _ in action.changes}
            out[d] = replace(current[d], **dict(action.changes))
        elif action.kind == "revert":
            out[d] = replace(current[d], **saved.pop((action.event_index, d), {}))
    return out


def walk_schedule(events: Sequence[ScheduleEvent], base: dict[str, "LinkDirectionSpec"]
                  ) -> Iterator[tuple[ScheduleAction, dict[str, "LinkDirectionSpec"], dict[str, "LinkDirectionSpec"]]]:
    """Each action of the schedule in the order a run fires it (`expand_schedule`), with what it sets
    (`schedule_step`) and every direction's spec after it, from `base`; the one walk that `prfaas check`'s capacity
    timeline and queue planning and `_check_scheduled_jitter` take (`Wan.apply` takes the same steps live)."""
    current, saved = dict(base), {}
    for a in expand_schedule(events):
        step = schedule_step(current, saved, a)
        current.update(step)
        yield a, step, dict(current)


def _read_event(f: Fields) -> ScheduleEvent:
    at = f.get("at", units.parse_duration_s)
    direction = f.choice("direction", ("both",) + DIRECTIONS, "both")
    changes: list[tuple[str, Any]] = []
    if f.has("rate"):
        changes.append(("rate_bps", f.get("rate", units.parse_rate_bps)))
    if f.has("delay"):
        changes.append(("delay_s", f.get("delay", wan_delay_s)))
    if f.has("jitter"):
        changes.append(("jitter_s", f.get("jitter", wan_delay_s)))
    if f.has("loss"):
        changes.append(("loss", f.get("loss", lambda v: parse_loss(v, f.name("loss"), f.source))))
    down = f.get("down", lambda v: units.parse_duration_s(v, allow_zero=False), 0.0)
    dur = f.get("for", lambda v: units.parse_duration_s(v, allow_zero=False), None)
    f.done()
    if not changes and not down:
        raise f.error("at", "a schedule entry needs at least one of: rate, delay, jitter, loss, down")
    if down and dur is not None:
        raise f.error("for", "'down' already has its own duration; drop 'for'")
    return ScheduleEvent(
        at_s=at,
        directions=DIRECTIONS if direction == "both" else (direction,),
        changes=tuple(changes),
        down_s=down,
        for_s=dur,
    )


@dataclass(frozen=True)
class WanSpec:
    backend: str = "auto"
    shaper: str = "htb"
    prfaas_to_pd: LinkDirectionSpec = field(default_factory=lambda: LinkDirectionSpec(rate_bps=100e9))
    pd_to_prfaas: LinkDirectionSpec = field(default_factory=lambda: LinkDirectionSpec(rate_bps=100e9))
    schedule: tuple[ScheduleEvent, ...] = ()

    def direction(self, name: str) -> LinkDirectionSpec:
        return getattr(self, name)

    @property
    def rtt_s(self) -> float:
        """The configured round trip: one-way delay there plus one-way delay back (jitter, queueing excluded).
        The one RTT of the project: BDP queues, calibration and the run's records all use it."""
        return self.prfaas_to_pd.delay_s + self.pd_to_prfaas.delay_s

    def only_delays(self, direction: str) -> bool:
        """Whether `direction`, at every point of the schedule, delays each packet by the same amount: no loss, no
        jitter, no reordering (what an open-loop UDP neighbour may skip; `testbed.net.wan.Wan.pass_open_loop_udp`)."""
        d = self.direction(direction)
        if d.jitter_s > 0 or d.reorder or d.loss.mean_rate > 0:
            return False
        return not any(direction in e.directions and ((k == "jitter_s" and v > 0) or (k == "loss" and v.mean_rate > 0))
                       for e in self.schedule for k, v in e.changes)

    @property
    def max_rate_bps(self) -> float:
        rates = [self.prfaas_to_pd.rate_bps, self.pd_to_prfaas.rate_bps]
        rates += [v for e in self.schedule for k, v in e.changes if k == "rate_bps"]
        return max(rates)


def parse_wan(f: Fields) -> WanSpec:
    backend = f.choice("backend", BACKENDS, "auto")
    shaper = f.choice("shaper", SHAPERS, "htb")
    common = Fields({k: f.data[k] for k in _DIRECTION_KEYS if k in f.data}, f.path, f.source)
    f.mark_read(*_DIRECTION_KEYS, *DIRECTIONS)
    base = _read_direction(common, None)
    dirs = {d: _read_direction(f.section(d), base) if f.has(d) else base for d in DIRECTIONS}
    for d in DIRECTIONS:
        if f.has(d):
            sub = f.section(d)
            sub.mark_read(*_DIRECTION_KEYS)
            sub.done()
    events = tuple(_read_event(e) for e in f.items("schedule"))
    f.done()
    last = -1.0
    for i, e in enumerate(events):
        if e.at_s < last:
            raise FieldError(f"{f.name('schedule')}[{i}].at", f"{e.at_s:g}s comes before the previous entry ({last:g}s); entries must be in time order", f.source)
        last = e.at_s
    _check_windows(f, events)
    _check_scheduled_jitter(f, events, dirs)
    return WanSpec(backend, shaper, dirs["prfaas_to_pd"], dirs["pd_to_prfaas"], events)


def _check_scheduled_jitter(f: Fields, events: Sequence[ScheduleEvent], dirs: dict[str, LinkDirectionSpec]) -> None:
    """The rule `_read_direction` applies to the base values (jitter <= delay with in-order delivery) at every
    change and revert of the schedule, walked in the order a run fires them (`expand_schedule`): ``{at: 1s,
    jitter: 100ms}`` on a 5 ms line passed. A revert restores what its entry's change found (`schedule_step`)."""
    for a, _, state in walk_schedule(events, dirs):
        changed = {k: v for k, v in a.changes if k in ("delay_s", "jitter_s")}
        for d in a.directions:
            delay, jitter = state[d].delay_s, state[d].jitter_s
            if changed and jitter > delay and not dirs[d].reorder:
                key = "for" if a.kind == "revert" else ("jitter" if "jitter_s" in changed else "delay")
                raise FieldError(f"{f.name('schedule')}[{a.event_index}].{key}", f"at {a.at_s:g}s {d}'s jitter {units.format_duration(jitter)} would be "
                                 f"larger than its delay {units.format_duration(delay)}; with in-order delivery jitter must be "
                                 f"<= delay (or set reorder: true)", f.source)


_FIELD_KEYS = {"rate_bps": "rate", "delay_s": "delay", "jitter_s": "jitter", "loss": "loss"}


def _check_windows(f: Fields, events: Sequence[ScheduleEvent]) -> None:
    """No entry changes a field of a direction (or takes it down) while an earlier entry's `for` (or `down`) window
    on it is open: the earlier revert restores the value from before *its* change, so a 10-20s dip and a 15-25s one
    left the line at the first dip's rate for good, and `prfaas check` drew another timeline (2026-12-06). Nor do two
    entries at the same time change one field of one direction (or both take it down): the later won, unsaid
    (2026-12-07); entries at the same time changing different fields are one change."""
    open_until: dict[tuple[str, str], tuple[float, int]] = {}  # (direction, field) -> (window end, entry index)
    set_at: dict[tuple[str, str], tuple[float, int]] = {}  # (direction, field) -> (time, entry index) of its last change
    for i, e in enumerate(events):
        keys = [k for k, _ in e.changes] + (["down"] if e.down_s else [])
        for d in e.directions:
            for k in keys:
                at, j = set_at.get((d, k), (-1.0, -1))
                if at == e.at_s:
                    key = _FIELD_KEYS.get(k, k)
                    what = f"takes {d} down" if k == "down" else f"sets {d}'s {key}"
                    raise FieldError(f"{f.name('schedule')}[{i}].{key}", f"at {e.at_s:g}s {what} again (also set by "
                                     f"{f.name('schedule')}[{j}]); the later entry would win unsaid: keep one", f.source)
                set_at[(d, k)] = (e.at_s, i)
                end, j = open_until.get((d, k), (-1.0, -1))
                if e.at_s < end:
                    what = "is down" if k == "down" else f"has its {_FIELD_KEYS[k]} changed"
                    raise FieldError(f"{f.name('schedule')}[{i}].at", f"{e.at_s:g}s: {d} {what} by entry {j} until {end:g}s, "
                                     f"whose end would undo this entry; start at {end:g}s or later, or shorten entry {j}", f.source)
                length = e.down_s if k == "down" else e.for_s
                if length is not None:
                    open_until[(d, k)] = (e.at_s + length, i)


@dataclass(frozen=True)
class DatacenterSpec:
    """Hosts per role in one datacenter. Host names: ``{dc}-p{i}`` prefill, ``{dc}-d{i}`` decode,
    ``{dc}-x{i}`` cross-traffic endpoints, ``{dc}-gw`` the gateway; the PD datacenter also has
    ``pd-router`` (router, global KV cache manager) and ``pd-client`` (load generator)."""

    name: str
    prefill_hosts: int
    decode_hosts: int
    cross_hosts: int

    def host_names(self) -> list[str]:
        roles = (("p", self.prefill_hosts), ("d", self.decode_hosts), ("x", self.cross_hosts))
        names = [f"{self.name}-{r}{i}" for r, n in roles for i in range(n)]
        if self.name == "pd":
            names += ["pd-router", "pd-client"]
        return names


@dataclass(frozen=True)
class TopologySpec:
    prfaas: DatacenterSpec = field(default_factory=lambda: DatacenterSpec("prfaas", 1, 0, 1))
    pd: DatacenterSpec = field(default_factory=lambda: DatacenterSpec("pd", 1, 1, 1))
    lan_rate_bps: float | None = None  # intra-datacenter links: unshaped unless set

    def datacenter(self, name: str) -> DatacenterSpec:
        return getattr(self, name)


# The most hosts of one kind per datacenter: 64 worker hosts (prefill and decode together), and 64 cross-traffic hosts.
# `cross: 1000000000` passed `prfaas check` (the bound on worker hosts left them out), and a run would have made a
# network namespace for each (2026-12-07).
MAX_HOSTS_PER_DC = 64


def parse_topology(f: Fields) -> TopologySpec:
    dcs = {}
    for name, defaults in (("prfaas", (1, 0, 1)), ("pd", (1, 1, 1))):
        s = f.section(name)
        dcs[name] = DatacenterSpec(
            name,
            s.get("prefill", whole_number, defaults[0]),
            s.get("decode", whole_number, defaults[1]),
            s.get("cross", at_most(whole_number, MAX_HOSTS_PER_DC, "hosts", "as many as worker hosts (each is a network namespace "
                                   "with its own link)"), defaults[2]),
        )
        s.done()
        if name == "prfaas" and dcs[name].decode_hosts:
            raise FieldError(s.name("decode"), "the PrfaaS datacenter only prefills; use 0", f.source)
        if sum((dcs[name].prefill_hosts, dcs[name].decode_hosts)) > MAX_HOSTS_PER_DC:
            d = dcs[name]
            raise FieldError(s.path, f"prefill {shown(d.prefill_hosts)} + decode {shown(d.decode_hosts)} worker hosts; at most "
                             f"{MAX_HOSTS_PER_DC} per datacenter (each is a network namespace with its own link)", f.source)
    if dcs["pd"].decode_hosts < 1:
        raise FieldError("topology.pd.decode", "needs at least 1 decode host", f.source)
    lan = f.get("lan_rate", units.parse_rate_bps, None)
    f.done()
    return TopologySpec(dcs["prfaas"], dcs["pd"], lan)


# -------------------------------------------------------------------------------------------- scenario

@dataclass(frozen=True)
class Section:
    """A scenario section owned by another package: `parse` reads its mapping into the package's own
    typed object; `check`, if any, runs once the whole scenario is read (checks across sections, e.g.
    serving instances against the topology)."""

    key: str
    parse: Callable[[Fields], Any]
    check: Callable[["Scenario"], None] | None = None
    # the section's rates that `scale` divides onto the wire, each named by its field (`Scenario.check_wire_rates`)
    rates: Callable[[Any], Sequence["WireRate"]] | None = None


@dataclass(frozen=True)
class WireRate:
    """A rate `scale` divides onto the wire, named by its field (`Scenario.check_wire_rates`). `parts` senders may share
    it equally, each at `bps` / `parts` on the wire (a cross-traffic flow's iperf3 streams), their count named by the
    field `parts_field` (e.g. ``cross_traffic.flows[0].streams``)."""

    field: str
    bps: float
    parts: int = 1
    parts_field: str = ""


def parse_scale(v: Any) -> float | str:
    if v == "auto":
        return "auto"
    try:
        return Scale(number(v)).factor
    except ValueError as exc:
        raise ValueError(f"{exc} or 'auto'") from None


@dataclass(frozen=True)
class Scenario:
    name: str
    seed: int = 1
    scale: float | str = 1.0
    duration_s: float = 60.0
    topology: TopologySpec = field(default_factory=TopologySpec)
    wan: WanSpec = field(default_factory=WanSpec)
    sections: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    source: str | None = None
    section_rates: tuple[WireRate, ...] = field(default=(), compare=False, repr=False)  # `Section.rates`

    def section(self, key: str) -> Any:
        """A typed section (``model``, ``workload``, ...) or None when the file has none."""
        return self.sections.get(key)

    def wire_rates(self) -> list[WireRate]:
        """Every rate `scale` divides onto the wire, named: the WAN's (each direction's, each scheduled one), the
        LAN's, and the sections' (`Section.rates`: cross traffic)."""
        rates = [WireRate(f"the {d} WAN rate", self.wan.direction(d).rate_bps) for d in DIRECTIONS]
        rates += [WireRate(f"wan.schedule[{i}].rate", v) for i, e in enumerate(self.wan.schedule) for k, v in e.changes if k == "rate_bps"]
        if self.topology.lan_rate_bps:
            rates.append(WireRate("topology.lan_rate", self.topology.lan_rate_bps))
        return rates + list(self.section_rates)

    def check_wire_rates(self, scale: Scale, said: str, auto: bool = False) -> None:
        """Refuse a scale that puts a rate below `units.MIN_WIRE_RATE_BPS` on the wire (`said`: the scale as the
        error shows it; `auto`: resolved from the host's capacity): ``scale: 1e30`` ran a 100 Gbps WAN at 1e-19 bit/s,
        past what the kernel's shaper can take. Then a rate shared by `WireRate.parts` senders, each below it: 64
        iperf3 streams of a 100 Kbps flow were ``-b 1562`` each, and past 100 Kbps / 8 bit/s streams ``-b 0``, which
        iperf3 reads as unlimited."""
        rates = self.wire_rates()
        lowest = min(rates, key=lambda r: r.bps)
        wire = scale.wire_bps(lowest.bps)
        if wire < units.MIN_WIRE_RATE_BPS:
            most = math.floor(lowest.bps / units.MIN_WIRE_RATE_BPS)
            raise_it = f", or raise that rate to {units.format_rate(units.MIN_WIRE_RATE_BPS * scale.factor)} or more" if auto else ""
            raise FieldError("scale", f"{said} puts {lowest.field}, {units.format_rate(lowest.bps)}, at {wire:.9g} bps on the wire, "
                             f"below 8 Kbps, the lowest rate the wire can be shaped at; use a scale of at most {most} (that rate / "
                             f"8 Kbps){raise_it}", self.source)
        for r in rates:
            wire = scale.wire_bps(r.bps)
            if wire / r.parts < units.MIN_WIRE_RATE_BPS:
                what = r.parts_field.rsplit(".", 1)[-1]
                raise FieldError(r.parts_field, f"{r.parts} {what} share {r.field}, {units.format_rate(r.bps)}, which scale {said} "
                                 f"puts at {units.format_rate(wire)} on the wire: {wire / r.parts:.4g} bps each, below 8 Kbps, the "
                                 f"lowest rate the wire can be paced at; use at most {math.floor(wire / units.MIN_WIRE_RATE_BPS)} {what} "
                                 f"(that rate on the wire / 8 Kbps), or raise that rate to "
                                 f"{units.format_rate(units.MIN_WIRE_RATE_BPS * r.parts * scale.factor)} or more", self.source)

    def resolve_scale(self, capacity_bps: float) -> Scale:
        """`scale: auto` -> the smallest S >= 1 with every scheduled WAN rate / S <= the host's capacity (a numeric
        scale is itself; `capacity_bps` is then unused). Either way no rate may fall below the lowest wire rate
        (`check_wire_rates`): this is the one place that checks it, for a numeric scale when the scenario is read
        (`read_scenario` resolves it) and again wherever it is resolved, for `auto` once a host's capacity is known."""
        if self.scale != "auto":
            scale = Scale(float(self.scale))
            said, auto = f"{scale.factor:.12g}", False
        else:
            scale = Scale(max(1.0, math.ceil(self.wan.max_rate_bps / capacity_bps)))
            said, auto = f"auto (here {scale.factor:.12g}, for a host capacity of {units.format_rate(capacity_bps)})", True
        self.check_wire_rates(scale, said, auto=auto)
        return scale

    def with_scale(self, scale: Scale | float) -> "Scenario":
        factor = Scale.of(scale).factor
        raw = dict(self.raw)
        raw["scale"] = factor
        return replace(self, scale=factor, raw=raw)


NETWORK_KEYS = ("name", "seed", "scale", "duration", "topology", "wan")  # what `read_scenario` reads itself; sections add theirs


def read_scenario(data: Any, source: str | None = None, *, sections: Sequence[Section]) -> Scenario:
    """A scenario from its YAML data: the network part, and each of `sections` the data has (any other
    key is refused). Whole scenarios: `testbed.sections.parse_scenario`."""
    f = Fields(data, "", source, document="scenario")
    # a plain name, or the file's (`name_or_stem`): it names the run's directory, runs/<name>-<time> (without '/', at most
    # `MAX_NAME_BYTES`). Any value passed through `str` before: ``name: [1, 2]`` ran as "[1, 2]", ``name: ../../x``
    # wrote its run two levels up.
    name = name_or_stem(f, "the run's directory runs/<name>-<time>", "scenario")
    sc = Scenario(
        name=name,
        seed=f.get("seed", random_seed, 1),
        scale=f.get("scale", parse_scale, 1.0),
        duration_s=f.get("duration", lambda v: units.parse_duration_s(v, allow_zero=False), 60.0),
        topology=parse_topology(f.section("topology")),
        wan=parse_wan(f.section("wan")),
        sections={s.key: s.parse(f.section(s.key)) for s in sections if f.has(s.key)},
        raw=data or {},
        source=source,
    )
    f.mark_read(*(s.key for s in sections))  # allowed where absent too: an unknown key's refusal lists them
    f.done()
    for e in sc.wan.schedule:
        if e.at_s > sc.duration_s:
            raise FieldError("wan.schedule", f"an entry at {e.at_s:g}s is after the end of the run (duration {sc.duration_s:g}s)", source)
    for s in sections:
        if s.check is not None and s.key in sc.sections:
            s.check(sc)
    sc = replace(sc, section_rates=tuple(r for s in sections if s.rates is not None and s.key in sc.sections
                                         for r in s.rates(sc.sections[s.key])))
    if sc.scale != "auto":  # a numeric scale is checked now (`resolve_scale`, which needs no capacity for it); `auto` once
        sc.resolve_scale(0.0)  # a host's capacity resolves it
    return sc


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``--set wan.rate=20Gbps`` style overrides; the value is read as YAML (``--set seed=3``)."""
    out = yaml.safe_load(yaml.safe_dump(data)) or {}
    if not isinstance(out, dict):  # a list or scalar file: its reader refuses it, naming the file
        return out
    for item in overrides:
        said = shown(item)  # a 6000-character value was echoed whole
        if "=" not in item:
            raise UserError(f"--set {said}: use key=value, e.g. --set wan.rate=20Gbps")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(p.strip() for p in parts):
            raise UserError(f"--set {said}: the key has an empty part; use a dotted path such as wan.rate=20Gbps")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise UserError(f"--set {key}: {p!r} is not a section")
        try:
            node[parts[-1]] = load_yaml(value)
        except yaml.YAMLError as exc:
            raise UserError(f"--set {said}: the value is not valid YAML ({yaml_problem(exc)}); "
                            "quote a string, e.g. --set 'name=\"a: b\"'") from None
    return out


def builtin_scenarios_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "topologies"


def find_scenario(name_or_path: str) -> Path:
    """A path, or the name of a ready scenario in topologies/ (``quick`` -> topologies/quick.yaml)."""
    p = Path(name_or_path)
    if not name_or_path:  # the folder '.': ".: cannot read (Is a directory)" said less
        raise UserError("scenario '': no name; name a scenario file (a YAML mapping: docs/scenario.md) or a ready scenario")
    if path_exists(p):
        return p
    cand = builtin_scenarios_dir() / f"{name_or_path}.yaml"
    if path_exists(cand):
        return cand
    ready = sorted(x.stem for x in builtin_scenarios_dir().glob("*.yaml"))
    raise UserError(f"scenario {name_or_path!r}: no such file, and not a ready scenario (ready: {', '.join(ready) or 'none'})")


def read_scenario_file(name_or_path: str, overrides: list[str] | None = None, *, sections: Sequence[Section]) -> Scenario:
    """A scenario file (a path or a ready scenario's name) with ``--set`` overrides applied; see `read_scenario`."""
    path = find_scenario(name_or_path)
    data = read_yaml(path, "a scenario (a YAML mapping of name, wan, workload, ...: docs/scenario.md)")
    return read_scenario(apply_overrides(data, overrides or []), str(path), sections=sections)


def dump_scenario(sc: Scenario) -> str:
    """The resolved scenario as YAML (written to each run directory)."""
    return yaml.safe_dump(sc.raw, sort_keys=False)
