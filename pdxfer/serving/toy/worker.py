"""What the prefill and decode workers share: model and pools, config, HTTP plumbing.

A worker process hosts the toy model (target plus draft) with paged KV pools and one pdxfer
``Endpoint`` for its tensor-parallel rank (TP=1 here: the pools are whole, and a TP>1
worker would start one such process per rank with head-sharded pools). The pools
registered with the endpoint are the model's own tensors, so a transfer writes straight
into the pages attention reads.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch
from aiohttp import web

from pdxfer import Endpoint, EndpointConfig, PoolSpec, load_secret

from ..errors import BadRequest, OutOfCapacity
from ..http import (  # noqa: F401  (re-exported for the worker modules)
    READY,
    error_response,
    field,
    metrics_text,
    poll_until_terminal,
    read_json,
    router_only,
    serve,
    token_list,
)
from .kv import KVPool, OutOfPagesError
from .model import ToyConfig, ToyModel, make_draft

log = logging.getLogger("pdxfer.serving")

AUX_WIDTH = 8
"""int32 words per aux row: [first token, prompt length, reserved...]."""


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One worker's settings, validated at construction."""

    role: str
    host: str = "127.0.0.1"
    port: int = 0
    bootstrap: str | None = None
    instance: str = "default"
    pages: int = 1024
    aux_slots: int = 64
    seed: int = 0
    page_size: int = 16
    max_seq_len: int = 1024
    chunk_size: int = 64
    l2_pages: int = 512
    l3: str = "file"
    l3_dir: str = ""
    l3_max_bytes: int = 4 << 30
    l3_mooncake: str = ""
    l3_mooncake_metadata: str = ""
    l3_mooncake_segment_bytes: int = 256 << 20
    kv_landing: str = "device"
    integrity: str = "sampled"
    integrity_retry: bool = False
    transport: str = "tcp"
    device: str = ""
    bootstrap_timeout_s: float = 30.0
    transfer_timeout_s: float = 60.0
    heartbeat_s: float = 0.5
    threads: int = 1
    max_waiting: int = 256
    admission_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {self.role!r}")
        if self.role == "prefill" and not self.bootstrap:
            raise ValueError("a prefill worker needs --bootstrap (host:port of the bootstrap)")
        for name in ("pages", "aux_slots", "page_size", "max_seq_len", "chunk_size", "threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")
        if self.l2_pages < 0:
            raise ValueError(f"l2_pages must be >= 0, got {self.l2_pages}")
        if self.l3 not in ("file", "mooncake", "off"):
            raise ValueError(f"l3 must be file, mooncake or off, got {self.l3!r}")
        if self.l3 == "mooncake" and not (self.l3_mooncake and self.l3_mooncake_metadata):
            raise ValueError("Mooncake Store as L3 needs the master (--l3-mooncake HOST:PORT) "
                             "and its metadata URL (--l3-mooncake-metadata)")
        if self.integrity not in ("sampled", "full", "off"):
            raise ValueError(f"integrity must be sampled, full or off, got {self.integrity!r}")
        if self.kv_landing not in ("device", "host"):
            raise ValueError(f"kv_landing must be device or host, got {self.kv_landing!r}")
        if self.kv_landing == "host" and self.role != "decode":
            raise ValueError("--kv-landing host is a decode option")

    @property
    def token_granular(self) -> bool:
        """Host landing: the pool is token-granular (page size 1) with the same capacity,
        and accepts a prefill of any page size (``page_remap``)."""
        return self.kv_landing == "host"

    @property
    def pool_page_size(self) -> int:
        return 1 if self.token_granular else self.page_size

    @property
    def pool_pages(self) -> int:
        return self.pages * self.page_size if self.token_granular else self.pages

    def toy(self) -> ToyConfig:
        return ToyConfig(seed=self.seed, page_size=self.pool_page_size,
                         max_seq_len=self.max_seq_len)


