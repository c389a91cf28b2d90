"""Mooncake transport bookkeeping with a scripted engine (no process, no network): a write
that fails halfway gives back every credit it took, so the peer is not slowly starved."""

from __future__ import annotations

import pytest

from pdxfer import TransportError
from pdxfer.transport import mooncake


class ScriptedEngine:
    """Answers like Mooncake's engine; batch number ``fail_at`` (1-based) fails for good."""

    fail_at = 0

    def __init__(self) -> None:
        self.bids = 0
        self.bad: set[int] = set()
        self.calls = 0
        self.synced: list[list[int]] = []
        self.fail_parts: set[int] = set()
        """Sources whose one-entry batch fails (polled writes)."""

    def initialize(self, *a: object) -> int:
        return 0

    def get_rpc_port(self) -> int:
        return 1

    def register_memory(self, *a: object) -> int:
        return 0

    def unregister_memory(self, *a: object) -> int:
        return 0

    def batch_transfer_async_write(self, peer: str, s: list, d: list, n: list) -> int:
        self.calls += 1
        self.bids += 1
        if self.calls == self.fail_at:
            self.bad.add(self.bids)
        return self.bids

    def get_batch_transfer_status(self, bids: list[int]) -> int:
        return -1 if bids[0] in self.bad else 0

    def batch_transfer_sync_write(self, peer: str, s: list, d: list, n: list) -> int:
        self.calls += 1
        self.synced.append(list(s))
        return -1 if self.calls >= self.fail_at > 0 else 0

    def transfer_submit_write(self, peer: str, s: int, d: int, n: int) -> int:
        self.bids += 1
        if s in self.fail_parts:
            self.bad.add(self.bids)
        return self.bids

    def transfer_check_status(self, bid: int) -> int:
        return -1 if bid in self.bad else 1


@pytest.fixture
def transport(monkeypatch: pytest.MonkeyPatch) -> mooncake.MooncakeTransport:
    monkeypatch.setattr(mooncake, "_load_engine", lambda: ScriptedEngine)
    return mooncake.MooncakeTransport(max_batch=8, window=2, completion="paced")


@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_a_multi_batch_write_that_fails_gives_back_every_credit(
    transport: mooncake.MooncakeTransport, fail_at: int
) -> None:
    transport._engine.fail_at = fail_at
    blocks = list(range(0, 20 * 64, 64))
    with pytest.raises(TransportError):
        transport.write("peer", blocks, blocks, [64] * 20)
    credits, _ = transport._peer_state("peer")
    assert credits.used == 0 and credits.bytes == 0
    assert transport.stats.failures >= 1
    transport._engine.fail_at = 0  # the peer recovers: the full cap is available again
    transport.write("peer", blocks, blocks, [64] * 20)
    assert credits.used == 0


def test_a_started_write_that_fails_gives_back_its_credits(
    transport: mooncake.MooncakeTransport,
) -> None:
    transport._engine.fail_at = 1
    started = transport.start("peer", [0], [0], [64])
    assert started is not None and started.submitted > 0
    with pytest.raises(TransportError):
        transport.finish("peer", started)
    assert transport._peer_state("peer")[0].used == 0


def test_one_thread_at_a_time_spins_in_a_peers_completion_wait(
    transport: mooncake.MooncakeTransport,
) -> None:
    """Mooncake's completion wait spins: four writers to one peer waiting at once would take
    four cores' worth of spinning; they take turns instead (the others sleep on a lock)."""
    import threading
    import time

    eng = transport._engine
    inside = [0]
    most = [0]
    guard = threading.Lock()

    def status(bids: list[int]) -> int:
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.02)  # the spin
        with guard:
            inside[0] -= 1
        return 0

    eng.get_batch_transfer_status = status
    blocks = list(range(0, 8 * 64, 64))  # two batches each: submitted, then awaited
    ts = [
        threading.Thread(target=transport.write, args=("peer", blocks, blocks, [64] * 8))
        for _ in range(4)
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert most[0] == 1
    assert transport.stats.calls == 8


def test_a_failed_write_taints_its_peer_until_a_later_fence_and_a_quiet_kernel_prove_it(
    transport: mooncake.MooncakeTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mooncake reports a batch failed while parts of it may still be queued or buffered:
    the peer stays tainted until a fence written after the failure completed and the kernel
    then owes the peer's host nothing, three reads in a row; a failure after the fence needs
    a fence of its own."""
    from pdxfer.transport import tcpstate

    owed: list[tcpstate.Owed] = []
    monkeypatch.setattr(tcpstate, "owed", lambda ip: list(owed))
    eng = transport._engine
    peer = "10.213.0.12:16000"
    eng.fail_at = 1
    with pytest.raises(TransportError):
        transport.write(peer, [0, 64], [128, 192], [64, 64])
    assert transport.tainted(peer) and transport.tainted_peers() == [peer]
    assert transport.stats.taints >= 1
    assert not transport.settle(peer)  # the fence fails too: the path is still down
    eng.fail_at = 0
    eng.calls = 0
    assert not transport.settle(peer)  # the fence went through (a rewrite of the first block)
    owed.append(tcpstate.Owed("10.213.0.12", 16001, 1, 4096, 0, True))
    assert not transport.settle(peer)  # a dropped connection still holds bytes for it
    owed.clear()
    assert not transport.settle(peer) and not transport.settle(peer)
    transport._taint(peer, mooncake._Batch([0], [128], [64]))  # fails again meanwhile
    assert not transport.settle(peer)  # that failure came after the fence: a new one
    assert not any(transport.settle(peer) for _ in range(2))
    assert transport.settle(peer) and not transport.tainted(peer)
    assert transport.settle(peer)  # nothing to prove


def test_a_polled_write_retries_only_its_failed_entries_and_taints_the_peer(
    transport: mooncake.MooncakeTransport,
) -> None:
    """A large write of few entries is awaited by polling one-entry batches: an entry that
    failed may still land later (the peer is tainted) and is retried alone, once."""
    eng = transport._engine
    eng.fail_parts = {1 << 20}
    src = [0, 1 << 20, 2 << 20]
    transport.write("peer", src, src, [1 << 20] * 3)
    assert eng.synced == [[1 << 20]]
    assert transport.tainted("peer") and transport.stats.retries == 1
    assert transport._peer_state("peer")[0].used == 0
