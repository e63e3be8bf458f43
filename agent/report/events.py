"""Kubernetes Events (events.k8s.io/v1): the one Event writer of the agent, preflight and the controller. The agent's
are on the Node, reportingController gpu-ready, reportingInstance gpu-ready-<node>: the only Events the chart's
admission policy lets the token write. The controller's (reportingController gpu-ready-controller) are about a Node
or its own Lease, each key written once (it never patches one: its policy allows only creates). The blast radius of
a GPU that turned bad (report/blast_radius.py) is told on the Node too, one Event per pod holding it, naming the pod:
the policy cannot read a Pod to check that it runs on this node, so the agent writes no Events about Pods.

One Event per condition transition and per new fatal Xid per GPU. Repeats within `interval_s` of the
same (reason, GPU) are not written at once: they are counted and folded into the existing Event's
`series` by one PATCH when the interval has passed, so a storm of any size costs at most one create
and one patch per (reason, GPU) per interval. The PATCH carries only `series`: every other field of
an events.k8s.io/v1 Event (note included) is immutable and the apiserver answers 422.

Events never hold up the condition: `EventPublisher` writes them on its own thread with its own
backoff. Events may be deferred (transient errors: retried with backoff) or dropped (an Event the
apiserver refuses for good, e.g. 403 or 422: logged once per reason and code, counted)."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent.clock import micro_time
from agent.kube.backoff import Backoff
from agent.kube.client import ApiError, KubeApi
from agent.logs import get_logger

CONTROLLER = "gpu-ready"
NAMESPACE = "default"
QUEUE_LIMIT = 10_000
MAX_NAME = 253  # an Event's name, like a Node's, is a DNS subdomain of at most 253 characters


def is_permanent(e: ApiError) -> bool:
    """A refusal that a retry will not change (bad request, forbidden, invalid, not found)."""
    return 400 <= e.status < 500 and e.status not in (408, 409, 429)


@dataclass
class _Slot:
    name: str | None = None  # the Event object written for this key
    first: float = 0.0
    last_write: float = 0.0
    count: int = 0  # occurrences folded into the Event so far
    pending: int = 0  # occurrences not written yet
    last_seen: float = 0.0


@dataclass
class PendingEvent:
    reason: str
    gpu: str
    note: str
    type: str
    action: str
    at: float
    regarding: dict[str, Any] | None = None  # None: the reporter's Node


def node_ref(node: str, uid: str | None = None) -> dict[str, Any]:
    """An Event's `regarding` for a Node."""
    ref: dict[str, Any] = {"apiVersion": "v1", "kind": "Node", "name": node}
    if uid:
        ref["uid"] = uid
    return ref


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
    on_drop: Callable[[PendingEvent | None, ApiError], None] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    controller: str = CONTROLLER  # reportingController
    instance: str = ""  # reportingInstance; "": <controller>-<node>

    def record(
        self,
        reason: str,
        note: str,
        gpu: str = "",
        type_: str = "Warning",
        action: str = "Detected",
        regarding: dict[str, Any] | None = None,
    ) -> None:
        """Notes an occurrence; nothing is written until flush(). `gpu` is the aggregation key with `reason`;
        `regarding` the object it is about (None: the reporter's Node)."""
        with self._lock:
            self.queue.append(PendingEvent(reason, gpu, note[:1000], type_, action, self.wall(), regarding))
            if len(self.queue) > QUEUE_LIMIT:  # a storm: keep the newest per key, counts are kept in the slots
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

    def _next(self) -> PendingEvent | None:
        with self._lock:
            return self.queue[0] if self.queue else None

    def _done(self, p: PendingEvent) -> None:
        with self._lock:
            if self.queue and self.queue[0] is p:
                self.queue.pop(0)

    def flush(self) -> int:
        """Writes what is due; returns the writes made. A refused Event is dropped (on_drop); a transient
        failure raises ApiError and what is unsent stays queued."""
        writes = 0
        now = self.wall()
        while (p := self._next()) is not None:
            key = (p.reason, p.gpu)
            slot = self.slots.setdefault(key, _Slot())
            quiet = slot.pending == 0 and now - slot.last_write >= self.interval_s
            if slot.name is None or quiet:
                try:
                    self._create(p, slot)
                    writes += 1
                except ApiError as e:
                    if not is_permanent(e):
                        raise
                    if self.on_drop:
                        self.on_drop(p, e)
            else:
                slot.pending += 1
                slot.last_seen = p.at
            self._done(p)
        for key, slot in list(self.slots.items()):
            if slot.pending and slot.name and now - slot.last_write >= self.interval_s:
                try:
                    self._aggregate(key, slot, now)
                    writes += 1
                except ApiError as e:
                    if not is_permanent(e):
                        raise
                    # Gone (expired after the apiserver's event TTL) or refused: the next occurrence
                    # starts a new Event instead of patching this one again.
                    slot.name, slot.pending = None, 0
                    if self.on_drop:
                        self.on_drop(None, e)
        return writes

    def due_in(self) -> float | None:
        """Seconds until an aggregation patch is due; 0 when something is queued; None when idle."""
        if self.queue:
            return 0.0
        now = self.wall()
        waits = [slot.last_write + self.interval_s - now for slot in self.slots.values() if slot.pending and slot.name]
        return max(0.0, min(waits)) if waits else None

    def _create(self, p: PendingEvent, slot: _Slot) -> None:
        regarding = p.regarding or node_ref(self.node, self.node_uid)
        about = str(regarding.get("name") or self.controller)
        name = f"{about[: MAX_NAME - 17].rstrip('.-')}.{secrets.token_hex(8)}"  # a name, at most 253
        namespace = self.namespace
        body = {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "eventTime": micro_time(p.at),
            "reportingController": self.controller,
            "reportingInstance": (self.instance or f"{self.controller}-{self.node}")[:128],
            "action": p.action,
            "reason": p.reason,
            "regarding": regarding,
            "note": p.note,
            "type": p.type,
        }
        self.api.create_event(namespace, body)
        slot.name, slot.first, slot.last_write, slot.count, slot.pending = name, p.at, self.wall(), 1, 0
        slot.last_seen = p.at
        if self.on_write:
            self.on_write(p.reason)

    def _aggregate(self, key: tuple[str, str], slot: _Slot, now: float) -> None:
        assert slot.name is not None
        count = slot.count + slot.pending
        # Only `series` may change on an events.k8s.io/v1 Event; the note of the first occurrence stays.
        self.api.patch_event(
            self.namespace,
            slot.name,
            {"series": {"count": count, "lastObservedTime": micro_time(slot.last_seen or now)}},
        )
        slot.count, slot.pending, slot.last_write = count, 0, now
        if self.on_write:
            self.on_write(key[0])


