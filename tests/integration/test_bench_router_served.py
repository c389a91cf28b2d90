"""``python -m benchmarks.router_served --quick``: two real vLLM prefills and a decode behind the
KV-aware and the round-robin router, one prefill restarted mid-run. Every figure is in the
JSON, no request fails, the sampled outputs equal colocated vLLM token for token, and the
KV-aware router's prefill choices reuse what the prefills hold. Timings are reported, not
asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness.benchrun import run_bench

pytestmark = pytest.mark.timeout(900)

FIGURES = ("prefill_reused_fraction_of_possible", "ttft_p50_ratio_kv_aware_vs_round_robin")
PER_VARIANT = ("requests", "errors", "possible_tokens", "reused_tokens", "ttft_p50_ms",
               "prefill_reused_fraction_of_possible", "router_reported_fraction",
               "load_before", "load_after")


def test_bench_router_served_quick_reports_every_figure_token_exact(tmp_path: Path) -> None:
    out = tmp_path / "served.json"
    r = run_bench("router_served", "--quick", "--json", str(out), timeout=880, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(out.read_text())
    assert json.loads(r.stdout) == res
    assert len(res["run.commit"].split("+")[0]) == 40
    for prefix in ("router", "router.restart"):
        for k in FIGURES:
            assert res[f"{prefix}.{k}"] > 0, (prefix, k)
        for v in ("kv_aware", "round_robin"):
            for k in PER_VARIANT:
                assert isinstance(res[f"{prefix}.{v}.{k}"], (int, float)), (prefix, v, k)
            assert res[f"{prefix}.{v}.requests"] > 0
        # the steady phases: no request fails; the conversations' prefixes were reusable
        assert res[f"{prefix}.kv_aware.possible_tokens"] > 0
    assert res["router.kv_aware.errors"] == res["router.round_robin.errors"] == 0
    assert res["router.kv_aware.kv_events_gaps"] == 0
    # the KV-aware router sent follow-ups where their prefix was (each conversation is
    # sequential, so the holder is known before the next turn goes out)
    assert res["router.prefill_reused_fraction_of_possible"] >= 0.9
    assert res["router.restart.down_s"] > 0
    assert "router.restart.recovery_s" in res
    assert res["router.outputs_compared"] >= 4
    assert res["router.outputs_mismatched"] == 0
