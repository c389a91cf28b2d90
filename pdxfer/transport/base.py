"""The transport protocol: register memory, write blocks to a peer, probe a peer."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass(slots=True)
class TransportStats:
    """Counters behind the transport (read by metrics)."""

    calls: int = 0
    entries: int = 0
    bytes: int = 0
    failures: int = 0
    retries: int = 0
    taints: int = 0
    """Failed batches whose bytes may still land (``Transport.tainted``)."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(
        self,
        calls: int = 0,
        entries: int = 0,
        nbytes: int = 0,
        failures: int = 0,
        retries: int = 0,
        taints: int = 0,
    ) -> None:
        with self.lock:
            self.calls += calls
            self.entries += entries
            self.bytes += nbytes
            self.failures += failures
            self.retries += retries
            self.taints += taints


class Started(Protocol):
    """A write submitted by ``Transport.start``; hand it to ``finish``."""

    submitted: float
    """``time.perf_counter()`` when it was submitted (the raw write's start, for metrics)."""


class Transport(Protocol):
    """What an endpoint needs from a transport: exactly the calls the endpoint makes. Writes
    are one-sided pushes into memory the peer registered."""

    name: str
    """Which transport this is (``mooncake``, ``memory``, ...): peers must use the same."""

    session_id: str
    """How peers name this transport (``host:port``); carried in Hello and registration."""

    stats: TransportStats

    batch_entries: int
    """Most entries in one batch; ``send()`` starts only writes that fit in one."""

    def peer_info(self) -> bytes:
        """What a peer needs to write into this transport's memory, carried in ``Hello`` and
        ``HelloAck`` (NIXL's agent metadata); empty when the transport finds peers itself."""
        ...

    def add_peer(self, peer: str, info: bytes) -> None:
        """Take a peer's ``peer_info`` before writing to it (or raise ``TransportError``)."""
        ...

    def register(self, addr: int, nbytes: int, location: str = "cpu", item_bytes: int = 0) -> None:
        """Make ``[addr, addr + nbytes)`` writable by peers (or a source of writes).
        ``item_bytes``: the buffer's page (item) size when it holds pages, a hint a
        transport may use to prepare page-granular descriptors once (NIXL)."""
        ...

    def deregister(self, addr: int) -> None: ...

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
        """Write every block, or raise ``TransportError``. Blocking; call it off the engine
        loop. ``deadline`` (monotonic) and ``should_stop`` stop new submissions; whatever is
        already in flight is awaited before this returns or raises ("stopped" means
        "drained"). ``tag`` (the room) only selects injected faults."""
        ...

    def start(
        self,
        peer: str,
        src: list[int],
        dst: list[int],
        nbytes: list[int],
        *,
        tag: int | None = None,
    ) -> Started | None:
        """Submit a small write without blocking, or None (then use ``write``); a started
        write must be passed to ``finish``."""
        ...

    def finish(self, peer: str, started: Started) -> None:
        """Wait for a started write, or raise ``TransportError``. Blocking."""
        ...

    def probe(self, peer: str) -> bool:
        """Whether ``peer``'s transport answers (cheap liveness check)."""
        ...

    def tainted(self, peer: str) -> bool:
        """Whether a write to ``peer`` that was reported failed may still land in its memory
        (a transport whose failures are final always says False)."""
        ...

    def tainted_peers(self) -> list[str]: ...

    def settle(self, peer: str) -> bool:
        """One step of proving that nothing already written to ``peer`` can still land; True
        once proven (``tainted`` is then False). May block: call it off the engine loop."""
        ...

    def close(self) -> None: ...


class FindsPeersBySession:
    """For transports whose peers are reached by session id alone (Mooncake's
    ``P2PHANDSHAKE``, the in-memory fabric): no pairing data to carry or take."""

    def peer_info(self) -> bytes:
        return b""

    def add_peer(self, peer: str, info: bytes) -> None:
        pass


class FinalFailures:
    """For transports whose reported failure is taken to mean that nothing of the write is
    still under way: NIXL (what UCX may still deliver after a failed transfer has not been
    examined; Mooncake, which can deliver late, taints its peer instead)."""

    def tainted(self, peer: str) -> bool:
        return False

    def tainted_peers(self) -> list[str]:
        return []

    def settle(self, peer: str) -> bool:
        return True
