"""Goodput and inter-token latency under load: a pdxfer PD pair against colocated vLLM."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from openai import APIStatusError, AsyncOpenAI

from benchmarks.common.runner import log as _log
from benchmarks.common.runner import phase_start
from pdxfer import BootstrapServer
from pdxfer.serving.procs import Proc
from pdxfer.serving.vllm.local_model import build_model
from pdxfer.serving.vllm.servers import (
    VllmServer,
    dev_endpoints,
    kv_config,
    read_stats,
    start_all,
)

NAME = "goodput"
BS = 32
VARIANTS = ("pd", "colocated", "colocated_x2")
"""pd: prefill on core 0, decode on core 1, behind ``pdxfer router``; colocated: one server
on both cores; colocated_x2: one server per core, least-outstanding dispatch."""
PREFILLERS = {"pd": 1, "colocated": 1, "colocated_x2": 2}
"""Servers that prefill, per variant (the queue model's servers)."""
ATTAINMENT = 0.9
"""Goodput counts a rate while at least this share of its requests meets the target."""
CALIB_TOKENS = 24
"""Answer length of a calibration request (its median inter-token time is the step)."""


@dataclass(frozen=True)
class Plan:
    shape: str
    prompt_min: int
    prompt_max: int
    out_min: int
    out_max: int
    requests: int
    """Requests per rate (the same list for every variant)."""
    load: tuple[float, ...]
    """Rates as fractions of colocated's estimated prefill capacity (calibrated here)."""
    calib_lens: tuple[int, ...]
    kv_cache_mb: int
    exact_sample: int
    """Requests per rate whose tokens are compared across variants (the shortest answers
    first: all of them when larger than ``requests``)."""


FULL = Plan(
    shape="goodput",
    prompt_min=256,
    prompt_max=8192,
    out_min=32,
    out_max=512,
    requests=24,
    load=(0.1, 0.2, 0.35, 0.6, 1.0),
    calib_lens=(256, 1024, 2048, 4096, 8192),
    kv_cache_mb=1536,
    exact_sample=1000,
)
QUICK = Plan(
    shape="small",
    prompt_min=64,
    prompt_max=768,
    out_min=8,
    out_max=32,
    requests=6,
    load=(0.5, 1.5),
    calib_lens=(64, 768),
    kv_cache_mb=256,
    exact_sample=1000,
)
TARGETS = {
    # name: (TTFT bound in unloaded prefills, TPOT bound in unloaded decode steps)
    "tpot_strict": (8.0, 2.0),
    "ttft_strict": (3.0, 5.0),
}


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--seed", type=int, default=0, help="the workload's seed")
    ap.add_argument(
        "--workload",
        type=Path,
        default=None,
        help="read the requests from this file (as written to --workload-out) instead of "
        "drawing them from --seed",
    )
    ap.add_argument("--workload-out", type=Path, default=None, help="write the requests here")
    ap.add_argument(
        "--requests-out",
        type=Path,
        default=None,
        help="write every request's outcome here (JSON lines: variant, rate, the request, "
        "ttft, tpot, the pd router's prefill leg, error)",
    )
    ap.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"a subset of {','.join(VARIANTS)}"
    )
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="write ITL p99 and attainment against rate, a line per variant (PNG)",
    )


def log(msg: str) -> None:
    _log(NAME, msg)


# -- the workload -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Req:
    idx: int
    at: float
    """Seconds after the phase starts (open loop: sent then, whatever came before)."""
    prompt_len: int
    max_tokens: int
    seed: int

    def prompt(self) -> list[int]:
        """Token ids in the model's ordinary vocabulary, distinct per request (no prefix
        shared across requests: prefix reuse is another benchmark's subject)."""
        r = random.Random(self.seed)
        return [r.randrange(300, 900) for _ in range(self.prompt_len)]


def draw(plan: Plan, seed: int, rate: float, key: int) -> list[Req]:
    """Poisson arrivals at ``rate``; prompt lengths log-uniform over the plan's range, answer
    lengths uniform. ``key`` separates the rates' request lists."""
    r = random.Random(f"{seed}:{key}")
    t, out = 0.0, []
    lo, hi = math.log(plan.prompt_min), math.log(plan.prompt_max)
    for i in range(plan.requests):
        t += r.expovariate(rate)
        out.append(
            Req(
                i,
                round(t, 4),
                int(math.exp(r.uniform(lo, hi))),
                r.randint(plan.out_min, plan.out_max),
                r.randrange(1 << 30),
            )
        )
    return out


