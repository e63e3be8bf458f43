"""Every sample the tests read is in the checkout, and every one has its source written down."""

import json

from testkit.fixture_files import FIXTURES


def test_every_fixture_has_a_source_row():
    sources = (FIXTURES / "SOURCES.md").read_text()
    files = sorted(p.name for p in FIXTURES.iterdir() if p.is_file() and p.name != "SOURCES.md")
    assert len(files) > 50
    missing = [f for f in files if f"`{f}`" not in sources]
    assert not missing, f"fixtures without a provenance row in SOURCES.md: {missing}"


def test_every_node_file_has_one_source_row():
    """Each corpus node (`nodes/<name>/`) says where each of its files came from, once, and is listed in SOURCES.md."""
    sources = (FIXTURES / "SOURCES.md").read_text()
    readme = (FIXTURES / "nodes" / "README.md").read_text()
    folders = sorted(p for p in (FIXTURES / "nodes").iterdir() if p.is_dir())
    assert len(folders) >= 40
    for folder in folders:
        bundle = json.loads((folder / "bundle.json").read_text())
        rows = [row["file"] for row in bundle["sources"]]
        files = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != "bundle.json")
        assert sorted(rows) == files, f"{folder.name}: files and source rows differ"
        assert all(row["from"].strip() and row["how"].strip() for row in bundle["sources"]), folder.name
        assert bundle["expect"]["status"] in ("True", "False", "Unknown"), folder.name
        assert f"`nodes/{folder.name}/`" in sources, f"{folder.name}: no row in SOURCES.md"
        assert f"`{folder.name}`" in readme, f"{folder.name}: not in nodes/README.md"
