"""The decode worker's host prefix cache and the serving CLI surface (in-process, fast)."""

from __future__ import annotations

import pytest
import torch

from pdxfer.cli import main
from pdxfer.serving import ToyConfig, ToyModel, make_draft
from pdxfer.serving.prefix import HostPrefixCache, page_keys

torch.set_num_threads(1)
CFG = ToyConfig(n_layers=2, draft_layers=1, max_seq_len=256)


def filled(model: ToyModel, tokens: list[int]) -> tuple[object, object, list[int]]:
    kv = model.new_kv_pool(32)
    dkv = make_draft(model).new_kv_pool(32, allocator=kv.allocator)
    pt = kv.allocator.alloc(model.pages_for(len(tokens)))
    model.prefill(tokens, pt, kv)
    make_draft(model).prefill(tokens, pt, dkv)
    return kv, dkv, pt


def test_restored_pages_equal_written_pages_in_every_pool() -> None:
    model = ToyModel(CFG)
    tokens = [(i * 7) % 256 for i in range(70)]  # 4 full pages + 6 tokens
    kv, dkv, pt = filled(model, tokens)
    cache = HostPrefixCache([kv, dkv], capacity_pages=16)
    cache.write_back(tokens, pt)
    assert cache.match(tokens) == 64
    kv2 = model.new_kv_pool(32)
    dkv2 = make_draft(model).new_kv_pool(32, allocator=kv2.allocator)
    pt2 = list(reversed(kv2.allocator.alloc(8)))  # scattered destination pages
    cache2 = HostPrefixCache([kv2, dkv2], capacity_pages=16)
    cache2._pages = cache._pages  # same store, other pools: restore copies bytes
    assert cache2.restore(tokens, 64, pt2) == 64
    for src, dst in ((kv, kv2), (dkv, dkv2)):
        for a, b in zip(src.tensors, dst.tensors):
            for i in range(4):
                assert torch.equal(a[pt[i]], b[pt2[i]])


def test_match_needs_equal_prefix_and_leaves_a_token_to_the_prefill() -> None:
    ps = 16
    a = list(range(64))
    b = list(range(16)) + [255] + list(range(17, 64))  # differs in page 1
    assert page_keys(a, ps)[0] == page_keys(b, ps)[0] and page_keys(a, ps)[1] != page_keys(b, ps)[1]
    model = ToyModel(CFG)
    kv, dkv, pt = filled(model, a)
    cache = HostPrefixCache([kv, dkv], capacity_pages=16)
    cache.write_back(a, pt)
    assert cache.match(b) == 16
    assert cache.match(a) == 48  # all 4 pages cached, but the last token must be computed
    assert cache.match(a + [1]) == 64


def test_eviction_keeps_capacity() -> None:
    model = ToyModel(CFG)
    tokens = list(range(80))
    kv, dkv, pt = filled(model, tokens)
    cache = HostPrefixCache([kv, dkv], capacity_pages=2)
    cache.write_back(tokens, pt)
    s = cache.stats()
    assert s["cached_pages"] == 2 and s["evicted_pages"] == 3
    assert cache.match(tokens + [0]) == 0  # the chain's first pages were evicted


@pytest.mark.parametrize("cmd", ["bootstrap", "prefill", "decode", "router", "demo",
                                 "transfer-demo", "bench"])
def test_every_subcommand_has_help(cmd: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    assert "usage" in capsys.readouterr().out
