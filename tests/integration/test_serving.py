"""End to end through the router on loopback: real prefill and decode worker processes, real
Mooncake transfers, real bootstrap; every output is compared token for token with the
colocated reference. One cluster for the module; the prefill-crash case runs last."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pdxfer.serving.toy import (
    EOS_ID,
    SpecResult,
    ToyConfig,
    ToyModel,
    encode,
    make_draft,
    speculative_generate,
)
from pdxfer.serving.toy.cluster import Cluster
from pdxfer.serving.toy.demo import make_prompts

FAST = [
    "--bootstrap-timeout",
    "10",
    "--transfer-timeout",
    "60",
    "--heartbeat",
    "0.25",
    "--pages",
    "512",
]
torch.set_num_threads(1)  # the toy model's ops are tiny; a second thread only spins
MODEL = ToyModel(ToyConfig())
DRAFT = make_draft(MODEL)
SPEC_PROMPT = "speculative decoding needs the draft KV of the prefix too. " * 6 + "go:"


@functools.cache
def spec_reference() -> SpecResult:
    return speculative_generate(MODEL, DRAFT, encode(SPEC_PROMPT), 24, k=4)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(worker_args=FAST, router_args=["--timeout", "60"]).start()
    try:
        yield c
    finally:
        c.stop()


def ids_of(status: int, body: object) -> list[int]:
    """The generated token ids (pdxfer's extension field), after checking that the text the
    client sees is exactly those tokens' text."""
    assert status == 200, body
    if isinstance(body, list):  # SSE chunks: text deltas, then the last one with the figures
        assert not [e for e in body if "error" in e], body
        final = [e for e in body if "pdxfer" in e]
        assert len(final) == 1, body
        ids = final[0]["pdxfer"]["token_ids"]
        text = "".join(e["choices"][0]["text"] for e in body if e.get("choices"))
    else:
        assert isinstance(body, dict)
        ids, text = body["pdxfer"]["token_ids"], body["choices"][0]["text"]
    assert text == detok(ids)
    return ids


def detok(ids: list[int]) -> str:
    return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")


def greedy(prompt: str, n: int) -> list[int]:
    """The colocated reference, ending before EOS as a served request does."""
    out = MODEL.generate(encode(prompt), n)
    return out[: out.index(EOS_ID)] if EOS_ID in out else out


def test_fifty_requests_identical_to_colocated(cluster: Cluster) -> None:
    prompts = make_prompts(50, seed=1, prefix_words=10)
    bodies = [
        {"prompt": p, "max_tokens": 6, "stream": i % 4 == 3, "temperature": 0}
        for i, p in enumerate(prompts)
    ]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(cluster.complete, bodies))
    for p, (status, body) in zip(prompts, results):
        assert ids_of(status, body) == greedy(p, 6), p


