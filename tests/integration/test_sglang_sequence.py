"""SGLang's documented transfer sequence, driven through the classes SGLang's own
``get_kv_class`` returns for ``pdxfer``, between separate processes over Mooncake TCP.

Every pool (target KV, draft KV, the aux rows, a Mamba state of two tensors) is checked byte
for byte against a pattern of (room, pool, layer, role, token, byte) on the decode, and every
page or slot the decode did not hand out must still hold its sentinel: a prefix the decode
already has (``decode_prefix_len``) never crosses the wire.
"""

from __future__ import annotations

import json
import socket

import pytest

from .sglang_helpers import result, spawn

ROOMS = [{"room": 101, "n": 37, "prefix": 0}, {"room": 102, "n": 50, "prefix": 8},
         {"room": 103, "n": 21, "prefix": 0}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_pair(prefill_tp: int = 1, **cfg: object) -> dict:
    conf = {"port": free_port(), "attn": "mha", "layers": 2, "page_size": 4, "pages": 64,
            "heads": 2, "head_dim": 8, "draft": True, "state": True, "prefill_tp": prefill_tp,
            "rooms": ROOMS, **cfg}
    arg = json.dumps(conf)
    prefills = [spawn("pd_sequence.py", "prefill", arg, str(r)) for r in range(prefill_tp)]
    try:
        dec = result(spawn("pd_sequence.py", "decode", arg), timeout=180)
    finally:
        for p in prefills:
            if p.poll() is None and p.stdin is None:
                pass
    outs = []
    for p in prefills:
        outs.append(result(p, timeout=60))
    return {"decode": dec, "prefill": outs}


def assert_exact(r: dict, pools: list[str]) -> None:
    d = r["decode"]
    assert d["pools"] == sorted(pools)
    for i, room in d["rooms"].items():
        assert room["state"] == 4, (i, room)
        assert room["bad"] == 0, room["first_bad"]
        assert room["checked"] > 0
    assert d["untouched_bad"] == {p: 0 for p in pools}, d["untouched_bad"]
    for p in r["prefill"]:
        assert set(p["states"].values()) == {4}, p
        # the prefill learnt each room's decode prefix (SGLang's pop_decode_prefix_len)
        assert p["prefix"] == {str(i): room["prefix"] for i, room in enumerate(ROOMS)}


ALL = ["aux", "draft_kv", "kv", "state0_mamba.0", "state0_mamba.1"]


def test_mha_draft_state_aux_and_decode_prefix_land_byte_exact() -> None:
    assert_exact(run_pair(), ALL)


def test_mla_with_draft_lands_byte_exact() -> None:
    assert_exact(run_pair(attn="mla", state=False), ["aux", "draft_kv", "kv"])


def test_host_pool_of_another_page_size_lands_token_by_token() -> None:
    r = run_pair(decode_host_page=1)
    assert r["decode"]["page"] == 1  # the decode's KV is a token-granular host pool
    assert_exact(r, ALL)


@pytest.mark.parametrize("attn", ["mha", "mla"])
def test_prefill_tp2_into_decode_tp1(attn: str) -> None:
    assert_exact(run_pair(prefill_tp=2, attn=attn, state=False, draft=attn == "mha"),
                 ["aux", "draft_kv", "kv"] if attn == "mha" else ["aux", "kv"])
