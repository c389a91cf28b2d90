"""What the scheduler side tells the workers each step (``build_connector_meta``).

vLLM hands the metadata to every worker rank (pickled when the workers are other processes),
so it is plain frozen data: block ids, rooms and token ids, no handles.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True, slots=True)
class ExpectOrder:
    """Prefill: the request arrived (vLLM queued it) with a room the router chose: declare
    the room (``Endpoint.expect``), so a decode dispatched with it, which asks at once, waits
    while the request is queued, past ``room_grace_s``. Its ``OpenOrder`` follows when vLLM
    schedules it; an ``AbortOrder`` withdraws it if the request ends first."""

    req_id: str
    room: int
    peer: str | None


@dataclass(frozen=True, slots=True)
class OpenOrder:
    """Prefill: the request was scheduled; open its room now, so a decode that asks before
    the prefill computed anything is attached and chunks can follow (only ``peer`` may ask
    when it is set)."""

    req_id: str
    room: int
    peer: str | None


@dataclass(frozen=True, slots=True)
class SendOrder:
    """Prefill: hand the sender the request's KV held in ``block_ids`` (all its blocks so
    far, in prompt order; the worker sends those it has not sent yet). ``last``: they hold
    tokens ``[0, num_tokens)``, the whole prompt; else full blocks only. In ``chunks`` the
    step computed them (sent after its forward); in ``sends`` the request finished, and
    vLLM frees the blocks once the worker reports the send done."""

    req_id: str
    room: int
    peer: str | None
    block_ids: tuple[int, ...]
    num_tokens: int
    last: bool = True
    groups: tuple[tuple[int, ...], ...] = ()
    """A hybrid model's final send: every transfer group's blocks as vLLM holds them (null
    blocks included); the worker clips them per group (``groups.py``)."""


@dataclass(frozen=True, slots=True)
class LayerOrder:
    """Prefill, ``send_by: layer``: this step computes tokens ``[start, end)`` of the request
    (``start`` is where the previous hand-off stopped: a prefix vLLM had cached goes with the
    first step), held in ``block_ids`` (the blocks of those tokens, in prompt order). As each
    layer finishes (``save_kv_layer``) its part goes to the sender; after the step, layers the
    forward did not report go too. The worker sends the tokens every layer was not given yet,
    up to ``end`` (or, where a block's interior is not addressable by token, up to the last
    complete block). ``last``: ``end`` is the prompt's end (the last block is then sent
    whole, as in the other modes)."""

    req_id: str
    room: int
    peer: str | None
    block_ids: tuple[int, ...]
    start: int
    end: int
    last: bool
    groups: tuple[tuple[int, ...], ...] = ()
    """A hybrid model (``block_ids`` then empty): each transfer group's blocks from the
    prompt's first token to ``end`` as vLLM holds them now (empty for a state group); the
    worker picks each part's pages (``groups.stream_pages``)."""
    num_tokens: int = 0
    """A hybrid model: the prompt's tokens (where a window ends)."""


@dataclass(frozen=True, slots=True)
class AbortOrder:
    """Prefill: end the room (the request was aborted, or preempted: vLLM freed its blocks).
    ``held``: vLLM keeps the blocks until the worker reports the request in
    ``finished_sending`` (after no write reads them any more); else vLLM already freed them
    and the worker waits for the writes to drain before this step's forward may reuse them."""

    req_id: str
    held: bool


@dataclass(frozen=True, slots=True)
class LoadOrder:
    """Decode: fill ``block_ids`` (all of the request's blocks; the first ``l1_len`` tokens
    are already in vLLM's prefix cache) with tokens ``[l1_len, num_tokens)`` of ``room``
    from the prefill behind ``bootstrap``. ``tokens`` (with decode-side tiers only) key the
    L2/L3 lookup; ``scope``: ``scheduler.tier_scope`` (the cache salt; a prompt's images)."""

    req_id: str
    room: int
    bootstrap: str
    instance: str | None
    block_ids: tuple[int, ...]
    l1_len: int
    num_tokens: int
    tokens: tuple[int, ...] = ()
    scope: str = ""
    early: bool = False
    """The request came at dispatch (the early form; ``params.DecodeAsk.early``)."""
    groups: tuple[tuple[int, ...], ...] = ()
    """A hybrid model: every transfer group's blocks (``block_ids`` is group 0's)."""
    dp: int | None = None
    """The prefill's data-parallel rank that holds the room (None: the bootstrap picks)."""


@dataclass(frozen=True, slots=True)
class WritebackOrder:
    """Decode with tiers: keep the full blocks of ``tokens`` in L2 (and L3) before vLLM frees
    them."""

    req_id: str
    tokens: tuple[int, ...]
    block_ids: tuple[int, ...]
    scope: str = ""
    groups: tuple[tuple[int, ...], ...] = ()
    """A hybrid model: each transfer group's blocks of ``tokens`` (empty for a group tiers
    do not keep, ``groups.tiered``)."""


@dataclass(eq=False)
class PdxferMetadata(KVConnectorMetadata):
    sends: list[SendOrder] = field(default_factory=list)
    loads: list[LoadOrder] = field(default_factory=list)
    writebacks: list[WritebackOrder] = field(default_factory=list)
    opens: list[OpenOrder] = field(default_factory=list)
    chunks: list[SendOrder] = field(default_factory=list)
    aborts: list[AbortOrder] = field(default_factory=list)
    expects: list[ExpectOrder] = field(default_factory=list)
    layers: list[LayerOrder] = field(default_factory=list)
    idle: bool = False
    """The step computes nothing: vLLM steps without pause while a request waits for its KV
    (a decode's load) or a finished one's blocks are being sent (a prefill's send), and the
    workers then wait a little for a transfer to end (``worker.IDLE_WAIT_S``)."""

    def orders(self) -> bool:
        """Whether this step orders anything (not ``__bool__``: vLLM tests metadata for
        None, and an empty step's metadata must still count as present)."""
        return bool(
            self.sends
            or self.loads
            or self.writebacks
            or self.opens
            or self.chunks
            or self.aborts
            or self.expects
            or self.layers
        )
