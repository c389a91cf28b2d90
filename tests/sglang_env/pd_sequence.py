"""SGLang's documented transfer sequence, through pdxfer's classes as SGLang's
``get_kv_class`` returns them (commands for sgl_server.py; one process per rank, each config
on ports and managers of its own, closed when the config is done).

prefill: ``Sender(mgr, addr, room)`` -> poll until WaitingForInput -> ``pop_decode_prefix_len``
-> ``init(pages, aux)`` -> ``send`` per chunk (the last with the state indices) -> poll until
Success. decode: ``Receiver(mgr, addr, room)`` -> ``init(dp)`` -> poll until WaitingForInput ->
``send_metadata(pages, aux, state, decode_prefix_len)`` -> poll until Success, then check every
byte of every pool against the pattern the prefill wrote, and that no other page changed.

Commands: ``prefill_start(cfg, tp_rank)`` (returns once the senders exist; a thread runs the
sequence), ``decode(cfg)`` (blocks until every room ended, returns the checks),
``prefill_finish(cfg, tp_rank)`` (the prefill's states, then closes). See
tests/integration/test_sglang.py for the configs.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import sgl_common as C
import torch

from pdxfer.agents import patterns as P


def geometry(cfg: dict, role: str, tp_rank: int) -> C.Side:
    tp = cfg["prefill_tp"] if role == "prefill" else 1
    total = cfg["heads"]
    return C.make_side(
        attn=cfg["attn"],
        layers=cfg["layers"],
        page_size=cfg["page_size"],
        pages=cfg["pages"],
        heads=total // tp,
        total_heads=total,
        head_dim=cfg["head_dim"],
        draft=cfg["draft"],
        state=cfg["state"],
        rows=8,
        tp_rank=tp_rank,
        host_page=cfg.get("decode_host_page") if role == "decode" else None,
        set_heads=role == "prefill",
        host_kv=role == "decode" and bool(cfg.get("host_rooms")),
    )


def src_pages(cfg: dict, i: int, n: int) -> np.ndarray:
    k = -(-n // cfg["page_size"])
    assert k <= 20 and 1 + 20 * (i + 1) <= cfg["pages"], "rooms must fit disjoint page ranges"
    return (np.arange(k)[::-1] + 1 + i * 20).astype(np.int64)  # reversed: order matters


def dst_pages(cfg: dict, rooms: list[dict], page: int) -> list[np.ndarray]:
    """Disjoint scattered destination pages per room (page 0 never used)."""
    perm = np.random.default_rng(7).permutation(cfg["pages"] * cfg["page_size"] // page - 1) + 1
    out, at = [], 0
    for r in rooms:
        k = -(-(r["n"] - r["prefix"]) // page)
        out.append(perm[at : at + k].astype(np.int64))
        at += k
    return out


def prefill_start(state: dict, cfg: dict, tp_rank: int = 0) -> str:
    sa = C.publish("prefill", cfg["port"], tp_size=cfg["prefill_tp"], tp_rank=tp_rank)
    cls = C.classes()
    server = None
    if tp_rank == 0:
        server = cls["bootstrap_server"]("127.0.0.1", cfg["port"])
    side = geometry(cfg, "prefill", tp_rank)
    mgr = cls["manager"](side.kv_args, _mode("PREFILL"), sa, cfg["attn"] == "mla")
    rooms = cfg["rooms"]
    senders, info = {}, {}
    for i, r in enumerate(rooms):
        n = r["n"]
        pages = src_pages(cfg, i, n)
        C.fill(side, mgr.pools, r["room"], pages, n, _slot_map(mgr, i))
        senders[i] = cls["sender"](mgr, f"127.0.0.1:{cfg['port']}", r["room"])
        info[i] = pages
    run = {"mgr": mgr, "server": server, "side": side, "senders": senders, "result": None}
    run["thread"] = threading.Thread(target=_prefill_loop, args=(cfg, run, info), daemon=True)
    run["thread"].start()
    state[("seq", cfg["port"], tp_rank)] = run
    return "started"


def _prefill_loop(cfg: dict, run: dict, info: dict) -> None:
    try:
        run["result"] = _prefill_run(cfg, run["senders"], info)
    except BaseException as e:  # noqa: BLE001 - re-raised by prefill_finish
        run["result"] = e


def _prefill_run(cfg: dict, senders: dict, info: dict) -> dict:
    rooms = cfg["rooms"]
    done: dict[int, int] = {}
    started: set[int] = set()
    end = time.monotonic() + 60
    while len(done) < len(rooms) and time.monotonic() < end:
        for i, s in senders.items():
            if i in done:
                continue
            st = s.poll()
            if st == 0:
                done[i] = 0
            elif st == 4:
                done[i] = 4
            elif st >= 2 and i not in started:
                started.add(i)
                _send_all(cfg, s, rooms[i]["n"], info[i], i)
        time.sleep(0.002)
    fails = {}
    for i, st in done.items():
        if st == 0:
            try:
                senders[i].failure_exception()
            except Exception as e:  # noqa: BLE001 - reported
                fails[i] = str(e)
    return {
        "states": {str(k): v for k, v in done.items()},
        "failures": fails,
        "prefix": {str(i): senders[i].pop_decode_prefix_len() for i in senders},
    }


def prefill_finish(state: dict, cfg: dict, tp_rank: int = 0) -> dict:
    """The prefill's view, once the decode is done reading; then the rank closes."""
    run = state.pop(("seq", cfg["port"], tp_rank))
    try:
        run["thread"].join(60)
    finally:
        run["mgr"].close()
        if run["server"] is not None:
            run["server"].close()
    if isinstance(run["result"], BaseException):
        raise run["result"]
    if run["result"] is None:
        raise TimeoutError("prefill sequence still running")
    return {"role": "prefill", "rank": tp_rank, "released": released(run["mgr"]), **run["result"]}


