#!/usr/bin/env python
"""Unloaded time to first token of one prompt through ``benchmarks/goodput.py``'s PD pair
(the router, a one-core prefill, a one-core decode), against the same prefill server and
the decode server answering it alone (a plain request, no transfer), and through the pair
again while the decode streams another request's answer, interleaved, prefix caches emptied
before each: what the PD path adds to its one-core prefill, and whether a busy decode (its
tokens relayed by the router to the client, both unpinned) slows the prefill.

    python scripts/probe_pd_ttft.py [--lens 1024,4096,8000] [--reps 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import benchmarks.goodput as g  # noqa: E402


async def main(lens: list[int], reps: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        fleet = g.Fleet(Path(d), g.FULL, ["pd"], 600)
        try:
            assert fleet.router is not None
            targets = [
                g.Target("pd", [fleet.router.url]),
                g.Target("prefill_alone", [fleet.servers["prefill"].url]),
                g.Target("decode_alone", [fleet.servers["decode"].url]),
            ]
            await targets[0].send(g.Req(0, 0.0, 300, 4, 1))  # warm-up
            for n in lens:
                for rep in range(reps):
                    req = g.Req(0, 0.0, n, 4, 1000 * n + rep)
                    out = []
                    for t in targets:
                        fleet.reset_caches()
                        r = await t.send(req)
                        out.append(
                            f"{t.name} {r.ttft:.3f} s" + (f" ({r.error})" if r.error else "")
                        )
                    fleet.reset_caches()
                    r, step, gap, at = await while_decoding(targets[0], req)
                    out.append(
                        f"pd_while_decoding {r.ttft:.3f} s (the other answer's step "
                        f"{1e3 * step:.0f} ms, its longest gap {1e3 * gap:.0f} ms ending "
                        f"{1e3 * at:+.0f} ms from this one's first token)"
                    )
                    print(f"{n} tokens, rep {rep}: " + ", ".join(out), flush=True)
            for t in targets:
                await t.close()
        finally:
            fleet.stop()


async def while_decoding(pd: g.Target, req: g.Req) -> tuple[g.Result, float, float, float]:
    """``req`` through the pair once another request (256 tokens, a 300-token answer) is
    decoding: ``req``'s result, the other's median inter-token time, its longest gap, and
    when that gap ended relative to ``req``'s first token (near 0: the decode stalled as
    ``req``'s KV arrived)."""
    t0 = time.perf_counter()
    other = asyncio.ensure_future(pd.send(g.Req(1, 0.0, 256, 300, req.seed + 1)))
    await asyncio.sleep(1.5)  # its prefill done: the decode streams its answer
    sent = time.perf_counter() - t0
    r = await pd.send(req)
    o = await other
    itls = o.itls()
    if not itls:
        return r, 0.0, 0.0, 0.0
    k = max(range(len(itls)), key=itls.__getitem__)
    return r, sorted(itls)[len(itls) // 2], itls[k], o.times[k + 1] - (sent + r.ttft)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default="1024,4096,8000")
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    asyncio.run(main([int(x) for x in a.lens.split(",")], a.reps))
