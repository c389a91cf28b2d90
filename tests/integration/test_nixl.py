"""The NIXL transport on its own (real agents, UCX on loopback), and paired through pdxfer:
metadata travels in Hello/HelloAck, writes land byte-exact, a write outside the peer's
registration never leaves, a dead peer is ``PeerLost``, and a prefill and a decode on
different transports refuse each other with a message naming both."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pdxfer import BootstrapServer, PeerLost, TransportError
from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent
from pdxfer.transport.nixl import NixlTransport

from .conftest import FAST
from .helpers import SIX_POOLS as GEOMS
from .helpers import Factory, decode_items, prefill_items


@pytest.fixture(scope="module")
def agents() -> Iterator[tuple[NixlTransport, NixlTransport, np.ndarray, np.ndarray]]:
    a, b = NixlTransport(), NixlTransport()
    src = np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8)
    dst = np.zeros(8 << 20, dtype=np.uint8)
    a.register(src.ctypes.data, src.nbytes)
    b.register(dst.ctypes.data, dst.nbytes)
    a.add_peer(b.session_id, b.peer_info())
    yield a, b, src, dst
    a.close()
    b.close()


def test_scattered_blocks_over_several_batches_land_byte_exact(agents) -> None:
    a, b, src, dst = agents
    n = 3 * a.batch_entries // 2 + 7
    perm = np.random.default_rng(1).permutation(n)
    s = (src.ctypes.data + np.arange(n) * 256).astype(np.uint64)
    d = (dst.ctypes.data + perm * 256).astype(np.uint64)
    calls0 = a.stats.calls
    a.write(b.session_id, s, d, np.full(n, 256, dtype=np.uint64))
    assert a.stats.calls - calls0 == 2
    got = dst[: n * 256].reshape(n, 256)
    want = src[: n * 256].reshape(n, 256)
    assert np.array_equal(got[perm], want)


def test_a_started_write_lands(agents) -> None:
    a, b, src, dst = agents
    dst[:4096] = 0
    x = a.start(b.session_id, [src.ctypes.data + 8192], [dst.ctypes.data], [4096])
    assert x is not None
    a.finish(b.session_id, x)
    assert np.array_equal(dst[:4096], src[8192:12288])


def test_a_write_outside_the_peers_registration_never_leaves(agents) -> None:
    a, b, src, dst = agents
    with pytest.raises(TransportError):
        a.write(b.session_id, [src.ctypes.data], [dst.ctypes.data + dst.nbytes], [4096])
    with pytest.raises(TransportError, match="not paired"):
        a.write("nixl-unknown", [src.ctypes.data], [dst.ctypes.data], [16])
    a.write(b.session_id, [src.ctypes.data], [dst.ctypes.data], [16])  # still works


def test_metadata_that_names_another_agent_is_refused(agents) -> None:
    a, b, _, _ = agents
    with pytest.raises(TransportError, match="names agent"):
        a.add_peer("nixl-someone-else", b.peer_info())
    with pytest.raises(TransportError):
        a.add_peer(b.session_id, b"\x00not metadata")


def test_a_peer_naming_impossible_regions_is_refused(agents) -> None:
    """Page sizes come from the network: a region list that would make this side build
    billions of descriptors, or that runs past the end of memory, refuses the pairing."""
    import msgspec

    from pdxfer.transport.nixl import _Info

    a, b, src, dst = agents
    md = msgspec.msgpack.decode(b.peer_info(), type=_Info).md
    for regions in ([(dst.ctypes.data, 1 << 40, 1)], [((1 << 63) - 8, (1 << 63) - 1, 8)]):
        with pytest.raises(TransportError, match="impossible regions"):
            a.add_peer(b.session_id, msgspec.msgpack.encode(_Info(md, regions)))
    # a device per region, or none: a list of another length is not this peer's regions
    two = [(dst.ctypes.data, 4096, 0), (dst.ctypes.data + 4096, 4096, 0)]
    with pytest.raises(TransportError, match="impossible regions"):
        a.add_peer(b.session_id, msgspec.msgpack.encode(_Info(md, two, [0])))
    a.add_peer(b.session_id, b.peer_info())  # the real metadata pairs again
    a.write(b.session_id, [src.ctypes.data], [dst.ctypes.data], [16])


def _target(q: mp.Queue) -> None:  # type: ignore[type-arg]
    import time

    t = NixlTransport()
    buf = np.zeros(1 << 20, dtype=np.uint8)
    t.register(buf.ctypes.data, buf.nbytes)
    q.put((t.session_id, t.peer_info(), buf.ctypes.data))
    time.sleep(120)  # until killed (an Event would hang its setter once this is killed)


def test_a_dead_peer_is_peer_lost_and_probes_false() -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_target, args=(q,), daemon=True)
    p.start()
    a = NixlTransport()
    try:
        session, info, addr = q.get(timeout=60)
        src = np.ones(1 << 20, dtype=np.uint8)
        a.register(src.ctypes.data, src.nbytes)
        a.add_peer(session, info)
        a.write(session, [src.ctypes.data], [addr], [1 << 20])
        assert a.probe(session)
        p.kill()
        p.join(10)
        err = None
        # until the disconnect is noticed (milliseconds), by the clock, not by a count of
        # tries: a fast machine could make any fixed number of writes before it is
        end = time.monotonic() + 30
        while err is None and time.monotonic() < end:
            try:
                a.write(session, [src.ctypes.data], [addr], [4096])
            except TransportError as e:
                err = e
                break
            time.sleep(0.001)
        assert err is not None
        assert isinstance(err, PeerLost), err
        assert not a.probe(session)
    finally:
        if p.is_alive():
            p.kill()
        a.close()


@pytest.fixture(scope="module")
def bootstrap() -> Iterator[BootstrapServer]:
    srv = BootstrapServer("127.0.0.1", 0).start()
    yield srv
    srv.stop()


def test_a_prefill_and_a_decode_on_different_transports_refuse_each_other(bootstrap) -> None:
    pf = Agent(
        "prefill",
        {**FAST, "bootstrap": bootstrap.address, "instance": "mixed", "transport": "nixl"},
        GEOMS,
    )
    dc = None
    try:
        dc = Agent("decode", {**FAST, "transport": "tcp"}, GEOMS)
        f = Factory(GEOMS, GEOMS, seed=9)
        reqs = [f.make(40)]
        prep, send = prefill_items(reqs)
        pf.call("prepare", items=prep)
        dc.call("recv", items=decode_items(reqs), bootstrap=bootstrap.address, instance="mixed")
        pf.call("send", items=send)
        o = dc.call("wait", rooms=[reqs[0]["room"]], timeout=30)[reqs[0]["room"]]
        assert o["state"] == "Failed", o
        assert "transport differs" in o["failure"], o
        assert "'nixl'" in o["failure"] and "'mooncake'" in o["failure"], o
    finally:
        pf.close()
        if dc is not None:
            dc.close()


@pytest.mark.parametrize(("tp_p", "tp_d"), [(2, 1), (1, 2)])
def test_heterogeneous_tp_over_nixl_lands_every_head_once(bootstrap, tp_p, tp_d) -> None:
    """TP 2->1 and 1->2 over NIXL: head slices (NHD, HND through staging, GQA) land exactly,
    and pages outside the requests keep the sentinel."""
    from .hetero import HEAD_POOLS as TP_GEOMS
    from .hetero import add_group, rank_geoms, run_case

    b = bootstrap.address
    nixl = {"transport": "nixl"}
    pf = Agent(
        "prefill",
        {**FAST, **nixl, "bootstrap": b, "instance": f"nx{tp_p}{tp_d}"},
        rank_geoms(TP_GEOMS, 1, 0),
    )
    dc = None
    try:
        dc = Agent("decode", {**FAST, **nixl}, rank_geoms(TP_GEOMS, 1, 0))
        groups = {
            "p": add_group(
                pf,
                "prefill",
                "p",
                tp_p,
                lambda r: rank_geoms(TP_GEOMS, tp_p, r),
                lambda r: {"tp_rank": r, "tp_size": tp_p, **nixl},
                b,
                f"nxg{tp_p}{tp_d}",
            ),
            "d": add_group(
                dc,
                "decode",
                "d",
                tp_d,
                lambda r: rank_geoms(TP_GEOMS, tp_d, r),
                lambda r: {"tp_rank": r, "tp_size": tp_d, **nixl},
            ),
        }
        run_case(groups, b, "p", "d", TP_GEOMS, [(16, 1), (45, 2), (200, 3), (1024, 2)])
    finally:
        pf.close()
        if dc is not None:
            dc.close()


def test_host_landing_over_nixl_remaps_every_token_exactly(bootstrap) -> None:
    """A prefill paging by 16 writes into a token-granular host pool (page size 1,
    ``page_remap``) over NIXL: every token lands in its own slot, checked byte by byte."""
    import dataclasses

    from .hetero import Group, assert_success_and_exact, run_groups

    KV = PoolGeom(
        "kv", "mha", layers=2, pages=512, page_size=16, heads=4, head_dim=16, total_heads=4
    )
    AUX = PoolGeom("aux", "slots", layers=1, pages=256, dim=8, dtype="int32")
    host = dataclasses.replace(KV, page_size=1, pages=8192, page_remap=True)
    nixl = {"transport": "nixl"}
    pf = Agent(
        "prefill", {**FAST, **nixl, "bootstrap": bootstrap.address, "instance": "nxh"}, [KV, AUX]
    )
    dc = None
    try:
        dc = Agent("decode", {**FAST, **nixl}, [host, AUX])
        dc.call("sentinel")
        f = Factory([KV, AUX], [host, AUX], seed=21)
        reqs = [f.make(n, chunks=c) for n, c in ((1, 1), (16, 1), (45, 2), (300, 3))]
        p, d = Group(pf, ["main"], "nxh"), Group(dc, ["main"])
        outs = run_groups(p, d, bootstrap.address, reqs)
        assert_success_and_exact(outs, d.each("verify", items=decode_items(reqs)))
    finally:
        pf.close()
        if dc is not None:
            dc.close()


def test_a_restore_from_l2_with_its_suffix_over_nixl_is_byte_exact(bootstrap) -> None:
    """The decode restores 90% of a prompt from L2 while NIXL brings the suffix: the bytes
    are right and only the suffix crossed the wire."""
    from .tiers_helpers import (
        MODEL,
        SHARED,
        STD,
        Family,
        N,
        X,
        assert_right,
        finish,
        start,
        write_back,
    )

    nixl = {"transport": "nixl"}
    pf = Agent("prefill", {**FAST, **nixl, "bootstrap": bootstrap.address, "instance": "nxr"}, STD)
    dc = None
    try:
        dc = Agent("decode", {**FAST, **nixl}, STD)
        dc.call("ext", fn=X + "setup", host_pages=128, model_id=MODEL)
        fam = Family(STD, seed=31)
        a = fam.make(fam.tokens(N))
        assert start(pf, dc, bootstrap.address, [a], instance="nxr")[a["room"]] == 0
        assert_right(finish(dc, [a]))
        write_back(dc, [a])  # into L2 (no L3 here)
        b = fam.child(a, SHARED, N)
        before = int(pf.call("ext", fn=X + "transport_bytes"))
        assert start(pf, dc, bootstrap.address, [b], instance="nxr")[b["room"]] == SHARED
        res = finish(dc, [b])
        assert_right(res)
        moved = int(pf.call("ext", fn=X + "transport_bytes")) - before
        suffix = int(dc.call("ext", fn=X + "suffix_bytes", start=SHARED, end=N, slots=["aux"]))
        assert moved == suffix, (moved, suffix)
    finally:
        pf.close()
        if dc is not None:
            dc.close()


def test_whole_pages_go_through_prepared_lists_and_the_rest_per_call() -> None:
    """Buffers registered with their page size get page descriptors prepared once per peer:
    whole-page blocks are written by index, a sub-page block in the same write is described
    per call, and every byte lands where it should."""
    item = 4096
    a, b = NixlTransport(), NixlTransport()
    try:
        src = np.random.default_rng(5).integers(0, 255, 64 * item, dtype=np.uint8)
        dst = np.zeros(64 * item, dtype=np.uint8)
        a.register(src.ctypes.data, src.nbytes, "cpu", item)
        b.register(dst.ctypes.data, dst.nbytes, "cpu", item)
        a.add_peer(b.session_id, b.peer_info())
        s0, d0 = src.ctypes.data, dst.ctypes.data
        # pages 3..5 -> 40..42 (a run), page 9 -> 7, and half a page 11 -> 20 (sub-page)
        a.write(
            b.session_id,
            [s0 + 3 * item, s0 + 9 * item, s0 + 11 * item],
            [d0 + 40 * item, d0 + 7 * item, d0 + 20 * item],
            [3 * item, item, item // 2],
        )
        assert a.stats_prepped == 4  # 3 + 1 page descriptors by index
        pg = src.reshape(64, item)
        got = dst.reshape(64, item)
        assert np.array_equal(got[40:43], pg[3:6]) and np.array_equal(got[7], pg[9])
        assert np.array_equal(got[20, : item // 2], pg[11, : item // 2])
        assert not got[20, item // 2 :].any() and not got[0].any()
    finally:
        a.close()
        b.close()


def test_a_hello_never_asks_the_agent_for_its_metadata_and_it_stays_current() -> None:
    """A Hello or HelloAck carries ``peer_info``: NIXL's metadata call keeps the GIL while
    it waits for a write in flight, stopping every thread of the process, so the bytes are
    taken when the registrations change and reused (retransmitted Hellos included). What a
    peer gets still names every region registered so far: its writes land in a region
    registered after the first Hello."""
    a, b, c = NixlTransport(), NixlTransport(), NixlTransport()
    try:
        src = np.random.default_rng(6).integers(0, 255, 1 << 16, dtype=np.uint8)
        dst1, dst2 = np.zeros(1 << 16, dtype=np.uint8), np.zeros(1 << 16, dtype=np.uint8)
        a.register(src.ctypes.data, src.nbytes)
        b.register(dst1.ctypes.data, dst1.nbytes)
        first = b.peer_info()
        agent, asked = b._agent, []
        real = agent.get_agent_metadata
        agent.get_agent_metadata = lambda: asked.append(1) or real()
        assert [b.peer_info() for _ in range(5)] == [first] * 5 and not asked
        b.register(dst2.ctypes.data, dst2.nbytes)  # described again, once, here
        assert len(asked) == 1
        info = b.peer_info()
        assert info != first and len(asked) == 1
        a.add_peer(b.session_id, info)
        a.write(b.session_id, [src.ctypes.data], [dst2.ctypes.data], [src.nbytes])
        assert np.array_equal(dst2, src)
        c.add_peer(b.session_id, b.peer_info())  # a second peer, the same bytes
        c.register(src.ctypes.data, src.nbytes)
        c.write(b.session_id, [src.ctypes.data], [dst1.ctypes.data], [src.nbytes])
        assert np.array_equal(dst1, src) and len(asked) == 1
    finally:
        for t in (a, b, c):
            t.close()


def test_a_peers_probes_do_not_pile_up_in_the_inbox(agents) -> None:
    """Nothing reads NIXL notifications but the probe: each probe empties its own agent's
    inbox of the probes its peer sent, so a long-held room's heartbeat grows no memory."""
    a, b, _, _ = agents
    before = b.notifs_dropped
    for _ in range(20):
        assert a.probe(b.session_id)
    end = time.monotonic() + 30.0  # a bound on the wait for the event, not a stopwatch
    while b.notifs_dropped - before < 20 and time.monotonic() < end:
        b.probe(a.session_id)
        time.sleep(0.01)
    assert b.notifs_dropped - before == 20


