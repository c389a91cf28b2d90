"""SGLang's ``KVArgs`` as pdxfer ``PoolSpec``s. Pure: reads attributes, imports no SGLang.

SGLang describes a rank's transfer buffers as flat address lists (``disaggregation/base/
conn.py``); pdxfer wants named pools with a geometry both sides check at pairing.
``pools_of`` maps one to the other (its docstring gives the mapping): target KV, draft KV,
metadata rows, states, and SGLang's sliding-window pool (``window.py`` says which of its
pages a request moves); rings, tails and other window-indexed states are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdxfer import BufferSpec, ConfigError, Piece, PoolSpec, Sharding

KV, DRAFT, AUX, SWA = "kv", "draft_kv", "aux", "swa"
DRAFT_LAYER_BASE = 1_000_000
"""Draft layers number from zero like the target's: their pdxfer layer ids are offset so the
two never collide (both sides apply the same offset)."""
SWA_LAYER_BASE = 2_000_000
"""The SWA pool's layers number from zero too (SGLang gives them no ids): offset likewise."""
SWA_STATE = "swa"
SWA_LAYOUTS = (None, "nhd")
"""SWA sub-pool layouts pdxfer moves (SGLang's MHA pools are token-major, NHD)."""

SLOT_STATES = frozenset({"mamba", "request_row"})
KV_PAGED_STATES = frozenset({"dsa", "qsa_compressed", "minimax_dense_kv", "block_scale"})


