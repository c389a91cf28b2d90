"""Protected mode and trusted bootstraps: what a process serves, and whom a decode loads from.

Without a shared secret nothing on the control plane is authenticated, so a pdxfer listener
then serves loopback peers only: at start (``check_serving``) a non-loopback bind or
advertised address refuses to start (a wildcard bind is left to the accept-time check), and
at accept (``peer_allowed``) every listener refuses a non-loopback peer. Serving other hosts
without a secret needs an explicit opt-in (``--insecure``, ``PDXFER_INSECURE=1``,
``EndpointConfig.insecure``), logged once per listener. Mooncake's and NIXL's own listeners
are not covered. Trusted bootstraps: a decode loads KV only from prefills found through the
bootstrap servers it was configured with (``require_trusted``, ``trusted_bootstrap``), with or
without a secret: the secret authenticates peers, not the caller's choice of prefill.
Threat model: docs/security.md.
"""

from __future__ import annotations

import logging
import os

from .config import knobs
from .errors import ConfigError, UntrustedBootstrap
from .netaddr import is_loopback, is_wildcard, parse_hostport, parse_hostports

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


def require_trusted(value: object, what_to_set: str) -> tuple[str, ...]:
    """A decode's trusted bootstrap list from its configuration (a comma-separated string or
    a list), or ConfigError naming ``what_to_set`` when there is none."""
    trusted = parse_hostports(value, "trusted bootstrap")
    if not trusted:
        raise ConfigError(
            f"a decode needs the bootstrap servers it trusts: set {what_to_set} "
            f"(host:port, several separated by commas); it loads KV only from "
            f"prefills registered there"
        )
    return trusted


TRUSTED_ENV = "PDXFER_TRUSTED_BOOTSTRAPS"
"""Where a decode without a configuration file of its own (SGLang's) reads its trusted list."""


def trusted_from_env(what_to_set: str = TRUSTED_ENV) -> tuple[str, ...]:
    """``PDXFER_TRUSTED_BOOTSTRAPS`` as a trusted list, read when a decode starts (not cached
    with the knobs: one process may start several decodes), or ConfigError when unset."""
    return require_trusted(os.environ.get(TRUSTED_ENV, ""), what_to_set)


def trusted_bootstrap(addr: object, trusted: tuple[str, ...], what: str = "bootstrap") -> str:
    """``addr`` normalised when it is one of ``trusted``; ConfigError when it is malformed,
    ``UntrustedBootstrap`` when it is well-formed but not trusted (checked before any
    connection is made)."""
    a = parse_hostport(addr, what)
    if a not in trusted:
        raise UntrustedBootstrap(
            f"{what} {a} is not one of this decode's trusted bootstrap "
            f"servers ({', '.join(trusted) or 'none'})"
        )
    return a