@pytest.mark.parametrize("threads", ["2", "1"])
def test_a_write_split_across_ucx_threads_lands_byte_exact(bootstrap, threads) -> None:
    """``PDXFER_NIXL_THREADS``: a chunk of at least ``SPLIT_ENTRIES`` blocks is copied by
    that many UCX threads (``1``: the posting thread alone, as before); every byte lands."""
    inst = f"split{threads}"
    pf = Agent(
        "prefill",
        {**FAST, "bootstrap": bootstrap.address, "instance": inst, "transport": "nixl"},
        GEOMS,
        env={"PDXFER_NIXL_THREADS": threads},
    )
    dc = None
    try:
        dc = Agent("decode", {**FAST, "transport": "nixl"}, GEOMS)
        got = pf.call("ext", fn="tests.harness.transport_cmds:nixl_threads")
        assert got["threads"] == int(threads)
        assert got["ucx"].get("num_threads", "0") == ("2" if threads == "2" else "0"), got
        f = Factory(GEOMS, GEOMS, seed=11)
        reqs = [f.make(600), f.make(520, chunks=2)]  # hundreds of blocks per chunk
        prep, send = prefill_items(reqs)
        pf.call("prepare", items=prep)
        dc.call("recv", items=decode_items(reqs), bootstrap=bootstrap.address, instance=inst)
        pf.call("send", items=send)
        out = dc.call("wait", rooms=[r["room"] for r in reqs], timeout=60)
        assert all(o["state"] == "Success" for o in out.values()), out
        assert not any(c[0] for c in dc.call("verify", items=decode_items(reqs)).values())
    finally:
        pf.close()
        if dc is not None:
            dc.close()


