"""Least privilege, proven on the real apiserver with the chart's own rendered RBAC and admission policies and
tokens bound to a Pod on node A: every attempt below (each verb, each patch type and server-side apply, on
nodes, nodes/status and Events) is made with the agent's, the agent-with-taints' and preflight's token, and the
observed HTTP code must be the expected one. Denied attempts must leave both Nodes unchanged; allowed ones must
take effect. The same list renders the security table in docs/deployment.md, which the test compares with the
file (GPU_READY_UPDATE_DOCS=1 rewrites it)."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.kube.client import MERGE_PATCH, STRATEGIC_MERGE, KubeApi
from testkit import security as sec
from testkit.chart import Release, apply_release, by_kind, render, serves
from testkit.cluster import (
    AGENT_CLUSTER_RULES,
    AGENT_EVENT_RULES,
    EVENT_NAMESPACE,
    PREFLIGHT_CLUSTER_RULES,
    PREFLIGHT_EVENT_RULES,
    create_node,
    now_rfc3339,
)
from testkit.controlplane import ControlPlane
from testkit.security import APPLY, JSON_PATCH, PATCH_NAMES, Req

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "deployment.md"
TABLE = sec.DocsTable(DOCS, "<!-- security-table:begin -->", "<!-- security-table:end -->", "security")
TAINT = "gpu-ready.io/gpu-not-ready"
CTYPE = "GPUReady"

# -- the baseline Nodes: what a kubelet, GPU feature discovery, an admin and the agent left there -------------

ADMIN_TAINT = {"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}
PLUGIN_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
OWN_TAINT = {"key": TAINT, "effect": "NoSchedule"}
BASE_LABELS = {
    "nvidia.com/gpu.present": "true",
    "node-restriction.kubernetes.io/pool": "a100",
    "node-role.kubernetes.io/gpu": "",
    "gpu-ready.io/needs-preflight": "true",
}
BASE_ANNOTATIONS = {"node.alpha.kubernetes.io/ttl": "0"}
BASE_STATUS = {
    "addresses": [{"type": "InternalIP", "address": "10.0.0.7"}, {"type": "Hostname", "address": "gpu-a"}],
    "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
    "nodeInfo": {
        "machineID": "m",
        "systemUUID": "s",
        "bootID": "b",
        "kernelVersion": "6.8.0",
        "osImage": "Ubuntu 24.04",
        "containerRuntimeVersion": "containerd://2.0.0",
        "kubeletVersion": "v1.36.3",
        "kubeProxyVersion": "",
        "operatingSystem": "linux",
        "architecture": "amd64",
    },
    "images": [{"names": ["nvcr.io/nvidia/k8s-device-plugin:v0.17.0"], "sizeBytes": 1000}],
}
BASE_CONDITIONS = [
    {"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory", "message": "ok"},
    {"type": CTYPE, "status": "Unknown", "reason": "Starting", "message": "first poll pending"},
]


def make_nodes(admin: KubeApi) -> tuple[str, str]:
    names = []
    for _ in range(2):
        name = f"sec-{secrets.token_hex(4)}"
        create_node(
            admin,
            name,
            BASE_LABELS,
            {"nvidia.com/gpu": "8"},
            annotations=BASE_ANNOTATIONS,
            taints=[ADMIN_TAINT, PLUGIN_TAINT, OWN_TAINT],
            status=BASE_STATUS,
            conditions=BASE_CONDITIONS,
        )
        names.append(name)
    return names[0], names[1]


def comparable(node: dict[str, Any]) -> dict[str, Any]:
    """The Node without what every write changes (resourceVersion, managedFields)."""
    return sec.without(node, "resourceVersion", "managedFields", "generation")


def cond(ctype: str = CTYPE, status: str = "True") -> dict[str, Any]:
    return sec.attempted_condition(ctype, status, reason="GPUsHealthy" if status == "True" else "Forged")


def idx(node: dict[str, Any], ctype: str) -> int:
    return next(i for i, c in enumerate(node["status"]["conditions"]) if c["type"] == ctype)


def conditions_with(node: dict[str, Any], ctype: str, new: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The node's conditions with `ctype` replaced by `new` (dropped when None)."""
    out = [c for c in node["status"]["conditions"] if c["type"] != ctype]
    return out + ([new] if new else [])


# -- one attempt ---------------------------------------------------------------------------------------


@dataclass
class Env:
    a: str  # the node the token is bound to
    b: str  # another node
    node_a: dict[str, Any]  # node A as it is before the attempt
    release_ns: str
    event: str = ""  # an Event made by the setup, if any

    @property
    def taints(self) -> list[dict[str, Any]]:
        return list((self.node_a.get("spec") or {}).get("taints") or [])


@dataclass
class Attempt:
    token: str  # agent | agent, taints on | preflight | agent, token not bound to a pod
    what: str
    make: Callable[[Env], Req]
    expect: int
    effect: Callable[[dict[str, Any], Env], bool] | None = None  # allowed node writes: the change is there
    setup: Callable[[KubeApi, Env], None] | None = None  # as admin, before the attempt


def strategic(sub: str, body: Any) -> Req:
    return Req("PATCH", "/api/v1/nodes/{A}" + sub, body, STRATEGIC_MERGE)


def merge(sub: str, body: Any) -> Req:
    return Req("PATCH", "/api/v1/nodes/{A}" + sub, body, MERGE_PATCH)


def jpatch(sub: str, ops: list[dict[str, Any]]) -> Req:
    return Req("PATCH", "/api/v1/nodes/{A}" + sub, ops, JSON_PATCH)


