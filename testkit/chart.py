"""The Helm chart (charts/gpu-ready) as the tests use it: helm on it, its manifests rendered with a set of values,
and a release's ServiceAccounts, RBAC and admission policies applied to a test apiserver with kubectl."""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from testkit.cluster import ensure_namespace
from testkit.controlplane import REPO, ControlPlane, k8s_version
from testkit.testbin import tool

CHART = REPO / "charts" / "gpu-ready"
KUBE_VERSION = k8s_version()
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or "kubectl"
# What apply_release applies of a rendered release: who the agent and preflight are and what they may do.
POLICY_KINDS = {
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([tool("helm"), *args], capture_output=True, text=True, timeout=120)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def render(values: list[str], namespace: str = "gpu-ready", release: str = "gpu-ready") -> list[dict[str, Any]]:
    out = helm(
        "template", release, str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSION, *values
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def kubectl(kc: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KUBECTL, "--kubeconfig", str(kc), *args], capture_output=True, text=True, input=stdin, timeout=120
    )


def load_monitoring_crds(cp: ControlPlane, kc: Path) -> None:
    """The Prometheus Operator's ServiceMonitor and PrometheusRule CRDs (from the testbin) applied to `cp` and
    Established (server-side apply: applying them again changes nothing)."""
    crds = cp.bin_dir / "crds"
    for name in ("servicemonitors", "prometheusrules"):
        r = kubectl(kc, "apply", "--server-side", "-f", str(crds / f"monitoring.coreos.com_{name}.yaml"))
        assert r.returncode == 0, r.stderr
        r = kubectl(kc, "wait", "--for=condition=Established", "--timeout=60s", f"crd/{name}.monitoring.coreos.com")
        assert r.returncode == 0, r.stderr


def server_dry_run(kc: Path, docs: list[dict[str, Any]]) -> None:
    """`kubectl apply --dry-run=server` of the rendered objects: the apiserver validates and admits each one."""
    r = kubectl(kc, "apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump_all(docs))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("(server dry run)") == len(docs), r.stdout


def serves(api: Any, group_version: str, resource: str) -> bool:
    """Whether the apiserver serves `resource` in `group_version`: an older minor (`make test-oldest`) lacks DRA's
    resource.k8s.io/v1 (1.34) and DeviceTaintRules (1.36, 1.37); the tests of those skip there, saying so."""
    from agent.kube.client import ApiError

    try:
        found = api.request("GET", f"/apis/{group_version}").get("resources") or []
    except ApiError:
        return False
    return any(r.get("name") == resource for r in found)


def is_hook(doc: dict[str, Any]) -> bool:
    """A Helm hook (the uninstall Job and its token): made by helm at a release event, not part of the release."""
    return "helm.sh/hook" in ((doc.get("metadata") or {}).get("annotations") or {})


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@dataclass
class Release:
    ns: str
    values: list[str]
    docs: list[dict[str, Any]]

    @property
    def fullname(self) -> str:
        return f"{self.ns}-gpu-ready"

    @property
    def sa(self) -> str:
        """The agent's ServiceAccount (named as the release, else the first the chart renders that is not the
        preflight Job's or the controller's)."""
        names = [str(d["metadata"]["name"]) for d in self.docs if d["kind"] == "ServiceAccount"]
        if self.fullname in names:
            return self.fullname
        return next(n for n in names if not n.endswith(("-preflight", "-controller")))


def apply_release(cp: ControlPlane, kc: Path, name: str, values: list[str]) -> Release:
    """The chart's ServiceAccount, RBAC and admission policies, rendered with `values` in a namespace of their
    own, applied with kubectl."""
    ns = f"{name}-{secrets.token_hex(3)}"
    docs = render(values, namespace=ns, release=ns)
    mine = [d for d in docs if d["kind"] in POLICY_KINDS]
    admin = cp.admin()
    try:
        ensure_namespace(admin, ns)
    finally:
        admin.close()
    r = subprocess.run(
        [KUBECTL, "--kubeconfig", str(kc), "apply", "-f", "-"],
        input=yaml.safe_dump_all(mine),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return Release(ns, values, docs)
