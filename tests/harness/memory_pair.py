"""Two real endpoints in one process over the in-memory transport, for the state-machine tests.

Both endpoints are real (ZMQ control on loopback, a bootstrap server the test starts); only
the transport is ``MemoryTransport``, which really copies bytes and lets a test delay or fail
writes. ``Pair`` holds them and their tensors; ``transfer`` and ``stranded_room`` drive one
room; ``wait`` and ``until`` poll with a bound that only ends a hang.
"""

from __future__ import annotations

import collections
import itertools
import time
from typing import Any

import numpy as np

from pdxfer import BootstrapServer, Endpoint, EndpointConfig, KVPoll
from pdxfer.agents import patterns as pat
from pdxfer.agents.patterns import PoolGeom
from pdxfer.transport import MemoryFabric, MemoryTransport

GEOMS = [
    PoolGeom("kv", "mha", layers=2, pages=64, page_size=4, heads=2, head_dim=8),
    PoolGeom("aux", "slots", layers=1, pages=16, dim=4, dtype="int32"),
]
FAST = {
    "bootstrap_timeout_s": 1.5,
    "transfer_timeout_s": 2.0,
    "abort_timeout_s": 0.3,
    "heartbeat_s": 0.1,
}


rooms = itertools.count(1 << 30)
"""Room ids no other test in the process uses."""


class Pair:
    """A prefill and a decode endpoint on one memory fabric, with their tensors."""

    def __init__(self, srv: BootstrapServer, batch_entries: int = 512, **cfg: Any) -> None:
        self.fabric = MemoryFabric()
        self.ptx = MemoryTransport(self.fabric, batch_entries=batch_entries)
        self.dtx = MemoryTransport(self.fabric, batch_entries=batch_entries)
        self.pspecs, self.pt = pat.build(GEOMS)
        self.dspecs, self.dt = pat.build(GEOMS)
        pat.fill_sentinel(self.dt)
        conf = {**FAST, **cfg}
        self.pf = Endpoint(
            EndpointConfig.from_flat(role="prefill", bootstrap=srv.address, **conf),
            self.pspecs,
            transport=self.ptx,
        )
        self.dc = Endpoint(
            EndpointConfig.from_flat(role="decode", bootstrap=srv.address, **conf),
            self.dspecs,
            transport=self.dtx,
        )
        self.released: collections.Counter[int] = collections.Counter()
        self.rng = np.random.default_rng(3)

    def close(self) -> None:
        self.dc.close()
        self.pf.close()

    def pages(self, n: int) -> tuple[list[int], list[int]]:
        return (
            self.rng.choice(64, n, replace=False).tolist(),
            self.rng.choice(64, n, replace=False).tolist(),
        )

    def receiver(self, room: int) -> Any:
        return self.dc.receiver(room, release=lambda d, s: self.released.update([room]))

    def fill(self, room: int, src: list[int], tokens: int) -> None:
        spec = self.pspecs[0]
        pat.fill_tokens(spec, self.pt["kv"], room, np.array(src), 0, 0, tokens)
        pat.fill_slot(self.pspecs[1], self.pt["aux"], room, 1)

    def wrong_bytes(self, room: int, dst: list[int], tokens: int) -> int:
        bad, _ = pat.check_tokens(self.dspecs[0], self.dt["kv"], room, np.array(dst), 0, 0, tokens)
        sbad, _ = pat.check_slot(self.dspecs[1], self.dt["aux"], room, 2)
        return bad + sbad


def wait(h: Any, timeout: float = 30.0) -> KVPoll:
    """Until ``h`` is terminal: the bound only ends a hang (a loaded machine is slow)."""
    end = time.monotonic() + timeout
    while not h.poll().terminal and time.monotonic() < end:
        time.sleep(0.002)
    return h.poll()


def until(cond: Any, timeout: float = 30.0) -> bool:
    """Until ``cond()``: the bound only ends a hang (a loaded machine is slow)."""
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.005)
    return bool(cond())


def transfer(p: Pair, tokens: int = 24, chunks: int = 2) -> tuple[Any, Any, int, list[int]]:
    room = next(rooms)
    n = -(-tokens // 4)
    src, dst = p.pages(n)
    p.fill(room, src, tokens)
    rx = p.receiver(room)
    rx.request({"kv": dst}, {"aux": 2}, 0, tokens)
    tx = p.pf.sender(room)
    cut = n // chunks
    for i in range(chunks):
        last = i == chunks - 1
        part = src[i * cut : n if last else (i + 1) * cut]
        tx.send({"kv": part}, {"aux": 1} if last else None, last=last)
    return tx, rx, room, dst


def stranded_room(
    p: Pair, strand_s: float, released: dict[int, float], dc: Endpoint | None = None
) -> tuple[int, Any, Any]:
    """A room sent whole (to ``p.dc``, or ``dc``) while every batch fails at once and lands
    ``strand_s`` later: (room, its receiver, its sender); ``released`` gets the time its
    pages came back."""
    p.ptx.faults.strand_s = strand_s
    room = next(rooms)
    src, dst = p.pages(2)
    p.fill(room, src, 8)
    rx = (dc or p.dc).receiver(
        room, release=lambda d, s: released.setdefault(room, time.monotonic())
    )
    rx.request({"kv": dst}, {"aux": 2}, 0, 8)
    tx = p.pf.sender(room)
    tx.send({"kv": src}, {"aux": 1}, last=True)
    return room, rx, tx
