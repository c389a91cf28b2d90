"""Rank 0 of a TP group: the worker's front, which drives the other ranks and answers once.

``start_host`` builds the worker's own rank; at ``--tp N`` it first starts ranks 1..N-1
(``tp.py``, ``follower.py``), joins their gloo group and hooks the model so that every forward
rank 0 runs is first sent to the others (``ToyModel.mirror``): one decision maker. A
request's transfer has one handle per rank, and ``Group`` makes them one ``RequestHandle``:
its state is the minimum of the ranks' (``KVPoll`` is ordered for that), so it succeeds only
when every rank holds its heads and fails as soon as one failed, aborting the others. A failed
request's pages come back only once every rank's receiver let go of them, since a page id
names memory on every rank. The functions at the end are what the workers call for a
request, whatever their TP size.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pdxfer import KVPoll, KVReceiver, KVSender, RequestHandle
from pdxfer.tiers import RestoringReceiver, TieredCache

from ..errors import TransferFailed, WorkerBroken
from . import follower, tp
from .kv import KVPool, PageTable
from .model import ToyModel
from .tiered import open_receiver as open_local_receiver
from .tiered import reuse
from .worker import ModelHost, WorkerConfig

log = logging.getLogger(__name__)

_MIN_KEYS = ("l1_pages", "l2_pages", "l3_pages", "restored_pages", "prefix_len")
"""Per-rank figures a group reports as their minimum (what every rank has)."""


class Remote:
    """Another rank's handle for one room, as rank 0 knows it from that rank's events."""

    def __init__(self, ranks: Ranks, rank: int, room: int, kind: str) -> None:
        self.ranks, self.rank, self.room, self.kind = ranks, rank, room, kind
        self.state = KVPoll.Bootstrapping
        self.failure: str | None = None
        self.stats: dict[str, Any] = {}
        self.holding = kind == "sender"
        self.released = False
        self.group: Group | None = None

    def settled(self) -> bool:
        """No write can land in this rank's pages of the room any more."""
        return self.released or self.state == KVPoll.Success

    def done(self) -> bool:
        return (
            not self.holding if self.kind == "sender" else (self.state.terminal and self.settled())
        )

    def gone(self, why: str) -> None:
        """Its rank died: its memory went with it."""
        if not self.state.terminal:
            self.state, self.failure = KVPoll.Failed, why
        self.holding, self.released = False, True


