"""gpu-ready's taint on its own Node, applied (the plan is act/taints/plan.py, pure): one JSON patch whose first op
`test`s the whole taint list it planned from, re-read and planned again on a conflict; its own backoff."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import quote

from agent.act.taints.plan import (
    JSON_PATCH,
    TaintMode,
    TaintPlan,
    TaintSettings,
    apply_plan,
    own_effects,
    plan_taints,
    taint_patch,
    taints_of,
)
from agent.kube.backoff import Backoff
from agent.kube.client import ApiError, KubeApi
from agent.model import Verdict
from agent.names import CONDITION_TYPE
from agent.report.metrics import TaintMetrics


class RecordsEvents(Protocol):
    """EventReporter or EventPublisher: notes an Event; the caller's publisher writes it."""

    def record(
        self, reason: str, note: str, gpu: str = "", type_: str = "Warning", action: str = "Detected"
    ) -> None: ...


class TaintReporter:
    """Applies plan_taints to the agent's own Node. Needs `get` and `patch` on nodes (the chart's admission
    policy lets the agent's token change only gpu-ready's taint entries, only on its own node)."""

    def __init__(
        self,
        api: KubeApi,
        node: str,
        settings: TaintSettings,
        events: RecordsEvents | None = None,
        metrics: TaintMetrics | None = None,
        wall: Callable[[], float] = time.time,
        attempts: int = 3,
        mono: Callable[[], float] = time.monotonic,
        retry_cap_s: float = 30.0,
        ctype: str = CONDITION_TYPE,
    ) -> None:
        self.api = api
        self.node = node
        self.settings = settings
        self.events = events
        self.metrics = metrics
        self.wall = wall
        self.brake: Callable[[], bool] | None = None  # the fleet brake (act/brake.py): True holds NoExecute back
        self.mono = mono
        self.attempts = max(1, attempts)
        self.retry_cap_s = retry_cap_s
        self.ctype = ctype
        self.last_taints: list[dict[str, Any]] | None = None
        self.newest: tuple[dict[str, Any], float] | None = None  # the last Node this reporter read or wrote
        self.superseded: list[str] = []  # resourceVersions this reporter planned from and then patched over
        self.backoff = Backoff(retry_cap_s, mono=mono)  # after a failed reconcile, none before its retry_at

    @property
    def failures(self) -> int:
        return self.backoff.failures

    @property
    def retry_at(self) -> float:
        return self.backoff.retry_at

    def due(self) -> bool:
        """False while backing off after a failed write."""
        return self.backoff.due()

    def freshest(self, node: dict[str, Any], read_at: float) -> dict[str, Any]:
        """`node` (read at monotonic `read_at`) or, when this reporter has read or written the Node since,
        that newer copy: planning from the poll's read after our own patch would repeat the patch. A poll that
        reads a watch cache can hand over, after our patch, a copy from before it: its resourceVersion is one we
        patched over (compared for equality only: resourceVersions are opaque)."""
        if self.newest is None:
            return node
        rv = (node.get("metadata") or {}).get("resourceVersion")
        if self.newest[1] >= read_at or (rv is not None and rv in self.superseded):
            return self.newest[0]
        return node

    def reconcile(
        self,
        verdict: Verdict,
        latched_fatal: bool,
        startup_gate_open: bool,
        node: dict[str, Any] | None = None,
        brake_engaged: bool | None = None,
    ) -> TaintPlan:
        """Brings gpu-ready's taint to what the verdict asks for and returns the plan applied (empty when
        nothing changed). `node` is the Node this poll already read (saves a GET; re-read on a conflict).
        Events are recorded, not flushed: the caller flushes with the others. Raises ApiError (and then
        backs off: see due()). Mode off only reports (metrics) the taint seen on `node`: a startup taint the
        agent is not allowed to remove still shows in gpu_ready_taint. `brake_engaged`: the fleet brake as the
        caller read it (None: ask `brake`)."""
        if self.settings.mode is TaintMode.OFF:
            if node is not None:
                self._observe(taints_of(node))
            return TaintPlan()
        try:
            if brake_engaged is None:
                brake_engaged = self.brake is not None and self.brake()
            plan = self._reconcile(verdict, latched_fatal, startup_gate_open, node, brake_engaged)
        except ApiError as e:
            self.backoff.failed(e)
            raise
        self.backoff.succeeded()
        return plan

    def _reconcile(
        self,
        verdict: Verdict,
        latched_fatal: bool,
        startup_gate_open: bool,
        node: dict[str, Any] | None,
        brake_engaged: bool,
    ) -> TaintPlan:
        if node is None:
            node = self._get()
        planned_from: list[str] = []
        for attempt in range(self.attempts):
            rv = (node.get("metadata") or {}).get("resourceVersion")
            if isinstance(rv, str):
                planned_from.append(rv)
            current = taints_of(node)
            plan = plan_taints(
                verdict.status,
                verdict.reason.value,
                latched_fatal,
                current,
                self.settings,
                startup_gate_open,
                self.ctype,
                brake=brake_engaged,
            )
            if not plan:
                self._observe(current)
                return plan
            raw = (node.get("spec") or {}).get("taints")
            ops = taint_patch(raw, apply_plan(current, plan, self.wall(), self.settings.key))
            try:
                node = self.api.request("PATCH", f"/api/v1/nodes/{quote(self.node)}", ops, JSON_PATCH)
            except ApiError as e:
                # 422: the `test` op failed (someone changed the taints since we read them); 409: conflict.
                if e.status in (409, 422) and attempt + 1 < self.attempts:
                    node = self._get()
                    continue
                raise
            self.newest = (node, self.mono())
            self.superseded = (self.superseded + planned_from)[-8:]
            self._observe(taints_of(node))
            self._record(plan)
            return plan
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def _get(self) -> dict[str, Any]:
        node = self.api.get_node(self.node)
        self.newest = (node, self.mono())
        return node

    def _observe(self, taints: list[dict[str, Any]]) -> None:
        self.last_taints = taints
        if self.metrics is not None:
            self.metrics.observe(own_effects(taints, self.settings.key))

    def _record(self, plan: TaintPlan) -> None:
        if self.metrics is not None:
            self.metrics.changed(plan)
        if self.events is None:
            return
        key = self.settings.key
        if plan.add:
            what = ", ".join(f"{key}:{e}" for e in plan.add)
            self.events.record("TaintAdded", f"added {what}: {plan.why}", type_="Warning", action="Tainted")
        if plan.remove:
            what = ", ".join(f"{key}:{e}" for e in plan.remove)
            self.events.record("TaintRemoved", f"removed {what}: {plan.why}", type_="Normal", action="Untainted")
