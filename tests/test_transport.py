"""The Mooncake transport on its own: real engines, real TCP on loopback."""

from __future__ import annotations

import builtins
from collections.abc import Iterator

import numpy as np
import pytest

from pdxfer import TransportError, TransportUnavailable
from pdxfer.transport import MooncakeTransport
from pdxfer.transport import mooncake as mc


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
    assert a.stats.calls - calls0 == 3
    got = dst[: n * 256].reshape(n, 256)
    want = src[: n * 256].reshape(n, 256)
    assert (got[perm] == want).all()


def test_write_outside_the_peer_registration_raises_and_the_next_write_works(engines) -> None:
    a, b, src, dst = engines
    one = np.ones(1, dtype=np.uint64)
    with pytest.raises(TransportError, match="failed"):
        a.write(b.session_id, one * src.ctypes.data, one * (dst.ctypes.data + dst.nbytes),
                one * 4096)
    dst[:4096] = 0
    a.write(b.session_id, one * src.ctypes.data, one * dst.ctypes.data, one * 4096)
    assert (dst[:4096] == src[:4096]).all()


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
    with pytest.raises(TransportError, match="stopped"):
        a.write(b.session_id, s, d, np.full(n, 64, dtype=np.uint64),
                should_stop=lambda: a.stats.calls > calls)
    assert a.stats.calls == calls + 1


@pytest.mark.parametrize("message,needle", [
    ("libibverbs.so.1: cannot open shared object file: No such file or directory", "libibverbs1"),
    ("libnuma.so.1: cannot open shared object file", "libnuma1"),
    ("libcurl.so.4: cannot open shared object file", "libcurl4"),
    ("No module named 'mooncake'", "mooncake-transfer-engine"),
])
def test_missing_mooncake_names_the_package_or_library(monkeypatch, message: str,
                                                       needle: str) -> None:
    real = builtins.__import__

    def fake(name: str, *args: object, **kw: object) -> object:
        if name.startswith("mooncake"):
            raise ImportError(message)
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(TransportUnavailable, match=needle):
        mc._load_engine()
