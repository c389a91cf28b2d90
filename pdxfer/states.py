"""Poll states and endpoint configuration."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import ConfigError


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


@dataclass(frozen=True, slots=True)
class EndpointConfig:
    """One rank's settings. Every wait has a deadline here; defaults suit a cluster, tests
    shorten them.

    - ``bootstrap_timeout_s``: a prefill sender waits this long for the decode's request; a
      decode receiver this long to find and handshake its prefill endpoints.
    - ``transfer_timeout_s``: from the decode's request to the last ``TransferDone``.
    - ``abort_timeout_s``: how long a failed request's pages wait for the prefill to confirm
      that no write is in flight before they are counted as quarantined.
    - ``heartbeat_s``: how often the decode probes the prefill endpoints it waits on; two
      failed probes in a row declare the peer lost.
    - ``start_in_send``: a chunk whose write is one small batch (at most ``max_batch / 2``
      entries, 32 MiB), with nothing else in flight to that decode, is planned and submitted
      from ``send()`` itself and only awaited on a worker: a small request then does not wait
      for a worker thread to wake (~0.05-0.1 ms on a small VM), at the price of ~0.1-0.3 ms
      of the caller's time per such ``send()`` (the transport's submission is ~1 us per
      entry). False leaves every write to the workers, and ``send()`` costs ~0.05 ms.
    """

    role: Literal["prefill", "decode"]
    bootstrap: str | None = None
    instance: str = "default"
    host: str = "127.0.0.1"
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    transport: str = "tcp"
    device: str = ""
    workers: int = 4
    bootstrap_timeout_s: float = 30.0
    transfer_timeout_s: float = 60.0
    abort_timeout_s: float = 5.0
    heartbeat_s: float = 0.5
    start_in_send: bool = True
    endpoint_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    secret: str | None = field(default=None, repr=False)
    """Shared secret for HMAC on bootstrap requests and Hello; None reads ``PDXFER_SECRET``
    or ``PDXFER_SECRET_FILE`` (and leaves access control off when neither is set)."""

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ConfigError(f"role must be 'prefill' or 'decode', got {self.role!r}")
        for r, s, what in ((self.tp_rank, self.tp_size, "tp"), (self.dp_rank, self.dp_size, "dp"),
                           (self.pp_rank, self.pp_size, "pp")):
            if s < 1 or not 0 <= r < s:
                raise ConfigError(f"{what}_rank {r} must be in [0, {what}_size={s})")
        if self.workers < 1:
            raise ConfigError("workers must be >= 1")
        for name in ("bootstrap_timeout_s", "transfer_timeout_s", "abort_timeout_s", "heartbeat_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        if self.transport not in ("tcp", "rdma"):
            raise ConfigError(f"transport must be 'tcp' or 'rdma', got {self.transport!r}")


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
