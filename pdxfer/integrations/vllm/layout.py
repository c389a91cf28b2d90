"""vLLM's KV cache tensors -> pdxfer ``PoolSpec``s, without a copy.

vLLM hands each attention layer's cache as a logical ``[B, H, N, C]`` tensor (blocks, KV
heads, tokens of a block, content; ``[2, B, N, H, D]`` is two of them) in one of several
memory orders. The layout is read from strides and data pointers, never assumed:
- each layer's block one contiguous span: one buffer per layer, one page per block;
  ``[H, N, C]`` inside is ``HND``, ``[N, H, C]`` ``NHD`` (head slices for different TP);
  vLLM's CPU tiles are packed per ISA: whole tiles move between equal block sizes, and
  between different ones unit by unit, as the kernel's packing (``tiles.py``) says;
- every layer of a block together: one buffer, one page per block, opaque (TP 1);
- anything else is refused with the reason.
MLA is one latent per token (``latent``), replicated over TP; Mamba-like state is one page
per block moved as a slot, split into TP-sharded pieces where its kind is known
(``describe_state``, ``state.py``). Block 0, vLLM's null block, is read only as the
filler of window tokens no decode reads (``groups.source_pages``), never written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdxfer import BufferSpec, ConfigError, PageSegment, PoolSpec, Sharding

from .state import TensorSplit, pieces

POOL = "kv"

log = logging.getLogger(__name__)

Interior = Callable[[str, Any, bool], "tuple[PageSegment, ...] | None"]
"""``(layer name, its cache tensor, latent)``: how the kernel lays a block out by token
(``tiles.py``), None where the strides say it all (plain tiles on a device), ``()`` where it
is unknown (blocks then move whole, between equal block sizes only)."""


@dataclass(frozen=True, slots=True)
class Layout:
    """What ``describe`` found (named in logs and in the pairing fingerprint)."""

    pool: PoolSpec
    kind: str
    """``HND``, ``NHD`` (heads addressable), ``opaque-layer`` or ``opaque-blocks``."""
    block_bytes: int
    """Bytes of one block over every layer: what one block costs to move."""


def layer_order(names: Sequence[str]) -> list[tuple[int, str]]:
    """(global layer index, name) in layer order: the number in the module path
    (``model.layers.7.self_attn.attn`` -> 7), else the position."""
    out = []
    for i, n in enumerate(names):
        nums = [int(p) for p in n.split(".") if p.isdigit()]
        out.append((nums[0] if len(nums) == 1 else i, n))
    if len({i for i, _ in out}) != len(out):
        out = list(enumerate(names))
    return sorted(out)


def _dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether dims with these sizes and strides tile a region with no gap or overlap."""
    expect = 1
    for size, st in sorted(zip(shape, stride), key=lambda x: x[1]):
        if size == 1:
            continue
        if st != expect:
            return False
        expect *= size
    return True


