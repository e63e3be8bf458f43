"""Kubernetes Events (events.k8s.io/v1) on the Node, reportingController gpu-ready.

One Event per condition transition and per new fatal Xid per GPU. Repeats within `interval_s` of the
same (reason, GPU) are not written at once: they are counted and folded into the existing Event's
`series` by one PATCH when the interval has passed, so a storm of any size costs at most one create
and one patch per (reason, GPU) per interval."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from agent.kube import KubeApi

CONTROLLER = "gpu-ready"
NAMESPACE = "default"


def micro_time(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class _Slot:
    name: str | None = None  # the Event object written for this key
    first: float = 0.0
    last_write: float = 0.0
    count: int = 0  # occurrences folded into the Event so far
    pending: int = 0  # occurrences not written yet
    last_seen: float = 0.0
    note: str = ""


@dataclass
class PendingEvent:
    reason: str
    gpu: str
    note: str
    type: str
    action: str
    at: float


@dataclass
class EventReporter:
    api: KubeApi
    node: str
    interval_s: float = 300.0
    namespace: str = NAMESPACE
    on_write: Callable[[str], None] | None = None
    wall: Callable[[], float] = time.time
    node_uid: str | None = None
    slots: dict[tuple[str, str], _Slot] = field(default_factory=dict)
    queue: list[PendingEvent] = field(default_factory=list)

    def record(self, reason: str, note: str, gpu: str = "", type_: str = "Warning", action: str = "Detected") -> None:
        """Notes an occurrence; nothing is written until flush()."""
        self.queue.append(PendingEvent(reason, gpu, note[:1000], type_, action, self.wall()))
        if len(self.queue) > 10_000:  # a storm: keep the newest per key, counts are kept in the slots
            self._compact()

    def _compact(self) -> None:
        newest: dict[tuple[str, str], PendingEvent] = {}
        for p in self.queue:
            key = (p.reason, p.gpu)
            slot = self.slots.setdefault(key, _Slot())
            if key in newest:
                slot.pending += 1
            newest[key] = p
        self.queue = list(newest.values())

    def flush(self) -> int:
        """Writes what is due; returns the writes made. Raises ApiError (what is unsent stays queued)."""
        writes = 0
        now = self.wall()
        while self.queue:
            p = self.queue[0]
            key = (p.reason, p.gpu)
            slot = self.slots.setdefault(key, _Slot())
            quiet = slot.pending == 0 and now - slot.last_write >= self.interval_s
            if slot.name is None or quiet:
                self._create(p, slot)
                writes += 1
            else:
                slot.pending += 1
                slot.last_seen = p.at
                slot.note = p.note
            self.queue.pop(0)
        for key, slot in self.slots.items():
            if slot.pending and slot.name and now - slot.last_write >= self.interval_s:
                self._aggregate(key, slot, now)
                writes += 1
        return writes

    def _regarding(self) -> dict[str, Any]:
        ref: dict[str, Any] = {"apiVersion": "v1", "kind": "Node", "name": self.node}
        if self.node_uid:
            ref["uid"] = self.node_uid
        return ref

    def _create(self, p: PendingEvent, slot: _Slot) -> None:
        name = f"{self.node}.{secrets.token_hex(8)}"
        body = {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": self.namespace},
            "eventTime": micro_time(p.at),
            "reportingController": CONTROLLER,
            "reportingInstance": f"{CONTROLLER}-{self.node}"[:128],
            "action": p.action,
            "reason": p.reason,
            "regarding": self._regarding(),
            "note": p.note,
            "type": p.type,
        }
        self.api.create_event(self.namespace, body)
        slot.name, slot.first, slot.last_write, slot.count, slot.pending = name, p.at, self.wall(), 1, 0
        slot.last_seen = p.at
        if self.on_write:
            self.on_write(p.reason)

    def _aggregate(self, key: tuple[str, str], slot: _Slot, now: float) -> None:
        assert slot.name is not None
        count = slot.count + slot.pending
        self.api.patch_event(
            self.namespace,
            slot.name,
            {"series": {"count": count, "lastObservedTime": micro_time(slot.last_seen or now)}, "note": slot.note},
        )
        slot.count, slot.pending, slot.last_write = count, 0, now
        if self.on_write:
            self.on_write(key[0])
