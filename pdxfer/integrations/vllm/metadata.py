"""What the scheduler side tells the workers each step (``build_connector_meta``).

vLLM hands the metadata to every worker rank (pickled when the workers are other processes),
so it is plain frozen data: block ids, rooms and token ids, no handles.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True, slots=True)
class SendOrder:
    """Prefill: the request finished its prefill; send tokens ``[0, num_tokens)`` from these
    blocks to whichever decode asks for ``room`` (only ``peer`` when it is set)."""

    req_id: str
    room: int
    peer: str | None
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class LoadOrder:
    """Decode: fill ``block_ids`` (all of the request's blocks; the first ``l1_len`` tokens
    are already in vLLM's prefix cache) with tokens ``[l1_len, num_tokens)`` of ``room``
    from the prefill behind ``bootstrap``. ``tokens`` (with decode-side tiers only) key the
    L2/L3 lookup; ``scope`` is the request's cache salt."""

    req_id: str
    room: int
    bootstrap: str
    instance: str | None
    block_ids: tuple[int, ...]
    l1_len: int
    num_tokens: int
    tokens: tuple[int, ...] = ()
    scope: str = ""


@dataclass(frozen=True, slots=True)
class WritebackOrder:
    """Decode with tiers: keep the full blocks of ``tokens`` in L2 (and L3) before vLLM frees
    them."""

    req_id: str
    tokens: tuple[int, ...]
    block_ids: tuple[int, ...]
    scope: str = ""


@dataclass(eq=False)
class PdxferMetadata(KVConnectorMetadata):
    sends: list[SendOrder] = field(default_factory=list)
    loads: list[LoadOrder] = field(default_factory=list)
    writebacks: list[WritebackOrder] = field(default_factory=list)
