"""The samples the tests read (tests/fixtures: nvidia-smi output, kernel logs, lspci, DCGM metrics), every one
with its source written down in tests/fixtures/SOURCES.md."""

from __future__ import annotations

from pathlib import Path

from testkit.controlplane import REPO

FIXTURES = REPO / "tests" / "fixtures"  # every sample the tests read; provenance in SOURCES.md


def fixture_path(name: str) -> Path:
    path = FIXTURES / name
    if not path.exists():
        raise FileNotFoundError(f"fixture {name} not found in {FIXTURES}")
    return path
