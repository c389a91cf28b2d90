"""``pdxfer bench NAME``: run a benchmark of ``benchmarks/``, which a checkout has and the wheel
does not ship. The package is found on ``sys.path``, else in the working directory or beside
an editable install's ``pdxfer/``; the library never imports it otherwise."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path


def _find() -> bool:
    """Whether ``benchmarks`` is importable, after adding the checkout it lives in."""
    for root in (None, Path.cwd(), Path(__file__).resolve().parents[1]):
        added = root is not None and (root / "benchmarks" / "__init__.py").is_file()
        if root is not None and not added:
            continue
        if added:
            sys.path.insert(0, str(root))  # its processes (agents) inherit it
        try:
            importlib.import_module("benchmarks")
            return True
        except ImportError:
            if added:
                sys.path.remove(str(root))
    return False


def run_benchmark(name: str, argv: list[str]) -> int:
    """``python -m benchmarks.NAME ARGV``, from the ``pdxfer`` command."""
    if not _find():
        print(
            "pdxfer bench: error: the benchmarks package is not importable; it is in a "
            "pdxfer checkout, not the wheel: run from the checkout's root (or put it on "
            "PYTHONPATH)",
            file=sys.stderr,
        )
        return 2
    names = importlib.import_module("benchmarks").NAMES
    if name not in names:
        print(
            f"pdxfer bench: error: no benchmark {name!r}; known: {', '.join(names)}",
            file=sys.stderr,
        )
        return 2
    runner = importlib.import_module("benchmarks.common.runner")
    return int(runner.run(importlib.import_module(f"benchmarks.{name}"), argv))
