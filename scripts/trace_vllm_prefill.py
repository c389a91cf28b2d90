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
  ``do_remote_decode`` (the room, ``request_finished``'s answer), the decode leg after it;
- ``pdxfer_leg_nopause``: the same with the step after a finish not yielding to vLLM's
  output thread (``scheduler.ANSWER_FIRST_S`` 0, as before it was added).

With the stamps (``scripts/trace_hooks``, on unless ``--no-stamps``), every case but the
streamed one is also split along the path: ``stamps.<segment>_p50_ms`` (HTTP in, API server
to engine, the steps with the forward pass and its CPU time, each stamped call in them, the
engine to the API server and what ran in the engine meanwhile, the answer, HTTP out).

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
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks, tests

from benchmarks.common.vllm_bench import run_and_report  # noqa: E402
from benchmarks.common.vllm_proxy import FrontDoor  # noqa: E402
from benchmarks.vllm import BS, Setup, makers, prom_sum, tokens, ttft  # noqa: E402
from pdxfer import BootstrapServer  # noqa: E402
from pdxfer.serving.vllm.local_model import SHAPES, build_model  # noqa: E402
from pdxfer.serving.vllm.servers import Server, add_startup_timeout_arg, start_one_by_one  # noqa: E402

HIST = {
    "e2e": "vllm:e2e_request_latency_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
}


def with_env(s: Server, env: dict[str, str]) -> Server:
    s.env.update(env)
    return s


def one_token(url: str, prompt: list[int], params: dict[str, Any] | None = None) -> float:
    body: dict[str, Any] = {
        "model": "llama",
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "stream": False,
    }
    if params:
        body["kv_transfer_params"] = params
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
    return time.perf_counter() - t0


def load_events(folder: Path) -> list[tuple[str, str, int, int]]:
    ev: list[tuple[str, str, int, int]] = []
    for f in folder.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                name, kind, t, cpu = json.loads(line)
            except ValueError:
                continue  # a line cut by the server's end
            ev.append((name, kind, int(t), int(cpu)))
    return sorted(ev, key=lambda e: e[2])


def calls(ev: list[tuple[str, str, int, int]], name: str) -> list[tuple[int, int, int]]:
    """(start, end, CPU ns) of each call of ``name`` (calls of one name do not overlap)."""
    out, start = [], None
    for n, kind, t, cpu in ev:
        if n != name:
            continue
        if kind == "in":
            start = (t, cpu)
        elif start is not None:
            out.append((start[0], t, cpu - start[1]))
            start = None
    return out


PARTS = (
    "exec.model",
    "exec.sample",
    "sched.schedule",
    "sched.update",
    "sched.conn_finished",
    "pdx.request_finished",
    "pdx.build_meta",
    "pdx.start_load_kv",
    "pdx.wait_for_save",
    "pdx.get_finished",
    "pdx.save_layer",
    "pdx.give",
    "pdx.open",
    "pdx.hand",
    "pdx.write_stats",
)
"""Stamped calls summed per request: in the steps until the answer, and after it."""


def timeline(folder: Path, spans: list[tuple[int, int]]) -> dict[str, list[float]]:
    """Per request (``spans``: the client's start and end), the segments of its path through
    the prefill's two processes, in ms: where each began and ended is a stamp."""
    ev = load_events(folder)
    seg: dict[str, list[float]] = {}

    def put(k: str, ns: float) -> None:
        seg.setdefault(k, []).append(ns / 1e6)

    for t0, t1 in spans:
        w = [e for e in ev if t0 <= e[2] <= t1]

        def first(
            name: str, kind: str = "in", after: int = 0, w: list[tuple[str, str, int, int]] = w
        ) -> int | None:
            return next((e[2] for e in w if e[0] == name and e[1] == kind and e[2] >= after), None)

        h_in, add = first("api.handler"), first("core.add_request")
        out_in = first("api.outputs", after=add or t0)
        h_out = max((e[2] for e in w if e[0] == "api.handler" and e[1] == "out"), default=None)
        steps = calls(w, "core.step")
        if None in (h_in, add, out_in, h_out) or not steps:
            continue
        fwd = [c for c in calls(w, "exec.model") if add <= c[0] and c[1] <= out_in]
        if not fwd:
            continue
        big = max(fwd, key=lambda c: c[1] - c[0])  # the prompt's forward pass
        run = [c for c in steps if c[0] >= add and c[1] <= out_in]
        done = next((c for c in run if c[0] <= big[0] and big[1] <= c[1]), None)
        if not run or done is None:
            continue
        last = done[1]  # the step that finished the request (its output queued at its end)
        put("http_in", h_in - t0)
        put("api_to_engine", add - h_in)
        put("engine_wait", run[0][0] - add)
        put("engine_steps", last - run[0][0])
        put("engine_steps.forward", big[1] - big[0])
        put("engine_steps.forward_cpu", big[2])
        for name in PARTS:
            cs = [c for c in calls(w, name) if c[0] >= run[0][0] and c[1] <= last]
            if name != "exec.model":
                put(f"engine_steps.{name}", sum(b - a for a, b, _ in cs))
            after = [c for c in calls(w, name) if last <= c[0] <= out_in]
            put(f"while_answer_travels.{name}", sum(b - a for a, b, _ in after))
        put("engine_to_api", out_in - last)
        put("api_answer", h_out - out_in)
        put("http_out", t1 - h_out)
        put("total", t1 - t0)
        later = [c for c in steps if last <= c[0] <= out_in]
        put("while_answer_travels.steps", 1e6 * len(later))  # a count, not ms
        put("while_answer_travels.step_wall", sum(b - a for a, b, _ in later))
    return seg


def hists(server: Server) -> dict[str, tuple[float, float]]:
    m = server.metrics_text()
    return {k: (prom_sum(m, v + "_sum"), prom_sum(m, v + "_count")) for k, v in HIST.items()}


def case(
    name: str, setup: Setup, n: int, ntok: int, seed: int, startup_timeout: float
) -> dict[str, float]:
    variant = "colocated" if name.startswith("colocated") else "pdxfer_tcp"
    mk, cfg = makers(variant, setup, f"trace_{name}")
    if name.endswith("_nopause"):
        mk = [lambda m=m: with_env(m(), {"PDXFER_TRACE_NO_PAUSE": "1"}) for m in mk]
    servers = start_one_by_one(mk, startup_timeout)
    door = None
    try:
        pre = servers[-1]  # the prefill (started last) or the colocated server
        if variant != "colocated":
            door = FrontDoor(pre.url, servers[0].url, cfg["decode_instance"]).start()
        for i in range(2):  # one-time costs
            ttft(door.url if door else pre.url, tokens(seed + 900 + i, ntok), 2, 600)
        h0 = hists(pre)
        client: list[float] = []
        spans: list[tuple[int, int]] = []
        for i in range(n):
            prompt = tokens(seed + i, ntok)
            if name == "colocated_stream":
                client.append(ttft(pre.url, prompt, 2, 600)[0])
            elif name.startswith("pdxfer_leg"):
                assert door is not None
                ttft(door.url, prompt, 2, 600)
                client.append(door.prefill_seconds[-1])
                spans.append(door.prefill_spans[-1])
            else:
                t0 = time.perf_counter_ns()
                client.append(one_token(pre.url, prompt))
                spans.append((t0, time.perf_counter_ns()))
        h1 = hists(pre)
        time.sleep(1.0)  # the stamps' last flush
    finally:
        if door:
            door.close()
        for s in reversed(servers):
            s.stop()
    out = {
        "client_p50_ms": 1e3 * statistics.median(client),
        "client_mean_ms": 1e3 * statistics.fmean(client),
    }
    if setup.trace_dir is not None and spans:
        for k, v in timeline(setup.trace_dir / pre.name, spans).items():
            if any(v):
                out[f"stamps.{k}_p50_ms"] = statistics.median(v)
    for k in HIST:
        (s0, c0), (s1, c1) = h0[k], h1[k]
        if c1 > c0:
            out[f"{k}_mean_ms"] = 1e3 * (s1 - s0) / (c1 - c0)
    return out


def run(a: argparse.Namespace) -> dict[str, Any]:
    sh = SHAPES["kv32k"]
    kv_per_token = sh.layers * 2 * sh.kv_heads * sh.head_size * 4
    max_len = -(-(a.tokens + 64) // BS) * BS
    tmp = Path(tempfile.mkdtemp(prefix="pdxfer-trace-vllm-"))
    boot = BootstrapServer("127.0.0.1", 0).start()
    res: dict[str, Any] = {}
    try:
        setup = Setup(
            tmp,
            build_model(tmp / "model", "kv32k"),
            boot.address,
            3 * max_len * kv_per_token,
            0,
            max_len,
            log_stats=True,
            trace_dir=tmp / "stamps" if a.stamps else None,
        )
        for r in range(a.rounds):
            for name in a.cases.split(","):
                got = case(name, setup, a.requests, a.tokens, 10_000 * (r + 1), a.startup_timeout)
                for k, v in got.items():
                    res.setdefault(f"trace_vllm.{name}.{k}", []).append(round(v, 1))
                print(f"[trace_vllm] {name}: {got}", file=sys.stderr)
    finally:
        boot.stop()
    return {k: statistics.median(v) for k, v in res.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=1536)
    ap.add_argument("--rounds", type=int, default=1, help="times each case is repeated")
    ap.add_argument("--cases", default="colocated_stream,colocated_one,pdxfer_idle,pdxfer_leg")
    ap.add_argument(
        "--no-stamps",
        dest="stamps",
        action="store_false",
        help="leave out scripts/trace_hooks (the stamps cost microseconds a call)",
    )
    add_startup_timeout_arg(ap)
    ap.add_argument("--json")
    a = ap.parse_args()
    return 0 if run_and_report("trace_vllm", lambda: run(a), a.json) is not None else 2


if __name__ == "__main__":
    raise SystemExit(main())
