"""`measure_rate_bps`'s arithmetic on a real capture (tests/data/calibrate_goodput_2s.json): iperf3's own
receiver figure over-reads a 2 s run past the TCP ceiling; goodput from the receiving interface's frames
in wire time stays under it, at the shaper's rate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from testbed.errors import HostError
from testbed.net.calibrate import FrameSample, steady_rate_bps
from testbed.packet import FRAME_BYTES, GOODPUT_MAX, MTU_BYTES, TCP_MSS_BYTES


def test_the_packet_sizes_derive_from_mtu_and_headers() -> None:
    assert (MTU_BYTES, TCP_MSS_BYTES, FRAME_BYTES) == (1500, 1448, 1514)
    assert GOODPUT_MAX == 1448 / 1514 and f"{GOODPUT_MAX:.3f}" == "0.956"


@pytest.fixture
def capture(test_data: Path) -> dict:
    return json.loads((test_data / "calibrate_goodput_2s.json").read_text())


def test_iperf3s_receiver_sum_over_reads_a_2s_run_past_the_ceiling(capture: dict) -> None:
    old = capture["iperf3"]["end"]["sum_received"]["bits_per_second"] / capture["wire_bps"]
    assert old > GOODPUT_MAX + 0.005, old  # 0.9646: the way calibrate read it before 2026-12-07


def captured_frames(text: str) -> tuple[int, list[FrameSample]]:
    """The capture's frame counts, as the first version's in-host sampler printed them: "mtu N", then
    "time_s rx_bytes rx_packets" lines (the same counters `ReceivedFrames` reads)."""
    lines = [line.split() for line in text.splitlines()]
    mtu = next(int(f[1]) for f in lines if f[0] == "mtu")
    return mtu, [FrameSample(float(f[0]), int(f[1]), int(f[2])) for f in lines if len(f) == 3]


def test_goodput_from_the_receivers_frames_is_under_the_ceiling_and_at_the_shapers_rate(capture: dict) -> None:
    mtu, samples = captured_frames(capture["frames"])
    header_bytes = 14 + mtu - capture["iperf3"]["start"]["tcp_mss_default"]
    assert (mtu, header_bytes) == (1500, 66)
    ratio = steady_rate_bps(samples, header_bytes=header_bytes, omit_s=1, duration_s=2) / capture["wire_bps"]
    assert 0.9559 - 0.003 <= ratio <= GOODPUT_MAX, ratio  # the shaper's counter x 1448/1514 read 0.9559


def frames(rate_bps: float, *, start_s: float, stop_s: float, end_s: float, step_s: float = 0.02) -> list[FrameSample]:
    """A flow of full 1514-byte frames at `rate_bps` of payload from start_s to stop_s, sampled to end_s."""
    out, t = [], 0.0
    while t <= end_s:
        payload = rate_bps / 8 * min(max(t - start_s, 0.0), stop_s - start_s)
        n = int(payload // 1448)
        out.append(FrameSample(round(t, 6), 1_000_000 + n * 1514, 500 + n))
        t += step_s
    return out


def test_the_window_starts_omit_after_the_first_data_and_ignores_the_idle_tail() -> None:
    samples = frames(4.78e9, start_s=0.5, stop_s=2.5, end_s=4.0)  # the flow stops before omit + duration ends
    bps = steady_rate_bps(samples, header_bytes=66, omit_s=1, duration_s=5)
    assert bps == pytest.approx(4.78e9, rel=2e-3)
    wire_bps = steady_rate_bps(samples, omit_s=1, duration_s=5)  # no headers taken off: whole frames, the wire rate
    assert wire_bps == pytest.approx(4.78e9 * 1514 / 1448, rel=2e-3)


def test_a_flow_shorter_than_its_omit_is_refused() -> None:
    with pytest.raises(HostError, match="too little"):
        steady_rate_bps(frames(4.78e9, start_s=0.5, stop_s=1.2, end_s=2.0), header_bytes=66, omit_s=1, duration_s=1)
    with pytest.raises(HostError, match="no data"):
        steady_rate_bps(frames(0.0, start_s=0.5, stop_s=1.2, end_s=2.0), header_bytes=66, omit_s=1, duration_s=1)


def test_the_longest_calibrate_duration_runs_iperf3_within_its_limit() -> None:
    """iperf3 refuses -t over 86400 with a parameter error, not JSON: --duration 86400 ran -t 86401 (2026-12-07)."""
    import math

    from testbed.cli import build_parser
    from testbed.net.calibrate import RATE_OMIT_S
    from traffic.cross import IPERF3_MAX_T_S

    longest = build_parser().parse_args(["calibrate", "--duration", "86399"]).duration
    assert math.ceil(RATE_OMIT_S + longest) == IPERF3_MAX_T_S == 86400


def test_the_omit_leaves_out_the_flows_first_seconds() -> None:
    """Slow start at 1 Gbps for the first second of data, 4.78 Gbps after: only the rate after the omit is counted."""
    samples, t = [], 0.0
    while t <= 4.0:
        payload = 1e9 / 8 * min(max(t - 0.5, 0.0), 1.0) + 4.78e9 / 8 * min(max(t - 1.5, 0.0), 2.0)  # data 0.5-3.5 s
        n = int(payload // 1448)
        samples.append(FrameSample(round(t, 6), 1_000_000 + n * 1514, 500 + n))
        t += 0.02
    assert steady_rate_bps(samples, header_bytes=66, omit_s=1, duration_s=2) == pytest.approx(4.78e9, rel=2e-3)
    assert steady_rate_bps(samples, header_bytes=66, omit_s=0, duration_s=2) == pytest.approx((0.98e9 + 1.02 * 4.78e9) / 2, rel=2e-3)  # 0.52-2.52 s


class CannedNet:
    """A network whose receiving interface (MTU `mtu_bytes`) counts a flow of full frames at `payload_bps` while its
    iperf3 runs (for its -t seconds, or failing, or hung), and whose counters or MTU may fail: what `measure_rate_bps`
    reads where, and what it leaves running."""

    def __init__(self, payload_bps: float = 4.78e9, fail: bool = False, hang: bool = False, unreadable: bool = False,
                 mtu_bytes: int | None = 1500) -> None:
        import time

        self.payload_bps, self.fail, self.hang, self.unreadable = payload_bps, fail, hang, unreadable
        self.mtu = mtu_bytes  # None: it cannot be read
        self.mss = (mtu_bytes or 1500) - 52  # Linux TCP over IPv4 with timestamps
        self.read_from: set[str] = set()
        self.mtu_read_from: list[str] = []
        self.iperf_argv: list[tuple[str, list[str]]] = []
        self.flow = (float("inf"), float("inf"))  # (start, stop) in time.monotonic()
        self.clock = time.monotonic

    def host_ip(self, host: str) -> str:
        return {"prfaas-p0": "10.1.0.10", "pd-d0": "10.2.0.11"}[host]

    def rx_counters(self, host: str) -> tuple[int, int]:
        if self.unreadable:
            raise HostError(f"{host}: interface {host}-eth0 not in /proc/1234/net/dev")
        self.read_from.add(host)
        start, stop = self.flow
        n = int(self.payload_bps / 8 * max(0.0, min(self.clock(), stop) - start) // self.mss)
        return 1_000_000 + n * (self.mss + 52 + 14), 500 + n

    def mtu_bytes(self, host: str) -> int:
        self.mtu_read_from.append(host)
        if self.mtu is None:  # as Network.mtu_bytes says it
            raise HostError(f"{host}: no MTU of {host}-eth0 in `ip link`: Device \"{host}-eth0\" does not exist.")
        return self.mtu

    def run(self, host: str, argv: list[str], timeout_s: float = 30) -> Any:
        import subprocess
        import time

        self.iperf_argv.append((host, argv))
        if self.hang:  # as Network.run: the process killed at its timeout, then this
            raise subprocess.TimeoutExpired(argv, timeout_s)
        if self.fail:
            return subprocess.CompletedProcess(argv, 1, "", "iperf3: error - the server is busy")
        t = self.clock()
        self.flow = (t + 0.05, t + float(argv[argv.index("-t") + 1]))
        time.sleep(self.flow[1] - t)
        return subprocess.CompletedProcess(argv, 0, json.dumps({"start": {"tcp_mss_default": self.mss}}), "")


def rx_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("rx-frames-")]


def test_measure_rate_reads_the_receiver_runs_iperf3_whole_seconds_and_stops_reading() -> None:
    from testbed.net.calibrate import measure_rate_bps

    for reverse, receiver in ((False, "pd-d0"), (True, "prfaas-p0")):  # -R: the client, in prfaas-p0, receives
        net = CannedNet(4.78e9)
        bps = measure_rate_bps(net, "prfaas-p0", "pd-d0", streams=4, duration_s=0.5, omit_s=0.5, reverse=reverse)
        assert bps == pytest.approx(4.78e9, rel=0.01)  # the payload rate, headers taken off every frame
        assert net.read_from == {receiver} and net.mtu_read_from == [receiver] and rx_threads() == []  # not left running
        host, argv = net.iperf_argv[0]
        assert host == "prfaas-p0" and argv[argv.index("-t") + 1] == "1" and "-O" not in argv  # ceil(0.5 + 0.5)
        assert ("-R" in argv) == reverse


def test_measure_rates_gives_the_goodput_and_the_link_rate_of_one_sampler_and_window() -> None:
    """wan_fidelity ran a second sampler beside calibrate's for its link rate (until session 68)."""
    from testbed.net.calibrate import measure_rates_bps
    from testbed.packet import FRAME_BYTES, TCP_MSS_BYTES

    net = CannedNet(4.78e9)
    good, link = measure_rates_bps(net, "prfaas-p0", "pd-d0", streams=4, duration_s=0.5, omit_s=0.5)
    assert good == pytest.approx(4.78e9, rel=0.01) and link / good == pytest.approx(FRAME_BYTES / TCP_MSS_BYTES, rel=1e-3)
    assert len(net.iperf_argv) == 1 and rx_threads() == []  # one run, one sampler, none left running


