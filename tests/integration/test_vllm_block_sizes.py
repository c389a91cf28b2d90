"""A prefill and a decode of different ``--block-size`` on real vLLM, both ways (32 -> 64
and 64 -> 32), through ``pdxfer router --engine vllm`` with the official client.

One rig of servers per model, shared by every case of that model:
- Gemma 3 (float32): a full group beside sliding-window groups, so one model covers plain
  attention and the window. Token-exact against colocated vLLM (the prefill serving the
  prompt itself, same weights and kernels), concurrent requests streamed and not, the
  window moved rather than the prompt, decode-side tiers restored in the decode's blocks.
  A decode of TP 2 and another block size is the pair pdxfer cannot map on vLLM's CPU
  backend (a head slice of a packed tile): refused at pairing, and the client gets the
  router's 409 naming both block sizes (vLLM's default ``fail`` policy on that decode).
- DeepSeek-V2 (MLA, bf16), judged as the families module judges bf16: every byte the
  decode loaded equal to the prefill's (``integrity: full``), and the answer colocated's
  where colocated computes the decode's step (``Rig.same_rows``; prompts of k blocks + 1).
  Both sides run vLLM's reference MLA backend (``MLA_ARGS``) on every host.
- Qwen3-Next (bf16) with prefix caching on the prefill and off on the decode: vLLM sizes
  the state groups' blocks 544 and 4,096 tokens, which changes no byte moved; it pairs and
  moves, judged the same way.
No load may fail where the pair maps: a recomputed request would give the right answer
without pdxfer having moved anything.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest

from pdxfer import BootstrapServer
from pdxfer.serving.procs import Proc
from pdxfer.serving.vllm.servers import VllmServer, kv_config, read_stats, start_all
from tests.harness.hf_families import FAMILIES, WINDOW, Family, build_family

from .vllm_helpers import MAX_TOKENS, UNBOUND, complete, rows_alike, stream_ids, wait
from .vllm_helpers import token_prompt as prompt

pytestmark = [pytest.mark.timeout(1500), pytest.mark.engine]

SIZES = (32, 64)
STEP = 96
"""The float32 prefill's tokens a step: a multiple of 32, not of 64 (a 64-token decode block
is filled by two steps), and under the window (its blocks are freed while the prefill runs)."""
L2 = 256
START_S = 900.0
"""Several vLLM servers start at once: on a loaded 2-core host that takes minutes."""
MLA_ARGS = ("--attention-backend", "CPU_MLA")
"""vLLM's reference CPU MLA backend on every CPU, so the answers are judged the same way on
each (on a CPU with AMX vLLM would pick AMX_MLA, whose write pdxfer probes alike:
test_vllm_tiles)."""


@dataclass
class Way:
    """A prefill, a decode and their router."""

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

    @functools.cached_property
    def same_rows(self) -> bool:
        """Whether colocated vLLM (the prefill) computes a prompt's first k blocks alike
        served alone and with one token more, as ``test_vllm_families``'s ``Pair`` asks:
        then its one-token step over k blocks is the decode's, and its answer the pair's
        to give. Without AMX vLLM's MLA computes a prompt in one step and its bf16 rows
        change with the step's length: there the bytes are the judge."""
        return rows_alike(self.prefill.url, (65, 257))


@dataclass
class Rig:
    family: Family
    ways: list[Way] = field(default_factory=list)
    refused: Way | None = None
    """A pair pdxfer cannot map (Gemma 3 only)."""

    @property
    def float32(self) -> bool:
        return self.family.dtype == "float32"

    def case(self, w: Way, n: int, seed: int) -> tuple[list[int], list[int]]:
        """A prompt of ``n`` tokens and the answer ``w`` owes it. float32: colocated's answer
        to the prompt. bf16 (``n`` is k blocks + 1): colocated serves the k blocks and one
        token more; the prompt is those and that token, the rest of the answer is owed
        (``test_vllm_families``'s ``Pair.case``)."""
        if self.float32:
            p = prompt(n, seed)
            return p, complete(w.prefill.url, p)
        assert n % max(SIZES) == 1, f"{n} tokens: a bf16 prompt is k blocks + 1"
        head = prompt(n - 1, seed)
        ref = complete(w.prefill.url, head, max_tokens=MAX_TOKENS + 1, extra={"cache_salt": "r"})
        return head + ref[:1], ref[1:]

    def owes(self, w: Way, got: list[int], want: list[int], what: str) -> None:
        if self.float32 or w.same_rows:
            assert got == want, f"{self.family.name} {w.name()}, {what}: {got} != {want}"
        else:
            assert len(got) == len(want), f"{self.family.name} {w.name()}, {what}: {got}"


