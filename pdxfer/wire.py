"""Every control message between endpoints: tagged msgspec Structs and one versioned codec.

A frame is a fixed 66-byte header followed by ``msgpack(tagged struct)``::

    MAGIC(3) | version(1) | kind(1) | mode(1) | length(4) | pair(16) | counter(8) | mac(32)

Everything needed to refuse a frame is in the header, so it is refused before any payload
byte is decoded: magic and version, the length (equal to what arrived, under its ``kind``'s
cap) and, with a secret, the MAC (``mode`` names the key, ``pair`` the handshake or session,
``counter`` refuses replays). Decoding is typed (msgspec and ``__post_init__``); anything else
raises ``Rejected`` with a short reason, counted as ``rejected_<reason>``. Page indices travel
as packed little-endian int32 bytes, several times cheaper to encode and decode than lists of
Python ints.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Annotated, NamedTuple, Union

import msgspec
import numpy as np

from .config import IntegrityMode
from .errors import WireError
from .pools import MAX_BUFFERS, MAX_PIECES, U64, Name, NonNeg, PoolSpec

PROTOCOL_VERSION = 5
"""4: a digest may cover some layers of a pool (partial-layer chunks); 3: sampled digests
read each page once (``integrity.Sampling``); 2 read the ends too."""
MAGIC = b"PDX"
MAX_FRAME = 16 << 20
"""No control message is this large (4M page indices); a bigger frame is hostile or broken,
and the control socket drops it (and its connection) before it is even read."""
MAX_HELLO = 1 << 20
"""Cap of a ``Hello`` or ``HelloAck``: 64 pools of a few hundred buffers each fit easily."""
MAX_SMALL = 32 << 10
MAX_DONE = 4 << 20
"""A TransferDone carries a room's integrity digests (one per pool, buffer and chunk)."""
"""Cap of every other message but ``TransferRequest`` (a 4096-character reason at most)."""
MAX_POOLS = 64

PLAIN, HELLO, ACK, SESSION = 0, 1, 2, 3
"""Header modes: unauthenticated (no secret), MAC under the secret's Hello key, under the
handshake's ack key (``pair`` = the Hello's nonce), under the pair's session key."""
ZERO_PAIR = bytes(16)
_HDR = struct.Struct("<3sBBBI16sQ32s")
HEADER_LEN = _HDR.size

Room = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Str = Annotated[str, msgspec.Meta(max_length=256)]
Reason = Annotated[str, msgspec.Meta(max_length=4096)]
Addr = Annotated[
    str,
    msgspec.Meta(min_length=1, max_length=256, pattern=r"^tcp://[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}$"),
]
"""A control address: replies only ever go to ``tcp://host:port``."""
Session = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
"""A transport session name (``host:port`` for Mooncake)."""
Packed = Annotated[bytes, msgspec.Meta(max_length=64 << 20)]


Mode = IntegrityMode
"""The integrity modes (``config.INTEGRITY_MODES``), as the wire carries them."""
MAX_DIGESTS = 1 << 16


class Digest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """What a sender wrote into one pool, as one ``integrity`` digest per buffer: tokens
    ``[start, end)`` and global heads ``[lo, hi)`` (``lo == hi``: whole rows) of the
    sender's buffers holding layers ``[l0, l1)`` (``l0 == l1``: every buffer; a
    partial-layer chunk's digest has one value per buffer of those layers). A slot row has
    ``start == end == 0``."""

    pool: Name
    start: NonNeg
    end: NonNeg
    lo: NonNeg
    hi: NonNeg
    values: Annotated[tuple[U64, ...], msgspec.Meta(max_length=MAX_BUFFERS)]
    l0: NonNeg = 0
    l1: NonNeg = 0

    def __post_init__(self) -> None:
        if self.end < self.start or self.hi < self.lo or self.l1 < self.l0:
            raise ValueError(f"digest of pool {self.pool!r}: empty or reversed range")


class Msg(msgspec.Struct, tag=True, forbid_unknown_fields=True, frozen=True):
    """Base of every control message (``tag`` is the class name)."""


Agent = Annotated[bytes, msgspec.Meta(max_length=512 << 10)]
"""A transport's pairing metadata (``Transport.peer_info``), bounded below ``MAX_HELLO``."""


