"""The chart as clusters and GitOps tools take it: the values examples (charts/gpu-ready/examples/), an umbrella chart
that depends on gpu-ready through file://, and the checks `helm install` makes against the cluster it installs into
(a missing RuntimeClass, the Prometheus Operator's CRDs): linted, rendered, dry-run on the real kube-apiserver and
installed with helm."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent import config
from agent.kube.client import ApiError, KubeApi
from testkit.chart import CHART, apply_release, helm, load_monitoring_crds, render, server_dry_run
from testkit.cluster import bound_token, create_runtime_class, ensure_namespace
from testkit.controlplane import ControlPlane
from testkit.harness import wait_for
from testkit.testbin import require_testbin, tool

EXAMPLES = {p.stem: p for p in sorted((CHART / "examples").glob("*.yaml"))}
EVERY_TAINT = [{"operator": "Exists", "effect": "NoSchedule"}, {"operator": "Exists", "effect": "NoExecute"}]


def example(name: str) -> list[str]:
    return ["-f", str(EXAMPLES[name])]


def agent_config(docs: list[dict[str, Any]], tmp_path: Path) -> config.Config:
    """The agent's settings from the rendered ConfigMap, read as the agent reads them (it refuses a bad one)."""
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and "config.yaml" in d.get("data", {}))
    f = tmp_path / "config.yaml"
    f.write_text(cm["data"]["config.yaml"])
    return config.load(None, environ={"GPU_READY_CONFIG": str(f)})


def pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return dict(next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"])


def test_the_examples_are_the_ones_the_docs_name():
    assert set(EXAMPLES) == {"aks", "eks", "gke", "gpu-operator", "node-readiness-controller", "openshift"}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_lints_strict_and_renders_a_config_the_agent_takes(name, tmp_path):
    r = helm("lint", str(CHART), "--strict", *example(name))
    assert "1 chart(s) linted, 0 chart(s) failed" in r.stdout, r.stdout
    docs = render(example(name))
    agent_config(docs, tmp_path)
    spec = pod_spec(docs)
    assert spec["tolerations"][1:] == EVERY_TAINT  # the default tolerations hold in every example
    assert spec["priorityClassName"] == "system-node-critical"


def test_gke_mounts_the_host_driver_and_needs_no_runtime_class(tmp_path):
    docs = render(example("gke"))
    spec, cfg = pod_spec(docs), agent_config(docs, tmp_path)
    assert "runtimeClassName" not in spec
    term = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term == [{"matchExpressions": [{"key": "cloud.google.com/gke-accelerator", "operator": "Exists"}]}]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["nvidia-install"]["hostPath"]["path"] == "/home/kubernetes/bin/nvidia"
    c = spec["containers"][0]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["nvidia-install"] == {"name": "nvidia-install", "mountPath": "/usr/local/nvidia", "readOnly": True}
    assert cfg.nvidia_smi == "/usr/local/nvidia/bin/nvidia-smi"
    assert {"name": "LD_LIBRARY_PATH", "value": "/usr/local/nvidia/lib64"} in c["env"]
    assert c["securityContext"]["privileged"] is True  # the host's /dev/nvidia* device nodes
    quota = next(d for d in docs if d["kind"] == "ResourceQuota")
    assert quota["spec"]["scopeSelector"]["matchExpressions"][0]["values"] == ["system-node-critical"]


@pytest.mark.parametrize("name", ["eks", "aks"])
def test_default_nvidia_runtime_clouds_need_no_runtime_class(name):
    spec = pod_spec(render(example(name)))
    assert "runtimeClassName" not in spec
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    keys = {e["key"] for t in terms for e in t["matchExpressions"]}
    assert "nvidia.com/gpu.present" in keys and len(terms) >= 2  # GFD's label or the cloud's own


def test_openshift_runs_the_agent_as_spc_t():
    docs = render(example("openshift"))
    spec = pod_spec(docs)
    sc = spec["containers"][0]["securityContext"]
    assert sc["seLinuxOptions"] == {"type": "spc_t"} and sc["privileged"] is True
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYSLOG"]}
    assert spec["runtimeClassName"] == "nvidia"
    assert any(m["name"] == "pod-resources" for m in spec["containers"][0]["volumeMounts"])


def test_gpu_operator_example_adds_the_monitoring_objects():
    docs = render(example("gpu-operator"))
    kinds = {d["kind"] for d in docs}
    assert {"ServiceMonitor", "PrometheusRule"} <= kinds and pod_spec(docs)["runtimeClassName"] == "nvidia"
    dash = next(d for d in docs if d["metadata"]["name"].endswith("-dashboard"))
    assert dash["metadata"]["annotations"] == {"grafana_folder": "GPU"}


def test_node_readiness_preset_feeds_the_controller_and_leaves_the_taint_to_it(tmp_path):
    docs = render(example("node-readiness-controller"))
    cfg = agent_config(docs, tmp_path)
    assert (cfg.condition_type, cfg.taints, cfg.taint_key) == (
        "nvidia.com/GPUReady",
        "off",
        "readiness.k8s.io/gpu-ready",
    )
    # the DaemonSet tolerates the controller's taint with every effect (a continuous rule may use NoExecute)
    assert pod_spec(docs)["tolerations"][0] == {"key": "readiness.k8s.io/gpu-ready", "operator": "Exists"}
    role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "gpu-ready")
    assert "patch" not in role["rules"][0]["verbs"]  # taints off: no patch nodes
    # the agent takes the controller's prefix as a taint key of its own (it refuses other k8s.io names)
    cfg = agent_config(render([*example("node-readiness-controller"), "--set", "taints.enabled=true"]), tmp_path)
    assert (cfg.taints, cfg.taint_key) == ("startup", "readiness.k8s.io/gpu-ready")
    r = helm("template", "x", str(CHART), "--set", "taints.key=node.k8s.io/gpu-ready", check=False)
    assert r.returncode != 0 and "reserved for Kubernetes" in r.stderr


