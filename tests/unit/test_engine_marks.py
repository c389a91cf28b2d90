"""scripts/test.sh runs the modules marked ``engine`` one at a time and every other module
three at a time: a module that starts vLLM or SGLang servers without the mark would run
beside two others and take the cores and memory they need. Every module that builds such
servers carries the mark."""

from __future__ import annotations

import re
from pathlib import Path

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"
STARTS_ENGINES = re.compile(r"pdxfer\.serving\.vllm\.servers|sglang_helpers|\bVllmServer\b")


def test_every_module_that_starts_engine_servers_is_marked_engine() -> None:
    starts = [
        p for p in sorted(INTEGRATION.glob("test_*.py")) if STARTS_ENGINES.search(p.read_text())
    ]
    assert len(starts) >= 10, "the pattern no longer finds the engine modules"
    unmarked = [p.name for p in starts if "pytest.mark.engine" not in p.read_text()]
    assert not unmarked, f"start engine servers but lack pytestmark engine: {unmarked}"