def test_the_prefill_streams_each_layer_of_each_chunk_as_the_forward_writes_it(
    cluster: Cluster,
) -> None:
    """TP 1: every target layer of every chunk is handed to the sender as soon as the forward
    wrote it, then the chunk's draft layers (one send); the output stays exact."""
    prompt = "layer by layer, every chunk of a prompt no cache has seen: " + "qz" * 90
    n = len(encode(prompt))
    before = cluster.metrics("prefill").get("pdxfer_prefill_layer_sends", 0)
    status, body = cluster.complete({"prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert ids_of(status, body) == greedy(prompt, 6)
    chunks = -(-n // 64)  # the workers' --chunk-size
    assert chunks >= 3
    want = chunks * (MODEL.config.n_layers + 1)
    assert body["pdxfer"]["prefill_layer_sends"] == want
    assert cluster.metrics("prefill")["pdxfer_prefill_layer_sends"] == before + want


def test_repeated_long_prefix_is_restored_and_output_identical(cluster: Cluster) -> None:
    prefix = "the long shared system prompt, " * 12  # 372 tokens: 23 full pages
    first = cluster.complete(
        {"prompt": prefix + "first question?", "max_tokens": 8, "temperature": 0}
    )
    second = cluster.complete(
        {"prompt": prefix + "another one!", "max_tokens": 8, "temperature": 0}
    )
    for (status, body), tail in ((first, "first question?"), (second, "another one!")):
        assert ids_of(status, body) == greedy(prefix + tail, 8)
    info1, info2 = first[1]["pdxfer"], second[1]["pdxfer"]
    assert info2["restored_tokens"] >= (len(encode(prefix)) // 16) * 16
    assert info2["bytes"] < info1["bytes"] / 4  # the prefill shipped only the suffix
    assert cluster.metrics("decode")["pdxfer_decode_restored_l2_tokens"] >= 23 * 16
    # the prefill did not compute the shared prefix again either
    assert cluster.metrics("prefill")["pdxfer_prefill_reused_tokens"] >= 23 * 16


def test_draft_kv_restored_with_target_keeps_accept_length(cluster: Cluster) -> None:
    ref = spec_reference()
    body = {"prompt": SPEC_PROMPT, "max_tokens": 24, "speculative_k": 4, "temperature": 0}
    fresh = cluster.complete(body)
    again = cluster.complete(body)
    want = ref.tokens[: ref.tokens.index(EOS_ID)] if EOS_ID in ref.tokens else ref.tokens
    assert ids_of(*fresh) == want and ids_of(*again) == want
    f, r = fresh[1]["pdxfer"], again[1]["pdxfer"]
    assert f["restored_tokens"] == 0 and r["restored_tokens"] > 300
    assert r["mean_accept_length"] >= 0.9 * f["mean_accept_length"]
    assert f["mean_accept_length"] == pytest.approx(ref.mean_accept_length)


def test_accept_length_check_detects_a_missing_draft_prefix() -> None:
    """The check above has teeth: without the prefix's draft KV the accept length drops."""
    prompt = encode(SPEC_PROMPT)
    good = spec_reference()
    kv = MODEL.new_kv_pool(64)
    dkv = DRAFT.new_kv_pool(64, allocator=kv.allocator)
    pt = kv.allocator.alloc(40)
    first = MODEL.prefill(prompt, pt, kv)  # target KV only; the draft pool stays zero
    bad = speculative_generate(
        MODEL, DRAFT, prompt, 24, k=4, kv=kv, draft_kv=dkv, page_table=pt, first_token=first
    )
    assert bad.tokens == good.tokens
    assert bad.mean_accept_length < 0.9 * good.mean_accept_length


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"{not json", "JSON"),
        (b"[1, 2]", "object"),
        (json.dumps({"prompt": "", "max_tokens": 4}).encode(), "empty"),
        (json.dumps({"prompt": 42}).encode(), "prompt"),
        (json.dumps({"prompt": [1, 999]}).encode(), "prompt"),
        (json.dumps({"prompt": "hi", "max_tokens": "4"}).encode(), "max_tokens"),
        (json.dumps({"prompt": "hi", "max_tokens": True}).encode(), "max_tokens"),
        (json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), "max_tokens"),
        (json.dumps({"prompt": "hi", "stream": "yes"}).encode(), "stream"),
        (json.dumps({"prompt": "hi", "speculative_k": 99}).encode(), "speculative_k"),
        (json.dumps({"prompt": "x" * 1020, "max_tokens": 16}).encode(), "exceeds"),
    ],
)
def test_bad_request_gets_4xx_with_message(cluster: Cluster, raw: bytes, why: str) -> None:
    status, body = cluster.complete(None, raw=raw)
    assert 400 <= status < 500, body
    assert why in body["error"]["message"]


def test_good_request_after_bad_ones_still_works(cluster: Cluster) -> None:
    assert ids_of(
        *cluster.complete({"prompt": "still fine?", "max_tokens": 5, "temperature": 0})
    ) == greedy("still fine?", 5)
    assert cluster.metrics("router")["pdxfer_router_bad_requests"] >= 11


HELD_WRITES = {"PDXFER_FAULTS": "delay_write=60"}
"""A prefill whose every transport write waits 60 s before it starts: its requests stay in
flight far longer than any test waits for them, however fast the machine computes them."""


def test_killed_prefill_fails_inflight_requests_then_recovers(cluster: Cluster) -> None:
    """The prefill is killed while requests are in flight there: each gets an answer (an
    error, as none of them can have finished: the prefill's writes are held back), and a
    prefill started again serves. The kill comes once the prefill shows a request in flight,
    so the verdict never depends on how fast it computes."""
    assert cluster.prefill is not None and cluster.decode is not None
    port = cluster.prefill.port
    cluster.prefill.stop()
    cluster.start_prefill(port, env=HELD_WRITES)
    assert cluster.prefill is not None
    prompts = [f"slow request {i}: " + "z" * 900 for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        futs = [
            pool.submit(cluster.complete, {"prompt": p, "max_tokens": 4, "temperature": 0}, 90)
            for p in prompts
        ]
        deadline = time.monotonic() + 60
        while cluster.metrics("prefill").get("pdxfer_prefill_inflight", 0) < 1:
            assert time.monotonic() < deadline, "no request reached the prefill"
            time.sleep(0.02)
        cluster.prefill.kill()
        results = [f.result(timeout=120) for f in futs]  # an answer each, never a hang
    for status, body in results:  # none could finish: every one failed, in OpenAI's shape
        assert status >= 500 and body["error"]["message"], body
    cluster.start_prefill(port)
    for p in ("after the restart", "and once more, longer " * 10):
        assert ids_of(
            *cluster.complete({"prompt": p, "max_tokens": 5, "temperature": 0})
        ) == greedy(p, 5)
    deadline = time.monotonic() + 30  # failed requests' pages come back (fail-closed release)
    while cluster.metrics("decode")["pdxfer_decode_free_pages"] < 512:
        assert time.monotonic() < deadline, cluster.metrics("decode")
        time.sleep(0.2)
