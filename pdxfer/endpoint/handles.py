"""The engine-facing handle contract: ``KVPoll`` and what every request handle shares.

Both the endpoint's ``KVSender``/``KVReceiver`` and ``tiers.RestoringReceiver`` implement it, so
an engine polls one kind of object whatever sits behind it."""

from __future__ import annotations

import enum
from typing import Any


class KVPoll(enum.IntEnum):
    """A request's state as the engine sees it. Ordered: ranks agree by taking the minimum,
    and a request's state only moves up (except to Failed)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

    @property
    def terminal(self) -> bool:
        return self in (KVPoll.Failed, KVPoll.Success)


class RequestHandle:
    """What both request handles share: the room, the poll state and the failure.

    ``_st`` is the side's room record (it has ``room``, ``state`` and ``failure``).
    """

    __slots__ = ("_side", "_st")

    def __init__(self, side: Any, st: Any) -> None:
        self._side = side
        self._st = st

    @property
    def room(self) -> int:
        return int(self._st.room)

    def poll(self) -> KVPoll:
        return KVPoll(self._st.state)

    @property
    def failure(self) -> Any:
        """None, or the ``PdxferError`` that failed the request (its message says why)."""
        return self._st.failure
