"""Health: which workers answer, and what they are.

``refresh`` probes each worker once per front (a DP front answers for its ranks) and asks
each prefill's bootstrap whether it can route to it: a worker down or not registered is
avoided while another is healthy. What a decode says of itself (its endpoint, context and
page size) is kept; a front that shows data-parallel ranks or groups becomes one record per
rank, in the router's shared worker lists. While a worker is down, a watch looks again
every ``HEALTH_TTL_S``, off the request path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from .backends import Backend, Decode, Http, Prefill, registered
from .kv_feed import KvFeeds

log = logging.getLogger(__name__)

HEALTH_TTL_S = 1.0


def _front(p: Prefill) -> tuple[str, str, str]:
    """A prefill instance behind one URL (all its DP ranks' records share it)."""
    return (p.url, p.bootstrap, p.instance)


class Health:
    """The workers' health over the router's worker lists, which it grows in place as
    data-parallel ranks show up (``pairing`` and ``dispatch`` see the same lists)."""

    def __init__(
        self,
        prefills: list[Prefill],
        decodes: list[Decode],
        backend: Backend,
        http: Http,
        kv: KvFeeds | None,
    ) -> None:
        self.prefills, self.decodes = prefills, decodes
        self.backend, self.http, self.kv = backend, http, kv
        self._health_at = 0.0
        self._health: dict[str, Any] = {}
        self._watch: asyncio.Future[None] | None = None

    def start(self) -> None:
        self._watch = asyncio.ensure_future(self._watch_down())

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)

    async def _watch_down(self) -> None:
        """While a worker is marked down, look again every ``HEALTH_TTL_S``: a worker (or
        its host) that comes back is used again without anyone calling ``/health``. Off the
        request path, so a worker that does not answer never slows a request."""
        while True:
            await asyncio.sleep(HEALTH_TTL_S)
            if all(p.healthy for p in self.prefills) and all(d.healthy for d in self.decodes):
                continue
            try:
                await self.refresh(force=True)
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("health refresh failed")

    async def refresh(self, force: bool = False) -> dict[str, Any]:
        """Each worker's state by its key (``ok``, ``down``, or why not); at most once per
        ``HEALTH_TTL_S`` unless ``force``."""
        now = time.monotonic()
        if not force and now - self._health_at < HEALTH_TTL_S:
            return self._health
        out: dict[str, Any] = {}
        probe = self.backend.probe
        fronts = {_front(p): p for p in reversed(self.prefills)}  # a DP instance once
        looked = await asyncio.gather(
            asyncio.gather(*(probe(self.http, p) for p in fronts.values())),
            asyncio.gather(*(registered(p) for p in fronts.values())),
        )
        by_front = dict(zip(fronts, zip(*looked)))
        self._expand_ranks(by_front)
        for p in self.prefills:
            info, size = by_front[_front(p)]
            ok = info is not None and size is not None
            self._down_forgets(p, ok)
            p.healthy = ok
            p.dp_size = size or p.dp_size
            out[p.key] = (
                "ok"
                if ok
                else "down"
                if info is None
                else f"not registered with bootstrap {p.bootstrap}"
            )
        urls = list(dict.fromkeys(d.url for d in self.decodes))  # a DP front once
        by_url = dict(
            zip(
                urls,
                await asyncio.gather(
                    *(probe(self.http, next(d for d in self.decodes if d.url == u)) for u in urls)
                ),
            )
        )
        self._expand_groups(by_url)
        for d in self.decodes:
            info = by_url.get(d.url)
            if info and d.dp is not None:  # this record is one of the worker's DP groups
                groups = info.get("groups") or []
                info = groups[d.dp] if d.dp < len(groups) else None
                if info and info.get("status", "ok") != "ok":
                    info = None
            self._down_forgets(d, info is not None)
            d.healthy = info is not None
            out[d.key] = "ok" if d.healthy else "down"
            if info:
                d.endpoint_id = info.get("peer") or info.get("endpoint") or d.endpoint_id
                d.max_seq_len = int(info.get("max_seq_len", d.max_seq_len or 0)) or None
                d.page_size = int(info.get("page_size", d.page_size))
        self._health, self._health_at = out, now
        return out

    def _down_forgets(self, w: Prefill | Decode, healthy: bool) -> None:
        """A worker going down may come back empty (a restart): what its events said it
        held is forgotten, and its history with it."""
        if w.healthy and not healthy:
            w.keys.clear()
            if self.kv is not None:
                self.kv.forget(w.key)

    def _expand_groups(self, infos: dict[str, Any]) -> None:
        """A decode URL that answers with DP ``groups`` becomes one record per group (each
        with its own cache keys, load and health), in place of its single record; its KV
        event feed becomes one per group."""
        out: list[Decode] = []
        for d in self.decodes:
            groups = (infos.get(d.url) or {}).get("groups")
            if d.dp is None and isinstance(groups, list) and groups:
                out += [Decode(d.url, d.instance, dp=g) for g in range(len(groups))]
                log.info("decode %s fronts %d DP groups", d.url, len(groups))
                if self.kv is not None:
                    self.kv.ranks(d.url, len(groups))
            else:
                out.append(d)
        self.decodes[:] = out

    def _expand_ranks(self, fronts: dict[tuple[str, str, str], tuple[Any, int | None]]) -> None:
        """A prefill instance whose bootstrap registration has several data-parallel ranks
        becomes one record per rank (each with its own load, cache keys and KV event feed):
        the router picks the rank, sends the request there and tells the decode to load
        from it. A restart with another DP size rebuilds its records (those kept keep their
        figures)."""
        out: list[Prefill] = []
        done: set[tuple[str, str, str]] = set()
        for p in self.prefills:
            f = _front(p)
            size = fronts.get(f, (None, None))[1]
            mine = [q for q in self.prefills if _front(q) == f]
            want = [None] if size == 1 else list(range(size)) if size else None
            if want is None or [q.dp for q in mine] == want:
                out.append(p)
                continue
            if f in done:
                continue
            done.add(f)
            old = {q.dp: q for q in mine}
            out += [old.get(r) or Prefill(p.url, p.bootstrap, p.instance, dp=r) for r in want]
            log.info("prefill %s (instance %s) runs %d DP ranks", p.url, p.instance, len(want))
            if self.kv is not None:
                self.kv.ranks(p.url, len(want))
        self.prefills[:] = out
