"""Two decode DP groups behind one address (``pdxfer decode --dp 2``): the router keeps one
record per group, so KV-aware routing sends a prompt to the group whose cache holds its
prefix. Through the official ``openai`` client; every output equals the colocated reference.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch

from pdxfer.serving.toy import EOS_ID, ToyConfig, ToyModel, encode
from pdxfer.serving.toy.cluster import Cluster

torch.set_num_threads(1)
MODEL = ToyModel(ToyConfig())
WORKER = [
    "--bootstrap-timeout",
    "15",
    "--transfer-timeout",
    "60",
    "--heartbeat",
    "0.25",
    "--pages",
    "256",
]
N = 10


def greedy(prompt: str) -> list[int]:
    out = MODEL.generate(encode(prompt), N)
    return out[: out.index(EOS_ID)] if EOS_ID in out else out


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return json.loads(text) if url.endswith("/health") else text


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(
        worker_args=WORKER, router_args=["--timeout", "90"], decode_args=["--dp", "2"]
    ).start()
    try:
        yield c
    finally:
        c.stop()


def test_each_group_is_its_own_decode_with_its_own_identity(cluster: Cluster) -> None:
    assert cluster.decode is not None and cluster.router is not None
    h = get(f"{cluster.decode.url}/health")
    assert h["dp_size"] == 2 and [g["status"] for g in h["groups"]] == ["ok", "ok"], h
    peers = {g["peer"] for g in h["groups"]}
    pids = {g["pid"] for g in h["groups"]}
    assert len(peers) == 2 and len(pids) == 2 and h["pid"] not in pids, h
    r = get(f"{cluster.router.url}/health")
    assert sorted(r["workers"]) == sorted(
        [f"{cluster.decode.url}#dp0", f"{cluster.decode.url}#dp1", cluster.prefill.url]
    ), r  # type: ignore[union-attr]
    assert r["policy"] == "kv_aware", r


def test_kv_aware_routing_sends_a_prefix_to_the_group_that_holds_it(cluster: Cluster) -> None:
    assert cluster.router is not None
    client = openai.OpenAI(
        base_url=f"{cluster.router.url}/v1", api_key="unused", max_retries=0, timeout=120
    )

    def ask(prompt: str) -> dict[str, Any]:
        r = client.completions.create(
            model="pdxfer-toy", prompt=prompt, max_tokens=N, temperature=0
        )
        info = r.model_extra["pdxfer"]
        assert info["token_ids"] == greedy(prompt), prompt
        return info

    topics = ["alpha", "beta", "gamma", "delta"]
    prefix = {
        t: f"{t}: " + " ".join(f"{t} page {i} of the shared history" for i in range(9))
        for t in topics
    }
    first = {t: ask(prefix[t] + " | opening question") for t in topics}
    groups = {t: first[t]["decode_dp"] for t in topics}
    assert set(groups.values()) == {0, 1}, groups  # an idle fleet is spread over both
    for t in topics:  # each follow-up goes where its history is, and restores it from L2
        info = ask(prefix[t] + " | follow-up question")
        assert info["decode_dp"] == groups[t], (t, info, groups)
        assert info["restored_l2_tokens"] >= 16 * (len(encode(prefix[t])) // 16 - 1), info
    metrics = get(f"{cluster.decode.url}/metrics")
    for g in (0, 1):  # one merged text, each group's series labelled
        assert f'pdxfer_decode_requests_total{{dp="{g}"}}' in metrics, metrics[:2000]
