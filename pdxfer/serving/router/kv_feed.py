"""The router's subscriptions to its workers' KV event streams, feeding one ``KvIndex`` per
block size.

Per worker a ZMQ SUB socket; each frame is bounded and decoded (``kv_events``) and queued;
one applier takes all queued frames as a burst (``KvIndex.ingest``), in sequence order per
worker. A gap (a sequence number skipped) asks the worker's replay endpoint for
the missing batches; a worker whose numbers go back (it restarted) or whose gap the replay
cannot fill (none, or its buffer moved on) has its entries cleared and is indexed again from
that frame on: what the index says a worker holds is then a subset of what it holds, never
more. While a replay is under way the worker is not ``synced`` and the router falls back to
its own history for it. A feed whose worker contradicts it (``kv_stale``) is ``suspect``:
cleared, not synced, its subscription opened again and a replay asked for; the next frame
in sequence (replayed or live) syncs it again.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import zmq
import zmq.asyncio

from ..kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BadFrame,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    RawBatch,
    RawStored,
    parse_frame,
)
from .kv_index import KvIndex, Op, warm
from .u64map import slots_for

log = logging.getLogger(__name__)
REPLAY_TIMEOUT_S = 2.0
MAX_REPLAY_FRAMES = 100_000
MAX_INBOX = 50_000
"""Frames decoded and waiting for the applier; the sockets wait past this."""
_CLEARED = KVEventBatch(0.0, [AllBlocksCleared()])
Frames = list[tuple[int, KVEventBatch | RawBatch]]
"""Replayed frames: (sequence number, batch), ascending."""
FEED_COUNTERS = (
    "batches",
    "blocks",
    "gaps",
    "resets",
    "replays",
    "replayed",
    "bad_frames",
    "misses",
    "unpublished",
    "stale",
)
"""What ``/metrics`` shows per worker's feed (``kv_feed_*{worker=URL}``)."""


def _run_from(
    frames: Sequence[tuple[int, KVEventBatch | RawBatch]], start: int, upto: int | None = None
) -> Frames | None:
    """The replayed frames from ``start`` on (and below ``upto``, reaching ``upto - 1``),
    if they follow on without a hole; None otherwise."""
    got = [(s, b) for s, b in frames if start <= s and (upto is None or s < upto)]
    if not got or got[0][0] != start or any(b[0] != a[0] + 1 for a, b in zip(got, got[1:])):
        return None
    return got if upto is None or got[-1][0] == upto - 1 else None


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
        if (
            not sep
            or not worker.startswith("http")
            or not 1 <= len(eps) <= 2
            or not all(e.startswith(("tcp://", "ipc://")) for e in eps)
        ):
            raise ValueError(
                f"--kv-events wants WORKER_URL=tcp://HOST:PORT[,tcp://HOST:PORT] "
                f"(events, replay), got {spec!r}"
            )
        return cls(worker.rstrip("/"), eps[0], eps[1] if len(eps) == 2 else None)

    def rank(self, r: int) -> FeedSpec:
        """Where data-parallel rank ``r`` of this worker publishes: vLLM offsets each rank's
        TCP ports by its rank (``tcp://*:5557`` -> rank 1 on 5558, its replay likewise);
        the feed is ``WORKER#dpR``, the router's record of that rank."""
        return FeedSpec(
            f"{self.worker}#dp{r}",
            _offset(self.endpoint, r),
            _offset(self.replay, r) if self.replay else None,
            self.topic,
        )


def _offset(endpoint: str, r: int) -> str:
    """vLLM's endpoint of data-parallel rank ``r`` (``ZmqEventPublisher``'s port offset;
    an endpoint without a port number gets the ``_dpR`` suffix vLLM gives in-process ones)."""
    base, sep, port = endpoint.rpartition(":")
    if r == 0:
        return endpoint
    if endpoint.startswith("tcp://") and sep and port.isdigit() and int(port):
        return f"{base}:{int(port) + r}"
    return f"{endpoint}_dp{r}"


@dataclass(slots=True)
class FeedState:
    spec: FeedSpec
    next_seq: int | None = None
    synced: bool = False
    counters: collections.Counter[str] = field(default_factory=collections.Counter)


