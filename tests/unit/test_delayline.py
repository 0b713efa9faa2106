"""The delay line's pure parts: config mapping, jitter moments, release schedule, loss models, netlink codec."""

from __future__ import annotations

import random
import socket
import statistics
import struct

import pytest

from testbed.net import nfqueue
from testbed.net.delayline import (
    ADMITTED,
    LOST,
    OVERFLOW,
    SEGMENT_KEY,
    SPLIT,
    DelayLineConfig,
    DelaySchedule,
    LossModel,
    StampClock,
    build_config,
    jitter_unit_sample,
    release_runs,
    rule_spec,
    segment_queue_num,
    wire_packets,
)
from testbed.scenario import LinkDirectionSpec, LossSpec
from testbed.units import QueueLimit


def test_build_config_copies_delay_jitter_loss_from_the_wan_direction() -> None:
    loss = LossSpec("gilbert-elliott", p=0.01, r=0.3, bad_loss=0.5)
    d = LinkDirectionSpec(rate_bps=10e9, delay_s=0.012, jitter_s=0.002, jitter_distribution="pareto",
                          reorder=True, loss=loss, queue=QueueLimit("packets", 500))
    c = build_config(d, seed=7)
    assert (c.delay_s, c.jitter_s, c.jitter_distribution, c.reorder, c.loss, c.seed) == (
        0.012, 0.002, "pareto", True, loss, 7)
    assert c.limit_packets == 100_000
    assert build_config(d, limit_packets=123).limit_packets == 123


def test_config_round_trips_through_json() -> None:
    c = DelayLineConfig(delay_s=0.01, jitter_s=0.001, loss=LossSpec("random", 0.02), seed=3)
    import json
    assert DelayLineConfig.from_dict(json.loads(c.to_json())) == c


@pytest.mark.parametrize("bad", [dict(delay_s=-1), dict(delay_s=0.01, jitter_s=-0.1),
                                 dict(delay_s=0.01, jitter_distribution="gamma"),
                                 dict(delay_s=0.01, limit_packets=0)])
def test_config_refuses_out_of_range_values(bad: dict) -> None:
    with pytest.raises(ValueError):
        DelayLineConfig(**bad)


@pytest.mark.parametrize("dist,mean,std", [("normal", 0.0, 1.0), ("uniform", 0.0, 1 / 3 ** 0.5),
                                           ("pareto", 0.0, None), ("paretonormal", 0.0, None)])
