"""Conformance without processes: vLLM's real ``Scheduler`` (its real ``Request``,
``SchedulerOutput``, block manager and ``kv_load_failure_policy`` handling) drives the
connector's scheduler side, and worker-side ``PdxferConnector`` instances move real KV
tensors between a prefill and a decode over pdxfer's in-memory transport, through the call
sequence vLLM's model runner uses. Only the model forward is replaced: it writes a pattern
of (layer, head, token, position) into the slots it "computes", so the decode's blocks can
be checked against what the prefill computed, byte for byte.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before vLLM imports transformers

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorLogging,
    KVConnectorProm,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from pdxfer import BootstrapServer  # noqa: E402
from pdxfer.integrations.vllm.connector import PdxferConnector  # noqa: E402
from pdxfer.transport import MemoryFabric  # noqa: E402
from tests.harness.vllm_engine import (
    BS,
    SAMPLED,
    Engine,
    Pair,
    expected,
    held,
    make_pair,
    model,
    prefill_then_decode,
    run_until,
    server,
)

__all__ = ["model", "server"]  # the fixtures


def test_prefill_holds_blocks_until_sent_and_decode_receives_exactly_what_was_computed(
    model: Path, server: BootstrapServer
) -> None:
    pair = make_pair(model, server, name="happy")
    p, d = pair.p, pair.d
    free_p, free_d = p.free_blocks(), d.free_blocks()
    tokens = [(i * 13) % 900 + 10 for i in range(150)]  # 5 blocks, the last one partial
    prefill_then_decode(pair, "r1", tokens, room=101)
    assert p.free_blocks() == free_p - 5, "request_finished returned True: blocks held"
    run_until([p, d], lambda: "r1-d" in d.finished and "r1" not in p.sched.requests)
    # the decode's first step after the load recomputed only the last prompt token
    assert d.computed["r1-d"][0] == (len(tokens) - 1, 1)
    assert d.outputs["r1-d"] == [SAMPLED] * 3
    assert p.free_blocks() == free_p and d.free_blocks() == free_d
    assert p.ep.metrics()["transport_bytes"] == 5 * p.conn.worker.layout.block_bytes


def test_decode_blocks_hold_the_prefill_kv_before_the_decode_computes(
    model: Path, server: BootstrapServer
) -> None:
    pair = make_pair(model, server, name="bytes")
    p, d = pair.p, pair.d
    tokens = [(i * 29) % 700 + 3 for i in range(200)]
    prefill_then_decode(pair, "b1", tokens, room=202, max_tokens=4)
    # step only until the decode got the KV, then look before it computes anything
    run_until([p, d], lambda: "b1-d" in d.computed)
    assert torch.equal(held(d, "b1-d", len(tokens) - 1), expected(tokens, len(tokens) - 1))
    run_until([p, d], lambda: "b1-d" in d.finished)


def test_a_prefix_in_vllms_own_cache_is_not_asked_for_again(
    model: Path, server: BootstrapServer
) -> None:
    pair = make_pair(model, server, name="l1")
    p, d = pair.p, pair.d
    shared = [(i * 17) % 800 + 20 for i in range(128)]  # 4 full blocks
    a = shared + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    b = shared + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]
    prefill_then_decode(pair, "a", a, room=301)
    run_until([p, d], lambda: "a-d" in d.finished)
    before = p.ep.metrics()["transport_bytes"]
    prefill_then_decode(pair, "b", b, room=302)
    run_until([p, d], lambda: "b-d" in d.finished and "b" not in p.sched.requests)
    block = p.conn.worker.layout.block_bytes
    assert p.ep.metrics()["transport_bytes"] - before == 1 * block, (
        "4 blocks came from the decode's own prefix cache: only the 5th crosses"
    )
    assert d.computed["b-d"][0] == (len(b) - 1, 1)


def test_decode_tiers_restore_from_l2_and_write_back(model: Path, server: BootstrapServer) -> None:
    pair = make_pair(model, server, name="l2", decode_extra={"l2_pages": 32}, prefix_caching=False)
    p, d = pair.p, pair.d
    shared = [(i * 19) % 800 + 20 for i in range(128)]
    a, b = shared + list(range(30, 50)), shared + list(range(60, 90))
    prefill_then_decode(pair, "a", a, room=401)
    run_until([p, d], lambda: "a-d" in d.finished)
    run_until(
        [p, d], lambda: d.conn.worker.counters["writebacks"] == 1 and "a-d" not in d.sched.requests
    )
    before = p.ep.metrics()["transport_bytes"]
    prefill_then_decode(pair, "b", b, room=402, max_tokens=2)
    run_until(
        [p, d], lambda: d.conn.worker.counters["restored_l2_pages"] >= 4 and "b-d" in d.computed
    )
    assert torch.equal(held(d, "b-d", len(b) - 1), expected(b, len(b) - 1))
    run_until([p, d], lambda: "b-d" in d.finished and "b" not in p.sched.requests)
    assert p.ep.metrics()["transport_bytes"] - before == p.conn.worker.layout.block_bytes
    assert d.conn.worker.counters["restored_l2_pages"] == 4


def test_the_connectors_figures_reach_vllms_log_line_and_prometheus(
    model: Path, server: BootstrapServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Each step's figures go worker -> vLLM's scheduler stats -> its logger and Prometheus
    (vLLM's own classes), and add up to what moved."""
    pair = make_pair(
        model, server, name="prom", decode_extra={"l2_pages": 32}, prefix_caching=False
    )
    p, d = pair.p, pair.d
    shared = [(i * 23) % 700 + 20 for i in range(128)]
    before = p.ep.metrics()["transport_bytes"]
    prefill_then_decode(pair, "a", shared + [7, 8, 9], room=501)
    run_until(
        [p, d],
        lambda: (
            "a-d" in d.finished
            and d.conn.worker.counters["writebacks"] == 1
            and "a" not in p.sched.requests
        ),
    )
    prefill_then_decode(pair, "b", shared + [10, 11, 12, 13], room=502)
    run_until([p, d], lambda: "b-d" in d.finished and "b" not in p.sched.requests)
    sent = p.ep.metrics()["transport_bytes"] - before

    labels = {"model_name": "m", "engine": "0"}

    def observed(e: Engine) -> tuple[str, Any]:
        """vLLM's log line and a Prometheus registry, fed what its scheduler handed over."""
        reg = CollectorRegistry()

        class Prom(KVConnectorProm):  # vLLM's class, on a registry of the test's own
            _gauge_cls = functools.partial(Gauge, registry=reg)  # type: ignore[assignment]
            _counter_cls = functools.partial(Counter, registry=reg)  # type: ignore[assignment]
            _histogram_cls = functools.partial(Histogram, registry=reg)  # type: ignore[assignment]

        prom = Prom(e.vc, list(labels), {0: list(labels.values())})
        logging_ = KVConnectorLogging(e.vc.kv_transfer_config)
        for data in e.kv_stats:
            prom.observe(data, 0)
            logging_.observe(data)
        with caplog.at_level(logging.INFO):
            logging_.log(log_fn=logging.getLogger("test").info)
        return caplog.records[-1].getMessage(), functools.partial(
            reg.get_sample_value, labels=labels
        )

    line, value = observed(p)
    assert "sends=2" in line, line
    assert value("vllm:pdxfer_sends_total") == 2
    assert value("vllm:pdxfer_sent_tokens_total") == 131 + 132
    line, value = observed(d)
    assert "loads=2" in line and "restored_l2_pages=4" in line, line
    assert value("vllm:pdxfer_loads_total") == 2
    assert value("vllm:pdxfer_restored_l2_pages_total") == 4
    assert value("vllm:pdxfer_net_bytes_total") == sent
    assert value("vllm:pdxfer_load_failures_total") == 0
    assert value("vllm:pdxfer_ready_seconds_count") == 2
    assert value("vllm:pdxfer_load_bytes_sum") == sent


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_load_returns_its_blocks_and_follows_the_policy(
    model: Path, server: BootstrapServer, policy: str
) -> None:
    pair = make_pair(model, server, name=f"f-{policy}", policy=policy, timeouts=1.0)
    d = pair.d
    free_d = d.free_blocks()
    tokens = list(range(100, 200))
    # a prefill answer for a room no prefill holds: the decode's request goes unanswered
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "pdxfer_room": 999,
        "pdxfer_bootstrap": server.address,
        "pdxfer_instance": "p-nobody",
    }
    d.add("x", tokens, 2, params)
    run_until([d], lambda: "x" in d.finished or "x" in d.computed, timeout=30)
    assert d.conn.worker.counters["load_failures"] == 1
    if policy == "recompute":
        assert d.computed["x"][0] == (0, len(tokens)), "recomputed from the start"
        run_until([d], lambda: "x" in d.finished)
        assert d.outputs["x"] == [SAMPLED] * 2
    else:
        assert d.finished["x"].finish_reason is not None and "x" not in d.computed
    run_until([d], lambda: d.free_blocks() == free_d)


