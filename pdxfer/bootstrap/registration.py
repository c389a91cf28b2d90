"""What a prefill rank registers (``Registration``) and how the server holds an instance.

A decode must never pair with half an instance: an ``Instance`` is complete only once every
(dp, pp, tp) slot of its shape has registered.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from ..pools import NonNeg

Small = Annotated[int, msgspec.Meta(ge=1, le=4096)]
TEXT_CHARS = 256
REASON_CHARS = 2048
Text = Annotated[str, msgspec.Meta(min_length=1, max_length=TEXT_CHARS)]
MAX_REFUSALS = 16
"""Refused decodes a registration carries (the most recent ones)."""


class Refusal(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A decode whose handshake this prefill rank refused, and why (naming both sides'
    values): what a router tells a client whose request that pair could not serve."""

    decode: Text
    """The decode's instance name (else its endpoint id)."""
    reason: Annotated[str, msgspec.Meta(min_length=1, max_length=REASON_CHARS)]


class Registration(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One prefill endpoint (rank) of an instance."""

    instance: Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[\w.:\-]+$")]
    endpoint_id: Text
    ctrl_addr: Text
    session: Text
    signature: Annotated[str, msgspec.Meta(max_length=64)]
    tp_rank: NonNeg = 0
    tp_size: Small = 1
    dp_rank: NonNeg = 0
    dp_size: Small = 1
    pp_rank: NonNeg = 0
    pp_size: Small = 1
    refused: Annotated[tuple[Refusal, ...], msgspec.Meta(max_length=MAX_REFUSALS)] = ()

    def __post_init__(self) -> None:
        for r, s, what in (
            (self.tp_rank, self.tp_size, "tp"),
            (self.dp_rank, self.dp_size, "dp"),
            (self.pp_rank, self.pp_size, "pp"),
        ):
            if r >= s:
                raise ValueError(f"{what}_rank {r} must be < {what}_size {s}")

    @property
    def slot(self) -> tuple[int, int, int]:
        return (self.dp_rank, self.pp_rank, self.tp_rank)


class Instance:
    """One instance's shape, layout signature and the ranks registered so far."""

    def __init__(self, first: Registration) -> None:
        self.shape = (first.dp_size, first.pp_size, first.tp_size)
        self.signature = first.signature
        self.slots: dict[tuple[int, int, int], Registration] = {}

    @property
    def complete(self) -> bool:
        dp, pp, tp = self.shape
        return len(self.slots) == dp * pp * tp
