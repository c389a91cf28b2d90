"""``transport/tcpstate.py`` reads what the kernel still owes a peer host: the sockets with
unacknowledged bytes that are orphaned (closed by Mooncake after it reported the write
failed) or in retransmission backoff. A healthy busy connection is not evidence of a stale
write, and an idle or drained one owes nothing."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from pdxfer.transport import tcpstate as T

HEAD = (
    "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
    "timeout inode\n"
)


def row(rem: str, tx: int, retr: int, inode: int, st: str = "01") -> str:
    return (
        f"   0: 0B00D50A:9C40 {rem} {st} {tx:08X}:00000000 01:00000014 {retr:08X}     0 "
        f"       0 {inode} 1 0000000000000000 20 4 30 10 -1\n"
    )


PEER = "0C00D50A:3E80"  # 10.213.0.12:16000
OTHER = "0D00D50A:3E80"  # 10.213.0.13:16000


def test_orphaned_or_backed_off_sockets_with_unacked_bytes_are_owed_and_nothing_else() -> None:
    text = HEAD + "".join(
        [
            row(PEER, 4096, 0, 0, "04"),  # orphaned (FIN_WAIT1), bytes unacked: owed
            row(PEER, 512, 3, 12345),  # live, in backoff after 3 lost retransmits: owed
            row(PEER, 65536, 0, 12346),  # live and busy, nothing lost: not evidence
            row(PEER, 0, 2, 0, "06"),  # TIME_WAIT-like, nothing unacked
            row(OTHER, 4096, 0, 0, "04"),  # another host's
        ]
    )
    got = T.parse(text)
    assert [(o.remote, o.port, o.tx_queue, o.orphan) for o in got] == [
        ("10.213.0.12", 16000, 4096, True),
        ("10.213.0.12", 16000, 512, False),
        ("10.213.0.13", 16000, 4096, True),
    ]


def test_ipv6_and_v4_mapped_addresses_are_read_as_the_kernel_prints_them() -> None:
    assert T._addr("0000000000000000FFFF00000C00D50A:3E80") == ("10.213.0.12", 16000)
    assert T._addr("00000000000000000000000001000000:0050") == ("::1", 80)
    assert T.resolve("10.213.0.12") == {"10.213.0.12"}


def test_this_hosts_own_tables_are_readable() -> None:
    assert T.owed({"192.0.2.1"}) == []  # TEST-NET-1: nothing here talks to it


def test_a_peer_host_is_every_address_it_stands_for_as_the_tables_print_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A session names its host as Mooncake was told it (a name with an IPv6 and an IPv4
    address, a v4-mapped or scoped IPv6 address): a socket to any of its addresses, as the
    kernel prints it, is evidence (one address only, or the unmapped text, hid a socket
    that still owed bytes, and the path was proven quiet on no evidence)."""
    infos = [
        (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 0, 0, 0)),
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.213.0.12", 0)),
    ]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: infos)
    assert T.resolve("decode-host") == {"::1", "10.213.0.12"}
    assert T.resolve("::ffff:10.213.0.12") == {"10.213.0.12"}
    assert T.resolve("fe80::1%eth0") == {"fe80::1"}
    table = tmp_path / "tcp"
    table.write_text(HEAD + row(PEER, 4096, 0, 0, "04") + row(OTHER, 4096, 0, 0, "04"))
    monkeypatch.setattr(T, "PATHS", (str(table), str(tmp_path / "no-tcp6")))
    for host in ("decode-host", "::ffff:10.213.0.12"):
        got = T.owed(T.resolve(host))
        assert got is not None and [o.remote for o in got] == ["10.213.0.12"], host
