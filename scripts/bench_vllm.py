"""pdxfer's vLLM connector against vLLM's own NixlConnector, and decode-side reuse on/off,
on real ``vllm serve`` pairs (CPU), in one interleaved run.

    python scripts/bench_vllm.py --json bench_vllm.json [--quick]

Model: ``pdxfer.testing.hf_model`` shape ``kv32k`` (8 layers, 8 KV heads of 128 on a 256-wide
model) served in float32: 64 KiB of KV per token, so a 2,000-token prompt is 128 MiB of KV
and moving it is a real share of the time to first token. Workload: conversations of several
turns, every prompt opening with one long system prefix shared by all conversations, each
turn repeating its conversation's history (the last prompt and answer) and adding a
question. Clusters (started once, all at the same time):

- ``pdxfer``: a prefill and a decode with PdxferConnector;
- ``pdxfer_reuse``: the same, the decode with decode-side tiers (L2 host pages);
- ``builtin``: vLLM's NixlConnector pair on CPU memory (``kv_buffer_device: cpu``; vLLM
  imports ``nixl._api`` and ``nixl-cu12`` installs as ``nixl_cu12``, so these two
  processes get ``scripts/nixl_shim`` on their PYTHONPATH; ``kv_lease_duration`` 300 s so
  a busy machine does not expire the prefill's blocks before the decode reads them).

vLLM's own prefix cache is off on every decode, so the decodes do the same work except for
what pdxfer's tiers restore; the prefills keep theirs (a turn's history is not recomputed),
and each variant has its own prefill, so each computes every new question once.
Each request goes through a front door following vLLM's proxy protocol, streamed; TTFT is
the time to the first streamed token. Requests run one at a time, the variants alternating
request by request (rotating which goes first). Outputs must be identical across variants.

The front door also times each request's prefill leg; the rest of a TTFT (``decode_leg``:
the decode's request until its first token, where the connectors differ) is reported too.

Keys: ``vllm.ttft_p50_ratio_vs_builtin`` (pdxfer without reuse over NixlConnector: the same
bytes moved), ``vllm.ttft_p50_ratio_vs_builtin_with_reuse``, ``vllm.ttft_p50_ratio_decode_reuse``
(reuse on over off), ``vllm.kv_gbps.pdxfer`` / ``vllm.kv_gbps.builtin`` (bytes moved over the
summed per-request transfer times, as each connector measures them), ``vllm.kv_bytes_per_token``,
``vllm.outputs_identical``, and per variant ``vllm.ttft_p50_ms.*``, ``vllm.ttft_p90_ms.*``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from openai import OpenAI

from pdxfer import BootstrapServer
from pdxfer.testing.hf_model import SHAPES, build_model
from pdxfer.testing.vllm_procs import VllmServer, free_port, kv_config, read_stats, start_all
from pdxfer.testing.vllm_proxy import FrontDoor

ROOT = Path(__file__).resolve().parent
BS = 32
VARIANTS = ("pdxfer", "pdxfer_reuse", "builtin")


def servers(tmp: Path, model: Path, boot: BootstrapServer, kv_bytes: int, l2_pages: int,
            max_len: int) -> dict[str, VllmServer]:
    common = {"bootstrap_timeout_s": 120.0, "transfer_timeout_s": 120.0}
    lim = ["--max-model-len", str(max_len)]
    nocache = [*lim, "--no-enable-prefix-caching"]
    shim = {"PYTHONPATH": f"{ROOT / 'nixl_shim'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "UCX_LOG_LEVEL": "error", "NIXL_LOG_LEVEL": "WARN"}
    nixl_extra = {"kv_lease_duration": 300}
    s = {
        "pdx_p": VllmServer("pdx_p", model, tmp, kv_cache_bytes=kv_bytes, args=lim,
                            kv_transfer_config=kv_config("kv_producer", {
                                "bootstrap": boot.address, "instance": "bench-p",
                                "stats_file": str(tmp / "pdx_p.json"), **common})),
        "pdx_p2": VllmServer("pdx_p2", model, tmp, kv_cache_bytes=kv_bytes, args=lim,
                             kv_transfer_config=kv_config("kv_producer", {
                                 "bootstrap": boot.address, "instance": "bench-p2",
                                 "stats_file": str(tmp / "pdx_p2.json"), **common})),
        "pdx_d": VllmServer("pdx_d", model, tmp, kv_cache_bytes=kv_bytes, args=nocache,
                            kv_transfer_config=kv_config("kv_consumer", {
                                "instance": "bench-d", "stats_file": str(tmp / "pdx_d.json"),
                                **common})),
        "pdx_dr": VllmServer("pdx_dr", model, tmp, kv_cache_bytes=kv_bytes, args=nocache,
                             kv_transfer_config=kv_config("kv_consumer", {
                                 "instance": "bench-dr", "l2_pages": l2_pages,
                                 "stats_file": str(tmp / "pdx_dr.json"), **common})),
        "nixl_p": VllmServer("nixl_p", model, tmp, kv_cache_bytes=kv_bytes, args=lim,
                             kv_transfer_config=kv_config(
                                 "kv_producer", nixl_extra, connector="NixlConnector",
                                 module=None, kv_buffer_device="cpu"),
                             env={**shim, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}),
        "nixl_d": VllmServer("nixl_d", model, tmp, kv_cache_bytes=kv_bytes, args=nocache,
                             log_stats=True,
                             kv_transfer_config=kv_config(
                                 "kv_consumer", nixl_extra, connector="NixlConnector",
                                 module=None, kv_buffer_device="cpu"),
                             env={**shim, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}),
    }
    return s


def prom_sum(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def ttft(url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    first = None
    ids: list[int] = []
    for chunk in client.completions.create(
            model="llama", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True}):
        if chunk.choices:
            got = list(getattr(chunk.choices[0], "token_ids", None) or [])
            if got and first is None:
                first = time.perf_counter() - t0
            ids += got
    assert first is not None, "no token streamed"
    return first, ids


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 37 * i) % 700 + 300 for i in range(n)]


def run(quick: bool) -> dict[str, Any]:
    convs, turns = (3, 3) if quick else (6, 4)
    system, question, answer = (1024, 96, 16) if quick else (1536, 128, 24)
    shape = SHAPES["kv32k"]
    kv_per_token = shape.layers * 2 * shape.kv_heads * shape.head_size * 4  # float32
    longest = system + turns * (question + answer)
    max_len = -(-(longest + 64) // BS) * BS
    kv_bytes = 3 * max_len * kv_per_token  # a few requests in flight, and then some
    l2_pages = 2 * convs * -(-longest // BS) + 64
    tmp = Path(tempfile.mkdtemp(prefix="pdxfer-bench-vllm-"))
    model = build_model(tmp / "model", "kv32k")
    boot = BootstrapServer("127.0.0.1", 0).start()
    srv: dict[str, VllmServer] = {}
    doors: dict[str, FrontDoor] = {}
    t_start = time.monotonic()
    try:
        srv = servers(tmp, model, boot, kv_bytes, l2_pages, max_len)
        start_all(list(srv.values()), timeout=600)
        doors = {
            "pdxfer": FrontDoor(srv["pdx_p"].url, srv["pdx_d"].url, "bench-d").start(),
            "pdxfer_reuse": FrontDoor(srv["pdx_p2"].url, srv["pdx_dr"].url, "bench-dr").start(),
            "builtin": FrontDoor(srv["nixl_p"].url, srv["nixl_d"].url, connector="nixl").start(),
        }
        print(f"[bench_vllm] {len(srv)} vLLM servers up in {time.monotonic() - t_start:.0f} s;"
              f" {convs} conversations x {turns} turns, system prefix {system} tokens",
              file=sys.stderr)
        # warm every path once (first requests pay one-time costs: handshakes, allocations)
        for door in doors.values():
            ttft(door.url, tokens(999, 2 * BS + 5), 2)
        nixl_b0 = prom_sum(srv["nixl_d"].metrics_text(), "vllm:nixl_bytes_transferred_sum")
        nixl_t0 = prom_sum(srv["nixl_d"].metrics_text(), "vllm:nixl_xfer_time_seconds_sum")
        nixl_n0 = prom_sum(srv["nixl_d"].metrics_text(), "vllm:nixl_xfer_time_seconds_count")
        pd0 = read_stats(tmp / "pdx_d.json")
        pdr0 = read_stats(tmp / "pdx_dr.json")
        sys_prefix = tokens(1, system)
        hist = {(v, c): list(sys_prefix) for v in VARIANTS for c in range(convs)}
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        legs: dict[str, list[float]] = {v: [] for v in VARIANTS}
        outs: dict[tuple[str, int, int], list[int]] = {}
        k = 0
        for t in range(turns):
            for c in range(convs):
                q = tokens(100 * c + t + 2, question)
                order = VARIANTS[k % 3:] + VARIANTS[:k % 3]
                k += 1
                for v in order:
                    prompt = hist[(v, c)] + q
                    dt, ids = ttft(doors[v].url, prompt, answer)
                    times[v].append(dt)
                    legs[v].append(dt - doors[v].prefill_seconds[-1])
                    outs[(v, c, t)] = ids
                    hist[(v, c)] = prompt + ids
            print(f"[bench_vllm] turn {t + 1}/{turns}: " + ", ".join(
                f"{v} p50 {1e3 * statistics.median(times[v]):.0f} ms" for v in VARIANTS),
                file=sys.stderr)
        identical = all(outs[("pdxfer", c, t)] == outs[(v, c, t)]
                        for v in VARIANTS for c in range(convs) for t in range(turns))
        nm = srv["nixl_d"].metrics_text()
        nixl_bytes = prom_sum(nm, "vllm:nixl_bytes_transferred_sum") - nixl_b0
        nixl_secs = prom_sum(nm, "vllm:nixl_xfer_time_seconds_sum") - nixl_t0
        pd = read_stats(tmp / "pdx_d.json")
        pdr = read_stats(tmp / "pdx_dr.json")
        nixl_n = prom_sum(nm, "vllm:nixl_xfer_time_seconds_count") - nixl_n0
        pdx_bytes = pd["net_bytes"] - pd0.get("net_bytes", 0)
        pdx_secs = (pd["net_us"] - pd0.get("net_us", 0)) / 1e6
        p50 = {v: statistics.median(times[v]) for v in VARIANTS}
        p90 = {v: sorted(times[v])[int(0.9 * (len(times[v]) - 1))] for v in VARIANTS}
        res: dict[str, Any] = {
            "vllm.ttft_p50_ratio_vs_builtin": p50["pdxfer"] / p50["builtin"],
            "vllm.ttft_p50_ratio_vs_builtin_with_reuse": p50["pdxfer_reuse"] / p50["builtin"],
            "vllm.ttft_p50_ratio_decode_reuse": p50["pdxfer_reuse"] / p50["pdxfer"],
            "vllm.kv_gbps.pdxfer": pdx_bytes / pdx_secs / 1e9 if pdx_secs else 0.0,
            "vllm.kv_gbps.builtin": nixl_bytes / nixl_secs / 1e9 if nixl_secs else 0.0,
            "vllm.kv_bytes_per_token": kv_per_token,
            "vllm.outputs_identical": identical,
            "vllm.kv_mib.pdxfer": pdx_bytes / 2**20, "vllm.kv_mib.builtin": nixl_bytes / 2**20,
            "vllm.kv_mib.pdxfer_reuse": (pdr["net_bytes"] - pdr0.get("net_bytes", 0)) / 2**20,
            "vllm.restored_fraction.pdxfer_reuse":
                (pdr["restored_pages"] - pdr0.get("restored_pages", 0)) * BS
                / max(1, pdr["loaded_tokens"] - pdr0.get("loaded_tokens", 0)),
            # the connector's own time per request until the KV is in place (mean)
            "vllm.kv_ready_ms_mean.pdxfer":
                (pd["ready_us"] - pd0.get("ready_us", 0)) / 1e3 / max(1, pd["loads"] - pd0.get("loads", 0)),
            "vllm.kv_ready_ms_mean.pdxfer_reuse":
                (pdr["ready_us"] - pdr0.get("ready_us", 0)) / 1e3
                / max(1, pdr["loads"] - pdr0.get("loads", 0)),
            "vllm.kv_ready_ms_mean.builtin": 1e3 * nixl_secs / max(1, nixl_n),
            "vllm.requests_per_variant": len(times["pdxfer"]),
            "vllm.quick": quick, "vllm.seconds": time.monotonic() - t_start,
        }
        res["vllm.decode_leg_p50_ratio_vs_builtin"] = (statistics.median(legs["pdxfer"])
                                                      / statistics.median(legs["builtin"]))
        res["vllm.decode_leg_p50_ratio_decode_reuse"] = (
            statistics.median(legs["pdxfer_reuse"]) / statistics.median(legs["pdxfer"]))
        for v in VARIANTS:
            res[f"vllm.requests_ms.{v}"] = [[round(1e3 * a), round(1e3 * b)]
                                            for a, b in zip(times[v], legs[v])]
            res[f"vllm.decode_leg_p50_ms.{v}"] = 1e3 * statistics.median(legs[v])
            res[f"vllm.ttft_p50_ms.{v}"] = 1e3 * p50[v]
            res[f"vllm.ttft_p90_ms.{v}"] = 1e3 * p90[v]
        return res
    finally:
        for d in doors.values():
            d.close()
        for s in srv.values():
            s.stop()
        boot.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="fewer, shorter conversations")
    a = ap.parse_args()
    res = run(a.quick)
    text = json.dumps(res, indent=1, sort_keys=True)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    return 0 if res["vllm.outputs_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
