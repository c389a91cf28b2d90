"""Bind versus advertise: configurations that could never work across hosts are refused when
the process starts, with a message that names the address (never a request that waits for an
answer that cannot come). ``10.213.0.x`` is never an address of this machine here (the
network tests give it only to hosts inside their own namespaces)."""

from __future__ import annotations

import pytest
import torch

from pdxfer import ConfigError, Endpoint, EndpointConfig, PoolSpec
from pdxfer.netaddr import advertised, host_of, is_local, is_loopback, unreachable_from
from pdxfer.serving.router.app import check_reachable
from pdxfer.serving.router.backends import Decode, Prefill

OTHER_HOST = "10.213.0.77"


def pools() -> list[PoolSpec]:
    return [PoolSpec.slots("aux", [torch.zeros((4, 8), dtype=torch.int32)])]


@pytest.mark.parametrize(
    "addr, host",
    [
        ("tcp://10.0.0.1:5000", "10.0.0.1"),
        ("http://h.example:80/x", "h.example"),
        ("10.0.0.1:8998", "10.0.0.1"),
        ("[::1]:8998", "::1"),
        ("tcp://[fe80::1]:9", "fe80::1"),
        ("localhost", "localhost"),
    ],
)
def test_host_of_reads_every_address_form(addr: str, host: str) -> None:
    assert host_of(addr) == host


def test_loopback_and_local_addresses() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.1") and not is_loopback("example.com")
    assert is_local("127.0.0.1") and is_local(OTHER_HOST) is False
    assert is_local("example.com") is None  # names are not resolved


def test_wildcard_bind_needs_an_address_to_advertise() -> None:
    with pytest.raises(ConfigError, match="binds every interface"):
        EndpointConfig(role="decode", host="0.0.0.0")
    with pytest.raises(ConfigError, match="wildcard"):
        EndpointConfig(role="decode", advertise="0.0.0.0")
    c = EndpointConfig(role="decode", host="0.0.0.0", advertise="127.0.0.1")
    assert c.address == "127.0.0.1"
    assert EndpointConfig(role="decode").address == "127.0.0.1"
    assert advertised("10.0.0.5") == "10.0.0.5"


def test_an_advertised_address_that_is_not_this_hosts_is_refused_at_start() -> None:
    cfg = EndpointConfig(
        role="decode", host="0.0.0.0", advertise=OTHER_HOST, transport="memory", insecure=True
    )
    with pytest.raises(ConfigError, match=f"{OTHER_HOST} is not an address of this host"):
        Endpoint(cfg, pools())


def test_a_loopback_prefill_with_a_bootstrap_on_another_host_is_refused_at_start() -> None:
    cfg = EndpointConfig(role="prefill", bootstrap=f"{OTHER_HOST}:8998", transport="memory")
    with pytest.raises(ConfigError, match="loopback address 127.0.0.1.*another host"):
        Endpoint(cfg, pools())
    assert unreachable_from("127.0.0.1", "127.0.0.1:8998") is None
    assert unreachable_from("10.0.0.5", f"{OTHER_HOST}:8998") is None


def test_router_refuses_a_loopback_bootstrap_that_remote_decodes_would_look_up() -> None:
    with pytest.raises(ValueError, match="loopback address, but decode"):
        check_reachable(
            [Prefill("http://127.0.0.1:8100", "127.0.0.1:8998")],
            [Decode(f"http://{OTHER_HOST}:8200")],
        )
    check_reachable(
        [Prefill("http://127.0.0.1:8100", "127.0.0.1:8998")], [Decode("http://127.0.0.1:8200")]
    )  # all on one host: fine
    check_reachable(
        [Prefill(f"http://{OTHER_HOST}:8100", f"{OTHER_HOST}:8998")],
        [Decode("http://10.213.0.78:8200")],
    )


def test_host_port_values_are_parsed_or_refused_as_malformed() -> None:
    from pdxfer import parse_hostport, parse_hostports

    assert parse_hostport(" 10.0.0.1:8998 ") == "10.0.0.1:8998"
    assert parse_hostport("[::1]:80") == "[::1]:80"
    assert parse_hostports("a:1, b:2,,a:1") == ("a:1", "b:2")
    for bad in (
        "10.0.0.1:x",
        "10.0.0.1:0",
        "10.0.0.1:65536",
        ":8998",
        "10.0.0.1",
        "::1:80",
        "a b:1",
        "h:+1",
        "",
        None,
        8998,
    ):
        with pytest.raises(ConfigError):
            parse_hostport(bad)


def test_protected_mode_refuses_a_host_address_without_a_secret_and_loopback_peers_pass() -> None:
    from pdxfer.trust import check_serving, peer_allowed

    assert check_serving("x", "127.0.0.1", secret=None) is True
    assert check_serving("x", "0.0.0.0", "127.0.0.1", secret=None) is True  # accept-time check
    assert check_serving("x", "10.0.0.1", secret=b"s" * 16) is False
    assert check_serving("x", "10.0.0.1", secret=None, opt_in=True) is False
    for host, adv in (("10.0.0.1", ""), ("0.0.0.0", "10.0.0.1"), ("example.com", "")):
        with pytest.raises(ConfigError, match="without a shared secret.*PDXFER_SECRET"):
            check_serving("x", host, adv, secret=None)
    assert all(peer_allowed(h) for h in ("127.0.0.1", "::1", "::ffff:127.0.0.1", None))
    assert not any(peer_allowed(h) for h in ("10.213.0.11", "::ffff:10.0.0.1", "fe80::1"))


def test_a_decode_trusts_exactly_its_configured_bootstraps() -> None:
    from pdxfer import UntrustedBootstrap, require_trusted, trusted_bootstrap

    trusted = require_trusted("10.0.0.1:8998,10.0.0.2:8998", "--bootstrap")
    assert trusted_bootstrap("10.0.0.2:8998", trusted) == "10.0.0.2:8998"
    with pytest.raises(UntrustedBootstrap):
        trusted_bootstrap("10.0.0.3:8998", trusted)
    with pytest.raises(UntrustedBootstrap):
        trusted_bootstrap("localhost:8998", require_trusted("127.0.0.1:8998", "x"))
    with pytest.raises(ConfigError, match="set --bootstrap"):
        require_trusted("", "--bootstrap")
    cfg = EndpointConfig(role="decode", transport="memory", trusted_bootstraps=trusted)
    ep = Endpoint(cfg, pools())
    try:
        with pytest.raises(UntrustedBootstrap):
            ep.receiver(1, "10.0.0.3:8998")
        assert ep.core.counters["untrusted_bootstraps_refused"] == 1
    finally:
        ep.close()


def test_free_ports_lie_below_the_ephemeral_range_each_bindable_and_never_twice() -> None:
    """Servers started together are each told a port they bind seconds later: no port the
    kernel hands out meanwhile (port 0 binds, outgoing connections) may be one of them, and
    no two of them may be the same (vLLM's KV event publisher failed to bind otherwise)."""
    import socket

    from pdxfer.netaddr import LOWEST_PORT, _ephemeral_low, free_port

    held = []
    try:
        for _ in range(30):  # the kernel's own picks, held while free_port picks
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
        ports = [free_port() for _ in range(300)]
        assert len(set(ports)) == len(ports)
        assert all(LOWEST_PORT <= p < _ephemeral_low() for p in ports)
        for p in ports[:20]:  # each is free on every address
            with socket.socket() as s:
                s.bind(("", p))
    finally:
        for s in held:
            s.close()
