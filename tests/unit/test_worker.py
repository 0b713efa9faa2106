"""Prefill and decode worker processes on 127.0.0.1 (no root): the HTTP control API of docs/protocol.md,
layer-wise KV streaming over the real transport, timeouts and checksum failures ending with a reason."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from testbed.kv.pool import chain_block_hashes
from testbed.kv.wire import Trailer, encode_trailer, profile_frames, transfer_digest
from testbed.models.spec import load_model_spec
from testbed.serving.httpio import Server
from testbed.serving.worker import DECODE_PREFIX_HEADER, WorkerConfig, make_handler

pytestmark = pytest.mark.timeout(120)
KV_TIMEOUT_S = 6.0  # from the decode request to the whole KV: prefill (0.72 s) + transfer, with room for a loaded host
MODEL = {"name": "paper-1t-hybrid", "compute": "profile"}
SCALE = 100.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory):
    """One decode and one prefill worker process in profile mode; always terminated."""
    d = tmp_path_factory.mktemp("workers")
    dec = WorkerConfig(role="decode", instance=0, cluster="pd", host="lo", port=free_port(), kv_port=free_port(),
                       profile="h20-paper-1t-hybrid", model=MODEL, scale=SCALE, bs_max=4, kv_timeout_s=KV_TIMEOUT_S,
                       ready_file=str(d / "dec.ready"), bind="127.0.0.1")
    pre = WorkerConfig(role="prefill", instance=0, cluster="prfaas", host="lo", port=free_port(),
                       profile="h200-paper-1t-hybrid", model=MODEL, scale=SCALE, ready_file=str(d / "pre.ready"), bind="127.0.0.1")
    procs = []
    try:
        for cfg, name in ((dec, "dec"), (pre, "pre")):
            cfg.save(d / f"{name}.json")
            procs.append(subprocess.Popen([sys.executable, "-m", "testbed.serving.worker", "--role", cfg.role, "--config", str(d / f"{name}.json")],
                                          env={**os.environ, "OMP_NUM_THREADS": "1"}))
        deadline = time.monotonic() + 60
        while not (Path(dec.ready_file).exists() and Path(pre.ready_file).exists()):
            assert time.monotonic() < deadline, "workers did not start"
            assert all(p.poll() is None for p in procs), "a worker exited at start"
            time.sleep(0.1)
        yield dec, pre
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def request(port: int, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request(method, path, json.dumps(body) if body is not None else None)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def sse(port: int, body: dict[str, Any], out: list[dict[str, Any]]) -> None:
    status, raw = request(port, "POST", "/v1/decode", body)
    assert status == 200
    out.extend(json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: "))


def test_kv_streams_layer_by_layer_and_the_decode_emits_every_token(workers):
    dec, pre = workers
    events: list[dict[str, Any]] = []
    t = threading.Thread(target=sse, args=(dec.port, {"request_id": "a1", "input_len": 8192, "output_len": 5, "prompt_token_ids": None}, events))
    t.start()
    hashes = list(range(100, 116))  # 16 full blocks
    sent_s = time.monotonic()  # testbed.clock: CLOCK_MONOTONIC, shared with the worker processes
    status, raw = request(pre.port, "POST", "/v1/prefill", {"request_id": "a1", "input_len": 8192, "cached_len": 0, "block_hashes": hashes,
                                                            "decode": {"host": "127.0.0.1", "kv_port": dec.kv_port, "instance": 0}})
    answered_s = time.monotonic()
    t.join(30)
    res = json.loads(raw)
    spec_bytes = round(load_model_spec("paper-1t-hybrid").kv_bytes(8192).total_bytes / SCALE)
    assert status == 200 and res["status"] == "ok", res
    assert res["kv_bytes"] == spec_bytes and res["wire_bytes"] > spec_bytes
    # H200 profile at 8K: 0.72 s. A sleep is never shorter; on a loaded host it can be many times longer
    # (8.7 s seen at load average 7), so the upper bound is the request's own span as the client saw it
    assert 0.72 * 0.97 <= res["prefill_end_s"] - res["prefill_start_s"]
    assert sent_s <= res["prefill_start_s"] < res["prefill_end_s"] <= answered_s
    assert res["transfer_start_s"] < res["prefill_end_s"] <= res["transfer_end_s"]
    tokens, final = events[:-1], events[-1]
    assert [e["index"] for e in tokens] == [0, 1, 2, 3, 4]
    assert final["done"] and final["status"] == "ok" and final["kv_bytes"] == spec_bytes
    assert final["first_token_s"] >= final["transfer_end_s"]
    steps = [b["t_s"] - a["t_s"] for a, b in zip(tokens, tokens[1:])]
    assert min(steps) > 0
    # the H20 profile's 25-ms step, paced (testbed.clock.Pacer): after a late step the next is shorter, so
    # one gap may be under 25 ms on a loaded host, but the five steps after the KV arrived take 5 x 25 ms
    assert tokens[-1]["t_s"] - final["transfer_end_s"] >= 5 * 0.025 * 0.97, (steps, final)
    # what the paced compute could not repay, reported for the run's timing fidelity (testbed.fidelity): the
    # prefill took its profile's time (plus any back-pressure) and that lateness; the token stream four steps and its own
    assert 0.0 <= res["prefill_late_s"] and res["prefill_end_s"] - res["prefill_start_s"] - res["prefill_late_s"] >= 0.72 * 0.99
    assert final["decode_late_s"] >= 0.0
    assert abs(tokens[-1]["t_s"] - tokens[0]["t_s"] - final["decode_late_s"] - 4 * 0.025) < 0.003, (steps, final)
    _, raw = request(pre.port, "GET", "/v1/state")
    st = json.loads(raw)
    assert st["role"] == "prefill" and st["queue_depth"] == 0
    assert chain_block_hashes(hashes)[-1] in st["prefix_blocks"]


def decode_with_header(port: int, body: dict[str, Any], out: dict[str, Any]) -> None:
    """A decode request as the router makes it: the prefix header first, then the event stream."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request("POST", "/v1/decode", json.dumps(body))
        r = c.getresponse()
        out["decode_prefix_len"] = r.getheader(DECODE_PREFIX_HEADER)
        out["ready"].set()
        raw = r.read()
        out["events"] = [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]
    finally:
        c.close()


