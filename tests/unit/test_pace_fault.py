"""The ``pace`` fault: each vLLM engine step that schedules work sleeps that long, so a test
can rely on a request of N tokens taking at least N steps (its client leaves first)."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest

from pdxfer import ConfigError
from pdxfer.faults import Faults

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_pace_is_parsed_and_replaced_like_the_other_delays() -> None:
    f = Faults.parse("pace=0.05,delay_write=1")
    assert f.pace == 0.05 and f.delay_write == 1.0
    f.update("drop=0.1")
    assert f.pace == 0.0
    with pytest.raises(ConfigError):
        Faults.parse("pace=fast")


@pytest.mark.parametrize("side", ["kv_producer", "kv_consumer"])
def test_a_paced_step_sleeps_once_and_only_when_it_schedules_work(
        side: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdxfer.integrations.vllm import config as C
    from pdxfer.integrations.vllm import scheduler as S

    slept: list[float] = []
    monkeypatch.setattr(S.time, "sleep", slept.append)
    sch = S.PdxferScheduler(C.parse(side, {"bootstrap": "127.0.0.1:9"}, "m"), 32)
    assert sch.pace == 0.0  # off unless PDXFER_FAULTS names it
    sch.pace = 0.05

    def step(tokens: int) -> Any:
        return SimpleNamespace(total_num_scheduled_tokens=tokens, num_scheduled_tokens={},
                               preempted_req_ids=(), scheduled_new_reqs=[])

    sch.build_connector_meta(step(7))
    assert slept == [0.05]
    sch.build_connector_meta(step(0))  # an idle step is not held
    sch.build_connector_meta()
    assert slept == [0.05]
