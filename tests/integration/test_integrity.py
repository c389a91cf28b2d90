"""No wrong KV reaches a decode silently: pages damaged after the transport reported the write
done (corrupted, left stale, written one page off) fail the request with ``IntegrityError``
in the default ``sampled`` mode, across page-size pairs, host landing and TP 2->1 and 1->2;
with integrity ``off`` the same faults go through as Success with wrong bytes (so these tests
can fail)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from pdxfer import BootstrapServer
from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent, wait_until

from .conftest import FAST
from .helpers import Factory, decode_items
from .hetero import Group, add_group, assert_success_and_exact, rank_geoms, run_groups, tp_group

KV = PoolGeom("kv", "mha", layers=2, pages=512, page_size=16, heads=4, head_dim=16, total_heads=4)
AUX = PoolGeom("aux", "slots", layers=1, pages=256, dim=8, dtype="int32")
NHD = KV
KINDS = ("corrupt", "skip_write", "shift_write")
PER_CASE = 40  # 5 cases x 40 = 200 faults of each kind


def _host(ps: int) -> PoolGeom:
    return dataclasses.replace(NHD, page_size=ps, pages=8192 // ps, page_remap=True)


@pytest.fixture(scope="module")
def cluster(bootstrap: BootstrapServer) -> Iterator[dict[str, Group]]:
    b = bootstrap.address
    pf = Agent("prefill", {**FAST, "bootstrap": b, "instance": "one"}, [KV, AUX])
    dc = None
    try:
        dc = Agent("decode", dict(FAST), [NHD, AUX])
        g = {
            "p1": Group(pf, ["main"], "one"),
            "p2": tp_group(pf, "prefill", "tp2", [KV, AUX], 2, b, "two"),
            "d16": Group(dc, ["main"]),
        }
        g["d1"] = add_group(dc, "decode", "host1", 1, lambda i: [_host(1), AUX], lambda i: {})
        g["d4"] = add_group(dc, "decode", "host4", 1, lambda i: [_host(4), AUX], lambda i: {})
        g["d2"] = tp_group(dc, "decode", "dtp2", [NHD, AUX], 2)
        g["off"] = add_group(
            dc, "decode", "off", 1, lambda i: [NHD, AUX], lambda i: {"integrity": "off"}
        )
        yield g
    finally:
        pf.close()
        if dc is not None:
            dc.close()


CASES = {  # name: (prefill group, decode group, decode geometry of rank 0, tp of the decode)
    "page16_to_16": ("p1", "d16", NHD, 1),
    "page16_to_host1": ("p1", "d1", _host(1), 1),
    "page16_to_host4": ("p1", "d4", _host(4), 1),
    "tp2_to_1": ("p2", "d16", NHD, 1),
    "tp1_to_2": ("p1", "d2", NHD, 2),
}


def _reqs(f: Factory, n: int) -> list[dict]:
    return [f.make(int(t), chunks=1 + i % 3) for i, t in enumerate(f.rng.integers(1, 120, n))]


def _inject(dc: Agent, kind: str, rooms: list[int], seed: int) -> None:
    dc.call("set_faults", spec=f"{kind}=1,rooms={';'.join(map(str, rooms))},seed={seed}")


def _injected(g: Group, kind: str) -> int:
    return sum(int(m.get(f"faults_injected_{kind}", 0)) for m in g.each("metrics"))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_injected_page_fault_fails_the_request_with_integrity_error(
    cluster, bootstrap, case: str, kind: str
) -> None:
    pname, dname, dgeom, tp = CASES[case]
    pf, dc = cluster[pname], cluster[dname]
    f = Factory([KV, AUX], [dgeom, AUX], seed=hash((case, kind)) % 1000)
    reqs = _reqs(f, PER_CASE)
    before = _injected(dc, kind)
    _inject(dc.agent, kind, [r["room"] for r in reqs], seed=len(case))
    try:
        outs = run_groups(pf, dc, bootstrap.address, reqs, timeout=60)
    finally:
        dc.agent.call("set_faults", spec="")
    # one fault per (room, sender): every one of them is caught, by its own room
    assert _injected(dc, kind) - before >= PER_CASE
    for out in outs:
        bad = {r: o for r, o in out.items() if o["state"] != "Failed" or o["kind"] != "integrity"}
        assert not bad, bad
    one = next(iter(outs[0].values()))["failure"]
    assert "pool 'kv'" in one and "layer" in one and "tokens [" in one, one
    for r in reqs:
        f.free(r)


@pytest.mark.parametrize("kind", KINDS)
def test_with_integrity_off_the_same_faults_pass_silently_with_wrong_kv(
    cluster, bootstrap, kind: str
) -> None:
    pf, dc = cluster["p1"], cluster["off"]
    f = Factory([KV, AUX], [NHD, AUX], seed=77)
    reqs = _reqs(f, 20)
    dc.each("sentinel")
    _inject(dc.agent, kind, [r["room"] for r in reqs], seed=3)
    try:
        outs = run_groups(pf, dc, bootstrap.address, reqs, timeout=60)
    finally:
        dc.agent.call("set_faults", spec="")
    assert all(o["state"] == "Success" for o in outs[0].values()), outs
    wrong = [r for r, c in dc.each("verify", items=decode_items(reqs))[0].items() if c[0]]
    # a one-page request has no next page to shift into: its fault still leaves a stale page
    assert len(wrong) == len(reqs), (len(wrong), len(reqs))


def test_no_false_positive_without_faults(cluster, bootstrap) -> None:
    for case, (pname, dname, dgeom, _) in sorted(CASES.items()):
        pf, dc = cluster[pname], cluster[dname]
        f = Factory([KV, AUX], [dgeom, AUX], seed=5)
        reqs = _reqs(f, 20)
        outs = run_groups(pf, dc, bootstrap.address, reqs, timeout=60)
        for out, chk in zip(outs, dc.each("verify", items=decode_items(reqs))):
            assert all(o["state"] == "Success" for o in out.values()), (case, out)
            assert not any(c[0] for c in chk.values()), (case, chk)
        checks = sum(int(m.get("integrity_checks", 0)) for m in dc.each("metrics"))
        assert checks > 0, case
        # what was read for them is counted on both sides
        assert sum(int(m.get("integrity_bytes", 0)) for m in dc.each("metrics")) > 0, case
        assert sum(int(m.get("integrity_bytes", 0)) for m in pf.each("metrics")) > 0, case
        for r in reqs:
            f.free(r)


def test_full_mode_passes_clean_transfers_and_catches_corrupt_pages(cluster, bootstrap) -> None:
    pf = cluster["p1"]
    dc = add_group(
        cluster["d16"].agent,
        "decode",
        "full",
        1,
        lambda i: [NHD, AUX],
        lambda i: {"integrity": "full"},
    )
    f = Factory([KV, AUX], [NHD, AUX], seed=8)
    clean = _reqs(f, 10)
    outs = run_groups(pf, dc, bootstrap.address, clean, timeout=60)
    assert all(o["state"] == "Success" for o in outs[0].values()), outs
    bad = _reqs(f, 10)
    _inject(dc.agent, "corrupt", [r["room"] for r in bad], seed=9)
    try:
        outs = run_groups(pf, dc, bootstrap.address, bad, timeout=60)
    finally:
        dc.agent.call("set_faults", spec="")
    assert all(o["kind"] == "integrity" for o in outs[0].values()), outs


# -- integrity_retry: the range is requested once more through the repair path --------------

RETRY_CASES = {  # name: (prefill group, decode tp)
    "page16_to_16": ("p1", 1),
    "tp2_to_1": ("p2", 1),
    "tp1_to_2": ("p1", 2),
}


def _retry_group(cluster: dict[str, Group], tp: int) -> Group:
    key = f"retry{tp}"
    if key not in cluster:
        cluster[key] = add_group(
            cluster["d16"].agent,
            "decode",
            key,
            tp,
            lambda r: rank_geoms([NHD, AUX], tp, r),
            lambda r: {"tp_rank": r, "tp_size": tp, "integrity_retry": True},
        )
    return cluster[key]


def _metric(g: Group, name: str) -> int:
    return sum(int(m.get(name, 0)) for m in g.each("metrics"))


def _run_faulted(pf: Group, dc: Group, bootstrap: str, reqs: list[dict], spec: str) -> list[dict]:
    """``run_groups`` with page faults ``spec`` on the requests' rooms (cleared after)."""
    rooms = ";".join(str(r["room"]) for r in reqs)
    dc.agent.call("set_faults", spec=f"{spec},rooms={rooms}")
    try:
        return run_groups(pf, dc, bootstrap, reqs, timeout=60)
    finally:
        dc.agent.call("set_faults", spec="")


