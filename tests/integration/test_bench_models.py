"""``python -m benchmarks.models --quick`` on one sliding-window family: the JSON names each
figure, the family is served token-exact, and a request moves about the window (the
decode's received bytes), not the prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness.benchrun import run_bench
from tests.harness.hf_families import FAMILIES, WINDOW

pytestmark = [pytest.mark.timeout(600), pytest.mark.engine]

ROOT = Path(__file__).resolve().parents[2]


def test_bench_models_quick_prints_each_family_figure_as_json() -> None:
    proc = run_bench(
        "models", "--quick", "--families", "mistral_swa", "--variants", "pdxfer", timeout=540
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    key = "models.mistral_swa.pdxfer"
    assert out[f"{key}.served"] == 1, out
    assert out[f"{key}.token_exact"] == 1.0, out
    assert out["models.served.pdxfer"] == ["mistral_swa"]
    for k in ("ttft_p50_ms", "colocated_ttft_p50_ms", "ttft_ratio_vs_colocated"):
        assert out[f"{key}.{k}"] > 0
    c = FAMILIES["mistral_swa"].config
    per_token = (
        4 * 2 * int(c["num_key_value_heads"]) * int(c["head_dim"]) * int(c["num_hidden_layers"])
    )  # float32 K and V, every layer
    (n,) = out["models.prompt_tokens"]
    assert 0 < out[f"{key}.bytes_per_request"] <= (WINDOW + 2 * 32) * per_token < n * per_token
