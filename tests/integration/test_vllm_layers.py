"""Real vLLM, the prefill sending layer by layer (``send_by: layer``): a bootstrap server, one
``vllm serve`` prefill and one decode loading ``PdxferConnector``, and a colocated vLLM as the
reference; every output equals it token for token.

The prefill computes ``STEP`` tokens a step (``--max-num-batched-tokens``), a block and a half,
so a prompt spans several steps and most steps fill a block in part (its next step completes
it). As each attention layer of a step finishes, ``save_kv_layer`` hands that layer's blocks
for the step's tokens to the sender (once the decode's request has reached the prefill;
before that, a step's layers go after its forward in one hand-off). The decode runs with
``integrity: sampled`` and ``kv_load_failure_policy: recompute``, vLLM's own prefix cache off (every block crosses); the
last test restarts it with ``kv_load_failure_policy: fail``. Faults are set per room from the
start: the rooms ``SLOW``'s writes are held back on the prefill (it is killed while they are),
the rooms ``CORRUPT``'s are damaged on the decode after their layers arrived (integrity must
catch it). The tests, each against colocated vLLM, in file order: a prompt of
many steps, a prefix cached on the prefill, a decode asking late and early, a corrupted
layer (both forms), a client that leaves while the prefill computes, a prefill killed
mid-stream under each ``kv_load_failure_policy`` (``docs/testing.md`` maps them). Each
prefill step is held ``PACE_S`` and each decode step ``DECODE_PACE_S`` (``step_pace_s``),
so a long prompt is still being computed, and a long answer still being generated,
when a client leaves, however fast the machine.

One cluster per module; the tests run in file order, each leaving it serving for the next.
Prompts start at distinct offsets of ``_ids``' cycle (``base % 700``), so a test's prompt hits
the prefill's prefix cache only where the test means it to.
"""

from __future__ import annotations

import concurrent.futures as cf
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from pdxfer.serving.vllm.local_model import SHAPES
from pdxfer.serving.vllm.servers import VllmServer, kv_config

from . import vllm_helpers as vh
from .vllm_helpers import client, complete, kv_usage, metric, wait

pytestmark = [pytest.mark.timeout(900), pytest.mark.engine]

BS = 32
STEP = 48  # the prefill's tokens per step: a block and a half
SLOW = {"recompute": 5151, "fail": 5153}
"""Rooms whose writes the prefill holds back 8 s (killed meanwhile), by the decode's policy."""
CORRUPT = {"late": 5252, "early": 5254}
"""Rooms the decode damages after their writes, by the protocol's form."""
LOADED = {"late": 5301, "early": 5302}
"""Rooms without faults, by the protocol's form."""
DECODE, PREFILL = "vllm-ld0", "vllm-lp0"
DEADLINE_S = 20.0
PACE_S = 0.1
"""The prefill's shortest step (``step_pace_s``): a prompt of N steps computes for at least
N * PACE_S, however fast the machine (a client can leave while it computes)."""
DECODE_PACE_S = 0.02
"""The decode's shortest step: ``LONG`` tokens take at least 20 s."""
LONG = 1000
S = SHAPES["small"]
PER_TOKEN = S.layers * S.kv_heads * 2 * S.head_size * 4  # bytes of one token's KV, fp32


