"""testbed.kv.tcplog: what a prefill worker keeps of its KV connections' TCP samples, and how the run reads it back."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from testbed.kv.tcplog import COLUMNS, TcpLog, read_tcp_logs
from testbed.kv.transport import KVReceiver, KVSender, TcpSample


def sample(t_s: float, connection: int = 0, acked: int = 0, unacked: int = 0, notsent: int = 0, retrans: int = 0) -> TcpSample:
    return TcpSample(t_s, connection, rtt_us=10_000, cwnd=10, total_retrans=retrans, bytes_acked=acked, notsent_bytes=notsent,
                     delivery_rate_bps=1e9, min_rtt_us=9_000, unacked_bytes=unacked, app_limited=True)


def test_an_idle_connection_is_kept_once_and_a_moving_one_every_sample(tmp_path: Path):
    log = TcpLog(tmp_path / "p.tcp.csv", "prfaas", 2, flush_s=100.0)
    kept = [log.record(1, 0, sample(t, acked=0)) for t in (0.1, 0.2, 0.3)]  # idle from the start
    assert kept == [True, False, False]
    assert log.record(1, 0, sample(0.4, connection=1)) is True  # another connection's first sample
    assert log.record(1, 0, sample(0.5, unacked=1448)) is True  # in flight: kept though nothing was acknowledged yet
    assert log.record(1, 0, sample(0.6, acked=5000)) is True  # the transfer's end: acknowledged bytes moved
    assert log.record(1, 0, sample(0.7, acked=5000)) is False  # idle again
    assert log.record(1, 0, sample(0.8, acked=5000, retrans=1)) is True  # a retransmit moves it too
    assert log.record(3, 0, sample(0.9, acked=5000, retrans=1)) is True  # the same state towards another decode
    log.close()
    df = read_tcp_logs([tmp_path / "p.tcp.csv"])
    assert list(df.columns) == list(COLUMNS)
    assert df["t_s"].tolist() == [0.1, 0.4, 0.5, 0.6, 0.8, 0.9]
    assert df["decode_instance"].tolist() == [1, 1, 1, 1, 1, 3]
    assert set(df["cluster"]) == {"prfaas"} and set(df["prefill_instance"]) == {2}
    assert df["app_limited"].dtype == bool and df["app_limited"].all()
    assert df["bytes_acked"].dtype == "int64" and df["bytes_acked"].max() == 5000
    assert not log.record(1, 0, sample(1.0, acked=9000))  # closed: nothing more is kept


def test_a_new_sender_to_the_same_decode_is_its_own_connection_and_times_are_on_the_run_clock(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PRFAAS_T0", "100.0")
    log = TcpLog(tmp_path / "p.tcp.csv", "prfaas", 0, flush_s=100.0)
    assert log.record(1, 0, sample(100.5, acked=5000))
    assert log.record(1, 1, sample(101.5, acked=5000))  # the replacement's counters start again: not "unchanged"
    log.close()
    df = read_tcp_logs([tmp_path / "p.tcp.csv"])
    assert df["sender"].tolist() == [0, 1] and df["t_s"].tolist() == [0.5, 1.5]


def test_a_writer_thread_writes_the_buffer_every_flush_period_without_waiting_for_samples(tmp_path: Path):
    path = tmp_path / "p.tcp.csv"
    log = TcpLog(path, "pd", 0, flush_s=0.05)
    try:
        log.record(0, 0, sample(0.5, acked=1))
        log.record(0, 0, sample(0.6, acked=2))  # the last sample: nothing comes after it
        deadline = time.monotonic() + 5.0
        while len(read_tcp_logs([path])) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert read_tcp_logs([path])["bytes_acked"].tolist() == [1, 2]  # written while the log is still open
    finally:
        log.close()


def test_a_failing_write_stops_the_log_once_and_never_raises_into_the_sampler(tmp_path: Path, capsys):
    log = TcpLog(tmp_path / "p.tcp.csv", "prfaas", 0, flush_s=100.0)
    class FullDisk:
        def writerows(self, rows):
            raise OSError(28, "No space left on device")

    log._writer = FullDisk()  # every write fails from now on
    log.record(0, 0, sample(0.1, acked=1))
    log.flush()
    assert log.error is not None and "tcp log stopped" in capsys.readouterr().err
    assert log.record(0, 0, sample(0.2, acked=2)) is False
    log.close()  # no exception either


def test_a_sampler_whose_on_sample_raises_keeps_sampling(tmp_path: Path):
    def boom(s: TcpSample) -> None:
        raise OSError("disk full")

    with KVReceiver("127.0.0.1", 0, lambda rid, kv: None) as rx, \
            KVSender("127.0.0.1", rx.port, connections=1, sample_interval_s=0.01, on_sample=boom) as tx:
        time.sleep(0.1)
        n = len(tx.samples)
        time.sleep(0.1)
        assert tx.on_sample is None and len(tx.samples) > n  # the hook is dropped, the router's samples go on


def test_damaged_lines_anywhere_cost_only_themselves_and_files_merge_in_time_order(tmp_path: Path):
    a, b = tmp_path / "prefill0.tcp.csv", tmp_path / "prefill1.tcp.csv"
    for path, cluster, inst, times in ((a, "prfaas", 0, (0.2, 0.4)), (b, "pd", 1, (0.1, 0.3))):
        log = TcpLog(path, cluster, inst)
        for i, t in enumerate(times):
            log.record(0, 0, sample(t, acked=i + 1))
        log.close()
    lines = a.read_text().splitlines(keepends=True)
    a.write_text(lines[0] + "prfaas,0,0,0,0.1" + lines[1] + "prfaas,0,0,0,junk" + lines[1][lines[1].index(",0.2,") + 4:]
                 + lines[2] + "prfaas,0,0,0,0.5,0,100")  # a cut line, a junk value, then a worker killed mid-write
    df = read_tcp_logs([a, b])
    # a's 0.2 went with the cut before it (the next write lands on the cut line), the junk row alone, the last partial line
    assert df["t_s"].tolist() == [0.1, 0.3, 0.4]
    assert df["cluster"].tolist() == ["pd", "pd", "prfaas"]
    (tmp_path / "other.tcp.csv").write_text("not,a,tcp,log\n1,2,3,4\n")
    (tmp_path / "empty.tcp.csv").write_text("")
    assert len(read_tcp_logs([tmp_path / "other.tcp.csv", tmp_path / "empty.tcp.csv", tmp_path / "absent.tcp.csv"])) == 0
    assert list(read_tcp_logs([]).columns) == list(COLUMNS)


@pytest.mark.parametrize("cc,mss", [(None, None), ("reno", 536)])
def test_a_real_sender_on_loopback_logs_every_connection_and_its_acknowledged_bytes(tmp_path: Path, cc: str | None,
                                                                                      mss: int | None):
    log = TcpLog(tmp_path / "p.tcp.csv", "prfaas", 0)
    with KVReceiver("127.0.0.1", 0, lambda rid, kv: None) as rx, \
            KVSender("127.0.0.1", rx.port, connections=2, sample_interval_s=0.01, congestion_control=cc, mss_bytes=mss,
                     on_sample=lambda s: log.record(4, 0, s)) as tx:
        tx.send_bytes("r1", 0, "mla", 8 << 20)
        stats = tx.finish("r1", tokens=1, model="m", timeout_s=10.0)
        assert stats.ok, stats.reason
        time.sleep(0.1)  # a few more samples after the last acknowledgement
    log.close()
    df = read_tcp_logs([tmp_path / "p.tcp.csv"])
    assert set(df["connection"]) == {0, 1} and set(df["decode_instance"]) == {4}
    acked = df.groupby("connection")["bytes_acked"].max().sum()
    assert acked >= stats.wire_bytes  # every wire byte of the transfer was acknowledged on one connection or the other
    assert (df["rtt_us"] > 0).all() and df["t_s"].is_monotonic_increasing
    # each sample names the congestion control its connection ran: the one asked for, else the host's default
    default = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    assert set(df["cc"]) == {cc or default}
    # and the segment size it counted its window in: loopback's (MTU 65536; a connection's first samples may read a
    # smaller one), or the one asked for (TCP_MAXSEG before the handshake; the timestamp option takes 12 of its bytes)
    if mss is None:
        assert df["mss"].max() > 60_000
    else:
        assert df["mss"].between(mss - 12, mss).all()


def test_congestion_control_restarts_add_up_each_connections_last_count_across_workers_and_senders(tmp_path: Path):
    """A connection's `cc_restarts` is cumulative in its samples; a replaced sender's connections count
    again from 0, and another prefill worker's connection with the same index is another connection."""
    import dataclasses

    from testbed.kv.tcplog import cc_restarts

    def stuck(t_s: float, connection: int, restarts: int) -> TcpSample:  # in flight: kept at every tick
        return dataclasses.replace(sample(t_s, connection, unacked=1448), cc_restarts=restarts)

    a, b = TcpLog(tmp_path / "a.tcp.csv", "prfaas", 0, flush_s=100.0), TcpLog(tmp_path / "b.tcp.csv", "prfaas", 1, flush_s=100.0)
    for t, n in ((0.1, 0), (0.2, 1), (0.3, 2)):
        a.record(0, 0, stuck(t, 0, n))
    a.record(0, 0, stuck(0.2, 1, 0))  # its sibling: never restarted
    a.record(0, 1, stuck(0.5, 0, 1))  # the sender that replaced it, counting from 0 again
    b.record(0, 0, stuck(0.4, 0, 3))  # worker 1's connection 0: not worker 0's
    a.close(), b.close()
    df = read_tcp_logs([tmp_path / "a.tcp.csv", tmp_path / "b.tcp.csv"])
    assert cc_restarts(df) == 2 + 0 + 1 + 3
    assert cc_restarts(df.iloc[:0]) == 0  # no sample: no restart
    assert cc_restarts(df.drop(columns=["cc_restarts"])) is None  # a run from before the count was logged


