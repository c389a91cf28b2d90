"""pdxfer's vLLM connector against colocated vLLM and vLLM's own connectors, each phase alone."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai

from benchmarks.common.proccpu import TreeClock, busy_cores
from benchmarks.common.runner import phase_start
from benchmarks.common.vllm_bench import (
    NIXL_SHIM,
    pct,
    request_body,
    root_cause,
    tokens,
    ttft,
)
from benchmarks.common.vllm_proxy import FrontDoor
from pdxfer import BootstrapServer
from pdxfer.integrations.vllm.config import default as connector_default
from pdxfer.serving.vllm.local_model import SHAPES, build_model
from pdxfer.serving.vllm.servers import (
    Server,
    ServerNotReady,
    VllmServer,
    add_startup_timeout_arg,
    kv_config,
    nixl_connector,
    read_stats,
    start_one_by_one,
    start_together,
)
from pdxfer.transport.auto import pick
from pdxfer.transport.nixl import installed as nixl_installed

ROOT = Path(__file__).resolve().parent
BS = 32
ALL = ("colocated", "pdxfer_tcp", "pdxfer_nixl", "pdxfer_reuse", "builtin", "mooncake")
SECTIONS = ("alone", "contended")
Maker = Callable[[], Server]
PROBE = 350
"""Added to a question's seed for colocated's reference leg (``reference_leg``): seeds equal
modulo 700 draw the same ids (``tokens``), and the questions' seeds are 2-5 modulo 100."""


def default_transport() -> str:
    """What a user who sets no ``transport`` gets (the connector's own default)."""
    return str(connector_default("transport"))


def default_variant() -> str:
    """The variant that runs what a user who sets no transport gets. ``auto`` picks, on one
    host, the first of its preference both sides can run: NIXL where ``nixl-cu12`` (or
    cu13) is installed, else Mooncake TCP (both servers here run one installation)."""
    t = default_transport()
    if t in ("tcp", "nixl"):
        return f"pdxfer_{t}"
    can = ["tcp"] + (["nixl"] if nixl_installed() else [])
    return f"pdxfer_{pick(can, can, same_host=True) or 'tcp'}"


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every phase's servers share."""

    tmp: Path
    model: Path
    boot: str
    kv_bytes: int
    l2_pages: int
    max_len: int
    log_stats: bool = False
    """vLLM's own stats (its /metrics histograms) on every server, not only NixlConnector's
    decode (whose transfer counters the benchmark reads)."""
    trace_dir: Path | None = None
    """``scripts/trace_hooks`` stamps in every colocated and pdxfer server, one folder each."""


