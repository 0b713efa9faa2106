"""The multi-connection KV transport on loopback: real TCP sockets, real tensors, real bytes."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from testbed.kv.cache import KVCache, LayerKV
from testbed.kv.transport import (
    PROBE_PREFIX, SO_MAX_PACING_RATE, FillStop, KVReceiver, KVSender, ReceivedKV, TransportError, _FillWatch, ack_rate_bps, tcp_info,
)
from testbed.kv.wire import DataHeader, Trailer, encode_data_header, encode_trailer, profile_frames

torch.set_num_threads(1)
LOOPBACK = "127.0.0.1"


def _cache(request_id: str = "req-1", tokens: int = 2048) -> KVCache:
    g = torch.Generator().manual_seed(3)
    return KVCache(request_id, "toy", tokens, [
        LayerKV(0, "linear", {"state": torch.randn(4, 32, 32, generator=g), "conv": torch.randn(3, 64, generator=g).bfloat16()}),
        LayerKV(1, "gqa", {"k": torch.randn(tokens, 4, 64, generator=g).bfloat16(), "v": torch.randn(tokens, 4, 64, generator=g).bfloat16()}),
        LayerKV(2, "mla", {"latent": torch.randn(tokens, 128, generator=g).bfloat16(), "k_rope": torch.randn(tokens, 16, generator=g).bfloat16()}),
        LayerKV(3, "swa", {"k": torch.randn(64, 4, 64, generator=g).bfloat16(), "v": torch.randn(64, 4, 64, generator=g).bfloat16()}),
    ])


class Results:
    def __init__(self) -> None:
        self.items: dict[str, ReceivedKV] = {}
        self.cond = threading.Condition()

    def __call__(self, rid: str, r: ReceivedKV) -> None:
        with self.cond:
            self.items[rid] = r
            self.cond.notify_all()

    def wait(self, rid: str, timeout_s: float = 20.0) -> ReceivedKV:
        with self.cond:
            assert self.cond.wait_for(lambda: rid in self.items, timeout_s), f"{rid} never completed"
            return self.items[rid]


@pytest.fixture
def receiver() -> Iterator[tuple[KVReceiver, Results]]:
    results = Results()
    rx = KVReceiver(LOOPBACK, 0, results).start()
    try:
        yield rx, results
    finally:
        rx.close()


def _kv_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kv-")]


def test_kv_crosses_n_connections_and_arrives_bit_identical(receiver: tuple[KVReceiver, Results]) -> None:
    rx, results = receiver
    cache = _cache()
    with KVSender(LOOPBACK, rx.port, connections=3, chunk_bytes=64 << 10) as tx:
        stats = tx.send_cache(cache)
        spread = tx.sent_bytes_by_connection()
    got = results.wait("req-1")
    # every byte went over one of the 3 connections; how they share an uncongested path is up to the pull
    # scheduler (one connection may carry it all when no socket ever fills): the next test makes them fill.
    # Exact: a connection counts a frame when it takes it (the count once trailed sendmsg, and `finish` could
    # return first: 4 in 1200 runs under load missed 33-131 kB)
    assert len(spread) == 3 and sum(spread) == stats.wire_bytes
    assert stats.ok and got.ok and got.reason is None
    # the sender's connect() returns once the kernel completed the handshake, before the receiver's accept
    # thread took the connection: when one connection carried the whole transfer the test may get here
    # first (`== 3` read at once failed 3 in 1200 runs under load with 2); wait for it, boundedly
    deadline = time.monotonic() + 5.0
    while rx.connections_accepted < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rx.connections_accepted == 3
    assert got.kv_bytes == stats.kv_bytes == cache.nbytes
    assert got.wire_bytes == stats.wire_bytes > cache.nbytes
    assert (got.wire_bytes - cache.nbytes) / cache.nbytes < 0.01
    assert got.cache is not None and (got.cache.tokens, got.cache.model) == (2048, "toy")
    for a, b in zip(cache.layers, got.cache.layers):
        for name, t in a.tensors.items():
            assert torch.equal(t, b.tensors[name])
    assert stats.start_s <= got.first_frame_s <= got.complete_s <= stats.end_s


def test_a_connection_that_cannot_take_more_pulls_no_more_and_the_others_carry_the_rest() -> None:
    """The pull model: a receiver that does not read fills each connection's small socket buffers, so
    no connection can take the whole transfer and the frames must spread (deterministic, unlike an
    uncongested path where one connection may legitimately carry everything)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)  # before listen: a small window
    server.bind((LOOPBACK, 0))
    server.listen(8)
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.extend(server.accept()[0] for _ in range(3)), daemon=True).start()
    cache = _cache()  # 2.7 MB
    per_connection_cap = 1 << 20  # receive window + notsent_lowat + one batch, generously
    tx = KVSender(LOOPBACK, server.getsockname()[1], connections=3, chunk_bytes=64 << 10, notsent_lowat_bytes=64 << 10)
    try:
        for layer in cache.layers:
            tx.send_layer("stuck", layer)
        deadline = time.monotonic() + 20
        while sum(1 for b in tx.sent_bytes_by_connection() if b > 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # let every writer run into its full socket
        spread = tx.sent_bytes_by_connection()
        assert sum(1 for b in spread if b > 0) >= 2, spread
        assert max(spread) <= per_connection_cap < cache.nbytes, spread
        assert sum(spread) < cache.nbytes  # nothing reads: the rest is still queued, not lost or faked as sent
    finally:
        tx.close()
        for s in accepted:
            s.close()
        server.close()


def test_profile_mode_sends_real_bytes_and_delivers_a_verified_count(receiver: tuple[KVReceiver, Results]) -> None:
    rx, results = receiver
    with KVSender(LOOPBACK, rx.port, connections=2, chunk_bytes=256 << 10) as tx:
        for layer in range(4):
            tx.send_bytes("p-1", layer, "mla" if layer % 2 else "linear", 1_000_003)
        stats = tx.finish("p-1", tokens=4096, model="paper-1t-hybrid")
        congestion = tx.congestion()
    got = results.wait("p-1")
    assert stats.ok and got.ok and got.cache is None
    assert got.kv_bytes == stats.kv_bytes == 4 * 1_000_003
    assert (got.tokens, got.model) == (4096, "paper-1t-hybrid")
    assert set(congestion) >= {"retransmits", "rtt_ms", "cwnd", "send_queue_bytes", "goodput_bps"}
    assert congestion["cwnd"] > 0 and congestion["rtt_ms"] > 0



def test_a_probe_measures_the_unloaded_rtt_and_the_delivery_rate_of_the_connections_that_carried_it(
        receiver: tuple[KVReceiver, Results]) -> None:
    rx, results = receiver
    with KVSender(LOOPBACK, rx.port, connections=2, chunk_bytes=256 << 10) as tx:
        # The rate needs the 1-ms sampler to run while the burst (3-16 ms on loopback) is acknowledged; a host
        # stall over all of it leaves no sample with acknowledged bytes and the probe rightly answers 0 (no
        # measurement: the estimator ignores it). Under load (2 cores, load average 17) that was 3 in 600
        # probes, so up to 3 tries: a prober that never measures a rate still fails every one.
        for tries in range(1, 4):
            ans = tx.probe(4 << 20, pings=2, timeout_s=10.0)
            if ans["rate_bps"] > 0:
                break
        retransmits_total = sum(s.total_retrans for s in tx.tcp_infos())
        deadline = time.monotonic() + 2.0  # the last acknowledgements may trail the receiver's verdict
        while (after := tx.congestion())["inflight_bytes"] and time.monotonic() < deadline:
            time.sleep(0.01)
    assert ans["ok"] and ans["bytes"] == 4 << 20 and ans["reason"] is None
    assert ans["rate_bps"] > 0 and 1 <= ans["connections"] <= 2 and ans["rtt_ms"] > 0
    # the burst's own retransmits, a part of the connections' cumulative count (was `== 0`: loopback TCP
    # retransmits under load, 1-9 in 15% of 600 probes at load average 17, all of them also in total_retrans)
    assert 0 <= ans["retransmits"] <= retransmits_total
    assert 0 < ans["idle_rtt_ms"] < 1000  # two one-byte transfers, round trip to the receiver's verdict
    if ans["retransmits"] == 0:  # nothing lost, nothing SACKed: delivered bytes are the acknowledged bytes
        assert ans["acked_rate_bps"] == ans["rate_bps"]
    probes = [rid for rid in results.items if rid.startswith(PROBE_PREFIX)]
    assert len(probes) == 3 * tries and all(results.items[r].ok for r in probes)  # checked like KV: the pings and the bulk
    assert after["send_queue_bytes"] == 0 and after["queue_rtt_ms"] == 0  # idle: no current RTT of a connection with work


def test_a_paced_sender_caps_each_connection_at_its_share_and_its_probe_reads_the_pace(receiver: tuple[KVReceiver, Results]) -> None:
    """`KVSender.pace`: SO_MAX_PACING_RATE on every connection at its share of the rate (bytes/s), which the
    kernel paces without an fq qdisc; a probe over loopback (far faster than the cap) then reads about the pace,
    not loopback's rate. `pace(None)` lifts the cap (~0)."""
    rx, _ = receiver
    with KVSender(LOOPBACK, rx.port, connections=2, chunk_bytes=256 << 10) as tx:
        tx.pace(400e6)
        caps = [struct.unpack("Q", c.sock.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, 8))[0] for c in tx._conns]
        assert caps == [25_000_000, 25_000_000]  # 400 Mbit/s over two connections: 25 MB/s each
        for _ in range(3):  # a host stall over the whole burst leaves no rate (see the test above): up to 3 tries
            ans = tx.probe(8 << 20, pings=2, timeout_s=10.0)
            if ans["rate_bps"] > 0:
                break
        assert ans["ok"] and 0.5 * 400e6 <= ans["rate_bps"] <= 2 * 400e6, ans["rate_bps"]  # fastest 5-ms span; unpaced: 10+ Gbit/s
        assert ans["seconds"] >= 0.8 * (8 << 20) * 8 / 400e6  # 168 ms at the pace; unpaced loopback takes a few
        tx.pace(None)
        caps = [struct.unpack("Q", c.sock.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, 8))[0] for c in tx._conns]
        assert caps == [(1 << 64) - 1] * 2