class Group(RequestHandle):
    """One room on every rank of the group, as one handle (module notes)."""

    def __init__(
        self,
        ranks: Ranks,
        local: RequestHandle,
        kind: str,
        release: Callable[[], None] | None = None,
    ) -> None:
        self.ranks, self.local, self.kind = ranks, local, kind
        self._release = release
        self._lock = threading.Lock()
        self._local_settled = False
        self._released = False
        self._failed = False
        self.remotes = [ranks.remote(r, local.room, kind, self) for r in ranks.links]

    @property
    def room(self) -> int:
        return self.local.room

    @property
    def prefix_len(self) -> int | None:
        return getattr(self.local, "prefix_len", None)

    @property
    def holding(self) -> bool:
        return bool(getattr(self.local, "holding", False)) or any(r.holding for r in self.remotes)

    @property
    def restored_pages(self) -> int:
        return min(
            [
                int(getattr(self.local, "restored_pages", 0)),
                *(int(r.stats.get("restored_pages", 0)) for r in self.remotes),
            ]
        )

    def poll(self) -> KVPoll:
        mine = self.local.poll()
        if mine == KVPoll.Success:
            self.local_settled()
        state = min([mine, *(r.state for r in self.remotes)])
        if state == KVPoll.Failed and not self._failed:
            self._failed = True
            self.abort(f"TP rank {self._failed_rank()} failed: {self._first_failure()}")
        self.check_release()
        return state

    def _failed_rank(self) -> int:
        if self.local.poll() == KVPoll.Failed:
            return 0
        return next((r.rank for r in self.remotes if r.state == KVPoll.Failed), -1)

    def _first_failure(self) -> str:
        if self.local.poll() == KVPoll.Failed:
            return str(self.local.failure)
        return next((r.failure or "failed" for r in self.remotes if r.state == KVPoll.Failed), "")

    @property
    def failure(self) -> Any:
        if self.local.poll() == KVPoll.Failed:
            return self.local.failure
        for r in self.remotes:
            if r.state == KVPoll.Failed:
                return TransferFailed(f"room {self.room}: TP rank {r.rank}: {r.failure}")
        return None

    def abort(self, reason: str = "aborted by engine") -> None:
        if not self.local.poll().terminal:
            self.local.abort(reason)
        for r in self.remotes:
            if not r.state.terminal:
                self.ranks.links[r.rank].send("abort", room=self.room, reason=reason)

    def send(
        self, dst: dict[str, Sequence[int]], slots: dict[str, int] | None = None, last: bool = False
    ) -> None:
        """A prefill's chunk: this rank ships its heads, every other rank its own (with the
        slot rows' values, which only rank 0 computed)."""
        assert isinstance(self.local, KVSender), "only a prefill's group sends"
        self.local.send(dst, slots=slots, last=last)
        rows = {
            name: (slot, getattr(self.ranks.host, name)[slot].tolist())
            for name, slot in (slots or {}).items()
        }
        self.ranks.send(
            "send", room=self.room, pages=[int(p) for p in dst["kv"]], rows=rows, last=last
        )

    def stats(self) -> dict[str, Any]:
        """Rank 0's figures with the others': bytes summed, prefix figures their minimum;
        ``ranks`` lists each rank's own."""
        assert isinstance(self.local, (KVReceiver, RestoringReceiver)), "a decode's group"
        mine = dict(self.local.stats())
        mine["restored_pages"] = int(getattr(self.local, "restored_pages", 0))
        out = dict(mine)
        for r in self.remotes:
            for k, v in r.stats.items():
                if not isinstance(v, (int, float)) or isinstance(v, bool) or k not in out:
                    continue
                if k.endswith("bytes"):
                    out[k] = (out[k] or 0) + v
                elif k in _MIN_KEYS and out[k] is not None:
                    out[k] = min(out[k], v)
        keep = ("restored_pages", "repaired_tokens", "bytes", "net_bytes", "repair_bytes")
        out["ranks"] = [
            {k: s.get(k, 0) for k in keep} for s in (mine, *(r.stats for r in self.remotes))
        ]
        return out

    # -- page lifetime (decode) --------------------------------------------------------------
    def local_settled(self, *_: Any) -> None:
        """Rank 0's receiver released the pages, or succeeded."""
        with self._lock:
            self._local_settled = True
        self.check_release()

    def check_release(self) -> None:
        if self._release is None:
            return
        with self._lock:
            if (
                self._released
                or not self._local_settled
                or not all(r.settled() for r in self.remotes)
            ):
                return
            self._released = True
        if not (
            self.local.poll() == KVPoll.Success
            and all(r.state == KVPoll.Success for r in self.remotes)
        ):
            self._release()  # a success's pages are the engine's, not the release path's


