"""An active probe that ends once it has filled the path (`KVSender.probe(stop=FillStop)`), on a real shaped
WAN between namespaces: the router's probe sized for a line 5x faster than the one it meets (a dip), sent
whole and ended early, side by side (docs/router.md, "An active probe", *Stop*). Needs root."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.net.emulation import Network
from testbed.sections import parse_scenario

REPO = Path(__file__).resolve().parents[2]
KV_PORT = 9000
SENDER = """
import json, sys
sys.path.insert(0, {repo!r})
from testbed.kv.transport import FillStop, KVSender
host, nbytes = sys.argv[1], int(sys.argv[2])
with KVSender(host, {port}, connections=4) as tx:
    for stop in [None, FillStop(2.0, 0.4, 3.0)] * 3:
        ans = tx.probe(nbytes, pings=2, timeout_s=10.0, stop=stop)
        print(json.dumps({{"filled": stop is not None, **ans}}), flush=True)
""".format(port=KV_PORT, repo=str(REPO))


@pytest.fixture(scope="module")
def net():
    with Network(parse_scenario({"name": "it-probe-stop", "scale": 10, "duration": "120s",
                                 "topology": {"prfaas": {"prefill": 1, "cross": 0}, "pd": {"prefill": 0, "decode": 1, "cross": 0}},
                                 "wan": {"rate": "10Gbps", "delay": "10ms", "queue": "1bdp"}})) as n:  # stops on every way out
        yield n


def test_a_probe_ends_once_it_filled_the_path_and_reads_what_the_whole_probe_reads(net) -> None:
    rx = net.popen("pd-d0", [sys.executable, str(REPO / "benchmarks" / "transport_bench.py"), "--role", "receiver",
                             "--port", str(KV_PORT)], stdout=subprocess.PIPE, text=True)
    try:
        assert rx.stdout is not None and rx.stdout.readline().strip() == "ready"
        # 1 Gbps on the wire, 20-ms RTT: a BDP is 2.5 MB; 5 BDPs at a line 5x faster is 62.5 MB, ~0.5 s here
        out = net.run("prfaas-p0", [sys.executable, "-c", SENDER, net.host_ip("pd-d0"), str(62_500_000)], timeout_s=120)
    finally:
        rx.terminate()  # the network's stop() reaps it, and kills it if it lingers
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    whole = [r for r in rows if not r["filled"]]
    early = [r for r in rows if r["filled"]]
    assert len(whole) == len(early) == 3 and all(r["ok"] for r in rows), rows
    assert not any(r["stopped"] for r in whole) and all(r["bytes"] == 62_500_000 for r in whole), rows
    # ended with bytes left unsent; a probe whose two pings both met host noise reads an unloaded RTT so high that
    # the 1-BDP queue is no standing queue above it and is sent whole, the safe way (once in CI at 2c92c53): 2 of 3
    assert all(r["bytes"] < 62_500_000 for r in early if r["stopped"]) and sum(r["stopped"] for r in early) >= 2, rows
    mid = lambda rs, k: sorted(r[k] for r in rs)[1]  # noqa: E731  (the median of three)
    assert mid(early, "seconds") < 0.7 * mid(whole, "seconds"), rows
    # both read the shaped line (1 Gbps on the wire, less headers): the early end costs no accuracy
    assert 0.7e9 <= mid(early, "rate_bps") <= 1.1e9 and 0.7e9 <= mid(whole, "rate_bps") <= 1.1e9, rows


PACED = """
import json, sys
sys.path.insert(0, {repo!r})
from testbed.kv.transport import FillStop, KVSender
host, nbytes_below, nbytes_above = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with KVSender(host, {port}, connections=4) as tx:
    for pace, nbytes in [(0.5e9, nbytes_below), (2e9, nbytes_above)] * 5:
        tx.pace(pace)
        ans = tx.probe(nbytes, pings=2, timeout_s=10.0, stop=FillStop(2.0, 0.4, 3.0))
        print(json.dumps({{"pace": pace, **ans}}), flush=True)
""".format(port=KV_PORT, repo=str(REPO))


def test_a_paced_probe_reads_its_pace_below_the_line_without_a_queue_and_the_line_above_it(net) -> None:
    """The router paces its probe at twice its estimate (`KVSender.pace`, docs/router.md "An active probe",
    "A paced probe"): below the line's rate a paced probe gets its pace and leaves no standing queue, so it is a
    lower bound that raises the estimate; above it, the path pushes back and it ends as filled, reading the line."""
    from testbed.kv.transport import is_standing_queue

    rx = net.popen("pd-d0", [sys.executable, str(REPO / "benchmarks" / "transport_bench.py"), "--role", "receiver",
                             "--port", str(KV_PORT)], stdout=subprocess.PIPE, text=True)
    try:
        assert rx.stdout is not None and rx.stdout.readline().strip() == "ready"
        # 1 Gbps on the wire, 20-ms RTT: 8 BDPs at 0.5 Gbps are 10 MB (0.16 s at the pace); above the line the
        # router's probe before a 5x dip, 5 BDPs at a line 5x faster (62.5 MB), paced at twice the line
        out = net.run("prfaas-p0", [sys.executable, "-c", PACED, net.host_ip("pd-d0"), str(10_000_000), str(62_500_000)],
                      timeout_s=120)
    finally:
        rx.terminate()
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    below = [r for r in rows if r["pace"] < 1e9]
    above = [r for r in rows if r["pace"] > 1e9]
    # five of each, judged by the median and a majority: a host busy for a second (CI beside other jobs, once at
    # 3f88f9a) read 2 of 3 above-line probes at half the line; with two CPU hogs beside it, it fails as it should
    assert len(below) == len(above) == 5 and all(r["ok"] for r in rows)
    mid = lambda rs, k: sorted(r[k] for r in rs)[2]  # noqa: E731  (the median of five)
    assert 0.3e9 <= mid(below, "rate_bps") <= 0.6e9, rows  # its pace, not the line
    assert sum(is_standing_queue(r["rtt_ms"] - r["idle_rtt_ms"], r["idle_rtt_ms"]) for r in below) <= 1, rows
    assert sum(r["stopped"] for r in below) == 0 and sum(r["stopped"] for r in above) >= 3, rows
    assert 0.7e9 <= mid(above, "rate_bps") <= 1.1e9, rows  # the line (1 Gbps on the wire, less headers)
