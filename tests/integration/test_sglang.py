"""pdxfer as SGLang's transfer backend, against SGLang's real classes, between separate
processes over Mooncake TCP.

Three SGLang-side processes serve the whole module (importing SGLang costs each ~15 s, so they
start once and run every scenario in turn, each scenario on ports and managers of its own):
a decode, a prefill (rank 0 of every prefill) and a second prefill (rank 1 of the TP 2 configs,
and last the prefill that is killed mid-transfer, so the failure tests come last).

- Registration: the decode's first command, in a fresh process, loads SGLang's plugins and asks
  SGLang's own ``get_kv_class`` and argument parser about ``pdxfer``.
- The documented sequence: every pool (target KV, draft KV, the aux rows, a Mamba state of two
  tensors) is checked byte for byte against a pattern of (room, pool, layer, role, token, byte)
  on the decode, and every page or slot the decode did not hand out must still hold its
  sentinel: a prefix the decode already has (``decode_prefix_len``) never crosses the wire.
- SGLang's own queues: ``PrefillBootstrapQueue`` and the prefill mixin's chunk sends on one
  side, ``DecodePreallocQueue`` and ``DecodeTransferQueue`` on the other, real pools,
  allocators and radix cache; every token lands where SGLang's ``req_to_token`` says.
- Failures through SGLang's interface end in ``KVPoll.Failed`` within their deadline, with a
  ``failure_exception()`` that names pdxfer's typed error (chained as its ``__cause__``), and
  no destination byte changes once Failed was seen.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from pdxfer.netaddr import free_port

from .sglang_helpers import SglangError, SglangProc

pytestmark = pytest.mark.engine


@dataclass
class Procs:
    decode: SglangProc
    prefill: SglangProc
    prefill1: SglangProc
    registration: dict


@pytest.fixture(scope="module")
def procs() -> Iterator[Procs]:
    started: list[SglangProc] = []
    try:
        for name in ("decode", "prefill", "prefill-rank1"):
            started.append(SglangProc(name))
        d, p0, p1 = started
        d.submit("sgl_checks.registration")  # the first command: a fresh process
        for p in (p0, p1):
            p.submit("sgl_checks.warm")  # the imports, side by side
        reg = d.result(240)
        for p in (p0, p1):
            p.result(240)
        yield Procs(d, p0, p1, reg)
    finally:
        for p in started:
            p.close()


# -- registration ----------------------------------------------------------------------------


def test_get_kv_class_returns_pdxfer_classes_for_every_class_type(procs: Procs) -> None:
    r = procs.registration
    assert r["fresh_process"]  # nothing of SGLang's plugin machinery ran before
    mod = "pdxfer.integrations.sglang.conn."
    assert r["classes"] == {
        "kvargs": "sglang.srt.disaggregation.base.conn.KVArgs",
        "manager": mod + "PdxferKVManager",
        "sender": mod + "PdxferKVSender",
        "receiver": mod + "PdxferKVReceiver",
        "bootstrap_server": mod + "PdxferKVBootstrapServer",
    }
    assert all(r["subclass"].values()), r["subclass"]  # SGLang's CommonKV* classes
    assert r["parsed"] == "pdxfer"  # --disaggregation-transfer-backend pdxfer parses
    assert r["queues_see_it"] == ["pdxfer", "pdxfer"]  # prefill.py and decode.py's binding
    assert r["fake"] == "FakeKVManager"  # other backends still resolve to SGLang's
    assert r["members"] == ["ascend", "fake", "mooncake", "mori", "nixl", "pdxfer"]


# -- the documented sequence -----------------------------------------------------------------

ROOMS = [
    {"room": 101, "n": 37, "prefix": 0},
    {"room": 102, "n": 50, "prefix": 8},
    {"room": 103, "n": 21, "prefix": 0},
]
ALL = ["aux", "draft_kv", "kv", "state0_mamba.0", "state0_mamba.1"]


def run_pair(procs: Procs, prefill_tp: int = 1, **cfg: object) -> dict:
    """One config: the prefill rank(s) serve ``ROOMS`` while the decode asks for them."""
    conf = {
        "port": free_port(),
        "attn": "mha",
        "layers": 2,
        "page_size": 4,
        "pages": 64,
        "heads": 2,
        "head_dim": 8,
        "draft": True,
        "state": True,
        "prefill_tp": prefill_tp,
        "rooms": ROOMS,
        **cfg,
    }
    ranks = [procs.prefill, procs.prefill1][:prefill_tp]
    started: list[int] = []
    dec, outs = None, []
    try:
        for r, p in enumerate(ranks):
            p.call("pd_sequence.prefill_start", cfg=conf, tp_rank=r)
            started.append(r)
        dec = procs.decode.call("pd_sequence.decode", cfg=conf, wait_s=180)
    finally:
        for r in started:  # each rank closes its manager, whatever the decode saw
            try:
                outs.append(
                    ranks[r].call("pd_sequence.prefill_finish", cfg=conf, tp_rank=r, wait_s=90)
                )
            except SglangError:
                if dec is not None:
                    raise
    return {"decode": dec, "prefill": outs}


def assert_exact(r: dict, pools: list[str], host: bool = False) -> None:
    """Every room Success and byte-exact, nothing else written; ``host``: the decode also
    had host KV buffers (``supports_host_destination``), which nothing outside the host
    rooms' pages may touch either."""
    d = r["decode"]
    assert d["pools"] == sorted(pools)
    assert d["supports_host"] is host
    for i, room in d["rooms"].items():
        assert room["state"] == 4, (i, room)
        assert room["bad"] == 0, room["first_bad"]
        assert room["checked"] > 0
    paged = [p for p in pools if p != "aux" and not p.startswith("state")]
    expect = pools + [f"host:{p}" for p in paged] * host
    assert d["untouched_bad"] == {p: 0 for p in expect}, d["untouched_bad"]
    # a closed manager leaves nothing open (SGLang's ZMQ socket and context included): the
    # next config in the same process would otherwise risk a hang in garbage collection
    assert d["released"] and all(p["released"] for p in r["prefill"])
    for p in r["prefill"]:
        assert set(p["states"].values()) == {4}, p
        # the prefill learnt each room's decode prefix (SGLang's pop_decode_prefix_len)
        assert p["prefix"] == {str(i): room["prefix"] for i, room in enumerate(ROOMS)}


