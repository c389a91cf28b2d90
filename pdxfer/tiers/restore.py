"""``RestoringReceiver``: one decode request whose prefix comes from L1/L2/L3 and whose
suffix comes over the network, both at once.

Local restore: ``PENDING -> READY | FAILED``. The match runs first (on a restore thread, so
the engine's call returns at once), then the TransferRequest goes out with the promised
``prefix_len`` and ``hold_for_repair``, then L3 to L2 prefetch and L2 to L1 load run while
the network brings the suffix. ``poll()`` says Success only when both are done.

If the local restore falls short of the promise (an L3 object vanished or is corrupt, the
restore deadline passed), the missing range is asked again from the prefill, which still
holds its pages; then ``Release`` lets it free them. A request ends with complete KV or
Failed with a reason, and every pin and page is returned on every path.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..endpoint.handles import KVPoll, Release, ReleaseOnce, RequestHandle
from ..endpoint.receiver import KVReceiver
from ..errors import Aborted, DeadlineExceeded, DuplicateRoom, PdxferError, PlanError
from .cache import Match, TieredCache
from .errors import RestoreFailed

if TYPE_CHECKING:
    from ..endpoint import Endpoint

log = logging.getLogger(__name__)


class RestoreState(enum.Enum):
    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"


class RestoringReceiver(RequestHandle):
    """The engine's handle for one request with decode-side prefix reuse (a ``RequestHandle``
    like ``KVReceiver``, and released through the same ``ReleaseOnce``).

    ``dst``: the engine's page indices per anchor pool covering tokens ``[l1_len,
    num_tokens)`` (``l1_len``: prefix tokens already on the device, from the engine's own
    cache). ``release(dst, slots)`` is called once, when a failed request's pages can be
    reused. Every call returns at once.
    """

    def __init__(
        self,
        cache: TieredCache,
        endpoint: Endpoint,
        room: int,
        bootstrap: str | None,
        tokens: Sequence[int] | np.ndarray,
        dst: Mapping[str, Any],
        slots: Mapping[str, int] | None = None,
        *,
        num_tokens: int | None = None,
        l1_len: int = 0,
        release: Release | None = None,
        instance: str | None = None,
        dp: int | None = None,
        restore_timeout_s: float | None = None,
        scope: str = "",
        early: bool = False,
    ) -> None:
        self.cache, self.ep = cache, endpoint
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.num_tokens = int(len(self.tokens) if num_tokens is None else num_tokens)
        self.l1_len = l1_len - l1_len % cache.page_size
        self.dst = {a: np.asarray(p, dtype=np.int64) for a, p in dst.items()}
        for a, p in self.dst.items():
            if p.size * cache.page_size < self.num_tokens - self.l1_len:
                raise PlanError(
                    f"room {room}: pool {a!r} pages cover fewer than "
                    f"{self.num_tokens - self.l1_len} tokens"
                )
        self.slots = dict(slots or {})
        self.scope = scope
        self._release = ReleaseOnce(room, release)
        self._bootstrap, self._instance, self._dp = bootstrap, instance, dp
        self._lock = threading.Lock()
        self._state = KVPoll.Bootstrapping
        self._failure: PdxferError | None = None
        self.restore = RestoreState.PENDING
        self.match: Match | None = None
        self.restored_pages = 0
        self._local_done = False
        self._source_released = False
        self._repair: KVReceiver | None = None
        self._repair_range = (0, 0)
        self._repair_released = False
        self._rx_released = False
        cfg = endpoint.config
        self.deadline = (
            time.monotonic() + cfg.limits.bootstrap_timeout_s + cfg.limits.transfer_timeout_s
        )
        self._restore_deadline = time.monotonic() + (
            restore_timeout_s or cfg.limits.transfer_timeout_s
        )
        self.t0 = time.monotonic()
        self.t_ready: float | None = None
        self.t_local: float | None = None
        self.t_match: float | None = None
        self.t_requested: float | None = None
        self._early = early  # asked at dispatch (``Endpoint.receiver``), repairs too
        self.rx = endpoint.receiver(
            room, bootstrap, instance=instance, dp=dp, release=self._on_rx_release, early=early
        )
        cache.executor.submit(self._run)

    # -- the restore thread --------------------------------------------------------------------
    def _run(self) -> None:
        m: Match | None = None
        try:
            m = self.cache.match(self.tokens, self.num_tokens, self.l1_len, self.scope)
            self.match = m
            self.t_match = time.monotonic()
            pp = m.promised_pages
            self.rx.request(
                {a: p[pp:] for a, p in self.dst.items()},
                self.slots,
                prefix_len=m.prefix_len,
                num_tokens=self.num_tokens,
                hold_for_repair=pp > 0,
            )
            self.t_requested = time.monotonic()
            good = self.cache.load(
                m,
                {a: p[:pp] for a, p in self.dst.items()},
                self._restore_deadline,
                tag=self.rx.room,
            )
        except Exception as e:  # noqa: BLE001 - any failure fails this request, not the engine
            log.exception("restore of room %d failed", self.rx.room)
            err = e if isinstance(e, PdxferError) else RestoreFailed(f"room {self.rx.room}: {e}")
            if m is not None:
                self.cache.finish(m)
            with self._lock:
                self._local_done = True
                self.restore = RestoreState.FAILED
            self.rx.abort(str(err))
            self._fail(err)
            return
        self.cache.finish(m)
        with self._lock:
            self.t_local = time.monotonic()
            self.restored_pages = good
            self._local_done = True
            self.restore = RestoreState.READY if good == pp else RestoreState.FAILED
        if good < pp:
            log.info(
                "room %d: restored %d of %d promised pages; repairing the rest from the prefill",
                self.rx.room,
                good,
                pp,
            )
        self.poll()

    # -- engine calls --------------------------------------------------------------------------
    @property
    def room(self) -> int:
        return self.rx.room

    @property
    def failure(self) -> PdxferError | None:
        return self._failure

    @property
    def prefix_len(self) -> int | None:
        return None if self.match is None else self.match.prefix_len

    def poll(self) -> KVPoll:
        with self._lock:
            state = self._state if self._state.terminal else self._advance()
        self._maybe_release()
        return state

    def _advance(self) -> KVPoll:
        """One step of the state machine (under the lock); failures are recorded here and
        acted on (aborts, release) outside it."""
        net = self.rx.poll()
        if net == KVPoll.Failed:
            return self._fail_locked(self.rx.failure or RestoreFailed("network part failed"))
        if time.monotonic() > self.deadline:
            return self._fail_locked(
                DeadlineExceeded(
                    f"room {self.room}: not ready before its deadline (restore "
                    f"{self.restore.value}, network {net.name})"
                )
            )
        if not self._local_done or net != KVPoll.Success:
            return min(net, KVPoll.Transferring)
        assert self.match is not None
        if self.restored_pages == self.match.promised_pages:
            return self._succeed()
        if self._repair is None:
            self._start_repair()
            return KVPoll.Transferring
        rp = self._repair.poll()
        if rp == KVPoll.Failed:
            return self._fail_locked(
                RestoreFailed(
                    f"room {self.room}: repair of tokens {self._repair_range} failed: "
                    f"{self._repair.failure}"
                )
            )
        if rp == KVPoll.Success:
            return self._succeed()
        return KVPoll.Transferring

    def _start_repair(self) -> None:
        assert self.match is not None
        ps = self.cache.page_size
        good, pp = self.restored_pages, self.match.promised_pages
        lo = self.l1_len + good * ps
        self._repair_range = (lo, self.match.prefix_len)
        try:
            rx = self.ep.receiver(
                self.room,
                self._bootstrap,
                instance=self._instance,
                dp=self._dp,
                release=self._on_repair_release,
                early=self._early,
            )
        except DuplicateRoom:
            return  # the first request's room is being dropped; next poll retries
        self.ep.count("repairs")
        rx.request(
            {a: p[good:pp] for a, p in self.dst.items()},
            {},
            prefix_len=lo,
            num_tokens=self.match.prefix_len,
        )
        self._repair = rx

    def _succeed(self) -> KVPoll:
        self._state = KVPoll.Success
        # Ready when the last part finished, not when somebody polled: the engine may poll
        # seldom, and its poll interval is not the transfer's latency.
        parts = [
            self.t_local,
            self.rx.done_at,
            self._repair.done_at if self._repair is not None else None,
        ]
        self.t_ready = max((t for t in parts if t is not None), default=time.monotonic())
        self._send_release()
        return self._state

    def _send_release(self) -> None:
        if not self._source_released and self.match is not None and self.match.promised_pages:
            self._source_released = True
            self.rx.release_source()

    def _fail_locked(self, err: PdxferError) -> KVPoll:
        if not self._state.terminal:
            self._state = KVPoll.Failed
            self._failure = err
            log.info("room %d failed: %s", self.room, err)
            threading.Thread(target=self._after_fail, daemon=True).start()
        return self._state

    def _fail(self, err: PdxferError) -> None:
        with self._lock:
            self._fail_locked(err)
        self._maybe_release()

    def _after_fail(self) -> None:
        """Stop whatever may still write into our pages, and let the prefill go."""
        if not self.rx.poll().terminal:
            self.rx.abort(str(self._failure))
        if self._repair is not None and not self._repair.poll().terminal:
            self._repair.abort(str(self._failure))
        with self._lock:
            self._send_release()
        self._maybe_release()

    def abort(self, reason: str = "aborted by decode engine") -> None:
        self._fail(Aborted(f"room {self.room}: {reason}"))

    # -- page lifetime -------------------------------------------------------------------------
    def _on_rx_release(self, dst: Any, slots: Any) -> None:
        with self._lock:
            self._rx_released = True
        self._maybe_release()

    def _on_repair_release(self, dst: Any, slots: Any) -> None:
        with self._lock:
            self._repair_released = True
        self._maybe_release()

    def _quiet(self) -> bool:
        """No write can land in our pages any more (network, repair, local load)."""
        if not self._local_done:
            return False
        rx_ok = self._rx_released or self.rx.poll() == KVPoll.Success
        rp = self._repair
        rp_ok = rp is None or self._repair_released or rp.poll() == KVPoll.Success
        return rx_ok and rp_ok

    def _maybe_release(self) -> None:
        with self._lock:
            if (
                self._state != KVPoll.Failed
                or self._release.done
                or not self._quiet()
                or not self._release.claim()
            ):
                return
        self._release.fire(self.dst, self.slots)

    @property
    def released(self) -> bool:
        return self._release.done

    def stats(self) -> dict[str, Any]:
        m = self.match
        net = self.rx.stats()
        rep = self._repair.stats() if self._repair is not None else {"bytes": 0}
        return {
            "prefix_len": m.prefix_len if m else None,
            "l1_pages": m.l1_pages if m else 0,
            "l2_pages": len(m.l2) if m else 0,
            "l3_pages": len(m.l3) if m else 0,
            "restored_pages": self.restored_pages,
            "restore": self.restore.value,
            "net_bytes": net["bytes"],
            "repair_bytes": rep["bytes"],
            "repaired_tokens": self._repair_range[1] - self._repair_range[0],
            "seconds": (self.t_ready - self.t0) if self.t_ready else None,
            "local_seconds": (self.t_local - self.t0) if self.t_local else None,
            "match_seconds": (self.t_match - self.t0) if self.t_match else None,
            "request_seconds": (self.t_requested - self.t0) if self.t_requested else None,
            "net_seconds": net["seconds"],
        }
