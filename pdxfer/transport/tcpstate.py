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


def _addr(hexaddr: str) -> tuple[str, int]:
    """``0100007F:1F90`` (IPv4) or 32 hex digits ``:port`` (IPv6; v4-mapped as IPv4)."""
    h, _, p = hexaddr.partition(":")
    raw = bytes.fromhex(h)
    # the kernel prints each 32-bit word in host (little-endian) order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(p, 16)


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


def resolve(host: str) -> str | None:
    """``host`` as the kernel prints it (an IP address), or None when it does not resolve."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0]
    except (OSError, IndexError):
        return None


def owed(ip: str) -> list[Owed] | None:
    """The sockets that may still deliver bytes to ``ip``; None when the kernel's tables
    cannot be read (not Linux): the caller then has no evidence either way."""
    out: list[Owed] = []
    read = False
    for path in PATHS:
        try:
            with open(path) as f:
                text = f.read()
        except OSError:
            continue
        read = True
        out += [o for o in parse(text) if o.remote == ip]
    return out if read else None
