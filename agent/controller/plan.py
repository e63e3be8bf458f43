"""The controller's decisions, pure: no I/O, no clock of its own (docs/controller.md).

- `node_view`: the few facts of a GPU Node the controller keeps (1,000 Nodes cost kilobytes, not the Nodes);
- `brake_state`: which GPU nodes gpu-ready holds out of service, the budget (maxUnavailable), and the nodes
  admitted to a disruptive action (NoExecute), at most the budget, those admitted before kept first;
- `plan_preflight`: which preflight Jobs to create and delete, which nodes to report, within maxConcurrent,
  the per-node backoff and the retry cap. The state lives in the cluster (the Jobs and their labels), so a
  restarted controller plans the same from what it lists: a running Job is adopted, never doubled."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.names import CORDONED_BY_ANNOTATION, PREFLIGHT_PASSED, format_brake

NODE_LABEL = "gpu-ready.io/preflight-node"  # on the controller's Jobs: the node (or its hash when too long)
NODE_ANNOTATION = "gpu-ready.io/preflight-node"  # the node's full name
ATTEMPT_LABEL = "gpu-ready.io/preflight-attempt"
# The condition reasons of a fault the agent keeps latched until a reboot, a reset or an operator's clear (the
# verdict's LATCHED_REASONS; a test holds the two equal). Preflight on such a node would only test a GPU known to
# be broken: the run waits for the remedy, and a pass then cannot remove the mark while the fault still stands.
LATCHED_REASONS = frozenset({"FatalXid", "GPURecoveryFailed", "GPUResetRefused"})
# The reasons of a GPU fault the agent found (model.FAULT_REASONS but PreflightNotPassed, which is no fault of the
# GPU): a node held for one of these is admitted to a disruptive action before a node held for anything else.
FAULT_REASONS = frozenset(
    {"GPURecoveryFailed", "GPUResetRefused", "FatalXid", "NvidiaSmiFailed", "NvmlHealth", "NvidiaSmiErr",
     "GPUCountMismatch", "DevicePluginUnhealthy", "MigConfigFailed", "FabricNotReady", "GPUDegraded"}
)  # fmt: skip
_PERCENT = re.compile(r"^(\d{1,3})%$")


@dataclass(frozen=True)
class NodeView:
    name: str
    needs: bool = False  # labelled <needs label>=true
    preflight: str = ""  # the preflight label's value (passed, failed, "")
    startup_tainted: bool = False  # carries the startup taint key the controller was told about
    held: str = ""  # why gpu-ready holds it out of service ("": it does not): taint, cordon or condition
    latched: bool = False  # its condition reports a fault still latched (FatalXid, GPURecoveryFailed)
    fault: bool = False  # its condition reports a GPU fault (a reason of the agent's own; not PreflightNotPassed)
    evicting: bool = False  # carries gpu-ready's taint with the NoExecute effect: an eviction in effect now


def node_view(
    node: Mapping[str, Any], needs_label: str, preflight_label: str, taint_key: str, ctype: str, startup_taint: str
) -> NodeView:
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    spec = node.get("spec") or {}
    taints = [t for t in (spec.get("taints") or [])[:1000] if isinstance(t, dict)]
    unschedulable = bool(spec.get("unschedulable"))
    conds = [c for c in ((node.get("status") or {}).get("conditions") or [])[:100] if isinstance(c, dict)]
    held = ""
    if any(t.get("key") == taint_key for t in taints):
        held = "taint"
    elif unschedulable and annotations.get(CORDONED_BY_ANNOTATION) == "true":
        held = "preflight-cordon"
    elif any(c.get("type") == ctype and c.get("status") == "False" for c in conds):
        held = "condition"  # fenced GPUs (DeviceTaintRules) on a node without the taint
    return NodeView(
        name=str(meta.get("name") or ""),
        needs=labels.get(needs_label) == "true",
        preflight=str(labels.get(preflight_label) or ""),
        startup_tainted=bool(startup_taint) and any(t.get("key") == startup_taint for t in taints),
        held=held,
        evicting=any(t.get("key") == taint_key and t.get("effect") == "NoExecute" for t in taints),
        latched=any(
            c.get("type") == ctype and c.get("status") == "False" and c.get("reason") in LATCHED_REASONS for c in conds
        ),
        fault=any(
            c.get("type") == ctype and c.get("status") == "False" and c.get("reason") in FAULT_REASONS for c in conds
        ),
    )


def max_unavailable(spec: str | int, total: int) -> int:
    """A count, or a percentage of `total` rounded down (as a PodDisruptionBudget's maxUnavailable), at least 1
    when total > 0 and the spec is not 0: a brake that admits no node at all would hold every NoExecute."""
    s = str(spec).strip()
    m = _PERCENT.match(s)
    if m:
        n = total * min(100, int(m.group(1))) // 100
        return max(1, n) if total > 0 and int(m.group(1)) > 0 else n
    if s.isdigit():
        return int(s)
    raise ValueError(f"maxUnavailable {s[:40]!r} is not a count or a percentage such as 10%")


@dataclass(frozen=True)
class BrakeState:
    gpu_nodes: int
    unavailable: tuple[str, ...]
    budget: int
    admitted: tuple[str, ...]

    @property
    def engaged(self) -> bool:
        return len(self.unavailable) > self.budget

    def data(self) -> dict[str, str]:
        """The brake ConfigMap's data (act/brake.py reads `admitted`; the rest is for people and alerts)."""
        return format_brake(self.engaged, self.admitted, len(self.unavailable), self.budget, self.gpu_nodes)


def admission_rank(v: NodeView) -> int:
    """Which held nodes the brake admits first: 0 a latched fault (what the disruptive actions are for), 1 another
    GPU fault the condition reports, 2 anything else (gpu-ready's taint or preflight's cordon alone, a condition
    False with no fault reason). A node's own report is one node's weight: it takes at most its own slot, and a
    report without a fault never keeps a slot from a node with one."""
    return 0 if v.latched else 1 if v.fault else 2


def brake_state(nodes: Iterable[NodeView], spec: str | int, previous: Iterable[str] = ()) -> BrakeState:
    """The held nodes in name order; the admitted ones, at most the budget: by admission_rank, and within a rank
    those admitted before first (an admission is not taken back from a node of the same rank), then by name.

    The budget bounds the evictions in effect, not only the admissions: a node that carries gpu-ready's NoExecute
    now (its agent has not yet dropped it, e.g. the node recovered a moment ago and its taint follows its
    condition) takes a slot until it drops it, so a new admission waits for it instead of adding a NoExecute
    beside it. Such a node is admitted (its eviction is counted, not a new one), within the budget."""
    views = list(nodes)
    held_views = sorted((v for v in views if v.held), key=lambda v: v.name)
    held = [v.name for v in held_views]
    budget = max_unavailable(spec, len(views))
    before = {n: i for i, n in enumerate(previous)}
    order = sorted(
        held_views, key=lambda v: (admission_rank(v), 0 if v.name in before else 1, before.get(v.name, 0), v.name)
    )
    evicting = {v.name for v in views if v.evicting}
    in_effect = set(evicting)  # the NoExecutes in effect once the admitted so far take theirs
    admitted: list[str] = []
    for v in order:
        if len(admitted) >= budget:
            break
        if v.name in evicting or len(in_effect) < budget:
            admitted.append(v.name)
            in_effect.add(v.name)
    return BrakeState(len(views), tuple(held), budget, tuple(admitted))


@dataclass(frozen=True)
class JobView:
    name: str
    node: str
    active: bool  # neither Complete nor Failed
    succeeded: bool
    failed: bool
    created: float  # unix seconds
    finished: float | None  # completion or failure time
    ready: int = 0  # pods ready (running)
    started: bool = False  # a pod of it has run (status.ready, or it finished)
    attempt: int = 0


def _time(v: Any) -> float | None:
    from agent.verdict import parse_rfc3339  # the one RFC 3339 parser

    return parse_rfc3339(v)


def job_view(job: Mapping[str, Any]) -> JobView | None:
    meta = job.get("metadata") or {}
    node = (meta.get("annotations") or {}).get(NODE_ANNOTATION)
    if not isinstance(node, str) or not node:
        return None
    st = job.get("status") or {}
    conds = {
        c.get("type"): c for c in (st.get("conditions") or []) if isinstance(c, dict) and c.get("status") == "True"
    }
    succeeded = "Complete" in conds or "SuccessCriteriaMet" in conds
    failed = "Failed" in conds or "FailureTarget" in conds
    fin = conds.get("Complete") or conds.get("Failed") or conds.get("FailureTarget") or conds.get("SuccessCriteriaMet")
    finished = _time((fin or {}).get("lastTransitionTime")) if fin else None
    ready = int(st.get("ready") or 0)
    attempt = str((meta.get("labels") or {}).get(ATTEMPT_LABEL) or "0")
    return JobView(
        name=str(meta.get("name") or ""),
        node=node,
        active=not succeeded and not failed,
        succeeded=succeeded,
        failed=failed,
        created=_time(meta.get("creationTimestamp")) or 0.0,
        finished=finished,
        ready=ready,
        started=ready > 0 or succeeded or failed,
        attempt=int(attempt) if attempt.isdigit() and len(attempt) < 6 else 0,
    )


@dataclass(frozen=True)
class Limits:
    max_concurrent: int = 2
    max_failures: int = 3
    backoff_s: float = 300.0
    pending_timeout_s: float = 900.0
    keep_succeeded_s: float = 30.0  # a passed Job is deleted this long after it finished (the Node's label first)


@dataclass
class Plan:
    create: list[str] = field(default_factory=list)  # nodes to start a Job on
    delete: list[str] = field(default_factory=list)  # Jobs to delete (finished and no longer needed)
    gave_up: list[str] = field(default_factory=list)  # nodes at the retry cap (report once)
    stuck: list[str] = field(default_factory=list)  # Jobs not running after pending_timeout (report once)
    waiting: list[str] = field(default_factory=list)  # nodes that need a run and wait (budget, backoff, brake)
    latched: list[str] = field(default_factory=list)  # nodes that need a run and wait for their fault's remedy
    running: int = 0


def wants_preflight(v: NodeView) -> bool:
    """A node that needs a run: labelled needs-preflight, or (startup taint asked for) new and not yet passed."""
    return v.needs or (v.startup_tainted and v.preflight != PREFLIGHT_PASSED)


def job_name(prefix: str, node: str, attempt: int) -> str:
    """`<prefix>-<node>-<attempt>` within 63 characters: a long node name is cut and a hash of it added."""
    tail = f"-{attempt}"
    base = f"{prefix}-{node}"
    if len(base) + len(tail) > 63:
        h = hashlib.sha256(node.encode()).hexdigest()[:8]
        base = f"{base[: 63 - len(tail) - 9].rstrip('-.')}-{h}"
    return (base + tail).lower()


def node_label_value(node: str) -> str:
    """The node as a label value (at most 63 characters): itself, or a hash of it when longer."""
    return node if len(node) <= 63 else "h-" + hashlib.sha256(node.encode()).hexdigest()[:40]


def plan_preflight(
    nodes: Mapping[str, NodeView],
    jobs: Iterable[JobView],
    limits: Limits,
    now: float,
    brake_engaged: bool = False,
) -> Plan:
    """What to do this round. A node's Jobs are its history: failed ones count toward the cap until the node no
    longer needs preflight (then they are deleted); a succeeded one is deleted once finished."""
    plan = Plan()
    by_node: dict[str, list[JobView]] = {}
    for j in jobs:
        by_node.setdefault(j.node, []).append(j)
    plan.running = sum(1 for js in by_node.values() for j in js if j.active)
    for node, js in sorted(by_node.items()):
        v = nodes.get(node)
        needed = v is not None and wants_preflight(v)
        for j in js:
            if (j.succeeded and now >= (j.finished or j.created) + limits.keep_succeeded_s) or (
                j.failed and not needed
            ):
                plan.delete.append(j.name)
            elif j.active and not j.started and now - j.created >= limits.pending_timeout_s:
                plan.stuck.append(j.name)
    slots = limits.max_concurrent - plan.running
    for name in sorted(nodes):
        v = nodes[name]
        if not wants_preflight(v):
            continue
        js = by_node.get(name, [])
        if any(j.active for j in js):
            continue  # adopted: one Job per node at a time
        if any(j.succeeded for j in js):
            continue  # it passed: the label goes with the record step's write, seen on the next event
        failures = [j for j in js if j.failed]
        if len(failures) >= limits.max_failures:
            plan.gave_up.append(name)
            continue
        if failures:
            last = max((j.finished or j.created) for j in failures)
            if now < last + limits.backoff_s * (2 ** (len(failures) - 1)):
                plan.waiting.append(name)
                continue
        if v.latched:
            plan.latched.append(name)  # a reboot, a reset or an operator's clear comes first
            continue
        if brake_engaged and not v.held:
            plan.waiting.append(name)  # the cordon would take one more node out while the fleet is over budget
            continue
        if slots <= 0:
            plan.waiting.append(name)
            continue
        plan.create.append(name)
        slots -= 1
    return plan


def attempt_of(jobs: Iterable[JobView], node: str) -> int:
    """The next attempt number for `node`: one more than the highest of its Jobs listed. The Job's name holds it,
    so two rounds that plan from the same list create the same name: the second gets 409, never a second Job."""
    return 1 + max((j.attempt for j in jobs if j.node == node), default=0)
