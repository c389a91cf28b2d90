"""``python -m benchmarks.router_served --quick``: two real vLLM prefills and a decode behind the
KV-aware and the round-robin router, then one prefill restarted mid-run under the KV-aware
one (the quick run restarts for that variant only). Every figure of the full run's JSON is
there but the round-robin restart's, no request fails, the sampled outputs equal colocated
vLLM token for token, and the KV-aware router's prefill choices reuse what the prefills
hold. Timings are reported, not asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness.benchrun import ROOT, run_bench

pytestmark = [pytest.mark.timeout(900), pytest.mark.engine]

FIGURES = ("prefill_reused_fraction_of_possible", "ttft_p50_ratio_kv_aware_vs_round_robin")
PER_VARIANT = (
    "requests",
    "errors",
    "possible_tokens",
    "reused_tokens",
    "ttft_p50_ms",
    "prefill_reused_fraction_of_possible",
    "router_reported_fraction",
    "load_before",
    "load_after",
)
PHASES = ("before_kill", "while_down", "after_return")
FULL_ONLY = (
    "router.restart.round_robin.",
    "router.restart.ttft_p50_ratio_",
    "router.kv_aware_baseline.",
    "router.ttft_p50_ratio_kv_aware_baseline_",
    "router.commit",
)  # the last: scripts/bench_router_served.py's, now run.commit


def test_bench_router_served_quick_reports_every_figure_token_exact(tmp_path: Path) -> None:
    out = tmp_path / "served.json"
    r = run_bench("router_served", "--quick", "--json", str(out), timeout=880, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(out.read_text())
    assert json.loads(r.stdout) == res
    assert len(res["run.commit"].split("+")[0]) == 40
    # every key of the recorded full run but the round-robin restart's (full runs only)
    recorded = json.loads(
        (ROOT / "benchmarks" / "results" / "bench_router_served.json").read_text()
    )
    want = {k for k in recorded if k.startswith("router.") and not k.startswith(FULL_ONLY)}
    assert want <= set(res), sorted(want - set(res))
    assert res["router.restart.variants"] == "kv_aware"
    for k in FIGURES:
        assert res[f"router.{k}"] > 0, k
    for v in ("kv_aware", "round_robin"):
        for k in PER_VARIANT:
            assert isinstance(res[f"router.{v}.{k}"], (int, float)), (v, k)
        assert res[f"router.{v}.requests"] > 0
    kv = "router.restart.kv_aware"
    for k in PER_VARIANT:
        assert isinstance(res[f"{kv}.{k}"], (int, float)), k
    # the restart run: a fixed list of conversations, split by the kill and the return
    assert (
        res[f"{kv}.requests"]
        == sum(res[f"{kv}.requests.{ph}"] for ph in PHASES)
        == (
            (res["router.restart.before_convs"] + res["router.restart.after_convs"])
            * res["router.turns"]
        )
    )
    for ph in PHASES:
        assert isinstance(res[f"{kv}.ttft_p50_ms.{ph}"], (int, float)), ph
    assert res[f"{kv}.requests.before_kill"] >= res["router.restart.kill_at_requests"]
    assert res[f"{kv}.requests.after_return"] >= (
        res["router.restart.after_convs"] * res["router.turns"]
    )
    assert res[f"{kv}.errors"] == 0
    # the steady phases: no request fails; the conversations' prefixes were reusable
    assert res["router.kv_aware.possible_tokens"] > 0
    assert res["router.kv_aware.errors"] == res["router.round_robin.errors"] == 0
    assert res["router.kv_aware.kv_events_gaps"] == 0
    # the KV-aware router sent follow-ups where their prefix was (each conversation is
    # sequential, so the holder is known before the next turn goes out)
    assert res["router.prefill_reused_fraction_of_possible"] >= 0.9
    assert res["router.restart.prefill_reused_fraction_of_possible"] > 0
    assert res["router.restart.down_s"] > 0
    assert "router.restart.recovery_s" in res
    assert res["router.outputs_compared"] >= 4
    assert res["router.outputs_mismatched"] == 0
