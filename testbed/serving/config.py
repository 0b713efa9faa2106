"""The scenario's ``serving:`` section: compute mode, profiles, instances and where they run, limits, SLOs.

`parse_serving_section` reads the section alone (registered in `testbed.sections.SECTIONS`);
`plan_instances` checks it against the topology and the other sections and places every instance on a
host. Both raise `FieldError` naming the field, so bad input is refused before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from testbed import units
from testbed.errors import FieldError
from testbed.kv.connector import connector_names
from testbed.packet import TCP_IPV4_HEADER_BYTES
from testbed.scenario import Scenario
from testbed.validation import Fields, at_least_one, boolean, congestion_control, path_exists, positive_number, whole_number

COMPUTE_MODES = ("profile", "torch")
ROLES = ("prfaas_prefill", "pd_prefill", "pd_decode")
FAULT_ACTIONS = ("kill",)
PREFILL_PORT = 8100  # prefill instance i listens on PREFILL_PORT + i (docs/protocol.md)
DECODE_PORT = 8200  # decode instance j: control PREFILL_PORT..., KV on KV_PORT + j
KV_PORT = 9000
ROUTER_PORT = 8000
MAX_PREFILL = DECODE_PORT - PREFILL_PORT  # ports must not collide
MAX_DECODE = KV_PORT - DECODE_PORT


@dataclass(frozen=True)
class SloSpec:
    ttft_s: float = 30.0  # time to first token a request should meet
    tpot_s: float = 0.025  # time per output token (the paper: 40 tokens/s -> 25 ms)
    # early stopping: the client ends the run once fewer than this share of all requests can still be
    # good (None: never; `prfaas capacity` sets its goodput bar; docs/experiments.md, "Early stopping")
    stop_below: float | None = None


@dataclass(frozen=True)
class FaultSpec:
    """Something done to a worker during the run (e.g. kill decode instance 0 at 5 s)."""

    at_s: float
    action: str
    role: str  # "prefill" | "decode"
    instance: int


@dataclass(frozen=True)
class ServingSpec:
    compute: str | None = None  # None: the model section's compute mode
    profiles: tuple[tuple[str, str | None], ...] = (("prfaas", None), ("pd", None))  # None: h200-/h20-<model>
    instances: tuple[tuple[str, int | None], ...] = (("prfaas_prefill", None), ("pd_prefill", None), ("pd_decode", None))
    per_host: int = 4  # at most this many instances of one role share a host
    bs_max: int = 20
    kv_connections: int = 4
    kv_connector: str = "tcp"  # a name in testbed.kv.connector's registry
    kv_congestion_control: str | None = None  # the KV connections' TCP congestion control (None: the hosts' default)
    kv_mss_bytes: int | None = None  # the KV connections' TCP maximum segment size (TCP_MAXSEG; None: the path's, MTU - 52)
    kv_timeout_s: float = 30.0  # decode: how long a registered request waits for its KV
    request_timeout_s: float = 120.0  # client: a request not finished by then counts as failed
    startup_timeout_s: float = 60.0  # workers and router must be ready by then
    drain_s: float = 30.0  # after the last arrival, how long the run waits for requests in flight
    slo: SloSpec = field(default_factory=SloSpec)
    prefix_pool_bytes: int = 8 * 10**9  # per prefill instance, emulated bytes (before scale)
    faults: tuple[FaultSpec, ...] = ()
    shed_slack: float | None = None  # early shedding: a request predicted past slack x slo.ttft is shed (None: never)

    @property
    def shed_ttft_s(self) -> float | None:
        """The TTFT beyond which a prefill worker sheds a request before computing it (docs/protocol.md)."""
        return None if self.shed_slack is None else self.shed_slack * self.slo.ttft_s

    def profile(self, cluster: str) -> str | None:
        return dict(self.profiles)[cluster]

    def count(self, role: str) -> int | None:
        return dict(self.instances)[role]


def _profile_name(path: str, source: str | None) -> Callable[[Any], str]:
    def parse(v: Any) -> str:
        name = str(v)
        beside = Path(source).parent / name if source else None
        if beside is not None and not Path(name).is_absolute() and Path(name).suffix in (".yaml", ".yml", ".csv", ".json") and path_exists(beside):
            name = str(beside)  # a profile file next to the scenario (e.g. one `prfaas profile` wrote)
        try:
            from testbed.models.profiles import load_profile
        except ImportError:  # the profiles module is not there: accept the name, checked at run time
            return name
        try:
            load_profile(name)
        except Exception as exc:  # the profile loader names what exists
            raise FieldError(path, str(exc), source) from None
        return name

    return parse


def _fraction(v: Any) -> float | None:
    """A share in (0, 1] (`units.parse_fraction`: 0.9 or 90%), or null."""
    if v is None:
        return None
    x = units.parse_fraction(v)
    if x == 0:
        raise ValueError(f"{v!r} must be a share of requests above 0 (e.g. 0.9), or null for never")
    return x


def _cc_name(v: Any) -> str | None:
    """`validation.congestion_control`, or null for the hosts' default."""
    if v is None:
        return None
    try:
        return congestion_control(v)
    except ValueError as e:
        raise ValueError(f"{e}, or null for the hosts' default") from None


