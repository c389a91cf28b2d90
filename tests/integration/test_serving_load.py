"""The served system under ordinary load: clients that drop their streams or leave early,
64 concurrent shared-prefix requests, and a long speculative request beside a short one.
Outputs are compared token for token with the colocated reference; pages must come back
exactly once (the decode's free-page gauge returns to the pool size)."""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pdxfer.serving.toy import EOS_ID, ToyConfig, ToyModel, encode
from pdxfer.serving.toy.cluster import Cluster

torch.set_num_threads(1)
MODEL = ToyModel(ToyConfig())
PAGES = 512
WORKER = [
    # more pages asked for than the decode holds: a request may wait long for pages on a
    # slow host, and its prefill waits for the decode's ask longer still
    "--admission-timeout",
    "60",
    "--bootstrap-timeout",
    "90",
    "--transfer-timeout",
    "60",
    "--heartbeat",
    "0.25",
    "--pages",
    str(PAGES),
]
MIN_STEP_S = 0.02
"""The decode's floor per step (``--min-step-s``): the 900-token generations that clients
leave last at least 18 s on any machine, so none can end on its own before its client left
(the client leaves as soon as the decode shows it generating). A floor only: a slow machine
makes them longer, never the verdict different."""


def greedy(prompt: str, n: int) -> list[int]:
    out = MODEL.generate(encode(prompt), n)
    return out[: out.index(EOS_ID)] if EOS_ID in out else out


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(
        worker_args=WORKER,
        decode_args=["--min-step-s", str(MIN_STEP_S)],
        router_args=["--timeout", "120"],
    ).start()
    try:
        yield c
    finally:
        c.stop()


def complete(cluster: Cluster, prompt: str, n: int, **kw: object) -> list[int]:
    status, body = cluster.complete(
        {"prompt": prompt, "max_tokens": n, "temperature": 0, **kw}, timeout=180
    )
    assert status == 200, body
    return body["pdxfer"]["token_ids"]


def wait_free_pages(cluster: Cluster, want: int = PAGES, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while cluster.metrics("decode")["pdxfer_decode_free_pages"] != want:
        assert time.monotonic() < end, cluster.metrics("decode")
        time.sleep(0.1)


def test_dropped_streams_never_corrupt_other_requests(cluster: Cluster) -> None:
    """Clients reset long streams after their first event while others run: every other
    output stays identical, the dropped requests stop generating, and every page returns."""
    assert cluster.router is not None
    u = urllib.parse.urlparse(cluster.router.url)
    prompts = [f"request number {i} runs while others leave: " for i in range(4)]
    before = cluster.metrics("decode").get("pdxfer_decode_cancelled", 0)

    def drop(i: int) -> None:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(
                {
                    "prompt": f"a client that will leave early {i}",
                    "max_tokens": 900,
                    "temperature": 0,
                    "stream": True,
                    "ignore_eos": True,
                }
            ),
            {"Content-Type": "application/json"},
        )
        r = conn.getresponse()
        assert r.status == 200
        r.fp.readline()  # the first event arrived: the request is generating
        conn.sock.close()  # reset, mid-stream

    with ThreadPoolExecutor(8) as pool:
        others = [pool.submit(complete, cluster, p, 200) for p in prompts]
        for _ in range(2):
            list(pool.map(drop, range(3)))
        outs = [f.result() for f in others]
    for p, out in zip(prompts, outs):
        assert out == greedy(p, 200), p
    end = time.monotonic() + 30
    while cluster.metrics("decode").get("pdxfer_decode_cancelled", 0) < before + 6:
        assert time.monotonic() < end, "dropped streams kept generating"
        time.sleep(0.1)
    wait_free_pages(cluster)


