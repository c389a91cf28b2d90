"""``scripts/gpu_check.sh``'s stream step: the toy engine's time to first token with layer
streaming on one device, against a colocated toy on the same device.

PD: a toy prefill and a toy decode worker computing on ``--device`` (``--torch-device``: two
processes on one GPU, their KV pools registered with the transport as device memory) behind
``pdxfer router``; the prefill sends each layer's KV as its forward writes it (a TP 1 toy
prefill always streams by layer: ``pdxfer.prefill_layer_sends`` counts the sends). Colocated:
in this process, the same model on the same device computes the same prompt in the same
chunks with the same draft pass per chunk (what the prefill worker computes before its first
token), with no transfer and no HTTP: the strictest reference. Per round and size, a fresh
prompt goes to colocated, then to PD (interleaved: both see the same machine state); the PD
TTFT is the client's time to the first streamed token through the router. Every PD output
must equal colocated's token for token. A warm-up request first (kernels, the transport's
handshake). The step writes its JSON after every measurement, stops starting rounds once
``--budget-s`` is spent, and on SIGTERM stops its workers and keeps what it measured.

    python scripts/gpu_stream.py --device cuda:0 --json OUT.json [--sizes 2048,8192]

Keys (``<L>``: a size as ``2k``, ``8k``, or its token count): ``ttft_ms_pd_<L>``,
``ttft_ms_colocated_<L>`` (medians over the rounds), ``ttft_ratio_vs_colocated_<L>`` (the
issue's goal at 8k: at most 1.10), ``pd_prefill_ms_<L>`` (the router's prefill leg),
``pd_kv_wait_ms_<L>`` (the decode's wait from its KV request to the last layer),
``pd_layer_sends_<L>``, ``rounds_<L>``; ``mismatches``, ``outputs_compared``, ``errors``,
``transport`` (the first of ``--transport`` whose cluster served the warm-up), ``startup_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pdxfer.serving.toy.cluster import Cluster  # noqa: E402
from pdxfer.serving.toy.model import ToyModel, make_draft  # noqa: E402
from pdxfer.serving.toy.worker import WorkerConfig  # noqa: E402

PAGE = 16


def label(n: int) -> str:
    """A prompt size in keys: ``2k`` for 2048 tokens, the count itself when not whole KiB."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


class Colocated:
    """The toy the workers run, on the same device, in this process: prefill in chunks with
    the draft pass after each (as ``prefill.py`` computes it), then greedy decode steps."""

    def __init__(self, device: str, max_seq_len: int, chunk: int, pages: int) -> None:
        cfg = WorkerConfig(
            role="prefill",
            bootstrap="127.0.0.1:1",
            max_seq_len=max_seq_len,
            page_size=PAGE,
            chunk_size=chunk,
            torch_device=device,
        )
        self.model = ToyModel(cfg.toy(), device=device)
        self.draft = make_draft(self.model)
        self.kv = self.model.new_kv_pool(pages)
        self.draft_kv = self.draft.new_kv_pool(pages, allocator=self.kv.allocator)
        self.chunk = chunk

    def run(self, tokens: list[int], answer: int) -> tuple[float, list[int]]:
        """Seconds to the first token, and the ``answer`` tokens."""
        m, d = self.model, self.draft
        pt = self.kv.allocator.alloc(m.pages_for(len(tokens) + answer))
        try:

            def on_chunk(a: int, b: int) -> None:
                d.forward(tokens[a:b], a, pt, self.draft_kv, logits_for="none")

            t0 = time.perf_counter()
            out = [m.prefill(tokens, pt, self.kv, chunk_size=self.chunk, on_chunk=on_chunk)]
            ttft = time.perf_counter() - t0
            while len(out) < answer:
                out.append(m.decode_step(out[-1], len(tokens) + len(out) - 1, pt, self.kv))
            return ttft, out
        finally:
            self.kv.allocator.free(pt)


def stream(url: str, tokens: list[int], answer: int, timeout: float) -> tuple[float, dict]:
    """One streamed completion through the router: seconds to the first token event, and the
    last event's ``pdxfer`` extension (token ids, the prefill's leg and layer sends)."""
    body = {
        "model": "toy",
        "prompt": tokens,
        "max_tokens": answer,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 0,
    }  # logprobs: every token shows
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    first, ext = 0.0, {}
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(f"stream error: {ev['error']}")
            if not first:
                first = time.perf_counter() - t0
            if "pdxfer" in ev:
                ext = ev["pdxfer"]
    if not first or not ext:
        raise RuntimeError("the stream ended without a token or without its summary")
    return first, ext


class Run:
    """The step's results, written to ``path`` after every change (a timeout keeps them)."""

    def __init__(self, path: Path | None, base: dict[str, Any]) -> None:
        self.path, self.res = path, dict(base)
        self.samples: dict[str, list[float]] = {}

    def add(self, key: str, value: float) -> None:
        self.samples.setdefault(key, []).append(value)
        self.res[key] = round(statistics.median(self.samples[key]), 2)

    def save(self) -> None:
        if self.path is not None:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.res, indent=1, sort_keys=True, default=str))
            os.replace(tmp, self.path)