KV_MSS_RANGE_BYTES = (88, 9000 - TCP_IPV4_HEADER_BYTES)  # Linux's smallest MSS (TCP_MIN_MSS) .. a 9000-byte jumbo frame's


def _kv_mss_bytes(v: Any) -> int | None:
    """A TCP maximum segment size in bytes (`536`, `536B`), or null for the path's."""
    if v is None:
        return None
    n = units.parse_size_bytes(v)
    lo, hi = KV_MSS_RANGE_BYTES
    if not lo <= n <= hi:
        raise ValueError(f"{v!r} must be {lo}..{hi} bytes (TCP_MAXSEG), or null for the path's (MTU - {TCP_IPV4_HEADER_BYTES})")
    return n


def _read_fault(f: Fields) -> FaultSpec:
    fault = FaultSpec(
        at_s=f.get("at", units.parse_duration_s),
        action=f.choice("action", FAULT_ACTIONS, "kill"),
        role=f.choice("role", ("prefill", "decode")),
        instance=f.get("instance", whole_number, 0),
    )
    f.done()
    return fault


def parse_serving_section(f: Fields) -> ServingSpec:
    d = ServingSpec()
    compute = f.choice("compute", COMPUTE_MODES, None)
    pf = f.section("profiles")
    profiles = tuple((c, pf.get(c, _profile_name(pf.name(c), f.source), dict(d.profiles)[c])) for c in ("prfaas", "pd"))
    pf.done()
    inst = f.section("instances")
    instances = tuple((r, inst.get(r, whole_number, None)) for r in ROLES)
    inst.done()
    if dict(instances)["pd_decode"] == 0:
        raise inst.error("pd_decode", "needs at least 1 decode instance")

    per_host = f.get("per_host", at_least_one, d.per_host)
    bs_max = f.get("bs_max", at_least_one, d.bs_max)
    conns = f.get("kv_connections", at_least_one, d.kv_connections)
    if conns > 64:
        raise f.error("kv_connections", f"{conns} is too many; use 1..64 TCP connections per prefill->decode pair")
    connector = f.choice("kv_connector", connector_names(), d.kv_connector)
    kv_cc = f.get("kv_congestion_control", _cc_name, d.kv_congestion_control)
    kv_mss = f.get("kv_mss", _kv_mss_bytes, d.kv_mss_bytes)
    positive_s = lambda v: units.parse_duration_s(v, allow_zero=False)  # noqa: E731
    to = f.section("timeouts")
    kv_timeout = to.get("kv", positive_s, d.kv_timeout_s)
    request_timeout = to.get("request", positive_s, d.request_timeout_s)
    startup_timeout = to.get("startup", positive_s, d.startup_timeout_s)
    drain = to.get("drain", positive_s, d.drain_s)
    to.done()
    if kv_timeout >= request_timeout:
        raise to.error("kv", f"{units.format_duration(kv_timeout)} must be shorter than timeouts.request "
                       f"({units.format_duration(request_timeout)}), or a lost KV transfer is reported as a client timeout")
    sf = f.section("slo")
    slo = SloSpec(ttft_s=sf.get("ttft", positive_s, d.slo.ttft_s), tpot_s=sf.get("tpot", positive_s, d.slo.tpot_s),
                  stop_below=sf.get("stop_below", _fraction, d.slo.stop_below))
    sf.done()
    if slo.tpot_s > slo.ttft_s + request_timeout:
        raise sf.error("tpot", "is longer than a whole request may take (slo.ttft + timeouts.request)")
    pool = f.get("prefix_pool", units.parse_size_bytes, d.prefix_pool_bytes)
    faults = tuple(_read_fault(x) for x in f.items("faults"))
    shed = f.section("shed")
    slack = shed.get("slack", positive_number, 1.0)
    shed_slack = slack if shed.get("enabled", boolean, False) else None
    shed.done()
    f.done()
    return ServingSpec(compute, profiles, instances, per_host, bs_max, conns, connector, kv_cc, kv_mss, kv_timeout,
                       request_timeout, startup_timeout, drain, slo, pool, faults, shed_slack)