def test_the_plugin_registers_the_connector_by_name() -> None:
    from importlib.metadata import entry_points

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import pdxfer.integrations.vllm as integration

    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "pdxfer"]
    assert eps and eps[0].value == "pdxfer.integrations.vllm:register"
    integration.register()
    integration.register()  # vLLM loads plugins in several places: twice is fine
    cls = KVConnectorFactory.get_connector_class(
        KVTransferConfig(kv_connector="PdxferConnector", kv_role="kv_consumer")
    )
    assert cls is PdxferConnector


def test_a_decode_never_loads_from_a_prefill_behind_a_bootstrap_it_does_not_trust(
    model: Path, server: BootstrapServer
) -> None:
    """A client names a rogue prefill (a real endpoint, on its own bootstrap, holding its own
    KV for the prompt): the decode serves the request as if it had no pdxfer params, computing
    the prompt itself, counts the refusal, and the rogue is never asked."""
    with BootstrapServer("127.0.0.1", 0) as rogue_boot:
        rogue = make_pair(model, rogue_boot, name="rogue")  # its own prefill and bootstrap
        pair = make_pair(model, server, name="victim")
        d = pair.d
        tokens = [(i * 31) % 800 + 7 for i in range(100)]
        params = prefill_then_decode(rogue, "evil", tokens, room=4242)
        run_until([rogue.p, rogue.d], lambda: "evil-d" in rogue.d.finished)
        sent = rogue.p.ep.metrics()["transport_bytes"]
        rogue.p.add("evil2", tokens, 1, {"do_remote_decode": True, "pdxfer_room": 4243})
        run_until([rogue.p], lambda: "evil2" in rogue.p.finished)
        params = rogue.p.finished["evil2"].kv_transfer_params
        assert params["pdxfer_bootstrap"] == rogue_boot.address
        d.add("v", tokens, 2, params)
        run_until([d, rogue.p], lambda: "v" in d.finished)
        assert d.computed["v"][0] == (0, len(tokens)), "computed by the decode, not loaded"
        assert d.outputs["v"] == [SAMPLED] * 2
        assert rogue.p.ep.metrics()["transport_bytes"] == sent, "the rogue was never asked"
        assert sum(s.get("untrusted_refused", 0) for s in d.kv_stats) == 1
        assert d.conn.worker.counters["loads"] == 0


