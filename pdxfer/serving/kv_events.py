"""KV cache events on the wire: vLLM's schema (``KVEventBatch`` of ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared``, msgpack), its ZMQ framing (PUB: topic, 8-byte
big-endian sequence number, payload; a ROUTER replay socket answering a start sequence with
the buffered frames and an end marker), and a publisher of the same for pdxfer's own workers.

Frames come from the network: each part is bounded before it is decoded, and decoding is
typed (``msgspec``), so a hostile frame is dropped, never half-applied. Events are not
tracked by the garbage collector (``gc=False``: decoded data holds no cycles), so a burst of
thousands does not set off collections.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Annotated, Any

import msgspec
import zmq

MAX_PAYLOAD = 32 << 20
MAX_TOPIC = 256
END_SEQ = (-1).to_bytes(8, "big", signed=True)
BlockHash = int | Annotated[bytes, msgspec.Meta(max_length=64)]  # msgpack ints are 64-bit at most
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Hashes = Annotated[list[BlockHash], msgspec.Meta(max_length=1 << 16)]


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: Hashes
    parent_block_hash: BlockHash | None
    token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=1 << 22)]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any | None] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: Hashes
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: Annotated[list[Event], msgspec.Meta(max_length=1 << 16)]
    data_parallel_rank: int | None = None


class RawStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    """``BlockStored`` as the router decodes it: hashes and token ids left as their msgpack
    bytes, read by one compiled pass over a burst (``router.kv_kernels``)."""

    block_hashes: msgspec.Raw
    parent_block_hash: BlockHash | None
    token_ids: msgspec.Raw
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any | None] | None = None
    group_idx: int | None = None


class RawBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: Annotated[
        list[RawStored | BlockRemoved | AllBlocksCleared], msgspec.Meta(max_length=1 << 16)
    ]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_raw_decoder = msgspec.msgpack.Decoder(RawBatch)
_encoder = msgspec.msgpack.Encoder()


class BadFrame(ValueError):
    """A frame that is not a well-formed, bounded event batch."""


def parse_frame(
    parts: list[bytes], raw: bool = False
) -> tuple[int, KVEventBatch | RawBatch | None]:
    """``(topic, seq, payload)`` -> (seq, batch); the replay's end marker -> (-1, None).
    ``raw``: stores as ``RawStored`` (their arrays checked when read)."""
    if len(parts) != 3:
        raise BadFrame(f"{len(parts)} parts, want 3")
    topic, seq_b, payload = parts
    if len(topic) > MAX_TOPIC or len(seq_b) != 8 or len(payload) > MAX_PAYLOAD:
        raise BadFrame("a frame part over its bound")
    if seq_b == END_SEQ:
        return -1, None
    try:
        return int.from_bytes(seq_b, "big"), (_raw_decoder if raw else _decoder).decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise BadFrame(str(e)) from None


def encode_batch(events: list[Event], dp_rank: int | None = None) -> bytes:
    return _encoder.encode(KVEventBatch(time.time(), events, dp_rank))


class EventPublisher:
    """vLLM's ZMQ publisher protocol for pdxfer's workers: PUB ``endpoint``, and a replay
    ROUTER at ``replay_endpoint`` over the last ``buffer`` batches. Thread-safe."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer: int = 10_000,
    ) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = topic.encode()
        self._buf: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer)
        self._seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.replay_endpoint: str | None = None
        self._thread: threading.Thread | None = None
        if replay_endpoint:
            self._rep = self._ctx.socket(zmq.ROUTER)
            self._rep.setsockopt(zmq.LINGER, 0)
            self._rep.bind(replay_endpoint)
            self.replay_endpoint = self._rep.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(
                target=self._serve_replay, daemon=True, name="pdxfer-kv-replay"
            )
            self._thread.start()

    def publish(self, events: list[Event], skip: bool = False) -> int:
        """Send one batch; ``skip`` (tests) numbers and buffers it but does not send it."""
        payload = encode_batch(events)
        with self._lock:
            seq, self._seq = self._seq, self._seq + 1
            self._buf.append((seq, payload))
            if not skip:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        return seq

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self._rep.poll(100):
                continue
            parts = self._rep.recv_multipart()
            if len(parts) != 3 or len(parts[2]) != 8:
                continue
            who, start = parts[0], int.from_bytes(parts[2], "big")
            with self._lock:
                frames = [(s, p) for s, p in self._buf if s >= start]
            for s, p in frames:
                self._rep.send_multipart((who, b"", self._topic, s.to_bytes(8, "big"), p))
            self._rep.send_multipart((who, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._rep.close(0)
        self._pub.close(0)
