"""The docs site builds with strict checks, and those checks do fail on a broken link, a
missing page or a page left out of the nav (else `mkdocs build --strict` in scripts/test.sh
would prove nothing)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _copy(tmp: Path) -> Path:
    """The site's config and pages in a scratch folder (the checkout stays untouched)."""
    shutil.copytree(ROOT / "docs", tmp / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp / "mkdocs.yml")
    return tmp / "mkdocs.yml"


def test_the_docs_site_builds_strictly(tmp_path: Path) -> None:
    r = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


@pytest.mark.parametrize(
    "damage", ["broken_link", "broken_anchor", "missing_page", "page_not_in_nav"]
)
def test_a_broken_docs_site_fails_the_build(tmp_path: Path, damage: str) -> None:
    config = _copy(tmp_path)
    docs = tmp_path / "docs"
    named = {
        "broken_link": "nope.md",
        "broken_anchor": "no-such-section",
        "missing_page": "metrics.md",
        "page_not_in_nav": "orphan.md",
    }[damage]
    if damage == "broken_link":
        (docs / "tiers.md").write_text((docs / "tiers.md").read_text() + "\n[x](nope.md)\n")
    elif damage == "broken_anchor":
        (docs / "tiers.md").write_text(
            (docs / "tiers.md").read_text() + "\n[x](vllm.md#no-such-section)\n"
        )
    elif damage == "missing_page":
        (docs / "metrics.md").unlink()
    else:
        (docs / "orphan.md").write_text("# Orphan\n")
    r = _build(config, tmp_path / "site")
    out = r.stdout + r.stderr
    assert r.returncode != 0, f"{damage} did not fail the build:\n{out[-2000:]}"
    warned = out[out.index("WARNING") :] if "WARNING" in out else ""
    assert named in warned, out[-2000:]  # it failed for that reason
