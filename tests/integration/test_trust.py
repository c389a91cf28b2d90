"""With a shared secret, no frame from a third party changes any state.

A prefill and a decode run in their own processes with the secret; the attacker is this test
process, sending raw ZMQ frames to their control ports. Each test asserts that the attack left
the rooms' states alone and corrupted no byte, and that the next legitimate request still
lands byte-exact.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest

from pdxfer import BootstrapClient, BootstrapServer
from pdxfer.agents import patterns as pat
from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent
from pdxfer.bootstrap import Registration
from pdxfer.pools import layout_signature

from . import attack as A
from .conftest import FAST
from .helpers import Factory, decode_items, prefill_items, run, verify

SECRET = "trust tests' shared secret, 16+ bytes"
PAGES, SLOTS = 192, 64
GEOMS = [
    PoolGeom("kv", "mha", layers=2, pages=PAGES, page_size=16, heads=2, head_dim=16),
    PoolGeom("aux", "slots", layers=1, pages=SLOTS, dim=8, dtype="int32"),
]


class Cluster:
    def __init__(self) -> None:
        self.srv = BootstrapServer(secret=SECRET).start()
        self.ghosts = BootstrapServer(secret=SECRET).start()
        """Routes to 'prefill endpoints' that are the attacker's sockets: what a man in the
        middle sees when the real prefill has not answered yet."""
        self.pf = Agent(
            "prefill",
            {**FAST, "bootstrap": self.srv.address, "instance": "pf", "secret": SECRET},
            GEOMS,
        )
        self.dc = Agent("decode", {**FAST, "secret": SECRET, "instance": "dec-a"}, GEOMS)
        self.raw = A.Raw()
        self.f = Factory(GEOMS, GEOMS, seed=13)
        specs, _ = pat.build(GEOMS)
        self.signature = layout_signature(specs)

    def ghost(self) -> tuple[str, str]:
        """A route (instance, endpoint id) whose prefill control address is the attacker's."""
        inst, eid = "ghost-" + A.rand_id(), "ghost-" + A.rand_id()
        BootstrapClient(self.ghosts.address, secret=SECRET).register(
            Registration(
                instance=inst,
                endpoint_id=eid,
                ctrl_addr=self.raw.addr,
                session="127.0.0.1:1",
                signature=self.signature,
            )
        )
        return inst, eid

    def ok(self, n: int = 40) -> dict:
        """One legitimate request, checked byte-exact."""
        r = self.f.make(n)
        out = run(self.pf, self.dc, self.srv.address, [r])
        assert out[r["room"]]["state"] == "Success", out
        assert verify(self.dc, [r])[r["room"]][0] == 0
        return r

    def close(self) -> None:
        self.raw.close()
        self.pf.close()
        self.dc.close()
        self.srv.stop()
        self.ghosts.stop()


@pytest.fixture(scope="module")
def c() -> Iterator[Cluster]:
    cl = Cluster()
    cl.dc.call("sentinel")
    yield cl
    cl.close()


def now(agent: Agent, room: int, ep: str = "main") -> str:
    return str(agent.call("ext", fn="tests.harness.attack:states", rooms=[room], ep=ep)[room])


def rejected(agent: Agent) -> int:
    """Control messages ``agent`` refused, whatever the reason (``rejected_*``)."""
    return sum(v for k, v in agent.call("metrics").items() if k.startswith("rejected_"))


def metric(agent: Agent, name: str, ep: str = "main") -> int:
    return int(agent.call("metrics", ep=ep).get(name, 0))


