"""Real vLLM, the prefill sending layer by layer (``send_by: layer``): a bootstrap server, one
``vllm serve`` prefill and one decode loading ``PdxferConnector``, and a colocated vLLM as the
reference; every output equals it token for token.

The prefill computes ``STEP`` tokens a step (``--max-num-batched-tokens``), a block and a half,
so a prompt spans several steps and most steps fill a block in part (its next step completes
it). As each attention layer of a step finishes, ``save_kv_layer`` hands that layer's blocks
for the step's tokens to the sender (once the decode's request has reached the prefill;
before that, a step's layers go after its forward in one hand-off). The decode runs with ``integrity: sampled`` and
``kv_load_failure_policy: recompute``, vLLM's own prefix cache off (every block crosses).
Faults are set per room from the start: room ``ROOM_SLOW``'s writes are held back on the
prefill (it is killed while they are), room ``ROOM_CORRUPT`` is damaged on the decode after a
layer arrived (integrity must catch it).

One cluster per module; the tests run in file order, each leaving it serving for the next.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdxfer import BootstrapServer
from pdxfer.serving.procs import Proc
from pdxfer.testing.hf_model import SHAPES, build_model
from pdxfer.testing.vllm_procs import VllmServer, kv_config, read_stats, start_all

from .vllm_helpers import client, complete, kv_usage, metric, wait

pytestmark = pytest.mark.timeout(900)

BS = 32
STEP = 48  # the prefill's tokens per step: a block and a half
ROOM_SLOW, ROOM_CORRUPT = 5151, 5252
DECODE, PREFILL = "vllm-ld0", "vllm-lp0"
DEADLINE_S = 20.0
S = SHAPES["small"]


@dataclass
class Cluster:
    tmp: Path
    model: Path
    boot: BootstrapServer
    prefill: VllmServer
    decode: VllmServer
    ref: VllmServer
    p_stats: Path
    d_stats: Path

    def p(self) -> dict[str, Any]:
        return read_stats(self.p_stats)

    def d(self) -> dict[str, Any]:
        return read_stats(self.d_stats)


def _prefill(c: Cluster, port: int | None = None) -> VllmServer:
    extra = {"bootstrap": c.boot.address, "instance": PREFILL, "stats_file": str(c.p_stats),
             "send_by": "layer", "bootstrap_timeout_s": DEADLINE_S,
             "transfer_timeout_s": DEADLINE_S}
    return VllmServer("prefill", c.model, c.tmp, port=port, log_stats=True,
                      args=["--max-num-batched-tokens", str(STEP)],
                      kv_transfer_config=kv_config("kv_producer", extra),
                      env={"PDXFER_FAULTS": f"delay_write=8,rooms={ROOM_SLOW}"})


def _decode(c: Cluster) -> VllmServer:
    extra = {"bootstrap": c.boot.address, "instance": DECODE, "stats_file": str(c.d_stats),
             "integrity": "sampled", "bootstrap_timeout_s": DEADLINE_S,
             "transfer_timeout_s": DEADLINE_S}
    return VllmServer("decode", c.model, c.tmp, args=["--no-enable-prefix-caching"],
                      log_stats=True,
                      kv_transfer_config=kv_config("kv_consumer", extra,
                                                   kv_load_failure_policy="recompute"),
                      env={"PDXFER_FAULTS": f"corrupt=1,rooms={ROOM_CORRUPT}"})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("vllm_layers")
    model = build_model(tmp / "model", "small")
    boot = BootstrapServer("127.0.0.1", 0).start()
    c = Cluster(tmp, model, boot, None, None, None, tmp / "p.json", tmp / "d.json")  # type: ignore[arg-type]
    c.prefill, c.decode = _prefill(c), _decode(c)
    c.ref = VllmServer("colocated", model, tmp)
    try:
        start_all([c.prefill, c.decode, c.ref])
        yield c
    finally:
        for s in (c.prefill, c.decode, c.ref):
            if s is not None:
                s.stop()
        boot.stop()


@pytest.fixture(scope="module")
def front_door(cluster: Cluster) -> Iterator[str]:
    """pdxfer's router in front of the pair (concurrent dispatch: the decode asks while the
    prefill computes, so layers reach it as they are computed)."""
    router = Proc("router", ["router", "--engine", "vllm", "--port", "0",
                             "--prefill", f"{cluster.prefill.url},{cluster.boot.address},{PREFILL}",
                             "--decode", f"{cluster.decode.url},{DECODE}"], timeout=180)
    try:
        yield router.url
    finally:
        router.stop()


def _ids(base: int, n: int) -> list[int]:
    return [(base + 37 * i) % 700 + 300 for i in range(n)]


def _settled(cluster: Cluster, loads: int) -> dict[str, Any]:
    wait("the decode's loads", lambda: cluster.d().get("loads", 0) >= loads
         and cluster.d().get("in_flight_loads", 1) == 0)
    wait("the prefill's sends", lambda: cluster.p().get("in_flight_sends", 1) == 0)
    return cluster.d()


def test_a_prompt_of_many_steps_streams_by_layer_and_equals_colocated(
        cluster: Cluster, front_door: str) -> None:
    prompts = [_ids(100 * k, n) for k, n in enumerate((5 * STEP + 7, 9 * STEP, 3 * BS + 1,
                                                       12 * STEP + 31))]
    want = [complete(cluster.ref.url, q) for q in prompts]
    with cf.ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda q: complete(front_door, q), prompts))
    assert got == want
    d = _settled(cluster, len(prompts))
    p = cluster.p()
    assert d["load_failures"] == 0 and d["loads"] == len(prompts)
    assert p["sends"] == len(prompts) and p["send_failures"] == 0
    # two prompts at a time share a step's STEP tokens: each takes at least this many steps
    steps = sum(-(-len(q) // STEP) for q in prompts)
    # a step computed once the decode's request had reached the prefill hands its layers
    # over one by one; one computed before (nobody to receive a layer yet) in one piece
    # after its forward. The decode asks at dispatch, so that is at most the first few
    assert steps < p["layer_sends"] <= steps * S.layers
    assert p["layer_sends"] > steps * S.layers // 2, "most steps went layer by layer"
    assert p["step_chunks"] >= steps - len(prompts), \
        "every step before the prompt's end handed its tokens over"
    tokens = sum(len(q) for q in prompts)
    assert p["sent_tokens"] == tokens
    assert p["endpoint"]["transport_bytes"] == d["net_bytes"] > 0
    assert metric(cluster.prefill, "vllm:pdxfer_layer_sends_total") == p["layer_sends"]


def test_a_prefix_cached_on_the_prefill_is_sent_with_the_first_step(
        cluster: Cluster, front_door: str) -> None:
    prefix = _ids(4000, 6 * BS)
    a, b = prefix + _ids(4100, 40), prefix + _ids(4200, 75)
    hits0 = metric(cluster.prefill, "vllm:prefix_cache_hits_total")
    d0, sent0 = cluster.d(), cluster.p()["endpoint"]["transport_bytes"]
    for q in (a, b):
        assert complete(front_door, q) == complete(cluster.ref.url, q)
    d = _settled(cluster, d0["loads"] + 2)
    assert metric(cluster.prefill, "vllm:prefix_cache_hits_total") - hits0 >= 6 * BS, \
        "the second prompt's prefix needed no compute on the prefill"
    assert d["load_failures"] == d0["load_failures"], "both loads completed"
    sent = cluster.p()["endpoint"]["transport_bytes"] - sent0
    assert sent == d["net_bytes"] - d0["net_bytes"]
    per_token = S.layers * S.kv_heads * 2 * S.head_size * 4  # fp32
    assert sent >= (len(a) + len(b) - 2) * per_token, "the cached prefix crossed too"


def _direct(cluster: Cluster, prompt: list[int], room: int) -> list[int]:
    """vLLM's sequential protocol by hand, with a chosen room (faults name rooms)."""
    params = {"do_remote_decode": True, "do_remote_prefill": False, "pdxfer_room": room,
              "pdxfer_decode": DECODE}
    first = client(cluster.prefill.url).completions.create(
        model="llama", prompt=prompt, max_tokens=1, temperature=0,
        extra_body={"kv_transfer_params": params})
    answer = first.model_extra["kv_transfer_params"]  # type: ignore[index]
    return complete(cluster.decode.url, prompt, extra={"kv_transfer_params": answer})