def test_tcp_info_counts_the_segments_sacked_beyond_the_cumulative_ack_as_delivered() -> None:
    """`delivered_bytes` = tcpi_bytes_acked + tcpi_sacked x tcpi_snd_mss (offsets of Linux's struct tcp_info)."""
    raw = bytearray(232)
    struct.pack_into("<I", raw, 16, 1448)  # snd_mss
    struct.pack_into("<I", raw, 28, 10)  # sacked
    struct.pack_into("<Q", raw, 120, 1_000_000)  # bytes_acked

    class Sock:
        def getsockopt(self, *_: object) -> bytes:
            return bytes(raw)

    s = tcp_info(Sock())  # type: ignore[arg-type]
    assert s is not None and s.bytes_acked == 1_000_000 and s.delivered_bytes == 1_000_000 + 10 * 1448
    struct.pack_into("<I", raw, 28, 0)
    s = tcp_info(Sock())  # type: ignore[arg-type]
    assert s is not None and s.delivered_bytes == s.bytes_acked == 1_000_000


def test_a_repaired_loss_bunches_acknowledged_bytes_but_not_delivered_ones() -> None:
    """Why a probe reads delivered bytes: a path delivers 0.8 MB per ms (6.4 Gbps); a segment lost at 30 ms
    is repaired at 45 ms. The cumulative ACK stands still meanwhile and then jumps by everything SACKed behind
    the hole, so its fastest 20-ms span reads ~1.6x the path; the delivered count grows with the path."""
    delivered, acked, t, d, hole_from = [(0.0, 0)], [(0.0, 0)], 0.0, 0, None
    for ms in range(1, 80):
        t, d = ms / 1000, d + 800_000
        delivered.append((t, d))
        if ms == 30:
            hole_from = acked[-1][1]
        acked.append((t, hole_from if 30 <= ms < 45 else d))
    assert ack_rate_bps(delivered, 0.020) == pytest.approx(6.4e9, rel=0.01)
    assert ack_rate_bps(acked, 0.020) > 1.5 * 6.4e9


