"""docs/configuration.md is generated from the code, and every ``PDXFER_*`` variable is in
the one registry it is generated from (``pdxfer.config.ENV_VARS``), so neither can drift."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from pdxfer.config import ENV_VARS, Knobs

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bPDXFER_[A-Z0-9_]*[A-Z0-9]\b")
NOT_VARIABLES = {"PDXFER_READY"}  # the line a served process prints once it serves
SEARCHED = ("pdxfer", "scripts", "tests", "examples")


def _sources() -> Iterator[Path]:
    for top in SEARCHED:
        for p in (ROOT / top).rglob("*"):
            if p.is_file() and p.suffix in (".py", ".sh", ".yml", ".yaml", ".md", ".toml", ""):
                yield p


def _used_names() -> dict[str, set[Path]]:
    """Each ``PDXFER_`` name -> the files it appears in (config.py, the registry, excepted)."""
    out: dict[str, set[Path]] = {}
    for p in _sources():
        if p == ROOT / "pdxfer" / "config.py":
            continue
        try:
            text = p.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for n in NAME.findall(text):
            out.setdefault(n, set()).add(p)
    return out


def test_configuration_page_is_what_the_generator_writes() -> None:
    r = subprocess.run(
        [sys.executable, "scripts/gen_config_docs.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, (
        "docs/configuration.md differs from the code: regenerate it with "
        "`python scripts/gen_config_docs.py` and commit the result.\n"
        + r.stdout[-4000:]
        + r.stderr[-2000:]
    )


def test_every_pdxfer_variable_used_in_the_repository_is_registered() -> None:
    registered = {v.name for v in ENV_VARS}
    unknown = {
        n: sorted(str(p.relative_to(ROOT)) for p in ps)
        for n, ps in _used_names().items()
        if n not in registered and n not in NOT_VARIABLES
    }
    assert not unknown, (
        f"PDXFER_ names used but not in pdxfer.config.ENV_VARS (add each "
        f"with its help text, then regenerate the docs): {unknown}"
    )


def test_every_registered_variable_is_used_somewhere() -> None:
    used = set(_used_names()) | _names_knobs_read()
    stale = [v.name for v in ENV_VARS if v.name not in used]
    assert not stale, f"registered in ENV_VARS but read nowhere: {stale}"


class _Recorder(Mapping[str, str]):
    def __init__(self) -> None:
        self.asked: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.asked.add(key)
        raise KeyError(key)

    def get(self, key: str, default: object = None) -> object:  # type: ignore[override]
        self.asked.add(key)
        return default

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def _names_knobs_read() -> set[str]:
    rec = _Recorder()
    Knobs.from_env(rec)
    return rec.asked


def test_knobs_read_exactly_the_registered_library_variables() -> None:
    library = {v.name for v in ENV_VARS if v.scope == "library"}
    assert _names_knobs_read() == library


def test_the_completion_help_names_exactly_the_values_the_transport_accepts() -> None:
    """``PDXFER_TE_COMPLETION``'s help once offered ``spin``, which the transport refuses."""
    import re

    from pdxfer.config import ENV_VARS
    from pdxfer.transport.mooncake import COMPLETIONS

    help_ = next(v.help for v in ENV_VARS if v.name == "PDXFER_TE_COMPLETION")
    named = set(re.findall(r"``(\w+)``", help_))
    assert named == set(COMPLETIONS), named
