"""Installable as a release: the runtime lock (requirements/runtime.lock) against pyproject.toml and against the
environment the tests run in, the light Kubernetes client path with the locked client (on, and reported), the chart
by digest, and the SBOM tools. The release's own steps run in `make release-dry-run` (.ci/run; docs/release.md)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from testkit.chart import CHART, KUBE_VERSION, helm, render

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements" / "runtime.lock"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
DIGEST = "sha256:" + "0123456789abcdef" * 4


def locked() -> dict[str, tuple[str, list[str]]]:
    """{name: (version, hashes)} of requirements/runtime.lock."""
    pins: dict[str, tuple[str, list[str]]] = {}
    current = None
    for line in LOCK.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", line)
        if m:
            current = canonicalize_name(m.group(1))
            pins[current] = (m.group(2), [])
        elif current and (h := re.match(r"^\s+--hash=(sha256:[0-9a-f]{64})", line)):
            pins[current][1].append(h.group(1))
    return pins


def runtime_requirements() -> list[Requirement]:
    project = PYPROJECT["project"]
    return [Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"]["podresources"]]]


def test_the_lock_pins_every_runtime_dependency_within_pyproject_and_hashes_every_pin():
    pins = locked()
    assert len(pins) >= 10
    assert all(hashes for _, hashes in pins.values()), [n for n, (_, h) in pins.items() if not h]
    for req in runtime_requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} is not in requirements/runtime.lock (make lock)"
        assert req.specifier.contains(pins[name][0], prereleases=True), f"locked {name}=={pins[name][0]} outside {req}"
    # the kubernetes bound is one major, the locked one (the light client path is tied to its module layout)
    kube = next(r for r in runtime_requirements() if r.name == "kubernetes")
    major = int(pins["kubernetes"][0].split(".")[0])
    assert kube.specifier.contains(f"{major}.0.0") and not kube.specifier.contains(f"{major + 1}.0.0")
    assert not kube.specifier.contains(f"{major - 1}.99.0")


LOCKED_ENV = r"""
import json, sys
import importlib.metadata as md
from agent.kube.client import client_layer
pins = json.loads(sys.argv[1])
print(json.dumps({"versions": {n: md.version(n) for n in pins}, "light": client_layer().light,
                  "whole_client": "kubernetes.client.models" in sys.modules}))
