#!/usr/bin/env python
"""The vLLM prefill leg against colocated vLLM, request shape by request shape, interleaved:
what ``benchmarks/vllm.py``'s ``vllm.prefill_leg_p50_ratio_vs_colocated`` compares, and
where the difference goes.

    python scripts/trace_vllm_legs.py [--quick] [--json trace_legs.json] [--no-stamps]

A colocated server and a pdxfer pair (pdxfer's default transport, ``bench_vllm``'s
``vllm.default_variant``) are up together (they sleep when idle: 0.02-0.04 cores a pair), each
behind its own front door (``benchmarks.common.vllm_proxy``). The workload is bench_vllm's:
conversations whose prompts open with one shared system prefix (cached in the colocated server
and the prefill), the conversation's history and a new question; the answers are greedy. For
every turn, in an order that rotates turn by turn, four requests:

- ``colocated_stream``: the turn's streamed request to the colocated server, timed by its door
  to the first streamed chunk (run 1's colocated "prefill leg");
- ``colocated_one``: colocated's reference leg as bench_vllm now times it (``reference_leg``):
  the prefill's request shape (one token, not streamed, read whole) computing what the
  prefill computes (the previous prompt is cached; the previous answer, which a colocated
  server also holds but a prefill never computed, and the question are replaced by as many
  other tokens);
- ``pdxfer_leg``: the turn through the pair, its prefill leg as the door times it (one token,
  not streamed, ``kv_transfer_params`` asking for a remote decode: the room, the answer's
  params), then the decode leg; its output must equal colocated's;
- ``pdxfer_one``: the pair's prefill sent ``colocated_one``'s request (no
  ``kv_transfer_params``: the connector loaded, no room).

So ``colocated_one - colocated_stream`` is vLLM's own price of the prefill's request shape (a
finished request, its answer built whole) and of recomputing the previous answer (as any
disaggregated prefill does), ``pdxfer_one - colocated_one`` what a loaded
connector costs a request it does not move, ``pdxfer_leg - pdxfer_one`` what the room and its
answer cost. Differences are medians of per-turn pairs (interleaved, so load drift cancels).

``--solo`` runs each case as ``bench_vllm``'s phases do, with only its own servers running: the
others are paused (``SIGSTOP`` to their process groups) around it and given a moment after
``SIGCONT`` before the next case. It adds ``pdxfer_one_solo``, ``pdxfer_one`` with the pair's
decode paused too, so ``pdxfer_one - pdxfer_one_solo`` is what an idle decode server beside
the prefill costs it on this host (a pair's two servers share its cores; colocated has one).

With the stamps (``scripts/trace_hooks``, see ``trace_vllm_prefill.py``) the non-streamed
cases are also split along the prefill's path: ``<case>.stamps.<segment>_p50_ms``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks, tests

from trace_vllm_prefill import timeline  # noqa: E402

from benchmarks.common.proccpu import host_busy_cores  # noqa: E402
from benchmarks.common.vllm_bench import (  # noqa: E402
    pct,
    request_body,
    run_and_report,
    stream_request,
    tokens,
)
from benchmarks.common.vllm_proxy import FrontDoor  # noqa: E402
from benchmarks.vllm import BS, Setup, default_variant, makers, reference_leg  # noqa: E402
from pdxfer import BootstrapServer  # noqa: E402
from pdxfer.serving.vllm.local_model import SHAPES, build_model  # noqa: E402
from pdxfer.serving.vllm.servers import add_startup_timeout_arg, start_one_by_one  # noqa: E402

CASES = ("colocated_stream", "colocated_one", "pdxfer_leg", "pdxfer_one")
SOLO = "pdxfer_one_solo"
DIFFS = (
    ("colocated_one", "colocated_stream"),
    ("pdxfer_leg", "colocated_one"),
    ("pdxfer_leg", "colocated_stream"),
    ("pdxfer_one", "colocated_one"),
    ("pdxfer_leg", "pdxfer_one"),
)
SOLO_DIFFS = (("pdxfer_one", SOLO), (SOLO, "colocated_one"))
SOLO_SEED = 50_000
"""Added to a turn's seed for ``pdxfer_one_solo``'s probe: it goes to the same prefill as
``pdxfer_one``'s, so with the same tokens the second of the two would find the first's in
the prefix cache and compute one block instead of the turn's."""
SETTLE_S = 0.3
"""After resuming paused servers, how long before the next case: their timers that came due
while paused fire now, not inside the next measurement."""