class Cluster(vh.Cluster):
    """The prefill sending by layer; the decode with ``integrity: sampled`` and ``recompute``;
    the faults set from the start."""

    prefill_instance, decode_instance = PREFILL, DECODE

    def prefill_server(self, port: int | None = None) -> VllmServer:
        extra = {
            "bootstrap": self.boot.address,
            "instance": PREFILL,
            "stats_file": str(self.p_stats),
            "send_by": "layer",
            "bootstrap_timeout_s": DEADLINE_S,
            "transfer_timeout_s": DEADLINE_S,
            "step_pace_s": PACE_S,
        }
        return VllmServer(
            "prefill",
            self.model,
            self.tmp,
            port=port,
            log_stats=True,
            args=["--max-num-batched-tokens", str(STEP)],
            kv_transfer_config=kv_config("kv_producer", extra),
            env={"PDXFER_FAULTS": f"delay_write=8,rooms={_rooms(SLOW)}"},
        )

    policy = "recompute"
    """The decode's ``kv_load_failure_policy`` (the last test restarts it with ``fail``)."""

    def decode_server(self, port: int | None = None) -> VllmServer:
        extra = {
            "bootstrap": self.boot.address,
            "instance": DECODE,
            "stats_file": str(self.d_stats),
            "integrity": "sampled",
            "bootstrap_timeout_s": DEADLINE_S,
            "transfer_timeout_s": DEADLINE_S,
            "step_pace_s": DECODE_PACE_S,
        }
        return VllmServer(
            "decode",
            self.model,
            self.tmp,
            port=port,
            args=["--no-enable-prefix-caching"],
            log_stats=True,
            kv_transfer_config=kv_config("kv_consumer", extra, kv_load_failure_policy=self.policy),
            env={"PDXFER_FAULTS": f"corrupt=1,rooms={_rooms(CORRUPT)}"},
        )


def _rooms(by: dict[str, int]) -> str:
    return ";".join(map(str, by.values()))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from vh.serve(Cluster(tmp_path_factory.mktemp("vllm_layers")))


@pytest.fixture(scope="module")
def front_door(cluster: Cluster) -> Iterator[str]:
    """pdxfer's router in front of the pair (concurrent dispatch: the decode asks while the
    prefill computes, so layers reach it as they are computed)."""
    yield from vh.front_door(cluster)


def _ids(base: int, n: int) -> list[int]:
    return [(base + 37 * i) % 700 + 300 for i in range(n)]


def _settled(cluster: Cluster, loads: int) -> dict[str, Any]:
    wait(
        "the decode's loads",
        lambda: cluster.d().get("loads", 0) >= loads and cluster.d().get("in_flight_loads", 1) == 0,
    )
    wait("the prefill's sends", lambda: cluster.p().get("in_flight_sends", 1) == 0)
    return cluster.d()


