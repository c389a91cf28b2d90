"""Trust: who may talk to a pdxfer process, and whom a decode loads KV from.

Reading order: ``secret`` (the shared secret, or none) -> ``keys`` (HMAC signatures, derived
keys) -> ``replay`` (the one nonce guard, the session counter window, the freshness window)
-> ``http`` (signed bootstrap and worker requests) -> ``sessions`` (control frames: per-pair
sessions, Hello freshness) -> ``protected`` (without a secret: loopback peers only) ->
``bootstraps`` (a decode's trusted bootstrap servers). Threat model: docs/security.md.
"""

from .bootstraps import TRUSTED_ENV, require_trusted, trusted_bootstrap, trusted_from_env
from .http import check_http, http_headers, http_replay_guard
from .keys import ack_key, hello_key, session_keys, sign, verify
from .protected import check_serving, insecure, peer_allowed
from .replay import MAX_SKEW_S, ReplayGuard, ReplayWindow
from .secret import ENV, ENV_FILE, load_secret
from .sessions import MAX_HELLO_NONCES, Session, Trust, new_nonce

__all__ = [
    "ENV",
    "ENV_FILE",
    "MAX_HELLO_NONCES",
    "MAX_SKEW_S",
    "TRUSTED_ENV",
    "ReplayGuard",
    "ReplayWindow",
    "Session",
    "Trust",
    "ack_key",
    "check_http",
    "check_serving",
    "hello_key",
    "http_headers",
    "http_replay_guard",
    "insecure",
    "load_secret",
    "new_nonce",
    "peer_allowed",
    "require_trusted",
    "session_keys",
    "sign",
    "trusted_bootstrap",
    "trusted_from_env",
    "verify",
]
