"""A prefill and a decode moving one request's KV through pdxfer's public API, on host memory.

What an engine with no integration yet does (docs/engine-api.md): hand pdxfer its KV pools
(its own tensors, registered in place) and page indices, then poll. The prefill runs in a child
process, as it would on another GPU or host; KV moves over Mooncake TCP on loopback.

    python examples/engine_api.py     # prints "OK: ... bytes moved, identical"
"""

import multiprocessing as mp
import time

import torch

from pdxfer import BootstrapServer, Endpoint, EndpointConfig, KVPoll, PoolSpec

LAYERS, PAGES, PAGE, HEADS, DIM = 4, 64, 16, 2, 64  # a small model's paged KV cache
ROOM, TOKENS = 12345, 100  # one request: 100 tokens, 7 pages
SRC_PAGES, DST_PAGES = [3, 9, 4, 20, 21, 22, 40], [0, 1, 2, 10, 11, 30, 31]


def kv_pools(fill: float | None) -> tuple[list[PoolSpec], list[torch.Tensor]]:
    """K and V per layer, [pages, page_size, heads, dim] (NHD), and one aux row per request."""
    gen = torch.Generator().manual_seed(0)
    k = [
        torch.rand(PAGES, PAGE, HEADS, DIM, generator=gen)
        if fill is None
        else torch.full((PAGES, PAGE, HEADS, DIM), fill)
        for _ in range(LAYERS)
    ]
    v = [t * 2 for t in k]
    aux = torch.zeros(8, 16, dtype=torch.int32)
    return [PoolSpec.mha("kv", k, v, page_size=PAGE), PoolSpec.slots("aux", [aux])], [*k, *v, aux]


def prefill(bootstrap: str, ready, done) -> None:
    pools, tensors = kv_pools(fill=None)  # the engine computed this KV
    tensors[-1][5] = torch.arange(16, dtype=torch.int32)  # e.g. the first sampled token
    ep = Endpoint(EndpointConfig(role="prefill", bootstrap=bootstrap), pools)
    ready.set()  # registered with the bootstrap server
    tx = ep.sender(ROOM)
    tx.send({"kv": SRC_PAGES[:4]})  # each finished prefill chunk, as it finishes
    tx.send({"kv": SRC_PAGES[4:]}, slots={"aux": 5}, last=True)
    while tx.poll() not in (KVPoll.Success, KVPoll.Failed):
        time.sleep(0.01)  # the engine loop polls
    done.wait(60)  # an engine frees the source pages once tx.holding is False (a repair
    ep.close()  # may still read them); here the process simply lives until the end


def main() -> None:
    server = BootstrapServer("127.0.0.1", 0).start()  # or: pdxfer bootstrap --port 8998
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    child = ctx.Process(target=prefill, args=(server.address, ready, done))
    child.start()
    assert ready.wait(120), "the prefill did not start"
    pools, tensors = kv_pools(fill=0.0)  # the decode's empty cache
    decode = Endpoint(EndpointConfig(role="decode", bootstrap=server.address), pools)  # trusted
    rx = decode.receiver(ROOM, bootstrap=server.address, release=lambda *a: None)
    rx.request({"kv": DST_PAGES}, slots={"aux": 3}, prefix_len=0, num_tokens=TOKENS)
    while rx.poll() not in (KVPoll.Success, KVPoll.Failed):
        time.sleep(0.01)
    assert rx.poll() == KVPoll.Success, rx.failure
    want = kv_pools(fill=None)[1]  # what the prefill sent (same seed)
    for got, src in zip(tensors[:-1], want[:-1]):  # every layer's K and V, token by token
        flat_src = src[SRC_PAGES].reshape(-1, HEADS, DIM)[:TOKENS]
        assert torch.equal(got[DST_PAGES].reshape(-1, HEADS, DIM)[:TOKENS], flat_src)
    assert torch.equal(tensors[-1][3], torch.arange(16, dtype=torch.int32))
    moved = decode.metrics()["bytes"]
    decode.close()
    done.set()
    child.join(30)
    server.stop()
    print(f"OK: {TOKENS} tokens of KV in {LAYERS} layers, {moved} bytes moved, identical")


if __name__ == "__main__":
    main()
