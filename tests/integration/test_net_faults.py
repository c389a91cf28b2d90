"""The network fails under a transfer: a prefill, a decode and a bootstrap server, each on a
host of its own (network namespaces on one bridge, ``tests.harness.hosts``), over Mooncake
TCP between the hosts' own addresses, never loopback.

Each test also shows that the network did what it meant to do (a connection attempt that
times out while a link is cut, token-bucket counters that held traffic back), so none passes
because nothing happened. The hosts and processes start once for the module; the bootstrap
case runs last since it takes the bootstrap off the network.
"""

from __future__ import annotations

import ipaddress
import re
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pdxfer.agents.patterns import PoolGeom
from pdxfer.agents.process import Agent
from pdxfer.serving.toy.cluster import RemoteBootstrap
from pdxfer.transport import tcpstate
from tests.harness.hosts import Network

from .conftest import FAST
from .helpers import Factory, decode_items, prefill_items, verify, wait_written
from .netconf import NET_ENV, bootstrap_on, needs_root, port_of

pytestmark = needs_root

# 8 layers x K,V x 16 tokens x 8 heads x 128 dims x fp16 = 512 KiB per page across buffers
GEOMS = [
    PoolGeom("kv", "mha", layers=8, pages=320, page_size=16, heads=8, head_dim=128),
    PoolGeom("aux", "slots", layers=1, pages=64, dim=16, dtype="int32"),
]
PAGE = 512 << 10
LONG_S = 120.0
"""A deadline no test here should reach: a failure that comes well before it came from the
mechanism under test, on however slow a machine."""


class Net:
    """The module's hosts and processes."""

    def __init__(self) -> None:
        self.net = Network(["boot", "prefill", "decode"]).start()
        self.boot: RemoteBootstrap | None = None
        self.pf: Agent | None = None
        self.dc: Agent | None = None
        self.f = Factory(GEOMS, GEOMS, seed=11)

    def start(self) -> Net:
        n = self.net
        self.boot = bootstrap_on(n["boot"])
        self.pf = Agent(
            "prefill",
            {**FAST, "bootstrap": self.boot.address, "host": n["prefill"].addr},
            GEOMS,
            setup=n["prefill"].entry,
            env=NET_ENV,
        )
        self.dc = Agent(
            "decode",
            {**FAST, "host": n["decode"].addr},
            GEOMS,
            setup=n["decode"].entry,
            env=NET_ENV,
        )
        self.dc.call("sentinel")
        return self

    def close(self) -> None:
        for a in (self.pf, self.dc):
            if a is not None:
                a.close(timeout=10)
        if self.boot is not None:
            self.boot.stop()
        self.net.close()

    # -- requests ---------------------------------------------------------------------------
    def start_request(
        self, tokens: int, chunks: int, delay_s: float = 0.0, ep: str = "main"
    ) -> dict[str, Any]:
        """A request under way; if it fails, the decode refills its pages with the sentinel
        the moment they are handed back (``clean_after_release`` then sees a late write)."""
        assert self.pf is not None and self.dc is not None and self.boot is not None
        r = self.f.make(tokens, chunks=chunks)
        r["delay_s"], r["scrub"] = delay_s, True
        prep, send = prefill_items([r])
        self.pf.call("prepare", items=prep)
        self.dc.call("recv", items=decode_items([r]), bootstrap=self.boot.address, ep=ep)
        self.pf.call("send", items=send)
        return r

    def wait(self, r: dict[str, Any], timeout: float, ep: str = "main") -> dict[str, Any]:
        assert self.dc is not None
        return self.dc.call("wait", rooms=[r["room"]], timeout=timeout, ep=ep)[r["room"]]

    def released(self, r: dict[str, Any], timeout: float, ep: str = "main") -> bool:
        assert self.dc is not None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if r["room"] in self.dc.call("released", ep=ep):
                return True
            time.sleep(0.1)
        return r["room"] in self.dc.call("released", ep=ep)

    def clean_after_release(self, r: dict[str, Any], ep: str = "main") -> None:
        """No byte landed in the pages of failed request ``r`` once they were handed back."""
        assert self.dc is not None
        got = self.dc.call("dirty", dst=r["dst"], slots=r["dst_slots"], ep=ep)
        assert got == 0, f"room {r['room']}: {got} bytes landed after its pages came back"

    def settle(self, ep: str = "main", timeout: float = 20.0) -> None:
        """Nothing left in any table and no page quarantined (polls: acks may trail)."""
        assert self.pf is not None and self.dc is not None
        end = time.monotonic() + timeout
        while True:
            state = (
                self.dc.call("tables", ep=ep),
                self.pf.call("tables"),
                self.dc.call("metrics", ep=ep)["quarantined_pages"],
            )
            if state == ({"rooms": 0}, {"rooms": 0, "pending": 0}, 0):
                return
            assert time.monotonic() < end, f"leaked: decode, prefill tables, quarantined {state}"
            time.sleep(0.1)

    def quiet(self, timeout: float = LONG_S) -> None:
        """Until no socket on the prefill's host owes the decode bytes and none on the
        decode's host holds bytes from the prefill its process has not read: after it, no
        late byte can still land (a fixed sleep could end first on a slow machine)."""
        pf, dc = self.net["prefill"], self.net["decode"]
        end = time.monotonic() + timeout
        while owed(pf, dc.addr) or unread(dc, pf.addr):
            assert time.monotonic() < end, "TCP never delivered what it held"
            time.sleep(0.1)

    def ctrl_port(self, who: str) -> int:
        a = self.pf if who == "prefill" else self.dc
        assert a is not None
        return port_of(a.info["ctrl_addr"])

    def proves_cut(self, frm: str, to: str, timeout: float = 0.5) -> str:
        """A connection attempt across the cut link: anything but ``ok``/``refused``."""
        got = self.net[frm].reach(self.net[to].addr, self.ctrl_port(to), timeout=timeout)
        assert got in ("timeout", "unreachable"), f"{frm} -> {to} while cut: {got}"
        return got


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    n = Net()
    try:
        yield n.start()
    finally:
        n.close()


