"""The commands an ``harness.Agent`` process understands (runs inside the agent)."""

from __future__ import annotations

import importlib
import threading
import time
from typing import Any

import numpy as np
import torch

from ..config import EndpointConfig
from ..endpoint import Endpoint
from ..endpoint.handles import KVPoll
from ..endpoint.receiver import KVReceiver
from ..endpoint.sender import KVSender
from ..pools import PoolSpec
from . import patterns as pat
from .patterns import PoolGeom


class _Ep:
    def __init__(self, role: str, config: dict[str, Any], geoms: list[PoolGeom]) -> None:
        specs, self.tensors = pat.build(geoms)
        self.specs: dict[str, PoolSpec] = {s.name: s for s in specs}
        self.ep = Endpoint(EndpointConfig.from_flat(role=role, **config), specs)
        self.tx: dict[int, KVSender] = {}
        self.rx: dict[int, KVReceiver] = {}
        self.released: dict[int, list[float]] = {}

    def anchor_pages(self, name: str, pages: dict[str, Any]) -> Any:
        spec = self.specs[name]
        return pages.get(spec.indices_from or name)

    def items(self, pages: dict[str, Any], slots: dict[str, Any]) -> dict[str, list[int]]:
        """Every pool's items (pages, or a slot) of one request."""
        out: dict[str, list[int]] = {}
        for name, spec in self.specs.items():
            if spec.kind == "paged":
                got = self.anchor_pages(name, pages)
                if got is not None:
                    out[name] = [int(x) for x in got]
            elif name in slots:
                out[name] = [int(slots[name])]
        return out

    def scrub(self, pages: dict[str, Any], slots: dict[str, Any]) -> None:
        for name, items in self.items(pages, slots).items():
            pat.scrub(self.specs[name], self.tensors[name], items)


