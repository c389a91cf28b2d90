"""SGLang's own queues drive pdxfer (commands for sgl_server.py, run in .venv-sglang).

prefill: SGLang's ``PrefillBootstrapQueue`` over a real CPU ``MHATokenToKVPool`` (with a draft
  pool), ``PagedTokenToKVPoolAllocator``, ``ReqToTokenPool``, ``MetadataBuffers`` and tree
  cache builds pdxfer's manager through ``get_kv_class``. Real ``Req``s go ``add`` ->
  ``pop_bootstrapped``; a stand-in "forward" allocates each chunk's KV the way an extend does
  and writes a pattern of (room, pool, layer, token) into it; SGLang's prefill mixin
  (``send_kv_chunk``, ``process_disagg_prefill_inflight_queue``) sends the chunks and
  retires the requests.
decode: SGLang's ``DecodePreallocQueue`` and ``DecodeTransferQueue`` over a real
  ``MHATokenToKVPool``, ``PagedTokenToKVPoolAllocator``, ``DecodeReqToTokenPool`` and radix
  cache preallocate (``add`` -> ``pop_preallocated``), receive and hand over
  (``pop_transferred``); a request whose prompt starts with a prefix already in the decode's
  radix cache asks for the rest only (``decode_prefix_len > 0``). Then every token of every
  request is checked where SGLang's ``req_to_token`` says it lives.

The scheduler object is the one stand-in: a plain class with the attributes the queues read
(a MagicMock attribute is truthy, and ``enable_hisparse`` or ``is_hybrid_swa`` must be False).
"""

from __future__ import annotations

import threading
import time
from array import array
from types import SimpleNamespace
from typing import Any

import numpy as np
import sgl_common as C
import torch

from pdxfer.agents import patterns as P

PAGE = 4
HEADS, HEAD_DIM, LAYERS, DRAFT_LAYERS = 2, 8, 2, 1
TOKENS = 1024  # KV slots per pool
VOCAB = 1000
CHUNK = 12  # tokens per prefill chunk (a multiple of the page size, as SGLang's)


def _kv_pool(layers: int) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        size=TOKENS,
        page_size=PAGE,
        dtype=torch.float16,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )


def _allocator(pool: Any) -> Any:
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    return PagedTokenToKVPoolAllocator(TOKENS, PAGE, torch.float16, "cpu", pool, need_sort=False)


def _tree_cache(rtp: Any, allocator: Any, enabled: bool) -> Any:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    return UnifiedRadixCache(
        CacheInitParams(
            disable=not enabled,
            req_to_token_pool=rtp,
            token_to_kv_pool_allocator=allocator,
            page_size=PAGE,
            tree_components=(ComponentType.FULL,),
        )
    )


def _metadata() -> tuple[Any, Any]:
    from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator

    return (
        MetadataBuffers(
            16, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=0
        ),
        ReqToMetadataIdxAllocator(16),
    )


def _gloo(port: int) -> Any:
    """A one-process gloo group: SGLang's queues all-reduce their polls over the TP group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return dist.new_group([0], backend="gloo")


def _model_config() -> Any:
    return SimpleNamespace(
        num_hidden_layers=LAYERS,
        get_total_num_kv_heads=lambda: HEADS,
        hf_text_config=SimpleNamespace(),
        hf_config=SimpleNamespace(),
    )


class _Streamed:
    """The scheduler's output streamer: records what SGLang would send to the client."""

    def __init__(self) -> None:
        self.reqs: list[Any] = []

    def stream_output(self, reqs: list[Any], *args: Any, **kw: Any) -> None:
        self.reqs.extend(reqs)


def _token_specs(pool: Any, draft: Any) -> list[tuple[Any, list[torch.Tensor]]]:
    """SGLang's KV pools (target and draft) described token by token, for the patterns: one
    token per item, K and V of every layer, whatever pdxfer's manager made of them."""
    from pdxfer import PoolSpec

    out = []
    for name, p, base in (("kv", pool, 0), ("draft_kv", draft, 100)):
        k, v = list(p.k_buffer), list(p.v_buffer)
        spec = PoolSpec.mha(
            name,
            [t.unsqueeze(1) for t in k],
            [t.unsqueeze(1) for t in v],
            page_size=1,
            layer_ids=[base + i for i in range(len(k))],
        )
        out.append((spec, k + v))
    return out


