"""The router on loopback, with small fake prefill and decode workers defined here; their messages are
`testbed.serving.protocol`'s (docs/protocol.md)."""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

import pytest

from testbed import clock
from testbed.errors import FieldError
from testbed.kv.pool import chain_block_hashes
from testbed.serving.policy import TelemetrySample, parse_policy_section
from testbed.serving.policy.signals import ORACLE_FIELDS
from testbed.serving.protocol import (
    Congestion, DecodeRequest, FinalEvent, PrefillCancel, PrefillCancelled, PrefillRequest, PrefillResult, TokenEvent, WorkerState,
)
from testbed.validation import Fields
from testbed.serving.router import (
    DecodeInstanceConfig, PrefillInstanceConfig, Router, RouterConfig, block_hashes_of, tokenize,
)

B = 512
KV_BYTES_PER_TOKEN = 1000


class FakeWorkers:
    """Prefill instances "ship" KV by setting an event the decode instance waits on (the transport's role)."""

    def __init__(self) -> None:
        self.kv_arrived: dict[str, threading.Event] = {}
        self.prefill_bodies: list[dict[str, Any]] = []
        self.prefix_blocks: dict[int, list[int]] = {}
        self.decode_mode: dict[int, str] = {}  # instance -> "ok" | "die" | "hang"
        self.congestion = Congestion()  # what the prefill instances report in /v1/state
        self.state_polls: list[tuple[float, Congestion]] = []  # (time, congestion answered) of prefill 0's /v1/state
        self.probes: list[dict[str, Any]] = []  # POST /v1/probe bodies
        self.probe_answer: dict[str, Any] = {"ok": False, "reason": "this fake does not probe"}
        self.prefill_gate: threading.Event | None = None  # when set here, a prefill answers only once it is set
        self.prefill_paused_s: float | None = None  # a prefill reports this pause (preempted), inside its start..end
        self.state_raw: bytes | None = None  # when set, prefill instances answer /v1/state with these bytes
        self.event_raw: bytes | None = None  # when set, a decode's first event is this data: line's payload
        self.servers: list[ThreadingHTTPServer] = []
        self.lock = threading.Lock()
        self.prefill_started: dict[str, float] = {}  # request id -> when its prefill began
        self.cancels: list[str] = []  # POST /v1/prefill/cancel request ids

    def event(self, rid: str) -> threading.Event:
        with self.lock:
            return self.kv_arrived.setdefault(rid, threading.Event())

    def serve(self, handler: type[BaseHTTPRequestHandler]) -> int:
        srv = _QuietServer(("127.0.0.1", 0), handler)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
        self.servers.append(srv)
        return srv.server_address[1]

    def prefill(self, instance: int) -> int:
        fw = self

        class H(_Base):
            def do_POST(self) -> None:
                body = self.body()
                if self.path == "/v1/probe":
                    fw.probes.append(body)
                    ans = fw.probe_answer
                    self.json(ans(body) if callable(ans) else ans)
                    return
                if self.path == "/v1/prefill/cancel":  # a running prefill runs on; says its start
                    rid = PrefillCancel.from_json(body).request_id
                    fw.cancels.append(rid)
                    start = fw.prefill_started.get(rid)
                    self.json(PrefillCancelled(rid, start is not None, False, start).to_json())
                    return
                fw.prefill_bodies.append(body)
                req = PrefillRequest.from_json(body)
                start = clock.now_s()
                fw.prefill_started[req.request_id] = start
                time.sleep(0.01)
                if fw.prefill_gate is not None:
                    fw.prefill_gate.wait(10)
                uncached = req.input_len - req.cached_len
                fw.event(req.request_id).set()
                now = clock.now_s()
                paused = fw.prefill_paused_s
                start -= paused or 0.0  # as if it had stood paused that long inside its prefill
                self.json(PrefillResult(req.request_id, "ok", None, start, now, start, now, uncached * KV_BYTES_PER_TOKEN,
                                        uncached * KV_BYTES_PER_TOKEN + 64, prefill_paused_s=paused).to_json())

            def state(self) -> Any:
                if fw.state_raw is not None:
                    return fw.state_raw
                cong = fw.congestion
                if instance == 0:
                    fw.state_polls.append((clock.now_s(), cong))
                return WorkerState("prefill", instance, "prfaas", prefix_blocks=tuple(fw.prefix_blocks.get(instance, [])),
                                   congestion=cong).to_json()

        return self.serve(H)

    def decode(self, instance: int) -> int:
        fw = self

        class H(_Base):
            def do_POST(self) -> None:
                req = DecodeRequest.from_json(self.body())
                mode = fw.decode_mode.get(instance, "ok")
                if mode == "hang":
                    time.sleep(30)
                    return
                self.sse_start()  # a decode answers at once (its prefix header), then waits for the KV
                if fw.event_raw is not None:
                    self.wfile.write(b"data: " + fw.event_raw + b"\n\n")
                    return
                if not fw.event(req.request_id).wait(5):
                    self.sse(FinalEvent("failed", "KV did not arrive").to_json())
                    return
                t_first = None
                for i in range(req.output_len):
                    if mode == "die" and i == 2:
                        self.connection.close()  # the process "dies": no final event
                        return
                    t = clock.now_s()
                    t_first = t_first or t
                    self.sse(TokenEvent(100 + i, i, t).to_json())
                self.sse(FinalEvent("ok", None, 0, None, None, t_first, clock.now_s(), req.output_len).to_json())

            def state(self) -> dict[str, Any]:
                return WorkerState("decode", instance, "pd").to_json()

        return self.serve(H)

    def close(self) -> None:
        for s in self.servers:
            s.shutdown()
            s.server_close()


