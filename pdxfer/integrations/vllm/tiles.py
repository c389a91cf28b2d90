"""How vLLM's CPU attention kernel packs a block: learned by writing through it, as pages of
any size (``PageSegment``s), so a prefill and a decode with different ``--block-size`` map
blocks token by token.

vLLM's CPU backend keeps each (block, head) of a layer as one tile: keys then values, each
packed per ISA (``vec``: keys dimension-major, values token-major; ``amx``: keys in 16-token
units, values in 16-dimension columns of token pairs). pdxfer never assumes one: each layer's
own kernel (``impl.do_kv_cache_update``) writes bit patterns that name every (token, head,
dimension) into scratch blocks of two block sizes, and ``fit`` finds rows of units that
explain every element at both sizes. A layout it cannot explain is opaque: its blocks move
whole, between equal block sizes only (the pairing says so, naming both sizes). An MLA
layer's latent cache is probed the same way, through its own write: one row per token (vLLM's
reference ``CPU_MLA`` and the ``AMX_MLA`` backend alike) maps token by token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from pdxfer import PageSegment

from .layout import Interior

log = logging.getLogger(__name__)

Writer = Callable[[Any, Any, Any, Any], None]
"""``(key, value, kv_cache, slot_mapping)``: a layer's own cache write."""


