"""``python -m benchmarks.goodput --quick``: a pdxfer PD pair behind the router and colocated
vLLM (one server on both cores, and one per core) under the same seeded Poisson load. Every
figure of the method is produced for every variant and rate, no request fails, and every PD
answer equals colocated's token for token. Timings are reported, not asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness.benchrun import run_bench

pytestmark = [pytest.mark.timeout(1200), pytest.mark.engine]

VARIANTS = ("pd", "colocated", "colocated_x2")
PER_PHASE = (
    "requests",
    "finished",
    "failed",
    "refused",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "attainment.tpot_strict",
    "attainment.ttft_strict",
    "rate",
    "loadavg_before",
    "client_cpu_s",
    "fifo_model.ttft_p50_ms",
    "fifo_model.ttft_p99_ms",
)


def test_bench_goodput_quick_reports_every_figure_token_exact(tmp_path: Path) -> None:
    out, wl = tmp_path / "goodput.json", tmp_path / "workload.json"
    r = run_bench(
        "goodput",
        "--quick",
        "--json",
        str(out),
        "--workload-out",
        str(wl),
        "--requests-out",
        str(tmp_path / "requests.jsonl"),
        timeout=1150,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(out.read_text())
    rates = res["goodput.rates"]
    assert len(rates) == 2 and rates[0] < rates[1]
    for v in VARIANTS:
        for k in range(len(rates)):
            for key in PER_PHASE:
                assert isinstance(res[f"goodput.{v}.r{k}.{key}"], (int, float)), (v, k, key)
            assert res[f"goodput.{v}.r{k}.requests"] == 6
            assert res[f"goodput.{v}.r{k}.failed"] == 0, res.get(f"goodput.{v}.r{k}.errors")
        for t in ("tpot_strict", "ttft_strict"):
            assert res[f"goodput.{v}.goodput_req_s.{t}"] >= 0
    for k in range(len(rates)):  # every PD request's KV moved, none recomputed
        assert res[f"goodput.pd.r{k}.recomputed"] == 0
        assert res[f"goodput.pd.r{k}.kv_bytes"] > 0
        # PD's TTFT split at the prefill's answer, as the router timed its legs
        assert 0 < res[f"goodput.pd.r{k}.prefill_leg_p50_ms"] <= res[f"goodput.pd.r{k}.ttft_p99_ms"]
        assert res[f"goodput.pd.r{k}.router_cpu_s"] > 0
    rows = [json.loads(x) for x in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 6 * len(rates) * len(VARIANTS)  # every request's outcome, once
    assert all(r["prefill_s"] is not None for r in rows if r["variant"] == "pd")
    assert all(r["prefill_s"] is None and not r["error"] for r in rows if r["variant"] != "pd")
    for key in ("goodput_ratio_tpot_strict", "goodput_ratio_ttft_strict", "failed", "recomputed"):
        assert isinstance(res[f"goodput.{key}"], (int, float)), key
    assert res["goodput.failed"] == res["goodput.recomputed"] == 0
    assert res["goodput.outputs_checked"] == 12
    assert res["goodput.outputs_mismatched"] == 0
    for pre in ("goodput.", *(f"goodput.{v}." for v in VARIANTS if v != "colocated")):
        for n in (64, 768):  # each variant's own unloaded figures, at each calibrated length
            assert res[f"{pre}unloaded.ttft_ms.{n}"] > 0, (pre, n)
            assert res[f"{pre}unloaded.decode_step_ms.{n}"] > 0, (pre, n)
    # the workload file replays: every variant got these requests, in this order
    workload = json.loads(wl.read_text())
    assert [float(k) for k in workload] == rates
    assert all(len(v) == 6 for v in workload.values())
