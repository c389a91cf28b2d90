"""Drive groups of endpoints (TP ranks, DP groups, PP stages) hosted in agent processes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent

from .conftest import FAST
from .helpers import Factory, decode_items, prefill_items


def shard(total: int, tp: int, r: int) -> tuple[int, int]:
    """(heads, first_head) of TP rank r: a contiguous split, or one replicated head."""
    return (total // tp, r * total // tp) if total >= tp else (1, r * total // tp)


def rank_geoms(geoms: list[PoolGeom], tp: int, r: int) -> list[PoolGeom]:
    """Each MHA pool's head slice for TP rank r (``total_heads`` must be set)."""
    out = []
    for g in geoms:
        if g.kind == "mha":
            h, f = shard(g.total_heads or g.heads, tp, r)
            g = dataclasses.replace(g, heads=h, first_head=f, total_heads=g.total_heads or g.heads)
        out.append(g)
    return out


@dataclasses.dataclass
class Group:
    """Endpoints of one role living in ``agent`` under names ``prefix:i``."""

    agent: Agent
    names: list[str]
    instance: str = "default"

    def each(self, cmd: str, **kw: Any) -> list[Any]:
        return [self.agent.call(cmd, ep=n, **kw) for n in self.names]


def add_group(
    agent: Agent,
    role: str,
    prefix: str,
    n: int,
    geoms_of: Callable[[int], list[PoolGeom]],
    cfg_of: Callable[[int], dict[str, Any]],
    bootstrap: str = "",
    instance: str = "default",
) -> Group:
    """``n`` endpoints ``prefix:i`` with pools ``geoms_of(i)`` and config ``cfg_of(i)``."""
    names = []
    for i in range(n):
        name = f"{prefix}:{i}"
        conf = {**FAST, **cfg_of(i)}
        if role == "prefill":
            conf.update(bootstrap=bootstrap, instance=instance)
        agent.call("add_endpoint", name=name, role=role, config=conf, geoms=geoms_of(i))
        names.append(name)
    g = Group(agent, names, instance)
    if role == "decode":
        g.each("sentinel")
    return g


def tp_group(
    agent: Agent,
    role: str,
    prefix: str,
    geoms: list[PoolGeom],
    tp: int,
    bootstrap: str = "",
    instance: str = "default",
) -> Group:
    return add_group(
        agent,
        role,
        prefix,
        tp,
        lambda r: rank_geoms(geoms, tp, r),
        lambda r: {"tp_rank": r, "tp_size": tp},
        bootstrap,
        instance,
    )


def run_groups(
    pf: Group, dc: Group, bootstrap: str, reqs: list[dict[str, Any]], timeout: float = 60.0
) -> list[dict[int, dict[str, Any]]]:
    """Every prefill rank prepares and sends every request; every decode rank receives it."""
    prep, send = prefill_items(reqs)
    pf.each("prepare", items=prep)
    dc.each("recv", items=decode_items(reqs), bootstrap=bootstrap, instance=pf.instance)
    pf.each("send", items=send)
    return dc.each("wait", rooms=[r["room"] for r in reqs], timeout=timeout)


def assert_success_and_exact(outs: list[dict], checks: list[dict]) -> None:
    for out, chk in zip(outs, checks):
        bad = {r: o for r, o in out.items() if o["state"] != "Success"}
        assert not bad, bad
        wrong = {r: c for r, c in chk.items() if c[0]}
        assert not wrong, wrong


HEAD_POOLS = [
    PoolGeom("kv", "mha", layers=2, pages=256, page_size=16, heads=4, total_heads=4, head_dim=8),
    PoolGeom(
        "kvh",
        "mha",
        layers=2,
        pages=256,
        page_size=16,
        heads=4,
        total_heads=4,
        head_dim=8,
        layout="HND",
        first_layer=10,
    ),
    PoolGeom(
        "gqa",
        "mha",
        layers=1,
        pages=256,
        page_size=16,
        heads=2,
        total_heads=2,
        head_dim=8,
        layout="HND",
        indices_from="kv",
        first_layer=20,
    ),
    PoolGeom("aux", "slots", layers=1, pages=32, dim=8, dtype="int32"),
]
"""Heads pools in NHD and HND layout and a GQA pool (fewer heads), and a slot pool: a
head slice one head off lands on another head's bytes."""


def exclude(reqs: list[dict]) -> dict[str, list[int]]:
    """Every page and slot ``reqs`` write, per pool: what ``untouched`` must leave out."""
    out: dict[str, list[int]] = {}
    for r in reqs:
        for n, p in r["dst"].items():
            out.setdefault(n, []).extend(p)
        for n, s in r["dst_slots"].items():
            out.setdefault(n, []).append(s)
    return out


BIG = 1024
SIZES = [(16, 1), (45, 2), (200, 3), (129, 4)]
"""(tokens, chunks) per request: partial pages, several chunks."""


def run_case(
    cluster: dict[str, Group],
    bootstrap: str,
    pf: str,
    dc: str,
    geoms: list[PoolGeom],
    sizes: list[tuple[int, int]] = SIZES,
) -> list[dict]:
    """Requests of ``sizes`` from group ``pf`` to group ``dc`` of ``cluster``: each one
    succeeds on every decode rank with exact bytes, and nothing lands outside them."""
    f = Factory(geoms, geoms, seed=len(pf) * 10 + len(dc))
    reqs = [f.make(n, chunks=c) for n, c in sizes]
    p, d = cluster[pf], cluster[dc]
    d.each("sentinel")
    outs = run_groups(p, d, bootstrap, reqs)
    assert_success_and_exact(outs, d.each("verify", items=decode_items(reqs)))
    assert d.each("untouched", exclude=exclude(reqs)) == [0] * len(d.names)
    return outs
