"""KV-aware pairing from KV events: each leg goes to the worker holding the longest prefix,
weighed against load (a prefill's: the prompt tokens it still has to compute); a worker
whose feed is out of sync is judged by the router's history, and one whose entries were
dropped counts as holding nothing (least loaded wins). Both legs alike: a gapped or dropped
stream never does worse than round robin."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pdxfer.serving.kv_events import BlockStored, KVEventBatch
from pdxfer.serving.router import openai_api as oa
from pdxfer.serving.router.app import Router
from pdxfer.serving.router.backends import Attempt, Decode, Done, Prefill, Tokens, ToyBackend
from pdxfer.serving.router.kv_feed import FeedSpec, KvFeeds
from pdxfer.tiers import page_keys

BS = 16
P0, P1 = "http://p0:1", "http://p1:1"
D0, D1 = "http://d0:1", "http://d1:1"
PROMPT = list(range(1000, 1100))  # 6 full blocks


def _router() -> tuple[Router, KvFeeds]:
    kv = KvFeeds([FeedSpec(u, "tcp://127.0.0.1:1") for u in (P0, P1, D0, D1)])
    r = Router(
        [Prefill(P0, "127.0.0.1:1"), Prefill(P1, "127.0.0.1:1")],
        [Decode(D0, page_size=BS), Decode(D1, page_size=BS)],
        "kv_aware",
        kv=kv,
        api_keys={},
    )
    for f in kv.feeds.values():  # every feed in sync, holding nothing
        kv.on_frame(f, 0, KVEventBatch(0.0, []))
    return r, kv


def _holds(kv: KvFeeds, worker: str, blocks: int, seq: int = 1) -> None:
    ev = BlockStored(list(range(7, 7 + blocks)), None, PROMPT[: blocks * BS], BS)
    assert kv.on_frame(kv.feeds[worker], seq, KVEventBatch(0.0, [ev])) == "apply"


def test_each_leg_goes_to_the_worker_whose_events_show_the_longest_prefix() -> None:
    r, kv = _router()
    _holds(kv, P1, 4)
    _holds(kv, P0, 1)
    _holds(kv, D0, 6)
    for _ in range(3):  # the choice is stable, not a round robin in disguise
        pf, dc, pf_held, dc_held = r.pairing.pick(PROMPT, set(), set())
        assert (pf.url, dc.url, pf_held, dc_held) == (P1, D0, 64, 96)


def test_a_holder_loaded_enough_loses_to_an_idle_worker() -> None:
    r, kv = _router()
    _holds(kv, P1, 1)
    r.prefills[1].outstanding, r.prefills[1].pending = 3, 300
    assert r.pairing.pick(PROMPT, set(), set())[0].url == P0


def test_a_holder_whose_requests_are_past_their_prefill_keeps_the_follow_up() -> None:
    """Requests a prefill has finished computing (decoding now) cost it nothing: counting
    them as load sent a conversation's next turn to a prefill that had to compute the
    whole history again (the served benchmark saw it after a prefill came back)."""
    r, kv = _router()
    _holds(kv, P1, 5)
    r.prefills[1].outstanding = 2  # both decoding: nothing pending
    pf, _, pf_held, _ = r.pairing.pick(PROMPT, set(), set())
    assert (pf.url, pf_held) == (P1, 80)


def test_a_holder_whose_queued_cached_turns_are_short_keeps_the_follow_up() -> None:
    """Two follow-ups queued on the holder that each compute a few tokens weigh those few
    tokens, not two whole prompts."""
    r, kv = _router()
    _holds(kv, P1, 5)
    r.prefills[1].outstanding, r.prefills[1].pending = 2, 2 * 20
    assert r.pairing.pick(PROMPT, set(), set())[0].url == P1


def test_a_holder_with_more_prefill_queued_than_it_saves_loses() -> None:
    r, kv = _router()
    _holds(kv, P1, 5)
    r.prefills[1].outstanding, r.prefills[1].pending = 1, 100
    assert r.pairing.pick(PROMPT, set(), set())[0].url == P0


class _Stream(ToyBackend):
    """A backend whose attempt yields one token when told to, then finishes."""

    def __init__(self) -> None:
        super().__init__()
        self.go = asyncio.Event()
        self.first = asyncio.Event()

    async def stream(self, http: Any, job: Attempt) -> AsyncIterator[Tokens | Done]:
        await self.go.wait()
        yield Tokens([65])
        self.first.set()
        await self.go.wait()
        yield Done("length")


def test_a_prefill_counts_what_it_computes_from_choice_to_first_token() -> None:
    r, kv = _router()
    _holds(kv, P1, 5)
    be = r.dispatch.backend = _Stream()
    ask = oa.Ask(chat=False, prompts=[PROMPT], prompt_texts=[""], max_tokens=2)

    async def main() -> list[int]:
        seen = []
        c = asyncio.ensure_future(r.dispatch.choice(ask, PROMPT, 0, 0, 0.0, None))
        await asyncio.sleep(0)
        seen.append(r.prefills[1].pending)  # chosen (holds 80 of 100): 20 to compute
        be.go.set()
        await be.first.wait()
        seen.append(r.prefills[1].pending)  # first token out: the prefill is done
        await c
        seen += [r.prefills[1].pending, r.prefills[1].outstanding]
        return seen

    assert asyncio.run(main()) == [20, 0, 0, 0]


LEGS = {"prefill": (P0, P1, 0), "decode": (D0, D1, 1)}
"""Per leg: its first and second worker, and where ``pick`` answers its choice."""


def _workers(r: Router, leg: str) -> list[Prefill] | list[Decode]:
    return r.prefills if leg == "prefill" else r.decodes


@pytest.mark.parametrize("leg", LEGS)
def test_a_feed_out_of_sync_falls_back_to_the_routers_history(leg: str) -> None:
    first, second, at = LEGS[leg]
    r, kv = _router()
    _holds(kv, first, 1)
    kv.feeds[second].synced = False  # a replay under way: its index entries are not trusted
    _workers(r, leg)[1].remember(page_keys(PROMPT, BS, ""))  # the router sent it there before
    picked = r.pairing.pick(PROMPT, set(), set())
    assert (picked[at].url, picked[2 + at]) == (second, 96)


@pytest.mark.parametrize("leg", LEGS)
def test_a_gapped_feed_is_not_trusted_for_what_it_said_before(leg: str) -> None:
    """A worker whose feed gapped (a replay under way) is judged by the router's history,
    never by its stale entries: a prefix it may have evicted in the gap does not draw the
    request to it."""
    first, second, at = LEGS[leg]
    r, kv = _router()
    _holds(kv, second, 6)
    kv.feeds[second].synced = False
    for _ in range(4):  # nothing known: the two alternate, as round robin would
        picked = [r.pairing.pick(PROMPT, set(), set())[at].url for _ in range(2)]
        assert sorted(picked) == sorted([first, second]), picked


@pytest.mark.parametrize("leg", LEGS)
def test_a_dropped_worker_holds_nothing_so_load_decides(leg: str) -> None:
    first, second, at = LEGS[leg]
    r, kv = _router()
    _holds(kv, second, 6)
    kv.restart(kv.feeds[second], "a gap and no replay endpoint")
    _workers(r, leg)[1].outstanding = 1
    picked = r.pairing.pick(PROMPT, set(), set())
    assert (picked[at].url, picked[2 + at]) == (first, 0)


def test_each_feed_shows_in_the_metrics_labelled_by_its_worker() -> None:
    r, kv = _router()
    _holds(kv, D1, 6)
    kv.feeds[P1].synced = False
    text = asyncio.run(r.h_metrics(None)).text  # type: ignore[arg-type]
    assert f'pdxfer_router_kv_feed_blocks_total{{worker="{D1}"}} 6.0' in text
    assert f'pdxfer_router_kv_feed_blocks_total{{worker="{D0}"}} 0.0' in text
    assert f'pdxfer_router_kv_feed_synced{{worker="{P1}"}} 0.0' in text
    assert f'pdxfer_router_kv_feed_synced{{worker="{P0}"}} 1.0' in text
    assert "pdxfer_router_kv_indexed_blocks_total 6.0" in text


def test_auto_routes_by_kv_when_only_the_prefill_leg_has_a_choice() -> None:
    """Two prefills and one decode under the default policy: the prefill holding the prompt's
    prefix (by its KV events) gets it, every time, not a round robin's turn."""
    kv = KvFeeds([FeedSpec(u, "tcp://127.0.0.1:1") for u in (P0, P1, D0)])
    r = Router(
        [Prefill(P0, "127.0.0.1:1"), Prefill(P1, "127.0.0.1:1")],
        [Decode(D0, page_size=BS)],
        kv=kv,
        api_keys={},
    )
    for f in kv.feeds.values():
        kv.on_frame(f, 0, KVEventBatch(0.0, []))
    _holds(kv, P1, 5)
    assert r.pairing.policy == "kv_aware"
    for _ in range(3):
        pf, dc, pf_held, _ = r.pairing.pick(PROMPT, set(), set())
        assert (pf.url, dc.url, pf_held) == (P1, D0, 80)


