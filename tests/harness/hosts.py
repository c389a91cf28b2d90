"""Little networks of "hosts" for tests: network namespaces joined by a bridge.

Loopback hides what a real deployment meets: a process that advertises ``127.0.0.1``, a
transport bound to the wrong interface, a link that fails under a transfer. ``Network``
builds N hosts, each a network namespace with its own address in ``10.213.0.0/24``, cabled
to a bridge in a namespace of its own, so nothing touches the machine's own network and two
test runs never see each other. A host runs any process (``ip netns exec``), and the network
can fail under it: ``cap`` (a token bucket), ``cut``/``heal`` (switch port or interface
down), ``block``/``unblock`` (one path between two processes), ``kill_all``. ``close()``
(also at exit) kills what runs on the hosts and deletes every namespace it made; namespaces
left by a killed run are removed by the next ``Network`` once their pid is gone. Everything
here needs root (``root_reason()`` says why a test must skip).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pdxfer.netaddr import NETNS_DIR, enter_netns, setns_net

SUBNET = "10.213.0"
"""The hosts' /24: private (RFC 1918), and only ever configured inside our namespaces."""
FIRST = 10
"""Host ``i`` is ``10.213.0.(FIRST + i)``."""
PREFIX = "pdxh"
_NAME = re.compile(rf"^{PREFIX}(\d+)x[0-9a-f]+-")


class NetError(RuntimeError):
    """A network command failed (the message carries the command and its stderr)."""


def root_reason() -> str | None:
    """Why this process cannot build networks (None when it can): namespaces, veth links
    and qdiscs need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)."""
    if os.geteuid() != 0:
        return "needs root: network namespaces, veth links and tc qdiscs (CI runs as root)"
    return None


def _ip(*args: str, check: bool = True) -> str:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise NetError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r.stdout


def _tc(ns: str, *args: str, check: bool = True) -> str:
    r = subprocess.run(
        ["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, timeout=30
    )
    if check and r.returncode != 0:
        raise NetError(f"tc {' '.join(args)} (in {ns}): {r.stderr.strip() or r.returncode}")
    return r.stdout


def ns_pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False)
    return [int(x) for x in out.split()]


