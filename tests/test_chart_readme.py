"""The chart's README (charts/gpu-ready/README.md) is what tools/chart_readme.py makes from values.schema.json,
values.yaml and examples/, and every value in the schema has the description it shows."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "gpu-ready"
SCRIPT = ROOT / "tools" / "chart_readme.py"


def chart_readme() -> ModuleType:
    spec = importlib.util.spec_from_file_location("chart_readme", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def properties(node: dict[str, Any], path: str = "") -> dict[str, dict[str, Any]]:
    """Every property of the schema by its dotted path, nested ones (and those of array items) included."""
    out: dict[str, dict[str, Any]] = {}
    for key, prop in node.get("properties", {}).items():
        out[path + key] = prop
        out.update(properties(prop, f"{path}{key}."))
    if isinstance(node.get("items"), dict):
        out.update(properties(node["items"], f"{path}[]."))
    return out


def test_every_schema_property_has_a_description():
    schema = json.loads((CHART / "values.schema.json").read_text())
    props = properties(schema)
    missing = sorted(p for p, prop in props.items() if not str(prop.get("description", "")).strip())
    assert not missing, f"values.schema.json properties without a description: {missing}"
    # what an umbrella chart passes and the overrides the name helpers read are there
    for key in ("global", "enabled", "nameOverride", "fullnameOverride", "podSecurityContext", "securityContext"):
        assert key in schema["properties"], key
    assert "seLinuxOptions" in schema["properties"]["securityContext"]["properties"]
    assert "seLinuxOptions" in schema["properties"]["podSecurityContext"]["properties"]


def test_the_readme_is_what_the_script_makes():
    text = chart_readme().render()
    assert (CHART / "README.md").read_text() == text, "charts/gpu-ready/README.md is stale: run make chart-readme"
    schema = json.loads((CHART / "values.schema.json").read_text())
    for path in properties(schema):
        if "[]" not in path:
            assert f"| `{path}` |" in text, path
    for example in (CHART / "examples").glob("*.yaml"):
        assert f"(examples/{example.name})" in text, example.name


def test_the_script_checks_without_writing():
    r = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, str(SCRIPT), "--bogus"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage:" in r.stderr
