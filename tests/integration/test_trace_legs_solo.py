"""scripts/trace_vllm_legs.py ``--solo``: each case runs with only the servers it uses, as
bench_vllm's phases run each variant alone, so the trace reproduces the benchmark's
conditions inside one interleaved run; the pause really stops a server's whole process group
(its engine core is a child) and always resumes it."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from pdxfer.agents.process import wait_until

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def legs(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    return importlib.import_module("trace_vllm_legs")


def test_each_case_keeps_exactly_its_own_servers_running(legs: ModuleType) -> None:
    uses = {
        "colocated_stream": {"colocated"},
        "colocated_one": {"colocated"},
        "pdxfer_leg": {"prefill", "decode"},
        "pdxfer_one": {"prefill", "decode"},
        legs.SOLO: {"prefill"},
    }
    for case in (*legs.CASES, legs.SOLO):
        assert set(legs.paused_for(case)) == {"colocated", "prefill", "decode"} - uses[case]


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_paused_server_group_child_included_is_stopped_and_resumed_even_on_error(
    legs: ModuleType,
) -> None:
    # a "server" that starts a child in its own group, as vLLM's API server does its core
    p = subprocess.Popen(
        ["sh", "-c", "sleep 60 & echo $!; wait"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert p.stdout is not None
        child = int(p.stdout.readline())
        # a signal takes effect when its target next runs: wait for it, bounded, not a guess
        both = (p.pid, child)
        with pytest.raises(RuntimeError), legs.paused([p.pid]):
            assert wait_until(lambda: all(state(x) == "T" for x in both), 30.0)
            raise RuntimeError("a failed request")
        assert wait_until(lambda: all(state(x) != "T" for x in both), 30.0)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
