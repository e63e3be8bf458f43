"""Least privilege for the blast radius (podResources.enabled, docs/allocation.md), proven on the real apiserver with
the chart's own rendered RBAC and admission policies and a token bound to a Pod on node A: the agent may GET a Pod
and create (and patch the series of) an Event about a Pod in that Pod's namespace, as this node's agent; it may
not list, watch, create, update or delete Pods, nor write Events with another reportingController, another
reportingInstance (node), another kind, in another namespace than the Pod's, relating to another object, nor
delete Events. With podResources off the same token gets none of the Pod rights."""

from __future__ import annotations

import json
import secrets
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.kube.client import MERGE_PATCH, ApiError, KubeApi
from testkit.chart import CHART, KUBECTL, Release, apply_release, by_kind, helm, render
from testkit.cluster import EVENT_NAMESPACE, bound_token, create_node, ensure_namespace
from testkit.controlplane import ControlPlane
from testkit.harness import wait_for
from testkit.security import denied_by, denied_by_policy

ROOT = Path(__file__).resolve().parents[1]
ON = ["--set", "podResources.enabled=true"]


@dataclass
class Env:
    node_a: str
    node_b: str
    ns: str  # a workload namespace holding the pod
    other_ns: str  # another workload namespace
    pod: str
    uid: str
    event: str = ""  # an Event the setup made


@dataclass
class PodsCluster:
    cp: ControlPlane
    admin: KubeApi
    on: Release
    off: Release
    env: Env

    def token(self, rel: Release, node: str) -> KubeApi:
        tok, _ = bound_token(self.admin, rel.ns, rel.fullname, node)
        return KubeApi.from_token(self.cp.host, tok, self.cp.ca_file)


def pod_event(e: Env, **over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": f"{e.pod}.{secrets.token_hex(6)}"},
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "reportingController": "gpu-ready",
        "reportingInstance": f"gpu-ready-{e.node_a}",
        "action": "Detected",
        "reason": "GPUUnhealthy",
        "regarding": {"apiVersion": "v1", "kind": "Pod", "namespace": e.ns, "name": e.pod, "uid": e.uid},
        "type": "Warning",
        "note": "GPU 0 (00000000:19:00.0, GPU-x) on node a is unhealthy: FatalXid: Xid 79",
    }
    body.update(over)
    return body


def events_path(ns: str, name: str = "") -> str:
    return f"/apis/events.k8s.io/v1/namespaces/{ns}/events" + (f"/{name}" if name else "")


def admin_pod_event(controller: str) -> Callable[[KubeApi, Env], None]:
    def setup(admin: KubeApi, e: Env) -> None:
        body = pod_event(e, reportingController=controller, reportingInstance=f"{controller}-{e.node_a}")
        e.event = body["metadata"]["name"]
        admin.request("POST", events_path(e.ns), body)

    return setup


def own_pod_event(admin: KubeApi, e: Env) -> None:
    body = pod_event(e)
    e.event = body["metadata"]["name"]
    admin.request("POST", events_path(e.ns), body)


SERIES = {"series": {"count": 2, "lastObservedTime": "2026-01-01T00:00:05.000000Z"}}


@dataclass
class Attempt:
    what: str
    method: str
    path: Callable[[Env], str]
    body: Callable[[Env], Any] | None
    expect: int
    by: str = ""  # the layer expected to say no: "RBAC" or "policy <name>"
    content_type: str = "application/json"
    setup: Callable[[KubeApi, Env], None] | None = None
    query: dict[str, str] | None = None


POD = lambda e: f"/api/v1/namespaces/{e.ns}/pods/{e.pod}"  # noqa: E731
OWN_EVENTS = "policy own-events-only"

