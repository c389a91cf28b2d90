"""A prefill and a decode of different ``--block-size`` on real vLLM, both ways (32 -> 64
and 64 -> 32), through ``pdxfer router --engine vllm`` with the official client: a plain
Llama (float32, the connector's one-pool path), Gemma 3 (float32: a full group beside
sliding-window groups) and DeepSeek-V2 (MLA, bf16); and Qwen3-Next with prefix caching on
the prefill and off on the decode, which vLLM then gives state groups of 544 and 4,096
tokens (bf16).

Per shape, one module start: a prefill and a decode at each block size, and one router per
direction. The reference is a prefill serving the prompt itself (colocated vLLM, same
weights and kernels). float32 answers equal it token for token. bf16 answers are judged as
the families module judges them: every byte the decode loaded equals the prefill's
(``integrity: full``), and the answer is colocated's where colocated computes the prompt's
last token as the decode does (Qwen3-Next: prompts of k blocks + 1 in one-block chunks).
vLLM's CPU MLA without AMX computes a prompt in one step (no chunks, no prefix cache), so no
colocated computation is a DeepSeek-V2 decode's: there the bytes are the judge, and where
they sit in a block of either size is vLLM's own write (``test_vllm_tiles``). No load may
fail: a recomputed request would give the right answer without pdxfer having moved anything.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pdxfer import BootstrapServer
from pdxfer.demo.hf_model import build_model
from pdxfer.demo.vllm_procs import VllmServer, kv_config, read_stats, start_all
from pdxfer.serving.procs import Proc
from tests.harness.hf_families import FAMILIES, WINDOW, build_family

from .vllm_helpers import complete, stream_ids, wait

pytestmark = pytest.mark.timeout(1800)

SIZES = (32, 64)
STEP = 96
"""The prefill's tokens a step: a multiple of 32, not of 64 (a 64-token decode block is
filled by two steps), and under the window (its blocks are freed while the prefill runs)."""
L2 = 256
START_S = 900.0
"""Four vLLM servers start at once: on a loaded 2-core host that takes minutes."""


@dataclass
class Way:
    """One direction: a prefill, a decode of the other block size and their router."""

    prefill: VllmServer
    decode: VllmServer
    router: Proc
    d_stats: Path

    def d(self) -> dict[str, Any]:
        return read_stats(self.d_stats)

    def integrity(self) -> dict[str, int]:
        ep = self.d().get("endpoint", {})
        return {k: int(ep.get(f"integrity_{k}", 0)) for k in ("checks", "mismatches", "bytes")}

    def name(self) -> str:
        return f"{self.prefill.name} -> {self.decode.name}"


@dataclass
class Shape:
    name: str
    dtype: str
    ways: list[Way] = field(default_factory=list)
    window: int = 0


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 1000) for _ in range(n)]


def _model(name: str, tmp: Path) -> tuple[Path, str, tuple[str, ...], int]:
    if name == "llama":
        return build_model(tmp / "model", "small"), "float32", (), 0
    f = FAMILIES[name]
    return build_family(tmp / "model", name), f.dtype, f.vllm_args, f.window


def _start(
    name: str, tmp: Path, pairs: list[tuple[int, int, tuple[str, ...], tuple[str, ...]]]
) -> Iterator[Shape]:
    """Start a prefill and a decode per ``(prefill block size, decode block size, prefill
    arguments, decode arguments)`` and a router for each pair; yield the shape."""
    model, dtype, args, window = _model(name, tmp)
    boot = BootstrapServer("127.0.0.1", 0).start()
    servers: list[VllmServer] = []
    routers: list[Proc] = []
    shape = Shape(name, dtype, window=window)
    try:
        for i, (bp, bd, pargs, dargs) in enumerate(pairs):
            common = [*args, "--max-model-len", "4096"]
            p = VllmServer(
                f"prefill{bp}-{i}",
                model,
                tmp,
                dtype=dtype,
                block_size=bp,
                args=[*common, "--max-num-batched-tokens", str(STEP), *pargs],
                kv_cache_bytes=256 << 20,
                kv_transfer_config=kv_config(
                    "kv_producer", {"bootstrap": boot.address, "instance": f"p{i}"}
                ),
            )
            d_stats = tmp / f"d{i}.json"
            d = VllmServer(
                f"decode{bd}-{i}",
                model,
                tmp,
                dtype=dtype,
                block_size=bd,
                args=[*common, *dargs],
                kv_cache_bytes=256 << 20,
                kv_transfer_config=kv_config(
                    "kv_consumer",
                    {
                        "bootstrap": boot.address,
                        "instance": f"d{i}",
                        "stats_file": str(d_stats),
                        "l2_pages": L2,
                        "integrity": "full",
                    },
                    kv_load_failure_policy="recompute",
                ),
            )
            servers += [p, d]
            shape.ways.append(Way(p, d, None, d_stats))  # type: ignore[arg-type]
        start_all(servers, timeout=START_S)
        for i, w in enumerate(shape.ways):
            w.router = Proc(
                f"router{i}",
                [
                    "router",
                    "--engine",
                    "vllm",
                    "--port",
                    "0",
                    "--prefill",
                    f"{w.prefill.url},{boot.address},p{i}",
                    "--decode",
                    f"{w.decode.url},d{i}",
                ],
                timeout=180,
            )
            routers.append(w.router)
        yield shape
    finally:
        for r in routers:
            r.stop()
        for s in servers:
            s.stop()
        boot.stop()


@pytest.fixture(scope="module", params=["llama", "gemma3", "deepseek_v2"])
def shape(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Shape]:
    name = request.param
    dargs = ("--no-enable-prefix-caching",)  # a repeated prompt comes from L2, not vLLM's cache
    a, b = SIZES
    yield from _start(name, tmp_path_factory.mktemp(name), [(a, b, (), dargs), (b, a, (), dargs)])


def _judge(shape: Shape, w: Way, p: list[int], got: list[int], ref: list[int]) -> None:
    """float32: colocated's tokens; bf16: what the decode computes from the loaded bytes."""
    if shape.dtype == "float32":
        assert got == ref, f"{shape.name} {w.name()}, {len(p)} tokens: {got} != colocated {ref}"
        return
    assert len(got) == len(ref), (shape.name, w.name(), got)  # the bytes judge: the caller


