"""The multi-connection TCP connector: `testbed.kv.transport`'s `KVSender` and `KVReceiver` (N parallel
TCP connections per prefill -> decode pair, checksummed frames of `testbed.kv.wire`, back-pressure,
TCP_INFO congestion signal; docs/kv.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from testbed.kv.connector.base import KVConnector, KVEndpoint, OnComplete

if TYPE_CHECKING:
    from testbed.kv.transport import KVReceiver, KVSender


class TcpConnector(KVConnector):
    name = "tcp"

    @classmethod
    def sender(cls, endpoint: KVEndpoint, *, connections: int, congestion_control: str | None = None,
               mss_bytes: int | None = None) -> KVSender:
        from testbed.kv.transport import KVSender  # here, not at the top: transport implements this package's interface

        return KVSender(endpoint.host, endpoint.port, connections=connections, congestion_control=congestion_control,
                        mss_bytes=mss_bytes)

    @classmethod
    def receiver(cls, bind_host: str, port: int, on_complete: OnComplete, *, timeout_s: float) -> KVReceiver:
        from testbed.kv.transport import KVReceiver

        return KVReceiver(bind_host, port, on_complete, request_timeout_s=timeout_s)
