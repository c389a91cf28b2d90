"""``pdxfer demo`` with heterogeneous TP, both ways: TP 2 prefill -> TP 1 decode and TP 1 ->
TP 2 each PASS and print the same table (the same requests, prompts and verdicts; timings
and cache hits aside, which depend on scheduling).

A reduced batch keeps it short; the decode restart (L3 round) is part of it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

ARGS = ["--requests", "4", "--max-tokens", "8", "--concurrency", "2"]


def table(out: str) -> list[tuple[str, ...]]:
    """(req, prompt tokens, verdict) of every row, and the restart marker."""
    rows: list[tuple[str, ...]] = []
    started = False
    for line in out.splitlines():
        if line.lstrip().startswith("req "):
            started = True
            continue
        if started and "after the decode restart" in line:
            rows.append(("restart",))
        elif started and line.strip() and line.split()[0].isdigit():
            cells = line.split()
            rows.append((cells[0], cells[1], cells[-1]))
        elif started and not line.strip() and rows:
            break
    return rows


@pytest.fixture(scope="module")
def runs() -> dict[str, str]:
    out = {}
    for p_tp, d_tp in ((2, 1), (1, 2)):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdxfer.cli",
                "demo",
                "--prefill-tp",
                str(p_tp),
                "--decode-tp",
                str(d_tp),
                *ARGS,
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        out[f"{p_tp}->{d_tp}"] = r.stdout
    return out


@pytest.mark.parametrize("pair", ["2->1", "1->2"])
def test_demo_passes_with_heterogeneous_tp(runs: dict[str, str], pair: str) -> None:
    out = runs[pair]
    assert out.rstrip().endswith("PASS"), out
    p_tp, d_tp = pair.split("->")
    assert f"prefill (TP {p_tp}), decode (TP {d_tp})" in out, out
    rows = table(out)
    assert ("restart",) in rows and all(r[-1] == "identical" for r in rows if len(r) > 1), out


def test_both_ways_print_the_same_table(runs: dict[str, str]) -> None:
    assert table(runs["2->1"]) == table(runs["1->2"])
    assert len(table(runs["2->1"])) >= 5