def test_auto_is_round_robin_for_a_single_pair() -> None:
    r = Router([Prefill(P0, "127.0.0.1:1")], [Decode(D0, page_size=BS)], api_keys={})
    assert r.pairing.policy == "round_robin"


def test_data_parallel_ranks_are_one_record_each_chosen_by_their_own_events() -> None:
    """A prefill instance registered with two DP ranks, and a decode whose health shows two
    (``groups``): each becomes one record and one feed per rank (vLLM's ports: the given one
    plus the rank), and each leg goes to the rank whose events hold the prompt's prefix."""
    kv = KvFeeds([FeedSpec(u, "tcp://127.0.0.1:5557") for u in (P0, D0)])
    r = Router(
        [Prefill(P0, "127.0.0.1:1", "p")],
        [Decode(D0, "d", page_size=BS)],
        "kv_aware",
        kv=kv,
        api_keys={},
    )
    r.health._expand_ranks({(P0, "127.0.0.1:1", "p"): ({"status": "ok"}, 2)})
    r.health._expand_groups({D0: {"groups": [{"status": "ok"}] * 2}})
    assert [(p.key, p.dp) for p in r.prefills] == [(f"{P0}#dp0", 0), (f"{P0}#dp1", 1)]
    assert [(d.key, d.dp) for d in r.decodes] == [(f"{D0}#dp0", 0), (f"{D0}#dp1", 1)]
    assert kv.feeds[f"{P0}#dp1"].spec.endpoint == "tcp://127.0.0.1:5558"
    assert sorted(kv.feeds) == sorted(p.key for p in [*r.prefills, *r.decodes])
    for f in kv.feeds.values():
        kv.on_frame(f, 0, KVEventBatch(0.0, []))
    _holds(kv, f"{P0}#dp1", 5)
    _holds(kv, f"{D0}#dp0", 6)
    pf, dc, pf_held, dc_held = r.pairing.pick(PROMPT, set(), set())
    assert (pf.dp, pf_held, dc.dp, dc_held) == (1, 5 * BS, 0, 6 * BS)
    r.health._expand_ranks({(P0, "127.0.0.1:1", "p"): ({"status": "ok"}, 2)})  # known: kept
    assert r.prefills[1] is pf
    r.health._expand_ranks({(P0, "127.0.0.1:1", "p"): ({"status": "ok"}, 1)})  # back to one rank
    assert [(p.key, p.dp) for p in r.prefills] == [(P0, None)] and P0 in kv.feeds
