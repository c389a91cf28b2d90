"""A prefill and a decode running different models are refused at pairing, with a message
that names the difference, instead of returning wrong text with status 200."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdxfer.serving.toy.cluster import Cluster

WORKER = ["--bootstrap-timeout", "5", "--transfer-timeout", "10", "--pages", "128"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(
        worker_args=WORKER, prefill_args=["--seed", "1"], router_args=["--timeout", "30"]
    ).start()
    try:
        yield c
    finally:
        c.stop()


def test_a_prefill_with_another_seed_is_refused_naming_the_seed(cluster: Cluster) -> None:
    status, body = cluster.complete(
        {"prompt": "which model are you?", "max_tokens": 4, "temperature": 0}, timeout=60
    )
    assert status >= 400, body
    msg = body["error"]["message"]
    assert "model differs" in msg and "seed: prefill 1, decode 0" in msg, msg


def test_workers_on_nixl_serve_identical_text_and_refuse_a_mooncake_peer() -> None:
    """``--transport nixl`` on both workers serves the colocated text; a decode left on
    Mooncake is refused at pairing with a message naming both transports."""
    from pdxfer.serving.toy import EOS_ID, ToyConfig, ToyModel, encode

    out = ToyModel(ToyConfig()).generate(encode("over nixl"), 8)
    want = out[: out.index(EOS_ID)] if EOS_ID in out else out
    with Cluster(
        worker_args=[*WORKER, "--transport", "nixl"], router_args=["--timeout", "30"]
    ) as c:
        status, body = c.complete({"prompt": "over nixl", "max_tokens": 8, "temperature": 0})
        assert status == 200, body
        assert body["pdxfer"]["token_ids"] == want
    with Cluster(
        worker_args=WORKER,
        prefill_args=["--transport", "nixl"],
        decode_args=["--transport", "tcp"],
        router_args=["--timeout", "30"],
    ) as c:
        status, body = c.complete(
            {"prompt": "mixed", "max_tokens": 4, "temperature": 0}, timeout=60
        )
        assert status >= 400, body
        msg = body["error"]["message"]
        assert "transport differs" in msg and "nixl" in msg and "mooncake" in msg, msg