class EventPublisher:
    """Writes Events on their own thread, with their own backoff: a slow or failing Event write never
    delays a condition write."""

    def __init__(
        self,
        reporter: EventReporter,
        retry_cap_s: float = 30.0,
        log: Any = None,
        on_drop: Callable[[int], None] | None = None,
    ) -> None:
        self.reporter = reporter
        self.count_drop = on_drop
        self.retry_cap_s = retry_cap_s
        self.log = log or get_logger()
        self.backoff = Backoff(retry_cap_s)
        self.state = "ok"  # "ok" or why the last write failed, logged once per change
        self.stop = threading.Event()
        self._kick = threading.Event()
        self._dropped: set[tuple[str, int]] = set()
        self.thread: threading.Thread | None = None
        reporter.on_drop = self._on_drop

    def record(
        self,
        reason: str,
        note: str,
        gpu: str = "",
        type_: str = "Warning",
        action: str = "Detected",
    ) -> None:
        self.reporter.record(reason, note, gpu, type_, action)
        self._kick.set()

    def start(self) -> EventPublisher:
        self.thread = threading.Thread(target=self._run, name="events", daemon=True)
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self._kick.set()

    def _on_drop(self, p: PendingEvent | None, e: ApiError) -> None:
        if self.count_drop is not None:
            self.count_drop(e.status)
        key = (p.reason if p else "aggregate", e.status)
        if key not in self._dropped:
            self._dropped.add(key)
            self.log.warning("Event refused by the API; dropped", reason=key[0], code=e.status, error=str(e)[:300])

    def _run(self) -> None:
        wait: float | None = None
        while not self.stop.is_set():
            self._kick.wait(wait)
            self._kick.clear()
            if self.stop.is_set():
                return
            try:
                self.reporter.flush()
                if self.state != "ok":
                    self.log.info("Event writes succeed again", previous=self.state)
                self.state = "ok"
                self.backoff.succeeded()
                wait = self.reporter.due_in()
            except ApiError as e:
                state = f"http_{e.status}" if e.status else "unreachable"
                if state != self.state:
                    self.log.warning("Event write failed; retrying with backoff", state=state, error=str(e)[:300])
                self.state = state
                wait = self.backoff.failed(e)
            except Exception as e:  # a bug here must not stop Events for good
                self.log.exception("Event publisher error", error=str(e))
                wait = self.retry_cap_s
