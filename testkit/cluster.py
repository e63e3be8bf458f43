"""Helpers on top of a real apiserver: Nodes that look like a kubelet registered them, and clients
authenticated as a ServiceAccount with a token from the TokenRequest API."""

from __future__ import annotations

import contextlib
import secrets
from datetime import UTC, datetime
from typing import Any

from agent.kube.client import ApiError, KubeApi


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def create_node(
    api: KubeApi,
    name: str,
    labels: dict[str, str] | None = None,
    capacity: dict[str, str] | None = None,
    allocatable: dict[str, str] | None = None,
    unschedulable: bool = False,
    annotations: dict[str, str] | None = None,
    taints: list[dict[str, str]] | None = None,
    spec: dict[str, Any] | None = None,
    status: dict[str, Any] | None = None,
    conditions: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """A Node with the given labels, capacity and allocatable, and a kubelet-style Ready condition; `status`
    adds status fields (addresses, nodeInfo, ...) and `conditions` more conditions after Ready."""
    meta: dict[str, Any] = {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}}
    if annotations:
        meta["annotations"] = annotations
    node_spec: dict[str, Any] = {"unschedulable": unschedulable, **(spec or {})}
    if taints:
        node_spec["taints"] = taints
    api.request("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": meta, "spec": node_spec})
    base = {"cpu": "16", "memory": "128Gi", "pods": "110"}
    t = now_rfc3339()
    ready = {
        "type": "Ready",
        "status": "True",
        "reason": "KubeletReady",
        "message": "kubelet is posting ready status",
        "lastHeartbeatTime": t,
        "lastTransitionTime": t,
    }
    return api.patch_node_status(
        name,
        {
            "status": {
                "capacity": {**base, **(capacity or {})},
                "allocatable": {**base, **(allocatable if allocatable is not None else capacity or {})},
                "conditions": [
                    ready,
                    *({"lastHeartbeatTime": t, "lastTransitionTime": t, **c} for c in conditions or []),
                ],
                **(status or {}),
            }
        },
    )


def drop_not_ready_taint(api: KubeApi, name: str) -> None:
    """The TaintNodesByCondition admission plugin adds node.kubernetes.io/not-ready:NoSchedule at creation; the
    node lifecycle controller removes it once the kubelet posts Ready. That controller is not run here (with no
    kubelet renewing a Lease it would taint every Node unreachable), so the test does its part."""
    now = api.get_node(name)["spec"].get("taints") or []
    keep = [t for t in now if t.get("key") != "node.kubernetes.io/not-ready"]
    ops = [{"op": "test", "path": "/spec/taints", "value": now}, {"op": "add", "path": "/spec/taints", "value": keep}]
    api.request("PATCH", f"/api/v1/nodes/{name}", ops, "application/json-patch+json")


def create_runtime_class(api: KubeApi, name: str = "nvidia", handler: str = "nvidia") -> None:
    """The RuntimeClass the GPU Operator creates (the chart runs the agent with `runtimeClassName: nvidia`)."""
    body = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": name}, "handler": handler}
    api.request("POST", "/apis/node.k8s.io/v1/runtimeclasses", body)


def condition(node: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    for c in (node.get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return dict(c)
    return None


def ensure_namespace(api: KubeApi, name: str) -> None:
    with contextlib.suppress(ApiError):
        api.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})


def bound_token(
    api: KubeApi, namespace: str, service_account: str, node: str | None = None, expiration_s: int = 3600
) -> tuple[str, str | None]:
    """A TokenRequest token for an existing ServiceAccount; with `node`, bound to a new Pod on that node (the
    token then carries the claim authentication.kubernetes.io/node-name). Returns (token, pod name)."""
    spec: dict[str, Any] = {"audiences": ["https://kubernetes.default.svc"], "expirationSeconds": expiration_s}
    pod_name = None
    if node is not None:
        pod_name = f"{service_account}-{secrets.token_hex(3)}"[-63:].lstrip("-.")
        pod = api.request(
            "POST",
            f"/api/v1/namespaces/{namespace}/pods",
            {
                "metadata": {"name": pod_name},
                "spec": {
                    "nodeName": node,
                    "serviceAccountName": service_account,
                    "automountServiceAccountToken": False,
                    "containers": [{"name": "agent", "image": "gpu-ready:test"}],
                },
            },
        )
        spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": pod_name, "uid": pod["metadata"]["uid"]}
    tr = api.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
    )
    return str(tr["status"]["token"]), pod_name


