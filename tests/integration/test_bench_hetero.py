"""``benchmarks/hetero.py`` as ``benchmarks/transfer.py`` runs it: its repetitions are requests
of their own. It once sent every repetition to one room; once a prefill began refusing a
second request for a room that had succeeded (a room is single-use), every run lost its
``hetero_tp.*`` figures, and ``benchmarks/transfer.py`` still exited 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness.benchrun import run_bench

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]


def test_every_repetition_of_bench_hetero_is_a_request_of_its_own_and_succeeds() -> None:
    proc = run_bench("hetero", "--quick", timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["hetero_tp.repetitions"] >= 2
    for case in ("tp1_1", "tp2_1_hnd", "tp2_1_nhd"):
        assert out[f"hetero_tp.{case}.bytes"] > 0
        assert out[f"hetero_tp.{case}.gb_per_s"] > 0
    # every repetition after the first of each case succeeded (the first verifies the bytes)
    for inst in ("tp1", "HND2", "NHD2"):
        assert proc.stderr.count(f"{inst} rep 1: Success") == 1, proc.stderr[-3000:]