# ------------------------------------------------------------------------------------------ placement


@dataclass(frozen=True)
class Instance:
    """One worker process: its role, index (ports derive from it), cluster and host."""

    role: str  # "prefill" | "decode"
    index: int
    cluster: str  # "prfaas" | "pd"
    host: str

    @property
    def port(self) -> int:
        return (PREFILL_PORT if self.role == "prefill" else DECODE_PORT) + self.index

    @property
    def kv_port(self) -> int | None:
        return KV_PORT + self.index if self.role == "decode" else None

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"


def _place(role_key: str, count: int, hosts: list[str], per_host: int, source: str | None) -> list[str]:
    if count and not hosts:
        raise FieldError(f"serving.instances.{role_key}", f"{count} instances but the topology has no host for them "
                         f"(set topology.{role_key.split('_')[0]}.{'decode' if role_key.endswith('decode') else 'prefill'} >= 1)", source)
    if count > len(hosts) * per_host:
        raise FieldError(f"serving.instances.{role_key}", f"{count} instances do not fit on {len(hosts)} host{'s' if len(hosts) != 1 else ''} "
                         f"with at most serving.per_host={per_host} each (at most {len(hosts) * per_host})", source)
    return [hosts[i % len(hosts)] for i in range(count)]


def plan_instances(scenario: Scenario) -> list[Instance]:
    """Every worker instance placed on a topology host; refuses counts that do not fit, naming the field.

    Prefill instances are numbered PrfaaS first, then PD-P (their index sets the control port).
    A count left out means one instance per host of that role.
    """
    spec: ServingSpec = scenario.section("serving") or ServingSpec()
    topo = scenario.topology
    hosts = {
        "prfaas_prefill": [f"prfaas-p{i}" for i in range(topo.prfaas.prefill_hosts)],
        "pd_prefill": [f"pd-p{i}" for i in range(topo.pd.prefill_hosts)],
        "pd_decode": [f"pd-d{i}" for i in range(topo.pd.decode_hosts)],
    }
    counts = {r: (len(hosts[r]) if spec.count(r) is None else spec.count(r)) for r in ROLES}
    out: list[Instance] = []
    for role_key, role, cluster in (("prfaas_prefill", "prefill", "prfaas"), ("pd_prefill", "prefill", "pd"),
                                    ("pd_decode", "decode", "pd")):
        first = sum(1 for x in out if x.role == role)
        for k, host in enumerate(_place(role_key, counts[role_key], hosts[role_key], spec.per_host, scenario.source)):
            out.append(Instance(role, first + k, cluster, host))
    n_prefill = sum(1 for x in out if x.role == "prefill")
    if n_prefill == 0:
        raise FieldError("serving.instances", "no prefill instance at all; set prfaas_prefill or pd_prefill >= 1", scenario.source)
    if n_prefill > MAX_PREFILL:
        raise FieldError("serving.instances", f"{n_prefill} prefill instances; at most {MAX_PREFILL} (ports {PREFILL_PORT}+i)", scenario.source)
    if counts["pd_decode"] > MAX_DECODE:
        raise FieldError("serving.instances.pd_decode", f"at most {MAX_DECODE}", scenario.source)
    for fault in spec.faults:
        if not any(x.role == fault.role and x.index == fault.instance for x in out):
            raise FieldError("serving.faults", f"there is no {fault.role} instance {fault.instance}", scenario.source)
        if fault.at_s > scenario.duration_s:
            raise FieldError("serving.faults", f"a fault at {fault.at_s:g}s is after the end of the run ({scenario.duration_s:g}s)", scenario.source)
    return out


