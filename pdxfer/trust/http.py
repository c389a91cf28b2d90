"""Signed HTTP requests (bootstrap server, serving workers' protected routes).

The signature covers method, path, body, a timestamp and a nonce; the server refuses a
request whose timestamp is off by more than ``MAX_SKEW_S`` or whose nonce it has seen
(``ReplayGuard``).
"""

from __future__ import annotations

import secrets
import time

from .keys import sign, verify
from .replay import MAX_SKEW_S, ReplayGuard
from .secret import ENV

HTTP_NONCES = 200_000
"""Nonces a server remembers (the oldest tenth go when full: ``ReplayGuard``)."""


def http_replay_guard() -> ReplayGuard:
    """A server's guard against replayed signed requests."""
    return ReplayGuard(HTTP_NONCES, when_full="evict")


def http_headers(secret: bytes | None, method: str, path: str, body: bytes) -> dict[str, str]:
    """Headers that authenticate one request (none without a secret)."""
    if secret is None:
        return {}
    ts = f"{time.time():.3f}"
    nonce = secrets.token_hex(12)
    return {
        "X-Pdxfer-Time": ts,
        "X-Pdxfer-Nonce": nonce,
        "X-Pdxfer-Signature": sign(secret, method, path, body, ts, nonce),
    }


def check_http(
    secret: bytes | None,
    method: str,
    path: str,
    body: bytes,
    ts: str | None,
    tag: str | None,
    nonce: str | None = None,
    replay: ReplayGuard | None = None,
) -> str:
    """Why a signed HTTP request is not authorised ("" when it is); ``replay`` refuses a
    nonce seen before."""
    if secret is None:
        return ""
    if not ts or not tag or not nonce:
        return f"authentication required: this bootstrap server needs {ENV} on the client"
    try:
        skew = abs(time.time() - float(ts))
    except ValueError:
        return "authentication failed: bad timestamp"
    if skew > MAX_SKEW_S:
        return f"authentication failed: timestamp {skew:.0f} s off (clock skew or replay)"
    if len(nonce) > 64 or not verify(secret, tag, method, path, body, ts, nonce):
        return "authentication failed: wrong signature (different secret?)"
    if replay is not None and replay.check(nonce):
        return "authentication failed: replayed request (nonce seen before)"
    return ""
