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
