"""Hostile and broken input, generated: no crash, no hang, a clear error where one can be given.

Targets: the wire decoder (random bytes, and structurally valid msgpack with wrong types, huge
lengths, negative and out-of-range values), a live prefill endpoint's message handler (real
transport, real registered memory that must stay untouched), the same with a shared secret
(authenticated frames with wrong MACs, old counters and wrong pairs, and garbage under a valid
MAC), and the bootstrap HTTP API.
"""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.parse
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdxfer import BootstrapServer, Endpoint, EndpointConfig, Limits, WireError, trust, wire
from pdxfer.agents import patterns as pat
from pdxfer.agents.patterns import PoolGeom
from pdxfer.pools import layout_signature
from tests.harness.zmqctx import context

N = 2000
FUZZ = settings(
    max_examples=N, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)
KIND = {k.__name__: k for k in wire.KINDS}


def framed(msg: dict, kind: type | None = None) -> bytes:
    """A plain frame around a msgpack payload (raises for values msgpack cannot carry)."""
    return wire.frame(msgspec.msgpack.encode(msg), kind or KIND.get(msg.get("type"), wire.Abort))


ints = st.one_of(st.integers(-(2**70), 2**70), st.integers(-5, 100))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    ints,
    st.floats(allow_nan=True),
    st.text(max_size=40),
    st.binary(max_size=64),
)
values = st.recursive(
    scalars,
    lambda c: st.one_of(
        st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=4)
    ),
    max_leaves=12,
)
# a few fixed loopback ports: replies to refused requests must stay on this machine, and a
# new socket per random port would measure ZMQ's connect cost instead of our handler
LOOPBACK = st.sampled_from([f"tcp://127.0.0.1:{p}" for p in (1, 9, 65000, 65535)])


def packed(draw_ints: list[int]) -> bytes:
    return np.asarray(draw_ints, dtype=np.int64).astype("<i4").tobytes()


request_like = st.fixed_dictionaries(
    {
        "type": st.just("TransferRequest"),
        "room": ints,
        "nonce": ints,
        "endpoint_id": st.text(max_size=20),
        "dst": st.dictionaries(
            st.sampled_from(["kv", "aux", "nope", ""]),
            st.one_of(
                st.binary(max_size=40), st.lists(st.integers(-10, 10**6), max_size=30).map(packed)
            ),
            max_size=3,
        ),
        "slots": st.dictionaries(st.sampled_from(["aux", "kv", "x"]), ints, max_size=2),
        "prefix_len": ints,
        "num_tokens": ints,
    },
    optional={
        "reply_to": st.one_of(LOOPBACK, st.text(max_size=30)),  # no longer a field
        "expected_senders": ints,
        "decode_peers": ints,
        "deadline_s": scalars,
        "hold_for_repair": scalars,
        "extra": values,
    },
)
other_like = st.fixed_dictionaries(
    {
        "type": st.sampled_from(
            ["Hello", "HelloAck", "TransferDone", "Abort", "AbortAck", "Release", "Unknown", ""]
        ),
    },
    optional={
        "room": ints,
        "nonce": ints,
        "endpoint_id": values,
        "ctrl_addr": values,
        "reply_to": st.one_of(LOOPBACK, values),
        "pools": values,
        "ok": values,
        "session": values,
        "signature": values,
        "tp_rank": ints,
        "tp_size": ints,
        "rank": ints,
        "bytes": ints,
        "reason": values,
    },
)
messages = st.one_of(request_like, other_like)


@FUZZ
@given(st.binary(max_size=300))
def test_decoder_survives_random_bytes(data: bytes) -> None:
    for frame in (
        data,
        wire.frame(data, wire.TransferRequest),
        wire.encode(wire.Release(room=1, nonce=2))[: wire.HEADER_LEN] + data,
    ):
        try:
            wire.decode(frame)
        except WireError:
            pass


@FUZZ
@given(messages)
def test_decoder_rejects_or_validates_structured_garbage(msg: dict) -> None:
    try:
        frame = framed(msg)
    except (OverflowError, TypeError):
        return  # not representable in msgpack: a peer cannot send it either
    try:
        out = wire.decode(frame)
    except WireError:
        return
    # accepted: then every field is in range
    if isinstance(out, wire.TransferRequest):
        assert 0 <= out.room < 2**63 and 0 <= out.prefix_len <= out.num_tokens
        assert all(len(v) % 4 == 0 for v in out.dst.values())


