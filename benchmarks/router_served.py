"""Served on vLLM: the router's prefill choice from KV events against round robin."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openai import OpenAI

from pdxfer import BootstrapServer
from pdxfer.netaddr import free_port
from pdxfer.serving.procs import Proc
from pdxfer.serving.vllm.local_model import build_model
from pdxfer.serving.vllm.servers import (
    ServerNotReady,
    VllmServer,
    dev_endpoints,
    kv_config,
    start_all,
)

BS = 32
VARIANTS = ("kv_aware", "round_robin")


@dataclass(frozen=True)
class Plan:
    convs: int
    turns: int
    system: int
    doc: int
    question: int
    answer: int
    concurrency: int
    rounds: int
    compare: int
    before_convs: int
    """Restart phase: conversations that may start before prefill 1 is back (those not
    started by the kill run while it is down)."""
    kill_at: int
    """Restart phase: prefill 1 is killed once this many requests have finished."""
    after_convs: int
    """Restart phase: conversations that start only once it is back."""
    restart_variants: tuple[str, ...] = VARIANTS

    def __post_init__(self) -> None:
        if not 0 < self.kill_at < self.before_convs * self.turns:
            raise ValueError("the kill must come while the first conversations run")


FULL = Plan(
    convs=6,
    turns=4,
    system=1024,
    doc=2560,
    question=64,
    answer=8,
    concurrency=3,
    rounds=2,
    compare=12,
    before_convs=6,
    kill_at=8,
    after_convs=9,
)
QUICK = Plan(
    convs=4,
    turns=3,
    system=256,
    doc=512,
    question=32,
    answer=4,
    concurrency=2,
    rounds=1,
    compare=4,
    before_convs=2,
    kill_at=2,
    after_convs=4,
    restart_variants=("kv_aware",),
)
PHASES = ("before_kill", "while_down", "after_return")


def ids(seed: int, n: int) -> list[int]:
    """Deterministic token ids (in the model's ordinary vocabulary)."""
    return [(seed * 7919 + 37 * i + (i * i) % 13) % 700 + 300 for i in range(n)]


@dataclass
class Req:
    conv: int
    turn: int
    prompt: list[int]
    t_send: float = 0.0
    ttft: float = 0.0
    prefill: str = ""
    out: list[int] = field(default_factory=list)
    reported: int = 0
    possible: int = 0
    reused: int = 0
    error: str = ""
    phase: str = ""


class Caches:
    """What each prefill's prefix cache holds, from what it served (block hashes as tuples
    of the chain's token prefixes would be large: the key is the prefix's Python hash)."""

    def __init__(self, prefills: list[str]) -> None:
        self.blocks = {p: set[int]() for p in prefills}
        self.lock = threading.Lock()

    @staticmethod
    def _chain(prompt: list[int]) -> list[int]:
        full = (len(prompt) - 1) // BS  # the last token is always computed
        return [hash(tuple(prompt[: (i + 1) * BS])) for i in range(full)]

    def held(self, p: str, prompt: list[int]) -> int:
        n = 0
        for h in self._chain(prompt):
            if h not in self.blocks[p]:
                break
            n += BS
        return n

    def snapshot(self, prompt: list[int]) -> dict[str, int]:
        with self.lock:
            return {p: self.held(p, prompt) for p in self.blocks}

    def served(self, p: str, prompt: list[int]) -> None:
        with self.lock:
            self.blocks[p].update(
                hash(tuple(prompt[: (i + 1) * BS])) for i in range(len(prompt) // BS)
            )

    def clear(self, p: str) -> None:
        with self.lock:
            self.blocks[p].clear()


class Fleet:
    def __init__(self, tmp: Path, quick: bool) -> None:
        self.tmp = tmp
        self.model = build_model(tmp / "model", "small")
        self.boot = BootstrapServer("127.0.0.1", 0).start()
        self.servers: list[VllmServer] = []
        self.events: list[tuple[str, str, str]] = []  # (cfg, pub, replay) per server
        self.routers: dict[str, Proc] = {}
        for _ in range(3):
            pub, rep = free_port(), free_port()
            cfg = json.dumps(
                {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"tcp://*:{pub}",
                    "replay_endpoint": f"tcp://*:{rep}",
                }
            )
            self.events.append((cfg, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}"))
        self.servers = [self.make(i) for i in range(3)]
        try:
            start_all(self.servers, timeout=600)
        except BaseException:
            self.boot.stop()
            raise

    def make(self, i: int, port: int | None = None) -> VllmServer:
        role, inst = ("kv_producer", f"p{i}") if i < 2 else ("kv_consumer", "d0")
        return VllmServer(
            f"prefill{i}" if i < 2 else "decode",
            self.model,
            self.tmp,
            block_size=BS,
            port=port,
            kv_cache_bytes=512 << 20,
            args=["--kv-events-config", self.events[i][0]],
            kv_transfer_config=kv_config(role, {"bootstrap": self.boot.address, "instance": inst}),
        )

    @property
    def prefills(self) -> list[VllmServer]:
        return self.servers[:2]

    def start_routers(self, baseline: str | None = None) -> None:
        base = [
            "--log-level",
            "WARNING",
            "router",
            "--engine",
            "vllm",
            "--port",
            "0",
            "--expose-cache-stats",
            "--decode",
            f"{self.servers[2].url},d0",
        ]
        for i, p in enumerate(self.prefills):
            base += ["--prefill", f"{p.url},{self.boot.address},p{i}"]
        kv = ["--policy", "kv_aware"]
        for s, (_, pub, rep) in zip(self.servers, self.events):
            kv += ["--kv-events", f"{s.url}={pub},{rep}"]
        self.routers["kv_aware"] = Proc("router-kv", [*base, *kv], timeout=180)
        self.routers["round_robin"] = Proc(
            "router-rr", [*base, "--policy", "round_robin"], timeout=180
        )
        if baseline:  # the same KV-aware router, another checkout's code
            self.routers["kv_aware_baseline"] = Proc(
                "router-base",
                [*base, *kv],
                timeout=180,
                env={"PYTHONPATH": str(Path(baseline).resolve())},
            )

    def reset_caches(self) -> int:
        """Empty every engine's prefix cache (vLLM refuses while blocks are still held, e.g.
        until the decode has pulled them: retried), then wait for the KV-aware router's
        index to drop them. Returns the refused tries."""
        refused = 0
        for s in self.servers:
            end = time.monotonic() + 120
            while True:
                req = urllib.request.Request(f"{s.url}/reset_prefix_cache", method="POST")
                with urllib.request.urlopen(req, timeout=30) as r:
                    if json.loads(r.read() or b"{}").get("success", True):
                        break
                refused += 1
                if time.monotonic() > end:
                    raise RuntimeError(f"{s.name} refused to reset its prefix cache")
                time.sleep(0.5)
        for s in self.servers:  # vLLM publishes the AllBlocksCleared at its next step
            OpenAI(
                base_url=f"{s.url}/v1", api_key="none", timeout=120, max_retries=0
            ).completions.create(model="llama", prompt=[300], max_tokens=1)
        end = time.monotonic() + 10
        while any(
            metrics(r.url).get("kv_indexed_blocks", 0) > 0
            for v, r in self.routers.items()
            if v.startswith("kv_aware")
        ):
            if time.monotonic() > end:  # a one-token prompt holds no full block: none left
                break
            time.sleep(0.2)
        return refused

    def stop(self) -> None:
        for r in self.routers.values():
            r.stop()
        for s in self.servers:
            s.stop()
        self.boot.stop()


def metrics(url: str) -> dict[str, float]:
    import re

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^pdxfer_router_(\w+?)(?:_total)? ([0-9.e+-]+)$", text, re.M)
    }


def stream(
    client: OpenAI, prompt: list[int], answer: int
) -> tuple[float, list[int], dict[str, Any]]:
    t0 = time.perf_counter()
    ttft, ext = 0.0, {}
    for ch in client.completions.create(
        model="llama",
        prompt=prompt,
        max_tokens=answer,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        # the first chunk: the router sends one per token that renders as text, else the
        # last (a first token that renders as nothing is not counted as no wait at all)
        if not ttft and ch.choices:
            ttft = time.perf_counter() - t0
        ext = (ch.model_extra or {}).get("pdxfer") or ext
    return ttft, list(ext.get("token_ids") or []), ext


def conversation(
    c: int, plan: Plan, system: list[int]
) -> tuple[list[int], Callable[..., list[int]]]:
    """The first prompt, and how a next prompt follows from a prompt and its answer."""
    first = system + ids(1000 + c, plan.doc)

    def nxt(prompt: list[int], out: list[int], turn: int) -> list[int]:
        return prompt + out + ids(5000 + 97 * c + turn, plan.question)

    return first, nxt


def phase(fleet: Fleet, variant: str, plan: Plan, restart: bool) -> dict[str, Any]:
    """One variant alone on a fixed list of conversations. The restart flavour kills
    prefill 1 once ``kill_at`` requests have finished and starts it again; conversations
    from ``before_convs`` on start only once it is back, so every variant gets the same
    requests and the same kill/return schedule whatever the restart takes."""
    refused = fleet.reset_caches()
    url = fleet.routers[variant].url
    caches = Caches([p.url for p in fleet.prefills])
    system = ids(7, plan.system)
    reqs: list[Req] = []
    lock = threading.Lock()
    nxt_conv = iter(range(10_000))
    back = threading.Event()
    finished = [0]
    n_convs = plan.before_convs + plan.after_convs if restart else plan.convs
    info: dict[str, Any] = {}

    def worker() -> None:
        client = OpenAI(base_url=f"{url}/v1", api_key="none", timeout=600, max_retries=0)
        while True:
            with lock:
                c = next(nxt_conv)
            if c >= n_convs:
                return
            if restart and c >= plan.before_convs:
                back.wait()
            prompt, follow = conversation(c, plan, system)
            for t in range(plan.turns):
                r = Req(c, t, prompt)
                held = caches.snapshot(prompt)
                r.possible = max(held.values())
                r.t_send = time.monotonic()
                try:
                    r.ttft, r.out, ext = stream(client, prompt, plan.answer)
                except Exception as e:  # noqa: BLE001 - counted in the figures
                    r.error = f"{type(e).__name__}: {e}"
                    with lock:
                        reqs.append(r)
                        finished[0] += 1
                    break
                r.prefill = str(ext.get("prefill", ""))
                r.reported = int(ext.get("prefill_cached_tokens", 0))
                r.reused = held.get(r.prefill, 0)
                caches.served(r.prefill, prompt)
                with lock:
                    reqs.append(r)
                    finished[0] += 1
                prompt = follow(prompt, r.out, t + 1)

    def restarter() -> None:
        try:
            while finished[0] < plan.kill_at:
                time.sleep(0.02)
            victim = fleet.servers[1]
            port = victim.port
            info["killed_at"] = time.monotonic()
            caches.clear(victim.url)  # first: a request sent from now on finds it empty
            victim.kill()
            while time.monotonic() - info["killed_at"] < 30:  # its port is free again
                with socket.socket() as sk:
                    if sk.connect_ex(("127.0.0.1", port)):
                        break
                time.sleep(0.1)
            again = fleet.make(1, port=port)
            fleet.servers[1] = again
            again.wait_ready(600)
            info["returned_at"] = time.monotonic()
        except BaseException as e:  # noqa: BLE001 - raised once the workers are done
            info["restart_error"] = e
        finally:
            back.set()

    load0 = os.getloadavg()
    t0 = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(plan.concurrency)]
    if restart:
        threads.append(threading.Thread(target=restarter))
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if "restart_error" in info:
        raise info["restart_error"]
    rec: dict[str, Any] = {
        "variant": variant,
        "restart": restart,
        "reqs": reqs,
        "seconds": time.monotonic() - t0,
        "load_before": load0,
        "load_after": os.getloadavg(),
        "metrics": metrics(url),
        "prefill0": fleet.prefills[0].url,
        "reset_refused": refused,
        **info,
    }
    if restart:
        p1 = fleet.servers[1].url
        for r in reqs:
            r.phase = (
                "before_kill"
                if r.t_send < info["killed_at"]
                else "while_down"
                if r.t_send < info["returned_at"]
                else "after_return"
            )
        back_reqs = [
            r
            for r in sorted(reqs, key=lambda r: r.t_send)
            if r.phase == "after_return" and r.prefill == p1 and r.reported > 0
        ]
        rec["recovery_s"] = back_reqs[0].t_send - info["returned_at"] if back_reqs else None
        rec["to_restarted_after_return"] = sum(
            1 for r in reqs if r.phase == "after_return" and r.prefill == p1
        )
        rec["down_s"] = info["returned_at"] - info["killed_at"]
    return rec


def p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def summarize(phases: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ttft: dict[tuple[str, str], float] = {}
    for v in dict.fromkeys(p["variant"] for p in phases):
        ps = [p for p in phases if p["variant"] == v]
        reqs = [r for p in ps for r in p["reqs"]]
        k = f"{prefix}.{v}"
        out.update(figures(k, reqs, ps[0]["prefill0"]))
        ttft[v, ""] = p50([r.ttft for r in reqs if not r.error])
        if ps[0]["restart"]:
            for ph in PHASES:
                part = [r for r in reqs if r.phase == ph]
                ok = [r for r in part if not r.error]
                ttft[v, ph] = p50([r.ttft for r in ok])
                out[f"{k}.requests.{ph}"] = len(part)
                out[f"{k}.ttft_p50_ms.{ph}"] = round(ttft[v, ph] * 1e3, 2)
                out[f"{k}.to_prefill0_share.{ph}"] = share(ok, ps[0]["prefill0"])
                out[f"{k}.prefill_reused_fraction_of_possible.{ph}"] = reuse(ok)
            rec = ps[-1]
            out[f"{k}.down_s"] = round(rec["down_s"], 2)
            out[f"{k}.recovery_s"] = (
                round(rec["recovery_s"], 3) if rec.get("recovery_s") is not None else -1.0
            )
            out[f"{k}.to_restarted_after_return"] = rec["to_restarted_after_return"]
        out[f"{k}.seconds"] = round(sum(p["seconds"] for p in ps), 2)
        out[f"{k}.load_before"] = round(ps[0]["load_before"][0], 2)
        out[f"{k}.load_after"] = round(ps[-1]["load_after"][0], 2)
        if v.startswith("kv_aware"):
            m = ps[-1]["metrics"]
            for c in (
                "gaps",
                "bad_frames",
                "resets",
                "replays",
                "misses",
                "unpublished",
                "stale",
            ):  # stale: feeds the router stopped trusting (kv_stale.py)
                out[f"{k}.kv_events_{c}"] = m.get(f"kv_events_{c}", 0)
    out[f"{prefix}.prefill_reused_fraction_of_possible"] = out[
        f"{prefix}.kv_aware.prefill_reused_fraction_of_possible"
    ]
    for ph in ("", *PHASES):
        rr = ttft.get(("round_robin", ph))
        tail = f".{ph}" if ph else ""
        for v in ("kv_aware", "kv_aware_baseline"):
            if rr and (v, ph) in ttft:
                out[f"{prefix}.ttft_p50_ratio_{v}_vs_round_robin{tail}"] = round(
                    ttft[v, ph] / rr, 4
                )
    return out


def share(reqs: list[Req], prefill0: str) -> float:
    return round(sum(r.prefill == prefill0 for r in reqs) / len(reqs), 3) if reqs else 0.0


def reuse(reqs: list[Req]) -> float:
    possible = sum(r.possible for r in reqs)
    return round(sum(r.reused for r in reqs) / possible, 4) if possible else 0.0


def figures(k: str, reqs: list[Req], prefill0: str) -> dict[str, Any]:
    """One variant's figures over ``reqs`` (its phases' requests)."""
    ok = [r for r in reqs if not r.error]
    possible = sum(r.possible for r in ok)
    t = [r.ttft for r in ok]
    return {
        f"{k}.requests": len(reqs),
        f"{k}.errors": len(reqs) - len(ok),
        f"{k}.prompt_tokens": sum(len(r.prompt) for r in ok),
        f"{k}.possible_tokens": possible,
        f"{k}.reused_tokens": sum(r.reused for r in ok),
        f"{k}.to_prefill0_share": share(ok, prefill0),
        f"{k}.prefill_reused_fraction_of_possible": reuse(ok),
        f"{k}.router_reported_fraction": (
            round(sum(r.reported for r in ok) / possible, 4) if possible else 0.0
        ),
        f"{k}.ttft_p50_ms": round(p50(t) * 1e3, 2),
        f"{k}.ttft_p90_ms": round(statistics.quantiles(t, n=10)[-1] * 1e3, 2)
        if len(t) > 1
        else 0.0,
        f"{k}.ttft_followup_p50_ms": round(p50([r.ttft for r in ok if r.turn > 0]) * 1e3, 2),
    }


def compare(fleet: Fleet, phases: list[dict[str, Any]], n: int, answer: int) -> dict[str, Any]:
    """Token for token against prefill 0 serving the prompt alone (colocated vLLM)."""
    reqs = [r for p in phases for r in p["reqs"] if not r.error]
    step = max(1, len(reqs) // n)
    sample = reqs[::step][:n]
    client = OpenAI(
        base_url=f"{fleet.prefills[0].url}/v1", api_key="none", timeout=600, max_retries=0
    )
    bad = 0
    for r in sample:
        ref = client.completions.create(
            model="llama",
            prompt=r.prompt,
            max_tokens=answer,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        bad += list(getattr(ref.choices[0], "token_ids", None) or []) != r.out
    return {"router.outputs_compared": len(sample), "router.outputs_mismatched": bad}


def run(a: argparse.Namespace) -> dict[str, Any]:
    plan = QUICK if a.quick else FULL
    res: dict[str, Any] = {
        "router.quick": a.quick,
        "router.load_before": round(os.getloadavg()[0], 2),
        "router.convs": plan.convs,
        "router.turns": plan.turns,
        "router.concurrency": plan.concurrency,
        "router.system_tokens": plan.system,
        "router.doc_tokens": plan.doc,
        "router.question_tokens": plan.question,
        "router.answer_tokens": plan.answer,
        "router.rounds": plan.rounds,
        "router.restart.before_convs": plan.before_convs,
        "router.restart.kill_at_requests": plan.kill_at,
        "router.restart.after_convs": plan.after_convs,
        "router.restart.variants": ",".join(plan.restart_variants),
    }
    keep = tempfile.mkdtemp(prefix="bench_router_served_", dir=a.workdir) if a.workdir else None
    with (
        contextlib.nullcontext(keep)
        if keep
        else tempfile.TemporaryDirectory(prefix="bench_router_served_")
    ) as tmp:
        t0 = time.monotonic()
        for attempt in range(3):  # a port picked free may be taken before vLLM binds it
            try:
                fleet = Fleet(Path(tmp), a.quick)
                break
            except ServerNotReady:
                if attempt == 2:
                    raise
        try:
            fleet.start_routers(a.baseline_tree)
            variants = list(fleet.routers)
            res["router.startup_s"] = round(time.monotonic() - t0, 1)
            steady: list[dict[str, Any]] = []
            for rnd in range(plan.rounds):
                for v in variants if rnd % 2 == 0 else variants[::-1]:
                    steady.append(phase(fleet, v, plan, restart=False))
            res.update(summarize(steady, "router"))
            restarts = [phase(fleet, v, plan, restart=True) for v in plan.restart_variants]
            res.update(summarize(restarts, "router.restart"))
            for k in ("recovery_s", "down_s", "to_restarted_after_return"):
                res[f"router.restart.{k}"] = res[f"router.restart.kv_aware.{k}"]
            res.update(compare(fleet, steady + restarts, plan.compare, plan.answer))
            if keep:
                with open(Path(keep) / "requests.jsonl", "w") as f:
                    for p in steady + restarts:
                        for r in p["reqs"]:
                            f.write(
                                json.dumps(
                                    {
                                        "variant": p["variant"],
                                        "restart": p["restart"],
                                        "killed_at": p.get("killed_at"),
                                        "returned_at": p.get("returned_at"),
                                        **{
                                            k: v
                                            for k, v in vars(r).items()
                                            if k not in ("prompt", "out")
                                        },
                                        "len": len(r.prompt),
                                    }
                                )
                                + "\n"
                            )
        finally:
            fleet.stop()
    res["router.load_after"] = round(os.getloadavg()[0], 2)
    return res


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--workdir",
        help="keep the model, server logs and requests.jsonl in a "
        "new folder here (default: a temporary folder, removed)",
    )
    ap.add_argument(
        "--baseline-tree",
        help="also run the KV-aware router from this "
        "checkout (e.g. main) in the steady phases: variant kv_aware_baseline",
    )


def main(a: argparse.Namespace) -> dict[str, Any]:
    dev_endpoints()
    return run(a)


def passed(res: dict[str, Any]) -> bool:
    """No request failed and the sampled outputs equal colocated vLLM's."""
    return (
        res.get("router.outputs_mismatched", 1) == 0
        and res.get("router.kv_aware.errors", 1) == 0
        and res.get("router.round_robin.errors", 1) == 0
    )


if __name__ == "__main__":
    from benchmarks.common import runner

    sys.exit(runner.run(sys.modules[__name__]))
