"""Stamps along one small request's path, inside a benchmark agent (``scripts/trace_small.py``).

``install`` wraps the functions a request passes through (both sides' handlers, the control
socket's send and receive, Mooncake's submit and completion calls) so that each records
``time.perf_counter_ns()`` on entry and exit. On Linux that clock is ``CLOCK_MONOTONIC``,
shared by every process of the host, so the prefill's and the decode's stamps merge into one
timeline. Each wrapper adds its own cost (a microsecond or two) to the segments it measures.
Nothing outside benchmarks imports this module.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

from pdxfer.endpoint import control, inbox, integrity_checks, receiver, sender, writer

_events: list[tuple[str, int, str]] = []
_installed = False
_side = ""


def _stamp(name: str) -> None:
    _events.append((_side + name, time.perf_counter_ns(), threading.current_thread().name))


def _named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn``, stamped ``<name>.in`` / ``.out`` around each call."""

    @functools.wraps(fn)
    def traced(*a: Any, **kw: Any) -> Any:
        _stamp(name + ".in")
        try:
            return fn(*a, **kw)
        finally:
            _stamp(name + ".out")

    return traced


def _wrap(owner: Any, attr: str, name: str) -> None:
    setattr(owner, attr, _named(getattr(owner, attr), name))


class _Engine:
    """Mooncake's engine with its submit and completion calls stamped (a pybind object's
    methods cannot be replaced in place)."""

    def __init__(self, engine: Any) -> None:
        self._e = engine
        for method, tag in (
            ("batch_transfer_async_write", "submit"),
            ("get_batch_transfer_status", "status"),
            ("batch_transfer_sync_write", "sync"),
        ):
            setattr(self, method, _named(getattr(engine, method), f"te.{tag}"))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._e, name)


def install(state: Any, side: str = "") -> None:
    """Wrap the request path in this agent process (idempotent); ``side`` prefixes names."""
    global _installed, _side
    _side = side
    if not _installed:
        _installed = True
        for owner, attr, name in (
            (sender.KVSender, "send", "send"),
            (writer.Writer, "_plan", "plan"),
            (writer.Writer, "_await", "await"),
            (writer.Writer, "_write", "write"),
            (writer.Writer, "_digest", "digest"),
            (writer.Writer, "finish", "finish"),
            (sender.PrefillSide, "on_request", "on_request"),
            (receiver.KVReceiver, "request", "request"),
            (receiver.DecodeSide, "on_done", "on_done"),
            (integrity_checks.IntegrityChecks, "check", "check"),
            (control.Control, "send", "ctl.send"),
            (inbox.Inbox, "_read", "inbox.read"),
        ):
            _wrap(owner, attr, name)
    for e in state.eps.values():
        c = e.ep.core
        if c.control is not None and not hasattr(c.control._on_frame, "__wrapped__"):
            # bound before install: wrap the instance's callables, not the class
            _wrap(c.control, "_on_frame", "frame")
            c.handlers = {k: _named(v, k.__name__) for k, v in c.handlers.items()}
        t = c.transport
        if hasattr(t, "_engine") and not isinstance(t._engine, _Engine):
            t._engine = _Engine(t._engine)


def collect(state: Any) -> list[tuple[str, int, str]]:
    """The stamps recorded since the last call (name, ns, thread), oldest first."""
    out = list(_events)
    del _events[: len(out)]
    return out


def threads(state: Any) -> dict[int, str]:
    """Python thread names by native id (``/proc/<pid>/task/<tid>`` names the rest)."""
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def set_pacing(state: Any, **fields: float) -> int:
    """Set ``pacing.RateEstimate`` fields on every peer of this agent's Mooncake transports
    (A/B runs of the completion pacing); returns how many estimates were changed."""
    n = 0
    for e in state.eps.values():
        for _, rate in getattr(e.ep.core.transport, "_peers", {}).values():
            for k, v in fields.items():
                setattr(rate, k, v)
            n += 1
    return n
