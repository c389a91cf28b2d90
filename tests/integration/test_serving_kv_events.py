"""The toy workers publish their L2 prefix cache as KV events (vLLM's schema, real ZMQ) and
the router learns from them: a conversation's second turn goes to the prefill that holds its
first, which really reuses it, token for token with the reference. A prefill restarted (its
stream starts over) is cleared from the index, and what the router claims a worker holds is
never more than the worker reused. A prefill whose publisher goes silent while it serves
(no gap) is suspected from what it served, and trusted again once it publishes."""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pdxfer.netaddr import free_port
from pdxfer.serving.procs import stop_all
from pdxfer.serving.toy import EOS_ID, ToyConfig, ToyModel, encode
from pdxfer.serving.toy.cluster import Cluster

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
    "256",
]
TURN1 = "a conversation the router follows by the prefills' own KV events: " * 4
STALE_DEADLINE_S = 1.0
MUTED = 8
SHORT = TURN1[:80]  # four pages: the silent-publisher test asks many prompts


def greedy(prompt: str, n: int) -> list[int]:
    out = MODEL.generate(encode(prompt), n)
    return out[: out.index(EOS_ID)] if EOS_ID in out else out


def ask(c: Cluster, prompt: str, n: int = 8) -> dict[str, Any]:
    status, body = c.complete({"prompt": prompt, "max_tokens": n, "temperature": 0}, timeout=120)
    assert status == 200, body
    out = body["pdxfer"]
    assert out["token_ids"] == greedy(prompt, n)
    return out


def route(c: Cluster, prompt: str) -> dict[str, Any]:
    """Where a prompt went and what was claimed and reused (``ask`` without the reference)."""
    status, body = c.complete({"prompt": prompt, "max_tokens": 2, "temperature": 0}, timeout=120)
    assert status == 200, body
    return dict(body["pdxfer"])


def router_kv(c: Cluster, name: str) -> float:
    return sum(v for k, v in c.metrics("router").items() if k.endswith(f"kv_{name}"))


def until(cond: Any, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    eps = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    c = Cluster(
        worker_args=WORKER, prefills=2, decodes=1, each_prefill=[["--kv-events", e] for e in eps]
    )
    c.start()
    try:
        urls = [p.url for p in c.prefills if p is not None]
        feeds = [a for u, e in zip(urls, eps) for a in ("--kv-events", f"{u}={e}")]
        plain, c.router = (
            c.router,
            c.add_router(
                [0, 1],
                [0],
                ["--policy", "kv_aware", *feeds, "--kv-stale-deadline", str(STALE_DEADLINE_S)],
            ),
        )
        c.routers = [plain]  # stopped with the cluster; requests go to the KV-aware one
        yield c
    finally:
        c.stop()


def test_the_second_turn_goes_to_the_prefill_that_holds_the_first(cluster: Cluster) -> None:
    c = cluster
    a = ask(c, TURN1 + "first?")
    pages = (len(encode(TURN1 + "first?")) - 1) // 16
    until(lambda: router_kv(c, "indexed_blocks") >= pages)  # learnt from the events
    b = ask(c, TURN1 + "first? and then a second question?")
    assert b["prefill_cached_tokens"] >= (len(encode(TURN1)) // 16 - 1) * 16, b
    assert b["prefill_reused_tokens"] >= b["prefill_cached_tokens"], (a, b)


def test_a_restarted_prefill_is_cleared_never_claimed(cluster: Cluster) -> None:
    c = cluster
    held = ask(c, "conversation 0: " + TURN1)["prefill"]
    i = [p.url if p else "" for p in c.prefills].index(held)
    until(lambda: router_kv(c, "indexed_blocks") >= 16)
    resets = router_kv(c, "events_resets")
    old = c.prefills[i]
    assert old is not None
    stop_all([old])
    c.start_prefill(port=old.port, i=i)
    assert c.router is not None
    with urllib.request.urlopen(f"{c.router.url}/health", timeout=10) as r:
        r.read()  # the router sees the prefill back now
    went = []
    for k in range(40):  # new prompts (no page in common) until the restarted stream has
        # published
        went.append(ask(c, f"{k:03d} after the restart: " + TURN1)["prefill"])
        if router_kv(c, "events_resets") > resets:
            break
    assert router_kv(c, "events_resets") > resets, went
    b = ask(c, "conversation 0: " + TURN1 + "again?")  # its holder restarted: not claimed
    assert b["prefill_cached_tokens"] <= b["prefill_reused_tokens"], b


def reached(cond: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def test_a_silent_publisher_is_suspected_and_trusted_again_once_it_publishes(
    cluster: Cluster,
) -> None:
    """Prefill 1 restarts with a publisher that, after its first batch, drops the next
    ``MUTED`` while the prefill serves (no gap: nothing is numbered). The prompts it computes
    never show up in its events, so the router suspects its feed (history decides for it;
    its claims are never more than it reused) and trusts it again once it publishes."""
    c, i = cluster, 1
    old = c.prefills[i]
    assert old is not None and c.router is not None
    own = c.each_prefill[i]
    c.each_prefill[i] = [*own, "--kv-events-mute", f"1:{MUTED}"]
    try:
        stop_all([old])
        c.start_prefill(port=old.port, i=i)
    finally:
        c.each_prefill[i] = own
    url = old.url

    def healthy() -> bool:
        assert c.router is not None
        with urllib.request.urlopen(f"{c.router.url}/health", timeout=10) as r:
            return bool(json.loads(r.read())["workers"].get(url) == "ok")

    def feed(name: str) -> float:
        return c.metrics("router").get(f"pdxfer_router_kv_feed_{name}{{worker={url}}}", 0.0)

    until(healthy)  # the router sees the prefill back, registered with the bootstrap
    stale, served = feed("stale"), 0
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        for b in range(8):  # rounds of new prompts, about half computed by prefill 1
            outs = ex.map(
                lambda k: route(c, f"{k:03d} while silent: " + SHORT), range(4 * b, 4 * b + 4)
            )
            served += sum(o["prefill"] == url for o in outs)
            if served > 3 and reached(lambda: feed("stale") > stale, 2 * STALE_DEADLINE_S):
                break
    assert feed("stale") > stale, served
    assert feed("unpublished") >= 3 and served <= MUTED + 1, served
    assert feed("synced") == 0.0  # suspected, not yet back
    for k in range(4 * MUTED):  # its next batch after the muted ones syncs it again
        if feed("synced") == 1.0:
            break
        out = route(c, f"{k:03d} once it publishes again: " + SHORT)
        assert out["prefill_cached_tokens"] <= out["prefill_reused_tokens"], out
    else:
        raise AssertionError("the silent prefill's feed never came back in sync")
    for k in range(8):  # and its events count again: a second turn finds its first there
        blocks, conv = feed("blocks"), f"{k:03d} trusted again: " + SHORT
        if route(c, conv)["prefill"] == url:
            until(lambda blocks=blocks: feed("blocks") > blocks)
            b2 = ask(c, conv + "?")
            assert b2["prefill"] == url and b2["prefill_cached_tokens"] > 0, b2
            break
    else:
        raise AssertionError("no first turn went to the prefill that resynced")
