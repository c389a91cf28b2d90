"""Prefix keys are the fleet's shared names for pages: every process must compute the same."""

from __future__ import annotations

import os
import subprocess
import sys

from pdxfer.tiers import page_keys


def test_prefix_keys_are_stable_across_processes() -> None:
    keys = page_keys(list(range(100, 164)), 16)
    code = (
        "from pdxfer.tiers import page_keys; print(','.join(page_keys(list(range(100, 164)), 16)))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    assert out.split(",") == keys