def test_unsigned_request_naming_a_real_decode_cannot_write_a_live_room_into_its_pages(
    c: Cluster,
) -> None:
    """An unsigned request that names a real decode cannot make the prefill write a live
    room into that decode's pages."""
    done = c.ok()
    victim = c.f.make(40)
    prep, send = prefill_items([victim])
    c.pf.call("prepare", items=prep)
    c.pf.call("send", items=send)  # a live room, waiting for its decode's request
    before = metric(c.pf, "rejected_unsigned")
    c.raw.send(
        c.pf.info["ctrl_addr"],
        A.plain(
            {
                "type": "TransferRequest",
                "room": victim["room"],
                "nonce": 1,
                "endpoint_id": c.dc.info["endpoint_id"],
                "reply_to": c.dc.info["ctrl_addr"],
                "dst": {"kv": A.wire.pack_indices(done["dst"]["kv"])},
                "slots": done["dst_slots"],
                "prefix_len": 0,
                "num_tokens": 40,
            }
        ),
    )
    # the forged request was handled (refused): waiting on that, not a fixed sleep, means
    # it was read before the room is looked at, however slow the machine
    assert A.wait_for(lambda: metric(c.pf, "rejected_unsigned") >= before + 1, 60)
    assert now(c.pf, victim["room"]) == "Bootstrapping"
    assert verify(c.dc, [done])[done["room"]][0] == 0  # the finished room's pages are intact
    assert metric(c.pf, "rejected_unsigned") == before + 1
    c.dc.call("recv", items=decode_items([victim]), bootstrap=c.srv.address)
    assert (
        c.dc.call("wait", rooms=[victim["room"]], timeout=20)[victim["room"]]["state"] == "Success"
    )
    assert verify(c.dc, [victim])[victim["room"]][0] == 0


def test_forged_hello_ack_cannot_get_a_live_prefill_declared_dead(c: Cluster) -> None:
    """An ack naming another transport session for an established peer."""
    c.ok()
    r = c.f.make(64, chunks=2)
    r["delay_s"] = 1.5  # the room waits on the prefill while the heartbeat probes it
    prep, send = prefill_items([r])
    c.pf.call("prepare", items=prep)
    c.dc.call("recv", items=decode_items([r]), bootstrap=c.srv.address)
    c.pf.call("send", items=send)
    lost = metric(c.dc, "peers_lost") + metric(c.dc, "peers_hung")
    refused = metric(c.dc, "rejected_unsigned")
    sessions = c.dc.call("ext", fn="tests.harness.attack:peer_sessions")
    ack = {
        "type": "HelloAck",
        "endpoint_id": c.pf.info["endpoint_id"],
        "ok": True,
        "session": "127.0.0.1:1",
        "tp_rank": 0,
        "tp_size": 1,
        "pools": [],
    }
    for _ in range(3):
        c.raw.send(c.dc.info["ctrl_addr"], A.plain(ack))
    assert A.wait_for(lambda: metric(c.dc, "rejected_unsigned") >= refused + 3, 60)
    out = c.dc.call("wait", rooms=[r["room"]], timeout=20)[r["room"]]
    assert out["state"] == "Success", out
    assert verify(c.dc, [r])[r["room"]][0] == 0
    assert metric(c.dc, "peers_lost") + metric(c.dc, "peers_hung") == lost
    assert c.dc.call("ext", fn="tests.harness.attack:peer_sessions") == sessions


@pytest.mark.parametrize("secured", [True, False])
def test_forged_empty_hello_ack_never_gives_success_and_is_not_cached(
    c: Cluster, secured: bool
) -> None:
    """The attacker answers the Hello first with ``ok=True`` and no pools. With
    the secret the ack is refused; without it, the empty pairing is a LayoutMismatch."""
    ep, boot, ctrl = "main", c.ghosts, c.dc.info["ctrl_addr"]
    if not secured:
        ep, boot = "open", BootstrapServer().start()
        ctrl = c.dc.call(
            "add_endpoint",
            name=ep,
            role="decode",
            config={**FAST, "bootstrap_timeout_s": 3.0},
            geoms=GEOMS,
        )["ctrl_addr"]
    try:
        if secured:
            inst, eid = c.ghost()
        else:
            inst, eid = "ghost-open", "ghost-" + A.rand_id()
            BootstrapClient(boot.address).register(
                Registration(
                    instance=inst,
                    endpoint_id=eid,
                    ctrl_addr=c.raw.addr,
                    session="127.0.0.1:1",
                    signature=c.signature,
                )
            )
        c.raw.drain()
        for i in range(3):
            r = c.f.make(32)
            c.dc.call("recv", items=decode_items([r]), bootstrap=boot.address, instance=inst, ep=ep)
            if i == 0:  # later rooms reuse the (refused or empty) handshake
                hello = c.raw.recv()
                c.raw.send(
                    ctrl,
                    A.answer(
                        hello,
                        {
                            "type": "HelloAck",
                            "endpoint_id": eid,
                            "ok": True,
                            "session": "127.0.0.1:1",
                            "pools": [],
                        },
                    ),
                )
            out = c.dc.call("wait", rooms=[r["room"]], ep=ep, timeout=20)[r["room"]]
            assert out["state"] == "Failed", out
            assert out["kind"] == ("deadline" if secured else "layout_mismatch"), out
    finally:
        if not secured:
            c.dc.call("close_endpoint", name=ep)
            boot.stop()


