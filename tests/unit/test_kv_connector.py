"""KV connectors (docs/kv.md "KV connectors"): the registry, the scheduler side's plan, the TCP connector
through the interface (bit-exact), and a second implementation plugging into a prefill worker unchanged."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from testbed.kv.cache import KVCache, LayerKV
from testbed.kv.connector import (
    KVConnector, KVConnectorScheduler, KVEndpoint, KVRecvConnector, KVSendConnector, ReceivedKV, TcpConnector,
    TransferStats, connector_names, get_connector, register_connector,
)
from testbed.serving.protocol import KVDestination, PrefillRequest
from testbed.serving.worker import Destination, PrefillJob


def test_the_registry_knows_tcp_refuses_unknown_names_and_double_registration() -> None:
    assert get_connector("tcp") is TcpConnector and "tcp" in connector_names()
    with pytest.raises(ValueError, match="'rdma' is not a KV connector; use one of: .*tcp"):
        get_connector("rdma")

    class Impostor(TcpConnector):
        name = "tcp"

    with pytest.raises(ValueError, match="registered twice"):
        register_connector(Impostor)


def test_the_scheduler_side_plans_what_the_decode_side_lacks_and_where() -> None:
    plan = KVConnectorScheduler().plan("r", 2048, 512, KVEndpoint("10.2.0.5", 9001))
    assert (plan.first_token, plan.last_token, plan.tokens, plan.endpoint.port) == (512, 2048, 1536, 9001)
    with pytest.raises(ValueError, match="cached_len"):
        KVConnectorScheduler().plan("r", 100, 100, KVEndpoint("h", 1))


def test_the_tcp_connector_moves_a_cache_bit_exact_through_the_interface() -> None:
    gen = torch.Generator().manual_seed(3)
    cache = KVCache("c1", "m", 37, [
        LayerKV(0, "linear", {"state": torch.randn(2, 8, 6, generator=gen), "conv": torch.randn(3, 40, generator=gen).bfloat16()}),
        LayerKV(1, "gqa", {"k": torch.randn(37, 2, 8, generator=gen).bfloat16(), "v": torch.randn(37, 2, 8, generator=gen).bfloat16()}),
    ])
    got: list[ReceivedKV] = []
    done = threading.Event()
    receiver = TcpConnector.receiver("127.0.0.1", 0, lambda rid, r: (got.append(r), done.set()), timeout_s=10).start()
    assert isinstance(receiver, KVRecvConnector)
    try:
        sender = TcpConnector.sender(KVEndpoint("127.0.0.1", receiver.port), connections=2)  # type: ignore[attr-defined]
        assert isinstance(sender, KVSendConnector)
        try:
            stats = sender.send_cache(cache)
        finally:
            sender.close()
        assert done.wait(10)
    finally:
        receiver.close()
    assert stats.ok and stats.kv_bytes == cache.nbytes and got[0].ok and got[0].cache is not None
    for a, b in zip(cache.layers, got[0].cache.layers):
        for name, t in a.tensors.items():
            assert torch.equal(t.view(torch.uint8), b.tensors[name].view(torch.uint8))


class MemoryConnector(KVConnector):
    """A second implementation, test-only: frames go to an in-process list instead of a socket."""

    name = "memory-test"
    sent: list[tuple[str, int, int]] = []

    class Sender(KVSendConnector):
        def send_layer(self, request_id: str, layer: LayerKV) -> None:
            MemoryConnector.sent.append((request_id, layer.layer_index, layer.nbytes))

        def send_bytes(self, request_id: str, layer_index: int, kind: str, nbytes: int) -> None:
            MemoryConnector.sent.append((request_id, layer_index, nbytes))

        def finish(self, request_id: str, tokens: int = 0, model: str = "", timeout_s: float | None = None) -> TransferStats:
            n = sum(b for r, _, b in MemoryConnector.sent if r == request_id)
            return TransferStats(request_id, True, None, n, n, 1, time.monotonic(), time.monotonic(), 1)

        def abort(self, request_id: str, reason: str = "aborted by sender") -> None:
            return None

        def close(self) -> None:
            return None

    @classmethod
    def sender(cls, endpoint: KVEndpoint, *, connections: int) -> KVSendConnector:
        return cls.Sender()

    @classmethod
    def receiver(cls, bind_host, port, on_complete, *, timeout_s):  # noqa: ANN001, ANN206
        raise NotImplementedError("not needed on the prefill side")


def test_a_new_connector_is_one_class_and_one_registration_and_the_prefill_worker_uses_it_unchanged() -> None:
    from testbed.serving.compute import ProfileLayer

    register_connector(MemoryConnector)
    ended: list[PrefillJob] = []
    done = threading.Event()
    dest = Destination("10.2.0.5", 9001, 4, lambda j: (ended.append(j), done.set()), "m", kv_timeout_s=5.0, connector="memory-test")
    job = PrefillJob(PrefillRequest("mem1", 1024, KVDestination("10.2.0.5", 9001, 0)))
    for i, n in enumerate((100, 200, 300)):
        dest.items.put(("layer", job, ProfileLayer(i, "linear", n)))
    dest.items.put(("finish", job, 1024))
    assert done.wait(5)
    assert ended[0].result["status"] == "ok" and ended[0].result["kv_bytes"] == 600
    assert [x for x in MemoryConnector.sent if x[0] == "mem1"] == [("mem1", 0, 100), ("mem1", 1, 200), ("mem1", 2, 300)]
