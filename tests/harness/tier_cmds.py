"""Agent commands for the tiers (run inside a ``harness.Agent`` via ``cmd_ext``).

Requests that share a prefix must carry the same bytes for it, so a request's pattern is
given as ``segments``: ``[seed, start, end)`` ranges (the room that first computed a range is
its seed). A byte restored from the wrong page, tier or request then shows up in ``verify``.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from pdxfer.agents import patterns as pat
from pdxfer.endpoint.handles import KVPoll
from pdxfer.tiers.cache import Match, TieredCache
from pdxfer.tiers.mooncake_store import MooncakeStoreStorage
from pdxfer.tiers.restore import RestoringReceiver
from pdxfer.tiers.storage import FileStorage, StorageBackend


class _Tiers:
    def __init__(self, cache: TieredCache) -> None:
        self.cache = cache
        self.rx: dict[int, RestoringReceiver] = {}
        self.released: set[int] = set()


_storages: dict[str, StorageBackend] = {}
"""Shared by every endpoint of the process (one Mooncake Store client per process)."""


def _t(state: Any, ep: str) -> _Tiers:
    return state.tiers[ep]  # type: ignore[no-any-return]


def storage(state: Any, name: str, kind: str, **kw: Any) -> None:
    if name in _storages:
        return
    if kind == "file":
        _storages[name] = FileStorage(kw["root"], kw.get("max_bytes"))
    else:
        _storages[name] = MooncakeStoreStorage(
            kw["master"], kw["metadata"], segment_bytes=kw.get("segment_bytes", 64 << 20)
        )


def setup(
    state: Any,
    host_pages: int | dict[str, int],
    model_id: str,
    use: str | None = None,
    ep: str = "main",
) -> None:
    """A tiered cache for endpoint ``ep``; ``model_id`` names what the test's patterns stand
    for (two ids: two models whose KV has the same shape)."""
    e = state.eps[ep]
    if not hasattr(state, "tiers"):
        state.tiers = {}
    old = state.tiers.get(ep)
    if old is not None:
        old.cache.close()
    cache = TieredCache(
        list(e.specs.values()),
        host_pages=host_pages,
        storage=_storages[use] if use else None,
        register=e.ep.transport.register,
        model_id=model_id,
    )
    state.tiers[ep] = _Tiers(cache)


def use(state: Any, name: str | None, ep: str = "main") -> None:
    _t(state, ep).cache.set_storage(_storages[name] if name else None)


def prepare(state: Any, items: list[dict[str, Any]], ep: str = "main") -> None:
    """Prefill: write each request's segments into its source pages and slots."""
    e = state.eps[ep]
    for it in items:
        for name, spec in e.specs.items():
            if spec.kind == "paged":
                pages = e.anchor_pages(name, it["pages"])
                for seed, a, b in it["segments"]:
                    pat.fill_tokens(spec, e.tensors[name], seed, pages, 0, a, b)
            elif name in it.get("slots", {}):
                pat.fill_slot(spec, e.tensors[name], it["room"], it["slots"][name])


def recv(
    state: Any,
    items: list[dict[str, Any]],
    bootstrap: str,
    ep: str = "main",
    instance: str | None = None,
    fault: dict[str, Any] | None = None,
) -> dict[int, int]:
    """Decode: start a RestoringReceiver per request; answer each promised prefix_len."""
    e, t = state.eps[ep], _t(state, ep)
    t.cache.after_match = None if fault is None else (lambda m: _inject(t.cache, m, fault))
    out: dict[int, int] = {}
    for it in items:
        room = it["room"]
        t.rx[room] = RestoringReceiver(
            t.cache,
            e.ep,
            room,
            bootstrap,
            it["tokens"],
            it["dst"],
            it.get("slots"),
            num_tokens=it["num_tokens"],
            instance=instance,
            l1_len=it.get("l1_len", 0),
            restore_timeout_s=it.get("restore_timeout_s"),
            release=lambda d, s, room=room: t.released.add(room),
        )
    for it in items:
        rx = t.rx[it["room"]]
        end = time.monotonic() + 30
        while rx.match is None and rx.poll() != KVPoll.Failed and time.monotonic() < end:
            time.sleep(0.002)
        out[it["room"]] = rx.prefix_len if rx.prefix_len is not None else -1
    return out


