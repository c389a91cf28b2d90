"""Fault injection for chaos and failure tests (off unless ``PDXFER_FAULTS`` is set).

``PDXFER_FAULTS`` names delays, drops, stranded batches and damaged pages per room
(``Faults`` lists every item); the transport, the control path, the decode's checks and the
tiers call the hooks here. They are single attribute checks when faults are off.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .config import knobs
from .errors import ConfigError


@dataclass(slots=True)
class Faults:
    """The parsed ``PDXFER_FAULTS``.

    ``PDXFER_FAULTS="delay_write=1.5,rooms=777;778,drop=0.05,delay_msg=0.01,seed=3"``:

    - ``delay_write``: seconds to sleep right before each transport batch of the listed rooms
      (all rooms when ``rooms`` is absent): the write is already committed to, so it lands late;
    - ``strand``: seconds after which a *stranded* batch lands: the first transport batch of each
      write of the listed rooms (Mooncake TCP) is reported failed at once while a copy of it
      lands that much later, as Mooncake's do when one task of a batch fails (its other tasks
      stay queued on the peer's lanes) or when it drops a stalled connection whose socket still
      buffers bytes that a healed link delivers (docs/failure-semantics.md, Quarantine);
    - ``drop``: probability that an incoming control message is dropped;
    - ``delay_msg``: seconds to hold each incoming control message;
    - ``corrupt``, ``skip_write``, ``shift_write``: probability, per sender's ``TransferDone`` of
      a listed room, that the decode damages one page of the room's destination after the
      transport reported the write done and before it checks it: ``corrupt`` flips every byte of
      one buffer's page, ``skip_write`` leaves a page stale (it gets another page's old bytes),
      ``shift_write`` writes a page one page off (the next page of the request gets its bytes).
      Integrity checks (``integrity.py``) must catch every one of them.
    - ``at``: where those page faults strike: ``network`` (the default, as above) or ``restore``
      (a tiered restore's page, right after its L2 -> L1 copy and before it is checked against
      the digest recorded when it entered L2: the damaged page and the rest are then repaired),
      or ``writeback`` (an L2 page of a write-back, after its digest was recorded and before
      it is stored in L3: a restore from L3 must catch it against the digest sealed with it).
    - ``pool=NAME``: page faults strike only that pool's buffers (e.g. ``pool=ballast``: the
      served toy's KV ballast, which the decode checks against the prompt's tokens).
    - ``once=1``: page faults strike each room at most once (a transient fault: what is sent
      again, by an ``integrity_retry`` or a repair, arrives intact).
    """

    delay_write: float = 0.0
    rooms: frozenset[int] | None = None
    drop: float = 0.0
    delay_msg: float = 0.0
    corrupt: float = 0.0
    skip_write: float = 0.0
    shift_write: float = 0.0
    at: str = "network"
    once: bool = False
    pool: str = ""
    seed: int = 0
    strand: float = 0.0
    _struck: set[int] = field(default_factory=set, repr=False)
    _held: dict[int | None, int] = field(default_factory=dict, repr=False)
    _landed: dict[int | None, list[float]] = field(default_factory=dict, repr=False)
    _began: dict[int | None, int] = field(default_factory=dict, repr=False)
    _ended: dict[int | None, list[float]] = field(default_factory=dict, repr=False)
    _rng: random.Random = field(default_factory=random.Random, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def active(self) -> bool:
        return bool(
            self.delay_write or self.drop or self.delay_msg or self.page_faults or self.strand
        )

    @property
    def page_faults(self) -> bool:
        return bool(self.corrupt or self.skip_write or self.shift_write)

    @staticmethod
    def parse(spec: str) -> Faults:
        f = Faults()
        for item in filter(None, (x.strip() for x in spec.split(","))):
            key, _, val = item.partition("=")
            try:
                if key == "rooms":
                    f.rooms = frozenset(int(r) for r in val.split(";") if r)
                elif key in (
                    "delay_write",
                    "drop",
                    "delay_msg",
                    "corrupt",
                    "skip_write",
                    "shift_write",
                    "strand",
                ):
                    setattr(f, key, float(val))
                elif key == "seed":
                    f.seed = int(val)
                elif key == "once":
                    f.once = bool(int(val))
                elif key == "pool":
                    f.pool = val
                elif key == "at":
                    if val not in ("network", "restore", "writeback"):
                        raise ValueError("at must be network, restore or writeback")
                    f.at = val
                else:
                    raise ValueError(f"unknown fault {key!r}")
            except ValueError as e:
                raise ConfigError(f"PDXFER_FAULTS item {item!r}: {e}") from None
        f._rng.seed(f.seed)
        return f

    def update(self, spec: str) -> None:
        """Replace every setting in place (the hooks hold this object), e.g. between tests."""
        new = Faults.parse(spec)
        with self._lock:
            for name in (
                "delay_write",
                "rooms",
                "drop",
                "delay_msg",
                "corrupt",
                "skip_write",
                "shift_write",
                "at",
                "once",
                "pool",
                "seed",
                "strand",
            ):
                setattr(self, name, getattr(new, name))
            self._rng.seed(new.seed)
            self._struck.clear()

    def delays(self, room: int | None) -> bool:
        """Whether writes of ``room`` are delayed (such writes never start from ``send()``)."""
        return bool(self.delay_write) and (self.rooms is None or room in self.rooms)

    def strands(self, room: int | None) -> bool:
        """Whether a batch of ``room`` is stranded (reported failed, landing ``strand`` s
        later)."""
        return bool(self.strand) and (self.rooms is None or room in self.rooms)

    def stranded_landed(self, room: int | None) -> None:
        with self._lock:
            self._landed.setdefault(room, []).append(time.monotonic())

    def landed(self, room: int | None) -> list[float]:
        """When (``time.monotonic()``) each stranded batch of ``room`` landed."""
        with self._lock:
            return list(self._landed.get(room, []))

    def before_batch(self, room: int | None) -> None:
        if self.delays(room):
            with self._lock:
                self._held[room] = self._held.get(room, 0) + 1
            time.sleep(self.delay_write)

    def held(self, room: int | None) -> int:
        """How many of ``room``'s batches ``delay_write`` has held so far: a test that sees
        one knows a write is committed and landing late (a fixed sleep could come before it
        on a slow machine)."""
        with self._lock:
            return self._held.get(room, 0)

    def write_began(self, room: int | None) -> None:
        with self._lock:
            self._began[room] = self._began.get(room, 0) + 1

    def write_ended(self, room: int | None) -> None:
        with self._lock:
            self._ended.setdefault(room, []).append(time.monotonic())

    def writes(self, room: int | None) -> tuple[int, list[float]]:
        """How many transport writes of ``room`` began while faults were on, and when
        (``time.monotonic()``) each that ended did: a write has returned only once every byte
        it posted landed or failed, so a test that sees them all ended knows no byte of the
        room is still on its way (a fixed sleep could end first on a slow machine)."""
        with self._lock:
            return self._began.get(room, 0), list(self._ended.get(room, []))

    def page_fault(self, room: int, at: str = "network") -> str | None:
        """Which page fault to inject into ``room``'s destination after a sender's write was
        reported done, or after a restore's copy (``at``): ``corrupt``, ``skip_write``,
        ``shift_write``, or None."""
        if (
            not self.page_faults
            or at != self.at
            or (self.rooms is not None and room not in self.rooms)
        ):
            return None
        with self._lock:
            if self.once and room in self._struck:
                return None
            for kind in ("corrupt", "skip_write", "shift_write"):
                p = getattr(self, kind)
                if p and self._rng.random() < p:
                    if self.once:
                        self._struck.add(room)
                    return kind
        return None

    def pools(self, names: list[str]) -> list[str]:
        """The pools a page fault may strike, of ``names`` (``pool=``: that one only)."""
        return [n for n in names if not self.pool or n == self.pool]

    def pick(self, n: int) -> int:
        with self._lock:
            return self._rng.randrange(n)

    def drop_incoming(self) -> bool:
        if self.delay_msg:
            time.sleep(self.delay_msg)
        if not self.drop:
            return False
        with self._lock:
            return self._rng.random() < self.drop


def damage(
    rows: Any,
    kind: str,
    page: int,
    neighbour: int | None,
    stale: int | None,
    cols: Any = slice(None),
) -> None:
    """Apply one page fault to ``rows[page]`` (``rows``: ``[pages, bytes]`` uint8, ``cols``
    the bytes the faulty write covered): ``corrupt`` flips them, ``shift_write`` puts them on
    page ``neighbour`` instead, ``skip_write`` (or a shift with no neighbour) leaves the page
    with page ``stale``'s old bytes (flipped bits when there is none)."""
    if kind == "corrupt":
        rows[page, cols] ^= 0xFF
    elif kind == "shift_write" and neighbour is not None:
        rows[neighbour, cols] = rows[page, cols]
    elif stale is not None:
        rows[page, cols] = rows[stale, cols]
    else:
        rows[page, cols] ^= 0x5A


_FAULTS: Faults | None = None


def faults() -> Faults:
    """The process's faults, parsed from ``PDXFER_FAULTS`` on first use (never at import)."""
    global _FAULTS
    if _FAULTS is None:
        _FAULTS = Faults.parse(knobs().faults)
    return _FAULTS
