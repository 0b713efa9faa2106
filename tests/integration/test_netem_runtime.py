"""The netem backend on a kernel that has netem: delay, rate, loss and live schedule changes.

Marked `netem`. Where the host kernel has netem these run directly. Where it has not, tests/conftest.py
deselects them here and tests/integration/test_netem_guest.py runs this file inside a qemu guest whose
kernel has netem (scripts/guest-kernel.sh), reporting each test's outcome there; only where no guest can
start do they skip, with both reasons. Rates are small (50 Mbit/s on the wire) so that a TCG guest holds
them; bounds are loose sanity bounds (benchmarks/netem_guest_bench.py has the tight figures).
"""

import json
import os
import re
import subprocess
import time
from dataclasses import replace

import pytest
from scipy.stats import binom

from testbed.net.calibrate import IperfServer, measure_rate_bps, measure_rtt, measure_udp_loss, measure_udp_reordering
from testbed.net.emulation import Network
from testbed.scenario import LossSpec, ScheduleAction
from testbed.sections import parse_scenario
from topologies.two_dc import lan_ifname, wan_ifname

pytestmark = pytest.mark.netem
SRC, DST, DIR = "prfaas-p0", "pd-d0", "prfaas_to_pd"
BACK = "pd_to_prfaas"  # the direction of a reversed (-R) iperf3 burst from SRC
WIRE_BPS = 50e6


def scenario(**wan):
    return parse_scenario({"name": "it-netem", "scale": 1, "duration": "600s",
                           "topology": {"prfaas": {"prefill": 1, "cross": 0}, "pd": {"prefill": 0, "decode": 1, "cross": 0}},
                           "wan": {"backend": "auto", "rate": "50Mbps", "delay": "10ms", **wan}})


@pytest.fixture(scope="module")
def net():
    with Network(scenario()) as n:  # stops on every way out
        yield n
    assert not n.teardown_errors


def netem_qdisc(net, gateway="prfaas-gw", ifname="prfaas-gw-wan") -> str:
    out = net.run(gateway, ["tc", "-s", "qdisc", "show", "dev", ifname]).stdout
    line = [ln for ln in out.splitlines() if ln.startswith("qdisc netem")]
    assert line, out
    return out[out.index(line[0]):]


def test_auto_picks_netem_as_root_with_the_htb_shaper_below_it(net):
    d = net.describe()
    assert d["backend"] == "netem" and d["netem_available"]
    q = netem_qdisc(net)
    m = re.search(r"qdisc netem 2: root refcnt \d+ limit (\d+) delay 10ms", q)
    assert m, q
    assert int(m.group(1)) >= 1000  # netem's default; the plan never goes below it
    below = net.run("prfaas-gw", ["tc", "qdisc", "show", "dev", "prfaas-gw-wan"]).stdout
    assert re.search(r"qdisc htb 1: parent 2:1 ", below) and re.search(r"qdisc bfifo 10: parent 1:10 limit \d+b", below), below


def test_netem_delays_both_directions(net):
    rtt = measure_rtt(net, SRC, DST, count=50, interval_s=0.02)
    assert rtt.replies == 50
    assert 0.0195 <= rtt.p50_s <= 0.026, rtt  # 2 x 10 ms one way


def test_rate_is_held_by_htb_with_netem_as_its_leaf(net):
    with IperfServer(net, DST):
        bps = measure_rate_bps(net, SRC, DST, streams=4, duration_s=3, omit_s=1)
    # held: never above the rate. The lower end only catches a shaper gone wrong; a TCG guest (an emulated
    # CPU) once carried 34.9 of 50 Mbit/s on a quiet host (CI, 2026-12-02), so under TCG it is 0.5
    low = 0.5 if os.environ.get("PRFAAS_GUEST_ACCEL") == "tcg" else 0.75
    # goodput (frames in wire time less their headers) can reach 1448/1514 = 0.956 of a held rate, never more: the
    # bound 1.02 x the rate let a shaper 6% over its rate pass (tightened 2026-12-07, with calibrate's wire-time count)
    assert low * WIRE_BPS <= bps <= 0.965 * WIRE_BPS, bps


def test_schedule_changes_apply_to_the_live_netem_qdisc(net):
    before = netem_qdisc(net)
    net.wan.apply(ScheduleAction(0, 7, (DIR,), "change", (("delay_s", 0.020), ("loss", LossSpec("random", 0.05)), ("rate_bps", 20e6))))
    try:
        q = netem_qdisc(net)
        assert "delay 20ms" in q and "loss 5%" in q, q
        assert q.split()[2] == before.split()[2] == "2:"  # changed in place, not re-created
        cls = net.run("prfaas-gw", ["tc", "class", "show", "dev", "prfaas-gw-wan"]).stdout
        assert "rate 20Mbit" in cls, cls
        rtt = measure_rtt(net, SRC, DST, count=40, interval_s=0.02)
        assert 0.0295 <= rtt.p50_s <= 0.036, rtt  # 20 ms + 10 ms
        with IperfServer(net, DST, port=5303):
            lost, sent = measure_udp_loss(net, SRC, DST, datagrams=4000, rate_bps=10e6, port=5303)
        assert sent >= 3800 and 0.035 <= lost / sent <= 0.065, (lost, sent)
    finally:
        net.wan.apply(ScheduleAction(0, 7, (DIR,), "revert", (("delay_s", None), ("loss", None), ("rate_bps", None))))
    q = netem_qdisc(net)
    assert "delay 10ms" in q and "loss" not in q.splitlines()[0], q