def test_the_probe_rate_leaves_out_a_token_buckets_burst_and_the_last_rounds_stragglers() -> None:
    """A shaper passes 4 MB at once (its token bucket, full after idleness), then 0.8 MB per ms (6.4 Gbps);
    the last 10 ms only one connection's stragglers (0.1 MB per ms), then the wait for the verdict. The best
    20-ms span starting 20 ms after the first acknowledged byte is the path's; the maximum over any span
    (the bucket's burst in it), the last span (the stragglers) and the average are not."""
    series, t, acked = [(0.0, 0)], 0.0, 0
    for per_ms in [4e6] + [0.8e6] * 49 + [0.1e6] * 10 + [0.0] * 15:
        t, acked = t + 0.001, acked + int(per_ms)
        series.append((t, acked))
    assert ack_rate_bps(series, 0.020) == pytest.approx(6.4e9, rel=0.01)
    assert 8 * series[-1][1] / series[-1][0] < 6.4e9 * 0.9
    short = series[:4]  # shorter than two windows: the rate over all of it
    assert ack_rate_bps(short, 0.020) == pytest.approx(8 * short[-1][1] / short[-1][0], rel=0.01)
    assert ack_rate_bps(series[:1], 0.020) == 0.0

class CorruptingProxy:
    """Forwards one TCP connection and flips one byte at `flip_at` of the sender -> receiver stream."""

    def __init__(self, target_port: int, flip_at: int) -> None:
        self.listener = socket.create_server((LOOPBACK, 0))
        self.port = self.listener.getsockname()[1]
        self.target_port, self.flip_at = target_port, flip_at
        self.threads = [threading.Thread(target=self._run, daemon=True)]
        self.threads[0].start()

    def _pipe(self, src: socket.socket, dst: socket.socket, flip: bool) -> None:
        seen = 0
        try:
            while data := src.recv(65536):
                if flip and seen <= self.flip_at < seen + len(data):
                    b = bytearray(data)
                    b[self.flip_at - seen] ^= 0x40
                    data = bytes(b)
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _run(self) -> None:
        client, _ = self.listener.accept()
        upstream = socket.create_connection((LOOPBACK, self.target_port))
        back = threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True)
        back.start()
        self._pipe(client, upstream, True)
        back.join(5)
        client.close()
        upstream.close()

    def close(self) -> None:
        self.listener.close()
        for t in self.threads:
            t.join(5)


def test_corrupted_transfer_is_detected_and_never_used(receiver: tuple[KVReceiver, Results]) -> None:
    rx, results = receiver
    proxy = CorruptingProxy(rx.port, flip_at=200_000)  # inside a payload, far from any header
    try:
        with KVSender(LOOPBACK, proxy.port, connections=1) as tx:
            stats = tx.send_cache(_cache("bad-1"))
    finally:
        proxy.close()
    got = results.wait("bad-1")
    assert not got.ok and got.cache is None
    assert "checksum" in (got.reason or "")
    assert not stats.ok and "checksum" in (stats.reason or "")
    assert rx.inflight_bytes == 0


def test_malformed_bytes_drop_only_that_connection(receiver: tuple[KVReceiver, Results]) -> None:
    rx, results = receiver
    absurd = encode_data_header(DataHeader("evil", 0, "gqa", 0, torch.bfloat16, (2**31, 2**31, 2**31), 0, 2**40, 0))
    for garbage in (b"GET / HTTP/1.1\r\n\r\n" + bytes(100), absurd):
        with socket.create_connection((LOOPBACK, rx.port)) as s:
            s.sendall(garbage)
            s.settimeout(5)
            try:
                assert s.recv(10) == b""  # the receiver hung up on it
            except ConnectionResetError:  # ... with our unread bytes still queued
                pass
    assert len(rx.protocol_errors) == 2 and "magic" in rx.protocol_errors[0] and "shape" in rx.protocol_errors[1]
    assert rx.inflight_bytes == 0
    with KVSender(LOOPBACK, rx.port, connections=2) as tx:  # and still serves real senders
        assert tx.send_cache(_cache("after")).ok
    assert results.wait("after").ok


def _drain(c: socket.socket) -> None:
    try:
        while c.recv(1 << 20):
            pass
    except OSError:
        pass


def test_slow_receiver_pushes_back_on_the_sender() -> None:
    server = socket.create_server((LOOPBACK, 0))
    accepted: list[socket.socket] = []
    release = threading.Event()

    def slow_accept() -> None:
        for _ in range(2):
            conn, _ = server.accept()
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            accepted.append(conn)
        release.wait(20)
        for c in accepted:
            threading.Thread(target=_drain, args=(c,), daemon=True).start()

    threading.Thread(target=slow_accept, daemon=True).start()
    big = LayerKV(0, "gqa", {"k": torch.zeros(64 << 10, 8, 64, dtype=torch.bfloat16),
                             "v": torch.zeros(64 << 10, 8, 64, dtype=torch.bfloat16)})  # 128 MiB
    tx = KVSender(LOOPBACK, server.getsockname()[1], connections=2, chunk_bytes=1 << 20, max_queued_bytes=4 << 20)
    try:
        sending = threading.Thread(target=tx.send_layer, args=("slow", big))
        sending.start()
        sending.join(1.0)
        assert sending.is_alive(), "send_layer must block while the receiver does not read"
        c = tx.congestion()
        assert 0 < c["send_queue_bytes"] and tx._queued_bytes <= (4 << 20) + (1 << 20) + 256
        release.set()
        sending.join(30)
        assert not sending.is_alive()
    finally:
        release.set()
        tx.close()
        for s in accepted:
            s.close()
        server.close()


