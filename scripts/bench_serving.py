#!/usr/bin/env python
"""The served system under a shared-prefix workload, variants compared in one interleaved run.

    python scripts/bench_serving.py [--quick] [--json out.json] [--plot docs/bench_serving.png]
                                    [--concurrency 8]

Workload: groups of requests that share a long prefix, as turns of multi-turn conversations
do (every turn repeats the history and adds a question), sent through the router with the
official streaming API at concurrency N (2N conversations, so a conversation's next turn does
not simply take the slot its last turn freed), with a progress bar. TTFT is the time to the first
streamed text at the client; TPOT the time per token after it.

Variants (each on its own workers, started once; rounds alternate A B A B ...):
- ``serving.*``: prefix reuse on both sides vs off on the decode, and vs off on the prefill
  (``--l2-pages 0``), 1 prefill + 1 decode: ``serving.ttft_p50_ratio_decode_reuse``
  and ``serving.ttft_p50_ratio_prefill_reuse`` (on / off).
- ``routing.*``: KV-aware routing vs least-outstanding over 1 prefill + 2 decodes:
  ``routing.restored_fraction_ratio`` (KV-aware / least-outstanding) and
  ``routing.ttft_p50_ratio``.
"""

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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdxfer.serving.toy.cluster import Cluster  # noqa: E402

WORKER = ["--bootstrap-timeout", "20", "--transfer-timeout", "60", "--pages", "1024"]


def workload(groups: int, turns: int, seed: int) -> list[list[str]]:
    """``groups`` conversations of ``turns`` prompts; turn t repeats turns 0..t-1."""
    rng = np.random.default_rng(seed)
    words = ["kv", "cache", "page", "token", "decode", "prefill", "router", "layer", "head",
             "room", "bootstrap", "transfer", "prefix", "draft", "batch"]
    out = []
    for g in range(groups):
        history = f"system: conversation {g} of the benchmark. " + " ".join(
            rng.choice(words, 60)) + ". "
        convo = []
        for t in range(turns):
            history += f"user {t}: " + " ".join(rng.choice(words, 8)) + "? "
            convo.append(history)
        out.append(convo)
    return out


async def one(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int
              ) -> dict[str, Any]:
    t0 = time.perf_counter()
    first = last = None
    final: dict[str, Any] = {}
    async with session.post(f"{url}/v1/completions", json={
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
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
    return {"ok": True, "ttft": (first or time.perf_counter()) - t0,
            "tpot": ((last - first) / (n - 1)) if first and last and n > 1 else None,
            "wall": time.perf_counter() - t0, "prompt": len(prompt.encode()),
            "restored": int(final.get("restored_tokens", 0)), "tokens": n}


async def run_round(url: str, convos: list[list[str]], conc: int, max_tokens: int,
                    bar: Any) -> list[dict[str, Any]]:
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


def summary(rs: list[dict[str, Any]]) -> dict[str, float]:
    ok = [r for r in rs if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    wall = sum(r["wall"] for r in ok) or 1.0
    return {"ttft_p50_ms": float(np.percentile(ttft, 50) * 1e3) if ttft else float("nan"),
            "ttft_p99_ms": float(np.percentile(ttft, 99) * 1e3) if ttft else float("nan"),
            "tpot_ms": statistics.median(tpot) * 1e3 if tpot else float("nan"),
            "restored_fraction": (sum(r["restored"] for r in ok)
                                  / max(1, sum(r["prompt"] for r in ok))),
            "ok": len(ok), "failed": len(rs) - len(ok), "busy_seconds": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--concurrency", type=int, default=8)
    a = ap.parse_args()
    # more conversations than requests in flight: in a closed loop with one request in
    # flight per conversation, the slot a turn frees is the one its next turn takes, so any
    # policy would keep a conversation on one decode and routing would show nothing
    groups, turns, rounds, max_tokens = ((a.concurrency + 4, 3, 1, 8) if a.quick
                                         else (2 * a.concurrency, 4, 2, 16))
    convos = workload(groups, turns, seed=1)
    per_round = groups * turns
    off = ["--l2-pages", "0"]
    specs = {
        "reuse_on": dict(prefills=1, decodes=1),
        "decode_reuse_off": dict(prefills=1, decodes=1, decode_args=off),
        "prefill_reuse_off": dict(prefills=1, decodes=1, prefill_args=off),
        "kv_aware": dict(prefills=1, decodes=2, router_args=["--policy", "kv_aware"]),
        "least_outstanding": dict(prefills=1, decodes=2,
                                  router_args=["--policy", "least_outstanding"]),
    }
    clusters: dict[str, Cluster] = {}
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in specs}
    total = rounds * per_round * len(specs)
    done = [0]
    t_start = time.perf_counter()

    def bar() -> None:
        done[0] += 1
        n = 30 * done[0] // total
        print(f"\r[{'#' * n}{'.' * (30 - n)}] {done[0]}/{total}", end="", file=sys.stderr,
              flush=True)

    try:
        for name, kw in specs.items():
            kw = dict(kw)
            router_args = ["--timeout", "120", *kw.pop("router_args", [])]
            clusters[name] = Cluster(worker_args=WORKER, router_args=router_args, **kw).start()
        for r in range(rounds):
            # fresh conversations every round: caches warm up within a round, as in serving
            round_convos = [[f"[round {r}] " + p for p in c] for c in convos]
            for name, c in clusters.items():
                assert c.router is not None
                results[name] += asyncio.run(run_round(c.router.url, round_convos,
                                                       a.concurrency, max_tokens, bar))
    finally:
        for c in clusters.values():
            c.stop()
    print(file=sys.stderr)
    out: dict[str, Any] = {"quick": a.quick, "concurrency": a.concurrency, "rounds": rounds,
                           "requests_per_variant": rounds * per_round}
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
    kv, lo = sums["kv_aware"], sums["least_outstanding"]
    out["routing.restored_fraction_ratio"] = (kv["restored_fraction"]
                                              / max(1e-9, lo["restored_fraction"]))
    out["routing.ttft_p50_ratio"] = kv["ttft_p50_ms"] / lo["ttft_p50_ms"]
    out["failed"] = sum(s["failed"] for s in sums.values())
    out["seconds_total"] = time.perf_counter() - t_start
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        a.json.write_text(text)
    if a.plot:
        plot(sums, a.plot)
    return 0 if out["failed"] == 0 else 1


def plot(sums: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(sums)
    fig, axes = plt.subplots(1, 4, figsize=(13, 3.4))
    for ax, (key, label) in zip(axes, (("ttft_p50_ms", "TTFT p50 (ms)"),
                                       ("ttft_p99_ms", "TTFT p99 (ms)"),
                                       ("tpot_ms", "TPOT (ms)"),
                                       ("restored_fraction", "prompt restored on decode"))):
        ax.bar(range(len(names)), [sums[n][key] for n in names],
               color=["tab:blue", "tab:gray", "tab:purple", "tab:green", "tab:orange"])
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(label, fontsize=9)
    fig.suptitle("shared-prefix workload through the router (loopback, 2 vCPUs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