def test_the_step_after_a_prefill_finished_lets_its_answer_go_out_first() -> None:
    """The step after a prefill finished requests carries their send orders; vLLM's output
    thread is then sending their answers (the router waits for them). That step must let
    another thread take the GIL before its work: without the pause, a thread woken just
    before it runs only after it (the GIL changes hands every 5 ms at the earliest)."""
    import threading

    from vllm.v1.request import RequestStatus

    from pdxfer.integrations.vllm import config as C
    from pdxfer.integrations.vllm.scheduler import PdxferScheduler

    sch = PdxferScheduler(C.parse("kv_producer", {"bootstrap": "127.0.0.1:9"}, "m"), BS)
    firsts = 0
    for i in range(20):
        r = Request(
            f"r{i}",
            list(range(40)),
            SamplingParams(
                max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}
            ),
            None,
        )
        sch.update_state_after_alloc(r, None, 0)  # scheduled: its room opens
        sch.build_connector_meta()  # the step that computes it (no send yet)
        r.status = RequestStatus.FINISHED_LENGTH_CAPPED
        assert sch.request_finished(r, [1, 2])[0]
        go, order = threading.Event(), []

        def output_thread(go: threading.Event = go, order: list[str] = order) -> None:
            go.wait()
            order.append("answer")

        t = threading.Thread(target=output_thread)
        t.start()
        time.sleep(0.02)  # the thread parked in wait()
        go.set()  # as vLLM's queue put wakes its output thread
        meta = sch.build_connector_meta()
        order.append("step")
        t.join(30)
        assert [s.req_id for s in meta.sends] == [f"r{i}"]
        firsts += order[0] == "answer"
    assert firsts > 0  # without the pause: never (the woken thread waits for the GIL)


