"""The fleet brake, as the agent sees it (docs/controller.md "Fleet brake").

`gpu-ready controller` publishes the brake on one ConfigMap in its namespace: which GPU nodes gpu-ready holds
out of service, how many it may (maxUnavailable), and the nodes admitted to a disruptive action (a NoExecute
taint, a NoExecute DeviceTaintRule), at most maxUnavailable of them. Every agent watches that one object (one
watch, agent/kube/object_watch.py; no Node list, no GET per poll) and its actions consult `brake_engaged()`
before anything that evicts: while it answers True they still write the condition and NoSchedule, and add no
NoExecute.

- no brake ConfigMap named in the settings (no controller installed): never engaged, the agent acts as before;
- the ConfigMap named but absent: never engaged (the controller is not there, or has not written it yet);
- the watch has not received the initial state yet (just after start; RBAC or the apiserver refusing it): held;
- present: engaged for this node unless the node is in `admitted`. A node's first NoExecute thus waits for the
  controller to see its fault and admit it (one round trip through two watches), which is what keeps
  five nodes failing in the same second from evicting more than the budget allows;
- a malformed ConfigMap (no `admitted`, an oversized value) is read as engaged: the brake fails closed;
- a node the controller does not count is admitted by rule: the ConfigMap's `selector` (the controller's GPU
  node selector) does not match the node's labels as the agent last read its Node. The controller never counts
  such a node, so it could never admit it; holding it would hold its evictions and resets forever. Until the
  agent has read its Node, or when the selector is missing or not one this reads (only `key`, `!key`,
  `key=value`, `key==value`, `key!=value`, comma-separated), the node counts (held unless admitted)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.kube.client import KubeApi
from agent.kube.object_watch import ObjectWatch
from agent.names import BRAKE_SELECTOR, fleet_over_budget, parse_admitted
from agent.settings import RUN_ONLY, optional, setting, to_str

_REF = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-.a-z0-9]*[a-z0-9])?$")


def admitted_nodes(obj: dict[str, Any] | None) -> frozenset[str] | None:
    """The nodes the brake ConfigMap admits to a disruptive action; None when it is malformed."""
    admitted = parse_admitted((obj or {}).get("data"))
    return None if admitted is None else frozenset(admitted)


_SEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
MAX_SELECTOR_BYTES = 1024


def selector_matches(selector: Any, labels: dict[str, str]) -> bool | None:
    """Pure: whether an equality-based label selector matches `labels`; None when it is not one this reads."""
    if not isinstance(selector, str) or not selector.strip() or len(selector) > MAX_SELECTOR_BYTES:
        return None
    for term in (t.strip() for t in selector.split(",")):
        for op in ("!=", "==", "="):
            if op in term:
                key, _, value = (x.strip() for x in term.partition(op))
                if not _SEL_KEY.match(key):
                    return None
                if (labels.get(key) == value) != (op != "!="):
                    return False
                break
        else:
            neg = term.startswith("!")
            key = term[1:].strip() if neg else term
            if not _SEL_KEY.match(key):
                return None
            if (key in labels) == neg:
                return False
    return True


def engaged_for(obj: dict[str, Any] | None, node: str, labels: dict[str, str] | None = None) -> bool:
    """Pure: whether the brake (the ConfigMap as last seen, None: absent) holds `node` from a disruptive action.
    `labels`: the node's labels as last read (None: not read yet); a node the ConfigMap's selector does not match
    is not counted by the controller and is admitted by rule."""
    if obj is None:
        return False
    admitted = admitted_nodes(obj)
    if admitted is None:
        return True  # malformed: fails closed, whatever else it says
    if node in admitted:
        return False
    data: dict[str, Any] = obj.get("data") or {}  # a dict: admitted_nodes read it
    # a node the selector does not match is not one of the controller's GPU nodes: it never counts or admits it
    return labels is None or selector_matches(data.get(BRAKE_SELECTOR), labels) is not False


def fleet_engaged(obj: dict[str, Any] | None) -> bool:
    """Whether the controller says the fleet is over its budget (the alert's condition; informational here)."""
    return obj is not None and fleet_over_budget(obj.get("data"))


class Brake:
    """`brake_engaged()` for the agent's actions; no request of its own beyond the one watch."""

    def __init__(
        self,
        api: KubeApi | None,
        node: str,
        namespace: str | None,
        name: str | None,
        on_change: Callable[[], None] | None = None,
        watch_timeout_s: float = 600.0,
    ) -> None:
        self.node = node
        # The own Node's labels as last read (the runner sets it from its Node watch); None: not known yet.
        self.node_labels: Callable[[], dict[str, str] | None] = lambda: None
        self.watch: ObjectWatch | None = None
        if api is not None and namespace and name:
            self.watch = ObjectWatch(
                api,
                namespace,
                name,
                on_change=(lambda _o: on_change()) if on_change is not None else None,
                watch_timeout_s=watch_timeout_s,
            )

    def start(self) -> None:
        if self.watch is not None:
            self.watch.start()

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.stop()

    def brake_engaged(self) -> bool:
        """True while a disruptive action (NoExecute taint or DeviceTaintRule) on this node must wait. Until the
        watch has received the initial state (just after start, or while RBAC or the apiserver refuse it) the
        brake is not known: held (fails closed)."""
        if self.watch is None:
            return False
        return not self.watch.known or engaged_for(self.watch.get(), self.node, self.node_labels())

    def fleet_engaged(self) -> bool:
        return self.watch is not None and fleet_engaged(self.watch.get())


@dataclass(frozen=True)
class BrakeSection:
    """Settings of the fleet brake's reader."""

    brake_configmap: str | None = setting(
        optional(lambda v: object_ref(to_str(v))),
        None,
        "the fleet brake's ConfigMap (namespace/name) that gpu-ready controller writes; unset: no brake",
        commands=RUN_ONLY,
    )


def object_ref(v: str) -> str:
    """A `namespace/name` reference (DNS labels and subdomains), else ValueError."""
    ns, name = split_ref(v)
    if ns is None or name is None or len(v) > 317 or not _REF.match(v):
        raise ValueError(f"expected namespace/name, got {v[:80]!r}")
    return v


def split_ref(ref: str | None) -> tuple[str | None, str | None]:
    """`namespace/name` -> (namespace, name); None or a malformed value -> (None, None)."""
    if not ref or ref.count("/") != 1:
        return None, None
    ns, name = ref.split("/")
    return (ns, name) if ns and name else (None, None)
