"""``pdxfer decode``: receives a prompt's KV from a prefill and generates the completion.

Flow per request: pages (+ aux slot) -> restore what the prefix cache holds -> ``receiver``
-> ``request(prefix_len=restored)`` so the prefill ships only the rest -> poll -> first token
from the aux row -> greedy or speculative decode over the received KV -> write the prompt's
full pages back to the prefix cache -> free. On a failed transfer the pages come back only
through the receiver's ``release`` callback (fail-closed: no late write can land in a page
that another request already uses).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from pdxfer import KVReceiver, PdxferError

from .errors import BadRequest, OutOfCapacity, TransferFailed
from .kv import OutOfPagesError
from .model import speculative_generate
from .prefix import HostPrefixCache, PrefixCache
from .worker import (
    ModelHost,
    RoomWorker,
    WorkerConfig,
    config_from_args,
    error_response,
    field,
    poll_until_terminal,
    read_json,
    serve,
    token_list,
)

log = logging.getLogger("pdxfer.serving.decode")
MAX_SPEC_K = 8


class _Req:
    """One request's resources; ``free`` runs exactly once, from success or ``release``."""

    def __init__(self, host: ModelHost, pages: list[int], slot: int) -> None:
        self.host, self.pages, self.slot = host, pages, slot
        self._lock = threading.Lock()
        self._freed = False

    def free(self, *_: Any) -> None:
        with self._lock:
            if self._freed:
                return
            self._freed = True
        self.host.kv.allocator.free(self.pages)
        self.host.slots.free(self.slot)


