"""Wire round trips and rejections; pool validation and layout signatures."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from pdxfer import BufferSpec, ConfigError, PoolSpec, WireError, wire
from pdxfer.pools import check_pair, check_pools, layout_signature

# -- wire ---------------------------------------------------------------------------------


def req(**kw: object) -> wire.TransferRequest:
    base = dict(
        room=42,
        nonce=7,
        endpoint_id="d0",
        dst={"kv": wire.pack_indices([3, 1, 2])},
        slots={"aux": 1},
        prefix_len=0,
        num_tokens=40,
    )
    base.update(kw)
    return wire.TransferRequest(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "msg",
    [
        req(),
        wire.TransferDone(room=1, nonce=2, endpoint_id="p", rank=0, ok=False, reason="x" * 100),
        wire.Abort(room=(1 << 63) - 1, nonce=0, reason="r", endpoint_id="d"),
        wire.AbortAck(room=5, nonce=6, known=False),
        wire.Release(room=5, nonce=6),
        wire.HelloAck(endpoint_id="p", ok=False, reason="nope"),
    ],
)
def test_every_message_round_trips(msg: wire.Msg) -> None:
    assert wire.decode(wire.encode(msg)) == msg


def test_packed_indices_round_trip() -> None:
    idx = np.array([0, 5, 2**31 - 1, 7])
    assert (wire.unpack_indices(wire.pack_indices(idx)) == idx).all()
    with pytest.raises(WireError):
        wire.pack_indices([-1])


def _f(payload: bytes, kind: type = wire.Abort) -> bytes:
    return wire.frame(payload, kind)


@pytest.mark.parametrize(
    "frame,why",
    [
        (b"", "magic"),
        (b"XYZ\x01abc", "magic"),
        (wire.MAGIC + b"\x09" + b"\x80", "version"),
        (wire.MAGIC + bytes([wire.PROTOCOL_VERSION]) + b"\x80", "shorter than its header"),
        (_f(b"\xc1"), "malformed"),
        (_f(msgspec.msgpack.encode({"type": "Nope"})), "invalid"),
        (_f(msgspec.msgpack.encode({"type": "Abort", "room": -1, "nonce": 0})), "invalid"),
        (
            _f(msgspec.msgpack.encode({"type": "Abort", "room": 1, "nonce": 0, "extra": 1})),
            "invalid",
        ),
        (_f(msgspec.msgpack.encode({"type": "Abort", "room": "1", "nonce": 0})), "invalid"),
        (
            _f(msgspec.msgpack.encode({"type": "Release", "room": 1, "nonce": 0})),
            "header says Abort",
        ),
        (_f(msgspec.msgpack.encode({"type": "Abort", "room": 1, "nonce": 0}))[:-1], "arrived"),
        (_f(b"\x00" * (wire.MAX_SMALL + 1)), "exceeds"),
        (_f(b"\x00" * (wire.MAX_HELLO + 1), wire.Hello), "exceeds"),
    ],
)
def test_malformed_frames_are_rejected_with_a_reason(frame: bytes, why: str) -> None:
    with pytest.raises(WireError, match=why):
        wire.decode(frame)


def test_request_with_prefix_beyond_tokens_is_rejected() -> None:
    frame = wire.encode(req())
    raw = msgspec.msgpack.decode(frame[wire.HEADER_LEN :])
    raw["prefix_len"] = 100
    with pytest.raises(WireError, match="prefix_len"):
        wire.decode(wire.frame(msgspec.msgpack.encode(raw), wire.TransferRequest))


def test_request_with_torn_packed_indices_is_rejected() -> None:
    frame = wire.encode(req())
    raw = msgspec.msgpack.decode(frame[wire.HEADER_LEN :])
    raw["dst"] = {"kv": b"\x01\x02\x03"}
    with pytest.raises(WireError, match="multiple of 4"):
        wire.decode(wire.frame(msgspec.msgpack.encode(raw), wire.TransferRequest))


# -- pools --------------------------------------------------------------------------------


def mha(
    heads: int = 2,
    dim: int = 8,
    dtype: torch.dtype = torch.float16,
    ps: int = 16,
    layers: int = 2,
    **kw: object,
) -> PoolSpec:
    k = [torch.zeros(8, ps, heads, dim, dtype=dtype) for _ in range(layers)]
    v = [torch.zeros_like(k[0]) for _ in range(layers)]
    spec = PoolSpec.mha("kv", k, v, page_size=ps, **kw)  # type: ignore[arg-type]
    mha.keep.append((k, v))  # type: ignore[attr-defined]
    return spec


mha.keep = []  # type: ignore[attr-defined]


def test_mha_spec_describes_its_tensors() -> None:
    s = mha(heads=4, dim=16, ps=16)
    assert s.item_bytes == 16 * 4 * 16 * 2 and s.num_items == 8 and s.token_bytes == 4 * 16 * 2
    assert [b.role for b in s.buffers] == ["k", "k", "v", "v"]
    assert s.sharding.head_bytes == 32 and s.dtype == "float16"


def test_layout_signature_is_stable_and_sensitive() -> None:
    a, b = mha(), mha()
    assert layout_signature([a]) == layout_signature([b])
    assert layout_signature([a]) != layout_signature([mha(dim=16)])
    assert layout_signature([a]) != layout_signature([mha(dtype=torch.bfloat16)])
    # TP split, page size and layer count do not change what pairs
    assert layout_signature([a]) == layout_signature([mha(ps=1, page_remap=True)])


@pytest.mark.parametrize(
    "other,needle",
    [
        (lambda: mha(dim=16), "head size"),
        (lambda: mha(dtype=torch.bfloat16), "dtype"),
        (lambda: mha(ps=32), "page_size"),
    ],
)
def test_mismatch_names_what_differs(other, needle: str) -> None:
    why = check_pair(mha(), other())
    assert why is not None and needle in why


def test_missing_pool_is_refused_unless_optional() -> None:
    kv = mha()
    rows = [torch.zeros(4, 16)]
    aux = PoolSpec.slots("aux", rows)
    why = check_pools([kv, aux], [kv])
    assert why is not None and "'aux'" in why
    assert check_pools([kv, aux.with_(optional=True)], [kv]) is None


def test_inconsistent_specs_are_refused_at_construction() -> None:
    with pytest.raises(ConfigError):
        PoolSpec.mha("kv", [torch.zeros(8, 16, 2, 8)], [torch.zeros(8, 32, 2, 8)], page_size=16)
    with pytest.raises(ConfigError):
        PoolSpec.mha("kv", [torch.zeros(8, 16, 2, 8)], [torch.zeros(8, 16, 2, 8)], page_size=8)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(
            {
                "name": "kv",
                "kind": "paged",
                "buffers": [{"addr": 4096, "nbytes": 10, "layer_id": 0, "role": "k"}],
                "item_bytes": 64,
                "num_items": 4,
            },
            PoolSpec,
        )


@pytest.mark.parametrize(
    "buf",
    [
        dict(addr=1 << 120, nbytes=64, layer_id=0, role="k"),
        dict(addr=-1, nbytes=64, layer_id=0, role="k"),
        dict(addr=4096, nbytes=0, layer_id=0, role="k"),
        dict(addr=4096, nbytes=64, layer_id=-1, role="k"),
    ],
)
def test_specs_built_in_code_are_held_to_the_wire_bounds(buf: dict) -> None:
    """An engine's own spec gets the bounds a decoded one gets (msgspec checks Meta only when
    it decodes): no address past 2^63, no empty buffer, no negative layer."""
    with pytest.raises(ValueError):
        BufferSpec(**buf)
    with pytest.raises(ValueError):
        PoolSpec("kv", "paged", (), item_bytes=64, num_items=-1)


# -- frame authentication -------------------------------------------------------------------


def test_replay_window_accepts_each_counter_once_out_of_order_but_not_too_old() -> None:
    from pdxfer.trust import ReplayWindow

    w = ReplayWindow()
    assert not w.accept(0)  # counters start at 1
    assert w.accept(5) and w.accept(3) and w.accept(4)  # threads may interleave
    assert not w.accept(5) and not w.accept(3)  # each once
    assert w.accept(10_000)
    assert not w.accept(10_000 - ReplayWindow.SIZE)  # too old to tell: refused
    assert w.accept(10_000 - ReplayWindow.SIZE + 1)


def test_the_replay_guard_accepts_each_nonce_once_within_its_window_and_stays_bounded() -> None:
    """One guard serves signed HTTP requests (full: the oldest tenth go) and Hellos (full:
    refused); a nonce is accepted once while its timestamp could still pass, and a nonce
    seen with the same tag is a retransmission."""
    from pdxfer.trust import MAX_SKEW_S, ReplayGuard

    g = ReplayGuard(10, when_full="refuse")
    assert g.check(b"n1", b"mac", now=0.0) == ""
    assert g.check(b"n1", b"mac", now=1.0) == "again"
    assert g.check(b"n1", b"other", now=1.0) == "replay"
    assert g.check(b"n1", now=1.0) == "replay"  # no tag: never a retransmission
    for i in range(2, 11):
        assert g.check(b"n%d" % i, now=2.0) == ""
    assert g.check(b"n11", now=3.0) == "table_full" and len(g) == 10
    later = 2 * MAX_SKEW_S + 1.0  # n1 expired (its timestamp can no longer pass), n2.. not
    assert g.check(b"n1", now=later) == "" and g.check(b"n11", now=later) == "table_full"

    h = ReplayGuard(10, when_full="evict")
    for i in range(10):
        assert h.check(str(i), now=0.0) == ""
    assert h.check("new", now=1.0) == "" and len(h) == 10  # the oldest went
    assert h.check("0", now=1.0) == "" and h.check("5", now=1.0) == "replay"


def test_mac_covers_header_and_payload_and_keys_differ_per_direction_and_pair() -> None:
    from pdxfer import trust

    key = b"k" * 32
    f = wire.frame(
        wire.payload(wire.Release(room=1, nonce=2)), wire.Release, wire.SESSION, b"p" * 16, 7, key
    )
    h = wire.header(f)
    assert wire.verify(f, key, h.mac)
    for i in (3, 6, 10, 30, len(f) - 1):  # mode, length, pair, counter, payload
        g = bytearray(f)
        g[i] ^= 1
        assert not wire.verify(bytes(g), key, h.mac), i
    s = b"a shared secret of 16+ bytes"
    d2p, p2d = trust.session_keys(s, b"p" * 16, b"q" * 16, "d", "p")
    assert d2p != p2d
    assert trust.session_keys(s, b"x" * 16, b"q" * 16, "d", "p")[0] != d2p
    assert trust.session_keys(s, b"p" * 16, b"q" * 16, "e", "p")[0] != d2p
    assert trust.ack_key(s, b"p" * 16) != trust.ack_key(s, b"x" * 16)
