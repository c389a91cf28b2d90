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
import json
import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch
from aiohttp import web

from ..endpoint import Endpoint
from ..pools import PoolSpec
from ..states import EndpointConfig
from .errors import BadRequest, OutOfCapacity, ServingError
from .kv import KVPool
from .model import ToyConfig, ToyModel, make_draft

log = logging.getLogger("pdxfer.serving")

AUX_WIDTH = 8
"""int32 words per aux row: [first token, prompt length, reserved...]."""
READY = "PDXFER_READY"
"""Printed on stdout with the worker's URL once it serves: launchers wait for this line."""


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
    prefix_cache_pages: int = 512
    bootstrap_timeout_s: float = 30.0
    transfer_timeout_s: float = 60.0
    heartbeat_s: float = 0.5

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {self.role!r}")
        if self.role == "prefill" and not self.bootstrap:
            raise ValueError("a prefill worker needs --bootstrap (host:port of the bootstrap)")
        for name in ("pages", "aux_slots", "page_size", "max_seq_len", "chunk_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")

    def toy(self) -> ToyConfig:
        return ToyConfig(seed=self.seed, page_size=self.page_size, max_seq_len=self.max_seq_len)


def config_from_args(a: argparse.Namespace, role: str) -> WorkerConfig:
    return WorkerConfig(
        role=role, host=a.host, port=a.port, bootstrap=a.bootstrap, instance=a.instance,
        pages=a.pages, aux_slots=a.aux_slots, seed=a.seed, page_size=a.page_size,
        max_seq_len=a.max_seq_len, chunk_size=a.chunk_size,
        prefix_cache_pages=a.prefix_cache_pages, bootstrap_timeout_s=a.bootstrap_timeout,
        transfer_timeout_s=a.transfer_timeout, heartbeat_s=a.heartbeat)


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


class ModelHost:
    """Target and draft models, their KV pools (sharing page ids), the aux rows, and the
    rank's endpoint. ``lock`` serialises model compute: one forward at a time per worker."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.model = ToyModel(cfg.toy())
        self.draft = make_draft(self.model)
        self.kv: KVPool = self.model.new_kv_pool(cfg.pages)
        self.draft_kv: KVPool = self.draft.new_kv_pool(cfg.pages, allocator=self.kv.allocator)
        self.aux = torch.zeros((cfg.aux_slots, AUX_WIDTH), dtype=torch.int32)
        self.slots = SlotAllocator(cfg.aux_slots)
        self.lock = threading.Lock()
        ps = cfg.page_size
        pools = [
            PoolSpec.mha("kv", self.kv.k_tensors, self.kv.v_tensors, page_size=ps),
            PoolSpec.mha("draft_kv", self.draft_kv.k_tensors, self.draft_kv.v_tensors,
                         page_size=ps, indices_from="kv"),
            PoolSpec.slots("aux", [self.aux]),
        ]
        self.endpoint = Endpoint(EndpointConfig(
            role=cfg.role, bootstrap=cfg.bootstrap if cfg.role == "prefill" else None,
            instance=cfg.instance, host=cfg.host, bootstrap_timeout_s=cfg.bootstrap_timeout_s,
            transfer_timeout_s=cfg.transfer_timeout_s, heartbeat_s=cfg.heartbeat_s), pools)

    def info(self) -> dict[str, Any]:
        c = self.model.config
        return {"role": self.cfg.role, "max_seq_len": c.max_seq_len, "page_size": c.page_size,
                "free_pages": self.kv.allocator.num_free, "pages": self.cfg.pages,
                "weights": self.model.weights_digest()[:16], "pid": os.getpid()}


# -- HTTP helpers ------------------------------------------------------------------------------
def error_response(err: BaseException) -> web.Response:
    status = err.status if isinstance(err, ServingError) else 500
    kind = getattr(err, "kind", type(err).__name__)
    return web.json_response({"error": {"message": str(err), "type": kind}}, status=status)


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


def field(body: dict[str, Any], name: str, kind: type, *, default: Any = ...,
          lo: int | None = None, hi: int | None = None) -> Any:
    """One typed field; bools are not ints here (JSON ``true`` is not a token count)."""
    if name not in body:
        if default is ...:
            raise BadRequest(f"missing field {name!r}")
        return default
    v = body[name]
    if isinstance(v, bool) and kind is not bool or not isinstance(v, kind):
        raise BadRequest(f"field {name!r} must be {kind.__name__}, got {type(v).__name__}")
    if lo is not None and v < lo or hi is not None and v > hi:
        raise BadRequest(f"field {name!r} = {v} outside [{lo}, {hi}]")
    return v


def token_list(body: dict[str, Any], name: str, vocab: int) -> list[int]:
    v = field(body, name, list)
    if not v:
        raise BadRequest(f"{name!r} is empty")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in v):
        raise BadRequest(f"{name!r} must be token ids in [0, {vocab})")
    return v


def metrics_text(prefix: str, values: dict[str, Any]) -> str:
    """Prometheus text exposition of flat numeric values."""
    lines = []
    for k, v in sorted(values.items()):
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            name = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in f"{prefix}_{k}")
            lines.append(f"{name} {v}")
    return "\n".join(lines) + "\n"


async def poll_until_terminal(handle: Any, deadline_s: float) -> None:
    """Poll a sender/receiver from the event loop without blocking it."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    delay = 0.0005
    while not handle.poll().terminal:
        if loop.time() > end:
            handle.abort(f"worker deadline of {deadline_s} s passed")
            return
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.01)


def serve(app: web.Application, host: str, port: int, on_stop: Any = None) -> int:
    """Run ``app`` until SIGINT/SIGTERM; print the ready line with the bound URL."""

    async def main() -> None:
        runner = web.AppRunner(app, handle_signals=True)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1]
        print(f"{READY} http://{host}:{bound}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        import signal

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    try:
        asyncio.run(main())
    finally:
        if on_stop is not None:
            on_stop()
    sys.stdout.flush()
    return 0
