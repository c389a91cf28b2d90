"""Latency of legitimate requests while a third party floods both control ports."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from tests.harness import flood as F


def _stats(prefix: str, lat: list[float]) -> dict[str, Any]:
    a = np.asarray(lat) * 1000
    return {
        f"{prefix}.requests": len(lat),
        f"{prefix}.p50_ms": float(np.percentile(a, 50)),
        f"{prefix}.p90_ms": float(np.percentile(a, 90)),
        f"{prefix}.p99_ms": float(np.percentile(a, 99)),
        f"{prefix}.max_ms": float(a.max()),
    }


def measure(seconds: float) -> dict[str, Any]:
    c = F.start()
    try:
        for i in range(5):
            F.legit(c, seed=1000 + i)  # handshake and warm-up
        base: list[float] = []
        bad = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            dt, b = F.legit(c, seed=len(base))
            base.append(dt)
            bad += b
        under = F.flood_run(c, seconds)
        hellos = F.hello_floods(c)
    finally:
        c.close()
    out: dict[str, Any] = {"flood.seconds": seconds}
    out.update(_stats("flood.off", base))
    out.update(_stats("flood.on", under["latencies"]))
    out["flood.slowdown_p50"] = out["flood.on.p50_ms"] / out["flood.off.p50_ms"]
    out["flood.slowdown_p99"] = out["flood.on.p99_ms"] / out["flood.off.p99_ms"]
    out["flood.bad_bytes"] = bad + under["bad_bytes"]
    out["flood.frames_sent"] = sum(under["sent"].values())
    out.update({f"flood.sent.{k}": v for k, v in sorted(under["sent"].items())})
    mb = 2**20
    out["flood.rss_before_flood_mb"] = hellos["rss_before"] / mb
    out["flood.rss_after_flood_mb"] = hellos["rss_after"] / mb
    out["flood.rss_peak_flood_mb"] = hellos["rss_peak"] / mb
    out["flood.hello_floods_gb"] = hellos["bytes"] / 1e9
    out["flood.hello_floods_s"] = hellos["seconds"]
    out["flood.hello_floods.legit_max_ms"] = max(hellos["latencies"]) * 1000
    out["flood.bad_bytes"] += hellos["bad_bytes"]
    for side in ("pf", "dc"):
        out[f"flood.rss_growth_{side}_mb"] = under[f"rss_growth_{side}"] / 2**20
        out.update({f"flood.{side}.{k}": v for k, v in sorted(under[f"rejected_{side}"].items())})
    return out


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--seconds", type=float, default=None, help="seconds per phase (default 30; --quick 5)"
    )


def main(a: argparse.Namespace) -> dict[str, Any]:
    return measure(a.seconds or (5.0 if a.quick else 30.0))


def passed(res: dict[str, Any]) -> bool:
    return res["flood.bad_bytes"] == 0


if __name__ == "__main__":
    from benchmarks.common import runner

    sys.exit(runner.run(sys.modules[__name__]))
