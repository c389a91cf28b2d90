"""vLLM's CPU tiles as page segments, learned by writing through vLLM's own kernel: the
layouts its ISAs pack (``vec``, ``vec16``, ``amx``) are each found at two block sizes, and a
layout that is no rows-of-units arrangement is opaque, never guessed."""

from __future__ import annotations

from types import SimpleNamespace

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
        pytest.param(
            "amx",
            torch.bfloat16,
            (PageSegment(1, 16, 16 * DIM * 2), PageSegment(DIM // 16, 2, 64)),
            # vLLM's amx kernel runs only on such a CPU (a VNNI-packed layout is fitted on
            # any CPU: test_fit_finds_the_finest_rows_of_units)
            marks=pytest.mark.skipif(
                not torch.cpu._is_amx_tile_supported(), reason="this CPU has no AMX"
            ),
        ),
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


def _mla_layer(impl_cls: type, lora: int = 512, pe: int = 64) -> SimpleNamespace:
    impl = object.__new__(impl_cls)  # its cache write reads nothing of the instance
    impl.kv_lora_rank, impl.qk_rope_head_dim = lora, pe
    return SimpleNamespace(impl=impl)


def _mla_impl(backend: str) -> type:
    if backend == "CPU_MLA":
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

        return CPUMLAImpl
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLAImpl

    return AMXMLAImpl


AMX = pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="this CPU has no AMX")
"""vLLM's AMX kernels run only on a CPU with AMX (where vLLM picks AMX_MLA by default)."""


@pytest.mark.parametrize("n", [32, 64])
@pytest.mark.parametrize("backend", ["CPU_MLA", pytest.param("AMX_MLA", marks=AMX)])
def test_vllms_mla_writes_are_found_to_be_one_latent_row_per_token(backend: str, n: int) -> None:
    """vLLM's CPU MLA backends (the reference one and the AMX one) write token ``t`` of
    block ``b`` at row ``b * n + t``: the probe, through their real writes, says so, so
    latent pages of two block sizes map token by token."""
    like = torch.zeros(3, n, 576, dtype=torch.bfloat16)
    layer = _mla_layer(_mla_impl(backend))
    assert tiles.latent_rows(layer, like)
    assert tiles.interior({"mla": layer}, torch.bfloat16)("mla", like, True) is None


class _PeFirst:
    """An MLA write that puts ``k_pe`` before ``kv_c`` in each row."""

    def do_kv_cache_update(self, kv_c, k_pe, cache, slots, dtype, scale) -> None:
        flat = cache.view(-1, cache.shape[-1])
        flat[slots] = torch.cat((k_pe.squeeze(1), kv_c), dim=-1).to(cache.dtype)


class _Blocked:
    """An MLA write that keeps a block's latents dimension-major (a packed tile)."""

    def do_kv_cache_update(self, kv_c, k_pe, cache, slots, dtype, scale) -> None:
        n = cache.shape[1]
        rows = torch.cat((kv_c, k_pe.squeeze(1)), dim=-1).to(cache.dtype)
        for i, s in enumerate(slots.tolist()):
            cache[s // n].view(-1, n)[:, s % n] = rows[i]


@pytest.mark.parametrize("impl", [_PeFirst, _Blocked])
def test_an_mla_write_of_any_other_layout_leaves_the_blocks_opaque(impl: type) -> None:
    like = torch.zeros(3, 32, 576, dtype=torch.bfloat16)
    assert not tiles.latent_rows(_mla_layer(impl), like)
    assert tiles.interior({"mla": _mla_layer(impl)}, torch.bfloat16)("mla", like, True) == ()
    # no write, or sizes that do not add up to the cache's row: opaque, never guessed
    assert not tiles.latent_rows(SimpleNamespace(), like)
    assert not tiles.latent_rows(_mla_layer(impl, lora=500), like)
