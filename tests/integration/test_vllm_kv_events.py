"""KV-aware routing from vLLM's own KV events, on both legs: two ``vllm serve`` prefills and
two decodes loading ``PdxferConnector``, each publishing its KV events over ZMQ
(``--kv-events-config``, with a replay endpoint), behind ``pdxfer router --engine vllm
--kv-events ...``.

The router's index learns a worker's blocks from its events (a first turn the router never
saw), and the second turn of the conversation goes to the prefill, and to the decode, that
holds the first, where the router's own history and tie-break would send it to the other
one. A decode's events show the blocks it loaded through the connector. Outputs equal
colocated vLLM token for token. One cluster for the module.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdxfer import BootstrapServer
from pdxfer.netaddr import free_port
from pdxfer.serving.procs import Proc
from pdxfer.serving.vllm.local_model import build_model
from pdxfer.serving.vllm.servers import VllmServer, kv_config, start_all

from .vllm_helpers import client, metric, wait

pytestmark = [pytest.mark.timeout(900), pytest.mark.engine]

BS = 32
MAX_TOKENS = 8


@dataclass
class Cluster:
    boot: BootstrapServer
    prefills: list[VllmServer]
    decodes: list[VllmServer]
    router: Proc


def _events(tmp: Path) -> tuple[str, str, str]:
    """A server's ``--kv-events-config`` and the endpoints the router dials."""
    pub, rep = free_port(), free_port()
    cfg = json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{pub}",
            "replay_endpoint": f"tcp://*:{rep}",
        }
    )
    return cfg, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("vllm_kv_events")
    model = build_model(tmp / "model", "small")
    boot = BootstrapServer("127.0.0.1", 0).start()
    servers: list[VllmServer] = []
    router: Proc | None = None
    try:
        feeds = []
        for i in range(2):
            cfg, pub, rep = _events(tmp)
            servers.append(
                VllmServer(
                    f"prefill{i}",
                    model,
                    tmp,
                    block_size=BS,
                    args=["--kv-events-config", cfg],
                    kv_transfer_config=kv_config(
                        "kv_producer", {"bootstrap": boot.address, "instance": f"p{i}"}
                    ),
                )
            )
            feeds.append((servers[-1].url, pub, rep))
        for i in range(2):
            cfg, pub, rep = _events(tmp)
            servers.append(
                VllmServer(
                    f"decode{i}",
                    model,
                    tmp,
                    block_size=BS,
                    args=["--kv-events-config", cfg],
                    log_stats=True,  # its prefix cache hits
                    kv_transfer_config=kv_config(
                        "kv_consumer", {"bootstrap": boot.address, "instance": f"d{i}"}
                    ),
                )
            )
            feeds.append((servers[-1].url, pub, rep))
        start_all(servers)
        args = [
            "--log-level",
            "INFO",
            "router",
            "--engine",
            "vllm",
            "--port",
            "0",
            "--policy",
            "kv_aware",
            "--expose-cache-stats",
        ]
        for i, p in enumerate(servers[:2]):
            args += ["--prefill", f"{p.url},{boot.address},p{i}"]
        for i, d in enumerate(servers[2:]):
            args += ["--decode", f"{d.url},d{i}"]
        for url, pub, rep in feeds:
            args += ["--kv-events", f"{url}={pub},{rep}"]
        router = Proc("router", args, timeout=180)
        yield Cluster(boot, servers[:2], servers[2:], router)
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            s.stop()
        boot.stop()


def _complete(url: str, prompt: list[int]) -> tuple[list[int], dict[str, Any]]:
    r = client(url).completions.create(
        model="llama",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    ext = (r.model_extra or {}).get("pdxfer") or {}
    ids = ext.get("token_ids") or getattr(r.choices[0], "token_ids", None)
    return list(ids), ext


def _metrics(c: Cluster) -> dict[str, float]:
    with urllib.request.urlopen(f"{c.router.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^pdxfer_router_(\w+?)(?:_total)? ([0-9.e+-]+)$", text, re.M)
    }