class _QuietServer(ThreadingHTTPServer):
    """A fake worker whose client (the router) hung up -- a timeout, a test that already ended -- is
    normal here: no traceback on stderr, where it would land in a later test's captured output."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):  # BrokenPipe, ConnectionReset, ConnectionAborted
            return
        super().handle_error(request, client_address)


class _Base(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, *a: Any) -> None:
        return None

    def body(self) -> dict[str, Any]:
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def json(self, obj: Any) -> None:
        data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def sse_start(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

    def sse(self, obj: Any) -> None:
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()

    def do_GET(self) -> None:
        self.json(self.state())


def make_config(fw: FakeWorkers, policy: dict[str, Any] | None = None, **kw: Any) -> RouterConfig:
    prefill = (PrefillInstanceConfig("prfaas", 0, "127.0.0.1", fw.prefill(0)),
               PrefillInstanceConfig("pd", 1, "127.0.0.1", fw.prefill(1)))
    decode = tuple(DecodeInstanceConfig(j, "127.0.0.1", fw.decode(j), 9000 + j) for j in (0, 1))
    spec = parse_policy_section(Fields(policy or {"name": "prfaas", "threshold": "8K"}, "policy"))
    opts = dict(host="127.0.0.1", port=0, scale=10.0, wan_capacity_bps=10e9, request_timeout_s=5.0, state_poll_s=0.1)
    opts.update(kw)
    return RouterConfig(prefill, decode, spec, **opts)


@pytest.fixture
def fw():
    w = FakeWorkers()
    try:
        yield w
    finally:
        w.close()


@pytest.fixture
def router(fw):
    routers: list[Router] = []

    def start(**kw: Any) -> Router:
        r = Router(make_config(fw, **kw))
        r.start()
        routers.append(r)
        return r

    try:
        yield start
    finally:
        for r in routers:
            r.stop()


def url(r: Router, path: str) -> str:
    return f"http://127.0.0.1:{r.address[1]}{path}"


def post(r: Router, path: str, body: Any, timeout: float = 20) -> tuple[int, Any]:
    req = urllib.request.Request(url(r, path), json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def get_text(r: Router, path: str) -> str:
    with urllib.request.urlopen(url(r, path), timeout=10) as resp:
        return resp.read().decode()


# ------------------------------------------------------------------------------------------- tests


def test_the_openai_client_streams_a_completion_through_the_router(router) -> None:
    import openai  # a test dependency (pyproject.toml [test]): installed by scripts/bootstrap.sh setup

    r = router()
    client = openai.OpenAI(base_url=url(r, "/v1"), api_key="unused", max_retries=0)
    chunks = list(client.completions.create(model="prfaas", prompt="the quick brown fox", max_tokens=5, stream=True))
    texts = [c.choices[0].text for c in chunks if c.choices[0].text]
    assert texts == [" t100", " t101", " t102", " t103", " t104"]
    assert chunks[-1].choices[0].finish_reason == "length"
    (rec,) = r.records()
    assert (rec["status"], rec["route"], rec["input_len"], rec["output_len"]) == ("ok", "pd", 4, 5)
    assert rec["arrival_s"] <= rec["prefill_start_s"] <= rec["prefill_end_s"] <= rec["first_token_s"] <= rec["finish_s"]
    models = client.models.list()
    assert [m.id for m in models.data] == ["prfaas"]


def test_non_streaming_token_id_prompts_return_all_tokens_and_usage(router) -> None:
    r = router()
    code, body = post(r, "/v1/completions", {"prompt": list(range(300)), "max_tokens": 3})
    assert code == 200
    assert body["choices"][0]["text"] == " t100 t101 t102"
    assert body["usage"] == {"prompt_tokens": 300, "completion_tokens": 3, "total_tokens": 303}


def test_long_hashed_prompts_are_offloaded_and_a_prefix_hit_cuts_the_kv_bytes(router, fw) -> None:
    r = router()
    hashes = list(range(1, 41))  # 40 blocks
    code, _ = post(r, "/v1/completions", {"max_tokens": 2, "prfaas": {"block_hashes": hashes, "input_len": 40 * B, "request_id": "a"}})
    assert code == 200
    more = hashes + [77, 78]
    code, _ = post(r, "/v1/completions", {"max_tokens": 2, "prfaas": {"block_hashes": more, "input_len": 42 * B, "request_id": "b"}})
    assert code == 200
    a, b = r.records()
    assert (a["route"], a["prefill_instance"], a["cached_len"], a["kv_bytes"]) == ("prfaas", 0, 0, 40 * B * KV_BYTES_PER_TOKEN)
    assert (b["route"], b["prefill_instance"], b["cached_len"], b["uncached_len"]) == ("prfaas", 0, 40 * B, 2 * B)
    assert b["kv_bytes"] == 2 * B * KV_BYTES_PER_TOKEN
    assert b["kv_bytes_emulated"] == 10 * b["kv_bytes"]  # scale 10: the policy works in emulated bytes
    assert r.policy.controller.kv_bytes_model()(1000) == pytest.approx(1000 * KV_BYTES_PER_TOKEN * 10)
    sent = fw.prefill_bodies[1]
    assert sent["cached_len"] == 40 * B and sent["block_hashes"] == more
    assert sent["decode"]["kv_port"] == 9000 + sent["decode"]["instance"]


def test_the_prefill_request_carries_the_decision_s_priority_and_the_ttft_objective(router, fw) -> None:
    r = router(slo_ttft_s=7.0)
    code, _ = post(r, "/v1/completions", {"max_tokens": 1, "prfaas": {"block_hashes": list(range(900, 904)), "input_len": 4 * B}})
    assert code == 200 and (fw.prefill_bodies[-1]["priority"], fw.prefill_bodies[-1]["slo_ttft_s"]) == (0, 7.0)
    decide = r.policy.decide
    r.policy.decide = lambda req, state: decide(req, state)._replace(priority=1)  # as natives-first marks a moved request
    code, _ = post(r, "/v1/completions", {"max_tokens": 1, "prfaas": {"block_hashes": list(range(910, 914)), "input_len": 4 * B}})
    assert code == 200 and fw.prefill_bodies[-1]["priority"] == 1
    assert [rec["route"] for rec in r.records()] == ["pd", "pd"]
    assert RouterConfig.from_mapping(r.cfg.to_mapping()).slo_ttft_s == 7.0


def test_the_policy_learns_a_prefill_s_own_time_without_the_pause_it_stood_preempted(router, fw) -> None:
    r = router()
    seen: list[tuple[str, int, float]] = []
    r.policy.on_prefill = lambda route, computed, seconds: seen.append((route, computed, seconds))
    fw.prefill_paused_s = 2.0  # PD-P ran two seconds of other prefills first (natives-first preemption)
    code, _ = post(r, "/v1/completions", {"max_tokens": 1, "prfaas": {"block_hashes": list(range(920, 924)), "input_len": 4 * B}})
    assert code == 200 and [(route, n) for route, n, _ in seen] == [("pd", 4 * B)]
    rec = r.records()[-1]
    assert rec["prefill_end_s"] - rec["prefill_start_s"] > 2.0  # the record keeps the span, pause included
    assert 0.0 < seen[0][2] < 1.0  # the policy's PD-P cost is the prefill's own ~0.01 s


def test_worker_prefix_pools_reported_in_state_steer_requests_to_the_holder(router, fw) -> None:
    hashes = list(range(500, 540))
    fw.prefix_blocks[1] = chain_block_hashes(hashes[:36])  # PD-P instance 1 holds 18K tokens
    r = router()
    deadline = time.monotonic() + 5
    while r.kv.blocks_held(1) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    code, _ = post(r, "/v1/completions", {"max_tokens": 1, "prfaas": {"block_hashes": hashes, "input_len": 40 * B}})
    (rec,) = r.records()
    assert code == 200 and (rec["route"], rec["prefill_instance"], rec["cached_len"]) == ("pd", 1, 36 * B)


def test_the_router_counts_each_prefill_instance_s_uncached_tokens_in_flight_until_the_prefill_answers(router, fw) -> None:
    """What `policy.prefill_pick: tokens` reads: the uncached tokens added at dispatch, taken away when the
    prefill answers, per instance; a prefix hit counts only the rest."""
    hashes = list(range(700, 740))
    fw.prefix_blocks[1] = chain_block_hashes(hashes[:36])  # PD-P instance 1 holds 18K tokens
    fw.prefill_gate = threading.Event()
    r = router()
    deadline = time.monotonic() + 5
    while r.kv.blocks_held(1) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    done: list[int] = []
    t = threading.Thread(target=lambda: done.append(post(r, "/v1/completions", {
        "max_tokens": 1, "prfaas": {"block_hashes": hashes, "input_len": 40 * B}})[0]))
    t.start()
    try:
        deadline = time.monotonic() + 5
        while not fw.prefill_bodies and time.monotonic() < deadline:
            time.sleep(0.01)
        assert {i: x.inflight_tokens for i, x in r.prefill.items()} == {0: 0, 1: 4 * B}
        assert r._states(r.prefill)[1].tokens_in_flight == 4 * B
    finally:
        fw.prefill_gate.set()
        t.join(20)
    assert done == [200]
    deadline = time.monotonic() + 5
    while any(x.inflight for x in r.prefill.values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(x.inflight == 0 and x.inflight_tokens == 0 for x in r.prefill.values())


def test_a_decode_worker_dying_mid_request_gives_a_failed_record_with_a_reason_and_no_hang(router, fw) -> None:
    fw.decode_mode = {0: "die", 1: "die"}
    r = router()
    t0 = time.monotonic()
    code, body = post(r, "/v1/completions", {"prompt": "hello there", "max_tokens": 8})
    assert time.monotonic() - t0 < 5
    assert code == 502 and "failed" in body["error"]["message"]
    (rec,) = r.records()
    assert rec["status"] == "failed" and "decode instance" in rec["reason"] and "final event" in rec["reason"]
    # the decode's failure answers the client at once; the prefill thread may still be reading its worker's
    # answer then (its count is released when it has), so the counts must drain soon, not at that instant
    deadline = time.monotonic() + 5
    while any(x.inflight for x in list(r.prefill.values()) + list(r.decode.values())) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(x.inflight == 0 for x in list(r.prefill.values()) + list(r.decode.values()))
    assert all(x.inflight_tokens == 0 for x in r.prefill.values())


def test_a_streaming_client_sees_an_error_when_the_decode_worker_dies(router, fw) -> None:
    import openai  # a test dependency (pyproject.toml [test]): installed by scripts/bootstrap.sh setup

    fw.decode_mode = {0: "die", 1: "die"}
    r = router()
    client = openai.OpenAI(base_url=url(r, "/v1"), api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError, match="failed"):
        list(client.completions.create(model="prfaas", prompt="a b c", max_tokens=8, stream=True))
    assert r.records()[0]["status"] == "failed"


def test_a_silent_decode_worker_times_out_instead_of_hanging(router, fw) -> None:
    fw.decode_mode = {0: "hang", 1: "hang"}
    r = router(request_timeout_s=0.5)
    t0 = time.monotonic()
    code, _ = post(r, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert code == 502 and time.monotonic() - t0 < 4
    assert "timed out" in r.records()[0]["reason"]


def test_an_unreachable_prefill_worker_fails_the_request_and_the_next_one_avoids_it(router, fw) -> None:
    r = router(state_poll_s=60)
    dead = r.prefill[1]
    object.__setattr__(dead.cfg, "port", 1)  # nothing listens on port 1
    code, _ = post(r, "/v1/completions", {"prompt": "short prompt", "max_tokens": 2})
    assert code == 502
    rec = r.records()[0]
    assert rec["status"] == "failed" and "prefill instance 1" in rec["reason"]
    code, _ = post(r, "/v1/completions", {"prompt": "short prompt again", "max_tokens": 2})
    assert code == 200 and r.records()[1]["route"] == "prfaas" and "fallback" in r.records()[1]["route_reason"]


def metric(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """One sample's value from the exposition, parsed by prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and (labels is None or all(s.labels.get(k) == v for k, v in labels.items())):
                return float(s.value)
    raise AssertionError(f"{name} {labels or ''} not in /metrics")


