"""Time to ready of a request whose prefix the decode already holds, against a full transfer."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

from benchmarks.common.fleet import Fleet
from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent

X = "tests.harness.tier_cmds:"


def _run_one(
    pf: Agent,
    dc: Agent,
    boot: str,
    room: int,
    tokens: list[int],
    src: list[int],
    dst: list[int],
    n: int,
) -> dict[str, Any]:
    pf.call(
        "send",
        items=[
            {"room": room, "chunks": [{"pages": {"kv": src}, "slots": {"aux": 0}, "last": True}]}
        ],
    )
    dc.call(
        "ext",
        fn=X + "recv",
        bootstrap=boot,
        instance="default",
        items=[
            {
                "room": room,
                "tokens": tokens,
                "dst": {"kv": dst},
                "slots": {"aux": 1},
                "num_tokens": n,
            }
        ],
    )
    out = dc.call("ext", fn=X + "wait", rooms=[room])[room]
    dc.call("ext", fn=X + "forget", rooms=[room])
    if out["state"] != "Success":
        raise RuntimeError(f"room {room}: {out['failure']}")
    return out


def measure(quick: bool = False) -> dict[str, Any]:
    """``incremental.l2_ratio`` / ``incremental.l3_file_ratio``: median time to ready with 90%
    of the prefix in L2 / L3 files, over the median time of the same request in full."""
    n, layers, ps = 4096, 8, 64
    heads = 2 if quick else 8
    reps = 3 if quick else 11
    pages = n // ps
    geoms = [
        PoolGeom(
            "kv",
            "mha",
            layers=layers,
            pages=2 * pages,
            page_size=ps,
            heads=heads,
            head_dim=128,
            dtype="float16",
        ),
        PoolGeom("aux", "slots", layers=1, pages=4, dim=16, dtype="int32"),
    ]
    rng = np.random.default_rng(0)
    shared = int(n * 0.9)
    base = rng.integers(0, 1 << 20, n).tolist()
    src = list(range(pages))
    parent_dst, child_dst = list(range(pages)), list(range(pages, 2 * pages))
    room = int(rng.integers(1, 1 << 40))
    times: dict[str, list[float]] = {"full": [], "l2": [], "l3_file": []}
    net: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="pdxfer-l3-") as root, Fleet() as fleet:
        srv = fleet.bootstrap()
        conf = {"bootstrap_timeout_s": 30.0, "transfer_timeout_s": 60.0, "transport": "tcp"}
        pf, dc = fleet.agents(
            [("prefill", {**conf, "bootstrap": srv.address}, geoms), ("decode", conf, geoms)]
        )
        pf.call(
            "ext",
            fn=X + "prepare",
            items=[
                {
                    "room": room,
                    "pages": {"kv": src},
                    "slots": {"aux": 0},
                    "segments": [(room, 0, n)],
                }
            ],
        )
        dc.call("ext", fn=X + "storage", name="file", kind="file", root=root)
        dc.call("ext", fn=X + "setup", host_pages=pages + 8, model_id="bench-pattern", use="file")
        _run_one(pf, dc, srv.address, room, base, src, parent_dst, n)
        copy_gbps: list[float] = []
        st = dc.call("ext", fn=X + "report")["stats"]
        copied = (st["l1_copy_bytes"], st["l1_copy_us"])
        dc.call(
            "ext",
            fn=X + "write_back",
            items=[{"tokens": base, "dst": {"kv": parent_dst}, "num_tokens": n}],
        )
        for kind in ("full", "l2", "l3_file") * reps:
            room += 1
            if kind == "full":
                toks = rng.integers(0, 1 << 20, n).tolist()
            else:
                toks = base[:shared] + rng.integers(0, 1 << 20, n - shared).tolist()
            if kind == "l3_file":
                dc.call("ext", fn=X + "clear_l2")
            out = _run_one(pf, dc, srv.address, room, toks, src, child_dst, n)
            times[kind].append(out["stats"]["seconds"])
            if os.environ.get("BENCH_DEBUG"):
                print(kind, out["stats"], file=sys.stderr)
            net[kind] = out["stats"]["net_bytes"]
            st = dc.call("ext", fn=X + "report")["stats"]
            if kind == "l2":  # this restore's L2 -> L1 copy alone
                copy_gbps.append(
                    (st["l1_copy_bytes"] - copied[0])
                    / max(1e-9, (st["l1_copy_us"] - copied[1]) * 1e-6)
                    / 1e9
                )
            copied = (st["l1_copy_bytes"], st["l1_copy_us"])
            if kind == "l3_file":  # the parent back into L2 for the next L2 round
                dc.call(
                    "ext",
                    fn=X + "write_back",
                    items=[{"tokens": base, "dst": {"kv": parent_dst}, "num_tokens": n}],
                )
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "incremental.l2_ratio": round(med["l2"] / med["full"], 3),
        "incremental.l3_file_ratio": round(med["l3_file"] / med["full"], 3),
        "incremental.full_ms": round(med["full"] * 1e3, 2),
        "incremental.l2_ms": round(med["l2"] * 1e3, 2),
        "incremental.l3_file_ms": round(med["l3_file"] * 1e3, 2),
        "incremental.full_net_bytes": net["full"],
        "incremental.l2_net_bytes": net["l2"],
        "incremental.l2_copy_gbps": round(statistics.median(copy_gbps), 2),
        "incremental.tokens": n,
        "incremental.layers": layers,
        "incremental.prefix_fraction": 0.9,
        "incremental.reps": reps,
        "incremental.quick": quick,
    }


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    """No options of its own: ``--quick`` uses 2 KV heads and 3 repetitions (8 and 11)."""


def main(a: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    t0 = time.monotonic()
    res = measure(quick=a.quick)
    res["incremental.wall_s"] = round(time.monotonic() - t0, 1)
    return res


if __name__ == "__main__":
    from benchmarks.common import runner

    sys.exit(runner.run(sys.modules[__name__]))
