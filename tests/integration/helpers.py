"""Request factories for multi-process tests: scattered, non-overlapping pages on both sides."""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np

from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent

_rooms = itertools.count(1000)

SIX_POOLS = [
    PoolGeom(
        "kv", "mha", layers=4, pages=1024, page_size=16, heads=2, head_dim=16, dtype="float16"
    ),
    PoolGeom(
        "kv_bf16",
        "mha",
        layers=2,
        pages=1024,
        page_size=16,
        heads=1,
        head_dim=8,
        dtype="bfloat16",
        indices_from="kv",
        first_layer=100,
    ),
    PoolGeom(
        "kv_fp32",
        "mha",
        layers=1,
        pages=1024,
        page_size=16,
        heads=2,
        head_dim=4,
        dtype="float32",
        indices_from="kv",
        first_layer=200,
    ),
    PoolGeom("mla", "paged", layers=3, pages=512, page_size=32, dim=36, dtype="bfloat16"),
    PoolGeom(
        "mla_fp32",
        "paged",
        layers=2,
        pages=512,
        page_size=32,
        dim=12,
        dtype="float32",
        indices_from="mla",
    ),
    PoolGeom("aux", "slots", layers=2, pages=64, dim=24, dtype="int32"),
]
"""Six pools of three kinds and four dtypes, two anchors and four that follow them: the
geometry the transfer tests share (``destinations`` knows its anchors)."""


