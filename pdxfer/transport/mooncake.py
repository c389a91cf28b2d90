"""Mooncake Transfer Engine as a pdxfer transport (TCP, RDMA when a device is named).

Writes are split into batches of at most ``max_batch`` entries with per-peer credits, and
their completion is awaited without spinning where that matters: Mooncake's waits spin, so a
batch is paced (sleep through most of its expected time, ``pacing.py``), a few large entries
are polled with Mooncake's non-spinning probe, and only a lone small batch is one blocking
call. A failed write may still land later, so it taints its peer until ``settle`` proves
the path quiet (a fence, then ``tcpstate.py``). Engine timeouts follow the endpoint's
deadline; glog is quieted to errors. What each rule guards against:
``pdxfer/transport/README.md``; measurements: docs/performance.md#what-pdxfer-does-to-be-fast-here.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import knobs, mooncake_env_defaults
from ..errors import ConfigError, TransportError, TransportUnavailable
from ..faults import faults
from . import nvlink, tcpstate
from .base import FindsPeersBySession, Started, TransportStats
from .pacing import Credits, RateEstimate

log = logging.getLogger(__name__)

_LIB_PACKAGES = {
    "libibverbs": "libibverbs1",
    "libnuma": "libnuma1",
    "libcurl": "libcurl4",
    "libnl-3": "libnl-3-200",
    "libnl-route": "libnl-route-3-200",
}


COMPLETIONS = ("paced", "sync")
PROTOCOLS = ("tcp", "rdma", "nvlink_intra")

LONE_SYNC_MAX_BYTES = 32 << 20
"""A lone batch up to this size is one blocking call; a bigger one is still paced, since its
spinning wait would take a core from the transport for tens of milliseconds."""

POLL_MIN_BYTES = 1 << 20
"""A batch this large (and of at most ``POLL_MAX_ENTRIES``) is awaited by polling, never by a
spin: it lasts long enough (0.5 ms at 2 GB/s) that a spin costs a core's share, and a poll's
few wake-ups and its late notice (at most ``POLL_MAX_S``) cost far less. Measured:
docs/performance-history.md#where-the-layer-by-layer-time-went-traced-2026-11-26."""

POLL_MAX_ENTRIES = 64
"""More entries than this are awaited as one Mooncake batch, paced: each polled
entry is a Mooncake batch of its own, submitted and probed one call each."""

POLL_FIRST_S = 100e-6
POLL_MAX_S = 1e-3
"""A poll's pause after the batch's expected duration: ``POLL_FIRST_S``, doubling up to
``POLL_MAX_S`` (at most ~1,000 wake-ups a second, tens of microseconds each)."""


@dataclass(slots=True, eq=False)
class _Batch:
    """One batch of entries: submitted asynchronously (``bid`` is Mooncake's batch id, 0 or
    less when the submit failed) or, with ``bid`` None, to be written synchronously."""

    src: list[int]
    dst: list[int]
    len: list[int]
    total: int = 0
    ahead: int = 0
    bid: int | None = None
    submitted: float = 0.0
    parts: list[int] | None = None
    """Polled (``POLL_MIN_BYTES``): one Mooncake batch id per entry (0: its submit failed)."""


FENCE_BYTES = 4096
"""A fence rewrites this much of the failed batch's first block (the same bytes, into the
failed room's own pages, which its decode holds until the sender says they are settled)."""

QUIET_SAMPLES = 3
"""Consecutive kernel reads (one per ``settle`` call) that must find nothing owed."""

NO_KERNEL_WAIT_S = 2.0
"""Without the kernel's tables (not Linux), how long after the fence a path counts as
quiet: a bound with no evidence behind it."""


@dataclass(slots=True, eq=False)
class _Taint:
    """A peer whose writes failed: what is needed to prove nothing more of them lands."""

    fence: tuple[int, int, int]
    gen: int = 1
    """Failures so far; a fence proves only the ones before it was submitted."""
    fenced: int = 0
    """``gen`` when the last fence was submitted (and then completed)."""
    fenced_at: float = 0.0
    quiet: int = 0
    stranded: int = 0
    """Batches the ``strand`` fault has not landed yet."""
    ips: frozenset[str] | None = None
    """The peer's host's addresses (``tcpstate.resolve``), once looked up."""


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


def _pollable(b: _Batch) -> bool:
    """Whether ``b`` is awaited by polling (``POLL_MIN_BYTES``)."""
    return len(b.src) <= POLL_MAX_ENTRIES and b.total >= POLL_MIN_BYTES