def _heads(total: int, rank_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(total heads, first head of this rank); GQA replication when heads < TP size."""
    if total >= tp_size:
        if rank_heads * tp_size != total:
            raise ConfigError(
                f"{total} KV heads over TP {tp_size}: this rank holds "
                f"{rank_heads}, expected {total // tp_size}"
            )
        return total, tp_rank * rank_heads
    return total, tp_rank * total // tp_size


def describe(
    kv_caches: Mapping[str, Any],
    *,
    block_size: int,
    total_kv_heads: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    name: str = POOL,
    latent: bool = False,
    interior: Interior | None = None,
) -> Layout:
    """The pool for vLLM's ``register_kv_caches`` tensors (see the module docstring).
    ``latent``: MLA, one latent per token replicated on every TP rank (never head slices,
    whatever the model config says of its heads). ``interior``: how a block is laid out by
    token, for a peer of another block size (without it, blocks move whole only)."""
    if not kv_caches:
        raise ConfigError("vLLM registered no KV cache tensors")
    order = layer_order(list(kv_caches))
    ts = [kv_caches[n] for _, n in order]
    ids = [i for i, _ in order]
    roles = ["kv"] * len(ts)
    if ts[0].dim() == 5 and ts[0].shape[0] == 2:
        # K and V apart, [2, B, N, H, D] (older vLLM and some GPU backends): each half is a
        # [B, H, N, D] view with its own buffer per layer
        ts = [t[j].permute(0, 2, 1, 3) for t in ts for j in (0, 1)]
        ids = [i for i in ids for _ in (0, 1)]
        roles = ["k", "v"] * (len(ts) // 2)
    t0 = ts[0]
    for t in ts:
        if (
            tuple(t.shape) != tuple(t0.shape)
            or t.stride() != t0.stride()
            or t.dtype != t0.dtype
            or t.device != t0.device
        ):
            raise ConfigError(
                "vLLM's KV cache layers differ in shape, stride, dtype or device: "
                "pdxfer needs one layout for all layers (hybrid models: set "
                "--disable-hybrid-kv-cache-manager)"
            )
    if t0.dim() == 3:  # [B, N, C]: one latent per token (MLA)
        shape, stride = (t0.shape[0], 1, *t0.shape[1:]), (t0.stride(0), 0, *t0.stride()[1:])
    elif t0.dim() == 4:
        shape, stride = tuple(t0.shape), tuple(t0.stride())
    else:
        raise ConfigError(
            f"unexpected KV cache tensor shape {tuple(t0.shape)}: expected "
            "[blocks, heads, block_size, content]"
        )
    nb, h, n, c = shape
    if n != block_size:
        raise ConfigError(
            f"KV cache tensor {tuple(t0.shape)}: dim 2 is not the block size {block_size}"
        )
    elt = t0.element_size()
    inner = h * n * c
    if not _dense(shape[1:], stride[1:]):
        raise ConfigError(
            f"KV cache strides {stride} for shape {shape}: a (block, layer) is "
            "not one dense span (heads outermost across blocks?); pdxfer "
            "cannot address this layout"
        )
    location = str(t0.device)
    dtype = str(t0.dtype).removeprefix("torch.")
    bases = sorted(int(t.data_ptr()) for t in ts)
    if stride[0] == inner and _apart(bases, nb * inner * elt):
        bufs = [
            BufferSpec(int(t.data_ptr()), nb * inner * elt, i, r) for t, i, r in zip(ts, ids, roles)
        ]
        kind, sharding = (
            ("latent", Sharding())
            if latent and h == 1
            else _inner(shape, stride, elt, total_kv_heads, tp_rank, tp_size)
        )
        item = inner * elt
        per_block = item * len(ts)
    elif (
        stride[0] == inner * len(ts)
        and bases[-1] - bases[0] < stride[0] * elt
        and _apart(bases, inner * elt)
    ):
        # every layer of a block together: one span of all layers per block
        if tp_size > 1:
            raise ConfigError(
                "vLLM's KV cache keeps all layers of a block together; pdxfer "
                "moves that layout with TP 1 only"
            )
        item = stride[0] * elt
        bufs = [BufferSpec(bases[0], nb * item, 0, "blocks")]
        kind, sharding, per_block = "opaque-blocks", Sharding(), item
    elif stride[0] > inner and _apart(bases, nb * stride[0] * elt):
        # padded pages, one layer each
        if tp_size > 1:
            raise ConfigError("vLLM's KV cache pages are padded; pdxfer moves them with TP 1 only")
        item = stride[0] * elt
        bufs = [BufferSpec(int(t.data_ptr()), nb * item, i, r) for t, i, r in zip(ts, ids, roles)]
        kind, sharding, per_block = "opaque-layer", Sharding(), item * len(ts)
    else:
        raise ConfigError(
            f"KV cache layers overlap or blocks are strided ({stride[0]} "
            f"elements per block, {inner} per layer-block): unsupported layout"
        )
    if item % block_size:
        raise ConfigError(f"a block is {item} bytes, not a multiple of its {block_size} tokens")
    segments: tuple[PageSegment, ...] | None = ()
    if kind in ("HND", "NHD", "latent") and interior is not None:
        segments = interior(order[0][1], t0, kind == "latent")
    try:
        pool = PoolSpec(
            name=name,
            kind="paged",
            buffers=tuple(bufs),
            item_bytes=item,
            num_items=nb,
            page_size=block_size,
            location=location,
            dtype=dtype,
            sharding=sharding,
            page_remap=segments != (),
            segments=segments,
        )
    except ValueError as e:
        raise ConfigError(f"KV cache as a pdxfer pool: {e}") from None
    return Layout(pool, kind, per_block)


def _apart(bases: list[int], span: int) -> bool:
    """Whether regions of ``span`` bytes starting at ``bases`` (sorted) do not overlap."""
    return all(b - a >= span for a, b in zip(bases, bases[1:]))


def _inner(
    shape: Sequence[int], stride: Sequence[int], elt: int, total: int, tp_rank: int, tp_size: int
) -> tuple[str, Sharding]:
    _, h, n, c = shape
    _, sh, sn, sc = stride
    if h == 1 and sh == 0 and sc == 1 and sn == c:  # [B, N, C]: one latent per token (MLA)
        return "latent", Sharding()
    if sc == 1 and (h == 1 or sh == n * c) and sn == c:
        layout = "HND"
    elif sc == 1 and sn == h * c and (h == 1 or sh == c):
        layout = "NHD"
    else:
        if tp_size > 1:
            raise ConfigError(
                f"KV cache block interior with strides {tuple(stride)}: heads are "
                "not addressable, so TP > 1 is not supported"
            )
        return "opaque-layer", Sharding()
    total, first = _heads(total, h, tp_rank, tp_size)
    return layout, Sharding.heads(total, h, first, c * elt, layout)


def _state_offsets(ts: Sequence[Any], split: Sequence[TensorSplit], base: int) -> tuple[int, ...]:
    """Where each tensor of ``split`` starts in a layer's page: one view per state, or the
    raw page holding them back to back; ``()`` when the tensors are neither."""
    if not split:
        return ()
    sizes = [s.nbytes for s in split]
    if len(ts) == len(split) and all(
        t[0].numel() * t.element_size() == n for t, n in zip(ts, sizes)
    ):
        return tuple(int(t.data_ptr()) - base for t in ts)
    if len(ts) == 1 and ts[0][0].numel() * ts[0].element_size() == sum(sizes):
        return tuple(sum(sizes[:i]) for i in range(len(sizes)))
    return ()


def describe_state(
    states: Mapping[str, Any],
    *,
    name: str,
    num_blocks: int,
    page_bytes: int,
    split: Sequence[TensorSplit] = (),
    tp_rank: int = 0,
    tp_size: int = 1,
) -> PoolSpec:
    """A slot pool for Mamba / linear-attention layers: vLLM hands each layer's state as
    tensors (conv, SSM) viewed over one page per block, or (0.32) as the raw page, its
    states packed from byte 0 in ``MambaSpec.shapes`` order (``MambaBase.bind_kv_cache``);
    a slot is the whole page (every state of the layer, padding included). With ``split``
    (``state.splits``) the slot is also described as TP-sharded pieces, so another TP size
    can take its share; without, it moves whole, between equal TP sizes."""
    order = layer_order(list(states))
    bufs = []
    location = "cpu"
    offsets: set[tuple[int, ...]] = set()
    for lid, n in order:
        ts = states[n] if isinstance(states[n], (list, tuple)) else [states[n]]
        base = min(int(t.data_ptr()) for t in ts)
        offsets.add(_state_offsets(ts, split, base))
        for t in ts:
            step = t.stride(0) * t.element_size()
            if step != page_bytes:
                raise ConfigError(
                    f"state of layer {n}: {step} bytes between blocks, expected "
                    f"one page of {page_bytes}"
                )
            if int(t.data_ptr()) + t[0].numel() * t.element_size() > base + page_bytes:
                raise ConfigError(f"state of layer {n} does not fit one page")
        location = str(ts[0].device)
        bufs.append(BufferSpec(base, num_blocks * page_bytes, lid, "state"))
    sharding = Sharding()
    if split and len(offsets) == 1 and () not in offsets:
        sharding = Sharding.sliced(pieces(split, next(iter(offsets)), tp_rank, tp_size))
    elif split:
        first = states[order[0][1]]
        ts = first if isinstance(first, (list, tuple)) else [first]
        log.warning(
            "pdxfer: state pool %r moves whole (equal TP sizes only): its tensors %s are not "
            "the split %s",
            name,
            [(tuple(t.shape), t.stride(), str(t.dtype)) for t in ts],
            split,
        )
    try:
        return PoolSpec(
            name=name,
            kind="slot",
            buffers=tuple(bufs),
            item_bytes=page_bytes,
            num_items=num_blocks,
            location=location,
            dtype="uint8",
            sharding=sharding,
        )
    except ValueError as e:
        raise ConfigError(f"state layers as a pdxfer pool: {e}") from None
