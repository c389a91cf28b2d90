"""Protected mode: without a shared secret every pdxfer listener serves
loopback peers only.

A peer on another host (a network namespace, ``tests.harness.hosts``) is refused by each
no-secret listener even when it is bound to ``0.0.0.0`` (the bootstrap server, an endpoint's
control socket, a worker's and the router's HTTP servers), while loopback peers on the same
host are served. A process asked to bind or advertise a non-loopback address without a
secret stops at start saying how to set one; the ``--insecure`` opt-in serves the network
and warns once, naming what is open.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from pdxfer import BootstrapServer, ConfigError, Endpoint, EndpointConfig
from pdxfer.agents import patterns as pat
from pdxfer.agents.patterns import PoolGeom
from pdxfer.serving.procs import Proc
from pdxfer.transport import MemoryTransport
from tests.harness.hosts import Host, Network

from .netconf import needs_root

pytestmark = needs_root

GEOMS = [PoolGeom("kv", "mha", layers=1, pages=4, page_size=4, heads=1, head_dim=8)]
_KEEP: list[object] = []


def pools() -> list:
    specs, tensors = pat.build(GEOMS)
    _KEEP.append(tensors)  # the endpoint registers their memory: keep it alive
    return specs


NO_SECRET = {"PDXFER_SECRET": "", "PDXFER_SECRET_FILE": "", "PDXFER_INSECURE": ""}


@pytest.fixture(scope="module")
def net() -> Iterator[Network]:
    with Network(["srv", "peer"]) as n:
        yield n


def http_status(host: Host | None, url: str) -> int | str:
    """GET ``url`` from ``host`` (None: from here); the status, or how the connection ended."""
    out: list[int | str] = []

    def attempt() -> None:
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                out.append(r.status)
        except urllib.error.HTTPError as e:
            out.append(e.code)
        except (urllib.error.URLError, OSError) as e:
            out.append(f"closed: {e}")

    def run() -> None:
        if host is None:
            attempt()
        else:
            with host.enter():
                attempt()

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    return out[0] if out else "timeout"


def first_bytes(host: Host, addr: str, port: int) -> bytes:
    """What a listener sends a fresh connection from ``host`` first (b'': closed; a greeting
    comes at once, the 10 s wait is room for a loaded machine, not a measure)."""
    out: list[bytes] = []

    def run() -> None:
        with host.enter(), socket.create_connection((addr, port), timeout=5) as s:
            s.settimeout(10)
            try:
                out.append(s.recv(1024))
            except (TimeoutError, ConnectionResetError):
                out.append(b"")

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    return out[0] if out else b"?"


def in_ns(host: Host, make: object) -> object:
    """Build a listener with this thread's sockets (and its threads) on ``host``."""
    out: list[object] = []

    def run() -> None:
        with host.enter():
            out.append(make())  # type: ignore[operator]

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    return out[0]


def test_a_no_secret_bootstrap_bound_everywhere_serves_loopback_only(net: Network) -> None:
    srv, peer = net["srv"], net["peer"]
    boot = in_ns(srv, lambda: BootstrapServer("0.0.0.0", 0, secret=None).start())
    assert isinstance(boot, BootstrapServer)
    try:
        assert boot.loopback_only
        assert http_status(peer, f"http://{srv.addr}:{boot.port}/instances") != 200
        assert boot.counters["peers_refused"] >= 1
        local = http_status(srv, f"http://127.0.0.1:{boot.port}/instances")
        assert local == 200, local
    finally:
        boot.stop()


def test_a_no_secret_control_socket_bound_everywhere_closes_a_peer_on_another_host(
    net: Network,
) -> None:
    srv, peer = net["srv"], net["peer"]
    cfg = EndpointConfig(role="prefill", host="0.0.0.0", advertise="127.0.0.1", transport="memory")
    ep = in_ns(srv, lambda: Endpoint(cfg, pools(), MemoryTransport()))
    assert isinstance(ep, Endpoint)
    try:
        port = int(ep.ctrl_addr.rpartition(":")[2])
        assert first_bytes(peer, srv.addr, port) == b"", "closed before the ZMTP greeting"
        assert first_bytes(srv, "127.0.0.1", port)[:1] == b"\xff", "loopback gets a greeting"
        assert ep.core.counters["rejected_peer_not_loopback"] >= 1
    finally:
        ep.close()


