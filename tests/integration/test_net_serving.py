"""Serving across hosts: the bootstrap and the router on one host, a prefill on each of two
more, the decode on a fourth and the client on a fifth (network namespaces on one bridge,
``tests.harness.hosts``), each process bound to and advertising its host's address. The
official ``openai`` client's answers, streamed or not, equal the colocated reference token
for token, over Mooncake TCP and over NIXL (UCX over TCP); the decode's link counters show
the KV crossed the network. Then the network fails under the served system: a prefill's
link is cut mid-request, and a prefill's host dies and comes back.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
import torch

from pdxfer.serving.router.openai_api import chat_prompt
from pdxfer.serving.toy import EOS_ID, ToyConfig, ToyModel, encode
from pdxfer.serving.toy.cluster import Cluster
from tests.harness.hosts import Network

from .netconf import needs_root

pytestmark = needs_root

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
    "512",
]
HOSTS = ["front", "p0", "p1", "d0", "client"]
ROUTER_TIMEOUT_S = 60


def greedy(prompt: str | list[int], n: int) -> list[int]:
    out = MODEL.generate(encode(prompt) if isinstance(prompt, str) else prompt, n)
    return out[: out.index(EOS_ID)] if EOS_ID in out else out


def text_of(ids: list[int]) -> str:
    return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")


def start(net: Network, transport: str, bind_all: bool = False) -> Cluster:
    """Bootstrap and router on ``front``, prefills on ``p0`` and ``p1``, the decode on ``d0``;
    ``bind_all``: each binds 0.0.0.0 and advertises its host's address."""
    env = {"UCX_TLS": "tcp"} if transport == "nixl" else None  # else UCX takes shared memory
    return Cluster(
        worker_args=[*WORKER, "--transport", transport],
        prefills=2,
        bind_all=bind_all,
        router_args=["--timeout", str(ROUTER_TIMEOUT_S)],
        env=env,
        client=net["client"].enter,
        hosts={
            "bootstrap": net["front"],
            "router": net["front"],
            "prefill": net["p0"],
            "prefill1": net["p1"],
            "decode": net["d0"],
        },
    ).start()


@pytest.fixture(scope="module")
def net() -> Iterator[Network]:
    with Network(HOSTS) as n:
        yield n


@pytest.fixture(scope="module")
def cluster(net: Network) -> Iterator[Cluster]:
    c = start(net, "tcp", bind_all=True)
    try:
        yield c
    finally:
        c.stop()


def client_for(c: Cluster) -> openai.OpenAI:
    assert c.router is not None
    return openai.OpenAI(base_url=f"{c.router.url}/v1", api_key="unused", max_retries=0, timeout=60)


def served_identically(net: Network, c: Cluster) -> int:
    """Completions (plain and streamed) and a streamed chat through the official client, each
    equal to the colocated reference; returns the KV bytes the decode received."""
    prompts = [
        f"request {i} from the client host, across the bridge: " + "w" * (40 * i) for i in range(4)
    ]
    kv_bytes = 0
    used: set[str] = set()
    with net["client"].enter():
        client = client_for(c)
        for p in prompts:
            r = client.completions.create(
                model="pdxfer-toy", prompt=p, max_tokens=12, temperature=0
            )
            ext = r.model_extra["pdxfer"]
            assert ext["token_ids"] == greedy(p, 12), p
            assert r.choices[0].text == text_of(ext["token_ids"])
            kv_bytes += ext["bytes"]
            used.add(ext["prefill"])
            chunks = list(
                client.completions.create(
                    model="pdxfer-toy", prompt=p, max_tokens=12, temperature=0, stream=True
                )
            )
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
            last = [ch.model_extra["pdxfer"] for ch in chunks if "pdxfer" in ch.model_extra]
            assert len(last) == 1 and last[0]["token_ids"] == ext["token_ids"]
            used.add(last[0]["prefill"])
        msgs = [{"role": "user", "content": "hello from another host"}]
        chunks = list(
            client.chat.completions.create(
                model="pdxfer-toy", messages=msgs, max_tokens=10, temperature=0, stream=True
            )
        )
        ids = greedy(chat_prompt(msgs), 10)
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text_of(
            ids
        )
    assert used == {p.url for p in c.prefills if p is not None}, used  # both prefill hosts
    return kv_bytes


