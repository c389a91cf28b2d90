#!/usr/bin/env python
"""Timeline of one small request on both sides, segment by segment; the small loop's CPU.

What ``small.fixed_cost_ms`` is made of, and which threads the 64-in-flight loop keeps busy.

    python scripts/trace_small.py [--requests 200] [--json out.json] [--loop 8]
        [--ab PDXFER_CONTROL_SEND=zmq] [--untraced]

A pdxfer prefill and decode on Mooncake TCP (the bench geometry: 128-token requests, 64
buffers of 128 KiB pages, integrity ``sampled``) serve requests one at a time, the decode's
request already at the prefill, as ``benchmarks/transfer.py``'s fixed cost does. Both
agents stamp the functions a request passes through (``benchmarks.common.trace``; one clock,
``CLOCK_MONOTONIC``, for both processes) and this script prints the median of each segment
in microseconds (flat JSON keys ``trace.<segment>_us``), each stamp costing ~1-2 us.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

import profile_small as PS  # noqa: E402

from benchmarks import transfer as B  # noqa: E402
from pdxfer.agents.process import Agent  # noqa: E402
from pdxfer.bootstrap import BootstrapServer  # noqa: E402

TRANSFER = [
    # (segment, from, to): the first stamp named ``to`` after ``from``
    ("send_to_plan", "P:send.in", "P:plan.in"),
    ("plan", "P:plan.in", "P:plan.out"),
    ("plan_to_submit", "P:plan.out", "P:te.submit.in"),
    ("submit_call", "P:te.submit.in", "P:te.submit.out"),
    ("submit_to_send_return", "P:te.submit.out", "P:send.out"),
    ("send_return_to_worker_awake", "P:send.out", "P:await.in"),
    ("worker_digest", "P:digest.in", "P:digest.out"),
    ("status_wait (spins: the write)", "P:te.status.in", "P:te.status.out"),
    ("status_to_finish", "P:te.status.out", "P:finish.in"),
    ("finish_to_ctl_send", "P:finish.in", "P:ctl.send.in"),
    ("ctl_send_call", "P:ctl.send.in", "P:ctl.send.out"),
    (
        "ctl_send_to_decode_read (zmq io thread, tcp, epoll wake)",
        "P:ctl.send.in",
        "D:inbox.read.in",
    ),
    ("decode_read_to_frame", "D:inbox.read.in", "D:frame.in"),
    ("frame_to_on_done (header, mac, decode)", "D:frame.in", "D:TransferDone.in"),
    ("on_done_to_check", "D:TransferDone.in", "D:check.in"),
    ("check (integrity)", "D:check.in", "D:check.out"),
    ("check_to_on_done_return (settle, Success)", "D:check.out", "D:TransferDone.out"),
]
REQUEST = [
    ("req_call_to_ctl_send", "D:request.in", "D:ctl.send.in"),
    ("req_ctl_send_call", "D:ctl.send.in", "D:ctl.send.out"),
    ("req_ctl_send_to_prefill_read", "D:ctl.send.in", "P:inbox.read.in"),
    ("req_prefill_read_to_frame", "P:inbox.read.in", "P:frame.in"),
    ("req_frame_to_on_request", "P:frame.in", "P:TransferRequest.in"),
    ("req_on_request", "P:TransferRequest.in", "P:TransferRequest.out"),
    ("req_request_call (decode, whole)", "D:request.in", "D:request.out"),
]


def first_after(ev: list[tuple[str, int]], name: str, after: int) -> int | None:
    return next((t for n, t in ev if n == name and t >= after), None)


def segments(
    ev: list[tuple[str, int]], table: list[tuple[str, str, str]], start: str
) -> dict[str, float]:
    """Each segment of ``table`` in us, chained from the first ``start`` stamp."""
    t0 = first_after(ev, start, 0)
    out: dict[str, float] = {}
    if t0 is None:
        return out
    for seg, a, b in table:
        ta = first_after(ev, a, t0)
        tb = first_after(ev, b, ta) if ta is not None else None
        if ta is not None and tb is not None:
            out[seg] = (tb - ta) / 1e3
    return out


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds of each thread of ``pid`` so far (utime + stime), with its kernel name."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        f = stat[stat.rindex(")") + 2 :].split()
        out[int(task.name)] = (comm, (int(f[11]) + int(f[12])) / 100)
    return out


def closed_loop(b: B.Bench, seconds: float, spy: Path | None = None) -> dict[str, float]:
    """The bench's small closed loop (64 in flight) for ``seconds``: rooms/s, and CPU
    seconds per second of each thread of both agents (Python names where known); with
    ``spy``, py-spy samples both agents meanwhile (``<spy>_prefill.txt``, ``_decode.txt``:
    the share of active samples under each pdxfer function)."""
    src = b.src_perm[:2]
    spies = []
    if spy is not None:
        for x, side in ((b.pf, "prefill"), (b.dc, "decode")):
            raw = spy.with_name(f"{spy.name}_{side}.raw")
            spies.append((PS._spy(x.proc.pid, "raw", raw, 500), raw, side))
        time.sleep(1.5)  # attached
    names = {x: x.call("ext", fn="benchmarks.common.trace:threads") for x in (b.pf, b.dc)}
    before = {x: thread_cpu(x.proc.pid) for x in (b.pf, b.dc)}
    first = b.next_room()
    b.room += 1 << 20
    b.pf.call("bench_serve", first_room=first, src=src, ahead=96)
    r = b.dc.call(
        "bench_closed_loop",
        timeout=seconds + 120,
        bootstrap=b.srv.address,
        first_room=first,
        dst_free=b.rng.permutation(B.DC_PAGES).tolist(),
        per=2,
        tokens=128,
        conc=64,
        duration=seconds,
    )
    b.pf.call("bench_serve_stop")
    for proc, raw, _ in spies:
        proc.send_signal(signal.SIGINT)
        proc.wait(120)
        if raw.exists():
            raw.with_suffix(".txt").write_text("\n".join(PS.summary(raw, 40)) + "\n")
            raw.unlink()
    wall = max(t1 for _, t1 in r["stamps"]) - r["start"]
    out = {
        "loop.rooms_per_s": len(r["stamps"]) / wall,
        "loop.failed": len(r["failed"]),
        "loop.load": B.loadavg(),
        "loop.p50_ms": 1e3 * statistics.median([t1 - t0 for t0, t1 in r["stamps"]]),
    }
    for x, side in ((b.pf, "prefill"), (b.dc, "decode")):
        after = thread_cpu(x.proc.pid)
        per: dict[str, float] = {}
        for tid, (comm, cpu) in after.items():
            name = names[x].get(tid, comm)
            name = (
                name.split("-")[0] + "-*"
                if name.startswith(("pdxfer-prefill-", "pdxfer-decode-")) and name[-1].isdigit()
                else name
            )
            per[name] = per.get(name, 0.0) + (cpu - before[x].get(tid, (comm, 0.0))[1]) / wall
        for name, v in sorted(per.items(), key=lambda kv: -kv[1]):
            if v >= 0.005:
                out[f"loop.cpu.{side}.{name}"] = v
    return out


def start_pair(env: dict[str, str]) -> B.Bench:
    b = B.Bench(False)
    b.srv = BootstrapServer("127.0.0.1", port=0).start()
    cfg = {
        "bootstrap": b.srv.address,
        "transfer_timeout_s": 60.0,
        "bootstrap_timeout_s": 60.0,
        "transport": "tcp",
    }
    b.pf = Agent("prefill", cfg, B.geoms(B.PF_PAGES), state=B.STATE, env=env)
    b.dc = Agent("decode", cfg, B.geoms(B.DC_PAGES), state=B.STATE, env=env)
    src = b.src_perm[:2]
    b.pf.call("prepare", items=[{"room": b.seed_room, "pages": {"kv": src}, "num_tokens": 128}])
    for _ in range(20):  # warm: handshake, lanes, route cache, sample plans
        b.pdx_send_once(128, src, b.rng.choice(B.DC_PAGES, 2, replace=False).tolist())
    return b


def stop_pair(b: B.Bench) -> None:
    for x in ("pf", "dc"):
        if hasattr(b, x):
            getattr(b, x).close()
    b.srv.stop()


def traced_once(b: B.Bench) -> tuple[float, dict[str, float]]:
    """One request, the fixed cost (s) and its segments (us)."""
    for x in (b.pf, b.dc):
        x.call("ext", fn="benchmarks.common.trace:collect")
    dst = b.rng.choice(B.DC_PAGES, 2, replace=False).tolist()
    own = b.pdx_send_once(128, b.src_perm[:2], dst) - b.last_write_s
    ev = sorted(
        (
            (n, t)
            for x in (b.pf, b.dc)
            for n, t, _ in x.call("ext", fn="benchmarks.common.trace:collect")
        ),
        key=lambda e: e[1],
    )
    seg = segments(ev, REQUEST, "D:request.in")
    seg.update(segments(ev, TRANSFER, "P:send.in"))
    return own, seg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--loop",
        type=float,
        default=0.0,
        help="also run the closed loop at concurrency 64 for this many seconds "
        "and report each thread's CPU share (untraced)",
    )
    ap.add_argument(
        "--ab",
        default="",
        help="VAR=VALUE: a second pair started with this environment variable "
        "(or pacing:FIELD=VALUE: a RateEstimate field set on its prefill); "
        "requests (and closed-loop rounds) alternate between the pairs",
    )
    ap.add_argument("--rounds", type=int, default=2, help="closed-loop rounds per pair")
    ap.add_argument(
        "--spy",
        type=Path,
        help="py-spy both agents during the first loop round "
        "(writes <spy>_prefill.txt and <spy>_decode.txt)",
    )
    ap.add_argument(
        "--untraced",
        action="store_true",
        help="leave the stamps out (fixed cost only, as the bench measures it)",
    )
    a = ap.parse_args(argv)
    pairs: dict[str, dict[str, str]] = {"a": {}}
    if a.ab:
        k, _, v = a.ab.partition("=")
        pairs["b"] = {k: v}
    bs: dict[str, B.Bench] = {}
    out: dict[str, float] = {"trace.requests": a.requests, "trace.load_before": B.loadavg()}
    try:
        for name, env in pairs.items():
            pace = {k[7:]: float(v) for k, v in env.items() if k.startswith("pacing:")}
            bs[name] = start_pair({k: v for k, v in env.items() if not k.startswith("pacing:")})
            if pace:  # a RateEstimate field, set on the prefill once its peer exists
                assert bs[name].pf.call("ext", fn="benchmarks.common.trace:set_pacing", **pace)
        for r in range(a.rounds if a.loop else 0):
            for name, b in bs.items():
                spy = a.spy.with_name(f"{a.spy.name}_{name}") if a.spy and not r else None
                for k, v in closed_loop(b, a.loop, spy).items():
                    out.setdefault(f"{name}.{k}", [])
                    out[f"{name}.{k}"].append(v)
        if not a.untraced:
            for b in bs.values():
                for x, side in ((b.pf, "P:"), (b.dc, "D:")):
                    x.call("ext", fn="benchmarks.common.trace:install", side=side)
        own: dict[str, list[float]] = {n: [] for n in bs}
        per: dict[str, list[dict[str, float]]] = {n: [] for n in bs}
        for _ in range(a.requests):
            for name, b in bs.items():
                if a.untraced:
                    dst = b.rng.choice(B.DC_PAGES, 2, replace=False).tolist()
                    own[name].append(b.pdx_send_once(128, b.src_perm[:2], dst) - b.last_write_s)
                    continue
                o, seg = traced_once(b)
                own[name].append(o)
                per[name].append(seg)
    finally:
        for b in bs.values():
            stop_pair(b)
    out["trace.load_after"] = B.loadavg()
    for name in bs:
        label = pairs[name] or "default"
        print(f"== pair {name} ({label})")
        for k, v in sorted(out.items()):
            if k.startswith(f"{name}.loop."):
                print(f"{statistics.median(v):9.3f}  {k}  {[round(x, 3) for x in v]}")
        if own[name]:
            out[f"{name}.trace.fixed_cost_us"] = statistics.median(own[name]) * 1e6
        for seg, _, _ in REQUEST + TRANSFER:
            xs = [p[seg] for p in per[name] if seg in p]
            if xs:
                out[f"{name}.trace.{seg.split(' ')[0]}_us"] = statistics.median(xs)
                print(f"{statistics.median(xs):9.1f} us  {seg}  (n={len(xs)})")
        if own[name]:
            print(
                f"fixed cost (send to Success minus the write), median: "
                f"{out[f'{name}.trace.fixed_cost_us']:.1f} us"
            )
    print(f"load {out['trace.load_before']} -> {out['trace.load_after']}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
