"""Mooncake Transfer Engine as pdxfer's transport (TCP here, RDMA when a device is named).

Things this module knows about Mooncake that callers should not have to
(``reference/mooncake_nixl_probes.md``):

* A batch of more than ~2048 entries to one peer is rejected and can wedge that peer's lane
  for good, so writes are split into batches of at most ``max_batch`` (1024) entries.
* After a rejected write the next call to the same peer may fail once: retry once before
  declaring the peer dead.
* A hung peer costs ``MC_TCP_PROGRESS_TIMEOUT_SEC`` / ``MC_TRANSFER_TIMEOUT`` seconds (30 by
  default); both are set from the endpoint's transfer deadline before the engine starts.
* glog is noisy at INFO; ``MC_LOG_LEVEL=ERROR`` keeps real errors and drops the rest.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ConfigError, TransportError, TransportUnavailable
from ..faults import FAULTS
from .base import TransportStats

log = logging.getLogger("pdxfer.transport")

_LIB_PACKAGES = {
    "libibverbs": "libibverbs1",
    "libnuma": "libnuma1",
    "libcurl": "libcurl4",
    "libnl-3": "libnl-3-200",
    "libnl-route": "libnl-route-3-200",
}


def _load_engine() -> Any:
    """Import Mooncake's engine, or say exactly which package or library is missing."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        msg = str(e)
        m = re.search(r"(lib[\w.+-]+)\.so", msg)
        if m:
            lib = m.group(1)
            pkg = next((p for k, p in _LIB_PACKAGES.items() if lib.startswith(k)), None)
            hint = f"apt-get install {pkg}" if pkg else "install the system library"
            raise TransportUnavailable(
                f"Mooncake Transfer Engine cannot load: system library {m.group(0)} is missing "
                f"({hint}); original error: {msg}"
            ) from None
        raise TransportUnavailable(
            "Mooncake Transfer Engine is not installed: pip install 'pdxfer[cpu]' "
            "(mooncake-transfer-engine-non-cuda) or 'pdxfer[cuda]' (mooncake-transfer-engine); "
            f"original error: {msg}"
        ) from None
    return TransferEngine


class MooncakeTransport:
    """One Mooncake ``TransferEngine`` per endpoint, with ``P2PHANDSHAKE`` metadata."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        protocol: str = "tcp",
        device: str = "",
        timeout_s: float = 30.0,
        max_batch: int = 1024,
    ) -> None:
        if protocol not in ("tcp", "rdma"):
            raise ConfigError(f"transport protocol must be 'tcp' or 'rdma', got {protocol!r}")
        if protocol == "rdma" and not device:
            raise ConfigError("RDMA needs a device name (e.g. device='mlx5_0')")
        if not 1 <= max_batch <= 2048:
            raise ConfigError(f"max_batch must be in [1, 2048], got {max_batch}")
        # Read by the engine at start: set before it exists, never override the user's choice.
        secs = max(5, int(timeout_s + 0.999))
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(secs))
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(max(1, int(timeout_s + 0.999))))
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        engine_cls = _load_engine()
        self._engine = engine_cls()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransportError(
                f"Mooncake initialize({host!r}, P2PHANDSHAKE, {protocol!r}, {device!r}) "
                f"returned {rc}"
            )
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        self.max_batch = max_batch
        self.stats = TransportStats()
        self._regions: dict[int, int] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -- memory ---------------------------------------------------------------------------
    def register(self, addr: int, nbytes: int, location: str = "cpu") -> None:
        loc = location if location.startswith(("cuda", "npu")) else "*"
        with self._lock:
            if addr in self._regions:
                return
            rc = self._engine.register_memory(int(addr), int(nbytes), loc)
            if rc != 0:
                raise TransportError(f"register_memory({addr:#x}, {nbytes}, {loc}) returned {rc}")
            self._regions[addr] = nbytes

    def deregister(self, addr: int) -> None:
        with self._lock:
            if self._regions.pop(addr, None) is not None:
                rc = self._engine.unregister_memory(int(addr))
                if rc != 0:
                    log.warning("unregister_memory(%#x) returned %d", addr, rc)

    def regions(self) -> list[tuple[int, int]]:
        with self._lock:
            return list(self._regions.items())

    # -- data -----------------------------------------------------------------------------
    def write(
        self,
        peer: str,
        src: np.ndarray,
        dst: np.ndarray,
        nbytes: np.ndarray,
        *,
        deadline: float | None = None,
        should_stop: Callable[[], bool] | None = None,
        tag: int | None = None,
    ) -> None:
        """Write all blocks in batches of at most ``max_batch`` entries.

        ``should_stop`` is checked between batches: an abort stops issuing new writes, and
        the batch in flight completes first (so "drained" means nothing is left in flight).
        ``tag`` (the room) only selects injected faults.
        """
        if self._closed:
            raise TransportError("transport is closed")
        n = int(src.shape[0])
        for i in range(0, n, self.max_batch):
            if should_stop is not None and should_stop():
                raise TransportError("stopped before all blocks were written")
            if deadline is not None and time.monotonic() > deadline:
                raise TransportError("deadline passed before all blocks were written")
            s = src[i : i + self.max_batch].tolist()
            d = dst[i : i + self.max_batch].tolist()
            ln = nbytes[i : i + self.max_batch].tolist()
            if FAULTS.active:
                FAULTS.before_batch(tag)
            rc = self._engine.batch_transfer_sync_write(peer, s, d, ln)
            if rc != 0:
                # A rejected write can break the lane so that the next call fails once.
                self.stats.add(retries=1)
                rc = self._engine.batch_transfer_sync_write(peer, s, d, ln)
            if rc != 0:
                self.stats.add(calls=1, failures=1)
                raise TransportError(
                    f"write of {len(s)} blocks to {peer} failed (rc {rc}) after one retry"
                )
            self.stats.add(calls=1, entries=len(s), nbytes=int(sum(ln)))

    def probe(self, peer: str) -> bool:
        try:
            return self._engine.send_probe(peer) == 0
        except Exception:  # noqa: BLE001 - a probe that raises means unreachable
            return False

    def close(self) -> None:
        if self._closed:
            return
        for addr in list(self._regions):
            self.deregister(addr)
        self._closed = True


def make_transport(kind: str, host: str, device: str = "", timeout_s: float = 30.0) -> MooncakeTransport:
    """The transport named by an endpoint config (``tcp`` or ``rdma``)."""
    return MooncakeTransport(host=host, protocol=kind, device=device, timeout_s=timeout_s)
