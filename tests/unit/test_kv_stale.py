"""A KV event feed that goes quiet without a gap is caught by what its worker does: a worker
holding less than its events claimed, or whose feed applies no batch after it served a prompt
it had to store blocks for, scores misses; enough of them in a window and the feed is
suspected (history decides, a replay asked for; wrong entries cleared) until it resyncs. Both
legs alike: a stale stream never draws requests somewhere worse than round robin, and a
worker whose events flow is never suspected for what its engine evicted."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from pdxfer.serving.kv_events import BlockRemoved, BlockStored, EventPublisher, KVEventBatch
from pdxfer.serving.router.app import Router
from pdxfer.serving.router.backends import Decode, Prefill
from pdxfer.serving.router.kv_feed import FeedSpec, KvFeeds
from pdxfer.serving.router.kv_stale import StaleLimits

BS = 16
P0, P1 = "http://p0:1", "http://p1:1"
D0, D1 = "http://d0:1", "http://d1:1"
PROMPT = list(range(1000, 1100))  # 6 full blocks
LIMITS = StaleLimits(misses=3, window_s=60.0, tolerance_blocks=1, deadline_s=5.0)
LEGS = {"prefill": (P0, P1, 0, "prefill_reused_tokens"), "decode": (D0, D1, 1, "restored_tokens")}
"""Per leg: its first and second worker, where ``pick`` answers its choice, and the stat in
which a worker reports the prompt tokens it held."""


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _router() -> tuple[Router, KvFeeds, Clock]:
    kv = KvFeeds([FeedSpec(u, "tcp://127.0.0.1:1") for u in (P0, P1, D0, D1)])
    r = Router(
        [Prefill(P0, "127.0.0.1:1"), Prefill(P1, "127.0.0.1:1")],
        [Decode(D0, page_size=BS), Decode(D1, page_size=BS)],
        "kv_aware",
        kv=kv,
        api_keys={},
        stale=LIMITS,
    )
    clock = Clock()
    assert r.stale is not None
    r.stale.clock = clock
    for f in kv.feeds.values():  # every feed in sync, holding nothing
        kv.on_frame(f, 0, KVEventBatch(0.0, []))
    return r, kv, clock


def _holds(kv: KvFeeds, worker: str, blocks: int, base: int = 7) -> None:
    f = kv.feeds[worker]
    ev = BlockStored(list(range(base, base + blocks)), None, PROMPT[: blocks * BS], BS)
    assert kv.on_frame(f, f.next_seq or 0, KVEventBatch(0.0, [ev])) == "apply"


def _serve(r: Router, leg: str, reported: int | None) -> tuple[str, int]:
    """Route the prompt and serve it: the chosen worker of ``leg`` reports ``reported``
    prompt tokens held (None: it reports nothing). Returns the worker and its claim."""
    at, stat = LEGS[leg][2], LEGS[leg][3]
    kv = r.kv
    assert kv is not None
    picked = r.pairing.pick(PROMPT, set(), set())
    marks = [kv.mark(picked[0].key), kv.mark(picked[1].key)]
    stats = {} if reported is None else {stat: reported}
    r.pairing.judge(
        len(PROMPT),
        stats,
        (picked[0].key, picked[2], marks[0]),
        (picked[1].key, picked[3], marks[1]),
    )
    return picked[at].key, picked[2 + at]


def _alternates(r: Router, leg: str) -> None:
    first, second, at, _ = LEGS[leg]
    for w in (*r.prefills, *r.decodes):
        w.used = 0
    for _ in range(3):  # nothing trusted: the two alternate, as round robin would
        picked = [r.pairing.pick(PROMPT, set(), set())[at].url for _ in range(2)]
        assert sorted(picked) == sorted([first, second]), picked


@pytest.mark.parametrize("leg", LEGS)
def test_a_worker_holding_less_than_its_events_claim_gets_its_feed_suspected(leg: str) -> None:
    first, second, at, _ = LEGS[leg]
    r, kv, _ = _router()
    _holds(kv, second, 6)  # what its events said; it has since evicted it all, silently
    for i in range(LIMITS.misses):
        assert kv.synced(second), i
        assert _serve(r, leg, 0) == (second, 96)
    f = kv.feeds[second]
    assert not kv.synced(second) and f.counters["misses"] == 3 and f.counters["stale"] == 1
    assert kv.cached(PROMPT) == {}  # its claims are dropped, not kept for later
    _alternates(r, leg)


@pytest.mark.parametrize("leg", LEGS)
def test_a_block_less_than_claimed_or_an_unreported_count_is_no_miss(leg: str) -> None:
    """One block evicted between choice and arrival (or the last one an engine computes
    again) is legitimate; a worker that reports nothing is no evidence either way."""
    first, second, at, _ = LEGS[leg]
    r, kv, _ = _router()
    _holds(kv, second, 6)
    for _ in range(LIMITS.misses + 2):
        assert _serve(r, leg, 96 - BS) == (second, 96)
        assert _serve(r, leg, None) == (second, 96)
    assert kv.synced(second) and kv.feeds[second].counters["misses"] == 0


@pytest.mark.parametrize("leg", LEGS)
def test_misses_further_apart_than_the_window_do_not_add_up(leg: str) -> None:
    first, second, at, _ = LEGS[leg]
    r, kv, clock = _router()
    _holds(kv, second, 6)
    for _ in range(2 * LIMITS.misses):
        _serve(r, leg, 0)
        clock.t += LIMITS.window_s / 2 + 1  # never three within one window
    assert kv.synced(second) and kv.feeds[second].counters["misses"] == 6


@pytest.mark.parametrize("leg", LEGS)
def test_a_worker_whose_events_never_show_what_it_served_gets_its_feed_suspected(leg: str) -> None:
    """Its feed is in sync (no gap) but silent: each prompt it computed should have shown
    up in its events within the deadline."""
    first, second, at, _ = LEGS[leg]
    r, kv, clock = _router()
    _holds(kv, second, 1)  # what it said before its publisher hung
    for _ in range(LIMITS.misses):
        assert _serve(r, leg, 16) == (second, 16)  # it holds what it claimed: no miss here
        clock.t += LIMITS.deadline_s + 0.1
    r.pairing.pick(PROMPT, set(), set())  # the router looks at what is overdue as it routes
    f = kv.feeds[second]
    assert f.counters["unpublished"] == 3 and f.counters["misses"] == 0
    assert not kv.synced(second) and f.counters["stale"] == 1
    _alternates(r, leg)
    # silent, not wrong: what it said stays, credited again once its next frame comes
    assert kv.on_frame(f, f.next_seq, KVEventBatch(0.0, [])) == "apply"
    picked = r.pairing.pick(PROMPT, set(), set())
    assert kv.synced(second) and (picked[at].url, picked[2 + at]) == (second, 16)


@pytest.mark.parametrize("leg", LEGS)
def test_a_worker_that_evicts_what_it_held_while_its_events_flow_stays_trusted(leg: str) -> None:
    """An engine evicts a chain's blocks as it pleases (vLLM under memory pressure frees the
    blocks of finished requests): the blocks a served prompt stored may be gone, or unfindable
    from the chain's start, by the deadline. Its feed moved, so it is not silent."""
    first, second, at, _ = LEGS[leg]
    r, kv, clock = _router()
    _holds(kv, second, 2)
    f = kv.feeds[second]
    for i in range(LIMITS.misses + 2):
        assert _serve(r, leg, None)[0] == second
        # its events: the served blocks stored, then the chain's first blocks evicted
        kv.on_frame(
            f,
            f.next_seq,
            KVEventBatch(0.0, [BlockStored([100 + i], 8, PROMPT[32:48], BS), BlockRemoved([7, 8])]),
        )
        clock.t += LIMITS.deadline_s + 0.1
        r.pairing.pick(PROMPT, set(), set())
        _holds(kv, second, 2)  # stored again, as the next request computes them
    assert kv.synced(second) and f.counters["unpublished"] == f.counters["stale"] == 0


