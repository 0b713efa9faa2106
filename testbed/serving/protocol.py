"""The router <-> worker protocol: one dataclass per message, validated on receipt (docs/protocol.md).

Who sends what:

- router -> prefill worker: `PrefillRequest` (``POST /v1/prefill``), answered by `PrefillResult` when
  the request's KV transfer has ended (or the prefill failed, was shed or waited too long in the queue);
- router -> decode worker: `DecodeRequest` (``POST /v1/decode``), answered by a server-sent event
  stream of `TokenEvent` and one last `FinalEvent`;
- router -> prefill worker: `PrefillCancel` (``POST /v1/prefill/cancel``) when a request's client went away
  before its first token, answered by `PrefillCancelled` (the prefill's times so far);
- router <- any worker: `WorkerState` (``GET /v1/state``), `Health` (``GET /healthz``).

Each message has ``to_json()`` (a JSON-ready dict) and ``from_json(data, source)``, which reads the
dict with the scenario's `Fields` and raises `FieldError` naming the field and what is allowed, so a
malformed message is one line (``POST /v1/prefill: decode.kv_port: 'x' is not a whole number >= 0``)
whichever side receives it. Times (``*_s``) are `testbed.clock.now_s()` readings: CLOCK_MONOTONIC,
shared by every process of the host. Byte counts are wire bytes (emulated = wire x scale).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, TypeVar

from testbed.kv.transport import FillStop
from testbed.kv.wire import MAX_PROFILE_LAYER_BYTES, MAX_REQUEST_ID_BYTES
from testbed import blocks
from testbed.models.spec import parse_dtype
from testbed.clock import now_s
from testbed.units import MAX_DURATION_S, MAX_TOKENS
from testbed.validation import (
    Fields, at_least_one, at_most, boolean, integers, mapping, non_negative, whole_number, positive_number, shown, string, text,
)

STATUSES = ("ok", "failed")
DECODE_PREFIX_HEADER = "X-Prfaas-Decode-Prefix-Len"  # on the /v1/decode response: positions this decode already holds
ROLES = ("prefill", "decode")
ROUTES = ("prfaas", "pd")

M = TypeVar("M")
PROBE_MAX_BYTES = MAX_PROFILE_LAYER_BYTES  # a probe's filler is one profile layer: at most what one layer's frames may carry
PROBE_MAX_PINGS = 100
PROBE_MAX_TIMEOUT_S = 600.0


MAX_TOKEN_ID = (1 << 31) - 1  # a token id: below any vocabulary's size (the router checks the model's own)


def _token_ids(v: Any) -> tuple[int, ...]:
    """A list of token ids: whole numbers (`validation.integers`) from 0 to `MAX_TOKEN_ID`."""
    out = integers(v)
    bad = next((x for x in out if x < 0 or x > MAX_TOKEN_ID), None)
    if bad is not None:
        raise ValueError(f"{bad} is not a token id (0 to {MAX_TOKEN_ID})")
    return out


def _block_hashes(v: Any) -> tuple[int, ...]:
    """A prompt's block hashes, read by the one reader of them (`blocks.block_hashes`: the router reads a client's
    ``prfaas.block_hashes`` and a trace's ``hash_ids`` with it); this module had a copy of its own until 2026-12-07,
    which took and refused the same lists in other words."""
    return tuple(blocks.block_hashes(v))


def _prompt_fits(f: Fields, out: dict[str, Any]) -> None:
    """A prompt's token ids are at most `input_len` of them (1.5 million ids with input_len 3 were taken)."""
    ids = out["prompt_token_ids"]
    if ids is not None and len(ids) > out["input_len"]:
        raise f.error("prompt_token_ids", f"{len(ids)} token ids, more than input_len ({out['input_len']})")


_TOKENS = at_most(at_least_one, MAX_TOKENS)  # a request's token count: 1 to `units.MAX_TOKENS`, as the router's