"""


def test_the_tests_run_the_locked_runtime_set_and_the_light_client_path_is_on_with_it():
    """`make dev` installs with the lock as constraints, so the suite runs what the image installs; with those
    versions the agent must import the client's REST layer on the light path (agent/lazy.py falls back silently
    to the whole client with a kubernetes whose layout it does not know, e.g. 36 or older)."""
    pins = {name: version for name, (version, _) in locked().items()}
    r = subprocess.run(
        [sys.executable, "-c", LOCKED_ENV, json.dumps(sorted(pins))], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    drift = {n: (got["versions"][n], v) for n, v in pins.items() if got["versions"][n] != v}
    assert not drift, f"installed vs locked: {drift} (make dev installs with the lock as constraints)"
    assert got["light"] is True and got["whole_client"] is False


GAUGE = r"""
import sys
from prometheus_client import generate_latest
from agent import config
from agent.kube.client import KubeApi
from agent.runner import Agent
state, kmsg = sys.argv[1:3]
cfg = config.load(None, environ={}, overrides={"node_name": "n", "state_dir": state, "kmsg": kmsg})
agent = Agent(cfg, api=KubeApi.from_token("https://127.0.0.1:1", "t"))
print([l for l in generate_latest(agent.metrics.registry).decode().splitlines() if l.startswith("gpu_ready_light")])
"""


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "GPU_READY_FULL_CLIENT"}


@pytest.mark.parametrize(("env", "value"), [({}, "1.0"), ({"GPU_READY_FULL_CLIENT": "1"}, "0.0")])
def test_the_agent_reports_whether_the_light_client_path_is_on(tmp_path, env, value):
    (tmp_path / "kmsg").write_text("")
    r = subprocess.run(
        [sys.executable, "-c", GAUGE, str(tmp_path / "state"), str(tmp_path / "kmsg")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**_env(), **env},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == str([f"gpu_ready_light_client {value}"])


def images(node: Any) -> set[str]:
    """Every container image in rendered manifests (any depth: DaemonSet, Job, CronJob)."""
    if isinstance(node, list):
        return set().union(*(images(n) for n in node)) if node else set()
    if not isinstance(node, dict):
        return set()
    found = {c["image"] for key in ("containers", "initContainers") for c in node.get(key) or []}
    return found.union(*(images(v) for v in node.values()))


def test_the_chart_runs_the_image_by_digest_when_one_is_set_else_by_the_app_version_tag():
    app_version = re.search(r'^appVersion: "?([^"\n]+)"?$', (CHART / "Chart.yaml").read_text(), re.M)
    assert app_version
    repo = "ghcr.io/gpu-ready/gpu-ready"
    preflight = ["--set", "preflight.enabled=true", "--set", "preflight.nodeName=node-1"]
    assert images(render(preflight)) == {f"{repo}:{app_version.group(1)}"}
    assert images(render([*preflight, "--set", f"image.digest={DIGEST}"])) == {f"{repo}@{DIGEST}"}
    assert images(render(["--set", "image.tag=9.9.9"])) == {f"{repo}:9.9.9"}
    bad = helm(
        "template", "x", str(CHART), "--kube-version", KUBE_VERSION, "--set", "image.digest=sha256:abc", check=False
    )
    assert bad.returncode != 0 and "image/digest" in bad.stderr


def test_the_sbom_of_an_environment_lists_the_locked_runtime_set_and_the_check_finds_what_is_not(tmp_path):
    """tools/release/sbom.py on the dev venv (which holds the runtime set at the locked versions, and the dev tools
    besides): the check finds every locked package at its version and calls the dev tools unpinned; a package
    missing, at another version or added is each a finding."""
    sbom = subprocess.run(
        [sys.executable, str(REPO / "tools/release/sbom.py"), "--extras", "podresources"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    bom = json.loads(sbom)
    assert bom["bomFormat"] == "CycloneDX" and bom["metadata"]["component"]["name"] == "gpu-ready"
    top = bom["dependencies"][0]
    for req in runtime_requirements():  # the direct edges, the podresources extra's included
        assert any(ref.startswith(f"pkg:pypi/{canonicalize_name(req.name)}@") for ref in top["dependsOn"]), req

    def findings(b: dict[str, Any]) -> list[str]:
        path = tmp_path / "sbom.json"
        path.write_text(json.dumps(b))
        r = subprocess.run(
            [sys.executable, str(REPO / "tools/release/check_sbom.py"), str(path)], capture_output=True, text=True
        )
        return [line.removeprefix("check_sbom: ") for line in r.stderr.splitlines()]

    pins = locked()
    found = findings(bom)
    assert found and all(line.endswith("(unpinned)") for line in found), found
    assert not any(canonicalize_name(line.split("==")[0]) in pins for line in found)
    only_runtime = {**bom, "components": [c for c in bom["components"] if canonicalize_name(c["name"]) in pins]}
    only_runtime["dependencies"] = []
    assert findings(only_runtime) == []
    without_h2 = {**only_runtime, "components": [c for c in only_runtime["components"] if c["name"] != "h2"]}
    assert findings(without_h2) == [f"h2=={pins['h2'][0]}: locked, missing from the SBOM"]
    other = [{**c, "version": "0.0.1"} if c["name"] == "structlog" else c for c in only_runtime["components"]]
    assert findings({**only_runtime, "components": other}) == [
        f"structlog: 0.0.1 in the SBOM, {pins['structlog'][0]} locked"
    ]
    added = [*only_runtime["components"], {"name": "six", "version": "1.17.0", "bom-ref": "pkg:pypi/six@1.17.0"}]
    assert findings({**only_runtime, "components": added}) == ["six==1.17.0: in the image, not in the lock (unpinned)"]
