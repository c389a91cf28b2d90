"""The model families people serve with PD, on real vLLM: MLA (DeepSeek-V2), every layer
sliding (Mistral-style), sliding beside full (Gemma 3), attention beside Mamba2 (Nemotron-H)
and beside Gated DeltaNet (Qwen3-Next), chunked local attention beside NoPE full attention
with MoE (Llama 4), each a tiny random model built here (``tests.harness.hf_families``).

Per family, one ``vllm serve`` prefill and one decode loading ``PdxferConnector`` with
vLLM's hybrid KV cache manager on (its default), behind ``pdxfer router --engine vllm``,
driven with the official ``openai`` client. The reference is the prefill itself serving a
request without pdxfer params: colocated vLLM, same weights, same kernels. Every answer
through the router equals it token for token: prompts shorter than a block, past the
sliding window, several thousand tokens, and several at once, streamed and not. A sliding
window family moves the window, not the prompt (bytes the decode received). The decode
checks every byte it loads against the prefill's (``integrity: full``). A prefill killed
with requests in flight leaves right answers or clean errors, and the decode serves on. The
prefill computes ``STEP`` tokens a step and sends by layer: full and window groups stream,
a state goes at the request's end.

bf16 families (DeepSeek-V2, Qwen3-Next, gpt-oss) are judged by what pdxfer owns, on any
CPU: every byte the decode loaded equals the prefill's, and the answer equals what colocated
vLLM computes from those bytes in the decode's step shape. In bf16 vLLM's CPU kernels round
differently per step shape and batch, and which kernels run depends on the CPU (without AMX
its MLA computes a prompt in one step: no chunks, no prefix cache), so a decode computing a
prompt's last token as a one-token step over loaded KV may part ways with colocated vLLM
computing that token inside its prompt's step. The prompt is therefore k blocks and the
token colocated vLLM answers after them (``Pair.case``): colocated computes that token as
a one-token step over its k blocks, as the decode does, and the rest of its answer is what
the pair owes. Those k blocks are computed in the prefill's own chunks (one block each,
``Family.exact_args``) or taken from the prefill's prefix cache, where vLLM chunks or
caches; each pair asks vLLM whether its rows come out alike (``Pair.same_rows``). Where
they do not (MLA without AMX), no colocated computation is the decode's and the bytes are
the judge. Concurrent answers are judged by the bytes each load brought.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import json
import random
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdxfer import BootstrapServer
from pdxfer.serving.procs import Proc
from pdxfer.serving.vllm.servers import VllmServer, kv_config, read_stats, start_all
from tests.harness.hf_families import CHUNK, FAMILIES, WINDOW, Family, build_family

from .vllm_helpers import (
    MAX_TOKENS,
    client,
    complete,
    logged,
    metric,
    right_or_clean_error,
    rows_alike,
    stream_ids,
    token_ids,
    wait,
)
from .vllm_helpers import (
    token_prompt as prompt,
)

pytestmark = [pytest.mark.timeout(900), pytest.mark.engine]

SERVED = ("gemma3", "mistral_swa", "nemotron_h", "deepseek_v2", "qwen3_next", "gpt_oss", "llama4")
"""The families this module serves (``benchmarks/models.py`` tries every one)."""
BS = 32
MAX_LEN = 4096
LONG = 3000
"""Several thousand prompt tokens (the model's context is ``MAX_LEN``)."""
L2 = 256
"""The decode's L2 pages (decode-side tiers: full-attention groups only)."""
STEP = 96
"""The prefill's tokens per step (``--max-num-batched-tokens``), under the window: a long
prompt spans many steps, and the window's blocks more than one (bf16 families: one block,
``Family.exact_args``, on both sides)."""
LOGPROB_TOL = 1e-3
"""How far a float32 family's logprobs through the pair may stray from colocated's (step
shapes and batches move them by about 1e-5; one key lost from a window by 3e-3 or more)."""
KILLED = ("gemma3", "mistral_swa", "nemotron_h", "deepseek_v2", "llama4")
"""The families the kill test runs on: one per mix of group kinds a failed load releases
(full and window, window alone, state, MLA, chunked). gpt-oss and Qwen3-Next repeat Gemma 3's
and Nemotron-H's mixes in bf16, and start no held prefill."""
HELD_S = 600.0
"""A held prefill's writes wait this long: far past its kill."""


@dataclass
class Pair:
    family: Family
    model: Path
    boot: BootstrapServer
    prefill: VllmServer
    decode: VllmServer
    router: Proc
    d_stats: Path
    p_stats: Path
    tmp: Path
    held: VllmServer | None
    """A second prefill whose writes wait ``HELD_S``: the kill test's (started with the
    pair, as their start-ups overlap), for ``KILLED`` families."""
    held_router: Proc | None
    """A router from ``held`` to the pair's decode."""

    def d(self) -> dict[str, Any]:
        return read_stats(self.d_stats)

    def since(self, d0: dict[str, Any]) -> str:
        """For a failure's message: the decode's loads and failures since ``d0`` (its stats
        then), and the router's retries so far (its log)."""
        d = self.d()
        retries = "; ".join(logged(self.router, "retrying")) or "none"
        return (
            f"loads {d0.get('loads', 0)} -> {d.get('loads', 0)}, failures "
            f"{d0.get('load_failures', 0)} -> {d.get('load_failures', 0)}; router retries: "
            f"{retries}"
        )

    def loaded_bytes(self) -> int:
        return int(self.d().get("net_bytes", 0))

    def integrity(self) -> dict[str, int]:
        """The decode's integrity counters: checks, mismatches, bytes digested."""
        ep = self.d().get("endpoint", {})
        return {k: int(ep.get(f"integrity_{k}", 0)) for k in ("checks", "mismatches", "bytes")}

    @property
    def exact_alone(self) -> bool:
        """Whether colocated vLLM gives a request the same tokens alone and beside others
        (float32 families; bf16 rounds differently with the batch's shape)."""
        return self.family.dtype == "float32"

    @functools.cached_property
    def same_rows(self) -> bool:
        """Whether colocated vLLM computes a prompt's first k blocks alike served alone and
        with one token more (what ``case`` leans on: the prefill computes the pair's prompt,
        k blocks and a token, and colocated the k blocks alone). True where it computes them
        in the same steps, one block each (``Family.exact_args``). Without AMX vLLM's MLA
        computes a prompt in one step, no chunks, no prefix cache, and its bf16 rows then
        change with the step's length: no colocated computation is the decode's, and the
        decode's bytes are the judge. Asked of vLLM, on prompt logprobs, not assumed;
        float32 families are exact without it."""
        if self.exact_alone:
            return True
        return rows_alike(self.prefill.url, self.lengths())

    def owes(self, got: list[int], want: list[int], what: str) -> None:
        """Judge ``got``, an answer through the pair, against ``want`` (``case``): token for
        token where colocated vLLM computes the decode's step from the prefill's bytes
        (``same_rows``); elsewhere a whole answer, and no byte the decode loaded unequal to
        the prefill's (``integrity: full``)."""
        if self.same_rows:
            assert got == want, f"{self.family.name}, {what}: {got} != colocated {want}"
        else:
            assert len(got) == len(want), f"{self.family.name}, {what}: {got}"
            assert self.integrity()["mismatches"] == 0, f"{what}: {self.integrity()}"

    def case(self, n: int, seed: int, salt: str | None = None) -> tuple[list[int], list[int]]:
        """A prompt of ``n`` tokens and the answer a pair owes it, from colocated vLLM (the
        prefill serving without pdxfer params). float32 families: the prompt's own answer.
        bf16 families (``n`` is k blocks + 1): the decode computes the last prompt token as
        a one-token step over the loaded k blocks, and colocated vLLM does so too where
        that token is its own greedy answer. So colocated serves the first k blocks and
        answers one token more; the prompt is those blocks and that token, and the rest
        of the answer is what the pair owes. ``salt`` keeps the reference out of the
        prefill's prefix cache (vLLM's ``cache_salt``)."""
        if self.exact_alone:
            p = prompt(n, seed)
            return p, complete(self.prefill.url, p)
        assert n % BS == 1, f"{n} tokens: a bf16 family's prompt is k blocks + 1"
        head = prompt(n - 1, seed)
        extra = {"extra": {"cache_salt": salt}} if salt else {}
        ref = complete(self.prefill.url, head, max_tokens=MAX_TOKENS + 1, **extra)
        return head + ref[:1], ref[1:]

    def exact(self, n: int) -> int:
        """``n`` tokens, or for a bf16 family the nearest k blocks + 1 at or below."""
        return n if self.exact_alone else (n - 1) // BS * BS + 1

    def lengths(self) -> tuple[int, int, int]:
        """Prompt lengths: shorter than a block (one block + 1 for bf16 families), past
        the window, several thousand tokens."""
        if not self.exact_alone:
            return BS + 1, (WINDOW // BS + 1) * BS + 1, (LONG // BS) * BS + 1
        return 7, WINDOW + 3 * BS + 5, LONG


def _server(
    f: Family,
    model: Path,
    tmp: Path,
    name: str,
    extra: dict[str, object] | None,
    role: str,
    env: dict[str, str] | None = None,
) -> VllmServer:
    args = [*f.vllm_args, "--max-model-len", str(MAX_LEN)]
    if role == "kv_producer":
        args += ["--max-num-batched-tokens", str(STEP)]
    args += f.exact_args  # after STEP: the last one given counts
    more = {"kv_load_failure_policy": "recompute"} if role == "kv_consumer" else {}
    if role == "kv_consumer":  # a repeated prompt is restored from L2, not vLLM's cache
        args.append("--no-enable-prefix-caching")
    return VllmServer(
        name,
        model,
        tmp,
        dtype=f.dtype,
        block_size=BS,
        args=args,
        kv_cache_bytes=512 << 20,
        env=env,
        log_stats=role == "kv_producer",  # vLLM's steps (``prompt_steps``) in its /metrics
        kv_transfer_config=kv_config(role, extra, **more) if extra else None,
    )


@pytest.fixture(scope="module", params=SERVED)
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    f = FAMILIES[request.param]
    tmp = tmp_path_factory.mktemp(f.name)
    model = build_family(tmp / "model", f.name)
    boot = BootstrapServer("127.0.0.1", 0).start()
    d_stats, p_stats = tmp / "d.json", tmp / "p.json"
    servers: list[VllmServer] = []
    routers: list[Proc] = []
    try:
        servers = [
            _server(
                f,
                model,
                tmp,
                "prefill",
                {
                    "bootstrap": boot.address,
                    "instance": "p0",
                    "stats_file": str(p_stats),
                    "send_by": "layer",
                },
                "kv_producer",
            ),
            _server(
                f,
                model,
                tmp,
                "decode",
                {
                    "bootstrap": boot.address,
                    "instance": "d0",
                    "stats_file": str(d_stats),
                    "l2_pages": L2,
                    "integrity": "full",
                },
                "kv_consumer",
            ),
        ]
        if f.name in KILLED:
            servers.append(
                _server(
                    f,
                    model,
                    tmp,
                    "held",
                    {"bootstrap": boot.address, "instance": "p-held"},
                    "kv_producer",
                    env={"PDXFER_FAULTS": f"delay_write={HELD_S}"},
                )
            )
        start_all(servers)
        prefill, decode = servers[:2]
        held = servers[2] if len(servers) > 2 else None

        def router(name: str, p: VllmServer, instance: str) -> Proc:
            """``pdxfer router --engine vllm`` from ``p`` (registered as ``instance``) to the
            pair's decode."""
            argv = ["--log-level", "INFO", "router", "--engine", "vllm", "--port", "0"]
            argv += ["--prefill", f"{p.url},{boot.address},{instance}"]
            argv += ["--decode", f"{decode.url},d0"]
            routers.append(Proc(name, argv, timeout=180, log=tmp / f"{name}.log"))
            return routers[-1]

        main = router("router", prefill, "p0")
        held_router = router("router-held", held, "p-held") if held is not None else None
        yield Pair(f, model, boot, prefill, decode, main, d_stats, p_stats, tmp, held, held_router)
    finally:
        for r in routers:
            r.stop()
        for s in servers:
            s.stop()
        boot.stop()


def test_outputs_equal_colocated_below_a_block_past_the_window_and_long(pair: Pair) -> None:
    for seed, n in enumerate(pair.lengths(), 1):
        p, want = pair.case(n, seed)
        pair.owes(complete(pair.router.url, p), want, f"{n} prompt tokens")


def answer(url: str, p: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs."""
    r = client(url).completions.create(
        model="llama",
        prompt=p,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=1,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None
    return token_ids(r.choices[0], r), [float(x) for x in lp.token_logprobs]


def test_the_decode_loads_the_prefills_kv_byte_for_byte(pair: Pair) -> None:
    """pdxfer's invariant, whatever the kernels round: every byte of KV and state the decode
    loaded equals what the prefill computed (``integrity: full`` digests both sides)."""
    before = pair.integrity()
    p, want = pair.case(pair.lengths()[1], 41)
    pair.owes(complete(pair.router.url, p), want, f"{len(p)} prompt tokens")
    wait("the decode's check", lambda: pair.integrity()["checks"] > before["checks"], timeout=30)
    after = pair.integrity()
    assert after["mismatches"] == 0, after
    assert after["bytes"] > before["bytes"], after


def test_concurrent_requests_streamed_and_not_equal_colocated(pair: Pair) -> None:
    """Four at once, streamed and not. bf16 families: colocated vLLM's own answers change
    with the batch, so the judge there is the bytes each load brought (checked in full)."""
    sizes = (40, 250, 600, 900) if pair.exact_alone else (33, 257, 609, 897)
    prompts = [prompt(n, 10 + i) for i, n in enumerate(sizes)]
    refs = [complete(pair.prefill.url, p) for p in prompts]
    before = pair.integrity()
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        futs = [
            ex.submit(stream_ids if i % 2 else complete, pair.router.url, p)
            for i, p in enumerate(prompts)
        ]
        got = [f.result() for f in futs]
    if pair.exact_alone:
        assert got == refs
    else:
        assert [len(g) for g in got] == [len(r) for r in refs]
    wait(
        "the decode's checks",
        lambda: pair.integrity()["checks"] >= before["checks"] + 4,
        timeout=30,
    )
    assert pair.integrity()["mismatches"] == 0


def test_a_sliding_window_group_moves_the_window_not_the_prompt(pair: Pair) -> None:
    f = pair.family
    if not f.window:
        pytest.skip(f"{f.name} has no sliding window")  # the same module serves every family
    types = f.config.get("layer_types") or ["sliding_attention"] * int(
        f.config["num_hidden_layers"]
    )  # type: ignore[call-overload]
    sliding = sum(t == "sliding_attention" for t in types)
    full = len(types) - sliding
    elt = 4 if f.dtype == "float32" else 2
    per_layer_token = (
        2
        * int(f.config["num_key_value_heads"])
        * int(  # type: ignore[call-overload]
            f.config["head_dim"]
        )
        * elt
    )  # type: ignore[call-overload]
    n = pair.exact(LONG + 11)
    assert (n - WINDOW + 1) % BS, "a prompt the decode loads whole"
    p, want = pair.case(n, 99)
    before = pair.loaded_bytes()
    pair.owes(complete(pair.router.url, p), want, f"{n} prompt tokens")
    wait("the decode's stats", lambda: pair.loaded_bytes() > before, timeout=30)
    moved = pair.loaded_bytes() - before
    blocks = -(-n // BS)
    window_blocks = blocks - (n - WINDOW + 1) // BS  # vLLM's decode holds these
    want = (full * blocks + sliding * window_blocks) * BS * per_layer_token
    whole = len(types) * blocks * BS * per_layer_token
    assert moved == want, (
        f"{f.name}: {moved} bytes moved for {n} tokens; the window "
        f"is {want}, the whole prompt {whole}"
    )


def test_a_load_that_fails_is_recomputed_and_the_decode_serves_on(pair: Pair) -> None:
    """A decode asked for a room its prefill never had: the load fails (every group's), vLLM
    recomputes the request (``kv_load_failure_policy: recompute``) and the engine serves on.
    vLLM takes block-level load errors from one KV cache group only: reported that way, a
    hybrid model's failed load killed the decode's engine."""
    p = prompt(200, 77)
    ref = complete(pair.prefill.url, p)
    bogus = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "pdxfer_room": random.Random(5).randrange(1 << 62),
        "pdxfer_bootstrap": pair.boot.address,
        "pdxfer_instance": "p0",
        "pdxfer_num_tokens": len(p),
    }
    before = int(pair.d().get("load_failures", 0))
    assert complete(pair.decode.url, p, extra={"kv_transfer_params": bogus}) == ref
    assert int(pair.d().get("load_failures", 0)) == before + 1
    q, want = pair.case(pair.lengths()[1], 78)
    pair.owes(complete(pair.router.url, q), want, "after the failed load")


def test_by_layer_attention_groups_leave_before_the_prompts_last_step(pair: Pair) -> None:
    """``send_by: layer`` on a hybrid model: each step hands its full groups' layers (and
    the window's blocks no later step frees) to the sender, so all but the last of a long
    prompt's steps went out before its end; a state group goes once, at the end. The
    decode loads every group without a failure, token for token as colocated. The steps
    are vLLM's (``prompt_steps``): it chunks by ``--max-num-batched-tokens`` where it
    chunks, and MLA on a CPU without AMX computes a prompt in one step."""
    # salted: the prefill computes the whole prompt, not the reference's cached blocks
    p, want = pair.case(pair.exact(LONG - 17), 31, salt="reference")
    # before a side's first request it has written no stats file yet: every count is 0
    d0, p0 = Counter(read_stats(pair.d_stats)), Counter(read_stats(pair.p_stats))
    steps0 = metric(pair.prefill, "vllm:pdxfer_prompt_steps_total")
    pair.owes(complete(pair.router.url, p), want, f"{len(p)} prompt tokens")
    wait(
        "the prefill's send",
        lambda: (
            read_stats(pair.p_stats).get("sends", 0) > p0["sends"]
            and read_stats(pair.p_stats).get("in_flight_sends", 1) == 0
        ),
        timeout=60,
    )
    d, st = read_stats(pair.d_stats), read_stats(pair.p_stats)
    assert d["load_failures"] == d0["load_failures"] and d["loads"] == d0["loads"] + 1
    steps = int(metric(pair.prefill, "vllm:pdxfer_prompt_steps_total") - steps0)
    assert steps >= 1, "vLLM computed the prompt in no step"
    early = st["step_chunks"] - p0["step_chunks"]
    # a step hands the blocks it completes: every step but the last here (a step is whole
    # blocks: STEP, or one block for a bf16 family), but only some where vLLM grew the
    # attention blocks to a Mamba state's page; a model whose every layer slides only the
    # steps in the last token's window (a step is under the window: at least one before
    # the last)
    f = pair.family
    stateful = any(k.startswith(("mamba", "linear")) for k in f.config)
    every_slides = bool(f.window) and "full_attention" not in (f.config.get("layer_types") or ())
    want = min(1, steps - 1) if stateful or every_slides else steps - 1
    assert early >= want, f"{pair.family.name}: {early} of {steps} steps went before the last"
    assert st["layer_sends"] > p0["layer_sends"] and st["send_failures"] == p0["send_failures"]


def test_decode_tiers_restore_full_groups_and_the_rest_comes_from_the_prefill(pair: Pair) -> None:
    """A prompt served twice: the second time the decode restores its full-attention
    groups' pages from L2 (written back after the first) and loads window and state groups
    from the prefill, token for token as colocated. A model whose every layer slides keeps
    nothing in L2 (``groups.tiered``)."""
    f = pair.family
    every_slides = bool(f.window) and "full_attention" not in (f.config.get("layer_types") or ())
    p, ref = pair.case(pair.exact(2000), 42)
    d0 = read_stats(pair.d_stats)
    pair.owes(complete(pair.router.url, p), ref, "first served")
    wait(
        "the write-back",
        lambda: (
            read_stats(pair.d_stats).get("writebacks", 0)
            + read_stats(pair.d_stats).get("writeback_failures", 0)
            > d0["writebacks"] + d0["writeback_failures"]
            or every_slides
        ),
        timeout=30,
    )
    pair.owes(complete(pair.router.url, p), ref, "served again, from L2")
    wait(
        "the second load",
        lambda: read_stats(pair.d_stats).get("loads", 0) >= d0["loads"] + 2,
        timeout=30,
    )
    d = read_stats(pair.d_stats)
    restored = d["restored_pages"] - d0["restored_pages"]
    assert d["load_failures"] == d0["load_failures"]
    assert d["writeback_failures"] == d0["writeback_failures"]
    if every_slides:
        assert restored == 0 and "tiers" not in d
    else:
        assert restored > 0, f"{f.name}: nothing restored from L2"


def _registered(boot: BootstrapServer, instance: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{boot.address}/instances", timeout=2) as r:
            return bool(json.loads(r.read()).get(instance, {}).get("complete"))
    except OSError:
        return False


def test_a_prefill_killed_mid_request_leaves_right_answers_or_clean_errors(pair: Pair) -> None:
    """A second prefill (its own instance and router) holds its writes back (the
    ``delay_write`` fault); two requests, one streamed, go through it, the decode engages a
    load for each, and the prefill is SIGKILLed. Each client gets colocated's tokens (the
    decode recomputed) or a clean error, never wrong tokens or a hang; the decode ends both
    loads and serves on, having loaded nothing the held prefill never sent. bf16 families:
    the decode may compute both prompts in one batch where colocated computed each alone,
    and their tokens may then differ (``exact_alone``); that nothing was loaded shows those
    answers came from vLLM's own compute."""
    held, held_router = pair.held, pair.held_router
    if held is None or held_router is None:
        pytest.skip(f"{pair.family.name}'s groups are another family's in bf16 (KILLED)")
    prompts = [prompt(n, 300 + i) for i, n in enumerate(pair.lengths()[:2])]
    refs = [complete(pair.prefill.url, p) for p in prompts]
    try:
        wait("the held prefill's registration", lambda: _registered(pair.boot, "p-held"))
        loads0, loaded0 = int(pair.d().get("loads", 0)), pair.d().get("loaded_tokens", 0)
        with cf.ThreadPoolExecutor(2) as ex:
            futs = [
                ex.submit(right_or_clean_error, held_router.url, p, i == 1, r, pair.exact_alone)
                for i, (p, r) in enumerate(zip(prompts, refs))
            ]
            wait(
                "the decode's loads",
                lambda: int(pair.d().get("loads", 0)) - loads0 >= 2,
                timeout=120,
            )
            assert not any(fu.done() for fu in futs), "a request ended while its KV was held"
            held.kill()
            verdicts = [fu.result(timeout=180) for fu in futs]
        assert len(verdicts) == 2
        wait(
            "the decode to end both loads", lambda: pair.d().get("in_flight_loads") == 0, timeout=60
        )
        assert pair.d().get("loaded_tokens", 0) == loaded0, verdicts
    finally:
        held.stop()
    q, want = pair.case(pair.lengths()[0], 310)
    pair.owes(complete(pair.router.url, q), want, "after the kill")


def test_a_chunked_group_is_token_exact_on_and_around_chunk_boundaries(pair: Pair) -> None:
    """Chunked local attention (Llama 4): prompts shorter than a chunk, exactly one chunk,
    one token past, several chunks ending on a boundary and one token past (four at a
    time), and thousands of tokens ending on a boundary and one past: each equals colocated
    token for token, every load ended without a failure (none recomputed by vLLM) and every
    byte matched the prefill's."""
    f = pair.family
    if not f.chunk:
        pytest.skip(f"{f.name} has no chunked local attention")
    short = (CHUNK - 5, CHUNK, CHUNK + 1, 5 * CHUNK, 5 * CHUNK + 1, 5 * CHUNK + 13)
    long = (LONG // CHUNK * CHUNK, LONG // CHUNK * CHUNK + 1)
    prompts = [prompt(n, 500 + i) for i, n in enumerate(short + long)]
    d0, before = pair.d(), pair.integrity()
    with cf.ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda p: complete(pair.router.url, p), prompts[: len(short)]))
    got += [complete(pair.router.url, p) for p in prompts[len(short) :]]
    refs = [complete(pair.prefill.url, p) for p in prompts]
    for p, g, r in zip(prompts, got, refs):
        assert g == r, f"{len(p)} prompt tokens: {g} != colocated {r}"
    wait(
        "the decode's checks",
        lambda: pair.integrity()["checks"] >= before["checks"] + len(prompts),
        timeout=30,
    )
    d = pair.d()
    assert d["loads"] - d0.get("loads", 0) == len(prompts), pair.since(d0)
    assert d["load_failures"] == d0.get("load_failures", 0)
    assert pair.integrity()["mismatches"] == 0


def test_a_chunked_group_moves_the_last_tokens_chunk_not_the_prompt(pair: Pair) -> None:
    """Of a chunked local attention group only the blocks of the chunk the last prompt
    token attends to move (vLLM's decode holds no other); the full groups move every
    block. The bytes the decode received are that, far below the whole prompt. A prompt
    ending on a chunk boundary loads one token less (the decode computes the last)."""
    f = pair.family
    if not f.chunk:
        pytest.skip(f"{f.name} has no chunked local attention")
    layers = int(f.config["num_hidden_layers"])  # type: ignore[call-overload]
    nope = int(f.config["no_rope_layer_interval"])  # type: ignore[call-overload]
    full = sum((i + 1) % nope == 0 for i in range(layers))  # NoPE layers: full attention
    page = BS * 2 * int(f.config["num_key_value_heads"]) * int(f.config["head_dim"]) * 4  # type: ignore[call-overload]
    for n, seed in ((LONG + 11, 98), (LONG // CHUNK * CHUNK, 99)):
        p = prompt(n, seed)
        before = pair.loaded_bytes()
        assert complete(pair.router.url, p) == complete(pair.prefill.url, p)
        wait("the decode's stats", lambda b=before: pair.loaded_bytes() > b, timeout=30)
        moved = pair.loaded_bytes() - before
        loaded = n - 1 if n % CHUNK == 0 else n
        blocks = -(-loaded // BS)
        chunk_blocks = blocks - loaded // CHUNK * CHUNK // BS  # vLLM's decode holds these
        want = (full * blocks + (layers - full) * chunk_blocks) * page
        whole = layers * blocks * page
        assert moved == want, (
            f"{n} tokens: {moved} bytes moved; the full layers and the chunk are "
            f"{want}, the whole prompt {whole}"
        )


def test_a_sliding_window_is_exact_where_its_first_token_opens_a_block(pair: Pair) -> None:
    """Sliding window ``W``: the last of ``n`` prompt tokens attends back to token ``n - W``,
    which opens a block where ``(n - W + 1) % BS == 0``; vLLM's decode holding all ``n``
    tokens would keep none of that block. Such prompts (short, four at a time, and
    thousands of tokens) and their neighbours equal colocated token for token and, float32
    families, logprob for logprob (one lost key moves them, seldom the greedy token); every
    load ended without a failure and every byte matched the prefill's."""
    f = pair.family
    if not f.window:
        pytest.skip(f"{f.name} has no sliding window")
    edge = WINDOW - 1 + BS  # (n - WINDOW + 1) % BS == 0
    short = (edge, edge + 1, edge + BS, edge + BS + 1)
    far = edge + (LONG - edge) // BS * BS
    prompts = [prompt(n, 700 + i) for i, n in enumerate((*short, far, far + 1))]
    d0, before = pair.d(), pair.integrity()
    with cf.ThreadPoolExecutor(len(short)) as ex:
        got = list(ex.map(lambda p: answer(pair.router.url, p), prompts[: len(short)]))
    got += [answer(pair.router.url, p) for p in prompts[len(short) :]]
    refs = [answer(pair.prefill.url, p) for p in prompts]
    for p, (g, glp), (r, rlp) in zip(prompts, got, refs):
        assert g == r or not pair.exact_alone, f"{len(p)} prompt tokens: {g} != colocated {r}"
        if pair.exact_alone:
            worst = max(abs(a - b) for a, b in zip(glp, rlp))
            assert worst <= LOGPROB_TOL, f"{len(p)} prompt tokens: logprobs {glp} != {rlp}"
    wait(
        "the decode's checks",
        lambda: pair.integrity()["checks"] >= before["checks"] + len(prompts),
        timeout=30,
    )
    d = pair.d()
    assert d["loads"] - d0.get("loads", 0) == len(prompts), pair.since(d0)
    assert d["load_failures"] == d0.get("load_failures", 0)
    assert pair.integrity()["mismatches"] == 0