def test_a_decode_holding_the_prompts_prefix_is_sent_only_the_rest(workers):
    """SGLang's decode-side prefix cache: the decode names the prefix it holds (header), the prefill sends
    the full-attention KV after it plus the whole fixed state, and the request decodes as before."""
    dec, pre = workers
    spec = load_model_spec("paper-1t-hybrid")
    first, second = list(range(300, 308)), list(range(300, 306)) + [400, 401, 402]  # 8 blocks; 6 shared + 3 new
    results = []
    for rid, hashes, n in (("d1", first, 8 * 512), ("d2", second, 9 * 512)):
        out: dict[str, Any] = {"ready": threading.Event()}
        t = threading.Thread(target=decode_with_header, args=(dec.port, {"request_id": rid, "input_len": n, "output_len": 2,
                                                                          "block_hashes": hashes}, out))
        t.start()
        assert out["ready"].wait(10)
        status, raw = request(pre.port, "POST", "/v1/prefill", {
            "request_id": rid, "input_len": n, "block_hashes": hashes, "decode_prefix_len": int(out["decode_prefix_len"]),
            "decode": {"host": "127.0.0.1", "kv_port": dec.kv_port, "instance": 0}})
        t.join(30)
        results.append((out, json.loads(raw)))
    (o1, r1), (o2, r2) = results
    assert o1["decode_prefix_len"] == "0" and o2["decode_prefix_len"] == str(6 * 512)  # d1 left 7 full blocks (4095 positions)
    assert r1["kv_bytes"] == round(spec.kv_bytes(8 * 512).total_bytes / SCALE)
    assert r2["kv_bytes"] == round((spec.kv_bytes(9 * 512).total_bytes - 6 * 512 * spec.full_attention_bytes_per_token) / SCALE)
    # the prefill's own pool has d1's linear state only at block 8, so by the hybrid rule it recomputes d2;
    # the decode needs no state (it is sent the final one), so its 6 shared blocks count
    assert r2["prefill_cached_len"] == 0 and r2["decode_prefix_len"] == 6 * 512
    assert [e.get("index") for e in o2["events"][:-1]] == [0, 1] and o2["events"][-1]["status"] == "ok"


def test_a_decode_whose_kv_never_arrives_fails_with_the_reason(workers):
    dec, _ = workers
    events: list[dict[str, Any]] = []
    t0 = time.monotonic()
    sse(dec.port, {"request_id": "lost", "input_len": 100, "output_len": 3, "request_timeout_s": 2.0}, events)
    assert len(events) == 1 and events[0]["status"] == "failed"
    assert events[0]["reason"] == "KV did not arrive within the request timeout (2 s)"
    assert 2.0 <= time.monotonic() - t0 < 2.0 + 5.0  # bounded by the request's timeout, not the KV timeout (6 s)


def test_a_second_request_of_an_id_in_flight_is_refused_and_the_id_is_free_again_once_it_ended(workers):
    """A decode worker took a second request of an id still in flight: the second's slot replaced the first's, whose
    stream then waited to its timeout with its KV given to the other (the router refuses it; a direct client did not)."""
    dec, _ = workers
    events: list[dict[str, Any]] = []
    body = {"request_id": "twice", "input_len": 100, "output_len": 3, "request_timeout_s": 2.0}
    first = threading.Thread(target=sse, args=(dec.port, body, events))
    first.start()
    time.sleep(0.5)  # registered (on loopback, within milliseconds), waiting for KV that never comes
    status, raw = request(dec.port, "POST", "/v1/decode", {**body, "request_timeout_s": 0.2})
    first.join(10)
    assert status == 400 and json.loads(raw)["error"] == ("request_id: 'twice' is already in flight on this worker; give "
                                                          "each request its own id"), raw
    assert [e["status"] for e in events] == ["failed"] and "within the request timeout (2 s)" in events[0]["reason"]
    again: list[dict[str, Any]] = []
    sse(dec.port, {**body, "request_timeout_s": 0.2}, again)  # ended (its final event sent): the id may come again
    assert [e["status"] for e in again] == ["failed"]


def test_a_corrupted_kv_transfer_is_rejected_and_never_decoded(workers):
    dec, _ = workers
    events: list[dict[str, Any]] = []
    t = threading.Thread(target=sse, args=(dec.port, {"request_id": "bad", "input_len": 100, "output_len": 3}, events))
    t.start()
    buf = memoryview(bytearray(os.urandom(1 << 20)))
    frames = profile_frames("bad", 0, "linear", 4096, buf, {})
    records = [f.record for f in frames]
    with socket.create_connection(("127.0.0.1", dec.kv_port)) as s:
        for f in frames:
            payload = bytearray(f.payload)
            payload[7] ^= 0xFF  # one flipped byte after the checksum was taken
            s.sendall(f.header + bytes(payload))
        s.sendall(encode_trailer(Trailer("bad", "paper-1t-hybrid", 100, 1, len(frames), 4096, transfer_digest(records))))
        t.join(10)
    assert len(events) == 1 and events[0]["status"] == "failed"
    assert "KV rejected" in events[0]["reason"] and "checksum" in events[0]["reason"].lower()


def test_bad_bodies_and_wrong_paths_get_http_errors(workers):
    dec, pre = workers
    assert request(pre.port, "POST", "/v1/prefill", [1, 2])[0] == 400
    assert request(pre.port, "POST", "/v1/decode", {"request_id": "x"})[0] == 404
    assert request(dec.port, "POST", "/v1/decode", {"input_len": 3})[0] == 400
    status, raw = request(pre.port, "POST", "/v1/prefill", {"request_id": "y"})
    assert status == 400 and json.loads(raw)["error"] == "POST /v1/prefill: input_len: is required"
    status, raw = request(pre.port, "POST", "/v1/prefill", {"request_id": "y", "input_len": 10, "decode": {"host": "h", "kv_port": "x", "instance": 0}})
    assert status == 400 and json.loads(raw)["error"] == "POST /v1/prefill: decode.kv_port: 'x' is not a whole number >= 1"
    assert json.loads(request(dec.port, "GET", "/healthz")[1])["role"] == "decode"