def default_l3_dir() -> str:
    """Where a decode keeps L3 files unless told (``$XDG_CACHE_HOME/pdxfer/l3``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pdxfer", "l3")


def config_from_args(a: argparse.Namespace, role: str) -> WorkerConfig:
    dec = role == "decode"
    l3 = ("off" if not dec or a.no_l3 else "mooncake" if a.l3_mooncake else "file")
    return WorkerConfig(
        role=role, host=a.host, port=a.port, bootstrap=a.bootstrap, instance=a.instance,
        pages=a.pages, aux_slots=a.aux_slots, seed=a.seed, page_size=a.page_size,
        max_seq_len=a.max_seq_len, chunk_size=a.chunk_size,
        l2_pages=a.l2_pages, l3=l3,
        l3_dir=(a.l3_dir or default_l3_dir()) if dec else "",
        l3_max_bytes=int(a.l3_max_gb * (1 << 30)) if dec else 0,
        l3_mooncake=a.l3_mooncake if dec else "",
        l3_mooncake_metadata=a.l3_mooncake_metadata if dec else "",
        l3_mooncake_segment_bytes=int(a.l3_mooncake_segment_mb) << 20 if dec else 0,
        kv_landing=a.kv_landing if dec else "device", transport=a.transport, device=a.device,
        integrity=a.integrity if dec else "sampled",
        integrity_retry=a.integrity_retry if dec else False,
        bootstrap_timeout_s=a.bootstrap_timeout,
        transfer_timeout_s=a.transfer_timeout, heartbeat_s=a.heartbeat, threads=a.threads,
        max_waiting=a.max_waiting, admission_timeout_s=a.admission_timeout)


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
    is ``OutOfCapacity`` (HTTP 503 with Retry-After), never a failed request."""

    def __init__(self, host: ModelHost, max_waiting: int, timeout_s: float) -> None:
        self.host, self.max_waiting, self.timeout_s = host, max_waiting, timeout_s
        self.waiting = 0
        self.rejected = 0

    async def acquire(self, n_pages: int) -> tuple[list[int], int]:
        h = self.host
        if n_pages > h.cfg.pool_pages:
            raise BadRequest(f"the request needs {n_pages} pages; this worker has "
                             f"{h.cfg.pool_pages} in all")
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
        raise OutOfCapacity(f"no {n_pages} free pages and an aux slot within "
                            f"{self.timeout_s} s")

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
    rank's endpoint. ``lock`` serialises model compute: one forward at a time per worker."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        torch.set_num_threads(cfg.threads)
        self.model = ToyModel(cfg.toy())
        self.draft = make_draft(self.model)
        self.kv: KVPool = self.model.new_kv_pool(cfg.pool_pages)
        self.draft_kv: KVPool = self.draft.new_kv_pool(cfg.pool_pages,
                                                       allocator=self.kv.allocator)
        self.aux = torch.zeros((cfg.aux_slots, AUX_WIDTH), dtype=torch.int32)
        self.slots = SlotAllocator(cfg.aux_slots)
        self.lock = threading.Lock()
        ps, remap = cfg.pool_page_size, cfg.token_granular
        self.pools = [
            PoolSpec.mha("kv", self.kv.k_tensors, self.kv.v_tensors, page_size=ps,
                         page_remap=remap),
            PoolSpec.mha("draft_kv", self.draft_kv.k_tensors, self.draft_kv.v_tensors,
                         page_size=ps, indices_from="kv", page_remap=remap),
            PoolSpec.slots("aux", [self.aux]),
        ]
        pools = self.pools
        c = self.model.config
        # what the model computes, not how its KV is paged: a prefill and a decode with
        # different page sizes (host landing) are the same model
        self.fingerprint = (f"model=toy seed={c.seed} max_seq_len={c.max_seq_len} "
                            f"layers={c.n_layers} d_model={c.d_model} "
                            f"weights={self.model.weights_digest()[:16]}")
        self.endpoint = Endpoint(EndpointConfig(
            model_id=self.fingerprint,
            role=cfg.role, bootstrap=cfg.bootstrap if cfg.role == "prefill" else None,
            instance=cfg.instance, host=cfg.host, bootstrap_timeout_s=cfg.bootstrap_timeout_s,
            transfer_timeout_s=cfg.transfer_timeout_s, heartbeat_s=cfg.heartbeat_s,
            transport=cfg.transport, device=cfg.device, integrity=cfg.integrity,  # type: ignore[arg-type]
            integrity_retry=cfg.integrity_retry), pools)

    def info(self) -> dict[str, Any]:
        c = self.model.config
        return {"role": self.cfg.role, "max_seq_len": c.max_seq_len, "page_size": c.page_size,
                "kv_landing": self.cfg.kv_landing,
                "free_pages": self.kv.allocator.num_free, "pages": self.cfg.pool_pages,
                "weights": self.model.weights_digest()[:16], "pid": os.getpid()}




class RoomWorker:
    """What both workers share: ``/abort`` by room and ``/metrics``.

    Subclasses name their live request handles (``_handles``) and their own numbers
    (``_metric_values``); the endpoint's metrics (failures by kind, phase timelines) follow.
    """

    metrics_prefix = "pdxfer_worker"
    host: ModelHost
    aborted: Any

    def app(self) -> web.Application:
        app = web.Application(client_max_size=8 << 20,
                              middlewares=[router_only(load_secret())])
        app.router.add_post("/generate", self.h_generate)  # type: ignore[attr-defined]
        app.router.add_post("/abort", self.h_abort)
        app.router.add_get("/health", self.h_health)  # type: ignore[attr-defined]
        app.router.add_get("/metrics", self.h_metrics)
        return app

    def _handles(self) -> Any:
        raise NotImplementedError

    def _metric_values(self) -> dict[str, Any]:
        raise NotImplementedError

    async def h_metrics(self, request: web.Request) -> web.Response:
        text = (metrics_text(self.metrics_prefix, self._metric_values())
                + self.host.endpoint.prometheus().decode())
        return web.Response(text=text)

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
