"""The control socket's receive side: frames are read header first, into bounded memory.

Peers send with ZMQ PUSH sockets; this side speaks what a ZMQ PULL socket speaks on TCP
(ZMTP 3.0 with the NULL mechanism: a 64-byte greeting, one READY command each way, then
length-prefixed frames) but reads each frame itself. A ZMQ PULL socket cannot be used here: it
reads a whole message into memory it allocates before the application sees a byte of it,
queues up to its high-water mark of them per connection and accepts any number of
connections, and the freed buffers of a flood stay in the process's heap (glibc keeps them).
Here each frame's header is checked before its body is read, and memory and connections are
capped (``Inbox`` lists the rules).
"""

from __future__ import annotations

import logging
import mmap
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from .. import wire
from ..trust import peer_allowed

log = logging.getLogger(__name__)

READ_AHEAD = 4096
"""Bytes read at a frame boundary: most control frames arrive whole in one read."""
SINK = 256 << 10
"""Bytes read per call while dropping a refused frame's body."""
MAX_CONNECTIONS = 4096
"""Open connections per endpoint (a prefill's decode peers, ``max_peers``, fit)."""
RECV_BUDGET = 64 << 20
"""Bytes of frames being received, per process (at least one largest frame fits)."""
HANDSHAKE_S = 10.0
FRAME_S = 30.0
"""A connection's greeting, and a frame that holds a pool buffer, must arrive within these."""
MAX_COMMAND = 4096
"""A ZMTP command (READY, PING) is small; a larger one ends the connection."""
MAPPED = 64 << 10
"""Pool buffers this large or larger are mapped (and unmapped) rather than allocated."""
IDLE_S = 1.0
"""A mapped buffer unused this long is unmapped."""


def zmtp_hello(socket_type: bytes) -> bytes:
    """A ZMTP 3.0 NULL-mechanism greeting and the READY command naming ``socket_type``: what
    each side of a connection sends first (``outbox`` as PUSH, this receiver as PULL)."""
    greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)
    ready = (
        b"\x05READY"
        + bytes([11])
        + b"Socket-Type"
        + len(socket_type).to_bytes(4, "big")
        + socket_type
    )
    return greeting + bytes([0x04, len(ready)]) + ready


_HELLO = zmtp_hello(b"PULL")
"""What this side sends on accepting: its greeting and READY (it never sends a frame)."""
MORE, LONG, COMMAND = 1, 2, 4

GREETING, READY, FRAMES, BODY, SKIP = range(5)


