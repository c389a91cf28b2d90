"""Real vLLM end to end: a bootstrap server, one ``vllm serve`` prefill and one decode, each
loading ``PdxferConnector``, driven with the official ``openai`` client through pdxfer's router
(``pdxfer router --engine vllm``); every output equals a colocated vLLM (same model, no
connector) token for token.

One cluster per module (engines start once). The router dispatches both sides at once (the
early form: the decode asks while the prefill computes), and the prefill computes at most
``STEP`` tokens a step (``--max-num-batched-tokens``), so a prompt spans several steps and its
blocks go out after each. The decode runs with decode-side tiers (L2 host pages, L3 files)
and vLLM's own prefix cache off, so a repeated prefix is restored by pdxfer, and with
``kv_load_failure_policy: recompute``. Faults are set per room from the start:
room ``ROOM_SLOW`` is written late by the prefill (to kill it mid-transfer), room
``ROOM_CORRUPT`` is damaged on the decode after it arrived (integrity must catch it). Each
decode step that runs requests is held ``PACE_S`` (``step_pace_s``), so a long request
cannot end before a client that leaves has left, however fast the machine.

The tests run in file order: each leaves the cluster serving for the next.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator

import pytest
from openai import OpenAI

from pdxfer import BootstrapServer
from pdxfer.serving.vllm.local_model import SHAPES
from pdxfer.serving.vllm.servers import VllmServer, kv_config, start_all

from . import vllm_helpers as vh
from .vllm_helpers import (
    MAX_TOKENS,
    chat_stream,
    client,
    complete,
    kv_usage,
    metric,
    ref_chat,
    stream_ids,
    text,
    token_ids,
    wait,
)

pytestmark = [pytest.mark.timeout(900), pytest.mark.engine]

BS = 32
ROOM_SLOW, ROOM_CORRUPT = 4242, 4343
DECODE, PREFILL = "vllm-d0", "vllm-p0"
DEADLINE_S = 20.0
PACE_S = 0.02  # the decode's shortest step: 400 tokens take at least 8 s
STEP = 64  # the prefill's tokens per step: two blocks
S = SHAPES["small"]
BLOCK_BYTES = S.layers * S.kv_heads * BS * 2 * S.head_size * 4  # one block, all layers, fp32


class Cluster(vh.Cluster):
    """The decode with L2/L3 (file) tiers and ``recompute``; the faults set from the start."""

    prefill_instance, decode_instance = PREFILL, DECODE

    def prefill_server(self, port: int | None = None) -> VllmServer:
        extra = {
            "bootstrap": self.boot.address,
            "instance": PREFILL,
            "stats_file": str(self.p_stats),
            "bootstrap_timeout_s": DEADLINE_S,
            "transfer_timeout_s": DEADLINE_S,
        }
        return VllmServer(
            "prefill",
            self.model,
            self.tmp,
            port=port,
            log_stats=True,
            args=["--max-num-batched-tokens", str(STEP)],
            kv_transfer_config=kv_config("kv_producer", extra),
            env={"PDXFER_FAULTS": f"delay_write=8,rooms={ROOM_SLOW}"},
        )

    def decode_server(self, port: int | None = None) -> VllmServer:
        extra = {
            "bootstrap": self.boot.address,
            "instance": DECODE,
            "stats_file": str(self.d_stats),
            "l2_pages": 256,
            "l3": "file",
            "l3_dir": str(self.tmp / "l3"),
            "bootstrap_timeout_s": DEADLINE_S,
            "transfer_timeout_s": DEADLINE_S,
            "step_pace_s": PACE_S,
        }
        return VllmServer(
            "decode",
            self.model,
            self.tmp,
            port=port,
            args=["--no-enable-prefix-caching"],
            log_stats=True,
            kv_transfer_config=kv_config("kv_consumer", extra, kv_load_failure_policy="recompute"),
            env={"PDXFER_FAULTS": f"corrupt=1,rooms={ROOM_CORRUPT}"},
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from vh.serve(Cluster(tmp_path_factory.mktemp("vllm_pd")))


@pytest.fixture(scope="module")
def front_door(cluster: Cluster) -> Iterator[str]:
    """pdxfer's router in front of the pair, as users run it: it tokenizes with the model's
    own tokenizer, draws the room and binds it to the decode it chose."""
    yield from vh.front_door(cluster)


def test_outputs_equal_colocated_vllm_token_for_token(cluster: Cluster, front_door: str) -> None:
    short = ["Hello", "The river", "def add(a, b):", "Numbers were shouted:"]
    long = [text(7 * i, 150 + 90 * i) for i in range(4)]  # ~5 to ~20 blocks
    prefix = text(500, 220)
    shared = [f"{prefix} Question {i}: {text(40 * i, 5 + i)}?" for i in range(6)]
    prompts = short + long + shared
    chats = [f"Tell me about {text(11 * i, 3)}." for i in range(3)] + [prefix + " Summarise."]
    want = {p: complete(cluster.ref.url, p) for p in prompts}
    want_chat = {t: ref_chat(cluster.ref.url, t) for t in chats}
    before = cluster.d().get("loads", 0)
    with cf.ThreadPoolExecutor(4) as pool:
        got = dict(zip(prompts, pool.map(lambda p: complete(front_door, p), prompts)))
        got_chat = dict(zip(chats, pool.map(lambda t: chat_stream(front_door, t), chats)))
    for p in prompts:
        assert got[p] == want[p], f"prompt {p[:40]!r}: {got[p]} != colocated {want[p]}"
    for t in chats:
        assert got_chat[t][0] == want_chat[t][0], f"chat {t[:40]!r}"
        assert got_chat[t][1] == want_chat[t][1]
    n = len(prompts) + len(chats)
    assert n >= 16
    # KV really moved: every request loaded from the prefill, none fell back to a recompute
    wait("the decode's stats", lambda: cluster.d().get("loads", 0) - before == n)
    d = cluster.d()
    assert d["load_failures"] == 0 and d["in_flight_loads"] == 0
    wait("the prefill's sends", lambda: cluster.p().get("in_flight_sends", 1) == 0)
    p = cluster.p()
    assert p["sends"] >= n and p["send_failures"] == 0
    assert p["endpoint"]["transport_bytes"] == d["net_bytes"] > 0


def _ids(base: int, n: int) -> list[int]:
    return [(base + 37 * i) % 700 + 300 for i in range(n)]


def test_a_repeated_prefix_is_restored_from_l2_and_only_the_suffix_crosses(
    cluster: Cluster, front_door: str
) -> None:
    prefix = _ids(1, 8 * BS)
    a, b = prefix + _ids(900, 20), prefix + _ids(1900, 45)
    assert complete(front_door, a) == complete(cluster.ref.url, a)
    wait(
        "the write-back of the first request",
        lambda: cluster.d().get("tiers", {}).get("l2_writebacks", 0) >= 8,
    )
    d0, sent0 = cluster.d(), cluster.p()["endpoint"]["transport_bytes"]
    assert complete(front_door, b) == complete(cluster.ref.url, b)
    wait("the prefill's send", lambda: cluster.p()["endpoint"]["transport_bytes"] > sent0)
    d1 = cluster.d()
    assert d1["restored_l2_pages"] - d0["restored_l2_pages"] == 8
    suffix = (-(-len(b) // BS) - 8) * BLOCK_BYTES
    assert cluster.p()["endpoint"]["transport_bytes"] - sent0 == suffix
    assert d1["net_bytes"] - d0["net_bytes"] == suffix
    # the same figures in vLLM's own /metrics (worker -> engine core -> API server)
    wait(
        "the decode's /metrics",
        lambda: metric(cluster.decode, "vllm:pdxfer_net_bytes_total") == cluster.d()["net_bytes"],
    )
    d2 = cluster.d()
    for k in ("restored_l2_pages", "loads", "loaded_tokens", "load_failures"):
        assert metric(cluster.decode, f"vllm:pdxfer_{k}_total") == d2[k], k
    assert metric(cluster.prefill, "vllm:pdxfer_sends_total") == cluster.p()["sends"]


KEY_A, KEY_B = "alice-key-0123456789", "bob-key-0123456789ab"


def test_tenants_never_restore_each_others_prefix(cluster: Cluster) -> None:
    """With API keys the router turns each tenant into vLLM's cache_salt: the decode restores
    a tenant's own prefix from L2, never another tenant's (it crosses the wire instead)."""
    router = cluster.router("router-keys", env={"PDXFER_API_KEYS": f"alice:{KEY_A},bob:{KEY_B}"})
    try:
        prefix = _ids(123, 6 * BS)
        a, b, c = (prefix + _ids(base, 10 + k) for k, base in enumerate((31, 57, 89)))

        def ask(key: str, prompt: list[int]) -> list[int]:
            r = OpenAI(
                base_url=f"{router.url}/v1", api_key=key, max_retries=0, timeout=120
            ).completions.create(
                model="llama",
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return token_ids(r.choices[0], r)

        w0 = cluster.d().get("tiers", {}).get("l2_writebacks", 0)
        assert ask(KEY_A, a) == complete(cluster.ref.url, a)
        wait(
            "alice's write-back",
            lambda: cluster.d().get("tiers", {}).get("l2_writebacks", 0) >= w0 + 6,
        )
        r0 = cluster.d()["restored_l2_pages"]
        assert ask(KEY_B, b) == complete(cluster.ref.url, b)
        assert cluster.d()["restored_l2_pages"] == r0, "bob restored alice's prefix"
        assert ask(KEY_A, c) == complete(cluster.ref.url, c)
        assert cluster.d()["restored_l2_pages"] == r0 + 6, "alice did not restore her own"
    finally:
        router.stop()


def _direct(cluster: Cluster, prompt: list[int], room: int, timeout: float = 120) -> list[int]:
    """The proxy protocol by hand, with a chosen room (the fault injection names rooms)."""
    params = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "pdxfer_room": room,
        "pdxfer_decode": DECODE,
    }
    first = client(cluster.prefill.url).completions.create(
        model="llama",
        prompt=prompt,
        max_tokens=1,
        temperature=0,
        extra_body={"kv_transfer_params": params},
    )
    answer = first.model_extra["kv_transfer_params"]  # type: ignore[index]
    assert answer["pdxfer_room"] == room
    return complete(
        cluster.decode.url, prompt, extra={"kv_transfer_params": answer}, timeout=timeout
    )


def test_a_rogue_prefill_named_in_kv_transfer_params_is_never_paired(
    cluster: Cluster, front_door: str
) -> None:
    """A client names a rogue prefill (a real ``vllm serve`` prefill with the connector, on a
    bootstrap of its own, holding the KV of another prompt) in the decode's
    ``kv_transfer_params``. The decode trusts only its configured bootstrap: it serves the
    request as if it had no pdxfer params (computing the prompt itself), never looks the rogue
    up, and counts the refusal; the victim's own request later gets the colocated tokens."""
    rogue_boot = BootstrapServer("127.0.0.1", 0).start()
    rogue = VllmServer(
        "rogue-prefill",
        cluster.model,
        cluster.tmp,
        kv_transfer_config=kv_config(
            "kv_producer",
            {"bootstrap": rogue_boot.address, "instance": "rogue", "bootstrap_timeout_s": 5.0},
        ),
    )
    try:
        start_all([rogue])
        victim, evil = _ids(5000, 3 * BS + 5), _ids(7000, 3 * BS + 5)
        r = client(rogue.url).completions.create(
            model="llama",
            prompt=evil,
            max_tokens=1,
            temperature=0,
            extra_body={
                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}
            },
        )
        params = (r.model_extra or {})["kv_transfer_params"]
        assert params["pdxfer_bootstrap"] == rogue_boot.address
        want = complete(cluster.ref.url, victim)
        refused = metric(cluster.decode, "vllm:pdxfer_untrusted_refused_total")
        loads = cluster.d().get("loads", 0)
        got = complete(cluster.decode.url, victim, extra={"kv_transfer_params": params})
        assert got == want, "the decode computed the prompt itself"
        wait(
            "the refusal in /metrics",
            lambda: metric(cluster.decode, "vllm:pdxfer_untrusted_refused_total") == refused + 1,
        )
        assert rogue_boot.counters["lookups"] == 0, "the rogue's bootstrap was never asked"
        assert cluster.d().get("loads", 0) == loads
        assert complete(front_door, victim) == want  # the victim, through the front door
    finally:
        rogue.stop()
        rogue_boot.stop()


