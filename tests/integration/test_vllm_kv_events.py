"""KV-aware routing from vLLM's own KV events: two ``vllm serve`` prefills and one decode
loading ``PdxferConnector``, each publishing its KV events over ZMQ (``--kv-events-config``,
with a replay endpoint), behind ``pdxfer router --engine vllm --kv-events ...``.

The router's index learns a prefill's blocks from its events (a first turn the router never
saw), and the second turn of the conversation goes to the prefill that holds the first,
where the router's own history and tie-break would send it to the other one. Outputs equal
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
from pdxfer.demo.hf_model import build_model
from pdxfer.demo.vllm_procs import VllmServer, free_port, kv_config, start_all
from pdxfer.serving.procs import Proc

from .vllm_helpers import client, wait

pytestmark = pytest.mark.timeout(900)

BS = 32
MAX_TOKENS = 8


@dataclass
class Cluster:
    boot: BootstrapServer
    prefills: list[VllmServer]
    decode: VllmServer
    router: Proc


def _events(tmp: Path) -> tuple[str, str, str]:
    """A server's ``--kv-events-config`` and the endpoints the router dials."""
    pub, rep = free_port(), free_port()
    cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{rep}"})
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
            servers.append(VllmServer(
                f"prefill{i}", model, tmp, block_size=BS, args=["--kv-events-config", cfg],
                kv_transfer_config=kv_config("kv_producer", {"bootstrap": boot.address,
                                                             "instance": f"p{i}"})))
            feeds.append((servers[-1].url, pub, rep))
        cfg, pub, rep = _events(tmp)
        servers.append(VllmServer(
            "decode", model, tmp, block_size=BS, args=["--kv-events-config", cfg],
            kv_transfer_config=kv_config("kv_consumer", {"bootstrap": boot.address,
                                                         "instance": "d0"})))
        feeds.append((servers[-1].url, pub, rep))
        start_all(servers)
        args = ["--log-level", "INFO", "router", "--engine", "vllm", "--port", "0",
                "--policy", "kv_aware", "--expose-cache-stats",
                "--decode", f"{servers[2].url},d0"]
        for i, p in enumerate(servers[:2]):
            args += ["--prefill", f"{p.url},{boot.address},p{i}"]
        for url, pub, rep in feeds:
            args += ["--kv-events", f"{url}={pub},{rep}"]
        router = Proc("router", args, timeout=180)
        yield Cluster(boot, servers[:2], servers[2], router)
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            s.stop()
        boot.stop()


def _complete(url: str, prompt: list[int]) -> tuple[list[int], dict[str, Any]]:
    r = client(url).completions.create(
        model="llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    ext = (r.model_extra or {}).get("pdxfer") or {}
    ids = ext.get("token_ids") or getattr(r.choices[0], "token_ids", None)
    return list(ids), ext


def _metrics(c: Cluster) -> dict[str, float]:
    with urllib.request.urlopen(f"{c.router.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^pdxfer_router_(\w+?)(?:_total)? ([0-9.e+-]+)$", text, re.M)}


def _ids(base: int, n: int) -> list[int]:
    return [(base + 37 * i) % 700 + 300 for i in range(n)]


def test_the_second_turn_goes_to_the_prefill_whose_events_show_the_first(
        cluster: Cluster) -> None:
    """Each conversation's first turn is served by prefill 1 directly (colocated vLLM: the
    router never sees it, so its own history knows nothing); only prefill 1's events tell
    the router it holds the prefix. Without them the second turn would go to prefill 0
    (every worker idle, nothing known: the first, then the least used)."""
    home = cluster.prefills[1].url
    turns = []
    for n, first in enumerate([_ids(1, 6 * BS + 7), _ids(500, 5 * BS + 3)]):
        want = _metrics(cluster).get("kv_indexed_blocks", 0) + len(first) // BS
        out, _ = _complete(home, first)
        wait("prefill 1's blocks in the router's index",
             lambda w=want: _metrics(cluster).get("kv_indexed_blocks", 0) >= w, timeout=60,
             show=lambda: _metrics(cluster))
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
