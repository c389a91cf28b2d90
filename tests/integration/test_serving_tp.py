"""The served system at TP > 1: prefill and decode of different TP sizes, through the router
with the official ``openai`` client, every output equal to the colocated TP 1 reference.

One cluster for the module: a TP 2 and a TP 1 prefill, and three decodes (TP 1, TP 2, and a
TP 1 landing KV in a token-granular host pool); each test sends through a router of its own
over exactly the pair it is about. Prompts span many pages and share long prefixes, so a head
or page written to the wrong place changes the tokens (the toy model leans hard on its KV).
"""

from __future__ import annotations

import functools
import json
import os
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch

from pdxfer.serving.toy import EOS_ID, ToyConfig, ToyModel, encode, make_draft
from pdxfer.serving.toy.cluster import Cluster
from pdxfer.serving.toy.model import speculative_generate

torch.set_num_threads(1)
MODEL = ToyModel(ToyConfig())
WORKER = [
    "--bootstrap-timeout",
    "15",
    "--transfer-timeout",
    "60",
    "--heartbeat",
    "0.25",
    "--pages",
    "256",
]
P_TP2, P_TP1 = 0, 1
D_TP1, D_TP2, D_HOST = 0, 1, 2
N = 12


@functools.cache
def greedy(prompt: str, n: int = N) -> tuple[int, ...]:
    out = MODEL.generate(encode(prompt), n)
    return tuple(out[: out.index(EOS_ID)] if EOS_ID in out else out)


def prompts(topic: str) -> list[str]:
    """Two prompts sharing a prefix of ~13 pages, and one of their own (~6 pages)."""
    prefix = f"{topic}: " + " ".join(f"{topic[:3]}{i} moves kv pages" for i in range(14))
    return [
        prefix + " | first question?",
        prefix + " | second, other question?",
        f"unrelated {topic} prompt " * 4,
    ]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(
        worker_args=WORKER,
        router_args=["--timeout", "90"],
        prefills=2,
        decodes=3,
        each_prefill=[["--tp", "2"], []],
        each_decode=[[], ["--tp", "2"], ["--kv-landing", "host"]],
    ).start()
    try:
        yield c
    finally:
        c.stop()


def client_for(c: Cluster, prefill: int, decode: int) -> openai.OpenAI:
    router = c.add_router([prefill], [decode], ["--timeout", "90"])
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=120)


def complete(client: openai.OpenAI, prompt: str, **extra: Any) -> dict[str, Any]:
    r = client.completions.create(
        model="pdxfer-toy", prompt=prompt, max_tokens=N, temperature=0, extra_body=extra or None
    )
    info = r.model_extra["pdxfer"]
    assert r.choices[0].text == bytes(t for t in info["token_ids"] if t < 256).decode(
        "utf-8", errors="replace"
    )
    return info


def health(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
        return json.loads(r.read())


def check_pair(c: Cluster, prefill: int, decode: int, topic: str) -> list[dict[str, Any]]:
    client = client_for(c, prefill, decode)
    out = []
    for p in prompts(topic):
        info = complete(client, p)
        assert tuple(info["token_ids"]) == greedy(p), p
        out.append(info)
    # the second prompt's prefix came from the decode's L2 and the prefill's L2
    assert out[1]["restored_l2_tokens"] >= 12 * 16, out[1]
    assert out[1]["prefill_reused_tokens"] >= 12 * 16, out[1]
    return out


def test_prefill_tp2_feeds_decode_tp1(cluster: Cluster) -> None:
    check_pair(cluster, P_TP2, D_TP1, "two to one")
    assert health(cluster.prefills[P_TP2].url)["tp"] == 2  # type: ignore[union-attr]


def test_prefill_tp1_feeds_decode_tp2_every_rank_restoring_its_heads(cluster: Cluster) -> None:
    out = check_pair(cluster, P_TP1, D_TP2, "one to two")
    ranks = out[1]["ranks"]
    assert len(ranks) == 2 and all(r["restored_tokens"] >= 12 * 16 for r in ranks), ranks
    h = health(cluster.decodes[D_TP2].url)
    assert h["ranks"][0]["alive"] and h["ranks"][0]["rooms"] == 0, h
    assert h["free_pages"] == h["pages"], h


def test_tp2_to_tp2_restores_prefix_and_repairs_a_short_restore_on_its_rank(
    cluster: Cluster,
) -> None:
    first, second, _ = check_pair(cluster, P_TP2, D_TP2, "two to two")
    assert all(
        r["restored_tokens"] >= 12 * 16 and r["repaired_tokens"] == 0 for r in second["ranks"]
    ), second
    # after a restart the prefix is in L3 only; rank 1's copy is damaged on disk: rank 1's
    # restore comes up short and is repaired from its prefill rank, rank 0 restores in full
    cluster.restart_decode(D_TP2)
    assert cluster.l3_dir is not None
    root = os.path.join(cluster.l3_dir, f"decode{D_TP2}", "rank1")
    damaged = 0
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "r+b") as f:
                f.seek(os.path.getsize(path) // 2)
                b = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([b[0] ^ 0xFF]))
            damaged += 1
    assert damaged, f"no L3 objects of rank 1 under {root}"
    client = client_for(cluster, P_TP2, D_TP2)
    p = prompts("two to two")[0].replace("first", "third")
    info = complete(client, p)
    assert tuple(info["token_ids"]) == greedy(p)
    r0, r1 = info["ranks"]
    assert r0["restored_tokens"] >= 12 * 16 and r0["repaired_tokens"] == 0, info
    assert r1["repaired_tokens"] >= 16 and r1["restored_tokens"] < r0["restored_tokens"], info
    assert info["restored_l3_tokens"] == r1["restored_tokens"], info  # what every rank had


def test_speculative_decoding_across_tp_sizes_keeps_the_draft_kv(cluster: Cluster) -> None:
    p = "speculative decoding over tensor-parallel ranks needs every draft head. " * 4
    ref = speculative_generate(MODEL, make_draft(MODEL), encode(p), N, k=3)
    info = complete(client_for(cluster, P_TP2, D_TP2), p, speculative_k=3)
    assert info["token_ids"] == ref.tokens[: len(info["token_ids"])]
    assert info["mean_accept_length"] == pytest.approx(ref.mean_accept_length)


def test_prefill_tp2_feeds_a_host_landing_decode_tp1_of_page_size_one(cluster: Cluster) -> None:
    h = health(cluster.decodes[D_HOST].url)
    assert h["page_size"] == 1 and h["kv_landing"] == "host", h
    check_pair(cluster, P_TP2, D_HOST, "host landing")