def _slot_map(mgr, i: int) -> dict[str, int]:
    return {p.name: (i + 3) % 8 for p in mgr.pools if p.kind == "slot"}


def _send_all(cfg: dict, s, n: int, pages: np.ndarray, i: int) -> None:
    prefix = s.pop_decode_prefix_len()
    ps = cfg["page_size"]
    suffix = pages[prefix // ps :]
    s.init(len(suffix), (i + 3) % 8)
    chunks = np.array_split(suffix, min(3, len(suffix)))
    state = [[np.array([(i + 3) % 8])]] if cfg["state"] else None
    for j, c in enumerate(chunks):
        s.send(c, state if j == len(chunks) - 1 else None)


def _mode(name: str):
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return getattr(DisaggregationMode, name)


def decode(state: dict, cfg: dict) -> dict:
    sa = C.publish("decode", cfg["port"])
    cls = C.classes()
    C.trust(f"127.0.0.1:{cfg['port']}")
    side = geometry(cfg, "decode", 0)
    for ts in side.tensors.values():
        for t in ts:
            t.view(dtype=torch.uint8).fill_(P.SENTINEL)
    mgr = cls["manager"](side.kv_args, _mode("DECODE"), sa, cfg["attn"] == "mla")
    try:
        out = _decode_run(cfg, cls, side, mgr)
    finally:
        mgr.close()
    out["released"] = released(mgr)
    return out


def released(mgr: Any) -> bool:
    """Nothing of the manager is left open: pdxfer's endpoints, SGLang's socket and context
    (a later garbage collection of a context with a live socket can hang the process)."""
    return (
        mgr.endpoint is None
        and getattr(mgr, "host_endpoint", None) is None
        and mgr.server_socket.closed
        and mgr._zmq_ctx.closed
    )


def _decode_run(cfg: dict, cls: dict, side: C.Side, mgr: Any) -> dict:
    from sglang.srt.disaggregation.base.conn import KVTransferDestination

    addr = f"127.0.0.1:{cfg['port']}"
    C.wait(lambda: mgr.try_ensure_parallel_info(addr), 60, "prefill never became ready")
    page = mgr.kv_page_size()
    rooms = cfg["rooms"]
    rxs, dsts = {}, {}
    for i, r in enumerate(rooms):
        rx = cls["receiver"](mgr, addr, r["room"])
        rx.init(0)
        rxs[i] = rx
    C.wait(lambda: all(rx.poll() >= 2 or rx.poll() == 0 for rx in rxs.values()), 30, "handshake")
    # rooms the decode lands in its host KV buffers (SGLang's destination=HOST)
    host_rooms = set(cfg.get("host_rooms", []))
    for i, (r, d) in enumerate(zip(rooms, dst_pages(cfg, rooms, page))):
        dsts[i] = d
        st_idx = [[np.array([(i + 5) % 8])]] if cfg["state"] else None
        where = KVTransferDestination.HOST if i in host_rooms else KVTransferDestination.DEVICE
        rxs[i].send_metadata(dsts[i], (i + 5) % 8, st_idx, r["prefix"], destination=where)
    C.wait(lambda: all(rx.poll() in (0, 4) for rx in rxs.values()), 60, "transfer")
    out = {
        "role": "decode",
        "page": page,
        "rooms": {},
        "supports_host": rxs[0].supports_host_destination,
    }
    seen: dict[str, list[int]] = {}
    for i, r in enumerate(rooms):
        st = rxs[i].poll()
        res = {"state": st, "bad": 0, "first_bad": "", "checked": 0}
        host = i in host_rooms
        if st == 4:
            for spec in mgr.host_pools if host else mgr.pools:
                ts = C.tensors_of(side, spec, host)
                if spec.kind == "paged":
                    bad, why = P.check_tokens(
                        spec, ts, r["room"], dsts[i], r["prefix"], r["prefix"], r["n"]
                    )
                    res["checked"] += (r["n"] - r["prefix"]) * spec.token_bytes * len(ts)
                    seen.setdefault(("host:" if host else "") + spec.name, []).extend(
                        int(x) for x in dsts[i]
                    )
                else:
                    slot = (i + 5) % 8
                    bad, why = P.check_slot(spec, ts, r["room"], slot)
                    res["checked"] += spec.item_bytes * len(ts)
                    seen.setdefault(spec.name, []).append(slot)
                res["bad"] += bad
                res["first_bad"] = res["first_bad"] or why
            # what landed, counted by pdxfer, and one copy of the room's pages and slots
            res["bytes"] = rxs[i].rx.stats()["bytes"]
            res["one_copy"] = sum(
                (-(-(r["n"] - r["prefix"]) // spec.page_size) if spec.kind == "paged" else 1)
                * spec.item_bytes
                * len(spec.buffers)
                for spec in (mgr.host_pools if host else mgr.pools)
            )
        else:
            try:
                rxs[i].failure_exception()
            except Exception as e:  # noqa: BLE001 - reported
                res["failure"] = str(e)
        out["rooms"][str(i)] = res
    follows = {p.name: p.indices_from for p in mgr.pools}
    out["untouched_bad"] = {
        p.name: P.untouched(p, C.tensors_of(side, p), seen.get(follows[p.name] or p.name, []))
        for p in mgr.pools
        if p.item_bytes
    }
    for p in mgr.host_pools:  # the host endpoint's own buffers (aux rows are shared)
        if p.kind == "paged":
            out["untouched_bad"]["host:" + p.name] = P.untouched(
                p, C.tensors_of(side, p, True), seen.get("host:" + (follows[p.name] or p.name), [])
            )
    out["pools"] = sorted(p.name for p in mgr.pools)
    return out
