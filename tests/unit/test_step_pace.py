"""The connector's ``step_pace_s``: each vLLM engine step that schedules work sleeps that long,
so a test can rely on a request of N tokens taking at least N steps (its client leaves first)."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest

from pdxfer import ConfigError
from pdxfer.faults import Faults

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_step_pace_is_a_checked_connector_key_not_a_fault() -> None:
    from pdxfer.integrations.vllm import config as C

    assert (
        C.parse("kv_producer", {"bootstrap": "127.0.0.1:9", "step_pace_s": 0.05}).step_pace_s
        == 0.05
    )
    with pytest.raises(ConfigError, match="step_pace_s"):
        C.parse("kv_producer", {"bootstrap": "127.0.0.1:9", "step_pace_s": -1})
    with pytest.raises(ConfigError, match="unknown fault 'pace'"):
        Faults.parse("pace=0.05")


@pytest.mark.parametrize("side", ["kv_producer", "kv_consumer"])
def test_a_paced_step_sleeps_once_and_only_when_it_schedules_work(
    side: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdxfer.integrations.vllm import config as C
    from pdxfer.integrations.vllm import scheduler as S

    slept: list[float] = []
    monkeypatch.setattr(S.time, "sleep", slept.append)
    assert S.PdxferScheduler(C.parse(side, {"bootstrap": "127.0.0.1:9"}, "m"), 32).pace == 0.0
    sch = S.PdxferScheduler(
        C.parse(side, {"bootstrap": "127.0.0.1:9", "step_pace_s": 0.05}, "m"), 32
    )

    def step(tokens: int) -> Any:
        return SimpleNamespace(
            total_num_scheduled_tokens=tokens,
            num_scheduled_tokens={},
            preempted_req_ids=(),
            scheduled_new_reqs=[],
        )

    sch.build_connector_meta(step(7))
    assert slept == [0.05]
    sch.build_connector_meta(step(0))  # an idle step is not held
    sch.build_connector_meta()
    assert slept == [0.05]