def test_a_corrupted_transfer_is_caught_and_no_wrong_token_is_returned(cluster: Cluster) -> None:
    prompt = _ids(5000, 5 * BS + 7)
    d0 = cluster.d()
    got = _direct(cluster, prompt, ROOM_CORRUPT)
    assert got == complete(cluster.ref.url, prompt)
    wait("the decode's stats", lambda: cluster.d()["load_failures"] > d0["load_failures"])
    d1 = cluster.d()
    assert d1["endpoint"]["integrity_mismatches"] > d0["endpoint"].get("integrity_mismatches", 0)
    assert d1["load_failures"] == d0["load_failures"] + 1


def test_a_prefill_killed_mid_transfer_ends_the_request_by_its_policy_and_blocks_come_back(
    cluster: Cluster, front_door: str
) -> None:
    prompt = _ids(7000, 6 * BS + 3)
    want = complete(cluster.ref.url, prompt)
    d0 = cluster.d()
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_direct, cluster, prompt, ROOM_SLOW)
        # the prefill answered and its write is held back 8 s: the load is in flight
        wait("the load to start", lambda: cluster.d().get("loads", 0) > d0.get("loads", 0))
        assert kv_usage(cluster.decode) > 0, "the decode holds blocks for the load"
        cluster.prefill.kill()
        got = fut.result(timeout=DEADLINE_S + 60)
    assert got == want, "recomputed by the decode (kv_load_failure_policy: recompute)"
    d1 = cluster.d()
    assert d1["load_failures"] == d0.get("load_failures", 0) + 1 and d1["in_flight_loads"] == 0
    # the kill was noticed, not waited out: the load failed for another cause than its
    # deadline (the cause, not a stopwatch, says so on any machine; fut.result's timeout
    # catches a hang: the recompute after the failure takes what the machine takes)
    e0, e1 = d0.get("endpoint", {}), d1["endpoint"]
    assert e1.get("failures_deadline", 0) == e0.get("failures_deadline", 0), e1
    assert sum(v for k, v in e1.items() if k.startswith("failures_")) > sum(
        v for k, v in e0.items() if k.startswith("failures_")
    ), e1
    wait("the decode's blocks to come back", lambda: kv_usage(cluster.decode) == 0.0)
    cluster.restart_prefill()
    nxt = _ids(8000, 3 * BS + 5)
    assert complete(front_door, nxt) == complete(cluster.ref.url, nxt)
    wait("the decode's stats", lambda: cluster.d()["loads"] == d1["loads"] + 1)
    assert cluster.d()["load_failures"] == d1["load_failures"]


