"""The vLLM connector's pure parts: cache tensors as a pool (read from strides, never
assumed), the extra config's validation, and the ``kv_transfer_params`` protocol."""

from __future__ import annotations

import math

import pytest
import torch

from pdxfer import ConfigError
from pdxfer.integrations.vllm import config as C
from pdxfer.integrations.vllm import params as P
from pdxfer.integrations.vllm.layout import describe, describe_state
from pdxfer.integrations.vllm.state import splits

L, B, H, N, D = 3, 8, 4, 32, 64
C2 = 2 * D  # K and V of one head and token


def _layers(order: str, tensor: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-layer logical [B, H, N, C] views of one allocation laid out as ``order``
    (vLLM's ``KVCacheLayout`` names)."""
    dims = {"L": L, "B": B, "H": H, "N": N, "C": C2}
    t = (
        tensor
        if tensor is not None
        else torch.zeros([dims[c] for c in order], dtype=torch.bfloat16)
    )
    logical = t.permute(*[order.index(c) for c in "LBHNC"])
    return {f"model.layers.{i}.self_attn.attn": logical[i] for i in range(L)}


def test_head_major_blocks_are_one_page_per_block_and_layer_with_addressable_heads() -> None:
    caches = _layers("LBHNC")
    lay = describe(caches, block_size=N, total_kv_heads=H)
    p = lay.pool
    assert lay.kind == "HND" and p.sharding.layout == "HND" and p.sharding.rank_heads == H
    assert p.item_bytes == H * N * C2 * 2 and p.num_items == B and p.page_size == N
    assert [b.addr for b in p.buffers] == [
        caches[f"model.layers.{i}.self_attn.attn"].data_ptr() for i in range(L)
    ]
    assert p.sharding.head_bytes == C2 * 2 and lay.block_bytes == L * p.item_bytes


def test_token_major_blocks_are_nhd() -> None:
    lay = describe(_layers("LBNHC"), block_size=N, total_kv_heads=H)
    assert lay.kind == "NHD" and lay.pool.sharding.layout == "NHD"


def test_block_outermost_layout_is_one_opaque_buffer_over_all_layers() -> None:
    caches = _layers("BLHNC")
    lay = describe(caches, block_size=N, total_kv_heads=H)
    p = lay.pool
    assert lay.kind == "opaque-blocks" and len(p.buffers) == 1
    assert p.item_bytes == L * H * N * C2 * 2 and p.buffers[0].nbytes == B * p.item_bytes
    assert p.buffers[0].addr == min(t.data_ptr() for t in caches.values())
    with pytest.raises(ConfigError, match="TP 1 only"):
        describe(caches, block_size=N, total_kv_heads=2 * H, tp_rank=0, tp_size=2)


def test_blocks_strided_by_heads_are_refused_not_misaddressed() -> None:
    with pytest.raises(ConfigError, match="not one dense span|unsupported"):
        describe(_layers("LHBNC"), block_size=N, total_kv_heads=H)


def test_padded_pages_are_opaque_items_of_the_padded_size() -> None:
    big = torch.zeros(L, B, H * N * C2 + 64, dtype=torch.bfloat16)
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.as_strided(
            big[i], (B, H, N, C2), (H * N * C2 + 64, N * C2, C2, 1)
        )
        for i in range(L)
    }
    lay = describe(caches, block_size=N, total_kv_heads=H)
    assert lay.kind == "opaque-layer" and lay.pool.item_bytes == (H * N * C2 + 64) * 2


def test_tp_ranks_name_their_heads_and_gqa_replication() -> None:
    lay = describe(_layers("LBHNC"), block_size=N, total_kv_heads=2 * H, tp_rank=1, tp_size=2)
    sh = lay.pool.sharding
    assert (sh.total_heads, sh.rank_heads, sh.first_head) == (2 * H, H, H)
    one = torch.zeros(L, B, 1, N, C2, dtype=torch.bfloat16)
    caches = {f"l.{i}": one[i] for i in range(L)}
    sh = describe(caches, block_size=N, total_kv_heads=2, tp_rank=3, tp_size=4).pool.sharding
    assert (sh.total_heads, sh.rank_heads, sh.first_head) == (2, 1, 1)


def test_layers_are_ordered_by_their_index_not_by_name() -> None:
    t = torch.zeros(12, B, H, N, C2, dtype=torch.bfloat16)
    caches = {f"model.layers.{i}.attn": t[i] for i in (10, 2, 11, 0, 1, 3, 4, 5, 6, 7, 8, 9)}
    lay = describe(caches, block_size=N, total_kv_heads=H)
    assert [b.layer_id for b in lay.pool.buffers] == list(range(12))
    assert [b.addr for b in lay.pool.buffers] == [t[i].data_ptr() for i in range(12)]


def test_a_block_size_that_is_not_dim_2_is_refused() -> None:
    with pytest.raises(ConfigError, match="block size"):
        describe(_layers("LBHNC"), block_size=16, total_kv_heads=H)


def test_extra_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="bootstrap"):
        C.parse("kv_producer", {})
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['bootstrp'\]"):
        C.parse("kv_consumer", {"bootstrp": "x:1"})
    with pytest.raises(ConfigError, match="l2_pages must be int"):
        C.parse("kv_consumer", {"l2_pages": "12"})
    with pytest.raises(ConfigError, match="kv_both"):
        C.parse("kv_both", {})
    with pytest.raises(ConfigError, match="L3 stages through L2"):
        C.parse("kv_consumer", {"l3": "file", "l3_dir": "/tmp/x"})
    with pytest.raises(ConfigError, match="transport"):
        C.parse("kv_consumer", {"transport": "udp"})
    c = C.parse(
        "kv_consumer",
        {
            "l2_pages": 64,
            "l3": "file",
            "l3_dir": "/tmp/x",
            "bootstrap": "10.0.0.1:8998, 10.0.0.2:8998",
        },
        "m",
        "r1",
    )
    assert c.side == "decode" and c.instance == "vllm-decode" and c.model_id == "m@r1"
    assert c.trusted == ("10.0.0.1:8998", "10.0.0.2:8998")


