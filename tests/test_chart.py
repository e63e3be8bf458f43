"""The Helm chart: lint, template, offline strict validation, server-side dry-run on the real
apiserver, and the chart's RBAC + admission policy proven with tokens minted for its ServiceAccount."""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agent.kube.client import ApiError
from testkit.chart import CHART, KUBE_VERSION, KUBECTL, helm, load_monitoring_crds, render
from testkit.cluster import ensure_namespace, now_rfc3339
from testkit.controlplane import ControlPlane
from testkit.harness import wait_for

ROOT = Path(__file__).resolve().parents[1]

VALUE_SETS = {
    "defaults": [],
    "monitoring": [
        "--set",
        "serviceMonitor.enabled=true",
        "--set",
        "prometheusRule.enabled=true",
        "--set",
        "dashboard.enabled=true",
    ],
    "custom": [
        "--set",
        "nodeRestriction.enabled=false",
        "--set",
        "serviceAccount.create=false",
        "--set",
        "serviceAccount.name=existing",
        "--set",
        "runtimeClassName=",
        "--set",
        "agent.privileged=true",
        "--set",
        "config.expectedGpus=8",
        "--set",
        "config.xidIgnore={109}",
        "--set-json",
        "affinity={}",
        "--set-json",
        'nodeSelector={"pool":"h100"}',
        "--set",
        "updateStrategy.maxUnavailable=1",
        "--set",
        "metrics.port=9555",
        "--set",
        "priorityClassName=",
    ],
    "taints": [
        "--set",
        "taints.enabled=true",
        "--set",
        "conditionType=nvidia.com/GPUReady",
        "--set",
        "events.namespace=kube-system",
    ],
    "fencing": [
        "--set",
        "fencing.enabled=true",
        "--set",
        "fencing.effect=NoExecute",
        "--set",
        "fencing.allowNoExecute=true",
    ],
    "preflight": [
        "--set",
        "preflight.enabled=true",
        "--set",
        "preflight.nodeName=gpu-node-7",
        "--set-json",
        'preflight.profile={"gpuCount":8,"gpuModel":"H100"}',
    ],
}


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_helm_lint(name):
    r = helm("lint", str(CHART), "--strict", *VALUE_SETS[name])
    assert "1 chart(s) linted, 0 chart(s) failed" in r.stdout


def test_schema_rejects_bad_values():
    r = helm("lint", str(CHART), "--set", "config.nvml=maybe", check=False)
    assert r.returncode != 0 and "/config/nvml" in r.stdout + r.stderr
    r = helm(
        "template", "x", str(CHART), "--kube-version", KUBE_VERSION, "--set", "config.pollIntervall=3", check=False
    )
    assert r.returncode != 0 and "pollIntervall" in r.stderr


