"""What the prefill and decode workers share: model and pools, HTTP plumbing.

Their settings are ``WorkerConfig`` (``config.py``, re-exported here).

A worker process hosts the toy model (target plus draft) with paged KV pools and one pdxfer
``Endpoint`` for its tensor-parallel rank. At ``--tp N`` the worker's front is rank 0 and
starts one process per other rank (``ranks.py``); each rank's pools hold only its KV heads
and its endpoint registers only those. The pools registered with the endpoint are the
model's own tensors, so a transfer writes straight into the pages attention reads.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch
from aiohttp import web

from pdxfer import Endpoint, EndpointConfig, PoolSpec
from pdxfer.trust import load_secret

from ..errors import BadRequest, OutOfCapacity
from ..http import (  # noqa: F401  (re-exported for the worker modules)
    READY,
    error_response,
    field,
    merge_metrics,
    metrics_text,
    poll_until_terminal,
    read_json,
    router_only,
    serve,
    token_list,
)
from . import ballast
from .config import WorkerConfig, config_from_args, default_l3_dir  # noqa: F401  (re-exported)
from .kv import KVPool, OutOfPagesError
from .model import Gather, ToyModel, make_draft

log = logging.getLogger(__name__)

AUX_WIDTH = 8
"""int32 words per aux row: [first token, prompt length, reserved...]."""


@dataclass(frozen=True, slots=True)
class LayerIds:
    """The KV pools' layer ids: the target model's ``[0, target)``, then the draft's, then
    the ballast's (if any), ``total`` in all; ``rest``: the layers that are not the
    target's (the prefill sends them after each chunk's draft pass)."""

    target: int
    total: int

    @property
    def rest(self) -> tuple[int, int]:
        return self.target, self.total


class SlotAllocator:
    """Free list of aux rows; all-or-nothing like the page allocator."""

    def __init__(self, n: int) -> None:
        self._free = list(range(n))
        self._lock = threading.Lock()

    def alloc(self) -> int:
        with self._lock:
            if not self._free:
                raise OutOfCapacity("no free aux slot: too many requests in flight")
            return self._free.pop()

    def free(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)


class Admission:
    """Pages and an aux slot for a request, waiting up to ``timeout_s`` while others finish,
    with at most ``max_waiting`` requests waiting: beyond that, or past the wait, the answer
    is ``OutOfCapacity`` (HTTP 503 with Retry-After), never a failed request.

    Each worker admits on its own, so the prefill asks only for rooms whose decode already
    admitted the request and asked for its KV (``prefill.py``): its pages are then never
    held by a request that waits for the decode's, and the two pools cannot deadlock."""

    def __init__(self, host: ModelHost, max_waiting: int, timeout_s: float) -> None:
        self.host, self.max_waiting, self.timeout_s = host, max_waiting, timeout_s
        self.waiting = 0
        self.rejected = 0

    def check(self, n_pages: int) -> None:
        """Refuse at once a request no wait could admit."""
        if n_pages > self.host.cfg.pool_pages:
            raise BadRequest(
                f"the request needs {n_pages} pages; this worker has "
                f"{self.host.cfg.pool_pages} in all"
            )

    async def acquire(self, n_pages: int) -> tuple[list[int], int]:
        self.check(n_pages)
        got = self._try(n_pages)
        if got is not None:
            return got
        if self.waiting >= self.max_waiting:
            self.rejected += 1
            raise OutOfCapacity(f"{self.waiting} requests already wait for pages; try later")
        self.waiting += 1
        try:
            loop = asyncio.get_running_loop()
            end = loop.time() + self.timeout_s
            delay = 0.002
            while loop.time() < end:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.02)
                got = self._try(n_pages)
                if got is not None:
                    return got
        finally:
            self.waiting -= 1
        self.rejected += 1
        raise OutOfCapacity(f"no {n_pages} free pages and an aux slot within {self.timeout_s} s")

    def _try(self, n_pages: int) -> tuple[list[int], int] | None:
        h = self.host
        try:
            pages = h.kv.allocator.alloc(n_pages)
        except OutOfPagesError:
            return None
        try:
            return pages, h.slots.alloc()
        except OutOfCapacity:
            h.kv.allocator.free(pages)
            return None


