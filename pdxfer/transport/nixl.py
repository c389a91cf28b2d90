"""NIXL (UCX) as a pdxfer transport (``transport="nixl"``, or picked by ``auto`` on one host).

Pairing metadata (the agent's registered memory, device list and page sizes) travels inside
pdxfer's own ``Hello``/``HelloAck``, so there is no etcd and no listener. Page descriptors
are prepared once per peer and memory type; whole-page blocks are written by index, other
blocks described per call. NIXL has no deadline of its own, so posts are polled with a
growing sleep and cancelled (or awaited, pages quarantined) at the endpoint's deadline; a
lost peer is ``NixlPeerLost``. The shape follows what NIXL needs: descriptors typed by
memory and device, the system libnl loaded before NIXL's own, an explicit ``close()``,
a progress thread that sleeps on events (``PDXFER_NIXL_TICK_US``) and large writes split
across UCX threads (``PDXFER_NIXL_THREADS``). The reasons, one by one:
``pdxfer/transport/README.md``; measurements: docs/performance-history.md#nixl-how-fast-ucx-allows-2026-11-26.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import importlib.util
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np

from ..config import knobs, nixl_env_defaults
from ..errors import ConfigError, PeerLost, TransportError, TransportUnavailable
from ..faults import faults
from .base import FinalFailures, Started, TransportStats

log = logging.getLogger(__name__)

_POLL_MIN_S = 20e-6
_POLL_MAX_S = 500e-6
SPLIT_ENTRIES = 256
"""Writes of at least this many descriptors are split across the UCX threads (NIXL's default
is 1024: a 512-page request would run on one thread)."""
_AGENT_LOCK = threading.Lock()
_ids = itertools.count(1)


class NixlPeerLost(TransportError, PeerLost):
    """NIXL reported the remote agent disconnected."""

    kind = "peer_lost"


_SYSTEM_NL = "libnl-route-3.so.200"
_pinned: list[Any] = []


def _pin_system_libnl() -> None:
    """Load the system's libnl-route before NIXL's bundled copy, or the process dies with
    SIGSEGV at exit.

    NIXL's wheel bundles its own libnl-route (under a hashed name, with its libibverbs), and
    UCX's InfiniBand/EFA modules pull in the system's ``libibverbs`` and with it the system's
    libnl-route, so one process holds two copies. Loaded in that order, the bundled copy's
    ELF destructor faults in ``rtnl_tc_unregister`` when the process exits (probed: a bare
    ``nixl_agent`` and nothing else, exit status -11; the same with the system copy loaded
    first, or with Mooncake, which links the system's libibverbs, imported first: exit 0).
    Loading the system copy first (locally: its symbols stay out of the global scope) is
    what Mooncake's import did by accident; where the system has none, there is no second
    copy and nothing to do."""
    if _pinned:
        return
    try:
        _pinned.append(ctypes.CDLL(_SYSTEM_NL))
    except OSError:
        _pinned.append(None)


def installed() -> bool:
    """Whether one of NIXL's builds (``_BUILDS``) is installed, without loading it."""
    return any(importlib.util.find_spec(name) is not None for name in _BUILDS)


def _load() -> Any:
    nixl_env_defaults()
    _pin_system_libnl()
    errors = []
    for name in _BUILDS:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise TransportUnavailable(
        "NIXL is not installed: pip install 'pdxfer[nixl]' (nixl-cu12; no CUDA needed), or "
        f"nixl-cu13 on a CUDA 13 machine; original errors: {'; '.join(errors)}"
    ) from None


_BUILDS = ("nixl_cu12", "nixl_cu13")
"""NIXL's builds as they install (one per CUDA major version), the first found is used."""


def _agent(nixl: Any, name: str, backends: tuple[str, ...], threads: int) -> Any:
    """A NIXL agent whose UCX progress thread sleeps (on events, at most
    ``PDXFER_NIXL_TICK_US``) instead of spinning, and whose UCX backend splits large writes
    across ``threads``.

    ``nixl_agent`` sets the tick (``pthrDelay``) to 0 on the config object it builds and
    offers no argument for it, so the config class it instantiates is swapped, for this
    construction only, for a subclass that keeps pdxfer's tick."""
    api = nixl._api
    base = api.nixlBind.nixlAgentConfig
    tick = knobs().nixl_tick_us

    class _Config(base):  # type: ignore[misc, valid-type]  # a base class known at run time
        def __setattr__(self, key: str, value: Any) -> None:
            super().__setattr__(key, tick if key == "pthrDelay" else value)

    conf = nixl.nixl_agent_config(
        backends=[], sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    )
    with _AGENT_LOCK:
        api.nixlBind.nixlAgentConfig = _Config
        try:
            agent = nixl.nixl_agent(name, conf)
        finally:
            api.nixlBind.nixlAgentConfig = base
    params = (
        {"num_threads": str(threads), "split_batch_size": str(SPLIT_ENTRIES)} if threads > 1 else {}
    )
    for b in backends:
        if b in agent.get_plugin_list():
            agent.create_backend(b, params if b == "UCX" else {})
    return agent


@dataclass(slots=True, eq=False)
class _Xfer:
    """One posted write (a ``Started``): one or two NIXL requests (prepared, per call)."""

    handles: list[Any]
    nbytes: int
    entries: int
    submitted: float
    states: list[str]


@dataclass(slots=True, eq=False)
class _Pending:
    """A small write handed to the post thread by ``start`` (a ``Started``)."""

    fut: Future[_Xfer]
    submitted: float


MAX_PEER_PAGES = 1 << 22
"""Most page descriptors a peer's regions may ask for (a peer's page sizes come from the
network: a forged region list must not make this side allocate without bound)."""

_U63 = msgspec.Meta(ge=0, le=(1 << 63) - 1)

DRAM = -1
"""The device code of host memory (a CUDA device's code is its index)."""
MAX_DEVICE = 1 << 16


def _device(location: str) -> int:
    """A pool's location string as a device code: ``cuda:N`` -> N, anything else DRAM."""
    if not location.startswith("cuda"):
        return DRAM
    return int(location.split(":")[1]) if ":" in location else 0


class _Mems:
    """Which memory holds each address of a set of regions.

    NIXL matches a transfer descriptor only against memory registered with the same type
    (``DRAM`` or ``VRAM``) and device: a device pool's pages described as DRAM are not found
    (``NIXL_ERR_NOT_FOUND``, seen on an H100). So every descriptor list is built per memory
    type, each row naming its device."""

    def __init__(self, regions: list[tuple[int, int, int]]) -> None:
        regs = sorted(regions)  # (addr, nbytes, device code)
        self.addr = np.array([a for a, _, _ in regs], dtype=np.int64)
        self.end = np.array([a + n for a, n, _ in regs], dtype=np.int64)
        self.dev = np.array([d for _, _, d in regs], dtype=np.int64)

    def of(self, addr: np.ndarray) -> np.ndarray:
        """Per address: the device code of the region holding it (``DRAM`` outside every
        region: NIXL then refuses the write, as for any unregistered address)."""
        if not self.addr.size:
            return np.full(addr.shape, DRAM, dtype=np.int64)
        r = np.searchsorted(self.addr, addr, side="right") - 1
        rc = np.maximum(r, 0)
        inside = (r >= 0) & (addr < self.end[rc])
        return np.where(inside, self.dev[rc], DRAM)


def split_by_memory(
    src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, src_dev: np.ndarray, dst_dev: np.ndarray
) -> list[tuple[str, np.ndarray, str, np.ndarray]]:
    """Blocks as NIXL descriptor rows ``(addr, len, device)``, one group per pair of memory
    types: ``[(src_mem, src_rows, dst_mem, dst_rows), ...]`` (a NIXL list has one type)."""
    out = []
    for s_vram in (False, True):
        for d_vram in (False, True):
            m = ((src_dev >= 0) == s_vram) & ((dst_dev >= 0) == d_vram)
            if not m.any():
                continue
            n = nbytes[m].astype(np.uint64)
            out.append(
                (
                    "VRAM" if s_vram else "DRAM",
                    np.stack(
                        [src[m].astype(np.uint64), n, np.maximum(src_dev[m], 0).astype(np.uint64)],
                        1,
                    ),
                    "VRAM" if d_vram else "DRAM",
                    np.stack(
                        [dst[m].astype(np.uint64), n, np.maximum(dst_dev[m], 0).astype(np.uint64)],
                        1,
                    ),
                )
            )
    return out


class _Info(msgspec.Struct, frozen=True):
    """What ``peer_info`` carries: the agent's metadata and its page-holding regions."""

    md: bytes
    regions: list[tuple[Annotated[int, _U63], Annotated[int, _U63], Annotated[int, _U63]]]
    """(addr, nbytes, item_bytes) per registered region; item 0: not paged. Device regions
    say 0 here (a peer of an older release would prepare them as host pages): their page
    size is in ``items``."""
    devices: list[Annotated[int, msgspec.Meta(ge=DRAM, le=MAX_DEVICE)]] = []
    """Per region: the CUDA device that holds it, or ``DRAM`` (-1); empty: all DRAM (a peer
    of a release before device memory was described)."""
    items: list[Annotated[int, _U63]] = []
    """Per region: its page size, device regions included; empty: ``regions``' (a peer of
    a release before device pages were prepared)."""


def page_regions(
    regions: list[tuple[int, int, int]], devices: list[int], items: list[int]
) -> dict[str, list[tuple[int, int, int, int]]]:
    """A peer's (or this side's) regions as ``(addr, nbytes, item_bytes, device)`` per memory
    type (``DRAM``/``VRAM``), each with the page size it prepares (``_Info.items`` where
    given, else ``regions``' own: device pages then stay unprepared)."""
    if len(items) != len(regions):
        items = [it for _, _, it in regions]
    out: dict[str, list[tuple[int, int, int, int]]] = {}
    for (a, n, _), it, d in zip(regions, items, devices):
        out.setdefault("DRAM" if d == DRAM else "VRAM", []).append((a, n, it, max(d, 0)))
    return out


class _Layout:
    """Page-granular descriptors of a set of regions of one memory type, in one prepared
    list: region ``r``'s page ``i`` is descriptor ``first[r] + i``. Regions are
    ``(addr, nbytes, item_bytes[, device])``."""

    def __init__(self, regions: Sequence[tuple[int, ...]], mem: str = "DRAM") -> None:
        regs = sorted(
            (r[0], r[1], r[2], r[3] if len(r) > 3 else 0)
            for r in regions
            if r[2] > 0 and r[1] >= r[2]
        )
        self.mem = mem
        self.addr = np.array([a for a, _, _, _ in regs], dtype=np.int64)
        self.end = np.array([a + n - n % it for a, n, it, _ in regs], dtype=np.int64)
        self.item = np.array([it for _, _, it, _ in regs], dtype=np.int64)
        self.dev = np.array([d for _, _, _, d in regs], dtype=np.int64)
        counts = (self.end - self.addr) // np.maximum(self.item, 1)
        self.first = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
        self.total = int(counts.sum())
        self.handle: Any = None

    def descs(self) -> np.ndarray:
        """``[total, 3]`` (addr, len, device) rows, region by region."""
        rows = [
            np.stack(
                [
                    np.arange(a, e, it, dtype=np.int64),
                    np.full((e - a) // it, it),
                    np.full((e - a) // it, d, dtype=np.int64),
                ],
                axis=1,
            )
            for a, e, it, d in zip(
                self.addr.tolist(), self.end.tolist(), self.item.tolist(), self.dev.tolist()
            )
        ]
        return (np.concatenate(rows) if rows else np.empty((0, 3), dtype=np.int64)).astype(
            np.uint64
        )

    def locate(self, addr: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per block: its first descriptor and its item size, or -1 where the block is not
        whole pages of one region (only called on a layout with regions)."""
        r = np.searchsorted(self.addr, addr, side="right") - 1
        rc = np.maximum(r, 0)
        item = self.item[rc]
        off = addr - self.addr[rc]
        ok = (
            (r >= 0)
            & (addr + nbytes <= self.end[rc])
            & (nbytes > 0)
            & (off % item == 0)
            & (nbytes % item == 0)
        )
        return np.where(ok, self.first[rc] + off // item, -1), np.where(ok, item, 0)


class NixlTransport(FinalFailures):
    """One NIXL agent (UCX backend) per endpoint; the agent name is the session id."""

    name = "nixl"

    def __init__(
        self,
        host: str = "127.0.0.1",
        timeout_s: float = 30.0,
        max_batch: int = 4096,
        backends: tuple[str, ...] = ("UCX",),
        threads: int | None = None,
    ) -> None:
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
        nixl = _load()
        bindings = importlib.import_module(f"{nixl.__name__}._bindings")

        self._errors = bindings
        self.session_id = f"nixl-{host}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.threads = knobs().nixl_workers if threads is None else threads
        try:
            self._agent: Any = _agent(nixl, self.session_id, backends, self.threads)
        except Exception as e:  # noqa: BLE001 - any library failure is "unavailable"
            raise TransportUnavailable(f"NIXL agent could not start: {e}") from None
        if not self._agent.backends:
            raise TransportUnavailable(f"NIXL has none of the backends {backends}")
        self.timeout_s = timeout_s
        self.batch_entries = max_batch
        self.stats = TransportStats()
        self._lock = threading.Lock()
        self._regions: dict[int, tuple[Any, int, int, int]] = {}
        """addr -> (NIXL descriptors, nbytes, item_bytes, device code)"""
        self._peers: dict[str, bytes] = {}
        self._remote: dict[str, dict[str, _Layout]] = {}
        """peer -> its page layouts, one per memory type"""
        self._remote_mems: dict[str, _Mems] = {}
        self._local_mems = _Mems([])
        self._local: dict[str, _Layout] | None = None
        self._retired: list[Any] = []
        self._info: bytes | None = None
        """``peer_info``'s bytes for the current registrations (``_describe``)."""
        self._closed = False
        self._poster: ThreadPoolExecutor | None = None
        self.stats_prepped = 0
        """Page descriptors written through prepared lists (the rest were described per
        call)."""
        self.notifs_dropped = 0
        """Peer probes taken out of this agent's inbox (``probe``)."""
        self._faults = faults()
        atexit.register(self.close)

    # -- pairing -------------------------------------------------------------------------------
    def peer_info(self) -> bytes:
        """This agent's metadata (its registered memory) and its regions' page sizes, for
        the peer's ``add_peer``: taken when the registrations last changed (``_info``),
        never at a Hello while writes run."""
        with self._lock:
            if self._info is None:
                self._info = self._describe()
            return self._info

    def _describe(self) -> bytes:
        """``peer_info``'s bytes, asked of the agent now (under the lock).

        NIXL's ``get_agent_metadata`` keeps the GIL while it waits for the UCX worker, and a
        write in flight holds that worker for its whole copy (CMA copies inside the post):
        asked while a write runs, it stops every Python thread of the process until the copy
        is over (probed: a 64 MiB write, the call and the whole process stalled 2.3 s). So it
        is asked when the registrations change, at start-up, and a Hello or HelloAck (each
        one, retransmissions too) takes the bytes kept here."""
        regions = [(a, n, it if d == DRAM else 0) for a, (_, n, it, d) in self._regions.items()]
        devices = [d for (_, _, _, d) in self._regions.values()]
        items = [it for (_, _, it, _) in self._regions.values()]
        return msgspec.msgpack.encode(
            _Info(bytes(self._agent.get_agent_metadata()), regions, devices, items)
        )

    def add_peer(self, peer: str, info: bytes) -> None:
        """Load ``peer``'s metadata so writes to it can be built; a peer that re-paired
        (new registrations) replaces its old metadata."""
        if not info:
            raise TransportError(f"peer {peer} sent no NIXL metadata (is it on --transport nixl?)")
        try:
            parsed = msgspec.msgpack.decode(bytes(info), type=_Info)
        except msgspec.DecodeError as e:
            raise TransportError(f"NIXL metadata of {peer} is malformed: {e}") from None
        with self._lock:
            if self._peers.get(peer) == info:
                return
            if peer in self._peers:
                self._forget(peer)
            try:
                name = self._agent.add_remote_agent(parsed.md)
            except Exception as e:  # noqa: BLE001 - bad metadata refuses the pairing
                raise TransportError(f"NIXL metadata of {peer} was refused: {e}") from None
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name != peer:
                self._agent.remove_remote_agent(name)
                raise TransportError(f"NIXL metadata names agent {name!r}, not {peer!r}")
            devices = parsed.devices or [DRAM] * len(parsed.regions)
            lays: dict[str, _Layout] | None = None
            try:
                if len(devices) == len(parsed.regions):
                    lays = {
                        m: _Layout(r, m)
                        for m, r in page_regions(parsed.regions, devices, parsed.items).items()
                    }
            except (OverflowError, ValueError):  # regions past the end of memory
                lays = None
            if lays is None or sum(x.total for x in lays.values()) > MAX_PEER_PAGES:
                self._agent.remove_remote_agent(name)
                raise TransportError(
                    f"NIXL peer {peer} names impossible regions or more than {MAX_PEER_PAGES} pages"
                )
            self._peers[peer] = bytes(info)
            self._remote[peer] = lays
            self._remote_mems[peer] = _Mems(
                [(a, n, d) for (a, n, _), d in zip(parsed.regions, devices)]
            )

    def _forget(self, peer: str) -> None:
        """Drop a peer's metadata and prepared list (under the lock)."""
        for lay in self._remote.pop(peer, {}).values():
            if lay.handle is not None:
                self._release_dlist(lay.handle)
        self._peers.pop(peer, None)
        self._remote_mems.pop(peer, None)
        self._agent.remove_remote_agent(peer)

    def _drop_local(self) -> None:
        """Forget the prepared local list (under the lock); writes prepare it again. Its
        handle is released at close, not now: a write on another thread may be using it."""
        for lay in (self._local or {}).values():
            if lay.handle is not None:
                self._retired.append(lay.handle)
        self._local = None

    def _release_dlist(self, h: Any) -> None:
        try:
            self._agent.release_dlist_handle(h)
        except Exception as e:  # noqa: BLE001
            log.debug("NIXL release_dlist_handle: %s", e)

    def _prepared(self, peer: str) -> list[tuple[_Layout, _Layout]]:
        """Both sides' prepared page lists for ``peer`` (prepared on first use), one pair
        per pair of memory types that both have pages of (none: every block per call)."""
        with self._lock:
            remote = self._remote.get(peer)
            if not remote:
                return []
            if self._local is None:
                regs = [(a, n, it) for a, (_, n, it, _) in self._regions.items()]
                devs = [d for (_, _, _, d) in self._regions.values()]
                self._local = {m: _Layout(r, m) for m, r in page_regions(regs, devs, []).items()}
            out = []
            for lm, local in self._local.items():
                if not local.total:
                    continue
                for rm, rem in remote.items():
                    if not rem.total:
                        continue
                    try:
                        if local.handle is None:
                            local.handle = self._agent.prep_xfer_dlist(
                                "NIXL_INIT_AGENT", local.descs(), lm
                            )
                        if rem.handle is None:
                            rem.handle = self._agent.prep_xfer_dlist(peer, rem.descs(), rm)
                    except Exception as e:  # noqa: BLE001 - then described per call
                        log.warning(
                            "NIXL prep_xfer_dlist (%s to %s of %s) failed (%s): those "
                            "writes are described per call",
                            lm,
                            rm,
                            peer,
                            e,
                        )
                        (local if local.handle is None else rem).total = 0
                        continue
                    out.append((local, rem))
            return out

    # -- memory --------------------------------------------------------------------------------
    def register(self, addr: int, nbytes: int, location: str = "cpu", item_bytes: int = 0) -> None:
        code = _device(location)
        mem = "DRAM" if code == DRAM else "VRAM"
        with self._lock:
            if addr in self._regions:
                return
            try:
                descs = self._agent.register_memory(
                    [(int(addr), int(nbytes), max(code, 0), "")], mem
                )
            except Exception as e:  # noqa: BLE001
                raise TransportError(
                    f"NIXL register_memory({addr:#x}, {nbytes}, {mem}) failed: {e}"
                ) from None
            self._regions[addr] = (descs, nbytes, item_bytes, code)
            self._local_mems = self._mems()
            self._drop_local()  # prepared again with the new region on the next write
            self._info = self._describe()

    def deregister(self, addr: int) -> None:
        with self._lock:
            reg = self._regions.pop(addr, None)
            if reg is not None:
                self._local_mems = self._mems()
                self._drop_local()
                try:
                    self._agent.deregister_memory(reg[0])
                except Exception as e:  # noqa: BLE001
                    log.warning("NIXL deregister_memory(%#x) failed: %s", addr, e)
                self._info = self._describe()

    def _mems(self) -> _Mems:
        return _Mems([(a, n, d) for a, (_, n, _, d) in self._regions.items()])

    # -- writes --------------------------------------------------------------------------------
    def _error(self, peer: str, what: str, e: BaseException) -> TransportError:
        self.stats.add(failures=1)
        if isinstance(e, self._errors.nixlRemoteDisconnectError):
            return NixlPeerLost(f"NIXL peer {peer} disconnected during {what}")
        return TransportError(f"NIXL {what} to {peer} failed: {type(e).__name__}: {e}")

    def _post(self, peer: str, src: Any, dst: Any, nbytes: Any) -> _Xfer:
        if peer not in self._peers:
            raise TransportError(f"no NIXL metadata for peer {peer} (not paired)")
        s = np.asarray(src, dtype=np.int64)
        d = np.asarray(dst, dtype=np.int64)
        n = np.asarray(nbytes, dtype=np.int64)
        if not (s.shape == d.shape == n.shape):
            raise TransportError("src, dst and nbytes differ in length")
        reqs: list[Any] = []
        try:
            rest = np.ones(s.size, dtype=bool)
            for local, remote in self._prepared(peer):  # one request per pair of memories
                if not rest.any():
                    break
                lf, li = local.locate(s, n)
                rf, ri = remote.locate(d, n)
                whole = rest & (lf >= 0) & (rf >= 0) & (li == ri) & (li > 0)
                if whole.any():
                    k = n[whole] // li[whole]  # pages per block
                    step = np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)
                    lidx = (np.repeat(lf[whole], k) + step).astype(np.int32)
                    ridx = (np.repeat(rf[whole], k) + step).astype(np.int32)
                    reqs.append(
                        self._agent.make_prepped_xfer(
                            "WRITE", local.handle, lidx, remote.handle, ridx
                        )
                    )
                    self.stats_prepped += int(k.sum())
                    rest &= ~whole
            if rest.any():
                with self._lock:
                    lm, rm = self._local_mems, self._remote_mems.get(peer, _Mems([]))
                sr, dr = s[rest], d[rest]
                for lmem, ls, rmem, rs in split_by_memory(sr, dr, n[rest], lm.of(sr), rm.of(dr)):
                    reqs.append(
                        self._agent.initialize_xfer(
                            "WRITE",
                            self._agent.get_xfer_descs(ls, lmem),
                            self._agent.get_xfer_descs(rs, rmem),
                            peer,
                        )
                    )
        except Exception as e:  # noqa: BLE001
            for h in reqs:
                self._release_handle(h)
            raise self._error(peer, "write setup", e) from None
        x = _Xfer(reqs, int(n.sum()), int(s.size), time.perf_counter(), [])
        try:
            for h in reqs:
                x.states.append(self._agent.transfer(h))
        except Exception as e:  # noqa: BLE001
            self._release(x)
            raise self._error(peer, "write", e) from None
        self.stats.add(calls=1, entries=x.entries, nbytes=x.nbytes)
        return x

    def _release_handle(self, h: Any) -> bool:
        try:
            self._agent.release_xfer_handle(h)
            return True
        except Exception as e:  # noqa: BLE001 - an active write NIXL cannot cancel
            log.warning("NIXL could not release a write in flight (%s): it may still land", e)
            return False

    def _release(self, x: _Xfer) -> bool:
        """Release every request of ``x``; those NIXL could not cancel stay in ``x`` (they
        may still land and are awaited). True when none is left."""
        kept = [(h, st) for h, st in zip(x.handles, x.states) if not self._release_handle(h)]
        x.handles, x.states = [h for h, _ in kept], [st for _, st in kept]
        return not kept

    def _wait(self, peer: str, x: _Xfer, deadline: float | None) -> None:
        delay = _POLL_MIN_S
        cancelled = False
        while "PROC" in x.states:  # drained, even when a part failed
            if deadline is not None and not cancelled and time.monotonic() > deadline:
                if self._release(x):
                    self.stats.add(failures=1)
                    raise TransportError(f"NIXL write to {peer} passed its deadline (cancelled)")
                cancelled = True  # it cannot be recalled: wait until it is over
            if self._closed:
                raise TransportError("transport closed while a write was in flight")
            time.sleep(delay)
            delay = min(delay * 1.5, _POLL_MAX_S)
            try:
                x.states = [
                    st if st != "PROC" else self._agent.check_xfer_state(h)
                    for h, st in zip(x.handles, x.states)
                ]
            except Exception as e:  # noqa: BLE001
                err = self._error(peer, "write", e)
                self._release(x)
                raise err from None
        states = list(x.states)
        self._release(x)
        if any(st != "DONE" for st in states):
            self.stats.add(failures=1)
            raise TransportError(f"NIXL write to {peer} ended in states {states}")
        if cancelled:
            raise TransportError(f"NIXL write to {peer} finished after its deadline")

    def write(
        self,
        peer: str,
        src: np.ndarray | list[int],
        dst: np.ndarray | list[int],
        nbytes: np.ndarray | list[int],
        *,
        deadline: float | None = None,
        should_stop: Callable[[], bool] | None = None,
        tag: int | None = None,
    ) -> None:
        total = len(src)
        f = self._faults
        if deadline is None:  # NIXL has none of its own: never wait without one
            deadline = time.monotonic() + self.timeout_s
        tracked = f.active
        if tracked:
            f.write_began(tag)
        try:
            for lo in range(0, total, self.batch_entries):
                if should_stop is not None and should_stop():
                    raise TransportError(f"write to {peer} stopped after {lo} of {total} blocks")
                if time.monotonic() > deadline:
                    raise TransportError(
                        f"write to {peer} passed its deadline after {lo} of {total} blocks"
                    )
                if f.active:
                    f.before_batch(tag)
                hi = min(total, lo + self.batch_entries)
                self._wait(peer, self._post(peer, src[lo:hi], dst[lo:hi], nbytes[lo:hi]), deadline)
        finally:
            if tracked:  # each batch was awaited: nothing of this write is on its way
                f.write_ended(tag)

    def start(
        self,
        peer: str,
        src: list[int],
        dst: list[int],
        nbytes: list[int],
        *,
        tag: int | None = None,
    ) -> _Pending | None:
        """Hand a small write to the post thread and return at once: over shared memory
        UCX copies inside the post, so posting here would block the engine's ``send()`` for
        the whole copy (and the sender's digest could not overlap it)."""
        if len(src) > self.batch_entries or (self._faults.active and self._faults.delays(tag)):
            return None
        with self._lock:
            if self._closed:
                return None
            if self._poster is None:
                self._poster = ThreadPoolExecutor(
                    max_workers=2, thread_name_prefix="pdxfer-nixl-post"
                )
            poster = self._poster
        return _Pending(poster.submit(self._post, peer, src, dst, nbytes), time.perf_counter())

    def finish(self, peer: str, started: Started) -> None:
        assert isinstance(started, _Pending), started
        x = started.fut.result()  # a failed post raises its TransportError here
        self._wait(peer, x, time.monotonic() + self.timeout_s)

    # -- liveness and teardown -----------------------------------------------------------------
    def probe(self, peer: str) -> bool:
        """A notification to the peer: refused at once when its agent is gone. The peer's
        own probes pile up in this agent's inbox (nothing else reads it): drop them here."""
        try:
            self.notifs_dropped += sum(len(v) for v in self._agent.get_new_notifs().values())
        except Exception:  # noqa: BLE001 - best effort: an inbox that cannot be read is no verdict
            pass
        if peer not in self._peers:
            return True  # not paired yet: nothing says it is gone
        try:
            self._agent.send_notif(peer, b"pdxfer-probe")
            return True
        except Exception:  # noqa: BLE001 - a refused notification means unreachable
            return False

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            poster, self._poster = self._poster, None
            regions = list(self._regions.values())
            self._regions.clear()
            peers = list(self._peers)
            self._peers.clear()
        if poster is not None:
            poster.shutdown(wait=True)  # posts in progress end before the agent goes
        for lays in [self._local or {}, *self._remote.values()]:
            for lay in lays.values():
                if lay.handle is not None:
                    self._release_dlist(lay.handle)
        for h in self._retired:
            self._release_dlist(h)
        self._retired.clear()
        self._remote.clear()
        self._remote_mems.clear()
        self._local = None
        for descs, _, _, _ in regions:
            try:
                self._agent.deregister_memory(descs)
            except Exception as e:  # noqa: BLE001
                log.debug("NIXL deregister at close: %s", e)
        for p in peers:
            try:
                self._agent.remove_remote_agent(p)
            except Exception as e:  # noqa: BLE001
                log.debug("NIXL remove_remote_agent at close: %s", e)
        agent, self._agent = self._agent, None
        del agent
        atexit.unregister(self.close)