def service_account_client(
    api: KubeApi,
    rules: list[dict[str, Any]] | None = None,
    cluster_role: str | None = None,
    namespace: str | None = None,
    name: str = "gpu-ready",
    pod_on_node: str | None = None,
    expiration_s: int = 3600,
    namespace_rules: dict[str, list[dict[str, Any]]] | None = None,
) -> tuple[KubeApi, dict[str, Any]]:
    """Creates a ServiceAccount bound to a ClusterRole (given by name, or made from `rules`) and, per
    namespace in `namespace_rules`, to a Role made from those rules (the chart's Events Role: see
    AGENT_EVENT_RULES); returns a client that authenticates with a TokenRequest token, optionally bound
    to a Pod scheduled on `pod_on_node` (the token then carries that node's name)."""
    ns = namespace or f"t-{secrets.token_hex(4)}"
    ensure_namespace(api, ns)
    with contextlib.suppress(ApiError):
        api.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": name}})
    if cluster_role is None:
        cluster_role = f"{ns}-{name}"
        api.request(
            "POST",
            "/apis/rbac.authorization.k8s.io/v1/clusterroles",
            {"metadata": {"name": cluster_role}, "rules": rules or []},
        )
    api.request(
        "POST",
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
        {
            "metadata": {"name": f"{ns}-{name}-{secrets.token_hex(3)}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
        },
    )
    for role_ns, role_rules in (namespace_rules or {}).items():
        ensure_namespace(api, role_ns)
        role = f"{ns}-{name}-{secrets.token_hex(3)}"
        api.request(
            "POST",
            f"/apis/rbac.authorization.k8s.io/v1/namespaces/{role_ns}/roles",
            {"metadata": {"name": role}, "rules": role_rules},
        )
        api.request(
            "POST",
            f"/apis/rbac.authorization.k8s.io/v1/namespaces/{role_ns}/rolebindings",
            {
                "metadata": {"name": role},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
                "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
            },
        )
    info: dict[str, Any] = {"namespace": ns, "service_account": name, "cluster_role": cluster_role}
    token, pod = bound_token(api, ns, name, pod_on_node, expiration_s)
    if pod is not None:
        info["pod"] = pod
    info["token"] = token
    cfg = api.configuration
    client = KubeApi.from_token(cfg.host, token, cfg.ssl_ca_cert)
    return client, info


# AGENT_RULES: the agent's rules as one ClusterRole, Events in every namespace included. The chart no longer
# grants that (Events only in one namespace: AGENT_CLUSTER_RULES + AGENT_EVENT_RULES below); kept for the
# harness until it runs the agent with GPU_READY_EVENT_NAMESPACE and the namespaced Role.
AGENT_RULES: list[dict[str, Any]] = [
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "watch"]},
    {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]},
    {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
    # the chart's <release>-dra ClusterRole: the node's ResourceSlices (DRA-aware counting), listed or watched
    {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"], "verbs": ["list", "watch"]},
]

# The chart's RBAC exactly (tests/test_security.py asserts these equal the rendered templates):
# ClusterRole rules of the agent (taints off; with taints.enabled "patch" is added on nodes; "watch" is dropped
# with config.nodeWatch=false) ...
AGENT_CLUSTER_RULES: list[dict[str, Any]] = [
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "watch"]},
    {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]},
]
# ... and its Role in the Events namespace (events.namespace, "default": the only namespaces besides kube-system
# where the apiserver accepts Events about a Node). Use: service_account_client(admin, AGENT_CLUSTER_RULES,
# namespace_rules={EVENT_NAMESPACE: AGENT_EVENT_RULES}, pod_on_node=node), and run the agent with
# GPU_READY_EVENT_NAMESPACE=EVENT_NAMESPACE.
EVENT_NAMESPACE = "default"
AGENT_EVENT_RULES: list[dict[str, Any]] = [
    {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
]
PREFLIGHT_CLUSTER_RULES: list[dict[str, Any]] = [
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
]
PREFLIGHT_EVENT_RULES = AGENT_EVENT_RULES
