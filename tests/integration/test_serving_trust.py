"""The served system with access control on: the router asks
for an API key, the workers accept only the router, a client cannot name a bootstrap server,
prefix reuse is scoped per tenant, and cache hits are shown only when the operator says so."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from pdxfer.serving.procs import Proc
from pdxfer.serving.toy.cluster import Cluster, post

SECRET = "a-shared-secret-for-this-test-0123456789"
ALICE, BOB = "key-for-alice-0123456789", "key-for-bob-0123456789xx"
ENV = {"PDXFER_SECRET": SECRET, "PDXFER_API_KEYS": f"alice:{ALICE},bob:{BOB}"}
WORKER = ["--bootstrap-timeout", "10", "--transfer-timeout", "30", "--pages", "256"]
PREFIX = "a secret system prompt of alice, long enough to fill several pages. " * 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(worker_args=WORKER, router_args=["--timeout", "60"], env=ENV).start()
    try:
        yield c
    finally:
        c.stop()


def ask(c: Cluster, prompt: str, key: str | None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return c.complete({"prompt": prompt, "max_tokens": 4, "temperature": 0}, headers=headers)


def test_the_router_needs_an_api_key(cluster: Cluster) -> None:
    assert cluster.router is not None
    anon = openai.OpenAI(
        base_url=f"{cluster.router.url}/v1", api_key="wrong-key-000000000000", max_retries=0
    )
    with pytest.raises(openai.AuthenticationError):
        anon.completions.create(model="pdxfer-toy", prompt="hi", max_tokens=2)
    alice = openai.OpenAI(base_url=f"{cluster.router.url}/v1", api_key=ALICE, max_retries=0)
    assert alice.completions.create(
        model="pdxfer-toy", prompt="hi", max_tokens=2, temperature=0
    ).choices


def test_workers_accept_only_the_router(cluster: Cluster) -> None:
    """A client that reaches the decode directly cannot make it look up (and then trust) a
    bootstrap server of its choosing, nor abort a room."""
    assert cluster.decode is not None and cluster.prefill is not None
    attacker_bootstrap = "127.0.0.1:9"
    status, body = post(
        f"{cluster.decode.url}/generate",
        {"room": 77, "bootstrap": attacker_bootstrap, "prompt_ids": [1, 2, 3], "max_tokens": 2},
    )
    assert status == 401, body
    status, body = post(f"{cluster.prefill.url}/abort", {"room": 77})
    assert status == 401, body
    status, _ = ask(cluster, "still served through the router", ALICE)
    assert status == 200


def test_prefix_reuse_is_scoped_per_tenant(cluster: Cluster) -> None:
    s1, a1 = ask(cluster, PREFIX + "pin 1234", ALICE)
    s2, a2 = ask(cluster, PREFIX + "pin 5678", ALICE)
    s3, b1 = ask(cluster, PREFIX + "pin 1234", BOB)
    assert s1 == s2 == s3 == 200
    assert a2["pdxfer"]["restored_tokens"] > 0  # alice's own prefix is reused
    assert b1["pdxfer"]["restored_tokens"] == 0  # bob never hits alice's pages
    assert b1["pdxfer"]["token_ids"] == a1["pdxfer"]["token_ids"]  # same model, same text


def test_cache_hits_are_hidden_unless_the_operator_shows_them(cluster: Cluster) -> None:
    assert cluster.bootstrap is not None and cluster.prefill is not None
    assert cluster.decode is not None
    quiet = Proc(
        "quiet-router",
        [
            "--log-level",
            "WARNING",
            "router",
            "--port",
            "0",
            "--prefill",
            f"{cluster.prefill.url},{cluster.bootstrap.address}",
            "--decode",
            cluster.decode.url,
        ],
        env=ENV,
    )
    try:
        for _ in range(2):
            status, body = post(
                f"{quiet.url}/v1/completions",
                {"prompt": PREFIX + "pin 9999", "max_tokens": 4, "temperature": 0},
                headers={"Authorization": f"Bearer {ALICE}"},
            )
            assert status == 200, body
        assert "restored_tokens" not in body["pdxfer"] and "bytes" not in body["pdxfer"]
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        quiet.stop()
