"""ZMQ contexts for tests, benchmarks and hand-made peers that can always be closed.

A socket's default linger is forever: ``term()`` (and the garbage collector, which pyzmq
makes call ``destroy()`` and then ``term()`` on a context nobody closed) waits until every
message a PUSH socket queued for a peer that is dead, or never was, has gone out, which it
never does. One test that failed before its ``close()`` once hung the whole suite that way.
Every context made here lingers 0, so its sockets drop what they still hold when closed, and
is meant to be closed deterministically: ``with context() as ctx:`` (``destroy()`` on exit),
or ``ctx.destroy()`` in a ``close()`` that a fixture's ``finally`` runs.
"""

from __future__ import annotations

import zmq


def context() -> zmq.Context:
    """A new context whose sockets linger 0 (unless a socket sets its own linger)."""
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    return ctx
