"""Integrity through the served system: every transfer the decode receives is checked before
it decodes from it. With ``--integrity-retry`` a page damaged in flight (every room struck
once, ``PDXFER_FAULTS=corrupt=1,once=1``) is asked for again and the output still equals the
colocated reference token for token, streamed or not, under concurrency; without it the
client gets an error, never wrong tokens behind a 200."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from pdxfer.serving.toy import EOS_ID, ToyConfig, ToyModel, decode, encode
from pdxfer.serving.toy.cluster import Cluster

torch.set_num_threads(1)
MODEL = ToyModel(ToyConfig())
WORKER = [
    "--bootstrap-timeout",
    "10",
    "--transfer-timeout",
    "30",
    "--pages",
    "256",
    "--l2-pages",
    "0",
]
FAULTS = {"PDXFER_FAULTS": "corrupt=1,once=1,seed=2"}


def greedy(prompt: str, n: int) -> list[int]:
    out = MODEL.generate(encode(prompt), n)
    return out[: out.index(EOS_ID)] if EOS_ID in out else out


def total(c: Cluster, name: str) -> float:
    return sum(
        v for k, v in c.metrics("decode").items() if k.startswith(f"pdxfer_endpoint_{name}{{")
    )


@pytest.fixture(scope="module")
def retry_cluster() -> Iterator[Cluster]:
    c = Cluster(
        worker_args=WORKER,
        decode_args=["--integrity-retry"],
        router_args=["--timeout", "60"],
        env=FAULTS,
    ).start()
    try:
        yield c
    finally:
        c.stop()


def test_with_integrity_retry_damaged_transfers_still_decode_the_reference_tokens(
    retry_cluster: Cluster,
) -> None:
    c = retry_cluster
    assert c.router is not None
    client = openai.OpenAI(base_url=f"{c.router.url}/v1", api_key="none", max_retries=0)
    prompts = [f"request {i} asks for its KV again: " + "pages " * (3 + 7 * i) for i in range(8)]
    before = total(c, "integrity_retries")

    def plain(p: str) -> list[int]:
        r = client.completions.create(model="pdxfer-toy", prompt=p, max_tokens=8, temperature=0)
        return r.model_extra["pdxfer"]["token_ids"]  # type: ignore[index]

    def streamed(p: str) -> str:
        return "".join(
            ch.choices[0].text
            for ch in client.completions.create(
                model="pdxfer-toy", prompt=p, max_tokens=8, temperature=0, stream=True
            )
            if ch.choices
        )

    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(plain, prompts[:4]))
        texts = list(ex.map(streamed, prompts[4:]))
    for p, ids in zip(prompts[:4], got):
        assert ids == greedy(p, 8), p
    assert texts == [decode(greedy(p, 8)) for p in prompts[4:]]
    # every room was damaged once, caught, and sent again
    assert total(c, "integrity_retries") - before >= len(prompts)
    assert total(c, "faults_injected_corrupt") >= len(prompts)


def test_without_integrity_retry_a_damaged_transfer_is_an_error_not_wrong_tokens() -> None:
    with Cluster(worker_args=WORKER, router_args=["--timeout", "60"], env=FAULTS) as c:
        assert c.router is not None
        client = openai.OpenAI(base_url=f"{c.router.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(
                model="pdxfer-toy", prompt="damaged in flight " * 4, max_tokens=8, temperature=0
            )
        assert "does not match the sender's digest" in str(e.value)
        assert total(c, "integrity_mismatches") >= 1


def test_a_retried_range_is_read_from_pages_no_other_request_got_meanwhile() -> None:
    """The prefill keeps a request's pages while its decode may still ask for a range again
    (the room is held until the decode's Release). Here its pool fits about three prompts,
    more wait for pages, and every control message is 100 ms late, so a page freed at Success
    would hold the next prompt's KV by the time the retry reads it: the retry would then
    ship that KV, with a matching digest, and the first request would decode wrong tokens."""
    env = {"PDXFER_FAULTS": "corrupt=1,once=1,delay_msg=0.1,seed=5"}
    with Cluster(
        worker_args=[*WORKER, "--max-waiting", "64"],
        prefill_args=["--pages", "32"],
        decode_args=["--integrity-retry"],
        router_args=["--timeout", "120"],
        env=env,
    ) as c:
        assert c.router is not None
        client = openai.OpenAI(
            base_url=f"{c.router.url}/v1", api_key="none", max_retries=0, timeout=120
        )
        prompts = [
            f"prompt {i} fills most of the prefill's pages: " + "kv " * (20 + 5 * i)
            for i in range(6)
        ]

        def plain(p: str) -> list[int]:
            r = client.completions.create(model="pdxfer-toy", prompt=p, max_tokens=6, temperature=0)
            return r.model_extra["pdxfer"]["token_ids"]  # type: ignore[index]

        with ThreadPoolExecutor(6) as ex:
            got = list(ex.map(plain, prompts))
        assert total(c, "integrity_retries") >= len(prompts)
        for p, ids in zip(prompts, got):
            assert ids == greedy(p, 6), p