def first_token(room: int) -> int:
    return (room * 7919) % VOCAB


def _req(
    room: int, n: int, host: str, port: int, mode: str, prompt: list[int] | None = None
) -> Any:
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    ids = prompt if prompt is not None else [(room * 31 + i) % VOCAB for i in range(n)]
    sp = SamplingParams(max_new_tokens=4)
    sp.normalize(None)
    sp.verify(VOCAB)
    return Req(
        f"room-{room}",
        "",
        array("q", ids),
        sp,
        bootstrap_host=host,
        bootstrap_port=port,
        bootstrap_room=room,
        disagg_mode=getattr(DisaggregationMode, mode),
        vocab_size=VOCAB,
    )


# -- prefill ---------------------------------------------------------------------------------


def prefill_setup(state: dict, port: int, gloo_port: int) -> dict:
    """SGLang's bootstrap server and PrefillBootstrapQueue, pdxfer's manager inside it."""
    sa = C.publish("prefill", port)
    cls = C.classes()  # load_plugins() first: it replaces TransferBackend
    from sglang.srt.disaggregation.prefill import (
        PrefillBootstrapQueue,
        SchedulerDisaggregationPrefillMixin,
    )
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    srv = cls["bootstrap_server"]("127.0.0.1", port)
    state.setdefault("closers", []).append(srv.close)
    g = _gloo(gloo_port)
    pool, draft = _kv_pool(LAYERS), _kv_pool(DRAFT_LAYERS)
    allocator = _allocator(pool)
    rtp = ReqToTokenPool(size=8, max_context_len=TOKENS, device="cpu", enable_memory_saver=False)
    mb, mb_alloc = _metadata()

    class PrefillScheduler(SchedulerDisaggregationPrefillMixin):
        """SGLang's prefill mixin over the parts of a scheduler it reads."""

    s = PrefillScheduler()
    s.server_args = sa
    s.tp_worker = SimpleNamespace(
        is_hybrid_swa=False,
        model_runner=SimpleNamespace(
            effective_logical_max_total_num_tokens=TOKENS, kv_cache_dtype_str="float16"
        ),
    )
    s.kv_shard_widening = 1
    s.token_to_kv_pool_allocator = allocator
    s.req_to_token_pool = rtp
    s.tree_cache = _tree_cache(rtp, allocator, enabled=False)
    s.rust_server = None
    s.attn_cp_cpu_group = s.attn_tp_cpu_group = g
    s.model_config = _model_config()
    s.disagg_metadata_buffers = mb
    s.req_to_metadata_buffer_idx_allocator = mb_alloc
    s.disagg_prefill_inflight_queue = []
    s.disagg_prefill_pending_chunk_rids = set()
    s.enable_staging = s.enable_overlap = False
    s.processed_tokens_counter = 0
    s.output_streamer = _Streamed()
    s.metrics_reporter = SimpleNamespace(enable_metrics=False)
    s.waiting_queue = []
    s.scheduler_stage_metrics = None
    q = PrefillBootstrapQueue(
        pool, draft, mb_alloc, mb, 0, port, TOKENS, s, None, TransferBackend("pdxfer")
    )
    s.disagg_prefill_bootstrap_queue = q
    state["closers"].append(q.kv_manager.close)
    state["prefill"] = SimpleNamespace(
        s=s, q=q, specs=_token_specs(pool, draft), thread=None, result=None, port=port
    )
    m = q.kv_manager
    kv = m.pools[0]
    return {
        "manager": type(m).__name__,
        "pools": [p.name for p in m.pools],
        "kv": {
            "buffers": len(kv.buffers),
            "page_size": kv.page_size,
            "heads": [kv.sharding.total_heads, kv.sharding.rank_heads],
            "item_bytes": kv.item_bytes,
        },
        "instance": m.endpoint.registration().instance,
    }


