"""The connector's worker side: one rank, its step, and what it reports to vLLM.

``register_kv_caches`` starts the rank (``rank.py``: pools and ``Endpoint``), its decode tiers
(``decode_tiers.py``) and its two halves, each handed what it shares (``RankKV``, the
tiers, the counters) through its constructor: the sender (``sender.py``, a prefill) and the
loader (``loader.py``, a decode). Each step vLLM calls the connector several times with the
same orders (``metadata.py``); ``Phase`` says how far the step went, so each stage runs once
and in order. ``get_finished`` reports what ended and rewrites the stats file
(``stats_file.py``). Every wait is pdxfer's, with its deadline (``bootstrap_timeout_s``,
``transfer_timeout_s``).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Iterable
from typing import Any

from pdxfer import Endpoint

from .config import ConnectorConfig
from .counters import Counters
from .cpu import hold_amx_tiles
from .decode_tiers import DecodeTiers
from .decode_tiers import build as build_tiers
from .groups import Group
from .layout import Interior, Layout
from .loader import DecodeLoader
from .metadata import PdxferMetadata
from .rank import RankInfo, RankKV, register
from .sender import PrefillSender
from .stats_file import StatsFile

log = logging.getLogger(__name__)

__all__ = ["IDLE_POLL_S", "IDLE_WAIT_S", "Phase", "PdxferWorker", "RankInfo"]

IDLE_WAIT_S = 0.005
"""How long a step that computes nothing waits in ``get_finished`` for a transfer to end
(vLLM's engine loop steps without pause while a request waits for its KV or a finished
one's blocks are sent); a request that arrives meanwhile waits at most this long
(docs/performance-history.md#where-the-layer-by-layer-time-went-traced-2026-11-26)."""

IDLE_POLL_S = 0.0005
"""How often that wait looks at the transfers."""


class Phase(enum.IntEnum):
    """How far the worker carried out one step's orders. vLLM reaches a stage from several
    calls (``start_load_kv``, each layer's ``wait_for_layer_load``, ``wait_for_save``); a
    call that finds the step at or past its stage does nothing, one ahead of it runs the
    stages before first."""

    NEW = 0
    """The step's orders arrived; nothing done."""
    CLEARED = 1
    """Preempted requests' rooms ended and their writes drained: the forward may write
    the blocks vLLM freed."""
    ORDERED = 2
    """The step's orders carried out (rooms, sends of earlier steps' KV, loads,
    write-backs)."""
    LAYERS = 3
    """The forward reported a computed layer (``send_by: layer``)."""
    SAVED = 4
    """After the forward: what the step computed is with the sender."""


class PdxferWorker:
    def __init__(
        self, cfg: ConnectorConfig, rank: RankInfo, groups: tuple[Group, ...] = ()
    ) -> None:
        self.cfg = cfg
        self.rank = rank
        self.groups = groups or (Group(0, "full", rank.block_size, ()),)
        self.transport: Any = None
        """The endpoint's transport (None: the configured one; unit tests put pdxfer's
        in-memory transport here before ``register_kv_caches``)."""
        self.interior: Interior | None = None
        """How the kernel lays a block out by token (``tiles.interior``, set by the
        connector): with it, a peer of another block size maps blocks token by token."""
        self.counts = Counters()
        """What the sender and the loader counted (``counters.py``)."""
        self.stats_file = StatsFile(cfg.stats_file, rank, cfg.dp_rank, cfg.dp_size)
        self.kv: RankKV | None = None
        """Set by ``register_kv_caches``, with the tiers and both halves."""
        self.tiers = DecodeTiers(None)
        self.sender: PrefillSender | None = None
        self.loader: DecodeLoader | None = None
        self._meta: PdxferMetadata | None = None
        """The step under way (vLLM hands every call of a step the same object)."""
        self._phase = Phase.NEW
        self._changed = False
        """A request's KV was ordered since the stats file was last written."""

    @property
    def ep(self) -> Endpoint | None:
        return self.kv.ep if self.kv is not None else None

    @property
    def counters(self) -> dict[str, int]:
        """Every count since the rank started (its stats file's figures)."""
        return self.counts.totals

    @property
    def layout(self) -> Layout | None:
        return self.kv.layout if self.kv is not None else None

    # -- start ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if all(str(t.device) == "cpu" for t in kv_caches.values()):
            hold_amx_tiles()  # before a decode's first step, a loaded one: cpu.py says why
        self.kv = kv = register(
            self.cfg, self.rank, self.groups, kv_caches, self.transport, self.interior
        )
        self.tiers = build_tiers(kv)
        self.sender = PrefillSender(kv, self.counts)
        self.loader = DecodeLoader(kv, self.tiers, self.counts)
        r, lay = self.rank, kv.layout
        if kv.hybrid:
            log.info(
                "pdxfer %s rank %d/%d: groups %s; rooms per request %d; endpoint %s",
                self.cfg.side,
                r.tp_rank,
                r.tp_size,
                "; ".join(g.describe() for g in kv.groups),
                len(kv.parts),
                kv.ep.endpoint_id,
            )
            return
        log.info(
            "pdxfer %s rank %d/%d: %d-byte blocks (%s, %d buffers), endpoint %s%s",
            self.cfg.side,
            r.tp_rank,
            r.tp_size,
            lay.block_bytes,
            lay.kind,
            len(lay.pool.buffers),
            kv.ep.endpoint_id,
            f", L2 {self.cfg.l2_pages} pages, L3 {self.cfg.l3}" if self.tiers.cache else "",
        )

    def _halves(self) -> tuple[PrefillSender, DecodeLoader]:
        if self.sender is None or self.loader is None:
            raise RuntimeError("vLLM ran a step before register_kv_caches")
        return self.sender, self.loader

    # -- each step -----------------------------------------------------------------------------
    def before_forward(self, meta: PdxferMetadata) -> None:
        """Before the step's forward writes: rooms of preempted requests end, and their
        writes drain (vLLM freed those blocks and may fill them in this very step)."""
        self._advance(meta, Phase.CLEARED)

    def run_orders(self, meta: PdxferMetadata) -> None:
        """Carry out the step's orders that concern KV computed in earlier steps, blocks not
        yet read, or rooms (from ``start_load_kv`` and ``wait_for_save``, whichever comes
        first)."""
        self._advance(meta, Phase.ORDERED)

    def save_layer(self, meta: PdxferMetadata, name: str, kv_layer: Any) -> None:
        """One layer of the step is computed: hand its part of each layer order to the
        sender (``send_by: layer``; from ``save_kv_layer``, inside the forward; see
        ``PrefillSender.layer_computed`` for which rooms get it now)."""
        sender, _ = self._halves()
        lid = sender.layer_id(name)
        if lid is None or not meta.layers:
            return
        event = _event(kv_layer)
        self._advance(meta, Phase.ORDERED)
        if self._phase == Phase.SAVED:
            return  # the step's layers all went after its forward
        if self._phase == Phase.ORDERED:
            self._phase = Phase.LAYERS
            sender.begin_layers(meta.layers, on_device=event is not None)
        sender.layer_computed(meta.layers, lid, event)

    def after_forward(self, meta: PdxferMetadata) -> None:
        """After the step's forward: hand the sender what it computed (a hand-off: the
        writes run on pdxfer's threads while the next steps compute). Layers the forward
        did not report (``save_layer``) go now, and a room's last layer ends its send."""
        self._advance(meta, Phase.SAVED)

    def _advance(self, meta: PdxferMetadata, to: Phase) -> None:
        """Run the stages of ``meta``'s step after the one it reached, up to ``to``."""
        sender, loader = self._halves()
        if meta is not self._meta:
            self._meta, self._phase = meta, Phase.NEW
            sender.forget_layers()
        if self._phase < Phase.CLEARED <= to:
            self._phase = Phase.CLEARED
            for a in meta.aborts:
                if not a.held:
                    sender.abort(a)
        if self._phase < Phase.ORDERED <= to:
            self._phase = Phase.ORDERED
            self._changed |= meta.orders()
            for e in meta.expects:
                sender.expect(e)
            for a in meta.aborts:  # held ones end now; the others ended at CLEARED (again:
                # a room expected just above for one is withdrawn)
                sender.abort(a)
            for o in meta.opens:
                sender.open(o)
            for s in meta.sends:
                sender.send_blocks(s, owned=True)
            for lo in meta.loads:
                loader.load(lo)
            for w in meta.writebacks:
                loader.write_back(w)
        if self._phase < Phase.SAVED <= to:
            self._phase = Phase.SAVED
            for c in meta.chunks:
                sender.send_blocks(c, owned=False)
            sender.end_layers(meta.layers)

    # -- what ended ----------------------------------------------------------------------------
    def get_finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str], set[str]]:
        """Sends that ended (write-backs too: their blocks are free again) and loads that
        ended, once vLLM may have their blocks back."""
        if self.sender is None or self.loader is None:
            return set(), set()  # not registered yet: nothing can have moved
        sender, loader = self.sender, self.loader
        finished_req_ids = list(finished_req_ids)
        meta = self._meta if self._phase >= Phase.ORDERED else None
        if (
            meta is not None
            and meta.idle
            and not finished_req_ids
            and not meta.orders()
            and (loader.in_flight or sender.in_flight)
        ):
            self._idle_wait(sender, loader)
        loader.abort_dropped(finished_req_ids)
        sending = loader.take_written() | sender.finished()
        recving = loader.finished()
        if sending or recving or self._changed:
            self._changed = False
            self.stats_file.write(self.stats)
        return sending, recving

    def _idle_wait(self, sender: PrefillSender, loader: DecodeLoader) -> None:
        """Wait up to ``IDLE_WAIT_S`` for something to report (a step that computes nothing:
        otherwise vLLM runs the next one at once, and the next, taking a core)."""
        end = time.monotonic() + IDLE_WAIT_S
        while not (loader.reportable() or sender.reportable()) and time.monotonic() < end:
            time.sleep(IDLE_POLL_S)

    def take_interval(self) -> dict[str, Any] | None:
        """What was counted since the last call (vLLM asks after every step), or None."""
        return self.counts.take_interval()

    def load_errors(self) -> set[int]:
        return self.loader.load_errors() if self.loader is not None else set()

    def failed_loads(self) -> set[str]:
        """Requests whose load failed since the last call (hybrid models)."""
        return self.loader.failed_loads() if self.loader is not None else set()

    # -- introspection and end -----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "role": self.cfg.side,
            "instance": self.cfg.instance,
            "tp_rank": self.rank.tp_rank,
            "dp_rank": self.cfg.dp_rank,
            **self.counts.totals,
            "in_flight_sends": self.sender.in_flight if self.sender is not None else 0,
            "in_flight_loads": self.loader.in_flight if self.loader is not None else 0,
        }
        if self.kv is not None:
            out["endpoint"] = self.kv.ep.metrics()
        tiers = self.tiers.stats()
        if tiers is not None:
            out["tiers"] = tiers
        return out

    def close(self) -> None:
        self.stats_file.write(self.stats)
        if self.loader is not None:
            self.loader.abort_all()
        self.tiers.close()
        if self.kv is not None:
            self.kv.ep.close()


def _event(kv_layer: Any) -> Any:
    """None for a layer already in memory (CPU: the forward wrote it before returning); on a
    device, an event recorded after the layer's writes on the current stream."""
    if getattr(kv_layer, "is_cuda", False):
        import torch

        event = torch.cuda.Event()
        event.record()
        return event
    return None