@pytest.mark.parametrize("leg", LEGS)
def test_a_worker_whose_events_show_what_it_served_in_time_stays_trusted(leg: str) -> None:
    first, second, at, _ = LEGS[leg]
    r, kv, clock = _router()
    _holds(kv, second, 1)
    assert _serve(r, leg, 16) == (second, 16)
    clock.t += LIMITS.deadline_s - 1
    _holds(kv, second, 6)  # its events follow the serve, within the deadline
    clock.t += 2
    r.pairing.pick(PROMPT, set(), set())
    assert kv.synced(second) and kv.feeds[second].counters["unpublished"] == 0


def test_a_claim_from_history_is_never_held_against_the_feed() -> None:
    r, kv, clock = _router()
    kv.feeds[P1].synced = False  # a replay under way: history decided
    for _ in range(LIMITS.misses + 1):
        r.pairing.judge(
            len(PROMPT), {"prefill_reused_tokens": 0}, (P1, 96, None), (D0, 0, kv.mark(D0))
        )
        clock.t += LIMITS.deadline_s + 1
        r.stale.sweep()  # type: ignore[union-attr]
    assert kv.feeds[P1].counters["misses"] == kv.feeds[P1].counters["stale"] == 0


@pytest.mark.parametrize("leg", LEGS)
def test_a_suspected_feed_is_trusted_again_once_it_resyncs(leg: str) -> None:
    first, second, at, _ = LEGS[leg]
    r, kv, _ = _router()
    _holds(kv, second, 6)
    kv.suspect(second, "a test")
    _alternates(r, leg)
    _holds(kv, second, 6)  # its next frame in sequence: in sync again
    assert kv.synced(second)
    picked = r.pairing.pick(PROMPT, set(), set())
    assert (picked[at].url, picked[2 + at]) == (second, 96)


