"""The bootstrap server under attack: replayed signed
requests, a second live endpoint claiming a slot, routes that must heal, malformed signature
headers and stalled connections. Attacks come as raw HTTP from this process."""

from __future__ import annotations

import json
import resource
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from pdxfer import BootstrapClient, BootstrapServer, Endpoint, EndpointConfig, Limits, trust
from pdxfer.agents import patterns as pat
from pdxfer.agents.patterns import PoolGeom
from pdxfer.bootstrap import Registration
from pdxfer.transport import MemoryTransport

SECRET = "bootstrap-secret-for-tests-0123456789"
GEOMS = [PoolGeom("kv", "mha", layers=1, pages=4, page_size=4, heads=1, head_dim=8)]


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    s = BootstrapServer("127.0.0.1", 0, secret=SECRET).start()
    yield s
    s.stop()


def raw(
    server: BootstrapServer, method: str, path: str, body: bytes, headers: dict[str, str]
) -> int:
    req = urllib.request.Request(
        f"http://{server.address}{path}", data=body or None, method=method, headers=headers
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def reg(eid: str, addr: str) -> Registration:
    return Registration(
        instance="inst", endpoint_id=eid, ctrl_addr=addr, session="s:1", signature="sig"
    )


def test_a_replayed_signed_registration_is_refused(server: BootstrapServer) -> None:
    body = json.dumps(
        {
            "instance": "inst",
            "endpoint_id": "e1",
            "ctrl_addr": "tcp://127.0.0.1:9",
            "session": "s:1",
            "signature": "sig",
        }
    ).encode()
    headers = {
        "Content-Type": "application/json",
        **trust.http_headers(SECRET.encode(), "PUT", "/register", body),
    }
    assert raw(server, "PUT", "/register", body, headers) == 200
    assert raw(server, "PUT", "/register", body, headers) == 401  # the same capture again


def test_a_live_slot_is_not_taken_over_and_a_dead_one_is(server: BootstrapServer) -> None:
    live = socket.socket()
    live.bind(("127.0.0.1", 0))
    live.listen(8)  # the first endpoint's control socket answers
    port = live.getsockname()[1]
    client = BootstrapClient(server.address, secret=SECRET, retries=0)
    client.register(reg("first", f"tcp://127.0.0.1:{port}"))
    with pytest.raises(Exception) as e:
        client.register(reg("second", "tcp://127.0.0.1:1"))
    assert "409" in str(e.value) and "first" in str(e.value)
    assert client.route(0, "inst")["endpoints"][0]["endpoint_id"] == "first"
    live.close()  # the first endpoint died: a restarted rank takes its slot
    client.register(reg("second", "tcp://127.0.0.1:1"))
    assert client.route(0, "inst")["endpoints"][0]["endpoint_id"] == "second"


def test_a_prefill_registers_again_so_a_lost_route_heals(server: BootstrapServer) -> None:
    specs, tensors = pat.build(GEOMS)
    ep = Endpoint(
        EndpointConfig(
            role="prefill",
            bootstrap=server.address,
            instance="heal",
            secret=SECRET,
            limits=Limits(register_interval_s=0.2),
        ),
        specs,
        transport=MemoryTransport(),
    )
    try:
        client = BootstrapClient(server.address, secret=SECRET, retries=0)
        client.deregister(ep.endpoint_id)  # the route is lost (bootstrap restart, bad actor)
        end = time.monotonic() + 30  # re-registers every 0.2 s: a bound, not a stopwatch
        while True:
            try:
                if client.route(0, "heal")["endpoints"][0]["endpoint_id"] == ep.endpoint_id:
                    break
            except Exception:
                pass
            assert time.monotonic() < end, "the route never came back"
            time.sleep(0.05)
    finally:
        ep.close()
        del tensors


@pytest.mark.parametrize("sig", ["\u00e9\u00e9\u00e9", "zz", "x" * 5000])
def test_a_malformed_signature_header_is_a_401(server: BootstrapServer, sig: str) -> None:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    nonce = "0" * 24
    req = (
        f"GET /route?room=1 HTTP/1.1\r\nHost: x\r\nX-Pdxfer-Time: {time.time():.3f}\r\n"
        f"X-Pdxfer-Nonce: {nonce}\r\nX-Pdxfer-Signature: {sig}\r\nConnection: close\r\n\r\n"
    )
    s.sendall(req.encode("utf-8"))
    head = s.recv(100).decode("latin-1")
    s.close()
    assert head.startswith("HTTP/1.1 401"), head


def test_stalled_connections_do_not_starve_lookups(server: BootstrapServer) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096:  # 1,100 client sockets plus the server's own, in this one process
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    stalled = []
    try:
        for _ in range(1100):
            c = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            stalled.append(c)
            try:
                c.sendall(b"GET /health HTTP/1.1\r\n")  # a request that never finishes
            except OSError:
                pass  # the server already dropped it to make room: that is the point
        client = BootstrapClient(server.address, secret=SECRET, timeout=5, retries=2)
        client.register(reg("e", "tcp://127.0.0.1:1"))
        assert client.route(0, "inst")["endpoints"][0]["endpoint_id"] == "e"
    finally:
        for c in stalled:
            c.close()
