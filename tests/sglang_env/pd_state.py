"""A Gated DeltaNet (Qwen3-Next-shaped) Mamba state between SGLang ranks of different
attention TP sizes, through pdxfer's classes as SGLang's ``get_kv_class`` returns them.

Each rank's state lives in SGLang's own ``MambaPool`` (built from ``Mamba2StateShape`` with
the GDN conv sub-blocks ``[key_dim, key_dim, value_dim]``, as ``qwen3_next.py`` does), and is
described in its ``KVArgs`` by SGLang's own ``append_state_component`` and the pool's own
getters. Every element of the state is numbered by what it is in the whole model (sub-block
and channel, or head; row; layer; room) and laid out for each rank's share, so a decode rank's
slot must equal the slot it would compute itself; every other slot keeps its sentinel.

Commands: ``prefill_start(cfg, tp_rank)``, ``decode(cfg, tp_rank)`` (blocks until every room
ended), ``prefill_finish(cfg, tp_rank)``. See tests/integration/test_sglang.py.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import sgl_common as C
import torch
from pd_sequence import _mode, released, src_pages

from pdxfer.agents import patterns as P

KH, KD, VH, VD, KERNEL = 2, 4, 4, 4, 4
"""Key heads x dim, value heads x dim, conv kernel: conv channels Q 8 | K 8 | V 16."""
LAYERS = [0, 2]
SLOTS = 8


def _pool(tp: int) -> Any:
    from sglang.srt.configs.mamba_utils import (
        Mamba2CacheParams,
        Mamba2StateDType,
        Mamba2StateShape,
    )
    from sglang.srt.mem_cache.memory_pool import MambaPool

    shape = Mamba2StateShape.create(
        tp_world_size=tp,
        intermediate_size=VH * VD,
        n_groups=KH,
        num_heads=VH,
        head_dim=VD,
        state_size=KD,
        conv_kernel=KERNEL,
        conv_shard_groups=[KH * KD, KH * KD, VH * VD],
    )
    params = Mamba2CacheParams(
        shape=shape,
        layers=LAYERS,
        dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32),
    )
    return MambaPool(
        size=SLOTS, spec_state_size=0, cache_params=params, mamba_layer_ids=LAYERS, device="cpu"
    )


def side(cfg: dict, tp: int, tp_rank: int) -> tuple[C.Side, Any]:
    """This rank's KV (SGLang's MHA layout, its heads) and its ``MambaPool``, in ``KVArgs``."""
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.utils import append_state_component

    s = C.make_side(
        attn="mha",
        layers=2,
        page_size=cfg["page_size"],
        pages=cfg["pages"],
        heads=cfg["heads"] // tp,
        total_heads=cfg["heads"],
        head_dim=8,
        draft=False,
        state=False,
        rows=SLOTS + 1,
        tp_rank=tp_rank,
        set_heads=True,
    )
    a = s.kv_args
    a.state_dim_per_tensor, a.state_slice_outer_counts, a.state_conv_shard_groups = [], [], []
    pool = _pool(tp)
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    append_state_component(
        a,
        StateType.MAMBA,
        ptrs,
        lens,
        items,
        pool.get_state_dim_per_tensor(),
        pool.get_state_conv_shard_groups(),
        pool.get_state_slice_outer_counts(),
        pool.get_state_layer_ids(),
    )
    return s, pool


def _numbers(tp: int, r: int, room: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``r``'s conv state ``[Q|K|V channels, kernel-1]`` and SSM state ``[heads, V, K]``
    for one room and layer, numbered from global coordinates."""
    qk, v = KH * KD, VH * VD
    q = list(range(r * qk // tp, (r + 1) * qk // tp))
    ch = q + [100 + c for c in q] + [200 + c for c in range(r * v // tp, (r + 1) * v // tp)]
    tag = (room % 7) * 4096 + layer * 1024
    conv = np.array([[tag + c * 4 + k for k in range(KERNEL - 1)] for c in ch], dtype=np.int16)
    heads = range(r * VH // tp, (r + 1) * VH // tp)
    ssm = np.array(
        [[[tag * 64 + h * 256 + i * KD + j for j in range(KD)] for i in range(VD)] for h in heads],
        dtype=np.int32,
    )
    return conv, ssm


def _fill(pool: Any, tp: int, r: int, room: int, slot: int) -> None:
    for li, layer in enumerate(LAYERS):
        conv, ssm = _numbers(tp, r, room, layer)
        pool.mamba_cache.conv[0][li][slot].view(torch.int16).copy_(torch.from_numpy(conv))
        pool.mamba_cache.temporal[li][slot].view(torch.int32).copy_(torch.from_numpy(ssm))


def _wrong(pool: Any, tp: int, r: int, room: int, slot: int) -> int:
    """Elements of ``slot`` that differ from rank ``r``'s own numbers for ``room``."""
    bad = 0
    for li, layer in enumerate(LAYERS):
        conv, ssm = _numbers(tp, r, room, layer)
        got_c = pool.mamba_cache.conv[0][li][slot].view(torch.int16).numpy()
        got_s = pool.mamba_cache.temporal[li][slot].view(torch.int32).numpy()
        bad += int((got_c != conv).sum()) + int((got_s != ssm).sum())
    return bad


def _sentinel(pool: Any) -> None:
    for t in [*pool.mamba_cache.conv, pool.mamba_cache.temporal]:
        t.view(torch.uint8).fill_(P.SENTINEL)


def _untouched(pool: Any, used: set[int]) -> int:
    """Bytes of slots no room used that lost their sentinel."""
    bad = 0
    for t in [*pool.mamba_cache.conv, pool.mamba_cache.temporal]:
        for s in set(range(SLOTS + 1)) - used:
            bad += int((t[:, s].contiguous().view(torch.uint8) != P.SENTINEL).sum())
    return bad


def prefill_start(state: dict, cfg: dict, tp_rank: int = 0) -> str:
    tp = cfg["prefill_tp"]
    sa = C.publish("prefill", cfg["port"], tp_size=tp, tp_rank=tp_rank)
    cls = C.classes()
    server = cls["bootstrap_server"]("127.0.0.1", cfg["port"]) if tp_rank == 0 else None
    s, pool = side(cfg, tp, tp_rank)
    mgr = cls["manager"](s.kv_args, _mode("PREFILL"), sa, False)
    senders, info = {}, {}
    for i, r in enumerate(cfg["rooms"]):
        pages = src_pages(cfg, i, r["n"])
        C.fill(s, [p for p in mgr.pools if p.kind == "paged"], r["room"], pages, r["n"], {})
        _fill(pool, tp, tp_rank, r["room"], (i + 3) % SLOTS)
        senders[i] = cls["sender"](mgr, f"127.0.0.1:{cfg['port']}", r["room"])
        info[i] = pages
    # the side owns the KV tensors the manager reads by address: it lives as long as the
    # manager (dropped, its memory goes back to malloc, whose chunk headers then cross the wire)
    run = {"mgr": mgr, "server": server, "senders": senders, "result": None}
    run |= {"pool": pool, "side": s, "pages": info}
    run["thread"] = threading.Thread(target=_prefill_loop, args=(cfg, run, info), daemon=True)
    run["thread"].start()
    state[("state", cfg["port"], tp_rank)] = run
    return "started"


def _prefill_loop(cfg: dict, run: dict, info: dict) -> None:
    try:
        done: dict[int, int] = {}
        started: set[int] = set()
        end = time.monotonic() + 90
        while len(done) < len(info) and time.monotonic() < end:
            for i, snd in run["senders"].items():
                st = snd.poll()
                if i in done:
                    continue
                if st in (0, 4):
                    done[i] = st
                elif st >= 2 and i not in started:
                    started.add(i)
                    snd.init(len(info[i]), (i + 3) % SLOTS)
                    parts = np.array_split(info[i], min(2, len(info[i])))
                    for j, part in enumerate(parts):
                        last = j == len(parts) - 1
                        snd.send(part, [[np.array([(i + 3) % SLOTS])]] if last else None)
            time.sleep(0.002)
        run["result"] = {"states": {str(k): v for k, v in done.items()}}
    except BaseException as e:  # noqa: BLE001 - re-raised by prefill_finish
        run["result"] = e


def prefill_finish(state: dict, cfg: dict, tp_rank: int = 0) -> dict:
    run = state.pop(("state", cfg["port"], tp_rank))
    try:
        run["thread"].join(90)
    finally:
        run["mgr"].close()
        if run["server"] is not None:
            run["server"].close()
    if isinstance(run["result"], BaseException):
        raise run["result"]
    if run["result"] is None:
        raise TimeoutError("prefill still running")
    kv = next(p for p in run["mgr"].pools if p.name == "kv")
    src_bad = sum(  # sending reads the source and never writes it
        P.check_tokens(kv, run["side"].tensors["kv"], r["room"], run["pages"][i], 0, 0, r["n"])[0]
        for i, r in enumerate(cfg["rooms"])
    )
    return {"rank": tp_rank, "released": released(run["mgr"]), "src_bad": src_bad, **run["result"]}


def decode(state: dict, cfg: dict, tp_rank: int = 0) -> dict:
    """One decode rank of TP ``cfg['decode_tp']``: ask for every room, then check its state
    slots against its own numbers, its KV against the pattern, every other slot untouched."""
    tp = cfg["decode_tp"]
    sa = C.publish("decode", cfg["port"], tp_size=tp, tp_rank=tp_rank)
    cls = C.classes()
    C.trust(f"127.0.0.1:{cfg['port']}")
    s, pool = side(cfg, tp, tp_rank)
    for ts in s.tensors.values():
        for t in ts:
            t.view(dtype=torch.uint8).fill_(P.SENTINEL)
    _sentinel(pool)
    mgr = cls["manager"](s.kv_args, _mode("DECODE"), sa, False)
    try:
        out = _decode_run(cfg, cls, s, pool, mgr, tp, tp_rank)
    finally:
        mgr.close()
    out["released"] = released(mgr)
    return out


def _decode_run(
    cfg: dict, cls: dict, s: C.Side, pool: Any, mgr: Any, tp: int, tp_rank: int
) -> dict:
    addr = f"127.0.0.1:{cfg['port']}"
    C.wait(lambda: mgr.try_ensure_parallel_info(addr), 60, "prefill never became ready")
    rooms = cfg["rooms"]
    rxs = {}
    for i, r in enumerate(rooms):
        rxs[i] = cls["receiver"](mgr, addr, r["room"])
        rxs[i].init(0)
    C.wait(lambda: all(rx.poll() >= 2 or rx.poll() == 0 for rx in rxs.values()), 60, "handshake")
    dsts = {}
    for i, r in enumerate(rooms):
        k = -(-r["n"] // cfg["page_size"])
        dsts[i] = (np.arange(k) * 2 + 1 + i * 16).astype(np.int64)
        rxs[i].send_metadata(dsts[i], (i + 5) % SLOTS, [[np.array([(i + 5) % SLOTS])]], 0)
    C.wait(lambda: all(rx.poll() in (0, 4) for rx in rxs.values()), 90, "transfer")
    out: dict[str, Any] = {"rank": tp_rank, "rooms": {}, "pools": sorted(p.name for p in mgr.pools)}
    out["pieces"] = {p.name: p.sharding.kind for p in mgr.pools if p.name.startswith("state")}
    for i, r in enumerate(rooms):
        res: dict[str, Any] = {"state": rxs[i].poll(), "bad_state": -1, "bad_kv": -1}
        if res["state"] == 4:
            res["bad_state"] = _wrong(pool, tp, tp_rank, r["room"], (i + 5) % SLOTS)
            kv = next(p for p in mgr.pools if p.name == "kv")
            res["bad_kv"] = P.check_tokens(kv, s.tensors["kv"], r["room"], dsts[i], 0, 0, r["n"])[0]
            res["bytes"] = rxs[i].rx.stats()["bytes"]
            res["one_copy"] = len(dsts[i]) * kv.item_bytes * len(kv.buffers) + _state_bytes(mgr)
        else:
            try:
                rxs[i].failure_exception()
            except Exception as e:  # noqa: BLE001 - reported
                res["failure"] = str(e)
        out["rooms"][str(i)] = res
    out["untouched_bad"] = _untouched(pool, {(i + 5) % SLOTS for i in range(len(rooms))})
    return out


def _state_bytes(mgr: Any) -> int:
    """One copy of a request's slots on this rank: its state pieces and its aux row, in
    every buffer."""
    return sum(
        (
            sum(q.width * q.rows for q in p.sharding.pieces)
            if p.name.startswith("state")
            else p.item_bytes
        )
        * len(p.buffers)
        for p in mgr.pools
        if p.kind == "slot"
    )