def fit(offsets: np.ndarray, n: int, dim: int) -> tuple[int, int, int] | None:
    """``(rows, tokens, elements)`` such that element ``(t, d)`` of a region of ``n`` tokens
    by ``dim`` sits at ``offsets[t, d]`` as rows one after the other of ``n / tokens`` units
    of ``elements``, the same row and place inside its unit for every unit (fewest tokens a
    unit, then fewest rows; at worst one unit of the whole block); None when ``offsets``
    are not each element once."""
    if offsets.shape != (n, dim) or np.unique(offsets).size != n * dim:
        return None
    if offsets.min() != 0 or offsets.max() != n * dim - 1:
        return None
    t = np.arange(n)[:, None]
    for u in (x for x in range(1, n + 1) if n % x == 0):
        for rows in (r for r in range(1, u * dim + 1) if (u * dim) % r == 0):
            unit = u * dim // rows
            row_len = n // u * unit
            r, rest = np.divmod(offsets, row_len)
            g, w = np.divmod(rest, unit)
            if not (g == t // u).all():
                continue
            first = np.arange(n) % u
            if (r == r[first]).all() and (w == w[first]).all():
                return rows, u, unit
    return None


def _written(write: Writer, like: Any, n: int, heads: int, dim: int) -> dict[str, np.ndarray]:
    """Element offsets of keys and values, ``[n, heads, dim]`` each, inside one block of
    ``n`` tokens shaped like ``like`` (``[blocks, heads, n, 2 * dim]``): every (token, head,
    dimension) is named by bit planes (ones where the bit is set), one write a plane."""
    import torch

    cache = torch.zeros((1, heads, n, like.shape[-1]), dtype=like.dtype, device=like.device)
    slots = torch.arange(n, dtype=torch.int64)
    t = torch.arange(n)[:, None, None].expand(n, heads, dim)
    h = torch.arange(heads)[None, :, None].expand(n, heads, dim)
    d = torch.arange(dim)[None, None, :].expand(n, heads, dim)
    code = (t * heads + h) * dim + d
    bits = max(1, int(code.max()).bit_length())
    zero = torch.zeros((n, heads, dim), dtype=torch.float32)
    out: dict[str, np.ndarray] = {}
    for side in ("k", "v"):
        planes = [torch.ones_like(zero)] + [((code >> b) & 1).float() for b in range(bits)]
        seen = []
        for p in planes:
            cache.zero_()
            kv = (p, zero) if side == "k" else (zero, p)
            write(kv[0], kv[1], cache, slots)
            seen.append(cache.reshape(-1).view(torch.uint8).reshape(cache.numel(), -1).any(1))
        where = torch.nonzero(seen[0]).reshape(-1)
        got = torch.zeros_like(where)
        for b, s in enumerate(seen[1:]):
            got |= s[where].long() << b
        if where.numel() != n * heads * dim:
            raise ValueError(f"{side}: {where.numel()} elements written for {n * heads * dim}")
        pos = torch.full((n * heads * dim,), -1, dtype=torch.int64)
        pos[got] = where
        out[side] = pos.reshape(n, heads, dim).numpy()
    return out


def segments(
    write: Writer, like: Any, block_size: int, heads: int, elt: int
) -> tuple[PageSegment, ...] | None:
    """One head's tile of a ``like``-shaped cache (``[blocks, heads, block_size, 2 * dim]``)
    as segments (keys, then values), checked at ``block_size`` and twice it; None when the
    kernel's packing is not such a layout."""
    dim = like.shape[-1] // 2
    probe = min(heads, 2)
    found: list[tuple[PageSegment, ...]] = []
    for n in (block_size, 2 * block_size):
        pos = _written(write, like, n, probe, dim)
        segs = []
        for side, base in (("k", 0), ("v", n * dim)):
            for h in range(probe):
                rel = pos[side][:, h, :] - h * n * 2 * dim - base
                got = fit(rel, n, dim)
                if got is None:
                    return None
                if h == 0:
                    rows, u, unit = got
                    segs.append(PageSegment(rows, u, unit * elt))
                elif PageSegment(got[0], got[1], got[2] * elt) != segs[-1]:
                    return None
        found.append(tuple(segs))
    return found[0] if found[0] == found[1] else None


def layer_writer(layer: Any, dtype: Any) -> Writer | None:
    """vLLM's CPU attention layer's own cache write (keys and values in the model's
    ``dtype``), or None where the layer is not one (another backend: its blocks stay
    opaque)."""
    impl = getattr(layer, "impl", None)
    backend = getattr(layer, "attn_backend", None)
    name = backend.get_name() if backend is not None else ""
    if impl is None or name != "CPU_ATTN" or not hasattr(impl, "do_kv_cache_update"):
        return None

    def write(key: Any, value: Any, cache: Any, slots: Any) -> None:
        impl.do_kv_cache_update(layer, key.to(dtype), value.to(dtype), cache, slots)

    return write


def probe(
    layers: dict[str, Any], name: str, like: Any, block_size: int, dtype: Any
) -> tuple[PageSegment, ...]:
    """The segments of layer ``name``'s tiles (``like``: its cache tensor; ``dtype``: the
    model's), or ``()`` (opaque) where its kernel cannot be probed or packs otherwise;
    logged either way."""
    write = layer_writer(layers.get(name), dtype)
    if write is None:
        log.info("pdxfer: %s is not vLLM's CPU attention: its blocks move whole", name)
        return ()
    heads, elt = int(like.shape[1]), like.element_size()
    try:
        segs = segments(write, like, block_size, heads, elt)
    except Exception as e:  # noqa: BLE001 - any failure leaves the blocks opaque
        log.info("pdxfer: cannot probe %s's block layout (%s): its blocks move whole", name, e)
        return ()
    if segs is None:
        log.info("pdxfer: %s packs its blocks in no layout pdxfer maps: they move whole", name)
        return ()
    log.info(
        "pdxfer: %s's blocks, per head: %s",
        name,
        ", ".join(f"{g.rows} rows of {g.tokens}-token units of {g.nbytes} B" for g in segs),
    )
    return segs


def latent_rows(layer: Any, like: Any) -> bool:
    """Whether an MLA layer's own cache write (``impl.do_kv_cache_update``) puts token
    ``slot``'s latent (``kv_c`` then ``k_pe``) in row ``slot`` of its cache viewed as
    ``[rows, head_size]``, nothing else written: learned by writing distinct rows into every
    slot of two scratch blocks shaped like ``like``, in a shuffled order. False (opaque)
    where the layer has no such write, its sizes do not add up, or it writes otherwise."""
    import torch

    impl = getattr(layer, "impl", None)
    lora = getattr(impl, "kv_lora_rank", getattr(layer, "kv_lora_rank", None))
    rope = getattr(impl, "qk_rope_head_dim", getattr(layer, "qk_rope_head_dim", None))
    if impl is None or not hasattr(impl, "do_kv_cache_update") or lora is None or rope is None:
        return False
    n, width = int(like.shape[1]), int(like.shape[-1])
    if like.dim() != 3 or lora + rope != width or not like.dtype.is_floating_point:
        return False
    rows = 2 * n
    # small integers, exact in any float dtype; row i's differ from every other row's
    vals = (torch.arange(rows)[:, None] * 7 + torch.arange(width)[None, :]) % 251 - 125
    vals = vals.to(like.dtype)
    slots = torch.from_numpy(np.random.default_rng(rows).permutation(rows))
    scratch = torch.zeros((2, n, width), dtype=like.dtype)
    try:
        impl.do_kv_cache_update(
            vals[:, :lora].clone(),
            vals[:, lora:].reshape(rows, 1, rope).clone(),
            scratch,
            slots,
            "auto",
            torch.ones((), dtype=torch.float32),
        )
    except Exception as e:  # noqa: BLE001 - any failure leaves the blocks opaque
        log.info("pdxfer: cannot probe the MLA cache write (%s): its blocks move whole", e)
        return False
    flat = scratch.reshape(rows, width)
    return bool(torch.equal(flat[slots], vals))


def interior(layers: dict[str, Any], dtype: Any) -> Interior:
    """``layout.describe``'s ``interior`` for a worker whose attention layers are ``layers``
    (vLLM's ``static_forward_context``): a device's blocks are what their strides say; on
    CPU, attention tiles are probed (``probe``) and so is an MLA latent (``latent_rows``)."""

    def of(name: str, like: Any, latent: bool) -> tuple[PageSegment, ...] | None:
        if like.device.type != "cpu":
            return None
        if latent:
            plain = latent_rows(layers.get(name), like)
            if not plain:
                log.info(
                    "pdxfer: %s's MLA cache is not one row per token: its blocks move whole", name
                )
            return None if plain else ()
        return probe(layers, name, like, int(like.shape[2]), dtype)

    return of
