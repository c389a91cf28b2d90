"""``pdxfer demo``: serve a batch through router -> prefill -> decode on loopback and check
every output token for token against the colocated reference.

Some prompts share a long prefix: once one of them finished, the decode restores that prefix
from its L2 (host DRAM) and the prefill reuses what it computed and ships only the rest (fewer
bytes, shorter TTFT), while the tokens stay identical. Then the decode is restarted: its L2
is gone, and a few more prompts with those prefixes are restored from L3 (files, or Mooncake
Store with ``--l3 mooncake``). Exit status is 0 only if every request succeeded and matched.

``pdxfer bench`` runs the same cluster and prints throughput and latency as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Literal

import torch

from pdxfer.setting import setting as setting_field
from pdxfer.setting import settings_of

from ..cli_args import add_field_args
from .cluster import Cluster
from .config import Landing
from .model import EOS_ID, ToyConfig, ToyModel, encode, make_draft, speculative_generate

WORDS = [
    "kv",
    "cache",
    "prefill",
    "decode",
    "page",
    "token",
    "layer",
    "head",
    "router",
    "room",
    "transfer",
    "bootstrap",
    "mooncake",
    "engine",
    "batch",
    "prefix",
    "draft",
    "verify",
    "stream",
    "chunk",
]


def make_prompts(
    n: int, seed: int, prefix_words: int = 60, groups: int = 3, share: int | None = None
) -> list[str]:
    """``n`` prompts: about two thirds share one of ``groups`` long prefixes (those of
    ``make_prompts(..., seed=share)`` when given: a later round of the same conversations)."""
    prng = random.Random(seed if share is None else share)
    prefixes = [" ".join(prng.choice(WORDS) for _ in range(prefix_words)) for _ in range(groups)]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tail = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        if i % 3 == 2:
            out.append(f"request {i}: {tail}")
        else:
            out.append(f"{prefixes[i % groups]} | question {i}: {tail}")
    return out


def reference(cfg: ToyConfig, prompt: str, max_tokens: int, spec_k: int) -> list[int]:
    """The colocated greedy output, ending before EOS as a served request does."""
    model = ToyModel(cfg)
    if spec_k:
        out = speculative_generate(
            model, make_draft(model), encode(prompt), max_tokens, k=spec_k
        ).tokens
    else:
        out = model.generate(encode(prompt), max_tokens)
    return out[: out.index(EOS_ID)] if EOS_ID in out else out


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """The options of ``pdxfer demo`` and ``pdxfer bench`` (their flags are generated from
    these fields)."""

    requests: int = setting_field(24, "requests in the first batch")
    max_tokens: int = setting_field(16, "tokens generated per request")
    concurrency: int = setting_field(4, "requests in flight")
    spec_k: int = setting_field(0, "speculative decoding draft length")
    seed: int = setting_field(0, "prompt seed")
    stream: bool = setting_field(False, "use SSE streaming responses")
    l3: Literal["file", "mooncake"] = setting_field(
        "file",
        "the decode's L3: files in a fresh folder, or Mooncake Store (a "
        "mooncake_master started for the demo)",
    )
    landing: Landing = setting_field(
        "device", "host: the decode lands KV in a token-granular host pool"
    )
    prefill_tp: int = setting_field(
        1, "tensor-parallel ranks of the prefill (its KV heads split over them)"
    )
    decode_tp: int = setting_field(
        1, "tensor-parallel ranks of the decode (any size the prefill's divides or that divides it)"
    )
    no_restart: bool = setting_field(False, "skip the decode restart (and the L3 round after it)")
    log_level: str = setting_field("ERROR", "log level of the child processes")
    verbose: bool = setting_field(False, "show the children's stderr")


def parser(prog: str) -> argparse.ArgumentParser:
    """The options of ``pdxfer demo`` and ``pdxfer bench``."""
    ap = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n")[0],
        epilog="pdxfer demo --engine vllm [--help]: the same path "
        "on real vLLM (needs the vllm extra)",
    )
    add_field_args(ap, DemoOptions, *settings_of(DemoOptions))
    return ap


def _args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    ap = parser(prog)
    a = ap.parse_args(argv)
    if a.requests < 1 or a.max_tokens < 1 or a.concurrency < 1:
        ap.error("--requests, --max-tokens and --concurrency must be positive")
    if a.prefill_tp < 1 or a.decode_tp < 1:
        ap.error("--prefill-tp and --decode-tp must be positive")
    return a


def _one(c: Cluster, prompt: str, a: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    status, body = c.complete(
        {
            "prompt": prompt,
            "max_tokens": a.max_tokens,
            "temperature": 0,
            "stream": a.stream,
            "speculative_k": a.spec_k,
        }
    )
    wall = time.perf_counter() - t0
    if status != 200:
        return {"ok": False, "error": f"HTTP {status}: {body}", "wall": wall}
    if a.stream:
        err = [e for e in body if "error" in e]
        if err:
            return {"ok": False, "error": str(err[0]["error"]), "wall": wall}
        final = next((e for e in body if "pdxfer" in e), None)
        if final is None:
            return {"ok": False, "error": "no final chunk in the stream", "wall": wall}
        ids = final["pdxfer"]["token_ids"]
        text = "".join(e["choices"][0]["text"] for e in body if e.get("choices"))
        if text != detok_text(ids):
            return {"ok": False, "error": "streamed text differs from its tokens", "wall": wall}
    else:
        final = body
        ids = body["pdxfer"]["token_ids"]
    return {"ok": True, "ids": ids, "info": final["pdxfer"], "wall": wall}


def detok_text(ids: list[int]) -> str:
    return bytes(t for t in ids if 0 <= t < 256).decode("utf-8", errors="replace")


def _install_sigterm() -> None:
    def on_term(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)


class _L3:
    """What ``--l3`` needs running beside the cluster: nothing for files; for Mooncake a
    master and a client holding the store's memory, so objects outlive a decode restart."""

    def __init__(self, kind: str) -> None:
        self.kind, self.master, self.holder = kind, None, None
        if kind == "mooncake":
            from pdxfer.tiers import MooncakeMaster, MooncakeStoreStorage

            self.master = MooncakeMaster()
            self.holder = MooncakeStoreStorage(
                self.master.master_addr, self.master.metadata_url, segment_bytes=512 << 20
            )

    def decode_args(self) -> list[str]:
        if self.master is None:
            return []
        return [
            "--l3-mooncake",
            self.master.master_addr,
            "--l3-mooncake-metadata",
            self.master.metadata_url,
            "--l3-mooncake-segment-mb",
            "0",
        ]

    def close(self) -> None:
        if self.holder is not None:
            self.holder.close()
        if self.master is not None:
            self.master.stop()


