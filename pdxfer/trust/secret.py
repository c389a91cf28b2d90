"""The shared secret: given explicitly, or read from ``PDXFER_SECRET`` / ``PDXFER_SECRET_FILE``.

Without one, nothing is signed or checked and every listener serves loopback peers only
(``protected``); with one, every bootstrap request and control frame is authenticated.
"""

from __future__ import annotations

from ..config import knobs
from ..errors import ConfigError

ENV = "PDXFER_SECRET"
ENV_FILE = "PDXFER_SECRET_FILE"


def load_secret(explicit: str | bytes | None = None) -> bytes | None:
    """The configured secret, or None when access control is off."""
    if explicit is not None:
        s = explicit.encode() if isinstance(explicit, str) else explicit
    elif knobs().secret:
        s = str(knobs().secret).encode()
    elif knobs().secret_file:
        path = str(knobs().secret_file)
        try:
            with open(path, "rb") as f:
                s = f.read().strip()
        except OSError as e:
            raise ConfigError(f"cannot read {ENV_FILE}={path!r}: {e}") from None
    else:
        return None
    if len(s) < 16:
        raise ConfigError("the shared secret must be at least 16 bytes")
    return s