def test_a_decode_without_trusted_bootstraps_or_with_a_malformed_one_fails_at_start() -> None:
    with pytest.raises(ConfigError, match="kv_connector_extra_config.bootstrap on the decode"):
        C.parse("kv_consumer", {})
    for bad in ("127.0.0.1:x", "127.0.0.1:70000", ":8998", "127.0.0.1"):
        with pytest.raises(ConfigError, match="port|host"):
            C.parse("kv_consumer", {"bootstrap": bad})
        with pytest.raises(ConfigError, match="port|host"):
            C.parse("kv_producer", {"bootstrap": bad})


def test_params_from_clients_are_checked_and_rooms_pair_the_two_sides() -> None:
    assert P.prefill_ask({"do_remote_decode": True, "pdxfer_room": -1}) is None
    assert P.prefill_ask({"do_remote_decode": True, "pdxfer_room": True}) is None
    assert P.prefill_ask({"do_remote_decode": "yes"}) is None
    drawn = P.prefill_ask({"do_remote_decode": True})
    assert drawn is not None and 0 <= drawn.room < 1 << 63 and drawn.decode is None
    ask = P.prefill_ask({"do_remote_decode": True, "pdxfer_room": 7, "pdxfer_decode": "d1"})
    assert ask == P.PrefillAsk(7, "d1")
    answer = P.prefill_answer(7, "h:1", "p1", 100)
    d = P.decode_ask(answer)
    assert d == P.DecodeAsk(7, "h:1", "p1", dp=0) and not d.early  # sequential: the answer
    early = {k: v for k, v in answer.items() if k not in ("pdxfer_num_tokens", "pdxfer_dp")}
    assert P.decode_ask(early) == P.DecodeAsk(7, "h:1", "p1", early=True)  # at dispatch
    assert P.decode_ask({**answer, "pdxfer_room": "7"}) is None
    assert P.decode_ask({**answer, "pdxfer_bootstrap": "x" * 500}) is None
    for bad in ("127.0.0.1:x", "127.0.0.1:0", "127.0.0.1:99999", ":8998", "h"):
        assert P.decode_ask({**answer, "pdxfer_bootstrap": bad}) is None, bad
    assert P.decode_ask({"do_remote_prefill": True}) is None


