"""What this host's kernel still owes a peer host over TCP (Linux ``/proc/net/tcp{,6}``).

Why: Mooncake TCP cannot recall a write. When it reports a write failed it may have
dropped a stalled connection whose socket still buffers unsent bytes (a closed socket
keeps sending them, then its FIN, once the link heals), or it may still retransmit on a
lane stuck in backoff. Those bytes land in the decode's registered memory whenever the
network lets them through. The kernel is the one witness of them: this module reads, for a
peer host, the sockets (of this network namespace) that still hold unacknowledged bytes
*and* are either orphaned (closed by their process: ``inode`` 0) or in retransmission
backoff (``retrnsmt`` > 0). A healthy busy connection (bytes queued, no backoff) is not
counted: its bytes are being acknowledged as they go.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Set
from dataclasses import dataclass

PATHS = ("/proc/net/tcp", "/proc/net/tcp6")


@dataclass(frozen=True, slots=True)
class Owed:
    """One socket that may still deliver bytes to the peer host."""

    remote: str
    port: int
    state: int
    tx_queue: int
    retransmits: int
    orphan: bool


def _plain(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    """``ip`` as this module compares addresses: a v4-mapped IPv6 address as IPv4 (a dual
    stack socket's peer), an IPv6 address without its scope (the tables carry none)."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ip).partition("%")[0]
    return str(ip)


def _addr(hexaddr: str) -> tuple[str, int]:
    """``0100007F:1F90`` (IPv4) or 32 hex digits ``:port`` (IPv6; v4-mapped as IPv4)."""
    h, _, p = hexaddr.partition(":")
    raw = bytes.fromhex(h)
    # the kernel prints each 32-bit word in host (little-endian) order
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return _plain(ipaddress.ip_address(raw)), int(p, 16)


def parse(text: str) -> list[Owed]:
    """Every socket of one ``/proc/net/tcp*`` table with unacknowledged bytes that is
    orphaned or in retransmission backoff."""
    out: list[Owed] = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 10:
            continue
        try:
            tx = int(f[4].partition(":")[0], 16)
            retr = int(f[6], 16)
            inode = int(f[9])
            if tx == 0:
                continue
            orphan = inode == 0
            if not orphan and retr == 0:
                continue
            host, port = _addr(f[2])
            out.append(Owed(host, port, int(f[3], 16), tx, retr, orphan))
        except ValueError:
            continue
    return out


def resolve(host: str) -> frozenset[str]:
    """Every address ``host`` stands for, as ``parse`` reports them (Mooncake may have
    connected to any of a name's addresses); empty when it does not resolve."""
    try:
        return frozenset({_plain(ipaddress.ip_address(host))})
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return frozenset()
    out: set[str] = set()
    for info in infos:
        try:
            out.add(_plain(ipaddress.ip_address(info[4][0])))
        except (ValueError, IndexError, TypeError):
            continue
    return frozenset(out)


def owed(ips: Set[str]) -> list[Owed] | None:
    """The sockets that may still deliver bytes to any of ``ips`` (one host's addresses,
    from ``resolve``); None when the kernel's tables cannot be read (not Linux): the caller
    then has no evidence either way."""
    out: list[Owed] = []
    read = False
    for path in PATHS:
        try:
            with open(path) as f:
                text = f.read()
        except OSError:
            continue
        read = True
        out += [o for o in parse(text) if o.remote in ips]
    return out if read else None
