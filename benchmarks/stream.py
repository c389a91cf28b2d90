"""KV streamed as it is computed: vLLM prefill and decode on two hosts, uncapped and capped links."""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common.proccpu import busy_cores
from benchmarks.common.runner import Unavailable, phase_start
from benchmarks.common.vllm_bench import (
    Reply,
    pct,
    root_cause,
    stream_request,
    tokens,
)
from pdxfer import ConfigError
from pdxfer.integrations.vllm.config import parse as parse_connector_config
from pdxfer.serving.procs import Proc, ProcessStartError
from pdxfer.serving.vllm.local_model import SHAPES, build_model
from pdxfer.serving.vllm.servers import (
    Server,
    ServerNotReady,
    VllmServer,
    add_startup_timeout_arg,
    kv_config,
    start_one_by_one,
    start_together,
)
from tests.harness.hosts import Host, Network, root_reason

BS = 32
PD = {
    "sequential": ("sequential", "request"),
    "concurrent_request": ("concurrent", "request"),
    "concurrent_step": ("concurrent", "step"),
    "concurrent_layer": ("concurrent", "layer"),
}
"""A PD variant's router dispatch and its prefill's send mode."""
ALL = ("colocated", *PD)
LINKS = ("uncapped", "capped")
LAYERWISE, SEQUENTIAL, WHOLE = "concurrent_layer", "sequential", "concurrent_request"
Key = tuple[int, int, int, int]
"""A prompt: (round, concurrency, tokens, index)."""


def log(msg: str) -> None:
    print(f"[bench_stream] {msg}", file=sys.stderr, flush=True)


def send_settings(mode: str) -> tuple[dict[str, Any] | None, str]:
    """The prefill's extra config for a send mode, asked of the connector's own parser:
    ``send_by`` where it is known; else ``send_per_step`` for ``request``/``step`` and, for
    ``layer``, None with the reason."""
    base = {"bootstrap": "127.0.0.1:1"}
    try:
        parse_connector_config("kv_producer", {**base, "send_by": mode})
        return {"send_by": mode}, ""
    except ConfigError as e:
        if mode == "layer":
            return None, f"the connector refuses send_by 'layer': {e}"
    return {"send_per_step": mode == "step"}, ""


@dataclasses.dataclass(frozen=True)
class Setup:
    tmp: Path
    model: Path
    net: Network
    boot: str
    secret: str
    kv_bytes: int
    max_len: int

    @property
    def p(self) -> Host:
        return self.net["p"]

    @property
    def d(self) -> Host:
        return self.net["d"]


@dataclasses.dataclass
class Run:
    """Everything measured so far."""

    ttft: dict[tuple[str, str, int, int], list[float]] = dataclasses.field(default_factory=dict)
    prefill: dict[tuple[str, str, int, int], list[float]] = dataclasses.field(default_factory=dict)
    outs: dict[tuple[str, str, Key], list[int]] = dataclasses.field(default_factory=dict)
    errors: list[str] = dataclasses.field(default_factory=list)
    phases: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    unavailable: dict[str, str] = dataclasses.field(default_factory=dict)


def servers_for(
    unit: str, s: Setup, tag: str, extra: dict[str, Any], dtag: str
) -> list[Callable[[], Server]]:
    """A phase's servers, in start order (the decode, tagged ``dtag``, before the prefill)."""
    lim = ["--max-model-len", str(s.max_len), "--no-enable-prefix-caching"]
    net_env = {"PDXFER_SECRET": s.secret}

    def vllm(
        name: str, host: Host, addr: str, cfg: str | None, env: dict[str, str], t: str = tag
    ) -> Callable[[], Server]:
        return lambda: VllmServer(
            f"{t}_{name}",
            s.model,
            s.tmp,
            kv_cache_bytes=s.kv_bytes,
            args=lim,
            kv_transfer_config=cfg,
            env=env,
            start=False,
            addr=addr,
            prefix=host.prefix,
            enter=host.enter,
        )

    if unit == "colocated":
        return [vllm("colocated", s.d, "127.0.0.1", None, {})]
    common = {"bootstrap": s.boot, "bootstrap_timeout_s": 120.0, "transfer_timeout_s": 120.0}
    d_cfg = kv_config("kv_consumer", {**common, "instance": f"{dtag}-d", "host": s.d.addr})
    p_cfg = kv_config("kv_producer", {**common, **extra, "instance": f"{tag}-p", "host": s.p.addr})
    return [
        vllm("d", s.d, s.d.addr, d_cfg, net_env, dtag),
        vllm("p", s.p, s.p.addr, p_cfg, net_env),
    ]


