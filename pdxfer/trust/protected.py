"""Protected mode: what a process without a shared secret serves.

Without a shared secret nothing on the control plane is authenticated, so a pdxfer listener
then serves loopback peers only: at start (``check_serving``) a non-loopback bind or
advertised address refuses to start (a wildcard bind is left to the accept-time check), and
at accept (``peer_allowed``) every listener refuses a non-loopback peer. Serving other hosts
without a secret needs an explicit opt-in (``--insecure``, ``PDXFER_INSECURE=1``,
``EndpointConfig.insecure``), logged once per listener. Mooncake's and NIXL's own listeners
are not covered. Threat model: docs/security.md.
"""

from __future__ import annotations

import logging

from ..config import knobs
from ..errors import ConfigError
from ..netaddr import is_loopback, is_wildcard

log = logging.getLogger(__name__)

HOW = (
    "set a shared secret of 16 bytes or more, the same on every pdxfer process "
    "(PDXFER_SECRET=..., or PDXFER_SECRET_FILE=/path; vLLM: secret_file in "
    "kv_connector_extra_config), or serve loopback only (--host 127.0.0.1); to serve "
    "other hosts without a secret anyway, opt in with --insecure (PDXFER_INSECURE=1, "
    "vLLM: insecure: true)"
)

_warned: set[tuple[str, str]] = set()


def insecure(explicit: bool = False) -> bool:
    """Whether this process opted in to serving non-loopback peers without a secret."""
    return explicit or knobs().insecure


def check_serving(
    what: str, host: str, advertise: str = "", *, secret: bytes | None, opt_in: bool = False
) -> bool:
    """Check a listener about to start: returns True when it must refuse non-loopback peers
    (protected mode), False when it may serve anyone (a secret, or the opt-in, which then
    logs one warning). Raises ConfigError for a non-loopback bind or advertised address with
    neither."""
    if secret is not None:
        return False
    exposed = [a for a in (host, advertise) if a and not is_wildcard(a) and not is_loopback(a)]
    if insecure(opt_in):
        shown = ", ".join(dict.fromkeys(exposed)) or (
            "every interface" if is_wildcard(host) else ""
        )
        if shown and (what, shown) not in _warned:
            _warned.add((what, shown))
            log.warning(
                "INSECURE: %s serves %s with no shared secret (opted in): anyone who "
                "reaches it can use it unauthenticated",
                what,
                shown,
            )
        return False
    if exposed:
        raise ConfigError(
            f"{what} would serve {exposed[0]} without a shared secret, so any "
            f"host that reaches it could use it unauthenticated: {HOW}"
        )
    return True


def peer_allowed(peer_host: str | None) -> bool:
    """Whether a protected listener may serve a peer at ``peer_host`` (loopback only; a Unix
    socket has no host and is local)."""
    return not peer_host or is_loopback(peer_host)