def test_mha_draft_state_aux_and_decode_prefix_land_byte_exact(procs: Procs) -> None:
    assert_exact(run_pair(procs), ALL)


def test_mla_with_draft_lands_byte_exact(procs: Procs) -> None:
    assert_exact(run_pair(procs, attn="mla", state=False), ["aux", "draft_kv", "kv"])


def test_host_pool_of_another_page_size_lands_token_by_token(procs: Procs) -> None:
    r = run_pair(procs, decode_host_page=1)
    assert r["decode"]["page"] == 1  # the decode's KV is a token-granular host pool
    assert_exact(r, ALL)


@pytest.mark.parametrize("attn", ["mha", "mla"])
def test_prefill_tp2_into_decode_tp1(procs: Procs, attn: str) -> None:
    r = run_pair(procs, prefill_tp=2, attn=attn, state=False, draft=attn == "mha")
    assert len(r["prefill"]) == 2
    assert_exact(r, ["aux", "draft_kv", "kv"] if attn == "mha" else ["aux", "kv"])
    # each decode page and slot is written once: MLA's replicated latent (and the aux row)
    # by one prefill rank, MHA's heads half by each
    for room in r["decode"]["rooms"].values():
        assert room["bytes"] == room["one_copy"], room


def test_host_destination_lands_that_request_in_the_host_buffers(procs: Procs) -> None:
    """SGLang's decode host receive: ``send_metadata(destination=HOST)`` for rooms 102 and
    103 lands their KV (target and draft) in the rank's host KV buffers, room 101 in the
    device ones, all through one manager; each room's bytes are checked where it asked."""
    assert_exact(
        run_pair(procs, state=False, host_rooms=[1, 2]), ["aux", "draft_kv", "kv"], host=True
    )


# -- a Mamba state across TP sizes (SGLang's MambaPool) ---------------------------------------

STATE_ROOMS = [
    {"room": 701, "n": 9},
    {"room": 702, "n": 30},
    {"room": 703, "n": 50},
]