class RecvPool:
    """Bytes of frames being received, capped per process; ``untrusted`` caps what
    connections without an admitted frame may hold together (before authentication).

    Buffers of ``MAPPED`` bytes or more are anonymous mappings in power-of-two sizes, reused
    while frames keep coming (a mapping's first touch costs a page fault per 4 KiB) and
    unmapped once idle for ``IDLE_S`` (``trim``), so after a burst or a flood the memory is
    the OS's again whatever the allocator does."""

    def __init__(self, budget: int, untrusted: int) -> None:
        self.budget, self.untrusted = budget, untrusted
        self.used = self.used_untrusted = self.peak = self.taken = 0
        self._idle: dict[int, list[tuple[float, mmap.mmap]]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def cost(n: int) -> int:
        """What a frame of ``n`` bytes holds of the budget (its buffer's size)."""
        return n if n < MAPPED else 1 << (n - 1).bit_length()

    def fits(self, n: int, trusted: bool) -> bool:
        cost = self.cost(n)
        return self.used + cost <= self.budget and (
            trusted or self.used_untrusted + cost <= self.untrusted
        )

    def take(self, n: int, trusted: bool) -> memoryview | None:
        cost = self.cost(n)
        with self._lock:
            if not self.fits(n, trusted):
                return None
            self.used += cost
            if not trusted:
                self.used_untrusted += cost
            self.peak = max(self.peak, self.used)
            self.taken += cost
            idle = self._idle.get(cost)
            mm = idle.pop()[1] if idle else None
        try:
            if n < MAPPED:
                return memoryview(bytearray(n))
            return memoryview(mm if mm is not None else mmap.mmap(-1, cost))
        except BaseException:
            self.give(n, trusted, None)
            raise

    def give(self, n: int, trusted: bool, buf: memoryview | None) -> None:
        cost = self.cost(n)
        obj = buf.obj if buf is not None else None
        if buf is not None:
            buf.release()
        with self._lock:
            self.used -= cost
            if not trusted:
                self.used_untrusted -= cost
            if isinstance(obj, mmap.mmap):
                self._idle.setdefault(cost, []).append((time.monotonic(), obj))

    def trim(self, now: float) -> None:
        """Unmap the buffers idle for ``IDLE_S``."""
        with self._lock:
            old = [mm for v in self._idle.values() for t, mm in v if now - t > IDLE_S]
            for k in list(self._idle):
                self._idle[k] = [(t, mm) for t, mm in self._idle[k] if now - t <= IDLE_S]
        for mm in old:
            try:
                mm.close()
            except BufferError:  # a handler kept a view of it: it goes with that view
                pass

    def mapped(self) -> int:
        """Bytes of idle mappings kept for reuse."""
        with self._lock:
            return sum(k * len(v) for k, v in self._idle.items())


_POOL: RecvPool | None = None
_POOL_LOCK = threading.Lock()


def pool(max_frame: int) -> RecvPool:
    """The process's receive pool (shared by every endpoint of the process)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = RecvPool(max(RECV_BUDGET, max_frame), max_frame)
        return _POOL


@dataclass(slots=True, eq=False)
class Conn:
    sock: socket.socket
    since: float
    state: int = GREETING
    tail: bytes = b""
    """Bytes of an incomplete greeting, command or frame kept between reads (< 2 reads)."""
    trusted: bool = False
    """It delivered a frame the endpoint admitted (with a secret: authenticated)."""
    more: bool = False
    """Inside a multi-part message (pdxfer sends none: its parts are dropped)."""
    buf: memoryview | None = None
    pool_trusted: bool = False
    """Which share of the pool ``buf`` was taken from."""
    size: int = 0
    got: int = 0
    skip: int = 0
    waiting: bool = False
    """It waits for room in the pool for a frame of ``size`` bytes (and is not read)."""


Screen = Callable[[memoryview, int], bool]
Deliver = Callable[[memoryview], bool]


class Inbox:
    """Accepts PUSH peers on ``host`` and hands each complete frame to ``deliver`` (which
    says whether the frame was admitted), after ``screen`` passed its header.

    Per connection:

    - frames are read at most ``READ_AHEAD`` bytes at a time into one shared scratch buffer;
      a frame complete in it is handed over from there (no allocation);
    - a larger frame's pdxfer header is checked first (``screen``: magic, version, kind, the
      kind's size cap, and with a secret the mode and the pair; everything but the MAC): a
      frame that will be refused is read into a shared sink and dropped, so it costs its
      header;
    - a frame that passed gets a buffer from the process-wide ``RecvPool``, whose total is
      capped, with a smaller cap for connections that have not yet delivered an admitted
      frame (before authentication). Buffers of 64 KiB and more are anonymous mappings,
      unmapped when the frame was handled, so their memory goes back to the OS whatever the
      allocator does. A connection that must wait for the pool stops being read (TCP pushes
      back on its sender);
    - connections are capped (``MAX_CONNECTIONS``; the oldest one that never delivered an
      admitted frame is closed for a new one), and a handshake or a frame holding a buffer
      must complete within its deadline, so a stalled sender cannot hold memory."""

    def __init__(
        self,
        host: str,
        deliver: Deliver,
        screen: Screen,
        reject: Callable[[str, str], None],
        max_frame: int,
        loopback_only: bool = False,
    ) -> None:
        """``loopback_only``: protected mode (``pdxfer.trust``, no secret): a peer on another
        host is closed on accept, before a byte is read or sent."""
        self._deliver, self._screen, self._reject = deliver, screen, reject
        self.loopback_only = loopback_only
        self.max_frame = max_frame
        self.pool = pool(max_frame)
        self._listen, self.port = _listen(host)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listen, selectors.EVENT_READ, None)
        self._conns: OrderedDict[int, Conn] = OrderedDict()
        self._waiting: list[Conn] = []
        self._scratch = bytearray(3 * READ_AHEAD)
        self._sink = bytearray(SINK)
        self.closed_connections = 0

    def connections(self) -> int:
        return len(self._conns)

    # -- the control thread's loop calls these -------------------------------------------------
    def poll(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for input and handle what arrived."""
        for key, _ in self._sel.select(timeout):
            if key.data is None:
                self._accept()
            else:
                self._read(key.data)
        if self._waiting:
            self._resume()

    def expire(self, now: float) -> None:
        """Close connections whose handshake or buffered frame is past its deadline; unmap
        idle receive buffers."""
        self.pool.trim(now)
        for c in list(self._conns.values()):
            limit = (
                HANDSHAKE_S
                if c.state in (GREETING, READY)
                else FRAME_S
                if c.state == BODY or c.waiting
                else 0.0
            )
            if limit and now - c.since > limit:
                self._close(c, "deadline")

    def close(self) -> None:
        for c in list(self._conns.values()):
            self._close(c)
        self._sel.close()
        self._listen.close()

    # -- internals -----------------------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(64):
            try:
                s, peer = self._listen.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors: the next poll tries again
                log.warning("control socket cannot accept: %s", e)
                return
            if self.loopback_only and not peer_allowed(peer[0]):
                s.close()
                self._reject(
                    "peer_not_loopback",
                    f"refused {peer[0]}: no shared secret is "
                    f"set, so only loopback peers are served",
                )
                continue
            if len(self._conns) >= MAX_CONNECTIONS:
                old = next((c for c in self._conns.values() if not c.trusted), None)
                if old is None:
                    s.close()
                    self._reject("connections", f"{MAX_CONNECTIONS} connections, all trusted")
                    continue
                self._close(old, "connections")
            s.setblocking(False)
            try:
                s.send(_HELLO)  # 92 bytes on a fresh connection: never short
            except OSError:
                s.close()
                continue
            c = Conn(s, time.monotonic())
            self._conns[s.fileno()] = c
            self._sel.register(s, selectors.EVENT_READ, c)

    def _close(self, c: Conn, why: str = "") -> None:
        if self._conns.pop(c.sock.fileno(), None) is None:
            return
        if why:
            self.closed_connections += 1
            log.debug("closing control connection: %s", why)
        if not c.waiting:
            self._sel.unregister(c.sock)
        else:
            self._waiting.remove(c)
        self._drop_buf(c)
        c.sock.close()

    def _drop_buf(self, c: Conn) -> None:
        if c.buf is not None:
            self.pool.give(c.size, c.pool_trusted, c.buf)
            c.buf = None

    def _read(self, c: Conn) -> None:
        for _ in range(8):  # then let other connections have their turn
            try:
                if c.state == BODY:
                    assert c.buf is not None
                    n = c.sock.recv_into(c.buf[c.got : c.size])
                elif c.state == SKIP:
                    n = c.sock.recv_into(self._sink, min(c.skip, SINK))
                else:
                    k = len(c.tail)
                    self._scratch[:k] = c.tail
                    n = c.sock.recv_into(memoryview(self._scratch)[k : k + READ_AHEAD])
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._close(c, "connection error")
                return
            if n == 0:
                self._close(c, "closed by peer")
                return
            if c.state == BODY:
                c.got += n
                if c.got == c.size:
                    self._body_done(c)
            elif c.state == SKIP:
                c.skip -= n
                if not c.skip:
                    c.state, c.since = FRAMES, time.monotonic()
            else:
                data = memoryview(self._scratch)[: len(c.tail) + n]
                c.tail = b""
                self._parse(c, data)
            if c.sock.fileno() not in self._conns or c.waiting:
                return

    def _parse(self, c: Conn, data: memoryview) -> None:
        """Consume ``data`` (greeting, commands, whole frames); keep an incomplete rest."""
        pos, end = 0, len(data)
        while pos < end:
            if c.state == GREETING:
                if end - pos < 64:
                    break
                g = data[pos : pos + 64]
                if (
                    g[0] != 0xFF
                    or not g[9] & 1
                    or g[10] < 3
                    or bytes(g[12:32]).rstrip(b"\0") != b"NULL"
                ):
                    self._close(c, "not a ZMTP 3 peer with the NULL mechanism")
                    return
                pos += 64
                c.state = READY
                continue
            flags = data[pos]
            p = 9 if flags & LONG else 2
            if flags & ~(MORE | LONG | COMMAND) or end - pos < p:
                if flags & ~(MORE | LONG | COMMAND):
                    self._close(c, "bad ZMTP frame flags")
                    return
                break
            size = int.from_bytes(data[pos + 1 : pos + 9], "big") if flags & LONG else data[pos + 1]
            body = pos + p
            avail = end - body
            if flags & COMMAND or c.state == READY:
                if not flags & COMMAND or size > MAX_COMMAND:
                    self._close(c, "ZMTP handshake expected a small command")
                    return
                if avail < size:
                    break
                if c.state == READY:
                    if not _ready_from_push(data[body : body + size]):
                        self._close(c, "the peer is not a ZMQ PUSH socket")
                        return
                    c.state, c.since = FRAMES, time.monotonic()
                pos = body + size  # later commands (PING and the like) are ignored
                continue
            if size > self.max_frame:
                self._reject(
                    "oversized",
                    f"control frame of {size} bytes exceeds {self.max_frame}: connection closed",
                )
                self._close(c, "oversized frame")
                return
            multi = c.more or bool(flags & MORE)
            c.more = bool(flags & MORE)
            if multi:
                if not c.more:
                    self._reject("malformed", "multi-part control message")
                if not self._skip(c, size, avail):
                    return
                pos = body + size
                continue
            if avail >= size:
                self._hand_over(c, data[body : body + size])
                if c.sock.fileno() not in self._conns:
                    return
                pos = body + size
                continue
            if avail < wire.HEADER_LEN or size + p <= READ_AHEAD:
                break  # the header (or a small frame) completes with the next read
            if not self._screen(data[body : body + wire.HEADER_LEN], size):
                self._skip(c, size, avail)
                return
            if not self._start_body(c, size, data[body:end]):
                c.tail, c.size = bytes(data[pos:end]), size
                self._wait(c)
            return
        c.tail = bytes(data[pos:end])

    def _skip(self, c: Conn, size: int, avail: int) -> bool:
        """Drop the rest of a frame; False when it goes on past this read."""
        if avail >= size:
            return True
        c.state, c.skip, c.since = SKIP, size - avail, time.monotonic()
        return False

    def _start_body(self, c: Conn, size: int, have: memoryview) -> bool:
        buf = self.pool.take(size, c.trusted)
        if buf is None:
            return False
        buf[: len(have)] = have
        c.buf, c.size, c.got, c.pool_trusted = buf, size, len(have), c.trusted
        c.state, c.since = BODY, time.monotonic()
        return True

    def _body_done(self, c: Conn) -> None:
        assert c.buf is not None
        buf, c.buf = c.buf, None
        c.state, c.since = FRAMES, time.monotonic()
        try:
            self._hand_over(c, buf[: c.size])
        finally:
            self.pool.give(c.size, c.pool_trusted, buf)

    def _hand_over(self, c: Conn, frame: memoryview) -> None:
        if self._deliver(frame):
            c.trusted = True

    def _wait(self, c: Conn) -> None:
        """Stop reading ``c`` until the pool has room for its frame."""
        self._sel.unregister(c.sock)
        c.waiting, c.since = True, time.monotonic()
        self._waiting.append(c)

    def _resume(self) -> None:
        for c in list(self._waiting):
            if not self.pool.fits(c.size, c.trusted):
                continue
            self._waiting.remove(c)
            c.waiting = False
            self._sel.register(c.sock, selectors.EVENT_READ, c)
            data, c.tail = memoryview(c.tail), b""
            self._parse(c, data)


def _ready_from_push(cmd: memoryview) -> bool:
    """Whether a ZMTP command is READY from a PUSH socket (the only sender a PULL side takes)."""
    if bytes(cmd[:6]) != b"\x05READY":
        return False
    pos, end = 6, len(cmd)
    while pos < end:
        n = cmd[pos]
        name = bytes(cmd[pos + 1 : pos + 1 + n])
        pos += 1 + n
        if pos + 4 > end:
            return False
        vlen = int.from_bytes(cmd[pos : pos + 4], "big")
        value = bytes(cmd[pos + 4 : pos + 4 + vlen])
        pos += 4 + vlen
        if name == b"Socket-Type":
            return value == b"PUSH"
    return False


def _listen(host: str) -> tuple[socket.socket, int]:
    """A non-blocking listening TCP socket on ``host`` (``*``: every address), random port."""
    h = host.strip("[]")
    h = "0.0.0.0" if h in ("*", "") else h
    fam, kind, proto, _, addr = socket.getaddrinfo(
        h, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    s = socket.socket(fam, kind, proto)
    try:
        s.bind(addr)
        s.listen(512)
        s.setblocking(False)
    except BaseException:
        s.close()
        raise
    return s, int(s.getsockname()[1])
