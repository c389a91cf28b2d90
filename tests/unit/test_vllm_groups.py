"""What of each vLLM KV cache group a request moves (``integrations/vllm/groups.py``), and
that a cache dtype mismatch is refused when the two sides pair, naming both."""

from __future__ import annotations

import types
from dataclasses import replace

import pytest

from pdxfer.endpoint.sender import model_diff
from pdxfer.integrations.vllm import groups as G
from pdxfer.integrations.vllm.groups import Group
from pdxfer.integrations.vllm.state import Sub, TensorSplit

FULL = Group(0, "full", 32, ("model.layers.5.self_attn.attn",))
SLIDE = Group(1, "window", 32, ("model.layers.0.self_attn.attn",), window=128)
SLIDE2 = Group(2, "window", 32, ("model.layers.1.self_attn.attn",), window=128)
STATE = Group(3, "state", 4096, ("model.layers.2.mixer",), page_bytes=1 << 16)
CHUNK = Group(1, "chunk", 32, ("model.layers.0.self_attn.attn",), chunk=64)


def test_pools_that_start_at_different_tokens_travel_in_separate_rooms() -> None:
    ps = G.parts([FULL, SLIDE, SLIDE2, STATE])
    assert [(p.key, [g.pool for g in p.groups]) for p in ps] == [
        (0, ["kv", "kv3"]),
        (128, ["kv1", "kv2"]),
    ]
    room = 12345
    assert ps[0].room(room) == room
    other = ps[1].room(room)
    assert other != room and 0 <= other < 1 << 63
    # a bijection per key: distinct requests never share a derived room
    assert len({ps[1].room(r) for r in range(10_000)}) == 10_000


def test_a_model_whose_every_layer_slides_keeps_the_request_room() -> None:
    (p,) = G.parts([Group(0, "window", 32, ("a",), window=128)])
    assert p.room(77) == 77
    (p,) = G.parts([Group(0, "chunk", 32, ("a",), chunk=128)])
    assert p.room(77) == 77


def test_a_chunk_group_travels_in_a_room_of_its_own_apart_from_a_window_of_its_size() -> None:
    win64 = Group(2, "window", 32, ("model.layers.1.self_attn.attn",), window=64)
    ps = G.parts([FULL, CHUNK, win64])
    assert [[g.pool for g in p.groups] for p in ps] == [["kv"], ["kv2"], ["kv1"]]
    assert ps[0].key == 0 and len({p.room(9) for p in ps}) == 3


def test_only_a_single_full_group_streams_and_local_groups_back_off_only_at_block_edges() -> None:
    assert G.streams([FULL]) and not G.streams([FULL, SLIDE]) and not G.streams([SLIDE])
    assert G.backoff([FULL, STATE], 100) == 1 and G.backoff([FULL], 128) == 0
    assert G.backoff([FULL, SLIDE], 100) == 0 and G.backoff([FULL, SLIDE], 160) == 0
    assert G.backoff([FULL, SLIDE], 159) == 1 and G.backoff([SLIDE], 191) == 1
    assert G.backoff([FULL, CHUNK], 100) == 0 and G.backoff([FULL, CHUNK], 128) == 1


def test_the_prefill_never_reads_a_block_vllm_freed() -> None:
    # vLLM replaced the first two blocks (outside the window) by the null block 0, which
    # no request owns
    assert G.source_pages(SLIDE, [0, 0, 7, 9, 4, 11], 150) == [0, 0, 7, 9, 4]


def test_the_decode_asks_from_its_first_real_block_and_refuses_a_hole() -> None:
    assert G.window_start(SLIDE, [0, 0, 0, 5, 6, 8], 0, 190) == 3
    assert G.window_start(SLIDE, [0, 0, 0, 5, 6, 8], 4, 190) == 4  # vLLM cached up to 4
    assert G.window_start(SLIDE, [3, 4, 5], 0, 90) == 0
    assert G.window_start(SLIDE, [0, 5, 0, 6], 0, 128) is None


