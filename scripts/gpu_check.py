"""The steps of ``scripts/gpu_check.sh``: pdxfer between two processes on one GPU.

Each step runs in its own process (the shell bounds it with ``timeout``) and writes a JSON of
flat dotted keys; the shell folds the parts and its step records into one file. The
steps reuse the suite's harness: ``harness.Agent`` processes with patterned pools, the
request factory of ``tests/integration/helpers.py``, the TP groups of ``hetero.py``, the tier
commands of ``tiers_helpers.py``; the pools only move to ``--device`` (``cuda:0`` there,
``cpu`` for ``gpu_check.sh --cpu`` here, which keeps this file tested).

    python scripts/gpu_check.py STEP --device cuda:0 --transport tcp --json OUT.json

Steps: ``transfers`` (per transport, ``tcp``: Mooncake TCP, ``nixl``: NIXL over UCX) runs
these checks on one prefill process and one decode process, each check adding the endpoints
it needs; a failed check is recorded and the next one runs:

* ``pages``: scattered, chunked requests over six pools (fp16/bf16/fp32 MHA, MLA-like paged,
  slots) land byte-exact in device pages; no page outside them changes.
* ``landing_host``: a prefill on the device, a decode whose pools are host memory (what
  ``--kv-landing host`` does), byte-exact.
* ``hetero``: two TP ranks of a prefill (half the heads each) into one TP 1 decode, HND
  pages, all on the device, byte-exact.
* ``integrity``: ``sampled`` and ``full``, decode on the device and on the host: every
  request passes (the digest the sender computes on the device equals the receiver's, on the
  device or the host); a page corrupted on the host decode fails its request as
  ``integrity`` (pdxfer's fault injection damages host pages only, so the corruption is
  checked where a device digest meets a host one; ``tests/gpu`` flips a device byte).
* ``l2_restore``: a decode with device pools and an L2: a request written back, then a child
  sharing 90% of its prefix restores it from L2 into device pages (only the suffix crosses
  the wire), byte-exact.
``bulk`` (all transports in one process): GB/s of one large request per transport (``nvlink``:
  Mooncake's nvlink_intra, on a GPU where the wheel has it), beside torch's device-to-device
  copy and pinned host-to-device copy of as many bytes, interleaved; with ``--raw`` (the JSON
  of ``gpu_probe.py``, the raw paths in the same shape) the best of them against the best
  raw path (``pdxfer_ratio_vs_best_raw``) and against the device copy.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's helpers

from pdxfer.agents.patterns import PoolGeom  # noqa: E402
from pdxfer.agents.process import Agent  # noqa: E402
from pdxfer.bootstrap import BootstrapServer  # noqa: E402
from tests.integration.conftest import FAST  # noqa: E402
from tests.integration.helpers import SIX_POOLS as GEOMS  # noqa: E402
from tests.integration.helpers import Factory, decode_items, run, verify  # noqa: E402
from tests.integration.hetero import Group, run_groups, tp_group  # noqa: E402
from tests.integration.tiers_helpers import MODEL, Family, X, finish, start, write_back  # noqa: E402

STATE = "benchmarks.common.bench_agent:BenchState"
CONF = {**FAST, "bootstrap_timeout_s": 30.0, "transfer_timeout_s": 60.0, "heartbeat_s": 2.0}
"""The suite's short deadlines, but room for a starved host: no check here is about a
deadline or liveness (on 2 cores at a load of 40-60, a NIXL HelloAck took over 5 s, and a
decode's 0.25 s heartbeat declared its busy prefill hung)."""
STEPS = ("transfers", "bulk")


def on(geoms: list[PoolGeom], device: str) -> list[PoolGeom]:
    return [dataclasses.replace(g, device=device) for g in geoms]


@contextlib.contextmanager
def agents(*specs: tuple[str, dict[str, Any], list[PoolGeom]]) -> Iterator[list[Agent]]:
    """Agents started side by side (each start imports torch, the cost of a step on a small
    host), all closed at exit, also side by side (each exit waits on its transport's
    teardown). Mooncake's log level comes from this process's environment (``main``):
    ``Agent(env=...)`` would set it around each start, not safe from threads."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futs = [
            pool.submit(Agent, role, {**CONF, **conf}, geoms, state=STATE)
            for role, conf, geoms in specs
        ]
        done = [f.exception() is None for f in futs]
        out = [f.result() for f, ok in zip(futs, done) if ok]
        try:
            if not all(done):
                raise next(f.exception() for f in futs if f.exception() is not None)
            yield out
        finally:
            list(pool.map(lambda a: a.close(), out))


@dataclasses.dataclass
class Rig:
    """One prefill and one decode process; each check adds the endpoints it needs."""

    dev: str
    transport: str
    boot: str
    pf: Agent
    dc: Agent

    def endpoint(self, agent: Agent, name: str, geoms: list[PoolGeom], **conf: Any) -> Group:
        role = "prefill" if agent is self.pf else "decode"
        cfg = {**CONF, "transport": self.transport, **conf}
        if role == "prefill":
            cfg.update(bootstrap=self.boot, instance=name)
        agent.call("add_endpoint", name=name, role=role, config=cfg, geoms=geoms)
        if role == "decode":
            agent.call("sentinel", ep=name)
        return Group(agent, [name], name)


def _exact(outs: dict[int, Any], checks: dict[int, Any]) -> dict[str, Any]:
    states = [o["state"] for o in outs.values()]
    wrong = sum(c[0] for c in checks.values())
    first = next((c[1] for c in checks.values() if c[0]), "")
    fails = [o["failure"] for o in outs.values() if o["state"] != "Success"]
    return {
        "requests": len(states),
        "success": states.count("Success"),
        "bytes_wrong": wrong,
        "first_wrong": first,
        "first_failure": fails[0] if fails else "",
        "ok": states.count("Success") == len(states) and wrong == 0,
    }


SIZES = [(16, 1), (17, 1), (100, 3), (257, 4), (500, 7), (64, 2), (1, 1), (333, 5)]


def check_pages(rig: Rig) -> dict[str, Any]:
    """test_transfer's pools and requests, every pool on the device, chunked and scattered."""
    pf, dc = rig.pf, rig.dc
    dc.call("sentinel")
    g = on(GEOMS, rig.dev)
    f = Factory(g, g, seed=7)
    reqs = [f.make(n, chunks=c) for n, c in SIZES]
    res = _exact(run(pf, dc, rig.boot, reqs), verify(dc, reqs))
    exclude = {
        "kv": [p for r in reqs for p in r["dst"]["kv"]],
        "mla": [p for r in reqs for p in r["dst"]["mla"]],
        "aux": [r["dst_slots"]["aux"] for r in reqs],
    }
    res["untouched_bytes_changed"] = dc.call("untouched", exclude=exclude)
    res["bytes"] = dc.call("metrics").get("bytes", 0)
    res["ok"] = res["ok"] and res["untouched_bytes_changed"] == 0
    return res


def check_landing_host(rig: Rig) -> dict[str, Any]:
    """The same requests from the device prefill into a decode's host pools."""
    src, dst = on(GEOMS, rig.dev), on(GEOMS, "cpu")
    dg = rig.endpoint(rig.dc, "host", dst)
    f = Factory(src, dst, seed=8)
    reqs = [f.make(n, chunks=c) for n, c in SIZES]
    outs = run_groups(Group(rig.pf, ["main"]), dg, rig.boot, reqs, timeout=60)
    res = _exact(outs[0], dg.each("verify", items=decode_items(reqs))[0])
    exclude = {
        "kv": [p for r in reqs for p in r["dst"]["kv"]],
        "mla": [p for r in reqs for p in r["dst"]["mla"]],
        "aux": [r["dst_slots"]["aux"] for r in reqs],
    }
    res["untouched_bytes_changed"] = rig.dc.call("untouched", exclude=exclude, ep="host")
    res["ok"] = res["ok"] and res["untouched_bytes_changed"] == 0
    return res


KV = PoolGeom("kv", "mha", layers=2, pages=512, page_size=16, heads=4, head_dim=16, total_heads=4)
AUX = PoolGeom("aux", "slots", layers=1, pages=256, dim=8, dtype="int32")


def check_hetero(rig: Rig) -> dict[str, Any]:
    """Two TP ranks (half the heads each) into one TP 1 decode, HND pages, on the device."""
    src = dst = on([dataclasses.replace(KV, layout="HND"), AUX], rig.dev)
    saved = dict(FAST)
    FAST.update(CONF, transport=rig.transport)  # tp_group's endpoints take the suite's FAST
    try:
        pg = tp_group(rig.pf, "prefill", "tp2", src, 2, rig.boot, "tp2")
    finally:
        FAST.clear()
        FAST.update(saved)
    dg = rig.endpoint(rig.dc, "het", dst)
    f = Factory(src, dst, seed=3)
    reqs = [f.make(n, chunks=1 + i % 3) for i, n in enumerate([16, 33, 100, 257, 1])]
    outs = run_groups(pg, dg, rig.boot, reqs, timeout=60)
    return _exact(outs[0], dg.each("verify", items=decode_items(reqs))[0])


def check_integrity(rig: Rig) -> dict[str, Any]:
    """``sampled`` and ``full`` from a device prefill into a device and a host decode; then
    pages corrupted on the host decode (after the write, before the check) are caught."""
    src = on([KV, AUX], rig.dev)
    pg = rig.endpoint(rig.pf, "ik", src)
    decodes = {
        "device": rig.endpoint(rig.dc, "idev", src),
        "host": rig.endpoint(rig.dc, "ihost", on([KV, AUX], "cpu")),
    }
    res: dict[str, Any] = {}
    ok = True
    for mode in ("sampled", "full"):
        for where, dg in decodes.items():
            ep = dg.names[0]
            rig.dc.call("set_integrity", mode=mode, ep=ep)
            f = Factory(src, src, seed=len(mode) + len(where))
            reqs = [f.make(n, chunks=1 + i % 2) for i, (n, _) in enumerate(SIZES)]
            before = rig.dc.call("metrics", ep=ep).get("integrity_checks", 0)
            outs = run_groups(pg, dg, rig.boot, reqs, timeout=60)
            r = _exact(outs[0], dg.each("verify", items=decode_items(reqs))[0])
            r["checks"] = rig.dc.call("metrics", ep=ep).get("integrity_checks", 0) - before
            r["ok"] = r["ok"] and r["checks"] > 0
            res.update({f"{mode}.{where}.{k}": v for k, v in r.items()})
            ok = ok and r["ok"]
        f = Factory(src, src, seed=len(mode) + 11)
        reqs = [f.make(n) for n in (48, 100, 257)]
        rooms = ";".join(str(r["room"]) for r in reqs)
        rig.dc.call("set_faults", spec=f"corrupt=1,rooms={rooms},seed=1")
        try:
            outs = run_groups(pg, decodes["host"], rig.boot, reqs, timeout=60)[0]
        finally:
            rig.dc.call("set_faults", spec="")
        caught = sum(o["state"] == "Failed" and o["kind"] == "integrity" for o in outs.values())
        res[f"{mode}.corrupt.requests"], res[f"{mode}.corrupt.caught"] = len(reqs), caught
        ok = ok and caught == len(reqs)
    res["ok"] = ok
    return res


TIER = [
    PoolGeom("kv", "mha", layers=2, pages=256, page_size=16, heads=2, head_dim=16),
    PoolGeom("aux", "slots", layers=1, pages=64, dim=8, dtype="int32"),
]
N, SHARED = 320, 288


def check_l2_restore(rig: Rig) -> dict[str, Any]:
    """A request written back to L2, then a child sharing 288 of its 320 tokens: the prefix
    is restored from L2 into the decode's device pages, only the suffix crosses the wire."""
    geoms = on(TIER, rig.dev)
    rig.endpoint(rig.pf, "tier", geoms)
    rig.endpoint(rig.dc, "tier", geoms)
    rig.dc.call("ext", fn=X + "setup", host_pages=64, model_id=MODEL, ep="tier")
    fam = Family(geoms, seed=5)
    a = fam.make(fam.tokens(N))
    first = start(rig.pf, rig.dc, rig.boot, [a], ep="tier", instance="tier")[a["room"]]
    ra = finish(rig.dc, [a], ep="tier")[a["room"]]
    wrote = write_back(rig.dc, [a], ep="tier")
    b = fam.child(a, SHARED, N)
    promised = start(rig.pf, rig.dc, rig.boot, [b], ep="tier", instance="tier")[b["room"]]
    rb = finish(rig.dc, [b], ep="tier")[b["room"]]
    st = rb.get("stats", {})
    ok = (
        first == 0
        and ra["state"] == "Success"
        and not ra["bad"][0]
        and promised == SHARED
        and rb["state"] == "Success"
        and not rb["bad"][0]
        and st.get("l2_pages") == SHARED // 16
    )
    return {
        "first.state": ra["state"],
        "first.bytes_wrong": ra["bad"][0],
        "l3_pages_written": wrote[0] if wrote else 0,
        "promised_tokens": promised,
        "state": rb["state"],
        "failure": rb.get("failure") or "",
        "bytes_wrong": rb["bad"][0],
        "first_wrong": rb["bad"][1],
        "l2_pages": st.get("l2_pages"),
        "net_bytes": st.get("net_bytes"),
        "ok": ok,
    }


CHECKS = {
    "pages": check_pages,
    "landing_host": check_landing_host,
    "hetero": check_hetero,
    "integrity": check_integrity,
    "l2_restore": check_l2_restore,
}


def step_transfers(dev: str, transport: str) -> dict[str, Any]:
    """Every check of ``CHECKS`` on one prefill/decode pair; a failing check is recorded and
    the next one runs."""
    res: dict[str, Any] = {}
    g = on(GEOMS, dev)
    with (
        BootstrapServer("127.0.0.1", 0).start() as srv,
        agents(
            ("prefill", {"bootstrap": srv.address, "transport": transport}, g),
            ("decode", {"transport": transport}, g),
        ) as (pf, dc),
    ):
        rig = Rig(dev, transport, srv.address, pf, dc)
        for name, fn in CHECKS.items():
            t0 = time.monotonic()
            try:
                r = fn(rig)
            except Exception as e:  # noqa: BLE001 - recorded as the check's verdict
                r = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            r["seconds"] = round(time.monotonic() - t0, 2)
            why = r.get("error") or r.get("first_failure") or r.get("first_wrong") or ""
            print(
                f"{transport} {name}: {'ok' if r['ok'] else 'FAILED'} in {r['seconds']} s {why}",
                file=sys.stderr,
                flush=True,
            )
            res.update({f"{name}.{k}": v for k, v in r.items()})
    res["ok"] = all(res[f"{n}.ok"] for n in CHECKS)
    return res


def _best_gbps(fn: Callable[[], tuple[int, float]], reps: int) -> float:
    best = 0.0
    for _ in range(reps):
        n, s = fn()
        best = max(best, n / s / 1e9)
    return round(best, 3)


PACK = "_pack"
"""A bulk path named ``<transport>_pack``: the same transport, the request packed
(``EndpointConfig.pack='on'``: gathered on the prefill, one large write, scattered)."""


def base(path: str) -> str:
    """The transport of a bulk path (``nixl_pack`` -> ``nixl``)."""
    return path.removesuffix(PACK)


def bulk_skips(dev: str, paths: list[str]) -> dict[str, str]:
    """Paths of ``paths`` the bulk cannot run here, and why."""
    from pdxfer.transport import nvlink

    nv = [p for p in paths if base(p) == "nvlink"]
    if not nv:
        return {}
    if not dev.startswith("cuda"):
        return dict.fromkeys(nv, "cpu: nvlink_intra moves device memory only")
    return {} if nvlink.built() else dict.fromkeys(nv, "this Mooncake build has no nvlink_intra")


def compare(res: dict[str, Any], raw: dict[str, Any], transports: list[str]) -> None:
    """pdxfer's best bulk against the best raw path of ``gpu_probe.py`` in the same shape
    (32 KiB pages) and against torch's device-to-device copy: the issue's goal keys."""
    mine = {t: res.get(f"gb_per_s.{t}", 0.0) for t in transports}
    best = max(mine, key=lambda t: mine[t]) if mine else ""
    res["gb_per_s.pdxfer_best"] = mine.get(best, 0.0)
    res["pdxfer_best_path"] = best
    d2d = res.get("gb_per_s.torch_d2d", 0.0)
    res["pdxfer_fraction_of_d2d"] = round(mine.get(best, 0.0) / d2d, 5) if d2d else 0.0
    top = float(raw.get("best_raw.gb_per_s", 0.0) or 0.0)
    res["best_raw.gb_per_s"], res["best_raw.path"] = top, raw.get("best_raw.path", "")
    res["pdxfer_ratio_vs_best_raw"] = round(mine.get(best, 0.0) / top, 4) if top else 0.0
    for t, v in mine.items():  # each pdxfer path against its own raw path, same shape
        key = {
            "nixl": "nixl.t1.d32k_batch4096",
            "tcp": "mooncake.tcp.d32k",
            "nvlink": "mooncake.nvlink_intra.d32k",
            "nixl_pack": "nixl.t1.dbuf",
            "tcp_pack": "mooncake.tcp.dbuf",
            "nvlink_pack": "mooncake.nvlink_intra.dbuf",
        }.get(t, "")
        r = float(raw.get(f"{key}.gb_per_s", 0.0) or 0.0)
        if r:
            res[f"ratio_vs_raw.{t}"] = round(v / r, 4)


def _bulk_pairs(
    stack: contextlib.ExitStack,
    srv: BootstrapServer,
    paths: list[str],
    g: list[PoolGeom],
    res: dict[str, Any],
) -> dict[str, tuple[Agent, Agent, str]]:
    """Per path its (prefill, decode, endpoint name): one agent pair per transport whose
    ``main`` endpoints never pack; a ``_pack`` path adds ``pack`` endpoints that always do.
    A transport that cannot start is recorded; the others run."""
    out: dict[str, tuple[Agent, Agent, str]] = {}
    for t in dict.fromkeys(base(p) for p in paths):
        conf = {"transport": t, "integrity": "off", "pack": "off"}
        try:
            pf, dc = stack.enter_context(
                agents(
                    ("prefill", {**conf, "bootstrap": srv.address, "instance": t}, g),
                    ("decode", conf, g),
                )
            )
        except Exception as e:  # noqa: BLE001
            for p in paths:
                if base(p) == t:
                    res[f"error.{p}"] = f"{type(e).__name__}: {e}"
            continue
        for p in paths:
            if base(p) != t:
                continue
            if p == t:
                out[p] = (pf, dc, "main")
                continue
            cfg = {**CONF, **conf, "pack": "on"}
            pf.call(
                "add_endpoint",
                name="pack",
                role="prefill",
                geoms=g,
                config={**cfg, "bootstrap": srv.address, "instance": p},
            )
            dc.call("add_endpoint", name="pack", role="decode", geoms=g, config=cfg)
            out[p] = (pf, dc, "pack")
    return out


def step_bulk(dev: str, paths: list[str], quick: bool, raw: Path | None = None) -> dict[str, Any]:
    """One request of ``tokens`` x 8 layers x K,V x 8 heads x 128 (fp16) per path (a
    transport, or ``<transport>_pack``), best of ``reps``, a packed path's last landing
    checked byte for byte (``bytes_wrong.<path>``); torch copies of as many bytes, interleaved with them; with
    ``raw`` (the probe's JSON) the comparison keys (``compare``)."""
    import numpy as np
    import torch

    tokens, reps = (1024, 2) if quick else (16384, 4)
    g = [
        PoolGeom(
            "kv",
            "mha",
            layers=8,
            pages=2 * tokens // 16,
            page_size=16,
            heads=8,
            head_dim=128,
            device=dev,
        )
    ]
    nbytes = tokens * 8 * 2 * 8 * 128 * 2
    # the pack staging: the whole request in one piece (a piece is at most half of it)
    os.environ["PDXFER_PACK_MB"] = str(2 * (nbytes >> 20) + 64)
    res: dict[str, Any] = {"bytes": nbytes, "tokens": tokens, "reps": reps}
    skips = bulk_skips(dev, paths)
    res.update({f"skipped.{t}": why for t, why in skips.items()})
    paths = [t for t in paths if t not in skips]
    srv = BootstrapServer("127.0.0.1", 0).start()
    stack = contextlib.ExitStack()
    try:
        pairs = _bulk_pairs(stack, srv, paths, g, res)
        rng = np.random.default_rng(0)
        pages = tokens // 16
        src = rng.permutation(2 * pages)[:pages].tolist()
        room = [int(rng.integers(1, 1 << 40))]
        landed: dict[str, dict[str, Any]] = {}
        for pf, _, ep in pairs.values():
            pf.call(
                "prepare", ep=ep, items=[{"room": 0, "pages": {"kv": src}, "num_tokens": tokens}]
            )

        def transfer(t: str) -> tuple[int, float]:
            pf, dc, ep = pairs[t]
            room[0] += 1
            dst = rng.permutation(2 * pages)[:pages].tolist()
            dc.call(
                "recv",
                items=[{"room": room[0], "dst": {"kv": dst}, "num_tokens": tokens}],
                bootstrap=srv.address,
                instance=t if ep == "pack" else base(t),
                ep=ep,
            )
            pf.call(
                "send",
                ep=ep,
                items=[{"room": room[0], "chunks": [{"pages": {"kv": src}, "last": True}]}],
            )
            out = dc.call("wait", rooms=[room[0]], timeout=120, ep=ep)[room[0]]
            if out["state"] != "Success":
                raise RuntimeError(f"{t}: {out['failure']}")
            dc.call("forget", rooms=[room[0]], ep=ep)
            pf.call("forget", rooms=[room[0]], ep=ep)
            landed[t] = {"room": room[0], "seed": 0, "dst": {"kv": dst}, "num_tokens": tokens}
            return out["stats"]["bytes"], out["stats"]["seconds"]

        d = torch.device(dev)
        a = torch.empty(nbytes, dtype=torch.uint8, device=d).random_()
        b = torch.empty_like(a)
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=d.type == "cuda").random_()
        sync = torch.cuda.synchronize if d.type == "cuda" else (lambda: None)

        def timed(dst: Any, src_: Any) -> tuple[int, float]:
            sync()
            t0 = time.perf_counter()
            dst.copy_(src_, non_blocking=True)
            sync()
            return nbytes, time.perf_counter() - t0

        best: dict[str, float] = {t: 0.0 for t in paths if t not in pairs}
        for _ in range(reps):  # interleaved: each figure sees the same machine state
            for t in pairs:
                if f"error.{t}" in res:
                    continue
                try:  # one path failing keeps the others' figures
                    best[t] = max(best.get(t, 0.0), _best_gbps(lambda t=t: transfer(t), 1))
                except RuntimeError as e:
                    res[f"error.{t}"], best[t] = str(e), 0.0
            best["torch_d2d"] = max(best.get("torch_d2d", 0.0), _best_gbps(lambda: timed(b, a), 1))
            best["torch_pinned_h2d"] = max(
                best.get("torch_pinned_h2d", 0.0), _best_gbps(lambda: timed(a, pinned), 1)
            )
        ok = bool(torch.equal(a, pinned.to(d)))
        for t, item in landed.items():  # the last packed landing, byte for byte
            _, dc, ep = pairs[t]
            if ep != "pack":  # the direct paths: the transfers step checks them
                continue
            res[f"bytes_wrong.{t}"] = dc.call("verify", items=[item], ep=ep)[item["room"]][0]
        for k, v in best.items():
            res[f"gb_per_s.{k}"] = v
        if raw is not None:
            compare(res, json.loads(raw.read_text()) if raw.exists() else {}, paths)
        res["ok"] = (
            ok
            and all(best[t] > 0 for t in paths)
            and all(res.get(f"bytes_wrong.{t}", 1) == 0 for t in paths if PACK in t)
        )
        return res
    finally:
        stack.close()
        srv.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("step", choices=STEPS)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument(
        "--transport",
        default="tcp",
        help="tcp, nixl, or both (bulk: paths, e.g. tcp,nixl,nixl_pack)",
    )
    ap.add_argument("--json", type=Path, help="write the step's result here")
    ap.add_argument("--quick", action="store_true", help="bulk: a small request, 2 reps")
    ap.add_argument("--raw", type=Path, help="bulk: gpu_probe.py's JSON, to compare with")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    if a.step == "bulk":
        res = step_bulk(a.device, a.transport.split(","), a.quick, a.raw)
    else:
        res = step_transfers(a.device, a.transport)
    res["wall_s"] = round(time.monotonic() - t0, 2)
    text = json.dumps(res, indent=1, sort_keys=True, default=str)
    if a.json:
        a.json.write_text(text)
    print(text)
    return 0 if res.get("ok") else 1


if __name__ == "__main__":
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    sys.exit(main())
