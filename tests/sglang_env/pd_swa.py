"""SGLang's sliding-window (SWA) pool through pdxfer (commands for sgl_server.py).

Each side builds SGLang's real ``SWAKVPool`` (a full-attention MHA sub-pool for layer 1, an
SWA one for layers 0 and 2) and ``SWATokenToKVPoolAllocator``; its ``KVArgs`` come from the
pool's ``get_contiguous_buf_infos`` and SGLang's ``setup_state_kv_args`` (state ``swa``).
prefill: each prompt is allocated chunk by chunk (``alloc_extend``), each chunk's full and
SWA slots get a pattern of (room, pool, layer, token), and SWA pages that left the window are
freed (``free_swa``), so later chunks reuse them. The sends are SGLang's: KV pages past the
decode's prefix, and with the last chunk the window's SWA pages as SGLang's prefill computes
them (``translate_swa_indices_for_transfer``, ``kv_to_page_indices``). decode: allocates
after a throwaway allocation (its ids differ from the prefill's), frees SWA pages before its
window, sends SGLang's decode metadata, then checks every full token past the prefix and every
SWA token of the window, and that no other page changed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import sgl_common as C
import torch

from pdxfer.agents import patterns as P

PAGE, HEADS, HEAD_DIM, CHUNK = 4, 2, 8, 12
SIZE, SIZE_SWA = 512, 192  # tokens of the full and the SWA sub-pool
SWA_LAYERS, FULL_LAYERS = [0, 2], [1]


def _pool(heads: int = HEADS) -> tuple[Any, Any]:
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    pool = SWAKVPool(
        size=SIZE,
        size_swa=SIZE_SWA,
        page_size=PAGE,
        dtype=torch.float16,
        head_num=heads,
        head_dim=HEAD_DIM,
        swa_attention_layer_ids=SWA_LAYERS,
        full_attention_layer_ids=FULL_LAYERS,
        device="cpu",
    )
    alloc = SWATokenToKVPoolAllocator(
        SIZE, SIZE_SWA, PAGE, torch.float16, "cpu", pool, need_sort=False
    )
    return pool, alloc


def _kv_args(pool: Any, aux: torch.Tensor, swa: bool, tp_rank: int = 0) -> Any:
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import setup_state_kv_args

    a = KVArgs()
    a.pp_rank = a.system_dp_rank = a.prefill_start_layer = a.gpu_id = 0
    a.engine_rank = tp_rank
    a.kv_cache_dtype_str, a.kv_layout, a.ib_device = "float16", None, ""
    a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = pool.get_contiguous_buf_infos()
    a.kv_layer_ids, a.num_draft_entries, a.page_size = [], 0, PAGE
    a.kv_head_num, a.total_kv_head_num = pool.head_num, HEADS
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = (
        [aux.data_ptr()],
        [aux.nbytes],
        [aux[0].nbytes],
    )
    setup_state_kv_args(a, pool)  # SGLang's own: state "swa" over the SWA sub-pool
    if not swa:  # a decode serving a model without a sliding window
        a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
    return a


def _tensors(pool: Any) -> dict[str, list[torch.Tensor]]:
    """Each pdxfer pool's tensors in its buffer order (K layers, then V layers)."""
    f, s = pool.full_kv_pool, pool.swa_kv_pool
    return {"kv": list(f.k_buffer) + list(f.v_buffer), "swa": list(s.k_buffer) + list(s.v_buffer)}


def _alloc(alloc: Any, loc: torch.Tensor, start: int, stop: int) -> None:
    """``alloc_extend`` tokens ``[start, stop)`` of one request (``loc``: its row)."""
    last = loc[start - 1 : start].clone() if start else torch.tensor([-1], dtype=torch.int64)
    t = lambda x: torch.tensor([x], dtype=torch.int64)  # noqa: E731
    new = alloc.alloc_extend(t(start), t(start), t(stop), t(stop), last, stop - start)
    assert new is not None, "pool exhausted"
    loc[start:stop] = new


def _pages(x: torch.Tensor) -> np.ndarray:
    from sglang.srt.mem_cache.common import kv_to_page_indices

    return np.asarray(kv_to_page_indices(x, PAGE), dtype=np.int64)


def window_start(n: int, prefix: int, window: int) -> int:
    """SGLang's (prefill and decode ``_swa_payload``): page-aligned max(prefix, n - window)."""
    from sglang.srt.mem_cache.common import page_align_floor

    return page_align_floor(max(prefix, n - window), PAGE)


def _specs(mgr: Any) -> dict[str, Any]:
    return {p.name: p for p in mgr.pools}


