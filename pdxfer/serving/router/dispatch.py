"""Dispatch: one choice, from its pair to its last token.

A choice waits at the door while every prefill's queue is full (``door``), takes a pair
(``pairing``), draws the room and sends the prompt to both workers at once: the prefill
computes and pushes KV, the decode waits for it and streams token events back (always: so a
stop string or a client that leaves ends the request on the workers at once). A pair that
fails before the first token is left for another; a full worker (503) sends the choice to
another pair; a bad request, or a failure once text went out, is not tried again.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import time
from typing import Any

from pdxfer.tiers import page_keys

from . import openai_api as oa
from .backends import Attempt, AttemptFailed, Backend, Decode, Done, Http, Prefill, later
from .door import Door
from .health import Health
from .kv_feed import KvFeeds
from .pairing import Pairing, usable

log = logging.getLogger(__name__)


class Dispatch:
    """Runs choices on the router's workers, with the parts it shares: the worker lists,
    the pairing, health (asked again after a failure), the door and the counters."""

    def __init__(
        self,
        prefills: list[Prefill],
        decodes: list[Decode],
        pairing: Pairing,
        health: Health,
        door: Door,
        backend: Backend,
        http: Http,
        kv: KvFeeds | None,
        counters: collections.Counter[str],
        timeout_s: float,
    ) -> None:
        self.prefills, self.decodes = prefills, decodes
        self.pairing, self.health, self.door = pairing, health, door
        self.backend, self.http, self.kv = backend, http, kv
        self.counters = counters
        self.timeout_s = timeout_s
        self._bg: set[asyncio.Future[Any]] = set()

    async def choice(
        self, ask: oa.Ask, ids: list[int], index: int, seed: int, t0: float, on_delta: Any
    ) -> oa.Choice:
        """Choice ``index`` of ``ask`` for prompt ``ids``, its text passed to ``on_delta``
        as it comes (None: only the whole); raises the last ``AttemptFailed``."""
        avoid_p: set[str] = set()
        avoid_d: set[str] = set()
        err: AttemptFailed | None = None
        tries = max(2, len(self.prefills) * len(self.decodes))
        for attempt in range(tries):
            full = await self.door.enter(usable(self.prefills, avoid_p), len(ids), self.timeout_s)
            pf, dc, pf_held, dc_held = self.pairing.pick(ids, avoid_p | full, avoid_d, ask.tenant)
            marks = (
                (self.kv.mark(pf.key), self.kv.mark(dc.key))
                if self.kv is not None
                else (None, None)
            )
            c = oa.Choice(index)
            if attempt:
                self.counters["retries"] += 1
                log.info("retrying on %s + %s after: %s", pf.url, dc.url, err)
            try:
                await self._attempt(
                    ask, ids, seed, pf, dc, c, t0, on_delta, len(ids) - pf_held, retry=attempt > 0
                )
                if self.pairing.policy == "kv_aware":
                    dc.remember(page_keys(ids, dc.page_size, ask.tenant))
                    pf.remember(page_keys(ids, self.decodes[0].page_size, ask.tenant))
                    self._report(c, ids, pf, dc, pf_held, dc_held)
                    self.pairing.judge(
                        len(ids), c.stats, (pf.key, pf_held, marks[0]), (dc.key, dc_held, marks[1])
                    )
                return c
            except AttemptFailed as e:
                err = e
                if e.client or c.token_ids:
                    break  # a bad request, or text already went out: no second try
                if e.capacity:
                    avoid_d.add(dc.key)
                    avoid_p.add(pf.key)
                elif attempt >= 1:
                    break
                else:
                    avoid_p.add(pf.key)
                    avoid_d.add(dc.key)
                # a worker may have restarted (a new endpoint id to bind rooms to)
                await self.health.refresh(force=True)
        assert err is not None
        raise err

    def _report(
        self, c: oa.Choice, ids: list[int], pf: Prefill, dc: Decode, pf_held: int, dc_held: int
    ) -> None:
        """Which workers a choice went to and how much of its prompt each held (as the
        router saw it when it chose): in the ``pdxfer`` extension, the metrics and the log."""
        c.stats["prefill_cached_tokens"] = pf_held
        c.stats["decode_cached_tokens"] = dc_held
        self.counters["kv_prompt_tokens"] += len(ids)
        self.counters["kv_prefill_cached_tokens"] += pf_held
        self.counters["kv_decode_cached_tokens"] += dc_held
        log.info(
            "routed %d prompt tokens: prefill %s (held %d, events %s), decode %s "
            "(held %d, events %s)",
            len(ids),
            pf.key,
            pf_held,
            self.kv is not None and self.kv.synced(pf.key),
            dc.key,
            dc_held,
            self.kv is not None and self.kv.synced(dc.key),
        )

    def _later(self, coro: Any) -> None:
        later(self._bg, coro)

    async def _attempt(
        self,
        ask: oa.Ask,
        ids: list[int],
        seed: int,
        pf: Prefill,
        dc: Decode,
        c: oa.Choice,
        t0: float,
        on_delta: Any,
        pf_work: int = 0,
        retry: bool = False,
    ) -> None:
        """One try on a pair; ``pf_work``: the prompt tokens the prefill has to compute
        (its ``pending`` until the first token: the prefill is done by then); ``retry``:
        an earlier try failed (``Attempt.retry``)."""
        room = secrets.randbits(63)
        pf.outstanding += 1
        dc.outstanding += 1
        pf.pending += pf_work
        finished, rendered = False, False
        detok, stops = ask.tok.detokenizer(), oa.StopText(ask.stop)
        events = self.backend.stream(self.http, Attempt(ask, ids, seed, pf, dc, room, retry))
        try:
            try:
                async for ev in events:
                    if isinstance(ev, Done):
                        c.finish_reason = ev.finish_reason
                        c.stats = {
                            **ev.stats,
                            "room": room,
                            "prefill": pf.url,
                            "decode": dc.url,
                            "seconds": time.perf_counter() - t0,
                        }
                        if dc.dp is not None:
                            c.stats["decode_dp"] = dc.dp
                        if pf.dp is not None:
                            c.stats["prefill_dp"] = pf.dp
                        finished = True
                        break
                    if pf_work and ev.token_ids:
                        pf.pending -= pf_work
                        pf_work = 0
                        self.door.released()
                    c.token_ids += ev.token_ids
                    c.logprobs += ev.logprobs
                    rendered |= ev.text is not None
                    text = stops.feed(ev.text if ev.text is not None else detok.feed(ev.token_ids))
                    await self._emit(c, text, ev.logprobs, on_delta)
                    if stops.stopped:
                        c.finish_reason = "stop"
                        c.stats = {
                            "room": room,
                            "prefill": pf.url,
                            "decode": dc.url,
                            "seconds": time.perf_counter() - t0,
                        }
                        break  # leaving closes the stream: the decode stops generating
            finally:
                await events.aclose()
            if not stops.stopped:
                if not finished:
                    raise AttemptFailed(502, f"decode {dc.url} ended the stream early")
                tail = "" if rendered else detok.flush()
                await self._emit(c, stops.feed(tail) + stops.flush(), [], on_delta)
            if c.finish_reason == "cancelled":
                raise AttemptFailed(502, f"room {room} was cancelled on {dc.url}")
        except BaseException:
            why = "the router gave up on this request"
            self._later(self.backend.abort(self.http, pf.url, room, why))
            self._later(self.backend.abort(self.http, dc.url, room, why))
            raise
        finally:
            pf.outstanding -= 1
            dc.outstanding -= 1
            if pf_work:
                pf.pending -= pf_work
                self.door.released()
            if stops.stopped:
                self._later(self.backend.abort(self.http, pf.url, room, "stop string reached"))

    async def _emit(
        self, c: oa.Choice, text: str, lps: list[dict[str, Any]], on_delta: Any
    ) -> None:
        if not text and not lps:
            return
        c.text += text
        if on_delta is not None:
            await on_delta(c.index, text, lps)
