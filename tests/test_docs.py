"""The documentation index: docs/README.md links every page in docs/ (and the project README names each of them),
so a new page cannot be left out of the index."""

from __future__ import annotations

import re
import subprocess
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


def tracked(*patterns: str) -> list[Path]:
    """The repository's tracked files matching `patterns` (git pathspecs), or every file under ROOT that matches
    them when this is not a git checkout (an unpacked release)."""
    r = subprocess.run(["git", "ls-files", "--", *patterns], cwd=ROOT, capture_output=True, text=True, check=False)
    if r.returncode == 0 and r.stdout.strip():
        return [ROOT / p for p in r.stdout.split()]
    return sorted(p for pat in patterns for p in ROOT.rglob(pat) if ".venv" not in p.parts)


def slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    out: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*)", line)):
            s = slug(m.group(1))
            n = seen[s] = seen.get(s, -1) + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def test_every_relative_link_and_anchor_of_every_markdown_file_resolves():
    broken = []
    for page in tracked("*.md"):
        for target, frag in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            dest = (page.parent / target).resolve() if target else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target}#{frag}")
    assert not broken, f"links to nothing: {broken}"


# This project's own issue numbers (the word issue then a number, the project's name then #number, its issue
# URL): a doc or comment says the reason itself.
# Upstream references (NVIDIA/gpu-operator#118, "NPD #470") name their project and are sources, not citations.
OWN_ISSUE = re.compile(r"\bissue[ -]#?\d+|\bgpu-ready#\d+|gpu-ready/gpu-ready/(?:issues|pull)/\d+", re.IGNORECASE)


def test_no_doc_or_comment_cites_an_issue_number():
    found = []
    for f in tracked("*.md", "*.py", "*.yaml", "*.tpl", "*.txt", "*.sh", "Makefile", "*.toml", "Dockerfile"):
        if "fixtures" in f.parts:
            continue  # captured public data, kept as it was
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if OWN_ISSUE.search(line):
                found.append(f"{f.relative_to(ROOT)}:{n}")
    assert not found, f"issue numbers cited: {found}"


def named_files(page: Path) -> set[str]:
    """The files and modules a page names in code spans: paths (`agent/act/taints.py`, `kube/cache.py`, `tests/`)
    and dotted modules (`agent.act.fencing.plan`, as a path); placeholders such as `<name>` and globs left out."""
    out = set()
    for tok in re.findall(r"`([^`\s]+)`", page.read_text()):
        if any(c in tok for c in "<>*()=[]"):
            continue
        if re.fullmatch(r"agent(\.\w+)+", tok):
            path = tok.replace(".", "/")
            out.add(path if (ROOT / path).is_dir() else path + ".py")
        elif re.search(r"\.(py|md|yaml|json|csv)$", tok) or tok.startswith(("agent/", "tests/", "testkit/", "charts/")):
            out.add(tok)
    return out


def test_the_architecture_page_names_only_files_that_exist():
    files = [p.relative_to(ROOT).as_posix() for p in tracked("*")]
    dirs = {d for f in files for d in (f.rsplit("/", i)[0] for i in range(1, f.count("/") + 1))}

    def exists(name: str) -> bool:
        name = name.rstrip("/")
        return name in dirs or any(f == name or f.endswith("/" + name) for f in files)

    missing = {n for n in named_files(DOCS / "architecture.md") if not exists(n)}
    assert not missing, f"docs/architecture.md names files that do not exist: {sorted(missing)}"
