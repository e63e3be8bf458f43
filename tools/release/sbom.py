"""A CycloneDX 1.5 SBOM (JSON, on stdout) of the Python packages installed in the interpreter that runs it.

The release runs it inside the image with the image's own interpreter, so the SBOM lists what the image holds,
read from the installed distributions' metadata (importlib.metadata), offline:
    podman run --rm -i --network none --entrypoint /opt/gpu-ready/bin/python IMAGE - --extras podresources \
        < tools/release/sbom.py
Standard library only (the image has nothing else to lean on). `--name NAME --version V` name the described
component (default: gpu-ready at its installed version), `--extras` the extras it was installed with. The output
is deterministic for a given environment: no timestamp unless SOURCE_DATE_EPOCH is set, the serial number derived
from the contents.
tools/release/check_sbom.py checks the result against requirements/runtime.lock."""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata as md
import json
import os
import re
import sys
import uuid
from typing import Any


def normalize(name: str) -> str:
    """PEP 503: the name pip and the package indexes compare by."""
    return re.sub(r"[-_.]+", "-", name).lower()


def purl(name: str, version: str) -> str:
    return f"pkg:pypi/{normalize(name)}@{version}"


def licenses(meta: Any) -> list[dict[str, Any]]:
    """License-Expression (core metadata 2.4) when present, else the OSI classifiers, else a short License field."""
    expression = meta.get("License-Expression")
    if expression:
        return [{"expression": expression.strip()}]
    names = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    if not names and meta.get("License"):
        text = meta["License"].strip().splitlines()[0][:100] if meta["License"].strip() else ""
        names = [text] if text and text.upper() != "UNKNOWN" else []
    return [{"license": {"name": n}} for n in names]


def _requirement_class() -> Any:
    """pip's vendored `packaging` Requirement (markers evaluated properly), or None where there is no pip."""
    try:
        from pip._vendor.packaging.requirements import Requirement
    except ImportError:
        return None
    return Requirement


def requirement_names(dist: md.Distribution, installed: dict[str, str], extras: tuple[str, ...] = ()) -> list[str]:
    """The installed distributions `dist` requires here (with `extras`): markers evaluated with pip's `packaging`
    where the environment has pip, else every named requirement whose extra, if any, is one of `extras`."""
    requirement = _requirement_class()
    out = []
    for raw in dist.requires or []:
        if requirement is not None:
            req = requirement(raw)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
                continue
            name = req.name
        else:
            extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)", raw)
            if extra and extra.group(1) not in extras:
                continue
            name = re.split(r"[ ;<>=!~\[(]", raw.strip(), maxsplit=1)[0]
        key = normalize(name)
        if key in installed:
            out.append(installed[key])
    return sorted(set(out))


def build(name: str, version: str | None, extras: tuple[str, ...] = ()) -> dict[str, Any]:
    dists: dict[str, md.Distribution] = {}
    for d in md.distributions():
        key = normalize(d.metadata["Name"])
        dists.setdefault(key, d)  # the first on sys.path wins, as for an import
    refs = {key: purl(d.metadata["Name"], d.version) for key, d in dists.items()}
    top_key = normalize(name)
    top_version = version or (dists[top_key].version if top_key in dists else "0")
    top_ref = purl(name, top_version)
    components, dependencies = [], []
    for key in sorted(dists):
        d = dists[key]
        if key == top_key:
            continue
        comp: dict[str, Any] = {
            "type": "library",
            "bom-ref": refs[key],
            "name": d.metadata["Name"],
            "version": d.version,
            "purl": refs[key],
        }
        lic = licenses(d.metadata)
        if lic:
            comp["licenses"] = lic
        components.append(comp)
        dependencies.append({"ref": refs[key], "dependsOn": requirement_names(d, refs)})
    top_deps = requirement_names(dists[top_key], refs, extras) if top_key in dists else sorted(refs.values())
    dependencies.insert(0, {"ref": top_ref, "dependsOn": [r for r in top_deps if r != top_ref]})
    metadata: dict[str, Any] = {
        "tools": {"components": [{"type": "application", "name": "gpu-ready tools/release/sbom.py"}]},
        "component": {"type": "application", "bom-ref": top_ref, "name": name, "version": top_version, "purl": top_ref},
        "properties": [
            {"name": "python:version", "value": ".".join(map(str, sys.version_info[:3]))},
            {"name": "python:prefix", "value": sys.prefix},
        ],
    }
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch and epoch.isdigit():
        stamp = datetime.datetime.fromtimestamp(int(epoch), datetime.UTC)
        metadata["timestamp"] = stamp.strftime("%Y-%m-%dT%H:%M:%SZ")
    bom: dict[str, Any] = {
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "version": 1,
        "metadata": metadata,
        "components": components,
        "dependencies": dependencies,
    }
    digest = hashlib.sha256(json.dumps(bom, sort_keys=True).encode()).digest()
    bom["serialNumber"] = f"urn:uuid:{uuid.UUID(bytes=digest[:16], version=5)}"
    return bom


def main() -> int:
    ap = argparse.ArgumentParser(description="CycloneDX SBOM of the installed Python packages")
    ap.add_argument("--name", default="gpu-ready")
    ap.add_argument("--version", default=None)
    ap.add_argument("--extras", default="", help="comma-separated extras the described component was installed with")
    args = ap.parse_args()
    extras = tuple(e.strip() for e in args.extras.split(",") if e.strip())
    json.dump(build(args.name, args.version, extras), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
