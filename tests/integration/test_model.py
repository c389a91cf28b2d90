"""Invariants of the toy model that the KV-transfer tests lean on.

The transfer layer proves KV arrived intact by comparing tokens with a colocated run, which
is only sound if nothing but the KV bytes can change those tokens: not the chunking, not
the page ids, not the process, not the thread count.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from pdxfer.serving.toy import (
    EOS_ID,
    KVPool,
    OutOfPagesError,
    PageAllocator,
    SpecResult,
    ToyConfig,
    ToyModel,
    copy_pages,
    decode,
    encode,
    make_draft,
    speculative_generate,
)

PROMPT = encode(
    "Disaggregated serving moves the KV cache from prefill to decode, page by page. " * 3
)[:200]
N_NEW = 16
VARIANTS = {
    "mha-fp16": ToyConfig(),
    "mha-bf16": ToyConfig(kv_dtype=torch.bfloat16),
    "mha-fp32": ToyConfig(kv_dtype=torch.float32),
    "mla-fp16": ToyConfig(attention="mla"),
}


@functools.cache
def model(variant: str) -> ToyModel:
    return ToyModel(VARIANTS[variant])


@functools.cache
def reference(variant: str, n_new: int = N_NEW) -> tuple[int, ...]:
    return tuple(model(variant).generate(PROMPT, n_new))


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def logical_kv(kv: KVPool, page_table: list[int], n: int) -> list[bytes]:
    """The KV of positions [0, n) in token order, independent of which pages hold it."""
    idx = torch.tensor(page_table, dtype=torch.long)
    return [as_bytes(t[idx].flatten(0, 1)[:n]) for t in kv.tensors]


def logical_kv_tokens(kv: KVPool, table: list[int], n: int) -> list[list[bytes]]:
    """Like :func:`logical_kv` but one entry per token, to compare token ranges."""
    idx = torch.tensor(table, dtype=torch.long)
    return [[as_bytes(r) for r in t[idx].flatten(0, 1)[:n]] for t in kv.tensors]


def garbage_pool(m: ToyModel, num_pages: int, seed: int = 123) -> KVPool:
    """A pool whose every byte is noise, so reading an unwritten slot cannot go unnoticed."""
    kv = m.new_kv_pool(num_pages)
    g = torch.Generator().manual_seed(seed)
    for t in kv.tensors:
        t.copy_(torch.randn(t.shape, generator=g))
    return kv


def run(m: ToyModel, kv: KVPool, page_table: list[int], chunk: int | None) -> list[int]:
    out = [m.prefill(PROMPT, page_table, kv, chunk_size=chunk)]
    while len(out) < N_NEW:
        out.append(m.decode_step(out[-1], len(PROMPT) + len(out) - 1, page_table, kv))
    return out


def test_bytes_round_trip_and_eos_is_not_text() -> None:
    text = "héllo, wörld ✓"
    assert decode(encode(text)) == text
    assert all(0 <= t < 256 for t in encode(text))
    assert decode([*encode("ab"), EOS_ID, *encode("c")]) == "abc"
    assert decode([0xFF]) == "\ufffd"


@pytest.mark.parametrize(
    "bad",
    [
        {"n_heads": 3},
        {"kv_dtype": torch.int8},
        {"attention": "gqa"},
        {"page_size": 0},
        {"vocab_size": 256},
        {"seed": -1},
        {"d_model": 64.0},
        {"n_layers": True},
    ],
)
def test_config_rejects_inconsistent_shapes(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ToyConfig(**bad)  # type: ignore[arg-type]


def test_config_is_frozen() -> None:
    cfg = ToyConfig()
    with pytest.raises(AttributeError):
        cfg.page_size = 32  # type: ignore[misc]


def test_same_seed_same_weights_across_processes() -> None:
    # 600 tokens: long enough that torch splits some reductions over threads when it can.
    prompt = PROMPT * 3
    code = (
        "import sys, torch; torch.set_num_threads(1)\n"
        "from pdxfer.serving.toy import ToyConfig, ToyModel\n"
        "m = ToyModel(ToyConfig(seed=7))\n"
        f"print(m.weights_digest()); print(m.generate({prompt!r}, 6))\n"
    )
    # the other process computes while this one does (it uses one core of two)
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    here = ToyModel(ToyConfig(seed=7))
    # One thread there, two here: the tokens must not depend on the thread count.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        mine = str(here.generate(prompt, 6))
    finally:
        torch.set_num_threads(threads)
        out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    digest, tokens = out.split("\n")[:2]
    assert here.weights_digest() == digest
    assert mine == tokens
    assert ToyModel(ToyConfig(seed=8)).weights_digest() != digest


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunking_does_not_change_tokens(variant: str) -> None:
    m = model(variant)
    pages = list(range(m.pages_for(len(PROMPT) + N_NEW)))
    seen = set()
    for chunk in (None, 1, 16, 23, 64):
        kv = m.new_kv_pool(len(pages))
        tokens = run(m, kv, pages, chunk)
        assert tuple(tokens) == reference(variant), f"chunk_size={chunk}"
        seen.add(tuple(logical_kv(kv, pages, len(PROMPT) + N_NEW - 1)))
    assert len(seen) == 1, "KV bytes differ between chunkings"


@pytest.mark.parametrize("variant", ["mha-fp16", "mla-fp16"])
def test_page_placement_does_not_change_tokens(variant: str) -> None:
    m = model(variant)
    n = m.pages_for(len(PROMPT) + N_NEW)
    rng = np.random.default_rng(0)
    tables = [list(range(n)), list(range(n))[::-1], rng.permutation(3 * n)[:n].tolist()]
    expected = None
    for table in tables:
        kv = garbage_pool(m, 3 * n)
        tokens = run(m, kv, table, 32)
        assert tuple(tokens) == reference(variant), f"page table {table}"
        # ... and the KV sits in the pages the table names, where a transfer will look for it.
        got = logical_kv(kv, table, len(PROMPT) + N_NEW - 1)
        assert expected is None or got == expected, f"page table {table}"
        expected = got


@pytest.mark.parametrize("prefix_len", [96, 101])
@pytest.mark.parametrize("variant", ["mha-fp16", "mla-fp16"])
def test_copied_prefix_pages_give_identical_tokens(variant: str, prefix_len: int) -> None:
    m = model(variant)
    n_pages = m.pages_for(len(PROMPT) + N_NEW)
    src_kv, src_table = m.new_kv_pool(n_pages), list(range(n_pages))
    m.prefill(PROMPT[:prefix_len], src_table, src_kv, chunk_size=64)
    copied = m.pages_for(prefix_len)

    def continue_on_copy(corrupt: bool) -> list[int]:
        dst_kv = garbage_pool(m, 2 * n_pages)
        dst_table = [2 * n_pages - 1 - 2 * i for i in range(n_pages)]
        sent = [i for i in range(copied) if not (corrupt and i == 1)]
        copy_pages(src_kv, [src_table[i] for i in sent], dst_kv, [dst_table[i] for i in sent])
        out = [m.prefill(PROMPT, dst_table, dst_kv, start=prefix_len, chunk_size=32)]
        while len(out) < N_NEW:
            out.append(m.decode_step(out[-1], len(PROMPT) + len(out) - 1, dst_table, dst_kv))
        return out

    assert tuple(continue_on_copy(corrupt=False)) == reference(variant)
    # Control: the prefix really is read from the pages, so one page that never arrived shows.
    assert tuple(continue_on_copy(corrupt=True)) != reference(variant)


def test_on_chunk_fires_once_the_chunk_is_in_the_pages() -> None:
    m = model("mha-fp16")
    kv = m.new_kv_pool(m.pages_for(len(PROMPT)))
    table = list(range(kv.num_pages))
    snapshots: list[tuple[int, int, list[bytes]]] = []

    def on_chunk(a: int, b: int) -> None:
        snapshots.append((a, b, [x[a:b] for x in logical_kv_tokens(kv, table, b)]))

    first = m.prefill(PROMPT, table, kv, start=0, chunk_size=64, on_chunk=on_chunk)
    assert first == reference("mha-fp16")[0]
    assert [(a, b) for a, b, _ in snapshots] == [(0, 64), (64, 128), (128, 192), (192, 200)]
    final = logical_kv_tokens(kv, table, len(PROMPT))
    for a, b, snap in snapshots:
        assert snap == [x[a:b] for x in final], f"chunk [{a}, {b}) not in pages at callback"


def test_mla_variant_generates_deterministically() -> None:
    a, b = ToyModel(ToyConfig(attention="mla")), ToyModel(ToyConfig(attention="mla"))
    assert a.weights_digest() == b.weights_digest()
    kv = a.new_kv_pool(20)
    assert len(kv.tensors) == a.config.n_layers
    assert all(t.shape == (20, 16, a.config.kv_lora_rank) for t in kv.tensors)
    out_a, out_b = a.generate(PROMPT, N_NEW), b.generate(PROMPT, N_NEW, chunk_size=48)
    assert out_a == out_b == list(reference("mla-fp16"))
    assert out_a != list(reference("mha-fp16"))


def test_pool_lists_all_k_layers_then_all_v_layers() -> None:
    m = model("mha-fp16")
    kv = m.new_kv_pool(8)
    n = m.config.n_layers
    assert len(kv.tensors) == 2 * n
    assert all(t.shape == (8, 16, 2, 16) and t.dtype == torch.float16 for t in kv.tensors)
    assert kv.k_tensors == kv.tensors[:n] and kv.v_tensors == kv.tensors[n:]
    assert all(kv.layer(i) == (kv.tensors[i], kv.tensors[n + i]) for i in range(n))
    assert kv.page_nbytes == 2 * n * 16 * 2 * 16 * 2
    with pytest.raises(AttributeError):
        _ = kv.latent_tensors


def test_allocator_refuses_when_full() -> None:
    alloc = PageAllocator(8)
    first = alloc.alloc(5)
    with pytest.raises(OutOfPagesError, match="requested 4 pages but only 3 of 8"):
        alloc.alloc(4)
    assert alloc.num_free == 3  # a refused request takes nothing
    rest = alloc.alloc(3)
    assert sorted(first + rest) == list(range(8))
    with pytest.raises(OutOfPagesError):
        alloc.alloc(1)
    alloc.free(first[:2])
    assert sorted(alloc.alloc(2)) == sorted(first[:2])
    with pytest.raises(ValueError, match="double free"):
        alloc.free([rest[0], rest[0]])
    with pytest.raises(ValueError, match="out of range"):
        alloc.free([8])


def test_allocator_never_hands_out_a_page_twice_across_threads() -> None:
    alloc = PageAllocator(64)
    holders = np.zeros(64, dtype=np.int64)
    book = threading.Lock()
    clashes: list[int] = []

    def worker() -> None:
        for _ in range(400):
            try:
                ids = alloc.alloc(5)
            except OutOfPagesError:
                continue
            with book:
                holders[ids] += 1
                clashes.extend(i for i in ids if holders[i] > 1)
            with book:
                holders[ids] -= 1
            alloc.free(ids)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often enough to expose a missing lock
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not clashes, f"pages handed out twice: {sorted(set(clashes))}"
    assert alloc.num_free == 64


def spec_pools(
    target: ToyModel, draft: ToyModel, n_new: int, k: int
) -> tuple[KVPool, KVPool, list[int]]:
    n = target.pages_for(len(PROMPT) + n_new + k)
    kv = target.new_kv_pool(3 * n)
    draft_kv = draft.new_kv_pool(kv.num_pages, allocator=kv.allocator)
    kv.allocator.alloc(n)  # the request's pages are not the first ones
    return kv, draft_kv, kv.allocator.alloc(n)


@pytest.mark.parametrize("variant", ["mha-fp16", "mla-fp16"])
def test_speculative_matches_greedy_and_accepts_long_runs(variant: str) -> None:
    target = model(variant)
    draft = make_draft(target)
    assert draft.config.n_layers < target.config.n_layers
    res = speculative_generate(target, draft, PROMPT, 48, k=4, chunk_size=64)
    assert tuple(res.tokens) == reference(variant, 48)
    assert res.mean_accept_length >= 2.0, res.accepted
    assert all(0 <= a <= 4 for a in res.accepted)


@pytest.mark.parametrize("variant", ["mha-fp16", "mla-fp16"])
def test_draft_equal_to_target_has_every_proposal_accepted(variant: str) -> None:
    """A full-depth draft computes the target's exact KV bytes in its own pool, so any slip in
    which draft positions hold valid KV shows up as a rejected proposal."""
    target = model(variant)
    twin = make_draft(target, n_layers=target.config.n_layers)
    res = speculative_generate(target, twin, PROMPT, 30, k=3, chunk_size=50)
    assert tuple(res.tokens) == reference(variant, 30)
    assert res.accepted == [3] * 8, res.accepted


@pytest.mark.parametrize("corruption", ["zero", "noise"])
@pytest.mark.parametrize("variant", ["mha-fp16", "mla-fp16"])
def test_corrupt_draft_kv_drops_accept_length(variant: str, corruption: str) -> None:
    target = model(variant)
    draft = make_draft(target)

    def decode_side(corrupt: bool) -> SpecResult:
        # Prefill side fills target and draft pools; the decode side gets byte copies at
        # different page ids, except that the draft's copy may be damaged in flight.
        kv, dkv, table = spec_pools(target, draft, 48, 4)
        first = target.prefill(PROMPT, table, kv, chunk_size=64)
        draft.prefill(PROMPT, table, dkv, chunk_size=64)
        assert all(t[table].abs().sum() > 0 for t in dkv.tensors), "draft prefill wrote no KV"
        rkv, rdkv, rtable = spec_pools(target, draft, 48, 4)
        rtable = rtable[::-1]
        n = target.pages_for(len(PROMPT))
        copy_pages(kv, table[:n], rkv, rtable[:n])
        copy_pages(dkv, table[:n], rdkv, rtable[:n])
        if corrupt:
            g = torch.Generator().manual_seed(5)
            for t in rdkv.tensors:
                noise = torch.randn(t[rtable[:n]].shape, generator=g).to(t.dtype)
                t[rtable[:n]] = torch.zeros_like(noise) if corruption == "zero" else noise
        return speculative_generate(
            target,
            draft,
            PROMPT,
            48,
            k=4,
            kv=rkv,
            draft_kv=rdkv,
            page_table=rtable,
            first_token=first,
        )

    intact, damaged = decode_side(corrupt=False), decode_side(corrupt=True)
    fresh = speculative_generate(target, draft, PROMPT, 48, k=4)
    assert intact.accepted == fresh.accepted  # transferred draft KV is as good as local
    assert tuple(intact.tokens) == tuple(damaged.tokens) == reference(variant, 48)
    assert damaged.mean_accept_length < 0.5 * intact.mean_accept_length, (
        intact.accepted,
        damaged.accepted,
    )


def test_draft_pool_is_separate_but_indexed_by_the_same_pages() -> None:
    target = model("mha-fp16")
    draft = make_draft(target)
    kv, dkv, table = spec_pools(target, draft, 8, 4)
    assert dkv.allocator is kv.allocator and dkv.num_pages == kv.num_pages
    assert len(dkv.tensors) == 2 * draft.config.n_layers
    ptrs = {t.data_ptr() for t in kv.tensors}
    assert not ptrs & {t.data_ptr() for t in dkv.tensors}
    before = [as_bytes(t) for t in kv.tensors]
    draft.prefill(PROMPT, table, dkv)
    assert [as_bytes(t) for t in kv.tensors] == before, "draft wrote into the target pool"


def test_generate_computes_each_position_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """What keeps the toy model cheap enough for the suite, counted rather than timed (a
    stopwatch fails on a loaded machine and proves nothing on a fast one): the prompt runs
    once, then each decode step runs one token on the KV already in the pages, never the
    prefix again."""
    m = ToyModel(ToyConfig(seed=3))
    ran: list[tuple[int, int]] = []
    forward = m.forward

    def counted(tokens: list[int], start: int, *a: object, **kw: object) -> torch.Tensor:
        ran.append((start, len(tokens)))
        return forward(tokens, start, *a, **kw)

    monkeypatch.setattr(m, "forward", counted)
    out = m.generate(PROMPT, 33)  # prefill of 200 tokens + 32 decode steps
    assert len(out) == 33
    assert ran == [(0, len(PROMPT))] + [(len(PROMPT) + i, 1) for i in range(32)]


def test_misuse_is_rejected_with_a_clear_error() -> None:
    m = model("mha-fp16")
    kv = m.new_kv_pool(4)
    with pytest.raises(ValueError, match="cannot hold"):
        m.prefill(PROMPT, [0, 1, 2, 3], kv)
    with pytest.raises(ValueError, match="start"):
        m.prefill(PROMPT[:10], [0], kv, start=10)
    with pytest.raises(ValueError, match="outside pool"):
        m.prefill(PROMPT[:10], [7], kv)
    with pytest.raises(ValueError, match="does not fit"):
        m.prefill(PROMPT[:10], [0], model("mla-fp16").new_kv_pool(4))
    with pytest.raises(ValueError, match="tokens in"):
        m.decode_step(300, 0, [0], kv)
    with pytest.raises(ValueError, match="first_token"):
        speculative_generate(m, make_draft(m), PROMPT, 4, first_token=1)
