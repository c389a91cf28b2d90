"""A decode rank's loading half: loads into vLLM's blocks, their failures, write-backs.

A ``LoadOrder`` starts one load: through the decode tiers (``decode_tiers.py``,
``RestoringReceiver``: L2/L3 first, the rest from the prefill) where there are some, else
straight from the prefill; a hybrid model's load is one receiver per room (``groups.Part``)
seen as one (``_Joined``). A failed load is reported only once no write can land in its
blocks (``release``), then its blocks go back to vLLM as load errors (its request ids, for
a hybrid model): a request never decodes from KV that did not arrive. A ``WritebackOrder``
writes a finished request's blocks to the tiers; vLLM hears of it as a finished send.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdxfer import KVPoll
from pdxfer.tiers import RestoringReceiver

from . import groups as G
from .counters import Counters
from .decode_tiers import DecodeTiers
from .groups import Part
from .layout import POOL
from .metadata import LoadOrder, WritebackOrder
from .rank import RankKV

log = logging.getLogger(__name__)


class _Handle(Protocol):
    """What a load needs of its handle: a pdxfer receiver, a restoring one, or one of ours
    below (``_Refused``, ``_Joined``)."""

    @property
    def failure(self) -> Any: ...

    def poll(self) -> KVPoll: ...

    def abort(self, reason: str = ...) -> None: ...

    def stats(self) -> dict[str, Any]: ...


@dataclass(eq=False)
class _Load:
    order: LoadOrder
    rx: _Handle
    blocks: list[int]
    """The blocks this load writes (from ``l1_len``): reported on failure."""
    released: threading.Event = field(default_factory=threading.Event)
    aborted: bool = False


class DecodeLoader:
    def __init__(self, kv: RankKV, tiers: DecodeTiers, counters: Counters) -> None:
        self.kv = kv
        self.tiers = tiers
        self.counters = counters
        self._loads: dict[str, _Load] = {}
        self._written: set[str] = set()
        self._errors: set[int] = set()
        self._failed: set[str] = set()
        """Hybrid models: requests whose load failed. vLLM takes block-level load errors
        from one KV cache group only; with several it needs the request ids
        (``failed_recving``) and fails or recomputes the whole request."""

    @property
    def in_flight(self) -> int:
        """Loads vLLM has not been told the end of."""
        return len(self._loads)

    # -- loads ---------------------------------------------------------------------------------
    def load(self, o: LoadOrder) -> None:
        if o.groups:
            return self._load_groups(o)
        ep, cache = self.kv.ep, self.tiers.cache
        bs = self.kv.rank.block_size
        blocks = list(o.block_ids[o.l1_len // bs : -(-o.num_tokens // bs)])
        rec: _Load | None = None

        def release(*_: Any) -> None:
            if rec is not None:
                rec.released.set()
            else:
                early.set()

        early = threading.Event()
        try:
            rx: _Handle
            if cache is not None:
                rx = RestoringReceiver(
                    cache,
                    ep,
                    o.room,
                    o.bootstrap,
                    o.tokens,
                    {POOL: blocks},
                    num_tokens=o.num_tokens,
                    l1_len=o.l1_len,
                    release=release,
                    instance=o.instance,
                    scope=o.scope,
                    early=o.early,
                    dp=o.dp,
                )
            else:
                rx = ep.receiver(
                    o.room,
                    o.bootstrap,
                    instance=o.instance,
                    release=release,
                    early=o.early,
                    dp=o.dp,
                )
                rx.request({POOL: blocks}, prefix_len=o.l1_len, num_tokens=o.num_tokens)
        except Exception as e:  # noqa: BLE001 - the request fails, vLLM recomputes it
            log.warning("room %d (request %s): cannot start the load: %s", o.room, o.req_id, e)
            rx = _Refused(o.room, e)
            early.set()
        rec = _Load(o, rx, blocks)
        if early.is_set():
            rec.released.set()
        self.counters.add("loads")
        self._loads[o.req_id] = rec

    def _load_groups(self, o: LoadOrder) -> None:
        """A hybrid model's load: one receiver per room (``groups.Part``), each asking for
        its groups' blocks from the first token the decode holds a block for (a window
        group's earlier blocks are vLLM's null block) and its state slots."""
        ep, cache = self.kv.ep, self.tiers.cache
        plans: list[tuple[Part, dict[str, list[int]], dict[str, int], int]] = []
        blocks: list[int] = []
        try:
            for part in self.kv.parts:
                pages: dict[str, list[int]] = {}
                slots: dict[str, int] = {}
                start = o.l1_len
                for g in part.groups:
                    ids = o.groups[g.index]
                    if g.kind == "state":
                        slots[g.pool] = G.state_slot(g, ids)
                        continue
                    f = o.l1_len // g.block_size
                    if g.kind in G.LOCAL:
                        w = G.window_start(g, ids, f, o.num_tokens)
                        if w is None:
                            raise ValueError(
                                f"{g.pool}: a null block inside the {g.kind} ({list(ids)})"
                            )
                        f = w
                    start = max(start, f * g.block_size)
                for g in part.groups:
                    if g.kind != "state":
                        need = -(-o.num_tokens // g.block_size)
                        pages[g.pool] = [
                            int(b) for b in o.groups[g.index][start // g.block_size : need]
                        ]
                start = min(start, o.num_tokens)
                plans.append((part, pages, slots, start))
                blocks += [b for p in pages.values() for b in p] + list(slots.values())
        except Exception as e:  # noqa: BLE001 - the request fails, vLLM recomputes it
            log.warning(
                "room %d (request %s): cannot load this model's groups: %s", o.room, o.req_id, e
            )
            rec = _Load(o, _Refused(o.room, e), [])
            rec.released.set()
            self.counters.add("loads")
            self._loads[o.req_id] = rec
            return
        joined = _Joined(o.room, len(plans))
        try:
            for part, pages, slots, start in plans:
                rx: _Handle
                if part.key == 0 and cache is not None and o.tokens and self.tiers.tiered:
                    # its full groups' prefix from L2/L3, the rest (and the state) over the
                    # network; the other rooms (windows) always over the network
                    rx = RestoringReceiver(
                        cache,
                        ep,
                        o.room,
                        o.bootstrap,
                        o.tokens,
                        pages,
                        slots,
                        num_tokens=o.num_tokens,
                        l1_len=start,
                        release=joined.release_one,
                        instance=o.instance,
                        scope=o.scope,
                        early=o.early,
                        dp=o.dp,
                    )
                    joined.parts.append(rx)
                    continue
                rx = ep.receiver(
                    part.room(o.room),
                    o.bootstrap,
                    instance=o.instance,
                    release=joined.release_one,
                    early=o.early,
                    dp=o.dp,
                )
                joined.parts.append(rx)
                rx.request(pages, slots=slots, prefix_len=start, num_tokens=o.num_tokens)
        except Exception as e:  # noqa: BLE001 - the request fails, vLLM recomputes it
            log.warning("room %d (request %s): cannot start the load: %s", o.room, o.req_id, e)
            joined.refuse(e, len(plans) - len(joined.parts))
        rec = _Load(o, joined, blocks, released=joined.released)
        self.counters.add("loads")
        self._loads[o.req_id] = rec

    def abort_dropped(self, finished_req_ids: Iterable[str]) -> None:
        """Abort the loads of requests vLLM finished while their KV was on the way."""
        for rid in finished_req_ids:
            rec = self._loads.get(rid)
            if rec is not None and not rec.rx.poll().terminal:
                rec.aborted = True
                rec.rx.abort("vLLM finished the request while its KV was on the way")

    def abort_all(self) -> None:
        """vLLM shuts down: every load under way ends."""
        for rec in self._loads.values():
            if not rec.rx.poll().terminal:
                rec.rx.abort("vLLM is shutting down")

    # -- write-back ----------------------------------------------------------------------------
    def write_back(self, w: WritebackOrder) -> None:
        cache = self.tiers.cache
        if cache is None:  # a hybrid model's tiers refused at start-up (logged then)
            self._written.add(w.req_id)
            return
        try:
            pages = (
                {POOL: list(w.block_ids)}
                if not w.groups
                else {
                    g.pool: list(w.groups[g.index])
                    for g in self.kv.groups
                    if g.pool in self.tiers.tiered
                }
            )
            cache.write_back(w.tokens, pages, len(w.tokens), w.scope)
            self.counters.add("writebacks")
        except Exception as e:  # noqa: BLE001 - a cache problem never fails a request
            self.counters.add("writeback_failures")
            log.warning("write-back of request %s failed: %s", w.req_id, e)
        self._written.add(w.req_id)

    def take_written(self) -> set[str]:
        """Requests written back since the last call (vLLM's ``finished_sending``: their
        blocks are free again)."""
        out, self._written = self._written, set()
        return out

    # -- what ended ----------------------------------------------------------------------------
    def finished(self) -> set[str]:
        """Loads that ended (then forgotten): counted, and a failed one's blocks (or request,
        for a hybrid model) kept for ``load_errors`` (``failed_loads``)."""
        done: set[str] = set()
        for rid, rec in list(self._loads.items()):
            st = _load_over(rec)
            if st is None:
                continue
            if st == KVPoll.Success:
                self._count_loaded(rec)
            else:
                self.counters.add("load_failures")
                if not rec.aborted:
                    log.warning(
                        "request %s (room %d): KV load failed: %s; its %d blocks go "
                        "back to vLLM as load errors",
                        rid,
                        rec.order.room,
                        rec.rx.failure,
                        len(rec.blocks),
                    )
                if self.kv.hybrid:
                    self._failed.add(rid)
                else:
                    self._errors.update(rec.blocks)
            done.add(rid)
            del self._loads[rid]
        return done

    def reportable(self) -> bool:
        """Whether the worker's ``get_finished`` would report a load or write-back now."""
        return bool(
            self._written
            or self._errors
            or self._failed
            or any(_load_over(r) is not None for r in self._loads.values())
        )

    def load_errors(self) -> set[int]:
        """Blocks of loads that failed since the last call."""
        out, self._errors = self._errors, set()
        return out

    def failed_loads(self) -> set[str]:
        """Requests whose load failed since the last call (hybrid models)."""
        out, self._failed = self._failed, set()
        return out

    def _count_loaded(self, rec: _Load) -> None:
        add = self.counters.add
        add("loaded_tokens", rec.order.num_tokens - rec.order.l1_len)
        net, net_s, ready_s = 0, 0.0, 0.0
        for rx in rec.rx.parts if isinstance(rec.rx, _Joined) else [rec.rx]:
            st = rx.stats()
            if isinstance(rx, RestoringReceiver):
                good, l2 = rx.restored_pages, int(st["l2_pages"])
                add("restored_pages", good)
                add("restored_l2_pages", min(good, l2))
                add("restored_l3_pages", max(0, good - l2))
                add("repaired_tokens", int(st["repaired_tokens"]))
                net += int(st["net_bytes"] or 0) + int(st["repair_bytes"] or 0)
                net_s = max(net_s, st["net_seconds"] or 0)
                ready_s = max(ready_s, st["seconds"] or 0)
                add("restore_us", int((st["local_seconds"] or 0) * 1e6))
            else:
                net += int(st.get("bytes") or 0)
                net_s = max(net_s, st.get("seconds") or 0)
                ready_s = max(ready_s, st.get("seconds") or 0)
        add("net_bytes", net)
        add("net_us", int(net_s * 1e6))
        add("ready_us", int(ready_s * 1e6))
        self.counters.observe("ready_seconds", float(ready_s))
        self.counters.observe("load_bytes", net)


