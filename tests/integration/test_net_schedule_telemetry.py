"""The schedule changes the WAN at its times (timed from Network.start) and telemetry shows it."""

import os
import threading
import time

import pandas as pd

from testbed.net.calibrate import IperfServer
from testbed.net.emulation import Network
from testbed.sections import parse_scenario


def test_rate_step_down_and_revert_show_in_telemetry_parquet(tmp_path):
    sc = parse_scenario({"name": "it-sched", "scale": 1, "duration": "30s",
                         "topology": {"prfaas": {"prefill": 1, "cross": 0}, "pd": {"prefill": 0, "decode": 1, "cross": 0}},
                         "wan": {"rate": "1Gbps", "delay": "5ms",
                                 "schedule": [{"at": "1.5s", "rate": "200Mbps", "for": "1.5s"}, {"at": "3.5s", "down": "0.5s"}]}})
    path = tmp_path / "link.parquet"
    seen = []
    net = Network(sc, telemetry_path=path)
    net.add_telemetry_listener(seen.append)
    try:
        net.start()
        with IperfServer(net, "pd-d0"):
            net.run("prfaas-p0", ["iperf3", "-c", net.host_ip("pd-d0"), "-t", "4.5", "-P", "2"], timeout_s=30)
        while net.since_start_s() < 4.2:
            time.sleep(0.05)
        fired = [a.kind for _, a in net.schedule.fired]
        fired_at = [round(t, 3) for t, _ in net.schedule.fired]
        errors = list(net.schedule.errors)  # the warm-up read and every action went through
    finally:
        net.stop()
    assert fired == ["change", "revert", "down", "up"][: len(fired)] and len(fired) >= 3 and errors == []
    df = pd.read_parquet(path)
    fwd = df[df.direction == "prfaas_to_pd"].sort_values("t_s")
    assert len(seen) == len(df)
    assert fwd.t_s.diff().median() <= 0.1  # at least 10 Hz
    assert {"tx_bytes", "tx_packets", "drops", "backlog_bytes", "rate_bps", "delayline_queued_packets"} <= set(df.columns) or \
        {"tx_bytes", "tx_packets", "drops", "backlog_bytes", "rate_bps"} <= set(df.columns)
    step = fwd[fwd.rate_bps == 200e6].t_s
    assert 1.5 <= step.min() <= 2.0  # visible soon after its time (loose here; the benchmark holds 100 ms)
    during = fwd[(fwd.t_s > 1.9) & (fwd.t_s < 2.9)].achieved_bps.median()
    before = fwd[(fwd.t_s > 0.7) & (fwd.t_s < 1.4)].achieved_bps.median()
    assert during <= 0.3e9 and before >= 0.5e9, (before, during)
    # the revert (3.0 s) and the outage (3.5-4.0 s) show soon after their times, with the same looseness as
    # the step above: a stalled host has woken the schedule thread 100+ ms late (CI, 2026-12-02: no
    # sample from 3.6 to 3.9 s may show the link up failed once in ~900 tests; the benchmark holds 100 ms)
    assert fwd[(fwd.t_s > 3.3) & (fwd.t_s < 3.45)].rate_bps.eq(1e9).all(), fired_at
    down = fwd[~fwd.link_up.astype(bool)].t_s
    assert len(down) >= 2 and 3.5 <= down.min() <= 3.9, (fired_at, down.tolist())


def _hold_gil_s(seconds: float) -> float:
    """Hold this process's GIL for about `seconds` in one C call (a builtin sum over a range runs no bytecode,
    so no other thread of this process runs until it returns). Returns how long it held it."""
    t = time.perf_counter()
    sum(range(2_000_000))
    n = int(2_000_000 * seconds / max(time.perf_counter() - t, 1e-6))
    t = time.perf_counter()
    sum(range(n))
    return time.perf_counter() - t


