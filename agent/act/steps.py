"""STEPS: every publish/act step once, in the order they run for each published verdict (the contract is
act/step.py; agent/publisher.py is the loop over this list).

1. fencing (act/fencing/): the verdict goes to its own thread, which never delays the condition; the devices
   fenced so far are named in the message;
2. the pods on the affected GPUs are named in the message (report/blast_radius.py), one Event (on the Node) per
   pod holding a GPU that turned bad;
3. metrics follow the verdict;
4. one Event per freshly latched kernel-log fault;
5. the condition (report/condition.py), under its own backoff and the first write's start-up spread;
6. the own taint (act/taints/), after the condition, from the freshest Node copy;
7. the needs-preflight label (act/preflight_mark.py) once a GPU fault latched, from the Node copy the taint
   step left.

The fleet brake (act/brake.py) is read once per verdict into the snapshot; the taint asks it before a NoExecute,
the fencing thread at each reconcile. Per-GPU recovery is no step: it acts on each check cycle's observation, not
on the published verdict (act/recovery/actor.py; the runner hands it each cycle)."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from agent.act import preflight_mark
from agent.act.fencing import plan as fencing_plan
from agent.act.fencing.plan import FencingSettings
from agent.act.fencing.reporter import FenceMetrics, FenceReporter, FenceWorker
from agent.act.preflight_mark import PreflightMark
from agent.act.step import Quiet, Snapshot, StepSpec, Wiring
from agent.act.taints import plan as taint_plan
from agent.act.taints.plan import TaintPlan, TaintSettings
from agent.act.taints.reporter import TaintReporter
from agent.kube.backoff import ApiHealth, first_write_delay, heartbeat_delay
from agent.kube.client import ApiError
from agent.model import Reason, Status, Verdict, gpu_label
from agent.report.blast_radius import EVENT_REASON as POD_EVENT_REASON
from agent.report.blast_radius import BlastRadius, affected_note

OWN_NODE = "own-node-only"  # the condition, the taint and the label: only the agent's own Node, only its fields
OWN_EVENTS = "own-events-only"  # Events: only in the Event namespace, only about the own Node
OWN_DEVICES = "own-devices-only"  # DeviceTaintRules: only for devices of the own node, only gpu-ready's names


class FenceStep(Quiet):
    """Per-GPU DeviceTaintRules (docs/fencing.md) on the fencing thread: `run` only hands the verdict over."""

    name: ClassVar[str] = "fencing"
    settings: ClassVar[type | None] = fencing_plan.FencingSection
    policies: ClassVar[tuple[str, ...]] = (OWN_DEVICES, OWN_EVENTS)

    def __init__(self, w: Wiring) -> None:
        cfg, node = w.cfg, w.cfg.node_name
        assert node
        fs = FencingSettings.of(cfg[fencing_plan.FencingSection], cfg.dra_driver)
        reporter = FenceReporter(
            w.api, node, fs, on_event=w.events.record, metrics=FenceMetrics(w.metrics.registry),
            clock=w.clock.mono, brake=w.brake.brake_engaged,
        )  # fmt: skip
        self.worker = FenceWorker(reporter, on_change=w.wake, log=w.log)

    def start(self) -> None:
        self.worker.start()

    def close(self) -> None:
        self.worker.close()

    def run(self, snap: Snapshot) -> Snapshot:
        self.worker.submit(snap.verdict, snap.inventory)  # never waits; it wakes the loop when its set changes
        return replace(snap, note=self.worker.summary())


class AffectedPodsStep(Quiet):
    """The pods on the affected GPUs: a count in the message, one Event per pod holding a GPU that turned bad."""

    name: ClassVar[str] = "affected pods"
    settings: ClassVar[type | None] = None
    policies: ClassVar[tuple[str, ...]] = (OWN_EVENTS,)

    def __init__(self, w: Wiring) -> None:
        assert w.cfg.node_name
        self.blast, self.events = BlastRadius(w.cfg.node_name), w.events

    def run(self, snap: Snapshot) -> Snapshot:
        for pe in self.blast.step(snap.verdict, snap.allocation):
            self.events.record(POD_EVENT_REASON, pe.note, pe.key, "Warning", "Detected")
        return replace(snap, note=affected_note(snap.verdict, snap.allocation))


class MetricsStep(Quiet):
    """The verdict's gauges (report/metrics.py): written to memory, served on /metrics."""

    name: ClassVar[str] = "metrics"
    settings: ClassVar[type | None] = None
    policies: ClassVar[tuple[str, ...]] = ()

    def __init__(self, w: Wiring) -> None:
        self.metrics = w.metrics

    def run(self, snap: Snapshot) -> Snapshot:
        self.metrics.publish(snap.verdict, snap.latched)
        return snap


