"""The router as real OpenAI clients see it: the official ``openai`` package against two
prefill and two decode workers (real processes, Mooncake transfers, bootstrap) on loopback.
Greedy outputs are compared token for token with the colocated reference."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator

import openai
import pytest
import torch

from pdxfer.serving.procs import Proc
from pdxfer.serving.router.openai_api import chat_prompt
from pdxfer.serving.toy import EOS_ID, ToyConfig, ToyModel, encode
from pdxfer.serving.toy.cluster import Cluster, post

torch.set_num_threads(1)
MODEL = ToyModel(ToyConfig())
WORKER = [
    "--bootstrap-timeout",
    "10",
    "--transfer-timeout",
    "60",
    "--heartbeat",
    "0.25",
    "--pages",
    "512",
]


def greedy(prompt: str | list[int], n: int) -> list[int]:
    out = MODEL.generate(encode(prompt) if isinstance(prompt, str) else prompt, n)
    return out[: out.index(EOS_ID)] if EOS_ID in out else out


def text_of(ids: list[int]) -> str:
    return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(worker_args=WORKER, router_args=["--timeout", "60"], prefills=2, decodes=2).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    assert cluster.router is not None
    return openai.OpenAI(
        base_url=f"{cluster.router.url}/v1", api_key="unused", max_retries=0, timeout=60
    )


def test_stream_joins_to_the_non_streamed_text_with_one_finish_reason(client) -> None:
    prompt = "streaming and non-streaming must agree byte for byte: "
    full = client.completions.create(
        model="pdxfer-toy", prompt=prompt, max_tokens=40, temperature=0
    )
    ids = full.model_extra["pdxfer"]["token_ids"]
    assert ids == greedy(prompt, 40)
    assert full.choices[0].text == text_of(ids)
    assert full.choices[0].finish_reason in ("stop", "length")
    chunks = list(
        client.completions.create(
            model="pdxfer-toy", prompt=prompt, max_tokens=40, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    reasons = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert reasons == [full.choices[0].finish_reason]


def test_usage_is_sent_when_asked_with_cached_tokens(client) -> None:
    prompt = "a prompt long enough to be cached page by page. " * 6
    client.completions.create(
        model="pdxfer-toy", prompt=prompt + "one", max_tokens=4, temperature=0
    )
    chunks = list(
        client.completions.create(
            model="pdxfer-toy",
            prompt=prompt + "two",
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens == len(encode(prompt + "two"))
    assert usage[0].completion_tokens == len(chunks[-2].model_extra["pdxfer"]["token_ids"])
    cached = usage[0].prompt_tokens_details.cached_tokens
    assert cached == chunks[-2].model_extra["pdxfer"]["restored_tokens"]
    plain = client.completions.create(
        model="pdxfer-toy", prompt="no usage asked", max_tokens=3, temperature=0, stream=True
    )
    assert all(c.usage is None for c in plain)


def test_chat_streaming_and_not(client) -> None:
    msgs = [
        {"role": "system", "content": "you are a toy"},
        {"role": "user", "content": "say something"},
    ]
    r = client.chat.completions.create(
        model="pdxfer-toy", messages=msgs, max_tokens=20, temperature=0
    )
    ids = r.model_extra["pdxfer"]["token_ids"]
    assert ids == greedy(chat_prompt(msgs), 20)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text_of(ids)
    chunks = list(
        client.chat.completions.create(
            model="pdxfer-toy", messages=msgs, max_tokens=20, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == r.choices[0].message.content
    assert [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ] == [r.choices[0].finish_reason]


def test_models_list(client) -> None:
    assert [m.id for m in client.models.list()] == ["pdxfer-toy"]


def test_stop_string_ends_the_text_before_it(client) -> None:
    prompt = "find a stop string in here: "
    ids = greedy(prompt, 60)
    text = text_of(ids)
    stop = text[10:13]  # a string the model will produce
    assert stop and stop in text
    r = client.completions.create(
        model="pdxfer-toy", prompt=prompt, max_tokens=60, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(
            model="pdxfer-toy", prompt=prompt, max_tokens=60, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_seeded_sampling_repeats_and_n_gives_n_choices(client) -> None:
    kw = {
        "model": "pdxfer-toy",
        "prompt": "sample me: ",
        "max_tokens": 24,
        "temperature": 0.9,
        "top_p": 0.95,
    }
    a = client.completions.create(seed=1234, **kw)
    b = client.completions.create(seed=1234, **kw)
    assert a.choices[0].text == b.choices[0].text
    assert a.model_extra["pdxfer"]["token_ids"] != greedy("sample me: ", 24)  # really sampled
    two = client.completions.create(seed=7, n=2, **kw)
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.usage.completion_tokens == sum(
        len(x["token_ids"]) for x in two.model_extra["pdxfer"]["choices"]
    )


def test_a_list_of_prompts_gets_a_choice_each(client) -> None:
    prompts = ["first prompt", "second prompt"]
    r = client.completions.create(model="pdxfer-toy", prompt=prompts, max_tokens=6, temperature=0)
    by_index = {c.index: c.text for c in r.choices}
    assert by_index == {i: text_of(greedy(p, 6)) for i, p in enumerate(prompts)}


def test_logprobs_are_the_models_top_k(client) -> None:
    r = client.completions.create(
        model="pdxfer-toy", prompt="log me", max_tokens=5, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert (
        len(lp.token_logprobs) == len(r.model_extra["pdxfer"]["token_ids"]) - 1
        or len(lp.token_logprobs) >= 1
    )
    assert all(len(t) == 3 for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)


@pytest.mark.parametrize(
    "kw, exc, words",
    [
        ({"temperature": "hot"}, openai.BadRequestError, "temperature"),
        ({"max_tokens": 0}, openai.BadRequestError, "max_tokens"),
        ({"n": 99}, openai.BadRequestError, "'n'"),
        ({"presence_penalty": 1.0}, openai.BadRequestError, "not supported"),
        ({"best_of": 3}, openai.BadRequestError, "not supported"),
        ({"stop": ["a", "b", "c", "d", "e"]}, openai.BadRequestError, "stop"),
    ],
)
def test_bad_requests_raise_the_clients_typed_errors(client, kw, exc, words) -> None:
    with pytest.raises(exc) as e:
        client.completions.create(model="pdxfer-toy", prompt="x", **{"max_tokens": 4, **kw})
    assert words in str(e.value)
    assert e.value.body["type"] and e.value.body["message"]  # OpenAI's error shape


def test_unknown_fields_are_accepted_and_unknown_paths_are_json_404(cluster, client) -> None:
    r = client.completions.create(
        model="pdxfer-toy",
        prompt="hi",
        max_tokens=2,
        temperature=0,
        extra_body={"some_new_field": {"x": 1}},
    )
    assert r.choices
    assert cluster.router is not None
    status, body = post(f"{cluster.router.url}/v1/embeddings", {"input": "x"})
    assert status == 404 and body["error"]["message"]


def test_deep_json_is_a_400_not_a_500(cluster) -> None:
    assert cluster.router is not None
    raw = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, body = post(f"{cluster.router.url}/v1/completions", None, raw=raw)
    assert status == 400, body


def _serving_decode(resp: dict) -> str:
    return resp["pdxfer"]["decode"]


def test_kv_aware_routing_sends_a_shared_prefix_to_the_decode_holding_it(cluster) -> None:
    assert cluster.router is not None
    prefix = "a long conversation prefix that two requests share, page after page. " * 5
    url = f"{cluster.router.url}/v1/completions"
    first = post(url, {"prompt": prefix + "turn 1", "max_tokens": 6, "temperature": 0})[1]
    home = _serving_decode(first)
    for i in range(2, 6):
        status, r = post(url, {"prompt": prefix + f"turn {i}", "max_tokens": 6, "temperature": 0})
        assert status == 200 and _serving_decode(r) == home, (i, r["pdxfer"])
        assert r["pdxfer"]["token_ids"] == greedy(prefix + f"turn {i}", 6)
        assert r["pdxfer"]["restored_tokens"] > 0
    other = post(url, {"prompt": "an unrelated prompt " * 3, "max_tokens": 4, "temperature": 0})[1]
    assert other["pdxfer"]["token_ids"] == greedy("an unrelated prompt " * 3, 4)


def test_round_robin_over_two_prefills_and_two_decodes_uses_every_worker(cluster) -> None:
    assert cluster.bootstrap is not None
    args = ["--log-level", "WARNING", "router", "--port", "0", "--policy", "round_robin"]
    for i, p in enumerate(cluster.prefills):
        assert p is not None
        inst = "default" if i == 0 else f"prefill{i}"
        args += ["--prefill", f"{p.url},{cluster.bootstrap.address},{inst}"]
    for d in cluster.decodes:
        args += ["--decode", d.url]
    rr = Proc("rr-router", args)
    try:
        seen: set[tuple[str, str]] = set()
        for i in range(8):
            status, r = post(
                f"{rr.url}/v1/completions", {"prompt": f"rr {i}", "max_tokens": 3, "temperature": 0}
            )
            assert status == 200, r
            seen.add((r["pdxfer"]["prefill"], r["pdxfer"]["decode"]))
        assert {p for p, _ in seen} == {p.url for p in cluster.prefills if p}
        assert {d for _, d in seen} == {d.url for d in cluster.decodes}
        with urllib.request.urlopen(f"{rr.url}/health", timeout=10) as h:
            assert h.status == 200 and json.loads(h.read())["status"] == "ok"
    finally:
        rr.stop()


def test_router_gauges_are_gauges(cluster) -> None:
    assert cluster.router is not None
    with urllib.request.urlopen(f"{cluster.router.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert "# TYPE pdxfer_router_outstanding gauge" in text
    assert "# TYPE pdxfer_router_healthy_decodes gauge" in text
    assert re.search(r"# TYPE pdxfer_router_success(_total)? counter", text), text
