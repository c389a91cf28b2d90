"""Keys and MACs: HMAC-SHA256 signatures and the control plane's derived keys.

Control frames never use the secret itself: a ``Hello`` is MACed under a key derived from
it, the ``HelloAck`` under a key bound to that Hello's nonce, and every later frame under a
per-pair, per-direction session key derived from the secret and both sides' fresh nonces
(``wire``).
"""

from __future__ import annotations

import hashlib
import hmac


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