def test_replayed_or_shifted_hello_is_refused_and_the_next_request_lands_right(c: Cluster) -> None:
    """A captured signed Hello, replayed as is and with its buffer addresses
    shifted by one page, to the prefill the decode is paired with."""
    c.ok()
    inst, _ = c.ghost()
    c.raw.drain()
    bait = c.f.make(16)
    c.dc.call("recv", items=decode_items([bait]), bootstrap=c.ghosts.address, instance=inst)
    hello = c.raw.recv()
    raw = msgspec.msgpack.decode(A.payload(hello))
    for pool in raw["pools"]:
        if pool["name"] == "kv":
            for b in pool["buffers"]:
                b["addr"] += pool["item_bytes"]
    shifted = A.reframe(hello, msgspec.msgpack.encode(raw))
    refused = rejected(c.pf)
    for frame in (hello, shifted):  # the shifted one last: it is the one that would stick
        c.raw.send(c.pf.info["ctrl_addr"], frame)
    # both were handled (refused) before the next request: a fixed sleep could end first
    assert A.wait_for(lambda: rejected(c.pf) >= refused + 2, 60), "a replayed Hello was taken"
    r = c.ok(48)
    bad = c.dc.call("untouched", exclude={"kv": _all_dst(c), "aux": list(range(SLOTS))})
    assert bad == 0, "a write landed outside the requested pages"
    assert verify(c.dc, [r])[r["room"]][0] == 0
    c.dc.call("wait", rooms=[bait["room"]], timeout=20)


def _all_dst(c: Cluster) -> list[int]:
    """Every decode page handed out so far (the others must still hold the sentinel)."""
    return sorted(set(range(PAGES)) - set(c.f.dst["kv"].free))


def test_forged_transfer_done_cannot_make_the_decode_report_success_early(c: Cluster) -> None:
    """A TransferDone with the nonce read off the wire, before the bytes landed."""
    c.ok()
    r = c.f.make(64, chunks=2)
    r["delay_s"] = 5.0  # the real last chunk: well after the forgery was handled
    prep, send = prefill_items([r])
    c.pf.call("prepare", items=prep)
    c.dc.call("recv", items=decode_items([r]), bootstrap=c.srv.address)
    assert A.wait_for(
        lambda: c.dc.call("ext", fn="tests.harness.attack:room_nonce", room=r["room"]) != 0
    )
    nonce = c.dc.call("ext", fn="tests.harness.attack:room_nonce", room=r["room"])
    refused = metric(c.dc, "rejected_unsigned")
    c.pf.call("send", items=send)
    c.raw.send(
        c.dc.info["ctrl_addr"],
        A.plain(
            {
                "type": "TransferDone",
                "room": r["room"],
                "nonce": nonce,
                "endpoint_id": c.pf.info["endpoint_id"],
                "rank": 0,
                "ok": True,
                "bytes": 1 << 20,
            }
        ),
    )
    # the forgery was handled (a fixed sleep could end before it was read on a slow machine)
    assert A.wait_for(lambda: metric(c.dc, "rejected_unsigned") >= refused + 1, 60)
    assert now(c.dc, r["room"]) != "Success"
    out = c.dc.call("wait", rooms=[r["room"]], timeout=20)[r["room"]]
    assert out["state"] == "Success", out
    assert verify(c.dc, [r])[r["room"]][0] == 0


