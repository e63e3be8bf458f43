"""The agent marks what needs proof: a GPU-level fault latched on this node -> `gpu-ready.io/needs-preflight=true`
on its own Node (docs/preflight.md "A node that lost a GPU").

The label outlives the latch: a reboot clears the latch (new boot id), the label stays until preflight passes
and removes it (the preflight Job's record step). With requirePreflight the node reports False/PreflightNotPassed
while it carries the label (verdict.node_facts), so a node that lost a GPU, was rebooted and came back cannot go
straight back to GPUReady=True on its old `preflight=passed`.

One merge patch that adds the label only, written once per latch (the Node copy the agent already holds says
whether it is there; no GET for it); a failed write backs off (kube/backoff.py) and is retried at the next
verdict. The chart's admission policy lets the agent's token set exactly this label to "true" on its own Node
and nothing else: never remove it, never touch `preflight=passed`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from agent.kube.backoff import Backoff
from agent.kube.client import ApiError, KubeApi
from agent.names import NEEDS_PREFLIGHT_LABEL
from agent.settings import RUN_ONLY, optional, own_label_key, setting, to_bool

NEEDS_LABEL = NEEDS_PREFLIGHT_LABEL
MERGE_PATCH = "application/merge-patch+json"


def needs_mark(enabled: bool, latched_fatal: bool, node: dict[str, Any] | None, label: str) -> bool:
    """Pure: whether the label must be written now."""
    if not enabled or not latched_fatal or node is None:
        return False
    labels = (node.get("metadata") or {}).get("labels") or {}
    return not (isinstance(labels, dict) and labels.get(label) == "true")


def label_patch(label: str) -> dict[str, Any]:
    return {"metadata": {"labels": {label: "true"}}}


class PreflightMark:
    def __init__(
        self,
        api: KubeApi,
        node: str,
        enabled: bool,
        label: str = NEEDS_LABEL,
        record: Callable[..., None] | None = None,
        mono: Callable[[], float] = time.monotonic,
        retry_cap_s: float = 30.0,
    ) -> None:
        self.api, self.node, self.enabled, self.label, self.record = api, node, enabled, label, record
        self.backoff = Backoff(cap_s=retry_cap_s, mono=mono)
        self.writes = 0
        self.marked_rv: str | None = None  # the Node version our last write produced (the cached copy may lag)

    def reconcile(self, latched_fatal: bool, node: dict[str, Any] | None) -> bool:
        """Writes the label when a fault is latched and the Node does not carry it; returns whether it wrote.
        Raises ApiError (and backs off)."""
        if not needs_mark(self.enabled, latched_fatal, node, self.label) or not self.backoff.due():
            return False
        assert node is not None
        rv = (node.get("metadata") or {}).get("resourceVersion")
        mine = self.marked_rv
        if mine is not None and isinstance(rv, str) and rv.isdigit() and mine.isdigit() and int(rv) < int(mine):
            return False  # our write is newer than the copy we were handed: wait for the watch to catch up
        try:
            ans = self.api.request("PATCH", f"/api/v1/nodes/{quote(self.node)}", label_patch(self.label), MERGE_PATCH)
        except ApiError as e:
            self.backoff.failed(e)
            raise
        self.backoff.succeeded()
        self.writes += 1
        self.marked_rv = str((ans.get("metadata") or {}).get("resourceVersion") or "") or None
        if self.record is not None:
            self.record(
                "NeedsPreflight",
                f"a GPU fault latched: labelled {self.label}=true; the node must pass preflight again",
                "",
                "Warning",
                "Labelled",
            )
        return True


@dataclass(frozen=True)
class PreflightMarkSection:
    """Settings of the needs-preflight mark after a fault."""

    preflight_after_fault: bool | None = setting(
        optional(to_bool),
        None,
        "label the own Node <needs-preflight-label>=true when a GPU fault latches (unset: when requirePreflight)",
        commands=RUN_ONLY,
    )
    needs_preflight_label: str = setting(
        own_label_key,
        NEEDS_LABEL,
        "the label that marks a node as needing preflight (= chart preflight.needsLabel)",
        commands=RUN_ONLY,
    )
