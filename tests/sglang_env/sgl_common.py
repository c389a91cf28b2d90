"""Shared by the SGLang-side test processes (run in .venv-sglang): SGLang's runtime context,
the plugin, and pools built as SGLang's ``KVArgs`` over CPU tensors filled with patterns."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdxfer.agents import patterns as P


def publish(mode: str, port: int, tp_size: int = 1, tp_rank: int = 0, **extra: Any) -> Any:
    """Publish a topology the way SGLang's launcher does for one scheduler rank."""
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(
        model_path="dummy",
        disaggregation_mode=mode,
        disaggregation_transfer_backend="pdxfer",
        disaggregation_bootstrap_port=port,
        host="127.0.0.1",
        tp_size=tp_size,
        **extra,
    )
    reset_context()
    publish(sa, role="test", ranks=SpawnRanks(world_rank=tp_rank))
    par = get_parallel()
    for name in ("pp_group", "world_group"):
        try:
            getattr(par, name)
        except (RuntimeError, ValueError):
            par.override_permanently(**{name: None})
    return sa


def trust(*addrs: str) -> None:
    """The bootstrap servers the decode managers built next trust (a pdxfer decode refuses
    to start without them, and refuses any other address a request names)."""
    os.environ["PDXFER_TRUSTED_BOOTSTRAPS"] = ",".join(addrs)


def classes() -> Any:
    """SGLang's ``get_kv_class`` after ``load_plugins()``: pdxfer's classes."""
    from sglang.srt.plugins import load_plugins

    load_plugins()  # first: it replaces TransferBackend, so import it after
    from sglang.srt.disaggregation import utils

    tb = utils.TransferBackend("pdxfer")
    return {ct.value: utils.get_kv_class(tb, ct) for ct in utils.KVClassType}


@dataclass
class Side:
    """One rank's buffers, as tensors and as SGLang's ``KVArgs``."""

    kv_args: Any
    tensors: dict[str, list[torch.Tensor]]


def make_side(
    *,
    attn: str,
    layers: int,
    page_size: int,
    pages: int,
    heads: int,
    total_heads: int,
    head_dim: int,
    draft: bool,
    state: bool,
    rows: int,
    tp_rank: int,
    host_page: int | None = None,
    set_heads: bool = True,
    dim: int = 32,
    host_kv: bool = False,
) -> Side:
    """Buffers laid out as SGLang's pools lay them out (MHA: ``[tokens, heads, head_dim]``
    per layer, K then V; MLA: ``[tokens, 1, dim]``; draft appended; aux rows; a Mamba state
    of two tensors with rows of different sizes). ``host_page``: the KV lands in a host pool
    of that page size (HiSparse), ``page_size`` stays SGLang's device page size. ``host_kv``:
    host copies of the KV buffers (``host_kv_data_*``, SGLang's decode host receive), tensors
    ``host_kv`` and ``host_draft_kv``."""
    from sglang.srt.disaggregation.base.conn import KVArgs, StateType

    kv_ps = host_page or page_size
    tokens = pages * page_size
    dt = torch.float16
    ts: dict[str, list[torch.Tensor]] = {}
    if attn == "mha":
        ts["kv"] = [torch.zeros(tokens, heads, head_dim, dtype=dt) for _ in range(2 * layers)]
    else:
        ts["kv"] = [torch.zeros(tokens, 1, dim, dtype=dt) for _ in range(layers)]
    if draft:
        ts["draft_kv"] = (
            [torch.zeros(tokens, heads, head_dim, dtype=dt) for _ in range(2)]
            if attn == "mha"
            else [torch.zeros(tokens, 1, dim, dtype=dt)]
        )
    ts["aux"] = [
        torch.zeros(rows, 16, dtype=torch.int32),
        torch.zeros(rows, 16, dtype=torch.float32),
    ]
    a = KVArgs()
    a.engine_rank = tp_rank
    a.pp_rank = 0
    a.system_dp_rank = 0
    a.kv_cache_dtype_str = "float16"
    a.kv_layout = None
    kv = ts["kv"] + ts.get("draft_kv", [])
    a.kv_data_ptrs = [t.data_ptr() for t in kv]
    a.kv_data_lens = [t.nbytes for t in kv]
    a.kv_item_lens = [t[0].nbytes * kv_ps for t in kv]
    a.kv_layer_ids = []
    a.num_draft_entries = len(ts.get("draft_kv", []))
    a.page_size = page_size
    if set_heads and attn == "mha":
        a.kv_head_num = heads
        a.total_kv_head_num = total_heads
    a.aux_data_ptrs = [t.data_ptr() for t in ts["aux"]]
    a.aux_data_lens = [t.nbytes for t in ts["aux"]]
    a.aux_item_lens = [t[0].nbytes for t in ts["aux"]]
    a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
    a.state_layer_ids = []
    if state:
        ts["mamba"] = [
            torch.zeros(rows, 4, 8, dtype=dt),
            torch.zeros(rows, 8, 8, dtype=torch.float32),
        ]
        a.state_types = [StateType.MAMBA]
        a.state_data_ptrs = [[t.data_ptr() for t in ts["mamba"]]]
        a.state_data_lens = [[t.nbytes for t in ts["mamba"]]]
        a.state_item_lens = [[t[0].nbytes for t in ts["mamba"]]]
        a.state_layer_ids = [[0, 0]]
    if host_kv:
        for name in ("kv", "draft_kv"):
            ts["host_" + name] = [torch.zeros_like(t) for t in ts.get(name, [])]
        host = ts["host_kv"] + ts["host_draft_kv"]
        a.host_kv_data_ptrs = [t.data_ptr() for t in host]
        a.host_kv_data_lens = [t.nbytes for t in host]
        a.host_kv_item_lens = list(a.kv_item_lens)
    a.ib_device = ""
    a.gpu_id = 0
    a.prefill_start_layer = 0
    return Side(a, ts)


def tensors_of(side: Side, spec: Any, host: bool = False) -> list[torch.Tensor]:
    """The tensors behind one pdxfer pool, in the pool's buffer order (``host``: a pool of
    the decode's host endpoint)."""
    if spec.name.startswith("state0_mamba."):
        return [side.tensors["mamba"][int(spec.name.rsplit(".", 1)[1])]]
    if host and spec.kind == "paged":
        return side.tensors["host_" + spec.name]
    return side.tensors[spec.name]


def fill(
    side: Side, pools: list[Any], room: int, pages: np.ndarray, n: int, slots: dict[str, int]
) -> None:
    for spec in pools:
        if spec.kind == "paged":
            P.fill_tokens(spec, tensors_of(side, spec), room, pages, 0, 0, n)
        elif spec.name in slots:
            P.fill_slot(spec, tensors_of(side, spec), room, slots[spec.name])


def wait(pred: Any, timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.005)
    raise TimeoutError(what)
