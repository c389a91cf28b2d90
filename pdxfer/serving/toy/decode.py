"""``pdxfer decode``: receives a prompt's KV from a prefill and generates the completion.

Flow per request: admission (pages and an aux slot, waiting in a bounded queue; 503 when
full) -> a ``RestoringReceiver`` (``pdxfer.tiers``: the prefix held in L2 host DRAM or L3
storage is restored while the network brings only the rest, and whatever the restore cannot
deliver is repaired from the prefill) -> poll -> the first token from the aux row -> the
scheduler's loop generates it step by step with every other running request
(``scheduler.py``) -> events stream back to the client.

Page lifetime: before the transfer succeeded, a request's pages come back only through the
receiver's ``release`` callback (fail-closed: no late write can land in a page another
request uses); afterwards only the scheduler's loop frees them, once it dropped the request,
so a cancelled generation can never write into pages that were handed out again. A client
that disconnects (streaming or not) cancels its request on both workers.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import threading
import time
from typing import Any

from aiohttp import web

from pdxfer import ConfigError, KVPoll, PdxferError, UntrustedBootstrap, trusted_bootstrap
from pdxfer.tiers import TieredCache

from ..errors import BadRequest, Forbidden, OutOfCapacity, TransferFailed
from ..errors import about as _about
from .ballast import BallastMismatch
from .ranks import check, open_receiver, start_host, write_back
from .sampling import parse_sampling
from .scheduler import Generation, Scheduler
from .tiered import make_cache
from .worker import (
    Admission,
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

log = logging.getLogger(__name__)
MAX_SPEC_K = 8


class _Req:
    """One request's pages and aux slot; ``free`` runs exactly once, from whichever path
    ends the request (the receiver's release, or the scheduler's end)."""

    def __init__(self, host: ModelHost, pages: list[int], slot: int) -> None:
        self.host, self.pages, self.slot = host, pages, slot
        self._lock = threading.Lock()
        self.freed = False

    def free(self, *_: Any) -> None:
        with self._lock:
            if self.freed:
                return
            self.freed = True
        self.host.kv.allocator.free(self.pages)
        self.host.slots.free(self.slot)


class _Cancel:
    """What ``/abort`` finds for a room that is generating."""

    def __init__(self, g: Generation, sched: Scheduler) -> None:
        self.g, self.sched = g, sched

    def abort(self, reason: str = "") -> None:
        self.g.cancel.set()
        self.sched.wake()


class DecodeWorker(RoomWorker):
    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.host = start_host(cfg)
        self.cache: TieredCache | None = make_cache(cfg, self.host)
        self.admission = Admission(self.host, cfg.max_waiting, cfg.admission_timeout_s)
        self.scheduler = Scheduler(self.host, cfg.min_step_s)
        self.live: dict[int, Any] = {}
        self.aborted: collections.OrderedDict[int, str] = collections.OrderedDict()
        self.counters = collections.Counter[str]()

    async def h_health(self, request: web.Request) -> web.Response:
        # ``peer``: what rooms are bound to (the instance name its TP ranks share, or its
        # endpoint id); ``dp``: which of a ``--dp`` front's groups this is
        return self.health(
            {
                "endpoint": self.host.endpoint.endpoint_id,
                "peer": self.host.peer,
                "instance": self.cfg.instance,
                "dp": self.cfg.dp_rank,
                "running": self.scheduler.active,
                "waiting": self.admission.waiting,
            }
        )

    metrics_prefix = "pdxfer_decode"

    def _handles(self) -> Any:
        return self.live

    def _metric_values(self) -> dict[str, Any]:
        vals = {
            **self.counters,
            "inflight": len(self.live),
            "free_pages": self.host.kv.allocator.num_free,
            "running": self.scheduler.active,
            "waiting": self.admission.waiting,
            "decode_steps": self.scheduler.steps,
            "rejected": self.admission.rejected,
        }
        if self.cache is not None:
            vals.update({f"tiers_{k.replace('.', '_')}": v for k, v in self.cache.stats().items()})
        return vals

    def close(self) -> None:
        self.scheduler.close()
        if self.host.ranks is not None:
            self.host.ranks.close()
        if self.cache is not None:
            self.cache.close()  # background L3 writes finish: a restart finds them
            if self.cache.storage is not None:
                self.cache.storage.close()
        self.host.endpoint.close()

    def _parse(self, body: dict[str, Any]) -> dict[str, Any]:
        c = self.host.model.config
        p = {
            "room": field(body, "room", int, lo=0, hi=(1 << 63) - 1),
            "bootstrap": self._bootstrap(body),
            "instance": field(body, "instance", str, default=None)
            if body.get("instance") is not None
            else None,
            "tokens": token_list(body, "prompt_ids", c.vocab_size),
            "max_tokens": field(body, "max_tokens", int, lo=1, hi=c.max_seq_len),
            "stream": field(body, "stream", bool, default=False),
            "spec_k": field(body, "spec_k", int, default=0, lo=0, hi=MAX_SPEC_K),
            "sampling": parse_sampling(body),
            "tenant": field(body, "tenant", str, default=""),
        }
        if len(p["tenant"]) > 128:
            raise BadRequest("field 'tenant' is longer than 128 characters")
        if p["spec_k"] and not p["sampling"].greedy:
            raise BadRequest("speculative decoding is greedy only: use temperature 0")
        span = len(p["tokens"]) + p["max_tokens"] + p["spec_k"]
        if span > c.max_seq_len:
            raise BadRequest(
                f"prompt ({len(p['tokens'])}) + max_tokens ({p['max_tokens']})"
                f" + spec_k ({p['spec_k']}) = {span} exceeds max_seq_len "
                f"{c.max_seq_len}"
            )
        return p

    def _bootstrap(self, body: dict[str, Any]) -> str:
        """The request's bootstrap server (default: the first trusted one), which must be one
        this decode trusts: a caller never chooses which prefill's KV it decodes from.
        Refused before any connection; malformed is a 400, untrusted a counted 403."""
        raw = body.get("bootstrap")
        if raw is None:
            return self.cfg.trusted[0]
        try:
            return trusted_bootstrap(raw, self.cfg.trusted, "field 'bootstrap'")
        except UntrustedBootstrap as e:
            self.counters["untrusted_bootstraps_refused"] += 1
            log.warning("decode request refused: %s", e)
            raise Forbidden(str(e)) from None
        except ConfigError as e:
            raise BadRequest(str(e)) from None

    async def h_generate(self, request: web.Request) -> web.StreamResponse:
        t_arrive = time.perf_counter()
        self.counters["requests"] += 1
        try:
            p = self._parse(await read_json(request))
            check(self.host)
            if p["room"] in self.aborted:
                raise TransferFailed(f"room {p['room']}: {self.aborted.pop(p['room'])}")
            h = self.host
            pages, slot = await self.admission.acquire(
                h.model.pages_for(len(p["tokens"]) + p["max_tokens"] + p["spec_k"])
            )
        except (PdxferError, ValueError) as e:
            return self._failed(e)
        req = _Req(h, pages, slot)
        try:
            stats = await self._receive(p, req, t_arrive)
        except (PdxferError, ValueError) as e:
            return self._failed(e)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        def emit(ev: dict[str, Any]) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ev)

        g = Generation(
            p["room"],
            p["tokens"],
            stats["first"],
            p["max_tokens"],
            p["sampling"],
            req.pages,
            emit,
            lambda g: self._ended(g, p, req, stats),
            spec_k=p["spec_k"],
        )
        self.live[p["room"]] = _Cancel(g, self.scheduler)
        self.scheduler.add(g)
        try:
            if p["stream"]:
                return await self._stream(request, events)
            return await self._collect(g, events)
        finally:
            # a client that went away (cancelled handler, reset stream) stops the request;
            # the loop frees its pages once it dropped it
            g.cancel.set()
            self.scheduler.wake()
            self.live.pop(p["room"], None)

    def _failed(self, e: BaseException) -> web.Response:
        self.counters[f"failures_{getattr(e, 'kind', 'error')}"] += 1
        log.log(
            logging.WARNING if isinstance(e, OutOfCapacity) else logging.INFO,
            "decode request failed: %s",
            e,
        )
        return error_response(e)

    async def _receive(self, p: dict[str, Any], req: _Req, t_arrive: float) -> dict[str, Any]:
        """Restore the cached prefix while the network brings the rest; returns with the
        first token, or raises (the request's pages then belong to the release path)."""
        h, room, tokens = self.host, p["room"], p["tokens"]
        n = len(tokens)
        t_request = time.perf_counter()
        try:
            rx = open_receiver(
                h,
                self.cache,
                room,
                p["bootstrap"],
                p["instance"],
                tokens,
                req.pages[: h.model.pages_for(n)],
                req.slot,
                n,
                p["tenant"],
                req.free,
            )
        except BaseException:
            req.free()
            raise
        self.live[room] = rx
        try:
            await poll_until_terminal(
                rx, self.cfg.bootstrap_timeout_s + self.cfg.transfer_timeout_s
            )
        except BaseException:  # cancelled by a client that left
            if rx.poll() == KVPoll.Success:
                req.free()  # the transfer is over: the pages are ours to free
            else:
                rx.abort("the decode's client went away")  # pages come back via release
            raise
        finally:
            self.live.pop(room, None)
        if rx.poll() != KVPoll.Success:
            raise TransferFailed(_about(room, rx.failure))
        # the decode's wait for the prompt's KV: from asking for it (restore and network
        # both started) to the whole prompt in place
        kv_wait_s = time.perf_counter() - t_request
        st = rx.stats()
        if h.ballast is not None:
            self._check_ballast(room, tokens, req)
        out: dict[str, Any] = {
            "first": int(h.aux[req.slot, 0]),
            "restored_tokens": 0,
            "restored_l2_tokens": 0,
            "restored_l3_tokens": 0,
            "bytes": int(st.get("bytes") or 0),
            "ttft_s": time.perf_counter() - t_arrive,
            "kv_wait_s": kv_wait_s,
        }
        for k in ("local", "net"):  # a RestoringReceiver's parts of the wait
            if st.get(f"{k}_seconds") is not None:
                out[f"kv_{k}_s"] = float(st[f"{k}_seconds"])
        if self.cache is not None:  # a RestoringReceiver (on every rank: their minimum)
            ps = self.cache.page_size
            good, l2 = rx.restored_pages, int(st["l2_pages"])
            out.update(
                restored_tokens=good * ps,
                restored_l2_tokens=min(good, l2) * ps,
                restored_l3_tokens=max(0, good - l2) * ps,
                bytes=int(st["net_bytes"] or 0) + int(st["repair_bytes"] or 0),
                repaired_tokens=int(st.get("repaired_tokens") or 0),
            )
            if "ranks" in st:  # TP: what each rank restored and had repaired
                out["ranks"] = [
                    {
                        "restored_tokens": r["restored_pages"] * ps,
                        "repaired_tokens": r["repaired_tokens"],
                    }
                    for r in st["ranks"]
                ]
            self.counters["restored_l2_tokens"] += out["restored_l2_tokens"]
            self.counters["restored_l3_tokens"] += out["restored_l3_tokens"]
        return out

    def _check_ballast(self, room: int, tokens: list[int], req: _Req) -> None:
        """A received or restored prompt's ballast must be what its tokens give; otherwise
        the request fails (its transfer is over: its pages are ours to free)."""
        assert self.host.ballast is not None
        try:
            self.host.ballast.check(tokens, req.pages)
        except BallastMismatch as e:
            self.counters["ballast_mismatches"] += 1
            req.free()
            raise TransferFailed(f"room {room}: {e}") from None
        self.counters["ballast_checked_tokens"] += len(tokens)

    def _ended(self, g: Generation, p: dict[str, Any], req: _Req, stats: dict[str, Any]) -> None:
        """On the scheduler's loop, once it dropped the request: keep the prompt's pages in
        the tiers (L1 to L2 now, L2 to L3 in the background), free them, then tell the client
        how it ended."""
        if self.cache is not None and g.error is None:
            try:
                write_back(
                    self.host, self.cache, p["tokens"], req.pages, len(p["tokens"]), p["tenant"]
                )
            except Exception as e:  # noqa: BLE001 - a cache problem never fails a request
                log.warning("prefix write-back failed: %s", e)
        req.free()
        if g.error is not None:
            self.counters["failures_generation"] += 1
            g.emit({"error": {"message": f"room {g.room}: {g.error}", "type": "generation"}})
            return
        if g.finish_reason == "cancelled":
            self.counters["cancelled"] += 1
        else:
            self.counters["success"] += 1
        g.emit({"done": True, **self._result(g, p, stats)})

    def _result(self, g: Generation, p: dict[str, Any], stats: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "room": g.room,
            "finish_reason": g.finish_reason,
            "prompt_tokens": len(g.prompt),
            "completion_tokens": len(g.out),
            "restored_tokens": stats["restored_tokens"],
            "restored_l2_tokens": stats["restored_l2_tokens"],
            "restored_l3_tokens": stats["restored_l3_tokens"],
            "bytes": stats["bytes"],
            "ttft_s": stats["ttft_s"],
            **{
                k: stats[k]
                for k in ("repaired_tokens", "ranks", "kv_wait_s", "kv_local_s", "kv_net_s")
                if k in stats
            },
            "queued_steps": (g.first_step - g.added_step) if g.first_step is not None else 0,
            "end_step": g.end_step,
        }
        if g.spec is not None:
            acc = g.spec.accepted
            out["accept_lengths"] = acc
            out["mean_accept_length"] = sum(acc) / len(acc) if acc else 0.0
        return out

    async def _collect(self, g: Generation, events: asyncio.Queue[dict[str, Any]]) -> web.Response:
        tokens: list[int] = []
        logprobs: list[Any] = []
        while True:
            ev = await events.get()
            if "error" in ev:
                return error_response(TransferFailed(ev["error"]["message"]))
            if ev.get("done"):
                res = {k: v for k, v in ev.items() if k != "done"}
                res["token_ids"] = tokens
                if g.sampling.logprobs is not None:
                    res["logprobs"] = logprobs
                return web.json_response(res)
            tokens += ev["token_ids"]
            logprobs += ev.get("logprobs", [])

    async def _stream(
        self, request: web.Request, events: asyncio.Queue[dict[str, Any]]
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        while True:
            ev = await events.get()
            await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
            if ev.get("done") or "error" in ev:
                break
        await resp.write_eof()
        return resp


def run(a: argparse.Namespace) -> int:
    cfg = config_from_args(a, "decode")
    w = DecodeWorker(cfg)
    return serve(
        w.app(),
        cfg.host,
        cfg.port,
        on_stop=w.close,
        advertise=cfg.advertise,
        what=f"{cfg.role} worker",
    )