def apply(sub: str, node: str, body: dict[str, Any], manager: str = "attempt") -> Req:
    """Server-side apply as field manager `manager`. A write of the Node itself with any field manager but
    gpu-ready's own adds a managedFields entry, which the policies refuse (tests/test_security_bounds.py, hole 7)."""
    obj = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, **body.pop("metadata", {})}, **body}
    return Req("PATCH", "/api/v1/nodes/{A}" + sub, json.dumps(obj), APPLY, {"fieldManager": manager, "force": "true"})


def watch_nodes(selector: str) -> Req:
    """A Node watch as the agent opens it (from the apiserver's cache, ended by the server after a second)."""
    return Req("GET", f"/api/v1/nodes?watch=1&resourceVersion=0&timeoutSeconds=1{selector}")


def on_b(req: Req) -> Req:
    req.path = req.path.replace("{A}", "{B}")
    return req


def event_body(e: Env, node: str | None = None, **over: Any) -> dict[str, Any]:
    body = {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": f"{e.a}.{secrets.token_hex(6)}"},
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "reportingController": "gpu-ready",
        "reportingInstance": f"gpu-ready-{e.a}",
        "action": "Detected",
        "reason": "XidFatal",
        "regarding": {"apiVersion": "v1", "kind": "Node", "name": node or e.a},
        "type": "Warning",
        "note": "attempt",
    }
    body.update(over)
    return body


def admin_event(controller: str) -> Callable[[KubeApi, Env], None]:
    def setup(admin: KubeApi, e: Env) -> None:
        body = event_body(e, reportingController=controller, reportingInstance=f"{controller}-{e.a}")
        e.event = body["metadata"]["name"]
        admin.create_event(EVENT_NAMESPACE, body)

    return setup


def has_cond(ctype: str, status: str) -> Callable[[dict[str, Any], Env], bool]:
    return lambda n, e: any(c["type"] == ctype and c["status"] == status for c in n["status"]["conditions"])


def others(e: Env) -> list[dict[str, Any]]:
    """The taints on node A that are not gpu-ready's (an admin's, the device plugin's, the node lifecycle's)."""
    return [t for t in e.taints if t["key"] != TAINT]


def taint_idx(e: Env, key: str) -> int:
    return next(i for i, t in enumerate(e.taints) if t["key"] == key)


def own_taints_are(*own: dict[str, str]) -> Callable[[dict[str, Any], Env], bool]:
    """The effect of an allowed taint write: gpu-ready's entries are `own`, every other taint is as it was."""

    def check(n: dict[str, Any], e: Env) -> bool:
        now = [{k: v for k, v in t.items() if k != "timeAdded"} for t in (n.get("spec") or {}).get("taints", [])]
        return [t for t in now if t["key"] != TAINT] == others(e) and [t for t in now if t["key"] == TAINT] == list(own)

    return check


AG, AT, PF, UB = "agent", "agent, taints on", "preflight", "agent, token not bound to a pod"
SLICES_OF_A = "spec.nodeName={A},spec.driver=gpu.nvidia.com"
NO_EXEC = {"key": TAINT, "effect": "NoExecute"}
SERIES = {"series": {"count": 2, "lastObservedTime": "2026-01-01T00:00:05.000000Z"}}

