"""What the chart refuses or accepts at install, for the cases a platform engineer meets first: a release named
like a YAML boolean, a namespace whose PodSecurity level cannot run the agent, a recovery plugin namespace that
does not exist (refused by `lookup` on the real apiserver, one line each), `updateStrategy.maxUnavailable` out of
bounds (the schema), and `global.imageRegistry` honoured for every image the chart runs."""

from __future__ import annotations

import re
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.chart import CHART, helm, render
from testkit.cluster import create_runtime_class
from testkit.controlplane import ControlPlane
from testkit.testbin import require_testbin, tool

AUTO = ["--set", "preflight.enabled=true", "--set", "preflight.nodeName=node-1", "--set", "preflight.auto.enabled=true"]


def label_values(docs: list[dict[str, Any]]) -> list[Any]:
    out = []
    for d in docs:
        for meta in (d.get("metadata") or {}, ((d.get("spec") or {}).get("template") or {}).get("metadata") or {}):
            out += list((meta.get("labels") or {}).values())
    return out


@pytest.mark.parametrize("release", ["on", "y", "no", "1"])
def test_a_release_named_like_a_yaml_boolean_or_number_renders_labels_as_strings(release: str) -> None:
    docs = render(AUTO, release=release)
    values = label_values(docs)
    assert values and all(isinstance(v, str) for v in values), [v for v in values if not isinstance(v, str)]
    assert release in values


@pytest.mark.parametrize("value,ok", [("1", True), ("10%", True), ("100%", True), ("0", False), ("150%", False),
                                      ("0%", False), ("-1", False)])  # fmt: skip
def test_max_unavailable_is_bounded_by_the_schema(value: str, ok: bool) -> None:
    flag = "--set" if value.lstrip("-").isdigit() else "--set-string"
    r = helm("template", "t", str(CHART), flag, f"updateStrategy.maxUnavailable={value}", check=False)
    assert (r.returncode == 0) is ok, r.stderr
    if not ok:
        assert "updateStrategy/maxUnavailable" in r.stderr


def images(docs: list[dict[str, Any]]) -> list[str]:
    """Every image of the rendered manifests, the controller's Job template (a YAML string) included."""
    text = yaml.safe_dump_all(docs)
    found = re.findall(r"image: ['\"]?([^'\"\s\\]+)", text)
    for d in docs:
        for v in (d.get("data") or {}).values():
            found += re.findall(r"image: ['\"]?([^'\"\s\\]+)", str(v))
    return found


def test_global_image_registry_is_honoured_for_every_image() -> None:
    every = ["--set", "uninstall.enabled=true", *AUTO]
    plain = images(render(every))
    assert len(plain) >= 5 and all(i.startswith("ghcr.io/gpu-ready/gpu-ready:") for i in plain), plain
    mirrored = images(render([*every, "--set", "global.imageRegistry=mirror.example.com:5000"]))
    assert len(mirrored) == len(plain)
    assert all(i.startswith("mirror.example.com:5000/gpu-ready/gpu-ready:") for i in mirrored), mirrored
    # a repository without a registry host gets the mirror in front
    own = images(render([*every, "--set", "image.repository=team/agent", "--set", "global.imageRegistry=m.example"]))
    assert set(own) == {f"m.example/team/agent:{own[0].rsplit(':', 1)[1]}"}


# -- against the real apiserver: helm install's lookups --------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ControlPlane, Path]]:
    cp = ControlPlane(require_testbin("kube-apiserver", "etcd"))
    try:
        cp.start()
        admin = cp.admin()
        create_runtime_class(admin)
        admin.close()
        kc = cp.kubeconfig(tmp_path_factory.mktemp("kc") / "admin")
        kc.chmod(0o600)
        yield cp, kc
    finally:
        cp.stop()


def helm_on(kc: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("helm"), *args, "--kubeconfig", str(kc)], capture_output=True, text=True, timeout=180)


def one_line(r: subprocess.CompletedProcess[str]) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith("Error: "), r.stdout + r.stderr
    return lines[0]


@pytest.mark.apiserver
def test_a_namespace_enforcing_baseline_is_refused_naming_the_label(cluster: tuple[ControlPlane, Path]) -> None:
    cp, kc = cluster
    admin = cp.admin()
    ns = f"psa-{secrets.token_hex(3)}"
    admin.request("POST", "/api/v1/namespaces",
                  {"metadata": {"name": ns, "labels": {"pod-security.kubernetes.io/enforce": "baseline"}}})  # fmt: skip
    line = one_line(helm_on(kc, "install", ns, str(CHART), "-n", ns))
    assert f"namespace {ns} enforces PodSecurity baseline" in line
    assert f"kubectl label --overwrite namespace {ns} pod-security.kubernetes.io/enforce=privileged" in line
    assert helm_on(kc, "list", "-n", ns, "-q").stdout.strip() == ""
    admin.request("PATCH", f"/api/v1/namespaces/{ns}",
                  {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "privileged"}}},
                  "application/merge-patch+json")  # fmt: skip
    r = helm_on(kc, "install", ns, str(CHART), "-n", ns, "--set", "uninstall.enabled=false")
    assert r.returncode == 0, r.stderr
    admin.close()


@pytest.mark.apiserver
def test_a_missing_plugin_namespace_is_refused_in_one_line(cluster: tuple[ControlPlane, Path]) -> None:
    _, kc = cluster
    ns = f"rec-{secrets.token_hex(3)}"
    line = one_line(helm_on(kc, "install", ns, str(CHART), "-n", ns, "--create-namespace",
                            "--set", "recovery.enabled=true", "--set", "podResources.enabled=true",
                            "--set", "recovery.devicePlugin.namespace=gpu-operator-missing",
                            "--set", "recovery.devicePlugin.daemonSet=nvidia-device-plugin-daemonset"))  # fmt: skip
    assert 'recovery.devicePlugin.namespace "gpu-operator-missing" names no Namespace in this cluster' in line


@pytest.mark.apiserver
def test_a_release_named_on_installs(cluster: tuple[ControlPlane, Path]) -> None:
    _, kc = cluster
    r = helm_on(kc, "install", "on", str(CHART), "-n", f"on-{secrets.token_hex(3)}", "--create-namespace",
                "--set", "uninstall.enabled=false")  # fmt: skip
    assert r.returncode == 0, r.stderr
