"""deploy/ is made from the chart by tools/deploy_manifests.py (`make deploy`): these tests fail when it lags the
chart, and apply its manifest to a real kube-apiserver as `kubectl apply -f deploy/gpu-ready.yaml` would."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from testkit.chart import is_hook, kubectl
from testkit.cluster import ensure_namespace
from testkit.testbin import tool

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
MANIFEST = DEPLOY / "gpu-ready.yaml"


def deploy_manifests() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deploy_manifests", ROOT / "tools" / "deploy_manifests.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def manifest() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def test_deploy_is_what_the_chart_makes():
    tools = deploy_manifests()
    files = tools.render(tool("helm"))
    assert sorted(files) == sorted(str(p.relative_to(DEPLOY)) for p in DEPLOY.rglob("*") if p.is_file())
    assert tools.stale(files) == [], "deploy/ lags the chart: run `make deploy`"


def test_check_mode_exits_1_naming_the_lagging_file(tmp_path, monkeypatch, capsys):
    tools = deploy_manifests()
    for p in [*tools.COPIES, tools.MANIFEST]:
        (tmp_path / p).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / p).write_text((DEPLOY / p).read_text())
    monkeypatch.setattr(tools, "DEPLOY", tmp_path)
    assert tools.main(["--helm", tool("helm"), "--check"]) == 0
    (tmp_path / "prometheus" / "gpu-ready.rules.yaml").write_text("groups: []\n")
    assert tools.main(["--helm", tool("helm"), "--check"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(prometheus/gpu-ready.rules.yaml)" in err and "make deploy" in err


def test_the_manifest_is_the_namespace_then_the_release_without_hooks():
    docs = manifest()
    ns = docs[0]
    assert ns["kind"] == "Namespace" and ns["metadata"]["name"] == "gpu-ready"
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert not [d["metadata"]["name"] for d in docs if is_hook(d)]
    kinds = {d["kind"] for d in docs}
    assert {"DaemonSet", "ServiceAccount", "ClusterRole", "ValidatingAdmissionPolicy"} <= kinds
    assert "Job" not in kinds  # the uninstall Job is a post-delete hook: Helm's, left out
    # namespaced objects go to the Namespace above, except the Events Role (Events about a Node live in `default`)
    elsewhere = {
        (d["kind"], d["metadata"]["namespace"])
        for d in docs[1:]
        if d["metadata"].get("namespace") not in (None, "gpu-ready")
    }
    assert elsewhere <= {("Role", "default"), ("RoleBinding", "default")}


@pytest.mark.apiserver
def test_the_manifest_applies_to_a_real_apiserver(control_plane, admin, tmp_path):
    ensure_namespace(admin, "gpu-ready")
    kc = control_plane.kubeconfig(tmp_path / "admin")
    r = kubectl(kc, "apply", "--dry-run=server", "-f", str(MANIFEST))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("(server dry run)") == len(manifest()), r.stdout
