"""The control socket's send side: frames go out from the calling thread, on TCP, speaking what
a ZMQ PUSH socket speaks to ``inbox.Inbox`` (ZMTP 3.0, NULL mechanism).

A ZMQ PUSH socket hands every message to ZMQ's I/O thread, which then writes it: one thread
wake-up per message before a byte leaves (the one-way latency this saves is in
docs/performance.md). Here the sending thread writes the frame itself with one non-blocking
``sendmsg``; only what cannot be written at once (a new connection still connecting, a full
socket buffer, a peer that is down) is left to the flusher thread, which also notices a
peer closing a connection. ``Outbox`` says what a caller can count on.
"""

from __future__ import annotations

import collections
import errno
import ipaddress
import itertools
import logging
import selectors
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .inbox import zmtp_hello

log = logging.getLogger(__name__)

HELLO = zmtp_hello(b"PUSH")
"""A PUSH socket's greeting and READY command, sent first on every connection."""
MAX_QUEUED = 256 << 20
"""Bytes queued for one peer (a peer that is down or does not read); past it, sends fail."""
RECONNECT_MIN_S = 0.01
RECONNECT_MAX_S = 5.0


def frame_header(n: int) -> bytes:
    """A ZMTP message frame's flags and size (one part: pdxfer sends no multi-part)."""
    return bytes([0, n]) if n < 256 else b"\x02" + n.to_bytes(8, "big")


def parse_addr(addr: str) -> tuple[str, int]:
    """``tcp://host:port`` (``[v6]:port`` too) as a socket address."""
    if not addr.startswith("tcp://"):
        raise ValueError(f"not a tcp:// address: {addr!r}")
    host, _, port = addr[6:].rpartition(":")
    return host.strip("[]"), int(port)


@dataclass(slots=True, eq=False)
class _Peer:
    addr: str
    where: tuple[str, int]
    lock: threading.Lock = field(default_factory=threading.Lock)
    sock: socket.socket | None = None
    queue: collections.deque[tuple[bytes, memoryview]] = field(default_factory=collections.deque)
    """Unsent frames in order (header, body); the first may be partly sent (``sent``
    bytes). ``HELLO`` stands first on a new connection as ``(HELLO, empty)``."""
    sent: int = 0
    queued: int = 0
    retry_at: float = 0.0
    backoff: float = RECONNECT_MIN_S
    ready: bool = False
    """The peer's greeting and first command arrived on this connection: frames may follow
    our HELLO (libzmq drops a connection whose first frame arrives in the same read as the
    end of the greeting, so frames wait for the peer's READY, as a ZMQ socket's do)."""
    shake: bytes = b""
    """What arrived of the peer's greeting and first command."""
    dead: list[socket.socket] = field(default_factory=list)
    """Broken connections for the flusher to unregister and close."""
    closed: bool = False


_EMPTY = memoryview(b"")


