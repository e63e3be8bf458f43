"""The publish order, once per verdict: what the loop hands over after each cycle or kernel-log wake.

1. fencing (act/fencing.py) gets the verdict on its own thread and never delays the condition; the devices fenced
   so far are named in the message;
2. the message names the pods on the affected GPUs (report/blast_radius.py); metrics follow the verdict;
3. Events (on the Node): one per pod holding a GPU that turned bad, naming it; one per freshly latched
   kernel-log fault;
4. the condition (report/condition.py), under its own backoff and the first write's start-up spread;
5. the own taint (act/taints.py), after the condition, from the freshest Node copy;
6. the needs-preflight label (act/preflight_mark.py) once a GPU fault latched.

The fleet brake (act/brake.py) is one watch of the controller's ConfigMap; the taint and the fencing ask it
before a NoExecute.

Every wait it imposes is one deadline (`next_deadline`), which the loop sleeps to."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from agent.act.brake import Brake, split_ref
from agent.act.fencing.plan import FenceEffect, FencingSettings
from agent.act.fencing.reporter import FenceMetrics, FenceReporter, FenceWorker
from agent.act.preflight_mark import PreflightMark
from agent.act.taints import TaintMode, TaintPlan, TaintReporter, TaintSettings
from agent.allocation import AllocationMap
from agent.clock import Clock
from agent.config import Config
from agent.kube.backoff import ApiHealth, first_write_delay, heartbeat_delay
from agent.kube.client import ApiError, KubeApi
from agent.model import GpuIdentity, PciAddress, Reason, Status, Verdict, XidEvent
from agent.probes.dra import DraInventory
from agent.report.blast_radius import EVENT_REASON as POD_EVENT_REASON
from agent.report.blast_radius import BlastRadius, affected_note
from agent.report.condition import ConditionReporter
from agent.report.events import EventPublisher, EventReporter
from agent.report.metrics import Metrics
from agent.verdict import gpu_label, with_note


class Publisher:
    def __init__(
        self, cfg: Config, api: KubeApi, metrics: Metrics, clock: Clock, log: Any, rng: random.Random, wake: Any
    ) -> None:
        assert cfg.node_name
        self.cfg, self.clock, self.log, self.rng, self.metrics = cfg, clock, log, rng, metrics
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
        self.blast = BlastRadius(node)
        self.write_health = ApiHealth(log, cfg.retry_cap_s, mono=clock.mono)
        # gpu-ready's taint on this Node (docs/taints.md): its own backoff, after the condition write, so a
        # refused taint patch never delays a condition write. Never removed on shutdown.
        settings = TaintSettings(TaintMode(cfg.taints), cfg.taint_no_execute, cfg.taint_unknown_as_false, cfg.taint_key)
        self.taints = TaintReporter(
            api, node, settings, events=self.events, metrics=m.taints, retry_cap_s=cfg.retry_cap_s,
            ctype=cfg.condition_type, wall=clock.wall, mono=clock.mono,
        )  # fmt: skip
        self.taint_health = ApiHealth(log, cfg.retry_cap_s, mono=clock.mono)  # logs the taint write's state
        ns, name = split_ref(cfg.brake_configmap)
        self.brake = Brake(api, node, ns, name, on_change=wake, watch_timeout_s=cfg.node_watch_timeout)
        self.taints.brake = self.brake.brake_engaged
        self.mark = PreflightMark(
            api, node, cfg.marks_after_fault, cfg.needs_preflight_label, self.events.record, clock.mono,
            cfg.retry_cap_s,
        )  # fmt: skip
        self.mark_health = ApiHealth(log, cfg.retry_cap_s, mono=clock.mono)
        self.fence: FenceWorker | None = None  # per-GPU DeviceTaintRules (docs/fencing.md); None when off
        if cfg.fencing:
            fs = FencingSettings(
                True, FenceEffect(cfg.fencing_effect), cfg.dra_driver, cfg.fencing_max_rules, cfg.fencing_resync
            )
            reporter = FenceReporter(
                api, node, fs, on_event=self.events.record, metrics=FenceMetrics(m.registry), clock=clock.mono
            )
            reporter.brake = self.brake.brake_engaged
            self.fence = FenceWorker(reporter, on_change=wake, log=log)
        self.first_write_at = clock.mono() + first_write_delay(rng, cfg.start_spread)

    def record(self, reason: str, note: str, key: str, type_: str, action: str) -> None:
        self.events.record(reason, note, key, type_, action)

    def start(self) -> None:
        self.brake.start()
        self.events.start()
        if self.fence is not None:
            self.fence.start()

    def close(self) -> None:
        self.brake.stop()
        self.events.close()
        if self.fence is not None:
            self.fence.close()

    def next_deadline(self, now: float) -> float | None:
        """The soonest moment a held write may go (a backoff ends, the first write's spread ends); None: none."""
        waits = [t for t in (self.write_health.retry_at, self.taints.retry_at, self.mark.backoff.retry_at) if t > now]
        if self.condition.sent is None and self.first_write_at > now:
            waits.append(self.first_write_at)
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
    ) -> None:
        if self.fence is not None:  # never waits for the fencing thread; it wakes the loop when its set changes
            self.fence.submit(v, inventory)
            v = with_note(v, self.fence.summary())
        v = with_note(v, affected_note(v, allocation))  # "...; 3 pods on the affected GPUs"
        self.metrics.publish(v, latched)
        for pe in self.blast.step(v, allocation):  # one Event (on the Node) per pod holding a GPU that turned bad
            self.events.record(POD_EVENT_REASON, pe.note, pe.key, "Warning", "Detected")
        for ev in fresh:
            where = gpu_label(ev.address, gpus) if ev.address else f"NVSwitch {ev.raw_address}"
            kind = "SXid" if ev.source == "sxid" else "Xid"
            note = f"{kind} {ev.xid} ({ev.name}) on {where}: {ev.text}"
            self.events.record(Reason.FATAL_XID.value, note[:1000], ev.raw_address, "Warning", "Detected")
        self._write_condition(v)
        self._reconcile_taints(v, latched_fatal, gate_open, node)
        self._mark_needs_preflight(latched_fatal, node)

    def _mark_needs_preflight(self, latched_fatal: bool, node: tuple[dict[str, Any], float] | None) -> None:
        if node is None:
            return
        try:
            if self.mark.reconcile(latched_fatal, self.taints.freshest(*node)):
                self.mark_health.ok("write needs-preflight label")
                self.log.info("labelled the Node", label=self.cfg.needs_preflight_label, value="true")
        except ApiError as e:
            self.mark_health.failed(e, "write needs-preflight label")

    def _write_condition(self, v: Verdict) -> None:
        now = self.clock.mono()
        if now < self.write_health.retry_at or not self.condition.due(v) or self._first_write_held(v, now):
            return
        prev = self.condition.sent_status
        try:
            changed = self.condition.write(v)
        except ApiError as e:
            self.write_health.failed(e, "write status")
            return
        self.write_health.ok("write status")
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

    def _first_write_held(self, v: Verdict, now: float) -> bool:
        """start_spread: a fleet that restarts together (a roll-out, a reboot) does not write together. The first
        write waits for its jittered moment unless it changes the status the Node shows (or shows none)."""
        if self.condition.sent is not None or now >= self.first_write_at:
            return False
        return self.condition.sent_status == v.status.value

    def _reconcile_taints(
        self, v: Verdict, latched_fatal: bool, gate_open: bool, node: tuple[dict[str, Any], float] | None
    ) -> None:
        """The taint is planned from the freshest Node copy (the poll's read, or the reporter's own newer one), so
        a steady state costs no request. It is removed only once the Node shows the condition True (what the
        scheduler lets in, observers can see why); it is added as soon as the verdict asks, whether or not the
        condition write went through."""
        if node is None or not self.taints.due():
            return
        if v.status is Status.TRUE and self.condition.sent_status != Status.TRUE.value:
            return
        try:
            plan: TaintPlan = self.taints.reconcile(v, latched_fatal, gate_open, self.taints.freshest(*node))
        except ApiError as e:
            self.taint_health.failed(e, "write taint")
            return
        if plan:
            self.taint_health.ok("write taint")
            self.log.info(
                "taint changed", key=self.cfg.taint_key, added=list(plan.add), removed=list(plan.remove),
                why=plan.why, mode=self.cfg.taints,
            )  # fmt: skip
