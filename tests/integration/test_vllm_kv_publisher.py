"""The router's KV event feed against vLLM's own publisher (``ZmqEventPublisher`` from the
installed package, real ZMQ; no engine): blocks vLLM published before the router joined
come back through vLLM's replay endpoint, and a publisher that restarts (its numbering
begins again) has its worker's entries cleared."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import zmq
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

from pdxfer.netaddr import free_port
from pdxfer.serving.router.kv_feed import FeedSpec, KvFeeds

BS = 16
W = "http://127.0.0.1:8100"


def _stored(ids: list[int], base: int) -> BlockStored:
    n = len(ids) // BS
    return BlockStored(
        block_hashes=list(range(base, base + n)),
        parent_block_hash=None,
        token_ids=ids,
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


async def _until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.05)


def test_a_late_router_replays_what_vllm_published_and_a_restart_clears() -> None:
    pub_port, rep_port = free_port(), free_port()
    a, b = list(range(100, 164)), list(range(500, 548))

    def publisher() -> ZmqEventPublisher:
        for _ in range(100):  # the old one's sockets close in ZMQ's own time
            try:
                return ZmqEventPublisher(
                    0, endpoint=f"tcp://*:{pub_port}", replay_endpoint=f"tcp://*:{rep_port}"
                )
            except zmq.ZMQError:
                time.sleep(0.1)
        raise AssertionError("the ports stayed in use")

    async def main() -> None:
        pub = publisher()
        pub.publish(KVEventBatch(ts=time.time(), events=[_stored(a, 10)]))  # nobody listens
        time.sleep(0.5)
        feeds = KvFeeds([FeedSpec(W, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{rep_port}")])
        feeds.start()
        f = feeds.feeds[W]
        try:
            await asyncio.sleep(0.5)  # the SUB socket joins
            pub.publish(KVEventBatch(ts=time.time(), events=[]))
            await _until(lambda: feeds.cached(a) == {W: 64})
            assert f.counters["replayed"] == 1 and feeds.synced(W)
            pub.shutdown()  # the worker restarts: a new publisher, numbering from 0
            pub = publisher()
            await asyncio.sleep(0.5)
            pub.publish(KVEventBatch(ts=time.time(), events=[_stored(b, 20)]))
            await _until(lambda: feeds.cached(b) == {W: 48})
            assert feeds.cached(a) == {} and f.counters["resets"] == 1
        finally:
            await feeds.stop()
            pub.shutdown()

    asyncio.run(main())
