#!/usr/bin/env python
"""Unloaded time to first token of one prompt through ``benchmarks/goodput.py``'s PD pair
(the router, a one-core prefill, a one-core decode), against the same prefill server and
the decode server answering it alone (a plain request, no transfer), interleaved, prefix
caches emptied before each: what the PD path adds to its one-core prefill.

    python scripts/probe_pd_ttft.py [--lens 1024,4096,8000] [--reps 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import benchmarks.goodput as g  # noqa: E402


async def first_token(client: AsyncOpenAI, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    it = await client.completions.create(
        model="llama",
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    first = None
    async for ch in it:
        if first is None and ch.choices and ch.choices[0].text:
            first = time.perf_counter() - t0
    return first if first is not None else time.perf_counter() - t0


async def main(lens: list[int], reps: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        fleet = g.Fleet(Path(d), g.FULL, ["pd"], 600)
        try:
            assert fleet.router is not None
            urls = {
                "pd": fleet.router.url,
                "prefill_alone": fleet.servers["prefill"].url,
                "decode_alone": fleet.servers["decode"].url,
            }
            clients = {
                k: AsyncOpenAI(base_url=f"{u}/v1", api_key="x", max_retries=0, timeout=600)
                for k, u in urls.items()
            }
            await first_token(clients["pd"], g.Req(0, 0, 300, 4, 1).prompt())  # warm-up
            for n in lens:
                for rep in range(reps):
                    p = g.Req(0, 0, n, 4, 1000 * n + rep).prompt()
                    out = []
                    for k, c in clients.items():
                        fleet.reset_caches()
                        out.append(f"{k} {await first_token(c, p):.3f} s")
                    print(f"{n} tokens, rep {rep}: " + ", ".join(out), flush=True)
        finally:
            fleet.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default="1024,4096,8000")
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    asyncio.run(main([int(x) for x in a.lens.split(",")], a.reps))