def _read(cls: type[M], data: Any, source: str, path: str, fields: Callable[[Fields], dict[str, Any]]) -> M:
    """Read one message: `fields` pulls every known key out of `Fields`; unknown keys are refused."""
    f = Fields(data, path, source)
    out = cls(**fields(f))
    f.done()
    return out


def request_id(v: Any) -> str:
    """A request id the KV wire can carry: a non-empty string of at most `MAX_REQUEST_ID_BYTES` UTF-8 bytes."""
    rid = text(v)
    try:
        n = len(rid.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"{rid!r} is not valid Unicode (a lone surrogate)") from None
    if n > MAX_REQUEST_ID_BYTES:
        raise ValueError(f"is {n} UTF-8 bytes; at most {MAX_REQUEST_ID_BYTES} (the KV wire's limit)")
    return rid


def _json(msg: Any) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(msg).items()}


# ---------------------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class KVDestination:
    """Where a prefill worker ships a request's KV: a decode worker's KV receiver."""

    host: str
    kv_port: int
    instance: int

    @classmethod
    def read(cls, f: Fields) -> "KVDestination":
        out = cls(f.get("host", text), f.get("kv_port", at_most(at_least_one, 65535)), f.get("instance", whole_number))
        f.done()
        return out


@dataclass(frozen=True)
class Deadline:
    """A request's time budget as the router sees it: it arrived at `arrival_s` and must be answered
    within `request_timeout_s`. Queues are bounded by it (docs/protocol.md "Timeouts")."""

    arrival_s: float
    request_timeout_s: float

    @property
    def deadline_s(self) -> float:
        return self.arrival_s + self.request_timeout_s


# A request's budget: at most a week (`units.MAX_DURATION_S`, the longest duration the testbed takes; the router's
# serving.timeouts.request is one). A decode request of 1e10 s, or one that arrived at 1e300, made its wait for the KV
# an OverflowError (a thread's wait takes at most ~292 years) in a thread of its own: the stream never ended.
_REQUEST_TIMEOUT = at_most(positive_number, MAX_DURATION_S, "s", "a week, the longest a request may take")


# A prefill request's priority: 0 to `PRIORITY_MAX` (vLLM's is any Python int; the router sends 0 or 1). 10**400 was
# taken: it only ordered the queue, but no JSON peer that reads integers as 64-bit or floats round-trips it.
PRIORITY_MAX = 2**31 - 1
_PRIORITY = at_most(whole_number, PRIORITY_MAX, why="the largest priority (2**31 - 1)")


def _arrival_s(v: Any) -> float:
    """A `now_s()` reading of the router's (the host's monotonic clock, this process's too): at most a week past now."""
    x, now = non_negative(v), now_s()
    if x > now + MAX_DURATION_S:
        raise ValueError(f"{shown(v)} is not a time on this host's clock (at most a week past its now, {now:.0f} s)")
    return x


def _deadline(f: Fields, default_timeout_s: float | None) -> dict[str, Any]:
    return {"arrival_s": f.get("arrival_s", _arrival_s, None),
            "request_timeout_s": f.get("request_timeout_s", _REQUEST_TIMEOUT, default_timeout_s)}