class KvFeeds:
    """The index, and the workers feeding it."""

    def __init__(self, specs: Sequence[FeedSpec] = (), index_blocks: int = 0) -> None:
        """``index_blocks``: the (worker, block) pairs each index is sized for up front (the
        fleet's KV cache blocks), so it does not grow while they stream in; 0: it starts
        small and grows (either way it grows past that when it must)."""
        if index_blocks < 0:
            raise ValueError(f"index_blocks {index_blocks}: 0 or more")
        self.indexes: dict[int, KvIndex] = {}
        self.index_slots = max(1024, slots_for(index_blocks))
        self.feeds = {s.worker: FeedState(s) for s in specs}
        self._given = {s.worker: s for s in specs}
        """Each worker's feed as given (``ranks`` splits it per data-parallel rank)."""
        if specs:
            warm()
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._subs: dict[str, asyncio.Task[None]] = {}
        self._bg: set[asyncio.Task[None]] = set()
        self._inbox: list[tuple[FeedState, int, KVEventBatch | RawBatch]] = []
        self._wake = asyncio.Event()

    # -- what the policy reads ----------------------------------------------------------------
    def synced(self, worker: str) -> bool:
        f = self.feeds.get(worker)
        return f is not None and f.synced

    def mark(self, worker: str) -> int | None:
        """The batches the worker's feed has applied, if it is in sync (None otherwise):
        taken at a choice, a later mark tells whether its events moved since."""
        f = self.feeds.get(worker)
        return f.counters["batches"] if f is not None and f.synced else None

    def cached(self, ids: Sequence[int], salt: str | None = None) -> dict[str, int]:
        """Per synced worker: the leading tokens of ``ids`` it holds (absent: none)."""
        out: dict[str, int] = {}
        for n, ws in self.cached_groups(ids, salt):
            for w in ws:
                out[w] = max(out.get(w, 0), n)
        return out

    def cached_groups(
        self, ids: Sequence[int], salt: str | None = None
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

    def block_size(self) -> int | None:
        """The block size the events use (the smallest, if workers differ; None: no events
        yet)."""
        return min(self.indexes) if self.indexes else None

    def per_worker(self) -> dict[str, dict[str, int]]:
        """Per worker: whether its feed is in sync and its counters (``blocks``: the blocks
        its events stored and removed in the index), for ``/metrics`` labelled by worker."""
        return {
            w: {
                "kv_feed_synced": int(f.synced),
                **{f"kv_feed_{k}": f.counters[k] for k in FEED_COUNTERS},
            }
            for w, f in self.feeds.items()
        }

    def forget(self, worker: str) -> None:
        """The worker is down or restarted: it holds nothing we know of."""
        for ix in self.indexes.values():
            ix.cleared(worker)

    def suspect(self, worker: str, why: str, clear: bool = True) -> None:
        """The worker's feed is stale: not trusted until it resynchronises (its
        subscription reopened, its replay asked for what followed). ``clear``: its entries
        are wrong (it held less than they said), so they go too; a feed that was only
        silent keeps them (a frame lost meanwhile shows as a gap when the next one comes)."""
        f = self.feeds[worker]
        log.warning(
            "kv events of %s: out of sync (%s); history decides until it resyncs", worker, why
        )
        f.counters["stale"] += 1
        if clear:
            self.forget(worker)
        f.synced = False
        if self._ctx is not None:
            t = asyncio.ensure_future(self._resync(f))
            self._bg.add(t)
            t.add_done_callback(self._bg.discard)

    def refill(self, f: FeedState, frames: Sequence[tuple[int, KVEventBatch | RawBatch]]) -> bool:
        """A suspect feed's replayed frames from ``f.next_seq`` on, applied when they follow
        on without a hole (onto its entries as they are: cleared, or kept for a feed that was
        only silent); whether the feed is in sync again."""
        got = None if f.synced or f.next_seq is None else _run_from(frames, f.next_seq)
        if got is None:
            return f.synced
        self._replayed(f, got)
        return True

    def ranks(self, worker: str, n: int) -> None:
        """``worker`` runs ``n`` data-parallel ranks, each publishing its own events (vLLM's
        ports: ``FeedSpec.rank``): its feed becomes one per rank, ``WORKER#dpR``, as the
        router's records of it are (one feed ``WORKER`` again for ``n`` 1). Feeds it no
        longer has are closed and their entries forgotten; new ones subscribe at once."""
        given = self._given.get(worker)
        if given is None:
            return
        want = {worker: given} if n == 1 else {s.worker: s for s in map(given.rank, range(n))}
        mine = [w for w in self.feeds if w == worker or w.startswith(f"{worker}#dp")]
        if sorted(mine) == sorted(want):
            return
        for w in mine:
            if w not in want:
                self.forget(w)
                del self.feeds[w]
                sub = self._subs.pop(w, None)
                if sub is not None:
                    sub.cancel()
        for w, spec in want.items():
            if w not in self.feeds:
                f = self.feeds[w] = FeedState(spec)
                if self._ctx is not None:
                    self._subs[w] = asyncio.ensure_future(self._run(f))
        log.info("kv events of %s: one feed per DP rank, %s", worker, sorted(want))

    # -- applying events ----------------------------------------------------------------------
    def _index(self, bs: int) -> KvIndex:
        ix = self.indexes.get(bs)
        if ix is None:
            ix = self.indexes[bs] = KvIndex(bs, self.index_slots)
        return ix

    def apply(self, worker: str, batch: KVEventBatch | RawBatch) -> int:
        """Apply one batch; returns the blocks stored and removed."""
        return self.apply_many([(worker, batch)]).get(worker, 0)

    def apply_many(self, items: Sequence[tuple[str, KVEventBatch | RawBatch]]) -> dict[str, int]:
        """Many workers' batches in one pass per index (each worker's events in order);
        returns per worker the blocks stored and removed."""
        ops: dict[int, list[Op]] = {bs: [] for bs in self.indexes}
        for worker, batch in items:
            ids: dict[int, int] = {}  # per block size, this worker's id in its index
            for ev in batch.events:
                if isinstance(ev, (RawStored, BlockStored)):
                    if ev.group_idx not in (None, 0) or ev.medium not in (None, "GPU"):
                        continue
                    bs = ev.block_size
                    w = ids.get(bs)
                    if w is None:
                        w = ids[bs] = self._index(bs).worker(worker)
                        ops.setdefault(bs, [])
                    ops[bs].append(
                        ("s", w, ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.extra_keys)
                    )
                elif isinstance(ev, BlockRemoved):
                    if ev.group_idx not in (None, 0) or ev.medium not in (None, "GPU"):
                        continue
                    for bs, ix in self.indexes.items():
                        ops[bs].append(("r", ix.worker(worker), ev.block_hashes))
                elif isinstance(ev, AllBlocksCleared):
                    for bs, ix in self.indexes.items():
                        ops[bs].append(("c", ix.worker(worker)))
        out: dict[str, int] = {}
        for bs, todo in ops.items():
            if not todo:
                continue
            ix = self.indexes[bs]
            counts = ix.ingest(todo)
            for w in np.flatnonzero(counts).tolist():
                out[ix.names[w]] = out.get(ix.names[w], 0) + int(counts[w])
        return out

    def _sequence(self, f: FeedState, seq: int) -> str:
        """Where a live frame stands: ``apply``, ``reset`` (apply after clearing the
        worker), ``dup`` or ``gap`` (the caller replays from ``f.next_seq``)."""
        if f.next_seq is not None and seq < f.next_seq:
            if seq == 0 or not f.synced:
                log.info(
                    "kv events of %s: its sequence went back; its entries are cleared",
                    f.spec.worker,
                )
                f.counters["resets"] += 1
                return "reset"
            f.counters["duplicates"] += 1
            return "dup"
        if f.next_seq is not None and seq > f.next_seq:
            f.counters["gaps"] += 1
            return "gap"
        if f.next_seq is None and seq > 0 and f.spec.replay:
            f.next_seq = 0
            return "gap"  # joined late: fetch what the replay buffer still has
        return "apply"

    def on_frame(self, f: FeedState, seq: int, batch: KVEventBatch | RawBatch) -> str:
        """One live frame, in order: ``apply``, ``dup``, or ``gap`` (the caller then replays
        from ``f.next_seq`` or calls ``restart``)."""
        a = self._sequence(f, seq)
        if a == "reset":
            self.forget(f.spec.worker)
            a = "apply"
        if a == "apply":
            self._take(f, seq, batch)
        return a

    def on_frames(
        self, frames: Sequence[tuple[FeedState, int, KVEventBatch | RawBatch]]
    ) -> list[tuple[FeedState, int, KVEventBatch | RawBatch, bool]]:
        """Live frames in arrival order: those in sequence applied as one burst. Returns
        the rest, in order, for one at a time: a worker's gap (flagged: replay it) and its
        frames after the gap."""
        burst: list[tuple[str, KVEventBatch | RawBatch]] = []
        rest: list[tuple[FeedState, int, KVEventBatch | RawBatch, bool]] = []
        held: set[str] = set()
        for f, seq, batch in frames:
            w = f.spec.worker
            if self.feeds.get(w) is not f:
                continue  # its feed was closed since (``ranks``)
            if w in held:
                rest.append((f, seq, batch, False))
                continue
            a = self._sequence(f, seq)
            if a == "gap":
                held.add(w)
                rest.append((f, seq, batch, True))
                continue
            if a == "dup":
                continue
            if a == "reset":
                burst.append((w, _CLEARED))
            burst.append((w, batch))
            f.counters["batches"] += 1
            f.next_seq, f.synced = seq + 1, True
        for w, n in self.apply_many(burst).items():
            self.feeds[w].counters["blocks"] += n
        return rest

    def _take(self, f: FeedState, seq: int, batch: KVEventBatch | RawBatch) -> None:
        f.counters["blocks"] += self.apply(f.spec.worker, batch)
        f.counters["batches"] += 1
        f.next_seq, f.synced = seq + 1, True

    def restart(self, f: FeedState, why: str) -> None:
        log.info("kv events of %s: %s; its entries are cleared", f.spec.worker, why)
        f.counters["resets"] += 1
        self.forget(f.spec.worker)
        f.next_seq, f.synced = None, True

    def fill(
        self,
        f: FeedState,
        frames: list[tuple[int, KVEventBatch | RawBatch]],
        upto: int,
        batch: KVEventBatch | RawBatch,
    ) -> None:
        """Frames from the replay (ascending) to close the gap before live frame ``upto``."""
        got = None if f.next_seq is None else _run_from(frames, f.next_seq, upto)
        if got is None:
            self.restart(f, "a gap the replay could not fill")
        else:
            self._replayed(f, got)
        self._take(f, upto, batch)

    def _replayed(self, f: FeedState, got: Frames) -> None:
        f.counters["replayed"] += len(got)
        for s, b in got:
            self._take(f, s, b)

    # -- the sockets ----------------------------------------------------------------------------
    def start(self) -> None:
        self._ctx = zmq.asyncio.Context.instance()
        self._wake = asyncio.Event()
        self._subs = {w: asyncio.ensure_future(self._run(f)) for w, f in self.feeds.items()}
        self._tasks = [asyncio.ensure_future(self._applier())]

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._subs.values(), *self._bg]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _resync(self, f: FeedState) -> None:
        """A suspect feed: its subscription opened again (one may die silently) and its
        replay, where it has one, asked for what followed the last frame applied."""
        w = f.spec.worker
        old = self._subs.get(w)
        if old is not None:
            old.cancel()
            await asyncio.gather(old, return_exceptions=True)
        self._subs[w] = asyncio.ensure_future(self._run(f))
        if f.spec.replay and f.next_seq is not None and not f.synced:
            self.refill(f, await self._replay(f, f.next_seq))

    async def _run(self, f: FeedState) -> None:
        """One worker's socket: frames bounded, decoded, and queued for the applier."""
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
                    seq, batch = parse_frame(parts, raw=True)
                except BadFrame as e:
                    f.counters["bad_frames"] += 1
                    log.warning("kv events of %s: a bad frame dropped: %s", f.spec.worker, e)
                    continue
                if batch is None:
                    continue
                while len(self._inbox) >= MAX_INBOX:
                    await asyncio.sleep(0.005)
                self._inbox.append((f, seq, batch))
                self._wake.set()
        finally:
            sub.close(0)

    async def _applier(self) -> None:
        """All the frames queued since it last ran, applied as one burst; gaps after."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            frames, self._inbox = self._inbox, []
            try:
                rest = self.on_frames(frames)
            except Exception:  # noqa: BLE001 - one bad batch must not end the feeds
                log.exception("kv events: a burst of %d frames failed", len(frames))
                for f in {id(x[0]): x[0] for x in frames}.values():
                    f.counters["bad_frames"] += 1
                    self.restart(f, "a batch it could not apply")
                continue
            for f, seq, batch, gap in rest:
                try:
                    await (self._gap(f, seq, batch) if gap else self._frame(f, seq, batch))
                except Exception:  # noqa: BLE001
                    f.counters["bad_frames"] += 1
                    log.exception("kv events of %s: a batch failed", f.spec.worker)
                    self.restart(f, "a batch it could not apply")

    async def _frame(self, f: FeedState, seq: int, batch: KVEventBatch | RawBatch) -> None:
        if self.on_frame(f, seq, batch) == "gap":
            await self._gap(f, seq, batch)

    async def _gap(self, f: FeedState, seq: int, batch: KVEventBatch | RawBatch) -> None:
        """Live frame ``seq`` after a gap from ``f.next_seq``: replay, else restart."""
        if not f.spec.replay:
            self.restart(f, "a gap and no replay endpoint")
            self._take(f, seq, batch)
            return
        f.synced = False
        self.fill(f, await self._replay(f, f.next_seq or 0), seq, batch)

    async def _replay(self, f: FeedState, start: int) -> list[tuple[int, KVEventBatch | RawBatch]]:
        """The replay buffer's frames from ``start`` on ([] when it does not answer)."""
        assert self._ctx is not None and f.spec.replay
        f.counters["replays"] += 1
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        out: list[tuple[int, KVEventBatch | RawBatch]] = []
        try:
            sock.connect(f.spec.replay)
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            while len(out) < MAX_REPLAY_FRAMES:
                parts = await asyncio.wait_for(sock.recv_multipart(), REPLAY_TIMEOUT_S)
                if len(parts) == 4 and parts[2] == END_SEQ:
                    return out
                try:
                    seq, batch = parse_frame(parts[1:], raw=True)
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
