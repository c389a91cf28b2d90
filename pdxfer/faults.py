"""Fault injection for chaos and failure tests (off unless ``PDXFER_FAULTS`` is set).

``PDXFER_FAULTS="delay_write=1.5,rooms=777;778,drop=0.05,delay_msg=0.01,seed=3"``:

- ``delay_write``: seconds to sleep right before each transport batch of the listed rooms
  (all rooms when ``rooms`` is absent): the write is already committed to, so it lands late;
- ``drop``: probability that an incoming control message is dropped;
- ``delay_msg``: seconds to hold each incoming control message.

The hooks are single attribute checks when faults are off.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

from .config import knobs
from .errors import ConfigError


@dataclass(slots=True)
class Faults:
    delay_write: float = 0.0
    rooms: frozenset[int] | None = None
    drop: float = 0.0
    delay_msg: float = 0.0
    seed: int = 0
    _rng: random.Random = field(default_factory=random.Random, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def active(self) -> bool:
        return bool(self.delay_write or self.drop or self.delay_msg)

    @staticmethod
    def parse(spec: str) -> Faults:
        f = Faults()
        for item in filter(None, (x.strip() for x in spec.split(","))):
            key, _, val = item.partition("=")
            try:
                if key == "rooms":
                    f.rooms = frozenset(int(r) for r in val.split(";") if r)
                elif key in ("delay_write", "drop", "delay_msg"):
                    setattr(f, key, float(val))
                elif key == "seed":
                    f.seed = int(val)
                else:
                    raise ValueError(f"unknown fault {key!r}")
            except ValueError as e:
                raise ConfigError(f"PDXFER_FAULTS item {item!r}: {e}") from None
        f._rng.seed(f.seed)
        return f

    def delays(self, room: int | None) -> bool:
        """Whether writes of ``room`` are delayed (such writes never start from ``send()``)."""
        return bool(self.delay_write) and (self.rooms is None or room in self.rooms)

    def before_batch(self, room: int | None) -> None:
        if self.delays(room):
            time.sleep(self.delay_write)

    def drop_incoming(self) -> bool:
        if self.delay_msg:
            time.sleep(self.delay_msg)
        if not self.drop:
            return False
        with self._lock:
            return self._rng.random() < self.drop


_FAULTS: Faults | None = None


def faults() -> Faults:
    """The process's faults, parsed from ``PDXFER_FAULTS`` on first use (never at import)."""
    global _FAULTS
    if _FAULTS is None:
        _FAULTS = Faults.parse(knobs().faults)
    return _FAULTS
