"""`gpu-ready run`: the DaemonSet agent. This module only schedules.

The loop thread runs every level check each poll (the Node from a watch's cache: node_cache.py; the node's DRA
ResourceSlices from another: slice_cache.py) and, after each cycle or kernel-log wake, asks the readiness policy
(verdict.py) for the verdict and hands it to the reporters. The kernel-log watcher (kmsg_watch.py) and the Event
publisher (report/events.py) run on their own threads; the main thread only waits for SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import random
import signal
import sys
import threading
import time
from dataclasses import replace
from typing import Any

from agent import config as config_mod
from agent.allocation import AllocationMap
from agent.checks import CheckSuite
from agent.config import Config, ConfigError
from agent.kmsg_watch import KernelLogIngest, KmsgSource, KmsgWatcher
from agent.kube import ApiError, ApiHealth, KubeApi
from agent.logs import get_logger
from agent.model import Check, Finding, Observation, Reason, Status, Verdict
from agent.node_cache import NodeCache, first_write_delay, heartbeat_delay
from agent.report.allocation import EVENT_REASON as POD_EVENT_REASON
from agent.report.allocation import BlastRadius, PodUids, affected_note
from agent.report.condition import ConditionReporter, find_condition
from agent.report.events import EventPublisher, EventReporter
from agent.report.fencing import FenceEffect, FenceMetrics, FenceReporter, FenceWorker, FencingSettings
from agent.report.metrics import Metrics
from agent.report.server import HealthServer
from agent.report.taints import TaintMode, TaintPlan, TaintReporter, TaintSettings
from agent.slice_cache import SliceCache
from agent.state import LatchState, read_boot_id, read_boot_time
from agent.verdict import GateState, NodeFacts, RecoveryGate, adopt, decide_clear, gpu_label, node_facts, with_note
from agent.xid import KernelLogParser, XidClassifier

CLEAR_ANNOTATION = "gpu-ready.io/clear-before"
STALE_NODE_S = 300.0  # judge the plugin on the last Node read for this long while the API is down


class Agent:
    def __init__(self, cfg: Config, api: KubeApi | None = None, metrics: Metrics | None = None) -> None:
        if not cfg.node_name:
            raise ConfigError("node-name is required (--node-name or NODE_NAME)")
        self.cfg, self.node = cfg, cfg.node_name
        self.log = get_logger(node=self.node)
        self.metrics = m = metrics or Metrics()
        self.api = api or api_from(cfg)
        self.api.on_request = self.api.on_request or m.api_request
        self.api.metadata_answers = True  # status patches: the answer is never read, so only its metadata
        self.suite = CheckSuite(cfg, api=self.api)
        self.state = LatchState(
            cfg.state_dir, read_boot_id(cfg.boot_id_file), on_write_failure=lambda _: m.state_write_failures.inc()
        )
        self.stop, self.wake = threading.Event(), threading.Event()
        parser = KernelLogParser(XidClassifier(cfg.xid_fatal, cfg.xid_ignore, cfg.unknown_xid_fatal))
        ingest = KernelLogIngest(parser, self.state, m, rate=self.suite.xid_rate, clock=self.suite.clock)
        self.kmsg = KmsgWatcher(KmsgSource(cfg.kmsg, cfg.kmsg_trust_user), ingest, m, self.wake.set, cfg.poll_interval)
        self.gate = RecoveryGate(cfg.recovery_polls)
        self.gate_state = GateState()
        self.facts = NodeFacts(cfg.require_preflight, False)
        self.condition = ConditionReporter(self.api, self.node, cfg.heartbeat_interval, ctype=cfg.condition_type)
        events = EventReporter(
            self.api, self.node, cfg.event_interval, cfg.event_namespace, on_write=lambda r: m.events.labels(r).inc()
        )
        # the blast radius (docs/allocation.md): Events on the Pods holding a GPU that turned bad, with their UIDs
        self.blast = BlastRadius(self.node)
        if self.pod_resources_on:
            events.uid_of = PodUids(self.api)
        dropped = m.events_dropped
        self.events = EventPublisher(
            events, min(30.0, cfg.poll_interval), self.log, on_drop=lambda code: dropped.labels(str(code)).inc()
        )
        self.api_health = ApiHealth(self.log, min(30.0, cfg.poll_interval))
        # gpu-ready's taint on this Node (docs/taints.md): its own backoff, after the condition write, so a
        # refused taint patch never delays a condition write. Never removed on shutdown.
        taint_settings = TaintSettings(
            TaintMode(cfg.taints), cfg.taint_no_execute, cfg.taint_unknown_as_false, cfg.taint_key
        )
        self.taints = TaintReporter(
            self.api,
            self.node,
            taint_settings,
            events=self.events,
            metrics=m.taints,
            retry_cap_s=min(30.0, cfg.poll_interval),
            ctype=cfg.condition_type,
        )
        self.taint_health = ApiHealth(self.log, min(30.0, cfg.poll_interval))  # logs the taint write's state
        self.fence = self._fence_worker()  # per-GPU DeviceTaintRules (docs/fencing.md); None when off
        self.obs: Observation | None = None  # the newest level observation
        self.last_node: tuple[dict[str, Any], float] | None = None
        self.state_outcome: str | None = None  # LatchState.load()'s answer; None until start()
        self.adopted = False
        self.cycles = 0
        self.started_mono = time.monotonic()
        # the own Node from a watch (node_cache.py): a poll reads the cache; a label or annotation change wakes
        # the loop at once (refresh_node). The first condition write is held up to start_spread (jittered).
        self.rng = random.Random()
        self.node_changed = threading.Event()
        self.node_cache = (
            NodeCache(self.api, self.node, on_change=self._node_changed, watch_timeout_s=cfg.node_watch_timeout)
            if cfg.node_watch
            else None
        )
        # the node's DRA ResourceSlices from a watch too (slice_cache.py): a poll reads them without a LIST; slices
        # change rarely, so each watch lasts twice the Node's (20-40 min, the apiserver's own default is 30-60)
        if cfg.node_watch and (cfg.dra_counting or cfg.fencing):
            self.suite.slice_cache = SliceCache(
                self.api, self.node, cfg.dra_driver, watch_timeout_s=2 * cfg.node_watch_timeout, rng=self.rng
            )
        self.first_write_at = self.started_mono + first_write_delay(self.rng, cfg.start_spread)
        self.last_cycle_mono: float | None = None
        self.loop_thread: threading.Thread | None = None
        self.server: HealthServer | None = None

    # -- health --------------------------------------------------------------------------------------

    def healthy(self) -> tuple[bool, str]:
        limit = 3 * self.cfg.poll_interval
        age = time.monotonic() - (self.last_cycle_mono or self.started_mono)
        if not self.kmsg.alive:
            return False, "kernel-log watcher thread died"
        if age > limit + self.cfg.nvidia_smi_timeout:
            return False, f"no check cycle completed for {age:.0f}s (limit {limit:.0f}s)"
        text = f"ok: last cycle {age:.1f}s ago"
        if self.state.write_problem:  # still 200: a restart would lose the latch kept in memory
            text += f"; latched faults are not persisted: {self.state.write_problem}"
        return True, text

    def ready(self) -> tuple[bool, str]:
        if self.cycles == 0:
            return False, "first check cycle not completed"
        return True, f"ok: {self.cycles} cycles"

    # -- one cycle of level checks ----------------------------------------------------------------

    def _read_node(self) -> tuple[dict[str, Any] | None, str | None]:
        try:
            # from the watch's cache; without it (or while it is down) GET resourceVersion=0: never a quorum read
            node = self.node_cache.get() if self.node_cache else self.api.get_node(self.node, resource_version="0")
            self.api_health.ok("get node")
            self.last_node = (node, time.monotonic())
            return node, None
        except ApiError as e:
            self.api_health.failed(e, "get node")
            if self.last_node is not None and time.monotonic() - self.last_node[1] < STALE_NODE_S:
                return self.last_node[0], None  # keep judging the plugin on the last Node we saw
            return None, str(e)

    def _node_changed(self, _old: dict[str, Any] | None, _new: dict[str, Any] | None) -> None:
        self.node_changed.set()  # on the watch thread: only wake the loop
        self.wake.set()

    def refresh_node(self) -> None:
        """A label or annotation of the Node changed (the watch saw it): apply the clear-before annotation and
        the preflight label now, for the next evaluate(), without a check cycle (no nvidia-smi run)."""
        node, _ = self._read_node()
        if node is None or not self.adopted:
            return  # the next cycle reads it
        self._apply_clear(node)
        self.facts = node_facts(node, self.cfg.preflight_label, self.cfg.require_preflight, self.facts)

    def cycle(self) -> None:
        self.node_changed.clear()  # this cycle reads the Node
        node, node_err = self._read_node()
        bid = read_boot_id(self.cfg.boot_id_file)
        if bid not in (self.state.boot_id, "unknown"):
            n = self.state.new_boot(bid)
            self.gate_state = self.gate_state.new_boot()
            self.log.info("boot ID changed: latched faults cleared", boot_id=bid, cleared=n)
        if node is not None:
            if not self.adopted:
                self._adopt(node)
            self._apply_clear(node)
        self.facts = node_facts(node, self.cfg.preflight_label, self.cfg.require_preflight, self.facts)
        self.state.retry()
        obs, stats = self.suite.run(node, node_err)
        for check, d in stats.durations.items():
            self.metrics.observe_check(str(check), d)
        for check in stats.failed:
            self.metrics.check_failures.labels(str(check)).inc()
        if stats.smi_timed_out:
            self.metrics.smi_timeouts.inc()
        if self.kmsg.problem is not None:
            obs.findings.append(Finding.unchecked(Check.XID, self.kmsg.problem, kind="kmsg_unavailable"))
            self.metrics.check_failures.labels("xid").inc()
        self.metrics.allocation.publish(
            self.allocation, enabled=self.pod_resources_on, read_seconds=stats.durations.get("pod_resources")
        )
        self.obs = obs
        self.cycles += 1
        self.last_cycle_mono = time.monotonic()
        self.metrics.last_cycle.set(time.time())

    def _adopt(self, node: dict[str, Any]) -> None:
        self.adopted = True
        existing = find_condition(node, self.cfg.condition_type)
        self.condition.adopt(existing)
        self.events.reporter.node_uid = (node.get("metadata") or {}).get("uid")
        hold = adopt(
            existing,
            latched_faults=len(self.state.snapshot()),
            state_outcome=self.state_outcome or "new",
            cleared_before=self.state.cleared_before,
            boot_time=read_boot_time(),
        )
        if hold is not None:
            self.gate_state = replace(self.gate_state, hold=hold)
            self.log.info(
                "holding the existing GPUReady=False" + (" as a latched fault" if hold.latched else ""),
                reason=hold.reason.value,
                polls=self.cfg.recovery_polls,
            )

    def _apply_clear(self, node: dict[str, Any]) -> None:
        ann = ((node.get("metadata") or {}).get("annotations") or {}).get(CLEAR_ANNOTATION)
        if ann is None:
            return  # nothing to clear (most polls: no /proc/stat read)
        d = decide_clear(
            ann,
            time.time(),
            boot_time=read_boot_time(),
            cleared_before=self.state.cleared_before,
            rejected=self.state.rejected_clears,
        )
        if d is None:
            return
        if d.problem is not None or d.before is None:
            if self.state.reject_clear(str(ann)[:100]):
                self.log.error("ignoring clear annotation", annotation=CLEAR_ANNOTATION, value=ann, problem=d.problem)
            return
        gone = self.state.clear_before(d.before, self.kmsg.source.last_seq)
        held = self.gate_state.hold
        self.gate_state = self.gate_state.cleared(d.before)
        n = len(gone) + (held is not None and self.gate_state.hold is None)
        if n:
            self.log.info("latched faults cleared by operator", cleared=n, before=ann)
            self.events.record(
                "FaultsCleared", f"{n} latched fault(s) cleared by {CLEAR_ANNOTATION}={ann}", "", "Normal", "Cleared"
            )

    # -- verdict and publishing ------------------------------------------------------------------

    def evaluate(self) -> Verdict:
        assert self.obs is not None
        was_bad = self.gate_state.bad is not None
        v, self.gate_state = self.gate.step(self.gate_state, self.obs, self.cycles, self.state.snapshot(), self.facts)
        if self.gate_state.bad is not None and not was_bad:
            self.log.warning("level fault", reason=v.reason.value, message=v.message)
        elif was_bad and self.gate_state.bad is None:
            self.log.info("level signals clean", polls=self.cfg.recovery_polls)
        return v

    @property
    def pod_resources_on(self) -> bool:
        return self.cfg.pod_resources

    @property
    def allocation(self) -> AllocationMap | None:
        """The newest cycle's allocation map (pod-resources); None when off or unreadable."""
        return self.suite.allocation

    def publish(self, v: Verdict) -> None:
        v = self._fence(v)
        amap = self.allocation
        v = with_note(v, affected_note(v, amap))  # "...; 3 pods on the affected GPUs"
        self.metrics.publish(v, len(self.state.snapshot()))
        for pe in self.blast.step(v, amap):  # one Event per pod holding a GPU that turned bad, per transition
            self.events.record(POD_EVENT_REASON, pe.note, pe.key, "Warning", "Detected", pe.regarding())
        gpus = self.obs.gpus if self.obs else {}
        for ev in self.kmsg.take_fresh():
            where = gpu_label(ev.address, gpus) if ev.address else f"NVSwitch {ev.raw_address}"
            kind = "SXid" if ev.source == "sxid" else "Xid"
            note = f"{kind} {ev.xid} ({ev.name}) on {where}: {ev.text}"
            self.events.record(Reason.FATAL_XID.value, note[:1000], ev.raw_address, "Warning", "Detected")
        self._write_condition(v)
        self._reconcile_taints(v)

    def _write_condition(self, v: Verdict) -> None:
        if time.monotonic() < self.api_health.retry_at or not self.condition.due(v) or self._first_write_held(v):
            return
        prev = self.condition.sent_status
        try:
            changed = self.condition.write(v)
        except ApiError as e:
            self.api_health.failed(e, "write status")
            return
        self.api_health.ok("write status")
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

    def _first_write_held(self, v: Verdict) -> bool:
        """start_spread: a fleet that restarts together (a roll-out, a reboot) does not write together. The first
        write waits for its jittered moment unless it changes the status the Node shows (or shows none)."""
        if self.condition.sent is not None or time.monotonic() >= self.first_write_at:
            return False
        return self.condition.sent_status == v.status.value

    def _reconcile_taints(self, v: Verdict) -> None:
        """gpu-ready's taint after the condition: planned from the freshest Node copy (the poll's read, or
        the reporter's own newer one), so a steady state costs no request. The taint is removed only once the
        Node shows the condition True (what the scheduler lets in, observers can see why); it is added as soon
        as the verdict asks, whether or not the condition write went through."""
        if self.last_node is None or not self.taints.due():
            return
        if v.status is Status.TRUE and self.condition.sent_status != Status.TRUE.value:
            return
        hold = self.gate_state.hold
        latched_fatal = bool(self.state.snapshot()) or (hold is not None and hold.latched)
        gate_open = not self.cfg.require_preflight or self.facts.preflight_passed
        node = self.taints.freshest(*self.last_node)
        try:
            plan: TaintPlan = self.taints.reconcile(v, latched_fatal, gate_open, node)
        except ApiError as e:
            self.taint_health.failed(e, "write taint")
            return
        if plan:
            self.taint_health.ok("write taint")
            self.log.info(
                "taint changed",
                key=self.cfg.taint_key,
                added=list(plan.add),
                removed=list(plan.remove),
                why=plan.why,
                mode=self.cfg.taints,
            )

    def _fence_worker(self) -> FenceWorker | None:
        cfg = self.cfg
        if not cfg.fencing:
            return None
        settings = FencingSettings(
            True, FenceEffect(cfg.fencing_effect), cfg.dra_driver, cfg.fencing_max_rules, cfg.fencing_resync
        )
        reporter = FenceReporter(
            self.api, self.node, settings, on_event=self.events.record, metrics=FenceMetrics(self.metrics.registry)
        )
        return FenceWorker(reporter, on_change=self.wake.set, log=self.log)

    def _fence(self, v: Verdict) -> Verdict:
        """Per-GPU fencing: hands the verdict and the node's slices to the fencing thread (never waits for it, so
        fencing never delays the condition write) and returns the verdict with the devices fenced so far named
        in its message. When that set changes the fencing thread wakes the loop, which republishes."""
        if self.fence is None:
            return v
        self.fence.submit(v, self.suite.inventory)
        return with_note(v, self.fence.summary())

    # -- main loop ---------------------------------------------------------------------------------------

    def start(self, serve: bool = True) -> None:
        self.state_outcome = self.state.load()
        if self.state.load_problem:
            self.log.error("state file problem", problem=self.state.load_problem)
        elif self.state_outcome == "boot_changed":
            self.log.info("new boot: latched faults from the previous boot dropped", boot_id=self.state.boot_id)
        elif self.state_outcome == "loaded" and self.state.faults:
            self.log.warning("latched faults restored from the state file", faults=len(self.state.faults))
        self.kmsg.read_available()  # the whole ring buffer once before the first verdict, then follow it
        self.kmsg.start()
        self.events.start()
        if self.node_cache is not None:
            self.node_cache.start()
        if self.suite.slice_cache is not None:
            self.suite.slice_cache.start()
        if self.fence is not None:
            self.fence.start()
        if serve:
            self.server = HealthServer(self.cfg.metrics_address, self.metrics.registry, self.healthy, self.ready)
            self.server.start()
            self.log.info("serving /metrics /healthz /readyz", address=self.cfg.metrics_address, port=self.server.port)
        self.loop_thread = threading.Thread(target=self.loop, name="agent-loop", daemon=True)
        self.loop_thread.start()

    def loop(self) -> None:
        next_poll = time.monotonic()
        while not self.stop.is_set():
            try:
                rerun = self.kmsg.take_rerun()  # records were lost: check the level signals now
                if rerun or time.monotonic() >= next_poll:
                    self.cycle()
                    next_poll = time.monotonic() + self.cfg.poll_interval
                elif self.node_changed.is_set():
                    self.node_changed.clear()
                    self.refresh_node()
                if self.cycles > 0 and not self.stop.is_set():
                    self.publish(self.evaluate())
            except Exception as e:  # a bug must not stop the agent from reporting
                self.log.exception("agent loop error", error=str(e))
                next_poll = time.monotonic() + min(self.cfg.poll_interval, 5.0)
            now = time.monotonic()
            deadline = min(next_poll, self.api_health.retry_at) if self.api_health.retry_at > now else next_poll
            if self.taints.retry_at > now:
                deadline = min(deadline, self.taints.retry_at)
            if self.condition.sent is None and self.first_write_at > now:
                deadline = min(deadline, self.first_write_at)
            self.wake.wait(max(0.0, deadline - now))
            self.wake.clear()

    def shutdown(self, grace_s: float = 4.0) -> None:
        self.stop.set()
        self.wake.set()
        if self.loop_thread is not None:
            self.loop_thread.join(grace_s)
        # The write in flight (if any) finishes under its own timeout; do not start another.
        self.suite.smi.kill_running()
        self.events.close()
        if self.node_cache is not None:
            self.node_cache.stop()
        if self.suite.slice_cache is not None:
            self.suite.slice_cache.stop()
        if self.fence is not None:
            self.fence.close()
        if self.server is not None:
            self.server.stop()
        self.kmsg.close()


