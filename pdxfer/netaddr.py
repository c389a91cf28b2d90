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

import functools
import ipaddress
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
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


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
            raise ConfigError(f"cannot advertise the wildcard address {advertise!r}: name the "
                              f"address peers reach this process at")
        return advertise
    if is_wildcard(host):
        raise ConfigError(f"host {host!r} binds every interface, so it cannot be advertised: "
                          f"also give the address peers reach this process at (advertise, "
                          f"--advertise)")
    return host


def check_local(addr: str, what: str = "advertised address") -> None:
    """Refuse an IP address that is not one of this machine's (a typo, another host's
    address): peers would dial somebody else, or nobody."""
    if is_local(addr) is False:
        raise ConfigError(f"{what} {addr} is not an address of this host: peers dialling it "
                          f"would never reach this process")


def unreachable_from(own: str, peer: str) -> str | None:
    """Why a peer at ``peer`` cannot reach this process advertised at ``own`` (None when no
    reason is known): a loopback address told to a process on another host."""
    peer_host = host_of(peer)
    if (is_loopback(own) and peer_host and not is_loopback(peer_host)
            and not is_wildcard(peer_host) and is_local(peer_host) is False):
        return (f"this process advertises the loopback address {own}, but {peer} is on "
                f"another host, which can never reach it: bind and advertise an address "
                f"that host can reach (host/advertise, --host/--advertise)")
    return None