def test_jitter_samples_have_netem_moments(dist: str, mean: float, std: float | None) -> None:
    rng = random.Random(5)
    xs = [jitter_unit_sample(rng, dist) for _ in range(100_000)]
    assert max(abs(x) for x in xs) <= 32767 / 8192 + 1e-9
    if std is not None:
        assert abs(statistics.fmean(xs) - mean) < 0.01
        assert statistics.pstdev(xs) == pytest.approx(std, rel=0.02)
    else:  # Pareto(a=3) shifted to mean 0, clipped at +4 like netem's int16 table (mean -0.03)
        assert -0.05 < statistics.fmean(xs) < 0.0
        assert 0.75 < statistics.pstdev(xs) < 0.9
        assert sorted(xs)[len(xs) // 2] < -0.1, "right-skewed: the median sits below the mean"
        if dist == "pareto":
            assert min(xs) >= -2 / 3 - 1e-9


def _drain(s: DelaySchedule, step_s: float = 0.0005) -> list[int]:
    """Every held packet's id, in release order, releasing every `step_s` from t = 0."""
    released: list[int] = []
    t = 0.0
    while s.queued_packets:
        t += step_s
        released += s.release(t)
    return released


def test_in_order_schedule_never_releases_a_packet_before_the_one_ahead() -> None:
    s = DelaySchedule(DelayLineConfig(delay_s=0.010, jitter_s=0.005, seed=2))
    for i in range(2000):
        assert s.admit(i * 1e-4, i, 1500) == ADMITTED
    dues = [due for due, _, _ in s.fifo]
    assert dues == sorted(dues)
    assert all(due >= i * 1e-4 for i, due in enumerate(dues))
    assert _drain(s) == list(range(2000))
    assert s.forwarded_bytes == 2000 * 1500 and s.queued_bytes == 0


def test_schedule_without_jitter_releases_exactly_at_arrival_plus_delay() -> None:
    s = DelaySchedule(DelayLineConfig(delay_s=0.020))
    s.admit(1.0, 10, 100)
    s.admit(1.001, 11, 100)
    assert s.next_due_s() == pytest.approx(1.020)
    assert s.release(1.0199) == []
    assert s.release(1.0200) == [10]
    assert s.release(1.0215) == [11]


def test_switching_reorder_off_keeps_arrival_order_and_never_makes_a_packet_earlier() -> None:
    """Held jittered packets leave the heap for the FIFO in id order (the in-order batch verdict accepts
    every id up to the last), each due no earlier than its own time nor the one ahead's; new packets follow."""
    s = DelaySchedule(DelayLineConfig(delay_s=0.010, jitter_s=0.005, reorder=True, seed=3))
    for i in range(200):
        assert s.admit(i * 1e-4, i, 1500) == ADMITTED
    own_due = {pid: due for due, pid, _ in s.heap}
    assert sorted(own_due, key=own_due.get) != sorted(own_due)  # jitter reordered them
    s.update(DelayLineConfig(delay_s=0.010, jitter_s=0.005, reorder=False, seed=3))
    assert not s.heap and [pid for _, pid, _ in s.fifo] == list(range(200))
    dues = [due for due, _, _ in s.fifo]
    assert dues == sorted(dues) and all(due >= own_due[pid] for due, pid, _ in s.fifo)
    s.admit(0.0201, 200, 1500)
    assert s.fifo[-1][1] == 200 and s.fifo[-1][0] >= dues[-1]
    assert _drain(s) == list(range(201))


@pytest.mark.parametrize("reorder", [False, True])
def test_coalescing_takes_only_packets_behind_a_due_head(reorder: bool) -> None:
    """The head never leaves before its due time (TCP's min RTT would catch it); once it is due, the
    packets due within the coalescing window leave with it, and no packet leaves more than the window early."""
    s = DelaySchedule(DelayLineConfig(delay_s=0.010, reorder=reorder))
    for i, t in enumerate((1.0, 1.00005, 1.00009, 1.0002)):
        assert s.admit(t, i, 1500) == ADMITTED
    assert s.release(1.00999, coalesce_s=0.0001) == []  # head 10 us short of due: nothing, window or not
    assert s.queued_packets == 4
    assert s.release(1.010, coalesce_s=0.0001) == [0, 1, 2]  # due at 1.01005 and 1.01009: within 0.1 ms
    assert s.release(1.0101, coalesce_s=0.0001) == []  # the next head is due at 1.0102
    assert s.release(1.0102, coalesce_s=0.0001) == [3]
    assert s.forwarded_packets == 4 and s.queued_bytes == 0


def test_reorder_releases_by_own_due_time() -> None:
    s = DelaySchedule(DelayLineConfig(delay_s=0.010, jitter_s=0.008, reorder=True, seed=4))
    for i in range(500):
        s.admit(i * 1e-4, i, 100)
    out = s.release(10.0)
    assert sorted(out) == list(range(500))
    assert out != list(range(500)), "with reorder and jitter >> spacing some packets overtake"


def test_overflow_drops_beyond_the_packet_limit() -> None:
    s = DelaySchedule(DelayLineConfig(delay_s=1.0, limit_packets=10))
    results = [s.admit(0.0, i, 100) for i in range(15)]
    assert results.count(ADMITTED) == 10 and results.count(OVERFLOW) == 5
    assert s.stats().dropped_overflow == 5 and s.stats().queued_packets == 10


def test_random_loss_rate_matches_configuration() -> None:
    s = DelaySchedule(DelayLineConfig(delay_s=0.0, loss=LossSpec("random", 0.05), seed=9))
    n = 100_000
    lost = sum(s.admit(0.0, i, 1) == LOST for i in range(n))
    assert lost / n == pytest.approx(0.05, rel=0.05)


def test_gilbert_elliott_loss_has_stationary_rate_and_bursts() -> None:
    spec = LossSpec("gilbert-elliott", p=0.01, r=0.2, bad_loss=0.8, good_loss=0.001)
    m = LossModel(spec, random.Random(3))
    n = 400_000
    seq = [m.lose() for _ in range(n)]
    assert sum(seq) / n == pytest.approx(spec.mean_rate, rel=0.08)
    p_loss_after_loss = sum(a and b for a, b in zip(seq, seq[1:])) / max(1, sum(seq[:-1]))
    assert p_loss_after_loss > 5 * spec.mean_rate, "losses come in bursts"


# ----------------------------------------------------------------- loss per wire packet (GSO segments)

GSO_45 = 52 + 45 * 1448  # a full 64 KiB TSO super-packet: 45 segments of 1448 B payload behind 52 B of headers


def test_wire_packets_counts_the_segments_of_a_tso_super_packet() -> None:
    assert [wire_packets(n) for n in (40, 1500, 1501, 52 + 2 * 1448, 52 + 2 * 1448 + 1, GSO_45)] == [1, 1, 2, 2, 3, 45]
    assert wire_packets(40 + 10 * 1460) == 11  # TCP without timestamps: one too many (reconciled at the split)
    assert wire_packets(52 + 6 * 8948, mtu_bytes=9000) == 6


def test_random_loss_is_the_same_bernoulli_process_whatever_the_grouping() -> None:
    """The geometric gaps make lost_among(45) exactly 45 single-packet decisions: same seed, same losses."""
    spec = LossSpec("random", 0.01)
    grouped, single = LossModel(spec, random.Random(5)), LossModel(spec, random.Random(5))
    by_45 = [45 * k + i for k in range(4000) for i in grouped.lost_among(45)]
    one_by_one = [k for k in range(45 * 4000) if single.lose()]
    assert by_45 == one_by_one
    assert len(by_45) / (45 * 4000) == pytest.approx(0.01, rel=0.06)
    assert LossModel(LossSpec("random", 1.0), random.Random(1)).lost_among(3) == [0, 1, 2]
    assert LossModel(LossSpec("random", 0.0), random.Random(1)).lost_among(45) == []


def test_gilbert_elliott_steps_once_per_wire_packet() -> None:
    spec = LossSpec("gilbert-elliott", p=0.01, r=0.2, bad_loss=0.8, good_loss=0.001)
    m = LossModel(spec, random.Random(3))
    lost = sum(len(m.lost_among(45)) for _ in range(8000))
    assert lost / (45 * 8000) == pytest.approx(spec.mean_rate, rel=0.1)


def test_super_packets_are_split_when_a_segment_is_lost_and_only_lost_segments_dropped() -> None:
    s = DelaySchedule(DelayLineConfig(delay_s=0.0, loss=LossSpec("random", 0.01), seed=4))
    splits = dropped = 0
    for i in range(3000):
        r = s.admit(0.0, i, GSO_45)
        assert r in (ADMITTED, SPLIT), "a super-packet is never lost whole"
        if r == SPLIT:
            splits += 1
            segs = [(SEGMENT_KEY + 45 * i + j, 1500) for j in range(45)]
            lost = s.admit_segments(segs)
            assert 1 <= len(lost) < 10 and set(lost) <= {k for k, _ in segs}
            dropped += len(lost)
    assert splits / 3000 == pytest.approx(1 - 0.99 ** 45, abs=0.04)  # ~36% split, not 1% lost whole
    assert dropped / (45 * 3000) == pytest.approx(0.01, rel=0.1)  # the configured rate, per wire packet
    st = s.stats()
    assert (st.split_packets, st.dropped_loss) == (splits, dropped)
    assert st.forwarded_packets == 0 and len(s.release(1.0)) == 3000 - splits + 45 * splits - dropped


def test_split_segments_leave_in_the_super_packets_place_at_its_arrival_time() -> None:
    s = DelaySchedule(DelayLineConfig(delay_s=0.010, loss=LossSpec("random", 0.01), seed=4))
    pid = 0
    while s.admit(pid * 1e-4, pid, GSO_45) != SPLIT:
        pid += 1
    t_split = pid * 1e-4
    segs = [(SEGMENT_KEY + j, 1500) for j in range(45)]
    lost = set(s.admit_segments(segs))
    kept = [k for k, _ in segs if k not in lost]
    later = [i for i in range(pid + 1, pid + 4) if s.admit(t_split + 1e-5 * (i - pid), i, 1000) == ADMITTED]
    before = s.release(t_split + 0.010 - 1e-6)
    assert before == list(range(pid)), "nothing of the split packet leaves before its arrival + delay"
    assert s.release(t_split + 0.010) == kept, "its segments leave at its arrival + delay..."
    assert s.release(1.0) == later, "...and ahead of everything that arrived after it"


def test_more_segments_than_counted_get_their_own_draws() -> None:
    s = DelaySchedule(DelayLineConfig(delay_s=0.0, loss=LossSpec("random", 1.0)))
    assert s.admit(0.0, 1, 3000) == SPLIT  # counted as 3 wire packets, all lost
    segs = [(SEGMENT_KEY + i, 800) for i in range(5)]  # came back as 5 (another protocol's headers)
    assert s.admit_segments(segs) == [k for k, _ in segs] and s.stats().dropped_loss == 5
    with pytest.raises(RuntimeError, match="without a preceding SPLIT"):
        s.admit_segments(segs)


def test_release_runs_keep_the_order_across_both_queues() -> None:
    keys = [1, 2, SEGMENT_KEY + 5, SEGMENT_KEY + 6, 3, SEGMENT_KEY + 7]
    assert release_runs(keys) == [(False, [1, 2]), (True, [5, 6]), (False, [3]), (True, [7])]
    assert release_runs([4, 5]) == [(False, [4, 5])]


def test_segment_queue_and_requeue_verdict() -> None:
    assert segment_queue_num(10) == 10 + 32768
    with pytest.raises(ValueError, match="queue_num must be in 0..32767"):
        segment_queue_num(40000)
    msg = nfqueue.requeue_verdict(10, 77, segment_queue_num(10))
    code, pid = struct.unpack_from("!II", msg, 24)
    assert (code & 0xFF, code >> 16, bool(code & 0x8000), pid) == (nfqueue.NF_QUEUE, 32778, True, 77)
    assert struct.unpack_from("=H", msg, 4)[0] == (3 << 8) | 1  # a single (not batch) verdict


def test_same_seed_gives_the_same_schedule() -> None:
    def run(seed: int) -> list:
        s = DelaySchedule(DelayLineConfig(delay_s=0.01, jitter_s=0.003, loss=LossSpec("random", 0.1), seed=seed))
        return [(s.admit(i * 1e-3, i, 1), s.last_due_s) for i in range(200)]

    assert run(1) == run(1) and run(1) != run(2)


def test_update_applies_new_delay_to_new_packets_only() -> None:
    s = DelaySchedule(DelayLineConfig(delay_s=0.050))
    s.admit(0.0, 1, 10)
    s.update(DelayLineConfig(delay_s=0.010))
    s.admit(0.001, 2, 10)
    assert [due for due, _, _ in s.fifo] == [pytest.approx(0.050), pytest.approx(0.050)], "in order: waits"
    s.update(DelayLineConfig(delay_s=0.010, loss=LossSpec("random", 1.0)))
    assert s.admit(0.1, 3, 10) == LOST


def test_rule_is_tagged_and_bypasses_when_no_listener() -> None:
    spec = rule_spec("wan0", 3)
    assert spec[:3] == ["FORWARD", "-o", "wan0"]
    assert "prfaas-delayline" in spec and "--queue-bypass" in spec
    assert spec[spec.index("--queue-num") + 1] == "3"


# ------------------------------------------------------------------------------------ netlink codec

def _packet_msg(packet_id: int, cap_len: int | None, payload: bytes) -> bytes:
    attrs = nfqueue.attr(nfqueue.NFQA_PACKET_HDR, struct.pack("!IHB", packet_id, 0x0800, 3))
    attrs += nfqueue.attr(nfqueue.NFQA_PAYLOAD, payload)
    if cap_len is not None:
        attrs += nfqueue.attr(nfqueue.NFQA_CAP_LEN, struct.pack("!I", cap_len))
    return nfqueue.message(nfqueue.TYPE_PACKET, 0, attrs)


def test_parse_packets_reads_id_and_full_length_from_cap_len() -> None:
    buf = _packet_msg(77, 65160, b"\x45") + _packet_msg(78, None, b"x" * 84)
    assert nfqueue.parse_packets(buf, len(buf)) == [(77, 65160, 0.0), (78, 84, 0.0)]


def test_parse_packets_skips_error_replies_to_verdicts_on_flushed_packets() -> None:
    err = struct.pack("=IHHIIi", 36, nfqueue.NLMSG_ERROR, 0, 1, 0, -2) + b"\0" * 16
    buf = err + _packet_msg(9, 1500, b"\x45")
    assert nfqueue.parse_packets(buf, len(buf)) == [(9, 1500, 0.0)]


def test_verdict_encoding_matches_kernel_layout() -> None:
    msg = nfqueue.verdict(5, 0x01020304, nfqueue.NF_ACCEPT, batch=True)
    length, mtype, flags = struct.unpack_from("=IHH", msg)
    assert length == len(msg) == 32
    assert mtype == (3 << 8) | 3 and flags == nfqueue.NLM_F_REQUEST
    family, version, res_id = struct.unpack_from("!BBH", msg, 16)
    assert (family, version, res_id) == (socket.AF_UNSPEC, 0, 5)
    alen, atype, v, pid = struct.unpack_from("=HH", msg, 20) + struct.unpack_from("!II", msg, 24)
    assert (alen, atype, v, pid) == (12, 2, 1, 0x01020304)
    single = nfqueue.verdict(5, 9, nfqueue.NF_DROP)
    assert struct.unpack_from("=H", single, 4)[0] == (3 << 8) | 1
    assert struct.unpack_from("!I", single, 24)[0] == 0


def test_config_params_sets_copy_mode_maxlen_and_gso_flag() -> None:
    msg = nfqueue.config_params(2, nfqueue.NFQNL_COPY_PACKET, 1, 200_000, nfqueue.NFQA_CFG_F_GSO)
    attrs = {}
    off = 20
    while off < len(msg):
        alen, atype = struct.unpack_from("=HH", msg, off)
        attrs[atype] = msg[off + 4: off + alen]
        off += (alen + 3) & ~3
    assert struct.unpack("!IB", attrs[nfqueue.NFQA_CFG_PARAMS]) == (1, nfqueue.NFQNL_COPY_PACKET)
    assert struct.unpack("!I", attrs[nfqueue.NFQA_CFG_QUEUE_MAXLEN]) == (200_000,)
    assert struct.unpack("!I", attrs[nfqueue.NFQA_CFG_FLAGS]) == (4,)
    assert struct.unpack("!I", attrs[nfqueue.NFQA_CFG_MASK]) == (4,)
    bind = nfqueue.config_bind(2)
    assert struct.unpack_from("=HH", bind, 4) == ((3 << 8) | 2, nfqueue.NLM_F_REQUEST | nfqueue.NLM_F_ACK)
    assert struct.unpack_from("!BxH", bind, 24) == (nfqueue.NFQNL_CFG_CMD_BIND, 0)


def test_parse_packets_reads_the_kernel_arrival_timestamp() -> None:
    attrs = nfqueue.attr(nfqueue.NFQA_PACKET_HDR, struct.pack("!IHB", 5, 0x0800, 3))
    attrs += nfqueue.attr(nfqueue.NFQA_TIMESTAMP, struct.pack("!QQ", 1_700_000_000, 250_000))
    attrs += nfqueue.attr(nfqueue.NFQA_PAYLOAD, b"\x45") + nfqueue.attr(nfqueue.NFQA_CAP_LEN, struct.pack("!I", 1500))
    buf = nfqueue.message(nfqueue.TYPE_PACKET, 0, attrs)
    [(pid, length, ts)] = nfqueue.parse_packets(buf, len(buf))
    assert (pid, length) == (5, 1500) and ts == pytest.approx(1_700_000_000.25)


@pytest.mark.parametrize("step_s", [0.0005, -0.0005, 0.3, -0.3])
def test_kernel_stamps_never_make_a_packet_early_across_a_realtime_step(step_s: float) -> None:
    # realtime = monotonic + 1000 s, stepped by step_s at t = 10 s (NTP, a VM's clock sync); the offset is
    # read after every receive (every 100 us), realtime up to 2 us after monotonic, as the line does. Each
    # packet is stamped (realtime) when it arrives and read 0-3 ms later: its arrival on the monotonic
    # clock is never before the true one by more than a reading's error, and is late only across the
    # step, by at most the step, for at most two windows. Converted with the offset read with it (the
    # line's first version), a forward step made packets early by the whole step.
    clock = StampClock(window_s=1.0)
    rng = random.Random(1)
    worst_early_s = naive_early_s = 0.0
    late_at_s = []

    def realtime(mono: float) -> float:
        return mono + 1000.0 + (step_s if mono >= 10.0 else 0.0)

    t = 5.0
    while t < 14.0:
        t += 1e-4
        true_arrival = t - rng.uniform(0, 0.003)
        rt = realtime(t) + rng.uniform(0, 2e-6)
        arrival, stamped = clock.arrival_s(realtime(true_arrival), clock.offset_s(t, rt), t)
        worst_early_s = max(worst_early_s, true_arrival - arrival)
        naive_early_s = max(naive_early_s, true_arrival - (realtime(true_arrival) - (rt - t)))
        if arrival - true_arrival > 1e-5:
            assert not stamped or arrival - true_arrival <= abs(step_s) + 3e-6
            late_at_s.append(t)
    assert worst_early_s <= 2e-6
    assert late_at_s and 10.0 <= min(late_at_s) and max(late_at_s) <= 10.0 + 2.0 + 0.003
    if step_s > 0:
        assert naive_early_s >= step_s - 3e-6
    # a stamp older than the window, or none, is not used: the packet arrives now
    assert clock.arrival_s(0.0, clock.offset_s(t, realtime(t)), t) == (t, False)
    assert clock.arrival_s(realtime(t - 1.5), clock.offset_s(t, realtime(t)), t) == (t, False)


def test_config_params_without_ack_for_runtime_changes() -> None:
    msg = nfqueue.config_params(1, nfqueue.NFQNL_COPY_PACKET, 1, 5000, nfqueue.NFQA_CFG_F_GSO, ack=False)
    assert struct.unpack_from("=H", msg, 6)[0] == nfqueue.NLM_F_REQUEST


def test_stats_file_round_trips_counters_and_state(tmp_path) -> None:
    import mmap
    import os

    from testbed.net.delayline import STATE_RUNNING, _write_stats, read_stats_file

    path = tmp_path / "stats"
    path.write_bytes(b"\0" * 128)
    fd = os.open(path, os.O_RDWR)
    try:
        buf = memoryview(mmap.mmap(fd, 128))
        s = DelaySchedule(DelayLineConfig(delay_s=1.0, limit_packets=2))
        for i in range(3):
            s.admit(0.0, i, 1000)
        seq = _write_stats(buf, 0, STATE_RUNNING, s)
        assert seq == 2
        state, stats = read_stats_file(fd)
        assert state == STATE_RUNNING
        assert stats == s.stats() and stats.queued_bytes == 2000 and stats.dropped_overflow == 1
        buf.release()
    finally:
        os.close(fd)


def test_stale_control_dirs_are_removed_only_when_old_and_their_line_is_gone(tmp_path) -> None:
    import os

    from testbed.net.delayline import _STATS, remove_stale_control_dirs

    def make(name: str, pid: int, age_s: float) -> None:
        d = tmp_path / name
        d.mkdir()
        (d / "stats").write_bytes(_STATS.pack(2, 2, 0, 0, 0, 0, 0, 0, 0, 0.0, pid).ljust(128, b"\0"))
        t = os.path.getmtime(d) - age_s
        os.utime(d, (t, t))

    make("prfaas-delayline-q1-dead", 2**22 + 12345, 600)  # beyond pid_max on most hosts: not running
    make("prfaas-delayline-q2-alive", os.getpid(), 600)
    make("prfaas-delayline-q3-young", 2**22 + 12345, 0)
    make("someone-else", 2**22 + 12345, 600)
    assert remove_stale_control_dirs(str(tmp_path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prfaas-delayline-q2-alive", "prfaas-delayline-q3-young",
                                                          "someone-else"]


def test_a_host_without_dev_shm_makes_cleans_and_accepts_control_dirs_in_the_temp_folder(tmp_path, monkeypatch) -> None:
    """One choice of folder (`state.delayline_dir_base`): a line's directory, `prfaas clean`'s sweep of stale ones and the
    state files' reader agree. Before 2026-12-07 clean looked only in /dev/shm, where such a host's lines made none."""
    import os

    from testbed.net import state
    from testbed.net.delayline import _STATS, remove_stale_control_dirs

    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(state, "delayline_dir_bases", lambda: (str(tmp_path / "no-shm"), str(temp)))
    assert state.delayline_dir_base() == str(temp)
    stale = temp / "prfaas-delayline-q7-dead"
    stale.mkdir()
    (stale / "stats").write_bytes(_STATS.pack(2, 2, 0, 0, 0, 0, 0, 0, 0, 0.0, 2**22 + 12345).ljust(128, b"\0"))
    os.utime(stale, (os.path.getmtime(stale) - 600,) * 2)
    assert state._delayline_dir(str(stale)) == str(stale)
    with pytest.raises(ValueError, match=f"is not under {tmp_path / 'no-shm'} or {temp}, where delay lines"):
        state._delayline_dir(str(tmp_path / "prfaas-delayline-q7-x"))
    assert remove_stale_control_dirs() == 1 and not stale.exists()
    (tmp_path / "no-shm").mkdir()  # a host with /dev/shm: the lines use it, and clean looks there
    assert state.delayline_dir_base() == str(tmp_path / "no-shm")