def _send(c: Cluster, prompts: list[str], a: argparse.Namespace, tty: bool) -> list[dict[str, Any]]:
    results: list[dict[str, Any] | None] = [None] * len(prompts)
    with ThreadPoolExecutor(a.concurrency) as pool:
        futs = {pool.submit(_one, c, p, a): i for i, p in enumerate(prompts)}
        for done, f in enumerate(as_completed(futs), 1):
            results[futs[f]] = f.result()
            if tty:
                print(f"\r  {done}/{len(prompts)} done", end="", flush=True)
            elif done % 8 == 0 or done == len(prompts):
                print(f"  {done}/{len(prompts)} done", flush=True)
    print(flush=True)
    return [r for r in results if r is not None]


def main(argv: list[str] | None = None) -> int:
    a = _args(argv, "pdxfer demo")
    _install_sigterm()
    tty = sys.stdout.isatty()
    green, red, off = ("\033[32m", "\033[31m", "\033[0m") if tty else ("", "", "")
    prompts = make_prompts(a.requests, a.seed)
    later = [] if a.no_restart else make_prompts(6, a.seed + 1000, groups=3, share=a.seed)
    # one per conversation: two requests for one prefix at once would share one L3 prefetch
    later = list({p.split(" | ")[0]: p for p in later if " | " in p}.values())
    print(
        f"starting bootstrap, prefill (TP {a.prefill_tp}), decode (TP {a.decode_tp}) and "
        f"router on 127.0.0.1 (toy model, {a.requests} requests, {a.max_tokens} tokens "
        f"each, L3 {a.l3}, {a.landing} landing) ...",
        flush=True,
    )
    l3: _L3 | None = None
    try:
        l3 = _L3(a.l3)
        dargs = [*l3.decode_args(), "--kv-landing", a.landing, "--tp", str(a.decode_tp)]
        with Cluster(
            log_level=a.log_level,
            quiet=not a.verbose,
            decode_args=dargs,
            prefill_args=["--tp", str(a.prefill_tp)],
        ) as c:
            assert c.router is not None
            print(f"router on {c.router.url}; sending ...", flush=True)
            t0 = time.perf_counter()
            results = _send(c, prompts, a, tty)
            total = time.perf_counter() - t0
            if later:
                print("restarting the decode: its L2 is gone, its L3 is not ...", flush=True)
                c.restart_decode()
                results += _send(c, later, a, tty)
    except KeyboardInterrupt:
        print("\ninterrupted; processes stopped", file=sys.stderr)
        return 130
    finally:
        if l3 is not None:
            l3.close()
    print("checking against the colocated reference ...", flush=True)
    torch.set_num_threads(1)  # tiny ops: extra threads only spin (and sums do not depend on it)
    cfg = ToyConfig()
    everything = prompts + later
    refs = [reference(cfg, p, a.max_tokens, a.spec_k) for p in everything]
    print(
        f"\n{'req':>4} {'prompt':>7} {'L2':>5} {'L3':>5} {'reused':>7} {'KV bytes':>10} "
        f"{'TTFT ms':>8} {'wall ms':>8}  verdict"
    )
    bad = 0
    for i, (r, ref) in enumerate(zip(results, refs)):
        if i == len(prompts):
            print("     --- after the decode restart ---")
        n = len(encode(everything[i]))
        if not r["ok"]:
            bad += 1
            print(
                f"{i:>4} {n:>7} {'-':>5} {'-':>5} {'-':>7} {'-':>10} {'-':>8} "
                f"{r['wall'] * 1e3:>8.0f}  {red}FAILED{off} {r['error']}"
            )
            continue
        same = r["ids"] == ref
        bad += not same
        inf = r["info"]
        print(
            f"{i:>4} {n:>7} {inf.get('restored_l2_tokens', 0):>5} "
            f"{inf.get('restored_l3_tokens', 0):>5} {inf.get('prefill_reused_tokens', 0):>7} "
            f"{inf['bytes']:>10} {(inf['decode_ttft_s'] or 0) * 1e3:>8.1f} "
            f"{r['wall'] * 1e3:>8.0f}  "
            + (f"{green}identical{off}" if same else f"{red}MISMATCH{off}")
        )
    ok = [r["info"] for r in results if r["ok"]]
    print(
        f"\n{len(everything) - bad}/{len(everything)} outputs identical to the colocated "
        f"reference; prompt tokens restored on the decode from L2: "
        f"{sum(i.get('restored_l2_tokens', 0) for i in ok)}, from L3: "
        f"{sum(i.get('restored_l3_tokens', 0) for i in ok)}; reused on the prefill: "
        f"{sum(i.get('prefill_reused_tokens', 0) for i in ok)}; {total:.1f} s for the batch"
    )
    streamed = [i["prefill_layer_sends"] for i in ok if i.get("prefill_layer_sends")]
    print(
        f"KV streamed layer by layer from the prefill: {len(streamed)}/{len(ok)} requests, "
        f"{sum(streamed)} layer hand-offs (each layer of a chunk went to the decode while "
        f"the prefill computed the next)"
    )
    if bad:
        print(f"{red}FAIL{off}: {bad} request(s) failed or differ")
        return 1
    print(f"{green}PASS{off}")
    return 0


