"""``python -m benchmarks.router_scale --quick`` prints every figure as flat JSON: the KV index
and choice at two fleet sizes, and the real bootstrap server with 1,000 registered ranks.
Timings are reported, not asserted."""

from __future__ import annotations

import json
from pathlib import Path

from tests.harness.benchrun import ROOT, run_bench

KEYS = (
    "decision_p50_ms",
    "decision_p99_ms",
    "bytes_per_block",
    "events_per_s",
    "bootstrap_lookups_per_s",
    "bootstrap_lookup_p99_ms",
)


def test_bench_router_scale_quick_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    r = run_bench("router_scale", "--quick", "--json", str(out), timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(out.read_text())
    assert json.loads(r.stdout) == res
    for k in KEYS:
        assert res[f"router_scale.{k}"] > 0, k
    figures = {k: v for k, v in res.items() if k.startswith("router_scale.")}
    assert all(isinstance(v, (int, float)) for v in figures.values())
    for w in (10, 100):
        assert res[f"router_scale.w{w}.indexed_blocks"] >= 20_000
        assert res[f"router_scale.w{w}.workers"] == w
        # the index found the conversations it was fed: most follow-ups go to a holder
        assert res[f"router_scale.w{w}.followups_routed_to_a_holder"] > 0.3
    assert res["router_scale.bootstrap_ranks"] == 1000
    assert res["router_scale.bootstrap_lookups"] == 2000
    assert res["run.benchmark"] == "router_scale" and res["run.commit"]
    # every figure of the recorded full run, its third fleet's aside
    recorded = json.loads((ROOT / "benchmarks" / "results" / "bench_router_scale.json").read_text())
    assert set(figures) == {
        k
        for k in recorded
        if k.startswith("router_scale.") and not k.startswith("router_scale.w1000.")
    }