def cluster(a: argparse.Namespace, transport: str, pages: int) -> Cluster:
    worker = [
        "--torch-device",
        a.device,
        "--transport",
        transport,
        "--pages",
        str(pages),
        "--max-seq-len",
        str(a.max_seq_len),
        "--page-size",
        str(PAGE),
        "--chunk-size",
        str(a.chunk_size),
        "--l2-pages",
        "0",  # every prompt computed
        "--heartbeat",
        "2",
        "--bootstrap-timeout",
        "60",
        "--transfer-timeout",
        "300",
        "--admission-timeout",
        "60",
    ]
    return Cluster(
        worker_args=worker,
        decode_args=["--no-l3", "--integrity", "sampled"],
        router_args=["--timeout", "300"],
        timeout=120.0,
    )  # stats exposed


def measure(a: argparse.Namespace, run: Run) -> None:
    res = run.res
    rng = np.random.default_rng(a.seed)
    prompt = lambda n: rng.integers(32, 127, n).tolist()  # noqa: E731 - printable bytes
    pages = 2 * -(-a.max_seq_len // PAGE) + 8
    t0 = time.monotonic()
    colo = Colocated(a.device, a.max_seq_len, a.chunk_size, pages)
    warm = prompt(min(a.sizes[0], 64))
    colo.run(warm, a.answer)  # the device's kernels, once
    deadline = a.deadline

    def compare(n: int, want: list[int], ext: dict[str, Any]) -> None:
        res["outputs_compared"] += 1
        if ext.get("token_ids") != want:
            res["mismatches"] += 1
            res["errors"].append(f"{n} tokens: PD {ext.get('token_ids')} != colocated {want}")

    for transport in a.transport.split(","):
        try:
            with cluster(a, transport, pages) as c:
                assert c.router is not None
                res["startup_s"] = round(time.monotonic() - t0, 2)
                _, want = colo.run(warm, a.answer)
                _, ext = stream(c.router.url, warm, a.answer, 45)
                compare(len(warm), want, ext)
                res["transport"] = transport
                run.save()
                for rnd in range(a.rounds):
                    r0 = time.monotonic()
                    for n in a.sizes:
                        k, toks = label(n), prompt(n)
                        ttft, want = colo.run(toks, a.answer)
                        run.add(f"ttft_ms_colocated_{k}", 1e3 * ttft)
                        left = deadline - time.monotonic()
                        ttft, ext = stream(c.router.url, toks, a.answer, max(left, 30) + 60)
                        run.add(f"ttft_ms_pd_{k}", 1e3 * ttft)
                        run.add(f"pd_prefill_ms_{k}", 1e3 * float(ext.get("prefill_s") or 0))
                        run.add(f"pd_kv_wait_ms_{k}", 1e3 * float(ext.get("kv_wait_s") or 0))
                        res[f"pd_layer_sends_{k}"] = ext.get("prefill_layer_sends", 0)
                        res[f"rounds_{k}"] = rnd + 1
                        res[f"tokens_{k}"] = n
                        res[f"ttft_ratio_vs_colocated_{k}"] = round(
                            res[f"ttft_ms_pd_{k}"] / res[f"ttft_ms_colocated_{k}"], 4
                        )
                        compare(n, want, ext)
                        run.save()
                    spent = time.monotonic() - r0
                    if rnd + 1 < a.rounds and time.monotonic() + spent > deadline:
                        res["stopped"] = f"after round {rnd + 1}: --budget-s {a.budget_s} spent"
                        break
            return
        except Exception as e:  # noqa: BLE001 - recorded; the next transport is tried
            res["errors"].append(f"{transport}: {type(e).__name__}: {e}")
            run.save()
            if "transport" in res:  # it served: a failure mid-run is the verdict
                return


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda:0", help="the torch device of both sides")
    ap.add_argument(
        "--transport",
        default="nixl,tcp",
        help="worker transports to try in order, the first that serves is used",
    )
    ap.add_argument("--sizes", default="2048,8192", help="prompt sizes in tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--answer", type=int, default=8, help="tokens generated per request")
    ap.add_argument("--chunk-size", type=int, default=64, help="the prefill's chunk")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=100.0,
        help="seconds from the start: no round starts that would end past them, "
        "by the last round's time (the first always runs)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the step's result here")
    a = ap.parse_args(argv)
    a.sizes = [int(x) for x in a.sizes.split(",")]
    a.max_seq_len = max(a.sizes) + a.answer + 64
    torch.set_num_threads(1)  # as the workers (--threads 1)
    t0 = time.monotonic()
    a.deadline = t0 + a.budget_s
    run = Run(
        a.json,
        {
            "sizes": a.sizes,
            "rounds": a.rounds,
            "answer_tokens": a.answer,
            "chunk_size": a.chunk_size,
            "torch_device": a.device,
            "mismatches": 0,
            "outputs_compared": 0,
            "errors": [],
            "ok": False,
        },
    )
    run.save()

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds the cluster: its workers stop by pid

    signal.signal(signal.SIGTERM, stop)
    res = run.res
    try:
        measure(a, run)
    except SystemExit:
        res["errors"].append("stopped by SIGTERM (the step's limit)")
    finally:
        ks = [label(n) for n in a.sizes]
        res["ok"] = (
            not res["errors"]
            and res["mismatches"] == 0
            and all(f"ttft_ratio_vs_colocated_{k}" in res for k in ks)
            and all(res.get(f"pd_layer_sends_{k}", 0) > 0 for k in ks)
        )
        res["wall_s"] = round(time.monotonic() - t0, 2)
        run.save()
        print(json.dumps(res, indent=1, sort_keys=True, default=str))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    sys.exit(main())