def _inject(cache: TieredCache, m: Match, fault: dict[str, Any]) -> None:
    """Test hook between match and load: make one promised L3 object vanish or tear."""
    if len(m.l3) <= fault["page"]:
        return
    key = f"{m.l3[fault['page']].key}.{fault.get('pool') or cache.data_pools[0]}"
    st = cache.storage
    if isinstance(st, FileStorage):
        path = st.path(key)
        with contextlib.suppress(FileNotFoundError):  # an earlier request's fault took it
            if fault["kind"] == "delete":
                os.unlink(path)
            else:
                os.truncate(path, os.path.getsize(path) // 2)
    elif isinstance(st, MooncakeStoreStorage):
        st.remove(key)


def wait(
    state: Any, rooms: list[int], timeout: float = 60.0, ep: str = "main"
) -> dict[int, dict[str, Any]]:
    t = _t(state, ep)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(t.rx[r].poll().terminal for r in rooms):
            break
        time.sleep(0.002)
    out: dict[int, dict[str, Any]] = {}
    for r in rooms:
        rx = t.rx[r]
        f = rx.failure
        out[r] = {
            "state": KVPoll(rx.poll()).name,
            "failure": str(f) if f else None,
            "stats": rx.stats(),
        }
    t.cache.after_match = None
    return out


def forget(state: Any, rooms: list[int], ep: str = "main") -> None:
    t = _t(state, ep)
    for r in rooms:
        t.rx.pop(r, None)


def verify(state: Any, items: list[dict[str, Any]], ep: str = "main") -> dict[int, Any]:
    """Bytes of each request (dst covering tokens from 0) that differ from its segments."""
    e = state.eps[ep]
    out: dict[int, Any] = {}
    for it in items:
        bad, first = 0, ""
        for name, spec in e.specs.items():
            if spec.kind == "paged":
                pages = e.anchor_pages(name, it["dst"])
                for seed, a, b in it["segments"]:
                    n, f = pat.check_tokens(spec, e.tensors[name], seed, pages, 0, a, b)
                    bad, first = bad + n, first or f
            elif name in it.get("slots", {}):
                n, f = pat.check_slot(spec, e.tensors[name], it["room"], it["slots"][name])
                bad, first = bad + n, first or f
        out[it["room"]] = (bad, first)
    return out


def suffix_bytes(state: Any, start: int, end: int, slots: list[str], ep: str = "main") -> int:
    """What the network must carry for tokens ``[start, end)`` plus ``slots``."""
    total = 0
    for spec in state.eps[ep].specs.values():
        if spec.kind == "paged":
            total += (end - start) * spec.token_bytes * len(spec.buffers)
        elif spec.name in slots:
            total += spec.item_bytes * len(spec.buffers)
    return total


def write_back(
    state: Any, items: list[dict[str, Any]], ep: str = "main", flush: bool = True
) -> list[int]:
    t = _t(state, ep)
    futs = [t.cache.write_back(it["tokens"], it["dst"], it["num_tokens"]) for it in items]
    return [f.result(timeout=60) for f in futs] if flush else []


def keys(state: Any, tokens: list[int], ep: str = "main") -> list[str]:
    """The cache's page keys of ``tokens`` (salted with its layout and model)."""
    return _t(state, ep).cache.keys(tokens)


def corrupt_l2(state: Any, n: int, ep: str = "main") -> int:
    """Flip every byte of up to ``n`` cached L2 pages (fault injection for restore checks)."""
    t = _t(state, ep)
    done = 0
    with t.cache.host.lock:
        for e in list(t.cache.host.entries.values())[:n]:
            for pool, page in e.pages.items():
                hp = t.cache.host.pools.get(pool)
                if hp is not None:
                    hp.data[page] ^= 0xFF
            done += 1
    return done


def clear_l2(state: Any, ep: str = "main") -> int:
    return _t(state, ep).cache.host.clear()


def report(state: Any, ep: str = "main") -> dict[str, Any]:
    """Leak check: pins, reservations, index consistency, room tables, released rooms."""
    t = _t(state, ep)
    t.cache.flush()
    x = state.eps[ep].ep
    rooms = x.tables()["rooms"]
    return {
        "check": t.cache.check(),
        "stats": t.cache.stats(),
        "rooms": rooms,
        "released": sorted(t.released),
        "metrics": x.metrics(),
    }


def prefill_tables(state: Any, ep: str = "main") -> dict[str, int]:
    t = state.eps[ep].ep.tables()
    return {k: t[k] for k in ("rooms", "pending", "held")}


def transport_bytes(state: Any, ep: str = "main") -> int:
    return int(state.eps[ep].ep.transport.stats.bytes)


def abort(state: Any, rooms: list[int], ep: str = "main") -> None:
    t = _t(state, ep)
    for r in rooms:
        t.rx[r].abort("aborted by the test")


def set_verify(state: Any, on: bool, ep: str = "main") -> None:
    """Turn the check of restored pages against their recorded digests on or off."""
    _t(state, ep).cache.verify = on