def test_a_corrupted_layer_is_caught_and_no_wrong_token_is_returned(cluster: Cluster) -> None:
    prompt = _ids(5000, 6 * STEP + 5)
    d0 = cluster.d()
    assert _direct(cluster, prompt, ROOM_CORRUPT) == complete(cluster.ref.url, prompt)
    wait("the decode's stats", lambda: cluster.d()["load_failures"] > d0["load_failures"])
    d1 = cluster.d()
    assert d1["endpoint"]["integrity_mismatches"] > d0["endpoint"].get("integrity_mismatches", 0)
    assert d1["load_failures"] == d0["load_failures"] + 1


def test_a_prefill_killed_mid_stream_fails_the_load_and_nothing_lands_after(
        cluster: Cluster, front_door: str) -> None:
    """The decode asks at dispatch (the early form) and the prefill streams a long prompt's
    layers, whose writes are held back; the prefill is killed once the stream started. The
    decode's load fails (its blocks are reported to vLLM only once no write can land in
    them: the prefill is known dead, none is quarantined), vLLM recomputes the prompt
    (``kv_load_failure_policy: recompute``), and the output equals colocated."""
    prompt = _ids(7000, 20 * STEP + 9)
    want = complete(cluster.ref.url, prompt)
    d0, p0 = cluster.d(), cluster.p()
    early = {"do_remote_prefill": True, "do_remote_decode": False, "pdxfer_room": ROOM_SLOW,
             "pdxfer_bootstrap": cluster.boot.address, "pdxfer_instance": PREFILL}
    params = {"do_remote_decode": True, "do_remote_prefill": False, "pdxfer_room": ROOM_SLOW,
              "pdxfer_decode": DECODE}
    with cf.ThreadPoolExecutor(2) as pool:
        fut = pool.submit(complete, cluster.decode.url, prompt,
                          extra={"kv_transfer_params": early})
        wait("the decode to ask", lambda: cluster.d().get("loads", 0) > d0["loads"])
        pre = pool.submit(client(cluster.prefill.url).completions.create, model="llama",
                          prompt=prompt, max_tokens=1, temperature=0,
                          extra_body={"kv_transfer_params": params})
        wait("the stream to start",
             lambda: cluster.p().get("layer_sends", 0) > p0.get("layer_sends", 0))
        assert kv_usage(cluster.decode) > 0, "the decode holds blocks for the load"
        cluster.prefill.kill()
        got = fut.result(timeout=DEADLINE_S + 60)
        pre.exception(timeout=60)  # the killed prefill's answer never comes
    assert got == want, "recomputed by the decode (kv_load_failure_policy: recompute)"
    d1 = cluster.d()
    assert d1["load_failures"] == d0["load_failures"] + 1 and d1["in_flight_loads"] == 0
    ep0, ep1 = d0.get("endpoint", {}), d1["endpoint"]
    assert ep1.get("quarantined_requests", 0) == ep0.get("quarantined_requests", 0), \
        "the failure was reported with no write left that could land"
    wait("the decode's blocks to come back", lambda: kv_usage(cluster.decode) == 0.0)
    cluster.prefill = _prefill(cluster, port=cluster.prefill.port)
    cluster.prefill.wait_ready()
    nxt = _ids(8000, 4 * STEP + 3)
    assert complete(front_door, nxt) == complete(cluster.ref.url, nxt)
    wait("the decode's stats", lambda: cluster.d()["loads"] == d1["loads"] + 1
         and cluster.d()["in_flight_loads"] == 0)
    assert cluster.d()["load_failures"] == d1["load_failures"]
