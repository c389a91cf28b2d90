"""The transport protocol: register memory, write blocks to a peer, probe a peer."""

from __future__ import annotations

import threading
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
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, calls: int = 0, entries: int = 0, nbytes: int = 0, failures: int = 0,
            retries: int = 0) -> None:
        with self.lock:
            self.calls += calls
            self.entries += entries
            self.bytes += nbytes
            self.failures += failures
            self.retries += retries


class Transport(Protocol):
    """What an endpoint needs from a transport. Writes are one-sided pushes."""

    session_id: str
    """How peers name this transport (``host:port``); carried in Hello and registration."""

    stats: TransportStats

    def register(self, addr: int, nbytes: int, location: str = "cpu") -> None: ...

    def deregister(self, addr: int) -> None: ...

    def write(self, peer: str, src: np.ndarray | list[int], dst: np.ndarray | list[int],
              nbytes: np.ndarray | list[int]) -> None:
        """Write every block, or raise ``TransportError``. Blocking; call it off the engine loop."""
        ...

    def start(self, peer: str, src: list[int], dst: list[int], nbytes: list[int],
              tag: int | None = None) -> object | None:
        """Submit a small write without blocking, or None (then use ``write``); a started
        write must be passed to ``finish``."""
        ...

    def finish(self, peer: str, started: object) -> None:
        """Wait for a started write, or raise ``TransportError``. Blocking."""
        ...

    def probe(self, peer: str) -> bool:
        """Whether ``peer``'s transport answers (cheap liveness check)."""
        ...

    def close(self) -> None: ...