class _Refused:
    """A load pdxfer refused to start (bad room, duplicate): Failed from the start, and no
    write was ever asked for, so its blocks are free at once."""

    def __init__(self, room: int, why: Exception) -> None:
        self.room, self.failure = room, why

    def poll(self) -> KVPoll:
        return KVPoll.Failed

    def abort(self, reason: str = "") -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {"bytes": 0}


class _Joined:
    """A hybrid model's load over several rooms, seen as one handle: Success when every
    room succeeded, Failed when one failed (the others are aborted), released once every
    room released its pages (no write can land any more)."""

    def __init__(self, room: int, count: int) -> None:
        self.room = room
        self.parts: list[_Handle] = []
        self.failure: Exception | None = None
        self.released = threading.Event()
        self._left = count
        self._lock = threading.Lock()

    def release_one(self, *_: Any) -> None:
        with self._lock:
            self._left -= 1
            if self._left <= 0:
                self.released.set()

    def refuse(self, why: Exception, never_started: int) -> None:
        """Some rooms could not start: those never release; the started ones are aborted."""
        self.failure = why
        for _ in range(never_started):
            self.release_one()
        self.abort(f"cannot start the load: {why}")

    def poll(self) -> KVPoll:
        sts = [p.poll() for p in self.parts]
        if self.failure is not None or KVPoll.Failed in sts:
            if self.failure is None:
                self.failure = next(p.failure for p in self.parts if p.poll() == KVPoll.Failed)
                self.abort(f"another room of the request failed: {self.failure}")
            return KVPoll.Failed
        return min(sts) if sts else KVPoll.Failed

    def abort(self, reason: str = "") -> None:
        for p in self.parts:
            if not p.poll().terminal:
                p.abort(reason)

    def stats(self) -> dict[str, Any]:
        st = [p.stats() for p in self.parts]
        secs = [t for x in st if (t := x.get("seconds")) is not None]
        return {
            "bytes": sum(int(x.get("bytes") or 0) for x in st),
            "seconds": max(secs) if secs else None,
        }


def _load_over(rec: _Load) -> KVPoll | None:
    """How a load ended, once vLLM may be told: Success, or Failed with no write left that
    could land in its blocks (``released``); None before."""
    st = rec.rx.poll()
    if st == KVPoll.Success or (st == KVPoll.Failed and rec.released.is_set()):
        return st
    return None
