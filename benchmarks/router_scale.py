"""The router at fleet scale, by simulation: KV index and choice, and 1,000 bootstrap ranks."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import time
from typing import Any

import aiohttp
import numpy as np

from benchmarks.common.runner import log
from pdxfer import BootstrapClient
from pdxfer.bootstrap import Registration
from pdxfer.serving.kv_events import BlockRemoved, BlockStored, encode_batch, parse_frame
from pdxfer.serving.procs import Proc
from pdxfer.serving.router.backends import Prefill
from pdxfer.serving.router.kv_feed import FeedSpec, FeedState, KvFeeds
from pdxfer.serving.router.kv_policy import choose, pending_tokens

BS = 16
SYS_BLOCKS = 8
CONV_BLOCKS = 24
EVENTS_PER_BATCH = 16
VOCAB = 32000


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def simulate(workers: int, blocks: int, requests: int, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    names = [f"http://w{i}:8000" for i in range(workers)]
    # sized as a router is told its fleet's KV cache blocks (--kv-index-blocks)
    feeds = KvFeeds([FeedSpec(n, "tcp://127.0.0.1:1") for n in names], index_blocks=blocks)
    states: dict[str, FeedState] = feeds.feeds
    seqs = dict.fromkeys(names, 0)
    sys_tokens = rng.integers(0, VOCAB, SYS_BLOCKS * BS).tolist()
    sys_hashes = [int(x) for x in rng.integers(1, 1 << 62, SYS_BLOCKS)]
    tails: dict[str, list[list[int]]] = {n: [] for n in names}  # each conversation's last
    # four block hashes (what an eviction removes)
    sample: list[tuple[str, list[int]]] = []
    pending: dict[str, list[Any]] = {
        n: [BlockStored(sys_hashes, None, sys_tokens, BS, medium="GPU")] for n in names
    }
    ingest_s = ingest_cpu_s = 0.0
    frames = 0
    total = 0

    def flush(force: bool) -> list[tuple[str, list[bytes]]]:
        out = []
        for n, evs in pending.items():
            if evs and (force or len(evs) >= EVENTS_PER_BATCH):
                out.append((n, [b"", seqs[n].to_bytes(8, "big"), encode_batch(evs)]))
                seqs[n] += 1
                pending[n] = []
        return out

    while total < blocks:
        for n in names:  # a round: one new conversation per worker
            toks = rng.integers(0, VOCAB, CONV_BLOCKS * BS).tolist()
            hashes = [int(x) for x in rng.integers(1, 1 << 62, CONV_BLOCKS)]
            ev = BlockStored(hashes, sys_hashes[-1], toks, BS, medium="GPU")
            pending[n].append(ev)
            tails[n].append(hashes[-4:])
            if rng.random() < 0.1:  # also on a second worker
                other = names[int(rng.integers(workers))]
                pending[other].append(ev)
            if rng.random() < 0.05 and len(tails[n]) > 1:  # an eviction of an older tail
                old = tails[n][int(rng.integers(len(tails[n]) - 1))]
                pending[n].append(BlockRemoved(old, medium="GPU"))
            if len(sample) < requests and rng.random() < 0.2:
                sample.append((n, sys_tokens + toks))
        batch = flush(force=False)
        t0, c0 = time.perf_counter(), time.thread_time()
        burst = []
        for n, parts in batch:
            seq, b = parse_frame(parts, raw=True)
            assert b is not None
            burst.append((states[n], seq, b))
        assert not feeds.on_frames(burst)
        ingest_s += time.perf_counter() - t0
        ingest_cpu_s += time.thread_time() - c0
        frames += len(batch)
        total = sum(len(ix) for ix in feeds.indexes.values())
    block_events = sum(states[n].counters["blocks"] for n in names)
    ix = feeds.indexes[BS]
    assert sum(st.counters["gaps"] for st in states.values()) == 0

    pool = [Prefill(n, "127.0.0.1:1") for n in names]
    for p in pool:
        p.outstanding = int(rng.integers(0, 4))
        p.pending = p.outstanding * CONV_BLOCKS * BS // 2  # prompt tokens still to compute
    lat, cpu = [], []
    hits = 0
    follow = 0
    for i in range(requests):
        if i % 2 == 0 and sample:
            owner, toks = sample[int(rng.integers(len(sample)))]
            ids = toks + rng.integers(0, VOCAB, 8 * BS + 5).tolist()
            follow += 1
        else:
            owner, ids = "", sys_tokens + rng.integers(0, VOCAB, CONV_BLOCKS * BS).tolist()
        t0, c0 = time.perf_counter(), time.thread_time()
        _, held = choose(pool, feeds.cached_groups(ids), len(ids), pending_tokens)
        lat.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        hits += owner != "" and held > SYS_BLOCKS * BS
    a, ac = np.asarray(lat) * 1000, np.asarray(cpu) * 1000
    return {
        "workers": workers,
        "indexed_blocks": len(ix),
        "unique_blocks": ix.holders.live,
        "shared_blocks": ix.shared(),
        "frames": frames,
        "events_per_s": block_events / ingest_s,
        "frames_per_s": frames / ingest_s,
        "events_per_cpu_s": block_events / ingest_cpu_s,
        "ingest_s": ingest_s,
        "bytes_per_block": ix.nbytes() / max(len(ix), 1),
        "decision_p50_ms": float(np.percentile(a, 50)),
        "decision_p99_ms": float(np.percentile(a, 99)),
        "decision_max_ms": float(a.max()),
        "requests": requests,
        "decision_cpu_p50_ms": float(np.percentile(ac, 50)),
        "decision_cpu_p99_ms": float(np.percentile(ac, 99)),
        "followups_routed_to_a_holder": hits / max(follow, 1),
        "rss_peak_mb": _rss_mb(),
    }


async def _lookups(addr: str, instances: int, n: int, conc: int) -> list[float]:
    lat: list[float] = []
    left = iter(range(n))

    async def client(s: aiohttp.ClientSession) -> None:
        for i in left:
            t0 = time.perf_counter()
            async with s.get(
                f"http://{addr}/route", params={"room": str(i), "instance": f"inst{i % instances}"}
            ) as r:
                body = await r.json()
                assert r.status == 200 and len(body["endpoints"]) == 8, body
            lat.append(time.perf_counter() - t0)

    conn = aiohttp.TCPConnector(limit=conc)
    async with aiohttp.ClientSession(connector=conn) as s:
        await asyncio.gather(*(client(s) for _ in range(conc)))
    return lat


def bootstrap_bench(ranks: int, lookups: int, conc: int) -> dict[str, Any]:
    proc = Proc("bootstrap", ["bootstrap", "--port", "0"])
    addr = proc.url.removeprefix("http://")
    try:
        tp = 8
        instances = ranks // tp
        cli = BootstrapClient(addr, retries=2)
        t0 = time.perf_counter()
        for i in range(instances):
            for r in range(tp):
                cli.register(
                    Registration(
                        f"inst{i}",
                        f"ep-{i}-{r}",
                        f"10.0.{i % 250}.{r}:9000",
                        f"s{i}",
                        "sig",
                        tp_rank=r,
                        tp_size=tp,
                    )
                )
        reg_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        lat = asyncio.run(_lookups(addr, instances, lookups, conc))
        wall = time.perf_counter() - t0
    finally:
        proc.stop()
    a = np.asarray(lat) * 1000
    return {
        "bootstrap_ranks": instances * tp,
        "bootstrap_registrations_per_s": instances * tp / reg_s,
        "bootstrap_lookups": len(lat),
        "bootstrap_clients": conc,
        "bootstrap_lookups_per_s": len(lat) / wall,
        "bootstrap_lookup_p50_ms": float(np.percentile(a, 50)),
        "bootstrap_lookup_p99_ms": float(np.percentile(a, 99)),
    }


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--blocks",
        type=int,
        default=None,
        help="indexed (worker, block) pairs per fleet (default 10M; --quick 20k)",
    )
    ap.add_argument(
        "--workers",
        default=None,
        help="fleet sizes, comma separated (default 10,100,1000; --quick 10,100)",
    )


def main(a: argparse.Namespace) -> dict[str, Any]:
    blocks = a.blocks or (20_000 if a.quick else 10_000_000)
    fleets = [int(x) for x in (a.workers or ("10,100" if a.quick else "10,100,1000")).split(",")]
    requests = 300 if a.quick else 5000
    out: dict[str, Any] = {
        "router_scale.block_size": BS,
        "router_scale.target_blocks": blocks,
        "router_scale.load_1m": os.getloadavg()[0],
    }
    last: dict[str, Any] = {}
    for w in fleets:
        last = simulate(w, blocks, requests)
        out.update({f"router_scale.w{w}.{k}": v for k, v in last.items()})
        log(
            "router_scale",
            json.dumps({k: v for k, v in out.items() if k.startswith(f"router_scale.w{w}.")}),
        )
    for k in (
        "decision_p50_ms",
        "decision_p99_ms",
        "bytes_per_block",
        "events_per_s",
        "decision_cpu_p99_ms",
        "events_per_cpu_s",
        "workers",
        "indexed_blocks",
    ):
        out[f"router_scale.{k}"] = last[k]
    b = bootstrap_bench(1000, 2000 if a.quick else 20000, 8)
    out.update({f"router_scale.{k}": v for k, v in b.items()})
    out["router_scale.load_1m_end"] = os.getloadavg()[0]
    return out


if __name__ == "__main__":
    from benchmarks.common import runner

    sys.exit(runner.run(sys.modules[__name__]))
