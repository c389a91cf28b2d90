"""Trusted bootstraps: whom a decode loads KV from.

A decode loads KV only from prefills found through the bootstrap servers it was configured
with (``require_trusted``, ``trusted_bootstrap``), with or without a secret: the secret
authenticates peers, not the caller's choice of prefill. Threat model: docs/security.md.
"""

from __future__ import annotations

import os

from ..errors import ConfigError, UntrustedBootstrap
from ..netaddr import parse_hostport, parse_hostports


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
