"""KV connectors (docs/kv.md "KV connectors"): the interface in `base`, one module per implementation,
registered here explicitly. A new path (RDMA, NIXL) is a new module and one line below."""

from __future__ import annotations

from testbed.kv.connector.base import (
    KVConnector, KVConnectorScheduler, KVEndpoint, KVRecvConnector, KVSendConnector, KVTransferMeta, ReceivedKV,
    TransferStats, connector_names, get_connector, register_connector,
)
from testbed.kv.connector.tcp import TcpConnector

register_connector(TcpConnector)

DEFAULT_CONNECTOR = TcpConnector.name

__all__ = [
    "DEFAULT_CONNECTOR", "KVConnector", "KVConnectorScheduler", "KVEndpoint", "KVRecvConnector", "KVSendConnector",
    "KVTransferMeta", "ReceivedKV", "TcpConnector", "TransferStats", "connector_names", "get_connector", "register_connector",
]