def ask_all(
    s: Setup, url: str, prompts: list[list[int]], conc: int, answer: int, timeout: float
) -> list[Reply | Exception]:
    """``prompts`` sent from host ``d``, ``conc`` at a time (a batch of ``conc`` goes out at
    once)."""

    def one(p: list[int]) -> Reply | Exception:
        with s.d.enter():
            try:
                return stream_request(url, p, answer, timeout, logprobs=0)
            except Exception as e:  # recorded and counted, the run goes on
                return e

    with ThreadPoolExecutor(conc) as pool:
        return list(pool.map(one, prompts))


def measure(
    variant: str, link: str, url: str, s: Setup, a: argparse.Namespace, rnd: int, run: Run
) -> None:
    for conc in (1, 4):
        n = a.requests if conc == 1 else 4 * a.batches
        for size in a.sizes:
            keys: list[Key] = [(rnd, conc, size, i) for i in range(n)]
            prompts = [
                tokens(1 + rnd * 100_000 + conc * 10_000 + size + 7 * i, size)
                for (_, _, _, i) in keys
            ]
            for k, r in zip(keys, ask_all(s, url, prompts, conc, a.answer, a.request_timeout)):
                if isinstance(r, Exception):
                    run.errors.append(f"{variant} {link} {k}: {type(r).__name__}: {r}"[:500])
                    continue
                run.ttft.setdefault((variant, link, size, conc), []).append(r.ttft)
                if r.ext.get("prefill_s") is not None:
                    run.prefill.setdefault((variant, link, size, conc), []).append(
                        float(r.ext["prefill_s"])
                    )
                run.outs[(variant, link, k)] = r.ids


def warm(s: Setup, url: str, a: argparse.Namespace) -> None:
    """One short request: the servers' one-time costs stay out of the figures."""
    r = ask_all(s, url, [tokens(999, 2 * BS + 5)], 1, 2, a.request_timeout)[0]
    if isinstance(r, Exception):
        raise RuntimeError(f"the warm-up request failed: {r}")


def calibrate(s: Setup, url: str, a: argparse.Namespace) -> float:
    """The colocated prefill of a fresh ``--match-tokens`` prompt (TTFT of one token,
    median of three; quick: of one), in seconds."""
    got = []
    for i in range(1 if a.quick else 3):
        r = ask_all(s, url, [tokens(5_000_000 + i, a.match_tokens)], 1, 1, a.request_timeout)[0]
        if isinstance(r, Exception):
            raise RuntimeError(f"the calibration request failed: {r}")
        got.append(r.ttft)
    return statistics.median(got)


def set_link(s: Setup, link: str, mbit: float) -> None:
    if link == "capped":
        s.p.cap(mbit)
    else:
        s.p.uncap()