def _idle_agent(q: mp.Queue, nixl_default: bool) -> None:
    """An agent that does nothing: pdxfer's, or one built with NIXL's own config."""
    if nixl_default:
        import nixl_cu12 as nixl

        agent = nixl.nixl_agent(
            "pdxfer-test-default",
            nixl.nixl_agent_config(
                backends=["UCX"], sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
            ),
        )
    else:
        agent = NixlTransport()
    q.put(bool(agent))
    time.sleep(120)  # until killed


def _cpu_ticks(pid: int) -> int:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])


def test_an_idle_agent_does_not_spin() -> None:
    """NIXL's Python config starts the UCX progress thread with a 0 delay: it polls without
    sleeping (0 voluntary context switches, all its CPU when a core is free). pdxfer's agent
    sleeps on the worker's events and a 100 ms tick. CPU of each idle agent's process over
    the same 2 s, side by side (a count of clock ticks, not a speed)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_idle_agent, args=(q, d), daemon=True) for d in (False, True)]
    try:
        for p in procs:
            p.start()
        for _ in procs:  # an agent's start took minutes on a loaded 2-core VM
            assert q.get(timeout=300), [p.exitcode for p in procs]
        time.sleep(0.5)
        t0 = [_cpu_ticks(p.pid) for p in procs]
        time.sleep(2.0)
        mine, theirs = (_cpu_ticks(p.pid) - t for p, t in zip(procs, t0))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    assert theirs > 0 and mine * 5 < theirs, (mine, theirs)


EXITS = """
import sys
from pdxfer.transport import make_transport
t = make_transport(sys.argv[1], "127.0.0.1")
if sys.argv[2] == "close":
    t.close()
print("started", t.name, flush=True)
"""


@pytest.mark.parametrize("kind", ["nixl", "auto"])
@pytest.mark.parametrize("close", ["close", "leave"])
def test_a_process_that_ran_nixl_exits_cleanly(kind: str, close: str) -> None:
    """NIXL's wheel bundles a libnl-route and UCX's IB/EFA modules load the system's: with
    the bundled one loaded first, its destructor faulted at exit (status -11 with an agent
    alone, or beside Mooncake in ``auto``). A process that used the transport, closed or left
    to exit, must end with status 0."""
    r = subprocess.run(
        [sys.executable, "-c", EXITS, kind, close], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and f"started {kind}" in r.stdout, (r.returncode, r.stderr[-2000:])