# -- one streamed request ---------------------------------------------------------------------


@dataclass
class Result:
    req: Req
    ttft: float = 0.0
    times: list[float] = field(default_factory=list)
    """When each chunk that carried a token arrived (seconds after the request was sent)."""
    ids: list[int] = field(default_factory=list)
    error: str = ""
    status: int = 0
    prefill_s: float | None = None
    """pd: the prefill leg as the router timed it (its ``pdxfer`` extension's ``prefill_s``),
    from the router's receipt of the request to the prefill's answer."""

    @property
    def ok(self) -> bool:
        return not self.error and len(self.ids) == self.req.max_tokens

    @property
    def tpot(self) -> float:
        n = len(self.ids)
        return (self.times[-1] - self.times[0]) / (n - 1) if n > 1 and self.times else 0.0

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


async def stream(client: AsyncOpenAI, req: Req) -> Result:
    """Greedy, ``ignore_eos``, streamed with ``logprobs=0`` (pdxfer's router then sends a
    chunk per token, as vLLM does); ids from vLLM's ``token_ids`` or the router's final
    ``pdxfer`` chunk."""
    res = Result(req)
    t0 = time.perf_counter()
    ext: dict[str, Any] = {}
    try:
        it = await client.completions.create(
            model="llama",
            prompt=req.prompt(),
            max_tokens=req.max_tokens,
            temperature=0,
            stream=True,
            logprobs=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        async for chunk in it:
            extra = chunk.model_extra or {}
            if isinstance(extra.get("pdxfer"), dict):
                ext = extra["pdxfer"]
            if not chunk.choices:
                continue
            ch = chunk.choices[0]
            got = list(getattr(ch, "token_ids", None) or [])
            lps = ch.logprobs.tokens if ch.logprobs is not None and ch.logprobs.tokens else []
            if got or lps or ch.text:
                now = time.perf_counter() - t0
                if not res.times:
                    res.ttft = now
                res.times.append(now)
            res.ids += got
    except APIStatusError as e:
        res.error, res.status = f"{e.status_code}: {e.message}"[:300], e.status_code
        return res
    except Exception as e:  # noqa: BLE001 - counted in the figures
        res.error = f"{type(e).__name__}: {e}"[:300]
        return res
    if not res.ids and ext.get("token_ids") is not None:
        res.ids = [int(t) for t in ext["token_ids"]]
    if isinstance(ext.get("prefill_s"), (int, float)):
        res.prefill_s = float(ext["prefill_s"])
    return res


# -- the variants -----------------------------------------------------------------------------


class Target:
    """Where a variant's requests go: one URL, or the least outstanding of several."""

    def __init__(self, name: str, urls: Sequence[str]) -> None:
        self.name = name
        self.clients = [
            AsyncOpenAI(base_url=f"{u}/v1", api_key="none", timeout=3600, max_retries=0)
            for u in urls
        ]
        self.outstanding = [0] * len(urls)

    async def send(self, req: Req) -> Result:
        i = min(range(len(self.clients)), key=lambda k: (self.outstanding[k], k))
        self.outstanding[i] += 1
        try:
            return await stream(self.clients[i], req)
        finally:
            self.outstanding[i] -= 1

    async def close(self) -> None:
        for c in self.clients:
            await c.close()


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of a server's processes (API server, engine core, and the connector's
    transfer threads; threads started later inherit it) on ``cores``: a side's KV sending
    or receiving then costs its own core, as on a host of its own, not the other side's."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for proc in procs:
        for t in proc.threads():
            try:
                os.sched_setaffinity(t.id, cores)
            except (ProcessLookupError, PermissionError):
                pass  # a thread that ended meanwhile


