"""The engine-facing handle contract: ``KVPoll`` and what every request handle shares.

Both the endpoint's ``KVSender``/``KVReceiver`` and ``tiers.RestoringReceiver`` implement it, so
an engine polls one kind of object whatever sits behind it."""

from __future__ import annotations

import abc
import enum
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


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


Release = Callable[[Mapping[str, np.ndarray], Mapping[str, int]], None]
"""``release(dst, slots)``: the engine takes back a failed request's pages and slots."""


class ReleaseOnce:
    """Hands a failed request's pages back to the engine exactly once.

    The one place that calls an engine's ``release``: the owner decides *when* it is safe (no
    write can land any more), this object makes sure it happens once, off the owner's lock,
    and that a failing callback never breaks pdxfer."""

    __slots__ = ("_cb", "_done", "_lock", "room")

    def __init__(self, room: int, cb: Release | None) -> None:
        self.room, self._cb = room, cb
        self._done = False
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        return self._done

    def claim(self) -> bool:
        """Mark released; True only for the one caller that must then ``fire``."""
        with self._lock:
            if self._done:
                return False
            self._done = True
            return True

    def fire(self, dst: Mapping[str, np.ndarray], slots: Mapping[str, int]) -> None:
        """Call the engine's callback (after a successful ``claim``, outside any lock)."""
        if self._cb is None:
            return
        try:
            self._cb(dst, slots)
        except Exception:  # noqa: BLE001 - the engine's callback must not break us
            log.exception("release callback for room %d failed", self.room)


class RequestHandle(abc.ABC):
    """What an engine may do with any request handle: read its room, poll it, read why it
    failed, abort it. ``KVSender``, ``KVReceiver`` and ``tiers.RestoringReceiver`` all are
    one."""

    __slots__ = ()

    @property
    @abc.abstractmethod
    def room(self) -> int: ...

    @abc.abstractmethod
    def poll(self) -> KVPoll: ...

    @property
    @abc.abstractmethod
    def failure(self) -> Any:
        """None, or the ``PdxferError`` that failed the request (its message says why)."""

    @abc.abstractmethod
    def abort(self, reason: str = "aborted by engine") -> None: ...


class RoomHandle(RequestHandle):
    """A handle over one side's room record ``_st`` (it has ``room``, ``state``, ``failure``)."""

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
        return self._st.failure