def test_metrics_expose_the_threshold_and_it_rises_after_oracle_wan_telemetry_shows_saturation(router) -> None:
    r = router(policy={"name": "prfaas", "threshold": "8K", "signals": "oracle", "control": {"interval": "50ms"}})
    text = get_text(r, "/metrics")
    assert metric(text, "prfaas_router_threshold_tokens") == 8192
    assert metric(text, "prfaas_router_queue_depth", {"role": "prefill", "cluster": "prfaas", "instance": "0"}) == 0
    assert metric(text, "prfaas_router_tokens_in_flight", {"role": "prefill", "cluster": "prfaas", "instance": "0"}) == 0
    assert metric(text, "prfaas_router_signals_oracle") == 1
    # wire units: 1 Gbit/s on a 1 Gbit/s wire at scale 10 -> 10 Gbit/s emulated
    for i in range(10):
        code, _ = post(r, "/v1/telemetry", {"t_s": clock.now_s(), "egress_bps": 1e9, "capacity_bps": 1e9, "backlog_bytes": 1000, "drops": 0})
        assert code == 200
        time.sleep(0.05)
    time.sleep(0.3)
    assert r.policy.threshold == 8192  # a full line alone: no step without a demand model (docs/router.md)
    deadline = time.monotonic() + 2
    while r.policy.threshold == 8192 and time.monotonic() < deadline:
        # what the PrfaaS workers' senders would report: 2 s of the 10 Gbit/s line committed, which will
        # not drain within a new offload's prefill
        r.policy.on_telemetry(TelemetrySample(clock.now_s(), send_queue_bytes=2 * 1e10 / 8))
        time.sleep(0.05)
    text = get_text(r, "/metrics")
    assert metric(text, "prfaas_router_threshold_tokens") >= 1.5 * 8192
    assert metric(text, "prfaas_router_wan_capacity_bps_emulated") == 1e10
    assert metric(text, "prfaas_router_threshold_changes_total") >= 1


def test_metrics_carry_latency_histograms_by_route_and_cluster(router) -> None:
    r = router()
    for i in range(3):
        code, _ = post(r, "/v1/completions", {"prompt": f"short prompt {i}", "max_tokens": 4})
        assert code == 200
    recs = [x for x in r.records() if x["status"] == "ok"]
    assert len(recs) == 3
    text = get_text(r, "/metrics")
    route = recs[0]["route"]
    labels = {"route": route, "cluster": route}
    assert metric(text, "prfaas_router_ttft_seconds_count", labels) == sum(1 for x in recs if x["route"] == route)
    ttft = sum(x["first_token_s"] - x["arrival_s"] for x in recs if x["route"] == route)
    assert metric(text, "prfaas_router_ttft_seconds_sum", labels) == pytest.approx(ttft, rel=1e-6)
    for name in ("tpot", "queue_wait", "prefill", "kv_transfer"):
        assert metric(text, f"prfaas_router_{name}_seconds_count", labels) >= 1, name
    assert metric(text, "prfaas_router_ttft_seconds_bucket", {**labels, "le": "+Inf"}) == metric(text, "prfaas_router_ttft_seconds_count", labels)
    assert metric(text, "prfaas_router_requests_total", {"route": route, "status": "ok"}) == 3


def test_bad_client_requests_get_400_naming_the_field(router) -> None:
    r = router()
    for body, param in (({"prompt": "x", "max_tokens": 0}, "max_tokens"), ({"max_tokens": 2}, "prompt"),
                        ({"prfaas": {"block_hashes": [1, 2, 3], "input_len": 100}}, "prfaas.block_hashes"),
                        ({"prompt": "x", "stream": "false"}, "stream"), ({"prompt": "x", "stream": 1}, "stream"),
                        ({"prompt": "x", "model": ["prfaas"]}, "model"),
                        ({"prompt": "x", "prfaas": {"request_id": "r" * 256}}, "prfaas.request_id"),
                        ({"prompt": "x", "prfaas": {"request_id": {"id": 1}}}, "prfaas.request_id"),
                        ({"prompt": "a \ud800 b"}, "prompt"), ({"prompt": "x", "max_tokens": 10 ** 21}, "max_tokens"),
                        ({"prompt": "x", "max_tokens": 16 * 2 ** 20 + 1}, "max_tokens"),
                        ({"prfaas": {"block_hashes": [1], "input_len": 10 ** 21}}, "prfaas.input_len"),
                        # taken as no extension, ignored, or served as if absent until 2026-12-07 (session 65)
                        ({"prompt": "x", "prfaas": []}, "prfaas"), ({"prompt": "x", "prfaas": 0}, "prfaas"),
                        ({"prompt": "x", "prfaas": {"block_hash": [1]}}, "prfaas.block_hash"),
                        ({"prompt": "x", "prfaas": {"input_len": 5}}, "prfaas.input_len"),
                        ({"prfaas": {"block_hashes": [10 ** 30], "input_len": 100}}, "prfaas.block_hashes"),
                        ({"prfaas": {"block_hashes": [-(2 ** 63) - 1], "input_len": 100}}, "prfaas.block_hashes"),
                        ({"prompt": "x", "prfaas": {"request_id": 0}}, "prfaas.request_id")):
        code, out = post(r, "/v1/completions", body)
        assert code == 400 and out["error"]["param"] == param
    for sample, param in (({"egress_bps": "fast"}, "egress_bps"), ({"backlog_bytes": 10 ** 400}, "backlog_bytes"),
                          ({"t_s": float("nan"), "egress_bps": 1}, "t_s"), ({"t_s": "now", "egress_bps": 1}, "t_s"),
                          ({"units": "bits", "egress_bps": 1}, "units"), ({"t_s": 1e300, "egress_bps": 1}, "t_s")):
        code, out = post(r, "/v1/telemetry", sample)
        assert code == 400 and out["error"]["param"] == param
    assert r.records() == [] and r.state()["wan"]["egress_bps"] == 0.0  # no refused sample was taken
    code, out = post(r, "/v1/telemetry", [{"egress_bps": 5e9}, {"egress_bps": -1}])  # a good sample, then a bad one
    assert code == 400 and out["error"]["param"] == "egress_bps"
    assert r.state()["wan"]["egress_bps"] == 0.0  # the list is refused whole: not even its good sample was taken
    assert post(r, "/v1/telemetry", [{"egress_bps": 5e9}, "x"])[0] == 400 and r.state()["wan"]["egress_bps"] == 0.0
    assert post(r, "/v1/telemetry", [{"egress_bps": 5e9}])[0] == 200 and r.state()["wan"]["egress_bps"] > 0


