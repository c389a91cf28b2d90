"""A prefill rank's sending half: what a step computed goes to pdxfer's sender.

One room a request (and one more per window size for a hybrid model, ``groups.Part``). The
scheduler's orders (``metadata.py``) say what goes when:

- by request or step (``send_blocks``): a ``SendOrder`` hands the blocks the sender does not
  have yet, the request's last ones at its end; a step's ``chunks`` are ``SendOrder``s too.
- by layer (``send_by: layer``): a ``LayerOrder`` a step; each layer the forward reports goes
  once computed (``layer_computed``) where a decode already asked, and what is left goes after
  the forward (``end_layers``).

Every send is a hand-off: the writes run on pdxfer's threads while the next steps compute;
nothing here waits on the network, except a preemption's drain (its blocks are vLLM's again).
A send is over, and reported to vLLM, once vLLM handed its blocks over and no write reads
them (``finished``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from pdxfer import KVPoll, KVSender

from . import groups as G
from .counters import Counters
from .groups import Part
from .layout import POOL
from .metadata import AbortOrder, ExpectOrder, LayerOrder, OpenOrder, SendOrder
from .rank import RankKV

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Out:
    """One prefill request's room on this rank."""

    room: int
    tx: KVSender | None
    """None: the room could not be opened (the request's send failed)."""
    sent: int = 0
    """Blocks handed to the sender so far (every layer of them)."""
    tokens: int = 0
    """Tokens every layer was handed (``send_by: layer``)."""
    last: bool = False
    owned: bool = False
    """vLLM handed the blocks over (``request_finished`` returned True): report the request
    in ``finished_sending`` once no write reads them."""
    others: list[KVSender] = field(default_factory=list)
    """A hybrid model's rooms after the first (``groups.Part``), in part order."""
    part_tokens: list[int] = field(default_factory=list)
    """A hybrid model: tokens every streamed layer of each part was handed, in part order."""
    part_last: list[bool] = field(default_factory=list)
    """A hybrid model: the parts whose room got its last send."""

    def senders(self) -> list[KVSender]:
        return ([self.tx] if self.tx is not None else []) + self.others


@dataclass(frozen=True, slots=True)
class _NewLayers:
    """Layers of a ``LayerOrder`` not handed over before (``_mark_handed``)."""

    out: _Out
    ids: list[int]
    first: bool
    """Whether they are the first of this step's for the request."""
    complete: bool
    """Whether every layer of the step is now handed over."""


