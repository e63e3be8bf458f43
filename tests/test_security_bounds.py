"""The bounds the apiserver puts on what gpu-ready's tokens write, proven on the real apiserver with the chart's own
rendered RBAC and admission policies, in both renderings of the chart: its defaults (with the preflight Job) and
every option on (continuous taints with NoExecute, fencing with NoExecute and maxRules 4, podResources). Tokens are
bound to a Pod on node A (or on a node with a 253-character name). Each attempt names the hole it closes:

1. a condition big enough to hold the Node at etcd's request limit;  2. forging another condition by duplicating
one;  3. DeviceTaintRules without bound;  4. rule names that collide across nodes;  5. reading any Pod;  6. Events
about any Pod, or as another reporter;  7. wiping managedFields;  8. preflight uncordoning an admin's cordon;
9. NoExecute on the own taint when not enabled;  10. (the chart and the agent refuse names that are not
gpu-ready's: the last tests here).

Nodes are made by a kubelet-like client (field manager kubelet), as kubelet, NPD, GPU feature discovery and an
admin leave them. A denied attempt must leave both Nodes (managedFields included) and the DeviceTaintRules as they
were; an allowed one must show its change. The list renders a table in docs/deployment.md, compared with the file
(GPU_READY_UPDATE_DOCS=1 rewrites it)."""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from agent.act.fencing.plan import (
    GPU_ANNOTATION,
    LONG_NODE,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    NODE_LABEL,
    DesiredRule,
    FenceEffect,
    FencingSettings,
    node_label,
    rule_prefix,
)
from agent.act.fencing.reporter import FenceReporter
from agent.kube.client import MERGE_PATCH, STRATEGIC_MERGE, ApiError, KubeApi
from agent.model import GpuStatus, PciAddress, Reason, Status, Verdict
from agent.probes.dra import parse_slices
from agent.report.blast_radius import EVENT_REASON as POD_EVENT_REASON
from agent.report.condition import POLICY_MESSAGE_LIMIT, ConditionReporter, fit_message
from agent.report.events import EventReporter
from agent.verdict import MESSAGE_LIMIT, render_message, with_note
from testkit import security as sec
from testkit.chart import CHART, KUBE_VERSION, Release, apply_release, helm, serves
from testkit.cluster import EVENT_NAMESPACE, create_node, ensure_namespace, now_rfc3339
from testkit.controlplane import ControlPlane
from testkit.dra import BUSES, nvidia_slice
from testkit.security import JSON_PATCH, Req

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "deployment.md"
TABLE = sec.DocsTable(
    DOCS, "<!-- security-bounds-table:begin -->", "<!-- security-bounds-table:end -->", "security-bounds"
)
CTYPE = "GPUReady"
TAINT = "gpu-ready.io/gpu-not-ready"
MARK = "gpu-ready.io/preflight-cordoned"
DRIVER = "gpu.nvidia.com"
RULES = "/apis/resource.k8s.io/v1/devicetaintrules"
MAX_RULES = 4
DEFAULTS, ALL_ON = "defaults", "all options on"
PREFLIGHT = ["--set", "preflight.enabled=true", "--set", "preflight.nodeName=any"]
VALUES = {
    DEFAULTS: PREFLIGHT,
    ALL_ON: [
        *PREFLIGHT,
        *("--set", "taints.enabled=true", "--set", "taints.mode=continuous", "--set", "taints.noExecuteOnFatal=true"),
        *("--set", "taints.unknownAsFalse=true", "--set", "fencing.enabled=true", "--set", "fencing.effect=NoExecute"),
        *("--set", "fencing.allowNoExecute=true", "--set", f"fencing.maxRules={MAX_RULES}"),
        *("--set", "podResources.enabled=true"),
    ],
}
AG, PF = "agent", "preflight"

# -- the Nodes: what kubelet, NPD, GPU feature discovery, an admin and the agent left there ------------------------