def _lengths(shape: Shape) -> tuple[int, ...]:
    """Shorter than a block, past the window over several prefill steps, long (bf16: k
    blocks of 64 + 1, as the families module's)."""
    if shape.dtype == "float32":
        return (7, WINDOW + 3 * 32 + 5, 2000)
    return (65, 4 * 64 + 1, 30 * 64 + 1)


def test_answers_are_right_both_ways_and_every_loaded_byte_is_the_prefills(shape: Shape) -> None:
    for k, w in enumerate(shape.ways):
        before, d0 = w.integrity(), w.d()
        for seed, n in enumerate(_lengths(shape), 10 * k):
            p = prompt(n, seed)
            ref = complete(w.prefill.url, p)
            _judge(shape, w, p, complete(w.router.url, p), ref)
        wait(
            "the decode's checks",
            lambda w=w, b=before: w.integrity()["checks"] >= b["checks"] + 3,
            timeout=60,
        )
        after, d = w.integrity(), w.d()
        assert after["mismatches"] == 0 and after["bytes"] > before["bytes"], (w.name(), after)
        assert d["load_failures"] == d0.get("load_failures", 0), (w.name(), d)
        assert d["loads"] >= d0.get("loads", 0) + 3


def test_concurrent_requests_streamed_and_not_are_right_both_ways(shape: Shape) -> None:
    if shape.dtype != "float32":
        pytest.skip("bf16 answers change with the batch: judged one at a time")
    for k, w in enumerate(shape.ways):
        prompts = [prompt(n, 100 + 10 * k + i) for i, n in enumerate((40, 250, 600, 900))]
        refs = [complete(w.prefill.url, p) for p in prompts]
        d0 = w.d()
        with cf.ThreadPoolExecutor(len(prompts)) as ex:
            futs = [
                ex.submit(stream_ids if i % 2 else complete, w.router.url, p)
                for i, p in enumerate(prompts)
            ]
            got = [f.result() for f in futs]
        assert got == refs, w.name()
        assert w.d()["load_failures"] == d0.get("load_failures", 0)


