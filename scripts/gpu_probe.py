#!/usr/bin/env python
"""Raw transport ceilings between two processes on one device, with no pdxfer endpoint code:
the figures pdxfer's own bulk (``gpu_check.py bulk``) is compared with.

    python scripts/gpu_probe.py --device cuda:0 [--quick] [--json out.json]

A target process holds the destination; this process writes into it. The shape is the GPU
check's bulk: ``buffers`` buffers (8 layers x K, V), each moving ``per_buffer`` bytes into a
buffer twice as large at random places, as descriptors of 32 KiB (one KV page), 512 KiB
and one per buffer (``dbuf``). Paths: NIXL (UCX) with 1, 2, 4 and 8 UCX threads, prepared
lists, plus one described per call and one posted in pdxfer's batches of 4,096; Mooncake
``tcp`` and ``nvlink_intra`` (GPU, where the wheel has it); the torch IPC ceiling (CUDA IPC,
or shared memory on ``cpu``): pages gathered with ``index_select``, one copy into the
peer's staging buffer, scattered there (``staged``), or written straight into the peer's
pages (``direct``). Every path is checked word for word on the target.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KiB, MiB = 1 << 10, 1 << 20
THREADS = (1, 2, 4, 8)
SEED = 45
UCX_TLS_NAMES = (
    "cuda_ipc",
    "cuda_copy",
    "gdr_copy",
    "cma",
    "posix",
    "sysv",
    "xpmem",
    "tcp",
    "rc_mlx5",
    "dc_mlx5",
    "ud_mlx5",
    "rc_verbs",
    "self",
    "knem",
)


@dataclass(frozen=True, slots=True)
class Shape:
    """What is moved: ``buffers`` x ``per_buffer`` bytes, each buffer twice that large."""

    buffers: int
    per_buffer: int
    reps: int

    @property
    def moved(self) -> int:
        return self.buffers * self.per_buffer

    @property
    def held(self) -> int:
        return 2 * self.moved

    def sizes(self) -> dict[str, int]:
        return {"d32k": 32 * KiB, "d512k": 512 * KiB, "dbuf": self.per_buffer}


def shape_for(quick: bool) -> Shape:
    """GPU: 16 x 32 MiB (512 MiB, the issue's shape); ``--quick``: 16 x 2 MiB (the shape of
    ``gpu_check.py bulk --quick``)."""
    return Shape(16, 2 * MiB, 2) if quick else Shape(16, 32 * MiB, 3)


def placement(s: Shape, desc: int) -> tuple[np.ndarray, np.ndarray]:
    """Global slot numbers (slots of ``desc`` bytes across all buffers) of each descriptor's
    source and destination: per buffer, ``per_buffer / desc`` random slots of twice as many,
    the same in both processes."""
    per = s.per_buffer // desc
    slots = 2 * per
    rng = np.random.default_rng(SEED + desc)
    src = [b * slots + rng.permutation(slots)[:per] for b in range(s.buffers)]
    dst = [b * slots + rng.permutation(slots)[:per] for b in range(s.buffers)]
    return np.concatenate(src).astype(np.int64), np.concatenate(dst).astype(np.int64)


def mooncake_has_nvlink_intra() -> tuple[bool, str]:
    """Whether the installed Mooncake engine was built with its intra-node NVLink transport."""
    from pdxfer.transport import nvlink

    ok = nvlink.built()
    return ok, "" if ok else "this Mooncake build has no nvlink_intra (USE_INTRA_NVLINK)"


@contextlib.contextmanager
def captured(into: list[str]) -> Iterator[None]:
    """This process's stdout and stderr (file descriptors 1 and 2: what C libraries such as
    UCX print) collected into ``into`` and echoed afterwards, so the log keeps them."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            f.seek(0)
            text = f.read().decode(errors="replace")
            into.append(text)
            sys.stderr.write(text)


