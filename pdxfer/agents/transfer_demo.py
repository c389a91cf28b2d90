"""Move one request's KV cache from a prefill process to a decode process and report it.

A bootstrap server runs here; the prefill and decode endpoints run in two separate processes
and talk over real ZMQ sockets and Mooncake Transfer Engine (TCP, loopback). Every byte that
lands on the decode side is checked against the pattern the prefill wrote.

    pdxfer transfer-demo --tokens 4096 --layers 8      (or: python -m pdxfer.agents.transfer_demo ...)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import numpy as np

from ..bootstrap import BootstrapServer
from ..serving.cli_args import add_field_args
from ..setting import setting, settings_of
from .patterns import PoolGeom
from .process import Agent


@dataclass(frozen=True, slots=True)
class TransferDemoOptions:
    """The options of ``pdxfer transfer-demo`` (its flags are generated from these fields)."""

    tokens: int = setting(4096, "tokens in the request")
    layers: int = setting(8, "model layers")
    heads: int = setting(8, "KV heads")
    head_dim: int = setting(128, "head dimension")
    page_size: int = setting(64, "tokens per page")
    chunks: int = setting(4, "prefill chunks sent as they finish")
    json: bool = setting(False, "print the summary as JSON only")


def parser() -> argparse.ArgumentParser:
    """The options of ``pdxfer transfer-demo``."""
    ap = argparse.ArgumentParser(prog="pdxfer transfer-demo", description=__doc__.split("\n")[0])
    add_field_args(ap, TransferDemoOptions, *settings_of(TransferDemoOptions))
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)

    pages = -(-a.tokens // a.page_size)
    geoms = [
        PoolGeom(
            "kv",
            "mha",
            layers=a.layers,
            pages=pages * 2,
            page_size=a.page_size,
            heads=a.heads,
            head_dim=a.head_dim,
            dtype="float16",
        ),
        PoolGeom("aux", "slots", layers=1, pages=4, dim=64, dtype="int32"),
    ]
    say = (lambda *x: None) if a.json else (lambda *x: print(*x, flush=True))
    rng = np.random.default_rng(0)
    src = rng.permutation(pages * 2)[:pages].tolist()
    dst = rng.permutation(pages * 2)[:pages].tolist()
    room = int(rng.integers(1, 1 << 62))
    cuts = np.linspace(0, pages, a.chunks + 1).astype(int)
    chunks = [
        {"pages": {"kv": src[x:y]}, "last": i == a.chunks - 1}
        for i, (x, y) in enumerate(zip(cuts, cuts[1:]))
    ]
    chunks[-1]["slots"] = {"aux": 1}

    with BootstrapServer().start() as srv:
        say(f"bootstrap server on {srv.address}; starting prefill and decode processes ...")
        pf = Agent("prefill", {"bootstrap": srv.address}, geoms)
        dc = Agent("decode", {}, geoms)
        try:
            pf.call(
                "prepare",
                items=[
                    {
                        "room": room,
                        "pages": {"kv": src},
                        "slots": {"aux": 1},
                        "num_tokens": a.tokens,
                    }
                ],
            )
            dc.call("sentinel")
            item = {"room": room, "dst": {"kv": dst}, "slots": {"aux": 2}, "num_tokens": a.tokens}
            t0 = time.perf_counter()
            dc.call("recv", items=[item], bootstrap=srv.address)
            pf.call("send", items=[{"room": room, "chunks": chunks}])
            out = dc.call("wait", rooms=[room], timeout=120)[room]
            wall = time.perf_counter() - t0
            bad, first = dc.call("verify", items=[item])[room]
            m = pf.call("metrics")
        finally:
            pf.close()
            dc.close()

    nbytes = out.get("stats", {}).get("bytes", 0)
    secs = out.get("stats", {}).get("seconds") or wall
    summary = {
        "state": out["state"],
        "failure": out["failure"],
        "tokens": a.tokens,
        "layers": a.layers,
        "bytes": nbytes,
        "transport_entries": m["transport_entries"],
        "transport_calls": m["transport_calls"],
        "chunks": a.chunks,
        "seconds_request_to_success": round(secs, 4),
        "gb_per_s": round(nbytes / secs / 1e9, 3),
        "bytes_wrong": bad,
    }
    if a.json:
        print(json.dumps(summary))
    else:
        say("")
        say(f"request {room}: {out['state']}" + (f" ({out['failure']})" if out["failure"] else ""))
        say(
            f"  moved     {nbytes / 2**20:.1f} MiB of KV ({a.tokens} tokens x {a.layers} layers "
            f"x K,V, {pages} scattered pages of {a.page_size}) + 1 aux row"
        )
        say(
            f"  entries   {m['transport_entries']} transport entries in "
            f"{m['transport_calls']} calls ({a.chunks} chunks)"
        )
        say(f"  time      {secs * 1e3:.1f} ms from request to Success ({summary['gb_per_s']} GB/s)")
        say(f"  verified  {'every byte right' if bad == 0 else f'{bad} bytes WRONG: {first}'}")
    return 0 if out["state"] == "Success" and bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