class ModelHost:
    """Target and draft models, their KV pools (sharing page ids), the aux rows, and the
    rank's endpoint. ``lock`` serialises model compute: one forward at a time per worker.

    At TP > 1 this is one rank: its pools hold its KV heads (``head_shard``), its endpoint
    registers them as that head range, and ``gather`` joins its group's ranks. The aux rows
    are whole on every rank (a replicated slot pool, written by whichever rank the library
    asks). ``ranks`` is set on rank 0 of such a group (``ranks.Ranks``)."""

    def __init__(self, cfg: WorkerConfig, tp_rank: int = 0, gather: Gather | None = None) -> None:
        self.cfg = cfg
        self.tp_rank = tp_rank
        self.ranks: Any = None
        torch.set_num_threads(cfg.threads)
        if cfg.torch_device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"--torch-device {cfg.torch_device}: torch sees no CUDA device")
        self.model = ToyModel(
            cfg.toy(), tp_rank=tp_rank, tp_size=cfg.tp, gather=gather, device=cfg.torch_device
        )
        self.draft = make_draft(self.model)
        # the pools the forward writes live on its device; a host landing's on the host
        where = "cpu" if cfg.token_granular else cfg.torch_device
        self.kv: KVPool = self.model.new_kv_pool(cfg.pool_pages, device=where)
        self.draft_kv: KVPool = self.draft.new_kv_pool(
            cfg.pool_pages, device=where, allocator=self.kv.allocator
        )
        self.aux = torch.zeros((cfg.aux_slots, AUX_WIDTH), dtype=torch.int32)
        self.slots = SlotAllocator(cfg.aux_slots)
        self.lock = threading.Lock()
        ps, remap = cfg.pool_page_size, cfg.token_granular
        c, sh = self.model.config, self.model.shard
        total_heads, first_head = c.n_kv_heads, sh.kv_lo
        # layer ids: the target's layers, then the draft's, then the ballast, so a send of
        # some layers (the prefill streams the target's layer by layer) names them apart
        nt, nd = len(self.kv.k_tensors), len(self.draft_kv.k_tensors)
        self.pools = [
            PoolSpec.mha(
                "kv",
                self.kv.k_tensors,
                self.kv.v_tensors,
                page_size=ps,
                page_remap=remap,
                total_heads=total_heads,
                first_head=first_head,
            ),
            PoolSpec.mha(
                "draft_kv",
                self.draft_kv.k_tensors,
                self.draft_kv.v_tensors,
                page_size=ps,
                indices_from="kv",
                page_remap=remap,
                layer_ids=range(nt, nt + nd),
                total_heads=total_heads,
                first_head=first_head,
            ),
            PoolSpec.slots("aux", [self.aux]),
        ]
        self.ballast: ballast.Ballast | None = None
        nb = cfg.kv_ballast_bytes_per_token
        if nb:
            self.ballast = ballast.Ballast(nb, cfg.pool_pages, ps)
            self.pools.append(
                PoolSpec.paged(
                    "ballast",
                    [self.ballast.tensor],
                    page_size=ps,
                    role="ballast",
                    indices_from="kv",
                    layer_ids=[nt + nd],
                    page_remap=remap,
                )
            )
        self.layer_ids = LayerIds(nt, nt + nd + (self.ballast is not None))
        pools = self.pools
        # what the model computes, not how its KV is paged or sharded: a prefill and a decode
        # with different page sizes (host landing) or TP sizes are the same model
        self.weights = self.model.weights_digest()[:16]
        self.model_id = (
            f"model=toy seed={c.seed} max_seq_len={c.max_seq_len} "
            f"layers={c.n_layers} d_model={c.d_model} weights={self.weights}"
            + (f" kv_ballast={nb}" if nb else "")
        )
        # ... while what one rank holds is its heads: its tier keys (L2, and L3 objects a
        # fleet may share) name the TP size and rank, so no rank reads another's shard
        self.fingerprint = f"{self.model_id} tp={cfg.tp}/{tp_rank}"
        self.endpoint = Endpoint(
            EndpointConfig.from_flat(
                model_id=self.model_id,
                role=cfg.role,
                bootstrap=(cfg.trusted or (cfg.bootstrap,))[0],
                trusted_bootstraps=cfg.trusted,
                instance=cfg.instance,
                host=cfg.host,
                advertise=cfg.advertise,
                bootstrap_timeout_s=cfg.bootstrap_timeout_s,
                transfer_timeout_s=cfg.transfer_timeout_s,
                heartbeat_s=cfg.heartbeat_s,
                transport=cfg.transport,
                device=cfg.device,
                integrity=cfg.integrity,
                integrity_retry=cfg.integrity_retry,
                tp_rank=tp_rank,
                tp_size=cfg.tp,
            ),
            pools,
        )

    @property
    def peer(self) -> str:
        """What a prefill binds this decode's rooms to (``sender(room, peer=...)``)."""
        return self.cfg.instance if self.cfg.peer_by_instance else self.endpoint.endpoint_id

    def info(self) -> dict[str, Any]:
        c = self.model.config
        return {
            "role": self.cfg.role,
            "max_seq_len": c.max_seq_len,
            "page_size": c.page_size,
            "kv_landing": self.cfg.kv_landing,
            "free_pages": self.kv.allocator.num_free,
            "pages": self.cfg.pool_pages,
            "weights": self.weights,
            "fingerprint": self.fingerprint,
            "tp": self.cfg.tp,
            "torch_device": self.cfg.torch_device,
            "pid": os.getpid(),
        }


