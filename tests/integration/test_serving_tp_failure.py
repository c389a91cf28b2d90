"""A prefill TP rank killed mid-transfer: the request fails on every decode rank -- also on
the one whose own prefill rank finished and which already holds its heads --, no rank
decodes from a partial KV, every rank's pages come back, and the worker that lost a rank
says so on ``/health``. After the prefill is restarted the same decode serves again.

Prefill TP 2 -> decode TP 2: decode rank 0 receives from prefill rank 0 only, rank 1 from
rank 1 only, so only the decode's group can tell that rank 1's half never came. Writes are
slowed (``PDXFER_FAULTS=delay_write``); prefill rank 1 is frozen (SIGSTOP) once the prompt is
computed, so rank 0 completes its transfer while rank 1's is in flight, and then killed.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
import torch

from pdxfer.serving.toy import EOS_ID, ToyConfig, ToyModel, encode
from pdxfer.serving.toy.cluster import Cluster

torch.set_num_threads(1)
MODEL = ToyModel(ToyConfig())
# a long heartbeat: the decode notices the frozen rank only after rank 0 has finished
WORKER = [
    "--bootstrap-timeout",
    "20",
    "--transfer-timeout",
    "60",
    "--heartbeat",
    "3",
    "--pages",
    "128",
    "--chunk-size",
    "32",
    "--tp",
    "2",
]
PAGES = 128
PROMPT = "a prompt whose KV is on its way when a prefill rank dies. " * 6


def health(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def total(metrics: dict[str, float], name: str, *labels: str) -> float:
    return sum(
        v for k, v in metrics.items() if k.startswith(name + "{") and all(x in k for x in labels)
    )


def wait(what: str, ok: Callable[[], bool], timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(
        worker_args=WORKER,
        router_args=["--timeout", "90"],
        env={"PDXFER_FAULTS": "delay_write=0.5"},
    ).start()
    try:
        yield c
    finally:
        c.stop()


def test_a_prefill_rank_killed_mid_transfer_fails_the_request_on_every_decode_rank(
    cluster: Cluster,
) -> None:
    assert cluster.prefill is not None and cluster.decode is not None
    assert cluster.router is not None
    client = openai.OpenAI(
        base_url=f"{cluster.router.url}/v1", api_key="unused", max_retries=0, timeout=120
    )
    before = cluster.metrics("decode")
    _, ph = health(cluster.prefill.url)
    victim = ph["ranks"][0]
    assert victim["rank"] == 1 and victim["alive"], ph
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(
            client.completions.create,
            model="pdxfer-toy",
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
        )
        wait(
            "the prompt computed and its KV on the way",
            lambda: (
                health(cluster.prefill.url)[1].get("computing") == 0  # type: ignore[union-attr]
                and health(cluster.prefill.url)[1].get("inflight") == 1  # type: ignore[union-attr]
                and total(cluster.metrics("prefill"), "pdxfer_endpoint_transport_bytes") > 0
            ),
        )
        os.kill(victim["pid"], signal.SIGSTOP)  # rank 1's transfer stops where it is
        try:
            wait(
                "decode rank 0 to hold all of its heads",
                lambda: (
                    total(cluster.metrics("decode"), "pdxfer_endpoint_success", "tp_rank=0")
                    > total(before, "pdxfer_endpoint_success", "tp_rank=0")
                ),
                timeout=30,
            )
        finally:
            os.kill(victim["pid"], signal.SIGKILL)
        with pytest.raises(openai.APIStatusError) as err:
            fut.result(timeout=120)
    assert err.value.status_code >= 500, err.value
    # the prefill says which rank it lost
    status, ph = health(cluster.prefill.url)
    assert status == 503 and "TP rank 1" in ph["error"] and "SIGKILL" in ph["error"], ph
    # the decode: every rank's pages back, nothing generated, rank 1's receiver failed
    wait(
        "the decode's pages",
        lambda: (
            health(cluster.decode.url)[1]["free_pages"] == PAGES  # type: ignore[union-attr]
            and health(cluster.decode.url)[1]["ranks"][0]["rooms"] == 0
        ),
        timeout=30,
    )  # type: ignore[union-attr]
    status, dh = health(cluster.decode.url)
    assert status == 200 and dh["ranks"][0]["alive"], dh
    after = cluster.metrics("decode")
    assert after["pdxfer_decode_decode_steps"] == before["pdxfer_decode_decode_steps"]
    assert after.get("pdxfer_decode_success", 0) == before.get("pdxfer_decode_success", 0)
    assert total(after, "pdxfer_endpoint_failures", "tp_rank=1") > total(
        before, "pdxfer_endpoint_failures", "tp_rank=1"
    ), after
    # a restarted prefill serves through the same decode again, token for token
    port = cluster.prefill.port
    cluster.prefill.stop()
    cluster.start_prefill(port)
    wait(
        "the router to see the prefill",
        lambda: health(cluster.router.url)[0] == 200,  # type: ignore[union-attr]
        timeout=30,
    )
    again = "served again after the restart, " * 2
    r = client.completions.create(model="pdxfer-toy", prompt=again, max_tokens=8, temperature=0)
    ref = MODEL.generate(encode(again), 8)
    assert r.model_extra["pdxfer"]["token_ids"] == (
        ref[: ref.index(EOS_ID)] if EOS_ID in ref else ref
    )
