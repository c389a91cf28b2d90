"""The prefill process is killed in the middle of a large transfer."""

from __future__ import annotations

import time

import pytest

from pdxfer import BootstrapServer
from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent

from .conftest import FAST, start_pair
from .helpers import Factory, decode_items, prefill_items, run, verify, wait_written

# 8 layers x K,V x 16 tokens x 8 heads x 128 dims x fp16 = 512 KiB per page across buffers
GEOMS = [
    PoolGeom("kv", "mha", layers=8, pages=384, page_size=16, heads=8, head_dim=128),
    PoolGeom("aux", "slots", layers=1, pages=8, dim=16, dtype="int32"),
]


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_prefill_killed_mid_transfer_fails_fast_releases_pages_and_a_new_prefill_serves(
    bootstrap: BootstrapServer, transport: str
) -> None:
    pf, dc = start_pair(bootstrap, GEOMS, transport=transport)
    pf2 = None
    try:
        dc.call("sentinel")
        f = Factory(GEOMS, GEOMS, seed=3)
        big = f.make(16 * 300, chunks=30)  # 150 MiB in 30 chunks, sent slowly
        big["delay_s"] = 0.1
        prep, send = prefill_items([big])
        pf.call("prepare", items=prep)
        dc.call("recv", items=decode_items([big]), bootstrap=bootstrap.address)
        pf.call("send", items=send)
        deadline = FAST["transfer_timeout_s"]
        wait_written(pf)  # its first chunks landed; the rest take 0.1 s each
        t_kill = time.monotonic()
        pf.kill()
        out = dc.call("wait", rooms=[big["room"]], timeout=deadline + 5)[big["room"]]
        waited = time.monotonic() - t_kill
        assert out["state"] == "Failed", out
        assert out["kind"] in ("peer_lost", "deadline"), out
        assert "stopped answering" in out["failure"] or "deadline" in out["failure"]
        assert waited < deadline, f"decode waited {waited:.1f} s for a dead prefill"
        # fail-closed pages: released (the writer is dead) and never reused before that
        t0 = time.monotonic()
        while big["room"] not in dc.call("released") and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        assert big["room"] in dc.call("released")
        assert dc.call("tables") == {"rooms": 0}
        assert dc.call("metrics")["quarantined_pages"] == 0

        # a request the bootstrap still routes to the dead prefill (its registration outlived
        # it) fails as lost: the unanswered Hello found its port refusing, and nobody waited
        # for the dead until the deadline (the failure's kind says which, whatever the speed)
        # (two at once: the one waiting on the other's handshake learns it as well)
        ghosts = [f.make(16 * 4), f.make(16 * 4)]
        dc.call("recv", items=decode_items(ghosts), bootstrap=bootstrap.address)
        outs = dc.call(
            "wait", rooms=[g["room"] for g in ghosts], timeout=FAST["bootstrap_timeout_s"] + 5
        )
        for out in outs.values():
            assert out["state"] == "Failed" and out["kind"] == "peer_lost", outs

        # a new prefill process registers in the dead one's place and serves the next request
        pf2 = Agent(
            "prefill", {**FAST, "bootstrap": bootstrap.address, "transport": transport}, GEOMS
        )
        small = f.make(16 * 20, chunks=3)
        res = run(pf2, dc, bootstrap.address, [small], timeout=20)
        assert res[small["room"]]["state"] == "Success", res
        assert verify(dc, [small])[small["room"]][0] == 0
    finally:
        for a in (pf, dc, pf2):
            if a is not None:
                a.close()


def freeze_mid_transfer(pf: Agent, dc: Agent, f: Factory, bootstrap: str, instance: str) -> dict:
    """Start one big request (20 chunks, 0.1 s each) and SIGSTOP the prefill once it has
    written some of it: the decode's room is then mid-transfer with a frozen prefill."""
    import os
    import signal

    dc.call("sentinel")
    big = f.make(16 * 200, chunks=20)
    big["delay_s"] = 0.1
    prep, send = prefill_items([big])
    pf.call("prepare", items=prep)
    dc.call("recv", items=decode_items([big]), bootstrap=bootstrap, instance=instance)
    pf.call("send", items=send)
    wait_written(pf)  # mid-transfer: the rest of its 20 chunks take 0.1 s each
    os.kill(pf.pid, signal.SIGSTOP)
    return big


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_frozen_prefill_fails_requests_but_keeps_pages_until_it_acknowledges(
    bootstrap: BootstrapServer, transport: str
) -> None:
    """SIGSTOP the prefill mid-transfer: a frozen writer may wake up and write, so its
    requests fail but their pages stay quarantined until it acknowledges; after SIGCONT the
    pages come back and the same prefill serves new requests without any restart."""
    import os
    import signal

    pf, dc = start_pair(bootstrap, GEOMS, instance=f"frozen-{transport}", transport=transport)
    try:
        f = Factory(GEOMS, GEOMS, seed=4)
        big = freeze_mid_transfer(pf, dc, f, bootstrap.address, f"frozen-{transport}")
        try:
            out = dc.call("wait", rooms=[big["room"]], timeout=FAST["transfer_timeout_s"] + 5)
            assert out[big["room"]]["state"] == "Failed", out
            assert out[big["room"]]["kind"] in ("peer_lost", "deadline"), out
            t0 = time.monotonic()  # quarantine is counted once abort_timeout_s has passed
            while dc.call("metrics")["quarantined_pages"] == 0 and time.monotonic() - t0 < 30:
                time.sleep(0.1)
            assert dc.call("metrics")["quarantined_pages"] > 0
            assert big["room"] not in dc.call("released"), "released while the writer was frozen"
        finally:
            os.kill(pf.pid, signal.SIGCONT)
        t0 = time.monotonic()
        while big["room"] not in dc.call("released") and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        assert dc.call("release_counts").get(big["room"]) == 1
        assert dc.call("metrics")["quarantined_pages"] == 0
        small = f.make(16 * 10, chunks=2)
        prep, send = prefill_items([small])
        pf.call("prepare", items=prep)
        dc.call(
            "recv",
            items=decode_items([small]),
            bootstrap=bootstrap.address,
            instance=f"frozen-{transport}",
        )
        pf.call("send", items=send)
        res = dc.call("wait", rooms=[small["room"]], timeout=20)
        assert res[small["room"]]["state"] == "Success", res
        assert verify(dc, [small])[small["room"]][0] == 0
    finally:
        pf.close()
        dc.close()