def _pair_args(
    f: Family, plain: bool
) -> list[tuple[int, int, tuple[str, ...], tuple[str, ...], dict[str, str] | None]]:
    """``(prefill block, decode block, prefill args, decode args, decode env)`` per pair."""
    a, b = SIZES
    nocache = ("--no-enable-prefix-caching",)  # a repeated prompt comes from L2
    if f.name == "qwen3_next":
        return [(a, a, ("--enable-prefix-caching", *f.exact_args), f.exact_args, None)]
    mla = MLA_ARGS if f.name == "deepseek_v2" else ()
    pargs = ("--max-num-batched-tokens", str(STEP)) if plain else (*f.exact_args, *mla)
    dargs = nocache if plain else (*nocache, *f.exact_args, *mla)
    pairs = [(a, b, pargs, dargs, None), (b, a, pargs, dargs, None)]
    if plain:  # a decode of TP 2 and another block size: refused (the module docstring)
        pairs.append((a, b, pargs, (*dargs, "--tensor-parallel-size", "2"), UNBOUND))
    return pairs


@pytest.fixture(scope="module", params=["gemma3", "deepseek_v2", "qwen3_next"])
def rig(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    f = FAMILIES[request.param]
    tmp = tmp_path_factory.mktemp(f.name)
    model = build_family(tmp / "model", f.name)
    plain = f.dtype == "float32"
    boot = BootstrapServer("127.0.0.1", 0).start()
    servers: list[VllmServer] = []
    routers: list[Proc] = []
    rig = Rig(f)
    ways: list[Way] = []
    try:
        prefills: dict[tuple[int, tuple[str, ...]], VllmServer] = {}
        for i, (bp, bd, pargs, dargs, denv) in enumerate(_pair_args(f, plain)):
            common = [*f.vllm_args, "--max-model-len", "4096"]
            if (bp, pargs) not in prefills:  # the refused pair reuses the 32-token prefill
                prefills[bp, pargs] = VllmServer(
                    f"prefill{bp}",
                    model,
                    tmp,
                    dtype=f.dtype,
                    block_size=bp,
                    args=[*common, *pargs],
                    kv_cache_bytes=256 << 20,
                    kv_transfer_config=kv_config(
                        "kv_producer", {"bootstrap": boot.address, "instance": f"p{bp}"}
                    ),
                )
                servers.append(prefills[bp, pargs])
            d_stats = tmp / f"d{i}.json"
            d = VllmServer(
                f"decode{bd}-{i}",
                model,
                tmp,
                dtype=f.dtype,
                block_size=bd,
                args=[*common, *dargs],
                env=denv,
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
                    # the refused pair keeps vLLM's default: its client gets the router's 409
                    kv_load_failure_policy="fail" if denv else "recompute",
                ),
            )
            servers.append(d)
            if "--tensor-parallel-size" in dargs:  # one file a rank: read rank 0's
                d_stats = d_stats.with_name(f"{d_stats.name}.tp0")
            ways.append(Way(prefills[bp, pargs], d, None, d_stats))  # type: ignore[arg-type]
        start_all(servers, timeout=START_S)
        for i, w in enumerate(ways):
            w.router = Proc(
                f"router{i}",
                [
                    "router",
                    "--engine",
                    "vllm",
                    "--port",
                    "0",
                    "--prefill",
                    f"{w.prefill.url},{boot.address},p{w.prefill.name.removeprefix('prefill')}",
                    "--decode",
                    f"{w.decode.url},d{i}",
                ],
                timeout=180,
            )
            routers.append(w.router)
        rig.ways = ways[:2]
        rig.refused = ways[2] if len(ways) > 2 else None
        yield rig
    finally:
        for r in routers:
            r.stop()
        for s in servers:
            s.stop()
        boot.stop()


def _lengths(rig: Rig) -> tuple[int, ...]:
    """float32: shorter than a block; where the last token's first window key opens a
    32-token block but not a 64-token one (159) and where it opens both (191); past the
    window over several prefill steps, where the 64-token decode's first window block
    starts before the 32-token prefill's first kept one (736 - 128 is 9.5 blocks of 64).
    bf16: k blocks of 64 + 1."""
    if rig.float32:
        return (7, WINDOW + 31, WINDOW + 63, 736)
    return (65, 4 * 64 + 1, 16 * 64 + 1)


def _no_failures(w: Way, d0: dict[str, Any], loads: int) -> None:
    d = w.d()
    assert d["load_failures"] == d0.get("load_failures", 0), (w.name(), d)
    assert d["loads"] >= d0.get("loads", 0) + loads, (w.name(), d)
    assert w.integrity()["mismatches"] == 0, (w.name(), w.integrity())


def test_answers_are_right_both_ways_and_every_loaded_byte_is_the_prefills(rig: Rig) -> None:
    lengths = _lengths(rig)
    m = len(lengths)
    for k, w in enumerate(rig.ways):
        before, d0 = w.integrity(), w.d()
        for seed, n in enumerate(lengths, 10 * k):
            p, want = rig.case(w, n, seed)
            rig.owes(w, complete(w.router.url, p), want, f"{n} prompt tokens")
        wait(
            "the decode's checks",
            lambda w=w, b=before: w.integrity()["checks"] >= b["checks"] + m,
            timeout=60,
            show=lambda w=w, b=before: (w.name(), b, w.integrity(), w.d()),
        )
        assert w.integrity()["bytes"] > before["bytes"], w.name()
        _no_failures(w, d0, m)