def api_from(cfg: Config) -> KubeApi:
    """The API client from --kubeconfig or the in-cluster config; a broken kubeconfig is a ConfigError."""
    try:
        return KubeApi.from_environment(cfg.kubeconfig, cfg.api_timeout)
    except Exception as e:  # the kubernetes package raises several types for a bad kubeconfig
        where = f"kubeconfig {cfg.kubeconfig}" if cfg.kubeconfig else "in-cluster or ~/.kube/config credentials"
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"cannot load {where}: {first}") from None


def wait_for_signal(stop: threading.Event) -> None:
    """Blocks the main thread until a signal handler sets `stop`, without waking up in between: a signal
    writes a byte to a pipe (signal.set_wakeup_fd) that a blocking read waits on, so one that comes before
    the read is not lost, and the handler has run before the loop looks at `stop` again."""
    import os

    r, w = os.pipe()
    os.set_blocking(w, False)
    previous = signal.set_wakeup_fd(w)
    try:
        while not stop.is_set():
            os.read(r, 64)
    finally:
        signal.set_wakeup_fd(previous)
        os.close(r)
        os.close(w)


def main(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args)
    from agent.logs import setup_logging

    setup_logging(cfg.log_format, cfg.log_level)
    agent = Agent(cfg)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        agent.log.info("signal received; shutting down", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    agent.log.info(
        "gpu-ready starting", poll_interval=cfg.poll_interval, kmsg=cfg.kmsg, nvml=cfg.nvml, state_dir=cfg.state_dir
    )
    try:
        agent.start()
    except OSError as e:  # e.g. the metrics port is taken
        raise ConfigError(f"cannot start: {e.strerror or e} (metrics-address {cfg.metrics_address})") from None
    wait_for_signal(stop)
    agent.shutdown()
    agent.log.info("stopped")
    sys.stdout.flush()
    return 0