@pytest.mark.parametrize("role", ["router", "decode"])
def test_no_secret_http_servers_bound_everywhere_refuse_a_peer_on_another_host(
    net: Network, role: str
) -> None:
    srv, peer = net["srv"], net["peer"]
    args = (
        ["router", "--prefill", "http://127.0.0.1:9,127.0.0.1:9", "--decode", "http://127.0.0.1:9"]
        if role == "router"
        else ["decode", "--bootstrap", "127.0.0.1:9", "--pages", "16"]
    )
    p = Proc(
        role,
        [*args, "--host", "0.0.0.0", "--advertise", "127.0.0.1", "--port", "0"],
        prefix=srv.prefix,
        env=NO_SECRET,
        timeout=120,
    )
    try:
        port = int(p.url.rpartition(":")[2])
        assert http_status(peer, f"http://{srv.addr}:{port}/metrics") == 403
        assert http_status(srv, f"http://127.0.0.1:{port}/metrics") == 200
    finally:
        p.stop()


@pytest.mark.parametrize(
    "cmd",
    [
        ["bootstrap", "--port", "0"],
        [
            "router",
            "--port",
            "0",
            "--prefill",
            "http://127.0.0.1:9,127.0.0.1:9",
            "--decode",
            "http://127.0.0.1:9",
        ],
        ["decode", "--port", "0", "--bootstrap", "127.0.0.1:9", "--pages", "16"],
    ],
)
def test_serving_a_host_address_without_a_secret_stops_at_start_saying_how_to_set_one(
    net: Network, cmd: list[str]
) -> None:
    srv = net["srv"]
    r = subprocess.run(
        [*srv.prefix, sys.executable, "-m", "pdxfer.cli", *cmd, "--host", srv.addr],
        env={**os.environ, **NO_SECRET},
        capture_output=True,
        text=True,
        timeout=600,
    )  # a hang detector: the decode's imports are slow when loaded
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "PDXFER_READY" not in r.stdout
    assert "without a shared secret" in r.stderr and "PDXFER_SECRET" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_an_endpoint_advertising_a_host_address_without_a_secret_is_refused() -> None:
    for kw in ({"host": "10.213.0.99"}, {"host": "0.0.0.0", "advertise": "10.213.0.99"}):
        with pytest.raises(ConfigError, match="without a shared secret.*PDXFER_SECRET"):
            Endpoint(
                EndpointConfig(role="decode", transport="memory", **kw),  # type: ignore[arg-type]
                pools(),
                MemoryTransport(),
            )


def test_the_insecure_opt_in_serves_other_hosts_and_warns_once(net: Network) -> None:
    srv, peer = net["srv"], net["peer"]
    p = subprocess.Popen(
        [
            *srv.prefix,
            sys.executable,
            "-m",
            "pdxfer.cli",
            "bootstrap",
            "--port",
            "0",
            "--host",
            srv.addr,
            "--insecure",
        ],
        env={**os.environ, **NO_SECRET},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None
        line = ""
        while "PDXFER_READY" not in line:
            line = p.stdout.readline()
            assert line, "the bootstrap exited"
        url = line.split()[1]
        assert http_status(peer, f"{url}/instances") == 200
        assert http_status(peer, f"{url}/instances") == 200
    finally:
        p.terminate()
        _, err = p.communicate(timeout=30)
    warnings = [ln for ln in err.splitlines() if "INSECURE" in ln]
    assert len(warnings) == 1, err
    assert "bootstrap server" in warnings[0] and srv.addr in warnings[0], warnings


def test_an_insecure_endpoint_warns_once_naming_what_is_open(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = EndpointConfig(
        role="prefill", host="0.0.0.0", advertise="127.0.0.1", transport="memory", insecure=True
    )
    with caplog.at_level(logging.WARNING, logger="pdxfer.trust"):
        eps = [Endpoint(cfg, pools(), MemoryTransport()) for _ in range(2)]
    for ep in eps:
        ep.close()
    lines = [r.getMessage() for r in caplog.records if "INSECURE" in r.getMessage()]
    assert len(lines) == 1 and "every interface" in lines[0], lines
