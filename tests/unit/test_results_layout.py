"""docs/ holds pages and the images its pages embed or link, nothing else; the raw benchmark
results live in benchmarks/results/, each one described in that folder's README."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)#\s]+)")  # a Markdown link or image's target
IMAGES = {".png", ".svg", ".jpg", ".gif"}


def _linked_from(page: Path) -> set[Path]:
    return {(page.parent / t).resolve() for t in LINK.findall(page.read_text()) if "://" not in t}


def test_docs_holds_only_pages_and_the_images_they_show() -> None:
    docs = ROOT / "docs"
    linked = set().union(*(_linked_from(p) for p in docs.rglob("*.md")))
    strays = [
        str(f.relative_to(ROOT))
        for f in sorted(docs.rglob("*"))
        if f.is_file()
        and f.suffix != ".md"
        and (f.suffix not in IMAGES or f.resolve() not in linked)
    ]
    assert not strays, f"under docs/, neither a page nor an image a page shows: {strays}"


def test_every_raw_result_is_described_in_its_index() -> None:
    results = ROOT / "benchmarks" / "results"
    linked = _linked_from(results / "README.md")
    files = [f for f in sorted(results.iterdir()) if f.name != "README.md"]
    assert files, "benchmarks/results/ is empty"
    unnamed = [f.name for f in files if f.resolve() not in linked]
    assert not unnamed, f"benchmarks/results/README.md does not describe: {unnamed}"
