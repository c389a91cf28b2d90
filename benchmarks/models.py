"""Model families through pdxfer and vLLM's NixlConnector: token-exactness, TTFT, bytes moved."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.common.vllm_bench import NIXL_SHIM, pct, root_cause, stream_request, tokens
from benchmarks.common.vllm_proxy import FrontDoor
from pdxfer import BootstrapServer
from pdxfer.serving.procs import Proc
from pdxfer.serving.vllm.servers import (
    ServerNotReady,
    VllmServer,
    kv_config,
    nixl_connector,
    read_stats,
    start_all,
)
from tests.harness.hf_families import FAMILIES, build_family

ROOT = Path(__file__).resolve().parent
BS, MAX_LEN, MAX_TOKENS, TIMEOUT = 32, 4096, 8, 300.0
VARIANTS = ("pdxfer", "nixl")


def _server(
    fam: str, model: Path, tmp: Path, name: str, cfg: str, env: dict[str, str] | None = None
) -> VllmServer:
    f = FAMILIES[fam]
    return VllmServer(
        name,
        model,
        tmp,
        dtype=f.dtype,
        block_size=BS,
        kv_cache_bytes=512 << 20,
        args=[*f.vllm_args, "--max-model-len", str(MAX_LEN)],
        kv_transfer_config=cfg,
        env=env,
        log_stats=False,
    )


@contextmanager
def pdxfer_pair(fam: str, model: Path, tmp: Path) -> Iterator[tuple[str, str, Callable[[], int]]]:
    """(front door URL, colocated URL, bytes the decode received so far)."""
    boot = BootstrapServer("127.0.0.1", 0).start()
    stats = tmp / "d.json"
    p = _server(
        fam,
        model,
        tmp,
        "p",
        kv_config("kv_producer", {"bootstrap": boot.address, "instance": "p0"}),
    )
    d = _server(
        fam,
        model,
        tmp,
        "d",
        kv_config(
            "kv_consumer", {"bootstrap": boot.address, "instance": "d0", "stats_file": str(stats)}
        ),
    )
    router = None
    try:
        start_all([p, d])
        router = Proc(
            "router",
            [
                "router",
                "--engine",
                "vllm",
                "--port",
                "0",
                "--prefill",
                f"{p.url},{boot.address},p0",
                "--decode",
                f"{d.url},d0",
            ],
            timeout=180,
        )
        yield router.url, p.url, lambda: int(read_stats(stats).get("net_bytes", 0))
    finally:
        try:
            if router is not None:
                router.stop()
        finally:
            for s in (p, d):
                s.stop()
            boot.stop()


@contextmanager
def nixl_pair(fam: str, model: Path, tmp: Path) -> Iterator[tuple[str, str, Callable[[], int]]]:
    """vLLM's NixlConnector on CPU memory, one server started after the other (their side
    channel ports are picked then), behind vLLM's proxy protocol."""
    up: list[VllmServer] = []
    door = None
    try:
        for name, role in (("p", "kv_producer"), ("d", "kv_consumer")):
            cfg, env = nixl_connector(role, NIXL_SHIM)
            up.append(_server(fam, model, tmp, name, cfg, env))
            start_all([up[-1]])
        door = FrontDoor(up[0].url, up[1].url, connector="nixl", timeout=TIMEOUT).start()
        yield door.url, up[0].url, lambda: 0
    finally:
        try:
            if door is not None:
                door.close()
        finally:
            for s in up:
                s.stop()


def phase(
    fam: str, variant: str, model: Path, tmp: Path, prompts: list[list[int]]
) -> dict[str, Any]:
    pair = pdxfer_pair if variant == "pdxfer" else nixl_pair
    t0 = time.monotonic()
    try:
        with pair(fam, model, tmp) as (front, colocated, moved):
            for url in (colocated, front):  # untimed: a fresh server's first request warms it
                stream_request(url, tokens(7, 40), MAX_TOKENS, TIMEOUT, logprobs=0)
            start = moved()
            ttft: list[float] = []
            ref_ttft: list[float] = []
            same = 0
            for i, p in enumerate(prompts):
                order = (colocated, front) if i % 2 == 0 else (front, colocated)
                got = {
                    url: stream_request(url, p, MAX_TOKENS, TIMEOUT, logprobs=0) for url in order
                }
                ttft.append(got[front].ttft)
                ref_ttft.append(got[colocated].ttft)
                same += got[front].ids == got[colocated].ids
            out: dict[str, Any] = {
                "served": 1,
                "token_exact": same / len(prompts),
                "ttft_p50_ms": round(pct(ttft, 0.5) * 1e3, 2),
                "colocated_ttft_p50_ms": round(pct(ref_ttft, 0.5) * 1e3, 2),
                "ttft_ratio_vs_colocated": round(pct(ttft, 0.5) / pct(ref_ttft, 0.5), 3),
            }
            if variant == "pdxfer":
                time.sleep(1.0)  # the decode's stats file is rewritten after its last load
                out["bytes_per_request"] = (moved() - start) // len(prompts)
    except ServerNotReady as e:
        log = next((s for s in tmp.glob("*.log")), None)
        out = {"served": 0, "error": (root_cause(log) if log else "") or str(e)[:300]}
    except Exception as e:  # noqa: BLE001 - one family's failure is a finding, not the end
        out = {"served": 0, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def run(a: argparse.Namespace) -> dict[str, Any]:
    fams = a.families.split(",") if a.families else sorted(FAMILIES)
    variants = a.variants.split(",")
    lengths = [300] if a.quick else [512, 2048]
    reps = 2 if a.quick else 4
    prompts = [tokens(100 + k, n) for n in lengths for k in range(reps)]
    res: dict[str, Any] = {"models.prompt_tokens": lengths, "models.requests": len(prompts)}
    with tempfile.TemporaryDirectory(prefix="pdxfer-bench-models-") as d:
        for fam in fams:
            model = build_family(Path(d) / fam / "model", fam)
            for v in variants:
                tmp = Path(d) / fam / v
                tmp.mkdir(parents=True)
                print(f"[bench_models] {fam} {v}", file=sys.stderr, flush=True)
                res.update(
                    {
                        f"models.{fam}.{v}.{k}": x
                        for k, x in phase(fam, v, model, tmp, prompts).items()
                    }
                )
    for v in variants:
        res[f"models.served.{v}"] = sorted(
            f for f in fams if res.get(f"models.{f}.{v}.token_exact") == 1
        )
    return res


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--families", default="", help=f"comma-separated, of {sorted(FAMILIES)}")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="pdxfer, nixl")


def main(a: argparse.Namespace) -> dict[str, Any]:
    bad = [v for v in a.variants.split(",") if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variants {bad}")
    return run(a)


if __name__ == "__main__":
    from benchmarks.common import runner

    sys.exit(runner.run(sys.modules[__name__]))