@dataclass(frozen=True)
class ServingPlan:
    """Everything a run needs to start its workers, resolved from the scenario and checked."""

    spec: ServingSpec
    instances: tuple[Instance, ...]
    compute: str  # "profile" | "torch"
    profiles: tuple[tuple[str, str], ...]  # cluster -> profile name (profile mode)

    def profile(self, cluster: str) -> str:
        return dict(self.profiles)[cluster]


def _resolve_profiles(spec: ServingSpec, model: Any, source: str | None) -> tuple[tuple[str, str], ...]:
    """Per-cluster profile: the serving section's, else ``h200-<model>`` / ``h20-<model>``, else the model's."""
    from testbed.models.profiles import available_profiles

    ready = available_profiles()
    out = []
    for cluster, chip in (("prfaas", "h200"), ("pd", "h20")):
        name = spec.profile(cluster) or (f"{chip}-{model.name}" if f"{chip}-{model.name}" in ready else model.profile)
        if not name:
            raise FieldError(f"serving.profiles.{cluster}", f"no compute profile for model {model.name!r} on the {cluster} "
                             f"cluster; name one of: {', '.join(ready)}", source)
        out.append((cluster, name))
    return tuple(out)


def check_slos(spec: ServingSpec, profiles: dict[str, Any], source: str | None) -> None:
    """Refuse settings that no schedule can meet: a TPOT below the decode profile's single-request step,
    a TTFT below the fastest prefill of one 512-token block, BS_max beyond the decode profile's batch."""
    pd = profiles["pd"]
    if pd.decode is None:
        raise FieldError("serving.profiles.pd", f"profile {pd.name!r} has no decode data; the PD cluster decodes", source)
    if spec.bs_max > pd.max_batch:
        raise FieldError("serving.bs_max", f"{spec.bs_max} exceeds the largest batch of profile {pd.name!r} ({pd.max_batch})", source)
    step_s = float(pd.decode_step_s(1))
    if spec.slo.tpot_s < step_s:
        raise FieldError("serving.slo.tpot", f"{units.format_duration(spec.slo.tpot_s)} is below one decode step of "
                         f"profile {pd.name!r} at batch 1 ({units.format_duration(step_s)}); no schedule can meet it", source)
    fastest_s = min(float(p.prefill_time_s(512, 0)) for p in profiles.values())
    if spec.slo.ttft_s < fastest_s:
        raise FieldError("serving.slo.ttft", f"{units.format_duration(spec.slo.ttft_s)} is below the fastest prefill of "
                         f"one 512-token block ({units.format_duration(fastest_s)}); no schedule can meet it", source)


def compute_mode(scenario: Scenario) -> str:
    """How the run computes: ``serving.compute``, else ``model.compute``, else (no model section) ``profile``."""
    spec: ServingSpec = scenario.section("serving") or ServingSpec()
    model = scenario.section("model")
    return spec.compute or (model.compute if model is not None else "profile")


