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
- a malformed ConfigMap (no `admitted`, an oversized value) is read as engaged: the brake fails closed."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from agent.kube.client import KubeApi
from agent.kube.object_watch import ObjectWatch
from agent.settings import RUN_ONLY, Setting, optional, to_str

_REF = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-.a-z0-9]*[a-z0-9])?$")
MAX_ADMITTED_BYTES = 64 * 1024  # the controller admits at most maxUnavailable names: far below this


def admitted_nodes(obj: dict[str, Any] | None) -> frozenset[str] | None:
    """The nodes the brake ConfigMap admits to a disruptive action; None when it is malformed."""
    data = (obj or {}).get("data")
    if not isinstance(data, dict):
        return None
    raw = data.get("admitted")
    if not isinstance(raw, str) or len(raw) > MAX_ADMITTED_BYTES:
        return None
    return frozenset(n for n in (x.strip() for x in raw.split(",")) if n)


def engaged_for(obj: dict[str, Any] | None, node: str) -> bool:
    """Pure: whether the brake (the ConfigMap as last seen, None: absent) holds `node` from a disruptive action."""
    if obj is None:
        return False
    admitted = admitted_nodes(obj)
    return admitted is None or node not in admitted


def fleet_engaged(obj: dict[str, Any] | None) -> bool:
    """Whether the controller says the fleet is over its budget (the alert's condition; informational here)."""
    return obj is not None and ((obj.get("data") or {}).get("engaged") == "true")


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
        return not self.watch.known or engaged_for(self.watch.get(), self.node)

    def fleet_engaged(self) -> bool:
        return self.watch is not None and fleet_engaged(self.watch.get())


SETTINGS = (
    Setting(
        "brake_configmap",
        optional(lambda v: object_ref(to_str(v))),
        None,
        "the fleet brake's ConfigMap (namespace/name) that gpu-ready controller writes; unset: no brake",
        commands=RUN_ONLY,
    ),
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
