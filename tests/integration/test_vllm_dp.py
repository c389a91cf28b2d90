"""vLLM data parallel (``--data-parallel-size 2``: two engine cores behind one API server) on
the prefill, on the decode and on both, through ``pdxfer router --engine vllm`` with the
official ``openai`` client; every output equals colocated vLLM token for token.

Four ``vllm serve`` servers share one bootstrap server: a DP-2 and a DP-1 prefill, a DP-2 and
a DP-1 decode. Three routers pair them: DP 2 on the prefill only (DP-2 prefill, DP-1
decode), on the decode only (DP-1 prefill, DP-2 decode) and on both; the last reads both
DP-2 servers' KV events, one feed per rank. Each DP rank of a prefill is an endpoint of its
own at the bootstrap; the router keeps one record per rank, sends each leg to its rank
(vLLM's ``X-data-parallel-rank``) and tells the decode which prefill rank holds the KV. The
reference is colocated vLLM: the DP-1 prefill asked directly, without pdxfer's params (it
then computes and decodes the prompt itself; no KV moves).

Requests go concurrently, and each case asserts that both ranks served: the router's record
of each answer (``prefill_dp``/``decode_dp``) against vLLM's own per-engine counters of
served requests and of the connector's sends and loads (``engine`` label). One cluster
for the module; each case uses prompts of its own.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import json
import socket
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pdxfer import BootstrapServer
from pdxfer.serving.procs import Proc
from pdxfer.serving.vllm.local_model import build_model
from pdxfer.serving.vllm.servers import VllmServer, kv_config, start_all

from .vllm_helpers import MAX_TOKENS, UNBOUND, client, complete, logged, text, wait

pytestmark = [pytest.mark.timeout(900), pytest.mark.engine]

DP = ["--data-parallel-size", "2", "--api-server-count", "1"]
DEADLINE_S = 180.0
"""The pairs' bootstrap and transfer deadlines, generous for a shared 2-core machine: a load
failed at its deadline would be retried on another rank pair, which this module's rank
counts do not expect."""
HEARTBEAT_S = 30.0
"""The pairs' liveness probes: a peer unanswered for two of them is declared hung and its
loads fail (then retried, which the rank counts do not expect). vLLM's DP ranks step in
lockstep and their idle workers spin, so on two cores a process here can get no CPU for
half a minute (docs/testing.md); the default (0.5 s, hung after 1 s) would call that a hang."""
CLIENT_S = 2 * DEADLINE_S + 60
"""The client's and the routers' deadline for one request: a deadline failure and a retry."""
BS = 32
START_S = 900.0
"""Only ends a hang: a DP-2 server is six processes, each importing vLLM (vLLM spawns
them), and on this shared 2-core machine a start took 516-650 s at load averages 30-100."""


def _two_ports() -> int:
    """A port free with the one after it: vLLM publishes DP rank r's events at the
    configured port plus r."""
    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise AssertionError("no two consecutive free ports")


def _events() -> tuple[list[str], str]:
    """A DP-2 server's ``--kv-events-config`` arguments and what the router is given
    (rank 0's endpoints: the router subscribes to each rank's)."""
    pub, rep = _two_ports(), _two_ports()
    cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{rep}",
    }
    return ["--kv-events-config", json.dumps(cfg)], f"tcp://127.0.0.1:{pub},tcp://127.0.0.1:{rep}"


@dataclass
class Cluster:
    tmp: Path
    boot: BootstrapServer
    servers: dict[str, VllmServer] = field(default_factory=dict)
    feeds: dict[str, str] = field(default_factory=dict)
    """Per DP-2 server: the ``--kv-events`` endpoints of its rank 0."""
    routers: dict[str, Proc] = field(default_factory=dict)

    def server(self, name: str, role: str, dp: bool) -> VllmServer:
        extra = {
            "bootstrap": self.boot.address,
            "instance": name,
            "stats_file": str(self.tmp / f"{name}.json"),
            "bootstrap_timeout_s": DEADLINE_S,
            "transfer_timeout_s": DEADLINE_S,
            "heartbeat_s": HEARTBEAT_S,
        }
        args = list(DP) if dp else []
        if dp:
            ev, self.feeds[name] = _events()
            args += ev
        return VllmServer(
            name,
            self.tmp / "model",
            self.tmp,
            args=args,
            env=UNBOUND if dp else None,
            log_stats=True,  # per-engine counters in /metrics: what the router reads of DP
            kv_transfer_config=kv_config(
                role, extra, **({"kv_load_failure_policy": "fail"} if role == "kv_consumer" else {})
            ),
        )

    def router(self, name: str, prefill: str, decode: str, events: bool = False) -> Proc:
        args = [
            "--log-level",
            "INFO",
            "router",
            "--engine",
            "vllm",
            "--port",
            "0",
            "--timeout",
            str(CLIENT_S),
            "--expose-cache-stats",
            "--prefill",
            f"{self.servers[prefill].url},{self.boot.address},{prefill}",
            "--decode",
            f"{self.servers[decode].url},{decode}",
        ]
        if events:
            args += ["--policy", "kv_aware"]
            for s in (prefill, decode):
                args += ["--kv-events", f"{self.servers[s].url}={self.feeds[s]}"]
        return Proc(name, args, timeout=240, log=self.tmp / f"{name}.log")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("vllm_dp")
    build_model(tmp / "model", "small")
    c = Cluster(tmp, BootstrapServer("127.0.0.1", 0).start())
    try:
        # the DP-2 pair first: vLLM gives its DP coordinator process 120 s to start (not
        # settable), which a start beside three other servers can exceed on a busy host
        for dp, names in ((True, ("p2", "d2")), (False, ("p1", "d1"))):
            for name in names:
                role = "kv_producer" if name[0] == "p" else "kv_consumer"
                c.servers[name] = c.server(name, role, dp)
            start_all([c.servers[n] for n in names], timeout=START_S)
        c.routers["prefill"] = c.router("r-prefill", "p2", "d1")
        c.routers["decode"] = c.router("r-decode", "p1", "d2")
        c.routers["both"] = c.router("r-both", "p2", "d2", events=True)
        yield c
    finally:
        for r in c.routers.values():
            r.stop()
        for s in c.servers.values():
            s.stop()
        c.boot.stop()


def served(url: str, prompt: str | list[int]) -> tuple[list[int], dict[str, Any]]:
    """One completion through a router: its token ids and the router's record of it."""
    r = client(url, timeout=CLIENT_S).completions.create(
        model="llama",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    ext = (r.model_extra or {})["pdxfer"]
    return list(ext["token_ids"]), ext


def per_engine(server: VllmServer, name: str) -> dict[str, float]:
    """A counter of vLLM's /metrics per engine core (DP rank)."""
    out: dict[str, float] = collections.defaultdict(float)
    for line in server.metrics_text().splitlines():
        if line.startswith(name + "{") and 'engine="' in line:
            engine = line.split('engine="', 1)[1].split('"', 1)[0]
            out[engine] += float(line.rsplit(" ", 1)[1])
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[int, int]:
    return {int(k): round(v - before.get(k, 0.0)) for k, v in after.items() if v != before.get(k)}


def run_case(c: Cluster, pair: str, start: int) -> list[dict[str, Any]]:
    """Prompts of the case's own, concurrently through ``pair``'s router: each equals the
    colocated reference; the router's records of the answers, in prompt order."""
    prompts = [text(start + 37 * i, 40 + 23 * i) for i in range(8)]
    want = [complete(c.servers["p1"].url, p) for p in prompts]
    url = c.routers[pair].url
    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: served(url, p), prompts))
    for p, w, (ids, _) in zip(prompts, want, got):
        assert ids == w, f"prompt {p[:40]!r}: {ids} != colocated {w}"
    return [ext for _, ext in got]


