#!/usr/bin/env python
"""Flame graphs of one small request at a time, both sides (what ``small.fixed_cost_ms`` is).

    python scripts/profile_small.py [--requests 1000] [--out docs/assets/profile_small]
        [--summary benchmarks/results/profile_small.txt]

A pdxfer prefill and decode on Mooncake TCP (the bench geometry: 128-token requests, 64
buffers of 128 KiB pages, integrity ``sampled``) serve requests one at a time, the decode's
request already at the prefill, as ``benchmarks/transfer.py``'s fixed cost does. py-spy
samples both agent processes without stopping them (Python frames only; idle threads left
out) and writes ``<out>_prefill.svg`` and ``<out>_decode.svg`` (pages link them), plus a
text summary (``--summary``): per side, the share of active samples under each pdxfer function.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from benchmarks import transfer as B  # noqa: E402
from pdxfer.agents.process import Agent  # noqa: E402
from pdxfer.bootstrap import BootstrapServer  # noqa: E402


def _spy(pid: int, fmt: str, path: Path, rate: int) -> subprocess.Popen[bytes]:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return subprocess.Popen(
        [
            exe,
            "record",
            "--pid",
            str(pid),
            "--rate",
            str(rate),
            "--nonblocking",
            "--format",
            fmt,
            "-o",
            str(path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


WAITS = (
    "Poller.poll",
    "Event.wait",
    "Condition.wait",
    "_recv_bytes",
    "_recv ",
    "select ",
    "SimpleQueue.get",
    "sleep",
    "Connection._poll",
    "wait ",
)
"""Leaf frames of a thread that waits (py-spy cannot always tell from outside)."""


def summary(raw: Path, top: int = 25) -> list[str]:
    """Share of active samples under each pdxfer function (a frame counted once per stack;
    stacks that end in a wait are left out)."""
    per: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        leaf = stack.rsplit(";", 1)[-1]
        if any(w in leaf for w in WAITS):
            continue
        total += int(n)
        seen = set()
        for f in stack.split(";"):
            if "pdxfer/" in f:
                name = f.split(" (")[0]
                if name not in seen:
                    seen.add(name)
                    per[name] += int(n)
    return [f"{total} active samples"] + [
        f"{100 * c / max(1, total):5.1f}%  {name}" for name, c in per.most_common(top)
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rate", type=int, default=1000, help="py-spy samples per second")
    ap.add_argument(
        "--out",
        type=Path,
        default=ROOT / "docs" / "assets" / "profile_small",
        help="prefix of the two flame graphs (<out>_prefill.svg, <out>_decode.svg)",
    )
    ap.add_argument(
        "--summary",
        type=Path,
        default=ROOT / "benchmarks" / "results" / "profile_small.txt",
        help="the text summary: each side's share of samples per function",
    )
    a = ap.parse_args(argv)
    b = B.Bench(False)
    b.srv = BootstrapServer("127.0.0.1", port=0).start()
    cfg = {
        "bootstrap": b.srv.address,
        "transfer_timeout_s": 60.0,
        "bootstrap_timeout_s": 60.0,
        "transport": "tcp",
    }
    b.pf = Agent("prefill", cfg, B.geoms(B.PF_PAGES), state=B.STATE)
    b.dc = Agent("decode", cfg, B.geoms(B.DC_PAGES), state=B.STATE)
    spies: list[subprocess.Popen[bytes]] = []
    raws: dict[str, Path] = {}
    src = b.src_perm[:2]
    lines = []
    try:
        b.pf.call("prepare", items=[{"room": b.seed_room, "pages": {"kv": src}, "num_tokens": 128}])
        for _ in range(20):  # warm: handshake, lanes, route cache, sample plans
            b.pdx_send_once(128, src, b.rng.choice(B.DC_PAGES, 2, replace=False).tolist())
        for side, agent in (("prefill", b.pf), ("decode", b.dc)):
            raws[side] = a.out.with_name(f"{a.out.name}_{side}.raw")
            spies.append(
                _spy(
                    agent.proc.pid,
                    "flamegraph",
                    a.out.with_name(f"{a.out.name}_{side}.svg"),
                    a.rate,
                )
            )
            spies.append(_spy(agent.proc.pid, "raw", raws[side], a.rate))
        time.sleep(2)  # py-spy attached
        fixed = []
        t0 = time.monotonic()
        for _ in range(a.requests):
            dst = b.rng.choice(B.DC_PAGES, 2, replace=False).tolist()
            fixed.append(b.pdx_send_once(128, src, dst) - b.last_write_s)
        fixed.sort()
        lines.append(
            f"{a.requests} requests in {time.monotonic() - t0:.1f} s; fixed cost "
            f"median {fixed[len(fixed) // 2] * 1e3:.3f} ms (send() to Success "
            f"minus the raw write, under py-spy)"
        )
    finally:
        for s in spies:
            s.send_signal(signal.SIGINT)
        for s in spies:
            s.wait(120)
        b.pf.close()
        b.dc.close()
        b.srv.stop()
    for side, raw in raws.items():
        if raw.exists():
            lines += [
                "",
                f"{side}: share of active samples under each pdxfer function",
                *summary(raw),
            ]
            raw.unlink()
    text = "\n".join(lines) + "\n"
    a.summary.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