def test_a_client_that_leaves_a_non_streamed_request_stops_it(cluster: Cluster) -> None:
    """A client that closes its connection while its non-streamed request is generating
    stops the generation: the decode counts it cancelled, never succeeded, and frees its
    pages. The client leaves once the decode's own gauges show the request generating, and
    the generation cannot end on its own before that (``MIN_STEP_S``), so the verdict never
    depends on how fast the machine runs."""
    assert cluster.router is not None
    u = urllib.parse.urlparse(cluster.router.url)
    m0 = cluster.metrics("decode")
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps(
            {
                "prompt": "nobody will wait for me",
                "max_tokens": 900,
                "temperature": 0,
                "ignore_eos": True,
            }
        ),
        {"Content-Type": "application/json"},
    )
    end = time.monotonic() + 60
    seen: float | None = None  # the decode's step count once the request was running
    while True:  # wait until the decode runs it and has stepped it: work has started
        m = cluster.metrics("decode")
        if m["pdxfer_decode_running"] >= 1:
            if seen is not None and m["pdxfer_decode_decode_steps"] > seen:
                break
            seen = m["pdxfer_decode_decode_steps"] if seen is None else seen
        assert m.get("pdxfer_decode_success", 0) == m0.get("pdxfer_decode_success", 0), m
        assert time.monotonic() < end, m
        time.sleep(0.05)
    assert conn.sock is not None
    conn.sock.close()  # the client leaves without reading its answer
    end = time.monotonic() + 60
    while (m := cluster.metrics("decode")).get("pdxfer_decode_cancelled", 0) < m0.get(
        "pdxfer_decode_cancelled", 0
    ) + 1:
        assert time.monotonic() < end, "the abandoned request kept generating"
        time.sleep(0.1)
    assert m.get("pdxfer_decode_success", 0) == m0.get("pdxfer_decode_success", 0), m
    wait_free_pages(cluster)


def test_sixty_four_concurrent_shared_prefix_requests_all_succeed(cluster: Cluster) -> None:
    """More pages asked for than the decode holds: requests wait for pages (admission)
    instead of failing, and every output is identical to the colocated reference."""
    groups = [f"conversation {g}: " + "the shared part of a long history. " * 8 for g in range(4)]
    prompts = [groups[i % 4] + f"turn {i}?" for i in range(64)]
    with ThreadPoolExecutor(64) as pool:
        outs = list(pool.map(lambda p: complete(cluster, p, 8), prompts))
    for p, out in zip(prompts, outs):
        assert out == greedy(p, 8), p
    wait_free_pages(cluster)


def test_a_speculative_request_does_not_hold_up_a_short_one(cluster: Cluster) -> None:
    """Counted in decode steps, not seconds: the short request starts within a step or two
    of arriving and ends while the long speculative one still runs. The short one is sent
    once the speculative one streams its first tokens, so a fast machine cannot finish the
    long one before the short one arrives."""
    assert cluster.router is not None
    u = urllib.parse.urlparse(cluster.router.url)
    long_prompt = "a long speculative generation: " * 4
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=180)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps(
            {
                "prompt": long_prompt,
                "max_tokens": 850,
                "temperature": 0,
                "speculative_k": 4,
                "ignore_eos": True,
                "stream": True,
            }
        ),
        {"Content-Type": "application/json"},
    )
    r = conn.getresponse()
    assert r.status == 200
    line = b"\n"
    while not line.startswith(b"data: "):  # wait until it is generating
        line = r.readline()
        assert line, "the stream ended before its first event"
    status, short = cluster.complete({"prompt": "short", "max_tokens": 4, "temperature": 0})
    events = [
        json.loads(line[6:])
        for line in r.read().decode().splitlines()
        if line.startswith("data: ") and line[6:] != "[DONE]"
    ]
    conn.close()
    s_ext = next(e["pdxfer"] for e in reversed(events) if (e.get("pdxfer") or {}).get("end_step"))
    assert status == 200, short
    assert short["pdxfer"]["token_ids"] == greedy("short", 4)
    assert short["pdxfer"]["queued_steps"] <= 2, short["pdxfer"]
    assert short["pdxfer"]["end_step"] < s_ext["end_step"]
