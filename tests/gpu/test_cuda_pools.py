"""Device pools on a GPU: what this machine (no GPU) cannot run, collected everywhere and run
where ``torch.cuda`` sees a device (``pytest tests/gpu``).

A pair with a pool on a device digests with the portable function, computed by torch on the
pool's own device; the other side may hold the same KV in host memory, at another page size
or layout, so the digest of the device pool must equal the host one bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdxfer.agents import patterns as pat
from pdxfer.agents.patterns import PoolGeom
from pdxfer.integrity import Span, digests, slot_digests

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"
)
ROOM = 7
TOKENS = (3, 77)


def _pool(ps: int, layout: str, device: str):
    g = PoolGeom(
        "kv",
        "mha",
        layers=2,
        pages=128,
        page_size=ps,
        heads=4,
        head_dim=32,
        layout=layout,
        total_heads=4,
    )
    specs, ts = pat.build([g], device=device)
    return specs[0], ts["kv"]


@pytest.mark.parametrize("mode", ["sampled", "full"])
@pytest.mark.parametrize(
    "host,dev", [((16, "NHD"), (16, "NHD")), ((16, "HND"), (4, "NHD")), ((1, "NHD"), (32, "HND"))]
)
def test_a_device_pool_digests_like_the_same_kv_in_host_memory(mode: str, host, dev) -> None:
    hs, ht = _pool(*host, "cpu")
    ds, dt = _pool(*dev, "cuda:0")
    rng = np.random.default_rng(0)
    hp = rng.permutation(128)[: -(-TOKENS[1] // host[0])].astype(np.int64)
    dp = rng.permutation(128)[: -(-TOKENS[1] // dev[0])].astype(np.int64)
    pat.fill_tokens(hs, ht, ROOM, hp, 0, *TOKENS)
    # the device pool's bytes come from the same pattern, filled on host and copied over
    ds_host, dt_host = _pool(*dev, "cpu")
    pat.fill_tokens(ds_host, dt_host, ROOM, dp, 0, *TOKENS)
    for d, h in zip(dt, dt_host):
        d.copy_(h)
    torch.cuda.synchronize()
    want = digests(hs, Span(hp, 0, *TOKENS, 0, 4), mode, 16, portable=True)
    got = digests(ds, Span(dp, 0, *TOKENS, 0, 4), mode, 16, portable=True)
    assert got == want and want
    # one byte of the second page (inside the span at every page size here)
    dt[0][int(dp[1])].reshape(-1).view(torch.uint8)[0] ^= 1
    torch.cuda.synchronize()
    if mode == "full":
        assert digests(ds, Span(dp, 0, *TOKENS, 0, 4), mode, 16, portable=True) != want


def test_a_device_slot_row_digests_like_the_host_row() -> None:
    g = PoolGeom("aux", "slots", layers=2, pages=8, dim=6, dtype="int32")
    (hs,), ht = pat.build([g])
    (ds,), dt = pat.build([g], device="cuda:0")
    for i, (h, d) in enumerate(zip(ht["aux"], dt["aux"])):
        h.copy_(torch.arange(h.numel(), dtype=torch.int32).view_as(h) * (i + 3))
        d.copy_(h)
    torch.cuda.synchronize()
    assert slot_digests(ds, 5, "full", portable=True) == slot_digests(hs, 5, "full", portable=True)


def test_the_allocation_holding_a_device_buffer_is_found_from_inside_it() -> None:
    """Mooncake's nvlink_intra maps a peer's IPC handle at the allocation's start, so pdxfer
    registers whole allocations (``transport/nvlink.py``): the driver must name the start
    and size of the allocation holding any address inside it."""
    from pdxfer.transport.nvlink import cuda_allocation

    t = torch.empty(64 << 20, dtype=torch.uint8, device="cuda:0")
    inner = t[3 << 20 :]
    found = cuda_allocation(inner.data_ptr())
    assert found is not None
    start, size = found
    assert start <= t.data_ptr() and t.data_ptr() + t.numel() <= start + size
    assert cuda_allocation(t.data_ptr()) == found
