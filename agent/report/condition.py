"""The GPUReady node condition: a strategic-merge PATCH of nodes/<node>/status carrying only that
condition, sent when status, reason or message changed or when the heartbeat is due.
lastTransitionTime changes only when the status changes."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from agent.kube import KubeApi
from agent.model import Verdict

CONDITION_TYPE = "GPUReady"


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def find_condition(node: dict[str, Any] | None, ctype: str = CONDITION_TYPE) -> dict[str, Any] | None:
    for c in ((node or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return dict(c)
    return None


class ConditionReporter:
    def __init__(
        self,
        api: KubeApi,
        node: str,
        heartbeat_s: float,
        wall: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.node = node
        self.heartbeat_s = heartbeat_s
        self.wall = wall
        self.mono = mono
        self.sent: tuple[str, str, str] | None = None
        self.sent_status: str | None = None
        self.transition: str | None = None
        self.last_write_mono: float | None = None

    def adopt(self, existing: dict[str, Any] | None) -> None:
        """Starts from the condition already on the Node (so a restart keeps lastTransitionTime)."""
        if existing:
            self.sent_status = existing.get("status")
            self.transition = existing.get("lastTransitionTime")

    def due(self, v: Verdict) -> bool:
        if self.sent != v.key:
            return True
        return self.last_write_mono is None or self.mono() - self.last_write_mono >= self.heartbeat_s

    def write(self, v: Verdict) -> bool:
        """Sends the condition; returns whether the status changed. Raises ApiError."""
        now = rfc3339(self.wall())
        changed = self.sent_status != v.status.value
        transition = now if changed or self.transition is None else self.transition
        cond = {
            "type": CONDITION_TYPE,
            "status": v.status.value,
            "reason": v.reason.value,
            "message": v.message,
            "lastHeartbeatTime": now,
            "lastTransitionTime": transition,
        }
        self.api.patch_node_status(self.node, {"status": {"conditions": [cond]}})
        self.sent, self.sent_status, self.transition = v.key, v.status.value, transition
        self.last_write_mono = self.mono()
        return changed
