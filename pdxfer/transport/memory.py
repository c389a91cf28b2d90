"""``MemoryTransport``: an in-process transport for unit tests of the state machines.

It really copies bytes (``ctypes.memmove``) between buffers registered on a shared
``MemoryFabric``, refuses any block outside a registered region of either side (as a real
engine would), keeps per-peer credits like Mooncake's, splits writes into batches, and lets a
test inject what networks do: a delay per batch, a failure after N batches (the first ones
landed), a peer that is gone (probes refused) or frozen (probes hang). Not for production:
both endpoints must live in one process.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..errors import TransportError
from .base import FindsPeersBySession, Started, TransportStats
from .pacing import Credits

_ids = itertools.count(1)


class MemoryFabric:
    """The "network": every ``MemoryTransport`` that joined it, by session id."""

    _default: MemoryFabric | None = None
    _default_lock = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peers: dict[str, MemoryTransport] = {}

    @classmethod
    def default(cls) -> MemoryFabric:
        with cls._default_lock:
            if cls._default is None:
                cls._default = cls()
            return cls._default

    def join(self, t: MemoryTransport) -> None:
        with self._lock:
            self._peers[t.session_id] = t

    def leave(self, t: MemoryTransport) -> None:
        with self._lock:
            self._peers.pop(t.session_id, None)

    def peer(self, session: str) -> MemoryTransport | None:
        with self._lock:
            return self._peers.get(session)


@dataclass(slots=True, eq=False)
class _Started:
    peer: str
    entries: int
    total: int
    submitted: float


@dataclass(slots=True)
class Faults:
    """What a test makes this transport do (all off by default)."""

    delay_s: float = 0.0
    """Sleep before each batch (a slow network: writes in flight for a while)."""
    fail_after_batches: int | None = None
    """Fail the write after this many batches landed (0: before any byte lands)."""
    frozen: bool = False
    """Probes of this transport hang (``hang_s``) and then fail: a stopped process. So does
    a step of proving a tainted path to it (``settle``: Mooncake's fence to a stopped
    process waits for its timeout), until it wakes or ``hang_s`` passed."""
    gone: bool = False
    """Writes to and probes of this transport fail at once: a dead process."""
    hang_s: float = 1.0
    strand_s: float = 0.0
    """Report each batch failed at once and land it this much later: Mooncake TCP's failed
    write whose bytes are still on their way (the peer stays ``tainted`` until it landed)."""
    landed: list[float] = field(default_factory=list, repr=False)
    """When (``time.monotonic()``) each stranded batch landed."""
    batches: int = field(default=0, repr=False)


class MemoryTransport(FindsPeersBySession):
    """A transport whose peers live in this process (see the module notes)."""

    name = "memory"

    def __init__(
        self, fabric: MemoryFabric | None = None, batch_entries: int = 512, max_inflight: int = 1024
    ) -> None:
        self.fabric = fabric or MemoryFabric.default()
        self.session_id = f"mem:{next(_ids)}"
        self.stats = TransportStats()
        self.batch_entries = batch_entries
        self.max_inflight = max_inflight
        self.faults = Faults()
        self._regions: dict[int, int] = {}
        self._credits: dict[str, Credits] = {}
        self._stranded: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.fabric.join(self)

    # -- memory ---------------------------------------------------------------------------
    def register(self, addr: int, nbytes: int, location: str = "cpu", item_bytes: int = 0) -> None:
        if location != "cpu":
            raise TransportError(f"the memory transport moves host memory only, not {location}")
        with self._lock:
            self._regions[int(addr)] = int(nbytes)

    def deregister(self, addr: int) -> None:
        with self._lock:
            self._regions.pop(int(addr), None)

    def inside(self, addr: int, n: int) -> bool:
        with self._lock:
            return any(a <= addr and addr + n <= a + size for a, size in self._regions.items())

    def credits(self, peer: str) -> Credits:
        with self._lock:
            c = self._credits.get(peer)
            if c is None:
                c = self._credits[peer] = Credits(self.max_inflight)
            return c

    # -- data -----------------------------------------------------------------------------
    def _target(self, peer: str) -> MemoryTransport:
        if self._closed:
            raise TransportError("transport is closed")
        t = self.fabric.peer(peer)
        if t is None or t.faults.gone or t._closed:
            raise TransportError(f"peer {peer} is unreachable")
        return t

    def _copy(self, t: MemoryTransport, src: list[int], dst: list[int], nb: list[int]) -> None:
        for s, d, n in zip(src, dst, nb):
            if not self.inside(s, n):
                raise TransportError(f"source block {s:#x}+{n} is not registered here")
            if not t.inside(d, n):
                raise TransportError(
                    f"destination block {d:#x}+{n} is outside {t.session_id}'s registered memory"
                )
        for s, d, n in zip(src, dst, nb):
            ctypes.memmove(d, s, n)

    def _batch(
        self, peer: str, src: list[int], dst: list[int], nb: list[int], deadline: float | None
    ) -> None:
        credits = self.credits(peer)
        total = sum(nb)
        credits.acquire(len(src), deadline, total)
        try:
            f = self.faults
            if f.delay_s:
                time.sleep(f.delay_s)
            if f.strand_s:
                self._strand(peer, src, dst, nb)
                self.stats.add(calls=1, failures=1, taints=1)
                raise TransportError(
                    f"injected failure of a batch to {peer} that lands {f.strand_s} s later"
                )
            if f.fail_after_batches is not None and f.batches >= f.fail_after_batches:
                self.stats.add(calls=1, failures=1)
                raise TransportError(f"injected failure after {f.batches} batches to {peer}")
            self._copy(self._target(peer), src, dst, nb)
            f.batches += 1
            self.stats.add(calls=1, entries=len(src), nbytes=total)
        finally:
            credits.release(len(src), total)

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
        sl = src.tolist() if isinstance(src, np.ndarray) else list(src)
        dl = dst.tolist() if isinstance(dst, np.ndarray) else list(dst)
        nl = nbytes.tolist() if isinstance(nbytes, np.ndarray) else list(nbytes)
        step = self.batch_entries
        for i in range(0, len(sl), step):
            if should_stop is not None and should_stop():
                raise TransportError("stopped before all blocks were written")
            if deadline is not None and time.monotonic() > deadline:
                raise TransportError("deadline passed before all blocks were written")
            self._batch(peer, sl[i : i + step], dl[i : i + step], nl[i : i + step], deadline)

    def start(
        self,
        peer: str,
        src: list[int],
        dst: list[int],
        nbytes: list[int],
        *,
        tag: int | None = None,
    ) -> _Started | None:
        """Copies at once (a fast network); ``finish`` only reports the outcome. Writes that a
        test delays or fails go through ``write`` instead, as Mooncake's do."""
        f = self.faults
        if (
            self._closed
            or not 0 < len(src) <= self.batch_entries
            or f.delay_s
            or f.fail_after_batches is not None
            or f.strand_s
        ):
            return None
        t0 = time.perf_counter()
        self._batch(peer, list(src), list(dst), list(nbytes), None)
        return _Started(peer, len(src), sum(nbytes), t0)

    def finish(self, peer: str, started: Started) -> None:
        assert isinstance(started, _Started), started
        return None

    # -- failed writes still on their way (``Faults.strand_s``) -------------------------------
    def _strand(self, peer: str, src: list[int], dst: list[int], nb: list[int]) -> None:
        with self._lock:
            self._stranded[peer] = self._stranded.get(peer, 0) + 1
        delay = self.faults.strand_s

        def land() -> None:
            time.sleep(delay)
            try:
                self._copy(self._target(peer), src, dst, nb)
            except TransportError:
                pass  # the peer left meanwhile: nothing lands
            finally:
                with self._lock:
                    self.faults.landed.append(time.monotonic())
                    self._stranded[peer] -= 1

        threading.Thread(target=land, name="memory-strand", daemon=True).start()

    def tainted(self, peer: str) -> bool:
        with self._lock:
            return bool(self._stranded.get(peer))

    def tainted_peers(self) -> list[str]:
        with self._lock:
            return [p for p, n in self._stranded.items() if n]

    def settle(self, peer: str) -> bool:
        if not self.tainted(peer):
            return True
        t = self.fabric.peer(peer)
        if t is not None and t.faults.frozen:  # the fence would wait for its timeout
            end = time.monotonic() + t.faults.hang_s
            while t.faults.frozen and time.monotonic() < end:
                time.sleep(0.01)
        return False

    def probe(self, peer: str) -> bool:
        t = self.fabric.peer(peer)
        if t is None or t.faults.gone or t._closed:
            return False
        if t.faults.frozen:
            time.sleep(t.faults.hang_s)
            return False
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.fabric.leave(self)
