"""The control plane's plumbing: a receiving control socket per endpoint, PUSH sockets to
peers, a control thread, and room-sharded worker threads.

Frames arrive through ``inbox.Inbox`` (what a ZMQ PULL socket speaks, read header first into
bounded memory) and leave through ``outbox.Outbox`` (what a ZMQ PUSH socket speaks, written by
the sending thread itself); ``PDXFER_CONTROL_SEND=zmq`` sends through ZMQ PUSH sockets instead
(each message then waits for ZMQ's I/O thread to wake). No pdxfer semantics live here: the
endpoint hands in a frame handler (saying whether it admitted the frame), a header screen and
a periodic tick. A handler that raises is logged and counted; it never kills the control
thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import zmq

from ..config import knobs
from ..errors import ConfigError
from ..faults import faults
from .inbox import Inbox, Screen
from .outbox import Outbox

log = logging.getLogger(__name__)

MAX_PEER_SOCKETS = 1024
"""Peer sockets kept open; the least recently used is closed beyond this. Frames only ever go
to registered peers' addresses (never to one named in a message), so this is a backstop."""


LATE_S = 1.0
"""A control thread this late for its tick logs it, with its process's CPU meanwhile: about
a CPU's worth (or more) says other threads of the process ran (one held the GIL, or threads
outside Python spun); little says the machine gave the process little CPU."""