def _skipped(window: int, computed: int) -> int:
    """vLLM's own rule: tokens a sliding-window group no longer keeps after ``computed``."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    me = types.SimpleNamespace(sliding_window=window, extra_retained_tokens=0)
    return SlidingWindowManager.get_num_skipped_tokens(me, computed)  # type: ignore[arg-type]


@pytest.mark.parametrize("window", [32, 100, 128])
def test_a_streamed_window_block_is_never_freed_and_covers_what_the_decode_holds(
    window: int,
) -> None:
    """While the prefill runs vLLM frees blocks below ``skipped(c) // bs`` for the tokens
    ``c < n`` it computed; the decode holds from ``skipped(n) // bs``. Streamed blocks start
    at ``window_first``: never freed before the request ends, none the decode holds left out."""
    g = Group(1, "window", 32, ("a",), window=window)
    for n in range(1, 700, 7):
        first = G.window_first(g, n)
        freed = max((_skipped(window, c) // 32 for c in range(n)), default=0)
        assert first >= freed, (n, first, freed)
        assert first <= _skipped(window, n) // 32, (n, first)


@pytest.mark.parametrize(("window", "bs"), [(128, 32), (100, 32), (32, 32), (127, 16), (64, 2)])
def test_the_decode_holds_the_window_its_last_prompt_token_attends_to(window: int, bs: int) -> None:
    """For every prompt length ``p``: the decode loads ``n = p - backoff`` tokens and holds
    the blocks from ``skipped(n) // bs`` (vLLM's null block below), then computes token
    ``p - 1``, which attends back to token ``max(0, p - window)``: the decode holds its
    block. A prompt backs off only where the decode holding all of it would not. The prefill,
    which computes every token, streams exactly the blocks the decode holds
    (``window_first``)."""
    g = Group(1, "window", bs, ("a",), window=window)
    for p in range(2, 900):
        n = p - G.backoff([FULL, g], p)
        held = _skipped(window, n) // bs
        assert held <= max(0, p - window) // bs, (p, n, held)
        assert G.backoff([FULL, g], p) == 0 or _skipped(window, p) // bs > max(0, p - window) // bs
        assert G.window_first(g, n) == held, (p, n, held)
        computed = p - G.prefill_backoff([FULL, g], p)  # the prefill computes all of it
        assert computed == p and G.window_first(g, computed) == held, (p, held)
        assert G.skipped(g, n) == _skipped(window, n)


@pytest.mark.parametrize(("bs_p", "bs_d"), [(32, 64), (64, 32), (32, 128)])
def test_with_two_block_sizes_the_prefills_kept_blocks_hold_every_window_token_a_decode_reads(
    bs_p: int, bs_d: int
) -> None:
    """The decode reads a window group's tokens from ``skipped(n)`` on; its first held block
    may start before the prefill's first kept one (larger decode blocks), and the prefill
    fills the rest of it from its null block. Every block it hands for a token the decode
    reads is its own, never freed before the request ends."""
    window = 128
    p = Group(1, "window", bs_p, ("a",), window=window)
    for n in range(1, 900, 11):
        ids = list(range(100, 100 + -(-n // bs_p)))
        first = G.window_first(p, n)
        freed = max((_skipped(window, c) // bs_p for c in range(n)), default=0)
        assert first >= freed  # never freed while the prefill runs
        reads = _skipped(window, n)
        held = reads // bs_d * bs_d  # the decode's first block starts here: it asks from it
        pages = G.stream_pages(p, ids, 0, n, n)
        for t in range(held, n):
            page = pages[t // bs_p]
            assert page >= 0, (n, t)  # every token the decode asks for can be planned
            assert page != G.NULL_BLOCK or t < reads, (n, t)  # and it reads only real ones


def _chunk_skipped(chunk: int, computed: int) -> int:
    """vLLM's own rule: tokens a chunked local attention group no longer keeps."""
    from vllm.v1.core.single_type_kv_cache_manager import ChunkedLocalAttentionManager

    me = types.SimpleNamespace(attention_chunk_size=chunk)
    return ChunkedLocalAttentionManager.get_num_skipped_tokens(me, computed)  # type: ignore[arg-type]


