"""Wan keeps each direction's shaping plan in step with the schedule: a BDP-relative queue follows the
current rate and the current round trip (both directions' delays), not the ones the network started with."""

from dataclasses import replace

from testbed.net import shaping
from testbed.net.wan import Wan
from testbed.scale import Scale
from testbed.scenario import DIRECTIONS, expand_schedule
from testbed.sections import load_scenario
from testbed.units import parse_queue


class Recorder:
    """Stands in for one direction's qdiscs (a fake inside this unit test only): keeps what Wan hands it."""

    def __init__(self, plan: shaping.ShapingPlan) -> None:
        self.plan, self.updates = plan, 0

    def update(self, spec, plan: shaping.ShapingPlan) -> None:
        self.spec, self.plan, self.updates = spec, plan, self.updates + 1


def wan_of(wan_spec, scale: float) -> Wan:
    wan = Wan(wan_spec, {}, scale=Scale(scale), backend="delayline", seed=1)
    wan.emulators = {d: Recorder(wan.plan(d)) for d in DIRECTIONS}
    return wan


def test_the_rtt_surge_resizes_a_1bdp_queue_and_its_revert_restores_it() -> None:
    sc = load_scenario("topologies/val-rtt-surge.yaml")  # 100 Gbps / scale 50 = 2 Gbps wire, 5 -> 40 ms one way
    wan = wan_of(sc.wan, sc.scale)
    start = {d: wan.emulators[d].plan.queue_bytes for d in DIRECTIONS}
    assert start == {d: int(2e9 * 0.010 / 8) for d in DIRECTIONS}  # 2.5 MB: 2 Gbps x 10 ms
    change, revert = expand_schedule(sc.wan.schedule)
    wan.apply(change)
    assert {d: wan.emulators[d].plan.queue_bytes for d in DIRECTIONS} == {d: int(2e9 * 0.080 / 8) for d in DIRECTIONS}
    wan.apply(revert)
    assert {d: wan.emulators[d].plan.queue_bytes for d in DIRECTIONS} == start


def test_one_directions_delay_resizes_the_other_directions_bdp_queue_but_not_a_byte_queue() -> None:
    sc = load_scenario("topologies/val-rtt-surge.yaml")
    there, back = DIRECTIONS
    wan = wan_of(sc.wan, sc.scale)
    wan.set_direction(there, replace(wan.current[there], delay_s=0.035))  # round trip 10 -> 40 ms
    assert [wan.emulators[d].plan.queue_bytes for d in DIRECTIONS] == [int(2e9 * 0.040 / 8)] * 2
    assert wan.emulators[back].updates == 1 and wan.current[back].delay_s == 0.005  # only its queue moved
    fixed = replace(sc.wan, pd_to_prfaas=replace(sc.wan.pd_to_prfaas, queue=parse_queue("3MB")))
    wan = wan_of(fixed, sc.scale)
    wan.set_direction(there, replace(wan.current[there], delay_s=0.035))
    assert wan.emulators[back].updates == 0 and wan.emulators[back].plan.queue_bytes == 3_000_000


def test_a_rate_change_resizes_burst_and_bdp_queue_at_the_current_round_trip() -> None:
    sc = load_scenario("topologies/val-rtt-surge.yaml")
    there = DIRECTIONS[0]
    wan = wan_of(sc.wan, sc.scale)
    wan.set_direction(there, replace(wan.current[there], delay_s=0.035))
    wan.set_direction(there, replace(wan.current[there], rate_bps=20e9))  # 0.4 Gbps on the wire
    plan = wan.emulators[there].plan
    assert (plan.rate_bps, plan.burst_bytes, plan.queue_bytes) == (0.4e9, shaping.MIN_BURST_BYTES, int(0.4e9 * 0.040 / 8))


class FakeGateway:
    """Stands in for a gateway's namespace (a fake inside this unit test only): answers `iptables -S` with a
    listing and records every other command."""

    def __init__(self, listing: str) -> None:
        self.listing, self.commands = listing, []

    def popen(self, argv: list[str]):
        import subprocess

        self.commands.append(argv)
        out = self.listing if "-S" in argv else ""
        return subprocess.Popen(["printf", "%s", out], stdout=subprocess.PIPE, stderr=subprocess.PIPE)


