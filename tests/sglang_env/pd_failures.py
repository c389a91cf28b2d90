"""Failures through SGLang's interface, each ending in KVPoll.Failed (commands for
sgl_server.py).

``prefill(cfg, "a")``: serves rooms 201 (the decode aborts it before any chunk) and 203 (a
  decode whose layout differs asks for it); sends nothing until the decode is done
  (``prefill_finish``).
``prefill(cfg, "b")``: room 301: a thread sends the first of three chunks, then kills this
  process (SIGKILL): run it last in a process.
``decode(cfg)``: one manager of the prefills' layout and one without the draft KV pool (a
  layout mismatch); room 202 looks pdxfer's bootstrap up at a listener that never answers.
  For each room it reports how long Failed took (``seconds``: from its metadata, or its
  abort; ``since_made``: from before its receiver was built, so no deadline of the room can
  have run longer), what ``failure_exception()`` said, and
  whether any destination byte changed after Failed was seen.

``cfg["env"]`` (SGLang's deadlines, short so the failures end in seconds) is applied before
the decode builds its managers; the prefills keep the defaults, so their own bootstrap
deadline cannot end a room while a loaded machine is still setting the decode up.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import numpy as np
import sgl_common as C
import torch

from pdxfer.agents import patterns as P


def side(cfg: dict, role: str, draft: bool = True) -> C.Side:
    return C.make_side(
        attn="mha",
        layers=2,
        page_size=4,
        pages=64,
        heads=2,
        total_heads=2,
        head_dim=8,
        draft=draft,
        state=False,
        rows=8,
        tp_rank=0,
        set_heads=role == "prefill",
    )


def _mode(name: str):
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return getattr(DisaggregationMode, name)


PAGES = np.arange(10, 0, -1, dtype=np.int64)  # 10 pages = 40 tokens


def prefill(state: dict, cfg: dict, which: str) -> str:
    port = cfg["port_a"] if which == "a" else cfg["port_b"]
    sa = C.publish("prefill", port)
    cls = C.classes()
    server = cls["bootstrap_server"]("127.0.0.1", port)
    s = side(cfg, "prefill")
    mgr = cls["manager"](s.kv_args, _mode("PREFILL"), sa, False)
    rooms = [201, 203] if which == "a" else [301]
    senders = {}
    for r in rooms:
        C.fill(s, mgr.pools, r, PAGES, 40, {p.name: 1 for p in mgr.pools if p.kind == "slot"})
        senders[r] = cls["sender"](mgr, f"127.0.0.1:{port}", r)
    # ``s`` owns the tensors the manager reads by address: kept as long as the manager is
    state["failures_side_" + which] = s
    if which == "b":
        threading.Thread(target=_send_and_die, args=(senders[301],), daemon=True).start()
        return "sending"
    state["failures_prefill"] = (mgr, server, senders)
    return "serving"


def _send_and_die(tx) -> None:
    C.wait(lambda: tx.poll() >= 2, 60, "decode's request for room 301")
    tx.init(10, 1)
    tx.send(PAGES[:3])
    C.wait(lambda: tx.tx.poll() >= 2 and time.sleep(0.5) is None, 5, "first chunk")
    os.kill(os.getpid(), signal.SIGKILL)


def prefill_finish(state: dict) -> dict:
    """Once the decode is done: the senders' states, then close."""
    mgr, server, senders = state.pop("failures_prefill")
    try:
        return {"role": "prefill", "states": {str(r): int(x.poll()) for r, x in senders.items()}}
    finally:
        mgr.close()
        server.close()
        state.pop("failures_side_a")  # after the manager that read it


