"""pdxfer: move KV cache from prefill to decode over Mooncake Transfer Engine.

Reading order: ``errors`` -> ``setting``/``config`` -> ``pools`` (geometry) -> ``plan/`` (pure address
math) -> ``wire`` (messages) -> ``transport/`` -> ``bootstrap`` -> ``endpoint/`` (one rank) ->
``tiers/`` (decode-side L2/L3) -> ``serving/`` (router and toy workers, users of this API) -> ``integrations/`` (vLLM, SGLang).
"""

from .auth import ReplayGuard, check_http, http_headers, load_secret
from .bootstrap import BootstrapClient, BootstrapServer
from .config import EndpointConfig, Limits, endpoint_settings, knobs
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
from .setting import setting as setting_field
from .setting import settings_of

__version__ = "0.1.0"

__all__ = [
    # endpoints and what they move
    "Endpoint", "EndpointConfig", "Limits", "KVPoll", "KVReceiver", "KVSender", "RequestHandle",
    "BootstrapClient", "BootstrapServer",
    # pools and layouts
    "BufferSpec", "PoolSpec", "Sharding", "layout_signature",
    # settings (each field's default and help, for generated flags and keys)
    "endpoint_settings", "knobs", "setting_field", "settings_of",
    # errors
    "Aborted", "BootstrapError", "ConfigError", "DeadlineExceeded", "DuplicateRoom",
    "IntegrityError", "LayoutMismatch", "PdxferError", "PeerLost", "PlanError", "ProtocolError",
    "RemoteFailure", "TransportError", "TransportUnavailable", "UnknownRoom",
    "UntrustedBootstrap", "WireError",
    # trust and addresses: who may connect, where a server may load from
    "ReplayGuard", "check_http", "check_serving", "http_headers", "load_secret", "peer_allowed",
    "require_trusted", "trusted_bootstrap", "trusted_from_env", "advertised", "host_of",
    "parse_hostport", "parse_hostports", "unreachable_from",
    # metrics
    "prometheus_text",
    "__version__",
]
"""What an engine integration (and ``serving``, a user like any engine) may import. The test
harness, scripts and benchmarks reach internals through their submodules (``pdxfer.faults``,
``pdxfer.wire``...), never through this list."""