def test_busy_state_reads_the_windows_and_the_rto_share_of_busy_connections_only(tmp_path: Path):
    """Idle samples (nothing unsent or in flight) do not count; the loss state is `ca_state` 4 (TCP_CA_Loss)."""
    import dataclasses

    from testbed.kv.tcplog import busy_state

    log = TcpLog(tmp_path / "a.tcp.csv", "prfaas", 0, flush_s=100.0)
    for i, (cwnd, ca) in enumerate([(4, 4), (6, 4), (10, 0), (20, 3), (40, 0)]):  # busy: 2 of 5 after an RTO
        log.record(0, 0, dataclasses.replace(sample(0.1 * (i + 1), 0, unacked=1448 * cwnd), cwnd=cwnd, ca_state=ca,
                                             mss=1448 if i else 0))  # 0: a sample that did not read it
    log.record(0, 1, dataclasses.replace(sample(0.1, 1), cwnd=2, ca_state=4, bytes_acked=5))  # idle: left out
    log.close()
    state = busy_state(read_tcp_logs([tmp_path / "a.tcp.csv"]))
    assert state == {"busy_samples": 5, "loss_state_share": pytest.approx(0.4), "cwnd_p50_segments": 10.0,
                     "cwnd_p10_segments": pytest.approx(4.8), "mss_p50_bytes": 1448.0}
    assert busy_state(None) is None and busy_state(read_tcp_logs([])) is None
