"""The served system restores through ``pdxfer.tiers``: a repeated prefix comes from the
decode's L2 (host DRAM) or, after the decode restarted, from its L3 (files, or Mooncake Store
against a real ``mooncake_master``); the prefill reuses what it computed; host landing
(token-granular pool, page size 1) decodes the same text. Every output is compared token for
token with the colocated reference; speculative accept length survives a restore."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pdxfer.serving.toy import (
    EOS_ID,
    SpecResult,
    ToyConfig,
    ToyModel,
    encode,
    make_draft,
    speculative_generate,
)
from pdxfer.serving.toy.cluster import Cluster
from pdxfer.tiers import MooncakeMaster, MooncakeStoreStorage

torch.set_num_threads(1)
MODEL = ToyModel(ToyConfig())
DRAFT = make_draft(MODEL)
WORKER = [
    "--bootstrap-timeout",
    "10",
    "--transfer-timeout",
    "60",
    "--heartbeat",
    "0.25",
    "--pages",
    "256",
]
PREFIX = "a conversation that comes back after the decode restarted: " * 5  # ~300 tokens
SPEC = "the draft KV comes back from storage with the target KV. " * 5 + "go:"


def greedy(prompt: str, n: int) -> list[int]:
    out = MODEL.generate(encode(prompt), n)
    return out[: out.index(EOS_ID)] if EOS_ID in out else out


@functools.cache
def spec_reference() -> SpecResult:
    return speculative_generate(MODEL, DRAFT, encode(SPEC), 24, k=4)


def ask(c: Cluster, prompt: str, n: int = 12, **kw: Any) -> dict[str, Any]:
    status, body = c.complete(
        {"prompt": prompt, "max_tokens": n, "temperature": 0, **kw}, timeout=120
    )
    assert status == 200, body
    return body["pdxfer"]


def full_pages(prompt: str, ps: int = 16) -> int:
    """Tokens a restore can cover: whole pages, leaving the last token to the prefill."""
    return (len(encode(prompt)) - 1) // ps * ps


def restart_round_trip(c: Cluster) -> None:
    """Seen once, then again from L2, then after a restart from L3: always identical."""
    p1, p2, p3 = PREFIX + "first?", PREFIX + "second?", PREFIX + "third?"
    a = ask(c, p1)
    assert a["token_ids"] == greedy(p1, 12) and a["restored_tokens"] == 0
    b = ask(c, p2)
    assert b["token_ids"] == greedy(p2, 12)
    assert b["restored_l2_tokens"] >= full_pages(PREFIX) - 16 and b["restored_l3_tokens"] == 0
    assert b["bytes"] < a["bytes"] / 4  # the prefill shipped only the suffix
    assert b["prefill_reused_tokens"] >= full_pages(PREFIX) - 16  # and did not recompute
    c.restart_decode()
    d = ask(c, p3)
    assert d["token_ids"] == greedy(p3, 12)
    assert d["restored_l3_tokens"] >= full_pages(PREFIX) - 16, d
    assert d["restored_l2_tokens"] == 0
    assert d["bytes"] < a["bytes"] / 4


def spec_round_trip(c: Cluster) -> None:
    """Accept length after a restore from L2 and from L3 is at least 0.9x fresh."""
    ref = spec_reference()
    want = ref.tokens[: ref.tokens.index(EOS_ID)] if EOS_ID in ref.tokens else ref.tokens
    body = {"speculative_k": 4}
    fresh = ask(c, SPEC, 24, **body)
    l2 = ask(c, SPEC, 24, **body)
    c.restart_decode()
    l3 = ask(c, SPEC, 24, **body)
    assert fresh["token_ids"] == want and l2["token_ids"] == want and l3["token_ids"] == want
    assert fresh["restored_tokens"] == 0
    assert l2["restored_l2_tokens"] >= full_pages(SPEC) - 16
    assert l3["restored_l3_tokens"] >= full_pages(SPEC) - 16
    assert fresh["mean_accept_length"] == pytest.approx(ref.mean_accept_length)
    for again in (l2, l3):
        assert again["mean_accept_length"] >= 0.9 * fresh["mean_accept_length"]


@pytest.fixture(scope="module")
def file_cluster() -> Iterator[Cluster]:
    c = Cluster(worker_args=WORKER, router_args=["--timeout", "60"]).start()
    try:
        yield c
    finally:
        c.stop()


def test_a_prompt_seen_before_a_decode_restart_is_restored_from_file_l3(
    file_cluster: Cluster,
) -> None:
    restart_round_trip(file_cluster)


def test_draft_kv_restored_from_l2_and_l3_keeps_accept_length(file_cluster: Cluster) -> None:
    spec_round_trip(file_cluster)


@pytest.fixture(scope="module")
def mooncake_cluster() -> Iterator[Cluster]:
    """Mooncake Store as L3. The test process holds the store's memory (a client with a
    segment), the decode contributes none: its objects outlive its restart."""
    master = MooncakeMaster()
    holder = None
    c = None
    try:
        holder = MooncakeStoreStorage(
            master.master_addr, master.metadata_url, segment_bytes=512 << 20
        )
        c = Cluster(
            worker_args=WORKER,
            router_args=["--timeout", "60"],
            decode_args=[
                "--l3-mooncake",
                master.master_addr,
                "--l3-mooncake-metadata",
                master.metadata_url,
                "--l3-mooncake-segment-mb",
                "0",
            ],
        ).start()
        yield c
    finally:
        if c is not None:
            c.stop()
        if holder is not None:
            holder.close()
        master.stop()


def test_a_prompt_seen_before_a_decode_restart_is_restored_from_mooncake_l3(
    mooncake_cluster: Cluster,
) -> None:
    restart_round_trip(mooncake_cluster)


@pytest.fixture(scope="module")
def host_landing_cluster() -> Iterator[Cluster]:
    """The decode lands KV in a token-granular host pool; the prefill pages by 8."""
    c = Cluster(
        worker_args=WORKER,
        prefill_args=["--page-size", "8"],
        decode_args=["--kv-landing", "host"],
        router_args=["--timeout", "60"],
    ).start()
    try:
        yield c
    finally:
        c.stop()


def test_host_landing_outputs_are_identical(host_landing_cluster: Cluster) -> None:
    c = host_landing_cluster
    prompts = [PREFIX + "host?", "short", "x" * 37, PREFIX + "host again?"]
    outs = [ask(c, p, 16) for p in prompts]
    for p, o in zip(prompts, outs):
        assert o["token_ids"] == greedy(p, 16), p
    # the repeated prefix comes from the token-granular L2: every token but the last
    assert outs[3]["restored_l2_tokens"] >= len(encode(PREFIX))
    st, events = c.complete(
        {"prompt": PREFIX + "stream?", "max_tokens": 16, "temperature": 0, "stream": True}
    )
    assert st == 200
    final = [e["pdxfer"] for e in events if e.get("pdxfer")]
    assert final and final[0]["token_ids"] == greedy(PREFIX + "stream?", 16)