def test_the_prfaas_extension_is_read_with_fields_and_refused_naming_the_field_and_what_is_allowed() -> None:
    """The body's ``prfaas`` object (`PrfaasExtension`, read with `validation.Fields`; its hashes with
    `blocks.block_hashes`): what it took it takes, and each refusal names ``prfaas.<key>`` and what is allowed."""
    from testbed.serving.router import BadRequest, parse_completion

    cfg = RouterConfig((), ())
    for ext in (None, {}, {"request_id": None}, {"block_hashes": [], "input_len": 1}, {"block_hashes": [2**63 - 1], "input_len": B},
                {"block_hashes": [-(2**63), 2], "input_len": B + 1, "request_id": "r1"}):
        c = parse_completion({"prompt": "a b c", "prfaas": ext}, cfg)
        hashed = bool(ext and "block_hashes" in ext)
        assert c.block_hashes == (ext["block_hashes"] if hashed else block_hashes_of(tokenize("a b c", cfg.vocab_size)))
        assert c.input_len == (ext["input_len"] if hashed else 3)
        rid = (ext or {}).get("request_id")
        assert c.request_id == rid if rid else c.request_id.startswith("cmpl-")
    refused = [
        ([], "prfaas", "must be a mapping of keys to values, got list; give an object of block_hashes, input_len, request_id, or null"),
        ({"block_hash": [1]}, "prfaas.block_hash", "unknown key; did you mean 'block_hashes'? allowed keys here: block_hashes, input_len, request_id"),
        ({"input_len": 5}, "prfaas.input_len", "goes with prfaas.block_hashes (a prompt's length is its own)"),
        ({"input_len": None}, "prfaas.input_len", "goes with prfaas.block_hashes (a prompt's length is its own)"),
        ({"block_hashes": None}, "prfaas.block_hashes", "null is not a list of whole numbers (block hashes); give one, or leave the key out"),
        ({"block_hashes": [True], "input_len": 5}, "prfaas.block_hashes", "must be a list of whole numbers (block hashes); item 0 is True"),
        ({"block_hashes": [1]}, "prfaas.input_len", "is required with prfaas.block_hashes: a whole number from 1 to 16777216"),
        ({"block_hashes": [1], "input_len": None}, "prfaas.input_len", "is required with prfaas.block_hashes: a whole number from 1 to 16777216"),
        ({"block_hashes": [1], "input_len": 0}, "prfaas.input_len", "0 is not a whole number >= 1"),
        ({"block_hashes": [1], "input_len": 2**24 + 1}, "prfaas.input_len", "16777217 is more than 16777216 tokens (16M), past any model's context"),
        ({"block_hashes": [1, 2], "input_len": B}, "prfaas.block_hashes", f"2 hashes for {B} tokens; at most one per {B} tokens"),
        ({"request_id": ""}, "prfaas.request_id", "'' is not a non-empty string"),
        ({"block_hashes": [1], "input_len": "x" * 5000}, "prfaas.input_len",  # echoed whole until 2026-12-07
         f"{'x' * 60!r}... (5000 characters) is not a whole number >= 1"),
    ]
    for ext, param, message in refused:
        with pytest.raises(BadRequest) as e:
            parse_completion({"prompt": "a b c", "prfaas": ext}, cfg)
        assert (e.value.param, str(e.value), e.value.status) == (param, message, 400), ext


def test_a_telemetry_sample_with_an_unknown_key_gets_400_naming_it_and_the_allowed_keys(router) -> None:
    r = router()
    allowed = "allowed keys here: backlog_bytes, capacity_bps, drops, egress_bps, t_s, units"
    for body in ({"egress_bps": 5e9, "capacity_bp": 1e9}, [{"egress_bps": 5e9}, {"capacity_bp": 1e9}]):
        code, out = post(r, "/v1/telemetry", body)  # a typo of capacity_bps was ignored: the capacity stayed the configured one
        assert (code, out["error"]["param"], out["error"]["message"]) == (400, "capacity_bp", f"capacity_bp: unknown key; did you mean 'capacity_bps'? {allowed}")
    assert r.state()["wan"]["egress_bps"] == 0.0  # neither sample was taken
    code, out = post(r, "/v1/telemetry", {"units": "emulated", "t_s": clock.now_s(), "egress_bps": 1.0, "capacity_bps": 2.0,
                                          "backlog_bytes": 3.0, "drops": 4.0})
    assert code == 200 and r.state()["wan"]["capacity_bps"] == 2.0
    # 1e308 wire bit/s at scale 10 was taken as inf emulated bit/s, which the policy and the estimator's truth read
    code, out = post(r, "/v1/telemetry", {"egress_bps": 1e308})
    assert (code, out["error"]["param"]) == (400, "egress_bps") and "x the scale 10" in out["error"]["message"]
    assert r.state()["wan"]["egress_bps"] == 1.0  # not taken


def test_every_key_the_runs_telemetry_relay_sends_is_one_the_router_takes(router) -> None:
    """The relay (`testbed.runner.relay`) posts through the client agent, which drops a refused sample silently:
    a key the router does not take would lose every WAN sample of a real run."""
    from testbed.runner.live import LiveState
    from testbed.runner.relay import TelemetryRelay
    from testbed.scale import Scale

    r = router()
    relay = TelemetryRelay(LiveState(), Scale(10))
    relay({"direction": "prfaas_to_pd", "rate_bps": 1e9, "achieved_bps": 5e8, "backlog_bytes": 1000, "drops": 2, "link_up": True})
    assert post(r, "/v1/telemetry", relay.samples.get_nowait()) == (200, {"ok": True})
    assert r.state()["wan"]["egress_bps"] == r.scale.emulated_bps(5e8)