def phase(
    unit: str,
    rnd: int,
    s: Setup,
    a: argparse.Namespace,
    run: Run,
    cal: dict[str, float],
    kept: dict[str, Server],
) -> None:
    """One prefill mode's servers up, its variants measured on both links (one router per
    variant, for both), then down. A PD pair starts together: its two hosts are two network
    namespaces, so no port either picks can collide with the other's. ``--quick``: the
    round's PD phases share one decode, kept in ``kept`` (the caller stops it)."""
    variants = (
        ["colocated"]
        if unit == "colocated"
        else [v for v in a.variants if v in PD and PD[v][1] == unit]
    )
    tag = f"{unit}_r{rnd}"
    rec: dict[str, Any] = {
        "phase": unit,
        "round": rnd,
        "variants": variants,
        **phase_start(min(3.0, a.idle_seconds)),
    }
    run.phases.append(rec)
    extra: dict[str, Any] = {}
    if unit != "colocated":
        got, why = send_settings(unit)
        if got is None:
            rec["unavailable"] = why
            for v in variants:
                run.unavailable[v] = why
            log(f"{unit}: unavailable: {why}")
            return
        extra = got
        rec["prefill_extra"] = extra
    keep = a.quick and unit != "colocated"
    dtag = f"pd_r{rnd}" if keep else tag
    makers = servers_for(unit, s, tag, extra, dtag)
    t0 = time.monotonic()
    try:
        if unit == "colocated":
            servers = start_one_by_one(makers, a.startup_timeout)
        elif dtag in kept:
            servers = [kept[dtag], *start_together(makers[1:], a.startup_timeout)]
        else:
            servers = start_together(makers, a.startup_timeout)
            if keep:
                kept[dtag] = servers[0]
    except ServerNotReady as e:
        if unit != "layer":
            raise
        why = root_cause(s.tmp / f"{tag}_p.log") or str(e).splitlines()[0]
        rec["unavailable"] = why
        for v in variants:
            run.unavailable[v] = f"its prefill did not start: {why}"
        log(f"{unit}: its servers did not start: {why}")
        return
    routers: dict[str, Proc] = {}
    try:
        rec["startup_s"] = round(time.monotonic() - t0, 1)
        links = LINKS if rnd % 2 == 0 else LINKS[::-1]
        if unit == "colocated":
            url = servers[0].url
            warm(s, url, a)
            if "prefill_s" not in cal:
                cal["prefill_s"] = calibrate(s, url, a)
                cal["mbit"] = a.kv_per_token * a.match_tokens * 8 / cal["prefill_s"] / 1e6
                log(
                    f"colocated prefill of {a.match_tokens} tokens: "
                    f"{1e3 * cal['prefill_s']:.0f} ms; cap {cal['mbit']:.1f} Mbit/s"
                )
            time.sleep(1.0)
            rec["idle_cpu_cores"] = round(busy_cores([x.pid for x in servers], a.idle_seconds), 4)
            rec["loadavg_measured"] = os.getloadavg()
            measure("colocated", "", url, s, a, rnd, run)
            return
        d, p = servers
        for i, link in enumerate(links):
            set_link(s, link, cal["mbit"])
            for v in variants if i % 2 == 0 else variants[::-1]:
                if v not in routers:
                    routers[v] = Proc(
                        "router",
                        [
                            "router",
                            "--engine",
                            "vllm",
                            "--port",
                            "0",
                            "--dispatch",
                            PD[v][0],
                            "--tokenizer",
                            str(s.model),
                            "--timeout",
                            str(a.request_timeout),
                            "--prefill",
                            f"{p.url},{s.boot},{tag}-p",
                            "--decode",
                            f"{d.url},{dtag}-d",
                        ],
                        prefix=s.d.prefix,
                        timeout=180,
                        env={"PDXFER_SECRET": s.secret},
                    )
                router = routers[v]
                warm(s, router.url, a)
                if "idle_cpu_cores" not in rec:
                    time.sleep(1.0)
                    rec["idle_cpu_cores"] = round(
                        busy_cores([x.pid for x in servers], a.idle_seconds), 4
                    )
                rec[f"loadavg_{v}_{link}"] = os.getloadavg()
                shaped0 = s.p.shaped()
                measure(v, link, router.url, s, a, rnd, run)
                if link == "capped":
                    shaped1 = s.p.shaped()
                    rec[f"capped_overlimits_{v}"] = shaped1["overlimits"] - shaped0["overlimits"]
    finally:
        s.p.uncap()
        for r in routers.values():
            r.stop()
        for srv in reversed(servers):
            if all(srv is not k for k in kept.values()):
                srv.stop()
        log(
            f"round {rnd} {unit}: up in {rec.get('startup_s')} s, idle "
            f"{rec.get('idle_cpu_cores')} cores, load before {rec['loadavg_before'][0]:.2f}"
        )


def p50(xs: list[float] | None) -> float | None:
    return 1e3 * pct(xs, 0.5) if xs else None