class Hello(Msg, frozen=True):
    """Decode endpoint -> prefill endpoint, once per pair: who I am and my pools.

    With a secret, the header's MAC covers every byte of this (every pool's addresses, sizes
    and page counts), the header's ``pair`` is a fresh random nonce and ``ts`` bounds how long
    a captured Hello could be replayed (and each nonce is accepted once). ``room`` names the
    request that started the handshake, so a refusal can fail that room on the prefill too;
    ``instance`` is the decode instance, which a room may be bound to (``sender(peer=...)``).
    """

    endpoint_id: Str
    ctrl_addr: Addr
    session: Session
    tp_rank: NonNeg
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    signature: Str
    pools: Annotated[tuple[PoolSpec, ...], msgspec.Meta(max_length=MAX_POOLS)]
    ts: float = 0.0
    room: Room | None = None
    instance: Str = ""
    to: Str = ""
    """The prefill endpoint this Hello is for: a Hello captured on its way to one prefill
    cannot open (and so replace) the decode's pair with another."""
    model: Reason = ""
    """The engine's model fingerprint (``EndpointConfig.model_id``): both sides must agree."""
    transport: Str = ""
    """The decode's transport (``Transport.name``): both sides must move bytes the same way."""
    agent: Agent = b""
    """The decode transport's ``peer_info`` (NIXL agent metadata: its registered memory)."""


class HelloAck(Msg, frozen=True):
    """Prefill -> decode: accepted (with the prefill's pools) or refused with a reason."""

    endpoint_id: Str
    ok: bool
    reason: Reason = ""
    session: Str = ""
    tp_rank: NonNeg = 0
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    pools: Annotated[tuple[PoolSpec, ...], msgspec.Meta(max_length=MAX_POOLS)] = ()
    nonce: Annotated[bytes, msgspec.Meta(max_length=32)] = b""
    """The prefill's fresh nonce: the session key is derived from both sides' nonces."""
    agent: Agent = b""
    """The prefill transport's ``peer_info`` (NIXL: what the decode's probes need)."""


class TransferRequest(Msg, frozen=True, omit_defaults=True):
    """Decode -> prefill: where to write a room's KV.

    ``dst`` holds packed int32 page (or token-slot) indices per pool, covering tokens
    ``[prefix_len, num_tokens)``; pools following an anchor (``indices_from``) are omitted.
    ``slots`` names the destination slot of each slot pool. ``expected_senders`` is how many
    prefill endpoints the decode waits for; ``decode_peers`` how many decode endpoints will ask this
    prefill endpoint for the same room. ``deadline_s`` is the decode's remaining patience.
    Heterogeneous TP (``topology.assign``): ``heads`` is the global head range this sender
    writes per head-sharded pool (default: all heads both sides hold), ``skip`` the pools it
    must not write (another rank writes them) and ``silent`` that it writes nothing and sends
    no ``TransferDone`` (the decode does not wait for it). ``stage`` names, per head-sliced
    host pool, the decode staging address that receives the packed head slice instead
    (``staging``; the sender checks the whole lease lies in the decode's staging pool).
    ``pack`` names, per pool written as whole token rows, the lease in the decode's pack
    staging that receives the request's rows packed (``plan/pack.py``); the decode
    scatters them into ``dst`` before Success. Defaults are left out of the encoded
    request, so a request that packs nothing reads as before.
    """

    room: Room
    nonce: U64
    endpoint_id: Str
    dst: dict[Name, Packed]
    slots: dict[Name, NonNeg]
    prefix_len: NonNeg
    num_tokens: NonNeg
    expected_senders: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    decode_peers: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    deadline_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 60.0
    hold_for_repair: bool = False
    heads: dict[Name, tuple[NonNeg, NonNeg]] = {}
    skip: Annotated[tuple[Name, ...], msgspec.Meta(max_length=MAX_POOLS)] = ()
    silent: bool = False
    stage: dict[Name, U64] = {}
    integrity: Mode = "off"
    """How the sender digests what it writes (the decode verifies in the same mode)."""
    early: bool = False
    """The decode asks at dispatch, maybe before this prefill has received the request (the
    early form): a room it does not know yet waits up to the bootstrap deadline, not only
    ``room_grace_s``; only the sender's router, which ends both legs, can know it never comes."""
    pack: dict[Name, U64] = {}
    pieces: dict[
        Name, Annotated[tuple[tuple[NonNeg, NonNeg], ...], msgspec.Meta(max_length=MAX_PIECES)]
    ] = {}
    """Per slot pool split into pieces (a Mamba / linear-attention state over different TP),
    the global units of each piece this sender writes (``lo == hi``: none); default: every
    unit both sides hold (``plan/pieces.py``)."""

    def __post_init__(self) -> None:
        if self.prefix_len > self.num_tokens:
            raise ValueError(f"prefix_len {self.prefix_len} > num_tokens {self.num_tokens}")
        if len(self.dst) > MAX_POOLS or len(self.slots) > MAX_POOLS:
            raise ValueError("too many pools")
        for name, packed in self.dst.items():
            if len(packed) % 4:
                raise ValueError(
                    f"dst[{name!r}]: packed indices length {len(packed)} not a multiple of 4"
                )
        if len(self.heads) > MAX_POOLS:
            raise ValueError("too many pools")
        for name in self.stage:
            if name not in self.heads:
                raise ValueError(f"stage[{name!r}] without a head range")
        if len(self.pack) > MAX_POOLS or set(self.pack) & set(self.stage):
            raise ValueError("a pool both packed and staged, or too many packed pools")
        for name, (lo, hi) in self.heads.items():
            if lo >= hi:
                raise ValueError(f"heads[{name!r}]: empty head range [{lo}, {hi})")
        if len(self.pieces) > MAX_POOLS:
            raise ValueError("too many pools")
        for name, ranges in self.pieces.items():
            if any(lo > hi for lo, hi in ranges):
                raise ValueError(f"pieces[{name!r}]: a unit range ends before it starts")


