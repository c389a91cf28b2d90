"""A control-plane flood for the trust tests and ``benchmarks/flood.py``.

A secured prefill and decode (real processes, one shared secret) serve legitimate requests
while a thread of the driver process floods both control ports with what a third party can
send: oversized frames, unsigned and forged frames (wrong MACs, unknown pairs), and frames
with a valid MAC replayed over and over (captured from a session the flooder opened itself
with the secret, which is the strongest replay source there is). Nothing here is needed by an
engine.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from pdxfer import trust, wire
from pdxfer.agents import patterns as pat
from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent
from pdxfer.bootstrap import BootstrapServer
from pdxfer.pools import layout_signature

from .zmqctx import context

SECRET = "flood test shared secret, 16+ bytes"
GEOMS = [
    PoolGeom("kv", "mha", layers=2, pages=256, page_size=16, heads=2, head_dim=32),
    PoolGeom("aux", "slots", layers=1, pages=64, dim=8, dtype="int32"),
]
CONF = {
    "bootstrap_timeout_s": 10.0,
    "transfer_timeout_s": 20.0,
    "abort_timeout_s": 2.0,
    "heartbeat_s": 0.25,
}


@dataclass
class Cluster:
    srv: BootstrapServer
    pf: Agent
    dc: Agent
    rooms: Iterator[int] = field(default_factory=lambda: iter(range(1, 1 << 40)))

    def close(self) -> None:
        self.pf.close()
        self.dc.close()
        self.srv.stop()


def start() -> Cluster:
    srv = BootstrapServer(secret=SECRET).start()
    pf = Agent("prefill", {**CONF, "bootstrap": srv.address, "secret": SECRET}, GEOMS)
    dc = Agent("decode", {**CONF, "secret": SECRET}, GEOMS)
    return Cluster(srv, pf, dc)


def legit(c: Cluster, n_tokens: int = 96, seed: int = 0) -> tuple[float, int]:
    """One legitimate request end to end; (seconds, bytes that differ from the pattern)."""
    rng = np.random.default_rng(seed)
    room = next(c.rooms)
    pages = -(-n_tokens // 16)
    src = rng.choice(256, pages, replace=False).tolist()
    dst = rng.choice(256, pages, replace=False).tolist()
    ss, ds = int(rng.integers(64)), int(rng.integers(64))
    c.pf.call(
        "prepare",
        items=[{"room": room, "pages": {"kv": src}, "slots": {"aux": ss}, "num_tokens": n_tokens}],
    )
    t0 = time.perf_counter()
    c.dc.call(
        "recv",
        items=[{"room": room, "dst": {"kv": dst}, "slots": {"aux": ds}, "num_tokens": n_tokens}],
        bootstrap=c.srv.address,
    )
    c.pf.call(
        "send",
        items=[
            {"room": room, "chunks": [{"pages": {"kv": src}, "slots": {"aux": ss}, "last": True}]}
        ],
    )
    out = c.dc.call("wait", rooms=[room])[room]
    dt = time.perf_counter() - t0
    if out["state"] != "Success":
        raise AssertionError(f"legitimate room {room} failed: {out['failure']}")
    bad = c.dc.call(
        "verify",
        items=[{"room": room, "dst": {"kv": dst}, "slots": {"aux": ds}, "num_tokens": n_tokens}],
    )[room][0]
    c.pf.call("forget", rooms=[room])
    c.dc.call("forget", rooms=[room])
    return dt, int(bad)


class Flooder:
    """Floods ``targets`` from a thread until ``stop()``; counts what it sent by kind."""

    def __init__(self, pf_addr: str, dc_addr: str, pf_id: str) -> None:
        self.ctx = context()
        self.sent: dict[str, int] = {}
        self._stop = threading.Event()
        self._pf, self._dc = pf_addr, dc_addr
        try:
            self._frames = self._make(pf_id)
        except BaseException:
            self.ctx.destroy()
            raise
        self._thread = threading.Thread(target=self._run, name="flooder", daemon=True)

    def _make(self, pf_id: str) -> list[tuple[str, str, bytes]]:
        """(kind, target, frame) to cycle through."""
        specs, _ = pat.build(GEOMS[:1])
        rnd = os.urandom
        small = [
            (
                "unsigned",
                wire.encode(
                    wire.TransferRequest(
                        room=1,
                        nonce=1,
                        endpoint_id="x",
                        dst={"kv": wire.pack_indices([1])},
                        slots={},
                        prefix_len=0,
                        num_tokens=16,
                    )
                ),
            ),
            ("unsigned", wire.encode(wire.Abort(room=2, nonce=2, endpoint_id="x"))),
            (
                "forged_mac",
                wire.frame(
                    wire.payload(wire.Release(room=3, nonce=3)),
                    wire.Release,
                    wire.SESSION,
                    rnd(16),
                    7,
                    rnd(32),
                ),
            ),
            (
                "forged_hello",
                wire.frame(
                    wire.payload(
                        wire.Hello(
                            endpoint_id="x",
                            ctrl_addr="tcp://127.0.0.1:1",
                            session="127.0.0.1:1",
                            tp_rank=0,
                            tp_size=1,
                            signature=layout_signature(specs),
                            pools=tuple(specs),
                        )
                    ),
                    wire.Hello,
                    wire.HELLO,
                    rnd(16),
                    0,
                    rnd(32),
                ),
            ),
        ]
        out = [(k, self._pf, f) for k, f in small]
        out += [
            (
                "unsigned",
                self._dc,
                wire.encode(wire.TransferDone(room=4, nonce=4, endpoint_id=pf_id, rank=0, ok=True)),
            ),
            (
                "forged_mac",
                self._dc,
                wire.frame(
                    wire.payload(wire.AbortAck(room=5, nonce=5)),
                    wire.AbortAck,
                    wire.SESSION,
                    rnd(16),
                    9,
                    rnd(32),
                ),
            ),
            (
                "forged_ack",
                self._dc,
                wire.frame(
                    wire.payload(wire.HelloAck(endpoint_id=pf_id, ok=True, session="127.0.0.1:1")),
                    wire.HelloAck,
                    wire.ACK,
                    rnd(16),
                    0,
                    rnd(32),
                ),
            ),
        ]
        big = wire.frame(b"\0" * (wire.MAX_HELLO + 1), wire.Hello)
        out += [
            ("oversized", self._pf, big),
            ("oversized", self._dc, wire.frame(b"\0" * (wire.MAX_HELLO + 1), wire.HelloAck)),
        ]
        out += [("replayed", self._pf, f) for f in self._captured(pf_id)]
        return out

    def _captured(self, pf_id: str) -> list[bytes]:
        """Frames with a valid MAC from a session opened with the secret: their replays must
        all be refused (the first copy of each is sent once, here)."""
        key = trust.load_secret(SECRET)
        assert key is not None
        pull = self.ctx.socket(zmq.PULL)
        addr = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
        push = self.ctx.socket(zmq.PUSH)
        push.connect(self._pf)
        pair = os.urandom(16)
        specs, keep = pat.build(GEOMS)
        self._keep = keep
        try:
            hello = wire.Hello(
                endpoint_id="replayer",
                ctrl_addr=addr,
                session="127.0.0.1:1",
                tp_rank=0,
                tp_size=1,
                signature=layout_signature(specs),
                pools=tuple(specs),
                ts=time.time(),
                to=pf_id,
            )
            push.send(
                wire.frame(
                    wire.payload(hello), wire.Hello, wire.HELLO, pair, 0, trust.hello_key(key)
                )
            )
            assert pull.poll(5000), "no HelloAck for the replay session"
            ack = pull.recv()
            msg = wire.body(ack, wire.header(ack))
            assert isinstance(msg, wire.HelloAck) and msg.ok, msg
            d2p, _ = trust.session_keys(key, pair, msg.nonce, "replayer", msg.endpoint_id)
            frames = [
                wire.frame(
                    wire.payload(wire.Release(room=9, nonce=9, endpoint_id="replayer")),
                    wire.Release,
                    wire.SESSION,
                    pair,
                    i + 1,
                    d2p,
                )
                for i in range(4)
            ]
            for f in frames:
                push.send(f)
            return frames
        finally:
            push.close(0)
            pull.close(0)

    @classmethod
    def for_cluster(cls, c: Cluster) -> Flooder:
        return cls(c.pf.info["ctrl_addr"], c.dc.info["ctrl_addr"], str(c.pf.info["endpoint_id"]))

    def start(self) -> Flooder:
        self._thread.start()
        return self

    def _run(self) -> None:
        socks: dict[str, zmq.Socket] = {}
        for addr in (self._pf, self._dc):
            s = socks[addr] = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, 2000)
            s.connect(addr)
        i = 0
        try:
            while not self._stop.is_set():
                kind, addr, f = self._frames[i % len(self._frames)]
                i += 1
                if kind == "oversized" and i % 50:
                    continue  # a 1 MB frame now and then; small ones the rest of the time
                try:
                    socks[addr].send(f, zmq.NOBLOCK, copy=False)
                    self.sent[kind] = self.sent.get(kind, 0) + 1
                except zmq.Again:
                    time.sleep(0.0005)  # the target is behind: keep it saturated, not us
        finally:
            for s in socks.values():
                s.close(0)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join(timeout=10)
        self.ctx.term()  # thread-safe (destroy is not): a sender still running gets ETERM
        return dict(self.sent)


def flood_run(c: Cluster, seconds: float) -> dict[str, Any]:
    """Legitimate requests for ``seconds`` under flood: latencies, bad bytes, RSS growth."""
    rss0 = {n: a.call("proc_stats")["rss"] for n, a in (("pf", c.pf), ("dc", c.dc))}
    fl = Flooder.for_cluster(c).start()
    lat: list[float] = []
    bad = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            dt, b = legit(c, seed=len(lat))
            lat.append(dt)
            bad += b
    finally:
        sent = fl.stop()
    out: dict[str, Any] = {"latencies": lat, "bad_bytes": bad, "sent": sent}
    for n, a in (("pf", c.pf), ("dc", c.dc)):
        out[f"rss_growth_{n}"] = a.call("proc_stats")["rss"] - rss0[n]
        out[f"rejected_{n}"] = {
            k: v for k, v in a.call("metrics").items() if k.startswith("rejected_")
        }
    return out


def _metric(a: Agent, name: str) -> int:
    return int(a.call("metrics").get(name, 0))


def hello_floods(
    c: Cluster, floods: int = 8, frames: int = 80, size: int = 2 << 20
) -> dict[str, Any]:
    """``floods`` floods in a row of ``frames`` unauthenticated Hellos of ``size`` bytes each
    (over the Hello cap, under the frame cap) at the prefill, each flood followed by one
    legitimate request once the prefill refused all of it. Reports the prefill's RSS (read
    from ``/proc``) before the first flood, after the last and the highest seen between."""
    legit(c, seed=2000)  # the pair is up and warm
    rss = lambda: int(c.pf.call("proc_stats")["rss"])  # noqa: E731
    rss0 = peak = rss()
    big = wire.frame(bytes(size), wire.Hello, wire.HELLO, os.urandom(16), 0, os.urandom(32))
    before = _metric(c.pf, "rejected_oversized")
    ctx = context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, frames + 1)
    push.connect(c.pf.info["ctrl_addr"])
    lat: list[float] = []
    bad = 0
    t0 = time.perf_counter()
    try:
        for i in range(floods):
            for _ in range(frames):
                push.send(big, copy=False)
            want, end = before + (i + 1) * frames, time.monotonic() + 120
            while _metric(c.pf, "rejected_oversized") < want:
                if time.monotonic() > end:
                    raise AssertionError(f"flood {i}: the prefill did not refuse every Hello")
                peak = max(peak, rss())
                time.sleep(0.05)
            dt, b = legit(c, seed=3000 + i)
            lat.append(dt)
            bad += b
    finally:
        ctx.destroy()
    seconds = time.perf_counter() - t0
    return {
        "rss_before": rss0,
        "rss_after": rss(),
        "rss_peak": peak,
        "bytes": floods * frames * len(big),
        "seconds": seconds,
        "latencies": lat,
        "bad_bytes": bad,
    }
