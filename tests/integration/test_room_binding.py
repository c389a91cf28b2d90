"""A room serves one decode group by default.

A secured prefill and decode endpoints of several groups in real processes (real bootstrap,
Mooncake TCP, ZMQ): a decode that holds the secret and knows another decode's room id is
refused and gets no byte, whether it asks before the room's sender exists (its request is
parked) or while the room is being written; the owner's bytes land exactly. The TP ranks of one
group share the room without ``sender(room, peer=...)``, and ``EndpointConfig.fan_out`` serves
one room to two groups when the engine wants that.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from pdxfer import BootstrapServer
from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent

from .conftest import FAST
from .helpers import Factory, decode_items, prefill_items
from .hetero import rank_geoms

SECRET = "room binding tests' secret, 16+ bytes"
GEOMS = [
    PoolGeom("kv", "mha", layers=2, pages=256, page_size=16, heads=2, head_dim=16),
    PoolGeom("aux", "slots", layers=1, pages=64, dim=8, dtype="int32"),
]
ONE = rank_geoms(GEOMS, 1, 0)
CONF = {**FAST, "secret": SECRET}


class Env:
    def __init__(self) -> None:
        self.srv = BootstrapServer(secret=SECRET).start()
        b = self.srv.address
        self.pf = self.dc = None
        self.pf = Agent("prefill", {**CONF, "bootstrap": b, "instance": "pf"}, ONE)
        self.pf.call(
            "add_endpoint",
            name="fan",
            role="prefill",
            geoms=ONE,
            config={**CONF, "bootstrap": b, "instance": "pfan", "fan_out": True},
        )
        self.dc = Agent("decode", {**CONF, "instance": "dec-a"}, ONE)
        decodes: dict[str, tuple[dict[str, Any], list[PoolGeom]]] = {
            "b": ({"instance": "dec-b"}, ONE),
            "x": ({}, ONE),
            "y": ({}, ONE),  # two decodes both left at the default instance
            **{
                f"{g}:{r}": ({"tp_rank": r, "tp_size": 2}, rank_geoms(GEOMS, 2, r))
                for g in "tu"
                for r in (0, 1)
            },
        }
        for name, (conf, geoms) in decodes.items():
            self.dc.call(
                "add_endpoint", name=name, role="decode", config={**CONF, **conf}, geoms=geoms
            )
        self.f = {"main": Factory(ONE, ONE, seed=27), "fan": Factory(ONE, ONE, seed=28)}

    def close(self) -> None:
        for a in (self.pf, self.dc):
            if a is not None:
                a.close()
        self.srv.stop()


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    e = Env()
    try:
        yield e
    finally:
        e.close()


def pf_metric(env: Env, name: str, ep: str = "main") -> int:
    return int(env.pf.call("metrics", ep=ep).get(name, 0))


def wait_for(cond: Any, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def ask(env: Env, r: dict[str, Any], ep: str, instance: str = "pf") -> None:
    env.dc.call("sentinel", ep=ep)
    env.dc.call(
        "recv", items=decode_items([r]), bootstrap=env.srv.address, ep=ep, instance=instance
    )


def parked_in_order(
    env: Env, r: dict[str, Any], eps: list[str], pf_ep: str = "main", instance: str = "pf"
) -> None:
    """Each decode's request reaches the prefill (and waits for the room's sender) before the
    next one asks, then the prefill sends: the first asker is the first attached."""
    base = pf_metric(env, "pending_requests", pf_ep)
    for i, ep in enumerate(eps):
        ask(env, r, ep, instance)
        wait_for(lambda i=i: pf_metric(env, "pending_requests", pf_ep) >= base + i + 1)
    prep, send = prefill_items([r])
    env.pf.call("prepare", items=prep, ep=pf_ep)
    env.pf.call("send", items=send, ep=pf_ep)


def outcome(env: Env, r: dict[str, Any], ep: str) -> dict[str, Any]:
    return env.dc.call("wait", rooms=[r["room"]], ep=ep, timeout=30)[r["room"]]


def exact(env: Env, r: dict[str, Any], ep: str) -> None:
    out = outcome(env, r, ep)
    assert out["state"] == "Success", out
    bad = env.dc.call("verify", items=decode_items([r]), ep=ep)[r["room"]]
    assert bad[0] == 0, bad


def refused(env: Env, r: dict[str, Any], ep: str) -> None:
    out = outcome(env, r, ep)
    assert out["state"] == "Failed" and out["kind"] == "protocol", out
    assert "bound to the decode group that asked first" in out["failure"], out
    assert env.dc.call("untouched", exclude={}, ep=ep) == 0  # not one byte landed


@pytest.mark.parametrize(
    "owner,other", [("main", "b"), ("x", "y")], ids=["other_instance", "same_default_instance"]
)
@pytest.mark.parametrize("when", ["parked", "live"])
def test_a_second_decode_group_is_refused_the_room_and_gets_no_byte(
    env: Env, owner: str, other: str, when: str
) -> None:
    r = env.f["main"].make(100, chunks=3)
    before = pf_metric(env, "rejected_not_bound")
    if when == "parked":
        parked_in_order(env, r, [owner, other])
    else:  # the owner's transfer is running when the other decode asks
        prep, send = prefill_items([dict(r, delay_s=0.4)])
        env.pf.call("prepare", items=prep)
        env.pf.call("send", items=send)
        ask(env, r, owner)
        wait_for(
            lambda: (
                env.pf.call("ext", fn="tests.harness.attack:states", rooms=[r["room"]])[r["room"]]
                != "Bootstrapping"
            )
        )
        ask(env, r, other)
    refused(env, r, other)
    exact(env, r, owner)
    assert pf_metric(env, "rejected_not_bound") == before + 1


def test_tp_ranks_of_one_decode_group_share_a_room_and_another_groups_rank_is_refused(
    env: Env,
) -> None:
    """TP 1 -> 2 unbound: both ranks of group t ask prefill rank 0 and land their heads;
    rank 0 of group u (same default instance, same TP size) asks too and is refused."""
    r = env.f["main"].make(130, chunks=2)
    parked_in_order(env, r, ["t:0", "t:1", "u:0"])
    refused(env, r, "u:0")
    for ep in ("t:0", "t:1"):
        exact(env, r, ep)


def test_fan_out_serves_one_room_to_two_decode_groups_when_set(env: Env) -> None:
    r = env.f["fan"].make(90, chunks=2)
    before = pf_metric(env, "rejected_not_bound", "fan")
    parked_in_order(env, r, ["main", "b"], pf_ep="fan", instance="pfan")
    for ep in ("main", "b"):
        exact(env, r, ep)
    assert pf_metric(env, "rejected_not_bound", "fan") == before