def _gone(pid: int) -> bool:
    """Whether ``pid`` released everything (its sockets too): no such process, or a zombie
    whose threads all exited. A killed process's main thread leaves the namespace before its
    other threads have closed the files they share, so an empty ``ip netns pids`` alone does
    not mean its listening sockets are closed yet."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
    except (FileNotFoundError, ProcessLookupError):
        return True
    return (
        status.get("State", "").strip().startswith("Z")
        and int(status.get("Threads", "1").strip() or 1) <= 1
    )


def _kill_ns(ns: str, timeout: float = 10.0) -> list[int]:
    """SIGKILL every process in ``ns`` and wait until each has released its resources."""
    killed: list[int] = []
    end = time.monotonic() + timeout
    while True:
        pids = [p for p in ns_pids(ns) if p != os.getpid()]
        if not pids or time.monotonic() > end:
            break
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
                if p not in killed:
                    killed.append(p)
        time.sleep(0.05)
    while not all(_gone(p) for p in killed) and time.monotonic() < end:
        time.sleep(0.02)
    return killed


def _delete(ns: str) -> None:
    _kill_ns(ns)
    _ip("netns", "del", ns, check=False)


def sweep_stale() -> list[str]:
    """Delete namespaces left by networks whose test process no longer exists."""
    gone = []
    for line in _ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME.match(name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # its owner is alive (another run at the same time): not ours
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _delete(name)
        gone.append(name)
    return gone


class Host:
    """One namespace on the network: ``addr`` on its interface ``eth0``, whose other end is
    port ``port`` of the bridge."""

    def __init__(self, net: Network, name: str, index: int) -> None:
        self.net, self.name, self.index = net, name, index
        self.ns = f"{net.tag}-{name}"
        self.addr = f"{SUBNET}.{FIRST + index}"
        self.port = f"p{index}"
        self.capped_mbit: float | None = None
        self._cut: str | None = None
        self._procs: list[subprocess.Popen[Any]] = []

    def __repr__(self) -> str:
        return f"Host({self.name} {self.addr})"

    # -- running things ------------------------------------------------------------------------
    @property
    def prefix(self) -> list[str]:
        """What to put before a command to run it on this host."""
        return ["ip", "netns", "exec", self.ns]

    @property
    def entry(self) -> functools.partial[None]:
        """What ``Agent(setup=...)`` calls first in its process to run it on this host."""
        return functools.partial(enter_netns, self.ns)

    def popen(
        self, argv: Sequence[str], env: Mapping[str, str] | None = None, **kw: Any
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` on this host (``env`` added to this process's environment); its pid
        is the command's own (``ip netns exec`` execs it)."""
        p = subprocess.Popen([*self.prefix, *argv], env={**os.environ, **(env or {})}, **kw)
        self._procs.append(p)
        return p

    @contextlib.contextmanager
    def enter(self) -> Iterator[Host]:
        """Run the calling thread on this host for the block: sockets it opens meanwhile
        (a client's) live in this host's namespace, and keep living there afterwards."""
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            fd = os.open(f"{NETNS_DIR}/{self.ns}", os.O_RDONLY)
            try:
                setns_net(fd)
            finally:
                os.close(fd)
            try:
                yield self
            finally:
                setns_net(own)
        finally:
            os.close(own)

    def pids(self) -> list[int]:
        return ns_pids(self.ns)

    def kill_all(self) -> list[int]:
        """SIGKILL every process on this host (the host died); returns their pids."""
        killed = _kill_ns(self.ns)
        for p in self._procs:
            with contextlib.suppress(Exception):
                p.wait(timeout=5)
        return killed

    # -- failing the network ---------------------------------------------------------------------
    def cut(self, at: str = "switch") -> None:
        """Take this host off the network: its switch port goes down (``switch``: packets
        vanish both ways, as when a cable or a switch fails) or its own interface does
        (``host``: its sockets see "network unreachable" at once)."""
        if at not in ("switch", "host"):
            raise ValueError(f"at must be 'switch' or 'host', got {at!r}")
        if at == "switch":
            _ip("-n", self.net.bridge_ns, "link", "set", self.port, "down")
        else:
            _ip("-n", self.ns, "link", "set", "eth0", "down")
        self._cut = at

    def heal(self) -> None:
        if self._cut == "switch":
            _ip("-n", self.net.bridge_ns, "link", "set", self.port, "up")
        elif self._cut == "host":
            _ip("-n", self.ns, "link", "set", "eth0", "up")  # its routes come back with it
        self._cut = None

    @property
    def is_cut(self) -> bool:
        return self._cut is not None

    def cap(self, mbit: float, burst_kb: int = 64, latency_ms: int = 100) -> None:
        """Limit this host's link to ``mbit`` Mbit/s each way (tbf on its interface for what
        it sends, on its switch port for what it receives)."""
        for ns, dev in ((self.ns, "eth0"), (self.net.bridge_ns, self.port)):
            _tc(
                ns,
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                f"{mbit}mbit",
                "burst",
                f"{burst_kb}kb",
                "latency",
                f"{latency_ms}ms",
            )
        self.capped_mbit = mbit

    def block(self, addr: str, keep: Sequence[int] = ()) -> None:
        """Drop every IPv4 packet this host sends to ``addr``, except TCP segments whose
        destination or source port is in ``keep`` (e.g. a control connection either side
        opened, while the data connections stall). ``unblock()`` ends it."""
        # htb (no prio qdisc or drop action in every kernel): kept traffic goes to a fast
        # class, the rest to one of 8 bit/s whose one-packet queue drops all that follows
        _tc(
            self.ns,
            "qdisc",
            "replace",
            "dev",
            "eth0",
            "root",
            "handle",
            "1:",
            "htb",
            "default",
            "1",
            "r2q",
            "1000",
        )
        _tc(
            self.ns,
            "class",
            "add",
            "dev",
            "eth0",
            "parent",
            "1:",
            "classid",
            "1:1",
            "htb",
            "rate",
            "10gbit",
        )
        _tc(
            self.ns,
            "class",
            "add",
            "dev",
            "eth0",
            "parent",
            "1:",
            "classid",
            "1:2",
            "htb",
            "rate",
            "8bit",
            "ceil",
            "8bit",
        )
        _tc(
            self.ns,
            "qdisc",
            "add",
            "dev",
            "eth0",
            "parent",
            "1:2",
            "handle",
            "2:",
            "pfifo",
            "limit",
            "1",
        )
        for port in keep:
            for field in ("dport", "sport"):
                _tc(
                    self.ns,
                    "filter",
                    "add",
                    "dev",
                    "eth0",
                    "parent",
                    "1:",
                    "protocol",
                    "ip",
                    "prio",
                    "1",
                    "u32",
                    "match",
                    "ip",
                    "dst",
                    f"{addr}/32",
                    "match",
                    "ip",
                    field,
                    str(port),
                    "0xffff",
                    "flowid",
                    "1:1",
                )
        _tc(
            self.ns,
            "filter",
            "add",
            "dev",
            "eth0",
            "parent",
            "1:",
            "protocol",
            "ip",
            "prio",
            "2",
            "u32",
            "match",
            "ip",
            "dst",
            f"{addr}/32",
            "flowid",
            "1:2",
        )

    def blocked(self) -> int:
        """Packets the ``block`` filters dropped so far."""
        for q in json.loads(_tc(self.ns, "-s", "-j", "qdisc", "show", "dev", "eth0")):
            if q.get("kind") == "pfifo" and q.get("handle") == "2:":
                return int(q.get("drops", 0))
        return 0

    def unblock(self) -> None:
        _tc(self.ns, "qdisc", "del", "dev", "eth0", "root", check=False)

    def uncap(self) -> None:
        for ns, dev in ((self.ns, "eth0"), (self.net.bridge_ns, self.port)):
            _tc(ns, "qdisc", "del", "dev", dev, "root", check=False)
        self.capped_mbit = None

    # -- evidence --------------------------------------------------------------------------------
    def link_stats(self) -> dict[str, int]:
        """Bytes and packets this host's interface sent and received (kernel counters)."""
        out = json.loads(_ip("-n", self.ns, "-s", "-j", "link", "show", "eth0"))[0]
        s = out["stats64"]
        return {
            "rx_bytes": s["rx"]["bytes"],
            "tx_bytes": s["tx"]["bytes"],
            "rx_packets": s["rx"]["packets"],
            "tx_packets": s["tx"]["packets"],
        }

    def shaped(self) -> dict[str, int]:
        """The host's egress token bucket: bytes it passed and times it held traffic back
        (``overlimits``: non-zero only when the cap was what limited the traffic)."""
        for q in json.loads(_tc(self.ns, "-s", "-j", "qdisc", "show", "dev", "eth0")):
            if q.get("kind") == "tbf":
                return {
                    "bytes": int(q.get("bytes", 0)),
                    "overlimits": int(q.get("overlimits", 0)),
                    "drops": int(q.get("drops", 0)),
                }
        return {"bytes": 0, "overlimits": 0, "drops": 0}

    def reach(self, addr: str, port: int, timeout: float = 1.0) -> str:
        """Try a TCP connection from this host: ``ok``, ``refused`` (the host answered, no
        one listens), ``timeout`` (nothing came back) or ``unreachable``."""
        result: list[str] = []

        def attempt() -> None:
            with self.enter():
                try:
                    socket.create_connection((addr, port), timeout=timeout).close()
                    result.append("ok")
                except ConnectionRefusedError:
                    result.append("refused")
                except TimeoutError:
                    result.append("timeout")
                except OSError as e:
                    result.append(
                        "unreachable"
                        if e.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH)
                        else f"error: {e}"
                    )

        t = threading.Thread(target=attempt, name=f"reach-{self.name}")
        t.start()  # its own thread: the caller's stays where it is
        t.join(timeout + 5)
        return result[0] if result else "timeout"


