"""netem plan: delay, jitter with distribution, in-order trick, random and Gilbert-Elliott loss, limit."""

import pytest

from testbed.net import netem, shaping
from testbed.scenario import LinkDirectionSpec, LossSpec


def plan_for(**kw):
    d = LinkDirectionSpec(rate_bps=kw.pop("rate_bps", 1e9), **kw)
    return netem.plan_netem(d, shaping.plan_shaping(d))


def test_delay_only():
    p = plan_for(delay_s=0.01)
    assert p.tc_options() == ["limit", str(p.limit_packets), "delay", "10000us", "rate", "0bit"]


def test_jitter_in_order_sets_netem_rate_to_the_wire_rate():
    p = plan_for(delay_s=0.02, jitter_s=0.002, jitter_distribution="normal")
    opts = p.tc_options()
    assert opts[opts.index("delay"):opts.index("delay") + 5] == ["delay", "20000us", "2000us", "distribution", "normal"]
    assert opts[-2:] == ["rate", "1000000000bit"]


def test_jitter_with_reorder_has_no_rate():
    p = plan_for(delay_s=0.02, jitter_s=0.03, reorder=True, jitter_distribution="pareto")
    assert p.tc_options()[-2:] == ["rate", "0bit"] and "pareto" in p.tc_options()  # 0bit: an earlier in-order rate is switched off


def test_uniform_jitter_uses_netem_default_table():
    p = plan_for(delay_s=0.02, jitter_s=0.002, jitter_distribution="uniform")
    assert "distribution" not in p.tc_options()


def test_random_loss_in_percent():
    p = plan_for(delay_s=0.01, loss=LossSpec("random", 0.001))
    opts = p.tc_options()
    assert opts[opts.index("loss"):opts.index("loss") + 3] == ["loss", "random", "0.1%"]


def test_gilbert_elliott_loss_is_gemodel_p_r_1h_1k():
    p = plan_for(delay_s=0.01, loss=LossSpec("gilbert-elliott", p=0.01, r=0.3, bad_loss=0.5, good_loss=0.001))
    opts = p.tc_options()
    assert opts[opts.index("loss"):opts.index("loss") + 6] == ["loss", "gemodel", "1%", "30%", "50%", "0.1%"]


def test_limit_holds_in_flight_packets_plus_queue():
    d = LinkDirectionSpec(rate_bps=10e9, delay_s=0.05)
    sp = shaping.plan_shaping(d)
    p = netem.plan_netem(d, sp)
    in_flight = 10e9 / 8 * 0.05
    assert p.limit_packets == pytest.approx((in_flight + sp.queue_bytes) / 1500, abs=1)


def test_limit_never_below_netem_default():
    assert plan_for(delay_s=0.0001, rate_bps=1e6).limit_packets == netem.MIN_LIMIT_PACKETS


def test_tc_argv_makes_netem_the_root_above_the_shaper():
    argv = netem.netem_tc_argv("pd-gw-wan", plan_for(delay_s=0.01))
    assert argv[:9] == ["tc", "qdisc", "add", "dev", "pd-gw-wan", "root", "handle", "2:", "netem"]
    assert netem.netem_tc_argv("pd-gw-wan", plan_for(delay_s=0.01), command="change")[2] == "change"
    assert netem.SHAPER_PARENT >> 16 == int(netem.NETEM_HANDLE[:-1], 16)  # the shaper hangs at netem's own class


def test_back_to_uniform_jitter_recreates_the_qdisc_only_when_a_table_is_loaded():
    normal = plan_for(delay_s=0.02, jitter_s=0.002, jitter_distribution="normal")
    uniform = plan_for(delay_s=0.02, jitter_s=0.002, jitter_distribution="uniform")
    assert normal.table == "normal" and uniform.table is None
    assert netem.needs_recreate("normal", uniform)
    assert not netem.needs_recreate(None, uniform)
    assert not netem.needs_recreate("normal", plan_for(delay_s=0.02))  # no jitter: the table is unused
    assert not netem.needs_recreate("normal", plan_for(delay_s=0.02, jitter_s=0.002, jitter_distribution="pareto"))
