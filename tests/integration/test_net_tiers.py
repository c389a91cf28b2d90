"""Mooncake Store as L3 shared by decodes on different hosts. Each decode binds every
interface and advertises its host's address; each contributes a segment of the store's
memory, and the master places a page's object in either. A prompt one decode wrote back is
restored from L3 by the other, so objects cross between hosts. Each store client registers
its segment under the decode's advertised address.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import torch

from pdxfer.serving.toy import EOS_ID, ToyConfig, ToyModel, encode
from pdxfer.serving.toy.cluster import Cluster
from pdxfer.tiers import MooncakeMaster
from tests.harness.hosts import Network

from .netconf import needs_root

pytestmark = needs_root

torch.set_num_threads(1)
MODEL = ToyModel(ToyConfig())
HOSTS = ["front", "store", "p0", "d0", "d1", "client"]
PREFIX = "a system prompt that two decodes on two hosts share through the store, " * 6


def greedy(prompt: str, n: int) -> list[int]:
    out = MODEL.generate(encode(prompt), n)
    return out[: out.index(EOS_ID)] if EOS_ID in out else out


@pytest.fixture(scope="module")
def net() -> Iterator[Network]:
    with Network(HOSTS) as n:
        yield n


@pytest.fixture(scope="module")
def cluster(net: Network) -> Iterator[Cluster]:
    with net["store"].enter():  # the master runs on its own host
        master = MooncakeMaster(host=net["store"].addr)
    c = None
    try:
        # round robin alternates the decodes, so a repeat lands on the decode that did not
        # see the prompt: its L2 has nothing, the store has it all
        c = Cluster(
            worker_args=["--bootstrap-timeout", "10", "--transfer-timeout", "60", "--pages", "512"],
            decode_args=[
                "--l3-mooncake",
                master.master_addr,
                "--l3-mooncake-metadata",
                master.metadata_url,
                "--l3-mooncake-segment-mb",
                "64",
            ],
            decodes=2,
            bind_all=True,
            client=net["client"].enter,
            router_args=["--timeout", "60", "--policy", "round_robin"],
            hosts={
                "bootstrap": net["front"],
                "router": net["front"],
                "prefill": net["p0"],
                "decode": net["d0"],
                "decode1": net["d1"],
            },
        ).start()
        yield c
    finally:
        if c is not None:
            c.stop()
        master.stop()


def test_decodes_on_two_hosts_restore_each_others_prompts_from_mooncake_store(
    net: Network, cluster: Cluster
) -> None:
    assert cluster.router is not None
    pages = (len(encode(PREFIX)) // 16) * 16
    with net["client"].enter():
        client = openai.OpenAI(
            base_url=f"{cluster.router.url}/v1", api_key="unused", max_retries=0, timeout=60
        )
        got = []
        for i in range(4):  # round robin: d0, d1, d0, d1 (which decode goes first is not ours)
            p = PREFIX + f"question {i}?"
            r = client.completions.create(model="pdxfer-toy", prompt=p, max_tokens=8, temperature=0)
            ext = r.model_extra["pdxfer"]
            assert ext["token_ids"] == greedy(p, 8), p
            got.append(ext)
    decodes = [g["decode"] for g in got]
    assert decodes[0] != decodes[1] and decodes[0] == decodes[2] and decodes[1] == decodes[3]
    assert got[0]["restored_tokens"] == 0
    # the second decode has nothing of the prefix in L2: all of it came from the store, whose
    # objects lie in both decodes' segments (the first request's pages were spread by the
    # master), so some crossed from the first decode's host
    assert got[1]["restored_l3_tokens"] >= pages - 16, got[1]
    for g in got[2:]:
        assert g["restored_tokens"] >= pages - 16, g
