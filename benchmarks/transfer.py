"""pdxfer against raw Mooncake on the same work, and the machine's own limits, in one run."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import hetero, incremental
from benchmarks.common.fleet import BENCH_STATE as STATE
from benchmarks.common.fleet import Fleet
from benchmarks.common.limits import socket_stream
from benchmarks.common.runner import ROOT, load, log
from benchmarks.common.transfer_report import plot, table
from pdxfer import plan as P
from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent

LAYERS, HEADS, HEAD_DIM, PS = 32, 8, 128, 64
PF_PAGES, DC_PAGES = 64, 160
PAGE_BYTES = PS * HEADS * HEAD_DIM * 2  # one page of one buffer: 128 KiB
BUFFERS = 2 * LAYERS
BULK_MAX = 2048
NIXL_VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "tcp": ("nixl.ucx_tls.tcp", {"UCX_TLS": "tcp"}),
    "one_thread": ("nixl.one_thread", {"PDXFER_NIXL_THREADS": "1"}),
}
"""NIXL pairs compared against the default one (name: JSON key prefix, environment).
``tcp``: UCX's choice on one host already writes with ``cma`` (process_vm_writev: one copy,
``UCX_PROTO_INFO=y`` shows it); ``UCX_TLS=tcp`` is what crosses hosts. Shared memory alone
(``posix``, ``sysv``) cannot start a NIXL agent, and with ``^cma`` the first bulk write hung
(nixl-cu12 1.5.1, probed on this VM). ``one_thread``: every write copied by the posting
thread alone, as before ``PDXFER_NIXL_THREADS``."""


def geoms(pages: int) -> list[PoolGeom]:
    return [
        PoolGeom(
            "kv",
            "mha",
            layers=LAYERS,
            pages=pages,
            page_size=PS,
            heads=HEADS,
            head_dim=HEAD_DIM,
            dtype="float16",
        )
    ]


def stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def loadavg() -> float:
    return load()[0]


class Bench:
    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.out: dict[str, Any] = {"quick": quick, "cpus": os.cpu_count()}
        self.rng = np.random.default_rng(1)
        self.room = 1 << 40
        self.src_perm = self.rng.permutation(PF_PAGES).tolist()
        self.seed_room = 77

    def next_room(self) -> int:
        self.room += 1
        return self.room

    def mark_load(self, section: str) -> None:
        self.out[f"load.before_{section}"] = loadavg()
        log("transfer", section)

    # -- setup ---------------------------------------------------------------------------------
    def start(self) -> None:
        self.fleet = Fleet()
        self.srv, self.nsrv = self.fleet.bootstrap(), self.fleet.bootstrap()
        cfg = {
            "bootstrap": self.srv.address,
            "transfer_timeout_s": 60.0,
            "bootstrap_timeout_s": 60.0,
            "transport": "tcp",
        }
        nixl = {**cfg, "transport": "nixl"}
        specs = [
            ("prefill", {"bootstrap": self.srv.address, **cfg}, PF_PAGES),
            ("decode", cfg, DC_PAGES),
            ("raw-prefill", {}, PF_PAGES),
            ("raw-decode", {}, DC_PAGES),
            ("prefill", {**nixl, "bootstrap": self.nsrv.address}, PF_PAGES),
            ("decode", nixl, DC_PAGES),
        ]
        self.pf, self.dc, self.rpf, self.rdc, self.npf, self.ndc = self.fleet.agents(
            [(role, c, geoms(n)) for role, c, n in specs], state=STATE, start_timeout=600
        )
        # one more NIXL pair per UCX transport list compared (UCX reads UCX_TLS when an agent
        # starts); started after the others, which must not inherit it while it is set
        self.tls_pairs = {}
        for tls in NIXL_VARIANTS:
            srv = self.fleet.bootstrap()
            c = {**nixl, "bootstrap": srv.address}
            self.tls_pairs[tls] = (
                *(
                    self.fleet.agent(
                        role, c, geoms(n), state=STATE, start_timeout=600, env=NIXL_VARIANTS[tls][1]
                    )
                    for role, n in (("prefill", PF_PAGES), ("decode", DC_PAGES))
                ),
                srv.address,
            )
        # the pattern only where transfers read: the largest request's pages
        item = {
            "room": self.seed_room,
            "pages": {"kv": self.src_perm[: BULK_MAX // PS]},
            "num_tokens": BULK_MAX,
        }
        for a in (self.pf, self.rpf, self.npf, *(p[0] for p in self.tls_pairs.values())):
            a.call("prepare", items=[item])
        for a in (self.dc, self.rdc, self.ndc, *(p[1] for p in self.tls_pairs.values())):
            a.call("sentinel")
        # one warm-up transfer each (handshake, lanes, route cache)
        self.pdx_once(128)
        self.pdx_once(128, transport="nixl")
        for t in NIXL_VARIANTS:
            self.pdx_once(128, transport=f"nixl:{t}")
        self.raw_once(128)

    def close(self) -> None:
        if hasattr(self, "fleet"):
            self.fleet.close()

    # -- one transfer of each kind ---------------------------------------------------------------
    def pages_for(self, tokens: int) -> tuple[list[int], list[int]]:
        n = -(-tokens // PS)
        return self.src_perm[:n], self.rng.choice(DC_PAGES, n, replace=False).tolist()

    def cpu(self, *agents: Agent) -> float:
        return sum(a.call("cpu") for a in agents)

    def pair(self, transport: str) -> tuple[Agent, Agent, str]:
        """The pdxfer prefill, decode and bootstrap that move bytes over ``transport`` (one
        bootstrap per pair: a decode never finds the other transport's prefill);
        ``nixl:<UCX_TLS>`` is a NIXL pair started with that UCX transport list."""
        if transport == "nixl":
            return self.npf, self.ndc, self.nsrv.address
        if transport.startswith("nixl:"):
            return self.tls_pairs[transport[5:]]
        return self.pf, self.dc, self.srv.address

    def pdx_once(self, tokens: int, verify: bool = False, transport: str = "tcp") -> dict[str, Any]:
        pf, dc, boot = self.pair(transport)
        src, dst = self.pages_for(tokens)
        room = self.next_room()
        item = {"room": room, "dst": {"kv": dst}, "num_tokens": tokens}
        dc.call("recv", items=[item], bootstrap=boot)
        if not pf.call("bench_wait_pending", rooms=[room]):
            raise RuntimeError("the decode's request never reached the prefill")
        c0 = self.cpu(pf, dc)
        t0 = pf.call("bench_send", room=room, pages=src, wait=True)["t"]
        r = dc.call("bench_done", rooms=[room])[room]
        cpu = self.cpu(pf, dc) - c0
        if r["state"] != "Success":
            raise RuntimeError(f"pdxfer transfer failed: {r['failure']}")
        bad = self.verify(dc, room, dst, tokens) if verify else None
        return {
            "seconds": r["t_done"] - t0,
            "bytes": r["bytes"],
            "entries": r["blocks"],
            "cpu": cpu,
            "bad": bad,
        }

    def raw_once(self, tokens: int, verify: bool = False) -> dict[str, Any]:
        src, dst = self.pages_for(tokens)
        c0 = self.cpu(self.rpf, self.rdc)
        r = self.rpf.call(
            "raw_write",
            peer=self.rdc.info["session"],
            pools=self.rdc.info["pools"],
            src=src,
            dst=dst,
            tokens=tokens,
        )
        cpu = self.cpu(self.rpf, self.rdc) - c0
        bad = self.verify(self.rdc, 0, dst, tokens) if verify else None
        return {
            "seconds": r["seconds"][0],
            "bytes": r["bytes"],
            "entries": r["entries"],
            "cpu": cpu,
            "bad": bad,
        }

    def verify(
        self, agent: Agent, room: int, dst: list[int], tokens: int, seed: int | None = None
    ) -> int:
        item = {
            "room": room,
            "dst": {"kv": dst},
            "num_tokens": tokens,
            "seed": self.seed_room if seed is None else seed,
        }
        bad, first = agent.call("verify", items=[item])[room]
        if bad:
            print(f"  VERIFY FAILED: {bad} bytes wrong: {first}", file=sys.stderr)
        return int(bad)

    # -- 1. bulk ----------------------------------------------------------------------------------
    def bulk(self) -> None:
        self.mark_load("bulk")
        sizes = [512, 2048] if self.quick else [128, 512, 1024, 2048]
        rounds = 3 if self.quick else 15
        res: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for rnd in range(rounds):
            for tokens in sizes:
                check = tokens == sizes[-1] and rnd in (
                    (rounds - 1,) if self.quick else (0, rounds - 1)
                )
                for name, fn in (("raw", self.raw_once), ("pdxfer", self.pdx_once)):
                    res.setdefault((name, tokens), []).append(fn(tokens, verify=check))
        self.bulk_res = res
        curve = []
        for tokens in sizes:
            row: dict[str, Any] = {"tokens": tokens}
            for name in ("raw", "pdxfer"):
                rs = res[(name, tokens)]
                gbps = [r["bytes"] / r["seconds"] / 1e9 for r in rs]
                s = stats(gbps)
                row[name] = s
                row[f"{name}_entries"] = rs[0]["entries"]
                row["bytes"] = rs[0]["bytes"]
            # ratio per round (interleaved pairs), then the median of the ratios
            ratios = [
                p["bytes"] / p["seconds"] / (r["bytes"] / r["seconds"])
                for p, r in zip(res[("pdxfer", tokens)], res[("raw", tokens)])
            ]
            row["ratio"] = stats(ratios)
            curve.append(row)
        self.out["bulk.curve"] = curve
        big = curve[-1]
        o = self.out
        o["bulk.tokens"] = big["tokens"]
        o["bulk.bytes"] = big["bytes"]
        o["bulk.entries_pdxfer"] = big["pdxfer_entries"]
        o["bulk.entries_raw"] = big["raw_entries"]
        o["bulk.raw_gbps"] = big["raw"]["median"]
        o["bulk.raw_gbps_min_max"] = [big["raw"]["min"], big["raw"]["max"]]
        o["bulk.pdxfer_gbps"] = big["pdxfer"]["median"]
        o["bulk.pdxfer_gbps_min_max"] = [big["pdxfer"]["min"], big["pdxfer"]["max"]]
        o["bulk.ratio_vs_raw"] = big["ratio"]["median"]
        o["bulk.ratio_vs_raw_min_max"] = [big["ratio"]["min"], big["ratio"]["max"]]
        o["bulk.rounds"] = rounds
        checked = [r["bad"] for k, v in res.items() for r in v if r["bad"] is not None]
        o["bulk.bytes_wrong"] = int(sum(checked))
        o["bulk.transfers_verified"] = len(checked)

    # -- 2. small requests -------------------------------------------------------------------------
    def small(self) -> None:
        self.mark_load("small")
        seg = 2.0 if self.quick else 5.0  # two rounds per variant: 10 s each in a full run
        rounds = 2
        tokens, per, conc = 128, 2, 64
        src = self.src_perm[:per]
        dst_free = self.rng.permutation(DC_PAGES).tolist()
        lat = {"pdxfer": [], "raw": []}
        rate = {"pdxfer": [], "raw": []}
        failed: list[str] = []
        warm = seg * 0.3

        def window(stamps: list[Any], start: float, seg: float, k: str) -> None:
            """Steady state only: every room that finished in [start + warm, end]. In a closed
            loop at this concurrency a room's latency (mostly queueing) can exceed the window,
            so filtering on the issue time too would leave no samples at all."""
            lo, hi = start + warm, start + seg
            lat[k] += [t1 - t0 for t0, t1 in stamps if lo <= t1 <= hi]
            rate[k].append(sum(lo <= t1 <= hi for _, t1 in stamps) / (seg - warm))

        for _ in range(rounds):
            first = self.next_room()
            self.room += 1 << 20
            pl = self.rpf.call(
                "raw_push_loop",
                timeout=seg + 120,
                peer=self.rdc.info["session"],
                pools=self.rdc.info["pools"],
                pull=self.rdc.info["pull"],
                src=src,
                dst_free=dst_free,
                tokens=tokens,
                conc=conc,
                duration=seg,
                threads=4,
                first_room=first,
            )
            window(self.rdc.call("raw_collect", first_room=first), pl["start"], seg, "raw")
            first = self.next_room()
            self.room += 1 << 20
            self.pf.call("bench_serve", first_room=first, src=src, ahead=conc + 32)
            r = self.dc.call(
                "bench_closed_loop",
                timeout=seg + 120,
                bootstrap=self.srv.address,
                first_room=first,
                dst_free=dst_free,
                per=per,
                tokens=tokens,
                conc=conc,
                duration=seg,
            )
            self.pf.call("bench_serve_stop")
            window(r["stamps"], r["start"], seg, "pdxfer")
            failed += r["failed"]
        o = self.out
        for k in ("pdxfer", "raw"):
            o[f"small.{k}_rooms_per_s"] = statistics.median(rate[k])
            o[f"small.{k}_p50_ms"] = pct(lat[k], 50) * 1e3
            o[f"small.{k}_p99_ms"] = pct(lat[k], 99) * 1e3
            o[f"small.{k}_completed"] = len(lat[k])
        o["small.p50_ratio_vs_baseline"] = o["small.pdxfer_p50_ms"] / o["small.raw_p50_ms"]
        o["small.rate_ratio_vs_baseline"] = (
            o["small.pdxfer_rooms_per_s"] / o["small.raw_rooms_per_s"]
        )
        o["small.concurrency"] = conc
        o["small.seconds_per_variant"] = seg * rounds
        o["small.failed"] = len(failed)
        self.fixed_cost(tokens, per)

    def pdx_send_once(
        self, tokens: int, src: list[int], dst: list[int], transport: str = "tcp"
    ) -> float:
        """One request whose decode side asked first (as in PD serving, where the decode's
        request goes out while the prefill computes): seconds from the prefill's ``send`` to
        Success on the decode."""
        pf, dc, boot = self.pair(transport)
        room = self.next_room()
        dc.call(
            "recv", items=[{"room": room, "dst": {"kv": dst}, "num_tokens": tokens}], bootstrap=boot
        )
        if not pf.call("bench_wait_pending", rooms=[room]):
            raise RuntimeError("the decode's request never reached the prefill")
        s = pf.call("bench_send", room=room, pages=src, wait=True)
        r = dc.call("bench_done", rooms=[room])[room]
        if r["state"] != "Success":
            raise RuntimeError(f"pdxfer transfer failed: {r['failure']}")
        self.last_write_s = s["raw_write_s"]
        return r["t_done"] - s["t"]

    def fixed_cost(self, tokens: int, per: int) -> None:
        """One request at a time, time to Success from the prefill's ``send`` (as the bulk
        figure counts) minus the raw write time.

        ``small.fixed_cost_ms``: per request, minus the raw Mooncake write of that very request
        (a lone batch is one ``batch_transfer_sync_write`` call, timed around the call inside
        pdxfer), then the median: what pdxfer adds, free of the transfer's own 4-12 ms
        jitter. ``small.fixed_cost_vs_baseline_ms``: the median against raw writes of the same
        blocks from the separate baseline processes, alternating one raw write and one pdxfer
        request (A B A B ...). ``small.fixed_cost_from_request_ms`` counts from the decode's
        ``request()`` instead, adding the request's trip to the prefill."""
        pairs = 30 if self.quick else 100
        src = self.src_perm[:per]
        raw: list[float] = []
        pdx: list[float] = []
        own: list[float] = []
        for _ in range(pairs):
            dst = self.rng.choice(DC_PAGES, per, replace=False).tolist()
            raw += self.rpf.call(
                "raw_write",
                peer=self.rdc.info["session"],
                pools=self.rdc.info["pools"],
                src=src,
                dst=dst,
                tokens=tokens,
                reps=1,
            )["seconds"]
            dst = self.rng.choice(DC_PAGES, per, replace=False).tolist()
            pdx.append(self.pdx_send_once(tokens, src, dst))
            own.append(pdx[-1] - self.last_write_s)
        rounds, k = (2, 10) if self.quick else (4, 20)
        req: list[float] = []
        raw_blk: list[float] = []
        for _ in range(rounds):
            dst = self.rng.choice(DC_PAGES, per, replace=False).tolist()
            raw_blk += self.rpf.call(
                "raw_write",
                peer=self.rdc.info["session"],
                pools=self.rdc.info["pools"],
                src=src,
                dst=dst,
                tokens=tokens,
                reps=k,
            )["seconds"]
            first = self.next_room()
            self.room += 1 << 20
            self.pf.call("bench_serve", first_room=first, src=src, ahead=4)
            r = self.dc.call(
                "bench_closed_loop",
                bootstrap=self.srv.address,
                first_room=first,
                dst_free=self.rng.permutation(DC_PAGES).tolist(),
                per=per,
                tokens=tokens,
                conc=1,
                count=k,
            )
            self.pf.call("bench_serve_stop")
            req += [t1 - t0 for t0, t1 in r["stamps"]]
        o = self.out
        med = statistics.median
        o["small.serial_pairs"] = pairs
        o["small.serial_pdxfer_ms"] = med(pdx) * 1e3
        o["small.serial_raw_write_ms"] = med(raw) * 1e3
        o["small.fixed_cost_ms"] = med(own) * 1e3
        o["small.fixed_cost_ms_p25_p75"] = [
            float(np.percentile(own, 25) * 1e3),
            float(np.percentile(own, 75) * 1e3),
        ]
        o["small.fixed_cost_vs_baseline_ms"] = (
            o["small.serial_pdxfer_ms"] - o["small.serial_raw_write_ms"]
        )
        o["small.serial_from_request_ms"] = med(req) * 1e3
        o["small.fixed_cost_from_request_ms"] = (med(req) - med(raw_blk)) * 1e3

    # -- 2b. integrity -------------------------------------------------------------------------------
    def integrity(self) -> None:
        """The cost of verifying every transfer: bulk seconds and the small request's fixed
        cost with the decode's integrity ``sampled`` and ``full`` against ``off``, the modes
        alternating request by request (off, sampled, full, off, ...)."""
        self.mark_load("integrity")
        modes = ("off", "sampled", "full")
        rounds = 3 if self.quick else 9
        bulk: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(rounds):
            for m in modes:
                self.dc.call("set_integrity", mode=m)
                bulk[m].append(self.pdx_once(BULK_MAX)["seconds"])
        pairs = 20 if self.quick else 60
        tokens, per = 128, 2
        src = self.src_perm[:per]
        own: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(pairs):
            for m in modes:
                self.dc.call("set_integrity", mode=m)
                dst = self.rng.choice(DC_PAGES, per, replace=False).tolist()
                own[m].append(self.pdx_send_once(tokens, src, dst) - self.last_write_s)
        self.dc.call("set_integrity", mode="sampled")
        med = statistics.median
        o = self.out
        for m in ("sampled", "full"):
            ratios = [a / b for a, b in zip(bulk[m], bulk["off"])]
            o[f"integrity.{m}_cost_ratio"] = med(ratios)
            o[f"integrity.{m}_cost_ratio_min_max"] = [min(ratios), max(ratios)]
        o["integrity.bulk_off_ms"] = med(bulk["off"]) * 1e3
        o["integrity.small_fixed_cost_off_ms"] = med(own["off"]) * 1e3
        o["integrity.small_fixed_cost_delta_ms"] = (med(own["sampled"]) - med(own["off"])) * 1e3
        o["integrity.small_fixed_cost_full_delta_ms"] = (med(own["full"]) - med(own["off"])) * 1e3
        o["integrity.rounds"] = rounds

    # -- 3. entries ---------------------------------------------------------------------------------
    def entries(self) -> None:
        self.mark_load("entries")
        n = 8
        tokens = n * PS
        base = self.rng.choice(np.arange(0, PF_PAGES - n, n), 1)[0]
        dbase = self.rng.choice(np.arange(0, DC_PAGES - n, n), 1)[0]
        rand_s = self.rng.choice(PF_PAGES, n, replace=False)
        rand_d = self.rng.choice(DC_PAGES, n, replace=False)
        half_s = np.concatenate([[2 * i * 3, 2 * i * 3 + 1] for i in range(n // 2)])
        half_d = np.concatenate([[100 + 2 * i * 5, 100 + 2 * i * 5 + 1] for i in range(n // 2)])
        cases = {
            "random": (rand_s, rand_d),
            "contiguous": (np.arange(base, base + n), np.arange(dbase, dbase + n)),
            "half_contiguous": (half_s, half_d),
        }
        ok = True
        for name, (s, d) in cases.items():
            s, d = [int(x) for x in s], [int(x) for x in d]
            room = self.next_room()
            self.pf.call(
                "prepare", items=[{"room": room, "pages": {"kv": s}, "num_tokens": tokens}]
            )
            item = {"room": room, "dst": {"kv": d}, "num_tokens": tokens}
            self.dc.call(
                "recv", items=[item], bootstrap=getattr(self, "_entries_boot", self.srv.address)
            )
            self.pf.call("bench_wait_pending", rooms=[room])
            e0 = self.pf.call("metrics")["transport_entries"]
            self.pf.call("bench_send", room=room, pages=s)
            r = self.dc.call("bench_done", rooms=[room])[room]
            got = self.pf.call("metrics")["transport_entries"] - e0
            runs = len(P.runs(np.asarray(s), np.asarray(d))[2])
            bad = self.verify(self.dc, room, d, tokens, seed=room)
            self.out[f"entries.{name}.runs"] = runs
            self.out[f"entries.{name}.entries"] = got
            self.out[f"entries.{name}.entries_per_buffer"] = got / BUFFERS
            self.out[f"entries.{name}.bytes_per_entry"] = r["bytes"] / max(1, got)
            self.out[f"entries.{name}.bytes_wrong"] = bad
            ok &= got == runs * BUFFERS and r["state"] == "Success" and bad == 0
        self.out["entries.buffers"] = BUFFERS
        self.out["entries.equal_to_runs"] = bool(ok)
        # the source pattern of the bulk pages was overwritten: restore it
        self.pf.call(
            "prepare",
            items=[
                {
                    "room": self.seed_room,
                    "pages": {"kv": self.src_perm[: BULK_MAX // PS]},
                    "num_tokens": BULK_MAX,
                }
            ],
        )

    # -- 3b. NIXL against Mooncake -----------------------------------------------------------
    def nixl(self) -> None:
        """pdxfer over NIXL and over Mooncake TCP, interleaved (A B A B ...): the bulk geometry
        (``nixl.bulk_ratio_vs_mooncake``, per pair, then the median), one small request's time
        from ``send`` to Success (``nixl.small_fixed_cost_ms`` minus its transport write, as
        ``small.fixed_cost_ms``), and the entries check over NIXL."""
        self.mark_load("nixl")
        rounds = 3 if self.quick else 10
        variants = ["tcp", "nixl", *(f"nixl:{t}" for t in NIXL_VARIANTS)]
        gb: dict[str, list[float]] = {v: [] for v in variants}
        failed: dict[str, str] = {}
        bad = 0
        for rnd in range(rounds):
            for tr in variants:
                if tr in failed:
                    continue
                try:
                    r = self.pdx_once(BULK_MAX, verify=rnd == rounds - 1, transport=tr)
                except RuntimeError as e:
                    if not tr.startswith("nixl:"):
                        raise
                    failed[tr] = str(e)  # a compared UCX_TLS variant: reported, not fatal
                    continue
                gb[tr].append(r["bytes"] / r["seconds"] / 1e9)
                bad += r["bad"] or 0
        ratios = [n / m for n, m in zip(gb["nixl"], gb["tcp"])]
        o = self.out
        for t, (key, _) in NIXL_VARIANTS.items():
            v = f"nixl:{t}"
            if v in failed:
                o[f"{key}.failed"] = failed[v]
            if gb[v]:
                o[f"{key}.bulk_gbps"] = statistics.median(gb[v])
                o[f"{key}.ratio_vs_default"] = statistics.median(
                    a / b for a, b in zip(gb[v], gb["nixl"])
                )
        o["nixl.bulk_gbps"] = statistics.median(gb["nixl"])
        o["nixl.bulk_mooncake_gbps"] = statistics.median(gb["tcp"])
        o["nixl.bulk_ratio_vs_mooncake"] = statistics.median(ratios)
        o["nixl.bulk_ratio_min_max"] = [min(ratios), max(ratios)]
        o["nixl.bulk_bytes_wrong"] = int(bad)
        idle = 1.0 if self.quick else 3.0  # CPU seconds per second of a pair doing nothing
        for tr, key in (("nixl", "nixl.idle_cpu_cores"), ("tcp", "nixl.idle_cpu_cores_mooncake")):
            pf, dc, _ = self.pair(tr)
            c0 = self.cpu(pf, dc)
            time.sleep(idle)
            o[key] = (self.cpu(pf, dc) - c0) / idle
        pairs = 30 if self.quick else 100
        per, tokens = 2, 128
        src = self.src_perm[:per]
        # the compared NIXL pairs too: a setting that speeds the bulk must not slow the small
        own: dict[str, list[float]] = {v: [] for v in variants if v not in failed}
        for _ in range(pairs):
            for tr in own:
                dst = self.rng.choice(DC_PAGES, per, replace=False).tolist()
                t = self.pdx_send_once(tokens, src, dst, transport=tr)
                own[tr].append(t - self.last_write_s)
        o["nixl.small_fixed_cost_ms"] = statistics.median(own["nixl"]) * 1e3
        o["nixl.small_fixed_cost_mooncake_ms"] = statistics.median(own["tcp"]) * 1e3
        for t, (key, _) in NIXL_VARIANTS.items():
            if own.get(f"nixl:{t}"):
                o[f"{key}.small_fixed_cost_ms"] = statistics.median(own[f"nixl:{t}"]) * 1e3
        # entries: the same three cases as ``entries``, over NIXL
        saved = (self.pf, self.dc)
        self.pf, self.dc = self.npf, self.ndc
        keep = {k: v for k, v in o.items() if k.startswith("entries.")}
        try:
            self._entries_boot = self.nsrv.address
            self.entries()
            o["nixl.entries_equal_to_runs"] = o["entries.equal_to_runs"]
        finally:
            self.pf, self.dc = saved
            self._entries_boot = self.srv.address
            o.update(keep)

    # -- 4. machine limits -------------------------------------------------------------------------
    def limits(self) -> None:
        self.mark_load("limits")
        n = (128 if self.quick else 256) << 20
        a = np.ones(n, np.uint8)
        b = np.zeros(n, np.uint8)
        np.copyto(b, a)
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            np.copyto(b, a)
            ts.append(time.perf_counter() - t)
        self.out["limits.memcpy_gbps"] = mc = n / statistics.median(ts) / 1e9
        if "nixl.bulk_gbps" in self.out:
            self.out["nixl.fraction_of_memcpy"] = self.out["nixl.bulk_gbps"] / mc
        del a, b
        total = (256 if self.quick else 1024) << 20
        gb = [socket_stream(total) for _ in range(3)]
        self.out["limits.socket_gbps"] = statistics.median(gb)
        self.out["limits.socket_gbps_min_max"] = [min(gb), max(gb)]
        s = self.out["limits.socket_gbps"]
        if "bulk.raw_gbps" not in self.out:
            return  # --only: no bulk section
        self.out["limits.raw_fraction_of_socket"] = self.out["bulk.raw_gbps"] / s
        self.out["limits.pdxfer_fraction_of_socket"] = self.out["bulk.pdxfer_gbps"] / s

    # -- 5. cpu --------------------------------------------------------------------------------------
    def cpu_cost(self) -> None:
        size = max(t for _, t in self.bulk_res)
        pdx, raw = self.bulk_res[("pdxfer", size)], self.bulk_res[("raw", size)]
        per = [(p["cpu"] / p["bytes"] - r["cpu"] / r["bytes"]) * 1e9 for p, r in zip(pdx, raw)]
        self.out["cpu.seconds_per_gb"] = statistics.median(per)
        self.out["cpu.pdxfer_total_seconds_per_gb"] = statistics.median(
            p["cpu"] / p["bytes"] * 1e9 for p in pdx
        )
        self.out["cpu.raw_total_seconds_per_gb"] = statistics.median(
            r["cpu"] / r["bytes"] * 1e9 for r in raw
        )

    # -- 6. other helpers' figures -----------------------------------------------------------------
    def others(self) -> None:
        """The heterogeneous-TP and incremental benchmarks, their keys beside these."""
        for name, mod in (("bench_hetero", hetero), ("bench_incremental", incremental)):
            self.mark_load(name)
            try:
                self.out.update(mod.measure(quick=self.quick))
                if "incremental.l2_copy_gbps" in self.out:
                    self.out["incremental.l2_copy_fraction_of_memcpy"] = (
                        self.out["incremental.l2_copy_gbps"] / self.out["limits.memcpy_gbps"]
                    )
            except Exception as e:  # noqa: BLE001 - their failure must not lose our figures
                self.out[f"{name}.error"] = f"{type(e).__name__}: {e}"
                print(f"[bench] {name} failed: {type(e).__name__}: {e}", file=sys.stderr)


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--md", type=Path, help="write the headline table as Markdown here")
    ap.add_argument(
        "--only",
        choices=["nixl"],
        default=None,
        help="run only this section (and memcpy, for nixl.fraction_of_memcpy)",
    )
    ap.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="PNG of throughput against request size (default "
        "docs/assets/bench_transfer.png for a full run, none for --quick)",
    )


def main(a: argparse.Namespace) -> dict[str, Any]:
    threading.current_thread().name = "bench"
    t0 = time.monotonic()
    b = Bench(a.quick)
    b.mark_load("start")
    try:
        b.start()
        if a.only is None:
            b.bulk()
            b.entries()
        b.nixl()
        if a.only is None:
            b.small()
            b.integrity()
            b.cpu_cost()
    finally:
        b.close()
    b.limits()
    if a.only is None:
        b.others()
    b.out["seconds_total"] = time.monotonic() - t0
    if a.md:
        a.md.write_text(table(b.out) + "\n")
    png = a.plot or (None if a.quick or a.only else ROOT / "docs" / "assets" / "bench_transfer.png")
    if png:
        plot(b.out, png)
    return b.out


def passed(res: dict[str, Any]) -> bool:
    return (
        res.get("bulk.bytes_wrong", 0) == 0
        and res.get("nixl.bulk_bytes_wrong", 0) == 0
        and res.get("entries.equal_to_runs", True)
        and not any(k.endswith(".error") for k in res)
    )  # a helper benchmark failed


if __name__ == "__main__":
    from benchmarks.common import runner

    sys.exit(runner.run(sys.modules[__name__]))
