"""How a vLLM Mamba / linear-attention state splits over TP, as pdxfer ``Piece``s. Pure.

vLLM keeps one page per block and layer holding the layer's state tensors (``MambaSpec``:
``shapes`` per rank, one ``dtypes`` each). Each tensor's first sharded axis is split over TP:

- the conv state, ``(dim, state_len)`` (``DS``) or ``(state_len, dim)`` (``SD``, vLLM's
  default), whose ``dim`` is sub-blocks each split on its own: Mamba2 ``x | B | C`` (``x`` by
  heads, ``B`` and ``C`` by groups, a single group replicated on every rank), Gated DeltaNet
  ``Q | K | V`` (by key and value heads), Mamba1 and short convolutions one block of
  channels;
- the temporal (SSM) state, by heads (Mamba2, GDN, linear attention) or channels (Mamba1).

``splits`` reads that from the spec's shapes (it needs no rank), ``pieces`` places it in one
rank's page. A state kind not listed here gets no split: its slot moves whole, between equal
TP sizes only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdxfer import Piece


@dataclass(frozen=True, slots=True)
class Sub:
    """One sub-block of a tensor's sharded axis: ``units`` units of ``unit`` axis elements
    on each rank, ``total`` units in all (fewer than ranks x units: replicated)."""

    units: int
    unit: int
    total: int


@dataclass(frozen=True, slots=True)
class TensorSplit:
    """One state tensor of a block as ``[rows, axis, inner]`` elements of ``elt`` bytes, its
    ``axis`` made of ``subs``."""

    rows: int
    inner: int
    elt: int
    subs: tuple[Sub, ...]

    @property
    def axis(self) -> int:
        return sum(s.units * s.unit for s in self.subs)

    @property
    def nbytes(self) -> int:
        return self.rows * self.axis * self.inner * self.elt


def _even(units: int, unit: int, tp: int) -> Sub:
    return Sub(units, unit, units * tp)


def splits(
    mamba_type: str,
    shapes: Sequence[Sequence[int]],
    elts: Sequence[int],
    *,
    conv_ds: bool,
    tp_size: int,
    n_groups: int | None = None,
) -> tuple[TensorSplit, ...] | str:
    """Each state tensor's split (in ``shapes`` order), or why it is unknown (the state then
    moves whole). ``n_groups``: Mamba2's B/C groups in the model config (a group count TP
    does not divide is replicated on every rank); None where the config names none."""
    shapes = [tuple(int(x) for x in s) for s in shapes]
    kind = mamba_type.upper()

    def conv(subs: tuple[Sub, ...]) -> TensorSplit:
        dim, length = shapes[0] if conv_ds else shapes[0][::-1]
        if sum(s.units * s.unit for s in subs) != dim:
            raise ValueError(f"conv dim {dim} is not {subs}")
        return (
            TensorSplit(1, length, elts[0], subs)
            if conv_ds
            else TensorSplit(length, 1, elts[0], subs)
        )

    try:
        if kind in ("MAMBA2", "GDN_ATTN") and len(shapes) == 2 and len(shapes[1]) == 3:
            heads, hd, inner = shapes[1]
            temporal = TensorSplit(1, hd * inner, elts[1], (_even(heads, 1, tp_size),))
            dim = shapes[0][0] if conv_ds else shapes[0][1]
            if kind == "MAMBA2":
                g = dim - heads * hd
                if g <= 0 or g % (2 * inner):
                    return f"Mamba2 conv dim {dim} is not x ({heads}x{hd}) + B + C"
                local = g // (2 * inner)
                if tp_size > 1 and n_groups is None:
                    return "Mamba2 group count not in the model config"
                total = local * tp_size if n_groups is None or n_groups % tp_size == 0 else n_groups
                bc = Sub(local, inner, total)
                return conv((_even(heads, hd, tp_size), bc, bc)), temporal
            qk = dim - heads * hd
            if qk <= 0 or qk % (2 * inner):
                return f"GDN conv dim {dim} is not Q + K + V ({heads}x{hd})"
            k = Sub(qk // (2 * inner), inner, qk // (2 * inner) * tp_size)
            return conv((k, k, _even(heads, hd, tp_size))), temporal
        if kind == "MAMBA1" and len(shapes) == 2 and len(shapes[1]) == 2:
            ch, inner = shapes[1]
            return (
                conv((_even(ch, 1, tp_size),)),
                TensorSplit(1, inner, elts[1], (_even(ch, 1, tp_size),)),
            )
        if kind == "SHORT_CONV" and len(shapes) == 1:
            dim = shapes[0][0] if conv_ds else shapes[0][1]
            return (conv((_even(dim, 1, tp_size),)),)
        if kind == "LINEAR" and len(shapes) == 1 and len(shapes[0]) == 3:
            heads, a, b = shapes[0]
            return (TensorSplit(1, a * b, elts[0], (_even(heads, 1, tp_size),)),)
    except ValueError as e:
        return str(e)
    return f"state kind {mamba_type} with shapes {shapes}"


def pieces(
    split: Sequence[TensorSplit], offsets: Sequence[int], tp_rank: int, tp_size: int
) -> tuple[Piece, ...]:
    """The pieces of one rank's page: tensor ``i`` of ``split`` at byte ``offsets[i]``."""
    out = []
    for t, off in zip(split, offsets):
        start = 0
        for s in t.subs:
            unit_bytes = s.unit * t.inner * t.elt
            first = (
                tp_rank * s.units if s.total == s.units * tp_size else tp_rank * s.total // tp_size
            )
            out.append(
                Piece(
                    offset=off + start * t.inner * t.elt,
                    total=s.total,
                    rank_units=s.units,
                    first=min(first, s.total - s.units),
                    unit_bytes=unit_bytes,
                    rows=t.rows,
                    row_stride=t.axis * t.inner * t.elt if t.rows > 1 else 0,
                )
            )
            start += s.units * s.unit
    return tuple(out)
