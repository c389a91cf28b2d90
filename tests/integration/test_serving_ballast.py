"""KV ballast through the served system (``--kv-ballast-bytes-per-token``, a benchmark
device): the sidecar pool travels with the KV, comes back from L2 with a repeated prefix, and
is checked on the decode against the prompt's tokens. Outputs equal the colocated reference
token for token; a ballast page damaged in flight with the transfer check off is caught by the
decode's ballast check (an error, never tokens behind a 200); one damaged in a restore is
caught by the tiers' check and repaired; a prefill and decode that disagree on the ballast
refuse to pair."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch

from pdxfer.serving.toy import EOS_ID, ToyConfig, ToyModel, encode
from pdxfer.serving.toy.cluster import Cluster

torch.set_num_threads(1)
MODEL = ToyModel(ToyConfig())
BALLAST = ["--kv-ballast-bytes-per-token", "4096"]
WORKER = [
    "--bootstrap-timeout",
    "10",
    "--transfer-timeout",
    "30",
    "--pages",
    "128",
    "--l2-pages",
    "128",
    *BALLAST,
]
PREFIX = "a long shared history whose ballast comes back from the decode's L2. " * 4


def greedy(prompt: str, n: int) -> list[int]:
    out = MODEL.generate(encode(prompt), n)
    return out[: out.index(EOS_ID)] if EOS_ID in out else out


def client(c: Cluster) -> openai.OpenAI:
    assert c.router is not None
    return openai.OpenAI(base_url=f"{c.router.url}/v1", api_key="none", max_retries=0)


def complete(c: Cluster, prompt: str, n: int = 8) -> dict[str, Any]:
    r = client(c).completions.create(model="pdxfer-toy", prompt=prompt, max_tokens=n, temperature=0)
    ext = r.model_extra["pdxfer"]  # type: ignore[index]
    assert isinstance(ext, dict)
    return ext


def counter(c: Cluster, which: str, name: str) -> float:
    return sum(v for k, v in c.metrics(which).items() if k.split("{")[0].endswith(name))


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(
        worker_args=WORKER, decode_args=["--no-l3"], router_args=["--timeout", "60"]
    ).start()
    try:
        yield c
    finally:
        c.stop()


def test_ballast_arrives_is_restored_from_l2_and_outputs_equal_the_reference(
    cluster: Cluster,
) -> None:
    c = cluster
    first = complete(c, PREFIX + "first question?")
    again = complete(c, PREFIX + "second question, same history?")
    assert first["token_ids"] == greedy(PREFIX + "first question?", 8)
    assert again["token_ids"] == greedy(PREFIX + "second question, same history?", 8)
    assert first["restored_tokens"] == 0
    # the shared history's pages (KV, draft KV and ballast) came from L2 ...
    assert again["restored_l2_tokens"] >= len(encode(PREFIX)) // 16 * 16 - 16 > 0
    # ... and every prompt position's ballast was checked against its tokens
    n = len(encode(PREFIX + "first question?")) + len(
        encode(PREFIX + "second question, same history?")
    )
    assert counter(c, "decode", "ballast_checked_tokens") >= n
    assert counter(c, "decode", "ballast_mismatches") == 0
    # the ballast is bytes on the wire: far more than the toy's 768 bytes per token
    assert first["bytes"] >= 4096 * len(encode(PREFIX + "first question?")) // 16 * 16
    # the decode's wait for the KV, and its parts with a restore
    assert first["kv_wait_s"] > 0
    assert 0 <= again["kv_local_s"] <= again["kv_wait_s"] and again["prefill_s"] > 0


def test_ballast_damaged_in_flight_without_the_transfer_check_is_caught_by_the_decode() -> None:
    env = {"PDXFER_FAULTS": "corrupt=1,pool=ballast,seed=4"}
    with Cluster(
        worker_args=WORKER,
        decode_args=["--no-l3", "--integrity", "off"],
        router_args=["--timeout", "60"],
        env=env,
    ) as c:
        with pytest.raises(openai.APIStatusError) as e:
            complete(c, PREFIX + "damaged?")
        assert "ballast" in str(e.value)
        assert counter(c, "decode", "ballast_mismatches") >= 1
        assert counter(c, "decode", "faults_injected_corrupt") >= 1


def test_ballast_damaged_in_a_restore_is_repaired_and_outputs_equal_the_reference() -> None:
    env = {"PDXFER_FAULTS": "corrupt=1,pool=ballast,at=restore,seed=4"}
    with Cluster(
        worker_args=WORKER, decode_args=["--no-l3"], router_args=["--timeout", "60"], env=env
    ) as c:
        for q in ("one?", "two?", "three?"):
            assert complete(c, PREFIX + q)["token_ids"] == greedy(PREFIX + q, 8)
        assert counter(c, "decode", "faults_injected_corrupt") >= 2
        assert counter(c, "decode", "ballast_mismatches") == 0


def test_prefill_and_decode_that_disagree_on_the_ballast_do_not_pair() -> None:
    with Cluster(
        worker_args=WORKER[:-2], each_prefill=[BALLAST], router_args=["--timeout", "30"]
    ) as c:
        with pytest.raises(openai.APIStatusError) as e:
            complete(c, "no pairing")
        assert "kv_ballast" in str(e.value)