ATTEMPTS: list[Attempt] = [
    # ---- the agent: its own GPUReady condition, every patch type -----------------------------------------
    Attempt(
        AG,
        f"set {CTYPE}",
        lambda e: strategic("/status", {"status": {"conditions": [cond()]}}),
        200,
        has_cond(CTYPE, "True"),
    ),
    Attempt(
        AG,
        f"set {CTYPE} (the whole list, others as they are)",
        lambda e: merge("/status", {"status": {"conditions": conditions_with(e.node_a, CTYPE, cond())}}),
        200,
        has_cond(CTYPE, "True"),
    ),
    Attempt(
        AG,
        f"replace {CTYPE}",
        lambda e: jpatch(
            "/status", [{"op": "replace", "path": f"/status/conditions/{idx(e.node_a, CTYPE)}", "value": cond()}]
        ),
        200,
        has_cond(CTYPE, "True"),
    ),
    Attempt(
        AG,
        f"set {CTYPE}",
        lambda e: apply("/status", e.a, {"status": {"conditions": [cond()]}}),
        200,
        has_cond(CTYPE, "True"),
    ),
    Attempt(
        AG,
        f"remove {CTYPE}",
        lambda e: jpatch("/status", [{"op": "remove", "path": f"/status/conditions/{idx(e.node_a, CTYPE)}"}]),
        200,
        lambda n, e: all(c["type"] != CTYPE for c in n["status"]["conditions"]),
    ),
    Attempt(
        AG, f"set {CTYPE} on node B", lambda e: on_b(strategic("/status", {"status": {"conditions": [cond()]}})), 403
    ),
    Attempt(
        AG, f"set {CTYPE} on node B", lambda e: on_b(apply("/status", e.b, {"status": {"conditions": [cond()]}})), 403
    ),
    # ---- the agent: kubelet's conditions ----------------------------------------------------------------
    Attempt(
        AG,
        "forge Ready=False",
        lambda e: strategic("/status", {"status": {"conditions": [cond("Ready", "False")]}}),
        403,
    ),
    Attempt(
        AG,
        "forge Ready=False",
        lambda e: merge(
            "/status", {"status": {"conditions": conditions_with(e.node_a, "Ready", cond("Ready", "False"))}}
        ),
        403,
    ),
    Attempt(
        AG,
        "forge Ready=False",
        lambda e: jpatch(
            "/status",
            [{"op": "replace", "path": f"/status/conditions/{idx(e.node_a, 'Ready')}/status", "value": "False"}],
        ),
        403,
    ),
    Attempt(
        AG,
        "forge Ready=False",
        lambda e: apply("/status", e.a, {"status": {"conditions": [cond("Ready", "False")]}}),
        403,
    ),
    Attempt(
        AG,
        "remove Ready",
        lambda e: jpatch("/status", [{"op": "remove", "path": f"/status/conditions/{idx(e.node_a, 'Ready')}"}]),
        403,
    ),
    Attempt(
        AG,
        "remove Ready",
        lambda e: strategic("/status", {"status": {"conditions": [{"type": "Ready", "$patch": "delete"}]}}),
        403,
    ),
    Attempt(
        AG,
        f"only {CTYPE} in the list (drops Ready, MemoryPressure)",
        lambda e: merge("/status", {"status": {"conditions": [cond()]}}),
        403,
    ),
    Attempt(
        AG,
        f"set {CTYPE} and forge Ready in one patch",
        lambda e: strategic("/status", {"status": {"conditions": [cond(), cond("Ready", "False")]}}),
        403,
    ),
    Attempt(
        AG,
        "change MemoryPressure",
        lambda e: strategic("/status", {"status": {"conditions": [cond("MemoryPressure", "True")]}}),
        403,
    ),
    Attempt(
        AG,
        "add another condition type",
        lambda e: strategic("/status", {"status": {"conditions": [cond("NetworkUnavailable")]}}),
        403,
    ),
    # ---- the agent: metadata through nodes/status ----------------------------------------------------------
    Attempt(
        AG,
        "label preflight=passed",
        lambda e: strategic("/status", {"metadata": {"labels": {"preflight": "passed"}}}),
        403,
    ),
    Attempt(
        AG, "label preflight=passed", lambda e: merge("/status", {"metadata": {"labels": {"preflight": "passed"}}}), 403
    ),
    Attempt(
        AG,
        "label preflight=passed",
        lambda e: jpatch("/status", [{"op": "add", "path": "/metadata/labels/preflight", "value": "passed"}]),
        403,
    ),
    Attempt(
        AG,
        "label preflight=passed",
        lambda e: apply("/status", e.a, {"metadata": {"labels": {"preflight": "passed"}}}),
        403,
    ),
    Attempt(
        AG,
        "label node-restriction.kubernetes.io/pool",
        lambda e: strategic("/status", {"metadata": {"labels": {"node-restriction.kubernetes.io/pool": "x"}}}),
        403,
    ),
    Attempt(
        AG,
        "remove label nvidia.com/gpu.present",
        lambda e: jpatch("/status", [{"op": "remove", "path": "/metadata/labels/nvidia.com~1gpu.present"}]),
        403,
    ),
    Attempt(
        AG,
        "remove label nvidia.com/gpu.present",
        lambda e: merge("/status", {"metadata": {"labels": {"nvidia.com/gpu.present": None}}}),
        403,
    ),
    Attempt(
        AG,
        "annotate gpu-ready.io/clear-before",
        lambda e: strategic("/status", {"metadata": {"annotations": {"gpu-ready.io/clear-before": now_rfc3339()}}}),
        403,
    ),
    Attempt(
        AG,
        "annotate gpu-ready.io/clear-before",
        lambda e: apply("/status", e.a, {"metadata": {"annotations": {"gpu-ready.io/clear-before": now_rfc3339()}}}),
        403,
    ),
    Attempt(
        AG,
        "add a finalizer",
        lambda e: jpatch("/status", [{"op": "add", "path": "/metadata/finalizers", "value": ["x.io/hold"]}]),
        403,
    ),
    Attempt(
        AG,
        "add an ownerReference",
        lambda e: merge(
            "/status",
            {
                "metadata": {
                    "ownerReferences": [
                        {
                            "apiVersion": "v1",
                            "kind": "Namespace",
                            "name": "default",
                            "uid": "00000000-0000-0000-0000-000000000001",
                        }
                    ]
                }
            },
        ),
        403,
    ),
    # ---- the agent: the rest of the status -------------------------------------------------------------------
    Attempt(
        AG,
        "capacity nvidia.com/gpu: 1000",
        lambda e: strategic("/status", {"status": {"capacity": {"nvidia.com/gpu": "1000"}}}),
        403,
    ),
    Attempt(
        AG,
        "capacity nvidia.com/gpu: 1000",
        lambda e: apply("/status", e.a, {"status": {"capacity": {"nvidia.com/gpu": "1000"}}}),
        403,
    ),
    Attempt(
        AG,
        "allocatable nvidia.com/gpu: 1000",
        lambda e: merge("/status", {"status": {"allocatable": {"nvidia.com/gpu": "1000"}}}),
        403,
    ),
    Attempt(
        AG,
        "allocatable nvidia.com/gpu: 1000",
        lambda e: jpatch(
            "/status", [{"op": "replace", "path": "/status/allocatable/nvidia.com~1gpu", "value": "1000"}]
        ),
        403,
    ),
    Attempt(
        AG,
        "change status.addresses",
        lambda e: strategic("/status", {"status": {"addresses": [{"type": "InternalIP", "address": "10.9.9.9"}]}}),
        403,
    ),
    Attempt(
        AG,
        "change status.daemonEndpoints",
        lambda e: merge("/status", {"status": {"daemonEndpoints": {"kubeletEndpoint": {"Port": 1}}}}),
        403,
    ),
    Attempt(
        AG,
        "change status.nodeInfo",
        lambda e: strategic("/status", {"status": {"nodeInfo": {"kubeletVersion": "v9.9.9"}}}),
        403,
    ),
    Attempt(
        AG,
        "add to status.images",
        lambda e: jpatch(
            "/status", [{"op": "add", "path": "/status/images/-", "value": {"names": ["evil:1"], "sizeBytes": 1}}]
        ),
        403,
    ),
    # ---- the agent: everything else ----------------------------------------------------------------------------
    Attempt(AG, "read node A", lambda e: Req("GET", "/api/v1/nodes/{A}"), 200),
    Attempt(AG, "read node B (RBAC cannot limit reads to one node)", lambda e: Req("GET", "/api/v1/nodes/{B}"), 200),
    Attempt(AG, "watch node A (the own-Node cache)", lambda e: watch_nodes(f"&fieldSelector=metadata.name={e.a}"), 200),
    Attempt(
        AG,
        "watch node B (RBAC cannot limit watch to one node)",
        lambda e: watch_nodes(f"&fieldSelector=metadata.name={e.b}"),
        200,
    ),
    Attempt(AG, "watch every node (RBAC cannot require a field selector)", lambda e: watch_nodes(""), 200),
    Attempt(AG, "list nodes", lambda e: Req("GET", "/api/v1/nodes"), 403),
    Attempt(
        AG, "label the Node object", lambda e: strategic("", {"metadata": {"labels": {"preflight": "passed"}}}), 403
    ),
    Attempt(AG, "cordon", lambda e: merge("", {"spec": {"unschedulable": True}}), 403),
    Attempt(
        AG,
        f"add the {TAINT} taint (taints off)",
        lambda e: jpatch("", [{"op": "add", "path": "/spec/taints/-", "value": NO_EXEC}]),
        403,
    ),
    Attempt(AG, "replace the status (update)", lambda e: Req("PUT", "/api/v1/nodes/{A}/status", e.node_a), 403),
    Attempt(AG, "delete node B", lambda e: Req("DELETE", "/api/v1/nodes/{B}"), 403),
    Attempt(
        AG,
        "create a node",
        lambda e: Req("POST", "/api/v1/nodes", {"metadata": {"name": f"forged-{secrets.token_hex(3)}"}}),
        403,
    ),
    Attempt(AG, "list secrets", lambda e: Req("GET", "/api/v1/secrets"), 403),
    Attempt(AG, "list pods", lambda e: Req("GET", "/api/v1/pods"), 403),
    # ---- the agent's Events -------------------------------------------------------------------------------------
    Attempt(
        AG,
        "Event about node A, reportingController gpu-ready",
        lambda e: Req("POST", "/apis/events.k8s.io/v1/namespaces/{events}/events", event_body(e)),
        201,
    ),
    Attempt(
        AG,
        "add a series to its own Event",
        lambda e: Req("PATCH", "/apis/events.k8s.io/v1/namespaces/{events}/events/" + e.event, SERIES, MERGE_PATCH),
        200,
        setup=admin_event("gpu-ready"),
    ),
    Attempt(
        AG,
        "Event about node B",
        lambda e: Req("POST", "/apis/events.k8s.io/v1/namespaces/{events}/events", event_body(e, e.b)),
        403,
    ),
    Attempt(
        AG,
        "Event about a Pod",
        lambda e: Req(
            "POST",
            "/apis/events.k8s.io/v1/namespaces/{events}/events",
            event_body(e, regarding={"apiVersion": "v1", "kind": "Pod", "namespace": EVENT_NAMESPACE, "name": "x"}),
        ),
        403,
    ),
    Attempt(
        AG,
        "Event with reportingController kubelet",
        lambda e: Req(
            "POST", "/apis/events.k8s.io/v1/namespaces/{events}/events", event_body(e, reportingController="kubelet")
        ),
        403,
    ),
    Attempt(
        AG,
        "Event related to another object",
        lambda e: Req(
            "POST",
            "/apis/events.k8s.io/v1/namespaces/{events}/events",
            event_body(e, related={"apiVersion": "v1", "kind": "Node", "name": e.b}),
        ),
        403,
    ),
    Attempt(
        AG,
        "patch kubelet's Event about node A",
        lambda e: Req("PATCH", "/apis/events.k8s.io/v1/namespaces/{events}/events/" + e.event, SERIES, MERGE_PATCH),
        403,
        setup=admin_event("kubelet"),
    ),
    Attempt(
        AG,
        "Event in kube-system",
        lambda e: Req("POST", "/apis/events.k8s.io/v1/namespaces/kube-system/events", event_body(e)),
        403,
    ),
    Attempt(
        AG,
        "Event in the release namespace",
        lambda e: Req("POST", "/apis/events.k8s.io/v1/namespaces/{ns}/events", event_body(e)),
        403,
    ),
    Attempt(
        AG,
        "core/v1 Event about node A",
        lambda e: Req(
            "POST",
            "/api/v1/namespaces/{events}/events",
            {
                "metadata": {"name": f"{e.a}.{secrets.token_hex(6)}"},
                "involvedObject": {"kind": "Node", "name": e.a},
                "reason": "XidFatal",
                "message": "attempt",
                "type": "Warning",
                "source": {"component": "gpu-ready"},
            },
        ),
        403,
    ),
    Attempt(
        AG,
        "delete its own Event",
        lambda e: Req("DELETE", "/apis/events.k8s.io/v1/namespaces/{events}/events/" + e.event),
        403,
        setup=admin_event("gpu-ready"),
    ),
    Attempt(AG, "list Events", lambda e: Req("GET", "/apis/events.k8s.io/v1/namespaces/{events}/events"), 403),
    # ---- a token of the agent's ServiceAccount that is not bound to a pod on a node -------------------------------
    Attempt(UB, f"set {CTYPE} on node A", lambda e: strategic("/status", {"status": {"conditions": [cond()]}}), 403),
    Attempt(
        UB,
        "Event about node A",
        lambda e: Req("POST", "/apis/events.k8s.io/v1/namespaces/{events}/events", event_body(e)),
        403,
    ),
    # ---- the agent with taints.enabled: only its own taint entries ---------------------------------------------
    Attempt(
        AT,
        f"add {TAINT}:NoExecute (taints.noExecuteOnFatal off)",
        lambda e: jpatch("", [{"op": "add", "path": "/spec/taints/-", "value": NO_EXEC}]),
        403,
    ),
    Attempt(
        AT,
        f"remove its {TAINT}:NoSchedule",
        lambda e: jpatch("", [{"op": "remove", "path": f"/spec/taints/{taint_idx(e, TAINT)}"}]),
        200,
        own_taints_are(),
    ),
    Attempt(
        AT,
        f"change its taint to {TAINT}:NoExecute (taints.noExecuteOnFatal off)",
        lambda e: strategic("", {"spec": {"taints": [*others(e), NO_EXEC]}}),
        403,
    ),
    Attempt(
        AT,
        f"change its taint to {TAINT}:NoExecute (taints.noExecuteOnFatal off)",
        lambda e: merge("", {"spec": {"taints": [*others(e), NO_EXEC]}}),
        403,
    ),
    Attempt(
        AT,
        f"change its taint to {TAINT}:NoExecute (taints.noExecuteOnFatal off)",
        lambda e: apply("", e.a, {"spec": {"taints": [*others(e), NO_EXEC]}}),
        403,
    ),
    Attempt(
        AT,
        f"add {TAINT}:NoSchedule again after removing it",
        lambda e: merge("", {"spec": {"taints": [*others(e), OWN_TAINT]}}),
        200,
        own_taints_are(OWN_TAINT),
        setup=lambda admin, e: admin.request(
            "PATCH", f"/api/v1/nodes/{e.a}", {"spec": {"taints": others(e)}}, MERGE_PATCH
        ),
    ),
    Attempt(
        AT,
        "remove the admin's taint",
        lambda e: jpatch("", [{"op": "remove", "path": f"/spec/taints/{taint_idx(e, 'dedicated')}"}]),
        403,
    ),
    Attempt(
        AT,
        "remove the device plugin's taint",
        lambda e: strategic("", {"spec": {"taints": [t for t in e.taints if t["key"] != "nvidia.com/gpu"]}}),
        403,
    ),
    Attempt(AT, "remove every taint", lambda e: merge("", {"spec": {"taints": []}}), 403),
    Attempt(
        AT,
        "apply only its own taint (drops the others)",
        lambda e: apply("", e.a, {"spec": {"taints": [NO_EXEC]}}),
        403,
    ),
    Attempt(
        AT,
        "change the admin's taint effect",
        lambda e: jpatch(
            "",
            [
                {
                    "op": "replace",
                    "path": f"/spec/taints/{taint_idx(e, 'dedicated')}/effect",
                    "value": "PreferNoSchedule",
                }
            ],
        ),
        403,
    ),
    Attempt(
        AT,
        "add another key's taint",
        lambda e: jpatch(
            "", [{"op": "add", "path": "/spec/taints/-", "value": {"key": "evil", "effect": "NoExecute"}}]
        ),
        403,
    ),
    Attempt(
        AT,
        "reorder the other taints",
        lambda e: merge("", {"spec": {"taints": [*reversed(others(e)), OWN_TAINT]}}),
        403,
    ),
    Attempt(
        AT,
        f"add {TAINT} on node B",
        lambda e: on_b(jpatch("", [{"op": "add", "path": "/spec/taints/-", "value": NO_EXEC}])),
        403,
    ),
    Attempt(
        AT,
        f"add {TAINT} and cordon in one patch",
        lambda e: merge("", {"spec": {"unschedulable": True, "taints": [*e.taints, NO_EXEC]}}),
        403,
    ),
    Attempt(AT, "cordon", lambda e: merge("", {"spec": {"unschedulable": True}}), 403),
    Attempt(AT, "set spec.providerID", lambda e: merge("", {"spec": {"providerID": "aws:///x/i-1"}}), 403),
    Attempt(
        AT, "label the Node object", lambda e: strategic("", {"metadata": {"labels": {"preflight": "passed"}}}), 403
    ),
    Attempt(
        AT, "label the Node object", lambda e: apply("", e.a, {"metadata": {"labels": {"preflight": "passed"}}}), 403
    ),
    Attempt(
        AT,
        "forge Ready=False",
        lambda e: strategic("/status", {"status": {"conditions": [cond("Ready", "False")]}}),
        403,
    ),
    Attempt(
        AT,
        f"set {CTYPE}",
        lambda e: strategic("/status", {"status": {"conditions": [cond()]}}),
        200,
        has_cond(CTYPE, "True"),
    ),
    # ---- preflight: its label, its annotations, cordon --------------------------------------------------------
    Attempt(
        PF,
        "what a pass writes: preflight=passed, annotations, uncordon, drop needs-preflight",
        lambda e: strategic(
            "",
            {
                "metadata": {
                    "labels": {"preflight": "passed", "gpu-ready.io/needs-preflight": None},
                    "annotations": {
                        "gpu-ready.io/preflight-time": now_rfc3339(),
                        "gpu-ready.io/preflight-report": "{}",
                        "gpu-ready.io/preflight-cordoned": None,
                    },
                },
                "spec": {"unschedulable": False},
            },
        ),
        200,
        lambda n, e: (
            n["metadata"]["labels"].get("preflight") == "passed"
            and "gpu-ready.io/needs-preflight" not in n["metadata"]["labels"]
        ),
    ),
    Attempt(
        PF,
        "what a failure writes: preflight=failed, cordon",
        lambda e: merge(
            "",
            {
                "metadata": {
                    "labels": {"preflight": "failed"},
                    "annotations": {"gpu-ready.io/preflight-cordoned": "true"},
                },
                "spec": {"unschedulable": True},
            },
        ),
        200,
        lambda n, e: n["metadata"]["labels"].get("preflight") == "failed" and n["spec"].get("unschedulable") is True,
    ),
    Attempt(
        PF,
        "remove needs-preflight",
        lambda e: jpatch("", [{"op": "remove", "path": "/metadata/labels/gpu-ready.io~1needs-preflight"}]),
        200,
        lambda n, e: "gpu-ready.io/needs-preflight" not in n["metadata"]["labels"],
    ),
    Attempt(
        PF,
        "label preflight=passed",
        lambda e: apply("", e.a, {"metadata": {"labels": {"preflight": "passed"}}}, "gpu-ready"),
        200,
        lambda n, e: n["metadata"]["labels"].get("preflight") == "passed",
    ),
    Attempt(PF, "label preflight=yes", lambda e: strategic("", {"metadata": {"labels": {"preflight": "yes"}}}), 403),
    Attempt(
        PF,
        "change needs-preflight to false",
        lambda e: strategic("", {"metadata": {"labels": {"gpu-ready.io/needs-preflight": "false"}}}),
        403,
    ),
    Attempt(
        PF,
        "label node-restriction.kubernetes.io/pool",
        lambda e: strategic("", {"metadata": {"labels": {"node-restriction.kubernetes.io/pool": "h100"}}}),
        403,
    ),
    Attempt(
        PF,
        "label node-restriction.kubernetes.io/pool",
        lambda e: apply("", e.a, {"metadata": {"labels": {"node-restriction.kubernetes.io/pool": "h100"}}}),
        403,
    ),
    Attempt(
        PF,
        "label node-role.kubernetes.io/control-plane",
        lambda e: merge("", {"metadata": {"labels": {"node-role.kubernetes.io/control-plane": ""}}}),
        403,
    ),
    Attempt(
        PF,
        "remove label nvidia.com/gpu.present",
        lambda e: jpatch("", [{"op": "remove", "path": "/metadata/labels/nvidia.com~1gpu.present"}]),
        403,
    ),
    Attempt(
        PF,
        "annotate gpu-ready.io/clear-before",
        lambda e: strategic("", {"metadata": {"annotations": {"gpu-ready.io/clear-before": now_rfc3339()}}}),
        403,
    ),
    Attempt(
        PF,
        "remove another annotation",
        lambda e: merge("", {"metadata": {"annotations": {"node.alpha.kubernetes.io/ttl": None}}}),
        403,
    ),
    Attempt(PF, "set spec.providerID", lambda e: merge("", {"spec": {"providerID": "aws:///x/i-1"}}), 403),
    Attempt(PF, "set spec.podCIDR", lambda e: strategic("", {"spec": {"podCIDR": "10.244.9.0/24"}}), 403),
    Attempt(PF, "remove every taint", lambda e: strategic("", {"spec": {"taints": []}}), 403),
    Attempt(PF, "remove every taint", lambda e: jpatch("", [{"op": "remove", "path": "/spec/taints"}]), 403),
    Attempt(PF, "remove every taint", lambda e: apply("", e.a, {"spec": {"taints": []}}), 403),
    Attempt(PF, f"add {TAINT}", lambda e: jpatch("", [{"op": "add", "path": "/spec/taints/-", "value": NO_EXEC}]), 403),
    Attempt(
        PF,
        "add a finalizer",
        lambda e: jpatch("", [{"op": "add", "path": "/metadata/finalizers", "value": ["x.io/hold"]}]),
        403,
    ),
    Attempt(
        PF,
        "label preflight=passed on node B",
        lambda e: on_b(strategic("", {"metadata": {"labels": {"preflight": "passed"}}})),
        403,
    ),
    Attempt(PF, "cordon node B", lambda e: on_b(merge("", {"spec": {"unschedulable": True}})), 403),
    Attempt(PF, f"set {CTYPE}", lambda e: strategic("/status", {"status": {"conditions": [cond()]}}), 403),
    Attempt(PF, "delete node A", lambda e: Req("DELETE", "/api/v1/nodes/{A}"), 403),
    Attempt(
        PF,
        "PreflightFailed Event about node A",
        lambda e: Req(
            "POST", "/apis/events.k8s.io/v1/namespaces/{events}/events", event_body(e, reason="PreflightFailed")
        ),
        201,
    ),
    Attempt(
        PF,
        "Event about node B",
        lambda e: Req("POST", "/apis/events.k8s.io/v1/namespaces/{events}/events", event_body(e, e.b)),
        403,
    ),
    Attempt(
        PF,
        "Event in kube-system",
        lambda e: Req("POST", "/apis/events.k8s.io/v1/namespaces/kube-system/events", event_body(e)),
        403,
    ),
    # ---- the agent: its node's DRA ResourceSlices (fencing.countFromResourceSlices, on by default) ---------------
    Attempt(
        AG,
        "list node A's ResourceSlices (the fallback while the watch is not kept)",
        lambda e: Req("GET", f"/apis/resource.k8s.io/v1/resourceslices?resourceVersion=0&fieldSelector={SLICES_OF_A}"),
        200,
    ),
    Attempt(
        AG,
        "watch node A's ResourceSlices (the slice cache; RBAC cannot narrow it to the node)",
        lambda e: Req(
            "GET",
            "/apis/resource.k8s.io/v1/resourceslices?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan"
            f"&resourceVersion=0&timeoutSeconds=1&fieldSelector={SLICES_OF_A}",
        ),
        200,
    ),
]


