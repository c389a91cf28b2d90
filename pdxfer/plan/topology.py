"""Which prefill endpoints a decode rank asks, and what each of them writes (pure, no I/O).

Planned once per (prefill instance route, decode rank) from TP sizes and the pools' shardings:

- Contacts: with prefill TP ``tp_p`` and decode TP ``tp_d`` (one must divide the other), decode
  rank ``d`` asks prefill ranks ``[d*r, (d+1)*r)`` when ``tp_p = r*tp_d`` (each prefill rank is
  asked by exactly one decode rank), or prefill rank ``d // r`` when ``tp_d = r*tp_p`` (each
  prefill rank is asked by ``r`` decode ranks: its ``decode_peers``). Every pipeline stage of
  the routed DP group is asked the same way.
- Assignment, per stage: a head-sharded pool's heads are split over the asked ranks, each head
  written by the first rank (lowest TP rank) that holds it, so GQA replication never writes a
  head twice; so are the units of each piece of a state slot split into pieces (``pieces.py``);
  a replicated pool (MLA latent, sidecar, slots) is written by the first asked rank that
  holds it. A rank left with nothing to write is told so (``silent``) and the decode does
  not wait for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..pools import PoolSpec, piece_key
from .pieces import held, same_pieces


@dataclass(frozen=True, slots=True)
class Assignment:
    """What one asked prefill endpoint writes for one decode rank."""

    index: int
    """Position of the endpoint in the list given to ``assign``."""
    heads: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Head-sharded pool -> global head range ``[lo, hi)`` it writes."""
    skip: tuple[str, ...] = ()
    """Pools it holds but must not write (another rank writes them)."""
    silent: bool = False
    """It writes nothing at all: it still gets the request, but needs not answer."""
    pieces: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    """Slot pool split into pieces -> the global units of each piece it writes (``lo == hi``:
    none), when not every unit it holds of a slot laid out as the decode's."""


def contacts(prefill_tp: int, decode_tp: int, decode_rank: int) -> list[int] | str:
    """Prefill TP ranks that decode rank ``decode_rank`` asks, or why none can be chosen."""
    if prefill_tp < 1 or decode_tp < 1 or not 0 <= decode_rank < decode_tp:
        return f"bad TP sizes: prefill {prefill_tp}, decode rank {decode_rank} of {decode_tp}"
    if prefill_tp >= decode_tp:
        if prefill_tp % decode_tp:
            return f"prefill TP {prefill_tp} is not a multiple of decode TP {decode_tp}"
        r = prefill_tp // decode_tp
        return list(range(decode_rank * r, (decode_rank + 1) * r))
    if decode_tp % prefill_tp:
        return f"decode TP {decode_tp} is not a multiple of prefill TP {prefill_tp}"
    return [decode_rank // (decode_tp // prefill_tp)]


def decode_peers(prefill_tp: int, decode_tp: int) -> int:
    """How many decode ranks ask each prefill rank for the same room."""
    return max(1, decode_tp // prefill_tp)


def _heads_range(p: PoolSpec) -> tuple[int, int]:
    sh = p.sharding
    return sh.first_head, sh.first_head + sh.rank_heads


def assign(
    mine: Mapping[str, PoolSpec], peers: Sequence[tuple[int, Mapping[str, PoolSpec]]]
) -> list[Assignment] | str:
    """Split the decode's pools ``mine`` over the asked endpoints ``peers``
    (``(pp_rank, that endpoint's pools)``, in ascending TP rank within a stage).

    Returns one ``Assignment`` per peer, or why the peers cannot fill the decode's pools.
    """
    out: dict[int, tuple[dict[str, tuple[int, int]], list[str]]] = {
        i: ({}, []) for i in range(len(peers))
    }
    cut: dict[int, dict[str, tuple[tuple[int, int], ...]]] = {i: {} for i in range(len(peers))}
    stages: dict[int, list[int]] = {}
    for i, (pp, _) in enumerate(peers):
        stages.setdefault(pp, []).append(i)
    for pp, idx in sorted(stages.items()):
        for name, d in mine.items():
            if d.item_bytes == 0:
                continue
            holders = [i for i in idx if name in peers[i][1] and peers[i][1][name].item_bytes]
            if not holders:
                continue
            if d.kind == "paged" and d.sharding.kind == "heads":
                lo, hi = _heads_range(d)
                cur = lo  # heads below cur are taken; ranks hold ascending ranges
                for i in holders:
                    s_lo, s_hi = _heads_range(peers[i][1][name])
                    a, b = max(cur, s_lo), min(hi, s_hi)
                    if a > cur and b > a:
                        return (
                            f"pool {name!r}: stage {pp} leaves decode heads [{cur}, {a}) "
                            f"unheld by any asked prefill rank"
                        )
                    if b > a:
                        out[i][0][name] = (a, b)
                        cur = b
                    else:
                        out[i][1].append(name)
                if cur < hi:
                    return (
                        f"pool {name!r}: no asked prefill rank of stage {pp} holds decode "
                        f"heads [{cur}, {hi})"
                    )
            elif d.kind == "slot" and d.sharding.kind == "pieces":
                got = _split_pieces(name, d, [(i, peers[i][1][name]) for i in holders], pp)
                if isinstance(got, str):
                    return got
                for i, r in got.items():
                    if r is None:
                        out[i][1].append(name)
                    elif r != held(peers[i][1][name]) or not same_pieces(peers[i][1][name], d):
                        cut[i][name] = r
            else:
                for i in holders[1:]:
                    out[i][1].append(name)
    res: list[Assignment] = []
    for i, (_, pools) in enumerate(peers):
        heads, skip = out[i]
        writes = [n for n, p in pools.items() if p.item_bytes and n in mine and n not in skip]
        res.append(Assignment(i, heads, tuple(sorted(skip)), silent=not writes, pieces=cut[i]))
    return res


def _split_pieces(
    name: str, d: PoolSpec, holders: list[tuple[int, PoolSpec]], pp: int
) -> dict[int, tuple[tuple[int, int], ...] | None] | str:
    """Per holder (in TP order), the units of each piece of the decode's slot it writes, each
    unit by the first holder that has it (None: it writes none); or why some go unheld."""
    want = held(d)
    cur = [lo for lo, _ in want]
    got: dict[int, list[tuple[int, int]]] = {}
    for i, s in holders:
        if piece_key(s) != piece_key(d):
            return f"pool {name!r}: stage {pp} prefill pieces {piece_key(s)} differ from decode's"
        mine: list[tuple[int, int]] = []
        for k, ((s_lo, s_hi), (_, hi)) in enumerate(zip(held(s), want)):
            a, b = max(cur[k], s_lo), min(hi, s_hi)
            if a > cur[k] and b > a:
                return (
                    f"pool {name!r}: stage {pp} leaves piece {k} units [{cur[k]}, {a}) "
                    f"unheld by any asked prefill rank"
                )
            if b > a:
                mine.append((a, b))
                cur[k] = b
            else:
                mine.append((0, 0))
        got[i] = mine
    for k, ((_, hi), c) in enumerate(zip(want, cur)):
        if c < hi:
            return (
                f"pool {name!r}: no asked prefill rank of stage {pp} holds piece {k} "
                f"units [{c}, {hi})"
            )
    return {i: (tuple(r) if any(b > a for a, b in r) else None) for i, r in got.items()}