def test_node_readiness_preset_with_the_automatic_flow_runs_preflight_on_new_tainted_nodes(tmp_path):
    from agent.controller.plan import node_view, wants_preflight

    on = [
        "--set",
        "preflight.enabled=true",
        "--set",
        "preflight.auto.enabled=true",
        "--set",
        "config.requirePreflight=true",
    ]
    docs = render([*example("node-readiness-controller"), *on])
    cfg = agent_config(docs, tmp_path)
    assert (cfg.condition_type, cfg.require_preflight, cfg.marks_after_fault) == ("nvidia.com/GPUReady", True, True)
    dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "gpu-ready-controller")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    for want in (
        "--startup-taint=readiness.k8s.io/gpu-ready",
        "--condition-type=nvidia.com/GPUReady",
        "--taint-key=readiness.k8s.io/gpu-ready",
    ):
        assert want in args
    new = {
        "metadata": {"name": "n"},
        "spec": {"taints": [{"key": "readiness.k8s.io/gpu-ready", "effect": "NoSchedule"}]},
    }
    v = node_view(new, cfg.needs_preflight_label, cfg.preflight_label, cfg.taint_key, cfg.condition_type,
                  "readiness.k8s.io/gpu-ready")  # fmt: skip
    assert wants_preflight(v) and v.held == "taint"
    passed = {**new, "metadata": {"name": "n", "labels": {"preflight": "passed"}}}
    assert not wants_preflight(node_view(passed, cfg.needs_preflight_label, "preflight", cfg.taint_key,
                                         cfg.condition_type, "readiness.k8s.io/gpu-ready"))  # fmt: skip


@pytest.fixture(scope="module")
def monitoring(control_plane, tmp_path_factory) -> Path:
    kc = control_plane.kubeconfig(tmp_path_factory.mktemp("kc") / "admin")
    load_monitoring_crds(control_plane, kc)
    return kc


@pytest.mark.apiserver
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_passes_server_side_dry_run(name, admin, monitoring):
    ns = f"ex-{name[:12]}-{secrets.token_hex(3)}"
    ensure_namespace(admin, ns)
    server_dry_run(monitoring, render(example(name), namespace=ns, release=ns))