def test_decode_tier_keys_of_a_prompt_with_images_depend_on_the_images() -> None:
    """An image's prompt tokens are one placeholder id repeated, whatever the image. L2/L3
    pages keyed by token ids alone would restore, for a second image shown with the same
    text, the KV the first image left there: the load's and the write-back's scope must
    name the images (content hash and place); a text-only prompt keeps its tenant's."""
    from types import SimpleNamespace

    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import RequestStatus

    from pdxfer.integrations.vllm import config as C
    from pdxfer.integrations.vllm.scheduler import PdxferScheduler

    boot = "127.0.0.1:9"
    sch = PdxferScheduler(C.parse("kv_consumer", {"bootstrap": boot, "l2_pages": 16}, "m"), BS)
    tokens = [7] * 10 + [99] * 64 + [8] * 30  # text, 64 image placeholders, text
    params = {
        "do_remote_prefill": True,
        "pdxfer_room": 5,
        "pdxfer_bootstrap": boot,
        "pdxfer_instance": "p0",
    }

    def scopes(
        rid: str, image: str | None, at: int = 10, salt: str | None = None
    ) -> tuple[str, str]:
        mm = (
            [
                MultiModalFeatureSpec(
                    data=None,
                    modality="image",
                    identifier=image,
                    mm_position=PlaceholderRange(offset=at, length=64),
                )
            ]
            if image
            else None
        )
        r = Request(
            rid,
            list(tokens),
            SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": dict(params)}),
            None,
            mm_features=mm,
            cache_salt=salt,
        )
        blocks = SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],))
        sch.update_state_after_alloc(r, blocks, len(tokens))  # type: ignore[arg-type]
        (load,) = sch.build_connector_meta().loads
        assert load.tokens == tuple(tokens)
        r.num_computed_tokens = len(tokens)
        r.status = RequestStatus.FINISHED_LENGTH_CAPPED
        assert sch.request_finished(r, ([1, 2, 3, 4],))[0]
        (wb,) = sch.build_connector_meta().writebacks
        assert wb.scope == load.scope, "a prompt's pages are written where they are looked up"
        return load.scope, wb.scope

    a, b = scopes("a", "hash-of-image-a")[0], scopes("b", "hash-of-image-b")[0]
    assert a != b, "two images behind the same placeholder ids share L2 pages"
    assert scopes("a2", "hash-of-image-a")[0] == a, "the same image, the same pages"
    assert scopes("a3", "hash-of-image-a", at=11)[0] != a, "the image moved"
    assert scopes("t", None)[0] == "" and scopes("s", None, salt="x")[0] == "x"
    assert scopes("as", "hash-of-image-a", salt="x")[0] not in (a, "x")


def test_each_data_parallel_rank_is_an_endpoint_and_the_decode_loads_from_the_one_named(
    model: Path, server: BootstrapServer
) -> None:
    """Two engine cores of one prefill (``--data-parallel-size 2`` of a dense model: vLLM
    runs each as an independent engine and resets its DP size to 1) register as ranks 0 and
    1 of one instance. A request's KV comes from the rank that computed it: named in the
    prefill's answer (sequential) or given at dispatch (early form), where the bootstrap's
    own choice (the room modulo the DP size) would be the other rank. A rank's route is
    looked up once, not per room."""
    fabric = MemoryFabric()
    dl = {"bootstrap_timeout_s": 10.0, "transfer_timeout_s": 10.0}
    ps = [
        Engine(
            model,
            "kv_producer",
            {"bootstrap": server.address, "instance": "p-dp", **dl},
            fabric,
            dp=(r, 2),
        )
        for r in (0, 1)
    ]
    d = Engine(model, "kv_consumer", {"bootstrap": server.address, "instance": "d-dp"}, fabric)
    for e in (*ps, d):
        e.finished = {}
    status, route = server.route("p-dp", None, 1)
    assert status == 200 and route["dp_size"] == 2 and route["dp_rank"] == 1
    assert [p.ep.registration().dp_rank for p in ps] == [0, 1]
    lookups = server.counters["lookups"]
    for r, p in enumerate(ps):
        tokens = [(i * 7 + r * 101) % 900 + 10 for i in range(100)]
        room = 8000 + 2 * r + (1 - r)  # room % 2 names the other rank
        params = prefill_then_decode(Pair(p, d, server), f"s{r}", tokens, room=room)
        assert params["pdxfer_dp"] == r
        run_until([*ps, d], lambda r=r: f"s{r}-d" in d.computed)
        assert torch.equal(held(d, f"s{r}-d", len(tokens) - 1), expected(tokens, len(tokens) - 1))
    tokens = [(i * 31) % 900 + 10 for i in range(90)]
    early = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "pdxfer_room": 8100,  # even: the bootstrap alone would send the decode to rank 0
        "pdxfer_bootstrap": server.address,
        "pdxfer_instance": "p-dp",
        "pdxfer_dp": 1,
    }
    d.add("e-d", tokens, 2, early)
    ps[1].add(
        "e",
        tokens,
        1,
        {"do_remote_decode": True, "pdxfer_room": 8100, "pdxfer_decode": "d-dp", "pdxfer_dp": 1},
    )
    run_until([*ps, d], lambda: "e-d" in d.computed)
    assert torch.equal(held(d, "e-d", len(tokens) - 1), expected(tokens, len(tokens) - 1))
    assert d.conn.worker.counters["load_failures"] == 0
    # a route naming its rank holds for every room: looked up once per rank, not per room
    assert server.counters["lookups"] - lookups == 2
    run_until([*ps, d], lambda: "e-d" in d.finished and "e" not in ps[1].sched.requests)


