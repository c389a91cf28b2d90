"""vLLM's KV cache groups as pdxfer pools, and what of each group a request moves.

With vLLM's hybrid KV cache manager a model's layers fall into groups, each with its own
block table (one block pool shared by all groups, so block ids never collide):

- ``full``: full attention and MLA. Every block of the prompt moves; it may stream.
- ``window``: sliding-window attention. vLLM frees blocks that left the window (its table
  then holds the null block 0), so only the window's tail moves; with ``send_by: layer``
  the blocks no step can free (``window_first``) stream as they are computed.
- ``chunk``: chunked local attention (Llama 4). A token attends only to the tokens of its
  own chunk, so vLLM frees the blocks of every chunk before the current one; only the last
  prompt token's chunk moves, streamed like a window (``chunk_first``).
- A window or chunk prompt whose last token's first key opens a block backs off one token
  (``backoff``): vLLM's decode, holding all the prompt, would keep no block of it
  (``skipped``), yet computes the last prompt token again. A window's depends on the
  decode's block size, so only the decode backs off for it (``prefill_backoff``).
- ``state``: Mamba2 / Gated DeltaNet state: one state block per request, final after the
  prefill's last chunk. It moves as a pdxfer slot (split into TP-sharded pieces, ``state.py``,
  when the two sides' TP differ); the prefill stops one token short and the decode computes
  the last prompt token itself (the state must not see it twice).

Pools whose first token differs travel as separate pdxfer rooms (``Part``): the main room
(full and state groups) and one derived room per window size and per chunk size. Pure: no
vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .state import TensorSplit

NULL_BLOCK = 0
"""vLLM's null block: a table holds it for blocks a group no longer (or never) keeps."""

POOL = "kv"
"""Group 0's pool (the only one of a plain attention model)."""

Kind = Literal["full", "window", "chunk", "state"]

LOCAL: tuple[Kind, ...] = ("window", "chunk")
"""Kinds whose earlier blocks vLLM frees while a request runs: only a tail moves."""

CHUNK_KEY = 1 << 32
"""A chunk group's ``Part`` key is this plus its chunk size (apart from every window's)."""


@dataclass(frozen=True, slots=True)
class Group:
    index: int
    """Position among vLLM's transfer groups (``KVCacheConfig.transfer_groups``)."""
    kind: Kind
    block_size: int
    layers: tuple[str, ...]
    window: int = 0
    """Tokens of the sliding window (``window`` groups)."""
    chunk: int = 0
    """Tokens of a local attention chunk (``chunk`` groups)."""
    spec_blocks: int = 0
    """Speculative scratch blocks vLLM appends after a state block (``state`` groups)."""
    page_bytes: int = 0
    """Bytes of one state block (``state`` groups: the page every state of a layer fills)."""
    mla: bool = False
    split: tuple[TensorSplit, ...] = ()
    """How each state tensor splits over TP (``state`` groups, ``state.splits``; empty: the
    state's kind is not known, so its slot moves whole, between equal TP sizes)."""
    replicated: bool = False
    """The same state on every TP rank (``state`` groups: vLLM's ``tp_replicated``)."""

    @property
    def pool(self) -> str:
        return POOL if self.index == 0 else f"{POOL}{self.index}"

    def describe(self) -> str:
        extra = (
            f" window {self.window}"
            if self.kind == "window"
            else f" chunk {self.chunk}"
            if self.kind == "chunk"
            else ""
        )
        return (
            f"{self.pool}: {self.kind}{' (MLA)' if self.mla else ''}{extra}, "
            f"{len(self.layers)} layers, block {self.block_size}"
        )


@dataclass(frozen=True, slots=True)
class Part:
    """Pools that start at the same token travel in one pdxfer room."""

    key: int
    """0: the request's own room; else what its room is derived from (``part_key``)."""
    groups: tuple[Group, ...]

    def room(self, room: int) -> int:
        return room if self.key == 0 else derived_room(room, self.key)


def derived_room(room: int, key: int) -> int:
    """A second room for the same request, a bijection of the 63-bit room space per key."""
    return (room * 0x9E3779B97F4A7C15 + key * 0x632BE59BD9B4E019 + 1) & ((1 << 63) - 1)


def part_key(g: Group) -> int:
    """Which room ``g`` travels in: 0 (the request's) for full and state groups, else one
    per window size and one per chunk size."""
    if g.kind == "window":
        return g.window
    if g.kind == "chunk":
        return CHUNK_KEY + g.chunk
    return 0


