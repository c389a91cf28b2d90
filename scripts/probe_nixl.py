#!/usr/bin/env python
"""NIXL/UCX's own ceiling on one host, apart from pdxfer: the same scattered pages written by
memcpy, by raw CMA (``process_vm_writev``, what UCX uses here) on one and two threads, and
by bare NIXL agents (the copy on the posting thread, or split across UCX threads), variants
interleaved; plus the idle CPU of an agent whose progress thread spins (NIXL's Python
default, a 0 delay) or sleeps between events (pdxfer's, ``PDXFER_NIXL_TICK_US``).

    python scripts/probe_nixl.py [--quick] [--json out.json]

A writer process (this one) and a target process holding the destination; every figure is
GB/s of 128 KiB pages scattered on both sides (2,048 pages, 256 MiB: the bulk request of
``bench_transfer.py``), medians of interleaved rounds.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdxfer.transport import nixl as pnixl  # noqa: E402

PAGE = 128 << 10


class _Iov(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _cpu_ticks() -> int:
    t = 0
    for p in glob.glob("/proc/self/task/*/stat"):
        try:
            f = Path(p).read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        t += int(f[11]) + int(f[12])
    return t


def _target(conn: Any, pages: int) -> None:
    """Holds the destination (twice the pages, written scattered) in a pdxfer-made agent."""
    nixl = pnixl._load()
    agent = pnixl._agent(nixl, "target", ("UCX",), 1)
    dst = np.zeros(pages * 2 * PAGE, np.uint8)
    dst[::4096] = 1  # resident, as a real pool is
    agent.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    conn.send((os.getpid(), dst.ctypes.data, agent.get_agent_metadata()))
    while (m := conn.recv()) != "stop":
        idx, first = m  # page idx of the destination must hold first's pattern
        conn.send(bool((dst[idx * PAGE : (idx + 1) * PAGE] == first % 251).all()))


def _idle(tick_default: bool, seconds: float) -> float:
    """Cores one idle agent burns (this process's other threads are idle meanwhile)."""
    nixl = pnixl._load()
    if tick_default:
        a = nixl.nixl_agent(
            f"idle-{time.monotonic_ns()}",
            nixl.nixl_agent_config(
                backends=["UCX"], sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
            ),
        )
    else:
        a = pnixl._agent(nixl, f"idle-{time.monotonic_ns()}", ("UCX",), 1)
    time.sleep(0.5)
    c = _cpu_ticks()
    time.sleep(seconds)
    cores = (_cpu_ticks() - c) / os.sysconf("SC_CLK_TCK") / seconds
    del a
    return cores


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    n = 2048
    rounds = 5 if a.quick else 15
    out: dict[str, Any] = {
        "quick": a.quick,
        "cpus": os.cpu_count(),
        "pages": n,
        "page_bytes": PAGE,
        "load.before": os.getloadavg()[0],
    }
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(there, n), daemon=True)
    proc.start()
    pid, daddr, md = here.recv()
    total = n * PAGE
    src = np.empty(total, np.uint8)
    for i in range(n):
        src[i * PAGE : (i + 1) * PAGE] = i % 251
    rng = np.random.default_rng(0)
    sp = rng.permutation(n)  # source page of the i-th write
    dp = rng.permutation(2 * n)[:n]  # its destination page
    copy = np.zeros(total, np.uint8)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    liov = (_Iov * n)(*[_Iov(src.ctypes.data + int(s) * PAGE, PAGE) for s in sp])
    riov = (_Iov * n)(*[_Iov(daddr + int(d) * PAGE, PAGE) for d in dp])
    pool = ThreadPoolExecutor(2)

    def cma(lo: int, hi: int) -> None:
        for b in range(lo, hi, 1024):  # IOV_MAX
            k = min(1024, hi - b)
            got = libc.process_vm_writev(
                pid, ctypes.byref(liov, b * 16), k, ctypes.byref(riov, b * 16), k, 0
            )
            if got != k * PAGE:
                raise OSError(ctypes.get_errno(), "process_vm_writev")

    nixl = pnixl._load()
    ld = np.stack(
        [
            src.ctypes.data + np.arange(n, dtype=np.int64) * PAGE,
            np.full(n, PAGE),
            np.zeros(n, np.int64),
        ],
        1,
    ).astype(np.uint64)
    rd = np.stack(
        [
            daddr + np.arange(2 * n, dtype=np.int64) * PAGE,
            np.full(2 * n, PAGE),
            np.zeros(2 * n, np.int64),
        ],
        1,
    ).astype(np.uint64)

    def nixl_writer(threads: int) -> Any:
        ag = pnixl._agent(nixl, f"writer{threads}", ("UCX",), threads)
        ag.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
        ag.add_remote_agent(md)
        lh = ag.prep_xfer_dlist("NIXL_INIT_AGENT", ld, "DRAM")
        rh = ag.prep_xfer_dlist("target", rd, "DRAM")
        li, ri = sp.astype(np.int32), dp.astype(np.int32)

        def write() -> None:
            h = ag.make_prepped_xfer("WRITE", lh, li, rh, ri)
            st, delay = ag.transfer(h), 20e-6
            while st == "PROC":
                time.sleep(delay)
                delay = min(delay * 1.5, 500e-6)
                st = ag.check_xfer_state(h)
            ag.release_xfer_handle(h)
            if st != "DONE":
                raise RuntimeError(f"NIXL write ended {st}")

        return write

    variants = {
        "memcpy": lambda: np.copyto(copy, src),
        "cma_1_thread": lambda: cma(0, n),
        "cma_2_threads": lambda: list(pool.map(lambda r: cma(*r), [(0, n // 2), (n // 2, n)])),
        "nixl_posting_thread": nixl_writer(1),
        "nixl_2_ucx_threads": nixl_writer(2),
    }
    for f in variants.values():
        f()
    gbps: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for k, f in variants.items():
            t = time.perf_counter()
            f()
            gbps[k].append(total / (time.perf_counter() - t) / 1e9)
    bad = 0
    for i in (0, n // 2, n - 1):
        here.send((int(dp[i]), int(sp[i])))
        bad += not here.recv()
    here.send("stop")
    proc.join(10)
    mc = statistics.median(gbps["memcpy"])
    for k, v in gbps.items():
        out[f"{k}.gbps"] = statistics.median(v)
        out[f"{k}.gbps_min_max"] = [min(v), max(v)]
        out[f"{k}.fraction_of_memcpy"] = statistics.median(v) / mc
    out["pages_wrong"] = bad
    idle = 2.0 if a.quick else 5.0
    out["idle_cores.nixl_default"] = _idle(True, idle)
    out["idle_cores.pdxfer"] = _idle(False, idle)
    out["load.after"] = os.getloadavg()[0]
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        a.json.write_text(text + "\n")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