class TransferDone(Msg, frozen=True):
    """Prefill -> decode: every write of this room from this sender has completed (or failed)."""

    room: Room
    nonce: U64
    endpoint_id: Str
    rank: NonNeg
    ok: bool
    reason: Reason = ""
    kind: Str = ""
    bytes: NonNeg = 0
    blocks: NonNeg = 0
    seconds: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    digests: Annotated[tuple[Digest, ...], msgspec.Meta(max_length=MAX_DIGESTS)] = ()


class Abort(Msg, frozen=True):
    """Either side -> peer: stop this room. The prefill answers ``AbortAck`` once no write of
    the room is still in flight, to the sender's registered address (never to an address
    named in a message)."""

    room: Room
    nonce: U64
    reason: Reason = ""
    endpoint_id: Str = ""


class AbortAck(Msg, frozen=True):
    """Prefill -> decode: the room's writes have drained (``known`` false: never saw it)."""

    room: Room
    nonce: U64
    endpoint_id: Str = ""
    rank: NonNeg = 0
    known: bool = True


class Release(Msg, frozen=True):
    """Decode -> prefill: the prefill may free the room's source pages (repair no longer needed)."""

    room: Room
    nonce: U64
    endpoint_id: Str = ""


Message = Union[Hello, HelloAck, TransferRequest, TransferDone, Abort, AbortAck, Release]
KINDS: tuple[type[Msg], ...] = (
    Hello,
    HelloAck,
    TransferRequest,
    TransferDone,
    Abort,
    AbortAck,
    Release,
)
_KIND = {t: i for i, t in enumerate(KINDS)}
_CAP = {Hello: MAX_HELLO, HelloAck: MAX_HELLO, TransferRequest: MAX_FRAME, TransferDone: MAX_DONE}

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class Rejected(WireError):
    """A frame refused, with a short ``reason`` (the metric is ``rejected_<reason>``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Header(NamedTuple):
    kind: type[Msg]
    mode: int
    length: int
    pair: bytes
    counter: int
    mac: bytes


def cap(kind: type[Msg]) -> int:
    """The largest payload a frame of this kind may carry."""
    return _CAP.get(kind, MAX_SMALL)


def frame(
    payload: bytes,
    kind: type[Msg],
    mode: int = PLAIN,
    pair: bytes = ZERO_PAIR,
    counter: int = 0,
    key: bytes | None = None,
) -> bytes:
    """A frame around an encoded payload; with ``key``, its MAC covers header and payload."""
    head = _HDR.pack(
        MAGIC, PROTOCOL_VERSION, _KIND[kind], mode, len(payload), pair, counter, bytes(32)
    )
    if key is None:
        return head + payload
    return head[:-32] + mac(key, head, payload) + payload


def mac(key: bytes, head: bytes | memoryview, payload: bytes | memoryview) -> bytes:
    m = hmac.new(key, head[: HEADER_LEN - 32], hashlib.sha256)
    m.update(payload)
    return m.digest()


def payload(msg: Msg) -> bytes:
    return _encoder.encode(msg)


def encode(msg: Msg) -> bytes:
    """An unauthenticated frame (the sender seals it with ``reseal`` when it has a key)."""
    return frame(_encoder.encode(msg), type(msg))


def reseal(f: bytes, mode: int, pair: bytes, counter: int, key: bytes | None) -> bytes:
    """The same payload under a new header (mode, pair, counter, MAC)."""
    kind = KINDS[f[4]]
    return frame(bytes(memoryview(f)[HEADER_LEN:]), kind, mode, pair, counter, key)


def header(f: bytes | bytearray | memoryview, size: int | None = None) -> Header:
    """Parse and check a frame's header against what arrived (raises ``Rejected``); with
    ``size``, ``f`` may be the header alone of a frame of ``size`` bytes still arriving."""
    if not isinstance(f, (bytes, bytearray, memoryview)):
        raise Rejected("malformed", f"frame is {type(f).__name__}, not bytes")
    if len(f) < 4 or bytes(f[:3]) != MAGIC:
        raise Rejected("malformed", "not a pdxfer frame (bad magic)")
    if f[3] != PROTOCOL_VERSION:
        raise Rejected(
            "version",
            f"protocol version {f[3]} not supported (this side speaks {PROTOCOL_VERSION})",
        )
    if len(f) < HEADER_LEN:
        raise Rejected("malformed", f"frame of {len(f)} bytes is shorter than its header")
    _, _, k, mode, length, pair, counter, tag = _HDR.unpack_from(f)
    if k >= len(KINDS) or mode > SESSION:
        raise Rejected("malformed", f"unknown message kind {k} or mode {mode}")
    kind = KINDS[k]
    total = len(f) if size is None else size
    if length != total - HEADER_LEN:
        raise Rejected(
            "malformed", f"header says {length} payload bytes, {total - HEADER_LEN} arrived"
        )
    if length > cap(kind):
        raise Rejected("oversized", f"{kind.__name__} of {length} bytes exceeds {cap(kind)}")
    return Header(kind, mode, length, bytes(pair), counter, bytes(tag))


def verify(f: bytes | memoryview, key: bytes, tag: bytes) -> bool:
    view = memoryview(f)
    return hmac.compare_digest(mac(key, view[:HEADER_LEN], view[HEADER_LEN:]), tag)


def body(f: bytes | memoryview, h: Header) -> Message:
    """Decode the payload of a frame whose header (and MAC, if any) was checked."""
    try:
        msg = _decoder.decode(memoryview(f)[HEADER_LEN:])
    except msgspec.ValidationError as e:
        raise Rejected("invalid", f"invalid message: {e}") from None
    except msgspec.DecodeError as e:
        raise Rejected("malformed", f"malformed message: {e}") from None
    if type(msg) is not h.kind:
        raise Rejected(
            "invalid",
            f"invalid message: header says {h.kind.__name__}, payload is {type(msg).__name__}",
        )
    return msg


def decode(f: bytes) -> Message:
    """Decode one frame without checking its MAC (tests, and endpoints without a secret), or
    raise ``WireError`` saying why it was rejected."""
    if isinstance(f, (bytes, bytearray, memoryview)) and len(f) > MAX_FRAME + HEADER_LEN:
        raise Rejected("oversized", f"frame of {len(f)} bytes exceeds {MAX_FRAME}")
    return body(f, header(f))


def pack_indices(idx: np.ndarray | list[int]) -> bytes:
    a = np.asarray(idx, dtype=np.int64)
    if a.size and (a.min() < 0 or a.max() >= 1 << 31):
        raise WireError("indices must be in [0, 2^31)")
    return a.astype("<i4").tobytes()


def unpack_indices(b: bytes) -> np.ndarray:
    if len(b) % 4:
        raise WireError("packed indices length not a multiple of 4")
    return np.frombuffer(b, dtype="<i4").astype(np.int64)
