"""The hosts harness itself (``tests.harness.hosts``): what the network tests lean on does
what it says, and leaves nothing behind, even when the test using it fails."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.harness.hosts import Network, ns_pids, sweep_stale

from .netconf import needs_root

pytestmark = needs_root

LISTEN = (
    "import socket, threading, time\n"
    "s = socket.socket(); s.bind(('0.0.0.0', 7000)); s.listen()\n"
    "def drain():\n"
    "    while True:\n"
    "        c, _ = s.accept()\n"
    "        while c.recv(1 << 16): pass\n"
    "        c.close()\n"
    "threading.Thread(target=drain, daemon=True).start()\n"
    "for _ in range(4): threading.Thread(target=time.sleep, args=(60,)).start()\n"
    "print('up', flush=True); time.sleep(60)\n"
)
"""A server on port 7000 that reads what it is sent, with a few more threads (a killed
process's threads outlive its main one for a moment: ``kill_all`` waits for them too)."""


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def serve(net: Network, host: str) -> subprocess.Popen[str]:
    p = net[host].popen([sys.executable, "-c", LISTEN], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "up"
    return p


def test_hosts_reach_each_other_and_cut_cap_and_kill_do_what_they_say() -> None:
    with Network(["a", "b"]) as net:
        a, b = net["a"], net["b"]
        assert a.addr != b.addr and a.addr.startswith("10.213.0.")
        srv = serve(net, "b")
        assert b.pids() == [srv.pid]  # ``ip netns exec`` execs: the pid is the program's
        assert a.reach(b.addr, 7000) == "ok" and a.reach(b.addr, 7001) == "refused"
        b.cut()  # the switch port: a black hole
        assert a.reach(b.addr, 7000, timeout=0.3) == "timeout"
        b.heal()
        assert a.reach(b.addr, 7000) == "ok"
        a.cut("host")  # its own interface: fails at once
        assert a.reach(b.addr, 7000) == "unreachable"
        a.heal()
        assert a.reach(b.addr, 7000) == "ok"
        a.cap(50)
        with a.enter():  # this thread's sockets now live on a
            import socket

            with socket.create_connection((b.addr, 7000), timeout=5) as s:
                s.sendall(b"x" * (1 << 20))
                s.shutdown(socket.SHUT_WR)
                assert s.recv(1) == b""  # the server read it all
        assert a.shaped()["bytes"] >= 1 << 20 and a.shaped()["overlimits"] > 0
        assert a.link_stats()["tx_bytes"] >= 1 << 20
        a.uncap()
        assert a.shaped() == {"bytes": 0, "overlimits": 0, "drops": 0}
        killed = b.kill_all()
        assert killed == [srv.pid] and srv.wait(timeout=5) == -signal.SIGKILL
        assert b.pids() == [] and a.reach(b.addr, 7000) == "refused"  # its sockets are gone
        mine = {h.ns for h in net.hosts.values()} | {net.bridge_ns}
        assert mine <= namespaces()
    assert not mine & namespaces()


def test_a_failing_test_leaves_no_namespace_link_or_process_behind() -> None:
    with pytest.raises(RuntimeError, match="the test failed"), Network(["x", "y"]) as net:
        srv = serve(net, "x")
        mine = {h.ns for h in net.hosts.values()} | {net.bridge_ns}
        raise RuntimeError("the test failed")
    assert not mine & namespaces()
    assert srv.poll() is not None


def test_two_networks_at_once_do_not_see_each_other() -> None:
    with Network(["a"]) as one, Network(["a"]) as two:
        assert one["a"].addr == two["a"].addr and one["a"].ns != two["a"].ns
        srv = serve(one, "a")
        assert two["a"].reach(two["a"].addr, 7000) == "refused"  # its own 10.213.0.10
        srv.kill()
        srv.wait()


def test_namespaces_left_by_a_killed_run_are_swept_by_the_next() -> None:
    """A test run killed outright cannot clean up: its namespaces carry its pid, and the
    next network removes them (with what still runs there) once that pid is gone."""
    code = (
        "import sys, time\nsys.path.insert(0, sys.argv[1])\n"
        "from tests.harness.hosts import Network\n"
        "net = Network(['z']).start()\n"
        "print(net['z'].ns, flush=True)\ntime.sleep(60)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.Popen([sys.executable, "-c", code, root], stdout=subprocess.PIPE, text=True)
    assert run.stdout is not None
    ns = run.stdout.readline().strip()
    assert ns in namespaces()
    run.kill()  # no atexit, no finally: the namespaces stay
    run.wait()  # gone: nothing of its own can remove them any more
    assert ns in namespaces()
    assert ns in sweep_stale() or ns not in namespaces()
    assert ns not in namespaces() and ns_pids(ns) == []
