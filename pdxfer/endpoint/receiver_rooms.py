"""Decode side's room table entry: what the engine asked for, whom it was asked from, and what
each sender has answered so far.

Plain data, read and changed under the core's lock by ``receiver.py`` and its parts.
"""

from __future__ import annotations

import builtins
import time
from dataclasses import dataclass, field

import numpy as np

from .. import integrity as I
from ..errors import PdxferError
from .connect import PrefillPeer
from .handles import KVPoll, ReleaseOnce
from .staging import Lease


@dataclass(slots=True, eq=False)
class RecvRoom:
    room: int
    bootstrap: str
    instance: str | None
    dp: int | None
    released: ReleaseOnce
    deadline: float
    nonce: int = 0
    state: KVPoll = KVPoll.Bootstrapping
    failure: PdxferError | None = None
    requested: bool = False
    dst: dict[str, np.ndarray] = field(default_factory=dict)
    slots: dict[str, int] = field(default_factory=dict)
    prefix_len: int = 0
    num_tokens: int = 0
    hold_for_repair: bool = False
    targets: list[PrefillPeer] = field(default_factory=list)
    done: set[str] = field(default_factory=set)
    outstanding: set[str] = field(default_factory=set)
    abort_deadline: float = 0.0
    quarantined: bool = False
    bytes: int = 0
    blocks: int = 0
    t_created: float = field(default_factory=time.monotonic)
    t_request: float = 0.0
    t_done: float = 0.0
    leases: dict[str, list[Lease]] = field(default_factory=dict)
    integrity: str = "off"
    skips: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Per sender, the pools it was told not to write (it sends no digest for them)."""
    auto_hold: bool = False
    """The prefill holds the room for an integrity retry (``integrity_retry``), not because
    the engine asked: this receiver sends the ``Release`` itself once the room is over."""
    early: bool = False
    """Asked at dispatch (``Endpoint.receiver(early=True)``; ``TransferRequest.early``)."""
    asks: dict[str, builtins.bytes] = field(default_factory=dict)
    """Per sender, the request frame sent to it (sent again, once, for an integrity retry)."""
    retried: set[str] = field(default_factory=set)
    """Senders asked a second time after a digest mismatch."""
    heads: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    """Per sender, the global heads it writes of each head-sliced pool (fault injection)."""
    pieces: dict[str, dict[str, tuple[tuple[int, int], ...]]] = field(default_factory=dict)
    """Per sender, the units it writes of each piece of a sliced state slot (``plan/pieces``;
    absent: every unit it shares with this rank), which its slot digests cover."""
    prepared: dict[tuple[str, str, int, int, int, int], I.Prepared] = field(default_factory=dict)
    """Sampled checks planned when the request went out, by (sender, pool, start, end, lo,
    hi): the digest a one-chunk sender reports for each pool (``IntegrityChecks.prepare``)."""


def route_key(st: RecvRoom) -> tuple[str, str | None, int | None]:
    return (st.bootstrap, st.instance, st.dp)