@dataclass(frozen=True)
class PrefillRequest:
    """``POST /v1/prefill``: compute `input_len` tokens (of which `cached_len` are a prefix hit) and
    stream the KV to `decode`. `shed_ttft_s`: when given, a request whose predicted time to first token
    exceeds it is shed before its prefill starts (its own reason)."""

    request_id: str
    input_len: int
    decode: KVDestination
    cached_len: int = 0
    decode_prefix_len: int = 0
    block_hashes: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] | None = None
    route: str = "prfaas"
    arrival_s: float | None = None
    request_timeout_s: float | None = None
    shed_ttft_s: float | None = None
    priority: int = 0  # the worker's queue serves the lowest first, FCFS among equals (vLLM's priority scheduling)
    slo_ttft_s: float | None = None  # the request's TTFT objective: what bounds a preemption of its prefill
    kv_dtype: str | None = None  # the full-attention KV's dtype on the wire (`policy.kv_compression`); None: the model's

    def to_json(self) -> dict[str, Any]:
        return _json(self)

    @classmethod
    def from_json(cls, data: Any, source: str = "POST /v1/prefill") -> "PrefillRequest":
        def fields(f: Fields) -> dict[str, Any]:
            out = {"request_id": f.get("request_id", request_id), "input_len": f.get("input_len", _TOKENS),
                   "decode": KVDestination.read(f.section("decode")) if f.has("decode") else f.get("decode", mapping),
                   "cached_len": f.get("cached_len", whole_number, 0), "decode_prefix_len": f.get("decode_prefix_len", whole_number, 0),
                   "block_hashes": f.get("block_hashes", _block_hashes, ()),
                   "prompt_token_ids": f.get("prompt_token_ids", _token_ids, None), "route": f.choice("route", ROUTES, "prfaas"),
                   "shed_ttft_s": f.get("shed_ttft_s", positive_number, None), "priority": f.get("priority", _PRIORITY, 0),
                   "slo_ttft_s": f.get("slo_ttft_s", positive_number, None),
                   "kv_dtype": f.get("kv_dtype", parse_dtype, None),
                   **_deadline(f, None)}
            for key in ("cached_len", "decode_prefix_len"):
                if out[key] >= out["input_len"]:
                    raise f.error(key, f"{out[key]} must be below input_len ({out['input_len']})")
            _prompt_fits(f, out)
            return out

        return _read(cls, data, source, "", fields)


@dataclass(frozen=True)
class DecodeRequest:
    """``POST /v1/decode``: register a request, wait for its KV, decode `output_len` tokens.
    `prompt_token_ids` is needed in torch mode (the prompt's last token is the decode's first input)."""

    request_id: str
    input_len: int
    output_len: int = 1
    prompt_token_ids: tuple[int, ...] | None = None
    block_hashes: tuple[int, ...] = ()
    arrival_s: float | None = None
    request_timeout_s: float | None = None
    kv_dtype: str | None = None  # the prefill sends its full-attention KV in this dtype (`PrefillRequest.kv_dtype`)

    def to_json(self) -> dict[str, Any]:
        return _json(self)

    @classmethod
    def from_json(cls, data: Any, source: str = "POST /v1/decode") -> "DecodeRequest":
        def fields(f: Fields) -> dict[str, Any]:
            out = {"request_id": f.get("request_id", request_id), "input_len": f.get("input_len", _TOKENS),
                   # (10**21 tokens held a batch slot for good: the router refuses past `units.MAX_TOKENS` too)
                   "output_len": f.get("output_len", _TOKENS, 1), "prompt_token_ids": f.get("prompt_token_ids", _token_ids, None),
                   "block_hashes": f.get("block_hashes", _block_hashes, ()), "kv_dtype": f.get("kv_dtype", parse_dtype, None),
                   **_deadline(f, None)}
            _prompt_fits(f, out)
            return out

        return _read(cls, data, source, "", fields)


