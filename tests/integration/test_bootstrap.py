"""The HTTP bootstrap server and client, over real HTTP on loopback."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import msgspec
import pytest

from pdxfer import BootstrapClient, BootstrapError, BootstrapServer
from pdxfer.bootstrap import Refusal, Registration
from pdxfer.bootstrap.registration import MAX_REFUSALS


@pytest.fixture()
def server() -> Iterator[BootstrapServer]:
    s = BootstrapServer().start()
    yield s
    s.stop()


def reg(
    tp_rank: int = 0,
    tp_size: int = 2,
    eid: str | None = None,
    sig: str = "abc",
    instance: str = "p0",
    dp_rank: int = 0,
    dp_size: int = 1,
) -> Registration:
    return Registration(
        instance=instance,
        endpoint_id=eid or f"ep{dp_rank}{tp_rank}",
        ctrl_addr=f"tcp://127.0.0.1:{1000 + tp_rank}",
        session="127.0.0.1:1",
        signature=sig,
        tp_rank=tp_rank,
        tp_size=tp_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )


def http(
    server: BootstrapServer, method: str, path: str, body: bytes | None = None
) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{server.address}{path}", data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_route_answers_503_until_every_rank_registered(server: BootstrapServer) -> None:
    c = BootstrapClient(server.address)
    c.register(reg(0))
    code, body = http(server, "GET", "/route?room=5")
    assert code == 503 and "1 of 2" in body["error"]
    c.register(reg(1))
    route = c.route(5)
    assert [e["tp_rank"] for e in route["endpoints"]] == [0, 1]
    assert route["tp_size"] == 2 and route["signature"] == "abc"


def test_client_waits_through_503_until_the_instance_completes(server: BootstrapServer) -> None:
    c = BootstrapClient(server.address)
    c.register(reg(0))
    threading.Timer(0.3, lambda: c.register(reg(1))).start()
    route = c.route(1, deadline=time.monotonic() + 120)  # returns once rank 1 registered
    assert len(route["endpoints"]) == 2


def test_client_gives_up_at_its_deadline(server: BootstrapServer) -> None:
    """A route that stays 503 ends at the caller's deadline: with a retry budget that
    would outlast any test (a million tries), only the deadline can end it."""
    c = BootstrapClient(server.address, retries=10**6, max_backoff=0.05)
    c.register(reg(0))
    with pytest.raises(BootstrapError, match="503"):
        c.route(1, deadline=time.monotonic() + 0.5)


class Stalling:
    """A TCP front to ``target`` that leaves its first ``hold`` connections unanswered (a
    bootstrap too busy to answer: a loaded host) and relays the later ones."""

    def __init__(self, target: str, hold: int) -> None:
        host, _, port = target.rpartition(":")
        self.target, self.hold, self.seen = (host, int(port)), hold, 0
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.lsock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            self.seen += 1
            if self.seen <= self.hold:
                self.held.append(c)  # never answered
                continue
            up = socket.create_connection(self.target)
            for a, b in ((c, up), (up, c)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the other direction closed both

    def close(self) -> None:
        self.lsock.close()
        for c in self.held:
            c.close()


def test_a_lookup_that_times_out_retries_until_its_deadline(server: BootstrapServer) -> None:
    """A bootstrap that does not answer in time is busy, not gone: the lookup tries again
    until the room's deadline rather than giving up after its retry budget (here one retry,
    while three tries go unanswered), and gets the route once the server answers."""
    BootstrapClient(server.address).register(reg(0, tp_size=1))
    front = Stalling(server.address, hold=3)
    try:
        c = BootstrapClient(front.address, timeout=0.2, retries=1, max_backoff=0.05)
        route = c.route(1, deadline=time.monotonic() + 120)
        assert [e["endpoint_id"] for e in route["endpoints"]] == ["ep00"]
        # three unanswered tries, then the answer (a loaded machine may relay the answer past
        # the 0.2 s client timeout and so try more: at least four, never fewer)
        assert front.seen >= 4
    finally:
        front.close()


def test_conflicting_registration_gets_409(server: BootstrapServer) -> None:
    c = BootstrapClient(server.address)
    c.register(reg(0))
    with pytest.raises(BootstrapError, match="409.*signature"):
        c.register(reg(1, sig="other"))
    with pytest.raises(BootstrapError, match="409.*dp/pp/tp"):
        c.register(reg(1, tp_size=4))
    with pytest.raises(BootstrapError, match="409.*already registered"):
        c.register(reg(1, eid="ep00"))


def test_restarted_rank_replaces_its_old_registration(server: BootstrapServer) -> None:
    c = BootstrapClient(server.address)
    c.register(reg(0, tp_size=1))
    c.register(reg(0, tp_size=1, eid="new"))
    assert c.route(1)["endpoints"][0]["endpoint_id"] == "new"


@pytest.mark.parametrize(
    "path,code,needle",
    [
        ("/route?room=abc", 400, "integer"),
        ("/route?room=-1", 400, "out of range"),
        ("/route?room=1&instance=nope", 404, "unknown instance"),
        ("/route?room=1&dp=7", 400, "dp 7"),
    ],
)
def test_bad_queries_get_4xx_with_a_message(
    server: BootstrapServer, path: str, code: int, needle: str
) -> None:
    BootstrapClient(server.address).register(reg(0, tp_size=1))
    got, body = http(server, "GET", path)
    assert got == code and needle in body["error"]


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"{}",
        b'{"instance": "x"}',
        json.dumps(
            {
                **json.loads(
                    b'{"instance":"p","endpoint_id":"e",'
                    b'"ctrl_addr":"a","session":"s","signature":"x"}'
                ),
                "tp_rank": 3,
                "tp_size": 2,
            }
        ).encode(),
    ],
)
def test_bad_registrations_get_400(server: BootstrapServer, body: bytes) -> None:
    code, resp = http(server, "PUT", "/register", body)
    assert code == 400 and resp["error"]


def test_dp_groups_route_by_room(server: BootstrapServer) -> None:
    c = BootstrapClient(server.address)
    for dp in range(2):
        c.register(reg(0, tp_size=1, dp_rank=dp, dp_size=2))
    assert c.route(4)["dp_rank"] == 0 and c.route(5)["dp_rank"] == 1
    assert c.route(5, dp=0)["endpoints"][0]["dp_rank"] == 0


def test_refusals_are_read_per_instance_over_its_ranks_and_kept_out_of_routes(
    server: BootstrapServer,
) -> None:
    """What a prefill's ranks refused (a router's 409 says why), merged over the ranks; a
    decode's route lookup does not carry them."""
    c = BootstrapClient(server.address)
    why = "model differs: block_size: prefill 32, decode 64"
    c.register(reg(0, tp_size=2))
    c.register(msgspec.structs.replace(reg(1, tp_size=2), refused=(Refusal("d0", why),)))
    c.register(reg(0, tp_size=1, instance="other"))
    assert c.refusals("p0") == {"d0": why}
    assert c.refusals("other") == {} and c.refusals("nobody") == {}
    assert all("refused" not in e for e in c.route(1, "p0")["endpoints"])
    c.register(reg(1, tp_size=2))  # the rank paired with d0 since: its record is gone
    assert c.refusals("p0") == {}


@pytest.mark.parametrize(
    "refused",
    [
        [{"decode": f"d{i}", "reason": "x"} for i in range(MAX_REFUSALS + 1)],
        [{"decode": "d0", "reason": "x" * 2049}],
        [{"decode": "", "reason": "x"}],
        [{"decode": "d0", "reason": "x", "extra": 1}],
    ],
)
def test_a_registration_with_unbounded_refusals_gets_400(
    server: BootstrapServer, refused: list[dict]
) -> None:
    body = {**msgspec.to_builtins(reg(0, tp_size=1)), "refused": refused}
    code, resp = http(server, "PUT", "/register", json.dumps(body).encode())
    assert code == 400 and "refused" in resp["error"], resp
    assert BootstrapClient(server.address).refusals("p0") == {}


def test_health_and_unreachable_server() -> None:
    s = BootstrapServer().start()
    addr = s.address
    assert BootstrapClient(addr).health()
    s.stop()
    c = BootstrapClient(addr, timeout=0.5, retries=1)
    assert not c.health()
    with pytest.raises(BootstrapError, match="unreachable"):
        c.route(1)
