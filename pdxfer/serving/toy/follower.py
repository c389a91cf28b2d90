"""A TP rank other than 0: its model shard, pools, endpoint and tier cache, driven by rank 0.

It decides nothing. Rank 0 tells it, in order, what to open (a sender or receiver for a room,
on its own endpoint: it holds its own heads), what to compute (every forward rank 0 runs,
meeting it in the gathers), what to ship, restore or keep, and what to abort. It reports when
a room's transfer on this rank ends (with its figures), when a failed room's pages are free
to reuse, and when the prefill may free a room's source pages (``holding`` over).

Two queues keep rank 0's order where it matters: forwards, sends, prefix loads, write-backs
and new receivers run one by one on the compute thread, in the order rank 0 issued them (so a
write-back of one request's pages always precedes the next request's writes into them);
opening a sender, aborting and statistics run at once on the command thread.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from pdxfer import KVPoll

from .model import LogitsFor
from .tiered import make_cache, open_receiver, reuse
from .tp import join
from .worker import ModelHost, WorkerConfig

log = logging.getLogger(__name__)

COMPUTE_OPS = frozenset({"forward", "send", "reuse", "write_back", "open_receiver"})
WATCH_S = 0.001


def main(conn: Connection, rank: int, cfg: WorkerConfig, store_port: int, log_level: str) -> None:
    """The rank's process: join the group, build the rank, serve rank 0 until told to stop
    or until rank 0 is gone."""
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops us
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    try:
        gather = join(store_port, rank, cfg.tp)
        host = ModelHost(cfg, rank, gather)
        cache = make_cache(cfg, host)
    except BaseException as e:  # noqa: BLE001 - told to rank 0, which refuses to start
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        os._exit(1)
    f = Follower(host, cache, conn)
    conn.send(("ready", {"rank": rank, "pid": os.getpid(), "endpoint": host.endpoint.endpoint_id}))
    try:
        f.run()
    finally:
        threading.Timer(5.0, os._exit, (0,)).start()  # a close that hangs does not keep us
        f.close()
        os._exit(0)  # transfer threads must not keep a stopped rank alive


class Follower:
    def __init__(self, host: ModelHost, cache: Any, conn: Connection) -> None:
        self.host, self.cache, self.conn = host, cache, conn
        self.handles: dict[int, tuple[Any, str]] = {}
        self.reported: set[int] = set()
        self.aborted: collections.OrderedDict[int, str] = collections.OrderedDict()
        self.q: queue.Queue[tuple[int, str, dict[str, Any]] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._added = threading.Event()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._compute, daemon=True, name="tp-compute"),
            threading.Thread(target=self._watch, daemon=True, name="tp-watch"),
        ]
        for t in self._threads:
            t.start()

    # -- plumbing ---------------------------------------------------------------------------
    def emit(self, *msg: Any) -> None:
        with self._send_lock:
            try:
                self.conn.send(msg)
            except (OSError, ValueError):
                pass

    def run(self) -> None:
        while True:
            try:
                seq, op, kw = self.conn.recv()
            except (EOFError, OSError):
                log.warning("rank 0 is gone: stopping")
                return
            if op == "stop":
                return
            if op in COMPUTE_OPS:
                self.q.put((seq, op, kw))
            else:
                self._exec(seq, op, kw)

    def _exec(self, seq: int, op: str, kw: dict[str, Any]) -> None:
        try:
            value, ok = getattr(self, f"op_{op}")(**kw), True
        except Exception as e:  # noqa: BLE001 - an op's failure is reported, never fatal
            log.log(logging.INFO if op == "send" else logging.WARNING, "%s failed: %s", op, e)
            value, ok = f"{type(e).__name__}: {e}", False
        if seq:
            self.emit("reply", seq, ok, value)

    def _compute(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            self._exec(*item)

    def close(self) -> None:
        self._stop.set()
        self.q.put(None)
        if self.cache is not None:
            self.cache.close()
            if self.cache.storage is not None:
                self.cache.storage.close()
        self.host.endpoint.close()

    # -- rooms --------------------------------------------------------------------------------
    def _track(self, room: int, handle: Any, kind: str) -> None:
        with self._lock:
            self.handles[room] = (handle, kind)
            self.reported.discard(room)
            reason = self.aborted.pop(room, None)
        if reason is not None:
            handle.abort(reason)
        self._added.set()

    def _watch(self) -> None:
        """Report each room's end once, then (a prefill) when its hold is over."""
        while not self._stop.is_set():
            with self._lock:
                items = list(self.handles.items())
            if not items:
                self._added.wait(0.1)
                self._added.clear()
                continue
            for room, (h, kind) in items:
                try:
                    self._check(room, h, kind)
                except Exception:  # noqa: BLE001 - the watcher must outlive any one room
                    log.exception("room %d: watching its handle failed", room)
            time.sleep(WATCH_S)

    def _check(self, room: int, h: Any, kind: str) -> None:
        st = h.poll()
        if st.terminal and room not in self.reported:
            self.reported.add(room)
            f = h.failure
            stats = h.stats() if kind == "receiver" and st == KVPoll.Success else {}
            self.emit(
                "event",
                "state",
                room,
                int(st),
                None if f is None else f"{getattr(f, 'kind', 'error')}: {f}",
                dict(stats),
            )
        if room in self.reported and not (kind == "sender" and h.holding):
            if kind == "sender":
                self.emit("event", "unheld", room)
            with self._lock:
                self.handles.pop(room, None)
                self.reported.discard(room)

    # -- control ops (command thread) ----------------------------------------------------------
    def op_open_sender(self, room: int, peer: str | None) -> None:
        self._track(room, self.host.endpoint.sender(room, peer=peer), "sender")

    def op_abort(self, room: int, reason: str) -> None:
        with self._lock:
            entry = self.handles.get(room)
            if entry is None:
                self.aborted[room] = reason  # its open is still queued
                while len(self.aborted) > 4096:
                    self.aborted.popitem(last=False)
        if entry is not None:
            entry[0].abort(reason)

    def op_stats(self) -> dict[str, Any]:
        with self._lock:
            rooms = len(self.handles)
        return {
            "rooms": rooms,
            "endpoint": self.host.endpoint.prometheus().decode(),
            "tiers": self.cache.stats() if self.cache is not None else {},
        }

    # -- compute ops (compute thread, rank 0's order) ----------------------------------------
    def op_forward(
        self,
        model: str,
        pool: str,
        tokens: list[int],
        start: int,
        pages: list[int],
        logits_for: LogitsFor,
    ) -> None:
        h = self.host
        m = h.model if model == "target" else h.draft
        with h.lock:
            m.forward(
                tokens, start, pages, h.kv if pool == "kv" else h.draft_kv, logits_for=logits_for
            )

    def op_send(
        self, room: int, pages: list[int], rows: dict[str, tuple[int, list[int]]], last: bool
    ) -> None:
        with self._lock:
            entry = self.handles.get(room)
        if entry is None:
            return  # aborted and dropped already
        for name, (slot, values) in rows.items():
            getattr(self.host, name)[slot] = torch.tensor(values, dtype=torch.int32)
        entry[0].send({"kv": pages}, slots={n: s for n, (s, _) in rows.items()} or None, last=last)

    def op_reuse(self, tokens: list[int], pages: list[int], tenant: str) -> int:
        if self.cache is None:
            return 0
        with self.host.lock:
            return reuse(self.cache, tokens, pages, tenant)

    def op_write_back(self, tokens: list[int], pages: list[int], n: int, tenant: str) -> None:
        if self.cache is not None:
            self.cache.write_back(tokens, {"kv": pages}, n, tenant)

    def op_open_receiver(
        self,
        room: int,
        bootstrap: str,
        instance: str | None,
        tokens: list[int],
        dst: list[int],
        slot: int,
        n: int,
        tenant: str,
    ) -> None:
        def release(*_: Any) -> None:
            self.emit("event", "released", room)

        with self._lock:
            reason = self.aborted.pop(room, None)
        if reason is not None:
            self.emit("event", "state", room, int(KVPoll.Failed), f"aborted: {reason}", {})
            release()
            return
        try:
            rx = open_receiver(
                self.host,
                self.cache,
                room,
                bootstrap,
                instance,
                tokens,
                dst,
                slot,
                n,
                tenant,
                release,
            )
        except Exception as e:  # noqa: BLE001 - this rank's request fails; nothing was asked
            self.emit(
                "event",
                "state",
                room,
                int(KVPoll.Failed),
                f"{getattr(e, 'kind', 'error')}: {e}",
                {},
            )
            release()
            return
        self._track(room, rx, "receiver")
