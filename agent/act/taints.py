"""gpu-ready's taint on its own Node, `gpu-ready.io/gpu-not-ready`: the verdict made visible to the scheduler.

A condition does not stop the scheduler; a taint does. Two modes (docs/taints.md):

- `startup`: nodes may join with `gpu-ready.io/gpu-not-ready:NoSchedule` (kubelet
  `--register-with-taints`, Karpenter `startupTaints`, Cluster Autoscaler `--startup-taint`). The agent
  removes it when the node is `True` (and the start-up gate is open: preflight=passed when
  requirePreflight is on) and never adds it.
- `continuous`: as `startup`, and the agent also adds `NoSchedule` while the node is `False` (plus
  `NoExecute` for latched fatal faults when asked to) and removes it when the node is `True` again. The
  verdict already carries the hysteresis, so the taint follows it without a second timer.
- `off` (default): the agent never touches taints.

`Unknown` ("could not check") leaves the taint as it is, unless `unknown_as_false` is set.

`plan_taints` is the pure part: verdict + the taints now on the Node -> which of gpu-ready's entries to
add and remove. `TaintReporter` applies a plan with one JSON patch whose first op `test`s the whole taint
list it planned from, so a concurrent change by anyone else (an admin, the device plugin, the node
lifecycle controller) fails the patch instead of being overwritten; it then re-reads the Node and plans
again. Entries whose key is not gpu-ready's are copied through unchanged, in their order.

The reporter keeps its own backoff (`due()`): a refused or failed taint write is retried later without
holding back the condition write, which the runner sends first and on its own backoff. It never removes
the taint on shutdown: a node whose agent stops keeps what its last verdict asked for."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol
from urllib.parse import quote

from agent.kube.backoff import Backoff
from agent.kube.client import ApiError, KubeApi
from agent.model import TAINT_EFFECTS, Status, Verdict
from agent.report.metrics import TaintMetrics
from agent.settings import RUN_ONLY, WITH_NODE, choice, own_taint_key, setting, to_bool

TAINT_KEY = "gpu-ready.io/gpu-not-ready"
NO_SCHEDULE = "NoSchedule"
PREFER_NO_SCHEDULE = "PreferNoSchedule"
NO_EXECUTE = "NoExecute"
EFFECTS = TAINT_EFFECTS
JSON_PATCH = "application/json-patch+json"
MAX_TAINTS = 1000  # bounds the work on a malformed Node; the API itself keeps the list far shorter
_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class RecordsEvents(Protocol):
    """EventReporter or EventPublisher: notes an Event; the caller's publisher writes it."""

    def record(
        self, reason: str, note: str, gpu: str = "", type_: str = "Warning", action: str = "Detected"
    ) -> None: ...


class TaintMode(StrEnum):
    OFF = "off"
    STARTUP = "startup"
    CONTINUOUS = "continuous"


@dataclass(frozen=True)
class TaintSettings:
    mode: TaintMode = TaintMode.OFF  # the chart turns taints on together with the `patch nodes` RBAC
    no_execute_on_fatal: bool = False  # continuous mode: NoExecute too while a fatal fault is latched
    unknown_as_false: bool = False  # continuous mode: treat Unknown like False
    key: str = TAINT_KEY  # must equal the chart's taints.key (its admission policy allows only that key)


@dataclass(frozen=True)
class TaintPlan:
    """Effects of gpu-ready's taint to add and to remove. Empty: the Node is as it should be."""

    add: tuple[str, ...] = ()
    remove: tuple[str, ...] = ()
    why: str = ""

    def __bool__(self) -> bool:
        return bool(self.add or self.remove)


def taint_key_error(key: str) -> str | None:
    """Why `key` is not a valid taint key (a qualified name: optional DNS-subdomain prefix and "/", then a
    name of at most 63 characters), or None when it is. For the settings' validation."""
    prefix, slash, name = key.rpartition("/")
    bad_prefix = bool(slash) and (not prefix or len(prefix) > 253 or not _PREFIX.match(prefix))
    if len(key) > 317 or not _NAME.match(name) or bad_prefix:
        return f"taint key {key[:80]!r} is not a qualified name like gpu-ready.io/gpu-not-ready"
    return None