# -- prefill ---------------------------------------------------------------------------------


def prefill_start(state: dict, cfg: dict, tp_rank: int = 0) -> dict:
    """One prefill rank (``cfg["prefill_tp"]`` ranks hold the heads in equal shares; they
    allocate in lockstep, as SGLang's TP ranks do, so their page ids agree)."""
    tp = cfg.get("prefill_tp", 1)
    sa = C.publish("prefill", cfg["port"], tp_size=tp, tp_rank=tp_rank)
    cls = C.classes()
    server = cls["bootstrap_server"]("127.0.0.1", cfg["port"]) if tp_rank == 0 else None
    pool, alloc = _pool(HEADS // tp)
    aux = torch.zeros(8, 16, dtype=torch.int32)
    mgr = cls["manager"](_kv_args(pool, aux, True, tp_rank), _mode("PREFILL"), sa, False)
    specs, ts = _specs(mgr), _tensors(pool)
    window = cfg["window_prefill"]
    locs, senders = {}, {}
    for i, r in enumerate(cfg["rooms"]):
        n, room = r["n"], r["room"]
        loc = torch.zeros(n, dtype=torch.int64)
        freed = 0
        for start in range(0, n, CHUNK):  # a chunked prefill: write, then drop the old window
            stop = min(n, start + CHUNK)
            _alloc(alloc, loc, start, stop)
            P.fill_tokens(specs["kv"], ts["kv"], room, _pages(loc[start:stop]), start, start, stop)
            swa_loc = alloc.translate_loc_from_full_to_swa(loc[start:stop])
            P.fill_tokens(specs["swa"], ts["swa"], room, _pages(swa_loc), start, start, stop)
            drop = max(0, (stop - window) // PAGE * PAGE)
            if drop > freed:
                alloc.free_swa(loc[freed:drop])
                freed = drop
        locs[i] = loc
        senders[i] = cls["sender"](mgr, f"127.0.0.1:{cfg['port']}", room)
    run = {
        "mgr": mgr,
        "server": server,
        "senders": senders,
        "result": None,
        "keep": (pool, alloc, aux),
    }
    run["thread"] = threading.Thread(
        target=_prefill_loop, args=(cfg, run, alloc, locs), daemon=True
    )
    run["thread"].start()
    state[("swa", cfg["port"], tp_rank)] = run
    return {"pools": sorted(specs), "swa": _describe(specs["swa"]), "kv": _describe(specs["kv"])}


def _describe(p: Any) -> dict:
    return {
        "buffers": len(p.buffers),
        "item_bytes": p.item_bytes,
        "page_size": p.page_size,
        "indices_from": p.indices_from,
        "heads": [p.sharding.total_heads, p.sharding.rank_heads],
    }


def _prefill_loop(cfg: dict, run: dict, alloc: Any, locs: dict) -> None:
    try:
        run["result"] = _prefill_run(cfg, run["senders"], alloc, locs)
    except BaseException as e:  # noqa: BLE001 - re-raised by prefill_finish
        run["result"] = e


def _prefill_run(cfg: dict, senders: dict, alloc: Any, locs: dict) -> dict:
    done: dict[int, int] = {}
    started: dict[int, int] = {}
    end = time.monotonic() + cfg.get("prefill_wait_s", 60)
    while len(done) < len(senders) and time.monotonic() < end:
        for i, s in senders.items():
            if i in done:
                continue
            st = s.poll()
            if st in (0, 4):
                done[i] = st
            elif st >= 2 and i not in started:
                started[i] = _send(cfg, s, alloc, locs[i], i)
        time.sleep(0.002)
    fails = {}
    for i, st in done.items():
        if st == 0:
            try:
                senders[i].failure_exception()
            except Exception as e:  # noqa: BLE001 - reported
                fails[str(i)] = str(e)
    return {
        "states": {str(k): v for k, v in done.items()},
        "failures": fails,
        "prefix": {str(k): v for k, v in started.items()},
    }


def _send(cfg: dict, s: Any, alloc: Any, loc: torch.Tensor, i: int) -> int:
    """SGLang's prefill sends: the KV past the decode's prefix in chunks, the window's SWA
    pages with the last (its ``_swa_payload``)."""
    prefix = s.pop_decode_prefix_len()
    n = loc.numel()
    kv = _pages(loc[prefix:])
    s.init(len(kv), i % 8)
    ws = window_start(n, prefix, cfg["window_prefill"])
    swa = _pages(alloc.translate_swa_indices_for_transfer(loc[ws:n]))
    chunks = np.array_split(kv, min(3, len(kv)))
    for j, c in enumerate(chunks):
        s.send(c, [swa] if j == len(chunks) - 1 else None)
    return prefix


def prefill_finish(state: dict, cfg: dict, tp_rank: int = 0) -> dict:
    run = state.pop(("swa", cfg["port"], tp_rank))
    try:
        run["thread"].join(60)
    finally:
        run["mgr"].close()
        if run["server"] is not None:
            run["server"].close()
    if isinstance(run["result"], BaseException):
        raise run["result"]
    if run["result"] is None:
        raise TimeoutError("prefill still running")
    return run["result"]


def _mode(name: str) -> Any:
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return getattr(DisaggregationMode, name)


# -- decode ----------------------------------------------------------------------------------


def decode(state: dict, cfg: dict) -> dict:
    sa = C.publish("decode", cfg["port"])
    cls = C.classes()
    C.trust(f"127.0.0.1:{cfg['port']}")
    pool, alloc = _pool()
    aux = torch.zeros(8, 16, dtype=torch.int32)
    ts = _tensors(pool)
    for t in [*ts["kv"], *ts["swa"]]:
        t.view(torch.uint8).fill_(P.SENTINEL)
    mgr = cls["manager"](
        _kv_args(pool, aux, cfg.get("decode_swa", True)), _mode("DECODE"), sa, False
    )
    try:
        return _decode_run(cfg, cls, mgr, alloc, ts)
    finally:
        mgr.close()


def _decode_run(cfg: dict, cls: dict, mgr: Any, alloc: Any, ts: dict) -> dict:
    addr = f"127.0.0.1:{cfg['port']}"
    C.wait(lambda: mgr.try_ensure_parallel_info(addr), 60, "prefill never became ready")
    rooms, window = cfg["rooms"], cfg["window_decode"]
    rxs = {i: cls["receiver"](mgr, addr, r["room"]) for i, r in enumerate(rooms)}
    for rx in rxs.values():
        rx.init(0)
    C.wait(lambda: all(rx.poll() >= 2 or rx.poll() == 0 for rx in rxs.values()), 30, "handshake")
    throwaway = torch.zeros(8, dtype=torch.int64)
    _alloc(alloc, throwaway, 0, 8)  # the decode's ids differ from the prefill's
    dst: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}
    for i, r in enumerate(rooms):
        n, prefix = r["n"], r["prefix"]
        loc = torch.zeros(n, dtype=torch.int64)
        _alloc(alloc, loc, 0, n)
        if i == 0:
            alloc.free(throwaway)  # reused by the next request
        ws = window_start(n, prefix, window)
        if ws:
            alloc.free_swa(loc[:ws])  # the decode holds the window's SWA pages only
        kv = _pages(loc[prefix:])
        swa = _pages(alloc.translate_swa_indices_for_transfer(loc[ws:n]))
        dst[i] = (kv, swa, ws)
        rxs[i].send_metadata(kv, i % 8, [swa], prefix)
    C.wait(lambda: all(rx.poll() in (0, 4) for rx in rxs.values()), 60, "transfer")
    specs = _specs(mgr)
    out: dict[str, Any] = {"pools": sorted(specs), "rooms": {}}
    seen: dict[str, list[int]] = {"kv": [], "swa": []}
    for i, r in enumerate(rooms):
        kv, swa, ws = dst[i]
        res: dict[str, Any] = {
            "state": rxs[i].poll(),
            "window_start": ws,
            "bad": 0,
            "first_bad": "",
        }
        if res["state"] == 4:
            for name, pages, first in (("kv", kv, r["prefix"]), ("swa", swa, ws)):
                bad, why = P.check_tokens(
                    specs[name], ts[name], r["room"], pages, first, first, r["n"]
                )
                res["bad"] += bad
                res["first_bad"] = res["first_bad"] or why
                seen[name] += [int(x) for x in pages]
            res["bytes"] = {"kv": rxs[i].rx.stats()["bytes"], "swa": rxs[i].swa_rx.stats()["bytes"]}
        else:
            try:
                rxs[i].failure_exception()
            except Exception as e:  # noqa: BLE001 - reported
                res["failure"] = str(e)
                res["cause"] = type(e.__cause__).__name__
        out["rooms"][str(i)] = res
    out["untouched_bad"] = {
        name: P.untouched(specs[name], ts[name], seen[name]) for name in specs if name in ts
    }
    out["swa_item_bytes"] = (
        specs["swa"].item_bytes * len(specs["swa"].buffers) if "swa" in specs else 0
    )
    out["kv_item_bytes"] = specs["kv"].item_bytes * len(specs["kv"].buffers)
    return out