class RoomWorker(abc.ABC):
    """What both workers share: ``/abort`` by room and ``/metrics``.

    Subclasses serve ``/generate`` and ``/health`` and name their live request handles
    (``_handles``) and their own numbers (``_metric_values``); the endpoint's metrics
    (failures by kind, phase timelines) follow.
    """

    metrics_prefix = "pdxfer_worker"
    host: ModelHost
    aborted: Any

    def app(self) -> web.Application:
        app = web.Application(client_max_size=8 << 20, middlewares=[router_only(load_secret())])
        app.router.add_post("/generate", self.h_generate)
        app.router.add_post("/abort", self.h_abort)
        app.router.add_get("/health", self.h_health)
        app.router.add_get("/metrics", self.h_metrics)
        return app

    @abc.abstractmethod
    async def h_generate(self, request: web.Request) -> web.StreamResponse: ...

    @abc.abstractmethod
    async def h_health(self, request: web.Request) -> web.Response: ...

    @abc.abstractmethod
    def _handles(self) -> Any: ...

    @abc.abstractmethod
    def _metric_values(self) -> dict[str, Any]: ...

    async def h_metrics(self, request: web.Request) -> web.Response:
        text = (
            metrics_text(self.metrics_prefix, self._metric_values())
            + self.host.endpoint.prometheus().decode()
        )
        ranks = self.host.ranks
        if ranks is not None:  # every rank's endpoint (labelled tp_rank) and tiers
            parts: list[tuple[str, dict[str, str]]] = [(text, {})]
            for r, st in (await asyncio.to_thread(ranks.stats)).items():
                tiers = {f"tiers_{k.replace('.', '_')}": v for k, v in st["tiers"].items()}
                parts += [
                    (st["endpoint"], {}),
                    (
                        metrics_text(
                            self.metrics_prefix,
                            {**tiers, "rooms": st["rooms"]},
                            {"tp_rank": str(r)},
                        ),
                        {},
                    ),
                ]
            text = merge_metrics(parts)
        return web.Response(text=text)

    def health(self, extra: dict[str, Any]) -> web.Response:
        """``/health``: 200 while every rank lives; 503 naming the lost rank otherwise."""
        h = self.host
        body: dict[str, Any] = {"status": "ok", **h.info(), **extra}
        if h.ranks is not None:
            body["ranks"] = h.ranks.info()
            if h.ranks.broken is not None:
                body.update(status="broken", error=f"lost a TP rank: {h.ranks.broken}")
                return web.json_response(body, status=503)
        return web.json_response(body)

    async def h_abort(self, request: web.Request) -> web.Response:
        """Abort a room now, or remember it so a request that arrives later is refused."""
        try:
            body = await read_json(request)
            room = field(body, "room", int, lo=0, hi=(1 << 63) - 1)
            reason = str(body.get("reason", "aborted by router"))
        except BadRequest as e:
            return error_response(e)
        handle = self._handles().get(room)
        if handle is not None:
            handle.abort(reason)
        else:
            self.aborted[room] = reason
            while len(self.aborted) > 4096:
                self.aborted.popitem(last=False)
        return web.json_response({"room": room, "found": handle is not None})
