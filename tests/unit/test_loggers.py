"""Every module logs under its own name (``logging.getLogger(__name__)``), so a log line
says which file it came from."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "pdxfer"


def test_every_logger_in_the_package_is_named_for_its_module() -> None:
    named = re.compile(r"getLogger\(\s*[\"']")
    offenders = [
        f"{p.relative_to(ROOT.parent)}:{i}"
        for p in sorted(ROOT.rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if named.search(line)
    ]
    assert not offenders, f"loggers not named __name__: {offenders}"