class AgentState:
    def __init__(self) -> None:
        self.eps: dict[str, _Ep] = {}

    def cmd_add_endpoint(
        self, name: str, role: str, config: dict[str, Any], geoms: list[PoolGeom]
    ) -> dict[str, Any]:
        e = self.eps[name] = _Ep(role, config, geoms)
        return {
            "ctrl_addr": e.ep.ctrl_addr,
            "session": e.ep.transport.session_id,
            "endpoint_id": e.ep.endpoint_id,
        }

    def cmd_close_endpoint(self, name: str) -> None:
        self.eps.pop(name).ep.close()

    def close(self) -> None:
        for e in self.eps.values():
            e.ep.close()
        self.eps.clear()

    # -- prefill ------------------------------------------------------------------------------
    def cmd_prepare(self, items: list[dict[str, Any]], ep: str = "main") -> None:
        """Write each room's pattern into its source pages and slots."""
        e = self.eps[ep]
        for it in items:
            for name, spec in e.specs.items():
                if spec.kind == "paged":
                    pages = e.anchor_pages(name, it["pages"])
                    if pages is not None:
                        pat.fill_tokens(
                            spec, e.tensors[name], it["room"], pages, 0, 0, it["num_tokens"]
                        )
                elif name in it.get("slots", {}):
                    pat.fill_slot(spec, e.tensors[name], it["room"], it["slots"][name])

    def cmd_send(self, items: list[dict[str, Any]], ep: str = "main") -> None:
        """Create a sender per room (bound to ``peer`` if given; ``open``: False for a room
        already created) and hand over its chunks (with ``delay_s`` between chunks, from a
        thread, when asked; ``abort_after_send``: abort right after the last one)."""
        e = self.eps[ep]
        for it in items:
            if not it.get("open", True):
                tx = e.tx[it["room"]]
            else:
                tx = e.tx[it["room"]] = (
                    e.ep.sender(it["room"], it["peer"])
                    if it.get("peer")
                    else e.ep.sender(it["room"])
                )
            chunks = it["chunks"]
            delay = it.get("delay_s", 0.0)
            if delay:
                threading.Thread(target=_send_slowly, args=(tx, chunks, delay), daemon=True).start()
            else:
                for c in chunks:
                    _send(tx, c)
                if it.get("abort_after_send"):
                    tx.abort("aborted right after send")

    def cmd_expect(self, rooms: list[int], ep: str = "main") -> None:
        """Declare rooms the engine received but has not opened (``Endpoint.expect``)."""
        for r in rooms:
            self.eps[ep].ep.expect(r)

    def cmd_withdraw(self, rooms: list[int], reason: str, ep: str = "main") -> None:
        for r in rooms:
            self.eps[ep].ep.withdraw(r, reason)

    # -- decode -------------------------------------------------------------------------------
    def cmd_sentinel(self, ep: str = "main") -> None:
        pat.fill_sentinel(self.eps[ep].tensors)

    def cmd_recv(
        self,
        items: list[dict[str, Any]],
        bootstrap: str,
        ep: str = "main",
        instance: str | None = None,
        early: bool = False,
    ) -> None:
        e = self.eps[ep]
        for it in items:
            room = it["room"]

            def release(
                d: Any, s: Any, room: int = room, scrub: bool = it.get("scrub", False)
            ) -> None:
                if scrub:  # reused at once, as an engine may: a late write would show
                    e.scrub(d, s)
                e.released.setdefault(room, []).append(time.monotonic())

            rx = e.ep.receiver(
                room, bootstrap, instance=instance, dp=it.get("dp"), release=release, early=early
            )
            e.rx[room] = rx
            rx.request(it["dst"], it.get("slots"), it.get("prefix_len", 0), it.get("num_tokens"))

    def cmd_verify(self, items: list[dict[str, Any]], ep: str = "main") -> dict[int, Any]:
        """Bytes of each room that differ from its pattern (0 = every byte right)."""
        e = self.eps[ep]
        out: dict[int, Any] = {}
        for it in items:
            room, prefix = it["room"], it.get("prefix_len", 0)
            bad, first = 0, ""
            for name, spec in e.specs.items():
                if spec.kind == "paged":
                    pages = e.anchor_pages(name, it["dst"])
                    if pages is None:
                        continue
                    n, f = pat.check_tokens(
                        spec,
                        e.tensors[name],
                        it.get("seed", room),
                        pages,
                        prefix,
                        prefix,
                        it["num_tokens"],
                    )
                elif name in it.get("slots", {}):
                    n, f = pat.check_slot(
                        spec, e.tensors[name], it.get("seed", room), it["slots"][name]
                    )
                else:
                    continue
                bad += n
                first = first or f
            out[room] = (bad, first)
        return out

    def cmd_dirty(self, dst: dict[str, list[int]], slots: dict[str, int], ep: str = "main") -> int:
        """Non-sentinel bytes in one request's pages and slots (after a scrubbing release:
        bytes that landed once the pages were handed back)."""
        e = self.eps[ep]
        return sum(
            pat.dirty(e.specs[n], e.tensors[n], items) for n, items in e.items(dst, slots).items()
        )

    def cmd_untouched(self, exclude: dict[str, list[int]], ep: str = "main") -> int:
        """Non-sentinel bytes outside ``exclude`` (pages or slots per pool)."""
        e = self.eps[ep]
        total = 0
        for name, spec in e.specs.items():
            if spec.item_bytes == 0:
                continue
            ex = exclude.get(spec.indices_from or name, [])
            total += pat.untouched(spec, e.tensors[name], ex)
        return total

    def cmd_released(self, ep: str = "main") -> list[int]:
        return sorted(self.eps[ep].released)

    def cmd_release_times(self, ep: str = "main") -> dict[int, list[float]]:
        """When (``time.monotonic()``, comparable across processes) each room's pages came
        back."""
        return dict(self.eps[ep].released)

    def cmd_release_counts(self, ep: str = "main") -> dict[int, int]:
        """How many times each room's pages were handed back (must never exceed one)."""
        return {r: len(v) for r, v in self.eps[ep].released.items()}

    def cmd_abort(self, rooms: list[int], ep: str = "main") -> None:
        e = self.eps[ep]
        for r in rooms:
            h = e.rx.get(r) or e.tx.get(r)
            if h is not None:
                h.abort()

    # -- both ---------------------------------------------------------------------------------
    def cmd_wait(
        self, rooms: list[int], timeout: float = 60.0, ep: str = "main"
    ) -> dict[int, dict[str, Any]]:
        """Poll until every room is terminal or ``timeout``; report each room's outcome."""
        e = self.eps[ep]
        handles = {r: (e.rx.get(r) or e.tx.get(r)) for r in rooms}
        t0 = time.monotonic()
        end = t0 + timeout
        done_at: dict[int, float] = {}
        while True:
            for r, h in handles.items():
                if r not in done_at and h is not None and h.poll().terminal:
                    done_at[r] = time.monotonic() - t0
            if len(done_at) == len(handles) or time.monotonic() > end:
                break
            time.sleep(0.002)
        out: dict[int, dict[str, Any]] = {}
        for r, h in handles.items():
            if h is None:
                out[r] = {"state": "Unknown", "failure": None, "kind": None}
                continue
            f = h.failure
            out[r] = {
                "state": KVPoll(h.poll()).name,
                "failure": str(f) if f else None,
                "kind": f.kind if f else None,
                "seconds": done_at.get(r),
            }
            if isinstance(h, KVReceiver):
                out[r]["stats"] = h.stats()
        return out

    def cmd_states(self, rooms: list[int], ep: str = "main") -> dict[int, str]:
        """Each room's state now (no waiting)."""
        e = self.eps[ep]
        return {r: KVPoll((e.rx.get(r) or e.tx[r]).poll()).name for r in rooms}

    def cmd_ext(self, fn: str, **kw: Any) -> Any:
        """Run ``fn`` (``module:function`` of pdxfer, the test harness or the benchmarks)
        with this state: lets them add agent commands without growing this file."""
        mod, _, name = fn.partition(":")
        if not mod.startswith(("pdxfer.", "tests.harness.", "benchmarks.")):
            raise ValueError(f"agent extension {fn!r} is not a pdxfer, harness or benchmark module")
        return getattr(importlib.import_module(mod), name)(self, **kw)

    def cmd_set_faults(self, spec: str) -> None:
        """Set this process's ``PDXFER_FAULTS`` settings now (same syntax)."""
        from ..faults import faults

        faults().update(spec)

    def cmd_held_batches(self, room: int) -> int:
        """How many of ``room``'s transport batches ``delay_write`` has held in this process."""
        from ..faults import faults

        return faults().held(room)

    def cmd_writes(self, room: int) -> dict[str, Any]:
        """How many transport writes of ``room`` began in this process while faults were on,
        and when (``time.monotonic()``) each that returned ended."""
        from ..faults import faults

        began, ended = faults().writes(room)
        return {"began": began, "ended": ended}

    def cmd_strand_landings(self, room: int) -> list[float]:
        """When (``time.monotonic()``) each of ``room``'s batches that the ``strand`` fault
        reported failed landed after all, in this process."""
        from ..faults import faults

        return faults().landed(room)

    def cmd_metrics(self, ep: str = "main") -> dict[str, Any]:
        return self.eps[ep].ep.metrics()

    def cmd_proc_stats(self) -> dict[str, int]:
        """Open file descriptors and resident memory of this agent process (leak checks)."""
        import gc
        import os

        gc.collect()
        with open("/proc/self/statm") as f:
            rss_pages = int(f.read().split()[1])
        return {
            "fds": len(os.listdir("/proc/self/fd")),
            "rss": rss_pages * os.sysconf("SC_PAGE_SIZE"),
        }

    def cmd_forget(self, rooms: list[int], ep: str = "main") -> None:
        """Drop the agent's own handles (an engine forgets finished requests)."""
        e = self.eps[ep]
        for r in rooms:
            e.rx.pop(r, None)
            e.tx.pop(r, None)

    def cmd_prometheus(self, ep: str = "main") -> str:
        return self.eps[ep].ep.prometheus().decode()

    def cmd_tables(self, ep: str = "main") -> dict[str, int]:
        """Sizes of the room tables (all zero when nothing leaked)."""
        t = self.eps[ep].ep.tables()
        return {k: t[k] for k in ("rooms", "pending") if k in t}

    def cmd_peek(self, pool: str, page: int, ep: str = "main") -> list[int]:
        e = self.eps[ep]
        return (
            e.tensors[pool][0]
            .view(torch.uint8)
            .view(e.specs[pool].num_items, -1)[page][:16]
            .tolist()
        )

    def cmd_random_pages(self, n: int, seed: int, pool: str = "kv", ep: str = "main") -> list[int]:
        rng = np.random.default_rng(seed)
        return rng.choice(self.eps[ep].specs[pool].num_items, n, replace=False).tolist()


def _send_slowly(tx: KVSender, chunks: list[dict[str, Any]], delay: float) -> None:
    for c in chunks:
        if tx.poll() == KVPoll.Failed:
            return
        _send(tx, c)
        time.sleep(delay)


def _send(tx: KVSender, c: dict[str, Any]) -> None:
    """One chunk: its pages, the slots of the last, and the layers and tokens it carries
    when it is a partial-layer chunk."""
    kw = {k: tuple(c[k]) for k in ("layers", "tokens") if c.get(k) is not None}
    tx.send(c["pages"], c.get("slots"), c.get("last", False), **kw)