class Control:
    """Receives frames on ``host`` (``address`` names it with ``advertise``, the address peers
    dial) and sends frames to peers' addresses."""

    def __init__(
        self,
        host: str,
        on_frame: Callable[[memoryview], bool],
        on_tick: Callable[[], None],
        tick_s: float = 0.05,
        max_frame: int = 64 << 20,
        name: str = "pdxfer-control",
        screen: Screen | None = None,
        reject: Callable[[str, str], None] | None = None,
        advertise: str = "",
        loopback_only: bool = False,
    ) -> None:
        mode = knobs().control_send
        if mode not in ("direct", "zmq"):
            raise ConfigError(f"PDXFER_CONTROL_SEND must be 'direct' or 'zmq', got {mode!r}")
        self._ctx = zmq.Context() if mode == "zmq" else None
        self._outbox = Outbox(MAX_PEER_SOCKETS, name=f"{name}-out") if mode == "direct" else None
        self._inbox = Inbox(
            host,
            self._deliver,
            screen or (lambda head, size: True),
            reject or (lambda reason, text: log.warning("%s: %s", reason, text)),
            max_frame,
            loopback_only,
        )
        self.address = f"tcp://{advertise or host}:{self._inbox.port}"
        self._on_frame = on_frame
        self._on_tick = on_tick
        self._tick_s = tick_s
        self._faults = faults()
        self._push: OrderedDict[str, tuple[zmq.Socket, threading.Lock]] = OrderedDict()
        self._push_lock = threading.Lock()
        self._stop = threading.Event()
        self.handler_errors = 0
        self.send_failures = 0
        self.late_max_s = 0.0
        """The longest the control thread ran its tick after it was due: time it spent in
        handlers, or runnable without a CPU or the GIL (``handler_max_ms`` tells which)."""
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        next_tick = time.monotonic() + self._tick_s
        proc, logged = time.process_time(), 0.0
        while not self._stop.is_set():
            self._inbox.poll(max(0.0, next_tick - time.monotonic()))
            now = time.monotonic()
            if now >= next_tick:
                late = now - next_tick
                self.late_max_s = max(self.late_max_s, late)
                used, proc = time.process_time() - proc, time.process_time()
                if late >= LATE_S and now - logged >= 1.0:
                    logged = now
                    log.warning(
                        "%s: the control thread ran %.1f s late (in handlers, or "
                        "without a CPU or the GIL); its process used %.2f s of CPU in "
                        "those %.1f s",
                        self._thread.name,
                        late,
                        used,
                        late + self._tick_s,
                    )
                self._guard(self._on_tick)
                self._inbox.expire(now)
                next_tick = time.monotonic() + self._tick_s

    def _deliver(self, frame: memoryview) -> bool:
        """Hand a complete frame to the endpoint; True if it admitted the frame."""
        fl = self._faults
        if fl.active and fl.drop_incoming():
            return False
        try:
            return bool(self._on_frame(frame))
        except Exception:  # noqa: BLE001 - one bad message must not stop the endpoint
            self.handler_errors += 1
            log.exception("control handler failed")
            return False

    def _guard(self, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - one bad message must not stop the endpoint
            self.handler_errors += 1
            log.exception("control handler failed")

    def send(self, addr: str, frame: bytes) -> bool:
        """Queue ``frame`` for ``addr`` without blocking; False if it could not be queued."""
        if self._outbox is not None:
            if self._outbox.send(addr, frame):
                return True
            self.send_failures += 1
            return False
        assert self._ctx is not None
        with self._push_lock:
            entry = self._push.get(addr)
            if entry is not None:
                self._push.move_to_end(addr)
            else:
                while len(self._push) >= MAX_PEER_SOCKETS:
                    _, (old, old_lock) = self._push.popitem(last=False)
                    with old_lock:
                        old.close(linger=0)
                s = self._ctx.socket(zmq.PUSH)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.SNDHWM, 100_000)
                s.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)  # a dead peer: back off, not spin
                try:
                    s.connect(addr)
                except zmq.ZMQError as e:
                    s.close()
                    log.warning("cannot connect to %s: %s", addr, e)
                    self.send_failures += 1
                    return False
                entry = self._push[addr] = (s, threading.Lock())
        sock, lock = entry
        with lock:
            try:
                sock.send(frame, zmq.NOBLOCK, copy=False)
                return True
            except zmq.ZMQError as e:
                self.send_failures += 1
                log.warning("send to %s failed: %s", addr, e)
                return False

    def sockets(self) -> int:
        """Open peer sockets (a metric: bounded by the peers a rank keeps)."""
        return self._outbox.sockets() if self._outbox is not None else len(self._push)

    def connections(self) -> int:
        """Open incoming connections (a metric: capped by ``inbox.MAX_CONNECTIONS``)."""
        return self._inbox.connections()

    def forget(self, addr: str) -> None:
        """Drop the socket to a peer that is gone (its queued frames are discarded)."""
        if self._outbox is not None:
            self._outbox.forget(addr)
            return
        with self._push_lock:
            entry = self._push.pop(addr, None)
        if entry is not None:
            with entry[1]:
                entry[0].close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._outbox is not None:
            self._outbox.close()
        with self._push_lock:
            for s, lock in self._push.values():
                with lock:
                    s.close(linger=0)
            self._push.clear()
        if not self._thread.is_alive():
            self._inbox.close()
        if self._ctx is not None:
            self._ctx.term()


class Workers:
    """FIFO worker threads; every job of one key (a room) runs on the same thread, in order.

    That ordering is what makes "drained" cheap to prove: a finish or ack job queued behind a
    room's writes runs only after they have returned.
    """

    def __init__(self, n: int, name: str = "pdxfer-worker") -> None:
        self._queues: list[queue.SimpleQueue[Callable[[], None] | None]] = [
            queue.SimpleQueue() for _ in range(n)
        ]
        self._threads = [
            threading.Thread(target=self._loop, args=(q,), name=f"{name}-{i}", daemon=True)
            for i, q in enumerate(self._queues)
        ]
        self.errors = 0
        for t in self._threads:
            t.start()

    def submit(self, key: int, job: Callable[[], None]) -> None:
        self._queues[key % len(self._queues)].put(job)

    def _loop(self, q: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        while True:
            job = q.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # noqa: BLE001 - a job's failure is reported by the job
                self.errors += 1
                log.exception("worker job failed")

    def close(self, timeout: float = 10.0) -> None:
        for q in self._queues:
            q.put(None)
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(timeout=max(0.0, end - time.monotonic()))