class Outbox:
    """Frames to peers' control sockets, written by the calling thread (module notes).

    - ``send`` never blocks and never waits for a thread; it returns False only when the
      frame cannot be queued (the peer's queue is over ``MAX_QUEUED`` bytes, or its address
      is bad);
    - frames to one address leave in the order ``send`` was called, each whole: a connection
      that breaks is dialled again (backing off up to ``RECONNECT_MAX_S`` while the peer is
      down) and the frames not fully written go out on the new one (a frame the old
      connection took whole but the peer never read is lost, as with ZMQ);
    - on a new connection frames wait for the peer's greeting and READY (the flusher reads
      them: one round trip per connection), as a ZMQ socket's do; later input is dropped
      (an ``Inbox`` and a ZMQ PULL socket send nothing else)."""

    def __init__(self, max_peers: int, name: str = "pdxfer-outbox") -> None:
        self.max_peers = max_peers
        self._peers: OrderedDict[str, _Peer] = OrderedDict()
        self._lock = threading.Lock()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._dirty: set[_Peer] = set()
        self._dirty_lock = threading.Lock()
        self._signalled = False
        self._stop = False
        self.failures = 0
        self.reconnects = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # -- callers' side ---------------------------------------------------------------------------
    def send(self, addr: str, frame: bytes | memoryview) -> bool:
        """Write ``frame`` to ``addr`` now, or queue what cannot go at once; never blocks."""
        peer = self._peer(addr)
        if peer is None:
            self.failures += 1
            return False
        body = memoryview(frame)
        head = frame_header(len(body))
        size = len(head) + len(body)
        with peer.lock:
            if peer.closed:
                self.failures += 1
                return False
            if peer.queued + size > MAX_QUEUED:
                self.failures += 1
                log.warning(
                    "control frames to %s: %d bytes queued, frame dropped", addr, peer.queued
                )
                return False
            if peer.sock is not None and peer.ready and not peer.queue:  # the usual case
                try:
                    n = peer.sock.sendmsg((head, body))
                except (BlockingIOError, InterruptedError):
                    n = 0
                except OSError:
                    n = -1
                if n == size:
                    return True  # no thread involved
                peer.queue.append((head, body))
                peer.queued += size
                if n < 0:
                    self._broken(peer)  # the whole frame goes out on the next connection
                else:
                    peer.sent = n
                    peer.queued -= n
            else:
                fresh = peer.sock is None
                if fresh and peer.retry_at <= time.monotonic():
                    self._connect(peer)
                peer.queue.append((head, body))
                peer.queued += size
                if fresh and peer.sock is not None and not self._flush(peer):
                    self._broken(peer)
        self._kick(peer)  # the flusher writes the rest, watches a new connection
        return True

    def forget(self, addr: str) -> None:
        """Close the connection to ``addr`` and drop what is queued for it."""
        with self._lock:
            peer = self._peers.pop(addr, None)
        if peer is not None:
            self._retire(peer)

    def sockets(self) -> int:
        return len(self._peers)

    def close(self) -> None:
        with self._lock:
            peers = list(self._peers.values())
            self._peers.clear()
        for p in peers:
            self._retire(p)
        self._stop = True
        self._wake()
        self._thread.join(timeout=5)

    # -- internals (a peer's ``lock`` held where a function touches its socket or queue) ----------
    def _peer(self, addr: str) -> _Peer | None:
        with self._lock:
            peer = self._peers.get(addr)
            if peer is not None:
                self._peers.move_to_end(addr)
                return peer
            try:
                where = parse_addr(addr)
            except ValueError as e:
                log.warning("cannot send to %s: %s", addr, e)
                return None
            old = None
            if len(self._peers) >= self.max_peers:
                _, old = self._peers.popitem(last=False)
            peer = self._peers[addr] = _Peer(addr, where)
        if old is not None:
            self._retire(old)
        return peer

    def _retire(self, peer: _Peer) -> None:
        with peer.lock:
            peer.closed = True
            peer.queue.clear()
            peer.queued = peer.sent = 0
            if peer.sock is not None:
                peer.dead.append(peer.sock)
                peer.sock = None
        self._kick(peer)  # the flusher unregisters and closes its sockets

    def _connect(self, peer: _Peer) -> None:
        """Start a connection (non-blocking) with its HELLO first in the queue; a frame the
        broken one took in part goes again whole."""
        try:
            host, port = peer.where
            try:
                fam = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
                where: tuple[Any, ...] = peer.where
            except ValueError:  # a name (pdxfer advertises addresses): resolved per connection
                fam, _, _, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            s = socket.socket(fam, socket.SOCK_STREAM)
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            rc = s.connect_ex(where)
        except OSError as e:
            log.warning("control socket to %s: %s", peer.addr, e)
            self._backoff(peer)
            return
        if rc not in (0, errno.EINPROGRESS):
            s.close()
            self._backoff(peer)
            return
        peer.sock = s
        peer.ready, peer.shake = False, b""
        if peer.queue and peer.queue[0][0] is HELLO:
            peer.queue.popleft()
            peer.queued -= len(HELLO) - peer.sent
        else:
            peer.queued += peer.sent
        peer.sent = 0
        peer.queue.appendleft((HELLO, _EMPTY))
        peer.queued += len(HELLO)

    def _flush(self, peer: _Peer) -> bool:
        """Write what the socket takes now; False when the connection is broken."""
        s = peer.sock
        assert s is not None
        while peer.queue:
            if not peer.ready and peer.queue[0][0] is not HELLO:
                return True  # frames wait for the peer's READY
            views: list[bytes | memoryview] = []
            # before the peer's READY only our HELLO goes out
            for head, body in itertools.islice(peer.queue, 32 if peer.ready else 1):
                views += (head, body)
            k = peer.sent
            if k:  # the first frame went out in part
                h = len(views[0])
                views[0], views[1] = (views[0][k:], views[1]) if k < h else (b"", views[1][k - h :])
            try:
                n = s.sendmsg(views)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return False
            peer.queued -= n
            if n:
                peer.backoff = RECONNECT_MIN_S  # the connection works
            while n:
                head, body = peer.queue[0]
                left = len(head) + len(body) - peer.sent
                if n < left:
                    peer.sent += n
                    return True  # the socket's buffer is full
                n -= left
                peer.queue.popleft()
                peer.sent = 0
            if not peer.ready:
                return True  # the HELLO went out: frames wait for the peer's READY
        return True

    def _broken(self, peer: _Peer) -> None:
        """Drop a broken connection; what is queued goes on the next one."""
        if peer.sock is not None:
            self.reconnects += 1
            peer.dead.append(peer.sock)
            peer.sock = None
        self._backoff(peer)

    def _backoff(self, peer: _Peer) -> None:
        peer.retry_at = time.monotonic() + peer.backoff
        peer.backoff = min(RECONNECT_MAX_S, peer.backoff * 2)

    def _kick(self, peer: _Peer) -> None:
        with self._dirty_lock:
            self._dirty.add(peer)
            if self._signalled:
                return
            self._signalled = True
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    # -- the flusher thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        reg: dict[_Peer, tuple[socket.socket, int]] = {}
        """What each peer's connection is registered for (only this thread registers)."""
        waiting: set[_Peer] = set()
        """Peers with frames queued and no connection: dialled again at ``retry_at``."""
        try:
            while not self._stop:
                now = time.monotonic()
                timeout = min((p.retry_at - now for p in waiting), default=None)
                touched: set[_Peer] = set()
                for key, ev in self._sel.select(None if timeout is None else max(0.0, timeout)):
                    p = key.data
                    if p is None:
                        self._drain(self._wake_r)
                        continue
                    touched.add(p)
                    with p.lock:
                        if p.sock is not key.fileobj:
                            continue
                        if (
                            ev & selectors.EVENT_READ
                            and not self._read(p)
                            or ev & selectors.EVENT_WRITE
                            and not self._flush(p)
                        ):
                            self._broken(p)
                with self._dirty_lock:
                    touched |= self._dirty
                    self._dirty = set()
                    self._signalled = False
                now = time.monotonic()
                touched |= {p for p in waiting if p.retry_at <= now}
                for p in touched:
                    self._update(p, reg, waiting, now)
        finally:
            for s, _ in reg.values():
                s.close()
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _update(
        self, p: _Peer, reg: dict[_Peer, tuple[socket.socket, int]], waiting: set[_Peer], now: float
    ) -> None:
        """Bring a peer's registration in line with its state (flusher thread)."""
        with p.lock:
            dead, p.dead = p.dead, []
            if p.sock is None and p.queue and not p.closed and p.retry_at <= now:
                self._connect(p)
                if p.sock is not None and not self._flush(p):
                    self._broken(p)
                    dead += p.dead
                    p.dead = []
            want = 0
            if p.sock is not None:
                writes = p.queue and (p.ready or p.queue[0][0] is HELLO)
                want = selectors.EVENT_READ | (selectors.EVENT_WRITE if writes else 0)
            sock = p.sock
            if p.sock is None and p.queue and not p.closed:
                waiting.add(p)
            else:
                waiting.discard(p)
        old = reg.get(p)
        if old is not None and (old[0] is not sock or not want):
            self._sel.unregister(old[0])
            del reg[p]
            old = None
        for s in dead:
            s.close()
        if want and sock is not None:
            if old is None:
                self._sel.register(sock, want, p)
            elif old[1] != want:
                self._sel.modify(sock, want, p)
            reg[p] = (sock, want)

    def _read(self, p: _Peer) -> bool:
        """Take in the peer's greeting and first command (then send what waited for them),
        later drop what comes; False on EOF, error or a peer that is not ZMTP 3."""
        assert p.sock is not None
        if p.ready:
            return self._drain(p.sock)
        try:
            data = p.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        if not data:
            return False
        p.shake += data
        g = p.shake
        if len(g) >= 10 and (g[0] != 0xFF or not g[9] & 1):
            return False
        if len(g) < 66:
            return True
        size = g[65] if not g[64] & 2 else int.from_bytes(g[65:73], "big")
        if len(g) < (66 if not g[64] & 2 else 73) + size:
            return True
        p.ready, p.shake = True, b""
        return self._flush(p)

    @staticmethod
    def _drain(s: socket.socket) -> bool:
        """Read and drop what came in (a peer's greeting and READY); False on EOF or error."""
        try:
            while True:
                if not s.recv(4096):
                    return False
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