class Fleet:
    """Every variant's servers, up together (idle servers cost little), so variants can run
    interleaved rate by rate. Cores: the prefill and one replica on core 0, the decode and
    the other replica on core 1, colocated on both (``VLLM_CPU_OMP_THREADS_BIND`` for the
    forward's threads, ``pin`` for every other thread of the server)."""

    def __init__(self, tmp: Path, plan: Plan, variants: Sequence[str], timeout: float) -> None:
        self.tmp = tmp
        self.model = build_model(tmp / "model", plan.shape)
        self.boot = BootstrapServer("127.0.0.1", 0).start()
        self.stats = tmp / "decode-stats.json"
        self.servers: dict[str, VllmServer] = {}
        self.router: Proc | None = None
        kv = plan.kv_cache_mb << 20

        self.cores: dict[str, set[int]] = {}

        def server(name: str, cores: str, cfg: str | None = None) -> None:
            lo, _, hi = cores.partition("-")
            self.cores[name] = set(range(int(lo), int(hi or lo) + 1))
            self.servers[name] = VllmServer(
                name,
                self.model,
                tmp,
                block_size=BS,
                kv_cache_bytes=kv,
                kv_transfer_config=cfg,
                env={
                    "VLLM_CPU_OMP_THREADS_BIND": cores,
                    "OMP_NUM_THREADS": str(len(self.cores[name])),
                },
            )

        try:
            if "pd" in variants:
                server(
                    "prefill",
                    "0",
                    kv_config("kv_producer", {"bootstrap": self.boot.address, "instance": "p0"}),
                )
                server(
                    "decode",
                    "1",
                    kv_config(
                        "kv_consumer",
                        {
                            "bootstrap": self.boot.address,
                            "instance": "d0",
                            "stats_file": str(self.stats),
                        },
                        kv_load_failure_policy="recompute",
                    ),
                )
            if "colocated" in variants:
                server("colocated", "0-1")
            if "colocated_x2" in variants:
                server("replica0", "0")
                server("replica1", "1")
            start_all(list(self.servers.values()), timeout=timeout)
            for name, srv in self.servers.items():
                if len(self.cores[name]) == 1:  # colocated keeps vLLM's thread-per-core binding
                    pin(srv.pid, self.cores[name])
            if "pd" in variants:
                p, d = self.servers["prefill"], self.servers["decode"]
                self.router = Proc(
                    "router",
                    [
                        "--log-level",
                        "WARNING",
                        "router",
                        "--engine",
                        "vllm",
                        "--port",
                        "0",
                        "--timeout",
                        "3600",
                        "--prefill",
                        f"{p.url},{self.boot.address},p0",
                        "--decode",
                        f"{d.url},d0",
                    ],
                    timeout=timeout,
                )
        except BaseException:
            self.stop()
            raise

    def targets(self, variants: Sequence[str]) -> dict[str, Target]:
        s = self.servers
        urls = {
            "pd": [self.router.url] if self.router else [],
            "colocated": [s["colocated"].url] if "colocated" in s else [],
            "colocated_x2": [s[r].url for r in ("replica0", "replica1") if r in s],
        }
        return {v: Target(v, urls[v]) for v in variants}

    def reset_caches(self) -> None:
        """Every engine's prefix cache emptied (a phase computes all of its prompts)."""
        for srv in self.servers.values():
            end = time.monotonic() + 120
            while True:
                req = urllib.request.Request(f"{srv.url}/reset_prefix_cache", method="POST")
                with urllib.request.urlopen(req, timeout=30) as r:
                    if json.loads(r.read() or b"{}").get("success", True):
                        break
                if time.monotonic() > end:
                    raise RuntimeError(f"{srv.name} refused to reset its prefix cache")
                time.sleep(0.5)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time used so far by this process (the benchmark's client) and the router:
        unpinned, they share the cores with the engines."""

        def used(pid: int) -> float:
            t = psutil.Process(pid).cpu_times()
            return t.user + t.system

        out = {"client": used(os.getpid())}
        out["router"] = used(self.router.pid) if self.router is not None else 0.0
        return out

    def decode_stats(self) -> dict[str, Any]:
        return read_stats(self.stats)

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for srv in self.servers.values():
            srv.stop()
        self.boot.stop()


# -- phases and figures -----------------------------------------------------------------------


async def run_phase(target: Target, reqs: Sequence[Req]) -> tuple[list[Result], float]:
    """Send each request at its time (open loop) and wait for every answer."""
    t0 = time.perf_counter()

    async def one(r: Req) -> Result:
        await asyncio.sleep(max(0.0, r.at - (time.perf_counter() - t0)))
        return await target.send(r)

    out = await asyncio.gather(*(one(r) for r in reqs))
    return list(out), time.perf_counter() - t0


def pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


class Reference:
    """Unloaded figures of one variant (one request at a time): a prompt's time to first
    token and its answer's decode step, each by linear interpolation over the calibrated
    prompt lengths (a step over an 8k-token context costs more than over 256 tokens)."""

    def __init__(self, lens: Sequence[int], ttfts: Sequence[float], steps: Sequence[float]) -> None:
        self.lens, self.ttfts, self.steps = list(lens), list(ttfts), list(steps)

    def ttft(self, n: int) -> float:
        return interpolate(self.lens, self.ttfts, n)

    def step(self, n: int) -> float:
        return interpolate(self.lens, self.steps, n)

    def meets(self, r: Result, target: str) -> bool:
        f_ttft, f_tpot = TARGETS[target]
        n = r.req.prompt_len
        return r.ok and r.ttft <= f_ttft * self.ttft(n) and r.tpot <= f_tpot * self.step(n)


def interpolate(xs: Sequence[int], ys: Sequence[float], n: int) -> float:
    """``ys`` at ``n``: linear between the calibrated points, extended past the last."""
    if n <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if n <= x1:
            return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else ys[-1] / xs[-1]
    return ys[-1] + slope * (n - xs[-1])


async def calibrate(target: Target, plan: Plan, seed: int) -> tuple[Reference, dict[str, Any]]:
    """One request at a time, at each calibration length: the time to first token and the
    median inter-token time of a ``CALIB_TOKENS``-token answer, each the best of two."""
    ttfts, steps = [], []
    for k, n in enumerate(plan.calib_lens):
        best, step = math.inf, math.inf
        for rep in range(2):
            r = await target.send(Req(0, 0.0, n, CALIB_TOKENS, seed * 1000 + 10 * k + rep + 7))
            if r.error:
                raise RuntimeError(f"calibration request failed: {r.error}")
            best, step = min(best, r.ttft), min(step, statistics.median(r.itls()))
        ttfts.append(best)
        steps.append(step)
    ref = Reference(plan.calib_lens, ttfts, steps)
    rec: dict[str, Any] = {}
    for n, t, st in zip(plan.calib_lens, ttfts, steps):
        rec[f"unloaded.ttft_ms.{n}"] = round(1e3 * t, 2)
        rec[f"unloaded.decode_step_ms.{n}"] = round(1e3 * st, 2)
    return ref, rec


def unloaded(res: dict[str, Any], variant: str, lens: Sequence[int]) -> Reference:
    """A variant's own unloaded figures, as recorded in ``res``."""
    pre = "goodput." if variant == "colocated" else f"goodput.{variant}."
    return Reference(
        lens,
        [res[f"{pre}unloaded.ttft_ms.{n}"] / 1e3 for n in lens],
        [res[f"{pre}unloaded.decode_step_ms.{n}"] / 1e3 for n in lens],
    )


def fifo_ttfts(reqs: Sequence[Req], own: Reference, servers: int) -> list[float]:
    """Each request's time to first token had its variant's ``servers`` prefilled one
    request at a time, first come first served (the earliest free server next), each in its
    own unloaded time: what queueing for the prefill alone costs, with nothing else (decodes,
    transfers, the router) slowing a prefill."""
    free = [0.0] * servers
    out = []
    for r in sorted(reqs, key=lambda r: r.at):
        i = min(range(servers), key=lambda j: free[j])
        free[i] = max(r.at, free[i]) + own.ttft(r.prompt_len)
        out.append(free[i] - r.at)
    return out


def queue_model(res: dict[str, Any], variant: str, k: int, reqs: Sequence[Req]) -> dict[str, Any]:
    """``goodput.VARIANT.rK.fifo_model.*``: the FIFO queue model's TTFT for that phase."""
    own = unloaded(res, variant, [int(n) for n in _calib_lens(res)])
    tt = fifo_ttfts(reqs, own, PREFILLERS[variant])
    pre = f"goodput.{variant}.r{k}.fifo_model."
    return {
        pre + "ttft_p50_ms": round(1e3 * pct(tt, 50), 3),
        pre + "ttft_p99_ms": round(1e3 * pct(tt, 99), 3),
    }


def _calib_lens(res: dict[str, Any]) -> list[int]:
    return sorted(
        int(k.rsplit(".", 1)[1]) for k in res if k.startswith("goodput.unloaded.ttft_ms.")
    )


def attainment(results: Sequence[Result], ref: Reference, target: str) -> float:
    return sum(ref.meets(r, target) for r in results) / len(results) if results else 0.0


def goodput(rates: Sequence[float], att: Sequence[float]) -> float:
    """The highest rate at which at least ``ATTAINMENT`` of requests meet the target:
    interpolated linearly between the last tested rate that meets it (every lower rate
    meeting it too) and the next one; 0 when the lowest rate already fails."""
    best = 0.0
    for i, (r, a) in enumerate(zip(rates, att)):
        if a < ATTAINMENT:
            if i == 0:
                return 0.0
            r0, a0 = rates[i - 1], att[i - 1]
            return r0 + (r - r0) * (a0 - ATTAINMENT) / (a0 - a)
        best = r
    return best


def figures(results: Sequence[Result], ref: Reference) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    itl = [x for r in ok for x in r.itls()]
    refused = sum(r.status in (429, 503) for r in results)
    out = {
        "requests": len(results),
        "finished": len(ok),
        "failed": len(results) - len(ok) - refused,
        "refused": refused,
        "ttft_p50_ms": 1e3 * pct([r.ttft for r in ok], 50),
        "ttft_p99_ms": 1e3 * pct([r.ttft for r in ok], 99),
        "tpot_p50_ms": 1e3 * pct([r.tpot for r in ok], 50),
        "tpot_p99_ms": 1e3 * pct([r.tpot for r in ok], 99),
        "itl_p50_ms": 1e3 * pct(itl, 50),
        "itl_p99_ms": 1e3 * pct(itl, 99),
    }
    legs = [r for r in ok if r.prefill_s is not None]
    if legs:  # pd: its TTFT split at the prefill's answer
        out["prefill_leg_p50_ms"] = 1e3 * pct([r.prefill_s or 0.0 for r in legs], 50)
        out["after_prefill_p50_ms"] = 1e3 * pct([r.ttft - (r.prefill_s or 0.0) for r in legs], 50)
        out["after_prefill_p99_ms"] = 1e3 * pct([r.ttft - (r.prefill_s or 0.0) for r in legs], 99)
    for t in TARGETS:
        out[f"attainment.{t}"] = attainment(results, ref, t)
    out["ttft_met_share"] = (
        sum(
            r.ok and r.ttft <= TARGETS["ttft_strict"][0] * ref.ttft(r.req.prompt_len)
            for r in results
        )
        / len(results)
        if results
        else 0.0
    )
    errors = sorted({r.error for r in results if r.error})
    if errors:
        out["errors"] = "; ".join(errors[:3])
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


async def measure(a: argparse.Namespace, plan: Plan, tmp: Path) -> dict[str, Any]:
    variants = [v for v in a.variants.split(",") if v]
    bad = sorted(set(variants) - set(VARIANTS))
    if bad or "colocated" not in variants:
        raise SystemExit(f"--variants: unknown {bad} or colocated missing (the reference)")
    log(f"starting {len(variants)} variants' servers ({plan.shape} model)")
    fleet = Fleet(tmp, plan, variants, a.startup_timeout)
    res: dict[str, Any] = {}
    try:
        targets = fleet.targets(variants)
        ref, calib = await calibrate(targets["colocated"], plan, a.seed)
        res.update({f"goodput.{k}": v for k, v in calib.items()})
        for v in variants:  # the others' unloaded figures: what their layout costs alone
            if v != "colocated":
                _, own = await calibrate(targets[v], plan, a.seed)
                res.update({f"goodput.{v}.{k}": val for k, val in own.items()})
        prefill_s = statistics.fmean(
            ref.ttft(r.prompt_len) for r in draw(plan, a.seed, 1.0, 10_000)
        )
        capacity = 1.0 / prefill_s
        rates = [round(capacity * f, 4) for f in plan.load]
        log(f"unloaded: {calib}; capacity ~{capacity:.3f} req/s; rates {rates}")
        workload = (
            json.loads(a.workload.read_text())
            if a.workload
            else {
                str(rate): [asdict(r) for r in draw(plan, a.seed, rate, k)]
                for k, rate in enumerate(rates)
            }
        )
        if a.workload:
            rates = [float(k) for k in workload]
        if a.workload_out:
            a.workload_out.write_text(json.dumps(workload, indent=1))
        per: dict[str, dict[float, list[Result]]] = {v: {} for v in variants}
        stats0 = fleet.decode_stats()
        moved: dict[float, dict[str, float]] = {}
        for k, rate in enumerate(rates):
            reqs = [Req(**r) for r in workload[str(rate)]]
            order = variants[k % len(variants) :] + variants[: k % len(variants)]
            for v in order:  # interleaved: each rate's variants back to back, rotating
                fleet.reset_caches()
                before = fleet.decode_stats()
                ph = phase_start(1.0)
                cpu0 = fleet.cpu_seconds()
                out, secs = await run_phase(targets[v], reqs)
                cpu = {k: x - cpu0[k] for k, x in fleet.cpu_seconds().items()}
                per[v][rate] = out
                if a.requests_out:
                    with a.requests_out.open("a") as f:
                        for x in out:
                            row = {"variant": v, "rate": rate, **asdict(x.req)}
                            row |= {"ttft": x.ttft, "tpot": x.tpot, "prefill_s": x.prefill_s}
                            f.write(json.dumps(row | {"error": x.error}) + "\n")
                rec = figures(out, ref)
                log(
                    f"rate {rate:.3f} {v}: {rec['finished']}/{rec['requests']} in {secs:.0f} s, "
                    f"ttft p50 {rec['ttft_p50_ms']:.0f} ms, itl p99 {rec['itl_p99_ms']:.0f} ms"
                )
                pre = f"goodput.{v}.r{k}."
                res.update({pre + key: val for key, val in rec.items()})
                res[pre + "rate"] = rate
                res[pre + "seconds"] = round(secs, 2)
                res[pre + "loadavg_before"] = round(ph["loadavg_before"][0], 2)
                res[pre + "background_cores_before"] = ph["background_cores_before"]
                res[pre + "client_cpu_s"] = round(cpu["client"], 2)
                if v == "pd":
                    res[pre + "router_cpu_s"] = round(cpu["router"], 2)
                if v == "pd":
                    after = fleet.decode_stats()
                    moved[rate] = {
                        key: after.get(key, 0) - before.get(key, 0)
                        for key in ("load_failures", "net_bytes", "loads")
                    }
                    res[pre + "recomputed"] = moved[rate]["load_failures"]
                    res[pre + "kv_bytes"] = moved[rate]["net_bytes"]
        for v in variants:
            for k, rate in enumerate(rates):
                res.update(queue_model(res, v, k, [r.req for r in per[v][rate]]))
        res.update(summarize(per, rates, ref, variants, plan))
        res["goodput.rates"] = rates
        res["goodput.capacity_estimate_req_s"] = round(capacity, 4)
        res["goodput.shape"] = plan.shape
        res["goodput.requests_per_rate"] = plan.requests
        res["goodput.recomputed"] = sum(m["load_failures"] for m in moved.values())
        res["goodput.kv_bytes"] = fleet.decode_stats().get("net_bytes", 0) - stats0.get(
            "net_bytes", 0
        )
        for t, (ft, fp) in TARGETS.items():
            res[f"goodput.target.{t}.ttft_x_unloaded"] = ft
            res[f"goodput.target.{t}.tpot_x_unloaded"] = fp
        for v in variants:
            await targets[v].close()
    finally:
        fleet.stop()
    return res


def summarize(
    per: dict[str, dict[float, list[Result]]],
    rates: Sequence[float],
    ref: Reference,
    variants: Sequence[str],
    plan: Plan,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    colo = [v for v in variants if v.startswith("colocated")]
    for t in TARGETS:
        for v in variants:
            out[f"goodput.{v}.goodput_req_s.{t}"] = round(
                goodput(rates, [attainment(per[v][r], ref, t) for r in rates]), 4
            )
        if "pd" in variants:
            best = max(out[f"goodput.{v}.goodput_req_s.{t}"] for v in colo)
            pd = out[f"goodput.pd.goodput_req_s.{t}"]
            out[f"goodput.goodput_ratio_{t.replace('_strict', '')}_strict"] = (
                round(pd / best, 3) if best else (math.inf if pd else 0.0)
            )
    if "pd" in variants:
        # the highest rate where colocated (its better variant) still meets the TTFT target
        meets = [
            r
            for r in rates
            if any(figures(per[v][r], ref)["ttft_met_share"] >= ATTAINMENT for v in colo)
        ]
        if meets:
            r = max(meets)
            itl = {v: figures(per[v][r], ref)["itl_p99_ms"] for v in ["pd", *colo]}
            best = min(itl[v] for v in colo)
            out["goodput.itl_p99_rate"] = r
            out["goodput.itl_p99_ratio_pd_vs_colocated"] = round(itl["pd"] / best, 3)
        failed = sum(figures(per[v][r], ref)["failed"] for v in variants for r in rates)
        out["goodput.failed"] = failed
        out["goodput.refused"] = sum(
            figures(per[v][r], ref)["refused"] for v in variants for r in rates
        )
        checked = mism = 0
        for r in rates:
            ok_pd = {x.req.idx: x for x in per["pd"][r] if x.ok}
            ok_co = {x.req.idx: x for x in per["colocated"][r] if x.ok}
            both = sorted(set(ok_pd) & set(ok_co), key=lambda i: ok_pd[i].req.max_tokens)
            for i in both[: plan.exact_sample]:
                checked += 1
                mism += ok_pd[i].ids != ok_co[i].ids
        out["goodput.outputs_checked"] = checked
        out["goodput.outputs_mismatched"] = mism
    return out


def plot(res: dict[str, Any], path: Path) -> None:
    """ITL p99 and each target's attainment against the rate, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = res["goodput.rates"]
    variants = [v for v in VARIANTS if f"goodput.{v}.r0.rate" in res]
    fig, axes = plt.subplots(1, 1 + len(TARGETS), figsize=(5 * (1 + len(TARGETS)), 4))
    for v in variants:
        axes[0].plot(
            rates, [res[f"goodput.{v}.r{k}.itl_p99_ms"] for k in range(len(rates))], "o-", label=v
        )
        for ax, t in zip(axes[1:], TARGETS):
            att = [res[f"goodput.{v}.r{k}.attainment.{t}"] for k in range(len(rates))]
            ax.plot(
                rates, att, "o-", label=f"{v} (goodput {res[f'goodput.{v}.goodput_req_s.{t}']:.2f})"
            )
    axes[0].set(xlabel="request rate (req/s)", ylabel="ITL p99 (ms)", title="inter-token latency")
    axes[0].set_yscale("log")
    for ax, t in zip(axes[1:], TARGETS):
        ax.axhline(ATTAINMENT, color="grey", ls="--", lw=0.8)
        ax.set(xlabel="request rate (req/s)", ylabel="share meeting the target", title=t)
        ax.set_ylim(0, 1.05)
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"goodput: pdxfer PD against colocated vLLM ({res['goodput.shape']} model)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(a: argparse.Namespace) -> dict[str, Any]:
    plan = QUICK if a.quick else FULL
    dev_endpoints()  # reset_caches
    with tempfile.TemporaryDirectory(prefix="pdxfer-goodput-") as d:
        res = asyncio.run(measure(a, plan, Path(d)))
    if a.plot:
        plot(res, a.plot)
    return res


def passed(res: dict[str, Any]) -> bool:
    """Wrong results: a PD answer that differs from colocated's, or a request lost."""
    return res.get("goodput.outputs_mismatched", 0) == 0 and res.get("goodput.failed", 0) == 0


if __name__ == "__main__":
    import sys

    from benchmarks.common.runner import run

    sys.exit(run(sys.modules[__name__]))