def test_a_sliding_window_group_moves_the_window_both_ways(shape: Shape) -> None:
    """A long prompt over many prefill steps: the prefill frees window blocks as it goes,
    and a decode with larger blocks holds a first block reaching before the prefill's first
    kept one (filled from the prefill's null block, its tokens never read). What moved is
    the window, not the prompt, and every loaded byte is the prefill's."""
    if not shape.window:
        pytest.skip(f"{shape.name} has no sliding window")
    f = FAMILIES[shape.name]
    types = f.config["layer_types"]
    sliding = sum(t == "sliding_attention" for t in types)  # type: ignore[union-attr]
    per_token = 2 * int(f.config["num_key_value_heads"]) * int(f.config["head_dim"]) * 4  # type: ignore[call-overload]
    for k, w in enumerate(shape.ways):
        # 3040 - 128 is 45 blocks of 64 and a half: the 64-token decode's first window block
        # starts at 2880, the 32-token prefill's first kept one at 2912
        n = 3040
        p = prompt(n, 77 + k)
        ref = complete(w.prefill.url, p)
        before, d0 = w.d().get("net_bytes", 0), w.d()
        assert complete(w.router.url, p) == ref, w.name()
        wait("the decode's stats", lambda w=w, b=before: w.d().get("net_bytes", 0) > b, timeout=60)
        moved = w.d()["net_bytes"] - before
        full = (len(types) - sliding) * n * per_token  # type: ignore[arg-type]
        high = full + sliding * (WINDOW + 2 * max(SIZES)) * per_token
        assert full <= moved <= high, (w.name(), moved, full, high)
        assert w.d()["load_failures"] == d0.get("load_failures", 0)
        assert w.integrity()["mismatches"] == 0


def test_decode_tiers_restore_in_the_decodes_blocks_and_the_rest_comes_in_the_prefills(
    shape: Shape,
) -> None:
    """A prompt served twice: the second time the decode restores what it wrote back to L2
    (its own block size) and loads the rest from the prefill (the other size), every byte
    checked, the answer judged as above."""
    for k, w in enumerate(shape.ways):
        p = prompt(1500, 500 + k)
        d0 = w.d()
        _judge(shape, w, p, complete(w.router.url, p), complete(w.prefill.url, p))
        wait(
            "the write-back",
            lambda w=w, d0=d0: w.d().get("writebacks", 0) > d0.get("writebacks", 0),
            timeout=60,
        )
        q = p + prompt(300, 600 + k)  # a longer prompt sharing the first one's blocks
        _judge(shape, w, q, complete(w.router.url, q), complete(w.prefill.url, q))
        wait(
            "the second load",
            lambda w=w, d0=d0: w.d().get("loads", 0) >= d0.get("loads", 0) + 2,
            timeout=60,
        )
        d = w.d()
        assert d["restored_pages"] > d0.get("restored_pages", 0), w.name()
        assert d["load_failures"] == d0.get("load_failures", 0)
        assert w.integrity()["mismatches"] == 0


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shape]:
    f = FAMILIES["qwen3_next"]
    yield from _start(
        "qwen3_next",
        tmp_path_factory.mktemp("qwen3_next"),
        [(32, 32, ("--enable-prefix-caching", *f.exact_args), f.exact_args)],
    )


def test_a_state_group_whose_checkpoint_interval_differs_pairs_and_moves(qwen3_next: Shape) -> None:
    """Prefix caching on the prefill only: vLLM sizes the state groups' blocks 544 and 4,096
    tokens, which changes no byte of a state; the pair loads every group without a failure,
    every byte equal to the prefill's, the answers colocated's (prompts of k blocks + 1 in
    one-block chunks, where colocated computes the last token as the decode does)."""
    (w,) = qwen3_next.ways
    before, d0 = w.integrity(), w.d()
    for seed, n in enumerate((33, 161, 417)):
        p = prompt(n, 900 + seed)
        ref = complete(w.prefill.url, p)
        assert complete(w.router.url, p) == ref, n
    wait("the decode's checks", lambda: w.integrity()["checks"] >= before["checks"] + 3, timeout=60)
    d = w.d()
    assert d["load_failures"] == d0.get("load_failures", 0) and d["loads"] >= d0.get("loads", 0) + 3
    assert w.integrity()["mismatches"] == 0
