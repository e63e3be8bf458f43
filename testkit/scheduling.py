"""A control plane with the real kube-scheduler (binding) and kube-controller-manager (NoExecute taint eviction) for
the taint tests (tests/test_taints.py, tests/test_taints_e2e.py; the `sched_plane` fixture in tests/conftest.py
starts one per module), GPU Nodes as a kubelet registers them with taints, Pods asking for a GPU, what the
scheduler made of them, and the taints that belong to others. No kubelet runs: pod status is set by the test
where it matters."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent.act.taints.plan import NO_SCHEDULE, TAINT_KEY
from agent.kube.client import KubeApi
from testkit.cluster import create_node, drop_not_ready_taint
from testkit.controlplane import ControlPlane
from testkit.harness import wait_for

BINARIES = ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager")
STARTUP_TAINT = {"key": TAINT_KEY, "effect": NO_SCHEDULE}
# Taints that belong to others and must come through every change byte for byte, in order.
OTHERS: list[dict[str, Any]] = [
    {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},  # the GPU pool's / device plugin's
    {"key": "example.com/dedicated", "value": "ml", "effect": "NoSchedule"},  # an admin's
    {"key": "example.com/maintenance", "value": "planned", "effect": "NoExecute", "timeAdded": "2026-11-30T08:00:00Z"},
]
TOLERATE_OTHERS = [{"key": t["key"], "operator": "Exists"} for t in OTHERS]


@dataclass
class SchedulerPlane:
    control_plane: ControlPlane  # the name tests/conftest.py looks for to append the apiserver log on failure
    admin: KubeApi
    namespace: str
    nodes: list[str] = field(default_factory=list)

    def logs(self) -> str:
        cp = self.control_plane
        return "".join(
            f"\n--- {c} log (tail) ---\n{cp.log_tail(40, component=c)}"
            for c in ("kube-scheduler", "kube-controller-manager")
        )

    def wait(self, pred: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
        try:
            return wait_for(pred, timeout, what=what)
        except AssertionError as e:
            raise AssertionError(f"{e}{self.logs()}") from None


def register_node(plane: SchedulerPlane, taints: list[dict[str, Any]]) -> str:
    """A GPU Node as a kubelet started with --register-with-taints would create it: the taints are there
    from the first write, then the status with 8 nvidia.com/gpu and Ready=True."""
    name = f"gpu-{secrets.token_hex(4)}"
    create_node(plane.admin, name, {"nvidia.com/gpu.present": "true"}, {"nvidia.com/gpu": "8"}, taints=taints)
    drop_not_ready_taint(plane.admin, name)
    plane.nodes.append(name)
    return name


def gpu_pod(plane: SchedulerPlane, node: str, tolerations: list[dict[str, Any]], node_name: str = "") -> str:
    """A Pod asking for one nvidia.com/gpu, pinned to `node` by its hostname label (other tests' nodes in this
    control plane must not take it). With node_name it is created already bound."""
    name = f"train-{secrets.token_hex(3)}"
    spec: dict[str, Any] = {
        "nodeSelector": {"kubernetes.io/hostname": node},
        "tolerations": tolerations,
        "terminationGracePeriodSeconds": 30,
        "containers": [{"name": "c", "image": "cuda:test", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
    }
    if node_name:
        spec["nodeName"] = node_name
    plane.admin.request(
        "POST", f"/api/v1/namespaces/{plane.namespace}/pods", {"metadata": {"name": name}, "spec": spec}
    )
    return name


def get_pod(plane: SchedulerPlane, name: str) -> dict[str, Any]:
    return plane.admin.request("GET", f"/api/v1/namespaces/{plane.namespace}/pods/{name}")


def pod_condition(pod: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == ctype), None)


def bound_to(plane: SchedulerPlane, name: str, node: str) -> bool:
    return get_pod(plane, name).get("spec", {}).get("nodeName") == node


def unschedulable(plane: SchedulerPlane, name: str) -> dict[str, Any] | None:
    pod = get_pod(plane, name)
    c = pod_condition(pod, "PodScheduled")
    if c and c.get("status") == "False" and c.get("reason") == "Unschedulable" and not pod["spec"].get("nodeName"):
        return c
    return None


def node_taints(plane: SchedulerPlane, node: str) -> list[dict[str, Any]]:
    return list(plane.admin.get_node(node).get("spec", {}).get("taints") or [])