def ok_request(net: Net, tokens: int = 16 * 8) -> None:
    """A request succeeds byte for byte (nothing restarted since whatever came before)."""
    r = net.start_request(tokens, chunks=2)
    out = net.wait(r, 20)
    assert out["state"] == "Success", out
    assert net.dc is not None
    assert verify(net.dc, [r])[r["room"]][0] == 0
    net.f.free(r)


def test_processes_bind_and_advertise_their_hosts_addresses(net: Net) -> None:
    assert net.pf is not None and net.dc is not None and net.boot is not None
    assert net.pf.info["ctrl_addr"].startswith(f"tcp://{net.net['prefill'].addr}:")
    assert net.pf.info["session"].startswith(f"{net.net['prefill'].addr}:")
    assert net.dc.info["ctrl_addr"].startswith(f"tcp://{net.net['decode'].addr}:")
    assert net.boot.address.startswith(net.net["boot"].addr + ":")
    before = net.net["decode"].link_stats()
    ok_request(net, 16 * 16)  # 8 MiB of KV
    got = net.net["decode"].link_stats()["rx_bytes"] - before["rx_bytes"]
    assert got >= 16 * PAGE, f"the KV did not cross the decode's link ({got} bytes)"


@pytest.mark.parametrize("side, at", [("decode", "host"), ("prefill", "switch")])
def test_partition_mid_transfer_fails_with_peer_lost_and_quarantines_until_healed(
    net: Net, side: str, at: str
) -> None:
    """Cut one end of a transfer in flight: the decode fails the request with PeerLost
    within its heartbeat budget (two probes), keeps its pages while a write could still land
    (the prefill lives, and TCP delivers what it holds once the link heals), and releases
    them once the prefill acknowledges after the heal; the next request then succeeds with
    nothing restarted. ``decode``/``host``: the decode's own interface goes down, so its
    probes fail at once (a fast failure is no proof that the prefill died);
    ``prefill``/``switch``: the prefill's switch port goes down (a black hole)."""
    assert net.dc is not None
    host = net.net[side]
    lost = net.dc.call("metrics").get("peers_hung", 0)
    sent = net.pf.call("metrics")["transport_bytes"] if net.pf is not None else 0
    big = net.start_request(16 * 96, chunks=24, delay_s=0.1)  # 48 MiB over >= 2.4 s
    assert net.pf is not None
    wait_written(net.pf, sent)  # mid-transfer: the rest of its 24 chunks take 0.1 s each
    host.cut(at)
    try:
        out = net.wait(big, FAST["transfer_timeout_s"] + 5)
        net.proves_cut("decode" if side == "prefill" else "prefill", side)
        assert out["state"] == "Failed", out
        # the heartbeat's verdict, not the transfer's deadline (which a hang would reach):
        # the kind says which fired, whatever the machine's speed
        assert out["kind"] == "peer_lost", out
        assert "is not responding" in out["failure"], out
        # past abort_timeout_s the pages count as quarantined, and are not handed back
        end = time.monotonic() + FAST["abort_timeout_s"] + 30
        while net.dc.call("metrics")["quarantined_pages"] == 0 and time.monotonic() < end:
            time.sleep(0.1)
        assert net.dc.call("metrics")["quarantined_pages"] > 0
        assert big["room"] not in net.dc.call("released"), (
            "pages released while the prefill could still write into them"
        )
        # one verdict for the whole partition, however many probes it lasts
        assert net.dc.call("metrics").get("peers_hung", 0) == lost + 1
    finally:
        healed = time.monotonic()
        host.heal()
    assert net.released(big, 30), "pages still held after the heal"
    assert net.dc.call("release_counts")[big["room"]] == 1
    # whenever it came, the release came after the heal (a check bounded by no wait)
    assert net.dc.call("release_times")[big["room"]][0] > healed, (
        "pages released while the prefill could still write into them"
    )
    net.settle()
    net.quiet()  # TCP delivered whatever it still held, and the decode read it
    net.clean_after_release(big)
    net.f.free(big)
    ok_request(net)


