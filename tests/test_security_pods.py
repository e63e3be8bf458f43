"""Least privilege for the blast radius (podResources.enabled, docs/allocation.md), proven on the real apiserver with
the chart's own rendered RBAC and admission policies and a token bound to a Pod on node A: podResources grants the
token nothing. The blast radius of a bad GPU is told in Events about the agent's own Node that name the pods (the
admission policy cannot read a Pod to see that it runs on the token's node, so Events about Pods would let the token
write about any Pod in any namespace); the agent reads no Pod (kubelet's pod-resources API names the pods). The
token may not read, list, watch, create, update, evict or delete Pods, nor write or patch Events about a Pod, in
any namespace. With podResources off the token has the very same rights."""

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
from agent.report.blast_radius import EVENT_REASON as POD_EVENT_REASON
from agent.report.events import EventReporter
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


def node_event(e: Env) -> dict[str, Any]:
    """The blast-radius Event as the agent writes it: about its Node, in the events namespace, naming the pod."""
    note = f"GPU 0 (00000000:19:00.0, GPU-x) on node {e.node_a} is unhealthy: FatalXid: Xid 79; pod {e.ns}/{e.pod} "
    body = pod_event(e, note=note + "holds 1 slot(s) of it (containers: main)")
    body["metadata"] = {"name": f"{e.node_a}.{secrets.token_hex(6)}"}
    body["regarding"] = {"apiVersion": "v1", "kind": "Node", "name": e.node_a}
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
    # ---- allowed: the blast-radius Event, about its Node, naming the pod ----------------------------------------
    Attempt("Event about its Node naming the pod", "POST", lambda e: events_path(EVENT_NAMESPACE), node_event, 201),
    # ---- before, with podResources: a pod's UID and Events about the pod ----------------------------------------
    Attempt("get a pod (its UID)", "GET", POD, None, 403, "RBAC"),
    Attempt("Event about a pod, in its namespace", "POST", lambda e: events_path(e.ns), pod_event, 403, "RBAC"),
    Attempt(
        "patch the series of its own pod Event",
        "PATCH",
        lambda e: events_path(e.ns, e.event),
        lambda e: SERIES,
        403,
        "RBAC",
        content_type=MERGE_PATCH,
        setup=own_pod_event,
    ),
    Attempt(
        "Event about a pod in the events namespace",
        "POST",
        lambda e: events_path(EVENT_NAMESPACE),
        lambda e: pod_event(e, metadata={"name": f"x.{secrets.token_hex(6)}", "namespace": EVENT_NAMESPACE}),
        403,
        OWN_EVENTS,
    ),
    # ---- pods: nothing ---------------------------------------------------------------------------------------------
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
    # ---- Events in a workload namespace: none (RBAC grants Events only in the events namespace) ------------------
    Attempt(
        "pod Event with another reportingController",
        "POST",
        lambda e: events_path(e.ns),
        lambda e: pod_event(e, reportingController="kubelet"),
        403,
        "RBAC",
    ),
    Attempt(
        "pod Event as another node's agent (reportingInstance)",
        "POST",
        lambda e: events_path(e.ns),
        lambda e: pod_event(e, reportingInstance=f"gpu-ready-{e.node_b}"),
        403,
        "RBAC",
    ),
    Attempt(
        "Event about another kind (Deployment) in the namespace",
        "POST",
        lambda e: events_path(e.ns),
        lambda e: pod_event(
            e, regarding={"apiVersion": "apps/v1", "kind": "Deployment", "namespace": e.ns, "name": "d"}
        ),
        403,
        "RBAC",
    ),
    Attempt(
        "Event about another kind (Secret) in the namespace",
        "POST",
        lambda e: events_path(e.ns),
        lambda e: pod_event(e, regarding={"apiVersion": "v1", "kind": "Secret", "namespace": e.ns, "name": "s"}),
        403,
        "RBAC",
    ),
    Attempt(
        "Event about a Node outside the events namespace",
        "POST",
        lambda e: events_path(e.ns),
        lambda e: pod_event(e, regarding={"apiVersion": "v1", "kind": "Node", "name": e.node_a}),
        403,
        "RBAC",
    ),
    Attempt(
        "pod Event in another namespace than the pod's",
        "POST",
        lambda e: events_path(e.other_ns),
        pod_event,
        403,
        "RBAC",
    ),
    Attempt(
        "pod Event relating to another object",
        "POST",
        lambda e: events_path(e.ns),
        lambda e: pod_event(e, related={"apiVersion": "v1", "kind": "Secret", "namespace": e.ns, "name": "s"}),
        403,
        "RBAC",
    ),
    Attempt(
        "patch another controller's pod Event",
        "PATCH",
        lambda e: events_path(e.ns, e.event),
        lambda e: SERIES,
        403,
        "RBAC",
        content_type=MERGE_PATCH,
        setup=admin_pod_event("kubelet"),
    ),
    Attempt(
        "turn its own pod Event into another controller's",
        "PATCH",
        lambda e: events_path(e.ns, e.event),
        lambda e: {"reportingController": "kubelet"},
        403,
        "RBAC",
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
    for rel in (on, off):  # each release's policies take a moment to load after creation: both, not only the first
        api = c.token(rel, a)
        try:
            wait_for(
                lambda api=api, rel=rel: denied_by_policy(
                    lambda: api.request(
                        "POST", events_path(EVENT_NAMESPACE), {**node_event(env), "reportingController": "x"}
                    ),
                    f"{rel.fullname}-own-events-only",
                ),
                60,
                0.2,
                f"release {rel.fullname}'s Events admission policy to take effect",
            )
        finally:
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
@pytest.mark.parametrize("pod_resources", [True, False], ids=["podResources on", "podResources off"])
def test_the_agent_reads_no_pod_and_writes_events_only_about_its_node(pods_cluster, pod_resources):
    problems = []
    rel = pods_cluster.on if pod_resources else pods_cluster.off
    for a in ATTEMPTS:
        code, message = attempt(pods_cluster, rel, a)
        if code != a.expect:
            problems.append(f"{a.what}: expected {a.expect}, got {code} {message[:300]}")
        elif a.by and denied_by(message) != a.by:
            problems.append(f"{a.what}: denied by {denied_by(message)!r}, expected {a.by!r}: {message[:200]}")
    print(f"\n[security-pods] {len(ATTEMPTS)} attempts; mismatches: {len(problems)}")
    assert not problems, "\n".join(problems)


@pytest.mark.apiserver
def test_the_blast_radius_event_is_on_the_node_and_names_the_pod(pods_cluster):
    """The agent's own code writes it (EventReporter with the token): `kubectl describe node` shows it, with the pod's
    namespace and name in the note."""
    c, e = pods_cluster, pods_cluster.env
    api = c.token(c.on, e.node_a)
    try:
        rep = EventReporter(api, e.node_a, 300.0, EVENT_NAMESPACE)
        rep.record(POD_EVENT_REASON, node_event(e)["note"], f"00000000:19:00.0|{e.ns}/{e.pod}")
        assert rep.flush() == 1
    finally:
        api.close()
    got = c.admin.request(
        "GET",
        f"/api/v1/namespaces/{EVENT_NAMESPACE}/events",
        query={"fieldSelector": f"involvedObject.name={e.node_a}"},
    )
    notes = [x["message"] for x in got["items"] if x["reason"] == POD_EVENT_REASON]
    assert any(f"pod {e.ns}/{e.pod} holds 1 slot" in n for n in notes), notes


def test_rendered_rbac_and_mount_follow_the_value():
    on, off = render(ON), render([])
    for kind in ("ClusterRole", "Role", "ValidatingAdmissionPolicy"):  # podResources grants the token nothing
        assert by_kind(on, kind) == by_kind(off, kind), kind
    assert "pods" not in json.dumps([r["rules"] for r in by_kind(on, "ClusterRole").values()])
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
    assert [v for v in by_kind(both, "DaemonSet")["gpu-ready"]["spec"]["template"]["spec"]["volumes"]
            if v["name"] == "pod-resources"]  # fmt: skip
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
    assert "gpu-ready-pods" not in r.stdout
