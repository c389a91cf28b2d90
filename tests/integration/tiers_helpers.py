"""Request families for the tier tests: requests sharing a prefix carry the same bytes for it."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent

from .helpers import Pages

X = "tests.harness.tier_cmds:"
MODEL = "model=pattern-a"
"""The model the tier tests' byte patterns stand for (L3 keys are salted with it)."""

STD = [
    PoolGeom("kv", "mha", layers=2, pages=768, page_size=16, heads=2, head_dim=16, dtype="float16"),
    PoolGeom(
        "draft",
        "mha",
        layers=1,
        pages=768,
        page_size=16,
        heads=1,
        head_dim=16,
        dtype="bfloat16",
        indices_from="kv",
        first_layer=50,
    ),
    PoolGeom("aux", "slots", layers=1, pages=128, dim=8, dtype="int32"),
]
"""A KV pool, a draft pool that follows it and a slot pool: the tiers tests' geometry."""
N, SHARED = 320, 288  # 20 pages; B shares A's first 18 (90%)

_rooms = itertools.count(50_000)


class Family:
    """Page free lists for one pool group and a token generator."""

    def __init__(self, geoms: list[PoolGeom], seed: int) -> None:
        self.anchors = [g for g in geoms if g.kind != "slots" and g.indices_from is None]
        self.slot_pools = [g for g in geoms if g.kind == "slots"]
        self.ps = self.anchors[0].page_size
        self.src = {g.name: Pages(g.pages, seed + 1) for g in self.anchors + self.slot_pools}
        self.dst = {g.name: Pages(g.pages, seed + 2) for g in self.anchors + self.slot_pools}
        self.rng = np.random.default_rng(seed)

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(0, 1 << 20, n).tolist()

    def make(
        self,
        tokens: list[int],
        segments: list[tuple[int, int, int]] | None = None,
        room: int | None = None,
    ) -> dict[str, Any]:
        room = next(_rooms) if room is None else room
        n = len(tokens)
        pages = -(-n // self.ps)
        return {
            "room": room,
            "tokens": tokens,
            "num_tokens": n,
            "segments": segments or [(room, 0, n)],
            "src": {g.name: self.src[g.name].take(pages) for g in self.anchors},
            "dst": {g.name: self.dst[g.name].take(pages) for g in self.anchors},
            "src_slots": {g.name: self.src[g.name].take(1)[0] for g in self.slot_pools},
            "dst_slots": {g.name: self.dst[g.name].take(1)[0] for g in self.slot_pools},
        }

    def child(self, parent: dict[str, Any], shared: int, n: int) -> dict[str, Any]:
        """A request whose first ``shared`` tokens are ``parent``'s (same bytes there)."""
        room = next(_rooms)
        segs = [(s, a, min(b, shared)) for s, a, b in parent["segments"] if a < shared]
        return self.make(
            parent["tokens"][:shared] + self.tokens(n - shared), [*segs, (room, shared, n)], room
        )

    def free(self, r: dict[str, Any]) -> None:
        for side, key in ((self.src, "src"), (self.dst, "dst")):
            for name, p in r[key].items():
                side[name].give(p)
            for name, s in r[key + "_slots"].items():
                side[name].give([s])


def start(
    pf: Agent,
    dc: Agent,
    bootstrap: str,
    reqs: list[dict[str, Any]],
    ep: str = "main",
    instance: str | None = None,
    fault: dict[str, Any] | None = None,
) -> dict[int, int]:
    """Prepare, request and send each request; return the promised prefix per room."""
    pf.call(
        "ext",
        fn=X + "prepare",
        ep=ep,
        items=[
            {
                "room": r["room"],
                "pages": r["src"],
                "slots": r["src_slots"],
                "segments": r["segments"],
            }
            for r in reqs
        ],
    )
    promised = dc.call(
        "ext",
        fn=X + "recv",
        ep=ep,
        bootstrap=bootstrap,
        instance=instance or "default",
        fault=fault,
        items=[
            {
                "room": r["room"],
                "tokens": r["tokens"],
                "dst": r.get("recv_dst", r["dst"]),
                "slots": r["dst_slots"],
                "num_tokens": r["num_tokens"],
                "l1_len": r.get("l1_len", 0),
                "restore_timeout_s": r.get("restore_timeout_s"),
            }
            for r in reqs
        ],
    )
    pf.call(
        "send",
        ep=ep,
        items=[
            {
                "room": r["room"],
                "chunks": [{"pages": r["src"], "slots": r["src_slots"], "last": True}],
            }
            for r in reqs
            if not r.get("no_send")
        ],
    )
    return {int(k): v for k, v in promised.items()}


def finish(dc: Agent, reqs: list[dict[str, Any]], ep: str = "main") -> dict[int, Any]:
    """Wait for every request, then check its bytes; outcome and (bad, first) per room."""
    rooms = [r["room"] for r in reqs]
    out = dc.call("ext", fn=X + "wait", rooms=rooms, ep=ep)
    checks = dc.call(
        "ext",
        fn=X + "verify",
        ep=ep,
        items=[
            {"room": r["room"], "dst": r["dst"], "slots": r["dst_slots"], "segments": r["segments"]}
            for r in reqs
        ],
    )
    dc.call("ext", fn=X + "forget", rooms=rooms, ep=ep)
    return {int(r): {**out[r], "bad": checks[r]} for r in out}


def write_back(dc: Agent, reqs: list[dict[str, Any]], ep: str = "main") -> list[int]:
    return dc.call(
        "ext",
        fn=X + "write_back",
        ep=ep,
        items=[
            {"tokens": r["tokens"], "dst": r["dst"], "num_tokens": r["num_tokens"]} for r in reqs
        ],
    )


def assert_right(res: dict[int, Any]) -> None:
    bad = {r: o for r, o in res.items() if o["state"] != "Success" or o["bad"][0]}
    assert not bad, bad
