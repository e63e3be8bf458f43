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

This module is the pure part: `plan_taints` (verdict + the taints now on the Node -> which of gpu-ready's
entries to add and remove), the patch it becomes, and the settings. `TaintReporter` (act/taints/reporter.py)
applies a plan with one JSON patch whose first op `test`s the whole taint
list it planned from, so a concurrent change by anyone else (an admin, the device plugin, the node
lifecycle controller) fails the patch instead of being overwritten; it then re-reads the Node and plans
again. Entries whose key is not gpu-ready's are copied through unchanged, in their order.

The reporter keeps its own backoff (`due()`): a refused or failed taint write is retried later without
holding back the condition write, which the runner sends first and on its own backoff. It never removes
the taint on shutdown: a node whose agent stops keeps what its last verdict asked for."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from agent.clock import rfc3339
from agent.model import TAINT_EFFECTS, Status
from agent.names import CONDITION_TYPE, TAINT_KEY
from agent.settings import RUN_ONLY, WITH_NODE, choice, own_taint_key, setting, to_bool

NO_SCHEDULE = "NoSchedule"
NO_EXECUTE = "NoExecute"
EFFECTS = TAINT_EFFECTS
JSON_PATCH = "application/json-patch+json"
MAX_TAINTS = 1000  # bounds the work on a malformed Node; the API itself keeps the list far shorter


class TaintMode(StrEnum):
    OFF = "off"
    STARTUP = "startup"
    CONTINUOUS = "continuous"


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


DEFAULT_MODE = TaintMode(TaintSection.taints)


@dataclass(frozen=True)
class TaintSettings:
    """What the plan and the reporter apply: TaintSection's values, typed (its defaults)."""

    mode: TaintMode = DEFAULT_MODE  # the chart turns taints on with the `patch nodes` RBAC
    no_execute_on_fatal: bool = TaintSection.taint_no_execute  # continuous: NoExecute too while a fault is latched
    unknown_as_false: bool = TaintSection.taint_unknown_as_false  # continuous mode: treat Unknown like False
    key: str = TaintSection.taint_key  # must equal the chart's taints.key (its admission policy allows only that key)

    @classmethod
    def of(cls, s: TaintSection) -> TaintSettings:
        return cls(TaintMode(s.taints), s.taint_no_execute, s.taint_unknown_as_false, s.taint_key)


@dataclass(frozen=True)
class TaintPlan:
    """Effects of gpu-ready's taint to add and to remove. Empty: the Node is as it should be."""

    add: tuple[str, ...] = ()
    remove: tuple[str, ...] = ()
    why: str = ""

    def __bool__(self) -> bool:
        return bool(self.add or self.remove)


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
    ctype: str = CONDITION_TYPE,
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