def test_abort_frees_the_receiver_and_reports_failure(receiver: tuple[KVReceiver, Results]) -> None:
    rx, results = receiver
    with KVSender(LOOPBACK, rx.port, connections=2) as tx:
        tx.send_layer("ab-1", _cache().layers[1])
        tx.abort("ab-1", "prefill cancelled")
        got = results.wait("ab-1")
        assert not got.ok and got.reason == "prefill cancelled"
        assert tx.send_cache(_cache("next")).ok  # the connections stay usable
    assert rx.inflight_bytes == 0


def test_incomplete_transfer_times_out_with_a_reason() -> None:
    results = Results()
    with KVReceiver(LOOPBACK, 0, results, request_timeout_s=0.5) as rx:
        with KVSender(LOOPBACK, rx.port, connections=1) as tx:
            tx.send_layer("stalled", _cache().layers[1])  # no finish(): the trailer never comes
            got = results.wait("stalled", timeout_s=10)
    assert not got.ok and "timed out" in (got.reason or "")


def test_a_transfer_whose_connection_closes_fails_at_once_and_frees_its_memory() -> None:
    """A sender fails as a whole when a connection fails, so the receiver fails the transfers that had frames on a
    closed connection at once: a header that announced a tensor, then a close, held its memory until the timeout."""
    results = Results()
    with KVReceiver(LOOPBACK, 0, results, request_timeout_s=300) as rx:
        tx = KVSender(LOOPBACK, rx.port, connections=1)
        tx.send_layer("cut", _cache().layers[1])  # no trailer
        deadline = time.monotonic() + 10
        while rx.inflight_bytes == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rx.inflight_bytes > 0
        tx.close()
        got = results.wait("cut", timeout_s=5)  # not 300 s
        assert not got.ok and "closed before the transfer completed" in (got.reason or "")
        assert rx.inflight_bytes == 0
        with KVSender(LOOPBACK, rx.port, connections=2) as tx2:  # and it still serves
            assert tx2.send_cache(_cache("next")).ok