class Ranks:
    """Rank 0's side of the group: the other ranks' links, their rooms, the model hook."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.host: ModelHost | None = None
        self.links: dict[int, tp.Link] = {}
        self._rooms: dict[tuple[int, int], Remote] = {}
        self._lock = threading.Lock()
        self.broken: str | None = None
        store = tp.open_store(cfg.tp)
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        try:
            for r in range(1, cfg.tp):
                self.links[r] = tp.spawn(follower.main, r, cfg, store.port, level)
            self.gather = self._join(store)
            for link in self.links.values():
                link.wait_ready(tp.START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        self._store = store
        for link in self.links.values():
            link.on_event, link.on_exit = self._on_event, self._on_exit
            link.start()

    def _join(self, store: Any) -> Any:
        """Join the group, failing at once (with its reason) if a rank dies before joining."""
        got: dict[str, Any] = {}

        def join() -> None:
            try:
                got["gather"] = tp.join(store.port, 0, self.cfg.tp, store)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                got["error"] = e

        t = threading.Thread(target=join, daemon=True, name="pdxfer-tp-join")
        t.start()
        while t.is_alive():
            t.join(0.2)
            for link in self.links.values():
                if link.proc.exitcode is not None:
                    link.wait_ready(0)  # raises with the rank's own reason
        if "error" in got:
            raise got["error"]
        return got["gather"]

    def attach(self, host: ModelHost) -> None:
        self.host = host
        host.ranks = self
        host.model.mirror = host.draft.mirror = self._mirror

    # -- commands ---------------------------------------------------------------------------
    def check(self) -> None:
        if self.broken is not None:
            raise WorkerBroken(f"this worker lost a TP rank: {self.broken}")

    def send(self, op: str, **kw: Any) -> None:
        for link in self.links.values():
            link.send(op, **kw)

    def _mirror(
        self,
        m: ToyModel,
        tokens: Sequence[int],
        start: int,
        page_table: PageTable,
        kv: KVPool,
        logits_for: str,
    ) -> None:
        self.check()
        h = self.host
        assert h is not None
        self.send(
            "forward",
            model="target" if m is h.model else "draft",
            pool="kv" if kv is h.kv else "draft_kv",
            tokens=[int(t) for t in tokens],
            start=start,
            pages=np.asarray(page_table, dtype=np.int64).tolist(),
            logits_for=logits_for,
        )

    # -- rooms ---------------------------------------------------------------------------------
    def remote(self, rank: int, room: int, kind: str, group: Group) -> Remote:
        r = Remote(self, rank, room, kind)
        r.group = group
        with self._lock:
            dead = self.links[rank].dead
            if dead is not None:
                r.gone(dead)
            else:
                self._rooms[(rank, room)] = r
        return r

    def _on_event(self, rank: int, kind: str, args: tuple[Any, ...]) -> None:
        room = int(args[0])
        with self._lock:
            r = self._rooms.get((rank, room))
        if r is None:
            return
        if kind == "state":
            _, state, failure, stats = args
            r.stats, r.failure, r.state = stats, failure, KVPoll(state)
        elif kind == "released":
            r.released = True
        elif kind == "unheld":
            r.holding = False
        if r.done():
            with self._lock:
                self._rooms.pop((rank, room), None)
        if r.group is not None:
            r.group.check_release()

    def _on_exit(self, rank: int, why: str) -> None:
        self.broken = self.broken or why
        with self._lock:
            gone = [r for (k, _), r in self._rooms.items() if k == rank]
            for r in gone:
                self._rooms.pop((rank, r.room), None)
        for r in gone:
            r.gone(why)
            if r.group is not None:
                r.group.check_release()

    def unsettled(self, rank: int) -> int:
        """Rooms rank 0 still waits on that rank for (a transfer, a release, a hold)."""
        with self._lock:
            return sum(1 for k, _ in self._rooms if k == rank)

    def info(self) -> list[dict[str, Any]]:
        out = []
        for r, link in sorted(self.links.items()):
            out.append(
                {
                    "rank": r,
                    "pid": link.pid,
                    "alive": link.dead is None,
                    "endpoint": link.info.get("endpoint"),
                    "rooms": self.unsettled(r),
                    **({"error": link.dead} if link.dead else {}),
                }
            )
        return out

    def stats(self) -> dict[int, dict[str, Any]]:
        """Each live rank's tier counters and endpoint metrics (Prometheus text)."""
        out = {}
        for r, link in self.links.items():
            if link.dead is None:
                try:
                    out[r] = link.call("stats", 10.0)
                except Exception:  # noqa: BLE001 - a slow or dying rank leaves a gap
                    continue
        return out

    def close(self) -> None:
        tp.stop_all(list(self.links.values()))


