"""pdxfer: move KV cache from prefill to decode over Mooncake Transfer Engine.

Reading order: ``errors`` -> ``setting``/``config`` -> ``pools`` (geometry) -> ``plan/`` (pure
address math) -> ``wire`` (messages) -> ``trust/`` (secret, signatures, replay, protected mode)
-> ``transport/`` -> ``bootstrap`` -> ``endpoint/`` (one rank) -> ``tiers/`` (decode-side
L2/L3) -> ``serving/`` (router and toy workers, users of this API) -> ``integrations/`` (vLLM,
SGLang).
"""

from .bootstrap import BootstrapClient, BootstrapServer
from .config import EndpointConfig, Limits, endpoint_settings
from .endpoint import Endpoint, KVPoll, KVReceiver, KVSender, RequestHandle
from .errors import (
    Aborted,
    BootstrapError,
    ConfigError,
    DeadlineExceeded,
    DuplicateRoom,
    IntegrityError,
    LayoutMismatch,
    PdxferError,
    PeerLost,
    PlanError,
    ProtocolError,
    RemoteFailure,
    TransportError,
    TransportUnavailable,
    UnknownRoom,
    UntrustedBootstrap,
    WireError,
)
from .netaddr import parse_hostport, parse_hostports
from .pools import BufferSpec, PageSegment, Piece, PoolSpec, Sharding
from .trust import require_trusted, trusted_bootstrap, trusted_from_env

__version__ = "0.1.0"

__all__ = [
    # endpoints and what they move
    "Endpoint",
    "EndpointConfig",
    "Limits",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "RequestHandle",
    "BootstrapClient",
    "BootstrapServer",
    # pools and layouts
    "BufferSpec",
    "PageSegment",
    "Piece",
    "PoolSpec",
    "Sharding",
    # the endpoint's settings (default, help, key), for an engine's generated keys
    "endpoint_settings",
    # errors
    "Aborted",
    "BootstrapError",
    "ConfigError",
    "DeadlineExceeded",
    "DuplicateRoom",
    "IntegrityError",
    "LayoutMismatch",
    "PdxferError",
    "PeerLost",
    "PlanError",
    "ProtocolError",
    "RemoteFailure",
    "TransportError",
    "TransportUnavailable",
    "UnknownRoom",
    "UntrustedBootstrap",
    "WireError",
    # trust and addresses: which bootstraps a decode may follow
    "require_trusted",
    "trusted_bootstrap",
    "trusted_from_env",
    "parse_hostport",
    "parse_hostports",
    "__version__",
]
"""What an engine integration may import. ``serving`` adds the server helpers (``SERVER_API``
in ``tests/unit/test_layers.py``); the test harness, scripts and benchmarks reach internals
through their submodules (``pdxfer.faults``, ``pdxfer.wire``...), never through this list."""
