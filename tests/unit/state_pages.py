"""Pages of a Mamba2 / Gated DeltaNet state as each TP rank holds them, from global numbers.

Every element is numbered by what it is in the whole model (sub-block, channel or head, row,
layer, slot), then laid out for one rank's share as vLLM and SGLang lay it out (the conv
state's x | B | C or Q | K | V per rank, a single B/C group replicated on every rank, ``SD``
or ``DS`` conv layout, padding after the state): a byte moved to the wrong place shows.
"""

from __future__ import annotations

import numpy as np

from pdxfer.integrations.vllm.state import TensorSplit, pieces, splits
from pdxfer.pools import Piece

SENTINEL = 0xA5

MAMBA2 = {"kind": "MAMBA2", "h": 4, "hd": 2, "n": 3, "rows": 3}
GDN = {"kind": "GDN_ATTN", "kh": 2, "kd": 3, "vh": 4, "vd": 2, "rows": 3}


def _m2_channels(h: int, hd: int, g: int, n: int, tp: int, r: int) -> list[int]:
    """The global conv channels of Mamba2 rank ``r``: its x heads, then its B and C groups
    (one group replicated on every rank when TP does not divide the group count)."""
    x = list(range(r * h * hd // tp, (r + 1) * h * hd // tp))
    gs = range(r * g // tp, (r + 1) * g // tp) if g % tp == 0 else range(g)
    b = [10_000 + k * n + j for k in gs for j in range(n)]
    return x + b + [20_000 + c - 10_000 for c in b]


def _gdn_channels(kh: int, kd: int, vh: int, vd: int, tp: int, r: int) -> list[int]:
    q = list(range(r * kh * kd // tp, (r + 1) * kh * kd // tp))
    return (
        q
        + [10_000 + c for c in q]
        + list(range(20_000 + r * vh * vd // tp, 20_000 + (r + 1) * vh * vd // tp))
    )


def page(model: dict, tp: int, r: int, layer: int, slot: int) -> tuple[bytes, int, list[int]]:
    """One rank's page for one (layer, slot): the conv state then the temporal state, as the
    engine computes them, plus the shapes it reports and the page's padded size."""
    kind, ds, length = model["kind"], model["ds"], model["rows"]
    if kind == "MAMBA2":
        h, hd, g, n = model["h"], model["hd"], model["g"], model["n"]
        ch = _m2_channels(h, hd, g, n, tp, r)
        heads, inner = range(r * h // tp, (r + 1) * h // tp), hd * n
        shapes = [(len(ch), length) if ds else (length, len(ch)), (h // tp, hd, n)]
    else:
        kh, kd, vh, vd = model["kh"], model["kd"], model["vh"], model["vd"]
        ch = _gdn_channels(kh, kd, vh, vd, tp, r)
        heads, inner = range(r * vh // tp, (r + 1) * vh // tp), vd * kd
        shapes = [(len(ch), length) if ds else (length, len(ch)), (vh // tp, vd, kd)]
    tag = (layer * 7 + slot) << 24
    conv = np.array([[tag + c * 16 + k for k in range(length)] for c in ch], dtype=np.int32)
    conv = conv if ds else conv.T.copy()
    temporal = np.array(
        [[tag + (1 << 23) + hh * 4096 + i for i in range(inner)] for hh in heads], dtype=np.int32
    )
    body = conv.tobytes() + temporal.tobytes()
    padded = -(-len(body) // 256) * 256 + 64 * tp  # pages differ in size and padding per TP
    return body + bytes([SENTINEL]) * (padded - len(body)), len(conv.tobytes()), shapes


def state_pieces(model: dict, tp: int, r: int) -> tuple[Piece, ...]:
    """Rank ``r``'s pieces of one page (conv state at byte 0, the temporal state after it)."""
    _, conv_bytes, shapes = page(model, tp, r, 0, 0)
    split = state_split(model, tp)
    return pieces(split, [0, conv_bytes], r, tp)


def state_split(model: dict, tp: int) -> tuple[TensorSplit, ...]:
    _, _, shapes = page(model, tp, 0, 0, 0)
    split = splits(
        model["kind"], shapes, [4, 4], conv_ds=model["ds"], tp_size=tp, n_groups=model.get("g")
    )
    assert not isinstance(split, str), split
    return split