def _nothing_held(pf: Group) -> None:
    """The decode's Release is one-way: wait for it (bounded), then the prefill must hold no
    room (a retry's hold never outlives its request)."""
    ok = wait_until(
        lambda: all(t["rooms"] == 0 and t["pending"] == 0 for t in pf.each("tables")), 5.0
    )
    assert ok, pf.each("tables")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", sorted(RETRY_CASES))
def test_with_integrity_retry_a_transient_page_fault_is_sent_again_once_and_arrives_exact(
    cluster, bootstrap, case: str, kind: str
) -> None:
    pname, tp = RETRY_CASES[case]
    pf, dc = cluster[pname], _retry_group(cluster, tp)
    dgeom = rank_geoms([NHD], tp, 0)[0]
    f = Factory([KV, AUX], [dgeom, AUX], seed=hash((case, kind, "retry")) % 1000)
    reqs = _reqs(f, 12)
    before = {m: _metric(dc, m) for m in ("integrity_retries", f"faults_injected_{kind}")}
    outs = _run_faulted(pf, dc, bootstrap.address, reqs, f"{kind}=1,once=1,seed=4")
    # each room was damaged once (one rank of it), caught, asked again, and is now exact
    assert _metric(dc, f"faults_injected_{kind}") - before[f"faults_injected_{kind}"] == len(reqs)
    assert _metric(dc, "integrity_retries") - before["integrity_retries"] == len(reqs)
    assert_success_and_exact(outs, dc.each("verify", items=decode_items(reqs)))
    _nothing_held(pf)
    for r in reqs:
        f.free(r)