DRY_NODE = {  # enough of a Node to build each request for the table
    "spec": {"taints": [ADMIN_TAINT, PLUGIN_TAINT, OWN_TAINT]},
    "status": {"conditions": [{"type": t} for t in ("Ready", "MemoryPressure", CTYPE)]},
}


def request_text(a: Attempt) -> str:
    """The request column: method, path with placeholders, patch type (from a dry build of the request)."""
    env = Env("{A}", "{B}", DRY_NODE, "{ns}", "{name}")
    r = a.make(env)  # paths with {A}, {B}, {ns}, {events} placeholders
    return sec.request_column(r, r.path.replace("{events}", EVENT_NAMESPACE).replace("{ns}", "<release ns>"))


def table(observed: list[tuple[int, str]]) -> str:
    lines = [
        "| # | token | request | attempt | expected | observed | denied by |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, (a, (code, by)) in enumerate(zip(ATTEMPTS, observed, strict=True), 1):
        lines.append(f"| {i} | {a.token} | {request_text(a)} | {a.what} | {a.expect} | {code} | {by} |")
    return "\n".join(lines)


# -- the chart on the apiserver ----------------------------------------------------------------------------


@dataclass
class Cluster:
    cp: ControlPlane
    admin: KubeApi
    plain: Release  # defaults + preflight
    taints: Release  # taints.enabled=true

    def token(self, who: str, node: str | None) -> KubeApi:
        rel = self.taints if who == AT else self.plain
        return sec.bound_client(self.cp, self.admin, rel, who == PF, None if who == UB else node)


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Any:
    kc = control_plane.kubeconfig(tmp_path_factory.mktemp("sec") / "admin")
    plain = apply_release(
        control_plane, kc, "sec", ["--set", "preflight.enabled=true", "--set", "preflight.nodeName=any"]
    )
    taints = apply_release(control_plane, kc, "sect", ["--set", "taints.enabled=true"])
    admin = control_plane.admin()
    c = Cluster(control_plane, admin, plain, taints)
    a0, b0 = make_nodes(admin)
    probes = {
        AG: lambda api: api.patch_node_status(b0, {"status": {"conditions": [cond()]}}),
        AT: lambda api: api.patch_node_status(b0, {"status": {"conditions": [cond()]}}),
        PF: lambda api: api.patch_node(b0, {"metadata": {"labels": {"preflight": "passed"}}}),
    }
    policy = {AG: f"{plain.fullname}-own-node-only", AT: f"{taints.fullname}-own-node-only"}
    policy[PF] = f"{plain.fullname}-preflight-own-node-only"
    for who, probe in probes.items():
        sec.wait_policy_loaded(c.token(who, a0), probe, policy[who], f"{who} admission policy")
    env = Env(a0, b0, {}, plain.ns)
    sec.wait_policy_loaded(
        c.token(AG, a0),
        lambda api: api.create_event(EVENT_NAMESPACE, event_body(env, b0)),
        f"{plain.fullname}-own-events-only",
        "Events admission policy",
    )
    yield c
    admin.close()


def attempt(c: Cluster, a: Attempt) -> tuple[int, str, str]:
    """Makes one attempt on fresh nodes; returns (observed code, denied by, problem or "")."""
    node_a, node_b = make_nodes(c.admin)
    env = Env(node_a, node_b, c.admin.get_node(node_a), c.plain.ns)
    if a.setup:
        a.setup(c.admin, env)
    req = a.make(env)
    path = req.path.format(A=node_a, B=node_b, ns=c.plain.ns, events=EVENT_NAMESPACE)
    if path.startswith("/apis/resource.k8s.io/v1/"):  # DRA: not served by an older minor (make test-oldest)
        resource = path.split("?")[0].split("/")[4]
        if not serves(c.admin, "resource.k8s.io/v1", resource):
            return 0, "skipped", f"resource.k8s.io/v1 {resource} is not served by this kube-apiserver"
    effect = a.effect
    result = sec.observe(
        c.token(a.token, node_a),
        req,
        path,
        a.expect,
        lambda: {n: comparable(c.admin.get_node(n)) for n in (node_a, node_b)},
        None if effect is None else lambda: effect(c.admin.get_node(node_a), env),
        req.method in ("PATCH", "PUT") and "/nodes/" in path,
    )
    sec.delete_nodes(c.admin, [node_a, node_b])
    return result


@pytest.mark.apiserver
def test_every_attempt_gets_the_expected_code_and_nothing_escapes(cluster):
    observed: list[tuple[int, str]] = []
    problems: list[str] = []
    t0 = time.monotonic()
    skipped: list[str] = []
    for i, a in enumerate(ATTEMPTS, 1):
        code, by, problem = attempt(cluster, a)
        observed.append((code, by))
        if by == "skipped":
            skipped.append(f"#{i} ({problem})")
        elif problem:
            problems.append(f"#{i} [{a.token}] {a.what} {request_text(a)}: {problem}")
    escapes = sum(1 for a, (code, _) in zip(ATTEMPTS, observed, strict=True) if a.expect >= 400 and code < 400)
    allowed = sum(1 for a in ATTEMPTS if a.expect < 400)
    print(
        f"\n[security] {len(ATTEMPTS)} attempts ({allowed} expected allowed, {len(ATTEMPTS) - allowed} expected "
        f"denied) in {time.monotonic() - t0:.1f}s; escapes: {escapes}; mismatches: {len(problems)}"
    )
    TABLE.conclude(problems, skipped, "needing a newer Kubernetes minor", lambda: table(observed))


def test_every_attempt_is_listed_once_with_a_known_token():
    sec.listed_once([(a.token, a.what, request_text(a)) for a in ATTEMPTS])
    assert all(a.token in (AG, AT, PF, UB) and a.expect in (200, 201, 403) for a in ATTEMPTS)
    kinds = {PATCH_NAMES.get(a.make(Env("a", "b", DRY_NODE, "n")).content_type) for a in ATTEMPTS}
    assert {"strategic merge", "merge", "JSON patch", "apply"} <= kinds


# -- the rendered chart ---------------------------------------------------------------------------------------


def test_chart_rbac_is_the_testkit_rbac_and_events_are_namespaced():
    # the uninstall hook's own Role and RoleBinding live in the release namespace: tests/test_uninstall.py
    docs = render(["--set", "preflight.enabled=true", "--set", "uninstall.enabled=false"])
    roles, cluster_roles = by_kind(docs, "Role"), by_kind(docs, "ClusterRole")
    assert cluster_roles["gpu-ready"]["rules"] == AGENT_CLUSTER_RULES
    assert cluster_roles["gpu-ready-preflight"]["rules"] == PREFLIGHT_CLUSTER_RULES
    assert roles["gpu-ready-events"]["rules"] == AGENT_EVENT_RULES
    assert roles["gpu-ready-preflight-events"]["rules"] == PREFLIGHT_EVENT_RULES
    assert {r["metadata"]["namespace"] for r in roles.values()} == {EVENT_NAMESPACE}
    for b in by_kind(docs, "RoleBinding").values():
        assert b["metadata"]["namespace"] == EVENT_NAMESPACE and b["subjects"][0]["namespace"] == "gpu-ready"
    assert not any("events" in r["resources"] for cr in cluster_roles.values() for r in cr["rules"])
    tainted = by_kind(render(["--set", "taints.enabled=true"]), "ClusterRole")["gpu-ready"]["rules"]
    assert tainted[0] == {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "watch", "patch"]}
    ks = render(["--set", "events.namespace=kube-system"])
    assert by_kind(ks, "Role")["gpu-ready-events"]["metadata"]["namespace"] == "kube-system"
    env = {
        e["name"]: e for e in by_kind(ks, "DaemonSet")["gpu-ready"]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["GPU_READY_EVENT_NAMESPACE"]["value"] == "kube-system"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_condition_type_and_taint_key_reach_the_policy():
    docs = render(["--set", "conditionType=nvidia.com/GPUReady", "--set", "taints.enabled=true"])
    text = yaml.safe_dump(by_kind(docs, "ValidatingAdmissionPolicy")["gpu-ready-own-node-only"])
    assert 'c.type != "nvidia.com/GPUReady"' in text and f't.key != "{TAINT}"' in text
    off = yaml.safe_dump(by_kind(render([]), "ValidatingAdmissionPolicy")["gpu-ready-own-node-only"])
    assert f't.key != "{TAINT}"' not in off, "with taints off no taint entry may change"
    assert render(["--set", "nodeRestriction.enabled=false"]) and not by_kind(
        render(["--set", "nodeRestriction.enabled=false"]), "ValidatingAdmissionPolicy"
    )


@pytest.mark.apiserver
def test_the_policies_cover_every_node_field_of_this_kubernetes(control_plane, admin):
    """A Kubernetes that adds a NodeStatus or NodeSpec field must fail here until the policy compares it."""
    schemas = admin.request("GET", "/openapi/v3/api/v1")["components"]["schemas"]
    status = set(schemas["io.k8s.api.core.v1.NodeStatus"]["properties"]) - {"conditions"}
    spec = set(schemas["io.k8s.api.core.v1.NodeSpec"]["properties"]) - {"taints", "unschedulable"}
    policies = by_kind(render(["--set", "preflight.enabled=true"]), "ValidatingAdmissionPolicy")
    agent = json.dumps(policies["gpu-ready-own-node-only"]["spec"]["validations"])
    preflight = json.dumps(policies["gpu-ready-preflight-own-node-only"]["spec"]["validations"])
    for f in sorted(status):
        assert f"object.status.?{f} == oldObject.status.?{f}" in agent, f"agent policy misses status.{f}"
    for f in sorted(spec | {"unschedulable"}):
        assert f"object.spec.?{f} == oldObject.spec.?{f}" in agent, f"agent policy misses spec.{f}"
    for f in sorted(spec):
        assert f"object.spec.?{f} == oldObject.spec.?{f}" in preflight, f"preflight policy misses spec.{f}"
    assert "object.spec.?taints == oldObject.spec.?taints && object.status == oldObject.status" in preflight


def test_preflight_job_runs_the_gates_without_the_token():
    docs = render(["--set", "preflight.enabled=true", "--set", "preflight.nodeName=gpu-node-7"])
    sa = by_kind(docs, "ServiceAccount")["gpu-ready-preflight"]
    assert sa["automountServiceAccountToken"] is False
    pod = next(d for d in docs if d["kind"] == "Job")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and pod["shareProcessNamespace"] is False
    steps = [*pod["initContainers"], *pod["containers"]]
    assert [c["name"] for c in steps] == ["cordon", "gates", "record"]
    token_vol = next(v for v in pod["volumes"] if v["name"] == "api-token")
    assert token_vol["projected"]["sources"][0]["serviceAccountToken"]["path"] == "token"
    for c in steps:
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        step = next(a for a in c["args"] if a.startswith("--step="))
        assert step == f"--step={c['name']}"
        if c["name"] == "gates":
            assert "api-token" not in mounts and "--node=$(NODE_NAME)" not in c["args"]
            assert not any("serviceaccount" in m["mountPath"] for m in c["volumeMounts"])
            assert {e["name"]: e.get("value") for e in c["env"]}["NVIDIA_VISIBLE_DEVICES"] == "all"
        else:
            assert mounts["api-token"]["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount"
            assert mounts["api-token"]["readOnly"] is True
            assert {e["name"]: e.get("value") for e in c["env"]}["NVIDIA_VISIBLE_DEVICES"] == "void"
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert (
        "--results=/results/results.json" in steps[1]["args"] and "--results=/results/results.json" in steps[2]["args"]
    )
