"""NIXL as pdxfer's second transport (``EndpointConfig(transport="nixl")``).

What this module knows about NIXL (``nixl-cu12`` 1.5.1, UCX backend, DRAM to DRAM, probed on
loopback) so callers need not:

* Pairing needs the target agent's metadata (its registered memory): it travels inside
  pdxfer's own ``Hello`` (decode -> prefill) and ``HelloAck`` (back), so there is no etcd and
  no extra listener. The metadata is taken when the Hello is built, after every pool and
  staging buffer is registered; a write outside what it names fails locally
  (``nixlNotFoundError``) and never reaches the peer.
* NIXL has no deadline of its own: a write is posted, then polled with a sleep that grows
  from 50 us to 1 ms (no core spins), and the endpoint's deadline is enforced here. A write
  past its deadline is cancelled by releasing its handle; if NIXL cannot cancel it, the write
  may still land, so it is awaited (the caller keeps the pages quarantined meanwhile).
* A peer that went away raises ``nixlRemoteDisconnectError``; it becomes ``NixlPeerLost``
  (a ``TransportError`` and a ``PeerLost``).
* The library can crash at interpreter exit if an agent is left to the garbage collector:
  ``close()`` releases handles, deregisters memory and drops the agent explicitly (and runs
  at exit if nobody called it).
* UCX picks its transports itself: shared memory / CMA on one host (fastest), TCP across
  hosts with ``UCX_TLS=tcp``, RDMA verbs on clusters. pdxfer does not override ``UCX_TLS``.
* Import ``nixl_cu12`` directly: the ``nixl`` meta package imports torch to detect CUDA.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import nixl_env_defaults
from ..errors import ConfigError, PeerLost, TransportError, TransportUnavailable
from ..faults import faults
from .base import TransportStats

log = logging.getLogger("pdxfer.transport.nixl")

_POLL_MIN_S = 50e-6
_POLL_MAX_S = 1e-3
_ids = itertools.count(1)


class NixlPeerLost(TransportError, PeerLost):
    """NIXL reported the remote agent disconnected."""

    kind = "peer_lost"


def _load() -> Any:
    nixl_env_defaults()
    try:
        import nixl_cu12
    except ImportError as e:
        raise TransportUnavailable(
            "NIXL is not installed: pip install 'pdxfer[nixl]' (nixl-cu12; no CUDA needed); "
            f"original error: {e}") from None
    return nixl_cu12


@dataclass(slots=True, eq=False)
class _Xfer:
    """One posted write (a ``Started``)."""

    handle: Any
    nbytes: int
    entries: int
    submitted: float
    state: str = "PROC"


class NixlTransport:
    """One NIXL agent (UCX backend) per endpoint; the agent name is the session id."""

    name = "nixl"

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = 30.0,
                 max_batch: int = 4096, backends: tuple[str, ...] = ("UCX",)) -> None:
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
        nixl = _load()
        from nixl_cu12 import _bindings as bindings

        self._errors = bindings
        self.session_id = f"nixl-{host}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        conf = nixl.nixl_agent_config(backends=list(backends),
                                      sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        try:
            self._agent: Any = nixl.nixl_agent(self.session_id, conf)
        except Exception as e:  # noqa: BLE001 - any library failure is "unavailable"
            raise TransportUnavailable(f"NIXL agent could not start: {e}") from None
        if not self._agent.backends:
            raise TransportUnavailable(f"NIXL has none of the backends {backends}")
        self.timeout_s = timeout_s
        self.batch_entries = max_batch
        self.stats = TransportStats()
        self._lock = threading.Lock()
        self._regions: dict[int, tuple[Any, int]] = {}
        self._peers: dict[str, bytes] = {}
        self._closed = False
        self._faults = faults()
        atexit.register(self.close)

    # -- pairing -------------------------------------------------------------------------------
    def peer_info(self) -> bytes:
        """This agent's metadata (its registered memory), for the peer's ``add_peer``."""
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, peer: str, info: bytes) -> None:
        """Load ``peer``'s metadata so writes to it can be built; a peer that re-paired
        (new registrations) replaces its old metadata."""
        if not info:
            raise TransportError(f"peer {peer} sent no NIXL metadata (is it on --transport "
                                 f"nixl?)")
        with self._lock:
            if self._peers.get(peer) == info:
                return
            if peer in self._peers:
                self._agent.remove_remote_agent(peer)
                del self._peers[peer]
            try:
                name = self._agent.add_remote_agent(bytes(info))
            except Exception as e:  # noqa: BLE001 - bad metadata refuses the pairing
                raise TransportError(f"NIXL metadata of {peer} was refused: {e}") from None
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name != peer:
                self._agent.remove_remote_agent(name)
                raise TransportError(f"NIXL metadata names agent {name!r}, not {peer!r}")
            self._peers[peer] = bytes(info)

    # -- memory --------------------------------------------------------------------------------
    def register(self, addr: int, nbytes: int, location: str = "cpu") -> None:
        mem = "VRAM" if location.startswith("cuda") else "DRAM"
        dev = int(location.split(":")[1]) if location.startswith("cuda:") else 0
        with self._lock:
            if addr in self._regions:
                return
            try:
                descs = self._agent.register_memory([(int(addr), int(nbytes), dev, "")], mem)
            except Exception as e:  # noqa: BLE001
                raise TransportError(f"NIXL register_memory({addr:#x}, {nbytes}) failed: "
                                     f"{e}") from None
            self._regions[addr] = (descs, nbytes)

    def deregister(self, addr: int) -> None:
        with self._lock:
            reg = self._regions.pop(addr, None)
            if reg is not None:
                try:
                    self._agent.deregister_memory(reg[0])
                except Exception as e:  # noqa: BLE001
                    log.warning("NIXL deregister_memory(%#x) failed: %s", addr, e)

    # -- writes --------------------------------------------------------------------------------
    def _error(self, peer: str, what: str, e: BaseException) -> TransportError:
        self.stats.add(failures=1)
        if isinstance(e, self._errors.nixlRemoteDisconnectError):
            return NixlPeerLost(f"NIXL peer {peer} disconnected during {what}")
        return TransportError(f"NIXL {what} to {peer} failed: {type(e).__name__}: {e}")

    def _post(self, peer: str, src: Any, dst: Any, nbytes: Any) -> _Xfer:
        if peer not in self._peers:
            raise TransportError(f"no NIXL metadata for peer {peer} (not paired)")
        s = np.asarray(src, dtype=np.uint64)
        d = np.asarray(dst, dtype=np.uint64)
        n = np.asarray(nbytes, dtype=np.uint64)
        if not (s.shape == d.shape == n.shape):
            raise TransportError("src, dst and nbytes differ in length")
        zero = np.zeros_like(s)
        try:
            local = self._agent.get_xfer_descs(np.stack([s, n, zero], axis=1), "DRAM")
            remote = self._agent.get_xfer_descs(np.stack([d, n, zero], axis=1), "DRAM")
            h = self._agent.initialize_xfer("WRITE", local, remote, peer)
        except Exception as e:  # noqa: BLE001
            raise self._error(peer, "write setup", e) from None
        x = _Xfer(h, int(n.sum()), int(s.size), time.perf_counter())
        try:
            x.state = self._agent.transfer(h)
        except Exception as e:  # noqa: BLE001
            self._release(x)
            raise self._error(peer, "write", e) from None
        self.stats.add(calls=1, entries=x.entries, nbytes=x.nbytes)
        return x

    def _release(self, x: _Xfer) -> bool:
        try:
            self._agent.release_xfer_handle(x.handle)
            return True
        except Exception as e:  # noqa: BLE001 - an active write NIXL cannot cancel
            log.warning("NIXL could not release a write in flight (%s): it may still land",
                        e)
            return False

    def _wait(self, peer: str, x: _Xfer, deadline: float | None) -> None:
        delay = _POLL_MIN_S
        cancelled = False
        while x.state == "PROC":
            if deadline is not None and not cancelled and time.monotonic() > deadline:
                if self._release(x):
                    self.stats.add(failures=1)
                    raise TransportError(f"NIXL write to {peer} passed its deadline "
                                         f"(cancelled)")
                cancelled = True  # it cannot be recalled: wait until it is over
            if self._closed:
                raise TransportError("transport closed while a write was in flight")
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
            try:
                x.state = self._agent.check_xfer_state(x.handle)
            except Exception as e:  # noqa: BLE001
                x.state = "ERR"
                err = self._error(peer, "write", e)
                self._release(x)
                raise err from None
        if not cancelled:
            self._release(x)
        if x.state != "DONE":
            self.stats.add(failures=1)
            raise TransportError(f"NIXL write to {peer} ended in state {x.state}")
        if cancelled:
            raise TransportError(f"NIXL write to {peer} finished after its deadline")

    def write(self, peer: str, src: np.ndarray | list[int], dst: np.ndarray | list[int],
              nbytes: np.ndarray | list[int], *, deadline: float | None = None,
              should_stop: Callable[[], bool] | None = None, tag: int | None = None) -> None:
        total = len(src)
        f = self._faults
        for lo in range(0, total, self.batch_entries):
            if should_stop is not None and should_stop():
                raise TransportError(f"write to {peer} stopped after {lo} of {total} blocks")
            if deadline is not None and time.monotonic() > deadline:
                raise TransportError(f"write to {peer} passed its deadline after {lo} of "
                                     f"{total} blocks")
            if f.active:
                f.before_batch(tag)
            hi = min(total, lo + self.batch_entries)
            self._wait(peer, self._post(peer, src[lo:hi], dst[lo:hi], nbytes[lo:hi]),
                       deadline)

    def start(self, peer: str, src: list[int], dst: list[int], nbytes: list[int], *,
              tag: int | None = None) -> _Xfer | None:
        if len(src) > self.batch_entries or (self._faults.active
                                             and self._faults.delays(tag)):
            return None
        return self._post(peer, src, dst, nbytes)

    def finish(self, peer: str, started: _Xfer) -> None:  # type: ignore[override]
        self._wait(peer, started, time.monotonic() + self.timeout_s)

    # -- liveness and teardown -----------------------------------------------------------------
    def probe(self, peer: str) -> bool:
        """A notification to the peer: refused at once when its agent is gone."""
        if peer not in self._peers:
            return True  # not paired yet: nothing says it is gone
        try:
            self._agent.send_notif(peer, b"pdxfer-probe")
            return True
        except Exception:  # noqa: BLE001 - a refused notification means unreachable
            return False

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            regions = list(self._regions.values())
            self._regions.clear()
            peers = list(self._peers)
            self._peers.clear()
        for descs, _ in regions:
            try:
                self._agent.deregister_memory(descs)
            except Exception as e:  # noqa: BLE001
                log.debug("NIXL deregister at close: %s", e)
        for p in peers:
            try:
                self._agent.remove_remote_agent(p)
            except Exception as e:  # noqa: BLE001
                log.debug("NIXL remove_remote_agent at close: %s", e)
        agent, self._agent = self._agent, None
        del agent
        atexit.unregister(self.close)