# -- the target process -------------------------------------------------------------------------
def _target(conn: Any, dev: str, s: Shape, protos: list[str], with_nixl: bool) -> None:
    """Holds the destination (and an IPC staging buffer), registered with a NIXL agent and one
    Mooncake engine per protocol; answers zero / verify / scatter until stop."""
    import torch
    import torch.multiprocessing  # noqa: F401 - tensors travel by IPC handle / shared memory

    from pdxfer.transport import nixl as pnixl

    d = torch.device(dev)
    if d.type == "cuda":
        torch.cuda.set_device(d)
    dst = torch.zeros(s.held, dtype=torch.uint8, device=d)
    stage = torch.zeros(s.moved, dtype=torch.uint8, device=d)
    if d.type == "cpu":
        dst.share_memory_()
        stage.share_memory_()
    md = b""
    if with_nixl:
        agent = pnixl._agent(pnixl._load(), "probe-target", ("UCX",), 1)
        mem = "VRAM" if d.type == "cuda" else "DRAM"
        agent.register_memory([(dst.data_ptr(), s.held, d.index or 0, "")], mem)
        md = agent.get_agent_metadata()
    engines, logs = {}, []
    for p in protos:
        engines[p] = _engine(p, logs)
        rc = engines[p].register_memory(dst.data_ptr(), s.held, dev if d.type == "cuda" else "*")
        assert rc == 0, f"mooncake {p} register_memory returned {rc}"
    conn.send(
        {
            "md": md,
            "addr": dst.data_ptr(),
            "sessions": {p: f"127.0.0.1:{e.get_rpc_port()}" for p, e in engines.items()},
            "dst": dst,
            "stage": stage,
            "logs": logs,
        }
    )
    sync = torch.cuda.synchronize if d.type == "cuda" else (lambda: None)
    while (m := conn.recv())[0] != "stop":
        if m[0] == "zero":
            dst.zero_()
            sync()
            conn.send(True)
        elif m[0] == "verify":  # words of the destination slots that differ from the source's
            desc = m[1]
            src_slots, dst_slots = placement(s, desc)
            w = desc // 8
            got = dst.view(torch.int64).view(-1, w)[torch.from_numpy(dst_slots).to(d)]
            want = (
                torch.from_numpy(src_slots).to(d)[:, None] * w + torch.arange(w, device=d)[None, :]
            )
            conn.send(int((got != want).sum()))
        elif m[0] == "scatter":  # the staged IPC path's last step, on this side
            desc = m[1]
            _, dst_slots = placement(s, desc)
            rows = dst.view(-1, desc)
            rows.index_copy_(0, torch.from_numpy(dst_slots).to(d), stage.view(-1, desc))
            sync()
            conn.send(True)
    conn.send("stopped")


INSTALLED = (
    ("Intra-Node NVLink", "nvlink_intra"),
    ("cross-node NVLink", "nvlink"),
    ("RDMA transport", "rdma"),
    ("type=rdma", "rdma"),
    ("TcpTransport:", "tcp"),
)
"""Mooncake's log lines at initialisation, and the transport each names."""


def installed(lines: list[str]) -> str:
    """Which transport a Mooncake engine's start-up lines say it installed ("" unknown)."""
    return next((t for mark, t in INSTALLED for line in lines if mark in line), "")


def _engine(proto: str, logs: list[str]) -> Any:
    """A raw Mooncake engine (``P2PHANDSHAKE``), its start-up log lines (at INFO) kept:
    which transport a build installs depends on its build flags, the environment and the
    NICs found, not only on the protocol string (``nvlink_intra`` needs
    ``MC_INTRANODE_NVLINK``; an engine without it must not see it). The log level is read
    when the library loads: imported here, after it is set."""
    env = {"MC_INTRANODE_NVLINK": "1" if proto == "nvlink_intra" else None, "MC_LOG_LEVEL": "INFO"}
    old = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    out: list[str] = []
    try:
        from mooncake.engine import TransferEngine

        with captured(out):
            e = TransferEngine()
            rc = e.initialize(
                "127.0.0.1", "P2PHANDSHAKE", "tcp" if proto == "tcp" else "nvlink_intra", ""
            )
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    logs.extend(
        f"{proto}: {line}"
        for line in out[0].splitlines()
        if re.search(r"(?i)transport|nvlink", line)
    )
    if rc != 0:
        raise RuntimeError(f"mooncake initialize({proto}) returned {rc}")
    return e


