"""The machine's own limits the transfer benchmark compares against: one TCP stream."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

_SOCK_SENDER = """
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
buf = memoryview(bytearray(4 << 20))
left = int(sys.argv[2])
while left > 0:
    k = min(left, len(buf))
    s.sendall(buf[:k])
    left -= k
s.close()
"""


def socket_stream(total: int) -> float:
    """GB/s of one plain TCP connection over loopback between two processes."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    p = subprocess.Popen(
        [sys.executable, "-c", _SOCK_SENDER, str(srv.getsockname()[1]), str(total)]
    )
    conn, _ = srv.accept()
    buf = memoryview(bytearray(4 << 20))
    got = 0
    t = time.perf_counter()
    while got < total:
        k = conn.recv_into(buf)
        if not k:
            break
        got += k
    dt = time.perf_counter() - t
    conn.close()
    srv.close()
    p.wait(30)
    return got / dt / 1e9


__all__ = ["socket_stream"]
