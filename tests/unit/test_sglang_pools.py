"""SGLang's KVArgs as pdxfer pools (pure mapping; no SGLang needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdxfer import ConfigError
from pdxfer.integrations.sglang.pools import (
    DRAFT_LAYER_BASE,
    SWA_LAYER_BASE,
    Heads,
    pools_of,
    state_slots,
)
from pdxfer.integrations.sglang.window import start_page, swa_pages, window_room
from pdxfer.pools import check_pair


def args(**kw: object) -> SimpleNamespace:
    # 2 layers MHA (K0 K1 V0 V1) + a 1-layer draft (K V); page 4 tokens of 2 heads x 16 bytes
    item = 4 * 2 * 16
    base = dict(
        kv_data_ptrs=[(i + 1) << 20 for i in range(6)],
        kv_data_lens=[item * 8] * 6,
        kv_item_lens=[item] * 6,
        kv_layer_ids=[],
        num_draft_entries=2,
        page_size=4,
        aux_data_ptrs=[1 << 40],
        aux_data_lens=[64 * 8],
        aux_item_lens=[64],
        state_types=[],
        state_data_ptrs=[],
        state_data_lens=[],
        state_item_lens=[],
        state_layer_ids=[],
        prefill_start_layer=0,
    )
    base.update(kw)
    return SimpleNamespace(**base)


def test_mha_halves_heads_and_draft_following_kv() -> None:
    heads = Heads.of_rank(4, 2, 16, tp_rank=1, tp_size=2)
    pools = {p.name: p for p in pools_of(args(), is_mla=False, heads=heads)}
    kv, draft = pools["kv"], pools["draft_kv"]
    assert [(b.layer_id, b.role) for b in kv.buffers] == [(0, "k"), (1, "k"), (0, "v"), (1, "v")]
    assert (kv.sharding.total_heads, kv.sharding.first_head, kv.sharding.rank_heads) == (4, 2, 2)
    assert draft.indices_from == "kv" and draft.buffers[0].layer_id == DRAFT_LAYER_BASE
    assert pools["aux"].kind == "slot" and kv.num_items == 8


def test_host_pool_of_another_page_size_is_remapped() -> None:
    a = args(kv_item_lens=[2 * 16] * 6, kv_data_lens=[2 * 16 * 32] * 6)
    pools = {p.name: p for p in pools_of(a, is_mla=False, heads=Heads(2, 2, 0, 16), kv_page_size=1)}
    assert pools["kv"].page_size == 1 and pools["kv"].page_remap


def swa_args(item: int = 4 * 2 * 16, **kw: object) -> SimpleNamespace:
    """Two sliding layers (K0 K1 V0 V1) in SGLang's SWA sub-pool, state ``swa``."""
    return args(
        state_types=["swa"],
        state_data_ptrs=[[(i + 9) << 20 for i in range(4)]],
        state_data_lens=[[item * 6] * 4],
        state_item_lens=[[item] * 4],
        state_layer_ids=[[]],
        **kw,
    )


def test_sglangs_swa_state_is_a_pool_of_its_own_sharded_as_the_kv() -> None:
    heads = Heads.of_rank(4, 2, 16, tp_rank=1, tp_size=2)
    swa = {p.name: p for p in pools_of(swa_args(), is_mla=False, heads=heads)}["swa"]
    assert swa.kind == "paged" and swa.indices_from is None  # its own (window) page ids
    assert [(b.layer_id - SWA_LAYER_BASE, b.role) for b in swa.buffers] == [
        (0, "k"),
        (1, "k"),
        (0, "v"),
        (1, "v"),
    ]
    assert (swa.sharding.total_heads, swa.sharding.first_head) == (4, 2)
    assert swa.num_items == 6 and swa.page_size == 4


def test_mla_swa_state_is_one_replicated_latent_per_layer() -> None:
    swa = {p.name: p for p in pools_of(swa_args(), is_mla=True, heads=None)}["swa"]
    assert swa.sharding.kind == "replicated" and len({b.layer_id for b in swa.buffers}) == 4


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"swa_kv_cache_layout": "hnd"}, "layout 'hnd'"),
        ({"state_item_lens": [[128, 128, 64, 64]]}, "one page size"),
        ({"state_types": ["swa_ring"]}, "'swa_ring'"),
        (
            {
                "state_types": ["swa", "swa"],
                "state_data_ptrs": [[1], [2]],
                "state_data_lens": [[1], [1]],
                "state_item_lens": [[1], [1]],
            },
            "2 SWA states",
        ),
    ],
)
def test_window_states_pdxfer_cannot_move_are_refused_by_name(kw: dict, words: str) -> None:
    a = swa_args()
    vars(a).update(kw)
    with pytest.raises(ConfigError, match=words):
        pools_of(a, is_mla=False, heads=Heads(2, 2, 0, 16))