def test_a_prompt_of_many_steps_streams_by_layer_and_equals_colocated(
    cluster: Cluster, front_door: str
) -> None:
    prompts = [
        _ids(100 * k, n) for k, n in enumerate((5 * STEP + 7, 9 * STEP, 3 * BS + 1, 12 * STEP + 31))
    ]
    want = [complete(cluster.ref.url, q) for q in prompts]
    with cf.ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda q: complete(front_door, q), prompts))
    assert got == want
    d = _settled(cluster, len(prompts))
    p = cluster.p()
    assert d["load_failures"] == 0 and d["loads"] == len(prompts)
    assert p["sends"] == len(prompts) and p["send_failures"] == 0
    # two prompts at a time share a step's STEP tokens: each takes at least this many steps
    # (a lower bound: the scheduler may take more)
    steps = sum(-(-len(q) // STEP) for q in prompts)
    assert p["step_chunks"] >= steps - len(prompts), (
        "every step before the prompt's end handed its tokens over"
    )
    # a step computed once the decode's request had reached the prefill hands its layers
    # over one by one (``streamed_steps``); one computed before (nobody to receive a layer
    # yet) in one piece after its forward. How many steps are of each kind turns on how soon
    # the decode's ask, sent at dispatch, reaches the prefill, i.e. on the machine's speed:
    # the bound counts the steps the prefill says were streamed (the "early" test below
    # asks first, and there every step streams)
    handed = p["step_chunks"] + p["sends"]  # steps that carried tokens
    assert 0 <= p["streamed_steps"] <= handed
    assert p["layer_sends"] >= p["streamed_steps"] * S.layers + handed - p["streamed_steps"], (
        "a streamed step hands over each layer, any other step its layers at least at once"
    )
    tokens = sum(len(q) for q in prompts)
    assert p["sent_tokens"] == tokens
    assert p["endpoint"]["transport_bytes"] == d["net_bytes"] > 0
    assert metric(cluster.prefill, "vllm:pdxfer_layer_sends_total") == p["layer_sends"]


def test_a_prefix_cached_on_the_prefill_is_sent_with_the_first_step(
    cluster: Cluster, front_door: str
) -> None:
    prefix = _ids(4000, 6 * BS)
    a, b = prefix + _ids(4100, 40), prefix + _ids(4200, 75)
    hits0 = metric(cluster.prefill, "vllm:prefix_cache_hits_total")
    d0, sent0 = cluster.d(), cluster.p()["endpoint"]["transport_bytes"]
    for q in (a, b):
        assert complete(front_door, q) == complete(cluster.ref.url, q)
    d = _settled(cluster, d0["loads"] + 2)
    assert metric(cluster.prefill, "vllm:prefix_cache_hits_total") - hits0 >= 6 * BS, (
        "the second prompt's prefix needed no compute on the prefill"
    )
    assert d["load_failures"] == d0["load_failures"], "both loads completed"
    sent = cluster.p()["endpoint"]["transport_bytes"] - sent0
    assert sent == d["net_bytes"] - d0["net_bytes"]
    assert sent >= (len(a) + len(b) - 2) * PER_TOKEN, "the cached prefix crossed too"


def _prefill_params(room: int) -> dict[str, Any]:
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "pdxfer_room": room,
        "pdxfer_decode": DECODE,
    }


def _early_params(cluster: Cluster, room: int) -> dict[str, Any]:
    """The decode's request in the early form: the prefill's answer, known in advance."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "pdxfer_room": room,
        "pdxfer_bootstrap": cluster.boot.address,
        "pdxfer_instance": PREFILL,
    }


def _ask_prefill(cluster: Cluster, prompt: list[int], room: int) -> Any:
    return client(cluster.prefill.url).completions.create(
        model="llama",
        prompt=prompt,
        max_tokens=1,
        temperature=0,
        extra_body={"kv_transfer_params": _prefill_params(room)},
    )


def _by_hand(cluster: Cluster, prompt: list[int], room: int, form: str) -> list[int]:
    """The protocol by hand, with a chosen room (faults name rooms). ``late``: vLLM's
    sequential form, the decode asks after the prefill finished (its answer is the decode's
    params). ``early``: the decode asks before the prefill has the request, and waits for
    the room; the prefill's layers then reach it as they are computed."""
    if form == "late":
        answer = _ask_prefill(cluster, prompt, room).model_extra["kv_transfer_params"]
        assert answer["pdxfer_room"] == room
        return complete(cluster.decode.url, prompt, extra={"kv_transfer_params": answer})
    loads = cluster.d().get("loads", 0)
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(
            complete,
            cluster.decode.url,
            prompt,
            extra={"kv_transfer_params": _early_params(cluster, room)},
        )
        wait("the decode to ask", lambda: cluster.d().get("loads", 0) > loads)
        assert not fut.done(), "the decode waits for the prefill's room"
        _ask_prefill(cluster, prompt, room)
        return fut.result(timeout=120)


FORMS = ["late", "early"]


@pytest.mark.parametrize("form", FORMS)
def test_a_decode_asking_after_the_prefill_finished_or_before_it_had_the_request_loads_all(
    cluster: Cluster, form: str
) -> None:
    """``late``: the prefill handed each step's layers to the sender after the step's
    forward (one hand-off: no decode had asked), with no decode attached; the decode asks
    after the prefill answered and gets all of it (blocks a step filled in part and the next
    completed included). ``early``: the decode asks first and each layer reaches it as it is
    computed. Both load, not recompute, and equal colocated."""
    prompt = _ids({"late": 50, "early": 150}[form], 7 * STEP + 13)
    want = complete(cluster.ref.url, prompt)
    d0, p0 = cluster.d(), cluster.p()
    assert _by_hand(cluster, prompt, LOADED[form], form) == want
    d = _settled(cluster, d0.get("loads", 0) + 1)
    wait(
        "the prefill's send",
        lambda: (
            cluster.p().get("sends", 0) > p0.get("sends", 0) and cluster.p()["in_flight_sends"] == 0
        ),
    )
    p = cluster.p()
    assert d["load_failures"] == d0.get("load_failures", 0), "loaded, not recomputed"
    assert d["loads"] == d0.get("loads", 0) + 1 and p["sends"] == p0.get("sends", 0) + 1
    steps = -(-len(prompt) // STEP)
    if form == "early":
        assert p["layer_sends"] - p0.get("layer_sends", 0) >= steps * S.layers, (
            "each step's layers went one by one"
        )
        handed = sum(p[k] - p0.get(k, 0) for k in ("step_chunks", "sends"))
        assert p["streamed_steps"] - p0.get("streamed_steps", 0) == handed >= steps, (
            "every step streamed: the decode asked first"
        )
    else:
        assert p["layer_sends"] - p0.get("layer_sends", 0) >= steps, (
            "each step's layers went after its forward"
        )
        assert p["streamed_steps"] == p0.get("streamed_steps", 0), "nobody asked: none streamed"
    sent = p["endpoint"]["transport_bytes"] - p0.get("endpoint", {}).get("transport_bytes", 0)
    assert sent == d["net_bytes"] - d0.get("net_bytes", 0) >= (len(prompt) - 1) * PER_TOKEN


@pytest.mark.parametrize("form", FORMS)
def test_a_corrupted_layer_is_caught_and_no_wrong_token_is_returned(
    cluster: Cluster, form: str
) -> None:
    """The decode damages one page of one layer's K or V after the prefill's last write of
    the room (the ``corrupt`` fault), before its sampled check: the digest of that layer's
    streamed range does not match, the load fails, and vLLM recomputes (the colocated
    tokens). The prefill sent digests per streamed layer range and step (a request-wide
    digest is one per pool), in both forms: ``early``, the layers went while the prefill
    computed; ``late``, each step's were handed over after its forward and went when the
    decode asked."""
    prompt = _ids({"late": 250, "early": 350}[form], 6 * STEP + 5)
    want = complete(cluster.ref.url, prompt)
    d0, p0 = cluster.d(), cluster.p()
    assert _by_hand(cluster, prompt, CORRUPT[form], form) == want
    failures0 = d0.get("load_failures", 0)
    wait(
        "the decode's stats",
        lambda: (
            cluster.d().get("load_failures", 0) > failures0 and cluster.d()["in_flight_loads"] == 0
        ),
    )
    wait(
        "the prefill's send",
        lambda: (
            cluster.p().get("sends", 0) > p0.get("sends", 0) and cluster.p()["in_flight_sends"] == 0
        ),
    )
    d1, p1 = cluster.d(), cluster.p()
    ep0 = d0.get("endpoint", {})
    assert d1["endpoint"]["integrity_mismatches"] == ep0.get("integrity_mismatches", 0) + 1
    assert d1["load_failures"] == failures0 + 1
    assert d1["loads"] == d0.get("loads", 0) + 1
    # digest values: one per buffer a digest covers (K and V of a layer at most 2), so a
    # request-wide digest has at most 2 per layer; the 7 steps' layer ranges have 7 times
    # what a layer holds
    digests = p1["endpoint"].get("integrity_digests", 0) - p0.get("endpoint", {}).get(
        "integrity_digests", 0
    )
    assert digests >= 4 * S.layers, f"{digests} digest values: not one per streamed range"
    assert p1["layer_sends"] - p0.get("layer_sends", 0) >= 4 * (S.layers if form == "early" else 1)


LEAVER = """
import sys
from openai import OpenAI
url, prompt, LONG = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
c = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
for _ in c.completions.create(model="llama", prompt=prompt, max_tokens=LONG, temperature=0,
                              stream=True, extra_body={"ignore_eos": True}):
    pass
"""
"""A streaming client in a process of its own: killing it is a client that leaves before
its first token (the router starts its answer with the first text)."""


def test_a_client_that_leaves_while_the_prefill_computes_ends_both_sides(
    cluster: Cluster, front_door: str
) -> None:
    """Through the router (concurrent dispatch), a prompt of 60 steps, which the paced
    prefill computes for at least 6 s: the client leaves once the decode asked and the
    prefill handed over its first layers. The router ends both legs: vLLM aborts the
    prefill's request before its last step (its send never completes) and the decode's (its
    load ends aborted, not at a deadline, and the request never finishes its ``LONG``
    tokens, which the paced decode needs ``LONG * DECODE_PACE_S`` for); both sides' blocks
    come back, and the next request is served."""
    prompt = _ids(20, 60 * STEP)
    d0, p0 = cluster.d(), cluster.p()
    ep0 = d0.get("endpoint", {})
    gen0 = metric(cluster.decode, "vllm:generation_tokens_total")
    ok0 = metric(cluster.decode, "vllm:request_success_total")
    base = {s.name: kv_usage(s) for s in (cluster.prefill, cluster.decode)}
    proc = subprocess.Popen(
        [sys.executable, "-c", LEAVER, front_door, ",".join(map(str, prompt)), str(LONG)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait("the decode to ask", lambda: cluster.d().get("loads", 0) > d0.get("loads", 0))
        wait(
            "the prefill to stream",
            lambda: cluster.p().get("layer_sends", 0) > p0.get("layer_sends", 0),
        )
    finally:
        proc.kill()
        proc.wait(timeout=60)
    for s in (cluster.prefill, cluster.decode):
        wait(
            f"{s.name} to end the request and free its blocks",
            lambda s=s: (
                metric(s, "vllm:num_requests_running") == 0
                and metric(s, "vllm:num_requests_waiting") == 0
                and kv_usage(s) == base[s.name]
            ),
        )
    wait(
        "the decode's load to end",
        lambda: (
            cluster.d()["in_flight_loads"] == 0
            and cluster.d()["endpoint"].get("failures_aborted", 0) > ep0.get("failures_aborted", 0)
        ),
    )
    wait("the prefill's room to end", lambda: cluster.p()["in_flight_sends"] == 0)
    p, ep = cluster.p(), cluster.d()["endpoint"]
    assert p["sends"] == p0.get("sends", 0), "the prefill computed the whole prompt"
    assert p["layer_sends"] - p0.get("layer_sends", 0) < 60 * S.layers
    assert ep.get("failures_deadline", 0) == ep0.get("failures_deadline", 0)
    # the prefill's abort may reach the decode before its own: it then recomputes the
    # prompt (kv_load_failure_policy: recompute) and generates a token or so meanwhile
    assert metric(cluster.decode, "vllm:request_success_total") == ok0, (
        "the decode finished the request of a client that left"
    )
    assert metric(cluster.decode, "vllm:generation_tokens_total") - gen0 < LONG
    nxt = _ids(120, 3 * STEP + 1)
    assert complete(front_door, nxt) == complete(cluster.ref.url, nxt)


def _kill_mid_stream(cluster: Cluster, prompt: list[int], room: int) -> cf.Future[list[int]]:
    """The decode asks at dispatch (the early form), the prefill streams the prompt's layers,
    whose writes are held back (``delay_write``), and is killed once the stream started.
    Returns the decode's answer (its future: done once the load's failure was handled)."""
    d0, p0 = cluster.d(), cluster.p()
    pool = cf.ThreadPoolExecutor(2)
    try:
        fut = pool.submit(
            complete,
            cluster.decode.url,
            prompt,
            extra={"kv_transfer_params": _early_params(cluster, room)},
        )
        wait("the decode to ask", lambda: cluster.d().get("loads", 0) > d0.get("loads", 0))
        pre = pool.submit(_ask_prefill, cluster, prompt, room)
        wait(
            "the stream to start",
            lambda: cluster.p().get("layer_sends", 0) > p0.get("layer_sends", 0),
        )
        assert kv_usage(cluster.decode) > 0, "the decode holds blocks for the load"
        cluster.prefill.kill()
        # its answer may have come before the kill (the writes are what was held back)
        cf.wait([pre, fut], timeout=DEADLINE_S + 60)
        return fut
    finally:
        pool.shutdown(wait=False)


def _failed_with_nothing_left_to_land(cluster: Cluster, d0: dict[str, Any]) -> dict[str, Any]:
    """The load failed once, for the kill (not waited out to its deadline), and was reported
    to vLLM with no write left that could land in its blocks: the prefill is known dead, so
    none was quarantined (pages are handed back only once nothing can land:
    ``docs/failure-semantics.md``; the bytes themselves are checked in ``test_crash``,
    ``test_abort`` and ``test_stranded_write``). Its blocks come back."""
    wait(
        "the decode's stats",
        lambda: (
            cluster.d().get("load_failures", 0) == d0.get("load_failures", 0) + 1
            and cluster.d()["in_flight_loads"] == 0
        ),
    )
    d1 = cluster.d()
    ep0, ep1 = d0.get("endpoint", {}), d1["endpoint"]
    assert ep1.get("quarantined_requests", 0) == ep0.get("quarantined_requests", 0), (
        "the failure was reported with no write left that could land"
    )
    assert ep1.get("failures_deadline", 0) == ep0.get("failures_deadline", 0), (
        "the kill was noticed, not waited out"
    )
    assert ep1.get("quarantined_pages", 0) == 0
    wait("the decode's blocks to come back", lambda: kv_usage(cluster.decode) == 0.0)
    return d1


def test_a_prefill_killed_mid_stream_fails_the_load_and_nothing_lands_after(
    cluster: Cluster, front_door: str
) -> None:
    """``kv_load_failure_policy: recompute``: the decode's load fails, vLLM recomputes the
    prompt, and the output equals colocated; a prefill back on the instance serves the
    next request."""
    prompt = _ids(550, 20 * STEP + 9)
    want = complete(cluster.ref.url, prompt)
    d0 = cluster.d()
    fut = _kill_mid_stream(cluster, prompt, SLOW["recompute"])
    assert fut.result(timeout=0) == want, (
        "recomputed by the decode (kv_load_failure_policy: recompute)"
    )
    d1 = _failed_with_nothing_left_to_land(cluster, d0)
    cluster.restart_prefill()
    nxt = _ids(650, 4 * STEP + 3)
    assert complete(front_door, nxt) == complete(cluster.ref.url, nxt)
    wait(
        "the decode's stats",
        lambda: cluster.d()["loads"] == d1["loads"] + 1 and cluster.d()["in_flight_loads"] == 0,
    )
    assert cluster.d()["load_failures"] == d1["load_failures"]


def test_under_policy_fail_a_prefill_killed_mid_stream_fails_the_request(cluster: Cluster) -> None:
    """The decode restarted with ``kv_load_failure_policy: fail``: the same kill ends the
    request with vLLM's error (HTTP 500), never with tokens decoded from KV that did not
    arrive; the failure is reported with nothing left to land, the blocks come back, and
    the decode serves the next request."""
    import openai

    cluster.decode.stop()
    cluster.d_stats.unlink(missing_ok=True)  # the new process's counters start at 0
    cluster.policy = "fail"
    cluster.decode = cluster.decode_server(port=cluster.decode.port)
    cluster.decode.wait_ready()
    prompt = _ids(450, 20 * STEP + 9)
    want = complete(cluster.ref.url, prompt)
    fut = _kill_mid_stream(cluster, prompt, SLOW["fail"])
    err = fut.exception(timeout=0)
    assert isinstance(err, openai.APIStatusError) and err.status_code == 500, (
        f"the request was not failed (kv_load_failure_policy: fail): {err!r}"
    )
    _failed_with_nothing_left_to_land(cluster, {})
    assert complete(cluster.decode.url, prompt) == want, "computed by the decode itself"