def test_flapping_link_ends_each_request_byte_exact_or_cleanly_failed(net: Net) -> None:
    """50 flaps: a link goes down for 200 ms and up again under a transfer that has just
    started (the prefill's and the decode's, at the switch and at the host, in turn; the
    next transfer starts while earlier ones may still recover). Every request ends in
    Success with exact bytes, or fails and gets its pages back exactly once; none leaks."""
    assert net.dc is not None
    sides = [("prefill", "switch"), ("decode", "switch"), ("prefill", "host"), ("decode", "host")]
    live: list[tuple[int, dict[str, Any]]] = []
    outcomes: dict[str, int] = {}
    failed: list[dict[str, Any]] = []

    def finish(i: int, r: dict[str, Any]) -> None:
        assert net.dc is not None
        out = net.wait(r, FAST["transfer_timeout_s"] + 5)
        assert out["state"] in ("Success", "Failed"), out
        key = out["kind"] or "success"
        outcomes[key] = outcomes.get(key, 0) + 1
        if out["state"] == "Success":
            bad, first = verify(net.dc, [r])[r["room"]]
            side, at = sides[i % len(sides)]
            assert bad == 0, f"flap {i} ({side} at {at}): Success with wrong bytes: {first}"
            net.f.free(r)
        else:
            failed.append(r)

    for i in range(50):
        side, at = sides[i % len(sides)]
        live.append((i, net.start_request(16 * 6, chunks=6, delay_s=0.04)))  # 3 MiB, 0.24 s
        time.sleep(0.02 * (i % 4))
        host = net.net[side]
        host.cut(at)
        try:
            t0 = time.monotonic()
            net.proves_cut("decode" if side == "prefill" else "prefill", side, timeout=0.1)
            time.sleep(max(0.0, 0.2 - (time.monotonic() - t0)))
        finally:
            host.heal()
        while len(live) > 8:  # bounded: pages and slots for the ones still recovering
            finish(*live.pop(0))
    for i, r in live:
        finish(i, r)
    for r in failed:  # pages of failed requests come back exactly once, and stay clean
        assert net.released(r, 30), f"room {r['room']} never released"
        assert net.dc.call("release_counts")[r["room"]] == 1
    net.settle()
    for r in failed:
        net.clean_after_release(r)
        net.f.free(r)
    print(f"flap outcomes: {outcomes}")
    ok_request(net)


