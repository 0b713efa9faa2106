"""The shaping plan: wire rate from scale, burst from the rate, queue from bytes/packets/BDP; netlink calls."""

import pytest

from testbed.errors import UserError
from testbed.net import netem, shaping
from testbed.scenario import LinkDirectionSpec
from testbed.units import parse_queue


def direction(rate="10Gbps", delay_s=0.01, queue="1bdp"):
    from testbed.units import parse_rate_bps

    return LinkDirectionSpec(rate_bps=parse_rate_bps(rate), delay_s=delay_s, queue=parse_queue(queue))


def test_wire_rate_is_emulated_rate_divided_by_scale():
    plan = shaping.plan_shaping(direction("100Gbps"), scale=20)
    assert plan.rate_bps == pytest.approx(5e9)


@pytest.mark.parametrize("rate_bps, burst", [(10e9, 1_250_000), (5e9, 625_000), (1e9, 131072), (1e6, 131072)])
def test_burst_is_one_millisecond_of_rate_but_at_least_two_gso_packets(rate_bps, burst):
    assert shaping.burst_bytes_for(rate_bps) == burst


def test_the_lowest_wire_rate_is_one_whose_smallest_burst_tc_can_carry():
    """tc gives the kernel a burst as a 32-bit count of ticks (pyroute2's `calc_xmittime`, from /proc/net/psched): the
    smallest burst (two GSO packets) at `units.MIN_WIRE_RATE_BPS` fits; at 3.8 Kbps it did not, and HTB and TBF failed
    to install ("'I' format requires 0 <= number <= 4294967295"), which is why a scenario may not go below 8 Kbps."""
    from pyroute2.netlink.rtnl.tcmsg.common import calc_xmittime

    from testbed.units import MIN_WIRE_RATE_BPS

    plan = shaping.plan_shaping(LinkDirectionSpec(rate_bps=MIN_WIRE_RATE_BPS), shaper="htb")
    assert plan.burst_bytes == shaping.MIN_BURST_BYTES
    assert calc_xmittime(MIN_WIRE_RATE_BPS / 8, plan.burst_bytes) < 2**32 // 2  # with a factor of 2 to spare
    assert calc_xmittime(3800 / 8, shaping.MIN_BURST_BYTES) >= 2**32


@pytest.mark.parametrize("queue, scale, expected", [
    ("1bdp", 1, int(10e9 * 0.02 / 8)),        # 10 Gbps x 20 ms RTT = 25 MB
    ("2bdp", 10, int(2 * 1e9 * 0.02 / 8)),    # BDP on the wire: rate / scale
    ("1000p", 1, 1000 * 1500),
    ("30MB", 1, 30_000_000),
    ("1KB", 1, shaping.MIN_QUEUE_BYTES),       # floor: one GSO packet must fit
])
def test_queue_limit_from_bytes_packets_or_bdp(queue, scale, expected):
    plan = shaping.plan_shaping(direction("10Gbps", 0.01, queue), scale=scale)
    assert plan.queue_bytes == expected


def test_bdp_uses_the_given_round_trip():
    plan = shaping.plan_shaping(direction("8Gbps", 0.01), rtt_s=0.05)
    assert plan.queue_bytes == int(8e9 * 0.05 / 8)


def test_htb_plan_is_root_class_and_bfifo_leaf_with_the_plan_numbers():
    plan = shaping.plan_shaping(direction("4Gbps"), scale=2)
    reqs = shaping.netlink_requests(plan)
    assert [(c, k) for c, k, _, _ in reqs] == [("add", "htb"), ("add-class", "htb"), ("add", "bfifo")]
    cls = reqs[1][3]
    assert cls["rate"] == cls["ceil"] == int(2e9 / 8)
    assert cls["burst"] == plan.burst_bytes == 250_000
    assert reqs[2][3]["limit"] == plan.queue_bytes
    assert reqs[2][3]["parent"] == shaping.CLASS_HANDLE