def _check(scenario: Scenario) -> tuple[ServingSpec, tuple[Instance, ...], str, tuple[tuple[str, str], ...]]:
    from testbed.models.profiles import check_model, load_profile

    spec: ServingSpec = scenario.section("serving") or ServingSpec()
    instances = tuple(plan_instances(scenario))
    model = scenario.section("model")
    compute = compute_mode(scenario)
    if model is None:
        return spec, instances, compute, ()
    if spec.compute and spec.compute != model.compute and "compute" in (scenario.raw.get("model") or {}):
        raise FieldError("serving.compute", f"{spec.compute!r} contradicts model.compute {model.compute!r}; set one of them", scenario.source)
    profiles = _resolve_profiles(spec, model, scenario.source)
    if compute == "profile":
        loaded = {}
        for cluster, name in profiles:
            try:
                loaded[cluster] = load_profile(name)
                check_model(loaded[cluster], model.spec.name)
            except Exception as exc:
                raise FieldError(f"serving.profiles.{cluster}", str(exc), scenario.source) from None
        check_slos(spec, loaded, scenario.source)
    return spec, instances, compute, profiles


def check_scenario(scenario: Scenario) -> None:
    """Run by `testbed.sections.parse_scenario` (its `SECTIONS` entry): the serving section against the
    topology and the model, so a bad count or SLO is refused when the scenario is loaded."""
    _check(scenario)


def plan_run(scenario: Scenario) -> ServingPlan:
    """Everything checked before a run starts on this host: `plan_serving`, then whether this host's kernel sets
    each congestion control the run names (`congestion_controls`: iperf3 -C with a name the kernel lacks ended every
    period's iperf3 at once, the run going on without that flow until 2026-12-07). (A run that may go to other
    hosts is checked with `plan_serving`, and each host is asked for the same names by
    `experiments.executor.Executor.run_hosts`.)"""
    from testbed.kv.transport import congestion_control_refused

    plan = plan_serving(scenario)
    for name, cc in congestion_controls(scenario, plan):
        if (why := congestion_control_refused(cc)) is not None:
            raise FieldError(name, why, scenario.source)
    return plan


def congestion_controls(scenario: Scenario, plan: ServingPlan) -> list[tuple[str, str]]:
    """Every TCP congestion control a run of `scenario` sets, as (field, name), in the scenario's order: the KV's
    (`serving.kv_congestion_control`) and each TCP cross-traffic flow's (`cross_traffic.flows[i].congestion`,
    iperf3 -C); a field left to the hosts' default is not listed. What a host's kernel must set for the run:
    `plan_run` asks this host, `experiments.engine.check_run` every host the run may land on."""
    cross = scenario.section("cross_traffic")
    named = [("serving.kv_congestion_control", plan.spec.kv_congestion_control)] + \
        [(f"cross_traffic.flows[{i}].congestion", flow.congestion) for i, flow in enumerate(cross.flows if cross else ())]
    return [(name, cc) for name, cc in named if cc is not None]


def plan_serving(scenario: Scenario) -> ServingPlan:
    """All checks that need more than the serving section alone and nothing of a host, before anything starts."""
    for key in ("model", "workload", "policy"):
        if scenario.section(key) is None:
            raise FieldError(key, "is required for a run", scenario.source)
    plan = ServingPlan(*_check(scenario))
    policy, model = scenario.section("policy"), scenario.section("model")
    if policy.kv_compression != "none":
        from testbed.models.spec import DTYPE_BYTES

        if DTYPE_BYTES[model.spec.kv_dtype] <= 1:
            raise FieldError("policy.kv_compression", f"'{policy.kv_compression}' sends float8; model {model.name}'s KV is "
                             f"{model.spec.kv_dtype} already (use 'none')", scenario.source)
    tcp_only = {"kv_congestion_control": plan.spec.kv_congestion_control, "kv_mss": plan.spec.kv_mss_bytes}
    for name, value in tcp_only.items():
        if value is not None and plan.spec.kv_connector != "tcp":
            raise FieldError(f"serving.{name}", f"is a TCP setting; the {plan.spec.kv_connector!r} connector has none "
                             "(set it to null, or kv_connector: tcp)", scenario.source)
    return plan