def test_link_down_and_up_with_netem(net):
    dirs = ("prfaas_to_pd", "pd_to_prfaas")
    net.wan.apply(ScheduleAction(0, 8, dirs, "down"))
    try:
        r = net.run(SRC, ["ping", "-c", "3", "-i", "0.1", "-W", "1", net.host_ip(DST)])
        assert r.returncode != 0 and " 0 received" in r.stdout
    finally:
        net.wan.apply(ScheduleAction(0, 8, dirs, "up"))
    assert net.run(SRC, ["ping", "-c", "2", "-i", "0.1", net.host_ip(DST)]).returncode == 0


def test_queueing_adds_to_the_delay_and_is_bounded_by_the_scenarios_queue(net):
    """4 saturating TCP streams: ping sees 2 x 10 ms plus at most the 1-BDP bfifo (20 ms at 50 Mbit/s).

    With netem as HTB's leaf (before), netem's 1000-packet tfifo was the queue: 108 ms p50 here."""
    with IperfServer(net, DST, port=5305):
        load = net.popen(SRC, ["iperf3", "-c", net.host_ip(DST), "-p", "5305", "-P", "4", "-t", "7"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(2.5)  # past slow start
            rtt = measure_rtt(net, SRC, DST, count=150, interval_s=0.02)
        finally:
            load.wait(timeout=30)
    assert rtt.replies >= 140, rtt
    # 2 x 10 ms plus the queue at the median; at most the 20 ms of the bfifo (+2 ms: the TCG guest's own
    # ~1 ms). The tail is not bounded here: a TCG guest on a shared host stalls now and then (p99 55-105 ms).
    assert 0.021 <= rtt.p50_s <= 0.042, rtt


def test_jitter_keeps_packets_in_order_unless_reorder_is_asked_for(net):
    """Jitter (5 ms, normal) on the PD -> PrfaaS direction, a 10 Mbit/s UDP burst through it (0.8 ms apart).

    The sender is pinned to one CPU: packets leaving netem on two CPUs can be reordered by the veths'
    per-CPU backlogs after it (the path's own reordering, not netem's; docs/network.md). A TCG guest on a
    shared host makes that more likely, hence up to 2% in order versus ~70% measured with reordering.
    """
    base = net.wan.current[BACK]
    try:
        with IperfServer(net, DST, port=5302, cpu=0):
            net.wan.set_direction(BACK, replace(base, jitter_s=0.005, jitter_distribution="normal"))
            in_order = measure_udp_reordering(net, SRC, DST, datagrams=1500, port=5302)
            net.wan.set_direction(BACK, replace(base, jitter_s=0.005, jitter_distribution="normal", reorder=True))
            reordered = measure_udp_reordering(net, SRC, DST, datagrams=1500, port=5302)
    finally:
        net.wan.set_direction(BACK, base)
    assert in_order[1] >= 1400 and in_order[0] <= 0.02 * in_order[1], in_order
    assert reordered[1] >= 1400 and reordered[0] >= 0.3 * reordered[1], reordered  # +-5 ms at 0.8 ms spacing: most overtake


def _drops(net) -> tuple[int, int]:
    """(netem's drops, the bfifo's drops) on the PrfaaS gateway's WAN egress; netem counts its child's too."""
    out = net.run("prfaas-gw", ["tc", "-s", "qdisc", "show", "dev", wan_ifname("prfaas")]).stdout
    drops = dict(re.findall(r"^qdisc (\w+) [0-9a-f]+: .*\n\s*Sent \d+ bytes \d+ pkt \(dropped (\d+)", out, re.M))
    return int(drops["netem"]), int(drops["bfifo"])


def _lan_rx(net) -> tuple[int, int]:
    """(bytes, packets) the PrfaaS gateway received from its LAN: a veth counts one packet per skb, however
    many wire packets a GSO skb carries (qdiscs count its segments, so their counters cannot tell)."""
    for line in net.run("prfaas-gw", ["cat", "/proc/net/dev"]).stdout.splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == lan_ifname("prfaas"):
            return int(counters.split()[0]), int(counters.split()[1])
    raise AssertionError("no LAN interface on prfaas-gw")


def _tcp_ext(net, host: str) -> dict[str, int]:
    """The host's namespace's TcpExt counters (/proc/net/netstat: a line of names, then a line of values)."""
    lines = [line.split() for line in net.run(host, ["cat", "/proc/net/netstat"]).stdout.splitlines()]
    for names, values in zip(lines, lines[1:]):
        if names[0] == "TcpExt:" and values[0] == "TcpExt:":
            return dict(zip(names[1:], map(int, values[1:])))
    raise AssertionError(f"no TcpExt counters on {host}")


def _stream(net, port: int, seconds: int) -> tuple[dict, float, int, int, int, dict[str, int]]:
    """One TCP stream SRC -> DST: (iperf3's JSON, mean bytes per skb into the gateway, skbs, netem's loss drops,
    bfifo drops, the sender's TcpExt counters over the stream)."""
    with IperfServer(net, DST, port=port):
        (b0, p0), (n0, f0), ext0 = _lan_rx(net), _drops(net), _tcp_ext(net, SRC)
        r = net.run(SRC, ["iperf3", "-J", "-c", net.host_ip(DST), "-p", str(port), "-t", str(seconds)], timeout_s=seconds + 30)
        (b1, p1), (n1, f1), ext1 = _lan_rx(net), _drops(net), _tcp_ext(net, SRC)
    ext = {k: ext1[k] - ext0.get(k, 0) for k in ext1}
    return json.loads(r.stdout), (b1 - b0) / max(1, p1 - p0), p1 - p0, (n1 - n0) - (f1 - f0), f1 - f0, ext


def test_netem_loses_wire_packets_not_gso_super_packets(net):
    """2% loss on a TCP stream: with loss in the WAN the network turns TSO/GSO/GRO off (testbed/net/offloads.py),
    so netem is handed wire packets, each of its drops is one wire packet, and TCP retransmits about as many
    segments as netem dropped. The loss-free network (offloads on) shows what netem got before: the same
    stream arrives at the gateway as GSO super-packets, which netem would lose whole (docs/network.md)."""
    assert net.describe()["offloads"] == "on (no loss in the WAN or its schedule)"
    _, skb_bytes, _, _, _, _ = _stream(net, 5306, 2)
    assert skb_bytes > 1.5 * 1514, f"a loss-free stream should reach the gateway as super-packets: {skb_bytes:.0f} B/skb"
    with Network(scenario(delay="2ms", prfaas_to_pd={"loss": "2%"})) as lossy:
        assert lossy.describe()["offloads"] == "off (loss per wire packet)"
        features = lossy.run(SRC, ["ethtool", "-k", f"{SRC}-eth0"]).stdout
        assert "tcp-segmentation-offload: off" in features and "generic-segmentation-offload: off" in features, features
        data, skb_bytes, skbs, lost, tail_drops, ext = _stream(lossy, 5307, 3)
        retransmits = data["end"]["sum_sent"]["retransmits"]
        assert skb_bytes <= 1514, f"netem must be handed wire packets: {skb_bytes:.0f} B per skb"
        # netem's drops per wire packet handed to it: 2% of them, binomially, within a 1e-6 chance on either side (a
        # fixed 1-3% is only +-3.1 sd at ~1,900 packets: CI failed once, 2026-12-06, on 57 of 1,897 in the TCG guest)
        lo, hi = binom.ppf(1e-6, skbs, 0.02), binom.isf(1e-6, skbs, 0.02)
        assert lo <= lost <= hi, (lost, skbs, lo, hi, tail_drops)
        # a tail drop at the bfifo behind netem is retransmitted too (the loss-free run of the same stream
        # tail-drops ~300 segments): before 2026-12-04 the bound counted netem's drops alone, and CI failed once
        # on 122 retransmits against 63 of them (tail drops not printed); super-packet loss gave 3.8x netem's.
        # A retransmit of a segment that had arrived is spurious (a TCG guest's stall fires an RTO, and the
        # window after it is sent again): the receiver reports each with a D-SACK, so those are not counted
        # against the drops (CI failed once, 2026-12-07, on 64 retransmits against 36 drops, 0 tail drops)
        # (TCPDSACKRecvSegs counts the segments a D-SACK covers, where the kernel has it; else count the D-SACK blocks)
        spurious = ext["TCPDSACKRecvSegs"] if "TCPDSACKRecvSegs" in ext else ext.get("TCPDSACKRecv", 0) + ext.get("TCPDSACKOfoRecv", 0)
        seen = {k: ext.get(k, 0) for k in ("TCPDSACKRecvSegs", "TCPDSACKRecv", "TCPDSACKOfoRecv", "TCPTimeouts", "TCPLossProbes",
                                           "TCPSpuriousRTOs")}
        assert 0.8 * lost <= retransmits, (retransmits, lost, tail_drops, seen)
        assert retransmits - spurious < 1.5 * (lost + tail_drops) + 10, (retransmits, lost, tail_drops, seen)
    assert not lossy.teardown_errors
