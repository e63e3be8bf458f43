"""The documentation index: docs/README.md links every page in docs/ (and the project README names each of them),
so a new page cannot be left out of the index."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def linked(page: Path) -> set[Path]:
    """The files a Markdown page links to, resolved from the page's directory."""
    return {(page.parent / target).resolve() for target in LINK.findall(page.read_text()) if "://" not in target}


def pages() -> set[Path]:
    return {p.resolve() for p in DOCS.glob("*.md") if p.name != "README.md"}


def test_docs_index_links_every_page() -> None:
    missing = sorted(p.name for p in pages() - linked(DOCS / "README.md"))
    assert not missing, f"docs/README.md does not link {missing}"
    assert {"comparison.md", "controller.md"} <= {p.name for p in pages()}


def test_project_readme_names_every_page() -> None:
    missing = sorted(p.name for p in pages() - linked(ROOT / "README.md"))
    assert not missing, f"README.md's Documentation list does not link {missing}"


def test_every_relative_link_of_the_index_and_readme_exists() -> None:
    for page in (DOCS / "README.md", ROOT / "README.md", DOCS / "comparison.md"):
        broken = sorted(str(p) for p in linked(page) if not p.exists())
        assert not broken, f"{page.name} links missing files {broken}"
