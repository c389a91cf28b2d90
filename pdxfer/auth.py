"""Shared-secret access control: HMAC-SHA256 on bootstrap requests and on every control frame.

The secret comes from ``PDXFER_SECRET`` or a file named by ``PDXFER_SECRET_FILE`` (or is
passed explicitly). With no secret configured, nothing is signed or checked (loopback and
trusted networks only); with one, every bootstrap request but ``/health`` must carry a valid
signature, and every control frame a MAC: a ``Hello`` under a key derived from the secret, the
``HelloAck`` under a key bound to that Hello's nonce, and every later frame under a per-pair,
per-direction session key derived from the secret and both sides' fresh nonces (``wire``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time

from .config import knobs
from .errors import ConfigError

ENV = "PDXFER_SECRET"
ENV_FILE = "PDXFER_SECRET_FILE"
MAX_SKEW_S = 300.0
"""A signed bootstrap request older (or newer) than this is refused: bounds replay."""


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


def sign(secret: bytes, *parts: str | bytes) -> str:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        mac.update(len(b).to_bytes(8, "little"))
        mac.update(b)
    return mac.hexdigest()


def verify(secret: bytes, tag: str, *parts: str | bytes) -> bool:
    # a tag that is not plain ASCII hex is simply wrong (compare_digest raises on non-ASCII)
    return bool(tag) and tag.isascii() and hmac.compare_digest(sign(secret, *parts), tag)


class ReplayGuard:
    """Nonces of signed requests seen within the timestamp window: a captured request
    replayed inside the window is refused. Bounded: past ``limit`` nonces the oldest go
    (their timestamps have expired or soon will)."""

    def __init__(self, limit: int = 200_000) -> None:
        self.limit = limit
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def fresh(self, nonce: str, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        with self._lock:
            if nonce in self._seen:
                return False
            if len(self._seen) >= self.limit:
                for k in [k for k, t in self._seen.items() if t < now] or list(self._seen)[
                    : self.limit // 10
                ]:
                    del self._seen[k]
            self._seen[nonce] = now + 2 * MAX_SKEW_S
            return True


def http_headers(secret: bytes | None, method: str, path: str, body: bytes) -> dict[str, str]:
    """Headers that authenticate one bootstrap request (none without a secret)."""
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
    """Why a signed HTTP request is not authorised ("" when it is). The signature covers
    method, path, body, timestamp and a nonce; ``replay`` refuses a nonce seen before."""
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
    if replay is not None and not replay.fresh(nonce):
        return "authentication failed: replayed request (nonce seen before)"
    return ""


def _hkdf(secret: bytes, salt: bytes, info: bytes) -> bytes:
    """HKDF-SHA256 (RFC 5869) with one output block: keys never reuse the secret itself."""
    prk = hmac.new(salt or bytes(32), secret, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


def hello_key(secret: bytes) -> bytes:
    """MAC key of ``Hello`` frames (anyone with the secret may open a handshake)."""
    return _hkdf(secret, b"", b"pdxfer/2 hello")


def ack_key(secret: bytes, pair: bytes) -> bytes:
    """MAC key of the ``HelloAck`` answering the Hello whose nonce is ``pair``: an ack forged
    without the secret, or replayed from another handshake, fails its MAC."""
    return _hkdf(secret, pair, b"pdxfer/2 helloack")


def session_keys(
    secret: bytes, pair: bytes, prefill_nonce: bytes, decode_id: str, prefill_id: str
) -> tuple[bytes, bytes]:
    """(decode->prefill, prefill->decode) MAC keys of one pair's session: bound to both
    nonces and both endpoint ids, one key per direction so a frame cannot be reflected."""
    salt = pair + prefill_nonce
    ids = len(decode_id).to_bytes(2, "little") + decode_id.encode() + prefill_id.encode()
    return (
        _hkdf(secret, salt, b"pdxfer/2 d2p " + ids),
        _hkdf(secret, salt, b"pdxfer/2 p2d " + ids),
    )