@dataclass(frozen=True, slots=True)
class Heads:
    """One rank's share of the KV heads: ``total`` heads, ``rank`` of them from ``first``,
    ``head_bytes`` per head and token (head_dim x dtype)."""

    total: int
    rank: int
    first: int
    head_bytes: int

    @staticmethod
    def of_rank(total: int, rank_heads: int, head_bytes: int, tp_rank: int, tp_size: int) -> Heads:
        """SGLang's split: contiguous shares, or (fewer heads than ranks) each head replicated
        on ``tp_size / total`` consecutive ranks."""
        if rank_heads * tp_size >= total:
            first = (tp_rank * total // tp_size) if total < tp_size else tp_rank * rank_heads
        else:
            raise ConfigError(f"{rank_heads} KV heads per rank x TP {tp_size} < {total} heads")
        return Heads(total, rank_heads, min(first, total - rank_heads), head_bytes)


def state_name(i: int, state_type: Any) -> str:
    return f"state{i}_{getattr(state_type, 'value', state_type)}"


def _bufs(
    ptrs: Sequence[int], lens: Sequence[int], ids: Sequence[int], role: str
) -> tuple[BufferSpec, ...]:
    return tuple(BufferSpec(int(p), int(n), int(i), role) for p, n, i in zip(ptrs, lens, ids))


def _paged(
    name: str,
    bufs: tuple[BufferSpec, ...],
    item: int,
    page_size: int,
    location: str,
    sharding: Sharding,
    indices_from: str | None = None,
    remap: bool = False,
) -> PoolSpec:
    try:
        return PoolSpec(
            name=name,
            kind="paged",
            buffers=bufs,
            item_bytes=int(item),
            num_items=min(b.nbytes for b in bufs) // int(item),
            page_size=page_size,
            location=location,
            sharding=sharding,
            indices_from=indices_from,
            page_remap=remap,
        )
    except ValueError as e:
        raise ConfigError(f"SGLang pool {name!r}: {e}") from None


def _kv_pools(
    ptrs: Sequence[int],
    lens: Sequence[int],
    items: Sequence[int],
    ids: Sequence[int],
    n_draft: int,
    is_mla: bool,
    page_size: int,
    heads: Heads | None,
    location: str,
    remap: bool,
    name: str = KV,
) -> list[PoolSpec]:
    out: list[PoolSpec] = []
    n = len(ptrs)
    groups = [(name, 0, n - n_draft, None)] + ([(DRAFT, n - n_draft, n, KV)] if n_draft else [])
    for name, a, b, follows in groups:
        p, ln, it, li = ptrs[a:b], lens[a:b], items[a:b], ids[a:b]
        if len(set(it)) != 1:
            raise ConfigError(f"SGLang pool {name!r}: buffers of different page sizes {set(it)}")
        item = it[0]
        if is_mla:
            out.append(
                _paged(
                    name,
                    _bufs(p, ln, li, "latent"),
                    item,
                    page_size,
                    location,
                    Sharding(),
                    follows,
                    remap,
                )
            )
            continue
        if len(p) % 2:
            raise ConfigError(f"SGLang MHA pool {name!r}: {len(p)} buffers, not K and V halves")
        if heads is None:
            raise ConfigError(f"SGLang MHA pool {name!r}: KV head geometry unknown")
        half = len(p) // 2
        token = item // page_size
        if token % heads.head_bytes:
            raise ConfigError(
                f"SGLang MHA pool {name!r}: {token} bytes per token is not whole "
                f"heads of {heads.head_bytes} bytes"
            )
        rank_heads = token // heads.head_bytes
        # a draft model may have its own head count: scale the target's split to it
        scale = rank_heads / heads.rank
        total = max(rank_heads, round(heads.total * scale))
        first = min(round(heads.first * scale), total - rank_heads)
        sh = Sharding(
            kind="heads",
            total_heads=total,
            rank_heads=rank_heads,
            first_head=first,
            head_bytes=heads.head_bytes,
            layout="NHD",
        )
        bufs = _bufs(p[:half], ln[:half], li[:half], "k") + _bufs(
            p[half:], ln[half:], li[half:], "v"
        )
        out.append(_paged(name, bufs, item, page_size, location, sh, follows, remap))
    return out


def layer_ids(args: Any) -> list[int]:
    """A pdxfer layer id per KV buffer: SGLang's ``kv_layer_ids`` when it gives them, else
    positional (MHA: K and V halves share ids), offset by the PP stage's first layer; draft
    buffers get ids of their own."""
    n = len(args.kv_data_ptrs)
    n_draft = int(getattr(args, "num_draft_entries", 0) or 0)
    given = list(getattr(args, "kv_layer_ids", None) or [])
    if len(given) == n:
        return [int(i) + (DRAFT_LAYER_BASE if j >= n - n_draft else 0) for j, i in enumerate(given)]
    start = int(getattr(args, "prefill_start_layer", 0) or 0)
    return [
        (DRAFT_LAYER_BASE + (j - (n - n_draft))) if j >= n - n_draft else start + j
        for j in range(n)
    ]


def _positional_mha_ids(args: Any, ids: list[int], is_mla: bool) -> list[int]:
    """MHA buffers without SGLang ids are [K layers, V layers]: V's ids repeat K's."""
    if is_mla or len(getattr(args, "kv_layer_ids", None) or []) == len(ids):
        return ids
    n = len(ids)
    n_draft = int(getattr(args, "num_draft_entries", 0) or 0)
    out = list(ids)
    for a, b in ((0, n - n_draft), (n - n_draft, n)):
        half = (b - a) // 2
        out[a + half : b] = out[a : a + half]
    return out


def pools_of(
    args: Any,
    *,
    is_mla: bool,
    heads: Heads | None,
    location: str = "cpu",
    kv_page_size: int | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> list[PoolSpec]:
    """Every pool of one rank. ``kv_page_size``: tokens per KV item when it is not SGLang's
    ``page_size`` (a decode landing on a host pool of its own page size, as HiSparse does):
    the KV is then mapped token by token (``page_remap``). The mapping:

    - ``kv_data_*``: the target KV. MHA (``is_mla`` False): K buffers of every layer, then V
      buffers, each item one page of ``page_size`` tokens, token-major (SGLang's MHA pools are
      ``[tokens, heads, head_dim]``: NHD), sharded by heads over attention TP. MLA: one latent
      buffer per layer, replicated. The last ``num_draft_entries`` buffers are the draft model's
      KV: pool ``draft_kv`` with ``indices_from="kv"`` (SGLang gives draft KV the target's page
      ids).
    - ``aux_data_*``: the metadata rows (first token, logprobs, ...): slot pool ``aux``, one
      buffer per row array.
    - ``state_*`` of type ``swa`` (SGLang's ``SWAKVPool``: the sliding-window layers' own
      KV, K layers then V, addressed by window-translated page ids): pool ``swa``, laid out
      and sharded as the target KV, with its own page indices (it moves in a room of its
      own, ``window.py``).
    - other ``state_*``, per ``state_types`` entry, named ``state<i>_<type>``: request-scoped states
      (``mamba``, ``request_row``: one row per request) are slot pools; states SGLang indexes
      with the KV's own page ids (``dsa``, ``qsa_compressed``, ``minimax_dense_kv``,
      ``block_scale``: its prefill and decode both pass ``req_to_token`` pages) are paged pools
      following ``kv``, so they move exactly the KV's token range. Other window-indexed states
      (SWA rings, DSA tails, the SWA pool's block scales) are refused. A ``mamba`` state's
      tensors are split over attention TP (``tp_rank`` of ``tp_size``) into pieces as its
      ``KVArgs`` describe them (``state_pieces``), so a decode of another TP size takes its
      share.
    - A decode whose KV buffers hold fewer tokens per item than ``page_size`` (HiSparse: the
      transfer lands in a host pool of its own page size) gets a ``page_remap`` KV pool, mapped
      token by token from any prefill page size.
    """
    ids = _positional_mha_ids(args, layer_ids(args), is_mla)
    n_draft = int(getattr(args, "num_draft_entries", 0) or 0)
    page_size = int(args.page_size)
    kv_ps = int(kv_page_size or page_size)
    pools = _kv_pools(
        args.kv_data_ptrs,
        args.kv_data_lens,
        args.kv_item_lens,
        ids,
        n_draft,
        is_mla,
        kv_ps,
        heads,
        location,
        kv_ps != page_size,
    )
    aux = list(zip(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens))
    if aux:
        if len({it for _, _, it in aux}) == 1:
            item = aux[0][2]
            pools.append(
                PoolSpec(
                    name=AUX,
                    kind="slot",
                    buffers=tuple(
                        BufferSpec(int(p), int(n), 0, f"row{j}") for j, (p, n, _) in enumerate(aux)
                    ),
                    item_bytes=int(item),
                    num_items=min(n for _, n, _ in aux) // int(item),
                )
            )
        else:  # rows of different widths: one pool per row array, paired by position
            for j, (p, n, it) in enumerate(aux):
                pools.append(
                    PoolSpec(
                        name=f"{AUX}{j}",
                        kind="slot",
                        buffers=(BufferSpec(int(p), int(n), 0, "row"),),
                        item_bytes=int(it),
                        num_items=int(n) // int(it),
                    )
                )
    pools += _state_pools(args, page_size, location, is_mla, heads, tp_rank, tp_size)
    return pools


def swa_state(args: Any) -> int | None:
    """The position of SGLang's ``swa`` state in ``state_types`` (at most one), or None."""
    found = [
        i
        for i, st in enumerate(getattr(args, "state_types", None) or [])
        if getattr(st, "value", st) == SWA_STATE
    ]
    if len(found) > 1:
        raise ConfigError(f"SGLang KVArgs name {len(found)} SWA states; pdxfer moves one")
    return found[0] if found else None


def _swa_pool(
    args: Any, i: int, page_size: int, location: str, is_mla: bool, heads: Heads | None
) -> PoolSpec:
    """SGLang's SWA sub-pool (``SWAKVPool.get_state_buf_infos``: its own K and V buffers per
    sliding layer, or one latent per layer for MLA) as pool ``swa``."""
    layout = getattr(args, "swa_kv_cache_layout", None)
    if layout not in SWA_LAYOUTS:
        raise ConfigError(
            f"SGLang SWA pool layout {layout!r}: pdxfer moves NHD (token-major) SWA pools only"
        )
    ptrs = [int(x) for x in args.state_data_ptrs[i]]
    lens = [int(x) for x in args.state_data_lens[i]]
    items = [int(x) for x in args.state_item_lens[i]]
    if not ptrs or len(set(items)) != 1:
        raise ConfigError(
            f"SGLang SWA state of {len(ptrs)} entries of sizes {sorted(set(items))}: "
            "pdxfer moves an SWA pool of KV buffers of one page size (not "
            "DeepSeek-V4's mixed SWA state)"
        )
    n = len(ptrs)
    ids = [SWA_LAYER_BASE + (j if is_mla else j % (n // 2 or 1)) for j in range(n)]
    return _kv_pools(
        ptrs, lens, items, ids, 0, is_mla, page_size, heads, location, False, name=SWA
    )[0]


def _state_pools(
    args: Any,
    page_size: int,
    location: str,
    is_mla: bool,
    heads: Heads | None,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> list[PoolSpec]:
    out: list[PoolSpec] = []
    types = list(getattr(args, "state_types", None) or [])
    swa = swa_state(args)
    for i, st in enumerate(types):
        kind = getattr(st, "value", st)
        name = state_name(i, st)
        if i == swa:
            out.append(_swa_pool(args, i, page_size, location, is_mla, heads))
            continue
        ptrs = list(args.state_data_ptrs[i])
        lens = list(args.state_data_lens[i])
        items = list(args.state_item_lens[i])
        ids_given = list((getattr(args, "state_layer_ids", None) or [[]] * len(types))[i] or [])
        ids = ids_given if len(ids_given) == len(ptrs) else list(range(len(ptrs)))
        if kind in SLOT_STATES:
            split = state_pieces(args, i, tp_rank, tp_size) if kind == "mamba" else None
            for j, (p, n, it) in enumerate(zip(ptrs, lens, items)):
                # tensors of one state may differ in row size (conv vs ssm): one pool each
                pieces = split[j] if split else ()
                try:
                    out.append(
                        PoolSpec(
                            name=f"{name}.{j}",
                            kind="slot",
                            buffers=(BufferSpec(int(p), int(n), int(ids[j]), "row"),),
                            item_bytes=int(it),
                            num_items=int(n) // int(it),
                            location=location,
                            sharding=Sharding.sliced(pieces) if pieces else Sharding(),
                        )
                    )
                except (ValueError, ConfigError) as e:
                    raise ConfigError(f"SGLang state {name}.{j}: {e}") from None
        elif kind in KV_PAGED_STATES:
            for item in sorted(set(items)):
                sel = [j for j, it in enumerate(items) if it == item]
                out.append(
                    _paged(
                        f"{name}.{item}",
                        _bufs(
                            [ptrs[j] for j in sel],
                            [lens[j] for j in sel],
                            [ids[j] for j in sel],
                            "state",
                        ),
                        item,
                        page_size,
                        location,
                        Sharding(),
                        KV,
                    )
                )
        else:
            raise ConfigError(
                f"SGLang state {kind!r} (state_types[{i}]) is indexed by a window or ring of "
                "its own: the pdxfer backend does not move it yet (it moves SGLang's SWA pool, "
                "state 'swa')"
            )
    return out


def state_pieces(args: Any, i: int, tp_rank: int, tp_size: int) -> list[tuple[Piece, ...]] | None:
    """How each tensor of ``state_types[i]`` splits over attention TP, from what SGLang's
    ``KVArgs`` say of it (as its own Mooncake backend reads them): ``state_dim_per_tensor``
    (the rank's length of the sliced axis; 0: replicated, moved whole), the rows before that
    axis (``state_slice_outer_counts``), and the conv state's sub-blocks, each split on its
    own (``state_conv_shard_groups``: GDN's Q, K, V). None (the state moves whole, between
    equal TP sizes only) when SGLang gives no dims, or no sub-blocks for any tensor: Mamba2's
    conv state is x | B | C per rank, which SGLang's KVArgs do not describe, so one
    contiguous slice of it would be wrong."""

    def at(key: str) -> list[Any]:
        v = list(getattr(args, key, None) or [])
        return list(v[i] or []) if i < len(v) else []

    n = len(args.state_data_ptrs[i])
    dims, outer, groups = (
        at("state_dim_per_tensor"),
        at("state_slice_outer_counts"),
        at("state_conv_shard_groups"),
    )
    if len(dims) != n or not any(groups):
        return None
    outer = outer if len(outer) == n else [1] * n
    groups = groups if len(groups) == n else [None] * n
    out: list[tuple[Piece, ...]] = []
    for dim, rows, subs, item in zip(dims, outer, groups, args.state_item_lens[i]):
        dim, rows, item = int(dim), int(rows or 1), int(item)
        if dim == 0:
            out.append(())
            continue
        if item % (dim * rows):
            return None
        unit = item // (dim * rows)
        full = [int(g) for g in subs] if subs else [dim * tp_size]
        if sum(full) != dim * tp_size or any(g % tp_size for g in full):
            return None
        ps, start = [], 0
        for g in full:
            local = g // tp_size
            ps.append(
                Piece(
                    offset=start * unit,
                    total=g,
                    rank_units=local,
                    first=tp_rank * local,
                    unit_bytes=unit,
                    rows=rows,
                    row_stride=dim * unit if rows > 1 else 0,
                )
            )
            start += local
        out.append(tuple(ps))
    return out


def state_slots(args: Any, state_indices: Sequence[Any] | None) -> dict[str, int]:
    """The slot of each slot-kind state pool in SGLang's ``state_indices`` (one entry per
    ``state_types`` entry: an index array, or a list holding one). Paged states follow the
    KV's pages and need nothing here."""
    out: dict[str, int] = {}
    types = list(getattr(args, "state_types", None) or [])
    if not state_indices:
        return out
    for i, st in enumerate(types):
        if getattr(st, "value", st) not in SLOT_STATES or i >= len(state_indices):
            continue
        idx = state_indices[i]
        while isinstance(idx, (list, tuple)) and len(idx) == 1:
            idx = idx[0]
        flat = [int(x) for x in _flat(idx)]
        if len(flat) != 1:
            raise ConfigError(
                f"SGLang state {state_name(i, st)!r}: expected one slot per "
                f"request, got {len(flat)}"
            )
        for j in range(len(args.state_data_ptrs[i])):
            out[f"{state_name(i, st)}.{j}"] = flat[0]
    return out


def _flat(x: Any) -> list[Any]:
    if hasattr(x, "reshape"):
        return list(x.reshape(-1).tolist())
    if isinstance(x, (list, tuple)):
        return [y for v in x for y in _flat(v)]
    return [x]


def aux_slots(pools: Sequence[PoolSpec], aux_index: int | None) -> dict[str, int]:
    if aux_index is None:
        return {}
    return {p.name: int(aux_index) for p in pools if p.kind == "slot" and p.name.startswith(AUX)}


def anchors(pools: Sequence[PoolSpec]) -> list[str]:
    """Pools that take page indices in ``send()``/``request()``: paged pools with own ids."""
    return [p.name for p in pools if p.kind == "paged" and p.indices_from is None]