GEOMS = [
    PoolGeom("kv", "mha", layers=2, pages=32, page_size=16, heads=2, head_dim=8),
    PoolGeom("aux", "slots", layers=1, pages=8, dim=8, dtype="int32"),
]


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[Endpoint, Endpoint, dict]]:
    """A prefill endpoint, and a decode endpoint whose memory the fuzzed requests target."""
    ps, pt = pat.build(GEOMS)
    ds, dt = pat.build(GEOMS)
    pat.fill_sentinel(dt)
    pf = Endpoint(EndpointConfig(role="prefill", limits=Limits(bootstrap_timeout_s=0.5)), ps)
    dc = Endpoint(EndpointConfig(role="decode"), ds)
    hello = wire.Hello(
        endpoint_id=dc.endpoint_id,
        ctrl_addr=dc.ctrl_addr,
        session=dc.transport.session_id,
        tp_rank=0,
        tp_size=1,
        signature=layout_signature(ds),
        pools=tuple(ds),
    )
    pf.core._on_frame(wire.encode(hello))
    yield pf, dc, {"specs": ds, "tensors": dt, "keep": (pt, ps)}
    pf.close()
    dc.close()


@FUZZ
@given(messages, st.booleans())
def test_prefill_handler_never_crashes_and_never_writes_outside_a_request(
    live, msg: dict, as_known_peer: bool
) -> None:
    pf, dc, mem = live
    if as_known_peer and msg.get("type") == "TransferRequest":
        msg = {k: v for k, v in msg.items() if k != "reply_to"}
        msg["endpoint_id"] = dc.endpoint_id
    try:
        frame = framed(msg)
    except (OverflowError, TypeError):
        return
    errors = pf.core.control.handler_errors
    pf.core._on_frame(frame)  # must not raise
    assert pf.core.control.handler_errors == errors
    # no sender exists for these rooms, so nothing may have been written to the decode
    assert pf.transport.stats.calls == 0


def test_fuzzed_prefill_endpoint_left_memory_and_tables_clean(live) -> None:
    pf, dc, mem = live
    for spec in mem["specs"]:
        assert pat.untouched(spec, mem["tensors"][spec.name], []) == 0
    # pending orphan requests expire at the (short) bootstrap deadline
    import time

    end = time.monotonic() + 30  # a bound on the wait for the event, not a stopwatch
    while pf.metrics()["pending_requests"] and time.monotonic() < end:
        time.sleep(0.05)
    assert pf.metrics()["pending_requests"] == 0


SECRET = b"a fuzzing secret of 16+ bytes"


class Forger:
    """A decode that holds the secret and completed a real handshake with ``pf``: it can make
    frames with a valid MAC, and break them on purpose."""

    def __init__(self, pf: Endpoint, specs: list) -> None:
        self.ctx = context()
        try:
            self._handshake(pf, specs)
        except BaseException:
            self.ctx.destroy()
            raise

    def _handshake(self, pf: Endpoint, specs: list) -> None:
        self.pull = self.ctx.socket(zmq.PULL)
        self.addr = f"tcp://127.0.0.1:{self.pull.bind_to_random_port('tcp://127.0.0.1')}"
        self.pair = os.urandom(16)
        hello = wire.Hello(
            endpoint_id="forger",
            ctrl_addr=self.addr,
            session="127.0.0.1:2",
            tp_rank=0,
            tp_size=1,
            signature=layout_signature(specs),
            pools=tuple(specs),
            ts=time.time(),
            to=pf.endpoint_id,
        )
        pf.core._on_frame(
            wire.frame(
                wire.payload(hello), wire.Hello, wire.HELLO, self.pair, 0, trust.hello_key(SECRET)
            )
        )
        assert self.pull.poll(5000), "no HelloAck"
        ack = self.pull.recv()
        h = wire.header(ack)
        assert wire.verify(ack, trust.ack_key(SECRET, self.pair), h.mac)
        msg = wire.body(ack, h)
        assert isinstance(msg, wire.HelloAck) and msg.ok, msg
        self.key, _ = trust.session_keys(SECRET, self.pair, msg.nonce, "forger", pf.endpoint_id)
        self.counter = 0

    def seal(
        self,
        payload: bytes,
        kind: type,
        counter: int | None = None,
        pair: bytes | None = None,
        key: bytes | None = None,
    ) -> bytes:
        if counter is None:
            self.counter += 1
            counter = self.counter
        return wire.frame(payload, kind, wire.SESSION, pair or self.pair, counter, key or self.key)

    def close(self) -> None:
        self.ctx.destroy()


@pytest.fixture(scope="module")
def secured_live() -> Iterator[tuple[Endpoint, Forger]]:
    ps, pt = pat.build(GEOMS)
    ds, _ = pat.build(GEOMS)
    pf = Endpoint(
        EndpointConfig(
            role="prefill", limits=Limits(bootstrap_timeout_s=0.5), secret=SECRET.decode()
        ),
        ps,
    )
    try:
        f = Forger(pf, ds)
        try:
            yield pf, f
        finally:
            f.close()
    finally:
        pf.close()