def test_a_data_parallel_rank_in_params_is_checked_and_names_the_rank_holding_the_kv() -> None:
    answer = P.prefill_answer(7, "h:1", "p1", 100, dp=3)
    assert answer["pdxfer_dp"] == 3 and P.decode_ask(answer) == P.DecodeAsk(7, "h:1", "p1", dp=3)
    early = {k: v for k, v in answer.items() if k != "pdxfer_num_tokens"}
    assert P.decode_ask(early) == P.DecodeAsk(7, "h:1", "p1", early=True, dp=3)
    ask = {"do_remote_decode": True, "pdxfer_room": 7, "pdxfer_dp": 1}
    assert P.prefill_ask(ask) == P.PrefillAsk(7, None, 1)
    for bad in (-1, True, "1", 1.0, P.DP_MAX):
        assert P.decode_ask({**answer, "pdxfer_dp": bad}) is None, bad
        assert P.prefill_ask({**ask, "pdxfer_dp": bad}) is None, bad


def test_k_and_v_apart_are_two_buffers_per_layer_with_heads_addressable() -> None:
    t = torch.zeros(L, 2, B, N, H, D, dtype=torch.bfloat16)  # FlashAttention-style [2, B, N, H, D]
    caches = {f"model.layers.{i}.attn": t[i] for i in range(L)}
    lay = describe(caches, block_size=N, total_kv_heads=2 * H, tp_rank=1, tp_size=2)
    p = lay.pool
    assert lay.kind == "NHD" and [(b.layer_id, b.role) for b in p.buffers] == [
        (i, r) for i in range(L) for r in ("k", "v")
    ]
    assert [b.addr for b in p.buffers] == [t[i, j].data_ptr() for i in range(L) for j in (0, 1)]
    assert p.item_bytes == N * H * D * 2 and p.sharding.head_bytes == D * 2
    assert p.sharding.first_head == H and lay.block_bytes == 2 * L * p.item_bytes


def test_an_mla_latent_is_one_replicated_pool_that_one_prefill_rank_writes_per_decode_rank() -> (
    None
):
    """DeepSeek-V2's cache as vLLM hands it (per layer ``[blocks, block_size, 512 + 64]``)
    on every rank of TP 1 and 2: whatever the config's KV heads (4), each rank's pool is the
    same replicated latent, and the planner has exactly one prefill rank write it to each
    decode rank, P TP 2 -> D TP 1 and 1 -> 2 (so each decode rank gets it once)."""
    from pdxfer.plan.topology import assign, contacts

    caches = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(B, N, 576, dtype=torch.bfloat16)
        for i in range(2)
    }

    def pool(rank: int, tp: int, latent: bool = True):  # noqa: ANN202
        return describe(
            caches, block_size=N, total_kv_heads=4, tp_rank=rank, tp_size=tp, latent=latent
        ).pool

    pools = [pool(0, 1), pool(0, 2), pool(1, 2)]
    for p in pools:
        assert p.sharding.kind == "replicated" and p.item_bytes == N * 576 * 2
    assert pool(0, 2, latent=False) == pools[1]  # a 3-dim cache is a latent either way
    plan = assign({"kv": pools[0]}, [(0, {"kv": pools[1]}), (0, {"kv": pools[2]})])
    assert not isinstance(plan, str)
    assert [a.silent for a in plan] == [False, True]  # 2 -> 1: rank 0 writes, rank 1 nothing
    for d in range(2):  # 1 -> 2: each decode rank asks the one prefill rank, which writes
        assert contacts(1, 2, d) == [0]
        plan = assign({"kv": pools[1 + d]}, [(0, {"kv": pools[0]})])
        assert not isinstance(plan, str) and not plan[0].silent and plan[0].skip == ()


