"""Run a benchmark of ``benchmarks/`` as its own process, the way a user does (``python -m``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def checkout_env() -> dict[str, str]:
    """This environment with the checkout first on ``PYTHONPATH``: ``benchmarks`` and
    ``tests.harness`` import from any working directory, and so do the processes they spawn."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def run_bench(name: str, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.NAME ARGS``; ``kw`` goes to ``subprocess.run``."""
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", *args],
        capture_output=True,
        text=True,
        env=checkout_env(),
        **kw,
    )


__all__ = ["checkout_env", "run_bench"]
