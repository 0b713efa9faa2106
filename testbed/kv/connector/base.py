"""The KV connector interface: how one request's KV gets from a prefill worker to a decode worker.

In the spirit of vLLM's ``KVConnectorBase_V1`` (the base class of vLLM's v1 KV-transfer connectors):
a small abstract interface with a stated contract per side, typed metadata, and a registry, so a new
path (RDMA, NIXL, shared memory) is a new class, not a rewrite of the workers.

- **Scheduler side** (the router): `KVConnectorScheduler.plan` says *what* a prefill worker sends for a
  request (the token range the decode side lacks) and *where* (the decode worker's KV endpoint), as a
  `KVTransferMeta`. vLLM: ``get_num_new_matched_tokens`` / ``build_connector_meta``.
- **Worker side, sending** (a prefill worker, one `KVSendConnector` per decode endpoint): `send_layer`
  as each layer is computed (layer-wise streaming; may block: back-pressure), `finish` once the last
  layer is handed over (returns when the receiver's verdict is in), `abort` when the prefill failed or
  ran out of time. vLLM: ``save_kv_layer`` / ``wait_for_save``.
- **Worker side, receiving** (a decode worker, one `KVRecvConnector`): hands every transfer's verdict,
  a verified `ReceivedKV` or a failure with its reason, to ``on_complete``. KV that did not verify is
  never delivered as usable. vLLM: ``start_load_kv`` / ``get_finished``.

Contract common to every implementation: the KV arrives bit-exact or the request fails with a reason;
nothing from the network is unpickled; `TransferStats.start_s` is when the first layer was handed to the
sender (the KV timeout runs from there, docs/protocol.md "Timeouts").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from testbed.kv.cache import KVCache, LayerKV


@dataclass(frozen=True)
class KVEndpoint:
    """Where a decode worker receives KV (for TCP: its address and KV port)."""

    host: str
    port: int


@dataclass(frozen=True)
class KVTransferMeta:
    """The scheduler side's plan for one request: send positions [first_token, last_token) to `endpoint`."""

    request_id: str
    endpoint: KVEndpoint
    first_token: int
    last_token: int

    @property
    def tokens(self) -> int:
        return self.last_token - self.first_token


@dataclass
class TransferStats:
    """A sender's account of one transfer."""

    request_id: str
    ok: bool
    reason: str | None
    kv_bytes: int  # payload bytes (KV or profile bytes)
    wire_bytes: int  # payload + framing
    frames: int
    start_s: float  # first layer handed to the sender
    end_s: float  # the receiver's verdict arrived
    connections: int

    @property
    def goodput_bps(self) -> float:
        return 8 * self.kv_bytes / (self.end_s - self.start_s) if self.end_s > self.start_s else 0.0


@dataclass
class ReceivedKV:
    """What the decode worker gets: a verified cache (torch) or a verified byte count (profile), or a failure."""

    request_id: str
    ok: bool
    reason: str | None
    cache: KVCache | None
    kv_bytes: int
    wire_bytes: int
    frames: int
    first_frame_s: float
    complete_s: float
    model: str = ""
    tokens: int = 0


OnComplete = Callable[[str, ReceivedKV], None]


class KVConnectorScheduler:
    """Router side. The default plan sends what the decode side lacks: every position past the prefix hit."""

    def plan(self, request_id: str, input_len: int, cached_len: int, endpoint: KVEndpoint) -> KVTransferMeta:
        if not 0 <= cached_len < input_len:
            raise ValueError(f"cached_len: {cached_len} must lie in [0, input_len={input_len})")
        return KVTransferMeta(request_id, endpoint, cached_len, input_len)


class KVSendConnector(ABC):
    """Prefill side, towards one decode endpoint. Thread-safe for one producer per request."""

    @abstractmethod
    def send_layer(self, request_id: str, layer: LayerKV) -> None:
        """Queue one computed layer (may block while the path is full: the bandwidth wall). The layer's
        tensors must not change until `finish` returns."""

    @abstractmethod
    def send_bytes(self, request_id: str, layer_index: int, kind: str, nbytes: int) -> None:
        """Profile mode: `nbytes` real, opaque bytes standing for one layer, checked like real KV."""

    @abstractmethod
    def finish(self, request_id: str, tokens: int = 0, model: str = "", timeout_s: float | None = None) -> TransferStats:
        """Every layer is handed over: wait (at most `timeout_s`) for the receiver's verdict."""

    @abstractmethod
    def abort(self, request_id: str, reason: str = "aborted by sender") -> None:
        """Drop what is still queued for the request and tell the receiver to free it."""

    def congestion(self) -> dict[str, Any]:
        """The path's congestion signal for the router (retransmits, rtt_ms, cwnd, send_queue_bytes, goodput_bps)."""
        return {}

    @abstractmethod
    def close(self) -> None: ...

    def send_cache(self, cache: KVCache) -> TransferStats:
        """A whole cache at once (tests, benchmarks): every layer, then `finish`."""
        for layer in cache.layers:
            self.send_layer(cache.request_id, layer)
        return self.finish(cache.request_id, tokens=cache.tokens, model=cache.model)


class KVRecvConnector(ABC):
    """Decode side: accepts transfers and hands each verdict to `on_complete(request_id, ReceivedKV)`."""

    @abstractmethod
    def start(self) -> KVRecvConnector: ...

    @abstractmethod
    def close(self) -> None:
        """Stop receiving; transfers still incomplete are delivered as failed."""


class KVConnector(ABC):
    """One way of moving KV: a name in the registry, and factories for its three sides."""

    name: ClassVar[str]

    @classmethod
    def scheduler(cls) -> KVConnectorScheduler:
        return KVConnectorScheduler()

    @classmethod
    @abstractmethod
    def sender(cls, endpoint: KVEndpoint, *, connections: int, congestion_control: str | None = None,
               mss_bytes: int | None = None) -> KVSendConnector:
        """`congestion_control`: the transport's congestion control where it has one (TCP: TCP_CONGESTION),
        None for its default; `mss_bytes`: its segment size (TCP: TCP_MAXSEG), None for the path's. Callers pass
        them only when one was asked for (`serving.kv_congestion_control`, `serving.kv_mss`), so a connector
        without the notion may leave the keywords out."""

    @classmethod
    @abstractmethod
    def receiver(cls, bind_host: str, port: int, on_complete: OnComplete, *, timeout_s: float) -> KVRecvConnector:
        """`timeout_s`: a transfer that makes no progress for this long fails (the receiver's own guard)."""


_REGISTRY: dict[str, type[KVConnector]] = {}


def register_connector(cls: type[KVConnector]) -> type[KVConnector]:
    """Add an implementation under `cls.name` (explicitly, from `testbed.kv.connector`)."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"KV connector {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def connector_names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def get_connector(name: str) -> type[KVConnector]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"{name!r} is not a KV connector; use one of: {', '.join(connector_names())}") from None