def test_schedule_and_telemetry_keep_time_while_the_runner_holds_its_gil(tmp_path):
    """The schedule and the sampler run in the WAN control process (testbed.net.wanctl), which shares no GIL with
    the runner: while one of the runner's threads holds the runner's GIL for ~1.2 s across an action's time, the
    action fires on time and the samples keep coming. In the runner's own threads they waited for the GIL: the
    case study lost telemetry for up to 1.2 s and fired its dip 0.6 s late (docs/scale-out.md)."""
    sc = parse_scenario({"name": "it-gil", "scale": 1, "duration": "30s",
                         "topology": {"prfaas": {"prefill": 1, "cross": 0}, "pd": {"prefill": 0, "decode": 1, "cross": 0}},
                         "wan": {"rate": "1Gbps", "delay": "5ms", "schedule": [{"at": "1.2s", "rate": "200Mbps"}]}})
    path = tmp_path / "link.parquet"
    net = Network(sc, telemetry_path=path)
    try:
        net.start()
        assert net.control.pid != os.getpid() and os.sched_getscheduler(net.control.pid) == os.SCHED_RR
        while net.since_start_s() < 0.55:
            time.sleep(0.01)
        ticks, stop = [], threading.Event()  # a thread of the runner: how long it could not run

        def tick() -> None:
            while not stop.wait(0.01):
                ticks.append(time.perf_counter())

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        while len(ticks) < 2:
            time.sleep(0.01)
        held_from_s = net.since_start_s()
        held_s = _hold_gil_s(1.5)
        held_to_s = net.since_start_s()
        while net.since_start_s() < held_to_s + 0.3:
            time.sleep(0.01)
        stop.set()
        ticker.join()
        fired = net.schedule.fired
        woke_late_s = list(net.schedule.woke_late_s)
    finally:
        net.stop()
    stalled_s = max(b - a for a, b in zip(ticks, ticks[1:]))
    assert stalled_s >= 0.5 and held_from_s < 1.2 < held_to_s, (stalled_s, held_from_s, held_s, held_to_s)  # the GIL was held across the action's time
    assert [a.kind for _, a in fired] == ["change"]
    assert fired[0][0] - 1.2 < 0.1 and woke_late_s[0] < 0.05, (fired, woke_late_s)
    fwd = pd.read_parquet(path).query("direction == 'prfaas_to_pd'").sort_values("t_s")
    held = fwd[(fwd.t_s >= held_from_s) & (fwd.t_s <= held_to_s)]
    assert len(held) >= 0.5 * (held_to_s - held_from_s) / 0.05 and held.t_s.diff().max() < 0.25, held.t_s.tolist()
    assert fwd[fwd.t_s > 1.35].rate_bps.eq(200e6).all()


def test_a_wan_control_process_that_dies_is_reported_as_a_schedule_error(tmp_path):
    """If the WAN control process is killed mid-run, its actions can no longer fire: the run says so (the error
    reaches `schedule.errors`, which timing fidelity flags), and the network still tears down."""
    import signal

    sc = parse_scenario({"name": "it-ctl-dies", "scale": 1, "duration": "30s",
                         "topology": {"prfaas": {"prefill": 1, "cross": 0}, "pd": {"prefill": 0, "decode": 1, "cross": 0}},
                         "wan": {"rate": "1Gbps", "delay": "5ms", "schedule": [{"at": "1.5s", "rate": "200Mbps"}]}})
    net = Network(sc, telemetry_path=tmp_path / "link.parquet")
    try:
        net.start()
        os.kill(net.control.pid, signal.SIGKILL)
        while net.since_start_s() < 2.0:
            time.sleep(0.05)
        fired, errors = net.schedule.fired, list(net.schedule.errors)
    finally:
        net.stop()
    assert fired == [] and len(errors) == 1 and "WAN control process ended during the run (exit code -9)" in errors[0]
    assert pd.read_parquet(tmp_path / "link.parquet").t_s.max() < 1.0


def test_a_user_script_without_a_main_guard_can_start_a_network(tmp_path):
    """The WAN control process is `python -m testbed.net.wanctl`, not a multiprocessing spawn: a spawn runs the
    parent's script again in the child, so a lab script that starts a Network at its top level (no
    `if __name__ == "__main__"`) would fail to start, or start a second network."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    script = tmp_path / "lab.py"
    script.write_text(
        "from testbed.net.emulation import Network\n"
        "from testbed.sections import parse_scenario\n"
        "sc = parse_scenario({'name': 'lab', 'scale': 1, 'duration': '30s', 'topology': {'prfaas': {'prefill': 1, 'cross': 0},"
        " 'pd': {'prefill': 0, 'decode': 1, 'cross': 0}}, 'wan': {'rate': '1Gbps', 'delay': '5ms'}})\n"
        "with Network(sc) as net:\n"
        "    print('control', net.control.pid, len(net.telemetry.rows) > 0)\n")
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(repo)})
    assert r.returncode == 0 and r.stdout.count("control ") == 1 and r.stdout.strip().endswith("True"), r.stderr[-2000:]
