"""``tests.harness.zmqctx``: a test's context closes even with messages nobody will take."""

from __future__ import annotations

import re
import socket
import threading
from pathlib import Path

import zmq

from tests.harness.zmqctx import context


def _dead_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return int(port)


def test_sockets_of_a_test_context_linger_zero() -> None:
    with context() as ctx:
        for kind in (zmq.PUSH, zmq.PULL, zmq.DEALER):
            assert ctx.socket(kind).getsockopt(zmq.LINGER) == 0


def test_a_context_whose_push_socket_holds_undeliverable_frames_still_closes() -> None:
    """What hung the suite: a PUSH socket with frames queued for a peer that is not there,
    left open by a failed test; closing its context (or the GC doing it) must return."""
    closed = threading.Event()

    def leave_it_open() -> None:
        ctx = context()
        push = ctx.socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{_dead_port()}")
        push.send(b"x" * 100, copy=False)  # queued: nobody listens there
        ctx.destroy()  # what ``with`` and the GC do with a context left open
        closed.set()

    t = threading.Thread(target=leave_it_open, daemon=True)
    t.start()
    assert closed.wait(60), "term() waits forever for the queued frame"


def test_tests_and_the_harness_make_their_contexts_in_one_place() -> None:
    """A new ``zmq.Context()`` in a test forgets the linger sooner or later: they all come
    from ``zmqctx.context`` (the library's own sockets each set linger 0 where made)."""
    root = Path(__file__).resolve().parents[2]
    files = [
        *root.joinpath("tests").rglob("*.py"),
        *root.joinpath("scripts").rglob("*.py"),
        *root.joinpath("examples").rglob("*.py"),
        *root.joinpath("benchmarks").rglob("*.py"),
        *root.joinpath("pdxfer", "demo").rglob("*.py"),
    ]
    bad = [
        str(p.relative_to(root))
        for p in files
        if p.name not in ("zmqctx.py", "test_zmqctx.py")
        and re.search(r"\bContext\s*\(", p.read_text())
    ]
    assert not bad, bad
