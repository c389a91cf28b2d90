"""Failures through SGLang's interface end in ``KVPoll.Failed`` within their deadline, with a
``failure_exception()`` that names pdxfer's typed error (chained as its ``__cause__``), and no
destination byte changes once Failed was seen. One decode process, two prefill processes (the
second killed mid-transfer), started once for the module."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from .sglang_helpers import result, spawn
from .test_sglang_sequence import free_port

BOOTSTRAP_TIMEOUT_S = 4  # SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT: pdxfer's lookup deadline


@pytest.fixture(scope="module")
def rooms() -> Iterator[dict]:
    cfg = json.dumps({"port_a": free_port(), "port_b": free_port()})
    env = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(BOOTSTRAP_TIMEOUT_S),
           "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "20"}
    pa = spawn("pd_failures.py", "prefill-a", cfg, **env)
    pb = spawn("pd_failures.py", "prefill-b", cfg, **env)
    try:
        dec = result(spawn("pd_failures.py", "decode", cfg, **env), timeout=180)
        assert dec["pending"] == []
        result(pa, timeout=60)
        pb.communicate(timeout=60)
        assert pb.returncode == -9  # it was killed mid-transfer, as meant
        yield dec["rooms"]
    finally:
        for p in (pa, pb):
            if p.poll() is None:
                p.kill()
                p.communicate()


def check(r: dict, cause: str, words: str, within: float) -> None:
    assert "success" not in r, r
    assert r["cause"] == cause, r
    assert f"pdxfer {cause}" in r["failure"] and words in r["failure"], r["failure"]
    assert r["seconds"] < within, r
    assert not r["changed_after_failed"], "a destination page was written after Failed"


def test_abort_fails_at_once_and_nothing_lands(rooms: dict) -> None:
    check(rooms["201"], "Aborted", "aborted by SGLang", 5.0)
    assert not rooms["201"]["written"]


def test_prefill_killed_mid_transfer_fails_with_peer_lost(rooms: dict) -> None:
    r = rooms["301"]
    check(r, "PeerLost", "stopped answering", 10.0)
    assert r["written"]  # the first chunk had landed: the kill really was mid-transfer


def test_bootstrap_that_never_answers_fails_at_its_deadline(rooms: dict) -> None:
    check(rooms["202"], "DeadlineExceeded", "did not finish before its deadline",
          BOOTSTRAP_TIMEOUT_S + 6.0)
    assert rooms["202"]["seconds"] >= BOOTSTRAP_TIMEOUT_S - 0.5


def test_layout_mismatch_is_refused_naming_the_pool(rooms: dict) -> None:
    check(rooms["203"], "LayoutMismatch", "pool 'draft_kv' exists on prefill but not on decode",
          5.0)
    assert not rooms["203"]["written"]
