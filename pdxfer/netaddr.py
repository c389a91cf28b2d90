"""Addresses: what a process binds, and what it tells its peers to connect to.

Every pdxfer process binds an address of its machine (``host``; a wildcard such as
``0.0.0.0`` binds all of them) and advertises the address its peers connect to
(``advertise``, the bound address by default): the control socket's address and the
transport's session travel in registrations and Hellos, and are dialled from other hosts.
A wildcard cannot be dialled, and a loopback address reaches only the machine that dials
it, so these checks turn such a configuration into an error when the process starts (or,
for a decode, when it first meets a prefill on another host) instead of a request that
waits for an answer that can never come.
"""

from __future__ import annotations

import ctypes
import functools
import ipaddress
import os
import random
import socket
import urllib.parse

from .errors import ConfigError

WILDCARDS = frozenset({"", "0.0.0.0", "::", "*", "[::]"})


def host_of(addr: str) -> str:
    """The host part of ``tcp://h:p``, ``http://h:p/x``, ``h:p``, ``[v6]:p`` or a bare host."""
    if "://" in addr:
        return urllib.parse.urlsplit(addr).hostname or ""
    if addr.startswith("["):
        return addr[1:].partition("]")[0]
    if addr.count(":") == 1:
        return addr.rpartition(":")[0]
    return addr


def is_wildcard(host: str) -> bool:
    return host.strip() in WILDCARDS


def is_loopback(host: str) -> bool:
    """A loopback address or ``localhost`` (names are not resolved: no DNS at start)."""
    h = host.strip("[]").lower()
    if h == "localhost" or h.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(h.partition("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1, an IPv4 peer on a v6 socket
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


@functools.lru_cache(maxsize=256)
def is_local(host: str) -> bool | None:
    """Whether ``host`` (an IP address) is an address of this machine (of this network
    namespace): True, False, or None for a name (not resolved here)."""
    h = host.strip("[]")
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return True if is_loopback(h) else None
    if ip.is_loopback:
        return True
    fam = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(fam, socket.SOCK_DGRAM) as s:
        try:
            s.bind((h, 0))
            return True
        except OSError:
            return False


def advertised(host: str, advertise: str = "") -> str:
    """The address peers are told: ``advertise``, else the bound ``host``. A wildcard bind
    needs an explicit ``advertise`` (peers cannot dial ``0.0.0.0``)."""
    if advertise:
        if is_wildcard(advertise):
            raise ConfigError(
                f"cannot advertise the wildcard address {advertise!r}: name the "
                f"address peers reach this process at"
            )
        return advertise
    if is_wildcard(host):
        raise ConfigError(
            f"host {host!r} binds every interface, so it cannot be advertised: "
            f"also give the address peers reach this process at (advertise, "
            f"--advertise)"
        )
    return host


def check_local(addr: str, what: str = "advertised address") -> None:
    """Refuse an IP address that is not one of this machine's (a typo, another host's
    address): peers would dial somebody else, or nobody."""
    if is_local(addr) is False:
        raise ConfigError(
            f"{what} {addr} is not an address of this host: peers dialling it "
            f"would never reach this process"
        )


def unreachable_from(own: str, peer: str) -> str | None:
    """Why a peer at ``peer`` cannot reach this process advertised at ``own`` (None when no
    reason is known): a loopback address told to a process on another host."""
    peer_host = host_of(peer)
    if (
        is_loopback(own)
        and peer_host
        and not is_loopback(peer_host)
        and not is_wildcard(peer_host)
        and is_local(peer_host) is False
    ):
        return (
            f"this process advertises the loopback address {own}, but {peer} is on "
            f"another host, which can never reach it: bind and advertise an address "
            f"that host can reach (host/advertise, --host/--advertise)"
        )
    return None


def parse_hostport(value: object, what: str = "address") -> str:
    """``value`` as a ``host:port`` address (``[v6]:port`` for IPv6), or ConfigError saying
    what is wrong with it: an address that came over the network or from a config file is
    checked before anything dials it, so a bad one is malformed input, not a failed connect."""
    if not isinstance(value, str):
        raise ConfigError(f"{what} must be a 'host:port' string, got {type(value).__name__}")
    s = value.strip()
    if s.startswith("["):
        host, sep, rest = s[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else None
        shown = f"[{host}]"
    else:
        host, sep, port = s.rpartition(":")
        sep = sep if host.count(":") == 0 else ""
        shown = host
    if not sep or port is None or not host:
        raise ConfigError(
            f"{what} {value!r} is not 'host:port' (a host and a port are both needed)"
        )
    if any(c.isspace() or c in "/@?#[]" for c in host) or len(host) > 253:
        raise ConfigError(f"{what} {value!r}: {host!r} is not a host name or address")
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ConfigError(f"{what} {value!r}: the port must be a number in 1-65535, got {port!r}")
    return f"{shown}:{int(port)}"


def parse_hostports(value: object, what: str = "addresses") -> tuple[str, ...]:
    """A list of ``host:port`` addresses: a comma-separated string or a sequence of strings
    (empty items are ignored, each one is checked by ``parse_hostport``)."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ConfigError(f"{what} must be 'host:port' strings, got {type(value).__name__}")
    out = [parse_hostport(v, what) for v in items if not (isinstance(v, str) and not v.strip())]
    return tuple(dict.fromkeys(out))


_HANDED_OUT: set[int] = set()
LOWEST_PORT = 20000
"""Ports ``free_port`` picks lie from here up to the kernel's ephemeral range: above the
ports Mooncake's transfer engine picks at random for itself (15000 to 17000)."""


@functools.cache
def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port for a process started now that binds it later (a server told ``--port``).

    Picked at random below the kernel's ephemeral range and checked bindable on every
    address, so no port the kernel hands another process meanwhile (a bind to port 0, an
    outgoing connection's own end) can take it, and never one this process picked before:
    servers started together each get their own. ``host`` is where it is checked."""
    top = _ephemeral_low()
    if top - LOWEST_PORT < 1000:  # no room below the ephemeral range: the kernel picks
        with socket.socket() as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    for _ in range(1000):
        port = random.randrange(LOWEST_PORT, top)
        if port in _HANDED_OUT:
            continue
        try:
            with socket.socket() as s:
                s.bind(("" if is_loopback(host) else host, port))
        except OSError:
            continue
        _HANDED_OUT.add(port)
        return port
    raise OSError(f"no free port in [{LOWEST_PORT}, {top}) on {host}")


CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"
"""Where ``ip netns add NAME`` keeps the namespace NAME."""


def setns_net(fd: int) -> None:
    """Move the calling thread into the network namespace ``fd`` refers to."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"setns: {os.strerror(e)}")


def enter_netns(name: str) -> None:
    """Move the calling thread into network namespace ``name`` for good, as ``ip netns exec``
    does for its command (a process's first step: threads it starts afterwards, and every
    socket they open, live there)."""
    fd = os.open(f"{NETNS_DIR}/{name}", os.O_RDONLY)
    try:
        setns_net(fd)
    finally:
        os.close(fd)