@pytest.mark.apiserver
def test_node_readiness_preset_policy_lets_the_agent_change_only_that_taint(control_plane, admin, make_node, tmp_path):
    """With taints.enabled on top of the preset the agent's token may add and remove readiness.k8s.io/gpu-ready on
    its own Node and nothing else; with the preset as it is (taints off) not even that."""
    kc = control_plane.kubeconfig(tmp_path / "admin")
    rel = apply_release(
        control_plane, kc, "nrc", [*example("node-readiness-controller"), "--set", "taints.enabled=true"]
    )
    own = {"key": "readiness.k8s.io/gpu-ready", "value": "pending", "effect": "NoSchedule"}
    other = {"key": "readiness.k8s.io/network-ready", "value": "pending", "effect": "NoSchedule"}
    probe, node = make_node(), make_node()

    def client(for_node: str) -> KubeApi:
        tok, _ = bound_token(admin, rel.ns, rel.sa, for_node)
        return KubeApi.from_token(control_plane.host, tok, control_plane.ca_file)

    def refused(api: KubeApi, n: str, taints: list[dict[str, str]]) -> str | None:
        try:
            api.patch_node(n, {"spec": {"taints": taints}})
        except ApiError as e:
            assert e.status == 403, e
            return str(e)
        return None

    agent = client(probe)
    # the policy is loaded asynchronously after it is created: wait until it refuses (on a node of its own; a new
    # value each time, since a write that changes nothing is never refused)
    wait_for(
        lambda: refused(agent, probe, [{**other, "value": secrets.token_hex(3)}]),
        20,
        0.3,
        "the admission policy to refuse another taint",
    )
    agent.close()
    agent = client(node)
    before = admin.get_node(node)["spec"].get("taints", [])  # the apiserver's node.kubernetes.io/not-ready
    try:
        assert refused(agent, node, [*before, own]) is None
        assert admin.get_node(node)["spec"]["taints"] == [*before, own]
        msg = refused(agent, node, [*before, own, other])
        assert msg is not None and "other than taints with key readiness.k8s.io/gpu-ready" in msg
        assert refused(agent, node, []) is not None  # not the apiserver's taint either
        assert refused(agent, node, before) is None
    finally:
        agent.close()
    off = apply_release(control_plane, kc, "nrcoff", example("node-readiness-controller"))
    tok, _ = bound_token(admin, off.ns, off.sa, node)
    agent = KubeApi.from_token(control_plane.host, tok, control_plane.ca_file)
    try:
        assert refused(agent, node, [*before, own]) is not None  # no patch nodes with taints off
    finally:
        agent.close()


# -- an umbrella chart (Argo CD / Flux style) that takes gpu-ready as a dependency --------------------------------

UMBRELLA_VALUES = {
    "global": {"imageRegistry": "registry.example.com", "labels": {"team": "ml-platform"}},
    "gpu-ready": {
        "enabled": True,
        "fullnameOverride": "gpu-health",
        "runtimeClassName": "",
        "config": {"expectedGpus": 8},
        "podLabels": {"team": "ml-platform"},
        "securityContext": {"seLinuxOptions": {"type": "spc_t"}},
    },
}


def helm_env(home: Path) -> dict[str, str]:
    """helm with its cache, config and data in `home` (nothing from the user's own helm setup)."""
    return {
        **os.environ,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }


