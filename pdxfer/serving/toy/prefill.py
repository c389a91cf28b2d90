"""``pdxfer prefill``: computes prompts and pushes their KV to the decode that asked for it.

Per request: ``sender(room)`` -> wait for the decode's ask -> pages and aux slot -> chunked
prefill, each layer sent as soon as the forward wrote it (the draft's after the chunk's draft
pass, which shares the target's page ids; with TP > 1 each chunk's pages after it) -> the last
send carries the first token in the aux row -> poll until the transfer settles -> free.
Admission order: the decode asks only once it admitted the request, and this worker takes
pages only after that ask, so every request holding prefill pages holds decode pages too and
runs to its end. Were both sides to admit on arrival, the prefill could hold A's pages
(waiting for A's decode) while the decode held B's (waiting for B's prefill), and both would
time out.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from pdxfer import KVPoll, PdxferError

from ..errors import BadRequest, OutOfCapacity, TransferFailed
from ..errors import about as _about
from .ranks import check, decode_asked, open_sender, reuse_prefix, start_host, write_back
from .sampling import Sampling, parse_sampling, sample
from .tiered import make_cache
from .worker import (
    Admission,
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


class PrefillWorker(RoomWorker):
    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.host = start_host(cfg)
        self.senders: dict[int, Any] = {}  # a KVSender, or one per TP rank as one (ranks.py)
        self.admission = Admission(self.host, cfg.max_waiting, cfg.admission_timeout_s)
        self._computing: dict[int, threading.Event] = {}
        self._holds: set[asyncio.Task[None]] = set()  # pages kept for a decode's repair
        # prompts it computed stay in L2 (pdxfer.tiers, like the decode's): a repeated prefix
        # is loaded, not recomputed, so TTFT falls with the hit length
        self.cache = make_cache(cfg, self.host)
        self.aborted: collections.OrderedDict[int, str] = collections.OrderedDict()
        self.counters = collections.Counter[str]()

    def close(self) -> None:
        if self.host.ranks is not None:
            self.host.ranks.close()
        if self.cache is not None:
            self.cache.close()
        self.host.endpoint.close()

    async def h_health(self, request: web.Request) -> web.Response:
        return self.health(
            {
                "endpoint": self.host.endpoint.endpoint_id,
                "inflight": len(self.senders),
                "computing": len(self._computing),
            }
        )

    metrics_prefix = "pdxfer_prefill"

    def _handles(self) -> Any:
        return self.senders

    def _metric_values(self) -> dict[str, Any]:
        return {
            **self.counters,
            "inflight": len(self.senders),
            "free_pages": self.host.kv.allocator.num_free,
            "waiting": self.admission.waiting,
            "rejected": self.admission.rejected,
        }

    async def h_generate(self, request: web.Request) -> web.Response:
        self.counters["requests"] += 1
        try:
            body = await read_json(request)
            room = field(body, "room", int, lo=0, hi=(1 << 63) - 1)
            tokens = token_list(body, "prompt_ids", self.host.model.config.vocab_size)
            sampling = parse_sampling(body)
            peer = (
                field(body, "decode_peer", str, default=None)
                if body.get("decode_peer") is not None
                else None
            )
            tenant = field(body, "tenant", str, default="")
            check(self.host)
            if len(tokens) > self.host.model.config.max_seq_len:
                raise BadRequest(
                    f"prompt of {len(tokens)} tokens exceeds max_seq_len "
                    f"{self.host.model.config.max_seq_len}"
                )
            out = await self._generate(room, tokens, sampling, peer, tenant)
        except (PdxferError, ValueError) as e:
            self.counters[f"failures_{getattr(e, 'kind', 'error')}"] += 1
            log.log(
                logging.WARNING if isinstance(e, OutOfCapacity) else logging.INFO,
                "prefill request failed: %s",
                e,
            )
            return error_response(e)
        self.counters["success"] += 1
        return web.json_response(out)

    async def _generate(
        self,
        room: int,
        tokens: list[int],
        sampling: Sampling,
        peer: str | None = None,
        tenant: str = "",
    ) -> dict[str, Any]:
        h = self.host
        if room in self.aborted:
            raise TransferFailed(f"room {room}: {self.aborted.pop(room)}")
        n_pages = h.model.pages_for(len(tokens))
        self.admission.check(n_pages)
        tx = open_sender(h, room, peer)  # only the decode chosen for the room
        self.senders[room] = tx
        held: tuple[list[int], int] | None = None
        try:
            try:
                # the admission order (module notes): pages only for a room the decode holds
                await self._until_decode_asked(tx)
                held = pages, slot = await self.admission.acquire(n_pages)
                if tx.poll() == KVPoll.Failed:  # aborted while it waited for pages
                    raise TransferFailed(_about(room, tx.failure))
                t0 = time.perf_counter()
                first, reused, layer_sends = await asyncio.to_thread(
                    self._compute, tx, tokens, pages, slot, sampling, tenant
                )
                compute_s = time.perf_counter() - t0
                await poll_until_terminal(
                    tx, self.cfg.bootstrap_timeout_s + self.cfg.transfer_timeout_s
                )
            except asyncio.CancelledError:  # the router's connection went away
                tx.abort("the prefill's client went away")
                raise
            except (PdxferError, ValueError) as e:  # no pages, a lost rank: the decode learns
                tx.abort(f"the prefill gave up: {e}")
                raise
            finally:
                self.senders.pop(room, None)
            if tx.poll() != KVPoll.Success:
                raise TransferFailed(_about(room, tx.failure))
            if self.cache is not None:
                await asyncio.to_thread(
                    write_back, h, self.cache, tokens, pages, len(tokens), tenant
                )
            return {
                "room": room,
                "prompt_tokens": len(tokens),
                "first_token": first,
                "compute_s": compute_s,
                "prefix_len": tx.prefix_len,
                "reused_tokens": reused,
                "layer_sends": layer_sends,
            }
        finally:
            # Source pages: a failed transfer's late reads can only spoil its own destination.
            # (A compute thread still running after a cancel stops at its next chunk; it
            # only reads its own pages, which stay allocated until it returns.)
            if held is not None:
                self._free_when_idle(tx, *held)

    async def _until_decode_asked(self, tx: Any) -> None:
        """Wait, holding no pages, until the room's decode admitted the request and asked
        for its KV. The sender's own bootstrap deadline ends a wait for a decode that never
        asks (the room fails); the loop's bound is only a backstop."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.cfg.bootstrap_timeout_s + 5.0
        delay = 0.0005
        while not decode_asked(tx):
            if loop.time() > end:
                tx.abort(f"no request from the decode within {self.cfg.bootstrap_timeout_s} s")
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.005)
        if tx.poll() == KVPoll.Failed:
            raise TransferFailed(_about(tx.room, tx.failure))

    def _free_when_idle(self, tx: Any, pages: list[int], slot: int) -> None:
        """Free a request's pages and aux row once nothing can read them: its compute thread
        returned, and its decode no longer holds the room for a repair (``tx.holding``: a
        restore that came up short, or an integrity retry, asks for a range again, and the
        prefill serves it from these very pages; they must not hold another request's KV
        before the decode's ``Release``, or its hold deadline)."""
        busy = self._computing.get(id(pages))
        # a hold ends at the decode's Release or the endpoint's hold deadline (the transfer
        # timeout, renewed by each repair); past twice that something is stuck: keep the
        # pages (a leak, logged) rather than hand out pages a repair may still read
        limit = 2 * (self.cfg.transfer_timeout_s + self.cfg.bootstrap_timeout_s)

        def free() -> None:
            self.host.kv.allocator.free(pages)
            self.host.slots.free(slot)

        def held() -> bool:
            return tx is not None and tx.holding

        def stuck() -> None:
            log.error(
                "room %d: still held for a repair after %.0f s: its %d pages are not freed",
                tx.room if tx is not None else -1,
                limit,
                len(pages),
            )

        if busy is not None and not busy.is_set():

            def later() -> None:
                busy.wait()
                end = time.monotonic() + limit
                while held():
                    if time.monotonic() > end:
                        stuck()
                        return
                    time.sleep(0.002)
                free()

            threading.Thread(target=later, daemon=True).start()
            return
        if not held():
            free()
            return

        async def after_hold() -> None:
            end = time.monotonic() + limit
            while held():
                if time.monotonic() > end:
                    stuck()
                    return
                await asyncio.sleep(0.002)
            free()

        task = asyncio.get_running_loop().create_task(after_hold())
        self._holds.add(task)
        task.add_done_callback(self._holds.discard)

    def _compute(
        self,
        tx: Any,
        tokens: Sequence[int],
        pages: list[int],
        slot: int,
        sampling: Sampling,
        tenant: str = "",
    ) -> tuple[int, int, int]:
        """Compute the prompt (restoring the prefix it computed before) and ship its KV as it
        is written: with TP 1, each target layer of a chunk as soon as the forward wrote it
        (the decode receives layer ``l`` while layer ``l + 1`` computes), the draft's layers
        after the chunk's draft pass; with TP > 1 (the ranks' sends mirror the leader's),
        each chunk's full pages after the chunk. Returns the first token, the reused tokens
        and the layer-wise sends."""
        h, ps, n = self.host, self.cfg.page_size, len(tokens)
        sent = 0
        done = self._computing[id(pages)] = threading.Event()
        start = 0
        if self.cache is not None:  # leaves the last token to compute
            start = reuse_prefix(h, self.cache, tokens, pages, tenant)
        if start:
            self.counters["reused_tokens"] += start
            sent = start // ps
            tx.send({"kv": pages[:sent]})  # restored pages are complete: ship them now
        by_layer = h.ranks is None
        given = sent * ps  # tokens every layer was given (a restored partial page goes next)
        layer_sends = 0

        def span(a: int, b: int) -> dict[str, list[int]]:
            return {"kv": pages[a // ps : -(-b // ps)]}

        def on_layer(li: int, a: int, b: int) -> None:
            nonlocal layer_sends
            tx.send(span(given, b), layers=(li, li + 1), tokens=(given, b))
            layer_sends += 1

        def on_chunk(a: int, b: int) -> None:
            nonlocal sent, given, layer_sends
            if tx.poll() == KVPoll.Failed:  # aborted (client gone, decode failed): stop
                raise TransferFailed(_about(tx.room, tx.failure))
            h.draft.forward(tokens[a:b], a, pages, h.draft_kv, logits_for="none")
            if h.ballast is not None:  # a benchmark's extra bytes per token (ballast.py)
                h.ballast.fill(tokens[a:b], a, pages)
            if by_layer:
                if b < n:  # the last chunk's rest goes with the first token (below)
                    tx.send(span(given, b), layers=h.layer_ids.rest, tokens=(given, b))
                    layer_sends += 1
                    given = b
                return
            full = b // ps
            if b < n and full > sent:
                tx.send({"kv": pages[sent:full]})
                sent = full

        try:
            with h.lock:
                first = h.model.prefill(
                    tokens,
                    pages,
                    h.kv,
                    start=start,
                    chunk_size=self.cfg.chunk_size,
                    on_chunk=on_chunk,
                    pick=lambda logits, pos: sample(logits, sampling, pos),
                    on_layer=on_layer if by_layer else None,
                )
            h.aux[slot, 0] = first
            h.aux[slot, 1] = n
            if by_layer:
                tx.send(
                    span(given, n),
                    slots={"aux": slot},
                    last=True,
                    layers=h.layer_ids.rest,
                    tokens=(given, n),
                )
                self.counters["layer_sends"] += layer_sends + 1
                self.counters["layer_streamed"] += 1
                return first, start, layer_sends + 1
            tx.send({"kv": pages[sent:]}, slots={"aux": slot}, last=True)
            return first, start, 0
        finally:
            done.set()
            self._computing.pop(id(pages), None)


def run(a: argparse.Namespace) -> int:
    cfg = config_from_args(a, "prefill")
    w = PrefillWorker(cfg)
    log.info(
        "prefill worker: endpoint %s registered with %s", w.host.endpoint.endpoint_id, cfg.bootstrap
    )
    return serve(
        w.app(),
        cfg.host,
        cfg.port,
        on_stop=w.close,
        advertise=cfg.advertise,
        what=f"{cfg.role} worker",
    )