def summary(run: Run, a: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for (v, link, size, conc), xs in sorted(run.ttft.items()):
        where = f"{v}.{link}." if link else f"{v}."
        res[f"stream.ttft_p50_ms.{where}{size}.c{conc}"] = p50(xs)
        res[f"stream.requests.{where}{size}.c{conc}"] = len(xs)
        col = p50(run.ttft.get(("colocated", "", size, conc)))
        if v != "colocated" and col:
            res[f"stream.ratio_vs_colocated.{where}{size}.c{conc}"] = p50(xs) / col  # type: ignore[operator]
    for (v, link, size, conc), xs in sorted(run.prefill.items()):
        res[f"stream.prefill_leg_p50_ms.{v}.{link}.{size}.c{conc}"] = p50(xs)
    m = a.match_tokens

    def div(x: float | None, y: float | None) -> float | None:
        return x / y if x is not None and y else None

    for conc, sfx in ((1, ""), (4, ".concurrency_4")):

        def t(v: str, link: str = "capped", c: int = conc) -> float | None:
            return p50(run.ttft.get((v, "" if v == "colocated" else link, m, c)))

        col, lay, seq = t("colocated"), t(LAYERWISE), t(SEQUENTIAL)
        res[f"stream.ttft_p50_ratio_vs_colocated{sfx}"] = div(lay, col)
        res[f"stream.ttft_p50_ratio_vs_colocated_loopback{sfx}"] = div(
            t(LAYERWISE, "uncapped"), col
        )
        res[f"stream.hidden_fraction{sfx}"] = (
            div(seq - lay, seq - col)
            if seq is not None and lay is not None and col is not None
            else None
        )
        res[f"stream.prefill_step_ratio{sfx}"] = div(
            p50(run.prefill.get((LAYERWISE, "capped", m, conc))),
            p50(run.prefill.get((WHOLE, "capped", m, conc))),
        )
    return res


def compare(run: Run) -> tuple[int, int]:
    """(mismatches, compared): every PD output against colocated's for the same prompt; a
    PD output whose prompt colocated did not answer counts as a mismatch."""
    bad = n = 0
    for (v, _link, k), ids in run.outs.items():
        if v == "colocated":
            continue
        n += 1
        bad += run.outs.get(("colocated", "", k)) != ids
    return bad, n


def run_all(a: argparse.Namespace) -> dict[str, Any]:
    shape = SHAPES[a.shape]
    max_len = -(-(max(a.sizes) + a.answer + 64) // BS) * BS
    shape = dataclasses.replace(shape, max_len=max(shape.max_len, max_len))
    a.kv_per_token = shape.layers * 2 * shape.kv_heads * shape.head_size * 4  # float32
    units = ["colocated"] if "colocated" in a.variants else []
    units += [
        m for m in ("request", "step", "layer") if any(PD[v][1] == m for v in a.variants if v in PD)
    ]
    tmp = Path(tempfile.mkdtemp(prefix="pdxfer-bench-stream-"))
    res: dict[str, Any] = {
        "stream.quick": a.quick,
        "stream.cores": os.cpu_count(),
        "stream.shape": a.shape,
        "stream.sizes": a.sizes,
        "stream.match_tokens": a.match_tokens,
        "stream.answer": a.answer,
        "stream.variants": a.variants,
        "stream.kv_bytes_per_token": a.kv_per_token,
    }
    secret = secrets.token_hex(24)
    t_start = time.monotonic()
    run = Run()
    cal: dict[str, float] = {}
    with Network(["p", "d"]) as net:
        boot = Proc(
            "bootstrap",
            ["bootstrap", "--host", net["p"].addr, "--port", "0"],
            prefix=net["p"].prefix,
            timeout=60,
            env={"PDXFER_SECRET": secret},
        )
        try:
            s = Setup(
                tmp,
                build_model(tmp / "model", shape),
                net,
                boot.url.removeprefix("http://"),
                secret,
                kv_bytes=(4 + 1) * max_len * a.kv_per_token,
                max_len=max_len,
            )
            log(f"variants {a.variants}, sizes {a.sizes}, {a.rounds} round(s); logs in {tmp}")
            for rnd in range(a.rounds):
                k = rnd % len(units)
                kept: dict[str, Server] = {}
                try:
                    for unit in units[k:] + units[:k]:
                        if unit != "colocated" and "mbit" not in cal:
                            raise SystemExit("the colocated phase must run first (it sets the cap)")
                        try:
                            phase(unit, rnd, s, a, run, cal, kept)
                        except (RuntimeError, ProcessStartError) as e:
                            if unit == "colocated" or isinstance(e, ServerNotReady):
                                raise  # no reference, or a server that never came up: no run
                            # e.g. an engine killed mid-phase (the OOM killer on a full
                            # host): the phase is recorded as failed, the others still count
                            why = f"{unit} phase, round {rnd}: {type(e).__name__}: {e}"[:500]
                            run.phases[-1]["failed"] = why
                            run.errors.append(why)
                            log(f"phase failed: {why}")
                finally:
                    for srv in kept.values():
                        srv.stop()
        finally:
            boot.stop()
    bad, n = compare(run)
    res.update(summary(run, a))
    res.update({f"stream.unavailable.{v}": why for v, why in run.unavailable.items()})
    res["stream.cap_mbit"] = cal.get("mbit")
    res["stream.colocated_prefill_ms"] = 1e3 * cal["prefill_s"] if "prefill_s" in cal else None
    res["stream.mismatches"] = bad
    res["stream.errors"] = len(run.errors)
    res["stream.error_samples"] = run.errors[:5]
    res["stream.outputs_compared"] = n
    res["stream.phases"] = run.phases
    res["stream.loadavg_max_before_phase"] = max(r["loadavg_before"][0] for r in run.phases)
    res["stream.background_cores_max_before_phase"] = max(
        r["background_cores_before"] for r in run.phases
    )
    res["stream.seconds"] = time.monotonic() - t_start
    res["stream.logs"] = str(tmp)
    return res


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rounds", type=int, help="phases per prefill mode (default 3; quick 1)")
    ap.add_argument(
        "--requests", type=int, help="requests per size, one at a time (default 3; quick 1)"
    )
    ap.add_argument(
        "--batches", type=int, help="batches of four per size at concurrency 4 (default 2; quick 1)"
    )
    ap.add_argument("--sizes", default="1024,2048,4096", help="prompt lengths in tokens")
    ap.add_argument(
        "--match-tokens",
        type=int,
        default=None,
        help="the prompt length the cap is matched at and the figures are read at "
        "(default 2048, or the middle of --sizes)",
    )
    ap.add_argument("--answer", type=int, default=8, help="tokens generated per request")
    ap.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="kv32k",
        help="pdxfer.serving.vllm.local_model shape (kv32k: 64 KiB of KV per token in float32)",
    )
    ap.add_argument("--variants", default=",".join(ALL), help=f"of {', '.join(ALL)}")
    add_startup_timeout_arg(ap)
    ap.add_argument(
        "--idle-seconds",
        type=float,
        default=None,
        help="how long each phase's idle CPU is measured (default 5; quick 2)",
    )
    ap.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds one request may take (default 600)",
    )


