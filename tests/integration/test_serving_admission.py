"""Admission under page pressure: a prefill and a decode whose pools each fit one request.

Both workers admit requests independently. If the prefill took pages for request A while the
decode took pages for request B, each would wait for the other's request to finish (A's
prefill for A's decode, B's decode for B's prefill) and neither could admit it: both time out
although the two requests could have run one after the other. The prefill takes pages only
for a room whose decode already admitted it and asked for its KV, which rules this out.
Outcomes are asserted (every request answered 200 with the colocated reference's tokens), not
wall time; the admission timeout is long so a deadlock would show as 503s, not as slowness."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
import torch

from pdxfer.serving.toy import EOS_ID, ToyConfig, ToyModel, encode
from pdxfer.serving.toy.cluster import Cluster, post

torch.set_num_threads(1)
MODEL = ToyModel(ToyConfig())
PAGES = 4
"""Per worker: a prompt below takes 3 pages on the prefill (3 with 8 new tokens on the
decode), so one request fits and a second waits."""
WORKER = [
    "--pages",
    str(PAGES),
    "--admission-timeout",
    "20",
    "--bootstrap-timeout",
    "40",
    "--transfer-timeout",
    "60",
    "--heartbeat",
    "0.25",
    "--max-waiting",
    "64",
]
NEW = 8


def greedy(ids: list[int], n: int) -> list[int]:
    out = MODEL.generate(ids, n)
    return out[: out.index(EOS_ID)] if EOS_ID in out else out


def prompt(i: int) -> str:
    return f"request {i:02d} needs three pages: .........."  # 40 bytes


def wait_until(what: Callable[[], bool], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("tp", [1, 2])
def test_prefill_and_decode_admitting_different_requests_do_not_deadlock(tp: int) -> None:
    """A's prefill call and B's decode call reach the workers first, then the other halves:
    the decode's pages go to B while A's prefill is in, and B's prefill and A's decode
    arrive after them. Both requests are served, one after the other. At TP 2 (both
    workers) rank 0 decides admission for its ranks."""
    with Cluster(worker_args=[*WORKER, "--tp", str(tp)], router_args=["--timeout", "120"]) as c:
        assert c.prefill is not None and c.decode is not None and c.bootstrap is not None
        pf, dc, boot = c.prefill.url, c.decode.url, c.bootstrap.address
        a, b = encode(prompt(1)), encode(prompt(2))
        assert len(a) == len(b) == 40
        room_a, room_b = 1001, 1002

        def prefill(room: int, ids: list[int]) -> tuple[int, Any]:
            return post(
                f"{pf}/generate", {"room": room, "prompt_ids": ids, "temperature": 0}, timeout=120
            )

        def decode(room: int, ids: list[int]) -> tuple[int, Any]:
            return post(
                f"{dc}/generate",
                {
                    "room": room,
                    "bootstrap": boot,
                    "instance": "default",
                    "prompt_ids": ids,
                    "max_tokens": NEW,
                    "temperature": 0,
                },
                timeout=120,
            )

        with ThreadPoolExecutor(4) as ex:
            pa = ex.submit(prefill, room_a, a)
            wait_until(lambda: c.metrics("prefill")["pdxfer_prefill_inflight"] == 1)
            db = ex.submit(decode, room_b, b)
            wait_until(lambda: c.metrics("decode")["pdxfer_decode_free_pages"] < PAGES)
            da = ex.submit(decode, room_a, a)
            pb = ex.submit(prefill, room_b, b)
            got = {
                name: f.result()
                for name, f in (
                    ("prefill A", pa),
                    ("decode A", da),
                    ("prefill B", pb),
                    ("decode B", db),
                )
            }
        for name, (status, body) in got.items():
            assert status == 200, (name, status, body)
        assert got["decode A"][1]["token_ids"] == greedy(a, NEW)
        assert got["decode B"][1]["token_ids"] == greedy(b, NEW)
        assert got["prefill A"][1]["first_token"] == greedy(a, 1)[0]
        assert c.metrics("prefill")["pdxfer_prefill_rejected"] == 0
        assert c.metrics("decode")["pdxfer_decode_rejected"] == 0


def test_many_concurrent_requests_against_pools_that_fit_one_all_succeed() -> None:
    """Through the router with the openai client: twelve requests at once against workers
    that each hold one at a time. Every one is answered with the reference's tokens at the
    first attempt; none is refused with 503 while they could be served one after another."""
    with Cluster(worker_args=WORKER, router_args=["--timeout", "120"]) as c:
        assert c.router is not None
        client = openai.OpenAI(
            base_url=f"{c.router.url}/v1", api_key="none", max_retries=0, timeout=120
        )
        prompts = [prompt(i) for i in range(12)]

        def complete(p: str) -> list[int]:
            r = client.completions.create(
                model="pdxfer-toy", prompt=p, max_tokens=NEW, temperature=0
            )
            return r.model_extra["pdxfer"]["token_ids"]  # type: ignore[index]

        with ThreadPoolExecutor(len(prompts)) as ex:
            outs = list(ex.map(complete, prompts))
        for p, out in zip(prompts, outs):
            assert out == greedy(encode(p), NEW), p
        # the router retries a 503 once, which can hide a deadlock from the client: no
        # worker refused a request and no attempt was retried
        assert c.metrics("prefill")["pdxfer_prefill_rejected"] == 0
        assert c.metrics("decode")["pdxfer_decode_rejected"] == 0
        assert c.metrics("router").get("pdxfer_router_retries", 0) == 0