# -- what the workers call, at any TP size ------------------------------------------------------
def start_host(cfg: WorkerConfig) -> ModelHost:
    """The worker's rank 0 (its only rank at TP 1), with the other ranks running."""
    if cfg.tp == 1:
        return ModelHost(cfg)
    ranks = Ranks(cfg)
    try:
        host = ModelHost(cfg, 0, ranks.gather)
    except BaseException:
        ranks.close()
        raise
    ranks.attach(host)
    return host


def check(host: ModelHost) -> None:
    """Refuse new work once a rank is gone (``WorkerBroken``)."""
    if host.ranks is not None:
        host.ranks.check()


def open_sender(host: ModelHost, room: int, peer: str | None) -> Any:
    tx = host.endpoint.sender(room, peer=peer)
    if host.ranks is None:
        return tx
    g = Group(host.ranks, tx, "sender")  # follows the other ranks' events from here on
    host.ranks.send("open_sender", room=room, peer=peer)
    return g


def decode_asked(tx: Any) -> bool:
    """Whether a sender's decode asked for the room's KV (every decode rank of its group:
    the sender left ``Bootstrapping``), or the room failed. A decode asks only after it
    admitted the request, and asks all prefill ranks at once, so at TP > 1 rank 0's own
    sender speaks for the group (the other ranks report only the end of a room)."""
    local = tx.local if isinstance(tx, Group) else tx
    return bool(local.poll() != KVPoll.Bootstrapping or tx.poll() == KVPoll.Failed)


def open_receiver(
    host: ModelHost,
    cache: TieredCache | None,
    room: int,
    bootstrap: str,
    instance: str | None,
    tokens: Sequence[int],
    dst: Sequence[int],
    slot: int,
    n: int,
    tenant: str,
    release: Callable[[], None],
) -> Any:
    """Every rank's receiver for the room; ``release()`` once a failed room's pages are free
    on every rank."""
    if host.ranks is None:
        return open_local_receiver(
            host,
            cache,
            room,
            bootstrap,
            instance,
            tokens,
            dst,
            slot,
            n,
            tenant,
            lambda *_: release(),
        )
    ranks = host.ranks
    seen: dict[str, Any] = {"released": False, "group": None}

    def local_release(*_: Any) -> None:
        seen["released"] = True
        if seen["group"] is not None:
            seen["group"].local_settled()

    rx = open_local_receiver(
        host, cache, room, bootstrap, instance, tokens, dst, slot, n, tenant, local_release
    )
    g = seen["group"] = Group(ranks, rx, "receiver", release)
    if seen["released"]:  # released before the group existed
        g.local_settled()
    ranks.send(
        "open_receiver",
        room=room,
        bootstrap=bootstrap,
        instance=instance,
        tokens=[int(t) for t in tokens],
        dst=[int(p) for p in dst],
        slot=slot,
        n=n,
        tenant=tenant,
    )
    return g


def reuse_prefix(
    host: ModelHost, cache: TieredCache, tokens: Sequence[int], pages: Sequence[int], tenant: str
) -> int:
    """Load the longest prefix every rank holds; a rank that loaded more recomputes it
    (bit for bit the same KV)."""
    if host.ranks is None:
        return reuse(cache, tokens, pages, tenant)
    # the others load while this rank does
    futs = [
        link.ask(
            "reuse", tokens=[int(t) for t in tokens], pages=[int(p) for p in pages], tenant=tenant
        )
        for link in host.ranks.links.values()
    ]
    mine = reuse(cache, tokens, pages, tenant)
    return min([mine, *(int(f.result(60.0)) for f in futs)])


def write_back(
    host: ModelHost,
    cache: TieredCache | None,
    tokens: Sequence[int],
    pages: Sequence[int],
    n: int,
    tenant: str,
) -> None:
    """Keep a prompt's pages in every rank's tiers (each its own heads)."""
    if cache is None:
        return
    if host.ranks is not None:
        host.ranks.send(
            "write_back",
            tokens=[int(t) for t in tokens],
            pages=[int(p) for p in pages],
            n=n,
            tenant=tenant,
        )
    cache.write_back(tokens, {"kv": list(pages)}, n, tenant)
