"""``pdxfer demo --engine vllm``: real vLLM behind pdxfer's router, checked token for token.

Builds a small Llama here (``local_model``: no download), starts a bootstrap server, a ``vllm
serve`` prefill and decode each loading ``PdxferConnector``, a colocated ``vllm serve`` without
a connector as the reference, and ``pdxfer router --engine vllm`` in front of the pair, which
dispatches both sides at once (the decode asks while the prefill computes and streams each
layer; the summary counts each request's dispatch as the router reported it). A batch
of prompts (some sharing a long prefix) goes through the router; the decode restores a prefix
it served before from its L2 and receives only the rest. Then the decode is restarted (its L2
is gone, its L3 files are not) and prompts with those prefixes are restored from L3. Every
output must equal the colocated reference's; the exit status is 0 only then.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdxfer import BootstrapServer
from pdxfer.serving.cli_args import add_field_args
from pdxfer.serving.procs import Proc
from pdxfer.serving.toy.cluster import post
from pdxfer.setting import setting as setting_field
from pdxfer.setting import settings_of

from .local_model import CORPUS, build_model
from .servers import VllmServer, kv_config, read_stats, start_all

PREFILL, DECODE = "demo-prefill", "demo-decode"
WORDS = CORPUS.split()


@dataclass(frozen=True, slots=True)
class VllmDemoOptions:
    """The options of ``pdxfer demo --engine vllm`` (its flags are generated from these
    fields)."""

    requests: int = setting_field(12, "requests in the first batch")
    max_tokens: int = setting_field(12, "tokens generated per request")
    concurrency: int = setting_field(4, "requests in flight")
    seed: int = setting_field(0, "prompt seed")
    stream: bool = setting_field(False, "use SSE streaming responses")
    no_restart: bool = setting_field(False, "skip the decode restart (and the L3 round after it)")
    keep: bool = setting_field(
        False, "keep the model, vLLM logs and L3 folder (printed at the end)"
    )


def parser() -> argparse.ArgumentParser:
    """The options of ``pdxfer demo --engine vllm``."""
    ap = argparse.ArgumentParser(
        prog="pdxfer demo --engine vllm", description=__doc__.split("\n")[0]
    )
    add_field_args(ap, VllmDemoOptions, *settings_of(VllmDemoOptions))
    return ap


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser()
    a = ap.parse_args(argv)
    if a.requests < 1 or a.max_tokens < 1 or a.concurrency < 1:
        ap.error("--requests, --max-tokens and --concurrency must be positive")
    return a


def make_prompts(n: int, seed: int, groups: int = 3) -> list[str]:
    """``n`` prompts; two in three share one of ``groups`` long prefixes (~200 tokens)."""
    rng = random.Random(seed)
    prefixes = [
        " ".join(WORDS[(97 * g + i) % len(WORDS)] for i in range(160)) for g in range(groups)
    ]
    out = []
    for i in range(n):
        tail = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14)))
        out.append(
            f"Request {i}: {tail}"
            if i % 3 == 2
            else f"{prefixes[i % groups]}\nQuestion {i}: {tail}?"
        )
    return out


def _ask(url: str, prompt: str, a: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    status, body = post(
        f"{url}/v1/completions",
        {
            "model": "llama",
            "prompt": prompt,
            "max_tokens": a.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": a.stream,
            "stream_options": {"include_usage": True} if a.stream else None,
        },
        timeout=300,
    )
    wall = time.perf_counter() - t0
    if status != 200:
        return {"ok": False, "error": f"HTTP {status}: {body}", "wall": wall}
    if a.stream:
        errors = [e for e in body if "error" in e]
        final = next((e for e in body if "pdxfer" in e), None)
        if errors or final is None:
            return {
                "ok": False,
                "error": str(errors[0] if errors else "no final chunk"),
                "wall": wall,
            }
        usage: dict[str, Any] = next((e["usage"] for e in body if e.get("usage")), {})
        return {
            "ok": True,
            "ids": final["pdxfer"]["token_ids"],
            "info": final["pdxfer"],
            "text": "".join(e["choices"][0]["text"] for e in body if e.get("choices")),
            "prompt_tokens": usage.get("prompt_tokens"),
            "wall": wall,
        }
    return {
        "ok": True,
        "ids": body["pdxfer"]["token_ids"],
        "info": body["pdxfer"],
        "text": body["choices"][0]["text"],
        "prompt_tokens": body["usage"]["prompt_tokens"],
        "wall": wall,
    }


def _reference(url: str, prompt: str, max_tokens: int) -> tuple[list[int], str]:
    status, body = post(
        f"{url}/v1/completions",
        {
            "model": "llama",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        timeout=300,
    )
    assert status == 200, f"the colocated reference failed: {body}"
    return list(body["choices"][0]["token_ids"]), body["choices"][0]["text"]


def _send(url: str, prompts: list[str], a: argparse.Namespace) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(a.concurrency) as pool:
        return list(pool.map(lambda p: _ask(url, p, a), prompts))


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    tty = sys.stdout.isatty()
    green, red, off = ("\033[32m", "\033[31m", "\033[0m") if tty else ("", "", "")
    prompts = make_prompts(a.requests, a.seed)
    later = [] if a.no_restart else [p for p in make_prompts(6, a.seed + 1000) if "\n" in p]
    tmp = Path(tempfile.mkdtemp(prefix="pdxfer-vllm-demo-"))
    p_stats, d_stats = tmp / "prefill.json", tmp / "decode.json"
    print(f"building a small Llama in {tmp / 'model'} (seeded, no download) ...", flush=True)
    model = build_model(tmp / "model", "small")
    boot = BootstrapServer("127.0.0.1", 0).start()
    p_extra = {"bootstrap": boot.address, "instance": PREFILL, "stats_file": str(p_stats)}
    d_extra = {
        "bootstrap": boot.address,
        "instance": DECODE,
        "stats_file": str(d_stats),
        "l2_pages": 512,
        "l3": "file",
        "l3_dir": str(tmp / "l3"),
    }
    prefill = VllmServer(
        "prefill", model, tmp, start=False, kv_transfer_config=kv_config("kv_producer", p_extra)
    )

    def decode_server(port: int | None = None) -> VllmServer:
        return VllmServer(
            "decode",
            model,
            tmp,
            port=port,
            start=False,
            args=["--no-enable-prefix-caching"],  # prefixes come from pdxfer L2/L3
            kv_transfer_config=kv_config(
                "kv_consumer", d_extra, kv_load_failure_policy="recompute"
            ),
        )

    decode = decode_server()
    ref = VllmServer("colocated", model, tmp, start=False)
    servers = [prefill, decode, ref]
    router: Proc | None = None
    print(
        "starting vllm serve: prefill and decode with PdxferConnector, and a colocated "
        f"reference (logs in {tmp}; about a minute) ...",
        flush=True,
    )
    try:
        for s in servers:
            s.start()
        start_all(servers)
        router = Proc(
            "router",
            [
                "router",
                "--engine",
                "vllm",
                "--port",
                "0",
                "--prefill",
                f"{prefill.url},{boot.address},{PREFILL}",
                "--decode",
                f"{decode.url},{DECODE}",
                "--expose-cache-stats",
            ],
            timeout=180,
        )
        print(f"router on {router.url}; sending {len(prompts)} requests ...", flush=True)
        t0 = time.perf_counter()
        results = _send(router.url, prompts, a)
        total = time.perf_counter() - t0
        first = read_stats(d_stats)
        if later:
            print("restarting the decode: its L2 is gone, its L3 is not ...", flush=True)
            decode.stop()
            decode = servers[1] = decode_server(decode.port)
            decode.start().wait_ready()
            with urllib.request.urlopen(f"{router.url}/health", timeout=30) as r:
                r.read()
            results += _send(router.url, later, a)
        print("checking against the colocated reference ...", flush=True)
        refs = [_reference(ref.url, p, a.max_tokens) for p in prompts + later]
        last = read_stats(d_stats)
        pst = read_stats(p_stats)
        sent = pst.get("endpoint", {}).get("transport_bytes", 0)
    except KeyboardInterrupt:
        print("\ninterrupted; processes stopped", file=sys.stderr)
        return 130
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            s.stop()
        boot.stop()
    print(
        f"\n{'req':>4} {'prompt':>6} {'output':>6} {'prefill ms':>10} "
        f"{'decode TTFT ms':>14} {'wall ms':>8}  verdict"
    )
    bad = 0
    for i, (r, (want, text)) in enumerate(zip(results, refs)):
        if i == len(prompts):
            print("     --- after the decode restart ---")
        if not r["ok"]:
            bad += 1
            print(
                f"{i:>4} {'-':>6} {'-':>6} {'-':>10} {'-':>14} {r['wall'] * 1e3:>8.0f}  "
                f"{red}FAILED{off} {r['error']}"
            )
            continue
        same = r["ids"] == want and r["text"] == text
        bad += not same
        inf = r["info"]
        print(
            f"{i:>4} {r['prompt_tokens'] or 0:>6} {len(r['ids']):>6} "
            f"{(inf.get('prefill_s') or 0) * 1e3:>10.0f} "
            f"{(inf.get('decode_ttft_s') or 0) * 1e3:>14.0f} {r['wall'] * 1e3:>8.0f}  "
            + (f"{green}identical{off}" if same else f"{red}MISMATCH{off}")
        )
    l2 = first.get("restored_l2_pages", 0)
    l3 = last.get("restored_l3_pages", 0) if later else first.get("restored_l3_pages", 0)
    print(
        f"\n{len(results) - bad}/{len(results)} outputs identical to colocated vLLM; "
        f"blocks restored on the decode from L2: {l2}, from L3 after the restart: {l3}; "
        f"KV bytes the prefill sent: {sent}; {total:.1f} s for the first batch"
    )
    print(
        f"KV streamed layer by layer from the prefill: {pst.get('layer_sends', 0)} layer "
        f"hand-offs (send_by: layer: inside the forward once a decode asked, else one "
        f"after it) for {pst.get('sends', 0)} requests"
    )
    modes = Counter(r["info"].get("dispatch", "unknown") for r in results if r["ok"])
    print(
        "dispatch: "
        + ", ".join(f"{m} for {n}/{len(results)} requests" for m, n in sorted(modes.items()))
        + " (concurrent: the decode engaged at dispatch, asking while the prefill computes)"
    )
    if a.keep:
        print(f"kept: {tmp}")
    else:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    if bad:
        print(f"{red}FAIL{off}: {bad} request(s) failed or differ")
        return 1
    print(f"{green}PASS{off}")
    return 0