def test_a_failing_or_hung_iperf3_or_unreadable_counters_are_one_line_and_leave_nothing_running() -> None:
    """A hung iperf3 (past its -t + 30 s) ended calibrate in a TimeoutExpired traceback (2026-12-07)."""
    from testbed.net.calibrate import measure_rate_bps

    for net, said in ((CannedNet(fail=True), "the server is busy"),
                      (CannedNet(hang=True), r"^iperf3 from prfaas-p0 to pd-d0 did not finish within 32 s$"),
                      (CannedNet(unreadable=True), r"^reading pd-d0's interface counters: pd-d0: interface pd-d0-eth0 not in")):
        with pytest.raises(HostError, match=said):
            measure_rate_bps(net, "prfaas-p0", "pd-d0", duration_s=1)
        assert rx_threads() == []


def test_the_headers_taken_off_each_frame_follow_the_receivers_mtu() -> None:
    """A 9000-byte MTU (8948-byte segments in 9014-byte frames): 66 B of headers a frame, as at 1500. Read as 1500
    (calibrate's assumption until 2026-12-07) it took 14 + 1500 - 8948 = -7434 B a frame off: 1.8 x the payload rate."""
    from testbed.net.calibrate import measure_rate_bps

    net = CannedNet(4.78e9, mtu_bytes=9000)
    bps = measure_rate_bps(net, "prfaas-p0", "pd-d0", streams=4, duration_s=0.5, omit_s=0.5)
    assert bps == pytest.approx(4.78e9, rel=0.01)
    assert net.mtu_read_from == ["pd-d0"]


def test_an_unreadable_mtu_is_one_line_before_iperf3_starts() -> None:
    from testbed.net.calibrate import measure_rate_bps

    net = CannedNet(mtu_bytes=None)
    with pytest.raises(HostError, match=r"^pd-d0: no MTU of pd-d0-eth0 in `ip link`: Device"):
        measure_rate_bps(net, "prfaas-p0", "pd-d0", duration_s=1)
    assert net.iperf_argv == [] and net.read_from == set() and rx_threads() == []
