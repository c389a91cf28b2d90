"""Speculative decoding in the vLLM connector: which drafter a pair must share (the pairing
fingerprint's ``draft=``), and a loaded request's first decode step without vLLM's
placeholder drafts. End to end on real vLLM: tests/integration/test_vllm_spec.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput  # noqa: E402

from pdxfer.endpoint.decode_peers import model_diff  # noqa: E402
from pdxfer.integrations.vllm import config as C  # noqa: E402
from pdxfer.integrations.vllm.scheduler import PdxferScheduler  # noqa: E402
from pdxfer.integrations.vllm.spec import draft_id  # noqa: E402


@dataclass(frozen=True)
class Spec:
    """The ``SpeculativeConfig`` fields ``draft_id`` reads."""

    method: str
    model: str | None = None
    revision: str | None = None
    kv_cache_dtype: str | None = None
    parallel_drafting: bool = False
    draft_model_config: object = None

    def uses_draft_kv_cache(self) -> bool:
        return self.method in ("draft_model", "eagle", "eagle3", "mtp")


def test_a_drafter_with_kv_is_named_by_method_and_draft_folder(tmp_path) -> None:
    d = tmp_path / "tiny-draft"
    d.mkdir()
    assert draft_id(Spec("draft_model", str(d))) == "draft_model:tiny-draft"
    assert draft_id(Spec("eagle3", "org/eagle3-head", revision="v2")) == "eagle3:org/eagle3-head@v2"
    assert draft_id(Spec("mtp", str(d), kv_cache_dtype="fp8")) == "mtp:tiny-draft:kv=fp8"


def test_eagle_eagle3_mtp_and_a_draft_model_in_one_folder_are_distinct_drafters(tmp_path) -> None:
    d = tmp_path / "head"
    d.mkdir()
    ids = {draft_id(Spec(m, str(d))) for m in ("draft_model", "eagle", "eagle3", "mtp")}
    assert ids == {"draft_model:head", "eagle:head", "eagle3:head", "mtp:head"}
    p = f"model=m draft={draft_id(Spec('eagle', str(d)))}"
    dd = f"model=m draft={draft_id(Spec('eagle3', str(d)))}"
    assert model_diff(p, dd) == "draft: prefill eagle:head, decode eagle3:head"


def test_no_drafter_or_a_model_free_one_needs_nothing_from_the_prefill() -> None:
    assert draft_id(None) == "none"
    assert draft_id(Spec("ngram")) == "none"
    assert draft_id(Spec("suffix")) == "none"


def test_a_drafter_mismatch_names_both_values() -> None:
    p = "model=m block_size=32 draft=draft_model:small"
    d = "model=m block_size=32 draft=none"
    assert model_diff(p, d) == "draft: prefill draft_model:small, decode none"


def _new(rid: str, computed: int) -> NewRequestData:
    return NewRequestData(
        req_id=rid,
        prompt_token_ids=list(range(computed + 1)),
        mm_features=[],
        sampling_params=None,
        pooling_params=None,
        block_ids=([0, 1],),
        num_computed_tokens=computed,
        lora_request=None,
    )


def _decode() -> PdxferScheduler:
    return PdxferScheduler(C.parse("kv_consumer", {"bootstrap": "127.0.0.1:9"}, "m"), 32)


def test_a_loaded_requests_first_step_carries_no_placeholder_drafts() -> None:
    """vLLM pads it with ``-1`` drafts that are always rejected and counted as drafts; the
    step then computes the last prompt token alone, as colocated vLLM's prefill does."""
    sch = _decode()
    sch._asked.update({"loaded", "real"})
    so = SchedulerOutput.make_empty()
    so.scheduled_new_reqs = [_new("loaded", 39), _new("other", 39), _new("real", 39)]
    so.num_scheduled_tokens = {"loaded": 4, "other": 4, "real": 4}
    so.total_num_scheduled_tokens = 12
    so.scheduled_spec_decode_tokens = {"loaded": [-1] * 3, "other": [-1] * 3, "real": [5, 6, 7]}
    sch.build_connector_meta(so)
    assert so.num_scheduled_tokens == {"loaded": 1, "other": 4, "real": 4}
    assert so.total_num_scheduled_tokens == 9
    assert so.scheduled_spec_decode_tokens == {"other": [-1] * 3, "real": [5, 6, 7]}


def test_a_prefill_leaves_vllms_schedule_as_it_is() -> None:
    sch = PdxferScheduler(C.parse("kv_producer", {"bootstrap": "127.0.0.1:9"}, "m"), 32)
    so = SchedulerOutput.make_empty()
    so.scheduled_new_reqs = [_new("r", 39)]
    so.num_scheduled_tokens = {"r": 4}
    so.total_num_scheduled_tokens = 4
    so.scheduled_spec_decode_tokens = {"r": [-1] * 3}
    sch.build_connector_meta(so)
    assert so.num_scheduled_tokens == {"r": 4} and so.scheduled_spec_decode_tokens == {
        "r": [-1] * 3
    }