def parts(groups: Sequence[Group]) -> tuple[Part, ...]:
    """The request's rooms: full and state groups in the first, one per window size and per
    chunk size; a model with no full group (every layer sliding, or every layer chunked)
    keeps its one local group in the request's room."""
    keys: dict[int, list[Group]] = {}
    for g in groups:
        keys.setdefault(part_key(g), []).append(g)
    out = [Part(k, tuple(gs)) for k, gs in sorted(keys.items())]
    if out and out[0].key != 0 and len(out) == 1:
        out[0] = Part(0, out[0].groups)
    return tuple(out)


def streams(groups: Sequence[Group]) -> bool:
    """Whether the model takes the plain path, one pool streamed in every ``send_by`` mode:
    every group full attention. A hybrid model streams by layer only (``stream_pages``; a
    state goes at the request's end), and with ``send_by: step | request`` once, at its end."""
    return all(g.kind == "full" for g in groups)


def tiered(groups: Sequence[Group]) -> tuple[Group, ...]:
    """The groups decode-side tiers (L2/L3) restore: the full-attention groups of the
    request's own room. A full group's page is a function of the tokens before it, so a
    page saved from any request serves any other with that prefix. Window and state groups
    always load from the prefill, which computed the whole prompt: a window block is kept by
    nobody once the window passed it, nor a chunk's once its chunk ended (a prefix's pages
    would have holes), and a state is sound only at the position it was taken (a vLLM
    ``align`` checkpoint), so none is saved. A model whose request room holds a window or
    chunk group (every layer sliding or chunked) has none."""
    first = parts(groups)[0].groups if groups else ()
    if any(g.kind in LOCAL for g in first):
        return ()
    return tuple(g for g in first if g.kind == "full")


def whole_state_tp(groups: Sequence[Group], tp_size: int) -> str:
    """The fingerprint's `` state_tp=N`` where a state group moves whole yet each TP rank
    holds its own share (no ``split``, not replicated): such a page pairs only with the same
    TP size, even where vLLM pads both sides' pages to one size; else ``""``."""
    if any(g.kind == "state" and not g.split and not g.replicated for g in groups):
        return f" state_tp={tp_size}"
    return ""


def skipped(g: Group, computed: int) -> int:
    """vLLM's rule: the tokens a window or chunk group no longer keeps once ``computed``
    tokens are computed, those token ``computed`` does not attend to (it frees the blocks
    below ``skipped // block_size``). A window of ``w`` tokens ends at the token itself, a
    chunk starts at a multiple of ``chunk``; 0 for any other group."""
    if g.kind == "window":
        return max(0, computed - g.window + 1)
    if g.kind == "chunk":
        return computed // g.chunk * g.chunk
    return 0


def backoff(groups: Sequence[Group], num_tokens: int) -> int:
    """Prompt tokens the prefill leaves to the decode, for a ``num_tokens`` prompt: a state
    group's state must be the one before the last prompt token, which the decode then
    computes. A window or chunk group may need one too: vLLM's decode holding all ``n``
    tokens keeps the blocks from ``skipped(n)`` on, yet computes token ``n - 1`` again,
    which attends from ``skipped(n - 1)``. Where those lie in different blocks (a chunk
    boundary at ``n``, or a window with ``(n - window + 1) % block_size == 0``) the decode
    holds ``n - 1`` tokens, so the blocks token ``n - 1`` attends to. This is the decode's
    count, by its own block sizes; the prefill's is ``prefill_backoff``."""
    if any(g.kind == "state" for g in groups):
        return 1
    n = num_tokens
    if n > 1 and any(
        skipped(g, n) // g.block_size > skipped(g, n - 1) // g.block_size
        for g in groups
        if g.kind in LOCAL
    ):
        return 1
    return 0


def prefill_backoff(groups: Sequence[Group], num_tokens: int) -> int:
    """Prompt tokens the prefill leaves uncomputed, never more than any decode's
    ``backoff``: a decode asking for a token the prefill did not compute would load a slot
    nobody wrote (or fail, where that token opens a page): a state group's, and a chunk
    group's at a chunk boundary (the prefill holding all ``n`` would keep none of the chunk
    before ``n``; a chunk boundary is one whatever the block size). Never a window group's: where a decode's window blocks begin depends on
    its block size, which the prefill does not know, and a prefill that computed all ``n``
    keeps every token a decode asking for ``n`` or ``n - 1`` reads (``window_first``)."""
    if any(g.kind == "state" for g in groups):
        return 1
    return backoff([g for g in groups if g.kind != "window"], num_tokens)


