"""Shared-secret access control: wrong or missing secret refused on every entry point."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import zmq

from pdxfer import BootstrapClient, BootstrapError, BootstrapServer, wire
from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent
from pdxfer.bootstrap import Registration
from pdxfer.pools import layout_signature
from tests.harness.zmqctx import context

from .conftest import FAST
from .helpers import Factory, run, verify

SECRET = "correct horse battery staple"
GEOMS = [
    PoolGeom("kv", "mha", layers=2, pages=64, page_size=16, heads=2, head_dim=16),
    PoolGeom("aux", "slots", layers=1, pages=8, dim=8, dtype="int32"),
]


@pytest.fixture(scope="module")
def secured() -> Iterator[tuple[BootstrapServer, Agent, Agent]]:
    srv = BootstrapServer(secret=SECRET).start()
    pf = Agent("prefill", {**FAST, "bootstrap": srv.address}, GEOMS, env={"PDXFER_SECRET": SECRET})
    dc = Agent("decode", {**FAST, "secret": SECRET}, GEOMS)
    yield srv, pf, dc
    pf.close()
    dc.close()
    srv.stop()


def reg(eid: str) -> Registration:
    return Registration(
        instance="x",
        endpoint_id=eid,
        ctrl_addr="tcp://127.0.0.1:1",
        session="127.0.0.1:1",
        signature="s",
    )


@pytest.mark.parametrize(
    "secret,needle",
    [(None, "authentication required"), ("a wrong secret, 16+ bytes", "wrong signature")],
)
def test_bootstrap_refuses_registration_and_lookup_without_the_secret(
    secured, secret: str | None, needle: str
) -> None:
    srv = secured[0]
    c = BootstrapClient(srv.address, secret=secret)
    with pytest.raises(BootstrapError, match=f"401.*{needle}"):
        c.register(reg("intruder"))
    with pytest.raises(BootstrapError, match=f"401.*{needle}"):
        c.route(1)
    with pytest.raises(BootstrapError, match="401"):
        c.deregister("anything")
    req = urllib.request.Request(f"http://{srv.address}/instances")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 401 and "authentication" in json.loads(e.value.read())["error"]
    assert c.health()  # /health stays open for liveness probes


def test_bootstrap_accepts_the_right_secret(secured) -> None:
    c = BootstrapClient(secured[0].address, secret=SECRET)
    assert c.route(1)["endpoints"][0]["tp_rank"] == 0


def test_authorised_pair_transfers_every_byte(secured) -> None:
    srv, pf, dc = secured
    f = Factory(GEOMS, GEOMS, seed=1)
    reqs = [f.make(100, chunks=2), f.make(33)]
    out = run(pf, dc, srv.address, reqs)
    assert all(o["state"] == "Success" for o in out.values()), out
    assert all(v[0] == 0 for v in verify(dc, reqs).values())


def test_decode_without_the_secret_is_refused_with_a_clear_error(secured) -> None:
    srv, _, dc = secured
    dc.call("add_endpoint", name="nosecret", role="decode", config=dict(FAST), geoms=GEOMS)
    dc.call(
        "recv",
        items=[{"room": 5, "dst": {"kv": [1]}, "slots": {"aux": 1}}],
        bootstrap=srv.address,
        ep="nosecret",
    )
    out = dc.call("wait", rooms=[5], ep="nosecret", timeout=10)[5]
    assert out["state"] == "Failed" and out["kind"] == "bootstrap"
    assert "authentication required" in out["failure"]
    dc.call("close_endpoint", name="nosecret")


@pytest.mark.parametrize(
    "mode,key,reason",
    [
        (wire.PLAIN, None, "unsigned"),
        (wire.HELLO, b"k" * 32, "bad_mac"),
    ],
)
def test_prefill_drops_a_hello_without_a_valid_mac_unanswered_and_counted(
    secured, mode: int, key: bytes | None, reason: str
) -> None:
    _, pf, _ = secured
    with context() as ctx:
        pull = ctx.socket(zmq.PULL)
        addr = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
        push = ctx.socket(zmq.PUSH)
        push.connect(pf.info["ctrl_addr"])
        before = pf.call("metrics")
        hello = wire.Hello(
            endpoint_id="intruder",
            ctrl_addr=addr,
            session="127.0.0.1:1",
            tp_rank=0,
            tp_size=1,
            signature=layout_signature([]),
            pools=(),
        )
        push.send(wire.frame(wire.payload(hello), wire.Hello, mode, b"n" * 16, 0, key))
        key_ = f"rejected_{reason}"
        end = time.monotonic() + 30
        while pf.call("metrics").get(key_, 0) == before.get(key_, 0):  # handled: counted
            assert time.monotonic() < end, f"the Hello was never counted as {key_}"
            time.sleep(0.05)
        after = pf.call("metrics")
        assert after[key_] == before.get(key_, 0) + 1
        assert after["table_peers"] == before["table_peers"]
        assert after["table_push_sockets"] == before["table_push_sockets"]  # none to answer on
        # dropped where it was counted: nothing about the prefill is disclosed, not even a
        # refusal (there is no later answer to order one behind: nothing answers an intruder)
        assert not pull.poll(0)


def test_metrics_are_prometheus_text_with_failures_by_kind_and_phases(secured) -> None:
    srv, pf, dc = secured
    f = Factory(GEOMS, GEOMS, seed=9)
    ok = f.make(20)
    assert run(pf, dc, srv.address, [ok])[ok["room"]]["state"] == "Success"
    dc.call(
        "recv",
        items=[{"room": 6, "dst": {"kv": [9]}, "slots": {"aux": 2}}],
        bootstrap="127.0.0.1:1",
    )  # nothing listens there
    assert dc.call("wait", rooms=[6], timeout=15)[6]["kind"] == "bootstrap"
    text = dc.call("prometheus")
    assert "pdxfer_endpoint_success_total{" in text
    assert "pdxfer_endpoint_request_phase_seconds_bucket{" in text and 'phase="transfer"' in text
    assert "pdxfer_endpoint_failures_total{" in text and 'kind="bootstrap"' in text
    assert "pdxfer_endpoint_quarantined_pages{" in text
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["pdxfer_endpoint_success"].samples[0].value >= 1
    req = urllib.request.Request(f"http://{srv.address}/metrics")
    with pytest.raises(urllib.error.HTTPError):  # metrics need the secret too
        urllib.request.urlopen(req, timeout=5)