def makers(v: str, s: Setup, tag: str) -> tuple[list[Maker], dict[str, Any]]:
    """The variant's servers (built lazily, in start order) and its front door's settings."""
    lim = ["--max-model-len", str(s.max_len)]
    nocache = [*lim, "--no-enable-prefix-caching"]
    common = {"bootstrap_timeout_s": 120.0, "transfer_timeout_s": 120.0}

    def vllm(
        name: str,
        args: list[str],
        cfg: str | None,
        env: dict[str, str] | None = None,
        log_stats: bool = False,
    ) -> Maker:
        if s.trace_dir is not None and env is None:
            (s.trace_dir / f"{tag}_{name}").mkdir(parents=True, exist_ok=True)
            env = {
                "PDXFER_TRACE_VLLM": str(s.trace_dir / f"{tag}_{name}"),
                "PYTHONPATH": f"{ROOT / 'trace_hooks'}{os.pathsep}"
                f"{os.environ.get('PYTHONPATH', '')}",
            }
        return lambda: VllmServer(
            f"{tag}_{name}",
            s.model,
            s.tmp,
            kv_cache_bytes=s.kv_bytes,
            args=args,
            kv_transfer_config=cfg,
            env=env,
            log_stats=log_stats or s.log_stats,
            start=False,
        )

    if v == "colocated":
        return [vllm("colocated", lim, None)], {}
    if v.startswith("pdxfer"):
        transport = default_transport() if v == "pdxfer_reuse" else v.split("_", 1)[1]
        extra = {**common, "transport": transport, "bootstrap": s.boot}
        d_extra = {**extra, "instance": f"{tag}-d", "stats_file": str(s.tmp / f"{tag}_d.json")}
        if v == "pdxfer_reuse":
            d_extra["l2_pages"] = s.l2_pages
        return [
            vllm("d", nocache, kv_config("kv_consumer", d_extra)),
            vllm("p", lim, kv_config("kv_producer", {**extra, "instance": f"{tag}-p"})),
        ], {"decode_instance": f"{tag}-d", "stats": s.tmp / f"{tag}_d.json", "together": True}
    if v == "builtin":

        def nixl(name: str, role: str, args: list[str]) -> Maker:
            def make() -> Server:  # built once the server before it is up (its port)
                cfg, env = nixl_connector(role, NIXL_SHIM)
                return vllm(name, args, cfg, env, log_stats=role == "kv_consumer")()

            return make

        return [nixl("d", "kv_consumer", nocache), nixl("p", "kv_producer", lim)], {
            "connector": "nixl"
        }
    if v == "mooncake":

        def mc(role: str) -> str:
            return kv_config(
                role, {"mooncake_protocol": "tcp"}, connector="MooncakeConnector", module=None
            )

        return [vllm("p", lim, mc("kv_producer")), vllm("d", nocache, mc("kv_consumer"))], {
            "connector": "mooncake"
        }
    raise ValueError(f"unknown variant {v!r}; known: {ALL}")


def prom_sum(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


class Burners:
    """A fixed CPU load: one spinning process per core, each killed by pid."""

    def __init__(self, n: int) -> None:
        self.procs = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(n)
        ]

    def stop(self) -> None:
        for p in self.procs:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(30)


class Laps:
    """A phase's wall time, step by step (``vllm.phases``' ``seconds``): each call closes a
    step, named, at now; together they attribute a run's duration."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._t = time.monotonic()

    def __call__(self, step: str) -> float:
        now = time.monotonic()
        self.seconds[step] = round(now - self._t, 1)
        self._t = now
        return self.seconds[step]


@dataclasses.dataclass(frozen=True)
class Shape:
    rounds: int
    convs: int
    turns: int
    system: int
    question: int
    answer: int
    builtin_convs: int
    """NixlConnector's conversations per phase (``builtin_convs``, ``convs_of``): as many of
    the others' ``convs``, the same prompts."""


@dataclasses.dataclass(frozen=True)
class Ask:
    """One request of a phase's section: conversation ``conv``'s turn ``turn``, its question
    drawn from ``seed``."""

    conv: int
    turn: int
    seed: int