@pytest.fixture(scope="module")
def umbrella(tmp_path_factory) -> Path:
    """gpu-stack: a chart whose one dependency is gpu-ready from file:// (with an `enabled` condition), and values
    with `global` and overrides for it; `helm dependency update` packs gpu-ready into its charts/."""
    root = tmp_path_factory.mktemp("umbrella")
    d = root / "gpu-stack"
    (d / "templates").mkdir(parents=True)
    chart = {
        "apiVersion": "v2",
        "name": "gpu-stack",
        "version": "0.1.0",
        "dependencies": [
            {
                "name": "gpu-ready",
                "version": ">=0.0.0-0",
                "repository": f"file://{CHART}",
                "condition": "gpu-ready.enabled",
            }
        ],
    }
    (d / "Chart.yaml").write_text(yaml.safe_dump(chart))
    (d / "values.yaml").write_text(yaml.safe_dump(UMBRELLA_VALUES))
    r = subprocess.run(
        [tool("helm"), "dependency", "update", str(d), "--skip-refresh"],
        capture_output=True,
        text=True,
        timeout=120,
        env=helm_env(root / "helm"),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert [p.name for p in (d / "charts").iterdir()] == ["gpu-ready-0.1.0.tgz"]
    return d


def render_umbrella(d: Path, *values: str, namespace: str = "gpu-ready") -> list[dict[str, Any]]:
    out = helm("template", "stack", str(d), "--namespace", namespace, *values).stdout
    return [x for x in yaml.safe_load_all(out) if x]


def test_umbrella_lints_and_renders_with_global_values_and_overrides(umbrella, tmp_path):
    r = helm("lint", str(umbrella), "--strict")
    assert "1 chart(s) linted, 0 chart(s) failed" in r.stdout, r.stdout
    docs = render_umbrella(umbrella)
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    assert ds["metadata"]["name"] == "gpu-health" and "runtimeClassName" not in ds["spec"]["template"]["spec"]
    assert ds["spec"]["template"]["metadata"]["labels"]["team"] == "ml-platform"
    assert ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["seLinuxOptions"] == {"type": "spc_t"}
    assert agent_config(docs, tmp_path).expected_gpus == 8
    assert render_umbrella(umbrella, "--set", "gpu-ready.enabled=false") == []  # the dependency's condition


@pytest.mark.apiserver
def test_umbrella_passes_server_side_dry_run(umbrella, admin, monitoring):
    ns = f"umbrella-{secrets.token_hex(3)}"
    ensure_namespace(admin, ns)
    server_dry_run(
        monitoring, render_umbrella(umbrella, "--set", "gpu-ready.prometheusRule.enabled=true", namespace=ns)
    )


# -- helm install against a cluster: what the chart checks there -----------------------------------------------


@pytest.fixture(scope="module")
def bare_cluster(tmp_path_factory) -> Iterator[tuple[ControlPlane, Path]]:
    """A kube-apiserver of this module's own, as a new cluster has it: no RuntimeClass, no CRDs (the session's
    control plane gets the Prometheus Operator's CRDs from other tests)."""
    cp = ControlPlane(require_testbin("kube-apiserver", "etcd"))
    try:
        cp.start()
        kc = cp.kubeconfig(tmp_path_factory.mktemp("bare") / "admin")
        kc.chmod(0o600)  # helm warns on stderr about a group- or world-readable kubeconfig
        yield cp, kc
    finally:
        cp.stop()


def error_line(r: subprocess.CompletedProcess[str]) -> str:
    """helm's one line on stderr for a failed command (nothing else on stderr)."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith("Error: "), r.stdout + r.stderr
    return lines[0]


@pytest.mark.apiserver
def test_helm_install_checks_the_runtime_class_and_the_crds(bare_cluster, umbrella, tmp_path):
    cp, kc = bare_cluster
    env = helm_env(tmp_path / "helm")

    def helm_on(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [tool("helm"), *args, "--kubeconfig", str(kc)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)

    admin = cp.admin()
    try:
        # 1. no RuntimeClass nvidia: helm install fails with one line that says what to do; nothing is installed
        line = error_line(helm_on("install", "gpu-ready", str(CHART), "-n", "gpu-ready", "--create-namespace"))
        assert 'runtimeClassName "nvidia" names no RuntimeClass in this cluster' in line, line
        for hint in (
            "NVIDIA GPU Operator",
            'runtimeClassName: ""',
            "/home/kubernetes/bin/nvidia",
            "/run/nvidia/driver",
        ):
            assert hint in line, hint
        assert helm_on("list", "-A", "-q").stdout.strip() == ""
        assert admin.request("GET", "/apis/apps/v1/daemonsets")["items"] == []
        # ... as an umbrella's dependency too; helm template cannot see the cluster and renders
        line = error_line(
            helm_on("install", "stack", str(umbrella), "-n", "gpu-ready", "--set", "gpu-ready.runtimeClassName=nvidia")
        )
        assert "gpu-ready/templates/validate.yaml" in line and 'runtimeClassName "nvidia" names no RuntimeClass' in line
        assert helm("template", "gpu-ready", str(CHART)).returncode == 0

        create_runtime_class(admin)
        # 2. ServiceMonitor / PrometheusRule without the Prometheus Operator's CRDs: one line each
        for value, kind in (("serviceMonitor", "ServiceMonitor"), ("prometheusRule", "PrometheusRule")):
            r = helm_on(
                "install",
                "gpu-ready",
                str(CHART),
                "-n",
                "gpu-ready",
                "--create-namespace",
                "--set",
                f"{value}.enabled=true",
            )
            line = error_line(r)
            assert f"{value}.enabled=true, but this cluster serves no monitoring.coreos.com/v1 {kind}" in line, line
            assert f"{value}.enabled=false" in line
            assert helm("template", "gpu-ready", str(CHART), "--set", f"{value}.enabled=true").returncode == 0

        # 3. with both in place helm install goes through, and its notes say how to watch the pods come up
        load_monitoring_crds(cp, kc)
        r = helm_on(
            "install", "gpu-ready", str(CHART), "-n", "gpu-ready", "--create-namespace",
            "--set", "serviceMonitor.enabled=true", "--set", "prometheusRule.enabled=true",
        )  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
        assert "kubectl -n gpu-ready rollout status daemonset/gpu-ready" in r.stdout, r.stdout
        labels = "app.kubernetes.io/name=gpu-ready,app.kubernetes.io/instance=gpu-ready"
        assert f"kubectl -n gpu-ready get pods -o wide -l {labels}" in r.stdout
        ds = admin.request("GET", "/apis/apps/v1/namespaces/gpu-ready/daemonsets/gpu-ready")
        assert ds["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"
        r = helm_on("install", "stack", str(umbrella), "-n", "stack", "--create-namespace")
        assert r.returncode == 0, r.stdout + r.stderr  # the umbrella's runtimeClassName "" needs no RuntimeClass
    finally:
        admin.close()
