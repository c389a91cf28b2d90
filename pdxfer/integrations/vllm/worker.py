"""The connector's worker side: one pdxfer ``Endpoint`` per vLLM worker rank.

``register_kv_caches`` describes vLLM's cache tensors as pools (``layout.py``, no copy;
one per KV cache group for a hybrid model, ``groups.py``) and starts the endpoint. Each
step the worker carries out the scheduler's orders (``metadata.py``): a prefill hands the
sender what the step computed (never a wait on the network inside the forward); a decode
starts loads (through L2/L3 with tiers, ``RestoringReceiver``) and writes finished requests
back. A send is over when the decode no longer needs its blocks; a failed load is reported
only once no write can land in its blocks (``release``), then its blocks go back to vLLM
as load errors: a request never decodes from KV that did not arrive. Every wait is
pdxfer's, with its deadline (``bootstrap_timeout_s``, ``transfer_timeout_s``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pdxfer import ConfigError, Endpoint, KVPoll, KVSender, RequestHandle
from pdxfer.tiers import FileStorage, RestoringReceiver, StorageBackend, TieredCache

from . import groups as G
from .config import ConnectorConfig
from .cpu import hold_amx_tiles
from .groups import Group, Part
from .layout import POOL, Layout, describe, describe_state, layer_order
from .metadata import (
    AbortOrder,
    ExpectOrder,
    LayerOrder,
    LoadOrder,
    OpenOrder,
    PdxferMetadata,
    SendOrder,
    WritebackOrder,
)

log = logging.getLogger("pdxfer.integrations.vllm")

IDLE_WAIT_S = 0.005
"""How long a step that computes nothing waits in ``get_finished`` for a transfer to end
(vLLM's engine loop steps without pause while a request waits for its KV or a finished
one's blocks are sent); a request that arrives meanwhile waits at most this long
(docs/performance-history.md#where-the-layer-by-layer-time-went-traced-2026-11-26)."""

IDLE_POLL_S = 0.0005
"""How often that wait looks at the transfers."""


@dataclass(eq=False)
class _Load:
    order: LoadOrder
    rx: RequestHandle
    blocks: list[int]
    """The blocks this load writes (from ``l1_len``): reported on failure."""
    released: threading.Event = field(default_factory=threading.Event)
    aborted: bool = False


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
class RankInfo:
    tp_rank: int
    tp_size: int
    block_size: int
    total_kv_heads: int
    cache_dtype: str = "auto"
    """vLLM's ``--kv-cache-dtype``: both sides of a pair must agree (``fp8`` against
    ``auto`` is refused when they pair, naming both)."""


class PdxferWorker:
    def __init__(
        self, cfg: ConnectorConfig, rank: RankInfo, groups: tuple[Group, ...] = ()
    ) -> None:
        self.cfg = cfg
        self.rank = rank
        self.groups = groups or (Group(0, "full", rank.block_size, ()),)
        self.hybrid = not G.streams(self.groups)
        self.parts: tuple[Part, ...] = G.parts(self.groups)
        self.ep: Endpoint | None = None
        self.transport: Any = None
        """The endpoint's transport (None: the configured one; unit tests put pdxfer's
        in-memory transport here before ``register_kv_caches``)."""
        self.layout: Layout | None = None
        self.cache: TieredCache | None = None
        self._sends: dict[str, _Out] = {}
        self._expected: dict[str, int] = {}
        """Queued prefill requests whose rooms this rank expects (``ExpectOrder``), by id."""
        self._loads: dict[str, _Load] = {}
        self._written: set[str] = set()
        self._errors: set[int] = set()
        self._failed: set[str] = set()
        """Hybrid models: requests whose load failed. vLLM takes block-level load errors
        from one KV cache group only; with several it needs the request ids
        (``failed_recving``) and fails or recomputes the whole request."""
        self._bound: PdxferMetadata | None = None
        self._pre: PdxferMetadata | None = None
        self._post: PdxferMetadata | None = None
        self.partial_blocks = False
        """Whether a block filled in part is sent for its tokens (set at registration)."""
        self.tiered: tuple[str, ...] = ()
        """A hybrid model's pools kept in and restored from L2/L3 (``groups.tiered``)."""
        self._layer_of: dict[str, int] = {}
        """vLLM's layer name -> its layer id in the pool (``layout.layer_order``)."""
        self._layer_ids: tuple[int, ...] = ()
        self._step: PdxferMetadata | None = None
        self._given: dict[str, set[int]] = {}
        """This step's layer orders: the layers handed over so far, by request."""
        self._live: set[str] = set()
        """This step's requests whose layers go one by one: their decode had asked by the
        step's first layer (or the layers are on a device). Counted as ``streamed_steps``,
        which says how often a decode's ask came early enough for streaming."""
        self._pending: list[tuple[Any, LayerOrder, int]] = []
        """Layers computed on a device, waiting for their event (GPU kernels run ahead of
        Python: a layer is handed over once its writes are done, never before)."""
        self.counters: dict[str, int] = {
            "sends": 0,
            "send_failures": 0,
            "step_chunks": 0,
            "layer_sends": 0,
            "streamed_steps": 0,
            "sent_tokens": 0,
            "loads": 0,
            "load_failures": 0,
            "loaded_tokens": 0,
            "net_bytes": 0,
            "net_us": 0,
            "ready_us": 0,
            "restore_us": 0,
            "restored_pages": 0,
            "restored_l2_pages": 0,
            "restored_l3_pages": 0,
            "repaired_tokens": 0,
            "writebacks": 0,
            "writeback_failures": 0,
        }
        self._interval: dict[str, Any] = {}
        """Counts and per-load figures since vLLM last asked (``take_interval``)."""
        self._changed = False

    # -- start ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        r = self.rank
        if all(str(t.device) == "cpu" for t in kv_caches.values()):
            hold_amx_tiles()  # before a decode's first step, a loaded one: cpu.py says why
        if self.hybrid:
            return self._register_groups(kv_caches)
        g0 = self.groups[0]
        self.layout = lay = describe(
            kv_caches,
            block_size=r.block_size,
            total_kv_heads=r.total_kv_heads,
            tp_rank=r.tp_rank,
            tp_size=r.tp_size,
            latent=g0.mla,
        )
        self._layer_of = {n: i for i, n in layer_order(list(kv_caches))}
        # a block's interior is addressable by token on a device (plain NHD/HND tiles); vLLM's
        # CPU backend packs each (block, head) tile per ISA, so a block moves whole there
        self.partial_blocks = lay.kind in (
            "HND",
            "NHD",
            "latent",
        ) and not lay.pool.location.startswith("cpu")
        self._layer_ids = tuple(sorted(set(self._layer_of.values())))
        ident = self.cfg.model_id.replace(" ", "_")
        fingerprint = (
            f"model={ident} block_size={r.block_size} kv_layout={lay.kind} "
            f"dtype={lay.pool.dtype} cache_dtype={r.cache_dtype}"
        )
        self.ep = Endpoint(
            self.cfg.endpoint_config(r.tp_rank, r.tp_size, fingerprint),
            [lay.pool],
            transport=self.transport,
        )
        if self.cfg.side == "decode" and self.cfg.l2_pages > 0:
            self.cache = TieredCache(
                [lay.pool],
                host_pages=self.cfg.l2_pages,
                storage=self._storage(),
                model_id=fingerprint,
                salt=f"tp{r.tp_rank}/{r.tp_size}",
            )
        log.info(
            "pdxfer %s rank %d/%d: %d-byte blocks (%s, %d buffers), endpoint %s%s",
            self.cfg.side,
            r.tp_rank,
            r.tp_size,
            lay.block_bytes,
            lay.kind,
            len(lay.pool.buffers),
            self.ep.endpoint_id,
            f", L2 {self.cfg.l2_pages} pages, L3 {self.cfg.l3}" if self.cache else "",
        )

    def _register_groups(self, kv_caches: dict[str, Any]) -> None:
        """A hybrid model: one pool per group (``groups.py``), each from its own layers'
        tensors (groups overlay one allocation; pdxfer registers each region once)."""
        r = self.rank
        pools, kinds = [], []
        for g in self.groups:
            mine = {n: kv_caches[n] for n in g.layers}
            if g.kind == "state":
                first = next(iter(mine.values()))
                t = first[0] if isinstance(first, (list, tuple)) else first
                pool = describe_state(
                    mine,
                    name=g.pool,
                    num_blocks=int(t.shape[0]),
                    page_bytes=g.page_bytes,
                    split=g.split,
                    tp_rank=r.tp_rank,
                    tp_size=r.tp_size,
                )
                kind = "state"
            else:
                lay = describe(
                    mine,
                    block_size=g.block_size,
                    total_kv_heads=r.total_kv_heads,
                    tp_rank=r.tp_rank,
                    tp_size=r.tp_size,
                    name=g.pool,
                    latent=g.mla,
                )
                pool, kind = lay.pool, lay.kind
            pools.append(pool)
            kinds.append(f"{g.pool}={g.kind}:{g.window}:{g.block_size}:{kind}:{pool.dtype}")
        self.layout = Layout(pools[0], "hybrid", sum(p.item_bytes * len(p.buffers) for p in pools))
        self._stream_layers()
        ident = self.cfg.model_id.replace(" ", "_")
        fingerprint = f"model={ident} groups={','.join(kinds)} cache_dtype={r.cache_dtype}"
        self.ep = Endpoint(
            self.cfg.endpoint_config(r.tp_rank, r.tp_size, fingerprint),
            pools,
            transport=self.transport,
        )
        if self.cfg.side == "decode" and self.cfg.l2_pages > 0:
            self._group_tiers(dict(zip((g.pool for g in self.groups), pools)), fingerprint)
        log.info(
            "pdxfer %s rank %d/%d: groups %s; rooms per request %d; endpoint %s",
            self.cfg.side,
            r.tp_rank,
            r.tp_size,
            "; ".join(g.describe() for g in self.groups),
            len(self.parts),
            self.ep.endpoint_id,
        )

    def _group_tiers(self, pools: dict[str, Any], fingerprint: str) -> None:
        """Decode-side tiers for a hybrid model: its full-attention groups only
        (``groups.tiered`` says why the others always come from the prefill)."""
        r, keep = self.rank, G.tiered(self.groups)
        rest = ", ".join(g.describe() for g in self.groups if g not in keep)
        if keep:
            try:
                self.cache = TieredCache(
                    [pools[g.pool] for g in keep],
                    host_pages=self.cfg.l2_pages,
                    storage=self._storage(),
                    model_id=fingerprint,
                    salt=f"tp{r.tp_rank}/{r.tp_size}",
                )
            except ConfigError as e:
                log.warning(
                    "pdxfer: decode-side tiers (l2_pages) are not used for this model: %s", e
                )
                return
            self.tiered = tuple(g.pool for g in keep)
        log.log(
            logging.INFO if keep else logging.WARNING,
            "pdxfer: decode-side tiers restore %s; %s always load from the prefill (a "
            "window block is not kept once the window passed it; a Mamba/linear state "
            "is sound only at a position the prefill checkpointed, so none is saved)",
            ", ".join(g.describe() for g in keep) or "no group of this model",
            rest,
        )

    def _stream_layers(self) -> None:
        """A hybrid model's layers that stream (``send_by: layer``): those of its full and
        window groups, each layer id naming one pool. Where ids collide across pools
        (layer names without one number), nothing streams: each request goes at its end."""
        of: dict[str, int] = {}
        for g in self.groups:
            if g.kind != "state":
                of.update({n: i for i, n in layer_order(list(g.layers))})
        if len(set(of.values())) != len(of):
            log.info(
                "pdxfer: layer ids of this model's groups collide; hybrid requests are "
                "sent at their end, not layer by layer"
            )
            return
        self._layer_of = of
        self._layer_ids = tuple(sorted(of.values()))

    def _storage(self) -> StorageBackend | None:
        c, r = self.cfg, self.rank
        if c.l3 == "file":
            # one folder per rank: each rank's pages hold its own heads
            root = os.path.join(c.l3_dir, f"tp{r.tp_rank}of{r.tp_size}")
            return FileStorage(root, max_bytes=int(c.l3_max_gb * (1 << 30)) or None)
        if c.l3 == "mooncake":
            from pdxfer.tiers import MooncakeStoreStorage

            return MooncakeStoreStorage(
                c.l3_mooncake,
                c.l3_mooncake_metadata,
                host=c.get("host"),
                segment_bytes=c.l3_mooncake_segment_mb << 20,
            )
        return None

    # -- each step -----------------------------------------------------------------------------
    def take(self, meta: PdxferMetadata) -> None:
        """Carry out one step's orders that concern KV computed in earlier steps, blocks not
        yet read, or rooms (called from ``start_load_kv`` and ``wait_for_save``, whichever
        comes first)."""
        if meta is self._bound:
            return
        self._bound = meta
        self._changed |= meta.orders()
        self.before_forward(meta)
        for e in meta.expects:
            self._expect(e)
        for a in meta.aborts:
            self._abort(a)
        for o in meta.opens:
            self._open(o)
        for s in meta.sends:
            self._hand(s, owned=True)
        for lo in meta.loads:
            self._load(lo)
        for w in meta.writebacks:
            self._write_back(w)

    def before_forward(self, meta: PdxferMetadata) -> None:
        """Before the step's forward writes: rooms of preempted requests end, and their
        writes drain (vLLM freed those blocks and may fill them in this very step)."""
        if meta is self._pre:
            return
        self._pre = meta
        for a in meta.aborts:
            if not a.held:
                self._abort(a)

    def after_forward(self, meta: PdxferMetadata) -> None:
        """After the step's forward: hand the sender what it computed (a hand-off: the
        writes run on pdxfer's threads while the next steps compute). Layers the forward
        did not report (``save_layer``) go now, and a room's last layer ends its send."""
        if meta is self._post:
            return
        self._post = meta
        self.take(meta)
        for c in meta.chunks:
            self._hand(c, owned=False)
        self._flush(wait=True)
        if meta is not self._step:
            self._given = {}  # no layer of this step was reported
        for o in meta.layers:
            self._rest(o)
        self._step, self._given, self._live = None, {}, set()

    def save_layer(self, meta: PdxferMetadata, name: str, kv_layer: Any) -> None:
        """One layer of the step is computed: hand its part of each layer order to the
        sender (``send_by: layer``; called from ``save_kv_layer``, inside the forward).

        Only for rooms a decode has asked for: a layer handed to a room nobody asked for yet
        cannot leave before the forward ends anyway, and each hand-off costs the engine
        thread time inside the forward while the request's answer waits for the step
        (measured: docs/performance-history.md#where-the-layer-by-layer-time-went-traced-2026-11-26). Under vLLM's own proxy the decode asks
        only after the prefill's answer, so every room is such a room: its layers go after
        the forward, in one hand-off (``after_forward``). Layers computed on a device are
        still handed over one by one, once their kernels are done."""
        lid = self._layer_of.get(name)
        if lid is None or not meta.layers:
            return
        event = _event(kv_layer)
        if meta is not self._step:
            self._step, self._given = meta, {}
            self.take(meta)
            self._live = {o.req_id for o in meta.layers if event is not None or self._asked(o)}
        for o in meta.layers:
            if event is not None:
                self._pending.append((event, o, lid))
            elif self._asked(o):
                self._give(o, lid, lid + 1)
        self._flush(wait=False)

    def _asked(self, o: LayerOrder) -> bool:
        """Whether a decode has asked for ``o``'s room (a layer handed now can leave now)."""
        out = self._sends.get(o.req_id)
        return out is not None and out.tx is not None and out.tx.prefix_len is not None

    def _flush(self, wait: bool) -> None:
        """Hand over device-computed layers whose writes are done (all of them: ``wait``)."""
        while self._pending:
            event, o, lid = self._pending[0]
            if not wait and not event.query():
                return
            event.synchronize()
            self._pending.pop(0)
            self._give(o, lid, lid + 1)

    def _take_layers(
        self, o: LayerOrder, a: int, b: int
    ) -> tuple[_Out, list[int], bool, bool] | None:
        """Mark layers ``[a, b)`` of ``o`` given, opening its room if need be: its sender
        record, the layers new to it, whether they are its first and whether every layer is
        now given; None when there is nothing to send (no sender, ended, nothing new)."""
        out = self._sends.get(o.req_id)
        if out is None:
            out = self._open(OpenOrder(o.req_id, o.room, o.peer))
        given = self._given.setdefault(o.req_id, set())
        ids = [x for x in self._layer_ids if a <= x < b and x not in given]
        if out.tx is None or out.last or not ids:
            return None
        first = not given
        given.update(ids)
        return out, ids, first, len(given) == len(self._layer_ids)

    def _give(self, o: LayerOrder, a: int, b: int) -> None:
        """Hand the sender layers ``[a, b)`` of ``o``; the room's last send is the one that
        completes every layer of the prompt's last tokens."""
        if o.groups:
            return self._give_groups(o, a, b)
        taken = self._take_layers(o, a, b)
        if taken is None:
            return
        out, ids, first, done = taken
        bs = self.rank.block_size
        t0 = out.tokens
        # a block the step fills in part: its tokens, where a block's interior is addressable
        # by token; else (vLLM's CPU tiles are packed per ISA) the block waits to be complete
        t1 = o.end if o.last or self.partial_blocks else o.end // bs * bs
        last = o.last and done
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
            self._add("layer_sends")
            if first and o.req_id in self._live:
                self._add("streamed_steps")
        if not done:
            return
        out.tokens = max(t0, t1)
        out.sent, out.last = out.tokens // bs, last
        if last:
            self._add("sends")
            self._add("sent_tokens", o.end)
        elif t1 > t0:
            self._add("step_chunks")

    def _give_groups(self, o: LayerOrder, a: int, b: int) -> None:
        """``_give`` for a hybrid model: each room (``groups.Part``) gets the pages of its
        groups that hold layers ``[a, b)``, for the tokens the step computed (a window
        group's only from ``groups.stream_start``: blocks vLLM may free before the request
        ends never go). A room of full and window groups ends with the prompt's last step;
        one with a state group at the request's end (``_hand_groups``: the state is final
        only after the whole forward of the last step)."""
        taken = self._take_layers(o, a, b)
        if taken is None:
            return
        out, ids, first, done = taken
        mine = set(ids)
        moved: list[tuple[int, int, bool]] = []
        try:
            for i, (part, tx) in enumerate(zip(self.parts, out.senders())):
                if out.part_last[i]:
                    continue
                t0, t1 = out.part_tokens[i], _part_end(part, o)
                last = o.last and done and not any(g.kind == "state" for g in part.groups)
                real = t1 > t0 and t1 > G.stream_start(part, o.num_tokens)
                moved.append((i, t1 if real else t0, last))
                pools = [
                    g
                    for g in part.groups
                    if g.kind != "state" and any(self._layer_of.get(n) in mine for n in g.layers)
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
                    self._add("layer_sends")
                elif last:
                    tx.send({}, last=True)  # its pools' layers were all given before
        except Exception as e:  # noqa: BLE001 - one bad room fails that request only
            log.warning("room %d (request %s): cannot send: %s", o.room, o.req_id, e)
            for tx in out.senders():
                tx.abort(f"cannot send: {e}")
            out.last = True
            return
        if first and o.req_id in self._live:
            self._add("streamed_steps")
        if not done:
            return
        advanced = any(t > out.part_tokens[i] for i, t, _ in moved)
        for i, t, last in moved:
            out.part_tokens[i], out.part_last[i] = t, last
        out.last = all(out.part_last)
        if out.last:
            self._add("sends")
            self._add("sent_tokens", o.end)
        elif advanced:
            self._add("step_chunks")

    def _rest(self, o: LayerOrder) -> None:
        """Hand over the layers of ``o`` the forward did not report, in contiguous runs."""
        given = self._given.get(o.req_id, set())
        run: list[int] = []
        for x in self._layer_ids:
            if x in given:
                if run:
                    self._give(o, run[0], run[-1] + 1)
                run = []
            else:
                run.append(x)
        if run:
            self._give(o, run[0], run[-1] + 1)

    def _expect(self, e: ExpectOrder) -> None:
        """Declare a queued request's room: a decode that asks before vLLM schedules it
        waits for it (``Endpoint.expect``)."""
        assert self.ep is not None
        try:
            for part in self.parts:
                self.ep.expect(part.room(e.room), e.peer)
        except Exception as ex:  # noqa: BLE001 - its decode falls back to the grace
            log.warning("room %d (request %s): cannot expect it: %s", e.room, e.req_id, ex)
            return
        self._expected[e.req_id] = e.room

    def _open(self, o: OpenOrder) -> _Out:
        assert self.ep is not None
        self._expected.pop(o.req_id, None)  # the endpoint forgets it when the room opens
        tx: KVSender | None = None
        others: list[KVSender] = []
        try:
            tx = self.ep.sender(o.room, peer=o.peer)
            others = [self.ep.sender(p.room(o.room), peer=o.peer) for p in self.parts[1:]]
        except Exception as e:  # noqa: BLE001 - one bad room fails that request only
            log.warning("room %d (request %s): cannot open: %s", o.room, o.req_id, e)
            self._add("send_failures")
            for t in [tx, *others]:
                if t is not None:
                    t.abort(f"cannot open: {e}")
            tx, others = None, []
        n = len(self.parts)
        out = self._sends[o.req_id] = _Out(
            o.room, tx, others=others, part_tokens=[0] * n, part_last=[False] * n
        )
        return out

    def _hand(self, s: SendOrder, owned: bool) -> None:
        """Hand the sender the blocks of ``s`` it does not have yet."""
        out = self._sends.get(s.req_id)
        if out is None:
            out = self._open(OpenOrder(s.req_id, s.room, s.peer))
        out.owned |= owned
        if s.groups:
            self._hand_groups(out, s)
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
            self._add("step_chunks")
        else:
            self._add("sends")
            self._add("sent_tokens", s.num_tokens)

    def _hand_groups(self, out: _Out, s: SendOrder) -> None:
        """A hybrid model's send at the request's end: each room (``groups.Part``) not ended
        by the stream gets its groups' pages from where the stream stopped, clipped
        (``groups.source_pages``), and its state slots."""
        if out.tx is None or out.last:
            return
        out.last = True
        try:
            for i, (part, tx) in enumerate(zip(self.parts, out.senders())):
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
        self._add("sends")
        self._add("sent_tokens", s.num_tokens)

    def _abort(self, a: AbortOrder) -> None:
        """End a room whose request vLLM aborted or preempted. Blocks vLLM already freed
        (not ``held``) may be filled by this step's forward: wait for writes that read them
        (bounded by ``abort_timeout_s``); held ones are reported once no write reads them."""
        room = self._expected.pop(a.req_id, None)
        if room is not None:  # ended while queued: a decode waiting for the room fails now
            assert self.ep is not None
            for part in self.parts:
                self.ep.withdraw(part.room(room), "aborted by vLLM while queued")
        out = self._sends.get(a.req_id)
        if out is None:
            return
        for tx in out.senders():
            tx.abort("vLLM ended the request" if a.held else "vLLM preempted the request")
        if a.held:
            out.owned = True
            return
        del self._sends[a.req_id]
        end = time.monotonic() + self.cfg.get("abort_timeout_s")
        while _reading(out) and time.monotonic() < end:
            time.sleep(0.001)
        if _reading(out):
            log.warning(
                "room %d (request %s): writes still read its blocks %.1f s after its preemption",
                out.room,
                a.req_id,
                self.cfg.get("abort_timeout_s"),
            )

    def _load(self, o: LoadOrder) -> None:
        assert self.ep is not None
        if o.groups:
            return self._load_groups(o)
        bs = self.rank.block_size
        blocks = list(o.block_ids[o.l1_len // bs : -(-o.num_tokens // bs)])
        rec: _Load | None = None

        def release(*_: Any) -> None:
            if rec is not None:
                rec.released.set()
            else:
                early.set()

        early = threading.Event()
        try:
            rx: RequestHandle
            if self.cache is not None:
                rx = RestoringReceiver(
                    self.cache,
                    self.ep,
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
                )
            else:
                rx = self.ep.receiver(
                    o.room, o.bootstrap, instance=o.instance, release=release, early=o.early
                )
                rx.request({POOL: blocks}, prefix_len=o.l1_len, num_tokens=o.num_tokens)
        except Exception as e:  # noqa: BLE001 - the request fails, vLLM recomputes it
            log.warning("room %d (request %s): cannot start the load: %s", o.room, o.req_id, e)
            rx = _Refused(o.room, e)
            early.set()
        rec = _Load(o, rx, blocks)
        if early.is_set():
            rec.released.set()
        self._add("loads")
        self._loads[o.req_id] = rec

    def _load_groups(self, o: LoadOrder) -> None:
        """A hybrid model's load: one receiver per room (``groups.Part``), each asking for
        its groups' blocks from the first token the decode holds a block for (a window
        group's earlier blocks are vLLM's null block) and its state slots."""
        assert self.ep is not None
        plans: list[tuple[Part, dict[str, list[int]], dict[str, int], int]] = []
        blocks: list[int] = []
        try:
            for part in self.parts:
                pages: dict[str, list[int]] = {}
                slots: dict[str, int] = {}
                start = o.l1_len
                for g in part.groups:
                    ids = o.groups[g.index]
                    if g.kind == "state":
                        slots[g.pool] = G.state_slot(g, ids)
                        continue
                    f = o.l1_len // g.block_size
                    if g.kind == "window":
                        f = G.window_start(g, ids, f, o.num_tokens)  # type: ignore[assignment]
                        if f is None:
                            raise ValueError(
                                f"{g.pool}: a null block inside the window ({list(ids)})"
                            )
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
            self._add("loads")
            self._loads[o.req_id] = rec
            return
        joined = _Joined(o.room, len(plans))
        try:
            for part, pages, slots, start in plans:
                rx: Any
                if part.key == 0 and self.cache is not None and o.tokens and self.tiered:
                    # its full groups' prefix from L2/L3, the rest (and the state) over the
                    # network; the other rooms (windows) always over the network
                    rx = RestoringReceiver(
                        self.cache,
                        self.ep,
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
                    )
                    joined.parts.append(rx)
                    continue
                rx = self.ep.receiver(
                    part.room(o.room),
                    o.bootstrap,
                    instance=o.instance,
                    release=joined.release_one,
                    early=o.early,
                )
                joined.parts.append(rx)
                rx.request(pages, slots=slots, prefix_len=start, num_tokens=o.num_tokens)
        except Exception as e:  # noqa: BLE001 - the request fails, vLLM recomputes it
            log.warning("room %d (request %s): cannot start the load: %s", o.room, o.req_id, e)
            joined.refuse(e, len(plans) - len(joined.parts))
        rec = _Load(o, joined, blocks, released=joined.released)
        self._add("loads")
        self._loads[o.req_id] = rec

    def _write_back(self, w: WritebackOrder) -> None:
        if self.cache is None:  # a hybrid model's tiers refused at start-up (logged then)
            self._written.add(w.req_id)
            return
        try:
            pages = (
                {POOL: list(w.block_ids)}
                if not w.groups
                else {g.pool: list(w.groups[g.index]) for g in self.groups if g.pool in self.tiered}
            )
            self.cache.write_back(w.tokens, pages, len(w.tokens), w.scope)
            self._add("writebacks")
        except Exception as e:  # noqa: BLE001 - a cache problem never fails a request
            self._add("writeback_failures")
            log.warning("write-back of request %s failed: %s", w.req_id, e)
        self._written.add(w.req_id)

    def get_finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str], set[str]]:
        finished_req_ids = list(finished_req_ids)
        meta = self._bound
        if (
            meta is not None
            and meta.idle
            and not finished_req_ids
            and not meta.orders()
            and (self._loads or self._sends)
        ):
            self._idle_wait()
        for rid in finished_req_ids:
            rec = self._loads.get(rid)
            if rec is not None and not rec.rx.poll().terminal:
                rec.aborted = True  # vLLM dropped the request while its KV was on the way
                rec.rx.abort("vLLM finished the request while its KV was on the way")
        sending, self._written = set(self._written), set()
        for rid, out in list(self._sends.items()):
            st = _send_over(out)
            if st is None:
                continue
            if st == KVPoll.Failed and out.tx is not None:
                self._add("send_failures")
                log.info("request %s: send failed: %s", rid, out.tx.failure)
            sending.add(rid)
            del self._sends[rid]
        recving: set[str] = set()
        for rid, rec in list(self._loads.items()):
            st = _load_over(rec)
            if st is None:
                continue
            if st == KVPoll.Success:
                self._loaded(rec)
            else:
                self._add("load_failures")
                if not rec.aborted:
                    log.warning(
                        "request %s (room %d): KV load failed: %s; its %d blocks go "
                        "back to vLLM as load errors",
                        rid,
                        rec.order.room,
                        rec.rx.failure,
                        len(rec.blocks),
                    )
                if self.hybrid:
                    self._failed.add(rid)
                else:
                    self._errors.update(rec.blocks)
            recving.add(rid)
            del self._loads[rid]
        if sending or recving or self._changed:
            self._changed = False
            self._write_stats()
        return sending, recving

    def _idle_wait(self) -> None:
        """Wait up to ``IDLE_WAIT_S`` for something to report (a step that computes nothing:
        otherwise vLLM runs the next one at once, and the next, taking a core)."""
        end = time.monotonic() + IDLE_WAIT_S
        while not self._reportable() and time.monotonic() < end:
            time.sleep(IDLE_POLL_S)

    def _reportable(self) -> bool:
        """Whether ``get_finished`` would report something now."""
        return bool(
            self._written
            or self._errors
            or self._failed
            or any(_send_over(o) is not None for o in self._sends.values())
            or any(_load_over(r) is not None for r in self._loads.values())
        )

    def _loaded(self, rec: _Load) -> None:
        add = self._add
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
        self._interval.setdefault("ready_seconds", []).append(float(ready_s))
        self._interval.setdefault("load_bytes", []).append(net)

    def _add(self, key: str, n: int = 1) -> None:
        self.counters[key] += n
        self._interval[key] = self._interval.get(key, 0) + n

    def take_interval(self) -> dict[str, Any] | None:
        """What was counted since the last call (vLLM asks after every step), or None."""
        if not any(self._interval.values()):
            return None
        out, self._interval = self._interval, {}
        return out

    def load_errors(self) -> set[int]:
        out, self._errors = self._errors, set()
        return out

    def failed_loads(self) -> set[str]:
        """Requests whose load failed since the last call (hybrid models)."""
        out, self._failed = self._failed, set()
        return out

    # -- introspection and end -----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "role": self.cfg.side,
            "instance": self.cfg.instance,
            "tp_rank": self.rank.tp_rank,
            **self.counters,
            "in_flight_sends": len(self._sends),
            "in_flight_loads": len(self._loads),
        }
        if self.ep is not None:
            out["endpoint"] = self.ep.metrics()
        if self.cache is not None:
            out["tiers"] = self.cache.stats()
        return out

    def _write_stats(self) -> None:
        """Rewrite the stats file (when something changed: a request's KV was ordered,
        sent, loaded or written back)."""
        if not self.cfg.stats_file:
            return
        path = self.cfg.stats_file
        if self.rank.tp_size > 1:
            path = f"{path}.tp{self.rank.tp_rank}"
        try:
            d = os.path.dirname(os.path.abspath(path))
            fd, tmp = tempfile.mkstemp(dir=d, prefix=".pdxfer-stats")
            with os.fdopen(fd, "w") as f:
                json.dump(self.stats(), f, default=str)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("cannot write stats to %s: %s", path, e)

    def close(self) -> None:
        self._write_stats()
        for rec in self._loads.values():
            if not rec.rx.poll().terminal:
                rec.rx.abort("vLLM is shutting down")
        if self.cache is not None:
            self.cache.close()
            if self.cache.storage is not None:
                self.cache.storage.close()
        if self.ep is not None:
            self.ep.close()


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
        self.parts: list[Any] = []
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
        secs = [x.get("seconds") for x in st if x.get("seconds") is not None]
        return {
            "bytes": sum(int(x.get("bytes") or 0) for x in st),
            "seconds": max(secs) if secs else None,
        }


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


def _load_over(rec: _Load) -> KVPoll | None:
    """How a load ended, once vLLM may be told: Success, or Failed with no write left that
    could land in its blocks (``released``); None before."""
    st = rec.rx.poll()
    if st == KVPoll.Success or (st == KVPoll.Failed and rec.released.is_set()):
        return st
    return None


def _event(kv_layer: Any) -> Any:
    """None for a layer already in memory (CPU: the forward wrote it before returning); on a
    device, an event recorded after the layer's writes on the current stream."""
    if getattr(kv_layer, "is_cuda", False):
        import torch

        event = torch.cuda.Event()
        event.record()
        return event
    return None
