"""A prefill and a decode running different models are refused at pairing, with a message
that names the difference, instead of returning wrong text with status 200."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdxfer.serving.cluster import Cluster

WORKER = ["--bootstrap-timeout", "5", "--transfer-timeout", "10", "--pages", "128"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(worker_args=WORKER, prefill_args=["--seed", "1"],
                router_args=["--timeout", "30"]).start()
    try:
        yield c
    finally:
        c.stop()


def test_a_prefill_with_another_seed_is_refused_naming_the_seed(cluster: Cluster) -> None:
    status, body = cluster.complete({"prompt": "which model are you?", "max_tokens": 4,
                                     "temperature": 0}, timeout=60)
    assert status >= 400, body
    msg = body["error"]["message"]
    assert "model differs" in msg and "seed: prefill 1, decode 0" in msg, msg