def test_a_body_that_is_not_exactly_its_content_length_of_json_gets_one_line_and_no_thread_waits(capsys) -> None:
    """The control handler alone (a stand-in worker: the body is refused before the role matters)."""
    stub = SimpleNamespace(cfg=SimpleNamespace(role="prefill", instance=0, request_timeout_s=1.0))
    srv = Server(("127.0.0.1", 0), make_handler(stub))
    threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
    port = srv.server_address[1]

    def send(data: bytes, half_close: bool = False) -> tuple[int, str]:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
            r = http.client.HTTPResponse(s)
            r.begin()
            return r.status, json.loads(r.read())["error"]

    def head(*headers: str) -> bytes:
        return ("POST /v1/prefill HTTP/1.1\r\nHost: x\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n").encode()

    try:
        for data, half_close, code, says in (
                (head("Content-Length: abc") + b"{}", False, 400, "Content-Length: 'abc' is not a whole number"),
                (head("Content-Length: -1") + b"{}", False, 400, "Content-Length: '-1' is not a whole number"),
                (head(f"Content-Length: {1 << 40}"), False, 413, "Content-Length: 1099511627776 bytes is above the limit"),
                (head("Transfer-Encoding: chunked") + b"2\r\n{}\r\n0\r\n\r\n", False, 411, "Transfer-Encoding: is not supported"),
                (head("Content-Length: 100") + b"{}", True, 400, "body: Content-Length says 100 bytes but the body ended after 2"),
                (head("Content-Length: 100") + b"{}", False, 400, "body: the 100 bytes of Content-Length did not arrive within 1.0 s"),
                (head("Content-Length: 200000") + b"[" * 100000 + b"]" * 100000, False, 400, "body: JSON nested too deeply"),
                (head("Content-Length: 2", "Content-Length: 100") + b"{}", False, 400, "Content-Length: given 2 times; give it once"),
                (b"PUT /v1/prefill HTTP/1.1\r\nHost: x\r\n\r\n", False, 501, "Unsupported method ('PUT')")):
            t0 = time.monotonic()
            got, error = send(data, half_close)
            assert got == code and says in error, error
            assert time.monotonic() - t0 < 5
        assert send(head("Content-Length: 2") + b"{}") == (404, "no such path /v1/prefill on a prefill worker")  # still serving
        # a kept-alive connection that sends nothing after its answer is closed after the handler's timeout (1 s): the
        # timeout lifted for the answer stayed lifted, and an idle client held a server thread for good
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(head("Content-Length: 2") + b"{}")
            r = http.client.HTTPResponse(s)
            r.begin()
            r.read()
            t0 = time.monotonic()
            assert s.recv(10) == b"" and time.monotonic() - t0 < 5  # the server hung up
    finally:
        srv.shutdown()
        srv.server_close()
    assert "Traceback" not in capsys.readouterr().err