def raw_request(r: Router, data: bytes, half_close: bool = False, timeout: float = 10) -> tuple[int, Any]:
    """Send `data` as it is on a fresh connection; the answer's status and JSON body."""
    with socket.create_connection(("127.0.0.1", r.address[1]), timeout=timeout) as s:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def post_head(path: str, *headers: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n").encode()


def test_a_body_that_is_not_exactly_its_content_length_of_json_gets_an_error_naming_the_header(router, capsys) -> None:
    r = router(request_timeout_s=1.0)
    body = b'{"prompt": "a b", "max_tokens": 1}'
    for head, data, half_close, code, param, says in (
            (post_head("/v1/completions", "Content-Length: abc"), body, False, 400, "Content-Length", "not a whole number"),
            (post_head("/v1/completions", "Content-Length: -1"), body, False, 400, "Content-Length", "not a whole number"),
            (post_head("/v1/completions", "Transfer-Encoding: chunked"), b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body), False,
             411, "Transfer-Encoding", "not supported"),
            (post_head("/v1/completions", f"Content-Length: {1 << 40}"), b"", False, 413, "Content-Length", "above the limit"),
            (post_head("/v1/completions", "Content-Length: 1000"), body, True, 400, "body", f"ended after {len(body)}"),
            (post_head("/v1/completions", "Content-Length: 1000"), body, False, 400, "body", "did not arrive within 1.0 s"),
            (post_head("/v1/telemetry", "Content-Length: 200000"), b"[" * 100000 + b"]" * 100000, False, 400, "body",
             "nested too deeply")):
        t0 = time.monotonic()
        got, out = raw_request(r, head + data, half_close)
        assert (got, out["error"]["param"]) == (code, param) and says in out["error"]["message"], out
        assert time.monotonic() - t0 < 5
    assert post(r, "/v1/completions", {"prompt": "a b", "max_tokens": 1})[0] == 200  # still serving
    assert [x["status"] for x in r.records()] == ["ok"]  # nothing of the refused bodies was served
    assert "Traceback" not in capsys.readouterr().err