def test_a_tensor_being_allocated_does_not_stall_another_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new tensor's pages are faulted in when it is allocated (1 GiB: 13.6 s on the 2-core VM); under the receiver's
    lock that stalled every other connection. Here the first allocation waits until another sender's transfer has
    completed: under the lock, that transfer could never complete."""
    from testbed.kv import wire

    real, entered, release = wire.alloc_tensor, threading.Event(), threading.Event()
    calls = []

    def slow_first(shape, dtype):  # type: ignore[no-untyped-def]
        calls.append(shape)
        if len(calls) == 1:
            entered.set()
            assert release.wait(20), "never released"
        return real(shape, dtype)

    monkeypatch.setattr(wire, "alloc_tensor", slow_first)
    results = Results()
    with KVReceiver(LOOPBACK, 0, results) as rx, KVSender(LOOPBACK, rx.port, connections=1) as slow, \
            KVSender(LOOPBACK, rx.port, connections=1) as fast:
        done = threading.Thread(target=lambda: slow.send_cache(_cache("slow")), daemon=True)
        done.start()
        assert entered.wait(10)
        assert fast.send_cache(_cache("fast")).ok  # while the first allocation still waits
        release.set()
        done.join(20)
        assert results.wait("slow").ok and results.wait("fast").ok


def test_a_failing_accept_is_retried_not_the_end_of_the_receiver(caplog: pytest.LogCaptureFixture) -> None:
    """Out of file descriptors (EMFILE), accept() raised and the accept thread returned: the receiver stayed up and
    never accepted again, without a word."""
    import errno
    import logging

    class Flaky:
        def __init__(self, ls: socket.socket) -> None:
            self.ls, self.failures = ls, 3

        def accept(self) -> tuple[socket.socket, tuple[str, int]]:
            if self.failures:
                self.failures -= 1
                raise OSError(errno.EMFILE, "Too many open files")
            return self.ls.accept()

        def __getattr__(self, name: str) -> object:
            return getattr(self.ls, name)

    results = Results()
    rx = KVReceiver(LOOPBACK, 0, results)
    real = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    real.bind((LOOPBACK, 0))
    real.listen(8)
    rx.port, rx._listener = real.getsockname()[1], Flaky(real)  # type: ignore[assignment]
    accept = threading.Thread(target=rx._accept_loop, daemon=True)
    with caplog.at_level(logging.WARNING, logger="testbed.kv.transport"):
        accept.start()
        try:
            with KVSender(LOOPBACK, rx.port, connections=1) as tx:
                assert tx.send_cache(_cache("through")).ok
            assert results.wait("through").ok
        finally:
            rx.close()
            accept.join(5)
    said = [r.getMessage() for r in caplog.records]
    assert sum("accept failed" in m and "Too many open files" in m for m in said) == 1 and any("accepting again" in m for m in said)


def test_connections_past_the_cap_are_closed_and_the_others_served() -> None:
    results = Results()
    with KVReceiver(LOOPBACK, 0, results, max_connections=2) as rx:
        idle = [socket.create_connection((LOOPBACK, rx.port)) for _ in range(2)]
        try:
            with socket.create_connection((LOOPBACK, rx.port)) as third:
                third.settimeout(5)
                try:
                    assert third.recv(10) == b""  # closed as it came
                except ConnectionResetError:
                    pass
        finally:
            for c in idle:
                c.close()
        deadline = time.monotonic() + 5
        while rx._conns and time.monotonic() < deadline:
            time.sleep(0.01)
        with KVSender(LOOPBACK, rx.port, connections=2) as tx:
            assert tx.send_cache(_cache("capped")).ok


def _hung_up(s: socket.socket) -> bool:
    s.settimeout(5)
    try:
        return s.recv(10) == b""
    except ConnectionResetError:  # ... with our unread bytes still queued
        return True


def _data_frame(rid: str) -> bytes:
    (f,) = profile_frames(rid, 0, "gqa", 16, memoryview(bytes(16)), {})
    return f.header + bytes(f.payload)


def _trailer(rid: str) -> bytes:
    return encode_trailer(Trailer(rid, "toy", 0, 1, 1, 16, 0))  # one frame announced, none sent: it stays in flight


def test_data_frames_that_open_requests_past_the_cap_are_refused_and_the_rest_still_served() -> None:
    results = Results()
    with KVReceiver(LOOPBACK, 0, results, max_inflight_requests=3, request_timeout_s=0.5) as rx:
        with socket.create_connection((LOOPBACK, rx.port)) as s:
            s.sendall(b"".join(_data_frame(f"d-{i}") for i in range(4)))
            assert _hung_up(s)
        assert len(rx.protocol_errors) == 1 and rx.protocol_errors[0].endswith(": request 'd-3': 3 transfers in flight already")
        for i in range(3):  # the three it opened had frames on the closed connection: failed at once
            got = results.wait(f"d-{i}", timeout_s=5)
            assert not got.ok and "closed before the transfer completed" in (got.reason or "")
        assert "d-3" not in results.items
        deadline = time.monotonic() + 10  # failed, they are held (to discard late frames) until their trailer or the timeout
        while rx._requests and time.monotonic() < deadline:
            time.sleep(0.05)
        with KVSender(LOOPBACK, rx.port, connections=2) as tx:
            assert tx.send_cache(_cache("after")).ok


def test_trailers_that_open_requests_past_the_cap_are_refused_as_data_frames_are() -> None:
    """Since 2026-12-07: a trailer for an id with no frames before it opens a request too, and it was never capped,
    so a flood of trailers held bookkeeping for as many ids as it named."""
    results = Results()
    with KVReceiver(LOOPBACK, 0, results, max_inflight_requests=3, request_timeout_s=0.5) as rx:
        with socket.create_connection((LOOPBACK, rx.port)) as s:
            s.sendall(b"".join(_trailer(f"t-{i}") for i in range(2)) + _data_frame("d-0") + _trailer("t-2"))
            assert _hung_up(s)
        assert len(rx.protocol_errors) == 1 and rx.protocol_errors[0].endswith(": request 't-2': 3 transfers in flight already")
        assert "t-2" not in results.items
        for rid in ("t-0", "t-1"):  # the two it opened wait for their frame until the timeout
            got = results.wait(rid, timeout_s=10)
            assert not got.ok and "timed out" in (got.reason or "")
        with KVSender(LOOPBACK, rx.port, connections=2) as tx:
            assert tx.send_cache(_cache("after")).ok


def test_a_failed_transfer_held_for_its_trailer_keeps_nothing_of_the_connection_that_closed() -> None:
    """A transfer whose connection closes is failed and held (to discard late frames) until its trailer or
    `request_timeout_s`; it must not hold the closed connection with it: the connection's scratch buffer (up to
    `WireLimits.max_frame_bytes`, 64 MiB, once it has discarded a frame) stayed alive for 300 s per such transfer, outside
    the receive budget (`_RecvRequest.conns`, 2026-12-07)."""
    import gc
    import weakref

    results = Results()
    with KVReceiver(LOOPBACK, 0, results, request_timeout_s=60) as rx:
        with socket.create_connection((LOOPBACK, rx.port)) as s:
            s.sendall(_data_frame("held"))
            deadline = time.monotonic() + 5
            while "held" not in rx._requests and time.monotonic() < deadline:
                time.sleep(0.01)
            with rx._lock:
                (conn,) = rx._conns
            gone = weakref.ref(conn)
            thread = conn.thread
            del conn
        got = results.wait("held", timeout_s=5)
        assert not got.ok and "closed before the transfer completed" in (got.reason or "")
        assert thread is not None
        thread.join(timeout=5)
        del thread
        with socket.create_connection((LOOPBACK, rx.port)):  # the accept loop holds the last connection it accepted
            deadline = time.monotonic() + 5
            while rx.connections_accepted < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        gc.collect()
        assert rx._requests["held"].failed is not None  # still held: no trailer, and the timeout is a minute away
        assert gone() is None, "the failed transfer keeps the closed connection (and its scratch buffer) alive"


def test_receiver_death_fails_the_transfer_without_hanging() -> None:
    results = Results()
    rx = KVReceiver(LOOPBACK, 0, results).start()
    tx = KVSender(LOOPBACK, rx.port, connections=2, ack_timeout_s=10)
    try:
        tx.send_layer("orphan", _cache().layers[1])
        rx.close()
        t0 = time.monotonic()
        stats = tx.finish("orphan")
        assert not stats.ok and stats.reason
        assert time.monotonic() - t0 < 8
        with pytest.raises(TransportError):
            tx.send_layer("later", _cache().layers[1])
    finally:
        tx.close()


def test_sender_and_receiver_release_threads_and_sockets() -> None:
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before_fds, before_threads = fds(), _kv_threads()
    results = Results()
    rx = KVReceiver(LOOPBACK, 0, results).start()
    tx = KVSender(LOOPBACK, rx.port, connections=4)
    assert tx.send_cache(_cache("c")).ok
    assert len(_kv_threads()) > len(before_threads)
    tx.close()
    rx.close()
    deadline = time.monotonic() + 5
    while _kv_threads() != before_threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _kv_threads() == before_threads
    assert fds() == before_fds


def test_reused_request_id_is_refused_instead_of_left_waiting(receiver: tuple[KVReceiver, Results]) -> None:
    rx, results = receiver
    with KVSender(LOOPBACK, rx.port, connections=2, ack_timeout_s=30) as tx:
        assert tx.send_cache(_cache("once")).ok
        t0 = time.monotonic()
        again = tx.send_cache(_cache("once"))
    assert not again.ok and "already ended" in (again.reason or "")
    assert time.monotonic() - t0 < 10


def test_tcp_info_is_sampled_into_telemetry_and_the_congestion_signal(receiver: tuple[KVReceiver, Results]) -> None:
    rx, results = receiver
    seen: list = []
    with KVSender(LOOPBACK, rx.port, connections=2, sample_interval_s=0.01, on_sample=seen.append) as tx:
        t_end = time.monotonic() + 0.5
        i = 0
        while time.monotonic() < t_end:
            tx.send_bytes(f"s-{i}", 0, "gqa", 4 << 20)
            assert tx.finish(f"s-{i}").ok
            i += 1
        c = tx.congestion()
    assert len(seen) >= 10 and {s.connection for s in seen} == {0, 1}
    acked = [s.bytes_acked for s in seen if s.connection == 0]
    assert acked == sorted(acked) and acked[-1] > acked[0]
    assert c["goodput_bps"] > 0 and c["rtt_ms"] > 0 and c["cwnd"] >= 2
    assert 0 < c["min_rtt_ms"] <= c["rtt_ms"] + 1e-3 and c["inflight_bytes"] >= 0
    # loopback loses next to nothing: no retransmission timeout ever, and the samples in the open state with nothing
    # counted lost (a loaded host once dropped a segment at the receiver: CI, 2026-12-06, one sample in recovery)
    assert all(s.backoff == 0 for s in seen)
    assert sum((s.ca_state, s.lost_segments) == (0, 0) for s in seen) >= 0.9 * len(seen)


def test_the_path_rate_is_reported_while_the_sender_has_work_and_zero_when_idle(receiver: tuple[KVReceiver, Results]) -> None:
    rx, _ = receiver
    with KVSender(LOOPBACK, rx.port, connections=2, sample_interval_s=0.01) as tx:
        rates = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                rates.append(tx.congestion()["path_rate_bps"])
                time.sleep(0.002)

        w = threading.Thread(target=watch)
        w.start()
        for i in range(4):
            tx.send_bytes(f"b-{i}", 0, "gqa", 64 << 20)
        for i in range(4):
            assert tx.finish(f"b-{i}").ok
        done.set()
        w.join()
        time.sleep(0.1)
        idle = tx.congestion()
    assert max(rates) > 0 and idle["path_rate_bps"] == 0.0


def test_the_path_rate_leaves_out_a_connection_with_work_whose_rate_is_not_current(receiver: tuple[KVReceiver, Results],
                                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection stalled in a deep dip (retransmission timeouts: bytes in flight, nothing acknowledged)
    keeps its pre-dip delivery rate; summed in, it made a 0.7 Gbps path read as the full line (val-thin-line
    seed 5). A connection counts when its acknowledgements of the last second support its rate: at least
    FRESH_ACKED_BYTES, or a quarter of a second at that rate (so a slow connection's rate is current too)."""
    from testbed.clock import now_s
    from testbed.kv.transport import FRESH_ACKED_BYTES, TcpSample

    rx, _ = receiver
    with KVSender(LOOPBACK, rx.port, connections=2, sample_interval_s=60.0) as tx:
        t = now_s()
        before = [TcpSample(t - 0.5, c, 20000, 10, 0, 10 << 20, 0, 9e9, unacked_bytes=1 << 20) for c in (0, 1)]
        now = [TcpSample(t, 0, 30000, 10, 0, (10 << 20) + 4 * FRESH_ACKED_BYTES, 0, 0.3e9, unacked_bytes=1 << 20),
               TcpSample(t, 1, 30000, 10, 0, 10 << 20, 0, 9e9, unacked_bytes=1 << 20)]  # stalled: its pre-dip rate
        tx.samples.clear()
        tx.samples.extend(before)
        monkeypatch.setattr(tx, "tcp_infos", lambda: now)
        assert tx.congestion()["path_rate_bps"] == pytest.approx(0.3e9)
        now[1] = TcpSample(t, 1, 30000, 10, 0, (10 << 20) + 2 * 1448, 0, 9e9, unacked_bytes=1 << 20)
        assert tx.congestion()["path_rate_bps"] == pytest.approx(0.3e9)  # two segments in a second: still stalled
        now[1] = TcpSample(t, 1, 30000, 10, 0, (10 << 20) + 10_000, 0, 0.2e6, unacked_bytes=1 << 20)  # slow, current
        assert tx.congestion()["path_rate_bps"] == pytest.approx(0.3e9 + 0.2e6)


