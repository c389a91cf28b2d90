"""One worker rank's KV caches as pdxfer sees them: its pools, its endpoint, its layers.

``register`` describes vLLM's cache tensors as pools (``layout.py``, no copy; one per KV cache
group for a hybrid model, ``groups.py``) and starts the rank's ``Endpoint``. What it returns,
``RankKV``, is what the sender (``sender.py``), the loader (``loader.py``) and the decode
tiers (``decode_tiers.py``) share; each gets it through its constructor.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdxfer import Endpoint, PoolSpec

from . import groups as G
from .config import ConnectorConfig
from .groups import Group, Part
from .layout import Interior, Layout, describe, describe_state, layer_order

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RankInfo:
    tp_rank: int
    tp_size: int
    block_size: int
    total_kv_heads: int
    cache_dtype: str = "auto"
    """vLLM's ``--kv-cache-dtype``: both sides of a pair must agree (``fp8`` against
    ``auto`` is refused when they pair, naming both)."""
    draft: str = "none"
    """The drafter whose KV moves beside the target's (``spec.draft_id``): both sides of a
    pair must agree (refused when they pair, naming both)."""


@dataclass(frozen=True)
class RankKV:
    """What a rank's roles share, fixed at registration."""

    cfg: ConnectorConfig
    rank: RankInfo
    groups: tuple[Group, ...]
    parts: tuple[Part, ...]
    """The request's rooms (``groups.Part``): one for a plain model."""
    ep: Endpoint
    layout: Layout
    pools: Mapping[str, PoolSpec]
    """The registered pools by name (one per group)."""
    fingerprint: str
    """What both sides of a pair must agree on (model, layout, dtypes); with the block sizes,
    the tiers' model id."""
    layer_of: Mapping[str, int]
    """vLLM's layer name -> its layer id in the pool (``layout.layer_order``); a hybrid
    model's streamed layers only, none where their ids collide."""
    layer_ids: tuple[int, ...]
    """The layer ids a step hands over one by one (``send_by: layer``), in order."""
    partial_blocks: bool
    """Whether a block filled in part can be sent for its tokens (a block's interior is
    addressable by token on a device; vLLM's CPU tiles are packed per ISA)."""

    @property
    def hybrid(self) -> bool:
        """Several KV cache groups that do not all stream (``groups.streams``)."""
        return not G.streams(self.groups)


def register(
    cfg: ConnectorConfig,
    rank: RankInfo,
    groups: tuple[Group, ...],
    kv_caches: dict[str, Any],
    transport: Any = None,
    interior: Interior | None = None,
) -> RankKV:
    """Describe ``kv_caches`` as pools and start this rank's endpoint on them (``interior``:
    how the kernel lays a block out by token, ``tiles.interior``; with it, a peer of another
    block size maps blocks token by token)."""
    if not G.streams(groups):
        return _register_groups(cfg, rank, groups, kv_caches, transport, interior)
    g0 = groups[0]
    lay = describe(
        kv_caches,
        block_size=rank.block_size,
        total_kv_heads=rank.total_kv_heads,
        tp_rank=rank.tp_rank,
        tp_size=rank.tp_size,
        latent=g0.mla,
        interior=interior,
    )
    layer_of = {n: i for i, n in layer_order(list(kv_caches))}
    # a block's interior is addressable by token on a device (plain NHD/HND tiles); vLLM's
    # CPU backend packs each (block, head) tile per ISA, so a block moves whole there
    partial = lay.kind in ("HND", "NHD", "latent") and not lay.pool.location.startswith("cpu")
    ident = cfg.model_id.replace(" ", "_")
    # no block size: the pools' page sizes carry it, and the planner maps blocks of
    # different sizes (the decode's tier keys add it: ``decode_tiers``)
    fingerprint = (
        f"model={ident} kv_layout={lay.kind} dtype={lay.pool.dtype} "
        f"cache_dtype={rank.cache_dtype} draft={rank.draft}"
    )
    ep = Endpoint(
        cfg.endpoint_config(rank.tp_rank, rank.tp_size, fingerprint),
        [lay.pool],
        transport=transport,
    )
    return RankKV(
        cfg,
        rank,
        groups,
        G.parts(groups),
        ep,
        lay,
        {lay.pool.name: lay.pool},
        fingerprint,
        layer_of,
        tuple(sorted(set(layer_of.values()))),
        partial,
    )


def _register_groups(
    cfg: ConnectorConfig,
    rank: RankInfo,
    groups: tuple[Group, ...],
    kv_caches: dict[str, Any],
    transport: Any,
    interior: Interior | None,
) -> RankKV:
    """A hybrid model: one pool per group (``groups.py``), each from its own layers'
    tensors (groups overlay one allocation; pdxfer registers each region once)."""
    pools, kinds = [], []
    for g in groups:
        mine = {n: kv_caches[n] for n in g.layers}
        if g.kind == "state":
            first = next(iter(mine.values()))
            t = first[0] if isinstance(first, (list, tuple)) else first
            pool = describe_state(
                mine,
                name=g.pool,
                num_blocks=int(t.shape[0]),
                page_bytes=g.page_bytes,
                split=g.split,
                tp_rank=rank.tp_rank,
                tp_size=rank.tp_size,
            )
            kind = "state"
        else:
            lay = describe(
                mine,
                block_size=g.block_size,
                total_kv_heads=rank.total_kv_heads,
                tp_rank=rank.tp_rank,
                tp_size=rank.tp_size,
                name=g.pool,
                latent=g.mla,
                interior=interior,
            )
            pool, kind = lay.pool, lay.kind
        pools.append(pool)
        span = g.window or g.chunk
        # no block size: a state's (its checkpoint interval) changes no byte of its slot
        # (the slot sizes are compared), an attention group's the planner maps
        kinds.append(f"{g.pool}={g.kind}:{span}:{kind}:{pool.dtype}")
    layout = Layout(pools[0], "hybrid", sum(p.item_bytes * len(p.buffers) for p in pools))
    layer_of = _stream_layers(groups)
    ident = cfg.model_id.replace(" ", "_")
    fingerprint = (
        f"model={ident} groups={','.join(kinds)} cache_dtype={rank.cache_dtype} draft={rank.draft}"
    ) + G.whole_state_tp(groups, rank.tp_size)
    ep = Endpoint(
        cfg.endpoint_config(rank.tp_rank, rank.tp_size, fingerprint),
        pools,
        transport=transport,
    )
    return RankKV(
        cfg,
        rank,
        groups,
        G.parts(groups),
        ep,
        layout,
        {g.pool: p for g, p in zip(groups, pools)},
        fingerprint,
        layer_of,
        tuple(sorted(layer_of.values())),
        False,
    )


def _stream_layers(groups: tuple[Group, ...]) -> dict[str, int]:
    """A hybrid model's layers that stream (``send_by: layer``): those of its full and
    window groups, each layer id naming one pool. Where ids collide across pools
    (layer names without one number), nothing streams: each request goes at its end."""
    of: dict[str, int] = {}
    for g in groups:
        if g.kind != "state":
            of.update({n: i for i, n in layer_order(list(g.layers))})
    if len(set(of.values())) != len(of):
        log.info(
            "pdxfer: layer ids of this model's groups collide; hybrid requests are "
            "sent at their end, not layer by layer"
        )
        return {}
    return of
