"""`helm uninstall` leaves no trace of gpu-ready on the Nodes: the chart's post-delete hook Job runs `gpu-ready
uninstall` with a token of its own, under an admission policy of its own (docs/deployment.md#uninstall).

The end-to-end case installs the chart with the real helm on a real kube-apiserver with the real Job and garbage
collector controllers, runs `helm uninstall`, and plays kubelet for the hook's pod only: it runs the pod's own
command line, here, with a token bound to that pod, then reports the pod Succeeded; the Job controller completes
the Job and helm finishes. The bounds case tries, with that token, every change the policy must refuse."""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.act.uninstall import UninstallSettings, node_change
from agent.kube.client import ApiError, KubeApi
from testkit.chart import CHART, Release, apply_release
from testkit.cluster import bound_token, create_node, ensure_namespace, now_rfc3339
from testkit.controller import finish_pod, jobs_control_plane
from testkit.controlplane import ControlPlane
from testkit.harness import wait_for
from testkit.testbin import tool

TAINT = "gpu-ready.io/gpu-not-ready"
NEEDS = "gpu-ready.io/needs-preflight"
CORDONED_BY = "gpu-ready.io/preflight-cordoned"
OURS_ANNOTATIONS = (
    CORDONED_BY,
    "gpu-ready.io/preflight-time",
    "gpu-ready.io/preflight-report",
    "gpu-ready.io/clear-before",
)
FOREIGN_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def node_with_history(name: str, cordoned_by_preflight: bool = False) -> dict[str, Any]:
    """A Node as gpu-ready leaves it: its condition, taint, preflight labels and annotations, beside kubelet's
    condition, another taint, label and annotation that are not gpu-ready's."""
    ann = {"gpu-ready.io/preflight-time": "2026-01-01T00:00:00Z", "gpu-ready.io/preflight-report": "{}",
           "gpu-ready.io/clear-before": "2026-01-01T00:00:00Z", "team.example.com/owner": "ml"}  # fmt: skip
    if cordoned_by_preflight:
        ann[CORDONED_BY] = "true"
    return {
        "metadata": {
            "name": name,
            "resourceVersion": "7",
            "labels": {"preflight": "passed", NEEDS: "true", "nvidia.com/gpu.present": "true"},
            "annotations": ann,
        },
        "spec": {
            "taints": [FOREIGN_TAINT, {"key": TAINT, "effect": "NoSchedule"}],
            "unschedulable": cordoned_by_preflight,
        },
        "status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "GPUReady", "status": "False"}]},
    }


def test_node_change_removes_only_gpu_readys_names() -> None:
    c = node_change(node_with_history("n1", cordoned_by_preflight=True), UninstallSettings("ns"))
    assert c.condition is True
    meta = c.patch["metadata"]
    assert meta["resourceVersion"] == "7"
    assert meta["labels"] == {"preflight": None, NEEDS: None}
    assert set(meta["annotations"]) == set(OURS_ANNOTATIONS) and set(meta["annotations"].values()) == {None}
    assert c.patch["spec"] == {"taints": [FOREIGN_TAINT], "unschedulable": None}
    assert len(c.removed) == 9


def test_keep_history_keeps_preflights_record_and_removes_what_steers_the_scheduler() -> None:
    c = node_change(node_with_history("n1", cordoned_by_preflight=True), UninstallSettings("ns", keep_history=True))
    assert "labels" not in c.patch["metadata"]
    assert c.patch["metadata"]["annotations"] == {CORDONED_BY: None}
    assert c.patch["spec"] == {"taints": [FOREIGN_TAINT], "unschedulable": None} and c.condition


def test_a_node_without_gpu_ready_needs_nothing() -> None:
    c = node_change({"metadata": {"name": "cpu-1", "labels": {"a": "b"}}, "spec": {"unschedulable": True}},
                    UninstallSettings("ns"))  # fmt: skip
    assert c.patch == {} and not c.condition and c.removed == []


