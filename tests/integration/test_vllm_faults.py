"""Real vLLM under load and faults: a bootstrap server, one ``vllm serve`` prefill and one
decode (``PdxferConnector``), a colocated vLLM for reference, pdxfer's router in front
(``pdxfer router --engine vllm``), driven with the official ``openai`` client.

One cluster per module (engines start once; the tests run in file order and each leaves the
cluster serving for the next). The decode runs with L2/L3 (file) tiers, vLLM's own prefix
cache off (a repeated prefix is restored by pdxfer) and ``kv_load_failure_policy:
recompute``, and with the ``step_pace_s`` key: each engine step that schedules work sleeps
``PACE_S``, so a request of N tokens cannot end before N steps, however fast the machine (a
client that leaves mid-stream always leaves first). Nothing here asserts a duration: every
"in flight" is a state the test waits for (the decode's stats, vLLM's /metrics), and a
held prefill's writes (``delay_write``, a second prefill instance with a router of its own)
cannot land before that prefill is killed.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdxfer import BootstrapServer
from pdxfer.serving.vllm.servers import VllmServer, kv_config

from . import vllm_helpers as vh
from .vllm_helpers import (
    client,
    complete,
    kv_usage,
    metric,
    right_or_clean_error,
    stream_ids,
    text,
    wait,
)

pytestmark = [pytest.mark.timeout(900), pytest.mark.engine]

BS = 32
DECODE, PREFILL, HELD = "vllm-d0", "vllm-p0", "vllm-p-held"
DEADLINE_S = 20.0
TRANSFER_S = 300.0  # no load or send ends at its deadline while a test holds it
PACE_S = 0.05
HELD_S = 600.0  # a held prefill's writes wait this long: far past its kill
LONG = 2000  # output tokens of a request whose client leaves: >= LONG * PACE_S to finish


def _ids(base: int, n: int) -> list[int]:
    return [(base + 37 * i) % 700 + 300 for i in range(n)]


class Cluster(vh.Cluster):
    """The decode with L2/L3 (file) tiers, ``recompute`` and ``step_pace_s``; prefills of
    any instance; the bootstrap server's port kept across its restarts; colocated tokens
    computed once per prompt."""

    prefill_instance, decode_instance = PREFILL, DECODE

    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp)
        self.port = self.boot.port  # the bootstrap server's, kept across its restarts
        self.refs: dict[str, list[int]] = {}

    def want(self, prompt: str | list[int]) -> list[int]:
        """Colocated vLLM's tokens, computed once per distinct prompt."""
        key = json.dumps(prompt)
        if key not in self.refs:
            self.refs[key] = complete(self.ref.url, prompt)
        return self.refs[key]

    def prefill_server(
        self,
        port: int | None = None,
        instance: str = PREFILL,
        faults: str = "",
        stats: Path | None = None,
    ) -> VllmServer:
        """A prefill registering as ``instance`` (started, not waited for)."""
        stats = stats or self.p_stats
        stats.unlink(missing_ok=True)
        extra = {
            "bootstrap": f"127.0.0.1:{self.port}",
            "instance": instance,
            "stats_file": str(stats),
            "bootstrap_timeout_s": DEADLINE_S,
            "transfer_timeout_s": TRANSFER_S,
        }
        return VllmServer(
            instance,
            self.model,
            self.tmp,
            port=port,
            log_stats=True,
            kv_transfer_config=kv_config("kv_producer", extra),
            env={"PDXFER_FAULTS": faults} if faults else None,
        )

    def decode_server(self, port: int | None = None) -> VllmServer:
        extra = {
            "bootstrap": f"127.0.0.1:{self.port}",
            "instance": DECODE,
            "stats_file": str(self.d_stats),
            "l2_pages": 256,
            "l3": "file",
            "l3_dir": str(self.tmp / "l3"),
            "bootstrap_timeout_s": DEADLINE_S,
            "transfer_timeout_s": TRANSFER_S,
            "step_pace_s": PACE_S,
        }
        self.d_stats.unlink(missing_ok=True)  # the next figures are the new process's
        return VllmServer(
            "decode",
            self.model,
            self.tmp,
            port=port,
            log_stats=True,
            args=["--no-enable-prefix-caching"],
            kv_transfer_config=kv_config("kv_consumer", extra, kv_load_failure_policy="recompute"),
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from vh.serve(Cluster(tmp_path_factory.mktemp("vllm_faults")))


@pytest.fixture(scope="module")
def front_door(cluster: Cluster) -> Iterator[str]:
    """pdxfer's router in front of the pair, as users run it."""
    yield from vh.front_door(cluster)


def _ask(url: str, prompt: str | list[int], stream: bool) -> list[int]:
    return stream_ids(url, prompt) if stream else complete(url, prompt)


def test_64_concurrent_requests_streamed_and_not_equal_colocated(
    cluster: Cluster, front_door: str
) -> None:
    prompts = [f"{text(13 * i, 4 + i % 5)} {i}" for i in range(16)]
    want = {p: cluster.want(p) for p in prompts}
    jobs = [(prompts[k % 16], k % 2 == 0) for k in range(64)]  # each prompt 2x streamed, 2x not
    loads0 = cluster.d().get("loads", 0)
    with cf.ThreadPoolExecutor(64) as pool:
        got = list(pool.map(lambda j: _ask(front_door, *j), jobs))
    for (p, streamed), ids in zip(jobs, got):
        assert ids == want[p], f"{'stream' if streamed else 'plain'} {p!r}: {ids} != {want[p]}"
    # KV really moved: every request loaded from the prefill, none fell back to a recompute
    wait("the decode's stats", lambda: cluster.d().get("loads", 0) - loads0 == 64, timeout=60)
    d = cluster.d()
    assert d["load_failures"] == 0 and d["in_flight_loads"] == 0


def _leave_after_first_text(
    url: str, prompt: list[int], got_text: threading.Barrier, leave: threading.Event
) -> None:
    stream = client(url).completions.create(
        model="llama",
        prompt=prompt,
        max_tokens=LONG,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            break
    got_text.wait(timeout=300)
    leave.wait(timeout=300)
    stream.close()


def test_clients_that_leave_mid_stream_end_their_requests_on_both_sides(
    cluster: Cluster, front_door: str
) -> None:
    """Four streamed clients leave at once after their first text: vLLM aborts each request
    and both sides end with no request running and all their blocks back. vLLM 0.32 has no
    counter of client aborts (its front end drops an aborted request's state before the
    engine's ABORT output comes back, so ``vllm:request_success_total{finished_reason=
    "abort"}`` stays 0): what it does count is that none of them finished."""
    n = 4
    base = {s: kv_usage(s) for s in (cluster.prefill, cluster.decode)}
    ok0 = metric(cluster.decode, "vllm:request_success_total")
    gen0 = metric(cluster.decode, "vllm:generation_tokens_total")
    got_text, leave = threading.Barrier(n + 1), threading.Event()
    with cf.ThreadPoolExecutor(n) as pool:
        futs = [
            pool.submit(
                _leave_after_first_text, front_door, _ids(400 + 97 * i, 2 * BS + 9), got_text, leave
            )
            for i in range(n)
        ]
        got_text.wait(timeout=300)  # every client has text: all four are generating
        # PACE_S per step: none can have reached its LONG tokens by now, whatever the machine
        running = metric(cluster.decode, "vllm:num_requests_running")
        leave.set()
        for f in futs:
            f.result(timeout=60)
    assert running == n, f"{running} requests running on the decode before the clients left"
    for s in (cluster.prefill, cluster.decode):
        wait(
            f"{s.name} to end the requests and free their blocks",
            lambda s=s: (
                metric(s, "vllm:num_requests_running") == 0
                and metric(s, "vllm:num_requests_waiting") == 0
                and kv_usage(s) == base[s]
            ),
            timeout=60,
        )
    assert metric(cluster.decode, "vllm:request_success_total") == ok0, (
        "vLLM counted a request whose client left as finished"
    )
    assert metric(cluster.decode, "vllm:generation_tokens_total") - gen0 < n * LONG
    # the decode is free for the next request (its blocks back, nothing stuck)
    p = _ids(999, BS + 3)
    assert complete(front_door, p) == cluster.want(p)


def _registered(boot_port: int, instance: str = PREFILL) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{boot_port}/instances", timeout=2) as r:
            return bool(json.loads(r.read()).get(instance, {}).get("complete"))
    except OSError:
        return False


def test_a_bootstrap_restarted_under_traffic_serves_new_requests_once_back(
    cluster: Cluster, front_door: str
) -> None:
    """While two clients keep asking, the bootstrap server stops and a new one starts on
    its port: requests in the gap end with the right tokens or a clean error, the prefill
    registers with the new server by itself, and new requests then load from the prefill
    again."""
    prompts = [_ids(3000 + 11 * i, BS + 5 + i) for i in range(6)]
    for q in prompts:
        cluster.want(q)
    verdicts: list[tuple[str, str]] = []  # (phase, verdict)
    phase, stop = ["before"], threading.Event()

    def traffic(k: int) -> None:
        i = k
        while not stop.is_set():
            q = prompts[i % len(prompts)]
            now = phase[0]
            verdicts.append((now, right_or_clean_error(front_door, q, i % 2 == 0, cluster.want(q))))
            i += 2

    def count(ph: str) -> int:
        return sum(1 for p, _ in verdicts if p == ph)

    with cf.ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(traffic, k) for k in range(2)]
        try:
            wait("requests before the restart", lambda: count("before") >= 2, timeout=120)
            cluster.boot.stop()
            phase[0] = "gap"
            wait("requests while the bootstrap is down", lambda: count("gap") >= 2, timeout=120)
            cluster.boot = BootstrapServer("127.0.0.1", cluster.port).start()
            phase[0] = "back"
            wait(
                "the prefill to register with the new bootstrap",
                lambda: _registered(cluster.port),
                timeout=60,
            )
            phase[0] = "registered"
            wait("requests after it is back", lambda: count("registered") >= 2, timeout=120)
        finally:
            stop.set()
            for f in futs:
                f.result(timeout=180)  # a failed assertion in a client surfaces here
    # requests started once the prefill registered again all succeed, with KV that crossed
    assert all(v == "ok" for p, v in verdicts if p == "registered"), verdicts
    d0 = cluster.d()
    for k, q in enumerate(prompts[:2]):
        assert _ask(front_door, q, k == 0) == cluster.want(q)
    wait("the decode's loads", lambda: cluster.d()["loads"] == d0["loads"] + 2)
    assert cluster.d()["load_failures"] == d0["load_failures"], "loaded, not recomputed"


def test_a_prefill_killed_with_8_requests_in_flight_leaves_clean_answers_and_no_blocks(
    cluster: Cluster,
) -> None:
    """A second prefill (its own instance and router) holds its writes (``delay_write``:
    they cannot land before it dies); eight requests (half streamed) are dispatched through
    it and the decode has engaged a load for each; the prefill is SIGKILLed. Every client
    gets the colocated tokens or a clean OpenAI error, the decode's KV usage returns to its
    baseline, and once a prefill is back on that instance new requests load from it and
    equal colocated."""
    held_stats = cluster.tmp / "held.json"
    prompts = [_ids(5000 + 31 * i, BS + 7 + 3 * i) for i in range(8)]
    for q in prompts:
        cluster.want(q)
    base = kv_usage(cluster.decode)
    servers = [
        cluster.prefill_server(instance=HELD, faults=f"delay_write={HELD_S}", stats=held_stats)
    ]
    router = None
    try:
        servers[0].wait_ready()
        wait("the held prefill's registration", lambda: _registered(cluster.port, HELD))
        router = cluster.router("router-held", prefill_url=servers[0].url, instance=HELD)
        loads0 = cluster.d().get("loads", 0)
        with cf.ThreadPoolExecutor(8) as pool:
            futs = [
                pool.submit(right_or_clean_error, router.url, q, i % 2 == 0, cluster.want(q))
                for i, q in enumerate(prompts)
            ]
            wait(
                "the decode's loads for all 8",
                lambda: cluster.d().get("loads", 0) - loads0 >= 8,
                timeout=120,
            )
            assert not any(f.done() for f in futs), "a request ended while its KV was held"
            servers[0].kill()
            verdicts = [f.result(timeout=180) for f in futs]
        assert len(verdicts) == 8
        wait(
            "the decode to end the loads and free their blocks",
            lambda: (
                cluster.d()["in_flight_loads"] == 0
                and metric(cluster.decode, "vllm:num_requests_running") == 0
                and kv_usage(cluster.decode) == base
            ),
            timeout=60,
        )
        servers.append(cluster.prefill_server(servers[0].port, instance=HELD, stats=held_stats))
        servers[1].wait_ready()
        wait("the new prefill's registration", lambda: _registered(cluster.port, HELD))
        d0 = cluster.d()
        nxt = [_ids(6100, 2 * BS + 3), _ids(6200, BS + 9)]
        assert _ask(router.url, nxt[0], True) == cluster.want(nxt[0])
        assert _ask(router.url, nxt[1], False) == cluster.want(nxt[1])
        wait("the decode's loads", lambda: cluster.d()["loads"] == d0["loads"] + 2)
        assert cluster.d()["load_failures"] == d0["load_failures"], "loaded, not recomputed"
    finally:
        if router is not None:
            router.stop()
        for srv in servers:
            srv.stop()


def test_a_restarted_decode_restores_a_prefix_written_back_before_from_l3(
    cluster: Cluster, front_door: str
) -> None:
    """A prefix written back (L2, then L3 files in the background) just before the decode
    is restarted: the restart keeps it (a graceful stop waits for the L3 writes), and the
    next request for it restores those blocks from L3 and equals colocated."""
    prefix = _ids(7000, 6 * BS)
    a, b = prefix + _ids(7100, 20), prefix + _ids(7200, 33)
    w0 = cluster.d().get("writebacks", 0)
    assert _ask(front_door, a, False) == cluster.want(a)
    wait("the write-back of the prefix", lambda: cluster.d().get("writebacks", 0) > w0)
    cluster.restart_decode()  # no wait for the L3 writes themselves: the stop must keep them
    assert _ask(front_door, b, True) == cluster.want(b)
    wait("the new decode's stats", lambda: cluster.d().get("loads", 0) == 1)
    d = cluster.d()
    assert d["restored_l3_pages"] == 6 and d["load_failures"] == 0