def prefill_serve(state: dict, rooms: list[dict]) -> str:
    """Start serving ``rooms`` ({room, n, prompt?}) in the background: the scheduler loop."""
    pf = state["prefill"]
    reqs = [
        _req(r["room"], r["n"], "127.0.0.1", pf.port, "PREFILL", r.get("prompt")) for r in rooms
    ]
    pf.result = None
    pf.thread = threading.Thread(target=_prefill_loop, args=(pf, reqs), daemon=True)
    pf.thread.start()
    return "serving"


def prefill_collect(state: dict, timeout: float = 60.0) -> dict:
    pf = state["prefill"]
    pf.thread.join(timeout)
    if pf.thread.is_alive():
        raise TimeoutError("prefill loop still running")
    if isinstance(pf.result, BaseException):
        raise pf.result
    return pf.result


def _prefill_loop(pf: Any, reqs: list[Any]) -> None:
    try:
        pf.result = _prefill_run(pf, reqs)
    except BaseException as e:  # noqa: BLE001 - re-raised in prefill_collect
        pf.result = e


def _prefill_run(pf: Any, reqs: list[Any]) -> dict:
    s, q = pf.s, pf.q
    for r in reqs:
        q.add(r, HEADS)
    waiting: list[Any] = []
    done: dict[str, Any] = {}
    end = time.monotonic() + 60
    while len(done) < len(reqs) and time.monotonic() < end:
        waiting += q.pop_bootstrapped()
        for r in list(waiting):
            if _forward_chunk(pf, r):  # the last chunk ran: the request is inflight
                waiting.remove(r)
        for r in s.process_disagg_prefill_inflight_queue():
            done[r.rid] = r
        time.sleep(0.002)
    if len(done) < len(reqs):
        raise TimeoutError(f"prefill: {len(done)} of {len(reqs)} requests finished")
    return {
        "rooms": {
            str(r.bootstrap_room): {
                "finished": type(r.finished_reason).__name__,
                # what finalize_bootstrap took from pop_decode_prefix_len() (sends start there)
                "decode_prefix_len": r.disagg_decode_prefix_len,
                "kv_released": r.kv.is_kv_released,
                "metadata_freed": r.metadata_buffer_index == -1,
            }
            for r in done.values()
        },
        "streamed": sorted(r.rid for r in s.output_streamer.reqs),
        "free_tokens": s.token_to_kv_pool_allocator.available_size(),
        "total_tokens": TOKENS,
    }