@dataclass(frozen=True)
class ProbeRequest:
    """Router -> PrfaaS prefill worker, `POST /v1/probe` (docs/router.md, "An active probe"): `pings`
    one-byte transfers, then `bytes` (wire) of filler to `decode`'s KV receiver, each ended within `timeout_s`.
    With `stop_path_ratio` > 0 the filler ends once it has filled the path (`testbed.kv.transport.FillStop`:
    a standing queue of `stop_queue_ms` and `stop_queue_fraction` of the unloaded RTT, and
    `stop_path_ratio` x rate x unloaded RTT delivered); 0, the default, sends all of it. With `pace_bps` > 0
    (wire bit/s) the probe goes over connections of the worker's kept for probes, paced at that rate in all
    (`KVSender.pace`), unless the KV connections' congestion control paces itself (BBR,
    `testbed.kv.transport.paces_itself`) and `pace_self_paced` is false; 0, the default, over the destination's
    KV connections, unpaced. The answer's `paced` says which."""

    decode: KVDestination
    bytes: int = 0
    pings: int = 2
    timeout_s: float = 2.0
    stop_queue_ms: float = 0.0
    stop_queue_fraction: float = 0.0
    stop_path_ratio: float = 0.0
    pace_bps: float = 0.0
    pace_self_paced: bool = False

    def to_json(self) -> dict[str, Any]:
        return _json(self)

    @classmethod
    def from_json(cls, data: Any, source: str = "POST /v1/probe") -> "ProbeRequest":
        # bounded (since 2026-12-07): 10**18 bytes was a traceback in the probe's thread and a 200 without a reason,
        # 10**9 pings ran for hours
        return _read(cls, data, source, "", lambda f: {
            "decode": KVDestination.read(f.section("decode")), "bytes": f.get("bytes", at_most(whole_number, PROBE_MAX_BYTES), 0),
            "pings": f.get("pings", at_most(whole_number, PROBE_MAX_PINGS), 2),
            "timeout_s": f.get("timeout_s", at_most(positive_number, PROBE_MAX_TIMEOUT_S), 2.0),
            "stop_queue_ms": f.get("stop_queue_ms", non_negative, 0.0),
            "stop_queue_fraction": f.get("stop_queue_fraction", non_negative, 0.0),
            "stop_path_ratio": f.get("stop_path_ratio", non_negative, 0.0),
            "pace_bps": f.get("pace_bps", non_negative, 0.0), "pace_self_paced": f.get("pace_self_paced", boolean, False)})

    @staticmethod
    def stop_fields(stop: FillStop | None) -> dict[str, float]:
        """`stop` as this request's fields (none for None: every byte is sent); `fill_stop` reads them back."""
        if stop is None:
            return {}
        return {"stop_queue_ms": stop.queue_ms, "stop_queue_fraction": stop.queue_fraction, "stop_path_ratio": stop.path_ratio}

    def fill_stop(self) -> FillStop | None:
        """The burst's early end, or None (send every byte)."""
        if self.stop_path_ratio <= 0:
            return None
        return FillStop(self.stop_queue_ms, self.stop_queue_fraction, self.stop_path_ratio)


@dataclass(frozen=True)
class PrefillCancel:
    """Router -> prefill worker, ``POST /v1/prefill/cancel``: the client of `request_id` went away before its
    first token (vLLM aborts such a request). A prefill still queued is taken out of the queue (its
    `PrefillRequest` is answered as failed); one already running runs on. Answered by `PrefillCancelled`."""

    request_id: str

    def to_json(self) -> dict[str, Any]:
        return _json(self)

    @classmethod
    def from_json(cls, data: Any, source: str = "POST /v1/prefill/cancel") -> "PrefillCancel":
        return _read(cls, data, source, "", lambda f: {"request_id": f.get("request_id", request_id)})


# ---------------------------------------------------------------------------------------- answers


def own_prefill_s(start_s: float | None, end_s: float | None, paused_s: float | None) -> float | None:
    """A prefill's own compute time: its span less the time it stood paused while preempting prefills ran
    (theirs, not its own; `PrefillResult.prefill_paused_s`). None when either end is unknown."""
    return None if start_s is None or end_s is None else float(end_s) - float(start_s) - float(paused_s or 0.0)


