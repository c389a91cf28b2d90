"""Benchmark commands for ``harness.Agent`` processes (``state="benchmarks.common.bench_agent:BenchState"``).

Timing happens inside the agents with ``time.monotonic()`` (one system-wide clock on Linux, so
stamps from the prefill and decode processes compare), never through the driver's pipe.

Roles ``raw-prefill`` / ``raw-decode`` hold the same patterned pools as a pdxfer endpoint but
only a bare Mooncake engine: they are the baselines (raw ``batch_transfer_sync_write`` of the
very blocks pdxfer plans, at most 1,000 entries a call as SGLang's Mooncake backend issues
them; and a minimal push design: raw write, then one ZMQ message).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

import msgspec
import numpy as np
import zmq

from pdxfer import plan as P
from pdxfer.agents import patterns as pat
from pdxfer.agents.commands import AgentState
from pdxfer.agents.patterns import PoolGeom
from pdxfer.endpoint.handles import KVPoll
from pdxfer.endpoint.receiver import KVReceiver
from pdxfer.pools import PoolSpec
from pdxfer.transport.mooncake import _load_engine
from tests.harness.zmqctx import context

RAW_CALL_ENTRIES = 1000


class _RawEp:
    """Patterned pools registered with a bare Mooncake engine (no pdxfer endpoint)."""

    def __init__(self, role: str, geoms: list[PoolGeom]) -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        specs, self.tensors = pat.build(geoms)
        self.specs: dict[str, PoolSpec] = {s.name: s for s in specs}
        self.engine = _load_engine()()
        if self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("Mooncake initialize failed")
        for s in specs:
            for b in s.buffers:
                if self.engine.register_memory(b.addr, b.nbytes, "*") != 0:
                    raise RuntimeError("register_memory failed")
        self.session = f"127.0.0.1:{self.engine.get_rpc_port()}"
        self.ctx = context()  # never termed: the agent process ends with it
        self.got: list[tuple[int, float, float]] = []
        self.pull_addr = ""
        if role == "raw-decode":
            pull = self.ctx.socket(zmq.PULL)
            port = pull.bind_to_random_port("tcp://127.0.0.1")
            self.pull_addr = f"tcp://127.0.0.1:{port}"
            threading.Thread(target=self._drain, args=(pull,), daemon=True).start()

    def _drain(self, pull: zmq.Socket) -> None:
        dec = msgspec.msgpack.Decoder(tuple[int, float])
        while True:
            room, t0 = dec.decode(pull.recv())
            self.got.append((room, t0, time.monotonic()))

    def anchor_pages(self, name: str, pages: dict[str, Any]) -> Any:
        spec = self.specs[name]
        return pages.get(spec.indices_from or name)


def _blocks(src: PoolSpec, dst: PoolSpec, sp: list[int], dp: list[int], tokens: int) -> P.Blocks:
    pr = P.pair_buffers(src, dst)
    assert not isinstance(pr, str), pr
    b = P.plan_paged(pr, np.asarray(sp), 0, np.asarray(dp), 0, 0, tokens)
    assert not isinstance(b, str), b
    return b


class BenchState(AgentState):
    """``AgentState`` plus benchmark commands; also serves the raw baseline roles."""

    def __init__(self) -> None:
        super().__init__()
        self.raw: _RawEp | None = None
        self._serve_stop = threading.Event()

    def cmd_add_endpoint(
        self, name: str, role: str, config: dict[str, Any], geoms: list[PoolGeom]
    ) -> dict[str, Any]:
        if not role.startswith("raw"):
            return super().cmd_add_endpoint(name, role, config, geoms)
        self.raw = _RawEp(role, geoms)
        self.eps[name] = self.raw  # type: ignore[assignment] - prepare/verify/sentinel work
        return {
            "session": self.raw.session,
            "pull": self.raw.pull_addr,
            "pools": msgspec.to_builtins(list(self.raw.specs.values())),
        }

    def close(self) -> None:
        if self.raw is not None:
            self.eps.pop("main", None)
        super().close()

    # -- both -----------------------------------------------------------------------------------
    def cmd_set_integrity(self, mode: str, ep: str = "main") -> None:
        """Switch a decode endpoint's integrity mode between requests (benchmarks compare
        modes interleaved in one process; an engine sets ``EndpointConfig.integrity``)."""
        side = self.eps[ep].ep.decode
        assert side is not None and mode in ("off", "sampled", "full")
        side.integrity = mode

    def cmd_cpu(self) -> float:
        return time.process_time()

    def cmd_now(self) -> float:
        return time.monotonic()

    # -- raw baselines -------------------------------------------------------------------------
    def _raw_write(self, peer: str, b: P.Blocks) -> None:
        assert self.raw is not None
        s, d, n = b.src.tolist(), b.dst.tolist(), b.nbytes.tolist()
        for i in range(0, len(s), RAW_CALL_ENTRIES):
            j = i + RAW_CALL_ENTRIES
            rc = self.raw.engine.batch_transfer_sync_write(peer, s[i:j], d[i:j], n[i:j])
            if rc != 0:
                raise RuntimeError(f"raw write failed rc={rc}")

    def cmd_raw_write(
        self,
        peer: str,
        pools: list[dict[str, Any]],
        src: list[int],
        dst: list[int],
        tokens: int,
        reps: int = 1,
    ) -> dict[str, Any]:
        """Write the blocks pdxfer would plan, ``reps`` times; seconds per rep and CPU."""
        assert self.raw is not None
        d = msgspec.convert(pools, list[PoolSpec])[0]
        b = _blocks(self.raw.specs["kv"], d, src, dst, tokens)
        out = []
        for _ in range(reps):
            t = time.monotonic()
            self._raw_write(peer, b)
            out.append(time.monotonic() - t)
        return {"seconds": out, "entries": len(b), "bytes": b.total_bytes}

    def cmd_raw_push_loop(
        self,
        peer: str,
        pools: list[dict[str, Any]],
        pull: str,
        src: list[int],
        dst_free: list[int],
        tokens: int,
        conc: int,
        duration: float,
        threads: int,
        first_room: int,
    ) -> dict[str, Any]:
        """Closed loop at ``conc`` in flight: ``threads`` workers each do a raw write then push
        one ZMQ message to the decode, which stamps its arrival."""
        assert self.raw is not None
        raw = self.raw
        d = msgspec.convert(pools, list[PoolSpec])[0]
        per = len(src)
        push = raw.ctx.socket(zmq.PUSH)
        push.connect(pull)
        plock = threading.Lock()
        enc = msgspec.msgpack.Encoder()
        free: queue.SimpleQueue[list[int]] = queue.SimpleQueue()
        for i in range(0, len(dst_free) - per + 1, per):
            free.put(dst_free[i : i + per])
        jobs: queue.SimpleQueue[tuple[int, float, list[int]] | None] = queue.SimpleQueue()
        slots = threading.Semaphore(conc)
        done = [0]

        def worker() -> None:
            while (job := jobs.get()) is not None:
                room, t0, dp = job
                if time.monotonic() > end:  # queued but not started: the segment is over
                    continue
                self._raw_write(peer, _blocks(raw.specs["kv"], d, src, dp, tokens))
                with plock:
                    push.send(enc.encode((room, t0)))
                    done[0] += 1
                free.put(dp)
                slots.release()

        start = time.monotonic()
        end = start + duration
        ws = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
        for w in ws:
            w.start()
        room = first_room
        while time.monotonic() < end:
            if not slots.acquire(timeout=0.1):
                continue
            jobs.put((room, time.monotonic(), free.get()))
            room += 1
        for _ in ws:
            jobs.put(None)
        for w in ws:  # every write has Mooncake's own timeout, so this ends
            w.join()
        push.close(linger=1000)
        return {"issued": room - first_room, "done": done[0], "start": start, "end": end}

    def cmd_raw_collect(self, first_room: int) -> list[tuple[float, float]]:
        """(issued, arrived) stamps of the push loop's rooms."""
        assert self.raw is not None
        time.sleep(0.2)
        return [(t0, t1) for r, t0, t1 in self.raw.got if r >= first_room]

    # -- pdxfer prefill ------------------------------------------------------------------------
    def cmd_bench_wait_pending(self, rooms: list[int], timeout: float = 30.0) -> bool:
        """Wait until the decode's requests for ``rooms`` reached this prefill (so a timed
        send measures the transfer, not the handshake)."""
        side = self.eps["main"].ep.prefill
        assert side is not None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with side.ep.lock:
                if all(r in side.pending for r in rooms):
                    return True
            time.sleep(0.0005)
        return False

    def cmd_bench_send(self, room: int, pages: list[int], wait: bool = False) -> Any:
        """Send one room as a single last chunk; return the monotonic stamp of the send.

        With ``wait`` the call returns (the stamp and the room's raw transport-write seconds)
        only once the room ended here (its TransferDone sent),
        so that the driver and the decode's poll loop stay idle while the transfer runs, as
        they do while a raw baseline write runs."""
        e = self.eps["main"]
        tx = e.ep.sender(room)
        if wait:
            e.tx[room] = tx
            t = time.monotonic()
            tx.send({"kv": pages}, last=True)
            end = t + 60.0
            while not tx.poll().terminal and time.monotonic() < end:
                time.sleep(0.002)
            return {"t": t, "raw_write_s": sum(x.write_seconds for x in tx._st.targets)}
        t = time.monotonic()
        tx.send({"kv": pages}, last=True)
        e.tx[room] = tx
        return t

    def cmd_bench_serve(self, first_room: int, src: list[int], ahead: int = 96) -> None:
        """From a thread: keep senders (one last chunk each, same source pages) created for
        rooms ``first_room, first_room+1, ...``, ``ahead`` beyond those already finished."""
        e = self.eps["main"]
        self._serve_stop.clear()
        pages = np.asarray(src, dtype=np.int64)

        def run() -> None:
            # Count finished rooms from the endpoint's counters: polling every live sender
            # would cost the benchmark's own CPU on a 2-core host.
            nxt = first_room
            base = e.ep.core.counters["success"] + e.ep.core.counters["failures_transport"]
            while not self._serve_stop.is_set():
                finished = (
                    e.ep.core.counters["success"] + e.ep.core.counters["failures_transport"] - base
                )
                while nxt - first_room < finished + ahead:
                    e.tx[nxt] = e.ep.sender(nxt)
                    e.tx[nxt].send({"kv": pages}, last=True)
                    nxt += 1
                time.sleep(0.002)
            for r in range(first_room, nxt):
                tx = e.tx.pop(r)
                if not tx.poll().terminal:
                    tx.abort("benchmark over")

        threading.Thread(target=run, daemon=True, name="bench-serve").start()

    def cmd_bench_serve_stop(self) -> None:
        self._serve_stop.set()
        time.sleep(0.05)

    # -- pdxfer decode -------------------------------------------------------------------------
    def cmd_bench_done(self, rooms: list[int], timeout: float = 60.0) -> dict[int, Any]:
        """Wait for rooms; report each one's state and the stamp at which Success arrived."""
        e = self.eps["main"]
        end = time.monotonic() + timeout
        while time.monotonic() < end and not all(e.rx[r].poll().terminal for r in rooms):
            time.sleep(0.001)
        out = {}
        for r in rooms:
            rx = e.rx.pop(r)
            out[r] = {
                "state": KVPoll(rx.poll()).name,
                "t_done": rx._st.t_done,
                "failure": str(rx.failure) if rx.failure else None,
                "blocks": rx._st.blocks,
                "bytes": rx._st.bytes,
            }
        return out

    def cmd_bench_closed_loop(
        self,
        bootstrap: str,
        first_room: int,
        dst_free: list[int],
        per: int,
        tokens: int,
        conc: int,
        duration: float = 0.0,
        count: int = 0,
    ) -> dict[str, Any]:
        """Keep ``conc`` requests in flight for ``duration`` s (or ``count`` requests); each
        latency is request() to the stamp at which Success arrived; returns the (request,
        Success) stamps of every room."""
        e = self.eps["main"]
        free = [dst_free[i : i + per] for i in range(0, len(dst_free) - per + 1, per)]
        live: dict[int, tuple[KVReceiver, float, list[int]]] = {}
        stamps: list[tuple[float, float]] = []
        failed: list[str] = []
        room = first_room
        t_start = time.monotonic()
        end = t_start + duration if duration else float("inf")
        issued = 0
        while True:
            now = time.monotonic()
            stop_issuing = now >= end or (count and issued >= count)
            while not stop_issuing and len(live) < conc and free:
                dp = free.pop()
                t0 = time.monotonic()
                rx = e.ep.receiver(room, bootstrap)
                rx.request({"kv": dp}, num_tokens=tokens)
                live[room] = (rx, t0, dp)
                room += 1
                issued += 1
                stop_issuing = bool(count and issued >= count)
            for r in [r for r, (rx, _, _) in live.items() if rx.poll().terminal]:
                rx, t0, dp = live.pop(r)
                if rx.poll() == KVPoll.Success:
                    stamps.append((t0, rx._st.t_done))
                    free.append(dp)
                else:
                    failed.append(str(rx.failure))
            if stop_issuing and not live:
                break
            if time.monotonic() > max(end, t_start) + 60:
                failed.append("closed loop did not drain")
                break
            time.sleep(0.0005)
        return {"stamps": stamps, "failed": failed, "issued": issued, "start": t_start, "end": end}