class PrefillSender:
    def __init__(self, kv: RankKV, counters: Counters) -> None:
        self.kv = kv
        self.counters = counters
        self.partial_blocks = kv.partial_blocks
        """Whether a block filled in part is sent for its tokens (``RankKV.partial_blocks``;
        a test whose fake forward writes plain tiles sets it)."""
        self._sends: dict[str, _Out] = {}
        self._expected: dict[str, int] = {}
        """Queued prefill requests whose rooms this rank expects (``ExpectOrder``), by id."""
        self._handed: dict[str, set[int]] = {}
        """This step's layer orders: the layers handed over so far, by request."""
        self._live: set[str] = set()
        """This step's requests whose layers go one by one: their decode had asked by the
        step's first layer (or the layers are on a device). Counted as ``streamed_steps``,
        which says how often a decode's ask came early enough for streaming."""
        self._pending: list[tuple[Any, LayerOrder, int]] = []
        """Layers computed on a device, waiting for their event (GPU kernels run ahead of
        Python: a layer is handed over once its writes are done, never before)."""

    @property
    def in_flight(self) -> int:
        """Requests whose send vLLM has not been told the end of."""
        return len(self._sends)

    # -- rooms ---------------------------------------------------------------------------------
    def expect(self, e: ExpectOrder) -> None:
        """Declare a queued request's room: a decode that asks before vLLM schedules it
        waits for it (``Endpoint.expect``)."""
        try:
            for part in self.kv.parts:
                self.kv.ep.expect(part.room(e.room), e.peer)
        except Exception as ex:  # noqa: BLE001 - its decode falls back to the grace
            log.warning("room %d (request %s): cannot expect it: %s", e.room, e.req_id, ex)
            return
        self._expected[e.req_id] = e.room

    def open(self, o: OpenOrder) -> _Out:
        ep, parts = self.kv.ep, self.kv.parts
        self._expected.pop(o.req_id, None)  # the endpoint forgets it when the room opens
        tx: KVSender | None = None
        others: list[KVSender] = []
        try:
            tx = ep.sender(o.room, peer=o.peer)
            others = [ep.sender(p.room(o.room), peer=o.peer) for p in parts[1:]]
        except Exception as e:  # noqa: BLE001 - one bad room fails that request only
            log.warning("room %d (request %s): cannot open: %s", o.room, o.req_id, e)
            self.counters.add("send_failures")
            for t in [tx, *others]:
                if t is not None:
                    t.abort(f"cannot open: {e}")
            tx, others = None, []
        n = len(parts)
        out = self._sends[o.req_id] = _Out(
            o.room, tx, others=others, part_tokens=[0] * n, part_last=[False] * n
        )
        return out

    def _room(self, req_id: str, room: int, peer: str | None) -> _Out:
        """The request's room, opened now if no order opened it yet."""
        out = self._sends.get(req_id)
        return out if out is not None else self.open(OpenOrder(req_id, room, peer))

    def abort(self, a: AbortOrder) -> None:
        """End a room whose request vLLM aborted or preempted. Blocks vLLM already freed
        (not ``held``) may be filled by this step's forward: wait for writes that read them
        (bounded by ``abort_timeout_s``); held ones are reported once no write reads them."""
        room = self._expected.pop(a.req_id, None)
        if room is not None:  # ended while queued: a decode waiting for the room fails now
            for part in self.kv.parts:
                self.kv.ep.withdraw(part.room(room), "aborted by vLLM while queued")
        out = self._sends.get(a.req_id)
        if out is None:
            return
        for tx in out.senders():
            tx.abort("vLLM ended the request" if a.held else "vLLM preempted the request")
        if a.held:
            out.owned = True
            return
        del self._sends[a.req_id]
        limit = self.kv.cfg.get("abort_timeout_s")
        end = time.monotonic() + limit
        while _reading(out) and time.monotonic() < end:
            time.sleep(0.001)
        if _reading(out):
            log.warning(
                "room %d (request %s): writes still read its blocks %.1f s after its preemption",
                out.room,
                a.req_id,
                limit,
            )

    # -- by request or step --------------------------------------------------------------------
    def send_blocks(self, s: SendOrder, owned: bool) -> None:
        """Hand the sender the blocks of ``s`` it does not have yet (``owned``: vLLM handed
        the request's blocks over, so its end is reported once no write reads them)."""
        out = self._room(s.req_id, s.room, s.peer)
        out.owned |= owned
        if s.groups:
            self._send_group_blocks(out, s)
            return
        new = list(s.block_ids[out.sent :])
        if out.tx is None or out.last or not (new or s.last):
            return
        try:
            out.tx.send({POOL: new}, last=s.last)
        except Exception as e:  # noqa: BLE001 - one bad room fails that request only
            log.warning("room %d (request %s): cannot send: %s", s.room, s.req_id, e)
            out.tx.abort(f"cannot send: {e}")
            out.last = True
            return
        out.sent, out.last = len(s.block_ids), s.last
        if not s.last:
            self.counters.add("step_chunks")
        else:
            self.counters.add("sends")
            self.counters.add("sent_tokens", s.num_tokens)

    def _send_group_blocks(self, out: _Out, s: SendOrder) -> None:
        """A hybrid model's send at the request's end: each room (``groups.Part``) not ended
        by the stream gets its groups' pages from where the stream stopped, clipped
        (``groups.source_pages``), and its state slots."""
        if out.tx is None or out.last:
            return
        out.last = True
        try:
            for i, (part, tx) in enumerate(zip(self.kv.parts, out.senders())):
                if out.part_last[i]:
                    continue
                out.part_last[i] = True
                t0 = out.part_tokens[i]
                pages: dict[str, list[int]] = {}
                slots: dict[str, int] = {}
                for g in part.groups:
                    ids = s.groups[g.index]
                    if g.kind == "state":
                        slots[g.pool] = G.state_slot(g, ids)
                    elif t0 < s.num_tokens:
                        pages[g.pool] = G.source_pages(g, ids, s.num_tokens)[t0 // g.block_size :]
                    else:
                        pages[g.pool] = []  # streamed whole: the state slot ends the room
                tx.send(pages, slots=slots, last=True)
        except Exception as e:  # noqa: BLE001 - one bad room fails that request only
            log.warning("room %d (request %s): cannot send: %s", s.room, s.req_id, e)
            for tx in out.senders():
                tx.abort(f"cannot send: {e}")
            return
        self.counters.add("sends")
        self.counters.add("sent_tokens", s.num_tokens)

    # -- by layer ------------------------------------------------------------------------------
    def layer_id(self, name: str) -> int | None:
        """The layer id of vLLM's layer ``name``; None for one that does not stream."""
        return self.kv.layer_of.get(name)

    def begin_layers(self, orders: list[LayerOrder], on_device: bool) -> None:
        """The step's first layer is computed: which requests' layers go one by one (all of
        them on a device; else those a decode asked for)."""
        self._handed = {}
        self._live = {o.req_id for o in orders if on_device or self._asked(o)}

    def layer_computed(self, orders: list[LayerOrder], lid: int, event: Any) -> None:
        """Layer ``lid`` of the step is computed: hand its part of each order to the sender.

        Only for rooms a decode has asked for: a layer handed to a room nobody asked for yet
        cannot leave before the forward ends anyway, and each hand-off costs the engine
        thread time inside the forward while the request's answer waits for the step
        (measured: docs/performance-history.md#where-the-layer-by-layer-time-went-traced-2026-11-26).
        Under vLLM's own proxy the decode asks only after the prefill's answer, so every room
        is such a room: its layers go after the forward, in one hand-off (``end_layers``).
        Layers computed on a device (``event`` not None) are still handed over one by one,
        once their kernels are done."""
        for o in orders:
            if event is not None:
                self._pending.append((event, o, lid))
            elif self._asked(o):
                self._send_layers(o, lid, lid + 1)
        self._send_done_layers(wait=False)

    def end_layers(self, orders: list[LayerOrder]) -> None:
        """After the forward: every layer of the step not handed over yet goes now (device
        layers once their kernels are done), in contiguous runs; a room's last layer ends its
        send."""
        self._send_done_layers(wait=True)
        for o in orders:
            self._send_unreported_layers(o)
        self.forget_layers()

    def forget_layers(self) -> None:
        """A new step: no layer of it was handed over yet."""
        self._handed, self._live = {}, set()

    def _asked(self, o: LayerOrder) -> bool:
        """Whether a decode has asked for ``o``'s room (a layer handed now can leave now)."""
        out = self._sends.get(o.req_id)
        return out is not None and out.tx is not None and out.tx.prefix_len is not None

    def _send_done_layers(self, wait: bool) -> None:
        """Hand over device-computed layers whose writes are done (all of them: ``wait``)."""
        while self._pending:
            event, o, lid = self._pending[0]
            if not wait and not event.query():
                return
            event.synchronize()
            self._pending.pop(0)
            self._send_layers(o, lid, lid + 1)

    def _send_unreported_layers(self, o: LayerOrder) -> None:
        """Hand over the layers of ``o`` the forward did not report, in contiguous runs."""
        handed = self._handed.get(o.req_id, set())
        run: list[int] = []
        for x in self.kv.layer_ids:
            if x in handed:
                if run:
                    self._send_layers(o, run[0], run[-1] + 1)
                run = []
            else:
                run.append(x)
        if run:
            self._send_layers(o, run[0], run[-1] + 1)

    def _mark_handed(self, o: LayerOrder, a: int, b: int) -> _NewLayers | None:
        """Mark layers ``[a, b)`` of ``o`` handed over, opening its room if need be; None when
        there is nothing to send (no sender, ended, nothing new)."""
        out = self._room(o.req_id, o.room, o.peer)
        handed = self._handed.setdefault(o.req_id, set())
        ids = [x for x in self.kv.layer_ids if a <= x < b and x not in handed]
        if out.tx is None or out.last or not ids:
            return None
        first = not handed
        handed.update(ids)
        return _NewLayers(out, ids, first, len(handed) == len(self.kv.layer_ids))

    def _send_layers(self, o: LayerOrder, a: int, b: int) -> None:
        """Hand the sender layers ``[a, b)`` of ``o``; the room's last send is the one that
        completes every layer of the prompt's last tokens."""
        if o.groups:
            return self._send_group_layers(o, a, b)
        new = self._mark_handed(o, a, b)
        if new is None:
            return
        out, ids = new.out, new.ids
        assert out.tx is not None
        bs = self.kv.rank.block_size
        t0 = out.tokens
        # a block the step fills in part: its tokens, where a block's interior is addressable
        # by token; else (vLLM's CPU tiles are packed per ISA) the block waits to be complete
        t1 = o.end if o.last or self.partial_blocks else o.end // bs * bs
        last = o.last and new.complete
        if t1 > t0:
            pages = list(o.block_ids[t0 // bs - o.start // bs : -(-t1 // bs) - o.start // bs])
            # the last step's pages are sent whole (the tail of the last block too), as in
            # the other modes; earlier steps name the tokens they carry
            try:
                out.tx.send(
                    {POOL: pages},
                    layers=(ids[0], ids[-1] + 1),
                    last=last,
                    tokens=None if o.last else (t0, t1),
                )
            except Exception as e:  # noqa: BLE001 - one bad room fails that request only
                log.warning("room %d (request %s): cannot send: %s", o.room, o.req_id, e)
                out.tx.abort(f"cannot send: {e}")
                out.last = True
                return
            self.counters.add("layer_sends")
            if new.first and o.req_id in self._live:
                self.counters.add("streamed_steps")
        if not new.complete:
            return
        out.tokens = max(t0, t1)
        out.sent, out.last = out.tokens // bs, last
        if last:
            self.counters.add("sends")
            self.counters.add("sent_tokens", o.end)
        elif t1 > t0:
            self.counters.add("step_chunks")

    def _send_group_layers(self, o: LayerOrder, a: int, b: int) -> None:
        """``_send_layers`` for a hybrid model: each room (``groups.Part``) gets the pages of
        its groups that hold layers ``[a, b)``, for the tokens the step computed (a window
        group's only from ``groups.stream_start``: blocks vLLM may free before the request
        ends never go). A room of full and window groups ends with the prompt's last step;
        one with a state group at the request's end (``_send_group_blocks``: the state is
        final only after the whole forward of the last step)."""
        new = self._mark_handed(o, a, b)
        if new is None:
            return
        out, ids = new.out, new.ids
        mine = set(ids)
        moved: list[tuple[int, int, bool]] = []
        try:
            for i, (part, tx) in enumerate(zip(self.kv.parts, out.senders())):
                if out.part_last[i]:
                    continue
                t0, t1 = out.part_tokens[i], _part_end(part, o)
                last = o.last and new.complete and not any(g.kind == "state" for g in part.groups)
                real = t1 > t0 and t1 > G.stream_start(part, o.num_tokens)
                moved.append((i, t1 if real else t0, last))
                pools = [
                    g
                    for g in part.groups
                    if g.kind != "state" and any(self.kv.layer_of.get(n) in mine for n in g.layers)
                ]
                if real and pools:
                    pages = {
                        g.pool: G.stream_pages(g, o.groups[g.index], t0, t1, o.num_tokens)
                        for g in pools
                    }
                    tx.send(
                        pages,
                        layers=(ids[0], ids[-1] + 1),
                        last=last,
                        tokens=None if o.last else (t0, t1),
                    )
                    self.counters.add("layer_sends")
                elif last:
                    tx.send({}, last=True)  # its pools' layers were all handed over before
        except Exception as e:  # noqa: BLE001 - one bad room fails that request only
            log.warning("room %d (request %s): cannot send: %s", o.room, o.req_id, e)
            for tx in out.senders():
                tx.abort(f"cannot send: {e}")
            out.last = True
            return
        if new.first and o.req_id in self._live:
            self.counters.add("streamed_steps")
        if not new.complete:
            return
        advanced = any(t > out.part_tokens[i] for i, t, _ in moved)
        for i, t, last in moved:
            out.part_tokens[i], out.part_last[i] = t, last
        out.last = all(out.part_last)
        if out.last:
            self.counters.add("sends")
            self.counters.add("sent_tokens", o.end)
        elif advanced:
            self.counters.add("step_chunks")

    # -- what ended ----------------------------------------------------------------------------
    def finished(self) -> set[str]:
        """Requests whose send ended and whose blocks vLLM may have back (then forgotten)."""
        done: set[str] = set()
        for rid, out in list(self._sends.items()):
            st = _send_over(out)
            if st is None:
                continue
            if st == KVPoll.Failed and out.tx is not None:
                self.counters.add("send_failures")
                log.info("request %s: send failed: %s", rid, out.tx.failure)
            done.add(rid)
            del self._sends[rid]
        return done

    def reportable(self) -> bool:
        """Whether ``finished`` would report something now."""
        return any(_send_over(o) is not None for o in self._sends.values())


def _part_end(part: Part, o: LayerOrder) -> int:
    """The token up to which a step hands ``part`` over: the prompt's end at its last step,
    else the last token of a block complete in every group of the part (vLLM's CPU tiles
    are packed per ISA: a block moves whole)."""
    if o.last:
        return o.end
    step = math.lcm(*(g.block_size for g in part.groups if g.kind != "state"), 1)
    return o.end // step * step


def _send_over(out: _Out) -> KVPoll | None:
    """How a send ended, once vLLM may be told (its blocks free): Failed, or Success and not
    held for a repair; None while vLLM still runs the request or a write reads its blocks."""
    if not out.owned or _reading(out):
        return None
    if out.tx is None:
        return KVPoll.Failed  # the room could not be opened
    sts = [tx.poll() for tx in out.senders()]
    if KVPoll.Failed in sts:
        return KVPoll.Failed
    if all(st == KVPoll.Success for st in sts) and not any(t.holding for t in out.senders()):
        return KVPoll.Success
    return None


def _reading(out: _Out) -> bool:
    """Whether a write may still read the request's blocks (any of its rooms)."""
    return any(tx.reading for tx in out.senders())