@FUZZ
@given(
    messages,
    st.sampled_from(["wrong_mac", "old_counter", "replay", "wrong_pair", "unsigned", "valid_mac"]),
)
def test_authenticated_frames_with_a_wrong_mac_counter_or_pair_change_nothing(
    secured_live, msg: dict, how: str
) -> None:
    pf, f = secured_live
    msg = {k: v for k, v in msg.items() if k != "reply_to"}
    try:
        payload = msgspec.msgpack.encode(msg)
    except (OverflowError, TypeError):
        return
    kind = KIND.get(msg.get("type"), wire.Release)
    if how == "valid_mac":  # garbage under a valid MAC: decoded, then refused or handled
        pf.core._on_frame(f.seal(payload, kind))
        assert pf.core.control.handler_errors == 0
        assert pf.transport.stats.calls == 0
        return
    # under the endpoint's lock: its own timers (an earlier example's parked ask
    # expiring) cannot change the tables between the two looks; only the frame could
    with pf.core.lock:
        before = pf.metrics()
        tables = pf.tables()
        if how in ("replay", "old_counter"):
            ok = f.seal(
                wire.payload(wire.Release(room=1, nonce=1, endpoint_id="forger")), wire.Release
            )
            pf.core._on_frame(ok)  # admitted (a stale Release), then replayed or outrun
            before = pf.metrics()
            frame = (
                ok if how == "replay" else f.seal(payload, kind, counter=max(1, f.counter - 5000))
            )
            if how == "old_counter":
                f.counter += 5000  # the window has moved on: anything 4096 behind is old
                pf.core._on_frame(f.seal(wire.payload(wire.Release(room=1, nonce=1)), wire.Release))
                before = pf.metrics()
                frame = f.seal(payload, kind, counter=f.counter - 4097)
        elif how == "wrong_mac":
            frame = f.seal(payload, kind, key=os.urandom(32))
        elif how == "wrong_pair":
            frame = f.seal(payload, kind, pair=os.urandom(16))
        else:
            frame = wire.frame(payload, kind)
        pf.core._on_frame(frame)
        after = pf.metrics()
        reason = {
            "wrong_mac": "bad_mac",
            "old_counter": "replay",
            "replay": "replay",
            "wrong_pair": "unknown_pair",
            "unsigned": "unsigned",
        }[how]
        if how != "replay" and kind not in pf.core.handlers:  # refused on its kind first
            reason = "unexpected"
        if how != "replay" and len(payload) > wire.cap(kind):
            reason = "oversized"
        assert after.get(f"rejected_{reason}", 0) == before.get(f"rejected_{reason}", 0) + 1, how
        assert after["wire_rejected"] == before.get("wire_rejected", 0) + 1
        assert pf.tables() == tables
        assert pf.transport.stats.calls == 0


@pytest.fixture(scope="module")
def server() -> Iterator[BootstrapServer]:
    s = BootstrapServer().start()
    yield s
    s.stop()


_conn: dict[str, http.client.HTTPConnection] = {}


def _http(server: BootstrapServer, method: str, path: str, body: bytes | None) -> int:
    """One request over a kept-alive connection (2,000 fresh connections cost most of a run)."""
    for attempt in range(2):
        c = _conn.get(server.address)
        if c is None:
            c = _conn[server.address] = http.client.HTTPConnection(
                *server.address.split(":"), timeout=5
            )
        try:
            c.request(method, path, body=body)
            r = c.getresponse()
            data = r.read()
        except (http.client.HTTPException, OSError):
            c.close()
            _conn.pop(server.address, None)
            if attempt:
                raise
            continue
        if r.status >= 400:
            assert "error" in json.loads(data), "a refusal must say why"
        return r.status
    raise AssertionError("unreachable")


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=200),
        values.map(lambda v: json.dumps(v, default=str).encode()),
        st.fixed_dictionaries(
            {
                "instance": values,
                "endpoint_id": values,
                "ctrl_addr": values,
                "session": values,
                "signature": values,
            },
            optional={
                "tp_rank": ints,
                "tp_size": ints,
                "dp_rank": ints,
                "dp_size": ints,
                "pp_rank": ints,
                "pp_size": ints,
            },
        ).map(lambda d: json.dumps(d, default=str).encode()),
    )
)
def test_bootstrap_registration_answers_4xx_or_200_never_5xx(server, body: bytes) -> None:
    code = _http(server, "PUT", "/register", body)
    assert code in (200, 400, 409)


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(["room", "dp", "instance", "x"]),
        st.one_of(st.text(max_size=30), ints.map(str)),
        max_size=4,
    )
)
def test_bootstrap_route_answers_4xx_200_or_503_never_5xx(server, query: dict) -> None:
    code = _http(server, "GET", "/route?" + urllib.parse.urlencode(query), None)
    assert code in (200, 400, 404, 503)
