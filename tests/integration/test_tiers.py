"""Decode-side tiers across real processes: a prefill, two decodes, a real bootstrap server,
Mooncake TCP for the network, real files and a real ``mooncake_master`` for L3.

Every decode byte is checked against the pattern of the request that first computed it, and
the bytes the prefill's transport moved are counted: a restored prefix must not cross the wire.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from pdxfer import BootstrapServer
from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent
from pdxfer.tiers.keys import pool_key
from pdxfer.tiers.mooncake_store import MooncakeMaster
from pdxfer.tiers.storage import FileStorage

from .conftest import FAST
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

V4 = [  # DeepSeek-V4 style: a logical anchor, data in two sidecars of different item sizes
    PoolGeom("c4", "logical", pages=256, page_size=16),
    PoolGeom(
        "c4_kv",
        "paged",
        layers=2,
        pages=256,
        page_size=16,
        dim=40,
        dtype="bfloat16",
        indices_from="c4",
    ),
    PoolGeom(
        "c4_idx",
        "paged",
        layers=2,
        pages=256,
        page_size=16,
        dim=6,
        dtype="float32",
        indices_from="c4",
        first_layer=10,
    ),
]
MODEL_B = "model=pattern-b"


class Setup:
    def __init__(self, bootstrap: str, root: str, master: MooncakeMaster) -> None:
        self.bootstrap, self.root = bootstrap, root
        conf = dict(FAST)
        self.pf = self.d1 = self.d2 = None
        self.pf = Agent("prefill", {**conf, "bootstrap": bootstrap}, STD)
        self.pf.call(
            "add_endpoint",
            name="v4",
            role="prefill",
            config={**conf, "bootstrap": bootstrap, "instance": "v4"},
            geoms=V4,
        )
        self.pf.call(
            "add_endpoint",
            name="mb",
            role="prefill",
            config={**conf, "bootstrap": bootstrap, "instance": "mb"},
            geoms=STD,
        )
        self.d1 = Agent("decode", conf, STD)
        self.d1.call("add_endpoint", name="v4", role="decode", config=conf, geoms=V4)
        self.d2 = Agent("decode", conf, STD)
        self.d2.call("add_endpoint", name="mb", role="decode", config=conf, geoms=STD)
        mc = {
            "kind": "mooncake",
            "master": master.master_addr,
            "metadata": master.metadata_url,
            "segment_bytes": 64 << 20,
        }
        for d in (self.d1, self.d2):
            d.call("ext", fn=X + "storage", name="file", kind="file", root=root)
            d.call("ext", fn=X + "storage", name="mc", **mc)
            d.call("ext", fn=X + "setup", host_pages=256, model_id=MODEL, use="file")
        # another model whose KV has exactly STD's shape, on the same L3 folder
        self.d2.call("ext", fn=X + "setup", ep="mb", host_pages=256, model_id=MODEL_B, use="file")
        self.d1.call(
            "ext",
            fn=X + "setup",
            ep="v4",
            model_id="v4",
            use="file",
            host_pages={"c4_kv": 128, "c4_idx": 96},
        )
        self.std = Family(STD, seed=11)
        self.v4 = Family(V4, seed=12)

    def close(self) -> None:
        """Close the agents side by side: each exit waits on Mooncake's own teardown."""
        ts = [threading.Thread(target=a.close) for a in (self.pf, self.d1, self.d2) if a]
        for t in ts:
            t.start()
        for t in ts:
            t.join()


