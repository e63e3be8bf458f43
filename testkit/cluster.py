"""Helpers on top of a real apiserver: Nodes that look like a kubelet registered them, and clients
authenticated as a ServiceAccount with a token from the TokenRequest API."""

from __future__ import annotations

import contextlib
import secrets
from datetime import UTC, datetime
from typing import Any

from agent.kube import ApiError, KubeApi


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def create_node(
    api: KubeApi,
    name: str,
    labels: dict[str, str] | None = None,
    capacity: dict[str, str] | None = None,
    allocatable: dict[str, str] | None = None,
    unschedulable: bool = False,
) -> dict[str, Any]:
    """A Node with the given labels, capacity and allocatable, and a kubelet-style Ready condition."""
    api.request(
        "POST",
        "/api/v1/nodes",
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
            "spec": {"unschedulable": unschedulable},
        },
    )
    base = {"cpu": "16", "memory": "128Gi", "pods": "110"}
    t = now_rfc3339()
    return api.patch_node_status(
        name,
        {
            "status": {
                "capacity": {**base, **(capacity or {})},
                "allocatable": {**base, **(allocatable if allocatable is not None else capacity or {})},
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "kubelet is posting ready status",
                        "lastHeartbeatTime": t,
                        "lastTransitionTime": t,
                    }
                ],
            }
        },
    )


def condition(node: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    for c in (node.get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return dict(c)
    return None


def ensure_namespace(api: KubeApi, name: str) -> None:
    with contextlib.suppress(ApiError):
        api.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})


def service_account_client(
    api: KubeApi,
    rules: list[dict[str, Any]] | None = None,
    cluster_role: str | None = None,
    namespace: str | None = None,
    name: str = "gpu-ready",
    pod_on_node: str | None = None,
    expiration_s: int = 3600,
) -> tuple[KubeApi, dict[str, Any]]:
    """Creates a ServiceAccount bound to a ClusterRole (given by name, or made from `rules`) and
    returns a client that authenticates with a TokenRequest token, optionally bound to a Pod
    scheduled on `pod_on_node` (the token then carries that node's name)."""
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
    spec: dict[str, Any] = {"audiences": [], "expirationSeconds": expiration_s}
    info: dict[str, Any] = {"namespace": ns, "service_account": name, "cluster_role": cluster_role}
    if pod_on_node is not None:
        pod_name = f"{name}-{secrets.token_hex(3)}"
        pod = api.request(
            "POST",
            f"/api/v1/namespaces/{ns}/pods",
            {
                "metadata": {"name": pod_name},
                "spec": {
                    "nodeName": pod_on_node,
                    "serviceAccountName": name,
                    "containers": [{"name": "agent", "image": "gpu-ready:test"}],
                },
            },
        )
        spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": pod_name, "uid": pod["metadata"]["uid"]}
        info["pod"] = pod_name
    spec["audiences"] = ["https://kubernetes.default.svc"]
    tr = api.request(
        "POST",
        f"/api/v1/namespaces/{ns}/serviceaccounts/{name}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
    )
    token = tr["status"]["token"]
    info["token"] = token
    cfg = api.configuration
    client = KubeApi.from_token(cfg.host, token, cfg.ssl_ca_cert)
    return client, info


AGENT_RULES: list[dict[str, Any]] = [
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]},
    {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
]  # the same rules as the chart's ClusterRole (charts/gpu-ready/templates/rbac.yaml)