def test_with_integrity_retry_a_persistent_fault_fails_after_exactly_one_retry(
    cluster, bootstrap
) -> None:
    pf, dc = cluster["p1"], _retry_group(cluster, 1)
    f = Factory([KV, AUX], [NHD, AUX], seed=31)
    reqs = _reqs(f, 10)
    before = _metric(dc, "integrity_retries")
    outs = _run_faulted(pf, dc, bootstrap.address, reqs, "corrupt=1,seed=5")
    assert all(o["state"] == "Failed" and o["kind"] == "integrity" for o in outs[0].values()), outs
    assert _metric(dc, "integrity_retries") - before == len(reqs)
    _nothing_held(pf)
    # the failed rooms' pages went back to the engine (nothing quarantined)
    assert set(dc.agent.call("released", ep=dc.names[0])) >= {r["room"] for r in reqs}
    for r in reqs:
        f.free(r)


def test_without_integrity_retry_a_transient_fault_still_fails_the_request(
    cluster, bootstrap
) -> None:
    pf, dc = cluster["p1"], cluster["d16"]
    f = Factory([KV, AUX], [NHD, AUX], seed=32)
    reqs = _reqs(f, 6)
    outs = _run_faulted(pf, dc, bootstrap.address, reqs, "skip_write=1,once=1")
    assert all(o["kind"] == "integrity" for o in outs[0].values()), outs
    _nothing_held(pf)