def main(a: argparse.Namespace) -> dict[str, Any]:
    a.sizes = sorted({int(x) for x in a.sizes.split(",") if x.strip()})
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    for v in a.variants:
        if v not in ALL:
            raise SystemExit(f"unknown variant {v!r}; known: {', '.join(ALL)}")
    if "colocated" not in a.variants:
        raise SystemExit("colocated is the reference: --variants must name it")
    if a.match_tokens is None:
        a.match_tokens = 2048 if 2048 in a.sizes else a.sizes[len(a.sizes) // 2]
    if a.match_tokens not in a.sizes:
        raise SystemExit("--match-tokens must be one of --sizes")
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.requests = a.requests or (1 if a.quick else 3)
    a.batches = a.batches or (1 if a.quick else 2)
    a.idle_seconds = a.idle_seconds if a.idle_seconds is not None else (2.0 if a.quick else 5.0)
    why = root_reason()
    if why:
        raise Unavailable(why)
    return run_all(a)


def passed(res: dict[str, Any]) -> bool:
    if res["stream.mismatches"] or res["stream.errors"]:
        log(
            f"FAIL: {res['stream.mismatches']} output(s) differ from colocated, "
            f"{res['stream.errors']} request(s) failed"
        )
        return False
    return True


if __name__ == "__main__":
    from benchmarks.common import runner

    sys.exit(runner.run(sys.modules[__name__]))
