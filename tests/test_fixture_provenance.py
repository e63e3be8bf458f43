"""Every sample the tests read is in the checkout, and every one has its source written down."""

from testkit.fixture_files import FIXTURES


def test_every_fixture_has_a_source_row():
    sources = (FIXTURES / "SOURCES.md").read_text()
    files = sorted(p.name for p in FIXTURES.iterdir() if p.is_file() and p.name != "SOURCES.md")
    assert len(files) > 50
    missing = [f for f in files if f"`{f}`" not in sources]
    assert not missing, f"fixtures without a provenance row in SOURCES.md: {missing}"