def test_the_window_ends_at_the_last_prompt_page() -> None:
    assert start_page(10, 3, room=1) == 7 and start_page(2, 2, room=1) == 0
    with pytest.raises(ConfigError, match="4 SWA pages for a prompt of 3 pages"):
        start_page(3, 4, room=1)
    with pytest.raises(ConfigError):
        start_page(3, 0, room=1)  # a prompt has at least one page in its window


def test_swa_pages_read_sglangs_state_indices_and_get_a_room_of_their_own() -> None:
    import numpy as np

    assert swa_pages([np.array([3, 1, 2])], 0).tolist() == [3, 1, 2]
    assert swa_pages([None, [np.array([5]), np.array([6])]], 1).tolist() == [5, 6]
    assert swa_pages(None, 0) is None and swa_pages([np.array([1])], None) is None
    rooms = [1, 2, 12345, (1 << 63) - 1]
    assert len({window_room(r) for r in rooms} | set(rooms)) == 2 * len(rooms)
    assert all(0 <= window_room(r) < 1 << 63 for r in rooms)


def test_mamba_slot_comes_from_sglangs_state_indices() -> None:
    a = args(
        state_types=["mamba"],
        state_data_ptrs=[[1 << 41, 1 << 42]],
        state_data_lens=[[512, 1024]],
        state_item_lens=[[64, 128]],
        state_layer_ids=[[0, 0]],
    )
    names = [p.name for p in pools_of(a, is_mla=True, heads=None)]
    assert "state0_mamba.0" in names and "state0_mamba.1" in names
    assert state_slots(a, [[[5]]]) == {"state0_mamba.0": 5, "state0_mamba.1": 5}


def gdn_args(tp: int, **kw: object) -> SimpleNamespace:
    """A GDN state as SGLang's MambaPool describes it at attention TP ``tp``: conv
    ``[Q|K|V channels, 3]`` (Q, K 8 channels, V 16, bf16) and SSM ``[4 heads, 4, 4]`` fp32,
    one entry per tensor (of one layer)."""
    conv = (8 + 8 + 16) // tp
    items = [conv * 3 * 2, 4 // tp * 16 * 4]
    return args(
        state_types=["mamba"],
        state_data_ptrs=[[9 << 20, 10 << 20]],
        state_data_lens=[[it * 8 for it in items]],
        state_item_lens=[items],
        state_layer_ids=[[5, 5]],
        state_dim_per_tensor=[[conv, 4 // tp]],
        state_slice_outer_counts=[[1, 1]],
        **{"state_conv_shard_groups": [[[8, 8, 16], None]], **kw},
    )


def test_gdn_state_splits_q_k_v_and_heads_as_sglangs_kvargs_say() -> None:
    pools = {
        p.name: p for p in pools_of(gdn_args(2), is_mla=True, heads=None, tp_rank=1, tp_size=2)
    }
    conv, ssm = pools["state0_mamba.0"], pools["state0_mamba.1"]
    # rank 1 holds Q [4, 8), K [4, 8), V [8, 16): 6 bytes a channel (3 rows x bf16)
    assert [
        (q.offset, q.total, q.first, q.rank_units, q.unit_bytes) for q in conv.sharding.pieces
    ] == [
        (0, 8, 4, 4, 6),
        (24, 8, 4, 4, 6),
        (48, 16, 8, 8, 6),
    ]
    assert [(q.offset, q.total, q.first, q.rank_units) for q in ssm.sharding.pieces] == [
        (0, 4, 2, 2)
    ]
    whole = {p.name: p for p in pools_of(gdn_args(1), is_mla=True, heads=None)}
    assert check_pair(conv, whole["state0_mamba.0"]) is None  # TP 2 and TP 1 pair


def test_a_state_sglang_does_not_describe_in_sub_blocks_moves_whole() -> None:
    # Mamba2: SGLang names no sub-blocks for its x | B | C conv state, so one contiguous
    # slice would mix them: the slot moves whole, and another TP size is refused at pairing
    a = gdn_args(2, state_conv_shard_groups=[[None, None]])
    b = gdn_args(1, state_conv_shard_groups=[[None, None]])
    pa = {p.name: p for p in pools_of(a, is_mla=True, heads=None, tp_rank=1, tp_size=2)}
    pb = {p.name: p for p in pools_of(b, is_mla=True, heads=None)}
    assert pa["state0_mamba.0"].sharding.kind == "replicated"
    assert "slot size mismatch" in (check_pair(pa["state0_mamba.0"], pb["state0_mamba.0"]) or "")