def test_a_rate_whose_rtt_predates_the_queue_the_busy_connections_see_is_left_out(receiver: tuple[KVReceiver, Results],
                                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """At a dip's start a connection that moved its last bytes before the queue formed still has the
    unloaded RTT and the pre-dip delivery rate, and 80 KB acknowledged in the last second vouch for it
    (val-dip seed 4: 19-Gbps rates at 10.2 ms beside busy connections at 15-21 ms; the poll read 0.52 of the
    estimate where 0.1 was true). Its rate and its RTT are left out once the sender's busy connections show
    a standing queue and its RTT carries less than half of that queue; a queue all of them share (a steady
    saturated line) leaves every connection in, and so does a path without a standing queue."""
    from testbed.clock import now_s
    from testbed.kv.transport import FRESH_ACKED_BYTES, TcpSample

    rx, _ = receiver
    acked = 2 * FRESH_ACKED_BYTES

    def sample(t: float, c: int, rtt_us: int, rate_bps: float, got: int = 0) -> TcpSample:
        return TcpSample(t, c, rtt_us, 10, 0, (10 << 20) + got, 0, rate_bps, min_rtt_us=10_000, unacked_bytes=1 << 20)

    with KVSender(LOOPBACK, rx.port, connections=3, sample_interval_s=60.0) as tx:
        t = now_s()
        tx.samples.clear()
        tx.samples.extend(sample(t - 0.5, c, 10_100, 9e9) for c in range(3))
        now = [sample(t, 0, 20_000, 0.3e9, acked), sample(t, 1, 10_200, 9e9, acked), sample(t, 2, 17_000, 0.2e9, acked)]
        monkeypatch.setattr(tx, "tcp_infos", lambda: now)
        c = tx.congestion()
        assert c["path_rate_bps"] == pytest.approx(0.5e9)  # 9 Gbps from before the queue: out
        assert c["queue_rtt_ms"] == pytest.approx(18.5)  # the mean RTT of the two that see it
        now[1] = sample(t, 1, 15_500, 9e9, acked)  # 5.5 of the 10-ms queue: it has seen the queue
        assert tx.congestion()["path_rate_bps"] == pytest.approx(9.5e9)
        now[:] = [sample(t, 0, 13_000, 0.3e9, acked), sample(t, 1, 10_200, 9e9, acked)]  # 3 ms: no standing queue
        c = tx.congestion()
        assert c["path_rate_bps"] == pytest.approx(9.3e9) and c["queue_rtt_ms"] == pytest.approx(11.6)


def test_notsent_s_scales_each_connections_unsent_budget_to_its_own_rate(receiver: tuple[KVReceiver, Results]) -> None:
    """`notsent_s`: a connection may hold that long of its own delivery rate unsent (64 KiB .. the cap),
    set in the kernel, changed only when off by more than 25%; a transfer still arrives bit-identical."""
    from testbed.kv.transport import MIN_NOTSENT_LOWAT_BYTES, TcpSample

    rx, results = receiver
    with KVSender(LOOPBACK, rx.port, connections=2, sample_interval_s=60.0, notsent_lowat_bytes=4 << 20, notsent_s=0.02) as tx:
        assert tx.notsent_lowat_by_connection() == [4 << 20, 4 << 20]  # the cap until a rate is known
        c0 = tx._conns[0]

        def at(rate_bps: float) -> int:
            tx._rescale_lowat(c0, TcpSample(0.0, 0, 20000, 10, 0, 0, 0, rate_bps))
            kernel = c0.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT)
            assert kernel == c0.notsent_lowat_bytes
            return kernel

        assert at(8e6) == MIN_NOTSENT_LOWAT_BYTES  # 8 Mbps x 20 ms = 20 kB: the floor (a CUBIC flow at 1% loss)
        assert at(400e6) == 1_000_000  # 400 Mbps x 20 ms
        assert at(440e6) == 1_000_000  # within 25%: unchanged
        assert at(10e9) == 4 << 20  # capped
        assert tx.notsent_lowat_by_connection()[1] == 4 << 20  # per connection
        stats = tx.send_cache(_cache("req-n"))
    assert stats.ok and results.wait("req-n").ok