def run_state(procs: Procs, prefill_tp: int, decode_tp: int) -> dict:
    """``pd_state``: prefill ranks of one attention TP size serve ``STATE_ROOMS`` to decode
    ranks of another (the three processes take whichever ranks the config needs)."""
    conf = {
        "port": free_port(),
        "page_size": 4,
        "pages": 64,
        "heads": 2,
        "rooms": STATE_ROOMS,
        "prefill_tp": prefill_tp,
        "decode_tp": decode_tp,
    }
    pre = [procs.prefill, procs.prefill1][:prefill_tp]
    dec = [procs.decode, procs.prefill1][:decode_tp]
    started: list[int] = []
    got: list[dict] = []
    try:
        for r, p in enumerate(pre):
            p.call("pd_state.prefill_start", cfg=conf, tp_rank=r)
            started.append(r)
        for r, d in enumerate(dec):
            d.submit("pd_state.decode", cfg=conf, tp_rank=r)
        got = [d.result(240) for d in dec]
    finally:
        outs = [
            pre[r].call("pd_state.prefill_finish", cfg=conf, tp_rank=r, wait_s=120) for r in started
        ]
    return {"decode": got, "prefill": outs}


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_gdn_state_lands_byte_exact_across_attention_tp_sizes(
    procs: Procs, prefill_tp: int, decode_tp: int
) -> None:
    r = run_state(procs, prefill_tp, decode_tp)
    assert len(r["decode"]) == decode_tp and len(r["prefill"]) == prefill_tp
    for d in r["decode"]:
        # SGLang's KVArgs describe the conv state's Q, K, V: each tensor is split into pieces
        assert d["pieces"] and set(d["pieces"].values()) == {"pieces"}, d["pieces"]
        for i, room in d["rooms"].items():
            assert room["state"] == 4, (d["rank"], i, room)
            assert room["bad_state"] == 0 and room["bad_kv"] == 0, (d["rank"], i, room)
            # each byte of this rank's share once, from whichever prefill rank holds it
            assert room["bytes"] == room["one_copy"], (d["rank"], i, room)
        assert d["untouched_bad"] == 0
        assert d["released"]
    for p in r["prefill"]:
        assert set(p["states"].values()) == {4}, p
        assert p["src_bad"] == 0, p
        assert p["released"]


# -- sliding window (SGLang's SWAKVPool) -----------------------------------------------------

WINDOW = 12
SWA_ROOMS = [
    {"room": 601, "n": 7, "prefix": 0},  # shorter than the window
    {"room": 602, "n": 37, "prefix": 0},  # longer: the window starts at token 24
    {"room": 603, "n": 50, "prefix": 8},  # a decode prefix, before the window
    {"room": 604, "n": 30, "prefix": 24},
]  # a decode prefix inside the window


def run_swa(procs: Procs, rooms: list[dict], prefill_tp: int = 1, **cfg: object) -> dict:
    """One config of ``pd_swa``: the prefill rank(s) serve ``rooms`` while the decode asks;
    ``prefill`` is rank 0's view."""
    conf = {
        "port": free_port(),
        "window_prefill": WINDOW,
        "window_decode": WINDOW,
        "rooms": rooms,
        "prefill_tp": prefill_tp,
        **cfg,
    }
    ranks = [procs.prefill, procs.prefill1][:prefill_tp]
    for r, p in enumerate(ranks):
        p.call("pd_swa.prefill_start", cfg=conf, tp_rank=r)
    try:
        dec = procs.decode.call("pd_swa.decode", cfg=conf, wait_s=180)
    finally:
        pre = [
            p.call("pd_swa.prefill_finish", cfg=conf, tp_rank=r, wait_s=90)
            for r, p in enumerate(ranks)
        ]
    return {"decode": dec, "prefill": pre[0], "ranks": pre}


@pytest.fixture(scope="module", params=[1, 2], ids=["prefill_tp1", "prefill_tp2"])
def swa(procs: Procs, request: pytest.FixtureRequest) -> dict:
    """Prefill TP 1 or 2 (each rank half the heads of both sub-pools) into a TP 1 decode."""
    return run_swa(procs, SWA_ROOMS, prefill_tp=request.param)


def test_swa_window_and_full_pages_land_byte_exact_in_sglangs_swa_pool(swa: dict) -> None:
    d = swa["decode"]
    assert d["pools"] == ["aux", "kv", "swa"]
    for i, room in d["rooms"].items():
        assert room["state"] == 4, (i, room)
        assert room["bad"] == 0, room["first_bad"]
    # SGLang's window of the last prompt token: page-aligned max(prefix, n - window)
    assert [d["rooms"][str(i)]["window_start"] for i in range(4)] == [0, 24, 36, 24]
    # no page outside the requests' full and window pages changed (pages the prefill
    # freed and reused, or the decode's SWA pages before the window, included)
    assert d["untouched_bad"] == {"kv": 0, "swa": 0}
    for p in swa["ranks"]:
        assert p["states"] == {str(i): 4 for i in range(4)}
        assert p["prefix"] == {str(i): r["prefix"] for i, r in enumerate(SWA_ROOMS)}