def test_frozen_prefill_with_a_secret_releases_pages_after_it_wakes_and_rehandshakes() -> None:
    """The same freeze with a shared secret: the decode drops the hung prefill from its
    peers, yet the answer to its Abort (``AbortAck``, under the old pair's session) must still
    be admitted once the prefill wakes, or the pages stay quarantined for good. A request
    started while it is frozen makes the decode handshake again (a new pair, which replaces
    the old one on the prefill); it lands byte-exact and the old room's pages still come back."""
    import os
    import signal

    secret = "crash tests' shared secret, 16+ bytes"
    srv = BootstrapServer("127.0.0.1", 0, secret=secret).start()
    conf = {**FAST, "secret": secret}
    pf = Agent("prefill", {**conf, "bootstrap": srv.address, "instance": "frozen-s"}, GEOMS)
    dc = Agent("decode", dict(conf), GEOMS)
    try:
        f = Factory(GEOMS, GEOMS, seed=5)
        big = freeze_mid_transfer(pf, dc, f, srv.address, "frozen-s")
        small = f.make(16 * 10, chunks=2)
        try:
            out = dc.call("wait", rooms=[big["room"]], timeout=FAST["transfer_timeout_s"] + 5)
            assert out[big["room"]]["state"] == "Failed", out
            assert out[big["room"]]["kind"] in ("peer_lost", "deadline"), out
            t0 = time.monotonic()
            while dc.call("metrics")["quarantined_pages"] == 0 and time.monotonic() - t0 < 30:
                time.sleep(0.1)
            assert dc.call("metrics")["quarantined_pages"] > 0
            assert big["room"] not in dc.call("released"), "released while the writer was frozen"
            # a new request to the frozen prefill: its Hello waits for the prefill to wake
            dc.call("recv", items=decode_items([small]), bootstrap=srv.address, instance="frozen-s")
        finally:
            os.kill(pf.pid, signal.SIGCONT)
        prep, send = prefill_items([small])
        pf.call("prepare", items=prep)
        pf.call("send", items=send)
        res = dc.call("wait", rooms=[small["room"]], timeout=20)
        assert res[small["room"]]["state"] == "Success", res
        assert verify(dc, [small])[small["room"]][0] == 0
        t0 = time.monotonic()
        while big["room"] not in dc.call("released") and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        assert dc.call("release_counts").get(big["room"]) == 1, "pages still quarantined"
        assert dc.call("metrics")["quarantined_pages"] == 0
        assert dc.call("metrics").get("rejected_unknown_pair", 0) == 0
    finally:
        pf.close()
        dc.close()
        srv.stop()


def test_a_prefill_that_died_idle_and_came_back_serves_the_very_next_request(
    bootstrap: BootstrapServer,
) -> None:
    """A prefill killed while no room waited on it (so no heartbeat watched it), and a new
    process registered under the same instance: the decode's next request, made after its
    route went unconfirmed for ``route_fresh_s``, looks the instance up again and lands
    byte-exact from the new process, never dialling the dead address (``PeerLost``)."""
    small = [PoolGeom("kv", "mha", layers=2, pages=64, page_size=16, heads=2, head_dim=16)]
    pf, dc = start_pair(bootstrap, small, route_fresh_s=1.0)
    pf2 = None
    try:
        f = Factory(small, small, seed=11)
        first = f.make(16 * 3)
        assert run(pf, dc, bootstrap.address, [first])[first["room"]]["state"] == "Success"
        pf.kill()
        pf2 = Agent(
            "prefill", {**FAST, "bootstrap": bootstrap.address, "instance": "default"}, small
        )
        time.sleep(1.5)  # at least route_fresh_s since the last success: a lower bound only
        nxt = f.make(16 * 5)
        out = run(pf2, dc, bootstrap.address, [nxt], timeout=30)[nxt["room"]]
        assert out["state"] == "Success", out
        assert verify(dc, [nxt])[nxt["room"]][0] == 0
    finally:
        for a in (pf, dc, pf2):
            if a is not None:
                a.close()