def bench(argv: list[str] | None = None) -> int:
    """Serving latency/throughput through the router, as one JSON line."""
    a = _args(argv, "pdxfer bench")
    _install_sigterm()
    prompts = make_prompts(a.requests, a.seed)
    with Cluster(log_level=a.log_level, quiet=not a.verbose) as c:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(a.concurrency) as pool:
            res = list(pool.map(lambda p: _one(c, p, a), prompts))
        total = time.perf_counter() - t0
    ok = [r for r in res if r["ok"]]
    ttft = sorted(r["info"]["decode_ttft_s"] for r in ok)
    walls = sorted(r["wall"] for r in ok)

    def pct(xs: list[float], q: float) -> float | None:
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4) if xs else None

    print(
        json.dumps(
            {
                "requests": len(prompts),
                "ok": len(ok),
                "seconds": round(total, 3),
                "requests_per_s": round(len(ok) / total, 3),
                "tokens_per_s": round(sum(len(r["ids"]) for r in ok) / total, 1),
                "ttft_p50_s": pct(ttft, 0.5),
                "ttft_p99_s": pct(ttft, 0.99),
                "latency_p50_s": pct(walls, 0.5),
                "latency_p99_s": pct(walls, 0.99),
                "kv_bytes": sum(r["info"]["bytes"] for r in ok),
                "restored_tokens": sum(r["info"]["restored_tokens"] for r in ok),
            }
        )
    )
    return 0 if len(ok) == len(prompts) else 1