class KernelLogEventsStep(Quiet):
    """One Event per freshly latched kernel-log fault (Xid or SXid), naming the GPU or the NVSwitch."""

    name: ClassVar[str] = "kernel-log events"
    settings: ClassVar[type | None] = None
    policies: ClassVar[tuple[str, ...]] = (OWN_EVENTS,)

    def __init__(self, w: Wiring) -> None:
        self.events = w.events

    def run(self, snap: Snapshot) -> Snapshot:
        for ev in snap.fresh:
            where = gpu_label(ev.address, snap.gpus) if ev.address else f"NVSwitch {ev.raw_address}"
            kind = "SXid" if ev.source == "sxid" else "Xid"
            note = f"{kind} {ev.xid} ({ev.name}) on {where}: {ev.text}"
            self.events.record(Reason.FATAL_XID.value, note[:1000], ev.raw_address, "Warning", "Detected")
        return snap


class ConditionStep:
    """The GPUReady condition: written when due (a change, or the heartbeat), under its own backoff; the first
    write waits for its start-up spread unless it changes what the Node shows."""

    name: ClassVar[str] = "condition"
    settings: ClassVar[type | None] = None
    policies: ClassVar[tuple[str, ...]] = (OWN_NODE, OWN_EVENTS)

    def __init__(self, w: Wiring) -> None:
        self.cfg, self.clock, self.log, self.rng, self.metrics = w.cfg, w.clock, w.log, w.rng, w.metrics
        self.condition, self.events = w.condition, w.events
        self.health = ApiHealth(w.log, w.cfg.retry_cap_s, mono=w.clock.mono)
        self.first_write_at = w.clock.mono() + first_write_delay(w.rng, w.cfg.start_spread)

    def start(self) -> None:
        return None

    def close(self) -> None:
        return None

    def deadline(self, now: float) -> float | None:
        waits = [t for t in (self.health.retry_at,) if t > now]
        if self.condition.sent is None and self.first_write_at > now:
            waits.append(self.first_write_at)
        return min(waits, default=None)

    def run(self, snap: Snapshot) -> Snapshot:
        v, now = snap.verdict, self.clock.mono()
        if now < self.health.retry_at or not self.condition.due(v) or self._first_write_held(v, now):
            return snap
        prev = self.condition.sent_status
        try:
            changed = self.condition.write(v)
        except ApiError as e:
            self.health.failed(e, "write status")
            return snap
        self.health.ok("write status")
        self.condition.heartbeat_s = heartbeat_delay(self.rng, self.cfg.heartbeat_interval, self.cfg.heartbeat_jitter)
        self.metrics.condition_writes.inc()
        if changed:
            ctype = self.cfg.condition_type
            self.log.info(
                "GPUReady changed", condition=ctype, status=v.status.value, reason=v.reason.value, message=v.message
            )
            self.events.record(
                v.reason.value,
                f"{ctype} {prev or 'unset'} -> {v.status.value}: {v.message}",
                "",
                "Normal" if v.status is Status.TRUE else "Warning",
                "StatusChanged",
            )
        return snap

    def _first_write_held(self, v: Verdict, now: float) -> bool:
        """start_spread: a fleet that restarts together (a roll-out, a reboot) does not write together. The first
        write waits for its jittered moment unless it changes the status the Node shows (or shows none)."""
        if self.condition.sent is not None or now >= self.first_write_at:
            return False
        return self.condition.sent_status == v.status.value