def silent_listener() -> tuple[socket.socket, str]:
    """Accepts connections (the kernel does) and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    return s, f"127.0.0.1:{s.getsockname()[1]}"


def decode(state: dict, cfg: dict) -> dict:
    os.environ.update(cfg["env"])
    sa = C.publish("decode", cfg["port_a"])
    cls = C.classes()
    C.trust(
        f"127.0.0.1:{cfg['port_a']}", f"127.0.0.1:{cfg['port_b']}", f"localhost:{cfg['port_a']}"
    )
    good, bad_side = side(cfg, "decode"), side(cfg, "decode", draft=False)
    for sd in (good, bad_side):
        for ts in sd.tensors.values():
            for t in ts:
                t.view(torch.uint8).fill_(P.SENTINEL)
    mgr = cls["manager"](good.kv_args, _mode("DECODE"), sa, False)
    other = cls["manager"](bad_side.kv_args, _mode("DECODE"), sa, False)
    quiet, quiet_addr = silent_listener()
    try:
        return _decode_run(cfg, cls, mgr, other, good, bad_side, quiet_addr)
    finally:
        quiet.close()
        mgr.close()
        other.close()


def _decode_run(
    cfg: dict, cls: dict, mgr, other, good: C.Side, bad_side: C.Side, quiet_addr: str
) -> dict:
    a, b = f"127.0.0.1:{cfg['port_a']}", f"127.0.0.1:{cfg['port_b']}"
    alias = f"localhost:{cfg['port_a']}"
    for m, addr in ((mgr, a), (mgr, b), (other, a), (mgr, alias)):
        C.wait(lambda m=m, addr=addr: m.try_ensure_parallel_info(addr), 60, f"{addr} ready")
    mgr.pdxfer_bootstrap[alias] = quiet_addr  # SGLang's front answers, pdxfer's never does
    cases = {
        201: (mgr, a, good),
        202: (mgr, alias, good),
        203: (other, a, bad_side),
        301: (mgr, b, good),
    }
    dst = {
        201: np.arange(1, 11),
        202: np.arange(11, 21),
        203: np.arange(1, 11),
        301: np.arange(21, 31),
    }
    # a bootstrap this decode does not trust: Failed at construction, before any connection
    rogue = cls["receiver"](mgr, f"127.0.0.1:{cfg['port_rogue']}", 401)
    try:
        rogue.failure_exception()
        rogue_why = "no exception"
    except Exception as e:  # noqa: BLE001 - that is what is checked
        rogue_why = str(e)
    untrusted = {
        "poll": int(rogue.poll()),
        "failure": rogue_why,
        "counted": mgr.untrusted_refused,
        "looked_up": f"127.0.0.1:{cfg['port_rogue']}" in mgr.prefill_info_table,
    }
    rxs, t0, made = {}, {}, {}
    for room, (m, addr, _) in cases.items():
        made[room] = time.monotonic()  # before any deadline of the room can have started
        rx = cls["receiver"](m, addr, room)
        rx.init(0)
        assert rx.poll() == 2, (room, rx.poll())
        rx.send_metadata(dst[room].astype(np.int64), 1, None, 0)
        rxs[room], t0[room] = rx, time.monotonic()
    time.sleep(0.3)
    rxs[201].abort()
    t0[201] = time.monotonic()
    out: dict[str, dict] = {}
    pending = set(cases)
    snap: dict[int, bytes] = {}
    end = time.monotonic() + 60
    while pending and time.monotonic() < end:
        for room in list(pending):
            st = rxs[room].poll()
            if st == 0:
                pending.discard(room)
                secs = time.monotonic() - t0[room]
                snap[room] = _bytes(cases[room][2], m_pools(cases[room][0]), dst[room])
                try:
                    rxs[room].failure_exception()
                    why, cause = "no exception", ""
                except Exception as e:  # noqa: BLE001 - that is what is checked
                    why, cause = str(e), type(e.__cause__).__name__ if e.__cause__ else ""
                out[str(room)] = {
                    "seconds": secs,
                    "since_made": time.monotonic() - made[room],
                    "failure": why,
                    "cause": cause,
                }
            elif st == 4:
                pending.discard(room)
                out[str(room)] = {"success": True}
        time.sleep(0.01)
    time.sleep(2.0)  # anything still in flight would land now
    for room, before in snap.items():
        after = _bytes(cases[room][2], m_pools(cases[room][0]), dst[room])
        out[str(room)]["changed_after_failed"] = before != after
        out[str(room)]["written"] = any(x != P.SENTINEL for x in after)
    return {"role": "decode", "rooms": out, "pending": sorted(pending), "untrusted": untrusted}


def m_pools(m) -> list:
    return [p for p in m.pools if p.kind == "paged"]


def _bytes(sd: C.Side, pools: list, pages: np.ndarray) -> bytes:
    out = []
    for spec in pools:
        for t in C.tensors_of(sd, spec):
            rows = t.view(torch.uint8).view(spec.num_items, -1)
            out.append(rows[torch.as_tensor(pages)].numpy().tobytes())
    return b"".join(out)
