"""The router's subscriptions to its workers' KV event streams, feeding one ``KvIndex`` per
block size.

Per worker a ZMQ SUB socket; each frame is bounded and decoded (``kv_events``), then applied
in sequence order. A gap (a sequence number skipped) asks the worker's replay endpoint for
the missing batches; a worker whose numbers go back (it restarted) or whose gap the replay
cannot fill (none, or its buffer moved on) has its entries cleared and is indexed again from
that frame on: what the index says a worker holds is then a subset of what it holds, never
more. While a replay is under way the worker is not ``synced`` and the router falls back to
its own history for it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from ..kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BadFrame,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    parse_frame,
)
from .kv_index import KvIndex

log = logging.getLogger("pdxfer.serving.router.kv")
REPLAY_TIMEOUT_S = 2.0
MAX_REPLAY_FRAMES = 100_000


@dataclass(frozen=True, slots=True)
class FeedSpec:
    """Where a worker publishes: ``--kv-events WORKER_URL=ENDPOINT[,REPLAY_ENDPOINT]``."""

    worker: str
    endpoint: str
    replay: str | None = None
    topic: str = ""

    @classmethod
    def parse(cls, spec: str) -> FeedSpec:
        worker, sep, rest = spec.partition("=")
        eps = rest.split(",")
        if not sep or not worker.startswith("http") or not 1 <= len(eps) <= 2 or not all(
                e.startswith(("tcp://", "ipc://")) for e in eps):
            raise ValueError(f"--kv-events wants WORKER_URL=tcp://HOST:PORT[,tcp://HOST:PORT] "
                             f"(events, replay), got {spec!r}")
        return cls(worker.rstrip("/"), eps[0], eps[1] if len(eps) == 2 else None)


@dataclass(slots=True)
class FeedState:
    spec: FeedSpec
    next_seq: int | None = None
    synced: bool = False
    counters: collections.Counter[str] = field(default_factory=collections.Counter)


class KvFeeds:
    """The index, and the workers feeding it."""

    def __init__(self, specs: Sequence[FeedSpec] = ()) -> None:
        self.indexes: dict[int, KvIndex] = {}
        self.feeds = {s.worker: FeedState(s) for s in specs}
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- what the policy reads ----------------------------------------------------------------
    def synced(self, worker: str) -> bool:
        f = self.feeds.get(worker)
        return f is not None and f.synced

    def cached(self, ids: Sequence[int], salt: str | None = None) -> dict[str, int]:
        """Per synced worker: the leading tokens of ``ids`` it holds (absent: none)."""
        out: dict[str, int] = {}
        for n, ws in self.cached_groups(ids, salt):
            for w in ws:
                out[w] = max(out.get(w, 0), n)
        return out

    def cached_groups(self, ids: Sequence[int], salt: str | None = None
                      ) -> list[tuple[int, list[str]]]:
        """Synced workers holding leading tokens of ``ids``, grouped by how many."""
        feeds = self.feeds
        out = []
        for ix in self.indexes.values():
            for n, ws in ix.cached_groups(ids, salt):
                ws = [w for w in ws if (f := feeds.get(w)) is not None and f.synced]
                if ws:
                    out.append((n, ws))
        return out

    def forget(self, worker: str) -> None:
        """The worker is down or restarted: it holds nothing we know of."""
        for ix in self.indexes.values():
            ix.cleared(worker)

    # -- applying events ----------------------------------------------------------------------
    def apply(self, worker: str, batch: KVEventBatch) -> int:
        """Apply one batch; returns the blocks stored and removed. Consecutive stores of one
        block size go to the index together (one vectorized pass)."""
        n = 0
        run: list[BlockStored] = []

        def flush() -> int:
            if not run:
                return 0
            bs = run[0].block_size
            ix = self.indexes.get(bs)
            if ix is None:
                ix = self.indexes[bs] = KvIndex(bs)
            got = ix.stored_many(worker, [(e.block_hashes, e.parent_block_hash, e.token_ids,
                                           e.extra_keys) for e in run])
            run.clear()
            return got

        for ev in batch.events:
            if isinstance(ev, BlockStored):
                if ev.group_idx not in (None, 0) or ev.medium not in (None, "GPU"):
                    continue
                if run and run[0].block_size != ev.block_size:
                    n += flush()
                run.append(ev)
                continue
            n += flush()
            if isinstance(ev, BlockRemoved):
                if ev.group_idx not in (None, 0) or ev.medium not in (None, "GPU"):
                    continue
                for ix in self.indexes.values():
                    n += ix.removed(worker, ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.forget(worker)
        return n + flush()

    def on_frame(self, f: FeedState, seq: int, batch: KVEventBatch) -> str:
        """One live frame, in order: ``apply``, ``dup``, or ``gap`` (the caller then replays
        from ``f.next_seq`` or calls ``restart``)."""
        if f.next_seq is not None and seq < f.next_seq:
            if seq == 0 or not f.synced:
                self.restart(f, "its sequence went back")
            else:
                f.counters["duplicates"] += 1
                return "dup"
        elif f.next_seq is not None and seq > f.next_seq:
            f.counters["gaps"] += 1
            return "gap"
        elif f.next_seq is None and seq > 0 and f.spec.replay:
            f.next_seq = 0
            return "gap"  # joined late: fetch what the replay buffer still has
        self._take(f, seq, batch)
        return "apply"

    def _take(self, f: FeedState, seq: int, batch: KVEventBatch) -> None:
        f.counters["blocks"] += self.apply(f.spec.worker, batch)
        f.counters["batches"] += 1
        f.next_seq, f.synced = seq + 1, True

    def restart(self, f: FeedState, why: str) -> None:
        log.info("kv events of %s: %s; its entries are cleared", f.spec.worker, why)
        f.counters["resets"] += 1
        self.forget(f.spec.worker)
        f.next_seq, f.synced = None, True

    def fill(self, f: FeedState, frames: list[tuple[int, KVEventBatch]], upto: int,
             batch: KVEventBatch) -> None:
        """Frames from the replay (ascending) to close the gap before live frame ``upto``."""
        want = f.next_seq
        got = [(s, b) for s, b in frames if want is not None and want <= s < upto]
        if want is None or not got or got[0][0] != want or any(
                b[0] != a[0] + 1 for a, b in zip(got, got[1:])) or got[-1][0] != upto - 1:
            self.restart(f, "a gap the replay could not fill")
        else:
            f.counters["replayed"] += len(got)
            for s, b in got:
                self._take(f, s, b)
        self._take(f, upto, batch)

    # -- the sockets ----------------------------------------------------------------------------
    def start(self) -> None:
        self._ctx = zmq.asyncio.Context.instance()
        self._tasks = [asyncio.ensure_future(self._run(f)) for f in self.feeds.values()]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run(self, f: FeedState) -> None:
        assert self._ctx is not None
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        sub.setsockopt(zmq.SUBSCRIBE, f.spec.topic.encode())
        sub.connect(f.spec.endpoint)
        try:
            while True:
                parts = await sub.recv_multipart()
                try:
                    seq, batch = parse_frame(parts)
                except BadFrame as e:
                    f.counters["bad_frames"] += 1
                    log.warning("kv events of %s: a bad frame dropped: %s", f.spec.worker, e)
                    continue
                if batch is None:
                    continue
                try:
                    await self._frame(f, seq, batch)
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - one bad batch must not end the feed
                    f.counters["bad_frames"] += 1
                    log.exception("kv events of %s: a batch failed", f.spec.worker)
                    self.restart(f, "a batch it could not apply")
        finally:
            sub.close(0)

    async def _frame(self, f: FeedState, seq: int, batch: KVEventBatch) -> None:
        if self.on_frame(f, seq, batch) != "gap":
            return
        if not f.spec.replay:
            self.restart(f, "a gap and no replay endpoint")
            self._take(f, seq, batch)
            return
        f.synced = False
        self.fill(f, await self._replay(f, f.next_seq or 0), seq, batch)

    async def _replay(self, f: FeedState, start: int) -> list[tuple[int, KVEventBatch]]:
        """The replay buffer's frames from ``start`` on ([] when it does not answer)."""
        assert self._ctx is not None and f.spec.replay
        f.counters["replays"] += 1
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        out: list[tuple[int, KVEventBatch]] = []
        try:
            sock.connect(f.spec.replay)
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            while len(out) < MAX_REPLAY_FRAMES:
                parts = await asyncio.wait_for(sock.recv_multipart(), REPLAY_TIMEOUT_S)
                if len(parts) == 4 and parts[2] == END_SEQ:
                    return out
                try:
                    seq, batch = parse_frame(parts[1:])
                except BadFrame:
                    f.counters["bad_frames"] += 1
                    return []
                if batch is not None:
                    out.append((seq, batch))
        except asyncio.TimeoutError:
            log.warning("kv events of %s: the replay did not answer", f.spec.worker)
        finally:
            sock.close(0)
        return out if len(out) < MAX_REPLAY_FRAMES else []
