"""One side of SGLang's documented transfer sequence, through pdxfer's classes as SGLang's
``get_kv_class`` returns them (run in .venv-sglang, one process per rank).

prefill: ``Sender(mgr, addr, room)`` -> poll until WaitingForInput -> ``pop_decode_prefix_len``
-> ``init(pages, aux)`` -> ``send`` per chunk (the last with the state indices) -> poll until
Success. decode: ``Receiver(mgr, addr, room)`` -> ``init(dp)`` -> poll until WaitingForInput ->
``send_metadata(pages, aux, state, decode_prefix_len)`` -> poll until Success, then check every
byte of every pool against the pattern the prefill wrote, and that no other page changed.

Usage: pd_sequence.py prefill|decode CONFIG_JSON (see tests/integration/test_sglang_sequence.py).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import sgl_common as C

from pdxfer.testing import patterns as P


def geometry(cfg: dict, role: str, tp_rank: int) -> C.Side:
    tp = cfg["prefill_tp"] if role == "prefill" else 1
    total = cfg["heads"]
    return C.make_side(
        attn=cfg["attn"], layers=cfg["layers"], page_size=cfg["page_size"],
        pages=cfg["pages"], heads=total // tp, total_heads=total, head_dim=cfg["head_dim"],
        draft=cfg["draft"], state=cfg["state"], rows=8, tp_rank=tp_rank,
        host_page=cfg.get("decode_host_page") if role == "decode" else None,
        set_heads=role == "prefill")


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
        out.append(perm[at:at + k].astype(np.int64))
        at += k
    return out


def prefill(cfg: dict, tp_rank: int) -> None:
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
    C.emit({"role": "prefill", "rank": tp_rank, "states": {str(k): v for k, v in done.items()},
            "failures": fails, "prefix": {str(i): senders[i].pop_decode_prefix_len()
                                          for i in senders}})
    # stay up until the decode is done reading (it closes our stdin)
    sys.stdin.read()
    mgr.close()
    if server is not None:
        server.close()


def _slot_map(mgr, i: int) -> dict[str, int]:
    return {p.name: (i + 3) % 8 for p in mgr.pools if p.kind == "slot"}


def _send_all(cfg: dict, s, n: int, pages: np.ndarray, i: int) -> None:
    prefix = s.pop_decode_prefix_len()
    ps = cfg["page_size"]
    suffix = pages[prefix // ps:]
    s.init(len(suffix), (i + 3) % 8)
    chunks = np.array_split(suffix, min(3, len(suffix)))
    state = [[np.array([(i + 3) % 8])]] if cfg["state"] else None
    for j, c in enumerate(chunks):
        s.send(c, state if j == len(chunks) - 1 else None)


def _mode(name: str):
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return getattr(DisaggregationMode, name)


def decode(cfg: dict) -> None:
    sa = C.publish("decode", cfg["port"])
    cls = C.classes()
    side = geometry(cfg, "decode", 0)
    for ts in side.tensors.values():
        for t in ts:
            t.view(dtype=__import__("torch").uint8).fill_(P.SENTINEL)
    mgr = cls["manager"](side.kv_args, _mode("DECODE"), sa, cfg["attn"] == "mla")
    addr = f"127.0.0.1:{cfg['port']}"
    C.wait(lambda: mgr.try_ensure_parallel_info(addr), 60, "prefill never became ready")
    page = mgr.kv_page_size()
    rooms = cfg["rooms"]
    rxs, dsts = {}, {}
    for i, r in enumerate(rooms):
        rx = cls["receiver"](mgr, addr, r["room"])
        rx.init(0)
        rxs[i] = rx
    C.wait(lambda: all(rx.poll() >= 2 or rx.poll() == 0 for rx in rxs.values()), 30,
           "handshake")
    for i, (r, d) in enumerate(zip(rooms, dst_pages(cfg, rooms, page))):
        dsts[i] = d
        state = [[np.array([(i + 5) % 8])]] if cfg["state"] else None
        rxs[i].send_metadata(dsts[i], (i + 5) % 8, state, r["prefix"])
    C.wait(lambda: all(rx.poll() in (0, 4) for rx in rxs.values()), 60, "transfer")
    out = {"role": "decode", "page": page, "rooms": {}}
    seen: dict[str, list[int]] = {}
    for i, r in enumerate(rooms):
        st = rxs[i].poll()
        res = {"state": st, "bad": 0, "first_bad": "", "checked": 0}
        if st == 4:
            for spec in mgr.pools:
                ts = C.tensors_of(side, spec)
                if spec.kind == "paged":
                    bad, why = P.check_tokens(spec, ts, r["room"], dsts[i], r["prefix"],
                                              r["prefix"], r["n"])
                    res["checked"] += (r["n"] - r["prefix"]) * spec.token_bytes * len(ts)
                    seen.setdefault(spec.name, []).extend(int(x) for x in dsts[i])
                else:
                    slot = (i + 5) % 8
                    bad, why = P.check_slot(spec, ts, r["room"], slot)
                    res["checked"] += spec.item_bytes * len(ts)
                    seen.setdefault(spec.name, []).append(slot)
                res["bad"] += bad
                res["first_bad"] = res["first_bad"] or why
        else:
            try:
                rxs[i].failure_exception()
            except Exception as e:  # noqa: BLE001 - reported
                res["failure"] = str(e)
        out["rooms"][str(i)] = res
    follows = {p.name: p.indices_from for p in mgr.pools}
    out["untouched_bad"] = {
        p.name: P.untouched(p, C.tensors_of(side, p), seen.get(follows[p.name] or p.name, []))
        for p in mgr.pools if p.item_bytes}
    out["pools"] = sorted(p.name for p in mgr.pools)
    C.emit(out)
    mgr.close()


if __name__ == "__main__":
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    if role == "prefill":
        prefill(cfg, int(sys.argv[3]) if len(sys.argv) > 3 else 0)
    else:
        decode(cfg)
