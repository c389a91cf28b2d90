"""pdxfer: move KV cache from prefill to decode over Mooncake Transfer Engine.

Reading order: ``errors`` -> ``config`` -> ``pools`` (geometry) -> ``plan/`` (pure address
math) -> ``wire`` (messages) -> ``transport/`` -> ``bootstrap`` -> ``endpoint/`` (one rank) ->
``tiers/`` (decode-side L2/L3) -> ``serving/`` (router and toy workers, users of this API) -> ``integrations/`` (vLLM, SGLang).
"""

from .auth import ReplayGuard, check_http, http_headers, load_secret
from .bootstrap import BootstrapClient, BootstrapServer
from .config import EndpointConfig, knobs
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
from .faults import Faults
from .metrics import prometheus_text
from .netaddr import advertised, host_of, parse_hostport, parse_hostports, unreachable_from
from .pools import BufferSpec, PoolSpec, Sharding, layout_signature
from .protect import (
    check_serving,
    peer_allowed,
    require_trusted,
    trusted_bootstrap,
    trusted_from_env,
)

__version__ = "0.1.0"

__all__ = [
    "Aborted", "BootstrapClient", "ReplayGuard", "BootstrapError", "BootstrapServer", "BufferSpec",
    "ConfigError", "DeadlineExceeded", "Faults", "DuplicateRoom", "Endpoint", "EndpointConfig",
    "IntegrityError", "ProtocolError", "RequestHandle",
    "KVPoll", "KVReceiver", "KVSender", "LayoutMismatch", "PdxferError", "PeerLost",
    "PlanError", "PoolSpec", "RemoteFailure", "Sharding", "TransportError",
    "TransportUnavailable", "UnknownRoom", "UntrustedBootstrap", "WireError", "check_http", "http_headers", "layout_signature",
    "knobs", "load_secret", "prometheus_text", "__version__", "advertised", "host_of",
    "unreachable_from", "parse_hostport", "parse_hostports", "trusted_bootstrap",
    "check_serving", "peer_allowed", "require_trusted", "trusted_from_env",
]