def test_a_restarted_decode_restores_a_prefix_from_l3_files(
    cluster: Cluster, front_door: str
) -> None:
    prefix = _ids(1, 8 * BS)  # written back by the L2 test above
    wait("L3 writes", lambda: cluster.d().get("tiers", {}).get("l3_puts", 0) >= 8)
    cluster.restart_decode()
    c = prefix + _ids(3300, 30)
    sent0 = cluster.p()["endpoint"]["transport_bytes"]
    assert complete(front_door, c) == complete(cluster.ref.url, c)
    wait("the decode's stats", lambda: cluster.d().get("loads", 0) == 1)
    d = cluster.d()
    assert d["restored_l3_pages"] == 8 and d["load_failures"] == 0
    wait("the prefill's send", lambda: cluster.p()["endpoint"]["transport_bytes"] > sent0)
    suffix = (-(-len(c) // BS) - 8) * BLOCK_BYTES
    assert d["net_bytes"] == cluster.p()["endpoint"]["transport_bytes"] - sent0 == suffix


def test_concurrent_and_sequential_dispatch_stream_steps_and_equal_colocated(
    cluster: Cluster, front_door: str
) -> None:
    """Concurrent dispatch (the router's default), streamed and not, and the sequential
    form (the decode asks after the prefill finished): equal to colocated vLLM. Prompts span
    several prefill steps, whose blocks are handed over after each step; the later prompts
    share a prefix the prefill holds in its own prefix cache (those blocks need no compute
    and are sent all the same)."""
    prefix = _ids(9100, 6 * BS)
    prompts = [prefix + _ids(9200 + 50 * i, 40 + 9 * i) for i in range(4)]
    want = [complete(cluster.ref.url, q) for q in prompts]
    p0 = {k: cluster.p().get(k, 0) for k in ("sends", "send_failures", "step_chunks")}
    hits0 = metric(cluster.prefill, "vllm:prefix_cache_hits_total")
    seq = cluster.router("router-seq", "--dispatch", "sequential")
    try:
        assert complete(front_door, prompts[0]) == want[0]
        assert stream_ids(front_door, prompts[1]) == want[1]
        assert complete(seq.url, prompts[2]) == want[2]
        assert stream_ids(seq.url, prompts[3]) == want[3]
        r = client(front_door).completions.create(
            model="llama", prompt=prompts[0], max_tokens=2, temperature=0
        )
        assert r.model_extra["pdxfer"]["dispatch"] == "concurrent"  # type: ignore[index]
        r = client(seq.url).completions.create(
            model="llama", prompt=prompts[0], max_tokens=2, temperature=0
        )
        assert r.model_extra["pdxfer"]["dispatch"] == "sequential"  # type: ignore[index]
    finally:
        seq.stop()
    wait(
        "the prefill's sends",
        lambda: cluster.p()["sends"] >= p0["sends"] + 6 and cluster.p()["in_flight_sends"] == 0,
    )
    p1 = cluster.p()
    assert p1["send_failures"] == p0["send_failures"]
    # the first prompt (232 tokens, nothing cached) takes four STEP-token steps: the first
    # three hand their blocks over before the prompt's end (the others start past the cached
    # prefix and take one or two steps)
    assert p1["step_chunks"] - p0["step_chunks"] >= 3
    assert metric(cluster.prefill, "vllm:prefix_cache_hits_total") > hits0


def test_a_decode_that_asks_before_the_prefill_has_the_request(cluster: Cluster) -> None:
    """The early form by hand: the decode's request (room, bootstrap, the prefill's
    instance) goes first and the decode asks; the prefill gets its request only then."""
    prompt = _ids(9600, 7 * BS + 11)
    want = complete(cluster.ref.url, prompt)
    room = 77_000_001
    early = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "pdxfer_room": room,
        "pdxfer_bootstrap": cluster.boot.address,
        "pdxfer_instance": PREFILL,
    }
    d0 = {k: cluster.d().get(k, 0) for k in ("loads", "load_failures", "loaded_tokens")}
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(complete, cluster.decode.url, prompt, extra={"kv_transfer_params": early})
        wait("the decode to ask", lambda: cluster.d().get("loads", 0) > d0["loads"])
        assert not fut.done(), "the decode waits for the prefill's room"
        params = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "pdxfer_room": room,
            "pdxfer_decode": DECODE,
        }
        client(cluster.prefill.url).completions.create(
            model="llama",
            prompt=prompt,
            max_tokens=1,
            temperature=0,
            extra_body={"kv_transfer_params": params},
        )
        assert fut.result(timeout=120) == want
    wait("the decode's stats", lambda: cluster.d()["in_flight_loads"] == 0)
    assert cluster.d()["load_failures"] == d0["load_failures"]
    # it waited, however long: its KV came from the prefill, which got the request only after
    # it asked (a decode that went on alone would have loaded nothing)
    assert cluster.d()["loaded_tokens"] > d0["loaded_tokens"]