def _feed_blocks(c: Cluster, worker: str) -> float:
    """The blocks one worker's events stored and removed in the router's index."""
    with urllib.request.urlopen(f"{c.router.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(
        rf'^pdxfer_router_kv_feed_blocks_total{{worker="{re.escape(worker)}"}} '
        rf"([0-9.e+-]+)$",
        text,
        re.M,
    )
    return float(m.group(1)) if m else 0.0


def _ids(base: int, n: int) -> list[int]:
    return [(base + 37 * i) % 700 + 300 for i in range(n)]


def test_the_second_turn_goes_to_the_prefill_whose_events_show_the_first(cluster: Cluster) -> None:
    """Each conversation's first turn is served by prefill 1 directly (colocated vLLM: the
    router never sees it, so its own history knows nothing); only prefill 1's events tell
    the router it holds the prefix. Without them the second turn would go to prefill 0
    (every worker idle, nothing known: the first, then the least used)."""
    home = cluster.prefills[1].url
    turns = []
    for n, first in enumerate([_ids(1, 6 * BS + 7), _ids(500, 5 * BS + 3)]):
        want = _metrics(cluster).get("kv_indexed_blocks", 0) + len(first) // BS
        out, _ = _complete(home, first)
        wait(
            "prefill 1's blocks in the router's index",
            lambda w=want: _metrics(cluster).get("kv_indexed_blocks", 0) >= w,
            timeout=60,
            show=lambda: _metrics(cluster),
        )
        second = first + out + _ids(900 + n, 20)
        got, ext = _complete(cluster.router.url, second)
        assert ext["prefill"] == home, (n, ext)
        assert ext["prefill_cached_tokens"] >= BS * (len(first) // BS), ext
        turns.append((second, got))
    m = _metrics(cluster)
    assert m["kv_events_gaps"] == 0 and m["kv_events_bad_frames"] == 0, m
    # token for token as colocated vLLM (a prefill serving the prompt alone)
    for prompt, got in turns:
        ref, _ = _complete(cluster.prefills[0].url, prompt)
        assert got == ref


def test_the_second_turn_goes_to_the_decode_whose_events_show_the_first(cluster: Cluster) -> None:
    """The router sends a conversation's opening (two blocks) to a decode X, so its own
    history says X holds that much. The first turn (the opening and four blocks more) then
    reaches the other decode, Y, through a second router the main one never hears of: Y
    loads it through ``PdxferConnector``, and only Y's events tell the main router. The
    second turn goes to Y (by its history alone, to X), the router's report shows Y's
    cached tokens, and Y's own prefix cache serves them."""
    opening = _ids(7, 2 * BS + 5)
    _, ext = _complete(cluster.router.url, opening)
    x = ext["decode"]
    i, y = next((i, d) for i, d in enumerate(cluster.decodes) if d.url != x)
    first = opening + _ids(300, 4 * BS + 2)
    full = BS * (len(first) // BS)
    before = _feed_blocks(cluster, y.url)
    side = Proc(
        "side-router",
        [
            "router",
            "--engine",
            "vllm",
            "--port",
            "0",
            "--prefill",
            f"{cluster.prefills[0].url},{cluster.boot.address},p0",
            "--decode",
            f"{y.url},d{i}",
        ],
        timeout=180,
    )
    try:
        out, ext = _complete(side.url, first)
        assert ext["decode"] == y.url, ext
    finally:
        side.stop()
    wait(
        "decode Y's loaded blocks in the router's index, from its events",
        lambda: _feed_blocks(cluster, y.url) >= before + full // BS,
        timeout=60,
        show=lambda: _feed_blocks(cluster, y.url),
    )
    second = first + out + _ids(950, 20)
    hits = metric(y, "vllm:prefix_cache_hits_total")
    got, ext = _complete(cluster.router.url, second)
    assert ext["decode"] == y.url, (x, ext)
    assert ext["decode_cached_tokens"] >= full, ext
    assert metric(y, "vllm:prefix_cache_hits_total") - hits >= full
    m = _metrics(cluster)
    assert m["kv_events_gaps"] == 0 and m["kv_events_bad_frames"] == 0, m
    for prompt, served in ((first, out), (second, got)):  # token for token as colocated
        assert _complete(cluster.prefills[0].url, prompt)[0] == served