def test_concurrent_requests_streamed_and_not_are_right_both_ways(rig: Rig) -> None:
    if not rig.float32:
        pytest.skip("bf16 answers change with the batch: judged one at a time")
    for k, w in enumerate(rig.ways):
        prompts = [prompt(n, 100 + 10 * k + i) for i, n in enumerate((40, 250, 400, 600))]
        refs = [complete(w.prefill.url, p) for p in prompts]
        d0 = w.d()
        with cf.ThreadPoolExecutor(len(prompts)) as ex:
            futs = [
                ex.submit(stream_ids if i % 2 else complete, w.router.url, p)
                for i, p in enumerate(prompts)
            ]
            got = [f.result() for f in futs]
        assert got == refs, w.name()
        _no_failures(w, d0, len(prompts))


def test_a_sliding_window_group_moves_the_window_both_ways(rig: Rig) -> None:
    """A prompt over several prefill steps: the prefill frees window blocks as it goes, and
    a decode with larger blocks holds a first block reaching before the prefill's first
    kept one (filled from the prefill's null block, its tokens never read). What moved is
    the full layer's prompt and the sliding layers' window, every loaded byte the prefill's."""
    if not rig.family.window:
        pytest.skip(f"{rig.family.name} has no sliding window")
    cfg = rig.family.config
    types = list(cfg["layer_types"])  # type: ignore[call-overload]
    sliding = sum(t == "sliding_attention" for t in types)
    per_token = 2 * int(cfg["num_key_value_heads"]) * int(cfg["head_dim"]) * 4  # type: ignore[call-overload]
    for k, w in enumerate(rig.ways):
        n = 736
        p = prompt(n, 77 + k)
        ref = complete(w.prefill.url, p)
        before, d0 = w.d().get("net_bytes", 0), w.d()
        assert complete(w.router.url, p) == ref, w.name()
        wait("the decode's stats", lambda w=w, b=before: w.d().get("net_bytes", 0) > b, timeout=60)
        moved = w.d()["net_bytes"] - before
        full = (len(types) - sliding) * n * per_token
        high = full + sliding * (WINDOW + 2 * max(SIZES)) * per_token
        assert full <= moved <= high, (w.name(), moved, full, high)
        _no_failures(w, d0, 1)


def test_decode_tiers_restore_in_the_decodes_blocks_and_the_rest_comes_in_the_prefills(
    rig: Rig,
) -> None:
    """A prompt, then a longer one sharing it: the decode restores what it wrote back to L2
    (its own block size) and loads the rest from the prefill (the other size)."""
    if not rig.float32:
        pytest.skip("the bf16 rigs judge loads one prompt at a time")
    for k, w in enumerate(rig.ways):
        p = prompt(300, 500 + k)
        d0 = w.d()
        assert complete(w.router.url, p) == complete(w.prefill.url, p), w.name()
        wait(
            "the write-back",
            lambda w=w, d0=d0: w.d().get("writebacks", 0) > d0.get("writebacks", 0),
            timeout=60,
        )
        q = p + prompt(100, 600 + k)
        assert complete(w.router.url, q) == complete(w.prefill.url, q), w.name()
        wait(
            "the second load",
            lambda w=w, d0=d0: w.d().get("loads", 0) >= d0.get("loads", 0) + 2,
            timeout=60,
        )
        assert w.d()["restored_pages"] > d0.get("restored_pages", 0), w.name()
        _no_failures(w, d0, 2)


def test_a_pair_whose_blocks_cannot_be_mapped_is_refused_naming_both_sizes(rig: Rig) -> None:
    """A decode of TP 2 and blocks of 64 behind a TP 1 prefill of 32 on vLLM's CPU backend:
    a head slice of a packed tile moves only whole. The load is refused at pairing, naming
    both block sizes. With vLLM's default ``kv_load_failure_policy: fail`` the decode fails
    the request with a bare 500; the client gets the router's 409 naming both sizes, read
    from the prefill's bootstrap registration (``recompute`` computes the prompt on the
    decode instead: ``test_vllm_spec``)."""
    w = rig.refused
    if w is None:
        pytest.skip(f"{rig.family.name}: the refused pair is built on the float32 rig")
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as e:
            if stream:
                stream_ids(w.router.url, prompt(100, 4243))
            else:
                complete(w.router.url, prompt(100, 4242))
        assert e.value.status_code == 409, e.value
        msg = str(e.value.message)
        assert "page_size: prefill 32, decode 64" in msg and "need equal page sizes" in msg, msg
        assert w.prefill.url in msg and w.decode.url in msg, msg
    log = w.decode.log.read_text(errors="replace")
    assert "refused the handshake: pool 'kv': page_size: prefill 32, decode 64" in log, log[-3000:]