def taints_of(node: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The Node's spec.taints as a list of dicts (entries that are not objects are dropped)."""
    raw = ((node or {}).get("spec") or {}).get("taints") or []
    if not isinstance(raw, list):
        return []
    return [t for t in raw[:MAX_TAINTS] if isinstance(t, dict)]


def own_effects(taints: Iterable[dict[str, Any]], key: str = TAINT_KEY) -> frozenset[str]:
    """The effects of the entries whose key is gpu-ready's."""
    return frozenset(str(t.get("effect", "")) for t in taints if t.get("key") == key)


def plan_taints(
    status: Status,
    reason: str,
    latched_fatal: bool,
    current_taints: Sequence[dict[str, Any]],
    settings: TaintSettings,
    startup_gate_open: bool,
    ctype: str = "GPUReady",
    brake: bool = False,
) -> TaintPlan:
    """What gpu-ready's taint should become. Pure: no I/O, no clock.

    `brake`: the fleet brake holds this node (act/brake.py): no NoExecute is added (one already there stays).

    `startup_gate_open` is True when nothing but the verdict holds the gate: preflight=passed when
    requirePreflight is on, always True otherwise. Only entries with gpu-ready's key are ever planned.
    `ctype` (the condition type) only names the condition in `why`."""
    ours = own_effects(current_taints, settings.key)
    if settings.mode is TaintMode.OFF:
        return TaintPlan()
    if status is Status.TRUE:
        if not startup_gate_open or not ours:
            return TaintPlan()
        return TaintPlan(remove=tuple(sorted(ours)), why=f"{ctype}=True ({reason})")
    if settings.mode is not TaintMode.CONTINUOUS:
        return TaintPlan()  # the start-up gate only opens; it never closes again
    if status is Status.UNKNOWN and not settings.unknown_as_false:
        return TaintPlan()  # could not check: leave the taint as it is
    want = {NO_SCHEDULE}
    if settings.no_execute_on_fatal and latched_fatal and (not brake or NO_EXECUTE in ours):
        want.add(NO_EXECUTE)
    add = tuple(e for e in EFFECTS if e in want and e not in ours)
    remove = tuple(sorted(ours - want))
    if not add and not remove:
        return TaintPlan()
    why = f"{ctype}={status.value} ({reason})" + (", fatal fault latched" if latched_fatal else "")
    if brake and settings.no_execute_on_fatal and latched_fatal and NO_EXECUTE not in want:
        why += "; fleet brake: no NoExecute"
    return TaintPlan(add, remove, why)


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def apply_plan(
    current: Sequence[dict[str, Any]], plan: TaintPlan, now: float, key: str = TAINT_KEY
) -> list[dict[str, Any]]:
    """The new taint list: every other entry unchanged and in order, gpu-ready's removals dropped, its
    additions appended (NoExecute with timeAdded, which the API keeps only for NoExecute)."""
    gone = set(plan.remove)
    out = [dict(t) for t in current if not (t.get("key") == key and t.get("effect") in gone)]
    have = own_effects(out, key)
    for effect in plan.add:
        if effect in have:
            continue
        taint: dict[str, Any] = {"key": key, "effect": effect}
        if effect == NO_EXECUTE:
            taint["timeAdded"] = rfc3339(now)
        out.append(taint)
    return out


def taint_patch(raw_taints: Any, new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A JSON patch that replaces spec.taints only if it still holds exactly `raw_taints` (None: absent)."""
    return [
        {"op": "test", "path": "/spec/taints", "value": raw_taints},
        {"op": "add", "path": "/spec/taints", "value": new},
    ]


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
        ctype: str = "GPUReady",
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
    ) -> TaintPlan:
        """Brings gpu-ready's taint to what the verdict asks for and returns the plan applied (empty when
        nothing changed). `node` is the Node this poll already read (saves a GET; re-read on a conflict).
        Events are recorded, not flushed: the caller flushes with the others. Raises ApiError (and then
        backs off: see due()). Mode off only reports (metrics) the taint seen on `node`: a startup taint the
        agent is not allowed to remove still shows in gpu_ready_taint."""
        if self.settings.mode is TaintMode.OFF:
            if node is not None:
                self._observe(taints_of(node))
            return TaintPlan()
        try:
            plan = self._reconcile(verdict, latched_fatal, startup_gate_open, node)
        except ApiError as e:
            self.backoff.failed(e)
            raise
        self.backoff.succeeded()
        return plan

    def _reconcile(
        self, verdict: Verdict, latched_fatal: bool, startup_gate_open: bool, node: dict[str, Any] | None
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
                brake=self.brake is not None and self.brake(),
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


@dataclass(frozen=True)
class TaintSection:
    """Settings of gpu-ready's taint on its own Node."""

    taints: str = setting(
        choice("off", "startup", "continuous"),
        "off",
        "gpu-ready's taint on its own Node: off, startup (remove when ready) or continuous (docs/taints.md)",
        commands=RUN_ONLY,
    )
    taint_key: str = setting(
        own_taint_key, TAINT_KEY, "key of gpu-ready's taint (= chart taints.key)", commands=WITH_NODE
    )
    taint_no_execute: bool = setting(
        to_bool, False, "continuous taints: also NoExecute while a fatal fault is latched", commands=RUN_ONLY
    )
    taint_unknown_as_false: bool = setting(
        to_bool, False, "continuous taints: Unknown taints like False", commands=RUN_ONLY
    )
