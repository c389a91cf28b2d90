"""Speculative decoding through PdxferConnector, on real vLLM: a prefill and a decode with
the same drafter (3 speculative tokens; MTP 1) behind ``pdxfer router --engine vllm``, driven
with the official ``openai`` client, against colocated vLLM with the same drafter. Four
drafters: ``draft_model`` (a draft identical to the target: colocated vLLM accepts every
draft), ``eagle`` (a head that replays the target shifted by one token,
``tests/harness/hf_drafters.py``: most of its drafts are accepted, and they depend on its own
KV of the whole prompt), ``eagle3`` (a random head: drafts right only by chance, so the
check there is the count of drafts and the tokens) and ``mtp`` (the target as a MiMo model
with a random MTP layer: vLLM's one MTP model of a plain dense decoder; one token a step).

The decode's drafter reads the draft KV the prefill computed for the prompt (it moves beside
the target's, in vLLM's KV cache), so its drafts, and vLLM's acceptance counters
(``/metrics``), are colocated's: the same drafts proposed, the same accepted. A decode
without the prefill's drafter is refused when the two pair, the log naming both values, and
(``kv_load_failure_policy: recompute``) computes the prompt itself (checked for ``REFUSED``).

One cluster per drafter: its prefill, decode, colocated reference (and for ``REFUSED`` a
decode without a drafter) start together; the next drafter's once the first's are stopped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdxfer import BootstrapServer
from pdxfer.serving.procs import Proc
from pdxfer.serving.vllm.local_model import SHAPES, build_model
from pdxfer.serving.vllm.servers import VllmServer, kv_config, read_stats, start_all
from tests.harness.hf_drafters import build_eagle, build_eagle3, build_mtp

from .vllm_helpers import complete, metric
from .vllm_helpers import token_prompt as prompt

pytestmark = [pytest.mark.timeout(900), pytest.mark.engine]

BS = 32
K = {"draft_model": 3, "eagle": 3, "eagle3": 3, "mtp": 1}
"""Speculative tokens a step (MiMo's MTP layer predicts one)."""
PREFILL, DECODE, PLAIN = "vllm-spec-p", "vllm-spec-d", "vllm-plain-d"
S = SHAPES["small"]
LAYER_BLOCK_BYTES = S.kv_heads * BS * 2 * S.head_size * 4
"""One block of one layer's KV (float32), the target's and its drafters' alike."""
DRAFT_LAYERS = {"draft_model": S.layers, "eagle": S.layers + 1, "eagle3": 1, "mtp": 1}
BUILD = {"eagle": build_eagle, "eagle3": build_eagle3}
LENGTHS = (7, 2 * BS + 1, 150)
"""Prompt tokens: under a block, k blocks + 1 (the decode computes one token), several."""
REFUSED = ("draft_model", "mtp")
"""The drafters whose cluster also starts a decode without one (the refusal is the same
check for every drafter: one in a model of its own, one inside the target)."""
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFTS = "vllm:spec_decode_num_draft_tokens_total"


class Cluster:
    def __init__(self, tmp: Path, method: str) -> None:
        self.tmp, self.method = tmp, method
        self.model = build_model(tmp / "model", "small")
        if method == "mtp":  # the target carries its drafter: every server serves it
            self.model = build_mtp(self.model, tmp / "mimo")
        build = BUILD.get(method)
        self.draft = build(self.model, tmp / method) if build else self.model
        spec = {"method": method, "model": str(self.draft), "num_speculative_tokens": K[method]}
        self.spec_args = ["--speculative-config", json.dumps(spec)]
        self.boot = BootstrapServer("127.0.0.1", 0).start()
        self.d_stats, self.plain_stats = tmp / "d.json", tmp / "plain.json"

    def _extra(self, instance: str, stats: Path | None = None) -> dict[str, object]:
        out: dict[str, object] = {"bootstrap": self.boot.address, "instance": instance}
        return {**out, "stats_file": str(stats)} if stats else out

    def start(self) -> None:
        self.prefill = VllmServer(
            "prefill",
            self.model,
            self.tmp,
            args=self.spec_args,
            kv_transfer_config=kv_config("kv_producer", self._extra(PREFILL)),
        )
        self.decode = VllmServer(
            "decode",
            self.model,
            self.tmp,
            args=[*self.spec_args, "--no-enable-prefix-caching"],
            log_stats=True,
            kv_transfer_config=kv_config("kv_consumer", self._extra(DECODE, self.d_stats)),
        )
        self.plain = self._plain() if self.method in REFUSED else None
        self.ref = VllmServer(
            "colocated",
            self.model,
            self.tmp,
            args=[*self.spec_args, "--no-enable-prefix-caching"],
            log_stats=True,
        )
        start_all([s for s in (self.prefill, self.decode, self.plain, self.ref) if s])

    def _plain(self) -> VllmServer:
        """A decode without the prefill's drafter, recomputing what it cannot load."""
        return VllmServer(
            "decode-plain",
            self.model,
            self.tmp,
            args=["--no-enable-prefix-caching"],
            kv_transfer_config=kv_config(
                "kv_consumer",
                self._extra(PLAIN, self.plain_stats),
                kv_load_failure_policy="recompute",
            ),
        )

    def router(self, decode: VllmServer, instance: str) -> Proc:
        return Proc(
            f"router-{instance}",
            [
                "router",
                "--engine",
                "vllm",
                "--port",
                "0",
                "--prefill",
                f"{self.prefill.url},{self.boot.address},{PREFILL}",
                "--decode",
                f"{decode.url},{instance}",
            ],
            timeout=180,
        )

    def stop(self) -> None:
        for name in ("prefill", "decode", "plain", "ref"):
            srv = getattr(self, name, None)
            if srv is not None:
                srv.stop()
        self.boot.stop()


@pytest.fixture(scope="module", params=sorted(DRAFT_LAYERS))
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp(f"vllm_spec_{request.param}"), request.param)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def acceptance(server: VllmServer) -> tuple[float, float]:
    """vLLM's counters: drafts accepted, drafts proposed."""
    return metric(server, ACCEPTED), metric(server, DRAFTS)


