"""The served system under a shared-prefix workload, variants compared in one interleaved run."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from pdxfer.serving.toy.cluster import Cluster

WORKER = ["--bootstrap-timeout", "20", "--transfer-timeout", "60", "--pages", "1024"]
PAGE = 16  # the workers' page size (their default)
BALLAST = 128 << 10
"""Bytes of KV ballast per token in the ``*_128k`` variants: an 8B model with GQA (32 layers
x 8 KV heads x 128 x 2 (K, V) x 2 bytes)."""
# 128 KiB per token makes a page 2 MiB: enough pages for 8 prompts in flight (about 41 pages
# each) and an L2 holding the 16 conversations' histories of a round, and no more: ~7 GB at
# the peak for both ballast clusters together
BALLAST_ARGS = ["--kv-ballast-bytes-per-token", str(BALLAST), "--pages", "384"]


def workload(groups: int, turns: int, seed: int) -> list[list[str]]:
    """``groups`` conversations of ``turns`` prompts; turn t repeats turns 0..t-1."""
    rng = np.random.default_rng(seed)
    words = [
        "kv",
        "cache",
        "page",
        "token",
        "decode",
        "prefill",
        "router",
        "layer",
        "head",
        "room",
        "bootstrap",
        "transfer",
        "prefix",
        "draft",
        "batch",
    ]
    out = []
    for g in range(groups):
        history = (
            f"system: conversation {g} of the benchmark. " + " ".join(rng.choice(words, 60)) + ". "
        )
        convo = []
        for t in range(turns):
            history += f"user {t}: " + " ".join(rng.choice(words, 8)) + "? "
            convo.append(history)
        out.append(convo)
    return out


async def one(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int
) -> dict[str, Any]:
    t0 = time.perf_counter()
    first = last = None
    final: dict[str, Any] = {}
    async with session.post(
        f"{url}/v1/completions",
        json={
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as r:
        if r.status != 200:
            return {"ok": False, "status": r.status}
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            now = time.perf_counter()
            if ev.get("choices") and ev["choices"][0].get("text"):
                first = first or now
                last = now
            if "pdxfer" in ev:
                final = ev["pdxfer"]
    n = len(final.get("token_ids", []))
    t1 = time.perf_counter()
    return {
        "ok": True,
        "ttft": (first or t1) - t0,
        "tpot": ((last - first) / (n - 1)) if first and last and n > 1 else None,
        "wall": t1 - t0,
        "prompt": len(prompt.encode()),
        "sent_at": t0,
        "done_at": t1,
        "ids": prompt.encode(),
        "decode": final.get("decode"),
        "restored": int(final.get("restored_tokens", 0)),
        "tokens": n,
        "prefill_reused": int(final.get("prefill_reused_tokens", 0)),
        **{k: final.get(k) for k in ("kv_wait_s", "kv_local_s", "kv_net_s", "prefill_s")},
    }


async def run_round(
    url: str, convos: list[list[str]], conc: int, max_tokens: int, bar: Any
) -> list[dict[str, Any]]:
    """Turn by turn (a conversation's next turn follows its previous one), conversations in
    parallel, at most ``conc`` requests in flight."""
    sem = asyncio.Semaphore(conc)
    out: list[dict[str, Any]] = []
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as s:

        async def convo(turns: list[str]) -> None:
            for p in turns:
                async with sem:
                    out.append(await one(s, url, p, max_tokens))
                bar()

        await asyncio.gather(*(convo(c) for c in convos))
    return out


def common_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    d = np.flatnonzero(np.frombuffer(a[:n], np.uint8) != np.frombuffer(b[:n], np.uint8))
    return int(d[0]) if d.size else n


def possible(rs: list[dict[str, Any]]) -> list[int]:
    """Per request, the prompt tokens some decode could have restored (module notes): the
    longest page-aligned common prefix with a prompt completed before it was sent."""
    done = sorted((r for r in rs if r["ok"]), key=lambda r: r["done_at"])
    out = []
    for r in rs:
        best = 0
        for q in done:
            if q["done_at"] >= r.get("sent_at", 0.0):
                break
            best = max(best, common_prefix(q["ids"], r.get("ids", b"")))
        # a restore leaves at least the last token to the prefill, and covers whole pages
        out.append(max(0, min(best, len(r.get("ids", b"")) - 1)) // PAGE * PAGE)
    return out


def pct_ms(xs: list[Any], q: float = 50) -> float:
    """The ``q``-th percentile in ms of the seconds in ``xs`` that are not None."""
    xs = [x for x in xs if x is not None]
    return float(np.percentile(xs, q) * 1e3) if xs else float("nan")


def summary(rs: list[dict[str, Any]]) -> dict[str, float]:
    ok = [r for r in rs if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    wall = sum(r["wall"] for r in ok) or 1.0
    could = sum(possible(ok))
    prompt = max(1, sum(r["prompt"] for r in ok))
    wait = [r.get("kv_wait_s") for r in ok]
    return {
        "ttft_p50_ms": pct_ms(ttft),
        "ttft_p99_ms": pct_ms(ttft, 99),
        "tpot_ms": statistics.median(tpot) * 1e3 if tpot else float("nan"),
        "restored_fraction": sum(r["restored"] for r in ok) / prompt,
        "restorable_fraction": could / prompt,
        "prefill_reused_fraction": sum(r["prefill_reused"] for r in ok) / prompt,
        "restored_of_possible": sum(r["restored"] for r in ok) / max(1, could),
        # the decode's wait for the prompt's KV and its parts (restore from L2, network),
        # and the prefill's compute the network part waits on
        "kv_wait_ms_p50": pct_ms(wait),
        "kv_wait_ms_p99": pct_ms(wait, 99),
        "kv_local_ms_p50": pct_ms([r.get("kv_local_s") for r in ok]),
        "kv_net_ms_p50": pct_ms([r.get("kv_net_s") for r in ok]),
        # the prefill's time for the request: waiting for its model (one forward at a
        # time), loading its L2 prefix, computing the rest; and what of the decode's wait
        # that leaves (the last chunk's transfer, the network behind the compute)
        "prefill_ms_p50": pct_ms([r.get("prefill_s") for r in ok]),
        "kv_wait_past_prefill_ms_p50": pct_ms(
            [
                r["kv_wait_s"] - r["prefill_s"]
                for r in ok
                if r.get("kv_wait_s") is not None and r.get("prefill_s") is not None
            ]
        ),
        "ok": len(ok),
        "failed": len(rs) - len(ok),
        "busy_seconds": wall,
    }


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--plot", type=Path, help="PNG of the variants' TTFT and throughput")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight")


def main(a: argparse.Namespace) -> dict[str, Any]:
    # more conversations than requests in flight: in a closed loop with one request in
    # flight per conversation, the slot a turn frees is the one its next turn takes, so any
    # policy would keep a conversation on one decode and routing would show nothing
    groups, turns, rounds, max_tokens = (
        (a.concurrency + 2, 3, 1, 8) if a.quick else (2 * a.concurrency, 4, 2, 16)
    )
    convos = workload(groups, turns, seed=1)
    per_round = groups * turns
    off = ["--l2-pages", "0"]
    specs = {
        "reuse_on": dict(prefills=1, decodes=1),
        "decode_reuse_off": dict(prefills=1, decodes=1, decode_args=off),
        "prefill_reuse_off": dict(prefills=1, decodes=1, prefill_args=off),
        "kv_aware": dict(prefills=1, decodes=2, router_args=["--policy", "kv_aware"]),
        "least_outstanding": dict(
            prefills=1, decodes=2, router_args=["--policy", "least_outstanding"]
        ),
        "reuse_on_128k": dict(
            prefills=1,
            decodes=1,
            worker_args=WORKER + BALLAST_ARGS,
            prefill_args=["--l2-pages", "720"],
            decode_args=["--l2-pages", "720", "--no-l3"],
        ),
        "decode_reuse_off_128k": dict(
            prefills=1,
            decodes=1,
            worker_args=WORKER + BALLAST_ARGS,
            prefill_args=["--l2-pages", "720"],
            decode_args=[*off, "--no-l3"],
        ),
    }
    clusters: dict[str, Cluster] = {}
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in specs}
    total = rounds * per_round * len(specs)
    done = [0]
    t_start = time.perf_counter()
    load_start = (
        Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else ""
    )

    def bar() -> None:
        done[0] += 1
        n = 30 * done[0] // total
        print(
            f"\r[{'#' * n}{'.' * (30 - n)}] {done[0]}/{total}", end="", file=sys.stderr, flush=True
        )

    try:
        for name, kw in specs.items():
            kw = dict(kw)
            router_args = ["--timeout", "120", *kw.pop("router_args", [])]
            kw.setdefault("worker_args", WORKER)
            clusters[name] = Cluster(router_args=router_args, **kw).start()
        for r in range(rounds):
            # fresh conversations every round: caches warm up within a round, as in serving
            round_convos = [[f"[round {r}] " + p for p in c] for c in convos]
            for name, c in clusters.items():
                assert c.router is not None
                results[name] += asyncio.run(
                    run_round(c.router.url, round_convos, a.concurrency, max_tokens, bar)
                )
    finally:
        for c in clusters.values():
            c.stop()
    print(file=sys.stderr)
    out: dict[str, Any] = {
        "quick": a.quick,
        "concurrency": a.concurrency,
        "rounds": rounds,
        "requests_per_variant": rounds * per_round,
    }
    sums = {k: summary(v) for k, v in results.items()}
    for k, s in sums.items():
        for m, v in s.items():
            out[f"variant.{k}.{m}"] = v
        out[f"variant.{k}.requests_per_s"] = s["ok"] / max(1e-9, s["busy_seconds"]) * a.concurrency
    on = sums["reuse_on"]
    for side in ("decode", "prefill"):
        off_s = sums[f"{side}_reuse_off"]
        out[f"serving.ttft_p50_ratio_{side}_reuse"] = on["ttft_p50_ms"] / off_s["ttft_p50_ms"]
        out[f"serving.ttft_p99_ratio_{side}_reuse"] = on["ttft_p99_ms"] / off_s["ttft_p99_ms"]
    out["serving.restored_fraction"] = on["restored_fraction"]
    on_b, off_b = sums["reuse_on_128k"], sums["decode_reuse_off_128k"]
    out["serving.kv_wait_ms_p50_ratio_decode_reuse"] = (
        on_b["kv_wait_ms_p50"] / off_b["kv_wait_ms_p50"]
    )
    out["serving.ttft_p50_ratio_decode_reuse_128k"] = on_b["ttft_p50_ms"] / off_b["ttft_p50_ms"]
    out["serving.restored_fraction_128k"] = on_b["restored_fraction"]
    kv, lo = sums["kv_aware"], sums["least_outstanding"]
    out["routing.restored_fraction_ratio"] = kv["restored_fraction"] / max(
        1e-9, lo["restored_fraction"]
    )
    out["routing.ttft_p50_ratio"] = kv["ttft_p50_ms"] / lo["ttft_p50_ms"]
    out["routing.kv_aware_restored_of_possible"] = kv["restored_of_possible"]
    out["routing.least_outstanding_restored_of_possible"] = lo["restored_of_possible"]
    out["failed"] = sum(s["failed"] for s in sums.values())
    out["seconds_total"] = time.perf_counter() - t_start
    out["loadavg_start"] = load_start
    if a.plot:
        plot(sums, a.plot)
    return out


def passed(res: dict[str, Any]) -> bool:
    return res["failed"] == 0


def plot(sums: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(sums)
    fig, axes = plt.subplots(1, 5, figsize=(16, 3.6))
    for ax, (key, label) in zip(
        axes,
        (
            ("ttft_p50_ms", "TTFT p50 (ms)"),
            ("ttft_p99_ms", "TTFT p99 (ms)"),
            ("tpot_ms", "TPOT (ms)"),
            ("restored_fraction", "prompt restored on decode"),
            ("kv_wait_ms_p50", "decode's KV wait p50 (ms)"),
        ),
    ):
        ax.bar(
            range(len(names)),
            [sums[n][key] for n in names],
            color=[
                "tab:blue",
                "tab:gray",
                "tab:purple",
                "tab:green",
                "tab:orange",
                "tab:cyan",
                "tab:olive",
            ][: len(names)],
        )
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(label, fontsize=9)
    fig.suptitle("shared-prefix workload through the router (loopback, 2 vCPUs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    from benchmarks.common import runner

    sys.exit(runner.run(sys.modules[__name__]))