def test_the_rate_scaled_unsent_budget_is_on_by_default_and_can_be_turned_off(receiver: tuple[KVReceiver, Results]) -> None:
    from testbed.kv.transport import DEFAULT_NOTSENT_S, MIN_NOTSENT_LOWAT_BYTES, TcpSample

    rx, _ = receiver
    for kwargs, slow_budget in (({}, MIN_NOTSENT_LOWAT_BYTES), ({"notsent_s": None}, 4 << 20)):
        with KVSender(LOOPBACK, rx.port, connections=1, sample_interval_s=60.0, **kwargs) as tx:
            assert tx.notsent_s == (DEFAULT_NOTSENT_S if not kwargs else None)
            c0 = tx._conns[0]
            tx._rescale_lowat(c0, TcpSample(0.0, 0, 20000, 10, 0, 0, 0, 8e6))  # a connection held to 8 Mbps
            assert c0.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT) == slow_budget


def test_a_probe_may_end_once_a_queue_has_stood_for_four_rate_windows_and_it_carried_three_bdps() -> None:
    """`FillStop` on a synthetic burst over a 10-ms path (windows of 20 ms): slow start doubles what it
    delivers each RTT up to 0.8 MB per ms (6.4 Gbps), and the RTT rises 8 ms above the unloaded 10 once
    the rate is reached (t = 40 ms). The burst may end at the first look `PROBE_FILLED_WINDOWS` (4) windows
    after the queue was first seen; with no queue it never ends early; with a size rule it cannot meet
    (3 x 6.4 Gbps x 10 ms = 24 MB, asked at 1000x) it never ends either."""
    stop = FillStop(queue_ms=2.0, queue_fraction=0.4, path_ratio=3.0)

    def run(queue_ms: float, ratio_stop: FillStop = stop) -> float | None:
        watch, series, d = _FillWatch(ratio_stop, 0.010, 0.020), [(0.0, 0)], 0
        for ms in range(1, 200):
            t = ms / 1000
            d += int(min(0.8e6, 0.05e6 * 2 ** (ms / 10)))
            series.append((t, d))
            if watch.done(t, 0.010 + (queue_ms / 1000 if ms >= 40 else 0.0), series):
                return t
        return None

    ended = run(8.0)
    assert ended is not None and 0.120 <= ended <= 0.122  # queue first seen at 40 ms, + 4 windows
    assert run(3.0) is None  # below max(2 ms, 40% of the 10-ms unloaded RTT): no standing queue, every byte is sent
    assert run(8.0, FillStop(2.0, 0.4, 3000.0)) is None



def test_a_whole_probe_filled_the_path_with_a_standing_queue_under_it_and_three_bdps_delivered() -> None:
    """`FillStop.filled`, the estimator's judgement of a whole probe: 10-ms floor, 4 Gbps read, 3 x 4 Gbps x 10 ms
    = 15 MB. Both parts are needed, each at its boundary; the size is against the unloaded RTT, the queue
    against the floor; no floor, no RTT or no queue rule never fills."""
    rule = FillStop(queue_ms=2.0, queue_fraction=0.4, path_ratio=3.0)
    assert rule.filled(15e6, 4e9, 14.0, 10.0, 10.0)  # 4 ms of queue (>= max(2, 0.4 x 10)), 15 MB
    assert not rule.filled(15e6, 4e9, 13.9, 10.0, 10.0)  # 3.9 ms: below 40% of the floor
    assert not rule.filled(14.9e6, 4e9, 20.0, 10.0, 10.0)  # a queue, but less than 3 BDPs: slow start's rate
    assert not rule.filled(15e6, 4e9, 14.0, 10.0, 12.0)  # 3 BDPs of a 12-ms unloaded RTT are 18 MB
    assert rule.filled(15e6, 4e9, 14.0, 10.0, 8.0)
    assert not rule.filled(15e6, 4e9, 14.0, 0.0, 10.0) and not rule.filled(15e6, 4e9, 0.0, 10.0, 10.0)
    assert not FillStop(0.0, 0.4, 3.0).filled(15e6, 4e9, 100.0, 10.0, 10.0)