class Network:
    """``names`` hosts on one bridge. Use as a context manager (or call ``close()``)."""

    def __init__(self, names: Sequence[str]) -> None:
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"host names must be unique and non-empty: {names}")
        if len(names) > 200:
            raise ValueError("at most 200 hosts")
        self.tag = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
        self.bridge_ns = f"{self.tag}-switch"
        self.hosts = {n: Host(self, n, i) for i, n in enumerate(names)}
        self._made: list[str] = []
        self._closed = False

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def start(self) -> Network:
        why = root_reason()
        if why:
            raise NetError(why)
        sweep_stale()
        atexit.register(self.close)
        try:
            self._add_ns(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for h in self.hosts.values():
                self._add_ns(h.ns)
                _ip("-n", h.ns, "link", "set", "lo", "up")
                # created inside the host and the switch at once: no name in the machine's
                # own namespace, so runs side by side cannot collide
                _ip(
                    "-n",
                    h.ns,
                    "link",
                    "add",
                    "eth0",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    h.port,
                    "netns",
                    self.bridge_ns,
                )
                _ip("-n", self.bridge_ns, "link", "set", h.port, "master", "br0")
                _ip("-n", self.bridge_ns, "link", "set", h.port, "up")
                _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", "eth0")
                _ip("-n", h.ns, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def close(self) -> None:
        """Kill every process on every host, then delete the namespaces (and so the links).
        Idempotent; runs at exit too."""
        if self._closed:
            return
        self._closed = True
        for ns in reversed(self._made):
            _delete(ns)
        for h in self.hosts.values():
            for p in h._procs:
                with contextlib.suppress(Exception):
                    p.wait(timeout=5)
        atexit.unregister(self.close)

    def __enter__(self) -> Network:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "FIRST",
    "SUBNET",
    "Host",
    "NetError",
    "Network",
    "enter_netns",
    "ns_pids",
    "root_reason",
    "sweep_stale",
]
