"""`gpu-ready uninstall`: what the chart's uninstall hook runs after `helm uninstall` has deleted the release's
objects. It removes what gpu-ready wrote outside them, so that no Node keeps a condition, a taint or a label
that nothing maintains any more:

- on every Node: the agent's condition (`conditionType`), its taint (`taints.key`, any effect), the preflight
  labels (`config.preflightLabel`, `preflight.needsLabel`) and annotations (`gpu-ready.io/preflight-*`,
  `gpu-ready.io/clear-before`), and a cordon that preflight set (annotation `gpu-ready.io/preflight-cordoned`);
- gpu-ready's DeviceTaintRules (label `app.kubernetes.io/managed-by=gpu-ready`);
- in the release namespace: the fleet brake ConfigMap, the controller's Lease and the controller's preflight Jobs
  (a running one first, so that it cannot record its labels after the removal).

With `keep_history` the record of what preflight found stays (the `preflight` and `needs-preflight` labels, the
time and report annotations, the finished Jobs: they are the Nodes' onboarding record); what steers the scheduler
(condition, taint, cordon, device taints) is removed all the same. The chart's admission policy holds this token to
removals of exactly these names (docs/deployment.md#uninstall).

Before the removal it waits, with a bound, until the release's agent and controller pods are gone: a pod still
terminating could publish its condition again after the removal."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from agent.kube.client import ApiError, KubeApi
from agent.names import (
    CLEAR_BEFORE_ANNOTATION,
    CONDITION_TYPE,
    CORDONED_BY_ANNOTATION,
    MANAGED_LABEL,
    MANAGED_VALUE,
    NEEDS_PREFLIGHT_LABEL,
    PREFLIGHT_LABEL,
    PREFLIGHT_REPORT_ANNOTATION,
    PREFLIGHT_TIME_ANNOTATION,
    RULE_MANAGED_LABEL,
    RULE_MANAGED_VALUE,
    TAINT_KEY,
)

MERGE = "application/merge-patch+json"
CORDONED_BY = CORDONED_BY_ANNOTATION
CLEAR_BEFORE = CLEAR_BEFORE_ANNOTATION
HISTORY_ANNOTATIONS = (PREFLIGHT_TIME_ANNOTATION, PREFLIGHT_REPORT_ANNOTATION)
JOB_SELECTOR = f"{MANAGED_LABEL}={MANAGED_VALUE}"
RULE_SELECTOR = f"{RULE_MANAGED_LABEL}={RULE_MANAGED_VALUE}"
CONFLICT_RETRIES = 5


@dataclass(frozen=True)
class UninstallSettings:
    namespace: str
    condition_type: str = CONDITION_TYPE
    taint_key: str = TAINT_KEY
    preflight_label: str = PREFLIGHT_LABEL
    needs_label: str = NEEDS_PREFLIGHT_LABEL
    brake_name: str = ""
    lease_name: str = ""
    pod_selector: str = ""  # the release's agent and controller pods, waited on until gone
    keep_history: bool = False
    wait_s: float = 120.0


@dataclass
class NodeChange:
    """What one Node needs: a merge patch of the Node (labels, annotations, taints, the cordon) and whether its
    condition goes."""

    node: str
    patch: dict[str, Any] = field(default_factory=dict)
    condition: bool = False
    removed: list[str] = field(default_factory=list)


def node_change(node: dict[str, Any], s: UninstallSettings) -> NodeChange:
    """Pure: what of gpu-ready's is on `node` and the patch that removes it (guarded by the Node's
    resourceVersion: a concurrent change of the taints makes it fail with 409, then it is computed again)."""
    meta = node.get("metadata") or {}
    name = str(meta.get("name", ""))
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    change = NodeChange(name)
    label_keys = [] if s.keep_history else [s.preflight_label, s.needs_label]
    gone_labels = [k for k in label_keys if k in labels]
    ann_keys = [CORDONED_BY, *([] if s.keep_history else [CLEAR_BEFORE, *HISTORY_ANNOTATIONS])]
    gone_ann = [k for k in ann_keys if k in annotations]
    spec = node.get("spec") or {}
    taints = spec.get("taints") or []
    kept = [t for t in taints if t.get("key") != s.taint_key]
    patch_meta: dict[str, Any] = {}
    if gone_labels:
        patch_meta["labels"] = dict.fromkeys(gone_labels)
        change.removed += [f"label {k}" for k in gone_labels]
    if gone_ann:
        patch_meta["annotations"] = dict.fromkeys(gone_ann)
        change.removed += [f"annotation {k}" for k in gone_ann]
    patch_spec: dict[str, Any] = {}
    if len(kept) != len(taints):
        patch_spec["taints"] = kept or None
        change.removed.append(f"taint {s.taint_key}")
    if annotations.get(CORDONED_BY) == "true" and spec.get("unschedulable"):
        patch_spec["unschedulable"] = None
        change.removed.append("the cordon preflight set")
    if patch_meta or patch_spec:
        patch_meta["resourceVersion"] = meta.get("resourceVersion")
        change.patch = {"metadata": patch_meta, **({"spec": patch_spec} if patch_spec else {})}
    conditions = (node.get("status") or {}).get("conditions") or []
    if any(c.get("type") == s.condition_type for c in conditions):
        change.condition = True
        change.removed.append(f"condition {s.condition_type}")
    return change


def job_finished(job: dict[str, Any]) -> bool:
    conditions = (job.get("status") or {}).get("conditions") or []
    return any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True" for c in conditions)


class Uninstall:
    def __init__(self, api: KubeApi, s: UninstallSettings, say: Callable[[str], None] = print) -> None:
        self.api, self.s, self.say = api, s, say
        self.errors: list[str] = []

    def run(self) -> int:
        """0 when everything of gpu-ready's is gone (or was never there), 1 when something could not be removed
        (each said in one line)."""
        self.delete_jobs()  # a running preflight would record its labels after the removal: it ends first
        self.wait_for_pods()
        self.clean_nodes()
        self.delete_rules()
        ns = quote(self.s.namespace)
        if self.s.brake_name:
            self.delete(f"/api/v1/namespaces/{ns}/configmaps/{quote(self.s.brake_name)}", "brake ConfigMap")
        if self.s.lease_name:
            self.delete(f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{quote(self.s.lease_name)}", "Lease")
        for e in self.errors:
            self.say(f"error: {e}")
        self.say(f"uninstall: {'done' if not self.errors else f'{len(self.errors)} thing(s) left'}")
        return 1 if self.errors else 0

    def wait_for_pods(self) -> None:
        if not self.s.pod_selector:
            return
        path = f"/api/v1/namespaces/{quote(self.s.namespace)}/pods"
        deadline = time.monotonic() + self.s.wait_s
        delay = 0.5
        while True:
            try:
                items = self.api.request("GET", path, query={"labelSelector": self.s.pod_selector}, verb="LIST")
            except ApiError as e:
                self.errors.append(f"cannot list the release's pods: {e}")
                return
            left = [str(p["metadata"]["name"]) for p in items.get("items") or []]
            if not left:
                return
            if time.monotonic() >= deadline:
                self.say(f"waited {self.s.wait_s:.0f} s for {len(left)} pod(s) to end ({', '.join(left[:3])}); "
                         "cleaning up anyway")  # fmt: skip
                return
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    def clean_nodes(self) -> None:
        query = {"limit": "500"}
        while True:  # in pages: a fleet of thousands of Nodes is not one answer
            try:
                page = self.api.request("GET", "/api/v1/nodes", query=query, verb="LIST")
            except ApiError as e:
                self.errors.append(f"cannot list Nodes: {e}")
                return
            for node in page.get("items") or []:
                self.clean_node(node)
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return
            query = {"limit": "500", "continue": token}

    def clean_node(self, node: dict[str, Any]) -> None:
        for _ in range(CONFLICT_RETRIES):
            change = node_change(node, self.s)
            try:
                if change.patch:
                    self.api.request("PATCH", f"/api/v1/nodes/{quote(change.node)}", change.patch, MERGE)
                if change.condition:
                    self.api.patch_node_status(
                        change.node, {"status": {"conditions": [{"type": self.s.condition_type, "$patch": "delete"}]}}
                    )
            except ApiError as e:
                if e.status == 409:
                    node = self.api.get_node(change.node)
                    continue
                if e.status == 404:
                    return
                self.errors.append(f"Node {change.node}: {e}")
                return
            if change.removed:
                self.say(f"Node {change.node}: removed {', '.join(change.removed)}")
            return
        self.errors.append(f"Node {change.node}: changed under every try ({CONFLICT_RETRIES})")

    def delete_rules(self) -> None:
        version = self.rules_version()
        if version is None:
            return
        path = f"/apis/resource.k8s.io/{version}/devicetaintrules"
        self.delete_listed(path, RULE_SELECTOR, "DeviceTaintRule", "DeviceTaintRules")

    def rules_version(self) -> str | None:
        """The served resource.k8s.io version with devicetaintrules, or None (a cluster without DRA device
        taints has none to remove)."""
        try:
            group = self.api.request("GET", "/apis/resource.k8s.io")
        except ApiError:
            return None
        for v in group.get("versions") or []:
            try:
                res = self.api.request("GET", f"/apis/resource.k8s.io/{v['version']}")
            except ApiError:
                continue
            if any(r.get("name") == "devicetaintrules" for r in res.get("resources") or []):
                return str(v["version"])
        return None

    def delete_jobs(self) -> None:
        self.delete_listed(
            f"/apis/batch/v1/namespaces/{quote(self.s.namespace)}/jobs",
            JOB_SELECTOR,
            "Job",
            "preflight Jobs",
            keep=lambda j: self.s.keep_history and job_finished(j),
            query={"propagationPolicy": "Background"},
        )

    def delete_listed(
        self,
        path: str,
        selector: str,
        kind: str,
        listed_as: str,
        keep: Callable[[dict[str, Any]], bool] = lambda _: False,
        query: dict[str, str] | None = None,
    ) -> None:
        """Deletes every object of `path` that `selector` lists, but those `keep` says stay."""
        try:
            listed = self.api.request("GET", path, query={"labelSelector": selector}, verb="LIST")
        except ApiError as e:
            self.errors.append(f"cannot list {listed_as}: {e}")
            return
        for obj in listed.get("items") or []:
            if not keep(obj):
                self.delete(f"{path}/{quote(obj['metadata']['name'])}", kind, query)

    def delete(self, path: str, what: str, query: dict[str, str] | None = None) -> None:
        name = path.rsplit("/", 1)[-1]
        try:
            self.api.request("DELETE", path, query=query)
        except ApiError as e:
            if e.status != 404:
                self.errors.append(f"{what} {name}: {e}")
            return
        self.say(f"deleted {what} {name}")
