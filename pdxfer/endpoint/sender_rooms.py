"""Prefill side's tables: the decode peers that said Hello, each room's chunks (what the engine
handed over) and targets (what each decode asked for, and how far its writes went).

Plain data, read and changed under the core's lock by ``sender.py`` and its parts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .. import plan as P
from .. import wire
from ..errors import PdxferError
from ..plan import chunk as C
from ..pools import PoolSpec
from .handles import KVPoll
from .trust import Session


@dataclass(slots=True, eq=False)
class DecodePeer:
    """A decode endpoint that said Hello: where to write and how its pools pair with ours."""

    endpoint_id: str
    ctrl_addr: str
    session: str
    pools: dict[str, PoolSpec]
    pairings: dict[str, P.BufferPairing]
    regions: list[tuple[int, int]]
    sess: Session | None = None
    """The authenticated pair (with a secret): the only source of this peer's frames, and
    the only way to answer it."""
    instance: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    """Its place in its decode group (the ranks of one instance that may share a room)."""
    probe_failures: int = 0
    hung: bool = False
    """Heartbeat state while this peer holds rooms for a repair (``liveness.py``)."""

    subsets: dict[tuple[int, int], dict[str, P.BufferPairing]] = field(default_factory=dict)
    """``pairings`` narrowed to a layer range (partial-layer chunks), made once per range."""

    def layer_pairings(self, layers: tuple[int, int] | None) -> dict[str, P.BufferPairing]:
        """The pairings a chunk of ``layers`` writes (all of them for ``None``); slot pools
        stay whole (the last chunk writes the request's slots, whatever its layers)."""
        if layers is None:
            return self.pairings
        hit = self.subsets.get(layers)
        if hit is None:
            if len(self.subsets) >= 1024:  # the engine's own ranges; bounded all the same
                self.subsets.clear()
            sub = {n: pr if pr.src.kind == "slot" else P.layer_subset(pr, *layers)
                   for n, pr in self.pairings.items()}
            hit = self.subsets[layers] = {n: pr for n, pr in sub.items() if pr is not None}
        return hit

    def is_(self, who: str) -> bool:
        """Whether this peer is the decode endpoint or instance ``who`` (room binding)."""
        return who in (self.endpoint_id, self.instance) and bool(who)


@dataclass(slots=True, eq=False)
class Chunk:
    """Pages per anchor pool; each pool's pages cover tokens from that pool's own cursor
    (``first``), so pools with different page sizes need not split chunks alike."""

    pages: dict[str, np.ndarray]
    first: dict[str, int]
    slots: dict[str, int]
    last: bool
    span: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per anchor pool, the tokens this chunk carries (what the engine computed: part of a
    page at either end is written for those tokens alone)."""
    layers: tuple[int, int] | None = None
    """The layers it carries (None: every layer)."""
    plans: dict[Target, P.Blocks] = field(default_factory=dict)
    """Plans made in ``send()`` for a write that could not start there (``_start``)."""


@dataclass(slots=True, eq=False)
class Slot:
    """A chunk's write that the engine's ``send()`` starts once it has released the lock;
    the room's worker job for it waits for ``ready`` (``sender_writes.py``)."""

    st: SenderRoom
    t: Target
    ci: int
    ready: threading.Event = field(default_factory=threading.Event)
    job: Callable[[], None] | None = None
    """The job that awaits the started write; None: the worker writes the chunk."""


@dataclass(slots=True, eq=False)
class Target:
    """One decode endpoint's request for a room."""

    req: wire.TransferRequest
    peer: DecodePeer
    dst: dict[str, np.ndarray]
    scheduled: int = 0
    finished: bool = False
    aborted: bool = False
    bytes: int = 0
    blocks: int = 0
    seconds: float = 0.0
    """Planning and writing, summed over chunks."""
    write_seconds: float = 0.0
    """The transport writes alone (the raw write time within ``seconds``)."""
    digests: list[wire.Digest] = field(default_factory=list)
    """Integrity digests of what was written so far (sent with ``TransferDone``)."""
    ok: bool = False
    """Finished with Success (a decode may then ask for its range again: a repair)."""
    released: bool = False
    """Its decode sent ``Release``: it will not ask for a repair."""
    settling: bool = False
    """Its terminal message waits for the transport to prove a failed write to its decode
    can no longer land (``sender_settle.py``)."""


@dataclass(slots=True, eq=False)
class SenderRoom:
    room: int
    deadline: float
    state: KVPoll = KVPoll.Bootstrapping
    failure: PdxferError | None = None
    hold_until: float = 0.0
    """While > 0 the room succeeded but its decode may ask for a range again (repair)."""
    chunks: list[Chunk] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    expected: int = 1
    cursor: dict[str, int] = field(default_factory=dict)
    """Per anchor pool, tokens given in every one of its layers (the last chunk must reach
    the decode's ``num_tokens``)."""
    layer_cursor: dict[str, C.Cursor] = field(default_factory=dict)
    """Per anchor pool, tokens given so far, per layer once chunks split its layers
    (``plan.chunk.claim``)."""
    last_given: bool = False
    t_created: float = field(default_factory=time.monotonic)
    t_request: float = 0.0
    bound: str | None = None
    """The decode endpoint or instance this room is for (``sender(room, peer=...)``); without
    it the room belongs to the decode group that asks first (``PrefillSide._binding``)."""


Pending = tuple[wire.TransferRequest, "DecodePeer", int]
"""A request that came before its room's sender: the request, its peer, its size in memory."""


def decodes(st: SenderRoom) -> int:
    """Decode endpoints that asked for the room (a repair adds a target, not a decode)."""
    return len({t.peer.endpoint_id for t in st.targets})


def pending_size(req: wire.TransferRequest) -> int:
    """Memory a parked request holds: its packed indices and their unpacked int64 copy."""
    return 1024 + 3 * sum(len(v) for v in req.dst.values())


def sliced(t: Target) -> bool:
    return C.sliced(t.peer.pairings, t.req.heads, t.req.stage)