def _mamba_page(nb: int, page: int, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """One layer's state tensors as vLLM views them: every tensor of a block inside one
    ``page``-byte page, one after the other (float32)."""
    raw = torch.zeros(nb * page, dtype=torch.uint8).view(torch.float32)
    out, off = [], 0
    for shape in shapes:
        inner = torch.empty(shape).stride()
        out.append(torch.as_strided(raw, (nb, *shape), (page // 4, *inner), off // 4))
        off += math.prod(shape) * 4
    return out


def test_a_mamba2_state_page_is_described_as_tp_sharded_pieces() -> None:
    # Nemotron-H at TP 2, rank 1: conv (SD) 3 rows of x 256 | B 64 | C 64, SSM 4 heads of
    # 64 x 64; one B/C group in the model, so both ranks hold it
    shapes = [(3, 256 + 64 + 64), (4, 64, 64)]
    split = splits("MAMBA2", shapes, [4, 4], conv_ds=False, tp_size=2, n_groups=1)
    assert not isinstance(split, str)
    page = 81920  # padded to the attention page
    states = {f"model.layers.{i}.mixer": _mamba_page(6, page, shapes) for i in (0, 4)}
    pool = describe_state(
        states, name="kv1", num_blocks=6, page_bytes=page, split=split, tp_rank=1, tp_size=2
    )
    got = [
        (p.offset, p.total, p.first, p.rank_units, p.unit_bytes, p.rows)
        for p in pool.sharding.pieces
    ]
    assert got == [
        (0, 8, 4, 4, 64 * 4, 3),  # x: heads [4, 8) of 8, 64 channels each, in each of 3 rows
        (256 * 4, 1, 0, 1, 64 * 4, 3),  # B: the one group
        (320 * 4, 1, 0, 1, 64 * 4, 3),  # C
        (3 * 384 * 4, 8, 4, 4, 64 * 64 * 4, 1),  # SSM: heads [4, 8)
    ]
    assert all(p.row_stride == 384 * 4 for p in pool.sharding.pieces[:3])
    assert [b.layer_id for b in pool.buffers] == [0, 4] and pool.item_bytes == page
    # vLLM 0.32 hands the raw page instead, [blocks, 1, 1, state bytes] of int8, its states
    # back to back from byte 0 (MambaBase.bind_kv_cache): the same pieces
    content = (3 * 384 + 4 * 64 * 64) * 4
    raw = torch.zeros(6 * page, dtype=torch.int8)
    view = torch.as_strided(raw, (6, 1, 1, content), (page, content, content, 1))
    packed = describe_state(
        {"model.layers.0.mixer": view},
        name="kv1",
        num_blocks=6,
        page_bytes=page,
        split=split,
        tp_rank=1,
        tp_size=2,
    )
    assert packed.sharding == pool.sharding
    # tensors that are not what the split says: the page moves whole
    other = describe_state(
        {"model.layers.0.mixer": _mamba_page(6, page, [(3, 100), (4, 64, 64)])},
        name="kv1",
        num_blocks=6,
        page_bytes=page,
        split=split,
        tp_rank=1,
        tp_size=2,
    )
    assert other.sharding.kind == "replicated"


def test_mamba2_without_a_group_count_is_not_split_over_tp() -> None:
    shapes = [(3, 384), (4, 64, 64)]
    assert "group count" in splits("MAMBA2", shapes, [4, 4], conv_ds=False, tp_size=2)  # type: ignore[operator]
    assert not isinstance(splits("MAMBA2", shapes, [4, 4], conv_ds=False, tp_size=1), str)
    assert "state kind" in splits("KDA", shapes, [4, 4], conv_ds=False, tp_size=2)  # type: ignore[operator]
