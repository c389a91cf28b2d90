"""A decode loads KV only from the bootstrap servers it was told to trust.

The attack: with no secret (the default), a caller that reaches a decode names its own
bootstrap server, behind which a rogue prefill (a real pdxfer prefill, same model, on its own
bootstrap) holds the KV of *another* prompt. A decode that paired with it would generate
from that KV and write it back to its L2 as the victim prompt's KV, where it would serve
later requests of other users. The decode must refuse it before any connection (403,
logged, counted), and the victim's own request, through the router with the ``openai``
client, must get the colocated reference's tokens.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from pdxfer import BootstrapServer
from pdxfer.serving.procs import Proc
from pdxfer.serving.toy import EOS_ID, ToyConfig, ToyModel, encode
from pdxfer.serving.toy.cluster import Cluster, post

torch.set_num_threads(1)
MODEL = ToyModel(ToyConfig())
WORKER = [
    "--pages",
    "128",
    "--bootstrap-timeout",
    "5",
    "--transfer-timeout",
    "30",
    "--heartbeat",
    "0.25",
]
NEW = 8
VICTIM = "the victim's prompt, long enough to fill several pages of KV: " * 2
EVIL = ("an attacker's prompt, whose KV is not the victim's. " * 4)[: len(VICTIM)]


def greedy(ids: list[int], n: int) -> list[int]:
    out = MODEL.generate(ids, n)
    return out[: out.index(EOS_ID)] if EOS_ID in out else out


class Setup:
    def __init__(self) -> None:
        self.cluster = Cluster(
            worker_args=WORKER, router_args=["--timeout", "60"], expose_cache_stats=True
        )
        self.rogue_boot = BootstrapServer("127.0.0.1", 0)
        self.rogue: Proc | None = None

    def start(self) -> Setup:
        self.cluster.start()
        self.rogue_boot.start()
        self.rogue = Proc(
            "rogue-prefill",
            [
                "--log-level",
                "ERROR",
                "prefill",
                "--port",
                "0",
                "--bootstrap",
                self.rogue_boot.address,
                *WORKER,
            ],
        )
        return self

    def stop(self) -> None:
        if self.rogue is not None:
            self.rogue.stop()
        self.rogue_boot.stop()
        self.cluster.stop()


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    s = Setup()
    try:
        yield s.start()
    finally:
        s.stop()


def decode_call(s: Setup, body: dict) -> tuple[int, dict]:
    assert s.cluster.decode is not None
    return post(
        f"{s.cluster.decode.url}/generate",
        {
            "room": 4242,
            "instance": "default",
            "prompt_ids": encode(VICTIM),
            "max_tokens": NEW,
            "temperature": 0,
            **body,
        },
        timeout=60,
    )


def test_a_rogue_prefill_named_by_a_caller_is_refused_and_the_victim_gets_its_tokens(
    setup: Setup,
) -> None:
    s, c = setup, setup.cluster
    assert s.rogue is not None and c.router is not None
    victim, evil = encode(VICTIM), encode(EVIL)
    assert len(victim) == len(evil)
    with ThreadPoolExecutor(2) as ex:  # the rogue computes the attacker's KV for room 4242
        rogue = ex.submit(
            post,
            f"{s.rogue.url}/generate",
            {"room": 4242, "prompt_ids": evil, "temperature": 0},
            60,
        )
        status, body = decode_call(s, {"bootstrap": s.rogue_boot.address})
        rogue.result()
    assert status == 403, body
    assert "not one of this decode's trusted bootstrap servers" in body["error"]["message"]
    assert c.metrics("decode")["pdxfer_decode_untrusted_bootstraps_refused"] == 1
    client = openai.OpenAI(base_url=f"{c.router.url}/v1", api_key="unused", max_retries=0)
    for _ in range(2):  # the second one is served from the decode's L2
        r = client.completions.create(
            model="pdxfer-toy", prompt=victim, max_tokens=NEW, temperature=0
        )
        assert r.model_extra["pdxfer"]["token_ids"] == greedy(victim, NEW)
    assert r.model_extra["pdxfer"]["restored_tokens"] > 0, "the victim's prefix came from L2"


@pytest.mark.parametrize(
    "bootstrap", ["127.0.0.1:x", "127.0.0.1:70000", "127.0.0.1:0", ":8998", "127.0.0.1", "", 8998]
)
def test_a_malformed_bootstrap_is_a_bad_request(setup: Setup, bootstrap: object) -> None:
    before = setup.cluster.metrics("decode")["pdxfer_decode_untrusted_bootstraps_refused"]
    status, body = decode_call(setup, {"bootstrap": bootstrap})
    assert status == 400, body
    assert setup.cluster.metrics("decode")["pdxfer_decode_untrusted_bootstraps_refused"] == before


def test_a_decode_without_trusted_bootstraps_fails_at_start_saying_what_to_set() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pdxfer.cli", "decode", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert "set --bootstrap" in r.stderr, r.stderr
