"""The publish order, once per verdict: what the loop hands over after each cycle or kernel-log wake.

The publisher is the loop over act/steps.py STEPS (each an act/step.py `ActionStep`), in this order:

1. fencing (act/fencing/) gets the verdict on its own thread and never delays the condition; the devices fenced
   so far are named in the message;
2. the message names the pods on the affected GPUs (report/blast_radius.py), with one Event (on the Node) per pod
   holding a GPU that turned bad;
3. metrics follow the verdict;
4. Events (on the Node): one per freshly latched kernel-log fault;
5. the condition (report/condition.py), under its own backoff and the first write's start-up spread;
6. the own taint (act/taints/), after the condition, from the freshest Node copy;
7. the needs-preflight label (act/preflight_mark.py) once a GPU fault latched.

Each step gets one `Snapshot` (the verdict, the latches, the Node, the DRA inventory, the allocation, the brake),
read once per verdict; a note a step adds goes into the message before the next step. A step that fails is logged
and the steps after it still run. The channels the steps share are built here: the Event writer (its own thread),
the condition reporter and the fleet brake (act/brake.py: one watch of the controller's ConfigMap; the taint and
the fencing ask it before a NoExecute).

Every wait it imposes is one deadline (`next_deadline`), which the loop sleeps to."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from agent.act.brake import Brake, split_ref
from agent.act.step import ActionStep, Snapshot, StepSpec, Wiring
from agent.act.steps import STEPS, ConditionStep
from agent.allocation import AllocationMap
from agent.clock import Clock
from agent.config import Config
from agent.kube.client import KubeApi
from agent.model import GpuIdentity, PciAddress, Verdict, XidEvent
from agent.probes.dra import DraInventory
from agent.report.condition import ConditionReporter
from agent.report.events import EventPublisher, EventReporter
from agent.report.metrics import Metrics
from agent.verdict import with_note

S = TypeVar("S")


class Publisher:
    def __init__(
        self,
        cfg: Config,
        api: KubeApi,
        metrics: Metrics,
        clock: Clock,
        log: Any,
        rng: random.Random,
        wake: Callable[[], None],
        node_labels: Callable[[], dict[str, str] | None] | None = None,
        steps: Sequence[StepSpec] = STEPS,
    ) -> None:
        """node_labels: the own Node's labels as last read (None: not known yet); the brake admits by rule a node
        its controller does not count (act/brake.py)."""
        assert cfg.node_name
        self.log = log
        node, m = cfg.node_name, metrics
        self.condition = ConditionReporter(
            api, node, cfg.heartbeat_interval, wall=clock.wall, mono=clock.mono, ctype=cfg.condition_type
        )
        events = EventReporter(
            api,
            node,
            cfg.event_interval,
            cfg.event_namespace,
            wall=clock.wall,
            on_write=lambda r: m.events.labels(r).inc(),
        )
        dropped = m.events_dropped
        self.events = EventPublisher(events, cfg.retry_cap_s, log, on_drop=lambda code: dropped.labels(str(code)).inc())
        ns, name = split_ref(cfg.brake_configmap)
        self.brake = Brake(api, node, ns, name, on_change=wake, watch_timeout_s=cfg.node_watch_timeout)
        if node_labels is not None:
            self.brake.node_labels = node_labels
        wiring = Wiring(cfg, api, m, clock, log, rng, wake, self.events, self.condition, self.brake)
        self.steps: list[ActionStep] = [spec.kind(wiring) for spec in steps if spec.enabled(cfg)]
        self.failures = 0  # step runs that raised (logged; the steps after it still ran)

    def step(self, kind: type[S]) -> S | None:
        """The built step of that class; None when it is not in the list (off under these settings)."""
        return next((s for s in self.steps if isinstance(s, kind)), None)

    @property
    def first_write_at(self) -> float:
        """When the first condition write may go at the latest (start_spread; see ConditionStep)."""
        cond = self.step(ConditionStep)
        return cond.first_write_at if cond is not None else 0.0

    @first_write_at.setter
    def first_write_at(self, at: float) -> None:
        cond = self.step(ConditionStep)
        if cond is not None:
            cond.first_write_at = at

    def record(self, reason: str, note: str, key: str, type_: str, action: str) -> None:
        """Queues an Event about the own Node (the Event writer sends it on its own thread)."""
        self.events.record(reason, note, key, type_, action)

    def brake_engaged(self) -> bool:
        """The fleet brake holds this node's disruptive actions (recovery asks it before an eviction or reset)."""
        return self.brake.brake_engaged()

    def adopt(self, existing: Any, node: dict[str, Any]) -> None:
        """The condition the Node already shows, held at start; the Node's UID for the Events' object reference."""
        self.condition.adopt(existing)
        self.events.reporter.node_uid = (node.get("metadata") or {}).get("uid")

    def start(self) -> None:
        self.brake.start()
        self.events.start()
        for s in self.steps:
            s.start()

    def close(self) -> None:
        self.brake.stop()
        self.events.close()
        for s in self.steps:
            try:
                s.close()
            except Exception as e:  # one step's failure to stop never keeps the others running
                self.log.exception("publish step failed to close", step=s.name, error=str(e))

    def next_deadline(self, now: float) -> float | None:
        """The soonest moment a held write may go (a backoff ends, the first write's spread ends); None: none."""
        waits = [t for t in (s.deadline(now) for s in self.steps) if t is not None and t > now]
        return min(waits, default=None)

    def publish(
        self,
        v: Verdict,
        *,
        latched: int,
        latched_fatal: bool,
        gate_open: bool,
        gpus: dict[PciAddress, GpuIdentity],
        fresh: Sequence[XidEvent],
        inventory: DraInventory | None,
        allocation: AllocationMap | None,
        node: tuple[dict[str, Any], float] | None,
    ) -> Snapshot:
        """Runs every step on one snapshot; returns the snapshot the last step handed on."""
        snap = Snapshot(
            v, latched, latched_fatal, gate_open, gpus, tuple(fresh), inventory, allocation, node,
            self.brake.brake_engaged(),
        )  # fmt: skip
        for s in self.steps:
            try:
                out = s.run(snap)
            except Exception as e:  # a bug in one step must not keep the others (the condition) from publishing
                self.failures += 1
                self.log.exception("publish step failed", step=s.name, error=str(e))
                continue
            snap = replace(out, verdict=with_note(out.verdict, out.note), note="") if out.note else out
        return snap