BASE_TAINTS = [
    {"key": "dedicated", "value": "gpu", "effect": "NoSchedule"},
    {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
    {"key": TAINT, "effect": "NoSchedule"},  # registered by kubelet (--register-with-taints)
]
BASE_CONDITIONS = [
    {"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory", "message": "ok"},
    {"type": "DiskPressure", "status": "False", "reason": "KubeletHasNoDiskPressure", "message": "ok"},
    {"type": "KernelDeadlock", "status": "True", "reason": "DockerHung", "message": "task docker blocked"},
    {"type": CTYPE, "status": "Unknown", "reason": "Starting", "message": "first poll pending"},
]


def long_name(head: str) -> str:
    """A 253-character node name (the most Kubernetes allows) starting with `head`."""
    return (head + "-" + "x" * 253)[:252] + "z"


def make_node(kubelet: KubeApi, name: str) -> str:
    create_node(
        kubelet,
        name,
        {
            "nvidia.com/gpu.present": "true",
            "gpu-ready.io/needs-preflight": "true",
            "kubernetes.io/hostname": name[:63].rstrip("-."),  # the host's name: a label value, at most 63
        },
        {"nvidia.com/gpu": "8"},
        annotations={"node.alpha.kubernetes.io/ttl": "0"},
        taints=BASE_TAINTS,
        conditions=BASE_CONDITIONS,
    )
    return name


def snapshot(node: dict[str, Any]) -> dict[str, Any]:
    """The Node without resourceVersion and generation (managedFields stay: they must not change either)."""
    return sec.without(node, "resourceVersion", "generation")


def cond(ctype: str = CTYPE, status: str = "True", **over: Any) -> dict[str, Any]:
    return sec.attempted_condition(ctype, status, **over)


def copy_of(node: dict[str, Any], source: str, as_type: str) -> list[dict[str, Any]]:
    """The node's conditions with the `as_type` entry replaced by a copy of the `source` condition."""
    conds = node["status"]["conditions"]
    src = next(c for c in conds if c["type"] == source)
    return [dict(src) if c["type"] == as_type else c for c in conds]


def tidx(e: Env, key: str) -> int:
    return next(i for i, t in enumerate(e.node_a["spec"]["taints"]) if t["key"] == key)


def cidx(node: dict[str, Any], ctype: str) -> int:
    return next(i for i, c in enumerate(node["status"]["conditions"]) if c["type"] == ctype)


class Capture:
    """Stands in for the API: keeps what the agent's reporter would send."""

    def __init__(self) -> None:
        self.body: dict[str, Any] = {}

    def patch_node_status(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.body = patch
        return {}

    def create_event(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self.body = body
        return body


def agent_condition(node: str) -> dict[str, Any]:
    """The longest condition the agent writes: 64 GPUs with a fatal Xid (non-ASCII text), the fenced devices and the
    pod count appended, as the publisher does; the patch body ConditionReporter sends."""
    items = [f"GPU {i} (00000000:{i:02X}:00.0): Xid 79 — GPU fell off the bus, µ-code ✗" for i in range(64)]
    v = Verdict(Status.FALSE, Reason.FATAL_XID, render_message([(Reason.FATAL_XID.value, items)]))
    v = with_note(v, "fenced " + ", ".join(f"gpu-{i}-mig-1g10gb-19-{i}" for i in range(64)) + " (NoSchedule)")
    v = with_note(v, "64 pods on the affected GPUs")
    cap = Capture()
    ConditionReporter(cap, node, 300.0).write(v)  # type: ignore[arg-type]
    return cap.body


def agent_event(node: str, note: str, reason: str = POD_EVENT_REASON, gpu: str = "") -> dict[str, Any]:
    """The Event body the agent's EventReporter writes about its Node."""
    cap = Capture()
    rep = EventReporter(cap, node, 300.0, EVENT_NAMESPACE)  # type: ignore[arg-type]
    rep.record(reason, note, gpu)
    rep.flush()
    return cap.body


def blast_radius_event(e: Env) -> dict[str, Any]:
    note = (
        f"GPU 3 (00000000:5D:00.0, GPU-3f2a) on node {e.a} is unhealthy: FatalXid: Xid 79; pod {e.ns}/{e.pod} "
        "holds 1 slot(s) of it (containers: main)"
    )
    return agent_event(e.a, note, gpu=f"00000000:5D:00.0|{e.ns}/{e.pod}")


def rule(
    name: str, pool: str, device: str = "gpu-3", *, labels: dict[str, str] | None = None, **meta: Any
) -> dict[str, Any]:
    """A DeviceTaintRule as the agent writes it (DesiredRule.body), with another name, labels or metadata."""
    gpu = PciAddress.parse("0000:5d:00.0")
    assert gpu is not None
    d = DesiredRule(name, pool, DRIVER, pool, device, gpu, Reason.FATAL_XID, FenceEffect.NO_SCHEDULE)
    body = d.body("v1")
    if labels is not None:
        body["metadata"]["labels"] = labels
    body["metadata"].update(meta)
    return body


# -- one attempt -----------------------------------------------------------------------------------------------


@dataclass
class Env:
    a: str  # node A
    b: str  # node B
    node_a: dict[str, Any]  # node A before the attempt
    c: str = ""  # a node with a 253-character name (rows that bind the token there)
    d: str = ""  # another, sharing its first 200 characters with C
    uid_c: str = ""
    ns: str = ""  # a workload namespace with a Pod on node B
    pod: str = ""
    uid: str = ""
    made: list[str] = field(default_factory=list)  # DeviceTaintRules the setup made


@dataclass
class Attempt:
    hole: int
    token: str  # agent | preflight
    what: str
    make: Callable[[Env], Req]
    expect: dict[str, int]  # rendering -> code
    effect: Callable[[KubeApi, Env], bool] | None = None  # allowed writes: the change is there
    setup: Callable[[KubeApi, Env], None] | None = None  # as admin, before the attempt
    on: str = "a"  # the node the token is bound to: a, c or d (c and d: long names, made for this row)


def both(code: int) -> dict[str, int]:
    return {DEFAULTS: code, ALL_ON: code}


def on_off(code: int) -> dict[str, int]:
    """Allowed (code) with every option on; denied by RBAC with the defaults (the option grants the verb)."""
    return {DEFAULTS: 403, ALL_ON: code}


def node_patch(e: Env, sub: str, body: Any, ct: str = STRATEGIC_MERGE, node: str | None = None) -> Req:
    return Req("PATCH", f"/api/v1/nodes/{node or e.a}{sub}", body, ct)


def event_req(body: dict[str, Any], ns: str = EVENT_NAMESPACE) -> Req:
    return Req("POST", f"/apis/events.k8s.io/v1/namespaces/{ns}/events", body)


def node_event(e: Env, **over: Any) -> dict[str, Any]:
    return {**agent_event(e.a, "Xid 79 on GPU 3"), **over}


def pod_event(e: Env, pod: str, uid: str) -> dict[str, Any]:
    """An Event about a Pod, in its namespace, as the agent wrote them before (blast radius on the Pod)."""
    body = node_event(e, regarding={"apiVersion": "v1", "kind": "Pod", "namespace": e.ns, "name": pod, "uid": uid})
    body["metadata"] = {"name": f"{pod}.{secrets.token_hex(6)}", "namespace": e.ns}
    return body


def has_cond(ctype: str, **want: Any) -> Callable[[KubeApi, Env], bool]:
    def check(admin: KubeApi, e: Env) -> bool:
        c = [x for x in admin.get_node(e.a)["status"]["conditions"] if x["type"] == ctype]
        return len(c) == 1 and all(c[0].get(k) == v for k, v in want.items())

    return check


def rule_exists(name: Callable[[Env], str]) -> Callable[[KubeApi, Env], bool]:
    def check(admin: KubeApi, e: Env) -> bool:
        try:
            admin.request("GET", f"{RULES}/{name(e)}")
            return True
        except ApiError as err:
            if err.status == 404:
                return False
            raise

    return check


def admin_cordon(mark: bool) -> Callable[[KubeApi, Env], None]:
    def setup(admin: KubeApi, e: Env) -> None:
        meta = {"annotations": {MARK: "true"}} if mark else {}
        admin.patch_node(e.a, {"spec": {"unschedulable": True}, "metadata": meta})

    return setup


def preflight_cordon(then: tuple[bool | None, ...] = ()) -> Callable[[KubeApi, Env], None]:
    """What preflight's cordon step writes (cordon and mark, field manager gpu-ready), then the admin's
    unschedulable writes `then` (None: the field removed, as `kubectl uncordon` does)."""

    def setup(admin: KubeApi, e: Env) -> None:
        ua, admin.user_agent = admin.user_agent, "gpu-ready/test"
        try:
            admin.patch_node(e.a, {"spec": {"unschedulable": True}, "metadata": {"annotations": {MARK: "true"}}})
        finally:
            admin.user_agent = ua
        for value in then:
            admin.request("PATCH", f"/api/v1/nodes/{e.a}", {"spec": {"unschedulable": value}}, MERGE_PATCH)

    return setup


def legacy_rule(admin: KubeApi, e: Env) -> None:
    """A rule as earlier gpu-ready versions named it (gpu-ready.<node>.<device>)."""
    body = rule(f"gpu-ready.{e.a}.gpu-3", e.a)
    admin.request("POST", RULES, body)
    e.made.append(body["metadata"]["name"])


def managers(admin: KubeApi, e: Env) -> dict[str, list[str]]:
    """Field manager (and subresource) -> its top-level fieldsV1 paths and those under f:spec."""
    out: dict[str, list[str]] = {}
    for m in admin.get_node(e.a)["metadata"].get("managedFields") or []:
        f = m.get("fieldsV1") or {}
        key = m["manager"] + ("/" + m["subresource"] if m.get("subresource") else "")
        out[key] = sorted(f) + [f"f:spec.{k}" for k in sorted(f.get("f:spec") or {})]
    return out


def taint_moved_to_gpu_ready(admin: KubeApi, e: Env) -> bool:
    """The own taint is gone, the others stay; kubelet's managedFields entry lost only spec.taints."""
    n = admin.get_node(e.a)
    keys = [t["key"] for t in n["spec"].get("taints") or []]
    m = managers(admin, e)
    was = [t["key"] for t in e.node_a["spec"]["taints"] if t["key"] != TAINT]
    return keys == was and "f:spec.f:taints" not in m["kubelet"] and "f:metadata" in m["kubelet"]


def wipe(e: Env, sub: str = "", node_patch_extra: dict[str, Any] | None = None) -> Req:
    return node_patch(e, sub, {"metadata": {"managedFields": [{}]}, **(node_patch_extra or {})}, MERGE_PATCH)


def renamed_kubelet_entry(e: Env) -> Req:
    """kubelet's managedFields entry of the Node itself handed to another manager."""
    i = next(i for i, m in enumerate(e.node_a["metadata"]["managedFields"]) if not m.get("subresource"))
    return node_patch(
        e, "", [{"op": "replace", "path": f"/metadata/managedFields/{i}/manager", "value": "x"}], JSON_PATCH
    )


def emptied_kubelet_entry(e: Env) -> Req:
    i = next(i for i, m in enumerate(e.node_a["metadata"]["managedFields"]) if not m.get("subresource"))
    return node_patch(
        e, "", [{"op": "replace", "path": f"/metadata/managedFields/{i}/fieldsV1", "value": {}}], JSON_PATCH
    )


ATTEMPTS: list[Attempt] = [
    # ---- 1. the condition stays small ---------------------------------------------------------------------------
    Attempt(
        1,
        AG,
        f"{CTYPE} with a 1.5 MB message",
        lambda e: node_patch(e, "/status", {"status": {"conditions": [cond(message="x" * 1_500_000)]}}),
        both(403),
    ),
    Attempt(
        1,
        AG,
        f"{CTYPE} with a message of {POLICY_MESSAGE_LIMIT + 1} bytes",
        lambda e: node_patch(e, "/status", {"status": {"conditions": [cond(message="é" * 512 + "x")]}}),
        both(403),
    ),
    Attempt(
        1,
        AG,
        f"{CTYPE} with a message of {POLICY_MESSAGE_LIMIT} bytes (the most allowed)",
        lambda e: node_patch(e, "/status", {"status": {"conditions": [cond(message="é" * 512)]}}),
        both(200),
        has_cond(CTYPE, message="é" * 512),
    ),
    Attempt(
        1,
        AG,
        f"the agent's longest {CTYPE} (64 GPUs, fenced devices, pods: cut to {MESSAGE_LIMIT} bytes)",
        lambda e: node_patch(e, "/status", agent_condition(e.a)),
        both(200),
        has_cond(CTYPE, reason="FatalXid"),
    ),
    Attempt(
        1,
        AG,
        f"{CTYPE} with a reason of 129 characters",
        lambda e: node_patch(e, "/status", {"status": {"conditions": [cond(reason="R" * 129)]}}),
        both(403),
    ),
    Attempt(
        1,
        AG,
        f"{CTYPE} with status Maybe",
        lambda e: node_patch(e, "/status", {"status": {"conditions": [cond(status="Maybe")]}}),
        both(403),
    ),
    Attempt(
        1,
        AG,
        f"{CTYPE} with another field of 1 MB (a NodeCondition has none: the apiserver drops it)",
        lambda e: node_patch(e, "/status", {"status": {"conditions": [cond(pad="x" * 1_000_000)]}}),
        both(200),
        lambda admin, e: has_cond(CTYPE, status="True")(admin, e) and len(json.dumps(admin.get_node(e.a))) < 20_000,
    ),
    # ---- 2. conditions are compared by type ---------------------------------------------------------------------
    Attempt(
        2,
        AG,
        "replace MemoryPressure with a copy of Ready",
        lambda e: node_patch(
            e, "/status", {"status": {"conditions": copy_of(e.node_a, "Ready", "MemoryPressure")}}, MERGE_PATCH
        ),
        both(403),
    ),
    Attempt(
        2,
        AG,
        "replace NPD's KernelDeadlock=True with a copy of DiskPressure=False",
        lambda e: node_patch(
            e,
            "/status",
            [
                {
                    "op": "replace",
                    "path": f"/status/conditions/{cidx(e.node_a, 'KernelDeadlock')}",
                    "value": copy_of(e.node_a, "DiskPressure", "KernelDeadlock")[cidx(e.node_a, "KernelDeadlock")],
                }
            ],
            JSON_PATCH,
        ),
        both(403),
    ),
    Attempt(
        2,
        AG,
        f"add a second {CTYPE}",
        lambda e: node_patch(
            e, "/status", [{"op": "add", "path": "/status/conditions/-", "value": cond()}], JSON_PATCH
        ),
        both(403),
    ),
    Attempt(
        2,
        AG,
        f"set {CTYPE} with the whole list in another order",
        lambda e: node_patch(
            e,
            "/status",
            {
                "status": {
                    "conditions": [
                        cond(),
                        *reversed([c for c in e.node_a["status"]["conditions"] if c["type"] != CTYPE]),
                    ]
                }
            },
            MERGE_PATCH,
        ),
        both(200),
        has_cond(CTYPE, status="True"),
    ),
    # ---- 3. DeviceTaintRules: at most maxRules names per node ----------------------------------------------------
    Attempt(
        3,
        AG,
        "rule for a made-up device, named after it as earlier versions did",
        lambda e: Req("POST", RULES, rule(f"gpu-ready.{e.a}.gpu-517", e.a, "gpu-517")),
        both(403),
    ),
    Attempt(
        3,
        AG,
        f"rule number {MAX_RULES} (fencing.maxRules {MAX_RULES})",
        lambda e: Req("POST", RULES, rule(f"gpu-ready.{e.a}.{MAX_RULES}", e.a)),
        both(403),
    ),
    Attempt(
        3,
        AG,
        "rule number 0 written as 00",
        lambda e: Req("POST", RULES, rule(f"gpu-ready.{e.a}.00", e.a)),
        both(403),
    ),
    Attempt(
        3,
        AG,
        "the agent's first rule, number 0",
        lambda e: Req("POST", RULES, rule(f"{rule_prefix(e.a)}0", e.a)),
        on_off(201),
        rule_exists(lambda e: f"{rule_prefix(e.a)}0"),
    ),
    Attempt(
        3,
        AG,
        f"rule number {MAX_RULES - 1}",
        lambda e: Req("POST", RULES, rule(f"{rule_prefix(e.a)}{MAX_RULES - 1}", e.a, "gpu-3-mig-1g10gb-19-0")),
        on_off(201),
        rule_exists(lambda e: f"{rule_prefix(e.a)}{MAX_RULES - 1}"),
    ),
    Attempt(
        3,
        AG,
        "rule with another annotation",
        lambda e: Req(
            "POST",
            RULES,
            rule(f"{rule_prefix(e.a)}1", e.a, annotations={GPU_ANNOTATION: "00000000:5D:00.0", "x.io/pad": "x" * 1000}),
        ),
        both(403),
    ),
    Attempt(
        3,
        AG,
        "rule with another label",
        lambda e: Req(
            "POST",
            RULES,
            rule(f"{rule_prefix(e.a)}1", e.a, labels={MANAGED_BY_LABEL: MANAGED_BY, NODE_LABEL: e.a, "x": "y"}),
        ),
        both(403),
    ),
    Attempt(
        3,
        AG,
        "rule with a finalizer",
        lambda e: Req("POST", RULES, rule(f"{rule_prefix(e.a)}1", e.a, finalizers=["x.io/hold"])),
        both(403),
    ),
    Attempt(
        3,
        AG,
        "rule with an ownerReference",
        lambda e: Req(
            "POST",
            RULES,
            rule(
                f"{rule_prefix(e.a)}1",
                e.a,
                ownerReferences=[{"apiVersion": "v1", "kind": "Node", "name": e.a, "uid": e.node_a["metadata"]["uid"]}],
            ),
        ),
        both(403),
    ),
    Attempt(
        3,
        AG,
        "delete a rule named after its device, as earlier versions did",
        lambda e: Req("DELETE", f"{RULES}/gpu-ready.{e.a}.gpu-3"),
        on_off(200),
        lambda admin, e: not rule_exists(lambda e: f"gpu-ready.{e.a}.gpu-3")(admin, e),
        setup=legacy_rule,
    ),
    # ---- 4. names of long node names ------------------------------------------------------------------------------
    Attempt(
        4,
        AG,
        "the agent's first rule on a node with a 253-character name (named after the Node's UID)",
        lambda e: Req("POST", RULES, rule(f"{rule_prefix(e.c, e.uid_c)}0", e.c)),
        on_off(201),
        rule_exists(lambda e: f"{rule_prefix(e.c, e.uid_c)}0"),
        on="c",
    ),
    Attempt(
        4,
        AG,
        "from node D (same first 200 characters as C), rule in D's pool named as C's first rule",
        lambda e: Req("POST", RULES, rule(f"{rule_prefix(e.c, e.uid_c)}0", e.d)),
        both(403),
        on="d",
    ),
    Attempt(
        4,
        AG,
        "from node D, rule in D's pool named after C's first 200 characters",
        lambda e: Req("POST", RULES, rule(f"gpu-ready.{e.c[:200]}-0.gpu-3", e.d)),
        both(403),
        on="d",
    ),
    Attempt(
        4,
        AG,
        "the agent's Event about a node with a 253-character name (reportingInstance cut at 128)",
        lambda e: event_req(agent_event(e.c, "Xid 79 on GPU 3", "FatalXid")),
        both(201),
        on="c",
    ),
    # ---- 5. no Pod is readable --------------------------------------------------------------------------------------
    Attempt(
        5,
        AG,
        "read a Pod on node B (its env values)",
        lambda e: Req("GET", f"/api/v1/namespaces/{e.ns}/pods/{e.pod}"),
        both(403),
    ),
    # ---- 6. Events: about the own Node, as the own agent -------------------------------------------------------------
    Attempt(
        6,
        AG,
        "Event about a Pod on node B, in its namespace",
        lambda e: event_req(pod_event(e, e.pod, e.uid), e.ns),
        both(403),
    ),
    Attempt(
        6,
        AG,
        "Event about a Pod that does not exist",
        lambda e: event_req(pod_event(e, "no-such-pod", "00000000-0000-0000-0000-000000000000"), e.ns),
        both(403),
    ),
    Attempt(
        6,
        AG,
        "Event about node A with reportingInstance kubelet",
        lambda e: event_req(node_event(e, reportingInstance="kubelet")),
        both(403),
    ),
    Attempt(
        6,
        AG,
        "Event about node A as node B's agent (reportingInstance gpu-ready-{B})",
        lambda e: event_req(node_event(e, reportingInstance=f"gpu-ready-{e.b}")),
        both(403),
    ),
    Attempt(
        6,
        PF,
        "Event about node A with reportingInstance kubelet",
        lambda e: event_req(node_event(e, reportingInstance="kubelet")),
        both(403),
    ),
    Attempt(
        6,
        AG,
        "the blast-radius Event: about node A, naming the pod on the bad GPU",
        lambda e: event_req(blast_radius_event(e)),
        both(201),
    ),
    # ---- 7. managedFields ------------------------------------------------------------------------------------------
    Attempt(7, AG, "wipe managedFields", lambda e: wipe(e), both(403)),
    Attempt(7, AG, "empty kubelet's managedFields entry", emptied_kubelet_entry, both(403)),
    Attempt(7, AG, "rename kubelet's managedFields entry", renamed_kubelet_entry, both(403)),
    Attempt(
        7,
        AG,
        f"remove its {TAINT} and wipe managedFields",
        lambda e: wipe(e, "", {"spec": {"taints": [t for t in e.node_a["spec"]["taints"] if t["key"] != TAINT]}}),
        both(403),
    ),
    Attempt(
        7,
        AG,
        f"remove its {TAINT} (kubelet registered it: the apiserver moves spec.taints to gpu-ready)",
        lambda e: node_patch(e, "", [{"op": "remove", "path": f"/spec/taints/{tidx(e, TAINT)}"}], JSON_PATCH),
        on_off(200),
        taint_moved_to_gpu_ready,
    ),
    Attempt(
        7,
        AG,
        "wipe managedFields through nodes/status (the apiserver keeps them for a subresource)",
        lambda e: wipe(e, "/status"),
        both(200),
        lambda admin, e: admin.get_node(e.a)["metadata"]["managedFields"] == e.node_a["metadata"]["managedFields"],
    ),
    Attempt(7, PF, "wipe managedFields", lambda e: wipe(e), both(403)),
    Attempt(7, PF, "empty kubelet's managedFields entry", emptied_kubelet_entry, both(403)),
    Attempt(
        7,
        PF,
        "label preflight=passed and wipe managedFields",
        lambda e: wipe(e, "", {"metadata": {"managedFields": [{}], "labels": {"preflight": "passed"}}}),
        both(403),
    ),
    # ---- 8. preflight uncordons only what it cordoned ----------------------------------------------------------------
    Attempt(
        8,
        PF,
        "uncordon a node an admin cordoned",
        lambda e: node_patch(e, "", {"spec": {"unschedulable": False}}, MERGE_PATCH),
        both(403),
        setup=admin_cordon(False),
    ),
    Attempt(
        8,
        PF,
        f"mark a node an admin cordoned {MARK}=true and uncordon it",
        lambda e: node_patch(
            e, "", {"spec": {"unschedulable": False}, "metadata": {"annotations": {MARK: "true"}}}, MERGE_PATCH
        ),
        both(403),
        setup=admin_cordon(False),
    ),
    Attempt(
        8,
        PF,
        f"mark a node an admin cordoned {MARK}=true",
        lambda e: node_patch(e, "", {"metadata": {"annotations": {MARK: "true"}}}, MERGE_PATCH),
        both(403),
        setup=admin_cordon(False),
    ),
    Attempt(
        8,
        PF,
        f"cordon, marking it {MARK}=true (what the cordon step writes)",
        lambda e: node_patch(e, "", {"spec": {"unschedulable": True}, "metadata": {"annotations": {MARK: "true"}}}),
        both(200),
        lambda admin, e: admin.get_node(e.a)["spec"].get("unschedulable") is True,
    ),
    Attempt(
        8,
        PF,
        f"uncordon a node it cordoned, dropping {MARK} (what a pass writes)",
        lambda e: node_patch(
            e,
            "",
            {
                "spec": {"unschedulable": False},
                "metadata": {
                    "labels": {"preflight": "passed", "gpu-ready.io/needs-preflight": None},
                    "annotations": {MARK: None, "gpu-ready.io/preflight-time": now_rfc3339()},
                },
            },
        ),
        both(200),
        lambda admin, e: not admin.get_node(e.a)["spec"].get("unschedulable"),
        setup=preflight_cordon(),
    ),
    Attempt(
        8,
        PF,
        f"uncordon with the mark {MARK}=true its failed run left, after an admin's uncordon and later cordon",
        lambda e: node_patch(
            e, "", {"spec": {"unschedulable": False}, "metadata": {"annotations": {MARK: None}}}, MERGE_PATCH
        ),
        both(403),
        setup=preflight_cordon((None, True)),
    ),
    # ---- 9. NoExecute only when enabled ----------------------------------------------------------------------------
    Attempt(
        9,
        AG,
        f"add {TAINT}:NoExecute (taints.noExecuteOnFatal)",
        lambda e: node_patch(
            e, "", [{"op": "add", "path": "/spec/taints/-", "value": {"key": TAINT, "effect": "NoExecute"}}], JSON_PATCH
        ),
        on_off(200),
        lambda admin, e: (
            {"key": TAINT, "effect": "NoExecute"}
            in [{k: v for k, v in t.items() if k != "timeAdded"} for t in admin.get_node(e.a)["spec"]["taints"]]
        ),
    ),
    Attempt(
        9,
        AG,
        f"add {TAINT}:PreferNoSchedule",
        lambda e: node_patch(
            e,
            "",
            [{"op": "add", "path": "/spec/taints/-", "value": {"key": TAINT, "effect": "PreferNoSchedule"}}],
            JSON_PATCH,
        ),
        both(403),
    ),
]


# -- the chart on the apiserver ------------------------------------------------------------------------------------


@dataclass
class Cluster:
    cp: ControlPlane
    admin: KubeApi
    kubelet: KubeApi  # writes as field manager kubelet
    operator: KubeApi  # writes as field manager kubectl: the setups (an admin's cordon, an earlier rule)
    releases: dict[str, Release]
    ns: str  # the workload namespace
    pod: str  # a Pod on node pods_node, with a secret in its env
    uid: str

    def token(self, rendering: str, who: str, node: str) -> KubeApi:
        return sec.bound_client(self.cp, self.admin, self.releases[rendering], who == PF, node)


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Any:
    kc = control_plane.kubeconfig(tmp_path_factory.mktemp("secb") / "admin")
    releases = {
        DEFAULTS: apply_release(control_plane, kc, "secd", VALUES[DEFAULTS]),
        ALL_ON: apply_release(control_plane, kc, "seca", VALUES[ALL_ON]),
    }
    admin = control_plane.admin()
    kubelet = sec.client_as(control_plane, "kubelet/v1.37.2 (linux/amd64) kubernetes/test")
    operator = sec.client_as(control_plane, "kubectl/v1.37.2 (linux/amd64) kubernetes/test")
    ns = f"work-{secrets.token_hex(3)}"
    ensure_namespace(admin, ns)
    pods_node = make_node(kubelet, f"secb-{secrets.token_hex(4)}")
    container = {"name": "main", "image": "x", "env": [{"name": "DB_PASSWORD", "value": "hunter2"}]}
    pod = admin.request(
        "POST", f"/api/v1/namespaces/{ns}/pods", {"metadata": {"name": "train-0"}, "spec": {"nodeName": pods_node,
                                                                                            "containers": [container]}}
    )  # fmt: skip
    c = Cluster(control_plane, admin, kubelet, operator, releases, ns, "train-0", pod["metadata"]["uid"])
    a, b = (make_node(kubelet, f"secb-{secrets.token_hex(4)}") for _ in range(2))
    for rendering, rel in releases.items():  # the policies take a moment to load after creation
        probes: list[tuple[str, str, Callable[[KubeApi], Any]]] = [
            (AG, "own-node-only", lambda api: api.patch_node_status(b, {"status": {"conditions": [cond()]}})),
            (PF, "preflight-own-node-only", lambda api: api.patch_node(b, {"metadata": {"labels": {"x": "y"}}})),
            (AG, "own-events-only", lambda api: api.create_event(EVENT_NAMESPACE, agent_event(b, "probe"))),
        ]
        if rendering == ALL_ON and not serves(admin, "resource.k8s.io/v1", "devicetaintrules"):
            print("\n[security bounds] DeviceTaintRule is not served by this kube-apiserver: its policy is not probed")
        elif rendering == ALL_ON:
            probes.append(
                (AG, "own-devices-only", lambda api: create_and_undo(admin, api, rule(f"gpu-ready.{b}.0", b)))
            )
        for who, policy, probe in probes:
            name = f"{rel.fullname}-{policy}"
            sec.wait_policy_loaded(c.token(rendering, who, a), probe, name, f"{policy} admission policy of {rendering}")
    sec.delete_nodes(admin, [a, b, pods_node])
    yield c
    for api in (admin, kubelet, operator):
        api.close()


def create_and_undo(admin: KubeApi, api: KubeApi, body: dict[str, Any]) -> None:
    """A probe that writes a rule: created (the policy not in force yet) means deleted again."""
    api.request("POST", RULES, body)
    admin.request("DELETE", f"{RULES}/{body['metadata']['name']}")


def rules_of(admin: KubeApi, nodes: list[str]) -> list[str]:
    try:
        items = admin.request("GET", RULES)["items"]
    except ApiError as e:
        if e.status == 404:  # an older minor (make test-oldest) serves no DeviceTaintRule: there are none
            return []
        raise
    return sorted(r["metadata"]["name"] for r in items if r["spec"]["deviceSelector"]["pool"] in nodes)


def attempt(c: Cluster, rendering: str, a: Attempt) -> tuple[int, str, str]:
    """Makes one attempt on fresh nodes; returns (observed code, denied by, problem or "")."""
    node_a, node_b = (make_node(c.kubelet, f"secb-{secrets.token_hex(4)}") for _ in range(2))
    nodes = [node_a, node_b]
    env = Env(node_a, node_b, c.admin.get_node(node_a), ns=c.ns, pod=c.pod, uid=c.uid)
    if a.on in ("c", "d"):
        head = f"secb-{secrets.token_hex(4)}"
        env.c = make_node(c.kubelet, long_name(head))
        env.d = make_node(c.kubelet, long_name(head)[:200] + "-d" + "y" * 51)
        env.uid_c = c.admin.get_node(env.c)["metadata"]["uid"]
        nodes += [env.c, env.d]
    if a.setup:
        a.setup(c.operator, env)
    req = a.make(env)
    effect = a.effect
    result = sec.observe(
        c.token(rendering, a.token, {"a": env.a, "c": env.c, "d": env.d}[a.on]),
        req,
        req.path,
        a.expect[rendering],
        lambda: ({n: snapshot(c.admin.get_node(n)) for n in nodes}, rules_of(c.admin, nodes)),
        None if effect is None else lambda: effect(c.admin, env),
        req.writes or "devicetaintrules" in req.path,
    )
    for name in rules_of(c.admin, nodes):
        c.admin.request("DELETE", f"{RULES}/{name}")
    sec.delete_nodes(c.admin, nodes)
    return result


def request_text(a: Attempt) -> str:
    """The request column: method, path with placeholders, patch type (from a dry build of the request)."""
    types = ("Ready", *(x["type"] for x in BASE_CONDITIONS))
    dry_node = {
        "metadata": {"uid": "u", "managedFields": [{"manager": "kubelet"}]},
        "spec": {"taints": BASE_TAINTS},
        "status": {"conditions": [{"type": t} for t in types]},
    }
    c = long_name("c")  # long names, as the rows make them, shown as placeholders
    env = Env("{A}", "{B}", dry_node, c, c[:200] + "-d" + "y" * 51, "{uid of C}", "{ns}", "{pod}", "u")
    r = a.make(env)

    def shown(text: str) -> str:
        return text.replace(env.c, "{C}").replace(env.d, "{D}").replace(c[:200], "{first 200 of C}")

    body = r.body if isinstance(r.body, dict) else {}
    name = (body.get("metadata") or {}).get("name", "") if r.method == "POST" and "devicetaintrules" in r.path else ""
    return shown(sec.request_column(r, r.path.replace("resource.k8s.io/v1/", "")) + (f" `{name}`" if name else ""))


def table(observed: list[dict[str, tuple[int, str]]]) -> str:
    lines = [
        f"| # | hole | token | request | attempt | {DEFAULTS} | {ALL_ON} |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, (a, obs) in enumerate(zip(ATTEMPTS, observed, strict=True), 1):
        cells = [f"{obs[r][0]}" + (f" ({obs[r][1]})" if obs[r][1] else "") for r in (DEFAULTS, ALL_ON)]
        lines.append(f"| {i} | {a.hole} | {a.token} | {request_text(a)} | {a.what} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


@pytest.mark.apiserver
def test_every_bound_holds_with_both_renderings(cluster):
    observed: list[dict[str, tuple[int, str]]] = []
    problems: list[str] = []
    dra = serves(cluster.admin, "resource.k8s.io/v1", "devicetaintrules")
    skipped: list[str] = []  # an older minor (make test-oldest): no DeviceTaintRule to attempt anything on
    for i, a in enumerate(ATTEMPTS, 1):
        obs = {}
        for rendering in (DEFAULTS, ALL_ON):
            try:
                code, by, problem = attempt(cluster, rendering, a)
            except ApiError as e:
                if dra or e.status != 404 or "resource.k8s.io" not in str(e):
                    raise
                code, by, problem = 404, "not served", "resource.k8s.io 404"
            if not dra and code == 404 and "resource.k8s.io" in problem + by + str(a.what):
                skipped.append(f"#{i} [{rendering}] {a.what}")
                problem = ""
            obs[rendering] = (code, by)
            if problem:
                problems.append(f"#{i} [{rendering}, {a.token}] {a.what}: {problem}")
        observed.append(obs)
    print(f"\n[security-bounds] {len(ATTEMPTS)} attempts x 2 renderings; mismatches: {len(problems)}")
    TABLE.conclude(problems, skipped, "DeviceTaintRule not served by this kube-apiserver", lambda: table(observed))


def test_every_attempt_is_listed_once_and_every_hole_has_a_denied_row():
    sec.listed_once([(a.token, a.what, request_text(a)) for a in ATTEMPTS])
    for a in ATTEMPTS:
        assert set(a.expect) == {DEFAULTS, ALL_ON} and set(a.expect.values()) <= {200, 201, 403}
    for hole in range(1, 10):
        rows = [a for a in ATTEMPTS if a.hole == hole]
        assert any(a.expect[ALL_ON] == 403 for a in rows), f"hole {hole} has no denied row"


# -- 1: after the agent's largest write, kubelet and an admin still write the Node ----------------------------------


@pytest.mark.apiserver
def test_after_the_largest_condition_allowed_kubelet_and_an_admin_still_write_the_node(cluster):
    c = cluster
    node = make_node(c.kubelet, f"secb-{secrets.token_hex(4)}")
    api = c.token(ALL_ON, AG, node)
    try:
        big = cond(status="False", reason="R" * 128, message="é" * (POLICY_MESSAGE_LIMIT // 2))
        api.patch_node_status(node, {"status": {"conditions": [big]}})
        with pytest.raises(ApiError) as denied:
            api.patch_node_status(node, {"status": {"conditions": [cond(message="x" * 1_500_000)]}})
        assert denied.value.status == 403 and "own-node-only" in str(denied.value)
    finally:
        api.close()
    size = len(json.dumps(c.admin.get_node(node)).encode())
    assert size < 16_000, size  # nowhere near etcd's request limit
    kubelet_patch = {
        "status": {"conditions": [cond("Ready", "False", reason="KubeletNotReady"), cond("MemoryPressure", "True")]}
    }
    got = c.kubelet.patch_node_status(node, kubelet_patch)
    now = {x["type"]: x["status"] for x in got["status"]["conditions"]}
    assert (now["Ready"], now["MemoryPressure"], now[CTYPE]) == ("False", "True", "False")
    assert c.admin.patch_node(node, {"spec": {"unschedulable": True}})["spec"]["unschedulable"] is True
    c.admin.request("DELETE", f"/api/v1/nodes/{node}")


# -- 3: a node owns at most maxRules rules ---------------------------------------------------------------------------


@pytest.mark.apiserver
def test_a_node_owns_at_most_max_rules_rules(cluster):
    """Every number taken, the agent's token of that node can create no further rule under any name."""
    c = cluster
    if not serves(c.admin, "resource.k8s.io/v1", "devicetaintrules"):
        pytest.skip("DeviceTaintRule is not served by this kube-apiserver (Kubernetes 1.36 with its gate, or 1.37)")
    node = make_node(c.kubelet, f"secb-{secrets.token_hex(4)}")
    api = c.token(ALL_ON, AG, node)
    prefix = rule_prefix(node)
    try:
        for n in range(MAX_RULES):
            api.request("POST", RULES, rule(f"{prefix}{n}", node, f"gpu-{n}"))
        names = [f"{prefix}{n}" for n in range(MAX_RULES + 2)] + [f"gpu-ready.{node}.gpu-{MAX_RULES}", f"{prefix}01"]
        names += [f"{prefix}{MAX_RULES}-0", f"gpu-ready-uid.{c.admin.get_node(node)['metadata']['uid']}.0"]
        codes = set()
        for name in names:
            with pytest.raises(ApiError) as refused:
                api.request("POST", RULES, rule(name, node, "gpu-99"))
            codes.add(refused.value.status)
        assert codes == {403, 409}  # taken (409) or not a name of this node (403)
        assert len(rules_of(c.admin, [node])) == MAX_RULES
    finally:
        api.close()
        for name in rules_of(c.admin, [node]):
            c.admin.request("DELETE", f"{RULES}/{name}")
        c.admin.request("DELETE", f"/api/v1/nodes/{node}")


def test_rule_names_never_collide_and_fit():
    a, b = long_name("n"), long_name("n")[:-1] + "q"
    assert len(a) == 253 and rule_prefix(a) is None  # the UID is needed
    assert rule_prefix(a, "u1") != rule_prefix(b, "u2") and len(f"{rule_prefix(a, 'u' * 36)}{MAX_RULES - 1}") < 253
    fits = "n" * LONG_NODE
    assert rule_prefix(fits) == f"gpu-ready.{fits}." and len(f"{rule_prefix(fits)}1023") == 253
    assert not rule_prefix(a, "u1").startswith("gpu-ready.")  # the two forms cannot meet  # type: ignore[union-attr]
    assert node_label(a).startswith("sha256-")


def test_the_policy_and_the_agent_agree_on_the_long_node_bound():
    text = (CHART / "templates" / "fencing.yaml").read_text()
    assert f"$longNode := {LONG_NODE} " in text


# -- 10: the chart and the agent refuse names that are not gpu-ready's ----------------------------------------------

HAZARDS = [
    ("conditionType", "Ready", "--condition-type"),
    ("conditionType", "MemoryPressure", "--condition-type"),
    ("conditionType", "node.kubernetes.io/GPUReady", "--condition-type"),
    ("taints.key", "node.kubernetes.io/not-ready", "--taint-key"),
    ("taints.key", "nvidia.com/gpu", "--taint-key"),
    ("taints.key", "kubernetes.io/x", "--taint-key"),
    ("config.preflightLabel", "node-role.kubernetes.io/control-plane", "--preflight-label"),
    ("config.preflightLabel", "k8s.io/x", "--preflight-label"),
    ("preflight.needsLabel", "node-role.kubernetes.io/control-plane", "--needs-label"),
    ("preflight.needsLabel", "nvidia.com/gpu.present", "--needs-label"),
]


@pytest.mark.parametrize(("key", "value", "flag"), HAZARDS, ids=[f"{k}={v}" for k, v, _ in HAZARDS])
def test_the_chart_and_the_agent_refuse_names_that_are_not_gpu_readys(key, value, flag, tmp_path):
    r = helm("template", "x", str(CHART), "--kube-version", KUBE_VERSION, "--set", "preflight.enabled=true", "--set",
             f"{key}={value}", check=False)  # fmt: skip
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("Error:")]
    assert r.returncode != 0 and len(err) == 1 and value in err[0], r.stderr
    if flag == "--needs-label":
        profile = tmp_path / "profile.yaml"
        profile.write_text("{}\n")
        argv = ["preflight", "--profile", str(profile), "--step", "cordon", "--node", "n", flag, value]
    else:
        argv = ["run", "--node-name", "n", flag, value]
    p = subprocess.run([sys.executable, "-m", "agent", *argv], capture_output=True, text=True, timeout=60)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and value in lines[0], p.stderr


def test_the_chart_still_takes_its_own_names():
    r = helm(
        "template", "x", str(CHART), "--kube-version", KUBE_VERSION, "--set", "conditionType=nvidia.com/GPUReady",
        "--set", "taints.key=example.com/gpu", "--set", "preflight.enabled=true",
        "--set", "config.preflightLabel=example.com/preflight",
    )  # fmt: skip
    assert r.returncode == 0


@pytest.mark.apiserver
def test_the_agent_fences_with_its_real_names_on_a_253_character_node(cluster):
    """FenceReporter with the agent's token of a node named with 253 characters (every option on): it reads the
    Node's UID once, creates gpu-ready-uid.<uid>.0 and deletes it again when the GPU is healthy."""
    c = cluster
    if not serves(c.admin, "resource.k8s.io/v1", "devicetaintrules"):
        pytest.skip("DeviceTaintRule is not served by this kube-apiserver (Kubernetes 1.36 with its gate, or 1.37)")
    node = make_node(c.kubelet, long_name(f"secb-{secrets.token_hex(4)}"))
    uid = c.admin.get_node(node)["metadata"]["uid"]
    api = c.token(ALL_ON, AG, node)
    inv = parse_slices([nvidia_slice(node)])
    bus = PciAddress.parse(f"0000:{BUSES[3]:02x}:00.0")
    assert bus is not None
    bad = GpuStatus(3, bus.nvml, "H100", False, ("FatalXid: Xid 79",), (Reason.FATAL_XID,))
    good = replace(bad, healthy=True, problems=(), reasons=())
    fence = FenceReporter(api, node, FencingSettings(True, FenceEffect.NO_SCHEDULE, max_rules=MAX_RULES))
    try:
        res = fence.reconcile(Verdict(Status.FALSE, Reason.FATAL_XID, "Xid 79", (bad,), (Reason.FATAL_XID,)), inv)
        assert not res.errors, res.errors
        assert [f.rule for f in res.fenced] == [f"gpu-ready-uid.{uid}.0"] and fence.node_uid == uid
        assert rules_of(c.admin, [node]) == [f"gpu-ready-uid.{uid}.0"]
        res = fence.reconcile(Verdict(Status.TRUE, Reason.GPUS_HEALTHY, "ok", (good,)), inv, force=True)
        assert not res.errors and res.changed == {"deleted": 1} and rules_of(c.admin, [node]) == []
    finally:
        api.close()
        c.admin.request("DELETE", f"/api/v1/nodes/{node}")


def test_the_agent_cuts_its_condition_message_to_fit_and_says_how_much():
    assert fit_message("x" * MESSAGE_LIMIT) == "x" * MESSAGE_LIMIT
    for text in ("x" * 5000, "é" * 3000, "ab" + "✗" * 900):
        cut = fit_message(text)
        n = int(re.search(r"\(\+(\d+) bytes cut\)$", cut).group(1))  # type: ignore[union-attr]
        head = cut[: cut.rindex("… (+")]
        assert len(cut.encode()) <= MESSAGE_LIMIT <= POLICY_MESSAGE_LIMIT and text.startswith(head)
        assert len(head.encode()) + n == len(text.encode())
    body = agent_condition("n")["status"]["conditions"][0]
    assert len(body["message"].encode()) <= MESSAGE_LIMIT and body["message"].endswith("64 pods on the affected GPUs")
