"""`gpu-ready run`: the DaemonSet agent.

One loop thread runs every check each poll (one Node GET per poll), turns findings into a verdict and
publishes it. A watcher thread reads the kernel log continuously (select() on /dev/kmsg) and wakes the
loop at once on a fatal Xid, so detection does not wait for the poll. The main thread only waits for
SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import random
import signal
import sys
import threading
import time
from typing import Any

from agent import config as config_mod
from agent.checks import CheckSuite
from agent.config import Config, ConfigError
from agent.kube import ApiError, KubeApi
from agent.logs import get_logger
from agent.model import Check, Finding, Observation, Reason, Status, Verdict, XidEvent
from agent.probes.kmsg import KmsgRecord, KmsgSource, KmsgUnavailable
from agent.report.condition import ConditionReporter, find_condition, parse_rfc3339
from agent.report.events import EventReporter
from agent.report.metrics import Metrics
from agent.report.server import HealthServer, parse_address
from agent.state import LatchState, read_boot_id
from agent.verdict import decide, gpu_label
from agent.xid import KernelLogParser, XidClassifier

CLEAR_ANNOTATION = "gpu-ready.io/clear-before"
KMSG_BATCH = 2000  # records parsed per read: bounds memory in a storm
STALE_NODE_S = 300.0


def api_state_of(e: ApiError) -> str:
    if e.status == 0:
        return "unreachable"
    if e.status in (401, 403):
        return "forbidden" if e.status == 403 else "unauthorized"
    if e.status == 429:
        return "throttled"
    return f"http_{e.status}"


class KernelLogIngest:
    """The kernel-log hot path: parse records, count GPU errors (one metric update per key and batch),
    latch fatal ones. Returns the newly latched events."""

    def __init__(self, parser: KernelLogParser, state: LatchState, metrics: Metrics) -> None:
        self.parser, self.state, self.metrics = parser, state, metrics

    def process(self, records: list[KmsgRecord]) -> list[XidEvent]:
        fresh: list[XidEvent] = []
        now = time.time()
        counts: dict[tuple[int, str, bool], int] = {}
        feed, latch = self.parser.feed, self.state.latch
        for r in records:
            for ev in feed(r.text, r.seq, r.usec):
                key = (ev.xid, ev.raw_address, ev.fatal)
                counts[key] = counts.get(key, 0) + 1
                if ev.fatal and latch(ev, now) is not None:
                    fresh.append(ev)
        for key, n in counts.items():
            self.metrics.observe_xid_key(key, n)
        return fresh


class Agent:
    def __init__(self, cfg: Config, api: KubeApi | None = None, metrics: Metrics | None = None) -> None:
        if not cfg.node_name:
            raise ConfigError("node-name is required (--node-name or NODE_NAME)")
        parse_address(cfg.metrics_address)
        self.cfg = cfg
        self.node = cfg.node_name
        self.log = get_logger(node=self.node)
        self.metrics = metrics or Metrics()
        self.api = api or KubeApi.from_environment(cfg.kubeconfig, cfg.api_timeout, on_request=self.metrics.api_request)
        if self.api.on_request is None:
            self.api.on_request = self.metrics.api_request
        self.suite = CheckSuite(cfg)
        self.parser = KernelLogParser(XidClassifier(cfg.xid_fatal, cfg.xid_ignore, cfg.unknown_xid_fatal))
        self.kmsg = KmsgSource(cfg.kmsg, cfg.kmsg_trust_user)
        self.state = LatchState(cfg.state_dir, read_boot_id(cfg.boot_id_file))
        self.ingest = KernelLogIngest(self.parser, self.state, self.metrics)
        self.condition = ConditionReporter(self.api, self.node, cfg.heartbeat_interval)
        self.events = EventReporter(
            self.api, self.node, cfg.event_interval, on_write=lambda r: self.metrics.events.labels(r).inc()
        )
        self.stop = threading.Event()
        self.wake = threading.Event()
        self._lock = threading.Lock()
        self.kmsg_problem: str | None = None
        self.rerun_levels = False
        self.last_obs: Observation | None = None
        self.last_node: dict[str, Any] | None = None
        self.last_node_at = 0.0
        self.bad_obs: Observation | None = None
        self.last_level_false = False  # the last cycle's level checks alone said False
        self.preflight_passed = False
        self._bad_clear: str | None = None  # the last unparseable clear annotation, logged once
        self.clean_streak = 0
        self.startup_hold: dict[str, Any] | None = None
        self.adopted = False
        self.cycles = 0
        self.started_mono = time.monotonic()
        self.last_cycle_mono: float | None = None
        self.api_states: dict[str, str] = {}  # per operation ("get node", "write status"): ok or why not
        self.retry_at = 0.0
        self.failures = 0
        self.verdict: Verdict | None = None
        self.pending_xid_events: list[XidEvent] = []
        self.watcher: threading.Thread | None = None
        self.loop_thread: threading.Thread | None = None
        self.server: HealthServer | None = None
        self.writes_in_flight = threading.Lock()

    # -- health --------------------------------------------------------------------------------------

    def healthy(self) -> tuple[bool, str]:
        limit = 3 * self.cfg.poll_interval
        ref = self.last_cycle_mono or self.started_mono
        age = time.monotonic() - ref
        if self.watcher is not None and not self.watcher.is_alive() and not self.stop.is_set():
            return False, "kernel-log watcher thread died"
        if age > limit + self.cfg.nvidia_smi_timeout:
            return False, f"no check cycle completed for {age:.0f}s (limit {limit:.0f}s)"
        return True, f"ok: last cycle {age:.1f}s ago"

    def ready(self) -> tuple[bool, str]:
        if self.cycles == 0:
            return False, "first check cycle not completed"
        return True, f"ok: {self.cycles} cycles"

    # -- kernel log ------------------------------------------------------------------------------

    def _process(self, records: list[KmsgRecord]) -> bool:
        """Parses records; latches fatal events; returns whether anything new was latched."""
        fresh = self.ingest.process(records)
        for ev in fresh:
            self.log.warning(
                "fatal GPU error latched", xid=ev.xid, gpu=ev.raw_address, source=ev.source, text=ev.text[:200]
            )
        if fresh:
            with self._lock:
                self.pending_xid_events += fresh
        return bool(fresh)

    def read_kmsg_once(self) -> bool:
        """Reads and processes what is available now, in bounded batches (a storm never sits in memory
        whole); returns whether a fatal event was latched."""
        new = False
        while True:
            more, latched = self._read_batch()
            new |= latched
            if latched:
                self.wake.set()  # report at once; keep reading the rest of a storm
            if not more:
                return new

    def _read_batch(self) -> tuple[bool, bool]:
        try:
            before = self.kmsg.records_read
            records, lost = self.kmsg.read_available(KMSG_BATCH)
            if self.kmsg_problem is not None:
                self.log.info("kernel log readable again", check="xid", path=self.cfg.kmsg)
                self.kmsg_problem = None
                self.wake.set()
        except KmsgUnavailable as e:
            if self.kmsg_problem != str(e):
                self.log.error("kernel log unavailable", check="xid", error=str(e))
                self.kmsg_problem = str(e)
                self.wake.set()
            self.kmsg.close()
            return False, False
        if lost:
            self.metrics.kmsg_lost.inc(lost)
            self.log.warning(
                "kernel-log records lost before they were read; re-running level checks", check="xid", lost=lost
            )
            self.rerun_levels = True
            self.wake.set()
        latched = self._process(records)
        self.metrics.kmsg_records.inc(self.kmsg.records_read - before)
        return len(records) >= KMSG_BATCH, latched

    def _watch(self) -> None:
        while not self.stop.is_set():
            try:
                if self.kmsg.fd is None:
                    if self.kmsg_problem is not None and self.stop.wait(self.cfg.poll_interval):
                        return
                    if self.read_kmsg_once():
                        self.wake.set()
                    continue
                if not self.kmsg.wait(0.5):
                    continue
                if self.read_kmsg_once():
                    self.wake.set()
            except Exception as e:  # never die silently: log, back off, go on
                self.log.exception("kernel-log watcher error", check="xid", error=str(e))
                self.kmsg.close()
                self.stop.wait(1.0)

    # -- one cycle of level checks ----------------------------------------------------------------

    def _read_node(self) -> tuple[dict[str, Any] | None, str | None]:
        try:
            node = self.api.get_node(self.node)
            self._api_ok("get node")
            self.last_node, self.last_node_at = node, time.monotonic()
            return node, None
        except ApiError as e:
            self._api_failed(e, "get node")
            if self.last_node is not None and time.monotonic() - self.last_node_at < STALE_NODE_S:
                return self.last_node, None  # keep judging the plugin on the last Node we saw
            return None, str(e)

    def cycle(self) -> None:
        node, node_err = self._read_node()
        bid = read_boot_id(self.cfg.boot_id_file)
        if bid != self.state.boot_id and bid != "unknown":
            n = self.state.new_boot(bid)
            self.log.info("boot ID changed: latched faults cleared", boot_id=bid, cleared=n)
        if node is not None:
            if not self.adopted:
                self._adopt(node)
            self._apply_clear(node)
        obs, stats = self.suite.run(node, node_err)
        for check, d in stats.durations.items():
            self.metrics.check_duration.labels(str(check)).observe(d)
        for check in stats.failed:
            self.metrics.check_failures.labels(str(check)).inc()
        if stats.smi_timed_out:
            self.metrics.smi_timeouts.inc()
        if self.kmsg_problem is not None:
            obs.findings.append(Finding.unchecked(Check.XID, self.kmsg_problem, kind="kmsg_unavailable"))
            self.metrics.check_failures.labels("xid").inc()
        level = decide(obs)
        self.last_level_false = level.status is Status.FALSE
        if level.status is Status.FALSE:
            if self.bad_obs is None:
                self.log.warning("level fault", reason=level.reason.value, message=level.message)
            self.bad_obs, self.clean_streak = obs, 0
            self.startup_hold = None
        elif level.status is Status.TRUE and (self.bad_obs is not None or self.startup_hold is not None):
            self.clean_streak += 1
            if self.clean_streak >= self.cfg.recovery_polls:
                self.log.info("level signals clean", polls=self.clean_streak)
                self.bad_obs, self.startup_hold, self.clean_streak = None, None, 0
        if node is not None and self.cfg.require_preflight:
            labels = (node.get("metadata") or {}).get("labels") or {}
            self.preflight_passed = labels.get(self.cfg.preflight_label) == "passed"
        self.last_obs = obs
        self.cycles += 1
        self.last_cycle_mono = time.monotonic()
        self.metrics.last_cycle.set(time.time())

    def _adopt(self, node: dict[str, Any]) -> None:
        self.adopted = True
        existing = find_condition(node)
        self.condition.adopt(existing)
        self.events.node_uid = (node.get("metadata") or {}).get("uid")
        if existing and existing.get("status") == Status.FALSE.value:
            # A restart during a fault must not flip the condition to True: hold it until the level
            # signals have been clean for --recovery-polls polls (latched faults come from the state file).
            self.startup_hold = existing
            self.log.info(
                "holding the existing GPUReady=False until checks are clean",
                reason=existing.get("reason"),
                polls=self.cfg.recovery_polls,
            )

    def _apply_clear(self, node: dict[str, Any]) -> None:
        ann = ((node.get("metadata") or {}).get("annotations") or {}).get(CLEAR_ANNOTATION)
        if not ann:
            return
        before = parse_rfc3339(ann)
        if before is None:
            if self._bad_clear != ann:
                self._bad_clear = ann
                self.log.error(
                    "ignoring clear annotation: not an RFC 3339 time", annotation=CLEAR_ANNOTATION, value=ann
                )
            return
        gone = self.state.clear_before(before, self.kmsg.last_seq)
        if gone:
            self.log.info("latched faults cleared by operator", cleared=len(gone), before=ann)
            self.events.record(
                "FaultsCleared",
                f"{len(gone)} latched fault(s) cleared by {CLEAR_ANNOTATION}={ann}",
                type_="Normal",
                action="Cleared",
            )

    # -- verdict and publishing ------------------------------------------------------------------

    def evaluate(self) -> Verdict:
        assert self.last_obs is not None
        obs = self.last_obs
        if self.bad_obs is not None and not self.last_level_false:
            obs = self.bad_obs  # recovering: keep the fault until enough clean polls
        v = decide(
            obs,
            self.state.snapshot(),
            preflight_required=self.cfg.require_preflight,
            preflight_passed=self.preflight_passed,
        )
        hold = self.startup_hold
        if hold is not None and v.status is Status.TRUE:
            try:
                reason = Reason(str(hold.get("reason")))
            except ValueError:
                reason = Reason.CHECK_FAILED
            v = Verdict(Status.FALSE, reason, str(hold.get("message", ""))[:1000], v.gpus, (reason,), v.counts)
        return v

    def _api_ok(self, what: str) -> None:
        prev = self.api_states.get(what, "ok")
        if prev != "ok":
            self.log.info("API request succeeds again", request=what, previous=prev)
        self.api_states[what] = "ok"
        if what == "write status":
            self.failures, self.retry_at = 0, 0.0

    def _api_failed(self, e: ApiError, what: str) -> None:
        state = api_state_of(e)
        if state != self.api_states.get(what, "ok"):
            level = self.log.error if state in ("forbidden", "unauthorized") else self.log.warning
            level("API request failed; retrying with backoff", request=what, state=state, error=str(e)[:300])
            self.api_states[what] = state
        if what != "write status":
            return  # reads are retried on the next poll
        self.failures += 1
        cap = min(30.0, self.cfg.poll_interval)
        delay = min(cap, 0.5 * 2 ** min(self.failures - 1, 10)) * random.uniform(0.8, 1.2)
        self.retry_at = time.monotonic() + min(delay, cap)

    def publish(self, v: Verdict) -> None:
        self.verdict = v
        self.metrics.publish(v, len(self.state.snapshot()))
        with self._lock:
            fresh, self.pending_xid_events = self.pending_xid_events, []
        gpus = self.last_obs.gpus if self.last_obs else {}
        for ev in fresh:
            where = gpu_label(ev.address, gpus) if ev.address else f"NVSwitch {ev.raw_address}"
            kind = "SXid" if ev.source == "sxid" else "Xid"
            self.events.record(
                Reason.FATAL_XID.value,
                f"{kind} {ev.xid} ({ev.name}) on {where}: {ev.text}"[:1000],
                gpu=ev.raw_address,
                action="Detected",
            )
        if time.monotonic() < self.retry_at:
            return
        with self.writes_in_flight:
            try:
                if self.condition.due(v):
                    prev = self.condition.sent_status
                    changed = self.condition.write(v)
                    self.metrics.condition_writes.inc()
                    if changed:
                        self.log.info(
                            "GPUReady changed", status=v.status.value, reason=v.reason.value, message=v.message
                        )
                        self.events.record(
                            v.reason.value,
                            f"GPUReady {prev or 'unset'} -> {v.status.value}: {v.message}",
                            type_="Normal" if v.status is Status.TRUE else "Warning",
                            action="StatusChanged",
                        )
                self.events.flush()
                self._api_ok("write status")
            except ApiError as e:
                self._api_failed(e, "write status")

    # -- main loop ---------------------------------------------------------------------------------------

    def start(self, serve: bool = True) -> None:
        loaded = self.state.load()
        if self.state.load_problem:
            self.log.error("state file problem", problem=self.state.load_problem)
        elif loaded == "boot_changed":
            self.log.info("new boot: latched faults from the previous boot dropped", boot_id=self.state.boot_id)
        elif loaded == "loaded" and self.state.faults:
            self.log.warning("latched faults restored from the state file", faults=len(self.state.faults))
        # Read the whole ring buffer once before the first verdict, then follow it.
        self.read_kmsg_once()
        self.watcher = threading.Thread(target=self._watch, name="kmsg-watcher", daemon=True)
        self.watcher.start()
        if serve:
            self.server = HealthServer(
                self.cfg.metrics_address, self.metrics.registry, self.healthy, self.ready
            ).start()
            self.log.info(
                "serving /metrics /healthz /readyz", address=f"{self.cfg.metrics_address}", port=self.server.port
            )
        self.loop_thread = threading.Thread(target=self.loop, name="agent-loop", daemon=True)
        self.loop_thread.start()

    def loop(self) -> None:
        next_poll = time.monotonic()
        while not self.stop.is_set():
            try:
                now = time.monotonic()
                if now >= next_poll or self.rerun_levels:
                    self.rerun_levels = False
                    self.cycle()
                    next_poll = time.monotonic() + self.cfg.poll_interval
                if self.cycles > 0 and not self.stop.is_set():
                    self.publish(self.evaluate())
            except Exception as e:  # a bug must not stop the agent from reporting
                self.log.exception("agent loop error", error=str(e))
                next_poll = time.monotonic() + min(self.cfg.poll_interval, 5.0)
            now = time.monotonic()
            deadline = next_poll
            if self.retry_at > now:
                deadline = min(deadline, self.retry_at)
            self.wake.wait(max(0.0, deadline - now))
            self.wake.clear()

    def shutdown(self, grace_s: float = 4.0) -> None:
        self.stop.set()
        self.wake.set()
        if self.loop_thread is not None:
            self.loop_thread.join(grace_s)
        # The write in flight (if any) finishes under its own timeout; do not start another.
        self.suite.smi.kill_running()
        if self.server is not None:
            self.server.stop()
        self.kmsg.close()


def main(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args)
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
    agent.start()
    while not stop.wait(1.0):
        pass
    agent.shutdown()
    agent.log.info("stopped")
    sys.stdout.flush()
    return 0