def test_the_decodes_drafts_and_acceptance_equal_colocated(cluster: Cluster) -> None:
    router = cluster.router(cluster.decode, DECODE)
    try:
        for seed, n in enumerate(LENGTHS, 1):
            p = prompt(n, seed)
            before = read_stats(cluster.d_stats)
            ref = complete(cluster.ref.url, p)
            got = complete(router.url, p)
            assert got == ref, f"{n} prompt tokens: {got} != colocated {ref}"
            after = read_stats(cluster.d_stats)
            # the load brought the drafter's KV beside the target's: both models' layers
            loaded = after["loaded_tokens"] - before.get("loaded_tokens", 0)
            moved = after["net_bytes"] - before.get("net_bytes", 0)
            layers = S.layers + DRAFT_LAYERS[cluster.method]
            assert moved == -(-loaded // BS) * LAYER_BLOCK_BYTES * layers, (n, loaded, moved)
    finally:
        router.stop()
    assert read_stats(cluster.d_stats)["load_failures"] == 0
    accepted, drafts = acceptance(cluster.decode)
    ref_accepted, ref_drafts = acceptance(cluster.ref)
    if cluster.method == "draft_model":
        assert ref_drafts > 0 and ref_accepted == ref_drafts, "an identical draft is always right"
    elif cluster.method == "eagle":  # it replays the target: right far more often than chance
        assert ref_accepted > ref_drafts / 3, (ref_accepted, ref_drafts)
    assert (accepted, drafts) == (ref_accepted, ref_drafts), (
        f"decode accepted {accepted:g} of {drafts:g} drafts, "
        f"colocated {ref_accepted:g} of {ref_drafts:g}"
    )


def test_a_decode_without_the_prefills_drafter_is_refused_naming_both(cluster: Cluster) -> None:
    if cluster.plain is None:
        pytest.skip(f"the refusal is checked for {', '.join(REFUSED)}")
    router = cluster.router(cluster.plain, PLAIN)
    try:
        p = prompt(40, 7)
        assert complete(router.url, p) == complete(cluster.ref.url, p)
    finally:
        router.stop()
    assert read_stats(cluster.plain_stats)["load_failures"] >= 1
    drafter = f"{cluster.method}:{cluster.draft.name}"
    why = f"model differs: draft: prefill {drafter}, decode none"
    assert why in cluster.plain.log.read_text(errors="replace")
    assert why in cluster.prefill.log.read_text(errors="replace")