def builtin_convs(convs: int, rounds: int, turns: int, requests: int) -> int:
    """NixlConnector's conversations per phase: the fewest whole conversations that give it
    ``requests`` per section over the run, never more than the others get. Its requests are
    the slow part of a run (87 of run 1's 108 minutes), and its figures (TTFT and legs, p50
    and p90) need no more than the requests ``--quick`` gives every variant."""
    return min(convs, max(1, -(-requests // (rounds * turns))))


def convs_of(shape: Shape, v: str, rnd: int) -> list[int]:
    """The conversations a variant sends in round ``rnd``: all of them, or NixlConnector's
    next ``builtin_convs`` (round 0 the first ones, round 1 the ones after, and so on around):
    over the run it sends each conversation about as often, whole (every turn's share kept,
    so its p50s read the same prompt lengths as the others')."""
    k = shape.builtin_convs if v == "builtin" else shape.convs
    if k >= shape.convs:
        return list(range(shape.convs))
    return sorted({(rnd * k + j) % shape.convs for j in range(k)})


def asks(shape: Shape, v: str, rnd: int, section: str) -> list[Ask]:
    """A phase's timed requests in one section, in the order they are sent (turn by turn,
    the conversations in turn). Every variant sends the same prompts (a conversation's seeds
    depend on the round, the section and the conversation only), so answers compare request
    by request; NixlConnector sends its conversations' (``convs_of``)."""
    return [
        Ask(c, t, salt(section) + 1000 * rnd + 100 * c + t + 2)
        for t in range(shape.turns)
        for c in convs_of(shape, v, rnd)
    ]


def untimed_first(shape: Shape, v: str, rnd: int, section: str) -> Ask | None:
    """What a phase sends its prefill, untimed, before a section's timed requests: nothing,
    or, when they do not start with conversation 0 (NixlConnector's later rounds), that
    conversation's first turn. A section's conversations share a system prefix, so its first
    request computes it cold and the others find it cached: one timed request in 24 per half,
    as in run 1's 72 (3), not one in 8 of NixlConnector's every phase."""
    if convs_of(shape, v, rnd)[0] == 0:
        return None
    return Ask(0, 0, salt(section) + 1000 * rnd + 2)


def salt(section: str) -> int:
    """Seeds of the contended half: fresh prompts (nothing in any cache from the first)."""
    return 0 if section == "alone" else 50_000


def order(active: list[str], rnd: int) -> list[str]:
    """Round ``rnd``'s phases: the variants rotated by one each round, so each one meets the
    host's drift at a different place in the round."""
    k = rnd % len(active) if active else 0
    return active[k:] + active[:k]


@dataclasses.dataclass
class Samples:
    """One variant's requests in one section (alone or contended), over all its phases."""

    ttft: list[float] = dataclasses.field(default_factory=list)
    prefill: list[float] = dataclasses.field(default_factory=list)
    """A pair's prefill leg; colocated's leg of the same request shape (``prefill_leg``)."""
    first_chunk: list[float] = dataclasses.field(default_factory=list)
    """Colocated: the door's time to the first streamed chunk."""
    kv_bytes: float = 0.0
    ready_s: float = 0.0
    loads: float = 0.0
    failed: list[float] = dataclasses.field(default_factory=list)
    """Requests that got no complete answer (a timeout, a dropped stream): the seconds each
    took to fail. Their TTFT is at least that: they count in the TTFT percentiles as that
    (censored), not left out, or a variant that stalls would look faster than one that
    answers late."""
    skipped: int = 0
    """Later turns of a conversation whose request failed (each turn needs the last answer)."""


def converse(
    sent: list[Ask],
    opening: list[int],
    question: int,
    ask: Callable[[Ask, list[int]], list[int]],
    s: Samples,
) -> Iterator[tuple[Ask, float, Exception]]:
    """Send ``sent`` in order, each prompt its conversation's history (``opening``, then
    each turn's prompt and answer) plus the turn's question, through ``ask`` (which returns
    the answer's ids). A request that gets no complete answer (``openai.APIError``: a
    timeout, a dropped stream) is recorded in ``s.failed`` (the seconds it took) and yielded;
    its conversation's later turns, which need its answer, are skipped (``s.skipped``). The
    run goes on: one stalled request (NixlConnector beside the load once took over 600 s)
    must not lose the run's other phases."""
    hist: dict[int, list[int]] = {}
    lost: set[int] = set()
    for q in sent:
        if q.conv in lost:
            s.skipped += 1
            continue
        prompt = hist.get(q.conv, opening) + tokens(q.seed, question)
        t0 = time.perf_counter()
        try:
            ids = ask(q, prompt)
        except openai.APIError as e:
            s.failed.append(time.perf_counter() - t0)
            lost.add(q.conv)
            yield q, s.failed[-1], e
            continue
        hist[q.conv] = prompt + ids


def reference_leg(
    door: FrontDoor, prompt: list[int], held: int, seed: int, answer: int, timeout: float
) -> float:
    """Colocated's prefill leg of a pair's request shape, computing what a pair's prefill
    computes: after a conversation's turn, the door sends the colocated server what a
    pair's prefill gets for it (one token, not streamed, read whole), timed where a pair's
    leg is timed. ``held``: the prompt's first tokens a pair's prefill has in its prefix
    cache, the conversation's previous prompt (a prefill never computes the answers: the
    decode did). The colocated server also holds the previous answer, so the rest of the
    prompt is replaced by as many other tokens (``PROBE`` added to the turn's seed): it
    computes as many tokens, over as long a context, as the prefill does, and the next turn
    finds the conversation's cache as it would without it."""
    probe = prompt[:held] + tokens(seed + PROBE, len(prompt) - held)
    return door.prefill_leg(request_body(probe, answer), timeout=timeout)[0]


def kv_counters(
    door: FrontDoor | None, cfg: dict[str, Any], servers: list[Server]
) -> tuple[float, float, float]:
    """(bytes received, seconds until KV in place summed, loads) as the connector counts."""
    if "stats" in cfg:
        st = read_stats(cfg["stats"])
        return float(st.get("net_bytes", 0)), st.get("ready_us", 0) / 1e6, float(st.get("loads", 0))
    if cfg.get("connector") == "nixl":
        m = servers[0].metrics_text()  # the decode, started first
        return (
            prom_sum(m, "vllm:nixl_bytes_transferred_sum"),
            prom_sum(m, "vllm:nixl_xfer_time_seconds_sum"),
            prom_sum(m, "vllm:nixl_xfer_time_seconds_count"),
        )
    return 0.0, 0.0, 0.0


def phase(
    v: str,
    rnd: int,
    setup: Setup,
    shape: Shape,
    a: argparse.Namespace,
    got: dict[tuple[str, str], Samples],
    outs: dict[tuple[str, Any], list[int]],
    log: list[dict[str, Any]],
) -> None:
    tag = f"{v}_r{rnd}"
    lap = Laps()
    rec: dict[str, Any] = {"variant": v, "round": rnd, **phase_start(), "seconds": lap.seconds}
    log.append(rec)
    lap("background")
    mk, cfg = makers(v, setup, tag)
    try:
        servers = (start_together if cfg.get("together") else start_one_by_one)(
            mk, a.startup_timeout
        )
    finally:  # a start-up that failed took its time too (MooncakeConnector's try)
        rec["startup_s"] = lap("startup")
    door = None
    try:
        if cfg.get("connector") == "mooncake":
            raise NotImplementedError(
                "MooncakeConnector started, but this front door does not "
                "speak its protocol (not measured)"
            )
        if len(servers) == 2:
            door = FrontDoor(
                servers[1].url,
                servers[0].url,
                cfg.get("decode_instance"),
                connector=cfg.get("connector", "pdxfer"),
                timeout=a.request_timeout,
            ).start()
        else:  # the same proxy in front: the same hops, its leg timed at the same place
            door = FrontDoor(
                servers[0].url, "", connector="colocated", timeout=a.request_timeout
            ).start()
        url = door.url
        ttft(url, tokens(999, 2 * BS + 5), 2, a.request_timeout)  # one-time costs
        if len(servers) == 1:  # and those of the reference leg's request shape
            door.prefill_leg(request_body(tokens(998, 2 * BS + 5), 2), timeout=a.request_timeout)
        time.sleep(1.0)
        lap("warmup")
        rec["idle_cpu_cores"] = round(busy_cores([s.pid for s in servers], a.idle_seconds), 4)
        lap("idle")
        for section in SECTIONS if a.contended else SECTIONS[:1]:
            burn = Burners(os.cpu_count() or 1) if section == "contended" else None
            try:
                if burn:
                    time.sleep(1.0)
                rec[f"loadavg_{section}"] = os.getloadavg()
                sys_prefix = tokens(1 + salt(section) + 7 * rnd, shape.system)
                warm = untimed_first(shape, v, rnd, section)
                if warm is not None:  # to the prefill alone: what it caches is what matters
                    try:
                        door.prefill_leg(
                            request_body(
                                sys_prefix + tokens(warm.seed, shape.question), shape.answer
                            ),
                            timeout=a.request_timeout,
                        )
                    except Exception as e:  # noqa: BLE001 - untimed: recorded, the half goes on
                        # a cold NixlConnector prefill beside the load can take over 600 s
                        # here: one such request must not end the run
                        rec[f"untimed_failed_{section}"] = f"{type(e).__name__}: {e}"[:300]
                        print(
                            f"[bench_vllm] round {rnd} {v} {section}: the untimed first "
                            f"turn failed ({type(e).__name__}: {e})",
                            file=sys.stderr,
                        )
                k0 = kv_counters(door, cfg, servers)
                clock = TreeClock([p.pid for p in servers])
                s = got.setdefault((v, section), Samples())
                held: dict[int, int] = {}  # a prefill's cache: the conversation's last prompt
                sent = asks(shape, v, rnd, section)
                t_n0, f_n0 = len(s.ttft), len(s.failed)

                def ask(
                    q: Ask,
                    prompt: list[int],
                    s: Samples = s,
                    section: str = section,
                    held: dict[int, int] = held,
                ) -> list[int]:
                    dt, ids = ttft(url, prompt, shape.answer, a.request_timeout)
                    s.ttft.append(dt)
                    if len(servers) == 2:
                        s.prefill.append(door.prefill_seconds[-1])
                    else:
                        s.first_chunk.append(door.prefill_seconds[-1])
                        s.prefill.append(
                            reference_leg(
                                door,
                                prompt,
                                held.get(q.conv, shape.system),
                                q.seed,
                                shape.answer,
                                a.request_timeout,
                            )
                        )
                    outs[(v, (rnd, section, q.conv, q.turn))] = ids
                    held[q.conv] = len(prompt)
                    return ids

                for q, secs, e in converse(sent, sys_prefix, shape.question, ask, s):
                    rec.setdefault(f"failed_{section}", []).append(
                        {
                            "conv": q.conv,
                            "turn": q.turn,
                            "seconds": round(secs, 1),
                            "error": f"{type(e).__name__}: {e}"[:300],
                        }
                    )
                    print(
                        f"[bench_vllm] round {rnd} {v} {section}: conversation {q.conv} "
                        f"turn {q.turn} failed after {secs:.0f} s ({type(e).__name__}: "
                        f"{e}); its later turns are skipped",
                        file=sys.stderr,
                    )
                rec[f"busy_cpu_cores_{section}"] = round(clock.cores(), 3)
                k1 = kv_counters(door, cfg, servers)
                s.kv_bytes += k1[0] - k0[0]
                s.ready_s += k1[1] - k0[1]
                s.loads += k1[2] - k0[2]
            finally:
                if burn:
                    burn.stop()
                lap(section)
            # what of the section's time went to its requests' first tokens (the rest:
            # their answers' other tokens, colocated's reference legs, the load's start)
            rec[f"first_tokens_s_{section}"] = round(sum(s.ttft[t_n0:]) + sum(s.failed[f_n0:]), 1)
    finally:
        if door:
            door.close()
        for srv in reversed(servers):
            srv.stop()
        lap("stop")
    alone = got[(v, "alone")]
    print(
        f"[bench_vllm] round {rnd} {v}: up in {rec['startup_s']} s, idle "
        f"{rec['idle_cpu_cores']} cores, TTFT p50 "
        f"{1e3 * statistics.median(alone.ttft + alone.failed):.0f} ms alone; "
        f"seconds {lap.seconds}",
        file=sys.stderr,
    )


def compare_outputs(
    outs: dict[tuple[str, Any], list[int]], ref: str, others: list[str]
) -> tuple[bool, str]:
    """Whether every variant's answers equal ``ref``'s, request by request, over the requests
    it sent (NixlConnector sends a subset: ``asks``), and what was compared. A variant that
    answered nothing, or a request ``ref`` never sent, fails it."""
    keys = {k for (v, k) in outs if v == ref}
    ok = bool(keys)
    counts = []
    for v in others:
        mine = [k for (w, k) in outs if w == v]
        ok = ok and bool(mine) and all(k in keys and outs[(v, k)] == outs[(ref, k)] for k in mine)
        counts.append(f"{v} {len(mine)}")
    return ok, f"{', '.join(counts)} requests vs {ref} ({len(keys)})"


def summary(
    got: dict[tuple[str, str], Samples], log: list[dict[str, Any]], variants: list[str]
) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for (v, section), s in got.items():
        sfx = "" if section == "alone" else f".{section}"
        if s.failed or s.skipped:
            res[f"vllm.failed_requests.{v}{sfx}"] = len(s.failed)
            res[f"vllm.skipped_requests.{v}{sfx}"] = s.skipped
        if not s.ttft:
            continue
        # a failed request's TTFT is at least the time it took to fail (censored)
        res[f"vllm.ttft_p50_ms.{v}{sfx}"] = 1e3 * pct(s.ttft + s.failed, 0.5)
        res[f"vllm.ttft_p90_ms.{v}{sfx}"] = 1e3 * pct(s.ttft + s.failed, 0.9)
        res[f"vllm.requests.{v}{sfx}"] = len(s.ttft)
        if s.prefill:
            res[f"vllm.prefill_leg_p50_ms.{v}{sfx}"] = 1e3 * pct(s.prefill, 0.5)
            res[f"vllm.prefill_leg_p90_ms.{v}{sfx}"] = 1e3 * pct(s.prefill, 0.9)
        if s.first_chunk:
            res[f"vllm.first_chunk_p50_ms.{v}{sfx}"] = 1e3 * pct(s.first_chunk, 0.5)
            res[f"vllm.first_chunk_p90_ms.{v}{sfx}"] = 1e3 * pct(s.first_chunk, 0.9)
            # per request, in order (turn by turn): TTFT, first chunk, the reference leg
            res[f"vllm.requests_ms.{v}{sfx}"] = [
                [round(1e3 * t), round(1e3 * c), round(1e3 * p)]
                for t, c, p in zip(s.ttft, s.first_chunk, s.prefill)
            ]
        if s.prefill and v != "colocated":
            dec = [t - p for t, p in zip(s.ttft, s.prefill)]
            res[f"vllm.decode_leg_p50_ms.{v}{sfx}"] = 1e3 * pct(dec, 0.5)
            res[f"vllm.decode_leg_p90_ms.{v}{sfx}"] = 1e3 * pct(dec, 0.9)
            res[f"vllm.requests_ms.{v}{sfx}"] = [
                [round(1e3 * t), round(1e3 * p)] for t, p in zip(s.ttft, s.prefill)
            ]
        if s.loads:
            res[f"vllm.kv_ready_ms_mean.{v}{sfx}"] = 1e3 * s.ready_s / s.loads
            res[f"vllm.kv_mib.{v}{sfx}"] = s.kv_bytes / 2**20
            # comparable across variants that sent different numbers of requests
            res[f"vllm.kv_mib_per_request.{v}{sfx}"] = s.kv_bytes / 2**20 / len(s.ttft)
    for v in variants:
        res[f"vllm.phase_seconds.{v}"] = round(
            sum(sum(r["seconds"].values()) for r in log if r["variant"] == v and "seconds" in r), 1
        )
        idle = [r["idle_cpu_cores"] for r in log if r["variant"] == v and "idle_cpu_cores" in r]
        if idle:
            res[f"vllm.idle_cpu_cores.{v}"] = statistics.median(idle)
        for section in SECTIONS:
            busy = [
                r[f"busy_cpu_cores_{section}"]
                for r in log
                if r["variant"] == v and f"busy_cpu_cores_{section}" in r
            ]
            if busy:
                sfx = "" if section == "alone" else f".{section}"
                res[f"vllm.busy_cpu_cores.{v}{sfx}"] = statistics.median(busy)
    dflt = default_variant()

    def ratio(key: str, num: str, den: str, top: str = "ttft_p50_ms") -> None:
        for sfx in ("", ".contended"):
            a = res.get(f"vllm.{top}.{num}{sfx}")
            b = res.get(f"vllm.{den}{sfx}")
            if a and b:
                res[f"vllm.{key}.{num}{sfx}"] = a / b
                if num == dflt or (key.endswith("decode_reuse") and num == "pdxfer_reuse"):
                    res[f"vllm.{key}{sfx}"] = a / b

    for v in variants:
        if v.startswith("pdxfer"):
            ratio(
                "prefill_leg_p50_ratio_vs_colocated",
                v,
                "prefill_leg_p50_ms.colocated",
                "prefill_leg_p50_ms",
            )
            ratio(
                "prefill_leg_p50_ratio_vs_colocated_stream",
                v,
                "first_chunk_p50_ms.colocated",
                "prefill_leg_p50_ms",
            )
            ratio("ttft_p50_ratio_vs_builtin", v, "ttft_p50_ms.builtin")
    ratio("ttft_p50_ratio_decode_reuse", "pdxfer_reuse", f"ttft_p50_ms.{dflt}")
    ratio(
        "kv_ready_ratio_decode_reuse",
        "pdxfer_reuse",
        f"kv_ready_ms_mean.{dflt}",
        "kv_ready_ms_mean",
    )
    return res


def all_phases(
    shape: Shape,
    setup: Setup,
    a: argparse.Namespace,
    active: list[str],
    got: dict[tuple[str, str], Samples],
    outs: dict[tuple[str, Any], list[int]],
    log: list[dict[str, Any]],
    res: dict[str, Any],
) -> None:
    """Every phase of the run, in order; a MooncakeConnector that cannot run is recorded
    (``vllm.unsupported.mooncake``) and left out of ``active``."""
    for rnd in range(shape.rounds):
        for v in order(active, rnd):
            try:
                phase(v, rnd, setup, shape, a, got, outs, log)
            except (ServerNotReady, NotImplementedError) as e:
                if v != "mooncake":
                    raise
                # tried, measured: the reason is the server's own
                log_file = setup.tmp / f"mooncake_r{rnd}_p.log"
                res["vllm.unsupported.mooncake"] = root_cause(log_file) or str(e)[-2000:]
                res["vllm.unsupported.mooncake_log"] = str(log_file)
                log[-1]["failed"] = str(e).splitlines()[0]
                active.remove(v)
                print(f"[bench_vllm] mooncake left out: {str(e).splitlines()[0]}", file=sys.stderr)


def run(a: argparse.Namespace) -> dict[str, Any]:
    q = a.quick
    rounds, convs = a.rounds or (2 if q else 3), a.convs or (4 if q else 6)
    turns = a.turns or (3 if q else 4)
    shape = Shape(
        rounds=rounds,
        convs=convs,
        turns=turns,
        system=1024 if q else 1536,
        question=96 if q else 128,
        answer=16 if q else 24,
        builtin_convs=builtin_convs(convs, rounds, turns, a.builtin_requests),
    )
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    for v in variants:
        if v not in ALL:
            raise SystemExit(f"unknown variant {v!r}; known: {', '.join(ALL)}")
    sh = SHAPES["kv32k"]
    kv_per_token = sh.layers * 2 * sh.kv_heads * sh.head_size * 4  # float32
    longest = shape.system + shape.turns * (shape.question + shape.answer)
    max_len = -(-(longest + 64) // BS) * BS
    tmp = Path(tempfile.mkdtemp(prefix="pdxfer-bench-vllm-"))
    boot = BootstrapServer("127.0.0.1", 0).start()
    t_start = time.monotonic()
    got: dict[tuple[str, str], Samples] = {}
    outs: dict[tuple[str, Any], list[int]] = {}
    log: list[dict[str, Any]] = []
    res: dict[str, Any] = {
        "vllm.default_transport": default_transport(),
        "vllm.default_variant": default_variant(),
        "vllm.cores": os.cpu_count(),
        "vllm.quick": q,
        "vllm.shape": dataclasses.asdict(shape),
        "vllm.kv_bytes_per_token": kv_per_token,
    }
    try:
        setup = Setup(
            tmp,
            build_model(tmp / "model", "kv32k"),
            boot.address,
            3 * max_len * kv_per_token,
            2 * shape.convs * -(-longest // BS) + 64,
            max_len,
        )
        print(f"[bench_vllm] {shape}; variants {variants}; logs in {tmp}", file=sys.stderr)
        active = list(variants)
        try:
            all_phases(shape, setup, a, active, got, outs, log, res)
        except ServerNotReady:
            raise
        except Exception as e:  # noqa: BLE001 - what was measured is reported all the same
            # two full runs once lost 40 minutes each to one exception; the phases done are
            # kept, the run says why it ended (and exits 1)
            traceback.print_exc()
            res["vllm.error"] = f"{type(e).__name__}: {e}"[:2000]
            res["vllm.error_phase"] = (
                f"{log[-1]['variant']} round {log[-1]['round']}"
                if log
                else "before the first phase"
            )
        ref = "colocated" if "colocated" in variants else (active[0] if active else "")
        res["vllm.outputs_identical"], res["vllm.outputs_compared"] = compare_outputs(
            outs, ref, [v for v in active if v != ref]
        )
        res.update(summary(got, log, active))
        res["vllm.failed_requests_total"] = sum(len(s.failed) for s in got.values())
        res["vllm.phases"] = log
        res["vllm.loadavg_max_before_phase"] = max(
            (r["loadavg_before"][0] for r in log), default=None
        )
        res["vllm.background_cores_max_before_phase"] = max(
            (r["background_cores_before"] for r in log), default=None
        )
        res["vllm.seconds"] = time.monotonic() - t_start
        return res
    finally:
        boot.stop()


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rounds", type=int, help="phases per variant (default 3; quick 2)")
    ap.add_argument("--convs", type=int, help="conversations per phase (default 6; quick 4)")
    ap.add_argument("--turns", type=int, help="turns per conversation (default 4; quick 3)")
    ap.add_argument("--variants", default=",".join(ALL), help=f"of {', '.join(ALL)}")
    ap.add_argument(
        "--builtin-requests",
        type=int,
        default=24,
        help="NixlConnector's requests per section over the run, in whole "
        "conversations, at most the others' (default 24: 2 of the full "
        "run's 6 conversations a round, each once; all of --quick's 4)",
    )
    ap.add_argument(
        "--no-contended",
        dest="contended",
        action="store_false",
        help="leave out the half measured beside a CPU load",
    )
    add_startup_timeout_arg(ap)
    ap.add_argument(
        "--idle-seconds",
        type=float,
        default=10.0,
        help="how long each phase's idle CPU is measured (default 10)",
    )
    ap.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds one request may take (default 600)",
    )


def main(a: argparse.Namespace) -> dict[str, Any]:
    return run(a)


def passed(res: dict[str, Any]) -> bool:
    return bool(res["vllm.outputs_identical"]) and "vllm.error" not in res


if __name__ == "__main__":
    from benchmarks.common import runner

    sys.exit(runner.run(sys.modules[__name__]))
