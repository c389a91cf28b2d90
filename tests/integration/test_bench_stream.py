"""benchmarks/stream.py works end to end: on a tiny configuration (the small model, prompts
of 64 and 128 tokens, one round) it starts real ``vllm serve`` processes on two network
namespaces behind ``pdxfer router --engine vllm``, caps the link, and writes every figure it
promises, with every output equal to colocated vLLM's. Its figures are not asserted (speed is
measured, not asserted); what is asserted is that the tool reports them and that it fails a
run whose outputs differ."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest

from pdxfer.integrations.vllm.config import KEYS
from tests.harness.benchrun import run_bench

from .netconf import needs_root

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
FIGURES = [
    f"stream.{k}{sfx}"
    for k in (
        "ttft_p50_ratio_vs_colocated",
        "hidden_fraction",
        "ttft_p50_ratio_vs_colocated_loopback",
        "prefill_step_ratio",
    )
    for sfx in ("", ".concurrency_4")
]
VARIANTS = ["colocated", "sequential", "concurrent_request", "concurrent_layer"]


def bench() -> ModuleType:
    return importlib.import_module("benchmarks.stream")


@needs_root
@pytest.mark.timeout(1800)
def test_bench_stream_quick_reports_every_figure_with_outputs_equal_to_colocated(
    tmp_path: Path,
) -> None:
    out = tmp_path / "stream.json"
    r = run_bench(
        "stream",
        "--quick",
        "--shape",
        "small",
        "--sizes",
        "64,128",
        "--answer",
        "4",
        "--idle-seconds",
        "1",
        "--variants",
        ",".join(VARIANTS),
        "--json",
        str(out),
        timeout=1700,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["stream.mismatches"] == 0 and res["stream.errors"] == 0, res
    layered = "stream.unavailable.concurrent_layer" not in res
    pd = [v for v in VARIANTS[1:] if layered or v != "concurrent_layer"]
    # per PD variant and link: 2 sizes x (1 alone + 4 at concurrency 4)
    assert res["stream.outputs_compared"] == len(pd) * 2 * 2 * 5
    assert res["stream.cap_mbit"] > 0 and res["stream.colocated_prefill_ms"] > 0
    for size in (64, 128):
        for c in (1, 4):
            assert res[f"stream.ttft_p50_ms.colocated.{size}.c{c}"] > 0
            for v in pd:
                for link in ("uncapped", "capped"):
                    assert res[f"stream.ttft_p50_ms.{v}.{link}.{size}.c{c}"] > 0
                    assert res[f"stream.prefill_leg_p50_ms.{v}.{link}.{size}.c{c}"] > 0
    for key in FIGURES:
        assert key in res
        if layered:
            assert isinstance(res[key], float), (key, res[key])
        else:  # before layer-by-layer sends exist: each figure needs them, so none is made up
            assert res[key] is None, (key, res[key])
    if not layered:
        assert "send_by" in res["stream.unavailable.concurrent_layer"]
    phases = res["stream.phases"]
    assert [p["phase"] for p in phases] == ["colocated", "request", "layer"]
    assert all(len(p["loadavg_before"]) == 3 for p in phases)


def test_an_output_that_differs_from_colocated_is_a_mismatch() -> None:
    b = bench()
    run = b.Run()
    k = (0, 1, 64, 0)
    run.outs[("colocated", "", k)] = [5, 6, 7]
    run.outs[("sequential", "capped", k)] = [5, 6, 7]
    run.outs[("concurrent_request", "capped", k)] = [5, 6, 8]
    run.outs[("concurrent_request", "uncapped", (0, 1, 64, 1))] = [5]  # no reference
    assert b.compare(run) == (2, 3)


def test_the_prefill_send_mode_falls_back_when_the_connector_does_not_know_send_by() -> None:
    b = bench()
    if "send_by" in KEYS:
        for mode in ("request", "step", "layer"):
            assert b.send_settings(mode) == ({"send_by": mode}, "")
    else:
        assert b.send_settings("request") == ({"send_per_step": False}, "")
        assert b.send_settings("step") == ({"send_per_step": True}, "")
        settings, why = b.send_settings("layer")
        assert settings is None and "send_by" in why
