"""The router's KV event feeds over real ZMQ: in-order batches reach the index; a gap is
filled from the replay endpoint, else the worker's entries are cleared (never a superset of
what it holds); a restart clears; hostile frames are dropped before decoding."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import pytest
import zmq

from pdxfer.serving.kv_events import (
    MAX_PAYLOAD,
    BadFrame,
    BlockRemoved,
    BlockStored,
    EventPublisher,
    KVEventBatch,
    parse_frame,
)
from pdxfer.serving.router.kv_feed import FeedSpec, KvFeeds

BS = 4
W = "http://127.0.0.1:1"


def _stored(ids: list[int], base: int, parent: int | None = None) -> BlockStored:
    n = len(ids) // BS
    return BlockStored(list(range(base, base + n)), parent, ids, BS, medium="GPU")


async def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > end:
            raise AssertionError(f"condition not reached: {cond.__code__.co_consts}")
        await asyncio.sleep(0.02)


async def _joined(feeds: KvFeeds, pub: EventPublisher) -> None:
    """Publish empty batches until the SUB socket sees one (ZMQ's slow joiner)."""
    f = feeds.feeds[W]
    for _ in range(200):
        pub.publish([])
        await asyncio.sleep(0.02)
        if f.counters["batches"]:
            return
    raise AssertionError("the feed never joined")


def _run(replay: bool, body: Callable[[KvFeeds, EventPublisher], object]) -> None:
    async def main() -> None:
        pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0" if replay else None)
        feeds = KvFeeds([FeedSpec(W, pub.endpoint, pub.replay_endpoint)])
        feeds.start()
        try:
            await _joined(feeds, pub)
            await body(feeds, pub)  # type: ignore[misc]
        finally:
            await feeds.stop()
            pub.close()

    asyncio.run(main())


A, B = list(range(100, 116)), list(range(200, 216))


def test_a_gap_is_filled_from_the_replay_endpoint() -> None:
    async def body(feeds: KvFeeds, pub: EventPublisher) -> None:
        f = feeds.feeds[W]
        replayed = f.counters["replayed"]  # joining late may have replayed already
        pub.publish([_stored(A, 10)])
        pub.publish([_stored(B, 20)], skip=True)  # lost on the way
        pub.publish([_stored(A + B, 30)])
        await _until(lambda: feeds.cached(A + B).get(W) == 32)
        assert feeds.cached(B) == {W: 16} and f.counters["gaps"] == 1
        assert f.counters["replayed"] == replayed + 1
        assert f.counters["resets"] == 0 and feeds.synced(W)

    _run(True, body)


def test_a_gap_without_replay_clears_what_the_worker_may_have_lost() -> None:
    async def body(feeds: KvFeeds, pub: EventPublisher) -> None:
        pub.publish([_stored(A, 10)])
        await _until(lambda: feeds.cached(A) == {W: 16})
        pub.publish([BlockRemoved([10, 11, 12, 13])], skip=True)  # lost: A is gone
        pub.publish([_stored(B, 20)])
        f = feeds.feeds[W]
        await _until(lambda: feeds.cached(B) == {W: 16})
        assert feeds.cached(A) == {} and f.counters["gaps"] == 1 and f.counters["resets"] == 1

    _run(False, body)


def test_a_worker_whose_sequence_restarts_is_cleared() -> None:
    async def body(feeds: KvFeeds, pub: EventPublisher) -> None:
        pub.publish([_stored(A, 10)])
        await _until(lambda: feeds.cached(A) == {W: 16})
        with pub._lock:  # the worker restarts: numbering begins again
            pub._seq = 0
        pub.publish([_stored(B, 20)])
        await _until(lambda: feeds.cached(B) == {W: 16})
        assert feeds.cached(A) == {} and feeds.feeds[W].counters["resets"] == 1

    _run(True, body)


def test_bad_frames_are_dropped_and_counted() -> None:
    async def body(feeds: KvFeeds, pub: EventPublisher) -> None:
        with pub._lock:
            pub._pub.send_multipart((b"", (5).to_bytes(8, "big"), b"\x93garbage"))
            pub._pub.send_multipart((b"", b"\x00"))
        pub.publish([_stored(A, 10)])
        f = feeds.feeds[W]
        await _until(lambda: f.counters["bad_frames"] == 2 and feeds.cached(A) == {W: 16})

    _run(True, body)


def test_parse_frame_bounds_parts_before_decoding() -> None:
    ok = msgspec.msgpack.encode([1.0, []])
    assert parse_frame([b"", (1).to_bytes(8, "big"), ok])[0] == 1
    for parts in (
        [b"", (1).to_bytes(8, "big"), b"\x00" * (MAX_PAYLOAD + 1)],
        [b"x" * 300, (1).to_bytes(8, "big"), ok],
        [b"", b"\x01", ok],
        [b"", (1).to_bytes(8, "big")],
        [
            b"",
            (1).to_bytes(8, "big"),
            msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": ["x"]}]]),
        ],
        [
            b"",
            (1).to_bytes(8, "big"),
            msgspec.msgpack.encode(  # a token id past int64
                [
                    1.0,
                    [
                        {
                            "type": "BlockStored",
                            "block_hashes": [1],
                            "parent_block_hash": None,
                            "token_ids": [(1 << 64) - 1],
                            "block_size": 1,
                        }
                    ],
                ]
            ),
        ],
    ):
        with pytest.raises(BadFrame):
            parse_frame(parts)


def test_kv_events_flags_are_checked_at_start() -> None:
    from pdxfer.cli import build_parser
    from pdxfer.serving.router.app import run

    s = FeedSpec.parse("http://h:1/=tcp://h:5557,tcp://h:5558")
    assert (s.worker, s.endpoint, s.replay) == ("http://h:1", "tcp://h:5557", "tcp://h:5558")
    assert FeedSpec.parse("http://h:1=tcp://h:5557").replay is None
    for bad in (
        "http://h:1",
        "h:1=tcp://h:1",
        "http://h:1=udp://h:1",
        "http://h:1=tcp://a:1,tcp://b:2,tcp://c:3",
    ):
        with pytest.raises(ValueError):
            FeedSpec.parse(bad)
    a = build_parser().parse_args(
        [
            "router",
            "--prefill",
            "http://127.0.0.1:1,127.0.0.1:2",
            "--decode",
            "http://127.0.0.1:3",
            "--kv-events",
            "http://127.0.0.1:9=tcp://127.0.0.1:5557",
        ]
    )
    with pytest.raises(ValueError, match="not a --prefill or --decode"):
        run(a)


def test_a_replay_that_stops_short_of_the_live_frame_clears_the_worker() -> None:
    """Frames 1-2 replayed for a gap before live frame 4: frame 3 is still missing, so what
    the worker holds is unknown and its entries go (never a superset of what it holds)."""
    feeds = KvFeeds([FeedSpec(W, "tcp://127.0.0.1:1")])
    f = feeds.feeds[W]
    a, b, c = list(range(100, 104)), list(range(200, 204)), list(range(300, 304))
    assert feeds.on_frame(f, 0, KVEventBatch(0.0, [_stored(a, 10)])) == "apply"
    assert feeds.on_frame(f, 4, KVEventBatch(0.0, [_stored(c, 30)])) == "gap"
    feeds.fill(
        f,
        [(1, KVEventBatch(0.0, [_stored(b, 20)])), (2, KVEventBatch(0.0, []))],
        4,
        KVEventBatch(0.0, [_stored(c, 30)]),
    )
    assert f.counters["resets"] == 1 and f.counters["replayed"] == 0
    assert feeds.cached(a) == {} and feeds.cached(b) == {} and feeds.cached(c) == {W: 4}
    assert f.synced and f.next_seq == 5


def _consecutive() -> tuple[EventPublisher, EventPublisher]:
    """Publishers on two consecutive ports: vLLM's DP ranks 0 and 1 of one endpoint."""
    for _ in range(50):
        a = EventPublisher("tcp://127.0.0.1:0")
        port = int(a.endpoint.rsplit(":", 1)[1])
        try:
            return a, EventPublisher(f"tcp://127.0.0.1:{port + 1}")
        except zmq.ZMQError:
            a.close()
    raise AssertionError("no two consecutive free ports")


def test_each_data_parallel_rank_publishes_at_its_offset_port() -> None:
    spec = FeedSpec(W, "tcp://h:5557", "tcp://h:5600")
    assert spec.rank(0) == FeedSpec(f"{W}#dp0", "tcp://h:5557", "tcp://h:5600")
    assert spec.rank(3) == FeedSpec(f"{W}#dp3", "tcp://h:5560", "tcp://h:5603")
    assert FeedSpec(W, "ipc:///tmp/ev").rank(1).endpoint == "ipc:///tmp/ev_dp1"


def test_a_worker_found_to_run_data_parallel_ranks_gets_one_feed_per_rank() -> None:
    dp0, dp1 = f"{W}#dp0", f"{W}#dp1"

    async def main() -> None:
        pubs = _consecutive()
        feeds = KvFeeds([FeedSpec(W, pubs[0].endpoint)])
        feeds.start()
        try:
            feeds.ranks(W, 2)
            assert sorted(feeds.feeds) == [dp0, dp1]
            assert feeds.feeds[dp1].spec.endpoint.endswith(pubs[1].endpoint.rsplit(":", 1)[1])
            for _ in range(200):  # both subscriptions joined (ZMQ's slow joiner)
                for p in pubs:
                    p.publish([])
                await asyncio.sleep(0.02)
                if feeds.synced(dp0) and feeds.synced(dp1):
                    break
            pubs[0].publish([_stored(A, 10)])
            pubs[1].publish([_stored(B, 20)])
            await _until(lambda: feeds.cached(A) == {dp0: 16} and feeds.cached(B) == {dp1: 16})
            feeds.ranks(W, 1)  # restarted with one rank: one feed again, the ranks' gone
            assert list(feeds.feeds) == [W] and feeds.cached(A) == feeds.cached(B) == {}
        finally:
            await feeds.stop()
            for p in pubs:
                p.close()

    asyncio.run(main())
