"""What preflight does to its Node: cordon before the gates, then record the outcome (label
<key>=passed|failed, the time and a short report as annotations, uncordon if preflight cordoned it, a
PreflightFailed Event naming the gate). These are the only changes the chart's admission policy allows the
preflight token to make (docs/deployment.md)."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from agent.kube.client import KubeApi
from agent.names import (
    CORDONED_BY_ANNOTATION,
    PREFLIGHT_FAILED,
    PREFLIGHT_LABEL,
    PREFLIGHT_PASSED,
    PREFLIGHT_REPORT_ANNOTATION,
    PREFLIGHT_TIME_ANNOTATION,
)
from agent.preflight.gates import run_gates
from agent.preflight.profile import Profile
from agent.preflight.result import GateFn, GateResult, passed
from agent.report.events import EventReporter

CORDONED_BY = CORDONED_BY_ANNOTATION
TIME_ANNOTATION = PREFLIGHT_TIME_ANNOTATION
REPORT_ANNOTATION = PREFLIGHT_REPORT_ANNOTATION
ANNOTATIONS = (CORDONED_BY, TIME_ANNOTATION, REPORT_ANNOTATION)  # every annotation preflight writes
DEFAULT_EVENT_NAMESPACE = "default"  # the apiserver takes Events about a Node only in default or kube-system


def short_report(results: list[GateResult]) -> str:
    return json.dumps(
        {r.gate: {"status": r.status, "reason": r.reason[:160], "s": r.duration_s} for r in results},
        separators=(",", ":"),
    )[:4000]


def cordon_for_preflight(api: KubeApi, node: str) -> bool:
    """Cordons the node unless it already is; returns whether preflight did it (now or in an earlier run)."""
    obj = api.get_node(node)
    if (obj.get("spec") or {}).get("unschedulable"):
        return cordoned_by_preflight(obj)
    api.patch_node(node, {"spec": {"unschedulable": True}, "metadata": {"annotations": {CORDONED_BY: "true"}}})
    return True


FIELD_MANAGER = "gpu-ready"  # the field manager the apiserver records for preflight's writes (its User-Agent)


def cordoned_by_preflight(node_obj: dict[str, Any]) -> bool:
    """Whether the node's cordon is preflight's own: the mark is set and spec.unschedulable is still owned by
    preflight's field manager alone. An admin's uncordon, or a cordon of theirs since, makes the field theirs, so a
    mark left behind by a failed run never lets preflight lift an admin's cordon (the admission policy holds the
    preflight token to the same rule)."""
    meta = node_obj.get("metadata") or {}
    if (meta.get("annotations") or {}).get(CORDONED_BY) != "true":
        return False
    owners = {
        str(m.get("manager") or "")
        for m in meta.get("managedFields") or []
        if isinstance(m, dict)
        and not m.get("subresource")
        and "f:unschedulable" in ((m.get("fieldsV1") or {}).get("f:spec") or {})
    }
    return owners == {FIELD_MANAGER}


def record_on_node(
    api: KubeApi,
    node: str,
    results: list[GateResult],
    ok: bool,
    blocking: list[GateResult],
    label_key: str = PREFLIGHT_LABEL,
    needs_label: str | None = None,
    cordoned_by_us: bool = False,
    event_namespace: str = DEFAULT_EVENT_NAMESPACE,
) -> dict[str, Any]:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    meta: dict[str, Any] = {
        "labels": {label_key: PREFLIGHT_PASSED if ok else PREFLIGHT_FAILED},
        "annotations": {TIME_ANNOTATION: now, REPORT_ANNOTATION: short_report(results)},
    }
    patch: dict[str, Any] = {"metadata": meta}
    if needs_label and ok:
        meta["labels"][needs_label] = None
    if ok and cordoned_by_us:
        patch["spec"] = {"unschedulable": False}
    if not cordoned_by_us:
        meta["annotations"][CORDONED_BY] = None  # a mark left from an earlier run is stale: the cordon is not ours
    if ok and cordoned_by_us:
        meta["annotations"][CORDONED_BY] = None
    if not ok:
        patch["spec"] = {"unschedulable": True}  # keep it cordoned, or cordon it
    out = api.patch_node(node, patch)
    if not ok:
        ev = EventReporter(api, node, interval_s=0, namespace=event_namespace, node_uid=out["metadata"].get("uid"))
        first = blocking[0]
        evidence = json.dumps(first.evidence, default=str)[:400] if first.evidence else ""
        ev.record(
            "PreflightFailed",
            f"preflight gate {first.gate} {first.status}: {first.reason} {evidence}".strip(),
            action="Preflight",
        )
        ev.flush()
    return out


def onboard(
    api: KubeApi,
    node: str,
    gates: dict[str, GateFn],
    profile: Profile,
    label_key: str = PREFLIGHT_LABEL,
    needs_label: str | None = None,
    event_namespace: str = DEFAULT_EVENT_NAMESPACE,
    progress: Callable[[str], None] | None = None,
) -> tuple[bool, list[GateResult]]:
    """All three steps in one process (for a workstation or a host; the chart's Job runs them as separate
    containers so that the gates never hold the token)."""
    by_us = cordon_for_preflight(api, node)
    results = run_gates(gates, profile.timeouts, progress)
    ok, blocking = passed(results, profile.allow_skip)
    record_on_node(api, node, results, ok, blocking, label_key, needs_label, by_us, event_namespace)
    return ok, results