def check_ranks(
    server: VllmServer, before: dict[str, dict[str, float]], counted: dict[int, int], kv: str
) -> None:
    """Both ranks served, each the requests the router sent it: vLLM's per-engine count of
    finished requests and of the connector's ``kv`` (sends, loads) against the router's."""
    assert sorted(counted) == [0, 1], f"one rank served every request: {counted}"
    names = ("vllm:request_success_total", f"vllm:pdxfer_{kv}_total")
    wait(
        f"{server.name}'s per-engine counters",
        lambda: all(delta(per_engine(server, n), before[n]) == counted for n in names),
        show=lambda: {
            "router": counted,
            **{n: delta(per_engine(server, n), before[n]) for n in names},
        },
    )


def snapshot(server: VllmServer, kv: str) -> dict[str, dict[str, float]]:
    return {
        n: per_engine(server, n) for n in ("vllm:request_success_total", f"vllm:pdxfer_{kv}_total")
    }


def test_a_data_parallel_prefill_serves_from_each_rank_token_exact(cluster: Cluster) -> None:
    p2 = cluster.servers["p2"]
    before = snapshot(p2, "sends")
    exts = run_case(cluster, "prefill", 0)
    counted = collections.Counter(e["prefill_dp"] for e in exts)
    assert all("decode_dp" not in e for e in exts)
    check_ranks(p2, before, dict(counted), "sends")


