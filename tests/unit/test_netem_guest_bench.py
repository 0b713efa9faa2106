"""benchmarks/netem_guest_bench.py: the goodput window scaled with the round trip, and --points."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "netem_guest_bench.py"


@pytest.fixture(scope="module")
def bench() -> SimpleNamespace:
    return SimpleNamespace(**runpy.run_path(str(SCRIPT), run_name="netem_guest_bench"))


def test_the_window_grows_with_the_round_trip_and_keeps_its_floor(bench) -> None:
    assert bench.window_s(5, 6) == (2.0, 6)  # 10 ms RTT: the floors
    assert bench.window_s(25, 6) == (2.0, 6)  # 50 ms RTT: still the floors
    assert bench.window_s(50, 6) == pytest.approx((4.0, 12.0))  # 100 ms RTT: 40 and 120 round trips
    assert bench.window_s(10, 4) == (2.0, 4)  # --quick keeps its 4 s


def test_points_are_parsed_and_bad_ones_named(bench) -> None:
    assert bench.parse_points("20x50, 200x5") == [(20.0, 50.0), (200.0, 5.0)]
    for bad in ("20x", "x5", "20", "0x5", "20x-1", "fastx5"):
        with pytest.raises(ValueError, match="--points"):
            bench.parse_points(bad)


def test_a_bad_point_is_one_line_and_exit_2() -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--points", "200by50"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--points: '200by50' is not RATExDELAY" in r.stderr and "Traceback" not in r.stderr


def test_each_point_gets_a_queue_of_its_own_bdp(bench) -> None:
    """The network starts at the first point; a later point must not keep a queue sized for that RTT.
    The WAN (the real `Wan`, its qdiscs replaced by a recorder) re-sizes the scenario's `1bdp`."""
    from testbed.net.wan import Wan
    from testbed.scale import Scale
    from testbed.scenario import DIRECTIONS

    class Qdiscs:  # one direction's qdiscs: a fake inside this unit test only
        def __init__(self, plan) -> None:
            self.plan = plan

        def update(self, spec, plan) -> None:
            self.plan = plan

    class Net:
        wan = Wan(bench.scenario("netem", "20Mbps", "5ms").wan, {}, scale=Scale(1), backend="netem", seed=1)

    net = Net()
    net.wan.emulators = {d: Qdiscs(net.wan.plan(d)) for d in DIRECTIONS}
    assert bench.set_point(net, 200, 50) == 2_500_000  # 200 Mbit/s x 100 ms
    assert bench.set_point(net, 200, 5) == 250_000  # not the 2.5 MB of the point before
    assert bench.set_point(net, 20, 5) == 67_036  # 25 kB, floored at one GSO packet
    for d in DIRECTIONS:
        spec = net.wan.current[d]
        assert (spec.rate_bps, spec.delay_s, spec.queue.kind, net.wan.emulators[d].plan.queue_bytes) == (20e6, 0.005, "bdp", 67_036)