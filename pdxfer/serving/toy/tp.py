"""Tensor-parallel plumbing of a toy worker: the gloo group whose all-gather joins the ranks'
attention heads, and the command link from rank 0 (the worker's front) to each other rank.

Rank 0 starts ranks 1..N-1 as processes of their own (``multiprocessing`` spawn: no fork of a
process that already runs transfer threads) and talks to each over a pipe: commands go one
way, in order; replies and events come back, read by one thread per rank. A pipe that closes
means its rank is gone: rank 0 fails what depended on that rank and reports it; a rank that
lost rank 0 exits. Ranks are stopped by pid (SIGTERM, then SIGKILL).

The gloo group rendezvouses through a ``TCPStore`` that rank 0 opens on a free loopback port
and binds its devices to 127.0.0.1: the ranks of a worker always share a host.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from ..errors import WorkerBroken
from .model import Gather

log = logging.getLogger(__name__)

GROUP_HOST = "127.0.0.1"
START_TIMEOUT_S = 120.0
"""How long rank 0 waits for the other ranks to start (imports, model, endpoint)."""
COLLECTIVE_TIMEOUT_S = 120.0
"""A gather a peer never joins fails after this (a dead peer fails it at once)."""


def open_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port (``store.port``)."""
    return dist.TCPStore(
        GROUP_HOST,
        0,
        size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
    )


def join(store_port: int, rank: int, size: int, store: dist.TCPStore | None = None) -> Gather:
    """Join the group; returns the all-gather the model calls (ranks concatenated in rank
    order along dim 1). A failed gather (a peer died) raises ``WorkerBroken``."""
    if store is None:
        store = dist.TCPStore(
            GROUP_HOST,
            store_port,
            size,
            is_master=False,
            timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
        )
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    gloo = dist.ProcessGroupGloo
    try:  # bind to loopback whatever the host name resolves to (a netns may not have it)
        opts = gloo._Options()
        opts._devices = [gloo.create_device(hostname=GROUP_HOST)]
        opts._timeout = timeout
        pg = gloo(store, rank, size, opts)
    except AttributeError:  # a torch without the options struct: its default device
        pg = gloo(store, rank, size, timeout)

    def gather(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(size)]
        try:
            pg.allgather([out], [t]).wait()
        except RuntimeError as e:
            raise WorkerBroken(f"TP gather failed (a rank is gone): {e}") from None
        return torch.cat(out, dim=1)

    gather.group = pg  # type: ignore[attr-defined]  # keeps the group alive with the model
    return gather


def exit_reason(proc: mp.process.BaseProcess) -> str:
    code = proc.exitcode
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class Link:
    """Rank 0's end of one other rank's pipe.

    ``send`` is fire-and-forget and ordered; ``call`` waits for the reply. ``on_event(rank,
    kind, args)`` gets the rank's events on the reader thread; ``on_exit(rank, why)`` runs once
    when the pipe closes."""

    def __init__(self, rank: int, proc: mp.process.BaseProcess, conn: Connection) -> None:
        self.rank, self.proc, self.conn = rank, proc, conn
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._waiting: dict[int, Future[Any]] = {}
        self.dead: str | None = None
        self.stopping = False
        self.info: dict[str, Any] = {}
        self.on_event: Callable[[int, str, tuple[Any, ...]], None] = lambda *_: None
        self.on_exit: Callable[[int, str], None] = lambda *_: None
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return int(self.proc.pid or 0)

    def wait_ready(self, timeout: float) -> None:
        """The rank's first message: ready (with its endpoint id), or why it could not start."""
        if not self.conn.poll(timeout):
            raise RuntimeError(
                f"TP rank {self.rank} (pid {self.pid}) did not start in {timeout:.0f} s"
            )
        try:
            kind, payload = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(5)
            raise RuntimeError(
                f"TP rank {self.rank} (pid {self.pid}) {exit_reason(self.proc)} while starting"
            ) from None
        if kind != "ready":
            raise RuntimeError(f"TP rank {self.rank} could not start: {payload}")
        self.info = dict(payload)

    def start(self) -> None:
        self._reader = threading.Thread(
            target=self._read, daemon=True, name=f"pdxfer-tp{self.rank}-link"
        )
        self._reader.start()

    def send(self, op: str, **kw: Any) -> None:
        self._put(0, op, kw)

    def ask(self, op: str, **kw: Any) -> Future[Any]:
        """Send a command whose reply comes back in the future."""
        fut: Future[Any] = Future()
        seq = next(self._seq)
        with self._lock:
            self._waiting[seq] = fut
        self._put(seq, op, kw)
        return fut

    def call(self, op: str, timeout: float = 60.0, **kw: Any) -> Any:
        return self.ask(op, **kw).result(timeout)

    def _put(self, seq: int, op: str, kw: dict[str, Any]) -> None:
        with self._lock:
            if self.dead is not None:
                fut = self._waiting.pop(seq, None)
                if fut is not None:
                    fut.set_exception(WorkerBroken(self.dead))
                return
            try:
                self.conn.send((seq, op, kw))
            except (OSError, ValueError):
                pass  # the reader sees the pipe close and reports the rank gone

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "reply":
                _, seq, ok, value = msg
                with self._lock:
                    fut = self._waiting.pop(seq, None)
                if fut is not None:
                    if ok:
                        fut.set_result(value)
                    else:
                        fut.set_exception(WorkerBroken(f"TP rank {self.rank}: {value}"))
            elif msg[0] == "event":
                try:
                    self.on_event(self.rank, msg[1], tuple(msg[2:]))
                except Exception:  # noqa: BLE001 - one bad event must not end the link
                    log.exception("TP rank %d: event %r failed", self.rank, msg[1])
        self.proc.join(2)
        why = f"TP rank {self.rank} (pid {self.pid}) {exit_reason(self.proc)}"
        with self._lock:
            self.dead = why
            waiting, self._waiting = self._waiting, {}
        for fut in waiting.values():
            fut.set_exception(WorkerBroken(why))
        if not self.stopping:
            log.error("%s: this worker cannot serve until it is restarted", why)
        self.on_exit(self.rank, why)

    def stop(self) -> None:
        """Ask the rank to close its endpoint and exit (``stop_all`` enforces it)."""
        self.stopping = True
        self.send("stop")


def stop_all(links: list[Link], grace: float = 3.0) -> None:
    """Stop ranks by pid: asked first, then SIGTERM, then SIGKILL, within ``grace`` + 2 s."""
    for link in links:
        link.stop()
    end = time.monotonic() + grace
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        for link in links:
            if link.proc.exitcode is None and sig is not None and link.pid:
                try:
                    os.kill(link.pid, sig)
                except ProcessLookupError:
                    pass
            link.proc.join(max(0.0, end - time.monotonic()))
        end = time.monotonic() + 1.0
    for link in links:
        link.conn.close()


def spawn(target: Callable[..., None], rank: int, *args: Any) -> Link:
    """Start one rank's process running ``target(conn, rank, *args)``."""
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=target, args=(theirs, rank, *args), name=f"pdxfer-tp{rank}")
    proc.start()
    theirs.close()
    return Link(rank, proc, mine)