# -- the writer (this process) --------------------------------------------------------------------
PATHS = ("nixl", "mooncake", "ipc")


class Probe:
    def __init__(self, dev: str, s: Shape, paths: tuple[str, ...] = PATHS) -> None:
        import multiprocessing as mp

        import torch
        import torch.multiprocessing  # noqa: F401 - tensors travel by IPC handle / shared memory

        self.torch = torch
        self.dev, self.s = torch.device(dev), s
        if self.dev.type == "cuda":
            torch.cuda.set_device(self.dev)
        self.gpu = self.dev.type == "cuda"
        self.res: dict[str, Any] = {
            "device": dev,
            "bytes": s.moved,
            "buffers": s.buffers,
            "per_buffer": s.per_buffer,
            "reps": s.reps,
            "split_entries": 0,
        }
        self.protos = ["tcp"] if "mooncake" in paths else []
        built, why = mooncake_has_nvlink_intra()
        if not self.gpu:
            why = "cpu: nvlink_intra moves device memory"
        if self.protos and built and self.gpu:
            self.protos.append("nvlink_intra")
        elif self.protos:
            self.res["mooncake.nvlink_intra.skipped"] = why
        self.src = torch.empty(s.held, dtype=torch.uint8, device=self.dev)
        self.src.view(torch.int64).copy_(torch.arange(s.held // 8, device=self.dev))
        self.stage = torch.empty(s.moved, dtype=torch.uint8, device=self.dev)
        ctx = mp.get_context("spawn")
        self.conn, there = ctx.Pipe()
        self.proc = ctx.Process(
            target=_target, args=(there, dev, s, self.protos, "nixl" in paths), daemon=True
        )
        self.proc.start()
        self.peer = self.conn.recv()
        self.res["mooncake.log"] = self.peer["logs"]
        self.wrong = 0

    def ask(self, *m: Any) -> Any:
        self.conn.send(m)
        return self.conn.recv()

    def sync(self) -> None:
        if self.gpu:
            self.torch.cuda.synchronize()

    def measure(self, key: str, desc: int, fn: Callable[[], None]) -> None:
        """``fn`` (one write of everything) ``reps`` times into a zeroed destination, then
        checked word for word; records the best GB/s and the words that differ."""
        try:
            self.ask("zero")
            best = 0.0
            for _ in range(self.s.reps):
                self.sync()
                t = time.perf_counter()
                fn()
                self.sync()
                best = max(best, self.s.moved / (time.perf_counter() - t) / 1e9)
            bad = self.ask("verify", desc)
        except Exception as e:  # noqa: BLE001 - a failed path is recorded, the rest run
            self.res[f"{key}.error"] = f"{type(e).__name__}: {e}"
            self.res[f"{key}.gb_per_s"] = 0.0
            print(f"{key}: FAILED {e}", file=sys.stderr, flush=True)
            return
        self.wrong += bad
        self.res[f"{key}.gb_per_s"] = round(best, 3)
        self.res[f"{key}.words_wrong"] = bad
        print(f"{key}: {best:.3f} GB/s, {bad} words wrong", file=sys.stderr, flush=True)

    # -- NIXL ---------------------------------------------------------------------------------
    def nixl(self) -> None:
        from pdxfer.transport import nixl as pnixl

        nixl = pnixl._load()
        self.res["split_entries"] = pnixl.SPLIT_ENTRIES
        mem = "VRAM" if self.gpu else "DRAM"
        did = self.dev.index or 0
        src, dst = self.src.data_ptr(), self.peer["addr"]

        def rows(base: int, desc: int) -> np.ndarray:
            n = self.s.held // desc
            return np.stack(
                [base + np.arange(n, dtype=np.int64) * desc, np.full(n, desc), np.full(n, did)], 1
            ).astype(np.uint64)

        def wait(ag: Any, hs: list[Any]) -> None:
            for h in hs:
                st = ag.transfer(h)
                while st == "PROC":
                    time.sleep(20e-6)
                    st = ag.check_xfer_state(h)
                if st != "DONE":
                    raise RuntimeError(f"NIXL write ended {st}")

        for t in THREADS:
            ag = pnixl._agent(nixl, f"probe-w{t}", ("UCX",), t)
            ag.register_memory([(src, self.s.held, did, "")], mem)
            ag.add_remote_agent(self.peer["md"])
            for label, desc in self.s.sizes().items():
                si, di = (x.astype(np.int32) for x in placement(self.s, desc))
                lh = ag.prep_xfer_dlist("NIXL_INIT_AGENT", rows(src, desc), mem)
                rh = ag.prep_xfer_dlist("probe-target", rows(dst, desc), mem)

                def prepped(
                    lo: int = 0,
                    hi: int = si.size,
                    lh: Any = lh,
                    rh: Any = rh,
                    si: np.ndarray = si,
                    di: np.ndarray = di,
                    ag: Any = ag,
                ) -> Any:
                    return ag.make_prepped_xfer("WRITE", lh, si[lo:hi], rh, di[lo:hi])

                def one(prepped: Callable[..., Any] = prepped, ag: Any = ag) -> None:
                    h = prepped()
                    wait(ag, [h])
                    ag.release_xfer_handle(h)

                self.measure(f"nixl.t{t}.{label}", desc, one)
                if t == 1 and label == "d32k":

                    def batched(
                        prepped: Callable[..., Any] = prepped, ag: Any = ag, n: int = si.size
                    ) -> None:
                        for lo in range(0, n, 4096):  # pdxfer's batches, one after another
                            h = prepped(lo, min(n, lo + 4096))
                            wait(ag, [h])
                            ag.release_xfer_handle(h)

                    ls_all, rs_all = rows(src, desc)[si], rows(dst, desc)[di]

                    def per_call(
                        ag: Any = ag, ls_all: np.ndarray = ls_all, rs_all: np.ndarray = rs_all
                    ) -> None:
                        for lo in range(0, len(ls_all), 4096):  # pdxfer's GPU path until now
                            h = ag.initialize_xfer(
                                "WRITE",
                                ag.get_xfer_descs(ls_all[lo : lo + 4096], mem),
                                ag.get_xfer_descs(rs_all[lo : lo + 4096], mem),
                                "probe-target",
                            )
                            wait(ag, [h])
                            ag.release_xfer_handle(h)

                    self.measure("nixl.t1.d32k_batch4096", desc, batched)
                    self.measure("nixl.t1.d32k_per_call", desc, per_call)

    # -- Mooncake -----------------------------------------------------------------------------
    def mooncake(self) -> None:
        logs: list[str] = []
        loc = str(self.dev) if self.gpu else "*"
        for p in self.protos:
            try:
                e = _engine(p, logs)
                rc = e.register_memory(self.src.data_ptr(), self.s.held, loc)
                if rc != 0:
                    raise RuntimeError(f"register_memory returned {rc}")
            except Exception as ex:  # noqa: BLE001 - recorded, the other protocol runs
                self.res[f"mooncake.{p}.error"] = str(ex)
                self.res[f"mooncake.{p}.d32k.gb_per_s"] = 0.0
                continue
            peer = self.peer["sessions"][p]
            for label in ("d32k", "dbuf"):
                desc = self.s.sizes()[label]
                si, di = placement(self.s, desc)
                sl = (self.src.data_ptr() + si * desc).tolist()
                dl = (self.peer["addr"] + di * desc).tolist()

                def write(
                    sl: list[int] = sl,
                    dl: list[int] = dl,
                    desc: int = desc,
                    e: Any = e,
                    peer: str = peer,
                ) -> None:
                    for lo in range(0, len(sl), 1024):  # more per peer can wedge its lane
                        n = len(sl[lo : lo + 1024])
                        rc = e.batch_transfer_sync_write(
                            peer, sl[lo : lo + 1024], dl[lo : lo + 1024], [desc] * n
                        )
                        if rc != 0:
                            raise RuntimeError(f"batch_transfer_sync_write returned {rc}")

                self.measure(f"mooncake.{p}.{label}", desc, write)
        every = logs + self.res["mooncake.log"]
        for p in self.protos:  # what each engine says it installed, here and at the target
            self.res[f"mooncake.{p}.installed"] = installed(
                [x for x in every if x.startswith(f"{p}: ")]
            )
        self.res["mooncake.log"] = every[-12:]

    # -- torch IPC ----------------------------------------------------------------------------
    def ipc(self) -> None:
        torch = self.torch
        desc = 32 * KiB
        si, di = (torch.from_numpy(x).to(self.dev) for x in placement(self.s, desc))
        src_rows = self.src.view(-1, desc)
        stage = self.stage.view(-1, desc)
        peer_stage, peer_rows = self.peer["stage"].view(-1, desc), self.peer["dst"].view(-1, desc)
        self.res["ipc.kind"] = "cuda_ipc" if self.gpu else "shared_memory"

        def staged() -> None:
            torch.index_select(src_rows, 0, si, out=stage)
            peer_stage.copy_(stage)
            self.sync()
            self.ask("scatter", desc)

        def direct() -> None:
            torch.index_select(src_rows, 0, si, out=stage)
            peer_rows.index_copy_(0, di, stage)

        self.measure("ipc.staged.d32k", desc, staged)
        self.measure("ipc.direct.d32k", desc, direct)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ask("stop")
        self.proc.join(10)


def best_raw(res: dict[str, Any]) -> tuple[str, float]:
    """The fastest raw path in pdxfer's shape (32 KiB pages): ``(key, GB/s)``."""
    figs = {
        k[: -len(".gb_per_s")]: v
        for k, v in res.items()
        if k.endswith(".gb_per_s") and ".d32k" in k and isinstance(v, (int, float))
    }
    if not figs:
        return "", 0.0
    k = max(figs, key=lambda x: figs[x])
    return k, float(figs[k])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--quick", action="store_true", help="16 x 2 MiB, 2 reps")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--paths", default=",".join(PATHS), help=f"some of {PATHS}")
    a = ap.parse_args(argv)
    paths = tuple(x for x in a.paths.split(",") if x)
    if not paths or set(paths) - set(PATHS):
        ap.error(f"--paths: some of {PATHS}")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("UCX_PROTO_INFO", "y")  # UCX prints the transport of each put
    t0 = time.monotonic()
    p = Probe(a.device, shape_for(a.quick), paths)
    res = p.res
    res["setup_s"] = round(time.monotonic() - t0, 2)
    for name in paths:
        t = time.monotonic()
        out: list[str] = []
        try:
            if name == "nixl":
                with captured(out):
                    p.nixl()
            else:
                getattr(p, name)()
        except Exception as e:  # noqa: BLE001 - a path that cannot start is recorded
            res[f"{name}.error"] = f"{type(e).__name__}: {e}"
        res[f"{name}.seconds"] = round(time.monotonic() - t, 2)
        if out:
            seen = sorted({w for w in UCX_TLS_NAMES if re.search(rf"\b{w}\b", out[0])})
            res["nixl.ucx_proto.transports"] = seen
            res["nixl.ucx_proto.cuda_ipc"] = "cuda_ipc" in seen
    p.close()
    res["words_wrong"] = p.wrong
    res["best_raw.path"], res["best_raw.gb_per_s"] = best_raw(res)
    # a raw path that fails is recorded (``*.error``) without failing the step: it measures
    res["errors"] = sorted(k for k in res if k.endswith(".error"))
    res["ok"] = p.wrong == 0 and res["best_raw.gb_per_s"] > 0
    res["wall_s"] = round(time.monotonic() - t0, 2)
    text = json.dumps(res, indent=1, sort_keys=True, default=str)
    if a.json:
        a.json.write_text(text)
    print(text, flush=True)
    os._exit(0 if res["ok"] else 1)  # NIXL agents can crash an interpreter's exit


if __name__ == "__main__":
    main()