class MooncakeTransport(FindsPeersBySession):
    """One Mooncake ``TransferEngine`` per endpoint, with ``P2PHANDSHAKE`` metadata."""

    name = "mooncake"

    def __init__(
        self,
        host: str = "127.0.0.1",
        protocol: str = "tcp",
        device: str = "",
        timeout_s: float = 30.0,
        max_batch: int = 1024,
        completion: str | None = None,
        window: int = 2,
    ) -> None:
        if protocol not in PROTOCOLS:
            raise ConfigError(f"transport protocol must be one of {PROTOCOLS}, got {protocol!r}")
        if protocol == "rdma" and not device:
            raise ConfigError("RDMA needs a device name (e.g. device='mlx5_0')")
        if not 1 <= max_batch <= 2048:
            raise ConfigError(f"max_batch must be in [1, 2048], got {max_batch}")
        completion = completion or knobs().te_completion
        self._faults = faults()
        if completion not in COMPLETIONS:
            raise ConfigError(f"completion must be one of {COMPLETIONS}, got {completion!r}")
        if not 1 <= window <= max_batch:
            raise ConfigError(f"window must be in [1, max_batch], got {window}")
        mooncake_env_defaults(timeout_s, protocol)
        self.timeout_s = timeout_s
        engine_cls = _load_engine()
        self.protocol = protocol
        self._ipc = nvlink.Allocations() if protocol == "nvlink_intra" else None
        if self._ipc is not None and not nvlink.built():
            raise TransportUnavailable(
                "Mooncake's nvlink_intra transport is not in this build "
                "(mooncake-transfer-engine-cuda13 has it; the CPU wheel "
                "does not): use transport 'nixl' or 'tcp'"
            )
        self._engine = engine_cls()
        with nvlink.intranode_env(protocol == "nvlink_intra"):
            rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransportError(
                f"Mooncake initialize({host!r}, P2PHANDSHAKE, {protocol!r}, {device!r}) "
                f"returned {rc}"
            )
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        self.max_batch = max_batch
        """Most entries in flight to one peer, summed over every writer thread."""
        self.completion = completion
        self.window = window if completion == "paced" else 1
        self.batch_entries = max(1, max_batch // self.window)
        self._peers: dict[str, tuple[Credits, RateEstimate]] = {}
        self.stats = TransportStats()
        self._regions: dict[int, int] = {}
        self._taints: dict[str, _Taint] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -- memory ---------------------------------------------------------------------------
    def register(self, addr: int, nbytes: int, location: str = "cpu", item_bytes: int = 0) -> None:
        loc = location if location.startswith(("cuda", "npu")) else "*"
        if self._ipc is not None:
            self._register_ipc(addr, nbytes, location)
            return
        with self._lock:
            if addr in self._regions:
                return
            rc = self._engine.register_memory(int(addr), int(nbytes), loc)
            if rc != 0:
                raise TransportError(f"register_memory({addr:#x}, {nbytes}, {loc}) returned {rc}")
            self._regions[addr] = nbytes

    def _register_ipc(self, addr: int, nbytes: int, location: str) -> None:
        """``nvlink_intra`` shares whole CUDA allocations (one IPC handle each, mapped at the
        peer by the allocation's start): each is registered once, from its start, however
        many buffers it holds (``nvlink.Allocations``)."""
        if not location.startswith("cuda"):
            raise ConfigError(
                f"transport 'nvlink' (Mooncake nvlink_intra) moves device memory "
                f"only, and a buffer at {addr:#x} is on {location!r}: use "
                f"transport 'nixl', 'tcp' or 'auto' for host pools"
            )
        assert self._ipc is not None
        with self._lock:
            if addr in self._regions:
                return
            base, size, new = self._ipc.add(addr, nbytes)
            if new:
                rc = self._engine.register_memory(int(base), int(size), location)
                if rc != 0:
                    self._ipc.remove(addr)
                    raise TransportError(
                        f"register_memory({base:#x}, {size}, {location}) "
                        f"returned {rc} (nvlink_intra)"
                    )
            self._regions[addr] = nbytes

    def deregister(self, addr: int) -> None:
        if self._ipc is not None:
            with self._lock:
                if self._regions.pop(addr, None) is not None:
                    base = self._ipc.remove(addr)
                    if base is not None and self._engine.unregister_memory(int(base)) != 0:
                        log.warning("unregister_memory(%#x) failed (nvlink_intra)", base)
            return
        with self._lock:
            if self._regions.pop(addr, None) is not None:
                rc = self._engine.unregister_memory(int(addr))
                if rc != 0:
                    log.warning("unregister_memory(%#x) returned %d", addr, rc)

    def regions(self) -> list[tuple[int, int]]:
        with self._lock:
            return list(self._regions.items())

    # -- data -----------------------------------------------------------------------------
    def _peer_state(self, peer: str) -> tuple[Credits, RateEstimate]:
        with self._lock:
            st = self._peers.get(peer)
            if st is None:
                st = self._peers[peer] = (Credits(self.max_batch), RateEstimate())
            return st

    def write(
        self,
        peer: str,
        src: np.ndarray | list[int],
        dst: np.ndarray | list[int],
        nbytes: np.ndarray | list[int],
        *,
        deadline: float | None = None,
        should_stop: Callable[[], bool] | None = None,
        tag: int | None = None,
    ) -> None:
        """Write all blocks, keeping at most ``max_batch`` entries in flight to ``peer``.

        Blocks go out in batches of ``batch_entries``; with ``completion="paced"`` up to
        ``window`` batches are in flight and each is awaited with a sleep first (see
        ``pacing``). ``should_stop`` and ``deadline`` are checked before each batch is
        submitted: they stop new submissions, and every batch already in flight is awaited
        before this returns or raises, so "stopped" also means "drained". ``tag`` (the room)
        only selects injected faults (``pdxfer.faults``).
        """
        if self._closed:
            raise TransportError("transport is closed")
        credits, rate = self._peer_state(peer)
        # the engine takes Python lists: convert once (plans of small requests already are)
        sl = src.tolist() if isinstance(src, np.ndarray) else src
        dl = dst.tolist() if isinstance(dst, np.ndarray) else dst
        nl = nbytes.tolist() if isinstance(nbytes, np.ndarray) else nbytes
        n = len(sl)
        step = self.batch_entries
        window = self.window if self.completion == "paced" else 1
        inflight: collections.deque[_Batch] = collections.deque()
        error = ""
        tracked = self._faults.active
        if tracked:
            self._faults.write_began(tag)
        try:
            for i in range(0, n, step):
                while len(inflight) >= window and not error:
                    error = self._await(peer, inflight.popleft(), credits, rate)
                if error:
                    break
                if should_stop is not None and should_stop():
                    error = "stopped before all blocks were written"
                    break
                if deadline is not None and time.monotonic() > deadline:
                    error = "deadline passed before all blocks were written"
                    break
                if self._faults.active:  # a write already committed to, landing late
                    self._faults.before_batch(tag)
                if n <= step:
                    b = _Batch(sl, dl, nl)
                else:
                    b = _Batch(sl[i : i + step], dl[i : i + step], nl[i : i + step])
                b.total = sum(b.len)
                if self._faults.active and self._faults.strands(tag):
                    self._strand(peer, b, tag)
                    error = "batch stranded (PDXFER_FAULTS strand): failed, landing later"
                    break
                ahead = credits.try_acquire(len(b.src), b.total)
                while ahead is None and inflight and not error:
                    # never wait for credits while holding some: finish our own batch first
                    error = self._await(peer, inflight.popleft(), credits, rate)
                    if not error:
                        ahead = credits.try_acquire(len(b.src), b.total)
                if error:
                    if ahead is not None:  # acquired for a batch that will not be sent
                        credits.release(len(b.src), b.total)
                    break
                b.ahead = (
                    ahead if ahead is not None else credits.acquire(len(b.src), deadline, b.total)
                )
                if self.completion == "paced" and _pollable(b):
                    self._submit_parts(peer, b)
                elif self.completion == "paced" and (
                    n > step or b.ahead > b.total or b.total > LONE_SYNC_MAX_BYTES
                ):
                    b.submitted = time.perf_counter()
                    b.bid = self._engine.batch_transfer_async_write(peer, b.src, b.dst, b.len)
                inflight.append(b)
        finally:
            while inflight:
                error = self._await(peer, inflight.popleft(), credits, rate) or error
            if tracked:  # every batch is awaited: nothing of this write is on its way
                self._faults.write_ended(tag)
        if error:
            raise TransportError(error)

    def start(
        self,
        peer: str,
        src: list[int],
        dst: list[int],
        nbytes: list[int],
        *,
        tag: int | None = None,
    ) -> _Batch | None:
        """Submit a small write without waiting for it, or None when it cannot start at once.

        For a caller that must not block (the engine's ``send()``): one batch of at most 32 MiB
        when nothing else is in flight to the peer; otherwise None, and the caller uses
        ``write`` from a worker (so do rooms whose writes ``PDXFER_FAULTS`` delays: a delay
        belongs to a worker, never to the caller of ``send()``). Starting the transfer here,
        rather than after a worker thread wakes, is what a lone small request waits for
        (docs/performance.md#what-pdxfer-does-to-be-fast-here). The returned write must be passed to ``finish`` (which releases its credits).

        Why alone: the caller awaits a started write on a worker queue, behind other jobs. A
        job ahead of it that waits for credits must never need this write's credits, or it
        would wait for its own queue. With at most one started write per peer, holding at
        most ``batch_entries`` (half the cap), every other batch fits once the writes that
        workers are running return, so such a job always gets through."""
        n = len(src)
        if (
            self._closed
            or self.completion != "paced"
            or not 0 < n <= self.batch_entries
            or self._faults.active
            and (self._faults.delays(tag) or self._faults.strands(tag))
        ):
            return None
        total = sum(nbytes)
        if total > LONE_SYNC_MAX_BYTES:
            return None
        credits, _ = self._peer_state(peer)
        ahead = credits.try_acquire(n, total, alone=True)
        if ahead is None:
            return None
        b = _Batch(src, dst, nbytes, total, ahead, submitted=time.perf_counter())
        try:
            if _pollable(b):
                self._submit_parts(peer, b)
            else:
                b.bid = self._engine.batch_transfer_async_write(peer, src, dst, nbytes)
        except Exception:
            credits.release(n, total)
            raise
        return b

    def finish(self, peer: str, started: Started) -> None:
        """Wait for a write begun by ``start`` (blocking: call it off the engine loop); retry
        it once if it failed, then raise ``TransportError``. A write with nothing else in
        flight to its peer is awaited without a pacing sleep (see the module notes)."""
        b = started
        assert isinstance(b, _Batch), b
        credits, rate = self._peer_state(peer)
        error = self._await(peer, b, credits, rate, pace=b.ahead > b.total)
        if error:
            raise TransportError(error)

    def _await(
        self, peer: str, b: _Batch, credits: Credits, rate: RateEstimate, pace: bool = True
    ) -> str:
        """Complete one batch (waiting for it, or writing it now when it was not submitted);
        retry a failed batch once. Returns why it failed, or ""."""
        try:
            if b.parts is not None:
                return self._ended(peer, b, self._poll(b, rate))
            if b.bid is not None and b.bid > 0:
                pause = rate.sleep_for(b.ahead, time.perf_counter() - b.submitted) if pace else 0
                if pause:
                    time.sleep(pause)
                # one_waiter: the others sleep on the lock, not in a spin
                with rate.waiter if rate.one_waiter else contextlib.nullcontext():
                    slept = time.perf_counter()
                    rc = self._engine.get_batch_transfer_status([b.bid])
                    done = time.perf_counter()
                rate.observe(b.ahead, b.submitted, slept, done)
            elif b.bid is not None:  # the async submit itself failed (unknown or dead peer)
                rc = -1
            else:
                rc = self._engine.batch_transfer_sync_write(peer, b.src, b.dst, b.len)
            return self._ended(peer, b, range(len(b.src)) if rc != 0 else ())
        finally:
            credits.release(len(b.src), b.total)

    def _submit_parts(self, peer: str, b: _Batch) -> None:
        """Submit each entry of ``b`` as a one-entry Mooncake batch (``_poll`` awaits them)."""
        b.submitted = time.perf_counter()
        b.parts = [
            int(self._engine.transfer_submit_write(peer, s, d, n))
            for s, d, n in zip(b.src, b.dst, b.len)
        ]

    def _poll(self, b: _Batch, rate: RateEstimate) -> list[int]:
        """Wait for ``b``'s parts without spinning: sleep through most of the batch's expected
        duration (``RateEstimate``), then probe each part not yet done, pausing between
        rounds. Returns the entries that failed (a failed submit, a failed or timed-out
        task, or one still pending past the transfer timeout: that one may land later, so
        the caller taints the peer)."""
        bad = [i for i, bid in enumerate(b.parts or ()) if bid <= 0]
        left = [i for i, bid in enumerate(b.parts or ()) if bid > 0]
        pause = rate.sleep_for(b.ahead, time.perf_counter() - b.submitted)
        if pause:
            time.sleep(pause)
        first = time.perf_counter()
        limit = first + self.timeout_s + b.total / (1 << 30)
        pause = POLL_FIRST_S
        check = self._engine.transfer_check_status
        assert b.parts is not None
        while True:
            still = []
            for i in left:
                rc = check(b.parts[i])  # 1 done (freed), 0 pending, -1 failed, -2 timed out
                if rc == 0:
                    still.append(i)
                elif rc < 0:
                    bad.append(i)
            left = still
            now = time.perf_counter()
            if not left or now > limit:
                break
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)
        rate.observe(b.ahead, b.submitted, first, now)
        if left:
            log.warning(
                "%d of %d entries still pending %.0f s after their submit",
                len(left),
                len(b.src),
                now - b.submitted,
            )
        return sorted(bad + left)

    def _ended(self, peer: str, b: _Batch, failed: Sequence[int]) -> str:
        """A batch's ending, awaited whole or polled entry by entry: its entries that failed
        (all of a failed batch) are written again once, together, with a blocking call (only
        after a failure: a rejected write can break the lane so that the next call fails
        once); the peer is tainted, since some of them may still land. Returns why the batch
        failed, or ""."""
        if failed:
            self._taint(peer, b)
            self.stats.add(retries=1)
            if len(failed) == len(b.src):
                rc = self._engine.batch_transfer_sync_write(peer, b.src, b.dst, b.len)
            else:
                rc = self._engine.batch_transfer_sync_write(
                    peer,
                    [b.src[i] for i in failed],
                    [b.dst[i] for i in failed],
                    [b.len[i] for i in failed],
                )
            if rc != 0:
                self._taint(peer, b)  # the retry's other tasks may be queued too
                self.stats.add(calls=1, failures=1)
                return f"write of {len(b.src)} blocks to {peer} failed (rc {rc}) after one retry"
        self.stats.add(calls=1, entries=len(b.src), nbytes=b.total)
        return ""

    # -- failed writes: taint and settle -----------------------------------------------------
    def _taint(self, peer: str, b: _Batch) -> None:
        """A batch to ``peer`` failed: some of it may still land (module notes)."""
        fence = (b.src[0], b.dst[0], min(b.len[0], FENCE_BYTES))
        with self._lock:
            t = self._taints.get(peer)
            if t is None:
                self._taints[peer] = _Taint(fence)
            else:
                t.gen += 1
                t.fence = fence  # the newest failed room's pages are held the longest
                t.quiet = 0
        self.stats.add(taints=1)

    def _strand(self, peer: str, b: _Batch, tag: int | None) -> None:
        """The ``strand`` fault: the batch is reported failed now and lands later."""
        self._taint(peer, b)
        with self._lock:
            self._taints[peer].stranded += 1

        def land() -> None:
            time.sleep(self._faults.strand)
            try:
                self._engine.batch_transfer_sync_write(peer, b.src, b.dst, b.len)
            finally:
                self._faults.stranded_landed(tag)
                with self._lock:
                    t = self._taints.get(peer)
                    if t is not None:
                        t.stranded -= 1

        threading.Thread(target=land, name="pdxfer-strand", daemon=True).start()

    def tainted(self, peer: str) -> bool:
        """Whether a failed write to ``peer`` may still land (until ``settle`` proves not)."""
        with self._lock:
            return peer in self._taints

    def tainted_peers(self) -> list[str]:
        with self._lock:
            return list(self._taints)

    def settle(self, peer: str) -> bool:
        """One step of proving that nothing written to ``peer`` before now can still land;
        True once proven (the taint is then gone). Blocking (a fence is a write): call it
        from a thread of its own, again until True."""
        with self._lock:
            t = self._taints.get(peer)
            if t is None:
                return True
            if t.stranded:
                return False
            gen, fence, need = t.gen, t.fence, t.fenced < t.gen
        if need:
            if (
                self._closed
                or self._engine.batch_transfer_sync_write(peer, [fence[0]], [fence[1]], [fence[2]])
                != 0
            ):
                return False
            with self._lock:
                t.fenced, t.fenced_at, t.quiet = gen, time.monotonic(), 0
            return False
        if t.ips is None:
            t.ips = tcpstate.resolve(peer.rpartition(":")[0].strip("[]"))
        owed = tcpstate.owed(t.ips) if t.ips else None
        with self._lock:
            if owed is None:
                ok = time.monotonic() - t.fenced_at >= NO_KERNEL_WAIT_S
            else:
                t.quiet = 0 if owed else t.quiet + 1
                ok = t.quiet >= QUIET_SAMPLES
            if ok and t.gen == gen and not t.stranded and self._taints.get(peer) is t:
                del self._taints[peer]
                return True
        return False

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