@pytest.mark.parametrize("chunk", [32, 64, 48])
def test_the_decode_holds_the_chunk_its_last_prompt_token_attends_to(chunk: int) -> None:
    """For every prompt length ``p``: the decode loads ``n = p - backoff`` tokens and holds
    the blocks from ``skipped(n) // bs`` (vLLM's null block below), then computes token
    ``p - 1``, which attends to its chunk from ``(p - 1) // chunk * chunk``: the decode holds
    every block of it, and at least one block. The prefill streams exactly the blocks the
    decode holds (``chunk_first``), none that a step of its own frees."""
    g = Group(1, "chunk", 32, ("a",), chunk=chunk)
    for p in range(2, 700):
        n = p - G.backoff([FULL, g], p)
        held = _chunk_skipped(chunk, n) // 32
        assert held * 32 <= (p - 1) // chunk * chunk, (p, n, held)
        assert held < -(-n // 32), (p, n, held)
        assert G.chunk_first(g, n) == held
        freed = max((_chunk_skipped(chunk, c) // 32 for c in range(n)), default=0)
        assert G.chunk_first(g, n) >= freed, (p, n, freed)
        assert G.skipped(g, n) == _chunk_skipped(chunk, n)
        edge = _chunk_skipped(chunk, p) // 32 > (p - 1) // chunk * chunk // 32
        assert G.backoff([FULL, g], p) == int(edge), p  # only where the decode would lose it


def test_a_step_hands_only_chunk_blocks_of_the_last_tokens_chunk() -> None:
    n = 300  # chunk 64: token 299's chunk starts at 256, block 8
    assert G.chunk_first(CHUNK, n) == 8
    ids = [0, 0, 0, 0, 7, 8, 9, 10, 11, 12]  # vLLM freed the chunks before 128 already
    assert G.stream_pages(CHUNK, ids, 0, 224, n) == [-1] * 7
    assert G.stream_pages(CHUNK, ids, 224, 300, n) == [-1, 11, 12]
    assert G.stream_start(G.parts([FULL, CHUNK])[1], n) == 256
    assert G.source_pages(CHUNK, ids, n) == [-1, -1, -1, -1, 7, 8, 9, 10, 11, 12]


def test_a_step_hands_only_window_blocks_no_step_frees() -> None:
    n = 300  # window 128: blocks from (300 - 128) // 32 = 5 on are never freed
    assert G.window_first(SLIDE, n) == 5
    ids = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert G.stream_pages(SLIDE, ids, 0, 224, n) == [0, 0, 0, 0, 0, 8, 9]
    assert G.stream_pages(SLIDE, ids, 224, 300, n) == [10, 11, 12]
    assert G.stream_pages(FULL, ids, 64, 128, n) == [5, 6]
    assert G.stream_start(G.parts([FULL, SLIDE])[1], n) == 160
    assert G.stream_start(G.parts([FULL, SLIDE])[0], n) == 0
    with pytest.raises(ValueError, match="blocks for tokens"):
        G.stream_pages(FULL, ids[:2], 0, 96, n)


@pytest.mark.parametrize(
    ("blocks", "spec", "slot"),
    [([0, 0, 17], 0, 17), ([17], 0, 17), ([0, 17, 30, 31], 2, 17), ([0], 0, None), ([], 0, None)],
)
def test_the_state_block_is_the_running_one(blocks: list[int], spec: int, slot: int | None) -> None:
    assert G.state_block(blocks, spec) == slot


def test_a_cache_dtype_mismatch_names_both_sides() -> None:
    p = "model=m block_size=32 kv_layout=HND dtype=float8_e4m3fn cache_dtype=fp8"
    d = "model=m block_size=32 kv_layout=HND dtype=float32 cache_dtype=auto"
    why = model_diff(p, d)
    assert "cache_dtype: prefill fp8, decode auto" in why
    assert "dtype: prefill float8_e4m3fn, decode float32" in why


def test_tiers_keep_full_groups_only_and_none_of_a_model_whose_every_layer_is_local() -> None:
    assert G.tiered([FULL, SLIDE, SLIDE2, STATE]) == (FULL,)
    assert G.tiered([FULL, STATE]) == (FULL,)
    assert G.tiered([FULL]) == (FULL,)
    assert G.tiered([SLIDE]) == () and G.tiered([STATE]) == ()
    assert G.tiered([FULL, CHUNK]) == (FULL,) and G.tiered([CHUNK]) == ()


def test_a_per_rank_state_that_moves_whole_pairs_only_with_its_own_tp_size() -> None:
    # a state of a kind pdxfer cannot split: each rank's page holds that rank's share, so
    # another TP size is refused at the handshake, naming both, even where vLLM pads both
    # sides' pages to one size
    p, d = (f"model=m groups=kv=state:0:4096{G.whole_state_tp([FULL, STATE], tp)}" for tp in (2, 1))
    assert "state_tp: prefill 2, decode 1" in model_diff(p, d)
    # a state split into pieces, or the same on every rank, pairs at any TP size
    split = replace(STATE, split=(TensorSplit(1, 64, 4, (Sub(4, 1, 8),)),))
    assert G.whole_state_tp([FULL, split], 2) == G.whole_state_tp([FULL, split], 1) == ""
    assert G.whole_state_tp([FULL, replace(STATE, replicated=True)], 2) == ""
    assert G.whole_state_tp([FULL, SLIDE], 2) == ""