class DecodeWorker(RoomWorker):
    def __init__(self, cfg: WorkerConfig, prefix_cache: PrefixCache | None = None) -> None:
        self.cfg = cfg
        self.host = ModelHost(cfg)
        self.cache: PrefixCache | None = prefix_cache
        if self.cache is None and cfg.prefix_cache_pages > 0:
            self.cache = HostPrefixCache([self.host.kv, self.host.draft_kv],
                                         cfg.prefix_cache_pages)
        self.receivers: dict[int, KVReceiver] = {}
        self.aborted: collections.OrderedDict[int, str] = collections.OrderedDict()
        self.counters = collections.Counter[str]()

    async def h_health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **self.host.info()})

    metrics_prefix = "pdxfer_decode"

    def _handles(self) -> Any:
        return self.receivers

    def _metric_values(self) -> dict[str, Any]:
        vals = {**self.counters, "inflight": len(self.receivers),
                "free_pages": self.host.kv.allocator.num_free}
        if self.cache is not None:
            vals.update({f"prefix_{k}": v for k, v in self.cache.stats().items()})
        return vals

    def _parse(self, body: dict[str, Any]) -> dict[str, Any]:
        c = self.host.model.config
        p = {
            "room": field(body, "room", int, lo=0, hi=(1 << 63) - 1),
            "bootstrap": field(body, "bootstrap", str, default=self.cfg.bootstrap),
            "instance": field(body, "instance", str, default=None) if body.get("instance")
            is not None else None,
            "tokens": token_list(body, "prompt_ids", c.vocab_size),
            "max_tokens": field(body, "max_tokens", int, lo=1, hi=c.max_seq_len),
            "stream": field(body, "stream", bool, default=False),
            "spec_k": field(body, "spec_k", int, default=0, lo=0, hi=MAX_SPEC_K),
        }
        if not p["bootstrap"]:
            raise BadRequest("no bootstrap address in the request and none configured")
        span = len(p["tokens"]) + p["max_tokens"] + p["spec_k"]
        if span > c.max_seq_len:
            raise BadRequest(f"prompt ({len(p['tokens'])}) + max_tokens ({p['max_tokens']})"
                             f" + spec_k ({p['spec_k']}) = {span} exceeds max_seq_len "
                             f"{c.max_seq_len}")
        return p

    async def h_generate(self, request: web.Request) -> web.StreamResponse:
        t_arrive = time.perf_counter()
        self.counters["requests"] += 1
        try:
            p = self._parse(await read_json(request))
            req, stats = await self._prefill_part(p, t_arrive)
        except (PdxferError, ValueError) as e:
            self.counters[f"failures_{getattr(e, 'kind', 'error')}"] += 1
            log.info("decode request failed: %s", e)
            return error_response(e)
        try:
            if p["stream"]:
                return await self._stream(request, p, req, stats)
            tokens, accepted = await asyncio.to_thread(self._decode_all, p, req, stats["first"])
            self.counters["success"] += 1
            return web.json_response(self._result(p, tokens, accepted, stats))
        finally:
            self._finish(p, req)

    async def _prefill_part(self, p: dict[str, Any], t_arrive: float
                            ) -> tuple[_Req, dict[str, Any]]:
        """Reserve, restore the cached prefix, receive the rest; returns with the first token
        or raises (the request's pages then belong to the receiver's release path)."""
        h, room, tokens = self.host, p["room"], p["tokens"]
        if room in self.aborted:
            raise TransferFailed(f"room {room}: {self.aborted.pop(room)}")
        n = len(tokens)
        try:
            pages = h.kv.allocator.alloc(h.model.pages_for(n + p["max_tokens"] + p["spec_k"]))
        except OutOfPagesError as e:
            raise OutOfCapacity(str(e)) from None
        try:
            slot = h.slots.alloc()
        except OutOfCapacity:
            h.kv.allocator.free(pages)
            raise
        req = _Req(h, pages, slot)
        restored = 0
        try:
            if self.cache is not None:
                want = self.cache.match(tokens)
                if want:
                    restored = await asyncio.to_thread(self.cache.restore, tokens, want, pages)
            rx = h.endpoint.receiver(room, bootstrap=p["bootstrap"], instance=p["instance"],
                                     release=req.free)
        except Exception:
            req.free()
            raise
        self.receivers[room] = rx
        try:
            ps = self.cfg.page_size
            rx.request({"kv": pages[restored // ps: h.model.pages_for(n)]},
                       slots={"aux": slot}, prefix_len=restored, num_tokens=n)
            await poll_until_terminal(rx, self.cfg.bootstrap_timeout_s
                                      + self.cfg.transfer_timeout_s)
        finally:
            self.receivers.pop(room, None)
        if rx.poll().name != "Success":
            raise TransferFailed(f"room {room}: {rx.failure}")
        first = int(h.aux[slot, 0])
        stats = {"first": first, "restored_tokens": restored,
                 "bytes": int(rx.stats().get("bytes") or 0),
                 "ttft_s": time.perf_counter() - t_arrive}
        return req, stats

    def _decode_all(self, p: dict[str, Any], req: _Req, first: int
                    ) -> tuple[list[int], list[int] | None]:
        h, tokens = self.host, p["tokens"]
        if p["spec_k"]:
            with h.lock:
                r = speculative_generate(h.model, h.draft, tokens, p["max_tokens"],
                                         k=p["spec_k"], kv=h.kv, draft_kv=h.draft_kv,
                                         page_table=req.pages, first_token=first)
            return r.tokens, r.accepted
        out = [first]
        self._steps(p, req, out, lambda t: None)
        return out, None

    def _steps(self, p: dict[str, Any], req: _Req, out: list[int],
               emit: Callable[[int], None]) -> None:
        h, n = self.host, len(p["tokens"])
        while len(out) < p["max_tokens"]:
            with h.lock:
                t = h.model.decode_step(out[-1], n + len(out) - 1, req.pages, h.kv)
            out.append(t)
            emit(t)

    async def _stream(self, request: web.Request, p: dict[str, Any], req: _Req,
                      stats: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[int | None] = asyncio.Queue()

        async def send(obj: dict[str, Any]) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        await send({"token_ids": [stats["first"]]})
        out = [stats["first"]]
        accepted: list[int] | None = None
        try:
            if p["spec_k"]:
                out, accepted = await asyncio.to_thread(self._decode_all, p, req, out[0])
                await send({"token_ids": out[1:]})
            else:
                def emit(t: int) -> None:
                    loop.call_soon_threadsafe(q.put_nowait, t)

                def work() -> None:
                    try:
                        self._steps(p, req, out, emit)
                    finally:
                        loop.call_soon_threadsafe(q.put_nowait, None)

                fut = asyncio.ensure_future(asyncio.to_thread(work))
                while (t := await q.get()) is not None:
                    await send({"token_ids": [t]})
                await fut
            self.counters["success"] += 1
            await send({"done": True, **self._result(p, out, accepted, stats)})
        except Exception as e:  # after the first token the status is sent: report in-band
            log.warning("stream for room %d failed: %s", p["room"], e)
            await send({"error": {"message": str(e), "type": getattr(e, "kind", "error")}})
        await resp.write_eof()
        return resp

    def _finish(self, p: dict[str, Any], req: _Req) -> None:
        if self.cache is not None:
            try:
                self.cache.write_back(p["tokens"], req.pages)
            except Exception as e:  # a cache problem must never fail or leak a request
                log.warning("prefix write-back failed: %s", e)
        req.free()

    def _result(self, p: dict[str, Any], tokens: list[int], accepted: list[int] | None,
                stats: dict[str, Any]) -> dict[str, Any]:
        out = {"room": p["room"], "token_ids": tokens, "prompt_tokens": len(p["tokens"]),
               "restored_tokens": stats["restored_tokens"], "bytes": stats["bytes"],
               "ttft_s": stats["ttft_s"]}
        if accepted is not None:
            out["accept_lengths"] = accepted
            out["mean_accept_length"] = sum(accepted) / len(accepted) if accepted else 0.0
        return out


def run(a: argparse.Namespace) -> int:
    cfg = config_from_args(a, "decode")
    w = DecodeWorker(cfg)
    return serve(w.app(), cfg.host, cfg.port, on_stop=w.host.endpoint.close)
