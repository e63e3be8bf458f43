"""Proof that the test fixture is a real kube-apiserver with real RBAC."""

from __future__ import annotations

import pytest

from agent.kube.client import ApiError
from testkit.cluster import condition, now_rfc3339

pytestmark = pytest.mark.apiserver

RULES = [
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]},
]


def test_status_patch_keeps_kubelet_condition_and_node_patch_is_forbidden(admin, make_node, sa_client):
    node = make_node(capacity={"nvidia.com/gpu": "8"})
    sa, _ = sa_client(rules=RULES)
    t = now_rfc3339()
    sa.patch_node_status(
        node,
        {
            "status": {
                "conditions": [
                    {
                        "type": "GPUReady",
                        "status": "True",
                        "reason": "GPUsHealthy",
                        "message": "8 GPUs healthy",
                        "lastHeartbeatTime": t,
                        "lastTransitionTime": t,
                    }
                ]
            }
        },
    )
    got = admin.get_node(node)
    assert condition(got, "Ready")["reason"] == "KubeletReady"
    assert condition(got, "GPUReady")["status"] == "True"
    assert sa.get_node(node)["metadata"]["name"] == node  # get is allowed
    with pytest.raises(ApiError) as ei:
        sa.patch_node(node, {"metadata": {"labels": {"x": "y"}}})
    assert ei.value.status == 403


def test_service_account_cannot_list_secrets(sa_client):
    sa, _ = sa_client(rules=RULES)
    with pytest.raises(ApiError) as ei:
        sa.request("GET", "/api/v1/secrets")
    assert ei.value.status == 403


def test_apiserver_reports_the_built_version(admin):
    from testkit.controlplane import k8s_version

    assert admin.request("GET", "/version")["gitVersion"] == "v" + k8s_version()