class TaintStep(Quiet):
    """gpu-ready's taint on this Node (docs/taints.md): its own backoff, after the condition write, so a refused
    taint patch never delays a condition write. Never removed on shutdown."""

    name: ClassVar[str] = "taint"
    settings: ClassVar[type | None] = taint_plan.TaintSection
    policies: ClassVar[tuple[str, ...]] = (OWN_NODE, OWN_EVENTS)

    def __init__(self, w: Wiring) -> None:
        cfg, node = w.cfg, w.cfg.node_name
        assert node
        settings = TaintSettings.of(cfg[taint_plan.TaintSection])
        self.reporter = TaintReporter(
            w.api, node, settings, events=w.events, metrics=w.metrics.taints, retry_cap_s=cfg.retry_cap_s,
            ctype=cfg.condition_type, wall=w.clock.wall, mono=w.clock.mono,
        )  # fmt: skip
        self.health = ApiHealth(w.log, cfg.retry_cap_s, mono=w.clock.mono)  # logs the taint write's state
        self.cfg, self.log, self.condition = cfg, w.log, w.condition

    def deadline(self, now: float) -> float | None:
        return self.reporter.retry_at if self.reporter.retry_at > now else None

    def run(self, snap: Snapshot) -> Snapshot:
        """The taint is planned from the freshest Node copy (the poll's read, or the reporter's own newer one), so
        a steady state costs no request. It is removed only once the Node shows the condition True (what the
        scheduler lets in, observers can see why); it is added as soon as the verdict asks, whether or not the
        condition write went through. The snapshot handed on carries the freshest Node copy."""
        if snap.node is None:
            return snap
        v = snap.verdict
        if self.reporter.due() and not (v.status is Status.TRUE and self.condition.sent_status != Status.TRUE.value):
            self._reconcile(snap)
        fresh = self.reporter.freshest(*snap.node)
        if fresh is snap.node[0] or self.reporter.newest is None:
            return snap
        return replace(snap, node=self.reporter.newest)

    def _reconcile(self, snap: Snapshot) -> None:
        assert snap.node is not None
        node = self.reporter.freshest(*snap.node)
        try:
            plan: TaintPlan = self.reporter.reconcile(
                snap.verdict, snap.latched_fatal, snap.gate_open, node, brake_engaged=snap.brake_engaged
            )
        except ApiError as e:
            self.health.failed(e, "write taint")
            return
        if plan:
            self.health.ok("write taint")
            self.log.info(
                "taint changed", key=self.cfg.taint_key, added=list(plan.add), removed=list(plan.remove),
                why=plan.why, mode=self.cfg.taints,
            )  # fmt: skip


class PreflightMarkStep(Quiet):
    """The needs-preflight label once a GPU fault latched (the controller runs preflight before it clears)."""

    name: ClassVar[str] = "needs-preflight label"
    settings: ClassVar[type | None] = preflight_mark.PreflightMarkSection
    policies: ClassVar[tuple[str, ...]] = (OWN_NODE, OWN_EVENTS)

    def __init__(self, w: Wiring) -> None:
        cfg, node = w.cfg, w.cfg.node_name
        assert node
        self.mark = PreflightMark(
            w.api, node, cfg.marks_after_fault, cfg.needs_preflight_label, w.events.record, w.clock.mono,
            cfg.retry_cap_s,
        )  # fmt: skip
        self.health = ApiHealth(w.log, cfg.retry_cap_s, mono=w.clock.mono)
        self.cfg, self.log = cfg, w.log

    def deadline(self, now: float) -> float | None:
        at = self.mark.backoff.retry_at
        return at if at > now else None

    def run(self, snap: Snapshot) -> Snapshot:
        if snap.node is None:
            return snap
        try:
            if self.mark.reconcile(snap.latched_fatal, snap.node[0]):
                self.health.ok("write needs-preflight label")
                self.log.info("labelled the Node", label=self.cfg.needs_preflight_label, value="true")
        except ApiError as e:
            self.health.failed(e, "write needs-preflight label")
        return snap


STEPS: tuple[StepSpec, ...] = (
    StepSpec(FenceStep, lambda cfg: cfg.fencing),
    StepSpec(AffectedPodsStep),
    StepSpec(MetricsStep),
    StepSpec(KernelLogEventsStep),
    StepSpec(ConditionStep),
    StepSpec(TaintStep),
    StepSpec(PreflightMarkStep),
)
