"""The router <-> worker messages (docs/protocol.md): every message survives JSON both ways, and a bad
field is refused with one line naming it and what is allowed."""

from __future__ import annotations

import json

import pytest

from testbed.clock import now_s
from testbed.errors import FieldError
from testbed.serving.protocol import (
    Congestion, DecodeRequest, FinalEvent, Health, KVDestination, PrefillRequest, PrefillResult, ProbeRequest, TokenEvent,
    WorkerState, decode_event,
)

MESSAGES = [
    PrefillRequest("r1", 2048, KVDestination("10.2.0.5", 9001, 1), cached_len=512, decode_prefix_len=1024, block_hashes=(7, 8, 9, 10),
                   prompt_token_ids=(1, 2, 3), route="pd", arrival_s=12.5, request_timeout_s=120.0, shed_ttft_s=10.0),
    DecodeRequest("r1", 2048, 16, (1, 2, 3), (7, 8, 9, 10), arrival_s=12.5, request_timeout_s=120.0),
    PrefillResult("r1", "ok", None, 1.0, 2.0, 1.1, 2.5, 4096, 4200, queue_s=0.25, prefill_cached_len=512, decode_prefix_len=1024),
    PrefillResult("r2", "failed", "waited 90.0 s in the queue of prefill instance 0"),
    TokenEvent(42, 0, 3.25),
    FinalEvent("ok", None, 4096, 1.1, 2.5, 2.6, 3.0, 16, queue_s=0.0),
    WorkerState("prefill", 2, "prfaas", queue_depth=3, busy=True, prefix_blocks=(5, 6), pool={"used_bytes": 10},
                congestion=Congestion(4.0, 30.5, 10.0, 20.0, 1e6, 5e5, 3e9, 2e9, {"10.2.0.5:9001": {"cwnd": 20}})),
    WorkerState("decode", 0, "pd", queue_depth=1, batch=8),
    Health(True, "decode", 0),
    ProbeRequest(KVDestination("10.2.0.5", 9001, 1), bytes=6_250_000, stop_queue_ms=2.0, stop_queue_fraction=0.4, stop_path_ratio=3.0,
                 pace_bps=3.36e9),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_json_unchanged(msg) -> None:
    wire = json.loads(json.dumps(msg.to_json()))
    back = decode_event(wire) if isinstance(msg, (TokenEvent, FinalEvent)) else type(msg).from_json(wire)
    assert back == msg


def test_the_final_event_carries_done_and_token_events_do_not() -> None:
    assert FinalEvent("failed", "x").to_json()["done"] is True
    assert "done" not in TokenEvent(1, 0, 0.0).to_json()


@pytest.mark.parametrize("cls, data, message", [
    (PrefillRequest, {"request_id": "a", "input_len": 10}, "POST /v1/prefill: decode: is required"),
    (PrefillRequest, {"request_id": "a", "input_len": 0, "decode": {"host": "h", "kv_port": 1, "instance": 0}},
     "POST /v1/prefill: input_len: 0 is not a whole number >= 1"),
    (PrefillRequest, {"request_id": "a", "input_len": 10, "cached_len": 10, "decode": {"host": "h", "kv_port": 1, "instance": 0}},
     "POST /v1/prefill: cached_len: 10 must be below input_len (10)"),
    (PrefillRequest, {"request_id": "a", "input_len": 10, "decode": {"host": "h", "kv_port": 1, "instance": 0, "port": 2}},
     "POST /v1/prefill: decode.port: unknown key; did you mean 'kv_port'? allowed keys here: host, instance, kv_port"),
    (PrefillRequest, {"request_id": "a", "input_len": 10, "route": "wan", "decode": {"host": "h", "kv_port": 1, "instance": 0}},
     "POST /v1/prefill: route: 'wan' is not allowed; use one of: prfaas, pd"),
    (DecodeRequest, {"request_id": "a", "input_len": 3, "prompt_token_ids": [1, "2"]},
     "POST /v1/decode: prompt_token_ids: must be a list of integers"),
    (DecodeRequest, {"request_id": "é" * 128, "input_len": 3},
     "POST /v1/decode: request_id: is 256 UTF-8 bytes; at most 255 (the KV wire's limit)"),
    (DecodeRequest, {"request_id": "\ud800", "input_len": 3},
     "POST /v1/decode: request_id: '\\ud800' is not valid Unicode (a lone surrogate)"),
    (DecodeRequest, {"request_id": "a", "input_len": 3, "arrival_s": 10 ** 400},
     "POST /v1/decode: arrival_s: a 401-digit number is out of range; use a number"),
    (DecodeRequest, {"request_id": "a", "input_len": 3, "request_timeout_s": -1},
     "POST /v1/decode: request_timeout_s: -1 must be > 0"),
    (PrefillResult, {"request_id": "a", "status": "maybe"}, "prefill result: status: 'maybe' is not allowed; use one of: ok, failed"),
    (ProbeRequest, {"decode": {"host": "h", "kv_port": 1, "instance": 0}, "bytes": 10, "stop_path_ratio": -3},
     "POST /v1/probe: stop_path_ratio: -3 must be >= 0"),
    (ProbeRequest, {"decode": {"host": "h", "kv_port": 1, "instance": 0}, "bytes": 10, "pace_bps": "fast"},
     "POST /v1/probe: pace_bps: 'fast' is not a number"),
    (WorkerState, {"role": "decode", "instance": 0, "cluster": "pd", "congestion": {"rtt_ms": "slow"}},
     "GET /v1/state: congestion.rtt_ms: 'slow' is not a number"),
])
def test_a_bad_field_is_refused_with_one_line_naming_it(cls, data, message) -> None:
    with pytest.raises(FieldError) as err:
        cls.from_json(data)
    assert str(err.value) == message


def test_a_token_event_with_a_missing_field_and_a_final_event_without_done_are_refused() -> None:
    with pytest.raises(FieldError, match="decode stream: t_s: is required"):
        decode_event({"token_id": 1, "index": 0})
    with pytest.raises(FieldError, match="final event: done: must be true"):
        FinalEvent.from_json({"done": False, "status": "ok"})


def test_a_probe_request_ends_its_burst_early_only_with_a_path_ratio() -> None:
    d = KVDestination("h", 1, 0)
    assert ProbeRequest(d, bytes=10).fill_stop() is None  # the default: every byte
    stop = ProbeRequest(d, bytes=10, stop_queue_ms=2.0, stop_queue_fraction=0.4, stop_path_ratio=3.0).fill_stop()
    assert stop is not None and (stop.queue_ms, stop.queue_fraction, stop.path_ratio) == (2.0, 0.4, 3.0)


@pytest.mark.parametrize("field,value,says", [
    ("bytes", 10**18, "bytes: 1000000000000000000 is more than 4294967295"),  # was a traceback in the probe's thread
    ("pings", 10**9, "pings: 1000000000 is more than 100"),  # ran for hours
    ("timeout_s", 1e9, "timeout_s: 1000000000.0 is more than 600"),
])
def test_a_probe_request_is_bounded_naming_the_field(field: str, value: float, says: str) -> None:
    body = {**ProbeRequest(KVDestination("h", 1, 0), bytes=10).to_json(), field: value}
    with pytest.raises(FieldError) as exc:
        ProbeRequest.from_json(body)
    assert str(exc.value) == f"POST /v1/probe: {says}"
    assert ProbeRequest.from_json({**body, field: 5 if field != "timeout_s" else 5.0}).to_json()[field] == 5


@pytest.mark.parametrize("message,field,value,says", [
    # a worker took what the router refuses (10**21 tokens held a batch slot for good); since 2026-12-07
    (DecodeRequest, "output_len", 10**21, "output_len: a 22-digit number is more than 16777216"),
    (DecodeRequest, "input_len", 10**15, "input_len: 1000000000000000 is more than 16777216"),
    (DecodeRequest, "prompt_token_ids", [-1], "prompt_token_ids: -1 is not a token id (0 to 2147483647)"),
    (DecodeRequest, "prompt_token_ids", [1] * 4096, "prompt_token_ids: 4096 token ids, more than input_len (2048)"),
    (PrefillRequest, "block_hashes", [10**30], "block_hashes: an id is outside the signed 64-bit range (-2^63 to 2^63 - 1) "
                                               "that block hashes take: item 0 is a 31-digit number"),
    (DecodeRequest, "block_hashes", [1, True], "block_hashes: must be a list of whole numbers (block hashes); item 1 is True"),
    (DecodeRequest, "block_hashes", "x", "block_hashes: must be a list of whole numbers (block hashes), got str"),
    (PrefillRequest, "decode", {"host": "h", "kv_port": 70000, "instance": 0}, "decode.kv_port: 70000 is more than 65535"),
])
def test_a_worker_request_is_bounded_as_the_router_bounds_it(message, field: str, value: object, says: str) -> None:
    good = (DecodeRequest("r1", 2048, 16) if message is DecodeRequest
            else PrefillRequest("r1", 2048, KVDestination("h", 1, 0))).to_json()
    with pytest.raises(FieldError) as exc:
        message.from_json({**good, field: value})
    assert str(exc.value).endswith(says)


def test_a_prefill_request_s_priority_is_bounded() -> None:
    """Any whole number was taken (10**400 too): it only orders the queue, but no JSON peer round-trips it."""
    from testbed.serving.protocol import PRIORITY_MAX

    good = PrefillRequest("r1", 2048, KVDestination("h", 1, 0)).to_json()
    assert PRIORITY_MAX == 2**31 - 1 and PrefillRequest.from_json({**good, "priority": PRIORITY_MAX}).priority == PRIORITY_MAX
    for value, shown in ((2**31, "2147483648"), (10**400, "a 401-digit number")):
        with pytest.raises(FieldError) as exc:
            PrefillRequest.from_json({**good, "priority": value})
        assert str(exc.value) == f"POST /v1/prefill: priority: {shown} is more than 2147483647, the largest priority (2**31 - 1)"
    with pytest.raises(FieldError, match=r"^POST /v1/prefill: priority: -1 is not a whole number >= 0$"):
        PrefillRequest.from_json({**good, "priority": -1})


@pytest.mark.parametrize("message,field,value,says", [
    # a decode request of 1e10 s (or one that arrived at 1e300) made the decode worker's wait for its KV an
    # OverflowError in a thread of its own, and its stream never ended (2026-12-07)
    (DecodeRequest, "request_timeout_s", 1e10, "request_timeout_s: 10000000000.0 is more than 604800 s, a week, the longest "
                                               "a request may take"),
    (PrefillRequest, "request_timeout_s", 1e300, "request_timeout_s: 1e+300 is more than 604800 s"),
    (DecodeRequest, "arrival_s", 1e300, "arrival_s: 1e+300 is not a time on this host's clock (at most a week past its now"),
    (PrefillRequest, "arrival_s", 1e12, "arrival_s: 1000000000000.0 is not a time on this host's clock"),
])
def test_a_request_s_deadline_is_one_a_thread_can_wait_for(message, field: str, value: float, says: str) -> None:
    import threading

    good = (DecodeRequest("r1", 2048, 16) if message is DecodeRequest
            else PrefillRequest("r1", 2048, KVDestination("h", 1, 0))).to_json()
    with pytest.raises(FieldError) as exc:
        message.from_json({**good, field: value})
    assert says in str(exc.value) and str(exc.value).startswith(f"POST /v1/{'decode' if message is DecodeRequest else 'prefill'}: {field}: ")
    week = message.from_json({**good, "arrival_s": now_s() + 3600, "request_timeout_s": 7 * 24 * 3600.0})  # the most is taken
    assert not threading.Event().wait(min(0.01, week.arrival_s + week.request_timeout_s - now_s()))