@pytest.fixture(scope="module")
def env(bootstrap: BootstrapServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    master = MooncakeMaster()
    s = None
    try:
        s = Setup(bootstrap.address, str(tmp_path_factory.mktemp("l3")), master)
        yield s
    finally:
        if s is not None:
            s.close()
        master.stop()


def pf_bytes(env: Setup, ep: str = "main") -> int:
    return int(env.pf.call("ext", fn=X + "transport_bytes", ep=ep))


def suffix_bytes(
    dc: Agent, start_tok: int, end: int, ep: str = "main", slots: tuple[str, ...] = ("aux",)
) -> int:
    return int(
        dc.call("ext", fn=X + "suffix_bytes", start=start_tok, end=end, slots=list(slots), ep=ep)
    )


def parent(
    env: Setup, fam: Family, dc: Agent, ep: str = "main", inst: str | None = None
) -> dict[str, Any]:
    """Transfer a fresh request in full and write it back (L2 and L3)."""
    a = fam.make(fam.tokens(N))
    promised = start(env.pf, dc, env.bootstrap, [a], ep=ep, instance=inst)
    assert promised[a["room"]] == 0
    assert_right(finish(dc, [a], ep=ep))
    assert write_back(dc, [a], ep=ep) == [N // fam.ps]
    return a


def child_run(
    env: Setup,
    fam: Family,
    a: dict[str, Any],
    dc: Agent,
    ep: str = "main",
    inst: str | None = None,
    fault: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], int, dict[str, Any]]:
    b = fam.child(a, SHARED, N)
    before = pf_bytes(env, ep)
    promised = start(env.pf, dc, env.bootstrap, [b], ep=ep, instance=inst, fault=fault)
    res = finish(dc, [b], ep=ep)
    moved = pf_bytes(env, ep) - before
    return b, promised[b["room"]], {**res[b["room"]], "moved": moved}


def no_leaks(env: Setup, dc: Agent, ep: str = "main") -> None:
    rep = dc.call("ext", fn=X + "report", ep=ep)
    assert rep["check"] is None, rep["check"]
    assert rep["stats"]["l2.pinned"] == 0 and rep["stats"]["l2.not_ready"] == 0, rep["stats"]
    assert rep["rooms"] == 0
    # the decode's Release of a held room is one-way and may still be on its way: wait for
    # it (bounded), then the prefill must hold nothing
    end = time.monotonic() + 30.0
    tables = env.pf.call("ext", fn=X + "prefill_tables", ep=ep)
    while tables != {"rooms": 0, "pending": 0, "held": 0} and time.monotonic() < end:
        time.sleep(0.05)
        tables = env.pf.call("ext", fn=X + "prefill_tables", ep=ep)
    assert tables == {"rooms": 0, "pending": 0, "held": 0}, tables


def test_only_the_suffix_crosses_the_wire_when_the_prefix_is_in_l2(env: Setup) -> None:
    a = parent(env, env.std, env.d1)
    b, promised, res = child_run(env, env.std, a, env.d1)
    assert promised == SHARED
    assert_right({b["room"]: res})
    want = suffix_bytes(env.d1, SHARED, N)
    assert res["stats"]["net_bytes"] == want and res["moved"] == want
    assert res["stats"]["l2_pages"] == SHARED // 16 and res["stats"]["repaired_tokens"] == 0
    for r in (a, b):
        env.std.free(r)
    no_leaks(env, env.d1)


def test_two_models_of_the_same_kv_shape_never_restore_each_others_pages(env: Setup) -> None:
    """Model B (the same pools, its own ``model_id``, the same L3 folder) asks for the very
    tokens model A wrote back: no hit, every byte (B's own: another model's KV for the same
    tokens) comes from the network. B's write-back of those tokens does not replace A's
    objects either: model A on another decode restores its own bytes from L3."""
    a = parent(env, env.std, env.d1)
    b = env.std.make(list(a["tokens"]))  # same tokens, model B's own bytes
    before = pf_bytes(env, "mb")
    assert start(env.pf, env.d2, env.bootstrap, [b], ep="mb", instance="mb")[b["room"]] == 0
    assert_right(finish(env.d2, [b], ep="mb"))
    assert pf_bytes(env, "mb") - before == suffix_bytes(env.d2, 0, N, ep="mb")
    assert write_back(env.d2, [b], ep="mb") == [N // 16]
    env.d2.call("ext", fn=X + "clear_l2")
    c, promised, res = child_run(env, env.std, a, env.d2)
    assert promised == SHARED and res["stats"]["l3_pages"] == SHARED // 16
    assert_right({c["room"]: res})
    for r in (a, b, c):
        env.std.free(r)
    no_leaks(env, env.d2, ep="mb")
    no_leaks(env, env.d2)


@pytest.mark.parametrize("store", ["file", "mc"])
def test_prefix_restored_from_l3_after_l2_is_cleared(env: Setup, store: str) -> None:
    env.d1.call("ext", fn=X + "use", name=store)
    try:
        a = parent(env, env.std, env.d1)
        assert env.d1.call("ext", fn=X + "clear_l2") > 0
        b, promised, res = child_run(env, env.std, a, env.d1)
    finally:
        env.d1.call("ext", fn=X + "use", name="file")
    assert promised == SHARED
    assert_right({b["room"]: res})
    assert res["stats"]["l3_pages"] == SHARED // 16 and res["stats"]["l2_pages"] == 0
    assert res["moved"] == suffix_bytes(env.d1, SHARED, N)
    for r in (a, b):
        env.std.free(r)
    no_leaks(env, env.d1)


def test_a_page_corrupted_in_l2_is_caught_after_the_copy_and_repaired(env: Setup) -> None:
    """Every restored page is checked against the digest recorded when it entered L2: a page
    damaged in host memory is never decoded from; the rest of the prefix comes again from the
    prefill (which holds it for repair) and the request ends with the right bytes."""
    a = parent(env, env.std, env.d1)
    before = env.d1.call("ext", fn=X + "report")["stats"]
    assert env.d1.call("ext", fn=X + "corrupt_l2", n=1000) > 0  # every page of the prefix
    b, promised, res = child_run(env, env.std, a, env.d1)
    assert promised == SHARED  # promised from L2 ...
    assert_right({b["room"]: res})  # ... but the damaged pages were repaired
    after = env.d1.call("ext", fn=X + "report")["stats"]
    assert after["integrity_restore_mismatches"] > before["integrity_restore_mismatches"]
    assert res["stats"]["repaired_tokens"] > 0
    for r in (a, b):
        env.std.free(r)
    no_leaks(env, env.d1)


@pytest.mark.parametrize("store", ["file", "mc"])
@pytest.mark.parametrize("kind", ["corrupt", "shift_write"])
def test_a_page_damaged_in_l2_before_its_write_back_is_caught_when_it_comes_back_from_l3(
    env: Setup, store: str, kind: str
) -> None:
    """The page digest recorded when a page entered L2 is sealed into its L3 object: a page
    damaged in host memory between that moment and its write-back is stored with a valid tag
    over wrong bytes, and only the sealed digest tells. The restore from L3 treats it as a
    miss and the prefill repairs it and what follows, so the request ends with right bytes."""
    env.d1.call("ext", fn=X + "use", name=store)
    try:
        env.d1.call("set_faults", spec=f"{kind}=1,at=writeback,seed=3")
        try:
            a = parent(env, env.std, env.d1)
        finally:
            env.d1.call("set_faults", spec="")
        before = env.d1.call("ext", fn=X + "report")["stats"]
        assert env.d1.call("ext", fn=X + "clear_l2") > 0
        b, promised, res = child_run(env, env.std, a, env.d1)
    finally:
        env.d1.call("ext", fn=X + "use", name="file")
    after = env.d1.call("ext", fn=X + "report")["stats"]
    assert after[f"faults_injected_{kind}"] > 0
    assert promised == SHARED  # every object is there and sealed ...
    assert_right({b["room"]: res})  # ... yet the damaged page was never used
    assert after["integrity_l3_mismatches"] > before["integrity_l3_mismatches"]
    assert res["stats"]["repaired_tokens"] > 0
    for r in (a, b):
        env.std.free(r)
    no_leaks(env, env.d1)


def test_page_whose_draft_part_is_missing_in_l3_is_not_a_hit(env: Setup) -> None:
    a = parent(env, env.std, env.d1)
    env.d1.call("ext", fn=X + "clear_l2")
    keys = env.d1.call("ext", fn=X + "keys", tokens=a["tokens"])
    os.unlink(FileStorage(env.root).path(pool_key(keys[5], "draft")))
    b, promised, res = child_run(env, env.std, a, env.d1)
    assert promised == 5 * 16  # target KV of page 5 alone is no hit
    assert_right({b["room"]: res})
    assert res["moved"] == suffix_bytes(env.d1, 5 * 16, N)
    for r in (a, b):
        env.std.free(r)
    no_leaks(env, env.d1)


def test_logical_anchor_with_two_sidecars_round_trips_through_l3(env: Setup) -> None:
    a = parent(env, env.v4, env.d1, ep="v4", inst="v4")
    env.d1.call("ext", fn=X + "clear_l2", ep="v4")
    b, promised, res = child_run(env, env.v4, a, env.d1, ep="v4", inst="v4")
    assert promised == SHARED
    assert_right({b["room"]: res})
    assert res["stats"]["l3_pages"] == SHARED // 16
    assert res["moved"] == suffix_bytes(env.d1, SHARED, N, ep="v4", slots=())
    for r in (a, b):
        env.v4.free(r)
    no_leaks(env, env.d1, ep="v4")


@pytest.mark.parametrize(
    "fault", [{"kind": "delete", "page": 3}, {"kind": "truncate", "page": 7, "pool": "draft"}]
)
def test_restore_failure_after_the_promise_is_repaired_by_the_prefill(
    env: Setup, fault: dict[str, Any]
) -> None:
    a = parent(env, env.std, env.d1)
    env.d1.call("ext", fn=X + "clear_l2")
    b, promised, res = child_run(env, env.std, a, env.d1, fault=fault)
    assert promised == SHARED
    assert_right({b["room"]: res})
    page = fault["page"]
    assert res["stats"]["restored_pages"] == page
    assert res["stats"]["repaired_tokens"] == SHARED - page * 16
    assert res["moved"] == suffix_bytes(env.d1, page * 16, N)
    for r in (a, b):
        env.std.free(r)
    no_leaks(env, env.d1)


def test_device_resident_prefix_is_neither_sent_nor_restored(env: Setup) -> None:
    a = parent(env, env.std, env.d1)
    b = env.std.child(a, SHARED, N)
    k = 4  # the engine still holds A's first k pages on the device and reuses them for B
    own = b["dst"]
    b["dst"] = {n: a["dst"][n][:k] + p[k:] for n, p in own.items()}
    b["recv_dst"], b["l1_len"] = {n: p[k:] for n, p in own.items()}, k * 16
    before = pf_bytes(env)
    promised = start(env.pf, env.d1, env.bootstrap, [b])
    res = finish(env.d1, [b])
    assert promised[b["room"]] == SHARED
    assert_right(res)
    st = res[b["room"]]["stats"]
    assert st["l1_pages"] == k and st["l2_pages"] == SHARED // 16 - k
    assert pf_bytes(env) - before == suffix_bytes(env.d1, SHARED, N)
    b["dst"] = own
    for r in (a, b):
        env.std.free(r)
    no_leaks(env, env.d1)


def test_restore_deadline_passing_after_the_promise_is_repaired(env: Setup) -> None:
    a = parent(env, env.std, env.d1)
    env.d1.call("ext", fn=X + "clear_l2")
    b = env.std.child(a, SHARED, N)
    b["restore_timeout_s"] = 1e-6  # passes before the first L3 read
    before = pf_bytes(env)
    promised = start(env.pf, env.d1, env.bootstrap, [b])
    res = finish(env.d1, [b])
    assert promised[b["room"]] == SHARED
    assert_right(res)
    st = res[b["room"]]["stats"]
    assert st["restored_pages"] == 0 and st["repaired_tokens"] == SHARED
    assert pf_bytes(env) - before == suffix_bytes(env.d1, 0, N)
    for r in (a, b):
        env.std.free(r)
    no_leaks(env, env.d1)


def test_two_decodes_share_one_mooncake_store(env: Setup) -> None:
    env.d1.call("ext", fn=X + "use", name="mc")
    env.d2.call("ext", fn=X + "use", name="mc")
    try:
        a = parent(env, env.std, env.d1)
        b, promised, res = child_run(env, env.std, a, env.d2)
    finally:
        env.d1.call("ext", fn=X + "use", name="file")
    assert promised == SHARED
    assert_right({b["room"]: res})
    assert res["stats"]["l3_pages"] == SHARED // 16
    for r in (a, b):
        env.std.free(r)
    no_leaks(env, env.d2)


def test_hundred_mixed_requests_with_failing_l3_leave_no_pin_no_reservation_and_a_consistent_index(
    env: Setup,
) -> None:
    fam, dc = env.std, env.d1
    rng = np.random.default_rng(5)
    parents: list[dict[str, Any]] = []
    aborted: list[int] = []
    done = 0
    for rnd in range(10):
        env.d1.call("ext", fn=X + "use", name="mc" if rnd % 3 == 2 else "file")
        if rnd % 4 == 3:
            dc.call("ext", fn=X + "clear_l2")
        reqs = []
        for _ in range(10):
            n = int(rng.integers(20, 321))
            if parents and rng.random() < 0.6:
                p = parents[int(rng.integers(len(parents)))]
                shared = int(rng.integers(1, p["num_tokens"] + 1))
                r = fam.child(p, shared, max(n, shared + 1))
            else:
                r = fam.make(fam.tokens(n))
            r["no_send"] = rng.random() < 0.1
            reqs.append(r)
        # a failing L3 in the rounds that must restore from it: promised objects vanish or
        # tear between match and load, and the repair path must still deliver every byte
        fault = {3: {"kind": "delete", "page": 0}, 7: {"kind": "truncate", "page": 1}}.get(rnd)
        start(env.pf, dc, env.bootstrap, reqs, fault=fault)
        ab = [r["room"] for r in reqs if r["no_send"]]
        if ab:
            dc.call("ext", fn=X + "abort", rooms=ab)
        res = finish(dc, reqs)
        for r in reqs:
            o = res[r["room"]]
            if r["no_send"]:
                assert o["state"] == "Failed", o
            else:
                assert o["state"] == "Success" and not o["bad"][0], o
        ok = [r for r in reqs if not r["no_send"]]
        write_back(dc, ok)
        aborted += ab
        done += len(reqs)
        parents = (parents + ok)[-8:]
        for r in reqs:
            fam.free(r)
    assert done == 100
    assert env.pf.call("metrics").get("repairs", 0) > 0, "the failing L3 was never exercised"
    env.d1.call("ext", fn=X + "use", name="file")
    rep = dc.call("ext", fn=X + "report")
    assert set(aborted) <= set(rep["released"])
    no_leaks(env, dc)


RESTORE_FAULTS = 100
"""Per fault kind and tier: 200 per kind over restores (the network cases in
test_integrity.py add their own 200+ per kind)."""


def _restores(env: Setup, tier: str, n: int, spec: str) -> tuple[list[dict[str, Any]], dict]:
    """``n`` children of one parent restored from ``tier`` with ``spec`` faults on their
    rooms; returns each child's outcome and the cache's counters before and after."""
    a = parent(env, env.std, env.d1)
    before = env.d1.call("ext", fn=X + "report")["stats"]
    outs = []
    batch = 10 if tier == "l2" else 1  # an L3 prefetch is one request's at a time
    try:
        for _ in range(0, n, batch):
            kids = [env.std.child(a, SHARED, N) for _ in range(batch)]
            env.d1.call(
                "set_faults",
                spec=f"{spec},at=restore,rooms=" + ";".join(str(k["room"]) for k in kids),
            )
            if tier == "l3":
                env.d1.call("ext", fn=X + "clear_l2")
            promised = start(env.pf, env.d1, env.bootstrap, kids)
            assert all(v == SHARED for v in promised.values()), promised
            res = finish(env.d1, kids)
            outs += [{**res[k["room"]], "room": k["room"]} for k in kids]
            for k in kids:
                env.std.free(k)
    finally:
        env.d1.call("set_faults", spec="")
    after = env.d1.call("ext", fn=X + "report")["stats"]
    env.std.free(a)
    return outs, {"before": before, "after": after}


@pytest.mark.parametrize("tier", ["l2", "l3"])
@pytest.mark.parametrize("kind", ["corrupt", "skip_write", "shift_write"])
def test_every_fault_in_a_restored_page_is_caught_and_repaired(
    env: Setup, tier: str, kind: str
) -> None:
    """A page damaged right after its L2 -> L1 copy (from L2, or from L3 through L2) never
    reaches the engine: the check against the digest recorded when it entered L2 catches
    it, and it and the pages after it come from the prefill instead."""
    outs, st = _restores(env, tier, RESTORE_FAULTS, f"{kind}=1,seed=7")
    b, a = st["before"], st["after"]
    injected = a[f"faults_injected_{kind}"] - b[f"faults_injected_{kind}"]
    assert injected == RESTORE_FAULTS
    assert a["integrity_restore_mismatches"] - b["integrity_restore_mismatches"] == injected
    assert_right({o["room"]: o for o in outs})  # every byte right: repaired, never used
    assert all(o["stats"]["repaired_tokens"] > 0 for o in outs)
    no_leaks(env, env.d1)


def test_with_restore_checks_off_the_same_faults_reach_the_engine(env: Setup) -> None:
    """The check above has teeth: without it the damaged pages are used as they are."""
    env.d1.call("ext", fn=X + "set_verify", on=False)
    try:
        outs, _ = _restores(env, "l2", 12, "corrupt=1,seed=8")
    finally:
        env.d1.call("ext", fn=X + "set_verify", on=True)
    wrong = [o for o in outs if o["state"] == "Success" and o["bad"][0]]
    assert len(wrong) == len(outs)
    no_leaks(env, env.d1)