def restores_l2(net: Network, c: Cluster) -> None:
    prefix = "a long system prompt shared by two requests, " * 9  # 405 tokens: 25 pages
    with net["client"].enter():
        client = client_for(c)
        first = client.completions.create(
            model="pdxfer-toy", prompt=prefix + "one?", max_tokens=8, temperature=0
        )
        second = client.completions.create(
            model="pdxfer-toy", prompt=prefix + "two!", max_tokens=8, temperature=0
        )
    a, b = first.model_extra["pdxfer"], second.model_extra["pdxfer"]
    assert a["token_ids"] == greedy(prefix + "one?", 8)
    assert b["token_ids"] == greedy(prefix + "two!", 8)
    assert b["restored_l2_tokens"] >= (len(encode(prefix)) // 16) * 16, b
    assert b["bytes"] < a["bytes"] / 4, (a["bytes"], b["bytes"])


def test_openai_client_across_hosts_matches_colocated_over_mooncake_tcp(
    net: Network, cluster: Cluster
) -> None:
    """Every process of this cluster binds 0.0.0.0 and advertises its host's address."""
    assert cluster.router is not None and cluster.bootstrap is not None
    for proc, host in (
        (cluster.router, "front"),
        (cluster.prefills[0], "p0"),
        (cluster.prefills[1], "p1"),
        (cluster.decode, "d0"),
    ):
        assert proc is not None and proc.url.startswith(f"http://{net[host].addr}:"), proc.url
    assert cluster.bootstrap.address.startswith(f"{net['front'].addr}:")
    before = net["d0"].link_stats()["rx_bytes"]
    kv = served_identically(net, cluster)
    got = net["d0"].link_stats()["rx_bytes"] - before
    assert kv > 0 and got >= kv, f"decode link received {got} bytes for {kv} bytes of KV"


def test_decode_restores_l2_across_hosts(net: Network, cluster: Cluster) -> None:
    restores_l2(net, cluster)


def test_openai_client_across_hosts_matches_colocated_over_nixl() -> None:
    """The same over NIXL, UCX on TCP (``UCX_TLS=tcp``: without it UCX finds the other
    namespaces on the same machine and takes shared memory, and nothing would cross)."""
    with Network(HOSTS) as n:
        c = start(n, "nixl")
        try:
            before = n["d0"].link_stats()["rx_bytes"]
            kv = served_identically(n, c)
            got = n["d0"].link_stats()["rx_bytes"] - before
            assert kv > 0 and got >= kv, f"decode link received {got} bytes for {kv} of KV"
            restores_l2(n, c)
        finally:
            c.stop()


def _hold_writes(c: Cluster, seconds: float) -> None:
    """Start prefill 0 again (same host and port) with every transport write held back
    ``seconds`` before it starts: requests there stay in flight at least that long, so a
    fault injected once one shows in flight always catches it, however fast the machine."""
    p0 = c.prefills[0]
    assert p0 is not None
    p0.stop()
    c.start_prefill(p0.port, i=0, env={"PDXFER_FAULTS": f"delay_write={seconds}"})


def _slow_requests(c: Cluster, n: int, tag: str) -> tuple[list[str], Any]:
    """Prompts no prefill has seen (``tag`` names the test): a KV-aware router would send
    prompts one prefill holds to that one, not to the prefill whose writes are held."""
    prompts = [f"slow request {tag} {i}: " + "z" * 900 for i in range(n)]
    pool = ThreadPoolExecutor(n)
    futs = [
        pool.submit(c.complete, {"prompt": p, "max_tokens": 4, "temperature": 0}, 120)
        for p in prompts
    ]
    pool.shutdown(wait=False)
    return prompts, futs


def _wait_inflight(c: Cluster, which: str) -> None:
    end = time.monotonic() + 60
    while c.metrics(which).get("pdxfer_prefill_inflight", 0) < 1:
        assert time.monotonic() < end, f"no request reached {which}"
        time.sleep(0.02)


def _deadline_failures(c: Cluster) -> float:
    """Rooms the decode failed at their deadline (its endpoint's failures of kind deadline)."""
    return sum(
        v
        for k, v in c.metrics("decode").items()
        if k.startswith("pdxfer_endpoint_failures{") and "kind=deadline" in k
    )


def _answered(prompts: list[str], results: list[tuple[int, Any]]) -> int:
    """Every answer is the reference, or an error in OpenAI's shape; returns the errors."""
    errors = 0
    for p, (status, body) in zip(prompts, results):
        if status == 200:
            assert body["pdxfer"]["token_ids"] == greedy(p, 4), p
        else:
            errors += 1
            assert status in (502, 503), (status, body)
            err = body["error"]
            assert err["message"] and err["type"] and err["code"] == status, body
    return errors


def _served_by(c: Cluster, url: str, within_s: float = 30.0) -> float:
    """Requests (nobody asks the router's ``/health`` meanwhile) until the prefill at ``url``
    serves one, each answer right; returns how long that took. Each prompt opens with
    tokens of its own: a KV-aware router sends a prompt whose first page a prefill holds to
    that prefill, and would never try the one that came back."""
    t0 = time.monotonic()
    i = 0
    while True:
        p = f"{uuid.uuid4().hex} after the trouble, request {i}"
        status, body = c.complete({"prompt": p, "max_tokens": 5, "temperature": 0})
        assert status == 200, body
        assert body["pdxfer"]["token_ids"] == greedy(p, 5)
        if body["pdxfer"]["prefill"] == url:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < within_s, f"{url} served none of {i + 1} requests"
        i += 1
        time.sleep(0.2)


def _pages_come_back(c: Cluster, timeout: float = 40.0) -> None:
    end = time.monotonic() + timeout
    while c.metrics("decode")["pdxfer_decode_free_pages"] < 512:
        assert time.monotonic() < end, c.metrics("decode")
        time.sleep(0.2)


def test_prefill_link_cut_mid_request_router_retries_on_the_other_pair(
    net: Network, cluster: Cluster
) -> None:
    """A prefill's switch port goes down while it computes and ships a request: the decode
    fails that request with PeerLost in about a second, the router (the failure came before
    the first token) sends it to the other prefill, so the client gets the right answer (an
    error in OpenAI's shape only if that failed too). After the heal the cut prefill serves
    again, with nothing restarted, and the decode's pages all come back. Its writes are held
    3 s each (a floor on how long its requests stay in flight; short enough for it to serve
    after the heal), so the cut always catches one."""
    _hold_writes(cluster, 3.0)
    p0 = cluster.prefills[0]
    assert p0 is not None
    retries = cluster.metrics("router").get("pdxfer_router_retries", 0)
    prompts, futs = _slow_requests(cluster, 8, "cut")
    _wait_inflight(cluster, "prefill")
    net["p0"].cut()
    try:
        results = [f.result(timeout=120) for f in futs]
        assert net["client"].reach(net["p0"].addr, p0.port, timeout=0.5) == "timeout"
    finally:
        net["p0"].heal()
    _answered(prompts, results)
    assert cluster.metrics("router")["pdxfer_router_retries"] > retries, (
        "no request was caught by the cut"
    )
    _served_by(cluster, p0.url)  # the router noticed by itself that it is back
    _pages_come_back(cluster)


def test_prefill_host_dies_new_requests_go_to_the_other_then_it_returns(
    net: Network, cluster: Cluster
) -> None:
    """Every process on a prefill's host is killed during traffic: requests in flight there
    get an answer at once (the other prefill's, or an OpenAI-shaped error), new ones go to
    the other prefill; a prefill started again on that host registers and serves. Its
    writes are held 60 s each until then: requests there are in flight when it dies."""
    _hold_writes(cluster, 60.0)
    p0, p1 = cluster.prefills
    assert p0 is not None and p1 is not None
    port = p0.port
    deadlines = _deadline_failures(cluster)
    prompts, futs = _slow_requests(cluster, 8, "killed")
    _wait_inflight(cluster, "prefill")
    killed = net["p0"].kill_all()
    assert p0.pid in killed and net["p0"].pids() == []
    assert net["client"].reach(net["p0"].addr, port, timeout=0.5) == "refused"
    results = [f.result(timeout=300) for f in futs]
    _answered(prompts, results)
    # nobody waited for the dead: the decode failed what it waited on as lost, never at a
    # deadline (judged by what happened, not by how long the retried requests took)
    assert _deadline_failures(cluster) == deadlines, "a room waited for the dead until its deadline"
    for i in range(3):
        p = f"while its host is down {i}"
        status, body = cluster.complete({"prompt": p, "max_tokens": 5, "temperature": 0})
        assert status == 200, body
        assert body["pdxfer"]["prefill"] == p1.url
        assert body["pdxfer"]["token_ids"] == greedy(p, 5)
    cluster.start_prefill(port, i=0)  # the host is back: the same address and port
    _served_by(cluster, p0.url)  # the router noticed by itself that it is back
    _pages_come_back(cluster)