ATTEMPTS: list[Attempt] = [
    # ---- allowed ------------------------------------------------------------------------------------------------
    Attempt("get a pod (its UID)", "GET", POD, None, 200),
    Attempt("Event about a pod, in its namespace", "POST", lambda e: events_path(e.ns), pod_event, 201),
    Attempt(
        "patch the series of its own pod Event",
        "PATCH",
        lambda e: events_path(e.ns, e.event),
        lambda e: SERIES,
        200,
        content_type=MERGE_PATCH,
        setup=own_pod_event,
    ),
    Attempt(
        "Event about its Node (unchanged)",
        "POST",
        lambda e: events_path(EVENT_NAMESPACE),
        lambda e: pod_event(
            e,
            metadata={"name": f"{e.node_a}.{secrets.token_hex(6)}"},
            regarding={"apiVersion": "v1", "kind": "Node", "name": e.node_a},
        ),
        201,
    ),
    # ---- pods: read one, nothing else ------------------------------------------------------------------------
    Attempt("list pods in a namespace", "GET", lambda e: f"/api/v1/namespaces/{e.ns}/pods", None, 403, "RBAC"),
    Attempt("list pods of the cluster", "GET", lambda e: "/api/v1/pods", None, 403, "RBAC"),
    Attempt(
        "watch pods",
        "GET",
        lambda e: f"/api/v1/namespaces/{e.ns}/pods",
        None,
        403,
        "RBAC",
        query={"watch": "1", "timeoutSeconds": "1"},
    ),
    Attempt(
        "update a pod (label)",
        "PATCH",
        POD,
        lambda e: {"metadata": {"labels": {"x": "y"}}},
        403,
        "RBAC",
        content_type=MERGE_PATCH,
    ),
    Attempt("delete a pod", "DELETE", POD, None, 403, "RBAC"),
    Attempt(
        "create a pod",
        "POST",
        lambda e: f"/api/v1/namespaces/{e.ns}/pods",
        lambda e: {"metadata": {"name": "x"}, "spec": {"containers": [{"name": "c", "image": "i"}]}},
        403,
        "RBAC",
    ),
    Attempt(
        "evict a pod", "POST", lambda e: POD(e) + "/eviction", lambda e: {"metadata": {"name": e.pod}}, 403, "RBAC"
    ),
    # ---- Events: only gpu-ready's, about a Pod in the Event's namespace, from this node -----------------------
    Attempt(
        "pod Event with another reportingController",
        "POST",
        lambda e: events_path(e.ns),
        lambda e: pod_event(e, reportingController="kubelet"),
        403,
        OWN_EVENTS,
    ),
    Attempt(
        "pod Event as another node's agent (reportingInstance)",
        "POST",
        lambda e: events_path(e.ns),
        lambda e: pod_event(e, reportingInstance=f"gpu-ready-{e.node_b}"),
        403,
        OWN_EVENTS,
    ),
    Attempt(
        "Event about another kind (Deployment) in the namespace",
        "POST",
        lambda e: events_path(e.ns),
        lambda e: pod_event(
            e, regarding={"apiVersion": "apps/v1", "kind": "Deployment", "namespace": e.ns, "name": "d"}
        ),
        403,
        OWN_EVENTS,
    ),
    Attempt(
        "Event about another kind (Secret) in the namespace",
        "POST",
        lambda e: events_path(e.ns),
        lambda e: pod_event(e, regarding={"apiVersion": "v1", "kind": "Secret", "namespace": e.ns, "name": "s"}),
        403,
        OWN_EVENTS,
    ),
    Attempt(
        "Event about a Node outside the events namespace",
        "POST",
        lambda e: events_path(e.ns),
        lambda e: pod_event(e, regarding={"apiVersion": "v1", "kind": "Node", "name": e.node_a}),
        422,  # the apiserver refuses it before admission: a Node's Events live only in default or kube-system
    ),
    Attempt(
        "pod Event in another namespace than the pod's",
        "POST",
        lambda e: events_path(e.other_ns),
        pod_event,
        403,
        OWN_EVENTS,
    ),
    Attempt(
        "pod Event relating to another object",
        "POST",
        lambda e: events_path(e.ns),
        lambda e: pod_event(e, related={"apiVersion": "v1", "kind": "Secret", "namespace": e.ns, "name": "s"}),
        403,
        OWN_EVENTS,
    ),
    Attempt(
        "patch another controller's pod Event",
        "PATCH",
        lambda e: events_path(e.ns, e.event),
        lambda e: SERIES,
        403,
        OWN_EVENTS,
        content_type=MERGE_PATCH,
        setup=admin_pod_event("kubelet"),
    ),
    Attempt(
        "turn its own pod Event into another controller's",
        "PATCH",
        lambda e: events_path(e.ns, e.event),
        lambda e: {"reportingController": "kubelet"},
        403,
        "",  # immutable field (422) or the policy (403): either way not allowed; the policy runs after validation
        content_type=MERGE_PATCH,
        setup=own_pod_event,
    ),
    Attempt(
        "delete its own pod Event",
        "DELETE",
        lambda e: events_path(e.ns, e.event),
        None,
        403,
        "RBAC",  # no delete verb at all
        setup=own_pod_event,
    ),
]


