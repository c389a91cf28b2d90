"""Agent extensions for the attack tests (``Agent.call("ext", fn="tests.harness.attack:...")``).

They stand in for what an attacker on the control network can observe (a room's nonce travels
in clear text in every frame); nothing here changes an endpoint's state.
"""

from __future__ import annotations

from typing import Any


def room_nonce(state: Any, room: int, ep: str = "main") -> int:
    """The nonce of a decode room's request (0 before it was sent)."""
    return int(state.eps[ep].rx[room]._st.nonce)


def peer_sessions(state: Any, ep: str = "main") -> dict[str, str]:
    """The transport session this decode believes each prefill peer has."""
    side = state.eps[ep].ep.decode
    return {eid: p.session for eid, p in side.peers.items()}


def states(state: Any, rooms: list[int], ep: str = "main") -> dict[int, str]:
    """Each room's poll state now (no waiting)."""
    e = state.eps[ep]
    out = {}
    for r in rooms:
        h = e.rx.get(r) or e.tx.get(r)
        out[r] = "Unknown" if h is None else h.poll().name
    return out


def ctrl_addr(state: Any, ep: str = "main") -> str:
    return str(state.eps[ep].ep.ctrl_addr)