@dataclass(frozen=True)
class PrefillResult:
    """The answer to a `PrefillRequest`: sent when the KV transfer has ended (or the request failed)."""

    request_id: str
    status: str
    reason: str | None = None
    prefill_start_s: float | None = None
    prefill_end_s: float | None = None
    transfer_start_s: float | None = None
    transfer_end_s: float | None = None
    kv_bytes: int | None = None
    wire_bytes: int | None = None
    queue_s: float | None = None  # time spent in the prefill queue
    prefill_cached_len: int | None = None  # positions the prefill resumed from (its own pool's hit)
    decode_prefix_len: int | None = None  # positions not sent: the decode already held them
    prefill_late_s: float | None = None  # profile mode: how far the emulated prefill ran past its time (clock.Pacer)
    prefill_paused_s: float | None = None  # of prefill_end_s - prefill_start_s, the time it stood paused, preempted

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def own_prefill_s(self) -> float | None:
        """The prefill's own compute time (`own_prefill_s`)."""
        return own_prefill_s(self.prefill_start_s, self.prefill_end_s, self.prefill_paused_s)

    def to_json(self) -> dict[str, Any]:
        return _json(self)

    @classmethod
    def from_json(cls, data: Any, source: str = "prefill result") -> "PrefillResult":
        return _read(cls, data, source, "", lambda f: {
            "request_id": f.get("request_id", text), "status": f.choice("status", STATUSES),
            "reason": f.get("reason", string, None),
            **{k: f.get(k, non_negative, None) for k in ("prefill_start_s", "prefill_end_s", "transfer_start_s",
                                                          "transfer_end_s", "queue_s", "prefill_late_s", "prefill_paused_s")},
            **{k: f.get(k, whole_number, None) for k in ("kv_bytes", "wire_bytes", "prefill_cached_len", "decode_prefix_len")}})


@dataclass(frozen=True)
class PrefillCancelled:
    """The answer to a `PrefillCancel`: whether the worker holds that request (`found`), whether it was taken
    out of the queue (`dequeued`), and the prefill's start and end so far (None: not yet). The router puts
    the times into the request's record, so the queue it counts is the one the request stood in
    (`analysis.metrics.queued_series`; docs/experiments.md, "The drain cut")."""

    request_id: str
    found: bool
    dequeued: bool = False
    prefill_start_s: float | None = None
    prefill_end_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return _json(self)

    @classmethod
    def from_json(cls, data: Any, source: str = "prefill cancel answer") -> "PrefillCancelled":
        return _read(cls, data, source, "", lambda f: {
            "request_id": f.get("request_id", text), "found": f.get("found", boolean),
            "dequeued": f.get("dequeued", boolean, False),
            **{k: f.get(k, non_negative, None) for k in ("prefill_start_s", "prefill_end_s")}})


@dataclass(frozen=True)
class TokenEvent:
    """One ``data:`` line of the decode stream: token `index` (0-based) was produced at `t_s`."""

    token_id: int
    index: int
    t_s: float

    def to_json(self) -> dict[str, Any]:
        return _json(self)

    @classmethod
    def from_json(cls, data: Any, source: str = "token event") -> "TokenEvent":
        return _read(cls, data, source, "", lambda f: {"token_id": f.get("token_id", whole_number),
                                                       "index": f.get("index", whole_number), "t_s": f.get("t_s", non_negative)})


@dataclass(frozen=True)
class FinalEvent:
    """The last ``data:`` line of the decode stream (``"done": true`` on the wire)."""

    status: str
    reason: str | None = None
    kv_bytes: int = 0
    transfer_start_s: float | None = None
    transfer_end_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    tokens: int = 0
    queue_s: float | None = None  # time spent waiting for a place in the decode batch
    decode_late_s: float | None = None  # profile mode: how far its token stream fell behind the profile's steps

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_json(self) -> dict[str, Any]:
        return {"done": True, **_json(self)}

    @classmethod
    def from_json(cls, data: Any, source: str = "final event") -> "FinalEvent":
        def fields(f: Fields) -> dict[str, Any]:
            if not f.get("done", boolean):
                raise f.error("done", "must be true in a final event")
            return {"status": f.choice("status", STATUSES), "reason": f.get("reason", string, None),
                    "kv_bytes": f.get("kv_bytes", whole_number, 0), "tokens": f.get("tokens", whole_number, 0),
                    **{k: f.get(k, non_negative, None) for k in ("transfer_start_s", "transfer_end_s", "first_token_s",
                                                                  "finish_s", "queue_s", "decode_late_s")}}

        return _read(cls, data, source, "", fields)