def trickle(port: int, head: bytes, drip: bytes, every_s: float = 0.2) -> tuple[float, bytes]:
    """Send `head`, then `drip` a byte every `every_s` (slowloris) until the server answers or hangs up; the seconds
    that took from the start and what the server sent."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head)
        for b in drip:
            if _readable(s):  # the server answered or hung up
                break
            try:
                s.sendall(bytes([b]))
            except OSError:  # the server hung up
                break
            time.sleep(every_s)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except OSError:
            pass
    return time.monotonic() - t0, out


def _readable(s: socket.socket) -> bool:
    import select

    return bool(select.select([s], [], [], 0)[0])


def test_a_request_trickled_a_byte_at_a_time_is_cut_off_at_the_handlers_timeout_in_all(capsys) -> None:
    """Slowloris: the timeout bounded each read, so a client that sent a header or body byte every 0.2 s (timeout 1 s)
    held a server thread as long as it kept dripping (2026-12-07); the request's line, headers and body now share it."""
    stub = SimpleNamespace(cfg=SimpleNamespace(role="prefill", instance=0, request_timeout_s=1.0))
    srv = Server(("127.0.0.1", 0), make_handler(stub))
    threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
    port = srv.server_address[1]
    try:
        took, out = trickle(port, b"POST /v1/prefill HTTP/1.1\r\nHost: x\r\n", b"X-Drip: " + b"a" * 40)  # headers that never end
        assert took < 3 and out == b"", (took, out)  # hung up without an answer, as for headers that stall
        took, out = trickle(port, b"POST /v1/prefill HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n", b"{" + b" " * 40)
        assert took < 3 and b"400 Bad Request" in out, (took, out)
        assert json.loads(out.partition(b"\r\n\r\n")[2]) == {"error": "body: the 50 bytes of Content-Length did not arrive within 1.0 s"}
        # a key given twice was taken with its last value, the first dropped without a word
        body = b'{"request_id": "a", "request_id": "b"}'
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/prefill HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            r = http.client.HTTPResponse(s)
            r.begin()
            assert (r.status, json.loads(r.read())) == (400, {"error": "request_id: is given twice in one object; give it once"})
        # a request that comes in time is served on a kept-alive connection, and the next one gets the timeout anew
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            for _ in range(3):
                s.sendall(b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
                r = http.client.HTTPResponse(s)
                r.begin()
                assert r.status == 404 and r.read()
                time.sleep(0.6)  # 1.8 s in all on one connection: more than one timeout, less than one per request
    finally:
        srv.shutdown()
        srv.server_close()
    assert "Traceback" not in capsys.readouterr().err


def test_a_probe_crosses_to_the_decode_workers_receiver_is_dropped_there_and_answers_with_tcp_info(workers):
    dec, pre = workers
    # The rate needs the prober's 1-ms sampler to see acknowledged bytes while the burst runs; a burst over before
    # its next sample answers rate 0 (no measurement; the estimator ignores it). The 1 MiB this test sent lasts
    # ~1 ms on loopback: rate 0 in 53 of 100 in-process probes at load average 28 (8 MiB: 0 of 100), and the
    # test failed 1 in 4 runs. 8 MiB, and up to 3 probes for a prober starved over a whole burst.
    nbytes = 8 << 20
    body = {"decode": {"host": "127.0.0.1", "kv_port": dec.kv_port, "instance": 0}, "bytes": nbytes, "pings": 2}
    for _ in range(3):
        status, raw = request(pre.port, "POST", "/v1/probe", body)
        ans = json.loads(raw)
        if status != 200 or ans.get("rate_bps", 0) > 0:
            break
    assert status == 200 and ans["ok"] and ans["bytes"] == nbytes
    assert ans["rate_bps"] > 0 and ans["idle_rtt_ms"] > 0 and ans["rtt_ms"] > 0
    status, raw = request(pre.port, "POST", "/v1/probe", {**body, "bytes": -1})
    assert status == 400 and "bytes" in json.loads(raw)["error"]
    assert request(dec.port, "POST", "/v1/probe", body)[0] == 404  # only a prefill worker sends probes


def test_a_request_queued_past_its_budget_fails_naming_the_prefill_queue_and_shedding_has_its_own_reason(workers):
    dec, pre = workers
    dest = {"host": "127.0.0.1", "kv_port": dec.kv_port, "instance": 0}
    out: dict[str, dict[str, Any]] = {}

    def post(rid: str, extra: dict[str, Any]) -> None:
        out[rid] = json.loads(request(pre.port, "POST", "/v1/prefill", {"request_id": rid, "input_len": 8192, "decode": dest, **extra})[1])

    first = threading.Thread(target=post, args=("q-a", {}))
    first.start()  # 0.72 s of H200 prefill
    time.sleep(0.2)
    arrival_s = time.monotonic()
    post("q-b", {"arrival_s": arrival_s, "request_timeout_s": 1.0})  # its own 0.72 s of prefill leave 0.28 s of queue
    answered_after_s = time.monotonic() - arrival_s
    first.join(30)
    assert out["q-a"]["status"] == "ok" and out["q-a"]["queue_s"] < 0.5
    reason = out["q-b"]["reason"]
    assert out["q-b"]["status"] == "failed" and out["q-b"]["prefill_start_s"] is None
    assert reason.startswith("waited 0.") and reason.endswith(" s in the queue of prefill instance 0 "
                                                              "(request timeout 1 s less its expected prefill 0.7 s)")
    # ~1 s - 0.72 s after its arrival (a loaded host only makes it later); the KV timeout (30 s), which once
    # bounded the queue, would have failed it at once
    assert answered_after_s >= 0.2
    post("shed", {"arrival_s": time.monotonic(), "shed_ttft_s": 0.5})  # alone, but its prefill alone takes 0.72 s
    assert out["shed"]["status"] == "failed" and out["shed"]["prefill_start_s"] is None
    assert out["shed"]["reason"].startswith("shed: predicted TTFT 0.7 s") and out["shed"]["reason"].endswith("exceeds 0.5 s")


def test_the_prefill_queue_serves_the_lowest_priority_first_and_arrival_order_among_equals(workers):
    dec, pre = workers
    dest = {"host": "127.0.0.1", "kv_port": dec.kv_port, "instance": 0}
    out: dict[str, dict[str, Any]] = {}

    def post(rid: str, priority: int) -> None:
        body = {"request_id": rid, "input_len": 4096, "decode": dest, "priority": priority}
        out[rid] = json.loads(request(pre.port, "POST", "/v1/prefill", body)[1])

    threads = []
    for rid, priority in (("busy", 0), ("moved-1", 1), ("moved-2", 1), ("native-1", 0), ("native-2", 0)):
        threads.append(threading.Thread(target=post, args=(rid, priority)))
        threads[-1].start()
        time.sleep(0.1)  # each queued behind the first, in this order (its prefill takes ~0.4 s)
    for t in threads:
        t.join(60)
    assert all(o["status"] == "ok" for o in out.values()), out
    order = sorted(out, key=lambda rid: out[rid]["prefill_start_s"])
    assert order == ["busy", "native-1", "native-2", "moved-1", "moved-2"]
    status, raw = request(pre.port, "POST", "/v1/prefill", {"request_id": "bad", "input_len": 10, "decode": dest, "priority": -1})
    assert status == 400 and b"priority" in raw and b"whole number >= 0" in raw


def test_a_queued_request_of_a_lower_priority_value_preempts_a_running_one_at_its_next_layer(workers):
    dec, pre = workers
    dest = {"host": "127.0.0.1", "kv_port": dec.kv_port, "instance": 0}
    out: dict[str, dict[str, Any]] = {}
    posted: dict[str, float] = {}

    def post(rid: str, n: int, priority: int, **extra: Any) -> None:
        posted[rid] = time.monotonic()
        body = {"request_id": rid, "input_len": n, "decode": dest, "priority": priority, **extra}
        out[rid] = json.loads(request(pre.port, "POST", "/v1/prefill", body)[1])

    def pair(slo_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
        m, n = f"moved-{slo_s:g}", f"native-{slo_s:g}"  # a request id is a transfer's id: one each
        moved = threading.Thread(target=post, args=(m, 16384, 1), kwargs={"arrival_s": time.monotonic(), "slo_ttft_s": slo_s})
        moved.start()  # ~1.1 s of H200 prefill in 60 layers
        time.sleep(0.4)
        post(n, 4096, 0)  # ~0.4 s
        moved.join(60)
        assert out[m]["status"] == out[n]["status"] == "ok", out
        posted["native"] = posted[n]
        return out[m], out[n]

    m, n = pair(slo_s=10.0)  # time to spare: the native runs at the moved one's next layer
    assert m["prefill_start_s"] < n["prefill_start_s"] < n["prefill_end_s"] < m["prefill_end_s"]
    assert n["prefill_start_s"] - posted["native"] < 0.3  # one layer of the running prefill (~25 ms), on a loaded host more
    # the moved prefill's time is its own plus the native's (paused, not repaid); the native ran alone
    assert m["prefill_end_s"] - m["prefill_start_s"] > n["prefill_end_s"] - n["prefill_start_s"] + 1.0
    # ... and it reports the pause, which is the native's prefill (the router's PD-P cost leaves it out)
    native_s = n["prefill_end_s"] - n["prefill_start_s"]
    assert native_s <= m["prefill_paused_s"] < native_s + 0.2
    own_s = m["prefill_end_s"] - m["prefill_start_s"] - m["prefill_paused_s"]
    assert own_s > 1.0 and own_s < m["prefill_end_s"] - m["prefill_start_s"] - 0.3
    m, n = pair(slo_s=1.3)  # none: after the native (~0.4 s) the moved one would end past its 1.3 s
    assert m["prefill_end_s"] <= n["prefill_start_s"]
    assert m["prefill_paused_s"] is None and n["prefill_paused_s"] is None  # never paused: null, as a field not reached


def test_the_kv_timeout_runs_from_the_first_layer_sent_not_from_the_queue() -> None:
    """A receiver that reads every byte but never answers: the transfer fails kv_timeout after its start."""
    from testbed.kv.cache import LayerKV
    from testbed.serving.protocol import KVDestination, PrefillRequest
    from testbed.serving.worker import Destination, PrefillJob

    import torch

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    conns: list[socket.socket] = []

    def drain() -> None:
        while True:
            try:
                c, _ = listener.accept()
            except OSError:
                return
            conns.append(c)
            threading.Thread(target=lambda c=c: [None for _ in iter(lambda: c.recv(1 << 16), b"")], daemon=True).start()

    threading.Thread(target=drain, daemon=True).start()
    ended: list[PrefillJob] = []
    done = threading.Event()
    dest = Destination("127.0.0.1", listener.getsockname()[1], 2, lambda j: (ended.append(j), done.set()), "m", kv_timeout_s=0.5)
    job = PrefillJob(PrefillRequest("late", 16, KVDestination("127.0.0.1", 1, 0)), queued_s=time.monotonic() - 60)  # queued long ago
    try:
        t0 = time.monotonic()
        dest.items.put(("layer", job, LayerKV(0, "linear", {"state": torch.ones(2, 4, 4)})))
        dest.items.put(("finish", job, 16))
        assert done.wait(10)
        took = time.monotonic() - t0
    finally:
        listener.close()
        for c in conns:
            c.close()
    assert ended[0].result["status"] == "failed"
    assert ended[0].result["reason"] == f"KV transfer to 127.0.0.1:{dest.kv_port} did not complete within 0.5 s of its start"
    assert 0.45 <= took < 5.0  # from the first layer; the 60 s it had queued do not count


def test_a_request_waiting_for_a_place_in_a_full_batch_fails_naming_the_batch_queue(tmp_path) -> None:
    from testbed.clock import now_s
    from testbed.kv.transport import ReceivedKV
    from testbed.serving.protocol import DecodeRequest, FinalEvent
    from testbed.serving.worker import DecodeWorker

    cfg = WorkerConfig(role="decode", instance=3, cluster="pd", host="lo", port=0, kv_port=free_port(), profile="h20-paper-1t-hybrid",
                       model=MODEL, scale=SCALE, bs_max=1, bind="127.0.0.1")
    worker = DecodeWorker(cfg)
    try:
        long = worker.register(DecodeRequest("long", 100, output_len=40))  # 40 steps of 25 ms hold the only place
        late = worker.register(DecodeRequest("late", 100, output_len=2, request_timeout_s=0.3))
        worker._on_kv("long", ReceivedKV("long", True, None, None, 100, 200, 1, now_s(), now_s()))
        first_long = long.events.get(timeout=10)  # "long" is in the batch now
        worker._on_kv("late", ReceivedKV("late", True, None, None, 100, 200, 1, now_s(), now_s()))
        final = late.events.get(timeout=10)
        worker._on_kv("~probe-1", ReceivedKV("~probe-1", True, None, None, 100, 200, 1, now_s(), now_s()))
        worker._on_kv("early", ReceivedKV("early", True, None, None, 100, 200, 1, now_s(), now_s()))
        assert set(worker.arrived) == {"early"}  # a probe's bytes are dropped, KV before its request is kept
    finally:
        worker.receiver.close()
    assert isinstance(final, FinalEvent) and final.status == "failed" and final.tokens == 0
    assert final.reason.startswith("waited 0.") and final.reason.endswith("s in the batch queue of decode instance 3 (request timeout 0.3 s)")
    assert not isinstance(first_long, FinalEvent)


def test_the_kv_clock_pauses_while_the_prefill_computes_later_layers() -> None:
    """Layer-wise streaming: 0.8 s of compute between two layers does not count against a 0.5 s KV timeout."""
    import torch

    from testbed.kv.cache import LayerKV
    from testbed.kv.transport import KVReceiver
    from testbed.serving.protocol import KVDestination, PrefillRequest
    from testbed.serving.worker import Destination, PrefillJob

    got: list[Any] = []
    rx = KVReceiver("127.0.0.1", 0, lambda rid, r: got.append(r), request_timeout_s=10).start()
    ended: list[PrefillJob] = []
    done = threading.Event()
    try:
        dest = Destination("127.0.0.1", rx.port, 2, lambda j: (ended.append(j), done.set()), "m", kv_timeout_s=0.5)
        job = PrefillJob(PrefillRequest("slow-compute", 16, KVDestination("127.0.0.1", rx.port, 0)))
        dest.items.put(("layer", job, LayerKV(0, "linear", {"state": torch.ones(2, 4, 4)})))
        time.sleep(0.8)  # the prefill computing layer 1
        job.compute_after_first_s += 0.8
        dest.items.put(("layer", job, LayerKV(1, "linear", {"state": torch.ones(2, 4, 4)})))
        dest.items.put(("finish", job, 16))
        assert done.wait(10)
    finally:
        rx.close()
    assert ended[0].result["status"] == "ok", ended[0].result
    assert got and got[0].ok


def torch_decode_worker(bs_max: int = 20) -> Any:
    from testbed.serving.worker import DecodeWorker

    return DecodeWorker(WorkerConfig(role="decode", instance=0, cluster="pd", host="lo", port=0, kv_port=free_port(),
                                     compute="torch", model={"name": "kimi-linear-48b", "compute": "torch", "variant": "tiny"},
                                     variant="tiny", device="cpu", seed=1, bind="127.0.0.1", bs_max=bs_max))


def decode_with_caches(worker: Any, caches: dict[str, Any], output_len: int = 5,
                       slots_out: dict[str, Any] | None = None) -> dict[str, list[Any]]:
    """Register one torch-mode request per cache, hand each its KV as the transport would, and collect every
    event of each stream (tokens, then the final event); the slots go to `slots_out` when given."""
    from testbed.clock import now_s
    from testbed.kv.transport import ReceivedKV
    from testbed.serving.protocol import DecodeRequest, FinalEvent

    try:
        slots = {rid: worker.register(DecodeRequest(rid, c.tokens + 1, output_len=output_len,
                                                    prompt_token_ids=tuple(range(c.tokens + 1)))) for rid, c in caches.items()}
        if slots_out is not None:
            slots_out.update(slots)
        for rid, c in caches.items():
            worker._on_kv(rid, ReceivedKV(rid, True, None, c, c.nbytes, c.nbytes, 1, now_s(), now_s()))
        events: dict[str, list[Any]] = {}
        for rid, slot in slots.items():
            events[rid] = [slot.events.get(timeout=30)]
            while not isinstance(events[rid][-1], FinalEvent):
                events[rid].append(slot.events.get(timeout=30))
        return events
    finally:
        worker.receiver.close()


def test_a_torch_decode_checks_each_cache_when_it_arrives_so_a_misfit_fails_alone(monkeypatch) -> None:
    """`Compute.admit` checks a cache on the request's own thread: one that does not fit the model (a layer short)
    fails its own request with the reason, while the request beside it decodes every token; only the admitted
    cache is placed on the device, by the batch loop as it joins."""
    from testbed.models.torch_model import synthetic_cache
    from testbed.serving import compute as compute_module

    placed: list[str] = []
    place = compute_module._cache_to
    monkeypatch.setattr(compute_module, "_cache_to", lambda c, *a: placed.append(threading.current_thread().name) or place(c, *a))
    worker = torch_decode_worker()
    spec = worker.compute.model.spec
    bad = synthetic_cache(spec, 40, "bad", seed=2)
    bad.layers = bad.layers[:-1]
    slots: dict[str, Any] = {}
    events = decode_with_caches(worker, {"good": synthetic_cache(spec, 40, "good", seed=1), "bad": bad}, slots_out=slots)
    assert [type(e).__name__ for e in events["good"]] == ["TokenEvent"] * 5 + ["FinalEvent"]
    assert events["good"][-1].status == "ok"
    assert len(events["bad"]) == 1 and events["bad"][0].status == "failed"
    assert events["bad"][0].reason == "KV rejected: cache has 26 layers, model kimi-linear-48b-tiny has 27"
    assert placed == ["decode"]
    assert slots["bad"].kv is None and slots["good"].kv is None  # nothing held after the end


def test_a_transfer_that_cannot_be_admitted_for_any_reason_still_ends_its_request() -> None:
    """An ok transfer without a cache on a torch decode (admit raises AttributeError, not ValueError): the request
    fails with the reason instead of leaving its stream waiting for ever."""
    from testbed.clock import now_s
    from testbed.kv.transport import ReceivedKV
    from testbed.serving.protocol import DecodeRequest

    worker = torch_decode_worker()
    try:
        slot = worker.register(DecodeRequest("r", 41, output_len=3, prompt_token_ids=tuple(range(41))))
        worker._on_kv("r", ReceivedKV("r", True, None, None, 1000, 1000, 1, now_s(), now_s()))
        final = slot.events.get(timeout=10)
    finally:
        worker.receiver.close()
    assert final.status == "failed" and final.reason.startswith("KV rejected: AttributeError: ")


def test_an_aborted_or_expired_request_lets_go_of_its_cache_before_another_is_placed(monkeypatch) -> None:
    """A client that goes away (`aborted`) and a request that expires in the batch queue drop their caches at the
    next join, before the next request's cache is placed, not when their slot objects are freed."""
    from testbed.clock import now_s
    from testbed.kv.transport import ReceivedKV
    from testbed.models.torch_model import synthetic_cache
    from testbed.serving.protocol import DecodeRequest, FinalEvent
    from testbed.serving.worker import ROUTER_GONE

    worker = torch_decode_worker(bs_max=1)
    spec = worker.compute.model.spec
    held_when_placed: dict[str, bool] = {}
    place = worker.compute.place
    slots: dict[str, Any] = {}

    def placing(slot: Any) -> None:
        held_when_placed[slot.request_id] = slots["long"].kv is not None
        place(slot)

    monkeypatch.setattr(worker.compute, "place", placing)
    # the caches are made before the requests are registered, so that "late" meets its timeout in the batch queue and
    # not while its KV is still being made (CI, 2026-12-06: a loaded host took more than 0.3 s for the two caches)
    caches = {rid: synthetic_cache(spec, 40, rid, seed=1) for rid in ("long", "late")}
    try:
        for rid, n, timeout in (("long", 10**6, None), ("late", 2, 1.0), ("next", 2, None)):
            slots[rid] = worker.register(DecodeRequest(rid, 41, output_len=n, prompt_token_ids=tuple(range(41)),
                                                       request_timeout_s=timeout))
        for rid, c in caches.items():
            worker._on_kv(rid, ReceivedKV(rid, True, None, c, c.nbytes, c.nbytes, 1, now_s(), now_s()))
            if rid == "long":
                slots["long"].events.get(timeout=30)  # "long" holds the only place
        final = slots["late"].events.get(timeout=30)
        assert final.reason.endswith("in the batch queue of decode instance 0 (request timeout 1 s)"), final.reason
        assert slots["late"].kv is None and slots["long"].kv is not None
        c = synthetic_cache(spec, 40, "next", seed=1)
        worker._on_kv("next", ReceivedKV("next", True, None, c, c.nbytes, c.nbytes, 1, now_s(), now_s()))
        worker.abandon(slots["long"])  # its router hung up mid-decode (httpio.HangupWatch)
        while not isinstance(slots["next"].events.get(timeout=30), FinalEvent):
            pass
        # the stream handler still waiting on it returns: a last event ends its stream (it waited forever before)
        while not isinstance(ev := slots["long"].events.get(timeout=30), FinalEvent):
            pass
        assert (ev.status, ev.reason) == ("failed", ROUTER_GONE)
    finally:
        worker.receiver.close()
    assert held_when_placed == {"long": True, "next": False}  # as "next" was placed, the aborted cache was gone
    assert slots["long"].kv is None


def test_a_failed_decode_step_fails_its_batch_and_lets_go_of_the_caches(monkeypatch) -> None:
    from testbed.models.torch_model import synthetic_cache

    worker = torch_decode_worker()

    def broken(slots: list[Any]) -> list[int]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(worker.compute, "decode_step", broken)
    slots: dict[str, Any] = {}
    events = decode_with_caches(worker, {"a": synthetic_cache(worker.compute.model.spec, 40, "a", seed=1)}, slots_out=slots)
    assert events["a"][-1].reason == "decode failed: RuntimeError: CUDA error: an illegal memory access was encountered"
    assert slots["a"].kv is None


def test_a_cache_that_cannot_be_placed_fails_alone_and_caches_are_placed_only_as_they_join(monkeypatch) -> None:
    """`Compute.place` runs as a request joins the batch (bs_max 1 here: the second request's cache is placed
    only after the first request has left), and a placement that fails (the device out of memory) fails
    that request alone."""
    from testbed.models.torch_model import synthetic_cache

    worker = torch_decode_worker(bs_max=1)
    order: list[tuple[str, int]] = []
    placed: dict[str, Any] = {}
    seen: list[tuple[int, bool]] = []
    place = worker.compute.place

    def placing(slot: Any) -> None:
        live = [r for r, s in placed.items() if s.emitted < s.req.output_len and s.kv is not None]
        order.append((slot.request_id, len(live)))  # caches already on the device and still decoding
        placed[slot.request_id] = slot
        state = worker.state()  # a request being placed is neither queued nor in the batch, yet counts
        seen.append((state.queue_depth, state.busy))
        if slot.request_id == "oom":
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        place(slot)

    monkeypatch.setattr(worker.compute, "place", placing)
    spec = worker.compute.model.spec
    caches = {rid: synthetic_cache(spec, 40, rid, seed=i) for i, rid in enumerate(("first", "oom", "last"))}
    events = decode_with_caches(worker, caches)
    assert [len(events[r]) for r in ("first", "last")] == [6, 6] and events["last"][-1].status == "ok"
    assert len(events["oom"]) == 1 and events["oom"][0].status == "failed"  # no token: it never joined
    assert events["oom"][0].reason == ("KV could not be placed on the decode device: RuntimeError: CUDA out of memory. "
                                       "Tried to allocate 2.00 GiB")
    assert sorted(order) == [("first", 0), ("last", 0), ("oom", 0)]  # none placed while another still decodes
    assert all(depth >= 1 and busy for depth, busy in seen), seen


def test_a_probe_s_own_bytes_are_not_reported_as_kv_and_kv_queued_under_it_is() -> None:
    """While a probe runs on a destination with no KV of its own, the bytes queued and in flight there are
    the probe's: a state poll must read no KV (else the router discards every probe a poll lands in, 10 of
    17 discards in six quick runs, 2026-12-04) and no backlog. KV queued under the probe shows again."""
    from testbed.serving.protocol import Congestion, KVDestination, ProbeRequest
    from testbed.serving.worker import Destination, _merge_congestion

    release, inside = threading.Event(), threading.Event()
    kv = {"send_queue_bytes": 5e6, "inflight_bytes": 1e6, "path_rate_bps": 2e9, "queue_rtt_ms": 14.0, "rtt_ms": 14.0,
          "min_rtt_ms": 10.0, "retransmits": 3.0, "cwnd": 40.0, "delivery_rate_bps": 2e9, "goodput_bps": 1e9}

    class Sender:  # the TCP sender's two calls the destination makes here
        def congestion(self) -> dict[str, float]:
            return dict(kv)

        def probe(self, nbytes: int, pings: int, timeout_s: float, stop: Any = None) -> dict[str, Any]:
            inside.set()
            release.wait(5)
            return {"ok": True, "bytes": nbytes}

    dest = Destination("127.0.0.1", 1, 2, lambda j: None, "m", kv_timeout_s=1.0)
    dest.sender = Sender()
    assert dest.congestion() == kv  # no probe: the sender's figures as they are
    answer: dict[str, Any] = {}
    t = threading.Thread(target=lambda: answer.update(dest.probe(ProbeRequest(KVDestination("127.0.0.1", 1, 0), bytes=10))))
    t.start()
    try:
        assert inside.wait(5)
        seen = dest.congestion()
        assert seen["probing"] == 1.0 and all(seen[k] == 0.0 for k in ("send_queue_bytes", "inflight_bytes", "path_rate_bps", "queue_rtt_ms"))
        assert (seen["retransmits"], seen["min_rtt_ms"], seen["cwnd"]) == (3.0, 10.0, 40.0)  # TCP's own counters stay
        merged = _merge_congestion({"a": seen, "b": dict(kv)})
        assert isinstance(merged, Congestion) and merged.probing == 1.0 and merged.send_queue_bytes == 5e6
        dest.started["r1"] = 0.0  # KV handed to this destination's sender under the probe: it shows
        assert dest.congestion()["send_queue_bytes"] == 5e6 and "probing" not in dest.congestion()
        del dest.started["r1"]
    finally:
        release.set()
        t.join(5)
    assert answer == {"ok": True, "bytes": 10, "paced": False} and dest.probing is False and dest.congestion() == kv


def test_a_paced_probe_goes_over_connections_of_its_own_and_kv_stays_unpaced() -> None:
    """`pace_bps` > 0: the probe's sender is a second one, made once, paced at the request's rate before each
    probe; the KV sender is neither used nor paced (the kernel keeps pacing a connection once capped). A
    probe that fails answers why, and its connections are made anew at the next one."""
    from testbed.serving.protocol import KVDestination, ProbeRequest
    from testbed.serving.worker import Destination

    made: list[Any] = []

    class Sender:
        def __init__(self) -> None:
            self.paced: list[float | None] = []
            self.probes = 0
            self.fail = False
            self.closed = False

        def pace(self, rate_bps: float | None) -> None:
            self.paced.append(rate_bps)

        def probe(self, nbytes: int, pings: int, timeout_s: float, stop: Any = None) -> dict[str, Any]:
            self.probes += 1
            if self.fail:
                raise OSError("connection reset")
            return {"ok": True, "bytes": nbytes}

        def close(self) -> None:
            self.closed = True

    dest = Destination("127.0.0.1", 1, 2, lambda j: None, "m", kv_timeout_s=1.0, congestion_control="cubic")
    dest.sender = kv = Sender()
    dest._new_sender = lambda: made.append(Sender()) or made[-1]  # type: ignore[method-assign]
    to = KVDestination("127.0.0.1", 1, 0)
    assert dest.probe(ProbeRequest(to, bytes=10, pace_bps=3e9)) == {"ok": True, "bytes": 10, "paced": True}
    assert dest.probe(ProbeRequest(to, bytes=20, pace_bps=1.5e9)) == {"ok": True, "bytes": 20, "paced": True}
    assert len(made) == 1 and made[0].paced == [3e9, 1.5e9] and made[0].probes == 2
    assert kv.paced == [] and kv.probes == 0
    assert dest.probe(ProbeRequest(to, bytes=30)) == {"ok": True, "bytes": 30, "paced": False} and kv.probes == 1 and kv.paced == []  # unpaced: as before
    made[0].fail = True
    ans = dest.probe(ProbeRequest(to, bytes=40, pace_bps=3e9))
    assert ans["ok"] is False and "connection reset" in ans["reason"] and dest.probe_sender is None and dest.probing is False
    assert dest.probe(ProbeRequest(to, bytes=50, pace_bps=3e9))["ok"] and len(made) == 2


@pytest.mark.parametrize("configured, default, self_paced, paced", [
    ("bbr", "cubic", False, False),  # BBR paces itself: unpaced, over the KV connections
    ("bbr", "cubic", True, True),  # ... unless the router asks for pacing whatever the congestion control
    ("cubic", "bbr", False, True),  # the configured one decides, not the namespace's default
    (None, "bbr", False, False),  # none configured: the namespace's default, which the connections take
    (None, "cubic", False, True),
])
def test_under_a_congestion_control_that_paces_itself_a_probe_goes_unpaced_over_the_kv_connections(
        monkeypatch: pytest.MonkeyPatch, configured: str | None, default: str, self_paced: bool, paced: bool) -> None:
    """docs/router.md, "A paced probe", *Under BBR*: on BBR paced probes over connections of their own found a
    5x dip later and estimated worse than unpaced ones over the warm KV connections (15 pairs, session 54)."""
    import testbed.kv.transport as transport
    from testbed.serving.protocol import KVDestination, ProbeRequest
    from testbed.serving.worker import Destination

    monkeypatch.setattr(transport, "tcp_sysctl", lambda key: default if key == "tcp_congestion_control" else None)
    used: list[str] = []

    class Sender:
        def __init__(self, name: str) -> None:
            self.name = name

        def pace(self, rate_bps: float | None) -> None:
            pass

        def probe(self, nbytes: int, pings: int, timeout_s: float, stop: Any = None) -> dict[str, Any]:
            used.append(self.name)
            return {"ok": True, "bytes": nbytes}

    dest = Destination("127.0.0.1", 1, 2, lambda j: None, "m", kv_timeout_s=1.0, congestion_control=configured)
    dest.sender = Sender("kv")
    dest._new_sender = lambda: Sender("probe")  # type: ignore[method-assign]
    ans = dest.probe(ProbeRequest(KVDestination("127.0.0.1", 1, 0), bytes=10, pace_bps=3e9, pace_self_paced=self_paced))
    assert ans["paced"] is paced and used == ["probe" if paced else "kv"]
    assert transport.paces_itself("bbr") and not transport.paces_itself("cubic") and not transport.paces_itself(None)


def test_a_cancelled_prefill_leaves_the_queue_and_a_running_one_says_its_start(workers):
    """``POST /v1/prefill/cancel`` (the router's client went away before its first token): a queued prefill is
    answered as failed without running; a running one runs on and the answer gives its start; an id the worker
    does not hold is not found."""
    dec, pre = workers
    dest = {"host": "127.0.0.1", "kv_port": dec.kv_port, "instance": 0}
    out: dict[str, dict[str, Any]] = {}

    def post(rid: str) -> None:
        out[rid] = json.loads(request(pre.port, "POST", "/v1/prefill", {"request_id": rid, "input_len": 4096, "decode": dest})[1])

    threads = [threading.Thread(target=post, args=(rid,)) for rid in ("c-running", "c-queued")]
    for t in threads:
        t.start()
        time.sleep(0.1)  # the second queues behind the first (~0.4 s of prefill)
    answers = {rid: json.loads(request(pre.port, "POST", "/v1/prefill/cancel", {"request_id": rid})[1])
               for rid in ("c-queued", "c-running", "c-unknown")}
    depth = json.loads(request(pre.port, "GET", "/v1/state")[1])["queue_depth"]
    assert depth <= 1  # the one running (if still): the cancelled one no longer counts though it is still in the heap
    for t in threads:
        t.join(60)
    assert answers["c-queued"] == {"request_id": "c-queued", "found": True, "dequeued": True, "prefill_start_s": None,
                                   "prefill_end_s": None}
    assert out["c-queued"]["status"] == "failed" and "cancelled in the queue" in out["c-queued"]["reason"]
    assert out["c-queued"].get("prefill_start_s") is None  # it never ran
    running = answers["c-running"]
    assert running["found"] and not running["dequeued"] and running["prefill_end_s"] is None
    assert running["prefill_start_s"] == pytest.approx(out["c-running"]["prefill_start_s"])
    assert out["c-running"]["status"] == "ok"  # it ran on
    assert answers["c-unknown"]["found"] is False
    late = json.loads(request(pre.port, "POST", "/v1/prefill", {"request_id": "c-unknown", "input_len": 10, "decode": dest})[1])
    assert late["status"] == "failed" and late["reason"].startswith("cancelled before it reached this worker")  # overtaken
    again = json.loads(request(pre.port, "POST", "/v1/prefill/cancel", {"request_id": "c-running"})[1])
    assert again["found"] is False  # answered already: remembered as answered, so the id is not refused later
    reused = json.loads(request(pre.port, "POST", "/v1/prefill", {"request_id": "c-running", "input_len": 10, "decode": dest})[1])
    assert not (reused.get("reason") or "").startswith("cancelled"), reused
    status, raw = request(pre.port, "POST", "/v1/prefill/cancel", {"request_id": ""})
    assert status == 400 and b"request_id" in raw


def test_a_decode_whose_router_hangs_up_before_the_kv_lets_the_request_go_at_once(workers):
    """The router aborts a decode stream when its client went away before the first token (and cancels the
    prefill, so no KV comes): the decode ends that request now, not at its request timeout, so its id is free."""
    dec, _ = workers
    body = json.dumps({"request_id": "gone", "input_len": 100, "output_len": 3, "request_timeout_s": 30.0}).encode()
    s = socket.create_connection(("127.0.0.1", dec.port), timeout=10)
    s.sendall(f"POST /v1/decode HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    assert s.recv(4096).startswith(b"HTTP/1.1 200")  # registered, waiting for KV that never comes
    s.shutdown(socket.SHUT_RDWR)
    s.close()
    deadline = time.monotonic() + 5
    again: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        status, raw = request(dec.port, "POST", "/v1/decode", {"request_id": "gone", "input_len": 100, "output_len": 3,
                                                                 "request_timeout_s": 0.2})
        if status == 200:
            again = [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]
            break
        time.sleep(0.05)
    assert [e["status"] for e in again] == ["failed"], "the id stayed in flight after its router hung up"
    assert time.monotonic() < deadline