# -- on the real apiserver ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jobs_plane() -> Iterator[ControlPlane]:
    with jobs_control_plane(("job-controller", "garbage-collector-controller")) as cp:
        yield cp


def seed_node(admin: KubeApi, name: str, cordoned_by_preflight: bool = False, cordoned: bool = False) -> None:
    """A Node with what gpu-ready writes, written as admin (the agent, preflight and the operator's clear)."""
    n = node_with_history(name, cordoned_by_preflight)
    create_node(admin, name, n["metadata"]["labels"])
    admin.request(
        "PATCH",
        f"/api/v1/nodes/{name}",
        {"metadata": {"annotations": n["metadata"]["annotations"]},
         "spec": {"taints": n["spec"]["taints"], "unschedulable": cordoned_by_preflight or cordoned}},
        "application/merge-patch+json",
    )  # fmt: skip
    t = now_rfc3339()
    admin.patch_node_status(name, {"status": {"conditions": [
        {"type": "GPUReady", "status": "False", "reason": "FatalXid", "message": "Xid 79",
         "lastHeartbeatTime": t, "lastTransitionTime": t}]}})  # fmt: skip


def leftovers(admin: KubeApi, nodes: list[str]) -> dict[str, list[str]]:
    """What of gpu-ready is still on each Node."""
    out: dict[str, list[str]] = {}
    for name in nodes:
        n = admin.get_node(name)
        meta = n["metadata"]
        left = [k for k in ("preflight", NEEDS) if k in (meta.get("labels") or {})]
        left += [k for k in OURS_ANNOTATIONS if k in (meta.get("annotations") or {})]
        left += [f"taint {t['key']}" for t in n["spec"].get("taints") or [] if t["key"] == TAINT]
        left += [f"condition {c['type']}" for c in n["status"].get("conditions") or [] if c["type"] == "GPUReady"]
        if left:
            out[name] = left
    return out


def rules_path(admin: KubeApi) -> str | None:
    try:
        served = admin.request("GET", "/apis/resource.k8s.io/v1").get("resources", [])
    except ApiError:
        return None
    return "/apis/resource.k8s.io/v1/devicetaintrules" if any(r["name"] == "devicetaintrules" for r in served) else None


def device_taint_rule(name: str, managed: bool) -> dict[str, Any]:
    labels = {"app.kubernetes.io/managed-by": "gpu-ready", "gpu-ready.io/node": "n"} if managed else {"team": "x"}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "deviceSelector": {"driver": "gpu.nvidia.com", "pool": "n", "device": "gpu-0"},
            "taint": {"key": "gpu-ready.io/unhealthy", "value": "FatalXid", "effect": "NoSchedule"},
        },
    }


def controller_job(ns: str, release: str, name: str) -> dict[str, Any]:
    """A preflight Job as the controller creates it (its pod never runs here: no kubelet)."""
    labels = {"gpu-ready.io/managed-by": "gpu-ready-controller", "app.kubernetes.io/instance": release}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": {**labels, "app.kubernetes.io/component": "preflight"}},
                "spec": {"restartPolicy": "Never", "containers": [{"name": "gates", "image": "gpu-ready:test"}]},
            },
        },
    }


def uninstall_token(cp: ControlPlane, ns: str, sa: str, pod: str | None = None) -> str:
    admin = cp.admin()
    try:
        spec: dict[str, Any] = {"audiences": ["https://kubernetes.default.svc"], "expirationSeconds": 3600}
        if pod is not None:
            uid = admin.request("GET", f"/api/v1/namespaces/{ns}/pods/{pod}")["metadata"]["uid"]
            spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": pod, "uid": uid}
            tr = admin.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token", {"spec": spec})
            return str(tr["status"]["token"])
        return bound_token(admin, ns, sa)[0]
    finally:
        admin.close()