@pytest.fixture(scope="module")
def pods_cluster(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Any:
    kc = control_plane.kubeconfig(tmp_path_factory.mktemp("secpods") / "admin")
    on = apply_release(control_plane, kc, "secp", ON)
    off = apply_release(control_plane, kc, "secq", [])
    admin = control_plane.admin()
    a, b = (f"secp-{secrets.token_hex(4)}" for _ in range(2))
    for n in (a, b):
        create_node(admin, n, {"nvidia.com/gpu.present": "true"}, {"nvidia.com/gpu": "8"})
    ns, other = (f"work-{secrets.token_hex(3)}" for _ in range(2))
    for n in (ns, other):
        ensure_namespace(admin, n)
    pod = admin.request(
        "POST",
        f"/api/v1/namespaces/{ns}/pods",
        {"metadata": {"name": "train-0"}, "spec": {"nodeName": a, "containers": [{"name": "main", "image": "x"}]}},
    )
    env = Env(a, b, ns, other, "train-0", pod["metadata"]["uid"])
    c = PodsCluster(control_plane, admin, on, off, env)
    api = c.token(on, a)
    wait_for(  # the policies take a moment to load after creation
        lambda: denied_by_policy(
            lambda: api.request("POST", events_path(ns), pod_event(env, reportingController="kubelet")),
            f"{on.fullname}-own-events-only",
        ),
        60,
        0.2,
        "the Events admission policy to take effect",
    )
    api.close()
    yield c
    for n in (a, b):
        admin.request("DELETE", f"/api/v1/nodes/{n}")
    admin.close()


def attempt(c: PodsCluster, rel: Release, a: Attempt) -> tuple[int, str]:
    e = Env(**{**vars(c.env), "event": ""})
    if a.setup:
        a.setup(c.admin, e)
    api = c.token(rel, e.node_a)
    try:
        body = a.body(e) if a.body else None
        api.request(a.method, a.path(e), body, a.content_type, a.query)
        return (201 if a.method == "POST" else 200), ""
    except ApiError as err:
        return err.status, str(err)
    finally:
        api.close()


@pytest.mark.apiserver
def test_with_pod_resources_the_agent_reads_pods_and_writes_pod_events_only(pods_cluster):
    problems = []
    for a in ATTEMPTS:
        code, message = attempt(pods_cluster, pods_cluster.on, a)
        expect = {a.expect, 422} if a.what.startswith("turn its own") else {a.expect}
        if code not in expect:
            problems.append(f"{a.what}: expected {a.expect}, got {code} {message[:300]}")
        elif a.by and denied_by(message) != a.by:
            problems.append(f"{a.what}: denied by {denied_by(message)!r}, expected {a.by!r}: {message[:200]}")
    print(f"\n[security-pods] {len(ATTEMPTS)} attempts; mismatches: {len(problems)}")
    assert not problems, "\n".join(problems)


@pytest.mark.apiserver
def test_the_event_the_agent_may_write_is_on_the_pod(pods_cluster):
    """The allowed Event is visible where `kubectl describe pod` looks: core/v1 events with the pod's UID."""
    c, e = pods_cluster, pods_cluster.env
    api = c.token(c.on, e.node_a)
    body = pod_event(e, note="blast radius proof")
    try:
        api.request("POST", events_path(e.ns), body)
    finally:
        api.close()
    got = c.admin.request(
        "GET", f"/api/v1/namespaces/{e.ns}/events", query={"fieldSelector": f"involvedObject.uid={e.uid}"}
    )
    assert "blast radius proof" in [x["message"] for x in got["items"]]


@pytest.mark.apiserver
def test_without_pod_resources_no_pod_rights(pods_cluster):
    c = pods_cluster
    for a in ATTEMPTS[:2]:  # get a pod, an Event about a pod
        code, message = attempt(c, c.off, a)
        assert code == 403, f"{a.what}: {code} {message[:200]}"
        assert denied_by(message) in ("RBAC", OWN_EVENTS), message[:300]


def test_rendered_rbac_and_mount_follow_the_value():
    on, off = render(ON), render([])
    roles = by_kind(on, "ClusterRole")
    assert roles["gpu-ready-pods"]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
        {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
    ]
    assert "gpu-ready-pods" not in by_kind(off, "ClusterRole")
    assert by_kind(off, "ClusterRole")["gpu-ready"] == by_kind(on, "ClusterRole")["gpu-ready"]  # base unchanged
    spec = by_kind(on, "DaemonSet")["gpu-ready"]["spec"]["template"]["spec"]
    (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "pod-resources"]
    assert mount == {"name": "pod-resources", "mountPath": "/var/lib/kubelet/pod-resources", "readOnly": True}
    (vol,) = [v for v in spec["volumes"] if v["name"] == "pod-resources"]
    assert vol["hostPath"] == {"path": "/var/lib/kubelet/pod-resources", "type": "Directory"}  # the directory
    off_spec = by_kind(off, "DaemonSet")["gpu-ready"]["spec"]["template"]["spec"]
    assert not [v for v in off_spec["volumes"] if v["name"] == "pod-resources"]
    cfg_on = yaml.safe_load(by_kind(on, "ConfigMap")["gpu-ready"]["data"]["config.yaml"])
    cfg_off = yaml.safe_load(by_kind(off, "ConfigMap")["gpu-ready"]["data"]["config.yaml"])
    assert cfg_on["podResources"] is True and cfg_off["podResources"] is False
    # config.podResources alone turns on the same (one switch, no duplicate key)
    both = render(["--set", "config.podResources=true"])
    assert "gpu-ready-pods" in by_kind(both, "ClusterRole")
    text = by_kind(both, "ConfigMap")["gpu-ready"]["data"]["config.yaml"]
    assert text.count("podResources:") == 1 and yaml.safe_load(text)["podResources"] is True
    assert json.dumps(by_kind(off, "ValidatingAdmissionPolicy")).count('"Pod"') == 0


ON_NONPRIV = [*ON, "--set", "agent.privileged=false", "--set", "podResources.hostPath=/var/lib/kubelet/pod-resources"]


@pytest.mark.parametrize("values", [ON, ON_NONPRIV], ids=["privileged", "non-privileged"])
def test_helm_lint_strict_and_schema(values):
    r = helm("lint", str(CHART), "--strict", *values)
    assert "1 chart(s) linted, 0 chart(s) failed" in r.stdout
    bad = helm("lint", str(CHART), "--set", "podResources.hostPath=relative", check=False)
    assert bad.returncode != 0 and "podResources" in bad.stdout + bad.stderr
    bad = helm("lint", str(CHART), "--set", "podResources.socket=/x", check=False)  # unknown key
    assert bad.returncode != 0


@pytest.mark.apiserver
@pytest.mark.parametrize("values", [ON, ON_NONPRIV], ids=["privileged", "non-privileged"])
def test_server_side_dry_run_with_pod_resources(values, control_plane, admin, tmp_path):
    ns = f"gr-podres-{secrets.token_hex(3)}"
    ensure_namespace(admin, ns)
    docs = [d for d in render(values, namespace=ns) if not d["apiVersion"].startswith("monitoring.coreos.com")]
    manifest = yaml.safe_dump_all(docs)
    kc = control_plane.kubeconfig(tmp_path / "admin")
    r = subprocess.run(
        [KUBECTL, "--kubeconfig", str(kc), "apply", "--dry-run=server", "-f", "-"],
        input=manifest,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("(server dry run)") == len(docs)
    assert f"clusterrole.rbac.authorization.k8s.io/{ns}-gpu-ready-pods" in r.stdout or "gpu-ready-pods" in r.stdout