def test_the_stale_counters_show_per_worker_in_the_metrics() -> None:
    r, kv, _ = _router()
    _holds(kv, P1, 6)
    for _ in range(LIMITS.misses):
        _serve(r, "prefill", 0)
    text = asyncio.run(r.h_metrics(None)).text  # type: ignore[arg-type]
    assert f'pdxfer_router_kv_feed_misses_total{{worker="{P1}"}} 3.0' in text
    assert f'pdxfer_router_kv_feed_stale_total{{worker="{P1}"}} 1.0' in text
    assert f'pdxfer_router_kv_feed_stale_total{{worker="{P0}"}} 0.0' in text
    assert f'pdxfer_router_kv_feed_unpublished_total{{worker="{P1}"}} 0.0' in text
    assert "pdxfer_router_kv_events_stale_total 1.0" in text


W = "http://127.0.0.1:1"
A, B = list(range(100, 116)), list(range(200, 216))


def _stored(ids: list[int], base: int) -> BlockStored:
    return BlockStored(list(range(base, base + len(ids) // 4)), None, ids, 4, medium="GPU")


async def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < end, "condition not reached"
        await asyncio.sleep(0.02)


def test_a_suspected_feed_asks_the_replay_for_what_it_missed_and_resyncs() -> None:
    """Over real ZMQ: a batch lost with no frame after it (no gap seen, the stream silent);
    once suspected, the feed's entries are cleared and the replay brings it back in sync,
    holding what the lost batch stored."""

    async def main() -> None:
        pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
        feeds = KvFeeds([FeedSpec(W, pub.endpoint, pub.replay_endpoint)])
        feeds.start()
        f = feeds.feeds[W]
        try:
            for _ in range(200):  # ZMQ's slow joiner
                pub.publish([])
                await asyncio.sleep(0.02)
                if f.counters["batches"]:
                    break
            pub.publish([_stored(A, 10)])
            await _until(lambda: feeds.cached(A) == {W: 16})
            pub.publish([_stored(B, 20)], skip=True)  # lost (never sent), and nothing after it
            assert feeds.cached(B) == {} and feeds.synced(W)  # silence: no gap to see
            replays = f.counters["replays"]
            feeds.suspect(W, "a test")
            assert not feeds.synced(W) and feeds.cached(A) == {}
            await _until(lambda: feeds.synced(W))
            assert f.counters["replays"] == replays + 1
            assert feeds.cached(B) == {W: 16} and feeds.cached(A) == {}
            pub.publish([_stored(A, 30)])  # and the new subscription hears live frames
            await _until(lambda: feeds.cached(A) == {W: 16})
        finally:
            await feeds.stop()
            pub.close()

    asyncio.run(main())


def test_a_vllm_prefills_cached_count_is_read_only_when_well_formed() -> None:
    from pdxfer.serving.router.vllm import _cached_tokens

    assert _cached_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": 64}}}) == 64
    for bad in (
        None,
        [],
        {"usage": None},
        {"usage": {"prompt_tokens_details": None}},
        {"usage": {"prompt_tokens_details": {"cached_tokens": "64"}}},
        {"usage": {"prompt_tokens_details": {"cached_tokens": -1}}},
        {"usage": {"prompt_tokens_details": {"cached_tokens": True}}},
    ):
        assert _cached_tokens(bad) is None, bad


@pytest.mark.parametrize(
    "bad",
    [
        {"misses": 0},
        {"window_s": 0.0},
        {"tolerance_blocks": -1},
        {"deadline_s": 0.0},
        {"deadline_s": 61.0},
    ],
)
def test_stale_limits_that_make_no_sense_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="kv-stale"):
        StaleLimits(**bad)  # type: ignore[arg-type]


def test_the_blocks_awaited_are_bounded_in_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdxfer.serving.router import kv_stale

    monkeypatch.setattr(kv_stale, "MAX_PENDING", 3)
    r, kv, _ = _router()
    _holds(kv, P0, 0)  # the index exists, and holds nothing
    for _ in range(10):
        _serve(r, "prefill", None)  # each leaves a batch awaited per leg
    assert r.stale is not None and len(r.stale._pending) == 3