def test_unsigned_abort_before_a_room_exists_does_not_fail_it_later(c: Cluster) -> None:
    """An unsigned Abort for a room the prefill does not hold yet does not fail that room
    once it opens."""
    c.ok()
    r = c.f.make(40)
    ear = A.Raw()
    refused = metric(c.pf, "rejected_unsigned")
    try:
        for nonce in range(4):
            c.raw.send(
                c.pf.info["ctrl_addr"],
                A.plain(
                    {
                        "type": "Abort",
                        "room": r["room"],
                        "nonce": nonce,
                        "reason": "forged",
                        "endpoint_id": c.dc.info["endpoint_id"],
                        "reply_to": ear.addr,
                    }
                ),
            )
        # all four were handled before the room exists (a fixed sleep could end first)
        assert A.wait_for(lambda: metric(c.pf, "rejected_unsigned") >= refused + 4, 60)
        out = run(c.pf, c.dc, c.srv.address, [r], decode_first=True)
        assert out[r["room"]]["state"] == "Success", out
        assert verify(c.dc, [r])[r["room"]][0] == 0
        assert not ear.pull.poll(100)  # and nothing was answered to the attacker
    finally:
        ear.close()


def test_room_bound_to_one_decode_is_refused_to_another_decode_with_the_secret(c: Cluster) -> None:
    """A second decode holding the secret asks for the first one's room."""
    c.ok()
    c.dc.call(
        "add_endpoint",
        name="thief",
        role="decode",
        config={**FAST, "secret": SECRET, "instance": "dec-b"},
        geoms=GEOMS,
    )
    c.dc.call("sentinel", ep="thief")
    try:
        r = c.f.make(40)
        prep, send = prefill_items([r])
        send[0]["peer"] = "dec-a"
        c.pf.call("prepare", items=prep)
        c.pf.call("send", items=send)
        c.dc.call("recv", items=decode_items([r]), bootstrap=c.srv.address, ep="thief")
        stolen = c.dc.call("wait", rooms=[r["room"]], ep="thief", timeout=20)[r["room"]]
        assert stolen["state"] == "Failed" and "bound" in stolen["failure"], stolen
        assert c.dc.call("untouched", exclude={}, ep="thief") == 0
        c.dc.call("recv", items=decode_items([r]), bootstrap=c.srv.address)
        out = c.dc.call("wait", rooms=[r["room"]], timeout=20)[r["room"]]
        assert out["state"] == "Success", out
        assert verify(c.dc, [r])[r["room"]][0] == 0
    finally:
        c.dc.call("close_endpoint", name="thief")


@pytest.mark.parametrize("target", ["pf", "dc"])
def test_oversized_unsigned_hellos_and_acks_are_dropped_undecoded_without_memory_growth(
    c: Cluster, target: str
) -> None:
    """Unsigned 2 MB and 20 MB Hellos (HelloAcks to a decode) are refused on
    their header, before their payload is decoded."""
    c.ok()
    agent = c.pf if target == "pf" else c.dc
    kind = "Hello" if target == "pf" else "HelloAck"
    rss0 = agent.call("proc_stats")["rss"]
    before = metric(agent, "rejected_oversized")
    big = {
        "type": kind,
        "endpoint_id": "x" * (2 << 20),
        "ctrl_addr": c.raw.addr,
        "ok": True,
        "session": "127.0.0.1:1",
        "tp_rank": 0,
        "tp_size": 1,
        "signature": "s",
        "pools": [],
    }
    two_mb = A.plain(big)
    big["endpoint_id"] = "x" * (20 << 20)
    twenty_mb = A.plain(big)
    for _ in range(12):
        c.raw.send(agent.info["ctrl_addr"], two_mb)
    flood = A.Raw()  # 20 MB is past the socket's message cap: it drops the connection
    try:
        for _ in range(12):
            flood.send(agent.info["ctrl_addr"], twenty_mb)
        time.sleep(1.0)
    finally:
        flood.close()
    assert A.wait_for(lambda: metric(agent, "rejected_oversized") >= before + 12, 20)
    c.ok()
    grew = agent.call("proc_stats")["rss"] - rss0
    assert grew < 64 << 20, f"RSS grew by {grew >> 20} MB"