def owed(host: Any, addr: str) -> int:
    """Sockets on ``host`` that still owe ``addr`` bytes while orphaned or backed off."""
    total = 0
    for path in tcpstate.PATHS:
        text = subprocess.run(
            [*host.prefix, "cat", path], capture_output=True, text=True, check=False
        ).stdout
        total += sum(1 for o in tcpstate.parse(text) if o.remote == addr)
    return total


def unread(host: Any, addr: str) -> int:
    """Sockets on ``host`` holding bytes from ``addr`` that their process has not read yet
    (``/proc/net/tcp*`` receive queues)."""
    total = 0
    for path in tcpstate.PATHS:
        text = subprocess.run(
            [*host.prefix, "cat", path], capture_output=True, text=True, check=False
        ).stdout
        for line in text.splitlines()[1:]:
            f = line.split()
            if len(f) > 4 and int(f[4].partition(":")[2], 16) and _remote(f[2]) == addr:
                total += 1
    return total


def _remote(hexaddr: str) -> str:
    """``0100007F:1F90`` (IPv4) or 32 hex digits (IPv6; v4-mapped as IPv4) as an address."""
    raw = bytes.fromhex(hexaddr.partition(":")[0])
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def test_a_write_mooncake_dropped_lands_late_and_the_pages_wait_for_it(net: Net) -> None:
    """The prefill's data connections to the decode stall while the control path between
    them works (``block``): Mooncake drops each stalled connection after its progress
    timeout (the transfer deadline here, 10 s) and reports the write failed, but the closed
    sockets keep the bytes they buffered and deliver them once the link carries them again.
    The decode must not get the pages back before that (the prefill holds the failure until
    it proved the path quiet), so nothing lands after they came back. Without that, the
    failure reached the decode at once over the working control path, and the buffered
    bytes landed in pages already handed back (the flapping link's "landed after")."""
    assert net.pf is not None and net.dc is not None
    pf_host, dc_addr = net.net["prefill"], net.net["decode"].addr
    before = net.pf.call("metrics")
    big = net.start_request(16 * 96, chunks=24, delay_s=0.1)  # 48 MiB over >= 2.4 s
    wait_written(net.pf, before["transport_bytes"])
    pf_host.block(dc_addr, keep=[net.ctrl_port("decode"), net.ctrl_port("prefill")])
    try:
        assert pf_host.blocked() > 0 or wait_blocked(pf_host)
        # Mooncake gave up on the stalled write (10 s without progress), retried once, failed
        end = time.monotonic() + LONG_S
        while net.pf.call("metrics")["transport_failures"] <= before["transport_failures"]:
            assert time.monotonic() < end, "the prefill's write never failed"
            time.sleep(0.2)
        assert net.pf.call("metrics")["transport_taints"] > before.get("transport_taints", 0)
        assert owed(pf_host, dc_addr) > 0, "no dropped connection holds bytes: nothing to test"
        out = net.wait(big, LONG_S)
        assert out["state"] == "Failed", out
        assert big["room"] not in net.dc.call("released")
    finally:
        unblocked = time.monotonic()
        pf_host.unblock()
    assert net.released(big, 60), "pages still held after the link carried the bytes again"
    assert net.dc.call("release_counts")[big["room"]] == 1
    # the control path worked all along: a failure message would have released the pages
    # while the link was blocked, however late (the release's time bounds the check)
    assert net.dc.call("release_times")[big["room"]][0] > unblocked, (
        "pages handed back while a dropped connection still held bytes for them"
    )
    end = time.monotonic() + LONG_S
    while owed(pf_host, dc_addr):  # the kernel delivered (or dropped) what it held
        assert time.monotonic() < end, "the prefill's kernel never delivered its bytes"
        time.sleep(0.2)
    net.settle()
    net.clean_after_release(big)
    net.f.free(big)
    ok_request(net)