def test_under_netem_the_shaper_hangs_at_netems_class_with_its_queue():
    plan = shaping.plan_shaping(direction())
    reqs = shaping.netlink_requests(plan, parent=netem.SHAPER_PARENT)
    assert [(k, h) for _, k, h, _ in reqs] == [("htb", shaping.ROOT_HANDLE), ("htb", shaping.CLASS_HANDLE), ("bfifo", shaping.LEAF_HANDLE)]
    assert reqs[0][3]["parent"] == netem.SHAPER_PARENT == 0x20001  # 2:1
    assert reqs[2][3]["limit"] == plan.queue_bytes  # the queue is the bfifo's, in bytes, with netem too
    assert "parent" not in shaping.netlink_requests(plan)[0][3]  # at the root: pyroute2's default
    (_, _, _, kw), = shaping.netlink_requests(shaping.plan_shaping(direction(), shaper="tbf"), parent=netem.SHAPER_PARENT)
    assert kw["parent"] == netem.SHAPER_PARENT
    updates = shaping.update_requests(plan, parent=netem.SHAPER_PARENT)
    assert [(c, k) for c, k, _, _ in updates] == [("change-class", "htb"), ("replace", "bfifo")]


def test_update_changes_class_and_replaces_leaf_without_touching_root():
    reqs = shaping.update_requests(shaping.plan_shaping(direction("1Gbps")))
    assert [(c, k) for c, k, _, _ in reqs] == [("change-class", "htb"), ("replace", "bfifo")]


def test_tbf_plan_is_one_qdisc_with_rate_burst_limit():
    plan = shaping.plan_shaping(direction("2Gbps"), shaper="tbf")
    (cmd, kind, handle, kw), = shaping.netlink_requests(plan)
    assert (cmd, kind, handle) == ("add", "tbf", shaping.ROOT_HANDLE)
    assert kw == {"rate": 250_000_000, "burst": 250_000, "limit": plan.queue_bytes}


def test_tbf_above_its_32bit_rate_is_refused_with_the_field_named():
    with pytest.raises(UserError, match="wan.shaper"):
        shaping.plan_shaping(direction("100Gbps"), shaper="tbf")


def test_htb_above_32bit_rate_is_allowed():
    assert shaping.plan_shaping(direction("100Gbps"), shaper="htb").rate_bps == 100e9


class FakeIPRoute:
    """Records tc calls; a fake inside this unit test only."""

    def __init__(self):
        self.calls = []

    def tc(self, *args, **kw):
        self.calls.append((args, kw))


def test_apply_clears_root_then_sends_each_request():
    ipr = FakeIPRoute()
    plan = shaping.plan_shaping(direction("1Gbps"))
    shaping.apply_plan(ipr, 7, plan)
    assert ipr.calls[0] == (("del",), {"index": 7, "handle": 0, "parent": 0xFFFFFFFF})
    assert [a[:3] for a, _ in ipr.calls[1:]] == [("add", "htb", 7), ("add-class", "htb", 7), ("add", "bfifo", 7)]


def test_a_queue_past_tcs_32_bit_byte_limit_on_the_wire_is_refused_naming_wan_queue():
    """A BDP multiple is bounded as written (at most 1000bdp); its bytes are known only with the rate, scale and round
    trip: 1000bdp of a 1-s delay passed `prfaas check` as a 116-GiB queue, which tc refuses (2026-12-07)."""
    d = LinkDirectionSpec(rate_bps=5e9, delay_s=1.0, queue=parse_queue("1000bdp"))
    with pytest.raises(UserError, match=r"^wan.queue: 116.42 GiB on the wire \(1000 bdp at 0.5 Gbps on the wire and a 2000 ms "
                                        r"round trip\), more than 4294967295 bytes"):
        shaping.plan_shaping(d, scale=10)
    assert shaping.plan_shaping(d, scale=10000).queue_bytes < 2**32  # a larger scale: the same queue fits