def _forward_chunk(pf: Any, req: Any) -> bool:
    """One chunk of a chunked prefill, as SGLang's non-overlap loop runs it: allocate the
    chunk's KV (a fresh request also a ``req_to_token`` row), "compute" it (write the
    pattern), then send it (``send_kv_chunk``), or, for the last chunk, pick the first token,
    put the request on the inflight queue and send the rest with the aux row."""
    s = pf.s
    n = len(req.origin_input_ids)
    start = req.extend_end or 0
    stop = min(n, start + CHUNK)
    if not req.kv.holds_kv:
        s.req_to_token_pool.alloc([req])
    rows = s.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    new = -(-stop // PAGE) - -(-start // PAGE)
    loc = s.token_to_kv_pool_allocator.alloc(new * PAGE)
    assert loc is not None, "prefill KV pool exhausted"
    rows[start:stop] = loc[: stop - start].to(rows.dtype)
    req.kv.kv_allocated_len = req.kv.kv_committed_len = stop
    req.prefix_len, req.extend_end = start, stop
    room = req.bootstrap_room
    for spec, ts in pf.specs:
        P.fill_tokens(spec, ts, room, rows[start:stop].to(torch.int64).numpy(), start, start, stop)
    if stop < n:
        if s.check_bootstrap(req):
            s.send_kv_chunk(req)
        return False
    req.output_ids.append(first_token(room))
    req.cached_tokens = room % 97
    s.disagg_prefill_inflight_queue.append(req)
    if not req.pending_bootstrap:
        s.send_kv_chunk(req, last_chunk=True)
    return True


# -- decode ----------------------------------------------------------------------------------


def decode_setup(state: dict, gloo_port: int, trusted: str) -> dict:
    """SGLang's DecodePreallocQueue and DecodeTransferQueue with a decode radix cache, its
    pdxfer manager trusting the bootstrap server ``trusted``."""
    C.trust(trusted)
    sa = C.publish("decode", 1, disaggregation_decode_enable_radix_cache=True)
    C.classes()  # load_plugins() first: it replaces TransferBackend
    from sglang.srt.disaggregation.decode import (
        DecodePreallocQueue,
        DecodeReqToTokenPool,
        DecodeTransferQueue,
    )
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    g = _gloo(gloo_port)
    # the queues read the TP group's CPU side only: the one-process gloo group
    get_parallel().override_permanently(attn_tp_group=SimpleNamespace(cpu_group=g))
    pool, draft = _kv_pool(LAYERS), _kv_pool(DRAFT_LAYERS)
    allocator = _allocator(pool)
    rtp = DecodeReqToTokenPool(
        size=8, max_context_len=TOKENS, device="cpu", enable_memory_saver=False, pre_alloc_size=8
    )
    tree = _tree_cache(rtp, allocator, enabled=True)
    mb, mb_alloc = _metadata()
    s = SimpleNamespace(
        server_args=sa,
        enable_hisparse=False,
        enable_decode_hicache=False,
        enable_lora=False,
        enable_overlap=False,
        enable_priority_scheduling=False,
        hisparse_coordinator=None,
        tp_worker=SimpleNamespace(
            is_hybrid_swa=False,
            model_runner=SimpleNamespace(kv_cache_dtype_str="float16", max_token_pool_size=TOKENS),
        ),
        running_batch=SimpleNamespace(reqs=[]),
        waiting_queue=[],
        last_batch=None,
        sliding_window_size=None,
        model_config=_model_config(),
        random_seed=0,
        metrics_reporter=SimpleNamespace(enable_metrics=False),
        output_streamer=_Streamed(),
        spec_algorithm=SpeculativeAlgorithm.NONE,
        batch_result_processor=SimpleNamespace(
            _maybe_update_reasoning_tokens=lambda req, token: None
        ),
        kv_checksum_computer=None,
        disagg_decode_prealloc_queue=None,
    )
    tq = DecodeTransferQueue(mb_alloc, mb, s, tree)
    pq = DecodePreallocQueue(
        rtp, allocator, draft, mb_alloc, mb, s, tq, tree, 0, 1, TOKENS, 2, TransferBackend("pdxfer")
    )
    s.disagg_decode_prealloc_queue = pq
    state.setdefault("closers", []).append(pq.kv_manager.close)
    specs = _token_specs(pool, draft)
    for _, ts in specs:
        for t in ts:
            t.view(torch.uint8).fill_(P.SENTINEL)
    state["decode"] = SimpleNamespace(
        s=s, pq=pq, tq=tq, tree=tree, rtp=rtp, specs=specs, owned=set()
    )
    return {"manager": type(pq.kv_manager).__name__, "pools": [p.name for p in pq.kv_manager.pools]}


def decode_cache_prefix(state: dict, owner_room: int, prompt: list[int]) -> dict:
    """Put ``prompt`` in the decode's radix cache, its KV holding ``owner_room``'s pattern
    (as if an earlier request of that room had run here): a later request sharing it asks
    the prefill for the rest only."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    dc = state["decode"]
    n = len(prompt)
    assert n % PAGE == 0, "a cached prefix is whole pages"
    loc = dc.s.disagg_decode_prealloc_queue.token_to_kv_pool_allocator.alloc(n)
    for spec, ts in dc.specs:
        P.fill_tokens(spec, ts, owner_room, loc.to(torch.int64).numpy(), 0, 0, n)
    res = dc.tree.insert(InsertParams(key=RadixKey(array("q", prompt)), value=loc))
    dc.owned.update(loc.tolist())
    return {"inserted": int(res.prefix_len) if res.prefix_len else 0, "locations": loc.tolist()}


def decode_run(state: dict, port: int, rooms: list[dict], timeout: float = 60.0) -> dict:
    """Add the requests to SGLang's prealloc queue and run its decode loop until the
    transfer queue handed every one over; then check every token of every request."""
    dc = state["decode"]
    reqs = [_req(r["room"], r["n"], "127.0.0.1", port, "DECODE", r.get("prompt")) for r in rooms]
    for r in reqs:
        dc.pq.add(r)
    handed: dict[int, Any] = {}
    prefix_sent: dict[int, int] = {}
    failed: list[int] = []
    end = time.monotonic() + timeout
    while len(handed) + len(failed) < len(reqs) and time.monotonic() < end:
        pre, bad = dc.pq.pop_preallocated()
        failed += [d.req.bootstrap_room for d in bad]
        for d in pre:
            prefix_sent[d.req.bootstrap_room] = int(d.req.kv.cache_protected_len)
        dc.tq.extend(pre)
        for r in dc.tq.pop_transferred():
            handed[r.bootstrap_room] = r
        time.sleep(0.002)
    out: dict[str, Any] = {
        "failed": failed,
        "stuck": [
            {
                "room": d.req.bootstrap_room,
                "waiting_for_input": d.waiting_for_input,
                "poll": int(d.kv_receiver.poll()) if d.kv_receiver else None,
            }
            for d in dc.pq.queue + dc.tq.queue
        ],
        "pending": sorted(
            r.bootstrap_room
            for r in reqs
            if r.bootstrap_room not in handed and r.bootstrap_room not in failed
        ),
        "rooms": {},
    }
    for spec_room in rooms:
        room = spec_room["room"]
        r = handed.get(room)
        if r is None:
            continue
        n = len(r.origin_input_ids)
        prefix = prefix_sent[room]
        loc = dc.rtp.req_to_token[r.kv.req_pool_idx, :n].to(torch.int64).numpy()
        res = {
            "n": n,
            "decode_prefix_len": prefix,
            "output_ids": list(r.output_ids),
            "cached_tokens": int(r.cached_tokens),
            "bad": 0,
            "first_bad": "",
            "checked_bytes": 0,
        }
        for tspec, ts in dc.specs:
            owner = spec_room.get("prefix_owner")
            if prefix:
                bad, why = P.check_tokens(tspec, ts, owner, loc[:prefix], 0, 0, prefix)
                res["bad"] += bad
                res["first_bad"] = res["first_bad"] or (why and f"prefix: {why}")
            bad, why = P.check_tokens(tspec, ts, room, loc[prefix:], prefix, prefix, n)
            res["bad"] += bad
            res["first_bad"] = res["first_bad"] or why
            res["checked_bytes"] += n * tspec.token_bytes * len(ts)
        res["locations_distinct"] = len(set(loc.tolist())) == n
        dc.owned.update(_page_slots(loc))
        out["rooms"][str(room)] = res
    out["untouched_bad"] = _untouched_bad(dc)
    return out


def _page_slots(loc: np.ndarray) -> set[int]:
    """Every slot of the pages holding ``loc``: a request owns whole pages, and the tail of
    its last page moves with it."""
    pages = np.unique(np.asarray(loc) // PAGE)
    return set((pages[:, None] * PAGE + np.arange(PAGE)).reshape(-1).tolist())


def _untouched_bad(dc: Any) -> int:
    """Bytes changed in KV slots no request and no cached prefix owns (all start as the
    sentinel): a write past a request's pages shows here."""
    free = torch.ones(dc.specs[0][1][0].shape[0], dtype=torch.bool)
    free[torch.tensor(sorted(dc.owned), dtype=torch.int64)] = False
    return sum(
        int((t.view(torch.uint8)[free] != P.SENTINEL).sum()) for _, ts in dc.specs for t in ts
    )