def test_default_manifest_shape():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in render([])}
    ds = docs[("DaemonSet", "gpu-ready")]
    spec = ds["spec"]["template"]["spec"]
    c = spec["containers"][0]
    sc = c["securityContext"]
    default_privileged = yaml.safe_load((CHART / "values.yaml").read_text())["agent"]["privileged"]
    assert sc["readOnlyRootFilesystem"] is True and sc["privileged"] is default_privileged
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYSLOG"]}
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == "10%"
    # every NoSchedule and NoExecute taint (a node agent must run where another controller tainted the node), after
    # gpu-ready's own key with every effect
    assert spec["tolerations"] == [
        {"key": "gpu-ready.io/gpu-not-ready", "operator": "Exists"},
        {"operator": "Exists", "effect": "NoSchedule"},
        {"operator": "Exists", "effect": "NoExecute"},
    ]
    term = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchExpressions"][0] == {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility"
    assert spec["runtimeClassName"] == "nvidia" and spec["priorityClassName"] == "system-node-critical"
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["kmsg"]["hostPath"] == {"path": "/dev/kmsg", "type": "CharDevice"}
    assert vols["state"]["hostPath"]["type"] == "DirectoryOrCreate"
    assert vols["boot-id"]["hostPath"]["path"] == "/proc/sys/kernel/random/boot_id"
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["sys"]["readOnly"] and mounts["kmsg"]["readOnly"]
    assert "resources" in c and c["resources"]["limits"]["memory"]
    rules = docs[("ClusterRole", "gpu-ready")]["rules"]
    assert rules == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "watch"]},  # watch: the own-Node cache
        {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]},
    ]
    # config.nodeWatch=false (GET resourceVersion=0 each poll instead) drops watch; taints add patch
    # (the schema check is skipped here so this holds whether or not values.schema.json names nodeWatch yet)
    for values, verbs in (
        (["--set", "config.nodeWatch=false"], ["get"]),
        (["--set", "config.nodeWatch=false", "--set", "taints.enabled=true"], ["get", "patch"]),
        (["--set", "taints.enabled=true"], ["get", "watch", "patch"]),
    ):
        other = {(d["kind"], d["metadata"]["name"]): d for d in render(["--skip-schema-validation", *values])}
        assert other[("ClusterRole", "gpu-ready")]["rules"][0]["verbs"] == verbs, values
    events = docs[("Role", "gpu-ready-events")]
    assert events["metadata"]["namespace"] == "default"  # Events about a Node: default or kube-system only
    assert events["rules"] == [{"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]}]
    assert env["GPU_READY_EVENT_NAMESPACE"]["value"] == "default"
    for policy in ("own-node-only", "own-events-only"):
        assert ("ValidatingAdmissionPolicy", f"gpu-ready-{policy}") in docs
        assert ("ValidatingAdmissionPolicyBinding", f"gpu-ready-{policy}") in docs


def test_configmap_is_a_valid_agent_config(tmp_path):
    from agent import config

    cm = next(
        d
        for d in render(["--set", "config.expectedGpus=8", "--set", "config.xidIgnore={109,63}"])
        if d["kind"] == "ConfigMap"
    )
    f = tmp_path / "config.yaml"
    f.write_text(cm["data"]["config.yaml"])
    cfg = config.load(None, environ={"GPU_READY_CONFIG": str(f)})
    assert (cfg.expected_gpus, list(cfg.xid_ignore), cfg.poll_interval) == (8, [109, 63], 30.0)


def agent_pod(values: list[str], tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """The DaemonSet container's args and its environment (the literal values, NODE_NAME as the downward API gives
    it), with the ConfigMap written where GPU_READY_CONFIG names it (under tmp_path)."""
    docs = {(d["kind"], d["metadata"]["name"]): d for d in render(values)}
    c = docs[("DaemonSet", "gpu-ready")]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "config")
    path = env["GPU_READY_CONFIG"]
    assert path.startswith(mount + "/")
    f = tmp_path / path.lstrip("/")
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(docs[("ConfigMap", "gpu-ready")]["data"][path.rpartition("/")[2]])
    return c["args"], {**env, "GPU_READY_CONFIG": str(f), "NODE_NAME": "gpu-node-1"}


def test_check_in_the_agent_pod_reads_the_agents_settings(tmp_path):
    """`kubectl exec <agent pod> -- gpu-ready check` (no flags) judges with the settings `run` uses: the file and
    the host's sysfs come from the environment, not from flags only `run` gets."""
    from agent import config
    from agent.cli import build_parser

    values = ["--set", "config.expectedGpus=8", "--set", "config.xidIgnore={109}", "--set", "config.pcie=false"]
    args, env = agent_pod(values, tmp_path)
    assert args[0] == "run" and not any(a.startswith(("--config", "--sysfs-root")) for a in args), args
    parser = build_parser(with_preflight=False)
    run = config.load(parser.parse_args(args), environ=env)
    check = config.load(parser.parse_args(["check"]), environ=env)
    assert (check.expected_gpus, check.xid_ignore, check.pcie, check.sysfs_root) == (8, (109,), False, "/host/sys")
    for s in config.flags_of("check"):
        if s.name not in ("log_format", "log_level"):  # how it logs, not what it decides
            assert getattr(check, s.name) == getattr(run, s.name), s.name
    assert run.node_name == check.node_name == "gpu-node-1"
    # a sysfsRoot of the user's own is the file's, for both
    args, env = agent_pod(["--set", "config.sysfsRoot=/run/host-sys"], tmp_path)
    assert "GPU_READY_SYSFS_ROOT" not in env
    assert config.load(parser.parse_args(["check"]), environ=env).sysfs_root == "/run/host-sys"


def test_configmap_passes_the_fencing_values_to_the_agent(tmp_path):
    """The `fencing` values reach the agent's settings (docs/fencing.md); defaults: counting on, fencing off."""
    from agent import config

    def cfg_of(values: list[str]) -> config.Config:
        cm = next(d for d in render(values) if d["kind"] == "ConfigMap")
        f = tmp_path / "config.yaml"
        f.write_text(cm["data"]["config.yaml"])
        return config.load(None, environ={"GPU_READY_CONFIG": str(f)})

    d = cfg_of([])
    assert (d.fencing, d.fencing_effect, d.dra_counting, d.dra_driver) == (False, "None", True, "gpu.nvidia.com")
    extra = [
        "--set",
        "fencing.maxRules=64",
        "--set",
        "fencing.resyncSeconds=60",
        "--set",
        "fencing.driver=gpu.example.com",
    ]
    c = cfg_of([*VALUE_SETS["fencing"], *extra, "--set", "fencing.countFromResourceSlices=false"])
    assert (c.fencing, c.fencing_effect, c.fencing_max_rules, c.fencing_resync) == (True, "NoExecute", 64, 60.0)
    assert (c.dra_driver, c.dra_counting) == ("gpu.example.com", False)
    r = helm(
        "template", "x", str(CHART), "--kube-version", KUBE_VERSION, "--set", "fencing.effect=NoExecute", check=False
    )
    assert r.returncode != 0 and "allowNoExecute" in r.stderr


def test_chart_rules_and_dashboard_are_the_shipped_files():
    assert (CHART / "files" / "gpu-ready.rules.yaml").read_bytes() == (
        ROOT / "deploy" / "prometheus" / "gpu-ready.rules.yaml"
    ).read_bytes()
    assert (CHART / "files" / "gpu-ready-dashboard.json").read_bytes() == (
        ROOT / "deploy" / "grafana" / "gpu-ready-dashboard.json"
    ).read_bytes()
    docs = render(VALUE_SETS["monitoring"])
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((ROOT / "deploy" / "prometheus" / "gpu-ready.rules.yaml").read_text())
    dash = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard"))
    assert json.loads(dash["data"]["gpu-ready.json"])["uid"] == "gpu-ready"


def test_name_overrides_name_every_object_and_the_policies_follow():
    docs = render(["--set", "fullnameOverride=gpu-health", "--set", "preflight.enabled=true"])
    assert all(d["metadata"]["name"].startswith("gpu-health") for d in docs), [d["metadata"]["name"] for d in docs]
    vap = next(d for d in docs if d["metadata"]["name"] == "gpu-health-own-node-only" and d["kind"].endswith("Policy"))
    assert "system:serviceaccount:gpu-ready:gpu-health" in vap["spec"]["matchConditions"][0]["expression"]
    ds = next(d for d in render(["--set", "nameOverride=gpu-health"]) if d["kind"] == "DaemonSet")
    assert ds["metadata"]["name"] == "gpu-ready-gpu-health"
    assert ds["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "gpu-health"
    r = helm("lint", str(CHART), "--set", "fullnameOverride=Not_A_Name", check=False)
    assert r.returncode != 0 and "fullnameOverride" in r.stdout + r.stderr


def test_security_contexts_merge_over_the_charts_own():
    def spec(*values: str) -> dict:
        return next(d for d in render(list(values)) if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]

    s = spec(
        *("--set", "securityContext.seLinuxOptions.type=spc_t", "--set", "podSecurityContext.seLinuxOptions.level=s0"),
        *("--set-json", 'securityContext.capabilities={"add":["SYSLOG","SYS_ADMIN"]}'),
    )
    sc = s["containers"][0]["securityContext"]
    assert sc["seLinuxOptions"] == {"type": "spc_t"} and sc["privileged"] is True and sc["readOnlyRootFilesystem"]
    assert sc["capabilities"] == {"add": ["SYSLOG", "SYS_ADMIN"], "drop": ["ALL"]}  # a list is replaced whole
    assert s["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}, "seLinuxOptions": {"level": "s0"}}
    sc = spec("--set", "agent.privileged=false", "--set", "securityContext.readOnlyRootFilesystem=false")
    sc = sc["containers"][0]["securityContext"]
    assert (sc["privileged"], sc["allowPrivilegeEscalation"], sc["readOnlyRootFilesystem"]) == (False, False, False)
    r = helm("lint", str(CHART), "--set", "securityContext.selinuxOptions.type=spc_t", check=False)
    assert r.returncode != 0 and "selinuxOptions" in r.stdout + r.stderr  # a typo is an error, not ignored


def test_prometheus_rule_leaves_out_disabled_alerts_and_adds_rules():
    shipped = yaml.safe_load((CHART / "files" / "gpu-ready.rules.yaml").read_text())["groups"]
    names = [r["alert"] for r in shipped[0]["rules"]]
    extra = {"alert": "GPUNodeCordoned", "expr": "max by (node) (kube_node_spec_unschedulable) == 1", "for": "1h"}
    docs = render(
        [
            *("--set", "prometheusRule.enabled=true", "--set", "prometheusRule.disabled={GPUDegraded,NvidiaSmiHung}"),
            *("--set-json", f"prometheusRule.additionalRules=[{json.dumps(extra)}]"),
        ]
    )
    groups = next(d for d in docs if d["kind"] == "PrometheusRule")["spec"]["groups"]
    assert [r["alert"] for r in groups[0]["rules"]] == [n for n in names if n not in ("GPUDegraded", "NvidiaSmiHung")]
    assert groups[0]["rules"][0] == shipped[0]["rules"][0]  # the rules kept are the shipped ones
    assert groups[-1] == {"name": "gpu-ready-additional", "rules": [extra]}
    r = helm(
        "template", "x", str(CHART), "--kube-version", KUBE_VERSION, "--set", "prometheusRule.enabled=true",
        "--set", "prometheusRule.disabled={GPUDegradd}", check=False,
    )  # fmt: skip
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("Error:")]
    assert r.returncode != 0 and len(err) == 1 and "GPUDegradd" in err[0] and "GPUDegraded" in err[0], r.stderr


def test_dashboard_namespace_and_grafana_folder():
    def dash(*values: str) -> dict:
        docs = render(["--set", "dashboard.enabled=true", *values])
        return next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard"))

    d = dash()
    assert d["metadata"]["namespace"] == "gpu-ready" and "annotations" not in d["metadata"]
    d = dash("--set", "dashboard.namespace=monitoring", "--set", "dashboard.folder=GPU Fleet")
    assert d["metadata"]["namespace"] == "monitoring"
    assert d["metadata"]["annotations"] == {"grafana_folder": "GPU Fleet"}
    assert d["metadata"]["labels"]["grafana_dashboard"] == "1"
    d = dash("--set", "dashboard.folder=GPU", "--set", "dashboard.folderAnnotation=k8s-sidecar-target-directory")
    assert d["metadata"]["annotations"] == {"k8s-sidecar-target-directory": "GPU"}


def test_priority_class_quota_admits_the_agents_class():
    docs = render(["--set", "priorityClassQuota.enabled=true", "--set", "priorityClassQuota.pods=64"])
    q = next(d for d in docs if d["kind"] == "ResourceQuota")
    assert q["spec"] == {
        "hard": {"pods": "64"},
        "scopeSelector": {
            "matchExpressions": [{"scopeName": "PriorityClass", "operator": "In", "values": ["system-node-critical"]}]
        },
    }
    docs = render(["--set", "priorityClassQuota.enabled=true", "--set", "priorityClassName="])
    assert not [d for d in docs if d["kind"] == "ResourceQuota"]  # no class, nothing to admit


def test_kube_version_is_what_the_admission_policies_need():
    """The policies find the token's Node in the node-name claim, which Kubernetes guarantees from 1.32."""
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"] == ">=1.32.0-0"
    r = helm("template", "x", str(CHART), "--kube-version", "1.31.9", check=False)
    assert r.returncode != 0 and "kubeVersion" in r.stderr
    helm("template", "x", str(CHART), "--kube-version", "1.32.0")


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_offline_strict_schema_validation(name, tmp_path):
    docs = [d for d in render(VALUE_SETS[name]) if not d["apiVersion"].startswith("monitoring.coreos.com")]
    f = tmp_path / "m.yaml"
    f.write_text(yaml.safe_dump_all(docs))
    validate = Path(sys.executable).parent / "kubernetes-validate"
    r = subprocess.run(
        [str(validate), "-k", KUBE_VERSION.rsplit(".", 1)[0] + ".0", "--strict", str(f)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("passed") == len(docs)


def kubectl(cp: ControlPlane, kc: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KUBECTL, "--kubeconfig", str(kc), *args], capture_output=True, text=True, input=stdin, timeout=120
    )


@pytest.fixture(scope="module")
def crds_loaded(control_plane, tmp_path_factory):
    kc = control_plane.kubeconfig(tmp_path_factory.mktemp("kc") / "admin")
    load_monitoring_crds(control_plane, kc)
    return kc


@pytest.mark.apiserver
@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_server_side_dry_run(name, control_plane, admin, crds_loaded):
    ns = f"gr-{name}-{secrets.token_hex(3)}"
    ensure_namespace(admin, ns)
    manifest = yaml.safe_dump_all(render(VALUE_SETS[name], namespace=ns))
    r = kubectl(control_plane, crds_loaded, "apply", "--dry-run=server", "-f", "-", stdin=manifest)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("(server dry run)") == manifest.count("\nkind: ") + manifest.startswith("kind: ")


@pytest.mark.apiserver
def test_chart_rbac_and_own_node_admission_policy(control_plane, admin, make_node, crds_loaded):
    ns = f"gr-rbac-{secrets.token_hex(3)}"
    ensure_namespace(admin, ns)
    r = kubectl(
        control_plane, crds_loaded, "apply", "-f", "-", stdin=yaml.safe_dump_all(render([], namespace=ns, release=ns))
    )
    assert r.returncode == 0, r.stderr
    sa = f"{ns}-gpu-ready"  # the chart's fullname: <release>-gpu-ready
    node_a = make_node(labels={"nvidia.com/gpu.present": "true"}, capacity={"nvidia.com/gpu": "8"})
    node_b = make_node(labels={"nvidia.com/gpu.present": "true"}, capacity={"nvidia.com/gpu": "8"})
    pod = admin.request(
        "POST",
        f"/api/v1/namespaces/{ns}/pods",
        {
            "metadata": {"name": "agent-a"},
            "spec": {"nodeName": node_a, "serviceAccountName": sa, "containers": [{"name": "a", "image": "x"}]},
        },
    )
    tr = admin.request(
        "POST",
        f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token",
        {
            "spec": {
                "audiences": ["https://kubernetes.default.svc"],
                "expirationSeconds": 3600,
                "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": "agent-a", "uid": pod["metadata"]["uid"]},
            }
        },
    )
    from agent.kube.client import KubeApi

    agent = KubeApi.from_token(control_plane.host, tr["status"]["token"], control_plane.ca_file)
    review = admin.request(
        "POST", "/apis/authentication.k8s.io/v1/tokenreviews", {"spec": {"token": tr["status"]["token"]}}
    )
    assert review["status"]["user"]["extra"]["authentication.kubernetes.io/node-name"] == [node_a]

    cond = {
        "status": {
            "conditions": [
                {
                    "type": "GPUReady",
                    "status": "True",
                    "reason": "GPUsHealthy",
                    "message": "ok",
                    "lastHeartbeatTime": now_rfc3339(),
                    "lastTransitionTime": now_rfc3339(),
                }
            ]
        }
    }
    can, cannot = [], []

    def attempt(what, fn):
        try:
            fn()
            can.append(what)
        except ApiError as e:
            assert e.status == 403, (what, e)
            cannot.append((what, str(e)))

    # The admission policy is loaded asynchronously after it is created: wait until it denies.
    def denied() -> bool:
        try:
            agent.patch_node_status(node_b, cond)
        except ApiError as e:
            assert e.status == 403
            assert "may only change the Node it runs on" in str(e)
            return True
        return False

    wait_for(denied, 20, 0.3, "the admission policy to deny the other node's status")
    attempt("get node A", lambda: agent.get_node(node_a))
    attempt("watch node A", lambda: agent.watch_nodes(f"metadata.name={node_a}", "0", 1).close())
    attempt("patch node A status", lambda: agent.patch_node_status(node_a, cond))
    attempt(
        "create event",
        lambda: agent.create_event(
            "default",
            {
                "metadata": {"name": f"{node_a}.{secrets.token_hex(4)}"},
                "eventTime": "2026-11-30T00:00:00.000000Z",
                "reportingController": "gpu-ready",
                "reportingInstance": f"gpu-ready-{node_a}",
                "action": "Test",
                "reason": "Test",
                "regarding": {"kind": "Node", "name": node_a},
                "type": "Normal",
                "note": "rbac test",
            },
        ),
    )
    attempt("patch node B status", lambda: agent.patch_node_status(node_b, cond))
    attempt("patch node A object", lambda: agent.patch_node(node_a, {"metadata": {"labels": {"x": "y"}}}))
    attempt("list secrets", lambda: agent.request("GET", "/api/v1/secrets"))
    attempt("read secrets in its namespace", lambda: agent.request("GET", f"/api/v1/namespaces/{ns}/secrets"))
    attempt("list pods", lambda: agent.request("GET", "/api/v1/pods"))
    attempt("read its own pod", lambda: agent.request("GET", f"/api/v1/namespaces/{ns}/pods/agent-a"))
    attempt("list nodes", lambda: agent.request("GET", "/api/v1/nodes"))
    attempt("delete node B", lambda: agent.request("DELETE", f"/api/v1/nodes/{node_b}"))
    print(f"\n[rbac] can: {can}\n[rbac] cannot: {[w for w, _ in cannot]}")
    assert can == ["get node A", "watch node A", "patch node A status", "create event"]
    by = dict(cannot)
    assert "may only change the Node it runs on" in by["patch node B status"]
    assert set(by) == {
        "patch node B status",
        "patch node A object",
        "list secrets",
        "read secrets in its namespace",
        "list pods",
        "read its own pod",
        "list nodes",
        "delete node B",
    }
    agent.close()


def test_dockerfile_is_clean_under_hadolint():
    hadolint = Path(sys.executable).parent / "hadolint"
    r = subprocess.run([str(hadolint), str(ROOT / "docker" / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def test_dockerfile_install_steps_in_a_fresh_venv(tmp_path):
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "RUN sh docker/install.sh /opt/gpu-ready /src" in dockerfile
    assert 'ENTRYPOINT ["gpu-ready"]' in dockerfile and 'CMD ["run"]' in dockerfile
    src = tmp_path / "src"
    src.mkdir()
    for item in ("pyproject.toml", "README.md", "LICENSE", "requirements/runtime.lock", "agent", "docker/install.sh"):
        dst = src / item
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if (ROOT / item).is_dir() else shutil.copy)(ROOT / item, dst)
    r = subprocess.run(
        ["sh", str(src / "docker" / "install.sh"), str(tmp_path / "opt"), str(src)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().startswith("gpu-ready ")
    r = subprocess.run([str(tmp_path / "opt" / "bin" / "gpu-ready"), "run", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--node NODE" in r.stdout
    # the deprecated `pynvml` wrapper must not come in: it warns on every import
    r = subprocess.run([str(tmp_path / "opt" / "bin" / "python"), "-W", "error", "-c", "import pynvml"])
    assert r.returncode == 0
    # no packaging tools left in the runtime environment
    facts = ROOT / "tools" / "release" / "image_facts.py"
    r = subprocess.run(
        [str(tmp_path / "opt" / "bin" / "python"), str(facts), "--prefix"], capture_output=True, text=True
    )
    assert r.returncode == 0 and '"packaging_tools": []' in r.stdout, r.stdout + r.stderr
