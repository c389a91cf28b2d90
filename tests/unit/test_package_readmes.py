"""Every folder of the package has a README.md giving its reading order, and it names every
module of that folder: a file added without a place in the reading order fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "pdxfer"
FOLDERS = sorted(p for p in [ROOT, *ROOT.rglob("*")] if p.is_dir() and any(p.glob("*.py")))


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_each_package_readme_names_every_module_in_its_reading_order(folder: Path) -> None:
    readme = folder / "README.md"
    assert readme.is_file(), f"{folder} has no README.md"
    text = readme.read_text()
    assert "reading order" in text.lower() or "Reading order" in text or folder == ROOT, readme
    missing = [
        p.name for p in sorted(folder.glob("*.py")) if p.stem != "__init__" and p.stem not in text
    ]
    assert not missing, f"{readme} does not name {missing}"
