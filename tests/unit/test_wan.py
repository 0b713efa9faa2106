"""Wan keeps each direction's shaping plan in step with the schedule: a BDP-relative queue follows the
current rate and the current round trip (both directions' delays), not the ones the network started with."""

from dataclasses import replace

from testbed.net import shaping
from testbed.net.schedule import expand_schedule
from testbed.net.wan import Wan
from testbed.scale import Scale
from testbed.scenario import DIRECTIONS
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
