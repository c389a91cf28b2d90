"""pdxfer: move KV cache from prefill to decode over Mooncake Transfer Engine.

Reading order: ``pools`` (geometry) -> ``plan`` (address math) -> ``wire`` (messages) ->
``transport`` -> ``bootstrap`` -> ``endpoint`` (facade) -> ``sender`` / ``receiver``.
"""

from .bootstrap import BootstrapClient, BootstrapServer
from .endpoint import Endpoint
from .errors import (
    Aborted,
    BootstrapError,
    ConfigError,
    DeadlineExceeded,
    DuplicateRoom,
    LayoutMismatch,
    PdxferError,
    PeerLost,
    PlanError,
    RemoteFailure,
    TransportError,
    TransportUnavailable,
    WireError,
)
from .metrics import prometheus_text
from .pools import BufferSpec, PoolSpec, Sharding, layout_signature
from .receiver import KVReceiver
from .sender import KVSender
from .states import EndpointConfig, KVPoll

__version__ = "0.1.0"

__all__ = [
    "Aborted", "BootstrapClient", "BootstrapError", "BootstrapServer", "BufferSpec",
    "ConfigError", "DeadlineExceeded", "DuplicateRoom", "Endpoint", "EndpointConfig",
    "KVPoll", "KVReceiver", "KVSender", "LayoutMismatch", "PdxferError", "PeerLost",
    "PlanError", "PoolSpec", "RemoteFailure", "Sharding", "TransportError",
    "TransportUnavailable", "WireError", "layout_signature", "prometheus_text", "__version__",
]
