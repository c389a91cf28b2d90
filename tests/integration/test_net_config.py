"""Multi-host configurations that cannot work fail at once, naming the address, instead of a
request waiting out its deadline for an answer that can never come (hosts are network
namespaces, ``tests.harness.hosts``). Without these checks each case below ends in a
``DeadlineExceeded`` after the whole bootstrap deadline (or a worker that starts and never
serves)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from pdxfer import BootstrapClient, BootstrapError
from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent
from pdxfer.bootstrap import Registration
from pdxfer.serving.procs import Proc
from pdxfer.serving.toy.cluster import RemoteBootstrap
from tests.harness.hosts import Network

from .conftest import FAST
from .helpers import Factory, decode_items
from .netconf import NET_ENV, SECRET, needs_root

pytestmark = needs_root

GEOMS = [
    PoolGeom("kv", "mha", layers=2, pages=32, page_size=16, heads=2, head_dim=32),
    PoolGeom("aux", "slots", layers=1, pages=8, dim=16, dtype="int32"),
]
DEADLINE = 10.0
"""The bootstrap deadline of these decodes: a wrong configuration must fail well before."""


@pytest.fixture(scope="module")
def net() -> Iterator[Network]:
    with Network(["boot", "prefill", "decode"]) as n:
        yield n


@pytest.fixture(scope="module")
def boot(net: Network) -> Iterator[RemoteBootstrap]:
    """Bound to every interface of its host (so a prefill there can use loopback), and
    advertising the host's address."""
    h = net["boot"]
    b = RemoteBootstrap(
        Proc(
            "bootstrap",
            ["bootstrap", "--host", "0.0.0.0", "--advertise", h.addr, "--port", "0"],
            prefix=h.prefix,
            env=NET_ENV,
        )
    )
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture(scope="module")
def dc(net: Network) -> Iterator[Agent]:
    """A decode on its host's address; its endpoint ``lo`` binds and advertises loopback."""
    a = Agent(
        "decode",
        {**FAST, "bootstrap_timeout_s": DEADLINE, "host": net["decode"].addr},
        GEOMS,
        setup=net["decode"].entry,
        env=NET_ENV,
    )
    try:
        a.call(
            "add_endpoint",
            name="lo",
            role="decode",
            config={**FAST, "bootstrap_timeout_s": DEADLINE},
            geoms=GEOMS,
        )
        yield a
    finally:
        a.close()


def fails_at_once(dc: Agent, bootstrap: str, instance: str | None = None, ep: str = "main") -> str:
    """Fails as a configuration error: the cause, checked before any wait (a room that had
    waited would fail as ``deadline``), whatever the machine's speed."""
    r = Factory(GEOMS, GEOMS).make(16 * 2)
    dc.call("recv", items=decode_items([r]), bootstrap=bootstrap, instance=instance, ep=ep)
    out = dc.call("wait", rooms=[r["room"]], timeout=DEADLINE + 5, ep=ep)[r["room"]]
    assert out["state"] == "Failed", out
    assert out["kind"] == "config", out
    return str(out["failure"])


def test_bootstrap_bound_everywhere_advertises_its_host(
    net: Network, boot: RemoteBootstrap
) -> None:
    assert boot.address == f"{net['boot'].addr}:{boot.port}"
    assert net["decode"].reach(net["boot"].addr, boot.port) == "ok"


def test_a_decode_advertising_loopback_fails_its_first_request_at_once(
    dc: Agent, boot: RemoteBootstrap
) -> None:
    why = fails_at_once(dc, boot.address, ep="lo")
    assert "loopback address 127.0.0.1" in why and boot.address in why, why


def test_a_prefill_registered_on_loopback_is_refused_by_a_decode_on_another_host(
    net: Network, boot: RemoteBootstrap, dc: Agent
) -> None:
    """The prefill shares the bootstrap's host and reaches it on loopback, advertising
    loopback too: fine on that host, unreachable from the decode's."""
    local = f"127.0.0.1:{boot.port}"
    pf = Agent(
        "prefill",
        {**FAST, "bootstrap": local, "instance": "colocated"},
        GEOMS,
        setup=net["boot"].entry,
        env=NET_ENV,
    )
    try:
        why = fails_at_once(dc, boot.address, instance="colocated")
        assert f"loopback control address {pf.info['ctrl_addr']}" in why, why
        assert "on another host" in why, why
    finally:
        pf.close()


def test_bootstrap_refuses_a_loopback_control_address_from_another_host(
    net: Network, boot: RemoteBootstrap
) -> None:
    reg = Registration(
        instance="liar",
        endpoint_id="e1",
        ctrl_addr="tcp://127.0.0.1:5",
        session="127.0.0.1:6",
        signature="s",
    )
    with net["decode"].enter(), pytest.raises(BootstrapError) as e:
        BootstrapClient(boot.address, retries=0, secret=SECRET).register(reg)
    assert "400" in str(e.value) and f"comes from {net['decode'].addr}" in str(e.value)


def test_a_prefill_advertising_an_address_nobody_reaches_stops_at_start_naming_it(
    net: Network, boot: RemoteBootstrap
) -> None:
    """``--advertise`` names an address of the prefill's host that no other host can route
    to (one on its loopback device, as a container's bridge address would be): the bootstrap
    cannot connect to it, refuses the registration, and the worker exits saying so."""
    h = net["prefill"]
    hidden = "10.214.0.1"
    subprocess.run(["ip", "-n", h.ns, "addr", "add", f"{hidden}/32", "dev", "lo"], check=True)
    p = h.popen(
        [
            sys.executable,
            "-m",
            "pdxfer.cli",
            "prefill",
            "--host",
            "0.0.0.0",
            "--advertise",
            hidden,
            "--bootstrap",
            boot.address,
            "--port",
            "0",
            "--pages",
            "16",
        ],
        env=NET_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2, (out, err)
    assert "PDXFER_READY" not in out
    assert f"cannot connect to its control address tcp://{hidden}:" in err, err
    assert "Traceback" not in err, err