def paused_for(case: str) -> tuple[str, ...]:
    """The servers (``colocated``, ``prefill``, ``decode``) that ``--solo`` pauses around a
    case: every one the case does not use, as a bench_vllm phase has only its variant's up."""
    if case.startswith("colocated"):
        return ("prefill", "decode")
    return ("colocated", "decode") if case == SOLO else ("colocated",)


@contextlib.contextmanager
def paused(pids: list[int]):
    """``SIGSTOP`` the process groups (a server's engine core is its child) for the block."""
    for pid in pids:
        os.killpg(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.killpg(pid, signal.SIGCONT)
        if pids:
            time.sleep(SETTLE_S)


def run(a: argparse.Namespace) -> dict[str, Any]:
    convs, turns = (2, 3) if a.quick else (a.convs, a.turns)
    system, question, answer = (1024, 96, 16) if a.quick else (1536, 128, 24)
    sh = SHAPES["kv32k"]
    kv_per_token = sh.layers * 2 * sh.kv_heads * sh.head_size * 4
    longest = system + turns * (question + answer)
    max_len = -(-(longest + 64) // BS) * BS
    tmp = Path(tempfile.mkdtemp(prefix="pdxfer-trace-legs-"))
    cases = (*CASES, SOLO) if a.solo else CASES
    res: dict[str, Any] = {
        "legs.shape": {
            "convs": convs,
            "turns": turns,
            "system": system,
            "question": question,
            "answer": answer,
        },
        "legs.solo": a.solo,
        "legs.variant": default_variant(),
        "legs.cores": os.cpu_count(),
        "legs.background_cores_before": round(host_busy_cores(3.0), 3),
        "legs.loadavg_before": os.getloadavg(),
    }
    boot = BootstrapServer("127.0.0.1", 0).start()
    doors: list[FrontDoor] = []
    servers: list[Any] = []
    try:
        setup = Setup(
            tmp,
            build_model(tmp / "model", "kv32k"),
            boot.address,
            3 * max_len * kv_per_token,
            0,
            max_len,
            trace_dir=tmp / "stamps" if a.stamps else None,
        )
        mk_c, _ = makers("colocated", setup, "legs")
        mk_p, cfg = makers(res["legs.variant"], setup, "legs")
        servers = start_one_by_one([*mk_c, *mk_p], a.startup_timeout)
        colo, dec, pre = servers
        doors.append(FrontDoor(colo.url, "", connector="colocated").start())
        doors.append(FrontDoor(pre.url, dec.url, cfg["decode_instance"]).start())
        c_door, p_door = doors
        pid = {"colocated": colo.pid, "prefill": pre.pid, "decode": dec.pid}
        for d in doors:  # one-time costs of both request shapes
            stream_request(d.url, tokens(999, 2 * BS + 5), 2, 600)
            d.prefill_leg(request_body(tokens(998, 2 * BS + 5), 2))
        legs: dict[str, list[float]] = {c: [] for c in cases}
        spans: dict[str, list[tuple[int, int]]] = {c: [] for c in cases}
        ttft: dict[str, list[float]] = {"colocated": [], "pdxfer": []}
        same = 0
        turn_of: list[int] = []
        res["legs.loadavg_start"] = os.getloadavg()
        prefix = tokens(1, system)
        hist = {c: list(prefix) for c in range(convs)}
        held = {c: system for c in range(convs)}  # what the prefill has cached
        k = 0
        for t in range(turns):
            for c in range(convs):
                seed = 100 * c + t + 2
                prompt = hist[c] + tokens(seed, question)
                got: dict[str, list[int]] = {}
                order = cases[k % len(cases) :] + cases[: k % len(cases)]
                turn_of.append(t)
                k += 1
                for case in order:
                    door = c_door if case.startswith("colocated") else p_door
                    stop = [pid[n] for n in paused_for(case)] if a.solo else []
                    with paused(stop):
                        if "_one" in case:  # the solo probe's own tokens: uncached
                            legs[case].append(
                                reference_leg(
                                    door,
                                    prompt,
                                    held[c],
                                    seed + SOLO_SEED * (case == SOLO),
                                    answer,
                                    600,
                                )
                            )
                        else:
                            r = stream_request(door.url, prompt, answer, 600)
                            legs[case].append(door.prefill_seconds[-1])
                            ttft[case.split("_")[0]].append(r.ttft)
                            got[case] = r.ids
                    spans[case].append(door.prefill_spans[-1])
                same += got["colocated_stream"] == got["pdxfer_leg"]
                hist[c], held[c] = prompt + got["colocated_stream"], len(prompt)
        res["legs.loadavg_end"] = os.getloadavg()
        res["legs.outputs_identical"] = f"{same}/{convs * turns}"
        time.sleep(1.0)  # the stamps' last flush
    finally:
        for d in doors:
            d.close()
        for s in reversed(servers):
            s.stop()
        boot.stop()
    for case in cases:
        res[f"legs.{case}.p50_ms"] = 1e3 * pct(legs[case], 0.5)
        res[f"legs.{case}.p90_ms"] = 1e3 * pct(legs[case], 0.9)
        res[f"legs.{case}.mean_ms"] = 1e3 * statistics.fmean(legs[case])
        res[f"legs.{case}.by_turn_p50_ms"] = [
            round(1e3 * statistics.median([x for x, u in zip(legs[case], turn_of) if u == t]), 1)
            for t in range(turns)
        ]
    for who, xs in ttft.items():
        res[f"legs.ttft_p50_ms.{who}"] = 1e3 * pct(xs, 0.5)
    for x, y in (*DIFFS, *SOLO_DIFFS) if a.solo else DIFFS:
        res[f"legs.diff_p50_ms.{x}_minus_{y}"] = 1e3 * statistics.median(
            [p - q for p, q in zip(legs[x], legs[y])]
        )
        res[f"legs.ratio_p50.{x}_vs_{y}"] = pct(legs[x], 0.5) / pct(legs[y], 0.5)
    if setup.trace_dir is not None:
        for case in cases[1:]:  # a streamed request's handler returns before its answer
            folder = setup.trace_dir / (colo.name if case.startswith("colocated") else pre.name)
            for seg, v in timeline(folder, spans[case]).items():
                if any(v):
                    res[f"legs.{case}.stamps.{seg}_p50_ms"] = round(statistics.median(v), 3)
    res["legs.logs"] = str(tmp)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 conversations x 3 turns, shorter")
    ap.add_argument("--convs", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    add_startup_timeout_arg(ap)
    ap.add_argument(
        "--no-stamps",
        dest="stamps",
        action="store_false",
        help="leave out scripts/trace_hooks (the stamps cost microseconds a call)",
    )
    ap.add_argument(
        "--solo",
        action="store_true",
        help="pause (SIGSTOP) the servers a case does not use around it, as "
        "bench_vllm's phases run alone; adds pdxfer_one_solo (decode paused)",
    )
    ap.add_argument("--json")
    a = ap.parse_args()
    return 0 if run_and_report("trace_vllm_legs", lambda: run(a), a.json) is not None else 2


if __name__ == "__main__":
    raise SystemExit(main())