LISTING = ("-P FORWARD ACCEPT\n"
           "-A FORWARD -o prfaas-gw-wan -m comment --comment prfaas-wan-down -j DROP\n"
           "-A FORWARD -o pd-gw-wan -m comment --comment prfaas-delayline -j NFQUEUE --queue-num 12 --queue-bypass\n"
           "-A FORWARD -o prfaas-gw-wan -m comment --comment prfaas-delayline -j NFQUEUE --queue-num 11 --queue-bypass\n")


def test_an_open_loop_udp_flow_skips_the_delay_line_only_where_the_direction_only_delays() -> None:
    from testbed.net.delayline import nfqueue_rule_number, udp_pass_rule
    from testbed.net.wan import GatewayPort
    from testbed.sections import parse_scenario

    assert nfqueue_rule_number(LISTING, "prfaas-gw-wan") == 3 and nfqueue_rule_number(LISTING, "pd-gw-wan") == 2
    assert nfqueue_rule_number(LISTING, "other") is None

    def wan(**extra):
        sc = parse_scenario({"name": "t", "wan": {"rate": "10Gbps", "delay": "5ms", **extra}})
        gw = FakeGateway(LISTING)
        ports = {"prfaas_to_pd": GatewayPort("prfaas-gw", "prfaas-gw-wan", "/proc/1/ns/net", gw.popen),
                 "pd_to_prfaas": GatewayPort("pd-gw", "pd-gw-wan", "/proc/1/ns/net", gw.popen)}
        return Wan(sc.wan, ports, scale=Scale(1), backend="delayline", seed=1), gw, sc.wan

    w, gw, spec = wan(schedule=[{"at": "10s", "delay": "40ms"}, {"at": "20s", "rate": "1Gbps"}])
    assert spec.only_delays("prfaas_to_pd") and w.pass_open_loop_udp("prfaas_to_pd", "10.1.0.20", 5301)
    insert = gw.commands[-1]
    assert insert[insert.index("-I"):insert.index("-I") + 3] == ["-I", "FORWARD", "3"]  # right above the NFQUEUE rule
    assert insert[insert.index("-I") + 3:] == udp_pass_rule("prfaas-gw-wan", "10.1.0.20", 5301)
    assert udp_pass_rule("x", "10.1.0.20", 5301)[-2:] == ["-j", "ACCEPT"] and "udp" in udp_pass_rule("x", "1.2.3.4", 1)

    for extra in ({"loss": "0.1%"}, {"jitter": "1ms"},
                  {"schedule": [{"at": "5s", "loss": {"model": "gilbert-elliott", "p": "1%", "r": "30%"}, "for": "5s",
                                 "direction": "prfaas_to_pd"}]},
                  {"schedule": [{"at": "5s", "jitter": "2ms"}]}):
        w, gw, spec = wan(**extra)
        assert not spec.only_delays("prfaas_to_pd")
        assert not w.pass_open_loop_udp("prfaas_to_pd", "10.1.0.20", 5301) and gw.commands == []  # kept in the line
    w, gw, spec = wan(schedule=[{"at": "5s", "loss": "1%", "direction": "pd_to_prfaas"}])  # the other direction's loss
    assert spec.only_delays("prfaas_to_pd") and not spec.only_delays("pd_to_prfaas")
    w, gw, spec = wan()
    w.backend = "netem"  # netem delays in the kernel at no cost to the host: nothing to skip
    assert not w.pass_open_loop_udp("prfaas_to_pd", "10.1.0.20", 5301) and gw.commands == []


def test_the_open_loop_udp_flows_are_numbered_as_cross_traffic_numbers_their_ports() -> None:
    from testbed.validation import Fields
    from traffic.cross import BASE_PORT, parse_cross_traffic_section

    spec = parse_cross_traffic_section(Fields({"flows": [
        {"name": "a", "protocol": "udp", "rate": "1Gbps"}, {"name": "b", "protocol": "tcp"},
        {"name": "c", "protocol": "udp", "rate": "1Gbps", "src": "pd-x0", "dst": "prfaas-x0"}]}, "cross_traffic"))
    assert spec.open_loop_udp() == [("prfaas-x0", "pd-x0", BASE_PORT), ("pd-x0", "prfaas-x0", BASE_PORT + 2)]
