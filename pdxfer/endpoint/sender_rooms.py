"""Prefill side's room record: each room's chunks (what the engine handed over) and targets
(what each decode asked for, and how far its writes went), and the rules a room applies to
who may ask for it (binding, repairs).

Records, read and changed under the core's lock by ``PrefillSide`` and its ``Writer``.
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
from .decode_peers import DecodePeer
from .handles import KVPoll


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
    the room's worker job for it waits for ``ready`` (``writer.py``)."""

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
    can no longer land (``settler.py``)."""


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
    it the room belongs to the decode group that asks first (``why_unbound``)."""

    def why_unbound(self, peer: DecodePeer, fan_out: bool) -> str:
        """Why ``peer`` may not ask for this room ("" if it may).

        A room serves one decode group: the one named by ``sender(room, peer=...)``, else the
        first that asks. A group is the TP ranks of one decode instance: further ranks may
        join the first asker while they share its instance and TP size, each rank once, and
        no more of them than the first asker said would ask this prefill rank
        (``decode_peers``). Another decode that holds the secret and knows the room id (a
        misrouted or curious one) gets no byte. ``EndpointConfig.fan_out`` lets several
        decode groups ask for the same room."""
        if self.bound and not peer.is_(self.bound):
            return (
                f"room {self.room} is bound to decode {self.bound!r}, not decode endpoint "
                f"{peer.endpoint_id} (instance {peer.instance!r})"
            )
        if fan_out:
            return ""
        others = [t for t in self.targets if t.peer.endpoint_id != peer.endpoint_id]
        if not others:
            return ""
        first = others[0]
        owner = first.peer
        whose = (
            f"room {self.room} is bound to the decode group that asked first (instance "
            f"{owner.instance!r}, TP size {owner.tp_size}, endpoint {owner.endpoint_id})"
        )
        if peer.instance != owner.instance or peer.tp_size != owner.tp_size:
            return (
                f"{whose}, not decode endpoint {peer.endpoint_id} (instance "
                f"{peer.instance!r}, TP size {peer.tp_size}); EndpointConfig.fan_out "
                f"serves one room to several decode groups"
            )
        ranks = {t.peer.endpoint_id: t.peer.tp_rank for t in others}
        if peer.tp_rank in ranks.values() or len(ranks) >= first.req.decode_peers:
            return (
                f"{whose}: its TP rank {peer.tp_rank} (or all {first.req.decode_peers} "
                f"of its ranks that ask this prefill rank) already asked, so decode "
                f"endpoint {peer.endpoint_id} is not one of them"
            )
        return ""

    def repairable(self, peer: DecodePeer) -> bool:
        """Whether a request from ``peer`` for this room is a repair: the room is held, or
        (other decodes still being served) this decode's own request succeeded and asked to
        be held. A repair shares the nonce of the request it repairs."""
        if self.state == KVPoll.Failed:
            return False
        if self.hold_until:
            return True
        mine = [t for t in self.targets if t.peer.endpoint_id == peer.endpoint_id]
        return (
            bool(mine)
            and all(t.finished and t.ok for t in mine)
            and any(t.req.hold_for_repair and not t.released for t in mine)
        )


def decodes(st: SenderRoom) -> int:
    """Decode endpoints that asked for the room (a repair adds a target, not a decode)."""
    return len({t.peer.endpoint_id for t in st.targets})


def sliced(t: Target) -> bool:
    return C.sliced(t.peer.pairings, t.req.heads, t.req.stage)
