"""SGLang's KVArgs as pdxfer pools (pure mapping; no SGLang needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdxfer import ConfigError
from pdxfer.integrations.sglang.pools import DRAFT_LAYER_BASE, Heads, pools_of, state_slots


def args(**kw: object) -> SimpleNamespace:
    # 2 layers MHA (K0 K1 V0 V1) + a 1-layer draft (K V); page 4 tokens of 2 heads x 16 bytes
    item = 4 * 2 * 16
    base = dict(kv_data_ptrs=[(i + 1) << 20 for i in range(6)], kv_data_lens=[item * 8] * 6,
                kv_item_lens=[item] * 6, kv_layer_ids=[], num_draft_entries=2, page_size=4,
                aux_data_ptrs=[1 << 40], aux_data_lens=[64 * 8], aux_item_lens=[64],
                state_types=[], state_data_ptrs=[], state_data_lens=[], state_item_lens=[],
                state_layer_ids=[], prefill_start_layer=0)
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
    pools = {p.name: p for p in pools_of(a, is_mla=False, heads=Heads(2, 2, 0, 16),
                                        kv_page_size=1)}
    assert pools["kv"].page_size == 1 and pools["kv"].page_remap


def test_window_states_are_refused_by_name() -> None:
    a = args(state_types=["swa"], state_data_ptrs=[[1 << 41]], state_data_lens=[[512]],
             state_item_lens=[[64]], state_layer_ids=[[0]])
    with pytest.raises(ConfigError, match="'swa'"):
        pools_of(a, is_mla=True, heads=None)


def test_mamba_slot_comes_from_sglangs_state_indices() -> None:
    a = args(state_types=["mamba"], state_data_ptrs=[[1 << 41, 1 << 42]],
             state_data_lens=[[512, 1024]], state_item_lens=[[64, 128]],
             state_layer_ids=[[0, 0]])
    names = [p.name for p in pools_of(a, is_mla=True, heads=None)]
    assert "state0_mamba.0" in names and "state0_mamba.1" in names
    assert state_slots(a, [[[5]]]) == {"state0_mamba.0": 5, "state0_mamba.1": 5}
