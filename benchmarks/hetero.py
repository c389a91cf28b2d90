"""Heterogeneous TP throughput: TP 2->1 (HND and NHD) against TP 1->1 in the same run."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from benchmarks.common.fleet import Fleet
from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent

TOKENS, LAYERS, HEADS, HEAD_DIM, PAGE = 4096, 8, 8, 128, 16
FAST = {"bootstrap_timeout_s": 20.0, "transfer_timeout_s": 60.0, "transport": "tcp"}
ENV = {"MC_LOG_LEVEL": "ERROR"}


def _geoms(layout: str, tp: int, rank: int) -> list[PoolGeom]:
    pages = 2 * TOKENS // PAGE
    h = HEADS // tp
    return [
        PoolGeom(
            "kv",
            "mha",
            layers=LAYERS,
            pages=pages,
            page_size=PAGE,
            heads=h,
            total_heads=HEADS,
            first_head=rank * h,
            head_dim=HEAD_DIM,
            layout=layout,
        )
    ]


class _Case:
    """One compared variant: sender ``i`` lives in ``pfs[i]`` (one process per rank); each
    repetition is a request of its own, a fresh room over the same source pages (a room is
    single-use: a prefill refuses a second request for a room that succeeded, as it must)."""

    def __init__(
        self,
        pfs: list[Agent],
        dc: Agent,
        boot: str,
        senders: list[str],
        instance: str,
        receiver: str,
        rng: np.random.Generator,
    ) -> None:
        self.pfs, self.dc, self.boot, self.senders = pfs, dc, boot, senders
        self.instance, self.receiver = instance, receiver
        pages = TOKENS // PAGE
        self.src = rng.permutation(2 * pages)[:pages].tolist()
        self.best: dict[str, Any] | None = None

    def rep(self, rep: int, rng: np.random.Generator) -> None:
        room, dc = int(rng.integers(1, 1 << 62)), self.dc
        for pf, ep in zip(self.pfs, self.senders):  # the room's pattern, untimed
            pf.call(
                "prepare",
                ep=ep,
                items=[{"room": room, "pages": {"kv": self.src}, "num_tokens": TOKENS}],
            )
        dst = rng.permutation(2 * (TOKENS // PAGE))[: TOKENS // PAGE].tolist()
        item = {"room": room, "dst": {"kv": dst}, "num_tokens": TOKENS}
        dc.call("recv", ep=self.receiver, items=[item], bootstrap=self.boot, instance=self.instance)
        for pf, ep in zip(self.pfs, self.senders):
            pf.call(
                "send",
                ep=ep,
                items=[{"room": room, "chunks": [{"pages": {"kv": self.src}, "last": True}]}],
            )
        out = dc.call("wait", ep=self.receiver, rooms=[room], timeout=120)[room]
        print(
            f"{self.instance} rep {rep}: {out['state']} {out['stats']}", file=sys.stderr, flush=True
        )
        if out["state"] != "Success":
            raise RuntimeError(f"{self.instance}: {out['failure']}")
        if rep == 0:
            bad, first = dc.call("verify", ep=self.receiver, items=[item])[room]
            if bad:
                raise RuntimeError(f"{self.instance}: {bad} bytes wrong: {first}")
        st = out["stats"]
        res = {
            "seconds": st["seconds"],
            "bytes": st["bytes"],
            "entries": st["blocks"],
            "gb_per_s": st["bytes"] / st["seconds"] / 1e9,
        }
        if self.best is None or res["seconds"] < self.best["seconds"]:
            self.best = res


def measure(quick: bool = False) -> dict[str, Any]:
    """Throughput of TP 1->1, 2->1 HND and 2->1 NHD, and the ratios against 1->1."""
    reps = 2 if quick else 6
    rng = np.random.default_rng(1)
    with Fleet() as fleet:
        b = fleet.bootstrap().address
        ranks = [
            {**FAST, "bootstrap": b, "instance": "HND2", "tp_rank": r, "tp_size": 2}
            for r in range(2)
        ]  # one process per prefill TP rank, as in a deployment
        pf, dc, *tp2 = fleet.agents(
            [
                ("prefill", {**FAST, "bootstrap": b, "instance": "tp1"}, _geoms("NHD", 1, 0)),
                ("decode", dict(FAST), _geoms("NHD", 1, 0)),
                *(("prefill", cfg, _geoms("HND", 2, r)) for r, cfg in enumerate(ranks)),
            ],
            env=ENV,
        )
        dc.call(
            "add_endpoint", name="hnd", role="decode", config=dict(FAST), geoms=_geoms("HND", 1, 0)
        )
        for r, (a, cfg) in enumerate(zip(tp2, ranks)):
            a.call(
                "add_endpoint",
                name="nhd",
                role="prefill",
                config={**cfg, "instance": "NHD2"},
                geoms=_geoms("NHD", 2, r),
            )
        cases = [
            _Case([pf], dc, b, ["main"], "tp1", "main", rng),
            _Case(tp2, dc, b, ["main", "main"], "HND2", "hnd", rng),
            _Case(tp2, dc, b, ["nhd", "nhd"], "NHD2", "main", rng),
        ]
        for rep in range(reps):  # interleaved (A B C A B C ...): the VM drifts
            for c in cases:
                c.rep(rep, rng)
        one, hnd, nhd = (c.best for c in cases)
        assert one is not None and hnd is not None and nhd is not None
    out: dict[str, Any] = {
        "hetero_tp.tokens": TOKENS,
        "hetero_tp.layers": LAYERS,
        "hetero_tp.repetitions": reps,
    }
    for name, r in (("tp1_1", one), ("tp2_1_hnd", hnd), ("tp2_1_nhd", nhd)):
        out[f"hetero_tp.{name}.gb_per_s"] = round(r["gb_per_s"], 3)
        out[f"hetero_tp.{name}.entries_per_request"] = r["entries"]
        out[f"hetero_tp.{name}.bytes"] = r["bytes"]
    out["hetero_tp.hnd_ratio"] = round(hnd["gb_per_s"] / one["gb_per_s"], 3)
    out["hetero_tp.nhd_ratio"] = round(nhd["gb_per_s"] / one["gb_per_s"], 3)
    return out


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    """No options of its own: ``--quick`` runs 2 repetitions instead of 6."""


def main(a: argparse.Namespace) -> dict[str, Any]:
    return measure(quick=a.quick)


if __name__ == "__main__":
    from benchmarks.common import runner

    sys.exit(runner.run(sys.modules[__name__]))