def _sender_for_samples(rx: KVReceiver, cc: str) -> KVSender:
    """A sender whose own sampler has taken its one sample of each connection and then waits a minute, so
    the test's samples are the only ones `_watch_loss` sees."""
    tx = KVSender(LOOPBACK, rx.port, connections=2, sample_interval_s=60.0, congestion_control=cc)
    deadline = time.monotonic() + 10
    while len(tx.samples) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(tx.samples) >= 2
    return tx


def _feed(tx: KVSender, i: int, t_s: float, ca_state: int, rate_bps: float, unacked: int = 1 << 20) -> int:
    from testbed.kv.transport import TcpSample

    s = TcpSample(t_s, i, 15000, 4, 0, 0, 0, rate_bps, unacked_bytes=unacked, ca_state=ca_state)
    tx._watch_loss(tx._conns[i], s)
    assert s.cc_restarts == tx._conns[i].cc_restarts  # the count travels with each sample (tcp.parquet)
    return s.cc_restarts


def test_a_bbr_connection_stuck_after_an_rto_gets_its_congestion_control_restarted_and_nothing_else_does(
        receiver: tuple[KVReceiver, Results]) -> None:
    """BBR paced a connection at its RTO recovery's delivery samples (6 kbps for 80 s, measured): a BBR
    connection in the loss state for >= 1 s with data in flight below 1% of its own best, while a sibling
    on the same path runs at >= 10% of its own, has its congestion control restarted at 1, 2, 4 ... s into
    its stay. An outage (no sibling delivering), a slow path, a recovered connection, and a connection
    under another algorithm are left alone."""
    from testbed.kv.transport import TCP_CA_LOSS

    rx, results = receiver
    try:
        with socket.socket() as probe:
            probe.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"bbr")
    except OSError as e:
        pytest.skip(f"bbr: this kernel cannot set TCP_CONGESTION bbr ({e}); the watchdog acts on BBR only, "
                    "and the non-BBR case is tested below")
    with _sender_for_samples(rx, "bbr") as tx:
        assert tx.send_cache(_cache("before", 65536)).ok and results.wait("before").ok
        c0 = tx._conns[0]
        assert _feed(tx, 0, 0.0, 0, 400e6) == 0 and _feed(tx, 1, 0.0, 0, 400e6) == 0  # their best rates
        assert _feed(tx, 0, 1.0, TCP_CA_LOSS, 6e3) == 0 and _feed(tx, 1, 1.0, TCP_CA_LOSS, 6e3) == 0  # both lose
        assert _feed(tx, 0, 2.5, TCP_CA_LOSS, 6e3) == 0  # 1.5 s: an outage, the sibling is stuck too
        assert _feed(tx, 1, 2.6, 0, 300e6) == 0  # the sibling is back (it was never past 1 s with a healthy sibling)
        bw_before = struct.unpack("<II", c0.sock.getsockopt(socket.IPPROTO_TCP, 26, 8))  # TCP_CC_INFO: bbr_bw_lo, _hi
        assert bw_before != (0, 0)
        assert _feed(tx, 0, 2.7, TCP_CA_LOSS, 6e3) == 1  # stuck beside a working sibling: restarted
        # BBR starts over: its bandwidth filter is empty, not the 6 kbps it was pacing at; the same algorithm
        assert struct.unpack("<II", c0.sock.getsockopt(socket.IPPROTO_TCP, 26, 8)) == (0, 0)
        assert c0.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0") == b"bbr"
        assert _feed(tx, 0, 4.0, TCP_CA_LOSS, 6e3) == 1  # 3.0 s into the stay: next at 2 x 1.7 = 3.4 s
        assert _feed(tx, 0, 4.5, TCP_CA_LOSS, 6e3) == 2  # 3.5 s: again, next at 7.0 s into the stay
        assert _feed(tx, 0, 7.5, TCP_CA_LOSS, 6e3) == 2 and _feed(tx, 0, 8.1, TCP_CA_LOSS, 6e3) == 3
        assert _feed(tx, 0, 8.3, 0, 50e6) == 3 and c0.loss_since_s is None  # recovered
        assert _feed(tx, 0, 9.0, TCP_CA_LOSS, 6e3) == 3 and _feed(tx, 0, 9.9, TCP_CA_LOSS, 6e3) == 3  # a new stay: 1 s
        assert _feed(tx, 0, 10.1, TCP_CA_LOSS, 6e3, unacked=0) == 3  # nothing in flight: nothing to be stuck on
        assert _feed(tx, 0, 10.2, TCP_CA_LOSS, 80e6) == 3  # a slow path (a fifth of its best), not a stuck connection
        assert _feed(tx, 0, 10.3, TCP_CA_LOSS, 6e3) == 4
        assert [c.cc_restarts for c in tx._conns] == [4, 0]  # the sibling, never stuck, was never restarted
        assert tx.send_cache(_cache("after", 65536)).ok and results.wait("after").ok  # the connection carries on


def test_a_connection_under_another_congestion_control_is_never_restarted(receiver: tuple[KVReceiver, Results]) -> None:
    from testbed.kv.transport import TCP_CA_LOSS, TcpSample, is_stuck_after_rto

    rx, _ = receiver
    with _sender_for_samples(rx, "reno") as tx:
        _feed(tx, 0, 0.0, 0, 400e6)
        _feed(tx, 1, 0.0, 0, 400e6)
        assert [_feed(tx, 0, t, TCP_CA_LOSS, 6e3) for t in (1.0, 2.5, 5.0, 20.0)] == [0, 0, 0, 0]
        assert tx._conns[0].sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0") == b"reno"
    s = TcpSample(10.0, 0, 15000, 4, 0, 0, 0, 6e3, unacked_bytes=1 << 20, ca_state=TCP_CA_LOSS)
    assert is_stuck_after_rto(s, 9.0, 400e6, [0.5]) and not is_stuck_after_rto(s, 9.5, 400e6, [0.5])
    assert not is_stuck_after_rto(s, 9.0, 400e6, []) and not is_stuck_after_rto(s, 9.0, 400e6, [0.05])
    assert not is_stuck_after_rto(s, None, 400e6, [0.5]) and not is_stuck_after_rto(s, 9.0, 500e3, [0.5])