def decode_event(data: Any, source: str = "decode stream") -> TokenEvent | FinalEvent:
    """One event of the decode stream: the final one carries ``"done": true``."""
    if isinstance(data, dict) and data.get("done"):
        return FinalEvent.from_json(data, source)
    return TokenEvent.from_json(data, source)


# ------------------------------------------------------------------------------------------ state


@dataclass(frozen=True)
class Congestion:
    """A prefill worker's transport signal (TCP_INFO of its KV senders), summed over its KV destinations;
    `rtt_ms` and `queue_rtt_ms` are the maxima and `min_rtt_ms` the minimum over them. Wire units."""

    retransmits: float = 0.0
    rtt_ms: float = 0.0
    min_rtt_ms: float = 0.0
    cwnd: float = 0.0
    send_queue_bytes: float = 0.0
    inflight_bytes: float = 0.0
    delivery_rate_bps: float = 0.0
    goodput_bps: float = 0.0
    by_destination: dict[str, Any] = field(default_factory=dict)
    path_rate_bps: float = 0.0  # the kernel's delivery rate while a sender has work (the bandwidth estimator's input)
    queue_rtt_ms: float = 0.0  # RTT of the connections with work whose RTT is current (the estimator's; 0: none)
    probing: float = 0.0  # destinations running a probe, whose own bytes are left out of the KV figures above

    def numbers(self) -> dict[str, float]:
        """The summed signals by name (everything but the per-destination detail)."""
        return {k: v for k, v in asdict(self).items() if k != "by_destination"}

    @classmethod
    def read(cls, f: Fields) -> "Congestion":
        out = cls(**{k: f.get(k, non_negative, 0.0) for k in NUMBERS},
                  by_destination=f.get("by_destination", mapping, {}))
        f.done()
        return out


NUMBERS = ("retransmits", "rtt_ms", "min_rtt_ms", "cwnd", "send_queue_bytes", "inflight_bytes", "delivery_rate_bps", "goodput_bps",
           "path_rate_bps", "queue_rtt_ms", "probing")


@dataclass(frozen=True)
class WorkerState:
    """``GET /v1/state``: what the router's poller reads (queues, prefix pool, transport signal)."""

    role: str
    instance: int
    cluster: str
    queue_depth: int = 0
    busy: bool = False
    batch: int = 0
    prefix_blocks: tuple[int, ...] = ()
    pool: dict[str, Any] | None = None
    congestion: Congestion = field(default_factory=Congestion)

    def to_json(self) -> dict[str, Any]:
        return _json(self)

    @classmethod
    def from_json(cls, data: Any, source: str = "GET /v1/state") -> "WorkerState":
        return _read(cls, data, source, "", lambda f: {
            "role": f.choice("role", ROLES), "instance": f.get("instance", whole_number), "cluster": f.get("cluster", text),
            "queue_depth": f.get("queue_depth", whole_number, 0), "busy": f.get("busy", boolean, False),
            "batch": f.get("batch", whole_number, 0), "prefix_blocks": f.get("prefix_blocks", integers, ()),
            "pool": f.get("pool", mapping, None), "congestion": Congestion.read(f.section("congestion"))})


@dataclass(frozen=True)
class Health:
    """``GET /healthz``."""

    ok: bool
    role: str
    instance: int

    def to_json(self) -> dict[str, Any]:
        return _json(self)

    @classmethod
    def from_json(cls, data: Any, source: str = "GET /healthz") -> "Health":
        return _read(cls, data, source, "", lambda f: {"ok": f.get("ok", boolean), "role": f.choice("role", ROLES),
                                                       "instance": f.get("instance", whole_number)})
