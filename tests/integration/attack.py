"""A third party on the control network: raw ZMQ sockets and hand-made frames.

The frame helpers also speak the protocol before frame authentication (version 1), so every
attack test can be run against the old code to see it fail there (``run it with PYTHONPATH``
pointing at an old checkout, with this tree's ``tests/harness/zmqctx.py`` copied into it).
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
import zmq

from pdxfer import wire
from tests.harness.zmqctx import context

NEW = hasattr(wire, "frame")
KINDS = {k.__name__: k for k in getattr(wire, "KINDS", ())}


def fields(kind: str) -> tuple[str, ...]:
    return getattr(wire, kind).__struct_fields__


def plain(msg: dict[str, Any]) -> bytes:
    """An unauthenticated frame around ``msg`` (a dict with its ``type``); fields the running
    protocol does not have (``reply_to`` after it was removed) are dropped, so the attack is
    the same against old and new code."""
    known = set(fields(msg["type"])) | {"type"}
    payload = msgspec.msgpack.encode({k: v for k, v in msg.items() if k in known})
    if NEW:
        return wire.frame(payload, KINDS[msg["type"]])
    return wire.MAGIC + bytes([wire.PROTOCOL_VERSION]) + payload


def payload(frame: bytes) -> bytes:
    return frame[wire.HEADER_LEN :] if NEW else frame[4:]


def pair_of(frame: bytes) -> bytes:
    return wire.header(frame).pair if NEW else b""


def reframe(frame: bytes, new_payload: bytes) -> bytes:
    """The same header (mode, pair, counter and MAC kept) around another payload."""
    if not NEW:
        return frame[:4] + new_payload
    h = wire.header(frame)
    head = wire.frame(new_payload, h.kind, h.mode, h.pair, h.counter)
    return head[: wire.HEADER_LEN - 32] + h.mac + new_payload


def answer(frame: bytes, msg: dict[str, Any]) -> bytes:
    """A plain reply carrying the pair of ``frame`` (what a man in the middle would send)."""
    f = plain(msg)
    if not NEW:
        return f
    h = wire.header(f)
    return wire.frame(payload(f), h.kind, wire.PLAIN, pair_of(frame))


class Raw:
    """PUSH sockets to any address and one PULL socket to read what comes back."""

    def __init__(self) -> None:
        self.ctx = context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.addr = f"tcp://127.0.0.1:{self.pull.bind_to_random_port('tcp://127.0.0.1')}"
        self._push: dict[str, zmq.Socket] = {}

    def send(self, addr: str, frame: bytes) -> None:
        s = self._push.get(addr)
        if s is None:
            s = self._push[addr] = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, 1_000_000)
            s.connect(addr)
        s.send(frame, copy=False)

    def recv(self, timeout: float = 10.0) -> bytes:
        assert self.pull.poll(int(timeout * 1000)), "nothing arrived"
        return self.pull.recv()

    def drain(self) -> None:
        while self.pull.poll(0):
            self.pull.recv()

    def close(self) -> None:
        self.ctx.destroy()


def wait_for(pred: Any, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return bool(pred())


def rand_id() -> str:
    return os.urandom(6).hex()