def test_a_request_trickled_a_byte_at_a_time_is_cut_off_at_the_timeout_and_a_key_given_twice_is_refused(router, capsys) -> None:
    """Slowloris: `request_timeout_s` bounded each read, so headers or a body sent a byte every 0.2 s held a router
    thread as long as the client liked (2026-12-07); the request's line, headers and body now share it. And
    ``{"max_tokens": 1, "max_tokens": 99}`` was served with 99, the first value dropped without a word."""
    r = router(request_timeout_s=1.0)

    from tests.unit.test_worker import trickle as drip_to

    def trickle(head: bytes, drip: bytes) -> tuple[float, bytes]:
        return drip_to(r.address[1], head, drip)

    took, out = trickle(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", b"X-Drip: " + b"a" * 40)
    assert took < 3 and out == b"", (took, out)
    took, out = trickle(post_head("/v1/completions", "Content-Length: 50"), b"{" + b" " * 40)
    assert took < 3 and json.loads(out.partition(b"\r\n\r\n")[2])["error"]["message"] == \
        "body: the 50 bytes of Content-Length did not arrive within 1.0 s", (took, out)
    body = b'{"prompt": "a b", "max_tokens": 1, "max_tokens": 99}'
    code, out = raw_request(r, post_head("/v1/completions", f"Content-Length: {len(body)}") + body)
    assert (code, out["error"]["param"], out["error"]["message"]) == (400, "max_tokens",
                                                                       "max_tokens: is given twice in one object; give it once")
    body = b'{"egress_bps": 1, "units": "wire", "egress_bps": 2}'
    assert raw_request(r, post_head("/v1/telemetry", f"Content-Length: {len(body)}") + body)[1]["error"]["param"] == "egress_bps"
    assert post(r, "/v1/completions", {"prompt": "a b", "max_tokens": 1})[0] == 200  # still serving
    assert [x["status"] for x in r.records()] == ["ok"] and r.state()["wan"]["egress_bps"] == 0.0
    assert "Traceback" not in capsys.readouterr().err


def test_a_prompt_longer_than_any_context_gets_400_naming_it() -> None:
    """A prompt of more than `units.MAX_TOKENS` tokens was served (the bound held for max_tokens and prfaas.input_len
    only), and the workers refused its input_len: a 502 for the client's own mistake (2026-12-07)."""
    from testbed.serving.router import BadRequest, parse_completion
    from testbed.units import MAX_TOKENS

    cfg = RouterConfig((), ())
    for prompt in ([0] * (MAX_TOKENS + 1), "a " * (MAX_TOKENS + 1)):
        with pytest.raises(BadRequest) as e:
            parse_completion({"prompt": prompt}, cfg)
        assert (e.value.param, str(e.value)) == ("prompt", f"{MAX_TOKENS + 1} tokens, more than {MAX_TOKENS} (16M), past any "
                                                           "model's context")
    assert parse_completion({"prompt": [0] * MAX_TOKENS}, cfg).input_len == MAX_TOKENS


def test_a_worker_answer_that_breaks_json_or_a_float_fails_its_request_not_a_router_thread(router, fw, capsys) -> None:
    """What the workers send is read as any bytes from the network: a /v1/state nested 100,000 deep was a
    RecursionError that ended the router's state polls for the run, a decode event so nested a traceback that lost the
    request's record, and a probe's rate of 10**400 an OverflowError that ended its probe thread (2026-12-07)."""
    fw.state_raw = b"[" * 100_000 + b"]" * 100_000
    r = router()
    deadline = time.monotonic() + 5
    while r.state()["instances"][0]["healthy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not r.state()["instances"][0]["healthy"]  # a state that breaks the protocol: unhealthy
    fw.state_raw = None
    while not r.state()["instances"][0]["healthy"] and time.monotonic() < deadline + 5:
        time.sleep(0.05)
    assert r.state()["instances"][0]["healthy"]  # and the polls went on: healthy again
    fw.event_raw = b"[" * 100_000 + b"]" * 100_000
    code, out = post(r, "/v1/completions", {"prompt": "a b", "max_tokens": 1})
    assert code == 502 and "JSON nested too deeply" in out["error"]["message"]
    assert [x["status"] for x in r.records()] == ["failed"]
    inst, dest = r.prefill[0], r.decode[0]
    for rate in (b"1" + b"0" * 400, b"NaN", b"-1"):
        fw.probe_answer = b'{"ok": true, "reason": null, "bytes": 1000, "rate_bps": %s, "rtt_ms": 1.0}' % rate
        ans = r.probe(inst, dest, 1e6)
        assert ans is not None and r.log.rows("probe")[-1]["ok"] is False  # no rate: not a measurement
    fw.probe_answer = b'{"ok": true, "ok": false, "rate_bps": 1e9, "bytes": 1000}'
    assert r.probe(inst, dest, 1e6) is None  # an answer that gives a key twice is no answer
    assert "Traceback" not in capsys.readouterr().err


def test_a_client_that_hangs_up_before_its_answer_leaves_no_traceback(router, capsys) -> None:
    r = router()
    body = json.dumps({"prompt": "a b", "max_tokens": 2}).encode()
    s = socket.create_connection(("127.0.0.1", r.address[1]), timeout=10)
    s.sendall(post_head("/v1/completions", f"Content-Length: {len(body)}") + body)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()  # a reset: the router's answer finds no one
    deadline = time.monotonic() + 10
    while not r.records() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # the answer's write comes after the record
    assert post(r, "/v1/completions", {"prompt": "a b", "max_tokens": 1})[0] == 200
    assert "Traceback" not in capsys.readouterr().err


def test_a_wrong_method_or_a_malformed_request_line_gets_a_json_error(router) -> None:
    r = router()
    code, out = raw_request(r, b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n")
    assert code == 405 and out["error"]["message"] == "GET is not allowed on /v1/completions; use POST"
    code, out = raw_request(r, post_head("/metrics", "Content-Length: 0"))
    assert code == 405 and out["error"]["message"] == "POST is not allowed on /metrics; use GET"
    code, out = raw_request(r, b"PUT /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert code == 501 and "PUT" in out["error"]["message"]
    with socket.create_connection(("127.0.0.1", r.address[1]), timeout=10) as s:  # answered HTTP/0.9 style: body only
        s.sendall(b"\x00garbage\r\n\r\n")
        assert "Bad request syntax" in json.loads(s.makefile("rb").read())["error"]["message"]
    assert raw_request(r, b"GET /nope HTTP/1.1\r\n\r\n")[0] == 404
    assert post(r, "/v1/completions", {"prompt": "a b", "max_tokens": 1})[0] == 200


def test_text_prompts_tokenise_deterministically_into_block_hashes() -> None:
    a = tokenize("one two three " * 400, 32000)
    assert a == tokenize("one two three " * 400, 32000) and len(a) == 1200 and max(a) < 32000
    h = block_hashes_of(a)
    assert len(h) == 3 and h[:2] == block_hashes_of(a[:1024]) and h != block_hashes_of(a[1:])


def test_the_config_round_trips_and_a_bad_field_is_named(tmp_path: Path, fw) -> None:
    cfg = make_config(fw)
    cfg.save(tmp_path / "c.json")
    assert RouterConfig.load(tmp_path / "c.json") == cfg
    bad = cfg.to_mapping()
    bad["decode"][0]["kv_port"] = "x"
    with pytest.raises(FieldError) as err:
        RouterConfig.from_mapping(bad)
    assert err.value.field == "decode[0].kv_port"
    bad = cfg.to_mapping()
    bad["policy"]["name"] = "magic"
    with pytest.raises(FieldError, match="policy.name"):
        RouterConfig.from_mapping(bad)


def test_the_entry_point_serves_from_a_config_file_and_writes_its_logs(tmp_path: Path, fw) -> None:
    cfg = make_config(fw)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from dataclasses import replace

    replace(cfg, port=port).save(tmp_path / "router.json")
    proc = subprocess.Popen([sys.executable, "-m", "testbed.serving.router", "--config", str(tmp_path / "router.json"),
                             "--out", str(tmp_path / "out")], stderr=subprocess.PIPE, text=True)
    try:
        assert "listening" in proc.stderr.readline()
        body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert json.loads(resp.read())["choices"][0]["text"] == " t100 t101"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # wait for one tick of the control loop
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/scheduler", timeout=10) as resp:
                if any(row["kind"] == "control" for row in json.loads(resp.read())):
                    break
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    import pandas as pd

    assert proc.returncode == 0
    sched = pd.read_parquet(tmp_path / "out" / "scheduler.parquet")
    reqs = pd.read_parquet(tmp_path / "out" / "router_requests.parquet")
    assert (sched["kind"] == "decision").sum() == 1 and list(reqs["status"]) == ["ok"]
    assert (sched["kind"] == "control").sum() >= 1 and (sched.loc[sched["kind"] == "control", "threshold"] == 8192).all()


def test_an_unreachable_decode_worker_fails_fast_and_leaves_no_request_counted_in_flight(router) -> None:
    r = router(state_poll_s=60)
    for d in r.decode.values():
        object.__setattr__(d.cfg, "port", 1)
    code, _ = post(r, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert code == 502 and "decode instance" in r.records()[0]["reason"]
    assert all(x.inflight == 0 for x in list(r.prefill.values()) + list(r.decode.values()))
    assert all(x.inflight_tokens == 0 for x in r.prefill.values())


def test_standby_instances_receive_nothing_until_a_role_flip_activates_them(fw) -> None:
    from dataclasses import replace

    cfg = make_config(fw)
    cfg = replace(cfg, decode=(cfg.decode[0], replace(cfg.decode[1], standby=True)))
    r = Router(cfg)
    r.start()
    try:
        for _ in range(3):
            assert post(r, "/v1/completions", {"prompt": "x y", "max_tokens": 1})[0] == 200
        assert [rec["decode_instance"] for rec in r.records()] == [0, 0, 0]
        assert metric(get_text(r, "/metrics"), "prfaas_router_instance_up", {"role": "decode", "cluster": "pd", "instance": "1"}) == 0
    finally:
        r.stop()


def test_every_series_the_grafana_dashboard_queries_is_exposed_by_the_router(router) -> None:
    import re

    from prometheus_client.parser import text_string_to_metric_families

    dash = json.loads((Path(__file__).resolve().parents[2] / "dashboards" / "grafana-prfaas.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"prfaas_router_\w+", e)}
    r = router()
    assert post(r, "/v1/completions", {"prompt": "one short prompt", "max_tokens": 2})[0] == 200
    exposed = {s.name for fam in text_string_to_metric_families(get_text(r, "/metrics")) for s in fam.samples}
    assert len(used) >= 10 and not used - exposed, sorted(used - exposed)


def test_no_oracle_field_reaches_the_policy_of_a_router_in_observed_mode(router) -> None:
    r = router(policy={"name": "prfaas", "threshold": "8K", "signals": "observed", "control": {"interval": "50ms"}})
    seen: list[TelemetrySample] = []
    inner = r.policy.on_telemetry
    r.policy.on_telemetry = lambda s: (seen.append(s), inner(s))[1]  # type: ignore[method-assign]
    for _ in range(5):
        body = json.dumps({"t_s": clock.now_s(), "egress_bps": 1e9, "capacity_bps": 1e8, "backlog_bytes": 1e6, "drops": 10}).encode()
        assert post(r, "/v1/telemetry", json.loads(body))[0] == 200
    time.sleep(0.5)  # a few state polls (every 0.1 s) and control ticks
    r.log_signals(clock.now_s())
    assert seen, "the policy got no sample at all"
    leaked = [(f, s) for s in seen for f in ORACLE_FIELDS if getattr(s, f) is not None]
    assert not leaked, leaked
    # the router still knows the truth, for the logs and the dashboard, and says which mode it ran
    row = r.log.rows("signals")[-1]
    assert row["signals"] == "observed" and row["wan_capacity_bps"] == pytest.approx(1e8 * r.cfg.scale)
    assert r.policy.controller.capacity_bps == r.cfg.wan_capacity_bps  # nominal, never the pushed capacity


def test_an_idle_observed_router_probes_the_path_and_the_estimate_takes_a_probe_that_found_a_dip(router, fw) -> None:
    """No KV moves: after `probe_after` the router asks the PrfaaS prefill instance for a probe sized to
    5 BDPs at the estimate (the nominal 10 Gbps before any measurement; 10 ms before any RTT: 62.5 MB
    emulated, 6.25 MB on the wire at scale 10); its answer (wire units) reaches the policy as an observed
    sample, and a probe that carried >= 3x rate x unloaded RTT with a standing queue under it (RTT 20 ms on a
    10.5-ms path) and got less than half the estimate halves it, alone; the next probe (200 ms later: nothing
    else was measured) confirms it and sets it."""
    fw.probe_answer = {"ok": True, "reason": None, "bytes": 6_250_000, "seconds": 0.1, "rate_bps": 0.3e9, "rtt_ms": 20.0,
                       "min_rtt_ms": 10.0, "idle_rtt_ms": 10.5, "connections": 4}
    r = router(policy={"name": "prfaas", "threshold": "8K", "signals": "observed", "estimator": {"probe_after": "200ms"}})
    deadline = time.monotonic() + 5
    # a probe is judged on the floor known before it, so the second probe's pings reach the published floor
    # at the estimator's next update (a state poll, every 0.5 s); the confirming probe can come before it
    while ((len(r.log.rows("probe")) < 2 or r.policy.controller.estimate.rtt_floor_ms != 10.5)
           and time.monotonic() < deadline):
        time.sleep(0.05)
    rows = r.log.rows("probe")
    assert len(rows) >= 2 and rows[0]["ok"] and rows[0]["instance"] == 0
    assert fw.probes[0]["bytes"] == 6_250_000 and fw.probes[0]["decode"]["kv_port"] in (9000, 9001)
    # it may end once it has filled the path, as the estimator judges a filled probe (`probe_until_filled`)
    assert (fw.probes[0]["stop_queue_ms"], fw.probes[0]["stop_queue_fraction"], fw.probes[0]["stop_path_ratio"]) == (2.0, 0.4, 3.0)
    # paced at twice the estimate (the nominal 10 Gbps: 20 Gbps emulated, 2 Gbps on the wire), logged emulated
    assert fw.probes[0]["pace_bps"] == pytest.approx(2e9) and rows[0]["probe_pace_bps"] == pytest.approx(20e9)
    assert rows[0]["probe_rate_bps"] == pytest.approx(3e9) and rows[0]["idle_rtt_ms"] == 10.5
    e = r.policy.controller.estimate
    assert e.available_bps == pytest.approx(3e9) and e.rtt_floor_ms == 10.5 and e.age_s < 5  # set by a probe, held since


def test_with_probe_until_filled_off_a_probe_sends_its_whole_size(router, fw) -> None:
    fw.probe_answer = {"ok": True, "reason": None, "bytes": 6_250_000, "seconds": 0.1, "rate_bps": 0.9e9, "rtt_ms": 10.6,
                       "min_rtt_ms": 10.0, "idle_rtt_ms": 10.5, "connections": 4}
    router(policy={"name": "prfaas", "threshold": "8K", "signals": "observed",
                   "estimator": {"probe_after": "200ms", "probe_until_filled": False}})
    deadline = time.monotonic() + 5
    while not fw.probes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fw.probes and fw.probes[0]["stop_path_ratio"] == 0.0  # the worker's FillStop is None: every byte


def test_with_probe_paced_off_a_probe_goes_unpaced(router, fw) -> None:
    fw.probe_answer = {"ok": True, "reason": None, "bytes": 6_250_000, "seconds": 0.1, "rate_bps": 0.9e9, "rtt_ms": 10.6,
                       "min_rtt_ms": 10.0, "idle_rtt_ms": 10.5, "connections": 4}
    r = router(policy={"name": "prfaas", "threshold": "8K", "signals": "observed",
                       "estimator": {"probe_after": "200ms", "probe_paced": False}})
    deadline = time.monotonic() + 5
    while not r.log.rows("probe") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fw.probes and fw.probes[0]["pace_bps"] == 0.0 and r.log.rows("probe")[0]["probe_pace_bps"] == 0.0



@pytest.mark.parametrize("paced_setting, worker_paced", [("auto", False), ("auto", True), (True, True)])
def test_a_probe_asks_for_pacing_and_logs_what_the_worker_did(router, fw, paced_setting: Any, worker_paced: bool) -> None:
    """`probe_paced: auto` (the default) asks for the pace and lets a worker whose KV congestion control paces
    itself (BBR) send unpaced (`pace_self_paced` false); `true` asks it to pace whatever it runs. The probe
    row logs the pace the worker answers it used (0: unpaced)."""
    fw.probe_answer = {"ok": True, "reason": None, "bytes": 6_250_000, "seconds": 0.1, "rate_bps": 0.9e9, "rtt_ms": 10.6,
                       "min_rtt_ms": 10.0, "idle_rtt_ms": 10.5, "connections": 4, "paced": worker_paced}
    r = router(policy={"name": "prfaas", "threshold": "8K", "signals": "observed",
                       "estimator": {"probe_after": "200ms", "probe_paced": paced_setting}})
    deadline = time.monotonic() + 5
    while not r.log.rows("probe") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fw.probes and fw.probes[0]["pace_bps"] == pytest.approx(2e9)
    assert fw.probes[0]["pace_self_paced"] is (paced_setting is True)
    assert r.log.rows("probe")[0]["probe_pace_bps"] == (pytest.approx(20e9) if worker_paced else 0.0)

def test_a_router_probes_nothing_for_a_policy_that_does_not_estimate(router, fw) -> None:
    router(policy={"name": "fixed-threshold", "threshold": "8K"})
    r2 = router(policy={"name": "prfaas", "threshold": "8K", "signals": "observed", "estimator": {"probe_after": "0s"}})
    time.sleep(0.6)
    assert not fw.probes and not r2.log.rows("probe")


# KV queued at 9 Gbps with no queue (headroom) on a nominal 10, then a dip: 1 Gbps under 30 ms of queue
STEADY_KV = Congestion(send_queue_bytes=5e6, inflight_bytes=1e6, path_rate_bps=0.9e9, goodput_bps=0.9e9, rtt_ms=10.2,
                       queue_rtt_ms=10.2, min_rtt_ms=10.0)
DIPPED_KV = dataclasses.replace(STEADY_KV, path_rate_bps=0.1e9, goodput_bps=0.1e9, rtt_ms=40.0, queue_rtt_ms=40.0)


def _router_on_a_steady_kv_line(router: Callable[..., Router], fw: FakeWorkers, poll_confirm: str) -> Router:
    """An observed-signals router polling every 0.5 s, whose PrfaaS instance reports `STEADY_KV`."""
    fw.congestion = STEADY_KV
    return router(policy={"name": "prfaas", "threshold": "8K", "signals": "observed",
                           "estimator": {"probe_after": "0s", "poll_confirm": poll_confirm}}, state_poll_s=0.5)


def _dipped_kv_polls(r: Router, fw: FakeWorkers, deadline_s: float) -> list[float]:
    """Once two state polls saw the steady line, the dip: the times of the polls that saw it, once three did and the
    estimate is below 2 Gbps (or `deadline_s` passed)."""
    deadline = time.monotonic() + deadline_s
    while len(fw.state_polls) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    fw.congestion = DIPPED_KV
    while (len([t for t, c in fw.state_polls if c is DIPPED_KV]) < 3 or r.policy.controller.estimate.available_bps > 2e9) \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    return [t for t, c in fw.state_polls if c is DIPPED_KV]


@pytest.mark.parametrize("confirm", ["50ms", "0s"])
def test_a_lone_saturated_poll_brings_the_next_state_poll_sooner_once(router, fw, confirm: str) -> None:
    """`poll_confirm`: KV queued at 9 Gbps with no queue (headroom) on a nominal 10, then a dip: 1 Gbps under
    30 ms of queue. The first dip poll is a lone upper bound (the estimate held at half); with `poll_confirm:
    50ms` the router polls again ~50 ms later instead of its 0.5-s period, once, and the second bound sets the
    estimate; with 0s the polls keep their period."""
    r = _router_on_a_steady_kv_line(router, fw, confirm)
    times = _dipped_kv_polls(r, fw, deadline_s=5)
    assert len(times) >= 3 and r.policy.controller.estimate.available_bps == pytest.approx(1e9)
    gaps = [b - a for a, b in zip(times, times[1:])]
    if confirm == "50ms":
        assert gaps[0] < 0.3 and gaps[1] > 0.4  # sooner once, then the period again
    else:
        assert gaps[0] > 0.4 and gaps[1] > 0.4


def test_a_confirm_poll_past_the_poll_period_waits_only_the_period(router, fw) -> None:
    """The bound on `poll_confirm` (docs/router.md: one at or above the router's poll period is the period), in the
    router's own poll loop: the same lone saturated poll as above with `poll_confirm: 1h` asks the loop for its next
    poll an hour on, and the loop still polls one `state_poll_s` (0.5 s) later, so the second bound sets the estimate
    then. `168h` held the polls, and every signal of the control loop, for up to a week (2026-12-07): a loop that
    waited what the policy asked, not `next_poll_wait_s`, fails here."""
    r = _router_on_a_steady_kv_line(router, fw, "1h")
    asked: list[float] = []  # each confirm poll the policy asked the poll loop for
    confirm_poll_s = r.policy.confirm_poll_s

    def recorded() -> float:
        wait = confirm_poll_s()
        if wait > 0:
            asked.append(wait)
        return wait

    r.policy.confirm_poll_s = recorded  # type: ignore[method-assign]  # the loop asks the policy after each poll
    times = _dipped_kv_polls(r, fw, deadline_s=8)
    assert asked == [3600.0]  # the lone saturated poll asked for a confirm poll an hour on, once
    assert len(times) >= 3, "the poll loop stopped polling after the policy asked for a confirm poll an hour on"
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert all(0.4 < g < 0.9 for g in gaps[:2]), gaps  # the period, not the hour (nor sooner)
    assert r.policy.controller.estimate.available_bps == pytest.approx(1e9)  # the second bound came a period later


def test_a_probe_under_which_kv_moved_is_logged_and_not_believed(router, fw) -> None:
    """The policy asks for a probe only with nothing committed; a state poll during the probe that sees KV
    queued (another worker's offload began under it) makes it no idle measurement: logged, not fed."""
    answer = {"ok": True, "reason": None, "bytes": 6_250_000, "seconds": 0.3, "rate_bps": 0.1e9, "rtt_ms": 14.0,
              "min_rtt_ms": 10.0, "idle_rtt_ms": 10.5, "connections": 4}

    def slow_probe(_body: dict[str, Any]) -> dict[str, Any]:
        fw.congestion = Congestion(send_queue_bytes=5e6)  # KV appears while the probe runs
        time.sleep(0.3)
        return answer

    fw.probe_answer = slow_probe  # type: ignore[assignment]
    r = router(policy={"name": "prfaas", "threshold": "8K", "signals": "observed", "estimator": {"probe_after": "200ms"}})
    deadline = time.monotonic() + 5
    while not r.log.rows("probe") and time.monotonic() < deadline:
        time.sleep(0.05)
    row = r.log.rows("probe")[0]
    assert not row["ok"] and row["reason"] == "KV moved during the probe (not an idle measurement)"
    assert r.policy.controller.estimate.available_bps == r.cfg.wan_capacity_bps  # 0.1 Gbps x scale never believed


def test_a_stream_cut_after_its_first_token_keeps_its_prefill_times_and_kv_in_the_record(router, fw) -> None:
    """The drain cut (testbed.serving.early_stop) closes streams after their first token: the record must
    still carry the prefill's times, or the queue trend would count the prefill as queueing."""
    from testbed.serving.router import Completion

    r = router()
    gen = r.serve(Completion("cut1", 9000, 50, [], None, True, "prfaas"))  # 9K > threshold 8K: offloaded
    assert [type(next(gen)).__name__ for _ in range(2)] == ["TokenEvent", "TokenEvent"]
    gen.close()  # the client went away mid-stream
    rec = next(x for x in r.records() if x["request_id"] == "cut1")
    assert (rec["status"], rec["reason"]) == ("failed", "client disconnected")
    assert rec["first_token_s"] is not None
    assert rec["prefill_start_s"] is not None and rec["prefill_end_s"] is not None
    assert rec["prefill_start_s"] <= rec["prefill_end_s"]
    assert rec["kv_bytes"] == 9000 * KV_BYTES_PER_TOKEN
    assert rec["kv_bytes_emulated"] == 9000 * KV_BYTES_PER_TOKEN * 10  # the router's scale, 10


def test_the_prefill_histogram_observes_a_preempted_prefills_own_time_not_its_pause() -> None:
    from testbed.serving.prometheus import RequestHistograms, exposition, new_registry

    reg = new_registry()
    h = RequestHistograms(reg)
    base = {"status": "ok", "route": "prfaas", "arrival_s": 0.0, "prefill_start_s": 1.0, "prefill_end_s": 4.0,
            "first_token_s": 5.0, "finish_s": 6.0, "output_len": 3}
    h.observe({**base, "prefill_paused_s": 2.0}, "prfaas")  # 3 s span, 2 s of it other prefills' time
    h.observe(dict(base), "prfaas")  # never paused: its span
    text = exposition(reg).decode()
    labels = {"route": "prfaas", "cluster": "prfaas"}
    assert metric(text, "prfaas_router_prefill_seconds_count", labels) == 2
    assert metric(text, "prfaas_router_prefill_seconds_sum", labels) == pytest.approx(1.0 + 3.0)
    assert metric(text, "prfaas_router_queue_wait_seconds_sum", labels) == pytest.approx(2.0)


def test_a_client_that_hangs_up_before_its_first_token_ends_the_request_with_its_prefill_times(router, fw) -> None:
    """A streaming client that goes away while its prefill runs (the drain cut, an early stop) is noticed at once
    (`HangupWatch`), not at the first token: its record says the client went away, carries the prefill's start
    (so `queued_series` does not count the prefill as queueing), the prefill is told (cancelled if still queued),
    and the decode instance whose stream the router aborted is not marked unhealthy."""
    r = router()
    fw.prefill_gate = threading.Event()  # the prefill runs until the test lets it end
    try:
        body = json.dumps({"prompt": "a b", "max_tokens": 4, "stream": True}).encode()
        s = socket.create_connection(("127.0.0.1", r.address[1]), timeout=10)
        s.sendall(post_head("/v1/completions", f"Content-Length: {len(body)}") + body)
        deadline = time.monotonic() + 10
        while not fw.prefill_started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fw.prefill_started, "the prefill never began"
        t_hangup = clock.now_s()
        s.shutdown(socket.SHUT_RDWR)  # as the client agent cancels a request (loadgen._abort)
        s.close()
        while not r.records() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.records(), "no record while the prefill still ran: the hang-up was not noticed"
        assert clock.now_s() - t_hangup < 2.0
    finally:
        fw.prefill_gate.set()
    rec = r.records()[0]
    rid = rec["request_id"]
    assert (rec["status"], rec["reason"], rec["first_token_s"]) == ("failed", "client disconnected", None)
    assert fw.cancels == [rid] and rec["prefill_cancel"] == "running"
    assert rec["prefill_start_s"] == pytest.approx(fw.prefill_started[rid] - clock.run_t0())
    assert rec["finish_s"] == pytest.approx(t_hangup - clock.run_t0(), abs=0.5)  # when the router saw it go
    assert all(x["healthy"] for x in r.state()["instances"])
    assert post(r, "/v1/completions", {"prompt": "a b", "max_tokens": 1})[0] == 200  # and the router serves on


def test_a_hangup_before_the_first_token_ends_the_request_the_router_is_blocked_in() -> None:
    """`Hangup` from another thread aborts the decode read the request waits in; without it the request waits."""
    from testbed.serving.router import Completion, Hangup

    w = FakeWorkers()
    r = Router(make_config(w))
    w.prefill_gate = threading.Event()
    try:
        hangup = Hangup()
        gen = r.serve(Completion("h1", 100, 8, [], None, True, "prfaas"), hangup)
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.append(next(gen)), daemon=True)
        t.start()
        t.join(0.5)
        assert t.is_alive() and not got  # no first token while the prefill is held
        hangup.set()
        t.join(5)
        assert got and got[0]["record"]["reason"] == "client disconnected"
    finally:
        w.prefill_gate.set()
        w.close()