def test_swa_moves_the_window_not_the_prompt(swa: dict) -> None:
    d = swa["decode"]
    for i, r in enumerate(SWA_ROOMS):
        room = d["rooms"][str(i)]
        ws = room["window_start"]
        assert room["bytes"]["swa"] == -(-(r["n"] - ws) // 4) * d["swa_item_bytes"], room
        # the full-attention room: every page past the prefix, and the aux row (16 int32)
        assert room["bytes"]["kv"] == -(-(r["n"] - r["prefix"]) // 4) * d["kv_item_bytes"] + 64


def test_swa_window_size_mismatch_fails_the_request_naming_both_windows(procs: Procs) -> None:
    """A decode whose sliding window is 8 tokens, the prefill's 12: a prompt shorter than
    both still moves, a longer one fails on both sides with a message naming each window."""
    r = run_swa(procs, SWA_ROOMS[:2], window_decode=8)
    ok, bad = r["decode"]["rooms"]["0"], r["decode"]["rooms"]["1"]
    assert ok["state"] == 4 and ok["bad"] == 0, ok
    assert bad["state"] == 0, bad
    assert "sliding-window mismatch" in bad["failure"], bad
    assert "[24, 40)" in bad["failure"] and "[28, 40)" in bad["failure"], bad
    assert r["decode"]["untouched_bad"]["swa"] == 0  # the failed room's window never landed
    assert r["prefill"]["states"] == {"0": 4, "1": 0}


def test_a_decode_without_the_swa_pool_is_refused_at_pairing(procs: Procs) -> None:
    r = run_swa(procs, SWA_ROOMS[1:2], decode_swa=False)
    room = r["decode"]["rooms"]["0"]
    assert room["state"] == 0 and room["cause"] == "LayoutMismatch", room
    assert "pool 'swa' exists on prefill but not on decode" in room["failure"], room


# -- SGLang's own queues ---------------------------------------------------------------------

PREFIX_OWNER = 77
"""An earlier request whose prompt prefix sits in the decode's radix cache."""


@pytest.fixture(scope="module")
def queues(procs: Procs) -> dict:
    """Both sides' queues built, then three requests through them; one shares a 16-token
    prefix with a prompt the decode already cached."""
    port = free_port()
    pf, dc = procs.prefill, procs.decode
    pf.submit("pd_queues.prefill_setup", port=port, gloo_port=free_port())
    dc.submit("pd_queues.decode_setup", gloo_port=free_port(), trusted=f"127.0.0.1:{port}")
    built = {"prefill": pf.result(120), "decode": dc.result(120)}
    shared = [(PREFIX_OWNER * 31 + i) % 1000 for i in range(40)]
    cached = dc.call("pd_queues.decode_cache_prefix", owner_room=PREFIX_OWNER, prompt=shared[:16])
    rooms = [
        {"room": 501, "n": 37},
        {"room": 502, "n": 40, "prompt": shared, "prefix_owner": PREFIX_OWNER},
        {"room": 503, "n": 9},
    ]
    pf.call("pd_queues.prefill_serve", rooms=rooms)
    dec = dc.call("pd_queues.decode_run", port=port, rooms=rooms, wait_s=120)
    pre = pf.call("pd_queues.prefill_collect", wait_s=90)
    return {"built": built, "cached": cached, "decode": dec, "prefill": pre}


def test_prefill_bootstrap_queue_builds_pdxfers_manager_from_real_pools(queues: dict) -> None:
    r = queues["built"]["prefill"]
    assert r["manager"] == "PdxferKVManager"
    assert r["pools"][:2] == ["kv", "draft_kv"]  # SGLang appended the draft pool's buffers
    assert len(r["pools"]) > 2 and all(p.startswith("aux") for p in r["pools"][2:])
    # 2 layers x K and V; page of 4 tokens x 2 heads x 8 dims x fp16
    assert r["kv"] == {"buffers": 4, "page_size": 4, "heads": [2, 2], "item_bytes": 128}
    assert r["instance"] == "sglang"
    assert queues["built"]["decode"]["manager"] == "PdxferKVManager"


def test_sglangs_queues_move_every_request_byte_exact_with_a_decode_prefix(queues: dict) -> None:
    from_vocab = 1000
    d = queues["decode"]
    assert d["failed"] == [] and d["pending"] == [], d
    assert sorted(d["rooms"]) == ["501", "502", "503"]
    for room, r in d["rooms"].items():
        assert r["bad"] == 0, (room, r["first_bad"])
        assert r["checked_bytes"] > 0 and r["locations_distinct"]
        # the aux row moved too: SGLang's transfer queue took the first token and the
        # cached-token count the prefill's MetadataBuffers.set_buf wrote for this room
        assert r["output_ids"] == [int(room) * 7919 % from_vocab], r
        assert r["cached_tokens"] == int(room) % 97, r
    # room 502 found its first 16 tokens in the decode's radix cache: the decode asked for
    # the rest only, and the cached tokens still hold the earlier request's KV
    assert d["rooms"]["502"]["decode_prefix_len"] == 16
    assert d["rooms"]["501"]["decode_prefix_len"] == d["rooms"]["503"]["decode_prefix_len"] == 0
    assert d["untouched_bad"] == 0  # no slot outside the requests' pages changed


def test_prefill_learns_the_decode_prefix_and_retires_requests_the_sglang_way(queues: dict) -> None:
    p = queues["prefill"]
    assert {k: v["decode_prefix_len"] for k, v in p["rooms"].items()} == {
        "501": 0,
        "502": 16,
        "503": 0,
    }
    for room, r in p["rooms"].items():
        # process_disagg_prefill_inflight_queue saw Success: the request finished, its KV
        # went back to the pool and its metadata slot was freed
        assert r == {
            "finished": "FINISH_LENGTH",
            "decode_prefix_len": r["decode_prefix_len"],
            "kv_released": True,
            "metadata_freed": True,
        }, (room, r)
    assert p["streamed"] == ["room-501", "room-502", "room-503"]
    assert p["free_tokens"] == p["total_tokens"]


# -- failures (last: the second prefill process is killed) -----------------------------------

BOOTSTRAP_TIMEOUT_S = 4  # SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT: pdxfer's lookup deadline
WAITING_TIMEOUT_S = 20  # SGLANG_DISAGGREGATION_WAITING_TIMEOUT: what would end a hung room


@pytest.fixture(scope="module")
def failures(procs: Procs) -> dict:
    cfg = {
        "port_a": free_port(),
        "port_b": free_port(),
        "port_rogue": free_port(),
        "env": {
            "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(BOOTSTRAP_TIMEOUT_S),
            "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(WAITING_TIMEOUT_S),
        },
    }
    procs.prefill.call("pd_failures.prefill", cfg=cfg, which="a")
    procs.prefill1.call("pd_failures.prefill", cfg=cfg, which="b")
    try:
        dec = procs.decode.call("pd_failures.decode", cfg=cfg, wait_s=180)
    finally:
        procs.prefill.call("pd_failures.prefill_finish", wait_s=60)
    assert dec["pending"] == []
    assert procs.prefill1.proc.wait(timeout=60) == -9  # it was killed mid-transfer, as meant
    return {**dec["rooms"], "untrusted": dec["untrusted"]}


def check(r: dict, cause: str, words: str) -> None:
    """Failed for ``cause``, the mechanism under test (the cause says which fired, on any
    machine), in well under SGLang's waiting timeout (pdxfer's transfer deadline, which would
    end a hung room, or one whose 4 s lookup deadline did not fire): a hang detector with
    room for a loaded machine, not a stopwatch."""
    assert "success" not in r, r
    assert r["cause"] == cause, r
    assert f"pdxfer {cause}" in r["failure"] and words in r["failure"], r["failure"]
    assert r["seconds"] < WAITING_TIMEOUT_S / 2, r
    assert not r["changed_after_failed"], "a destination page was written after Failed"


def test_abort_fails_at_once_and_nothing_lands(failures: dict) -> None:
    check(failures["201"], "Aborted", "aborted by SGLang")
    assert not failures["201"]["written"]


def test_prefill_killed_mid_transfer_fails_with_peer_lost(failures: dict) -> None:
    r = failures["301"]
    check(r, "PeerLost", "stopped answering")
    assert r["written"]  # the first chunk had landed: the kill really was mid-transfer


def test_bootstrap_that_never_answers_fails_at_its_deadline(failures: dict) -> None:
    check(failures["202"], "DeadlineExceeded", "did not finish before its deadline")
    # not before its deadline: counted from before the receiver was built, so this holds
    # however slowly the machine built it
    assert failures["202"]["since_made"] >= BOOTSTRAP_TIMEOUT_S - 0.05, failures["202"]


def test_a_bootstrap_the_decode_does_not_trust_fails_at_once_without_a_lookup(
    failures: dict,
) -> None:
    r = failures["untrusted"]
    assert r["poll"] == 0, r  # KVPoll.Failed, at construction
    assert "not one of this decode's trusted bootstrap servers" in r["failure"], r
    assert r["counted"] == 1 and not r["looked_up"], r


def test_layout_mismatch_is_refused_naming_the_pool(failures: dict) -> None:
    check(failures["203"], "LayoutMismatch", "pool 'draft_kv' exists on prefill but not on decode")
    assert not failures["203"]["written"]