def state_block(blocks: Sequence[int], spec_blocks: int) -> int | None:
    """The block holding a request's running state (vLLM keeps null placeholders before it
    and ``spec_blocks`` scratch blocks after it)."""
    live = list(blocks)
    if spec_blocks and len(live) > 1:
        live = live[: -min(spec_blocks, len(live) - 1)]
    return live[-1] if live and live[-1] != NULL_BLOCK else None


def state_slot(g: Group, blocks: Sequence[int]) -> int:
    """``g``'s state block for one request (``state_block``), or ValueError: a request with
    a state group and no state is not one pdxfer can move."""
    slot = state_block(blocks, g.spec_blocks)
    if slot is None:
        raise ValueError(f"no state block for {g.pool} in {list(blocks)}")
    return slot


def window_first(g: Group, num_tokens: int) -> int:
    """The first block of window group ``g`` that no step of a ``num_tokens`` prefill frees:
    vLLM frees blocks below ``(c - window + 1) // block_size`` for ``c`` computed tokens, and
    ``c`` stays below ``num_tokens`` while the request runs. The decode holds from
    ``(num_tokens - window + 1) // block_size`` on, the same block (``backoff``)."""
    return max(0, num_tokens - g.window) // g.block_size


def chunk_first(g: Group, num_tokens: int) -> int:
    """The first block of chunk group ``g`` a decode holding ``num_tokens`` keeps: vLLM
    skips the tokens of every chunk before the one token ``num_tokens`` falls in. No step
    of a ``num_tokens`` prefill frees it: with ``c < num_tokens`` computed, vLLM frees only
    the blocks below the start of ``c``'s chunk."""
    return num_tokens // g.chunk * g.chunk // g.block_size


def local_first(g: Group, num_tokens: int) -> int:
    """``window_first`` or ``chunk_first`` for a local group; 0 for any other."""
    if g.kind == "window":
        return window_first(g, num_tokens)
    if g.kind == "chunk":
        return chunk_first(g, num_tokens)
    return 0


def freed(g: Group) -> int:
    """What stands for a block vLLM freed (or may free) in a prefill's list of ``g``'s
    pages: -1, a page pdxfer refuses to read (a decode that needs it fails the load rather
    than get another block's bytes); for a window group its null block, which no request
    owns (``source_pages`` says why)."""
    return NULL_BLOCK if g.kind == "window" else -1


def stream_pages(g: Group, blocks: Sequence[int], t0: int, t1: int, num_tokens: int) -> list[int]:
    """The pages of ``g`` holding tokens ``[t0, t1)`` that a step may hand over before the
    request ends: every block of a full group; of a window or chunk group, ``freed`` below
    ``local_first`` (vLLM may free those before the request ends; the decode reads none of
    their tokens)."""
    lo = local_first(g, num_tokens)
    ids = list(blocks)
    if len(ids) < -(-t1 // g.block_size):
        raise ValueError(f"{g.pool}: {len(ids)} blocks for tokens [{t0}, {t1})")
    gone = freed(g)
    return [
        gone if k < lo or ids[k] == NULL_BLOCK else int(ids[k])
        for k in range(t0 // g.block_size, -(-t1 // g.block_size))
    ]


def stream_start(part: Part, num_tokens: int) -> int:
    """The token before which a step hands nothing of ``part`` (its window or chunk groups'
    earliest block that no step frees; 0 for a part of full groups)."""
    wins = [local_first(g, num_tokens) * g.block_size for g in part.groups if g.kind in LOCAL]
    return min(wins) if wins else 0


def source_pages(g: Group, blocks: Sequence[int], num_tokens: int) -> list[int]:
    """A prefill's pages of ``g`` for tokens ``[0, num_tokens)``: blocks vLLM already freed
    (the null block) are ``freed``. A window group's stay its null block: a decode reads
    none of those tokens (it needs them from ``num_tokens - window + 1`` on, and the prefill
    frees none at or after ``window_first``), but a decode with larger blocks holds, and
    asks for, its whole first block, which may begin before the prefill's first kept one;
    that part of it is filled from the null block, never from another request's."""
    need = -(-num_tokens // g.block_size)
    gone = freed(g)
    return [gone if b == NULL_BLOCK else int(b) for b in list(blocks)[:need]]


def window_start(g: Group, blocks: Sequence[int], first: int, num_tokens: int) -> int | None:
    """The first block a decode holds for window or chunk group ``g`` at or after block
    ``first`` (vLLM leaves the null block where the window, or the last token's chunk, does
    not reach); None if a null block follows a real one."""
    need = -(-num_tokens // g.block_size)
    ids = list(blocks)[first:need]
    i = next((k for k, b in enumerate(ids) if b != NULL_BLOCK), len(ids))
    if any(b == NULL_BLOCK for b in ids[i:]):
        return None
    return first + i
