"""Who a control frame comes from: per-pair sessions and Hello freshness.

With a shared secret, a frame is admitted only when its header names a known pair (or is a
``Hello`` under the secret's Hello key) and its MAC verifies over the raw bytes, before any byte
of its payload is decoded; a session frame's counter must also be new (``ReplayWindow``). What
is admitted carries its ``Session``, whose ``peer`` is the only party a handler may believe or
answer. Without a secret nothing is checked (loopback and trusted networks only).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .. import wire
from ..wire import Header, Rejected
from .keys import hello_key
from .replay import MAX_SKEW_S, ReplayGuard, ReplayWindow

MAX_HELLO_NONCES = 65536
"""Hello nonces remembered for the freshness window; past this, new Hellos are refused (only
holders of the secret can make them, so a legitimate cluster never gets near it)."""


@dataclass(eq=False)
class Session:
    """One handshake or established pair. ``peer`` is the side's record of the other end."""

    pair: bytes
    peer: Any
    ack_key: bytes | None = None
    send_key: bytes | None = None
    recv_key: bytes | None = None
    sent: int = 0
    ack: bytes = b""
    """Prefill: the sealed HelloAck, sent again when the same Hello is retransmitted."""
    window: ReplayWindow = field(default_factory=ReplayWindow)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def established(self) -> bool:
        return self.send_key is not None

    def seal(self, frame: bytes) -> bytes:
        """The frame under this session's key and next counter."""
        with self.lock:
            self.sent += 1
            c = self.sent
        return wire.reseal(frame, wire.SESSION, self.pair, c, self.send_key)


def new_nonce() -> bytes:
    return os.urandom(16)


class Trust:
    """One rank's sessions by pair and the checks every incoming frame passes first."""

    def __init__(self, secret: bytes | None) -> None:
        self.secret = secret
        self.hello_key = hello_key(secret) if secret else None
        self.sessions: dict[bytes, Session] = {}
        self._hellos = ReplayGuard(MAX_HELLO_NONCES, when_full="refuse")
        self.lock = threading.Lock()

    def admit(self, f: bytes | memoryview, h: Header) -> Session | None:
        """The session a frame belongs to (None: a Hello, or no secret), or ``Rejected``."""
        sess, key = self.key(h)
        if key is None:
            return None
        if not wire.verify(f, key, h.mac):
            if h.mode == wire.HELLO:
                raise Rejected("bad_mac", "Hello with a wrong MAC (different secret?)")
            raise Rejected("bad_mac", f"{h.kind.__name__} with a wrong MAC")
        if h.mode == wire.SESSION:
            assert sess is not None
            with sess.lock:
                fresh = sess.window.accept(h.counter)
            if not fresh:
                raise Rejected("replay", f"{h.kind.__name__} with an old counter {h.counter}")
        return sess

    def key(self, h: Header) -> tuple[Session | None, bytes | None]:
        """The session and key a frame's MAC must verify under, from its header alone (raises
        ``Rejected``): everything ``admit`` checks but the MAC and the counter, so a frame
        still arriving can be refused on its header (``Inbox``). No key: no secret."""
        if self.secret is None:
            return None, None
        if h.mode == wire.PLAIN:
            raise Rejected("unsigned", f"unsigned {h.kind.__name__} (this endpoint has a secret)")
        if h.mode == wire.HELLO:
            if h.kind is not wire.Hello:
                raise Rejected("unexpected", f"{h.kind.__name__} under the Hello key")
            return None, self.hello_key
        with self.lock:
            sess = self.sessions.get(h.pair)
        if sess is None:
            raise Rejected("unknown_pair", f"{h.kind.__name__} for an unknown pair")
        if h.mode == wire.ACK:
            if h.kind is not wire.HelloAck:
                raise Rejected("unexpected", f"{h.kind.__name__} under an ack key")
            if sess.ack_key is None or sess.established:  # e.g. the answer to a retransmit
                raise Rejected("replay", "HelloAck for a handshake already settled")
            return sess, sess.ack_key
        if sess.recv_key is None:
            raise Rejected("unknown_pair", f"{h.kind.__name__} before the handshake ended")
        return sess, sess.recv_key

    def fresh_hello(self, h: Header, ts: float) -> str:
        """ "" for a new Hello, "again" for a retransmission of one already answered, or the
        rejection reason (stale timestamp, replayed nonce, too many nonces)."""
        if self.secret is None:
            return ""
        now = time.time()
        if abs(now - ts) > MAX_SKEW_S:
            return "stale_hello"
        return self._hellos.check(h.pair, h.mac, now)

    def add(self, sess: Session) -> None:
        with self.lock:
            self.sessions[sess.pair] = sess

    def drop(self, sess: Session | None) -> None:
        if sess is not None:
            with self.lock:
                if self.sessions.get(sess.pair) is sess:
                    del self.sessions[sess.pair]

    def __len__(self) -> int:
        return len(self.sessions)