def wait_blocked(host: Any, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while host.blocked() == 0:
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def test_slow_link_delivers_within_deadline_and_too_short_deadline_fails_cleanly(net: Net) -> None:
    """The prefill's link is capped at 200 Mbit/s: a 64 MiB request (~2.7 s at that rate)
    arrives byte-exact within its 10 s deadline; a decode endpoint whose deadline is 1 s
    fails the same request with DeadlineExceeded naming the state it was in, and nothing
    leaks on either side."""
    assert net.dc is not None
    host = net.net["prefill"]
    dec = net.net["decode"]
    net.dc.call(
        "add_endpoint",
        name="short",
        role="decode",
        config={**FAST, "transfer_timeout_s": 1.0, "host": dec.addr},
        geoms=GEOMS,
    )
    host.cap(200)
    try:
        before = host.shaped()
        r = net.start_request(16 * 128, chunks=8)  # 128 pages: 64 MiB
        out = net.wait(r, 30)
        shaped = host.shaped()
        assert out["state"] == "Success", out
        assert verify(net.dc, [r])[r["room"]][0] == 0
        net.f.free(r)
        # the bucket carried the request and held it back: the cap is what set the pace
        assert shaped["bytes"] - before["bytes"] >= 128 * PAGE
        assert shaped["overlimits"] > before["overlimits"]

        r = net.start_request(16 * 128, chunks=8, ep="short")
        out = net.wait(r, 30, ep="short")
        assert out["state"] == "Failed", out
        assert out["kind"] == "deadline", out
        assert re.search(
            r"transfer \(state (WaitingForInput|Transferring), waiting for", out["failure"]
        ), out
        assert net.released(r, 30, ep="short")
        assert net.dc.call("release_counts", ep="short")[r["room"]] == 1
        net.settle(ep="short")
        net.clean_after_release(r, ep="short")
        net.f.free(r)
    finally:
        host.uncap()
        net.dc.call("close_endpoint", name="short")
    ok_request(net)


def test_bootstrap_unreachable_keeps_pairs_working_and_lookups_fail_naming_it(net: Net) -> None:
    """The bootstrap's host drops off the network: the pair already connected keeps
    serving (its route is known), and a lookup nobody made before fails at the request's
    own deadline (2 s: tries that time out are tried again until then), with a message
    naming the bootstrap."""
    assert net.dc is not None and net.boot is not None
    ok_request(net)  # the route is fresh
    boot = net.net["boot"]
    # the transfer's own deadline far off: only the lookup's 2 s can end the room in time
    net.dc.call(
        "add_endpoint",
        name="fresh",
        role="decode",
        config={
            **FAST,
            "bootstrap_timeout_s": 2.0,
            "transfer_timeout_s": LONG_S,
            "host": net.net["decode"].addr,
        },
        geoms=GEOMS,
    )
    boot.cut()
    try:
        got = net.net["decode"].reach(boot.addr, net.boot.port, timeout=0.5)
        assert got == "timeout", f"decode -> bootstrap while cut: {got}"
        ok_request(net)
        r = net.f.make(16 * 4)
        t0 = time.monotonic()
        net.dc.call("recv", items=decode_items([r]), bootstrap=net.boot.address, ep="fresh")
        out = net.wait(r, LONG_S / 2, ep="fresh")
        took = time.monotonic() - t0
        assert out["state"] == "Failed", out
        # the client's last try or the room's deadline, whichever ends first: both name it
        assert out["kind"] in ("bootstrap", "deadline"), out
        assert net.boot.address in out["failure"], out
        # a hang detector, not a stopwatch: far past 2 s (a loaded machine is slow), far
        # short of the transfer's own deadline (LONG_S), which would end a lookup that
        # ignored its 2 s
        assert took < LONG_S / 4, f"the lookup outlived its 2 s deadline: {took:.1f} s"
        assert net.released(r, 10, ep="fresh")
        net.f.free(r)
    finally:
        boot.heal()
        net.dc.call("close_endpoint", name="fresh")
    ok_request(net)
