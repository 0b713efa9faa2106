"""Cross-traffic section, flow periods, iperf3 command lines and report parsing (no processes here;
tests/integration/test_cross_traffic.py runs real iperf3 between namespaces)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from testbed.errors import FieldError
from testbed.validation import Fields
from traffic.cross import FlowSpec, RatePeriod, iperf3_client_argv, parse_cross_traffic_section, parse_iperf3_intervals


def parse(data: dict):
    return parse_cross_traffic_section(Fields(data, "cross_traffic"))


def test_defaults_and_direction() -> None:
    spec = parse({"flows": [{"rate": "2Gbps"}, {"protocol": "udp", "rate": "1Gbps", "direction": "pd_to_prfaas"}]})
    a, b = spec.flows
    assert (a.name, a.protocol, a.src, a.dst, a.rate_bps) == ("flow0", "tcp", "prfaas-x0", "pd-x0", 2e9)
    assert (b.src, b.dst) == ("pd-x0", "prfaas-x0")
    assert spec.interval_s == 1.0


def test_onoff_and_schedule_periods() -> None:
    f = FlowSpec("f", pattern="onoff", start_s=1.0, stop_s=10.0, on_s=2.0, off_s=3.0, rate_bps=1e6)
    assert list(f.periods()) == [RatePeriod(1.0, 3.0, 1e6), RatePeriod(6.0, 8.0, 1e6)]
    endless = FlowSpec("g", pattern="onoff", on_s=1.0, off_s=1.0)
    assert [p.start_s for p in itertools.islice(endless.periods(), 3)] == [0.0, 2.0, 4.0]
    spec = parse({"flows": [{"protocol": "udp", "pattern": "schedule", "stop": "60s",
                             "schedule": [{"at": "0s", "rate": "1Gbps"}, {"at": "10s", "rate": "off"}, {"at": "20s", "rate": "3Gbps"}]}]})
    assert list(spec.flows[0].periods()) == [RatePeriod(0.0, 10.0, 1e9), RatePeriod(20.0, 60.0, 3e9)]


@pytest.mark.parametrize("flow, field, words", [
    ({"protocol": "udp"}, "cross_traffic.flows[0].rate", "needs a rate"),
    ({"src": "pd-p0"}, "cross_traffic.flows[0].src", "prfaas-x<i> or pd-x<i>"),
    ({"src": "pd-x0", "dst": "pd-x1"}, "cross_traffic.flows[0].dst", "same datacenter"),
    ({"pattern": "onoff", "on": "1s"}, "cross_traffic.flows[0].on", "both on and off"),
    ({"protocol": "udp", "rate": "1Gbps", "congestion": "bbr"}, "cross_traffic.flows[0].congestion", "only TCP"),
    ({"congestion": "-x"}, "cross_traffic.flows[0].congestion", "not a congestion control's name"),  # was iperf3's -C -x
    ({"congestion": "cubic --logfile /x"}, "cross_traffic.flows[0].congestion", "at most 15 characters"),
    ({"congestion": "a" * 16}, "cross_traffic.flows[0].congestion", "e.g. cubic"),  # past TCP_CA_NAME_MAX
    ({"rate": "fast"}, "cross_traffic.flows[0].rate", "Gbps"),
    ({"start": "5s", "stop": "2s"}, "cross_traffic.flows[0].stop", "after start"),
    ({"pattern": "schedule"}, "cross_traffic.flows[0].schedule", "needs entries"),
])
def test_bad_flows_name_the_field(flow: dict, field: str, words: str) -> None:
    with pytest.raises(FieldError) as e:
        parse({"flows": [flow]})
    assert e.value.field == field and words in str(e.value)


def test_duplicate_names_are_refused() -> None:
    with pytest.raises(FieldError, match="two flows are named 'a'"):
        parse({"flows": [{"name": "a"}, {"name": "a"}]})


def test_client_command_line() -> None:
    f = FlowSpec("f", protocol="udp", streams=4, rate_bps=2.5e9)
    argv = iperf3_client_argv(f, "10.2.0.5", 5301, 2.2, 2.5e9, 0.5, Path("/x/c.json"))
    # -t is a backstop 2 s past the period (3 whole seconds): the runner's SIGTERM at the period's end ends it
    assert argv[:9] == ["iperf3", "-c", "10.2.0.5", "-p", "5301", "-t", "5", "-i", "0.5"]
    # a period until stop() (24 h) stays within the longest -t iperf3 accepts
    assert iperf3_client_argv(f, "10.2.0.5", 5301, 24 * 3600.0, 2.5e9, 0.5, Path("c"))[6] == "86400"
    # the flow's rate split over its streams (iperf3 applies -b to each of the -P streams)
    assert "-u" in argv and argv[argv.index("-b") + 1] == "625000000" and argv[argv.index("-P") + 1] == "4"
    # and each stream's socket buffers hold 100 ms of its share (625 Mbps: 7.8 MB), within 1-8 MiB
    assert argv[argv.index("-w") + 1] == str(int(625e6 * 0.1 / 8))
    slow = iperf3_client_argv(FlowSpec("s", protocol="udp", rate_bps=20e6), "1.2.3.4", 1, 1, 20e6, 1, Path("c"))
    assert slow[slow.index("-w") + 1] == str(1 << 20) and slow[slow.index("-b") + 1] == "20000000"
    tcp = iperf3_client_argv(FlowSpec("t", congestion="cubic"), "1.2.3.4", 1, 1, None, 1, Path("c"))
    assert "-b" not in tcp and "-u" not in tcp and "-w" not in tcp and tcp[tcp.index("-C") + 1] == "cubic"


def test_iperf3_report_parsing_drops_the_repeated_last_interval() -> None:
    doc = {"intervals": [
        {"sum": {"start": 0, "end": 0.5, "seconds": 0.5, "bytes": 3125000, "bits_per_second": 5e7, "lost_packets": 0, "packets": 2000, "jitter_ms": 0.01}},
        {"sum": {"start": 0.5, "end": 1.0, "seconds": 0.5, "bytes": 3125000, "bits_per_second": 5e7, "lost_packets": 3, "packets": 2000, "jitter_ms": 0.02}},
        {"sum": {"start": 1.0, "end": 1.0, "seconds": 0.00001, "bytes": 0, "bits_per_second": 0}},
    ], "error": "the client has terminated"}
    ivs = parse_iperf3_intervals(json.dumps(doc))
    assert [(i["end_s"], i["bytes"], i["lost_packets"]) for i in ivs] == [(0.5, 3125000, 0), (1.0, 3125000, 3)]
    assert parse_iperf3_intervals("") == [] and parse_iperf3_intervals("{truncated") == []


def test_scaled_divides_every_rate() -> None:
    spec = parse({"flows": [{"protocol": "udp", "rate": "10Gbps"},
                            {"protocol": "udp", "pattern": "schedule", "schedule": [{"at": 0, "rate": "4Gbps"}, {"at": "1s", "rate": "off"}]}]})
    s = spec.scaled(10)
    assert s.flows[0].rate_bps == 1e9
    assert s.flows[1].schedule == ((0.0, 4e8), (1.0, None))


def test_a_neighbour_gets_a_real_time_priority_else_a_nice_value(monkeypatch) -> None:
    """Best effort, in that order; a process that is gone or refused both is reported, never raised."""
    import os

    from traffic import cross

    calls = []
    monkeypatch.setattr(os, "sched_setscheduler", lambda pid, policy, param: calls.append(("rr", pid, param.sched_priority)))
    monkeypatch.setattr(os, "setpriority", lambda which, pid, nice: calls.append(("nice", pid, nice)))
    assert cross.boost_priority(42) == "realtime" and calls == [("rr", 42, cross.RT_PRIORITY)]

    def refuse(*a):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    calls.clear()
    assert cross.boost_priority(42) == "nice" and calls == [("nice", 42, cross.NICE)]
    monkeypatch.setattr(os, "setpriority", refuse)
    assert cross.boost_priority(42) == "none" and cross.boost_priority(0) == "none"


def test_a_flow_whose_streams_share_less_than_the_lowest_wire_rate_each_is_refused_naming_streams() -> None:
    """iperf3's -b is each stream's rate, `int(rate / streams)` on the wire: 64 streams of a 100 Kbps flow were -b 1562,
    past rate / 8 bit/s streams -b 0, which iperf3 reads as unlimited; and iperf3 runs at most 128 streams (-P)."""
    from testbed.scale import Scale
    from testbed.sections import parse_scenario

    def refused(flow: dict, **extra) -> FieldError:
        with pytest.raises(FieldError) as err:
            parse_scenario({"wan": {"rate": "100Gbps"}, **extra, "cross_traffic": {"flows": [flow]}}, "s.yaml")
        return err.value

    tail = "below 8 Kbps, the lowest rate the wire can be paced at; use at most"
    err = refused({"protocol": "udp", "rate": "100Kbps", "streams": 64})
    assert (err.field, str(err)) == ("cross_traffic.flows[0].streams", "s.yaml: cross_traffic.flows[0].streams: 64 streams share "
                                     "cross_traffic.flows[0].rate, 100 Kbps, which scale 1 puts at 100 Kbps on the wire: 1562 bps each, "
                                     f"{tail} 12 streams (that rate on the wire / 8 Kbps), or raise that rate to 512 Kbps or more")
    assert parse_scenario({"wan": {"rate": "100Gbps"}, "cross_traffic": {"flows": [{"protocol": "udp", "rate": "100Kbps",
                                                                                    "streams": 12}]}})  # 8.33 Kbps each
    err = refused({"rate": "1Mbps", "streams": 8}, scale=20)  # a TCP flow's cap, at the scenario's scale
    assert str(err).endswith("8 streams share cross_traffic.flows[0].rate, 1 Mbps, which scale 20 puts at 50 Kbps on the wire: "
                             f"6250 bps each, {tail} 6 streams (that rate on the wire / 8 Kbps), or raise that rate to 1.28 Mbps or more")
    err = refused({"protocol": "udp", "pattern": "schedule", "streams": 4, "schedule": [{"at": "0s", "rate": "1Gbps"},
                                                                                        {"at": "1s", "rate": "20Kbps"}]})
    assert "4 streams share cross_traffic.flows[0].schedule[1].rate, 20 Kbps" in str(err) and f"{tail} 2 streams" in str(err)
    # scale: auto, once the host's capacity resolves it (here 20 for 5 Gbps)
    sc = parse_scenario({"wan": {"rate": "100Gbps"}, "scale": "auto",
                         "cross_traffic": {"flows": [{"protocol": "udp", "rate": "1Mbps", "streams": 8}]}}, "s.yaml")
    assert sc.resolve_scale(1e11) == Scale(1)
    with pytest.raises(FieldError) as e:
        sc.resolve_scale(5e9)
    assert str(e.value) == ("s.yaml: cross_traffic.flows[0].streams: 8 streams share cross_traffic.flows[0].rate, 1 Mbps, which "
                            "scale auto (here 20, for a host capacity of 5 Gbps) puts at 50 Kbps on the wire: 6250 bps each, "
                            f"{tail} 6 streams (that rate on the wire / 8 Kbps), or raise that rate to 1.28 Mbps or more")
    # iperf3's own limit
    assert parse({"flows": [{"streams": 128}]}).flows[0].streams == 128
    for n, says in ((129, "129 is more than 128, the most parallel streams iperf3 runs (-P)"), (0, "0 is not a whole number >= 1")):
        with pytest.raises(FieldError) as e:
            parse({"flows": [{"streams": n}]})
        assert str(e.value) == f"cross_traffic.flows[0].streams: {says}"


def test_a_schedule_flow_of_too_many_entries_is_named_by_its_schedule_not_its_on_and_off() -> None:
    """A `pattern: schedule` flow past MAX_PERIODS was told to lengthen `on` and `off`, which it has not (2026-12-07)."""
    from testbed.errors import FieldError
    from testbed.sections import load_scenario
    from traffic.cross import MAX_PERIODS

    entries = ", ".join(f"{{at: {k / 1000:g}s, rate: 1Mbps}}" for k in range(MAX_PERIODS + 1))
    flow = f"{{name: s, protocol: udp, direction: prfaas_to_pd, pattern: schedule, schedule: [{entries}]}}"
    with pytest.raises(FieldError, match=r"cross_traffic.flows\[0\].schedule: starts more than 10,000 periods in the run "
                                         r"\(30s\), each a new iperf3 server and client; give at most 10,000 entries"):
        load_scenario("quick", ["topology.prfaas.cross=1", "topology.pd.cross=1", f"cross_traffic={{flows: [{flow}]}}"])
