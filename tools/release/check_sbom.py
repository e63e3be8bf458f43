"""Checks an image's SBOM (tools/release/sbom.py's CycloneDX JSON) against requirements/runtime.lock.

Fails (exit 1, one line per finding) unless
  - every package the lock pins is in the SBOM at the locked version (the runtime set: pyproject.toml's
    dependencies and podresources extra, and everything they pull in),
  - every direct runtime dependency of pyproject.toml is in the lock and so in the SBOM,
  - the SBOM has no other package than those, the described component itself and the virtual environment's own
    installer (pip, setuptools: python3 -m venv puts them there), so nothing unpinned is in the image,
  - every dependency edge points at a listed component.
Prints one summary line. Standard library only.
    tools/release/check_sbom.py SBOM.json [--lock requirements/runtime.lock] [--pyproject pyproject.toml]"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
VENV_TOOLS = {"pip", "setuptools"}  # python3 -m venv installs these; not part of the runtime set
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    """{normalized name: version} of every `name==version` line of a pip requirements lock."""
    pins = {}
    for line in path.read_text().splitlines():
        m = PIN.match(line)
        if m:
            pins[normalize(m.group(1))] = m.group(2)
    return pins


def direct_runtime(pyproject: Path) -> set[str]:
    """The names pyproject.toml's runtime set asks for: [project] dependencies and the podresources extra."""
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = [*project["dependencies"], *project.get("optional-dependencies", {}).get("podresources", [])]
    return {normalize(re.split(r"[ ;<>=!~\[(]", r.strip(), maxsplit=1)[0]) for r in reqs}


def check(bom: dict[str, Any], pins: dict[str, str], direct: set[str]) -> tuple[list[str], str]:
    problems = []
    if bom.get("bomFormat") != "CycloneDX" or not bom.get("components"):
        return ["not a CycloneDX SBOM with components"], ""
    top = bom.get("metadata", {}).get("component", {})
    listed = {normalize(c["name"]): c["version"] for c in bom["components"]}
    for name in sorted(direct - set(pins)):
        problems.append(f"{name}: a runtime dependency of pyproject.toml that the lock does not pin")
    for name, version in sorted(pins.items()):
        if name not in listed:
            problems.append(f"{name}=={version}: locked, missing from the SBOM")
        elif listed[name] != version:
            problems.append(f"{name}: {listed[name]} in the SBOM, {version} locked")
    extra = set(listed) - set(pins) - VENV_TOOLS - {normalize(top.get("name", ""))}
    for name in sorted(extra):
        problems.append(f"{name}=={listed[name]}: in the image, not in the lock (unpinned)")
    refs = {c["bom-ref"] for c in bom["components"]} | {top.get("bom-ref")}
    for dep in bom.get("dependencies", []):
        for ref in [dep["ref"], *dep.get("dependsOn", [])]:
            if ref not in refs:
                problems.append(f"dependency edge to {ref}, which is not a component")
    tools = sorted(f"{n} {listed[n]}" for n in VENV_TOOLS & set(listed))
    summary = (
        f"SBOM: {len(listed)} packages ({len(pins)} locked runtime packages at their locked versions, "
        f"{len(direct)} of them direct; venv tools: {', '.join(tools) or 'none'}); "
        f"describes {top.get('name')} {top.get('version')}"
    )
    return problems, summary


def main() -> int:
    ap = argparse.ArgumentParser(description="check an image SBOM against the runtime lock")
    ap.add_argument("sbom", type=Path)
    ap.add_argument("--lock", type=Path, default=REPO / "requirements" / "runtime.lock")
    ap.add_argument("--pyproject", type=Path, default=REPO / "pyproject.toml")
    args = ap.parse_args()
    problems, summary = check(json.loads(args.sbom.read_text()), read_lock(args.lock), direct_runtime(args.pyproject))
    for p in problems:
        print(f"check_sbom: {p}", file=sys.stderr)
    if problems:
        return 1
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
