"""Prefill side: the writes. Each chunk a target has not been given is planned (``plan.chunk``),
digested for the integrity check, written (started in ``send()`` when small, else on the
room's worker) and finally answered with the target's one terminal message.

A room's writes, its ``TransferDone`` and its ``AbortAck`` all run on one worker thread, in
order (``control.Workers``): a terminal message queued behind the room's writes is sent only
after they returned, which is what lets the decode free its pages without a late write.
``Writer`` changes rooms only through the two callbacks ``PrefillSide`` hands it (``fail``,
``ended``), and holds terminal messages back through the ``Settler`` while a failed write
to their decode may still land.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import integrity as I
from .. import plan as P
from .. import wire
from ..config import knobs
from ..errors import PdxferError, PlanError, TransportError
from ..plan import chunk as C
from ..plan.pack import Pack
from ..plan.pieces import spans as piece_spans
from ..plan.pieces import written_ranges
from ..transport.base import Started
from .handles import KVPoll
from .pack import Packer, staging_for
from .sender_rooms import Chunk, SenderRoom, Slot, Target, decodes, sliced
from .settler import Settler
from .staging import Staging, bounce

if TYPE_CHECKING:
    from .core import Core

log = logging.getLogger(__name__)


class Writer:
    """Plans, starts and awaits a prefill rank's writes and sends each target's terminal
    message. ``fail(room, err)`` fails a room; ``ended(room)`` is called (under the lock)
    when every target of a room finished, to take it out of the table or hold it."""

    def __init__(
        self,
        ep: Core,
        settler: Settler,
        fail: Callable[[SenderRoom, PdxferError], None],
        ended: Callable[[SenderRoom], None],
    ) -> None:
        self.ep = ep
        self.cfg = ep.config
        self.settler = settler
        self._fail = fail
        self._ended = ended
        self.page_sizes = {p.name: p.page_size for p in ep.pools}
        host = all(p.location == "cpu" for p in ep.pools)
        n = Staging.wanted(ep.pools) if host and knobs().gather else 0
        self.staging = Staging(n) if n else None  # gathers head slices into few big writes
        if self.staging is not None:
            ep.transport.register(self.staging.addr, n, "cpu")
        ps = staging_for(ep.pools, self.cfg.limits.pack)  # gathers packed requests' rows
        self.packer = Packer(ps) if ps is not None else None
        if ps is not None:
            ep.transport.register(ps.addr, ps.nbytes, ps.location)

    def pump(self, st: SenderRoom, start: bool = False) -> list[Slot]:
        """Queue every chunk each target has not been given yet (called under the lock).

        ``start`` (the engine's ``send()``): a small chunk's write is to be started by the
        caller once it has released the lock (``start_slots``) and only awaited on the
        worker; the returned slots say which. Either way the room's jobs are queued here, in
        order, on its worker, so a terminal message queued later still runs after every
        write has returned.

        Nothing that may wait on a peer runs under the lock: a transport's ``start`` may (the
        first write to a peer can open its connection; under load, add the caller's turns at
        the CPU), and every thread that needs the lock, the control thread's Hello handler
        among them, would wait with it. On the control thread (a request for chunks already
        given) nothing is started: the room's worker writes."""
        slots: list[Slot] = []
        for t in st.targets:
            while t.scheduled < len(st.chunks):
                ci = t.scheduled
                t.scheduled += 1
                if start and self._startable(st, t, ci):
                    slot = Slot(st, t, ci)
                    slots.append(slot)
                    self.ep.workers.submit(st.room, functools.partial(self._slotted, slot))
                else:
                    self.ep.workers.submit(st.room, functools.partial(self._write, st, t, ci))
        return slots

    def start_slots(self, slots: list[Slot]) -> None:
        """Start the writes ``pump`` left to the caller (after the lock is released); each
        slot's worker job waits for its outcome, so it is always given one."""
        try:
            for s in slots:
                s.job = self._start(s.st, s.t, s.ci)
                s.ready.set()
        finally:
            for s in slots:  # whatever escaped: no worker waits for a start that never comes
                s.ready.set()

    def _slotted(self, s: Slot) -> None:
        """A slot's worker job: await the write its caller started, else write it here."""
        s.ready.wait()
        if s.job is not None:
            s.job()
        else:
            self._write(s.st, s.t, s.ci)

    def _startable(self, st: SenderRoom, t: Target, ci: int) -> bool:
        """Whether a chunk is small enough to start in ``send()`` (``_start`` decides)."""
        chunk = st.chunks[ci]
        pages = sum(a.size for a in chunk.pages.values())
        return not (
            not self.cfg.limits.start_in_send
            or st.state == KVPoll.Failed
            or t.finished
            or t.req.silent
            or pages > P.FEW_PAGES
            or bool(t.req.pack)
            # more entries than one batch at most (no merged runs): not worth planning
            or pages * sum(len(pr) for pr in t.peer.pairings.values())
            > self.ep.transport.batch_entries
            or (self.staging is not None and sliced(t))
        )

    def _start(self, st: SenderRoom, t: Target, ci: int) -> Callable[[], None] | None:
        """Plan a small chunk and start its write now (the lock not held), returning the
        worker job that awaits it; None to leave the whole write to the worker (a room that
        failed or is late meanwhile, or the transport cannot start it at once)."""
        chunk = st.chunks[ci]
        if st.state == KVPoll.Failed or t.finished or time.monotonic() > st.deadline:
            return None
        t0 = time.perf_counter()
        try:
            blocks = self._plan(t, chunk, st.cursor)
            if isinstance(blocks, str) or not len(blocks):
                return None  # the worker fails it (or just finishes) on the usual path
            ts = time.perf_counter()
            started = self.ep.transport.start(t.peer.session, *blocks.lists(), tag=st.room)
            self.ep.gauge_max("start_max_ms", (time.perf_counter() - ts) * 1e3)
        except Exception:  # noqa: BLE001 - a bug must not escape into the engine's send()
            log.exception("room %d: starting a write in send() failed", st.room)
            return None  # the worker plans again and fails the room with the reason
        if started is None:
            chunk.plans[t] = blocks  # the worker writes it without planning again
            return None
        self.ep.count("started_writes")
        return lambda: self._await(st, t, chunk, blocks, started, t0)

    def _await(
        self, st: SenderRoom, t: Target, chunk: Chunk, blocks: P.Blocks, started: Started, t0: float
    ) -> None:
        """The worker's half of a started write: wait for it (even if the room failed
        meanwhile: the write is in flight and must drain), then as ``_write``. The success
        message of a last chunk is encoded while the write runs, off the request's path."""
        frame = None
        self._digest(t, chunk)  # while the write runs
        if chunk.last and not t.aborted:
            frame = wire.encode(
                wire.TransferDone(
                    room=st.room,
                    nonce=t.req.nonce,
                    endpoint_id=self.ep.endpoint_id,
                    rank=self.cfg.tp_rank,
                    ok=True,
                    bytes=t.bytes + blocks.total_bytes,
                    blocks=t.blocks + len(blocks),
                    seconds=t.seconds + time.perf_counter() - t0,
                    digests=tuple(t.digests),
                )
            )
        try:
            self.ep.transport.finish(t.peer.session, started)
        except TransportError as e:
            self._write_failed(st, t, e)
            return
        self._wrote(st, t, chunk, blocks, len(blocks), t0, started.submitted, frame)

    def _digest(self, t: Target, chunk: Chunk) -> None:
        """Digest what this chunk writes to ``t``, in the mode its decode asked for (over the
        source pages, in logical order: ``integrity.py``). A digest that cannot be taken is
        logged and left out: the write goes on, and the decode fails the request for the
        range no digest covers (rather than this worker dying mid-room)."""
        mode = t.req.integrity
        if mode == "off" or t.req.silent:
            return
        try:
            self._digest_chunk(t, chunk, mode)
        except Exception:  # noqa: BLE001 - e.g. a device the portable digest cannot read
            self.ep.count("integrity_digest_errors")
            log.exception(
                "room %d: cannot digest what is sent to decode %s (integrity=%s; "
                "the decode will fail the request; integrity='off' on the decode "
                "turns the check off)",
                t.req.room,
                t.peer.endpoint_id,
                mode,
            )

    def _digest_chunk(self, t: Target, chunk: Chunk, mode: str) -> None:
        t0 = time.perf_counter()
        n = nb = 0
        ask = C.ask_of(t.req, t.dst)
        pairings = t.peer.layer_pairings(chunk.layers)
        l0, l1 = chunk.layers or (0, 0)
        for w in C.written(ask, pairings, chunk.pages, chunk.first, self.page_sizes, chunk.span):
            pr = pairings[w.pool]
            if not (I.supported(pr.src.location) and I.supported(pr.dst.location)):
                continue  # memory that cannot be digested (the decode does not expect it)
            span = I.Span(w.pages, w.first, w.start, w.end, w.lo, w.hi)
            vals = I.digests(
                pr.src,
                span,
                mode,
                I.sample_stride(pr.src, pr.dst),
                portable=I.portable(pr.src, pr.dst),
            )
            t.digests.append(wire.Digest(w.pool, w.start, w.end, w.lo, w.hi, tuple(vals), l0, l1))
            n += len(vals)
            nb += vals.nbytes
        if chunk.last:
            for name, _ in t.req.slots.items():
                spr = t.peer.pairings.get(name)
                sslot = chunk.slots.get(name)
                if (
                    spr is None
                    or name in t.req.skip
                    or sslot is None
                    or not (I.supported(spr.src.location) and I.supported(spr.dst.location))
                ):
                    continue
                r = written_ranges(spr.src, spr.dst, t.req.pieces.get(name))
                vals = I.slot_digests(
                    spr.src,
                    int(sslot),
                    mode,
                    portable=I.portable(spr.src, spr.dst),
                    spans=None if r is None else piece_spans(spr.src, r),
                )
                t.digests.append(wire.Digest(name, 0, 0, 0, 0, tuple(vals)))
                n += len(vals)
                nb += vals.nbytes
        self.ep.count("integrity_digests", n)
        self.ep.count("integrity_bytes", nb)
        self.ep.count("integrity_seconds", time.perf_counter() - t0)

    def _plan(
        self, t: Target, chunk: Chunk, cursor: dict[str, int], packs: list[Pack] | None = None
    ) -> P.Blocks | str:
        return C.plan_chunk(
            C.ask_of(t.req, t.dst),
            t.peer.layer_pairings(chunk.layers),
            chunk.pages,
            chunk.first,
            chunk.slots,
            chunk.last,
            cursor,
            self.page_sizes,
            self.ep.regions,
            t.peer.regions,
            chunk.span,
            packs,
        )

    def _write(self, st: SenderRoom, t: Target, ci: int) -> None:
        if st.state == KVPoll.Failed or t.finished:
            return
        chunk = st.chunks[ci]
        if t.req.silent:  # another rank writes everything this decode rank needs
            if chunk.last:
                self.finish(st, t, True, None)
            return
        t0 = time.perf_counter()
        packs: list[Pack] | None = [] if t.req.pack and self.packer is not None else None
        blocks = chunk.plans.pop(t, None) or self._plan(t, chunk, st.cursor, packs)
        if isinstance(blocks, str):
            self._fail(st, PlanError(blocks))
            self.finish(st, t, False, st.failure)
            return
        self._digest(t, chunk)
        packed = (0, 0)
        if packs:
            got = self._write_packed(st, t, packs)
            if got is None:
                return
            packed = got
        gathered = bounce(blocks, self.staging) if self.staging is not None and sliced(t) else None
        wire_blocks = gathered.blocks if gathered is not None else blocks
        if gathered is not None:
            self.ep.count("gathered_writes")
        tw = time.perf_counter()
        try:
            self.ep.transport.write(
                t.peer.session,
                *wire_blocks.lists(),
                deadline=st.deadline,
                should_stop=lambda: st.state == KVPoll.Failed,
                tag=st.room,
            )
        except TransportError as e:
            self._write_failed(st, t, e)
            return
        finally:
            if gathered is not None:
                self.staging.release(gathered.addr, gathered.nbytes)  # type: ignore[union-attr]
        self._wrote(st, t, chunk, blocks, len(wire_blocks) + packed[1], t0, tw, packed=packed[0])

    def _write_packed(self, st: SenderRoom, t: Target, packs: list[Pack]) -> tuple[int, int] | None:
        """Write a chunk's packed pools into the decode's leases: gathered into the pack
        staging piece by piece (``pack.py``), else straight from the pages. ``(bytes,
        entries)`` written, or None when a write failed (the room is failed)."""
        assert self.packer is not None
        nbytes = entries = 0
        loose = [p for p in packs if p.location != self.packer.staging.location]
        ours = [p for p in packs if p.location == self.packer.staging.location]
        for part in self.packer.pieces(ours):
            try:
                g = self.packer.gather(part)
            except Exception:  # noqa: BLE001 - the direct write is always correct
                log.exception(
                    "room %d: gathering packed rows failed; writing them directly", st.room
                )
                self.ep.count("pack_gather_errors")
                g = None
            if g is None:
                loose += [
                    Pack(p.location, (p.src[i],), (p.dst[i],), p.rows, p.row_bytes, p.src_rows)
                    for p, i in part
                ]
                continue
            self.ep.count("packed_writes")
            try:
                ok = self._send_blocks(st, t, g.blocks)
            finally:
                self.packer.release(g)
            if not ok:
                return None
            nbytes, entries = nbytes + g.blocks.total_bytes, entries + len(g.blocks)
        if loose:
            self.ep.count("pack_direct_writes")
            b = P.Blocks.concat([p.blocks() for p in loose])
            if not self._send_blocks(st, t, b):
                return None
            nbytes, entries = nbytes + b.total_bytes, entries + len(b)
        return nbytes, entries

    def _send_blocks(self, st: SenderRoom, t: Target, b: P.Blocks) -> bool:
        """One write to ``t``'s decode; False (the room failed) when it failed."""
        try:
            self.ep.transport.write(
                t.peer.session,
                *b.lists(),
                deadline=st.deadline,
                should_stop=lambda: st.state == KVPoll.Failed,
                tag=st.room,
            )
        except TransportError as e:
            self._write_failed(st, t, e)
            return False
        return True

    def _write_failed(self, st: SenderRoom, t: Target, e: TransportError) -> None:
        self._fail(
            st, TransportError(f"room {st.room}: write to decode {t.peer.endpoint_id} failed: {e}")
        )
        self.finish(st, t, False, st.failure)

    def _wrote(
        self,
        st: SenderRoom,
        t: Target,
        chunk: Chunk,
        blocks: P.Blocks,
        entries: int,
        t0: float,
        tw: float,
        frame: bytes | None = None,
        packed: int = 0,
    ) -> None:
        now = time.perf_counter()
        t.bytes += blocks.total_bytes + packed
        t.blocks += entries
        t.seconds += now - t0
        t.write_seconds += now - tw
        if chunk.last:
            self.finish(st, t, True, None, frame)

    def _give_up(self, st: SenderRoom, t: Target) -> None:
        """A target whose decode's path was not proven quiet before the transfer deadline:
        the room fails here and the target ends without a message (its decode keeps the
        pages until an ``AbortAck``, which waits for the proof)."""
        self._fail(
            st,
            TransportError(
                f"room {st.room}: a failed write to decode {t.peer.endpoint_id} was not proven "
                f"drained before the deadline"
            ),
        )
        self.finish(st, t, False, st.failure, settled=True, send=False)

    def finish(
        self,
        st: SenderRoom,
        t: Target,
        ok: bool,
        err: PdxferError | None,
        frame: bytes | None = None,
        settled: bool = False,
        send: bool = True,
    ) -> None:
        """Send the target its one terminal message; runs on the room's worker thread.

        The outcome is decided under the lock (an abort decided first turns it into a
        failure; one decided after finds the target finished and sends nothing more) and the
        message goes out right after the lock is released: the send writes to the socket
        (tens to hundreds of microseconds on a busy host), which other threads should not
        wait for. The room's terminal messages all come from this worker, so they stay in
        order. ``frame``: the success message, encoded ahead.

        While a failed write to the target's decode may still land (the transport says it
        is tainted), the target stays unfinished (its source pages may still be read) and
        this runs again once the path is proven quiet (``settler.py``): the decode must not
        hear that the room's writes are over before they are; a room held past the transfer
        deadline ends without a message (``send=False``)."""
        if t.finished:
            return
        if (
            not settled
            and t.scheduled
            and not t.req.silent
            and self.ep.transport.tainted(t.peer.session)
        ):
            if not t.settling:
                t.settling = True
                self.ep.count("settle_waits")
                self.settler.hold(
                    t.peer.session,
                    lambda: self.ep.workers.submit(
                        st.room, lambda: self.finish(st, t, ok, err, frame, settled=True)
                    ),
                    lambda: self.ep.workers.submit(st.room, lambda: self._give_up(st, t)),
                )
            return
        now = time.monotonic()
        success = False
        out: bytes | None = None
        with self.ep.lock:
            if t.finished:
                return
            t.finished = True
            if ok and st.state == KVPoll.Failed:  # aborted or expired while the write ran
                ok, err = False, st.failure
            t.ok = ok
            if not (t.req.silent and not t.aborted):  # a silent sender's decode does not wait
                if t.aborted:
                    out = wire.encode(
                        wire.AbortAck(
                            room=st.room,
                            nonce=t.req.nonce,
                            endpoint_id=self.ep.endpoint_id,
                            rank=self.cfg.tp_rank,
                        )
                    )
                elif ok and frame is not None:
                    out = frame
                else:
                    out = wire.encode(
                        wire.TransferDone(
                            room=st.room,
                            nonce=t.req.nonce,
                            endpoint_id=self.ep.endpoint_id,
                            rank=self.cfg.tp_rank,
                            ok=ok,
                            reason=str(err) if err else "",
                            kind=err.kind if err else "",
                            bytes=t.bytes,
                            blocks=t.blocks,
                            seconds=t.seconds,
                            digests=tuple(t.digests) if ok else (),
                        )
                    )
            all_done = decodes(st) >= st.expected and all(x.finished for x in st.targets)
            if ok and all_done and not st.state.terminal:
                st.state = KVPoll.Success
                success = True
            if all_done or st.state == KVPoll.Failed and all(x.finished for x in st.targets):
                self._ended(st)
        if out is not None and send:
            self.ep.send_frame(t.peer.ctrl_addr, out, t.peer.sess)
        if success:
            self.ep.count("success")
            self.ep.timeline.observe("waiting", st.t_request - st.t_created)
            self.ep.timeline.observe("transfer", now - st.t_request)
        self.ep.count_transfer(t.bytes, t.blocks)
