"""The Mooncake transport on its own: real engines, real TCP on loopback."""

from __future__ import annotations

import builtins
import time
from collections.abc import Iterator

import numpy as np
import pytest

from pdxfer import TransportError, TransportUnavailable
from pdxfer.transport import MooncakeTransport
from pdxfer.transport import mooncake as mc
from pdxfer.transport.pacing import Credits


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[MooncakeTransport, MooncakeTransport, np.ndarray, np.ndarray]]:
    a, b = MooncakeTransport(), MooncakeTransport()
    src = np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8)
    dst = np.zeros(8 << 20, dtype=np.uint8)
    a.register(src.ctypes.data, src.nbytes)
    b.register(dst.ctypes.data, dst.nbytes)
    yield a, b, src, dst
    a.close()
    b.close()


def test_batches_over_the_per_peer_limit_are_split_and_all_land(engines) -> None:
    a, b, src, dst = engines
    n = 3000  # one batch this large is rejected by Mooncake's TCP lane and can wedge it
    perm = np.random.default_rng(1).permutation(n)
    s = (src.ctypes.data + np.arange(n) * 256).astype(np.uint64)
    d = (dst.ctypes.data + perm * 256).astype(np.uint64)
    calls0 = a.stats.calls
    a.write(b.session_id, s, d, np.full(n, 256, dtype=np.uint64))
    assert a.stats.calls - calls0 == -(-n // a.batch_entries)
    assert a.batch_entries * a.window <= a.max_batch <= 1024
    got = dst[: n * 256].reshape(n, 256)
    want = src[: n * 256].reshape(n, 256)
    assert (got[perm] == want).all()


def test_write_outside_the_peer_registration_raises_and_the_next_write_works(engines) -> None:
    a, b, src, dst = engines
    one = np.ones(1, dtype=np.uint64)
    with pytest.raises(TransportError, match="failed"):
        a.write(
            b.session_id, one * src.ctypes.data, one * (dst.ctypes.data + dst.nbytes), one * 4096
        )
    dst[:4096] = 0
    a.write(b.session_id, one * src.ctypes.data, one * dst.ctypes.data, one * 4096)
    assert (dst[:4096] == src[:4096]).all()


def test_started_write_lands_and_a_failed_one_gives_back_its_credits(engines) -> None:
    # start() submits without waiting (the engine's send() calls it); finish() awaits on a
    # worker. A write that fails must still return its per-peer credits, or the peer would
    # be throttled for good; a write larger than one batch is not started at all.
    a, b, src, dst = engines
    n, sz = 64, 4096
    s = [src.ctypes.data + i * sz for i in range(n)]
    d = [dst.ctypes.data + (n - 1 - i) * sz for i in range(n)]
    dst[: n * sz] = 0
    started = a.start(b.session_id, s, d, [sz] * n)
    assert started is not None
    a.finish(b.session_id, started)
    assert (dst[: n * sz].reshape(n, sz)[::-1] == src[: n * sz].reshape(n, sz)).all()
    bad = a.start(b.session_id, [src.ctypes.data], [dst.ctypes.data + dst.nbytes], [sz])
    assert bad is not None
    with pytest.raises(TransportError, match="failed"):
        a.finish(b.session_id, bad)
    credits, _ = a._peer_state(b.session_id)
    assert credits.used == 0 and credits.bytes == 0
    many = a.batch_entries + 1
    assert a.start(b.session_id, s[:1] * many, d[:1] * many, [sz] * many) is None
    assert credits.used == 0


def test_a_started_write_never_holds_up_a_workers_write(engines) -> None:
    # A started write is awaited on a worker queue, possibly behind a write that needs
    # credits: that write must get through while the started one is still unawaited, and a
    # second write cannot start while the first holds credits (one started write per peer).
    a, b, src, dst = engines
    n, sz = a.batch_entries, 1024
    s = [src.ctypes.data + i * sz for i in range(n)]
    d = [dst.ctypes.data + i * sz for i in range(n)]
    first = a.start(b.session_id, s, d, [sz] * n)
    assert first is not None
    assert a.start(b.session_id, s[:1], d[:1], [sz]) is None
    m = 2 * n
    s2 = (src.ctypes.data + (1 << 20) + np.arange(m) * sz).astype(np.uint64)
    d2 = (dst.ctypes.data + (1 << 20) + np.arange(m)[::-1] * sz).astype(np.uint64)
    dst[1 << 20 : (1 << 20) + m * sz] = 0
    a.write(
        b.session_id, s2, d2, np.full(m, sz, dtype=np.uint64), deadline=time.monotonic() + 10
    )  # raises on the deadline if it waited for `first`
    a.finish(b.session_id, first)
    got = dst[1 << 20 : (1 << 20) + m * sz].reshape(m, sz)[::-1]
    assert (got == src[1 << 20 : (1 << 20) + m * sz].reshape(m, sz)).all()
    again = a.start(b.session_id, s[:1], d[:1], [sz])
    assert again is not None
    a.finish(b.session_id, again)


SPINNING = {
    "batch_transfer_sync_write",
    "batch_transfer_sync",
    "get_batch_transfer_status",
    "transfer_sync_write",
    "transfer_sync",
}
"""Mooncake's calls that spin on a core until their batch completes."""


class Recorder:
    """A Mooncake engine that notes the name of each call it forwards."""

    def __init__(self, engine: object, calls: list[str]) -> None:
        self._engine, self._calls = engine, calls

    def __getattr__(self, name: str) -> object:
        self._calls.append(name)
        return getattr(self._engine, name)


def test_a_large_write_of_few_entries_is_awaited_without_a_spinning_call(
    engines, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vLLM prefill streaming by layer writes each layer (16 MiB in a few entries in the
    streaming benchmark) while its forward computes on every core: a wait that spins took a
    core from the forward for each write's whole length. Such a write, lone (one blocking
    call before) or started in send(), lands awaited by polling alone; so does one that
    fails, and its credits come back."""
    a, b, src, dst = engines
    calls: list[str] = []
    monkeypatch.setattr(a, "_engine", Recorder(a._engine, calls))
    n, sz = 4, 1 << 19  # 2 MiB in 4 entries, written in reverse order
    s = [src.ctypes.data + i * sz for i in range(n)]
    d = [dst.ctypes.data + (n - 1 - i) * sz for i in range(n)]
    for write in ("lone", "started"):
        dst[: n * sz] = 0
        if write == "lone":
            a.write(b.session_id, s, d, [sz] * n)
        else:
            started = a.start(b.session_id, s, d, [sz] * n)
            assert started is not None
            a.finish(b.session_id, started)
        assert (dst[: n * sz].reshape(n, sz)[::-1] == src[: n * sz].reshape(n, sz)).all()
    assert "transfer_check_status" in calls and not SPINNING & set(calls), calls
    with pytest.raises(TransportError, match="failed"):  # the last entry lies outside
        a.write(b.session_id, s, d[:-1] + [dst.ctypes.data + dst.nbytes], [sz] * n)
    credits, _ = a._peer_state(b.session_id)
    assert credits.used == 0 and credits.bytes == 0


def test_dead_peer_fails_fast_and_probes_false(engines) -> None:
    a, _, src, _ = engines
    one = np.ones(1, dtype=np.uint64)
    assert not a.probe("127.0.0.1:1")
    with pytest.raises(TransportError):
        a.write("127.0.0.1:1", one * src.ctypes.data, one * 4096, one * 64)


def test_stop_request_halts_between_batches(engines) -> None:
    a, b, src, dst = engines
    n = 2048
    s = (src.ctypes.data + np.arange(n) * 64).astype(np.uint64)
    d = (dst.ctypes.data + np.arange(n) * 64).astype(np.uint64)
    calls = a.stats.calls
    asked = []

    def stop() -> bool:  # let the first batch go, stop before the second
        asked.append(1)
        return len(asked) > 1

    with pytest.raises(TransportError, match="stopped"):
        a.write(b.session_id, s, d, np.full(n, 64, dtype=np.uint64), should_stop=stop)
    # the batch in flight was awaited before the error (drained), and no other was submitted
    assert a.stats.calls == calls + 1
    assert a._peer_state(b.session_id)[0].used == 0


@pytest.mark.parametrize(
    "message,needle",
    [
        (
            "libibverbs.so.1: cannot open shared object file: No such file or directory",
            "libibverbs1",
        ),
        ("libnuma.so.1: cannot open shared object file", "libnuma1"),
        ("libcurl.so.4: cannot open shared object file", "libcurl4"),
        ("No module named 'mooncake'", "mooncake-transfer-engine"),
    ],
)
def test_missing_mooncake_names_the_package_or_library(
    monkeypatch, message: str, needle: str
) -> None:
    real = builtins.__import__

    def fake(name: str, *args: object, **kw: object) -> object:
        if name.startswith("mooncake"):
            raise ImportError(message)
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(TransportUnavailable, match=needle):
        mc._load_engine()


@pytest.mark.parametrize("completion", ["paced", "sync"])
def test_every_completion_mode_lands_every_byte_from_concurrent_writers(
    engines, completion: str
) -> None:
    """Several threads writing to one peer at once: all bytes land, and the per-peer in-flight
    count never exceeds the limit (the peer would otherwise reject entries and wedge)."""
    import threading

    a, b, src, dst = engines
    mode, a.completion = a.completion, completion
    a.window = 2 if completion == "paced" else 1
    old = a._peer_state(b.session_id)
    peak = [0]

    class Spy(Credits):
        def acquire(self, n: int, deadline: float | None, nbytes: int = 0) -> int:
            ahead = super().acquire(n, deadline, nbytes)
            peak[0] = max(peak[0], self.used)
            return ahead

    credits = Spy(a.max_batch)
    a._peers[b.session_id] = (credits, old[1])
    try:
        dst[:] = 0
        n, size = 4400, 1024  # > 2 batches per thread: writers must not wait holding credits
        perm = np.random.default_rng(7).permutation(n)
        s = (src.ctypes.data + np.arange(n) * size).astype(np.uint64)
        d = (dst.ctypes.data + perm * size).astype(np.uint64)
        parts = np.array_split(np.arange(n), 4)
        errs: list[BaseException] = []

        def run(ix: np.ndarray) -> None:
            try:
                a.write(b.session_id, s[ix], d[ix], np.full(ix.size, size, dtype=np.uint64))
            except BaseException as e:  # noqa: BLE001 - reported below
                errs.append(e)

        ts = [threading.Thread(target=run, args=(ix,)) for ix in parts]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert not errs
        got = dst[: n * size].reshape(n, size)
        assert (got[perm] == src[: n * size].reshape(n, size)).all()
        assert 0 < peak[0] <= a.max_batch
        assert credits.used == 0 and credits.bytes == 0
    finally:
        a._peers[b.session_id] = old
        a.completion, a.window = mode, 2 if mode == "paced" else 1