def wait_denied(api: KubeApi, node: str, what: str) -> None:
    """Policies load asynchronously: wait until the uninstall policy refuses adding a label to `node` (RBAC
    allows the patch, so only the policy can refuse it)."""

    def denied() -> bool:
        try:
            probe = {"metadata": {"labels": {"x.example.com/probe": secrets.token_hex(4)}}}  # a change each time
            api.request("PATCH", f"/api/v1/nodes/{node}", probe, "application/merge-patch+json")
        except ApiError as e:
            return e.status in (403, 422) and "uninstall" in str(e)
        return False

    wait_for(denied, 60, 0.5, what)


@pytest.mark.apiserver
def test_helm_uninstall_leaves_nothing_of_gpu_ready_on_any_node(jobs_plane: ControlPlane, tmp_path: Path) -> None:
    cp = jobs_plane
    admin = cp.admin()
    kc = cp.kubeconfig(tmp_path / "admin")
    kc.chmod(0o600)
    release = f"un{secrets.token_hex(3)}"
    ns = release
    full = f"{release}-gpu-ready"
    suffix = secrets.token_hex(3)
    nodes = [f"gpu-a-{suffix}", f"gpu-b-{suffix}", f"gpu-c-{suffix}"]
    seed_node(admin, nodes[0])
    seed_node(admin, nodes[1], cordoned_by_preflight=True)
    seed_node(admin, nodes[2], cordoned=True)  # an admin's cordon: not preflight's, stays
    plain = f"cpu-{suffix}"
    create_node(admin, plain, {"kubernetes.io/os": "linux"})

    def helm(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([tool("helm"), *args, "--kubeconfig", str(kc)], capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip

    r = helm("install", release, str(CHART), "-n", ns, "--create-namespace", "--set", "preflight.enabled=true",
             "--set", "preflight.auto.enabled=true", "--set", "taints.enabled=true")  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    # what the controller and the agents wrote in the cluster while the release ran
    admin.request("POST", f"/api/v1/namespaces/{ns}/configmaps", {"metadata": {"name": f"{full}-brake"}})
    admin.request("POST", f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases",
                  {"metadata": {"name": f"{full}-controller"}, "spec": {"holderIdentity": "a"}})  # fmt: skip
    admin.request("POST", f"/apis/batch/v1/namespaces/{ns}/jobs", controller_job(ns, release, f"{full}-preflight-1"))
    other_job = controller_job(ns, release, "not-the-controllers")
    other_job["metadata"]["labels"] = {"team": "x"}
    other_job["spec"]["template"]["metadata"]["labels"] = {"team": "x"}
    admin.request("POST", f"/apis/batch/v1/namespaces/{ns}/jobs", other_job)
    rules = rules_path(admin)
    if rules is None:
        print("\n[uninstall] this apiserver serves no DeviceTaintRule: that part is not checked")
    else:
        admin.request("POST", rules, device_taint_rule(f"gr-{suffix}", managed=True))
        admin.request("POST", rules, device_taint_rule(f"other-{suffix}", managed=False))

    un = subprocess.Popen([tool("helm"), "uninstall", release, "-n", ns, "--timeout", "4m", "--kubeconfig", str(kc)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        # play kubelet for the hook's pod: run its command line here with a token bound to it
        def hook_pod() -> dict[str, Any] | None:
            if un.poll() is not None:  # helm gave up before the hook's pod ran
                return {"helm ended": f"{un.returncode}: {un.communicate()[1][-2000:]}"}
            pods = admin.request("GET", f"/api/v1/namespaces/{ns}/pods",
                                 query={"labelSelector": f"job-name={full}-uninstall"})["items"]  # fmt: skip
            return pods[0] if pods else None

        pod = wait_for(hook_pod, 120, 0.2, "the uninstall hook's pod")
        assert "helm ended" not in pod, pod
        assert pod["spec"]["serviceAccountName"] == f"{full}-uninstall"
        token = uninstall_token(cp, ns, f"{full}-uninstall", pod["metadata"]["name"])
        hook_kc = cp.kubeconfig(tmp_path / "hook", token=token, user="uninstall")
        wait_denied(KubeApi.from_token(cp.host, token, cp.ca_file), plain, "the uninstall policy to load")
        args = pod["spec"]["containers"][0]["args"]
        run = subprocess.run([sys.executable, "-m", "agent.cli", *args, "--kubeconfig", str(hook_kc), "--wait", "30"],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        finish_pod(admin, ns, pod, ok=True)
        out, err = un.communicate(timeout=300)
    finally:
        if un.poll() is None:
            un.kill()
    assert un.returncode == 0, out + err
    assert leftovers(admin, [*nodes, plain]) == {}, run.stdout
    for name in nodes:  # what is not gpu-ready's is kept
        n = admin.get_node(name)
        assert n["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"
        assert n["metadata"]["annotations"]["team.example.com/owner"] == "ml"
        assert FOREIGN_TAINT in n["spec"]["taints"]
    assert [bool(admin.get_node(n)["spec"].get("unschedulable")) for n in nodes] == [False, False, True]
    gone = [
        f"/api/v1/namespaces/{ns}/configmaps/{full}-brake",
        f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{full}-controller",
        f"/apis/batch/v1/namespaces/{ns}/jobs/{full}-preflight-1",
        f"/api/v1/namespaces/{ns}/serviceaccounts/{full}-uninstall",
        f"/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/{full}-uninstall",
    ]
    kept = [f"/apis/batch/v1/namespaces/{ns}/jobs/not-the-controllers"]
    if rules is not None:
        gone.append(f"{rules}/gr-{suffix}")
        kept.append(f"{rules}/other-{suffix}")
    for path in gone:
        with pytest.raises(ApiError) as e:
            admin.request("GET", path)
        assert e.value.status == 404, path
    for path in kept:
        assert admin.request("GET", path)["metadata"]["name"]
    assert run.stdout.count(": removed ") == len(nodes), run.stdout
    assert run.stdout.strip().endswith("uninstall: done")
    admin.close()


@pytest.fixture(scope="module")
def bound_release(jobs_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Release:
    kc = jobs_plane.kubeconfig(tmp_path_factory.mktemp("kc") / "admin")
    return apply_release(
        jobs_plane, kc, "unb", ["--set", "preflight.enabled=true", "--set", "preflight.auto.enabled=true"]
    )


@pytest.mark.apiserver
def test_the_uninstall_token_may_only_remove(jobs_plane: ControlPlane, bound_release: Release) -> None:
    cp, rel = jobs_plane, bound_release
    admin = cp.admin()
    suffix = secrets.token_hex(3)
    node = f"gpu-b-{suffix}"
    seed_node(admin, node)
    cordoned = f"gpu-c-{suffix}"
    seed_node(admin, cordoned, cordoned=True)
    api = KubeApi.from_token(cp.host, uninstall_token(cp, rel.ns, f"{rel.fullname}-uninstall"), cp.ca_file)
    wait_denied(api, node, "the uninstall policy to load")
    merge = "application/merge-patch+json"
    n = admin.get_node(node)
    attempts: list[tuple[str, str, str, Any, str]] = [
        ("add a label", "PATCH", f"/api/v1/nodes/{node}", {"metadata": {"labels": {"a.example.com/x": "1"}}}, merge),
        (
            "change a foreign label",
            "PATCH",
            f"/api/v1/nodes/{node}",
            {"metadata": {"labels": {"nvidia.com/gpu.present": "false"}}},
            merge,
        ),
        (
            "remove a foreign label",
            "PATCH",
            f"/api/v1/nodes/{node}",
            {"metadata": {"labels": {"nvidia.com/gpu.present": None}}},
            merge,
        ),
        (
            "set gpu-ready's label",
            "PATCH",
            f"/api/v1/nodes/{node}",
            {"metadata": {"labels": {"preflight": "failed"}}},
            merge,
        ),
        (
            "remove a foreign annotation",
            "PATCH",
            f"/api/v1/nodes/{node}",
            {"metadata": {"annotations": {"team.example.com/owner": None}}},
            merge,
        ),
        (
            "remove a foreign taint",
            "PATCH",
            f"/api/v1/nodes/{node}",
            {"spec": {"taints": [t for t in n["spec"]["taints"] if t["key"] != "nvidia.com/gpu"]}},
            merge,
        ),
        (
            "add its taint",
            "PATCH",
            f"/api/v1/nodes/{node}",
            {"spec": {"taints": [*n["spec"]["taints"], {"key": TAINT, "effect": "NoExecute"}]}},
            merge,
        ),
        ("uncordon an admin's cordon", "PATCH", f"/api/v1/nodes/{cordoned}", {"spec": {"unschedulable": None}}, merge),
        ("cordon", "PATCH", f"/api/v1/nodes/{node}", {"spec": {"unschedulable": True}}, merge),
        (
            "remove kubelet's condition",
            "PATCH",
            f"/api/v1/nodes/{node}/status",
            {"status": {"conditions": [{"type": "Ready", "$patch": "delete"}]}},
            "application/strategic-merge-patch+json",
        ),
        (
            "set its condition",
            "PATCH",
            f"/api/v1/nodes/{node}/status",
            {"status": {"conditions": [{"type": "GPUReady", "status": "True"}]}},
            "application/strategic-merge-patch+json",
        ),
        ("delete a Node", "DELETE", f"/api/v1/nodes/{node}", None, merge),
    ]
    ensure_namespace(admin, rel.ns)
    team_job = controller_job(rel.ns, "x", f"team-{suffix}")
    team_job["metadata"]["labels"] = {"team": "x"}
    admin.request("POST", f"/apis/batch/v1/namespaces/{rel.ns}/jobs", team_job)
    jobs = f"/apis/batch/v1/namespaces/{rel.ns}/jobs"
    attempts.append(("delete a Job not the controller's", "DELETE", f"{jobs}/team-{suffix}", None, merge))
    admin.request("POST", f"/api/v1/namespaces/{rel.ns}/configmaps", {"metadata": {"name": f"other-{suffix}"}})
    attempts.append(("delete another ConfigMap", "DELETE", f"/api/v1/namespaces/{rel.ns}/configmaps/other-{suffix}",
                     None, merge))  # fmt: skip
    rules = rules_path(admin)
    if rules is not None:
        admin.request("POST", rules, device_taint_rule(f"other-{suffix}", managed=False))
        attempts.append(("delete a foreign DeviceTaintRule", "DELETE", f"{rules}/other-{suffix}", None, merge))
        attempts.append(
            ("create a DeviceTaintRule", "POST", rules, device_taint_rule(f"new-{suffix}", True), "application/json")
        )
    allowed = []
    for what, method, path, body, ctype in attempts:
        try:
            api.request(method, path, body, ctype)
            allowed.append(what)
        except ApiError as e:
            assert e.status in (403, 422), (what, e)
    assert allowed == [], f"the uninstall token was allowed to {allowed}"
    assert leftovers(admin, [node]) == {node: ["preflight", NEEDS, "gpu-ready.io/preflight-time",
                                               "gpu-ready.io/preflight-report", "gpu-ready.io/clear-before",
                                               f"taint {TAINT}", "condition GPUReady"]}  # fmt: skip
    # what it may do: remove exactly gpu-ready's names
    from agent.act.uninstall import Uninstall

    lines: list[str] = []
    code = Uninstall(api, UninstallSettings(rel.ns, brake_name=f"{rel.fullname}-brake"), lines.append).run()
    assert code == 0, lines
    assert leftovers(admin, [node, cordoned]) == {}
    assert admin.get_node(cordoned)["spec"].get("unschedulable") is True
    api.close()
    admin.close()
