"""vLLM's CPU tiles as page segments, learned by writing through vLLM's own kernel: the
layouts its ISAs pack (``vec``, ``vec16``, ``amx``) are each found at two block sizes, and a
layout that is no rows-of-units arrangement is opaque, never guessed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdxfer import PageSegment
from pdxfer.integrations.vllm import tiles

ops = pytest.importorskip("vllm._custom_ops")
HEADS, DIM = 2, 64


def kernel(isa: str):
    def write(key, value, cache, slots):
        dt = torch.bfloat16 if cache.dtype == torch.bfloat16 else torch.float32
        n = cache.shape[2]
        kv = cache.view(cache.shape[0], cache.shape[1], 2 * n, -1)
        k, v = kv.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key.to(dt), value.to(dt), k, v, slots, isa)

    return write


@pytest.mark.parametrize(
    "isa,dtype,want",
    [
        ("vec", torch.float32, (PageSegment(DIM, 1, 4), PageSegment(1, 1, DIM * 4))),
        ("vec16", torch.float32, (PageSegment(DIM, 1, 4), PageSegment(1, 1, DIM * 4))),
        ("vec", torch.bfloat16, (PageSegment(DIM, 1, 2), PageSegment(1, 1, DIM * 2))),
        ("amx", torch.bfloat16, (PageSegment(1, 16, 16 * DIM * 2), PageSegment(DIM // 16, 2, 64))),
    ],
)
def test_each_isas_packing_is_found_as_the_same_segments_at_two_block_sizes(
    isa, dtype, want
) -> None:
    like = torch.zeros(4, HEADS, 32, 2 * DIM, dtype=dtype)
    got = tiles.segments(kernel(isa), like, 32, HEADS, like.element_size())
    assert got == want


def test_a_layout_that_is_not_rows_of_units_is_opaque() -> None:
    def shuffled(key, value, cache, slots):
        n = cache.shape[2]
        perm = torch.from_numpy(np.random.default_rng(n).permutation(n * 2 * DIM))
        flat = torch.cat((key[:, 0], value[:, 0]), dim=1).reshape(-1)  # one head's tile
        cache[0, 0].view(-1)[perm] = flat.to(cache.dtype)
        flat = torch.cat((key[:, 1], value[:, 1]), dim=1).reshape(-1)
        cache[0, 1].view(-1)[perm] = flat.to(cache.dtype)

    like = torch.zeros(4, HEADS, 32, 2 * DIM, dtype=torch.float32)
    assert tiles.segments(shuffled, like, 32, HEADS, 4) is None


def test_fit_finds_the_finest_rows_of_units() -> None:
    n, d = 32, 8
    t, k = np.meshgrid(np.arange(n), np.arange(d), indexing="ij")
    assert tiles.fit(k * n + t, n, d) == (d, 1, 1)  # dimension-major
    assert tiles.fit(t * d + k, n, d) == (1, 1, d)  # token-major
    packed = (t // 16) * 16 * d + (k // 2) * 32 + (t % 16) * 2 + k % 2  # 16-token VNNI units
    assert tiles.fit(packed, n, d) == (1, 16, 16 * d)
    # tokens in reverse: only as one unit of the whole block, which another block size
    # does not share (``segments`` then calls it opaque)
    assert tiles.fit((t * d + k)[::-1].copy(), n, d) == (1, n, n * d)
    assert tiles.fit(np.zeros((n, d), dtype=np.int64), n, d) is None


def _caches(n: int) -> dict[str, torch.Tensor]:
    t = torch.zeros(2, 8, HEADS, n, 2 * DIM, dtype=torch.float32)  # [L, B, H, N, C]
    return {f"model.layers.{i}.self_attn.attn": t[i] for i in range(2)}


def test_a_learned_packing_pairs_blocks_of_two_sizes_and_an_unknown_one_is_refused_naming_both() -> (
    None
):
    from pdxfer.integrations.vllm.layout import describe
    from pdxfer.pools import check_pair

    vec = (PageSegment(DIM, 1, 4), PageSegment(1, 1, DIM * 4))
    a = describe(_caches(32), block_size=32, total_kv_heads=HEADS, interior=lambda *_: vec).pool
    b = describe(_caches(64), block_size=64, total_kv_heads=HEADS, interior=lambda *_: vec).pool
    assert a.segments == vec and a.page_remap and check_pair(a, b) is None
    x = describe(_caches(32), block_size=32, total_kv_heads=HEADS, interior=lambda *_: ()).pool
    y = describe(_caches(64), block_size=64, total_kv_heads=HEADS).pool
    why = check_pair(x, y) or ""
    assert "page_size: prefill 32, decode 64" in why and "opaque" in why
    assert check_pair(x, describe(_caches(32), block_size=32, total_kv_heads=HEADS).pool) is None


@pytest.mark.parametrize("n", [32, 64])
def test_vllms_cpu_mla_writes_one_plain_latent_row_per_token_at_any_block_size(n: int) -> None:
    """What ``tiles.PLAIN_LATENT`` stands on: vLLM's reference CPU MLA backend writes token
    ``t`` of block ``b`` at row ``b * n + t`` of the cache, so latent pages map token by token."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

    assert CPUMLABackend.get_name() in tiles.PLAIN_LATENT
    lora, pe, blocks = 512, 64, 3
    cache = torch.zeros(blocks, n, lora + pe, dtype=torch.bfloat16)
    slots = torch.tensor([2 * n + 5, 7, n + 1], dtype=torch.int64)
    kv_c = torch.arange(3 * lora, dtype=torch.float32).reshape(3, lora) % 97 + 1
    k_pe = torch.arange(3 * pe, dtype=torch.float32).reshape(3, 1, pe) % 89 + 1
    CPUMLAImpl.do_kv_cache_update(
        None, kv_c.bfloat16(), k_pe.bfloat16(), cache, slots, "auto", None
    )  # type: ignore[arg-type]
    rows = cache.reshape(-1, lora + pe)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(rows[s, :lora], kv_c[i].bfloat16())
        assert torch.equal(rows[s, lora:], k_pe[i, 0].bfloat16())
    assert int((rows != 0).any(dim=1).sum()) == 3