def test_a_data_parallel_decode_loads_on_each_rank_token_exact(cluster: Cluster) -> None:
    d2 = cluster.servers["d2"]
    before = snapshot(d2, "loads")
    exts = run_case(cluster, "decode", 1000)
    counted = collections.Counter(e["decode_dp"] for e in exts)
    assert all("prefill_dp" not in e for e in exts)
    check_ranks(d2, before, dict(counted), "loads")


def test_data_parallel_on_both_sides_moves_kv_rank_to_rank_token_exact(cluster: Cluster) -> None:
    p2, d2 = cluster.servers["p2"], cluster.servers["d2"]
    before_p, before_d = snapshot(p2, "sends"), snapshot(d2, "loads")
    exts = run_case(cluster, "both", 2000)
    check_ranks(p2, before_p, dict(collections.Counter(e["prefill_dp"] for e in exts)), "sends")
    check_ranks(d2, before_d, dict(collections.Counter(e["decode_dp"] for e in exts)), "loads")
    pairs = {(e["prefill_dp"], e["decode_dp"]) for e in exts}
    assert len(pairs) > 1, f"every request took one rank pair: {pairs}"


def test_each_leg_follows_the_kv_events_of_the_rank_holding_the_prefix(cluster: Cluster) -> None:
    """A first turn sent straight to one rank of each DP-2 server (the router never saw it):
    the second turn goes to that rank on both legs, as that rank's events say, where the
    router's tie-break alone would pick rank 0 first. Prompts are token ids, so the router
    hashes the blocks vLLM computed."""
    p2, d2 = cluster.servers["p2"], cluster.servers["d2"]
    url = cluster.routers["both"].url
    firsts = {rank: _ids(3000 + 500 * rank, 5 * BS + 7) for rank in (1, 0)}
    feeds = [f"{s.url}#dp{r}" for s in (p2, d2) for r in (0, 1)]
    before = {w: _blocks(_router_metrics(url), w) for w in feeds}
    for rank, first in firsts.items():
        for s in (p2, d2):
            client(s.url).completions.create(
                model="llama",
                prompt=first,
                max_tokens=1,
                temperature=0,
                extra_headers={"X-data-parallel-rank": str(rank)},
            )
    metrics = ""

    def indexed() -> bool:
        nonlocal metrics
        metrics = _router_metrics(url)
        return all(
            f'pdxfer_router_kv_feed_synced{{worker="{w}"}} 1.0' in metrics
            and _blocks(metrics, w) >= before[w] + 5
            for w in feeds
        )

    wait("each rank's events in the router's index", indexed, show=lambda: metrics[-3000:])
    for rank, first in firsts.items():  # rank 1's conversation first: no tie-break luck
        second = first + _ids(40 + rank, 20)
        ids, ext = served(url, second)
        assert ids == complete(cluster.servers["p1"].url, second)
        assert (ext["prefill_dp"], ext["decode_dp"]) == (rank, rank), (ext, _feed_log(cluster))
        assert ext["prefill_cached_tokens"] >= 5 * BS and ext["decode_cached_tokens"] >= 5 * BS


def _feed_log(c: Cluster) -> str:
    """For a failure's message: what the router logged of its KV event feeds."""
    return "\n".join(logged(c.routers["both"], "kv events")) or "nothing of its feeds"


def _ids(base: int, n: int) -> list[int]:
    return [(base + 37 * i) % 700 + 300 for i in range(n)]


def _router_metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return r.read().decode()


def _blocks(metrics: str, worker: str) -> float:
    key = f'pdxfer_router_kv_feed_blocks_total{{worker="{worker}"}} '
    for line in metrics.splitlines():
        if line.startswith(key):
            return float(line[len(key) :])
    return 0.0
