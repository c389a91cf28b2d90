#!/usr/bin/env python
"""Where a disaggregated prefill's time goes on vLLM: the prefill leg against a colocated
prefill of the same prompt, split by vLLM's own per-request clocks.

    python scripts/trace_vllm_prefill.py [--requests 12] [--tokens 1536] [--json out.json]

Cases, each measured with only its own servers running (started one at a time, stopped
after), on distinct prompts (no prefix shared, so each request computes its whole prompt):

- ``colocated_stream``: a colocated server, the client's streamed TTFT (bench_vllm's
  reference);
- ``colocated_one``: the same server, the prefill leg's request shape (``max_tokens`` 1, not
  streamed) sent directly;
- ``pdxfer_idle``: a pdxfer prefill (its decode up), the same one-token request without
  ``kv_transfer_params``: the connector loaded (its KV layout, its step hooks) but unused;
- ``pdxfer_leg``: the prefill leg as bench_vllm times it: through the front door, with
  ``do_remote_decode`` (the room, ``request_finished``'s answer), the decode leg after it.

For each: the client's p50 and mean, and the means of vLLM's histograms on the server that
prefilled (``/metrics``): ``e2e`` (the API server's arrival to its finish), ``queue`` (the
engine's queue), ``prefill`` (scheduled to first token: the forward passes), so
``client - e2e`` is HTTP (and, for ``pdxfer_leg``, the front door), ``e2e - queue - prefill``
the hops between the API server and the engine core. Flat keys ``trace_vllm.<case>.<part>_ms``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vllm import BS, Setup, makers, prom_sum, tokens, ttft  # noqa: E402

from pdxfer import BootstrapServer  # noqa: E402
from pdxfer.testing.hf_model import SHAPES, build_model  # noqa: E402
from pdxfer.testing.vllm_procs import Server, start_one_by_one  # noqa: E402
from pdxfer.testing.vllm_proxy import FrontDoor  # noqa: E402

HIST = {"e2e": "vllm:e2e_request_latency_seconds", "queue": "vllm:request_queue_time_seconds",
        "prefill": "vllm:request_prefill_time_seconds",
        "ttft": "vllm:time_to_first_token_seconds"}


def one_token(url: str, prompt: list[int], params: dict[str, Any] | None = None) -> float:
    body: dict[str, Any] = {"model": "llama", "prompt": prompt, "max_tokens": 1,
                            "temperature": 0, "stream": False}
    if params:
        body["kv_transfer_params"] = params
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
    return time.perf_counter() - t0


def hists(server: Server) -> dict[str, tuple[float, float]]:
    m = server.metrics_text()
    return {k: (prom_sum(m, v + "_sum"), prom_sum(m, v + "_count")) for k, v in HIST.items()}


def case(name: str, setup: Setup, n: int, ntok: int, seed: int) -> dict[str, float]:
    variant = "colocated" if name.startswith("colocated") else "pdxfer_tcp"
    mk, cfg = makers(variant, setup, f"trace_{name}")
    servers = start_one_by_one(mk, 600.0)
    door = None
    try:
        pre = servers[-1]  # the prefill (started last) or the colocated server
        if variant != "colocated":
            door = FrontDoor(pre.url, servers[0].url, cfg["decode_instance"]).start()
        for i in range(2):  # one-time costs
            ttft(door.url if door else pre.url, tokens(seed + 900 + i, ntok), 2, 600)
        h0 = hists(pre)
        client: list[float] = []
        for i in range(n):
            prompt = tokens(seed + i, ntok)
            if name == "colocated_stream":
                client.append(ttft(pre.url, prompt, 2, 600)[0])
            elif name == "pdxfer_leg":
                assert door is not None
                ttft(door.url, prompt, 2, 600)
                client.append(door.prefill_seconds[-1])
            else:
                client.append(one_token(pre.url, prompt))
        h1 = hists(pre)
    finally:
        if door:
            door.close()
        for s in reversed(servers):
            s.stop()
    out = {"client_p50_ms": 1e3 * statistics.median(client),
           "client_mean_ms": 1e3 * statistics.fmean(client)}
    for k in HIST:
        (s0, c0), (s1, c1) = h0[k], h1[k]
        if c1 > c0:
            out[f"{k}_mean_ms"] = 1e3 * (s1 - s0) / (c1 - c0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=1536)
    ap.add_argument("--rounds", type=int, default=1, help="times each case is repeated")
    ap.add_argument("--cases", default="colocated_stream,colocated_one,pdxfer_idle,pdxfer_leg")
    ap.add_argument("--json")
    a = ap.parse_args()
    sh = SHAPES["kv32k"]
    kv_per_token = sh.layers * 2 * sh.kv_heads * sh.head_size * 4
    max_len = -(-(a.tokens + 64) // BS) * BS
    tmp = Path(tempfile.mkdtemp(prefix="pdxfer-trace-vllm-"))
    boot = BootstrapServer("127.0.0.1", 0).start()
    res: dict[str, Any] = {}
    try:
        setup = Setup(tmp, build_model(tmp / "model", "kv32k"), boot.address,
                      3 * max_len * kv_per_token, 0, max_len, log_stats=True)
        for r in range(a.rounds):
            for name in a.cases.split(","):
                got = case(name, setup, a.requests, a.tokens, 10_000 * (r + 1))
                for k, v in got.items():
                    res.setdefault(f"trace_vllm.{name}.{k}", []).append(round(v, 1))
                print(f"[trace_vllm] {name}: {got}", file=sys.stderr)
    finally:
        boot.stop()
    res = {k: statistics.median(v) for k, v in res.items()}
    text = json.dumps(res, indent=1, sort_keys=True)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