def _asked(
    window: int, bs_p: int, bs_d: int, n: int, i: int, chunk: bool = False
) -> tuple[int, int]:
    """A ``n``-token prompt of a one-group model (window or chunk ``window``): the tokens
    the prefill computes and those the decode asks it for."""
    from pdxfer.integrations.vllm import config as C
    from pdxfer.integrations.vllm.groups import Group
    from pdxfer.integrations.vllm.scheduler import PdxferScheduler

    boot = "127.0.0.1:9"
    layer = ("model.layers.0.self_attn.attn",)

    def g(bs: int) -> tuple[Group, ...]:
        if chunk:
            return (Group(0, "chunk", bs, layer, chunk=window),)
        return (Group(0, "window", bs, layer, window=window),)

    pre = PdxferScheduler(C.parse("kv_producer", {"bootstrap": boot}, "m"), bs_p, g(bs_p))
    dec = PdxferScheduler(C.parse("kv_consumer", {"bootstrap": boot}, "m"), bs_d, g(bs_d))
    ask = {"do_remote_decode": True, "pdxfer_room": 7 + i}
    r = Request(
        f"p{i}",
        list(range(n)),
        SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": ask}),
        None,
    )
    pre.on_new_request(r)
    assert r.num_prompt_tokens == len(r.prompt_token_ids or ())
    answer = {"do_remote_prefill": True, "pdxfer_room": 7 + i, "pdxfer_bootstrap": boot}
    d = Request(
        f"d{i}",
        list(range(n)),
        SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": answer}),
        None,
    )
    count, ok = dec.get_num_new_matched_tokens(d, 0)
    assert ok
    return r.num_prompt_tokens, count


def test_the_decode_leaves_a_window_prompts_last_token_where_its_first_key_opens_a_block() -> None:
    """Window 128, blocks of 32: a 159-token prompt's last token attends back to token 31
    (block 0), which a decode holding all 159 would not keep: the decode asks for 158 and
    computes the last token itself; a 160-token prompt moves whole. The prefill computes
    every token (it keeps every one the decode reads)."""
    for i, (n, want) in enumerate(((159, 158), (160, 160), (191, 190))):
        assert _asked(128, BS, BS, n, i) == (n, want), n


@pytest.mark.parametrize(("bs_p", "bs_d"), [(32, 64), (64, 32), (32, 32), (16, 64)])
def test_a_decode_never_asks_for_a_prompt_token_the_prefill_left_uncomputed(
    bs_p: int, bs_d: int
) -> None:
    """Whatever the two block sizes, for every prompt length: the decode asks for no more
    tokens than the prefill computed (else its load fails), and backs off where its own
    window blocks need it (window 128; chunks of 64 back off on both sides alike)."""
    from pdxfer.integrations.vllm import groups as G

    for n in range(2, 700):
        computed, asked = _asked(128, bs_p, bs_d, n, n)
        assert asked <= computed, (n, computed, asked)
        dg = G.Group(0, "window", bs_d, ("a",), window=128)
        assert asked == n - G.backoff([dg], n), n
    for n in (63, 64, 65, 128, 129, 320):
        computed, asked = _asked(64, bs_p, bs_d, n, n, chunk=True)
        assert asked == computed == n - (n % 64 == 0), n