def test_a_failed_prefill_ends_the_engaged_decode_with_an_openai_error(cluster: Cluster) -> None:
    """The router's 'prefill' is a worker that is no kv_producer (it answers without
    kv_transfer_params): the decode, engaged at dispatch, is aborted by the router (its load
    ends as aborted, not at its bootstrap deadline), its blocks come back, and the client
    gets an OpenAI-shaped error after the retry, whose decode leg waits for the prefill's
    answer and so is never sent (one load, not two)."""
    import openai

    bad = cluster.router("router-bad", prefill_url=cluster.decode.url)
    prompt = _ids(9900, 4 * BS + 3)
    loads0 = cluster.d().get("loads", 0)
    ep0 = cluster.d().get("endpoint", {})
    try:
        with pytest.raises(openai.APIStatusError) as e:
            client(bad.url).completions.create(
                model="llama", prompt=prompt, max_tokens=4, temperature=0
            )
    finally:
        bad.stop()
    assert e.value.status_code == 502
    assert "kv_transfer_params" in str(e.value.body), e.value.body
    wait(
        "the decode's loads to end",
        lambda: cluster.d()["in_flight_loads"] == 0 and cluster.d()["loads"] >= loads0 + 1,
        timeout=60,
    )
    ep1 = cluster.d()["endpoint"]
    assert ep1.get("failures_aborted", 0) - ep0.get("failures_aborted", 0) == 1, (
        "the first try's decode was engaged at dispatch and ended by the router's abort"
    )
    assert cluster.d()["loads"] == loads0 + 1, "the retry's decode leg was never sent"
    assert ep1.get("failures_deadline", 0) == ep0.get("failures_deadline", 0)
    wait("the decode's blocks to come back", lambda: kv_usage(cluster.decode) == 0.0)
    assert complete(cluster.decode.url, prompt) == complete(cluster.ref.url, prompt)


def test_a_client_that_leaves_ends_both_sides(cluster: Cluster, front_door: str) -> None:
    """A streamed client that leaves after its first token: the router closes both legs, and
    vLLM aborts the decode's request before its 400 tokens, which the
    paced decode needs at least 8 s for (its blocks come back)."""
    prompt = _ids(9950, 3 * BS + 5)
    gen0 = metric(cluster.decode, "vllm:generation_tokens_total")
    ok0 = metric(cluster.decode, "vllm:request_success_total")
    stream = client(front_door).completions.create(
        model="llama",
        prompt=prompt,
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            break
    stream.close()
    wait(
        "the decode to end the request",
        lambda: (
            metric(cluster.decode, "vllm:num_requests_running") == 0
            and metric(cluster.decode, "vllm:num_requests_waiting") == 0
            and kv_usage(cluster.decode) == 0.0
        ),
        timeout=60,
    )
    assert metric(cluster.prefill, "vllm:num_requests_running") == 0
    # nothing runs or waits on the decode: no token of the request can follow
    assert metric(cluster.decode, "vllm:request_success_total") == ok0, "it finished"
    gen = metric(cluster.decode, "vllm:generation_tokens_total")
    assert gen - gen0 < 400, "the decode generated every token: the request was not aborted"