class Pages:
    """A free list of page (or slot) ids, handed out in random order."""

    def __init__(self, n: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.free = list(self.rng.permutation(n).tolist())

    def take(self, k: int) -> list[int]:
        if k > len(self.free):
            raise RuntimeError("test ran out of pages")
        out, self.free = self.free[:k], self.free[k:]
        return out

    def give(self, ids: list[int]) -> None:
        self.free.extend(ids)
        self.rng.shuffle(self.free)


class Factory:
    """Builds matching prefill and decode request descriptions for the agents."""

    def __init__(self, src: list[PoolGeom], dst: list[PoolGeom], seed: int = 0) -> None:
        self.anchors = [g for g in dst if g.kind in ("mha", "paged") and g.indices_from is None]
        self.slots = [g for g in dst if g.kind == "slots"]
        sg = {g.name: g for g in src}
        self.src = {g.name: Pages(sg[g.name].pages, seed + 1) for g in self.anchors + self.slots}
        self.dst = {g.name: Pages(g.pages, seed + 2) for g in self.anchors + self.slots}
        self.ps_src = {g.name: sg[g.name].page_size for g in self.anchors}
        self.ps_dst = {g.name: g.page_size for g in self.anchors}
        self.rng = np.random.default_rng(seed)

    def make(
        self, num_tokens: int, prefix_len: int = 0, chunks: int = 1, room: int | None = None
    ) -> dict[str, Any]:
        room = next(_rooms) if room is None else room
        src = {n: self.src[n].take(-(-num_tokens // ps)) for n, ps in self.ps_src.items()}
        dst = {
            n: self.dst[n].take(-(-(num_tokens - prefix_len) // ps))
            for n, ps in self.ps_dst.items()
        }
        ss = {g.name: self.src[g.name].take(1)[0] for g in self.slots}
        ds = {g.name: self.dst[g.name].take(1)[0] for g in self.slots}
        # chunk boundaries in tokens; each pool sends the whole pages finished by then
        cuts = sorted(set(self.rng.integers(1, max(2, num_tokens), chunks - 1).tolist()))
        bounds = [0, *cuts, num_tokens]
        chunk_list = []
        for i, b in enumerate(bounds[1:]):
            last = i == len(bounds) - 2
            a = bounds[i]
            pages = {
                n: p[a // self.ps_src[n] if i else 0 : len(p) if last else b // self.ps_src[n]]
                for n, p in src.items()
            }
            chunk_list.append({"pages": pages, "last": last})
        chunk_list[-1]["slots"] = ss
        return {
            "room": room,
            "num_tokens": num_tokens,
            "prefix_len": prefix_len,
            "src": src,
            "dst": dst,
            "src_slots": ss,
            "dst_slots": ds,
            "chunks": chunk_list,
        }

    def free(self, r: dict[str, Any]) -> None:
        for n, p in r["src"].items():
            self.src[n].give(p)
        for n, p in r["dst"].items():
            self.dst[n].give(p)
        for n, s in r["src_slots"].items():
            self.src[n].give([s])
        for n, s in r["dst_slots"].items():
            self.dst[n].give([s])


def prefill_items(reqs: list[dict[str, Any]]) -> tuple[list[dict], list[dict]]:
    prep = [
        {
            "room": r["room"],
            "pages": r["src"],
            "slots": r["src_slots"],
            "num_tokens": r["num_tokens"],
        }
        for r in reqs
    ]
    send = [
        {"room": r["room"], "chunks": r["chunks"], "delay_s": r.get("delay_s", 0.0)} for r in reqs
    ]
    return prep, send


def decode_items(reqs: list[dict[str, Any]]) -> list[dict]:
    return [
        {
            "room": r["room"],
            "dst": r["dst"],
            "slots": r["dst_slots"],
            "prefix_len": r["prefix_len"],
            "num_tokens": r["num_tokens"],
            "dp": r.get("dp"),
            "scrub": r.get("scrub", False),
        }
        for r in reqs
    ]


def run(
    pf: Agent,
    dc: Agent,
    bootstrap: str,
    reqs: list[dict[str, Any]],
    decode_first: bool = True,
    timeout: float = 60.0,
) -> dict[int, dict[str, Any]]:
    """Start every request on both sides, wait for the decode, return outcomes by room."""
    prep, send = prefill_items(reqs)
    pf.call("prepare", items=prep)
    if decode_first:
        dc.call("recv", items=decode_items(reqs), bootstrap=bootstrap)
        pf.call("send", items=send)
    else:
        pf.call("send", items=send)
        dc.call("recv", items=decode_items(reqs), bootstrap=bootstrap)
    return dc.call("wait", rooms=[r["room"] for r in reqs], timeout=timeout)


def start(pf: Agent, dc: Agent, bootstrap: str, reqs: list[dict]) -> None:
    """Start every request on both sides (the decode first) without waiting for it."""
    prep, send = prefill_items(reqs)
    pf.call("prepare", items=prep)
    dc.call("recv", items=decode_items(reqs), bootstrap=bootstrap)
    pf.call("send", items=send)


def wait_released(dc: Agent, room: int, timeout: float = 10.0) -> bool:
    """Whether the decode ``dc`` handed ``room``'s pages back within ``timeout``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if room in dc.call("released"):
            return True
        time.sleep(0.02)
    return False


def wait_held(pf: Agent, room: int, timeout: float = 60.0) -> None:
    """Until the prefill's transport holds a batch of ``room`` (``delay_write``): the write is
    committed and lands ``delay_write`` s later, whatever the machine's speed (a fixed sleep could
    come before the write started on a slow machine, and the abort would then stop it)."""
    end = time.monotonic() + timeout
    while pf.call("held_batches", room=room) == 0:
        assert time.monotonic() < end, f"no write of room {room} started"
        time.sleep(0.01)


def destinations(reqs: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Every page and slot ``reqs`` write on the decode, per pool (of the six-pool geometry
    the transfer tests share): what the decode's ``untouched`` check must exclude."""
    return {
        "kv": [p for r in reqs for p in r["dst"]["kv"]],
        "mla": [p for r in reqs for p in r["dst"]["mla"]],
        "aux": [r["dst_slots"]["aux"] for r in reqs],
    }


def assert_all_right(outcomes: dict, checks: dict) -> None:
    """Every request succeeded and every byte ``verify`` checked is right."""
    bad = {r: o for r, o in outcomes.items() if o["state"] != "Success"}
    assert not bad, bad
    wrong = {r: c for r, c in checks.items() if c[0]}
    assert not wrong, wrong


def verify(dc: Agent, reqs: list[dict[str, Any]]) -> dict[int, Any]:
    return dc.call("verify", items=decode_items(reqs))


def wait_written(pf: Agent, before: int = 0, timeout: float = 60.0) -> None:
    """Until the sender ``pf`` has written more than ``before`` bytes: a transfer is under
    way (a fault injected now strikes it mid-transfer, where a fixed sleep could come before
    its first write on a slow machine)."""
    end = time.monotonic() + timeout
    while pf.call("metrics")["transport_bytes"] <= before:
        assert time.monotonic() < end, "the sender wrote nothing"
        time.sleep(0.02)


def wait_drained(pf: Agent, room: int, timeout: float = 60.0) -> float:
    """Until the sender ``pf`` ended ``room`` and every transport write of it returned
    (``PDXFER_FAULTS`` on: the transports count them); when the last one ended. After it no
    byte of the room is on its way, so a check that nothing landed late is bounded by that
    event, not by a sleep a slow defect could outlast."""
    out = pf.call("wait", rooms=[room], timeout=timeout)[room]
    assert out["state"] in ("Success", "Failed"), f"room {room} never ended: {out}"
    end = time.monotonic() + timeout
    while True:
        w = pf.call("writes", room=room)
        if w["began"] and len(w["ended"]) == w["began"]:
            return max(w["ended"])
        assert time.monotonic() < end, f"room {room}: writes still running: {w}"
        time.sleep(0.02)
