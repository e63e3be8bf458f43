"""The GPUReady node condition: a strategic-merge PATCH of nodes/<node>/status carrying only that
condition, sent when status, reason or message changed or when the heartbeat is due.
lastTransitionTime changes only when the status changes. The condition's type is a setting
(`conditionType`, default GPUReady; e.g. nvidia.com/GPUReady to stand in for gpu-operator's probe):
the reporter writes it and the runner adopts the condition of that type found on the Node at start."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from agent.clock import rfc3339
from agent.kube.client import KubeApi
from agent.model import Verdict
from agent.names import CONDITION_TYPE
from agent.verdict import MESSAGE_LIMIT, cut_utf8

# The chart's admission policy refuses a condition message over this many bytes (admission-policy.yaml), so that
# the condition can never hold the Node near etcd's request limit; the agent's own stay within MESSAGE_LIMIT.
POLICY_MESSAGE_LIMIT = 1024
assert MESSAGE_LIMIT <= POLICY_MESSAGE_LIMIT


def fit_message(message: str, limit: int = MESSAGE_LIMIT) -> str:
    """`message` if it fits in `limit` bytes (UTF-8), else its head and how much was cut:
    "<head>… (+N bytes cut)". The verdict's messages are built to fit already; this is the last guard."""
    data = message.encode()
    if len(data) <= limit:
        return message
    tail = f"… (+{len(data)} bytes cut)"  # an upper bound on the digits; corrected below
    head = cut_utf8(message, limit - len(tail.encode()))
    return f"{head}… (+{len(data) - len(head.encode())} bytes cut)"


def find_condition(node: dict[str, Any] | None, ctype: str = CONDITION_TYPE) -> dict[str, Any] | None:
    """The Node's condition of type `ctype`; None when absent (or the Node is malformed: a saved file)."""
    status = (node or {}).get("status")
    conditions = status.get("conditions") if isinstance(status, dict) else None
    for c in conditions[:1000] if isinstance(conditions, list) else []:
        if isinstance(c, dict) and c.get("type") == ctype:
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
        ctype: str = CONDITION_TYPE,
    ) -> None:
        self.api = api
        self.node = node
        self.heartbeat_s = heartbeat_s
        self.ctype = ctype
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
            "type": self.ctype,
            "status": v.status.value,
            "reason": v.reason.value,
            "message": fit_message(v.message),
            "lastHeartbeatTime": now,
            "lastTransitionTime": transition,
        }
        self.api.patch_node_status(self.node, {"status": {"conditions": [cond]}})
        self.sent, self.sent_status, self.transition = v.key, v.status.value, transition
        self.last_write_mono = self.mono()
        return changed


def on_node(node: dict[str, Any], ctype: str, taint_key: str) -> dict[str, Any]:
    """What a Node shows of gpu-ready (for `gpu-ready check --node/--node-json`): its condition of the
    configured type (None when absent) and the effects of gpu-ready's taint on it."""
    spec = node.get("spec")
    taints = spec.get("taints") if isinstance(spec, dict) else None
    effects = sorted(
        {
            str(t.get("effect", ""))[:32]
            for t in (taints[:1000] if isinstance(taints, list) else [])
            if isinstance(t, dict) and t.get("key") == taint_key
        }
    )
    c = find_condition(node, ctype)
    keep = ("status", "reason", "message", "lastTransitionTime", "lastHeartbeatTime")
    return {
        "conditionType": ctype,
        "condition": {k: c.get(k) for k in keep} if c else None,
        "taintKey": taint_key,
        "taintEffects": effects,
    }


def render_on_node(shown: dict[str, Any]) -> list[str]:
    """Table lines for on_node()'s answer."""
    c = shown["condition"]
    cond = (
        f"{shown['conditionType']}={c.get('status')} ({c.get('reason')}) since {c.get('lastTransitionTime')}"
        if c
        else f"no {shown['conditionType']} condition"
    )
    effects = shown["taintEffects"]
    taint = f"{shown['taintKey']}: {', '.join(effects)}" if effects else f"no {shown['taintKey']} taint"
    return ["", f"On the Node now: {cond}; {taint}"]
