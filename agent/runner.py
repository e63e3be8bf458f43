"""`gpu-ready run`: the DaemonSet agent. Wiring and the loop; it parses, decides and formats nothing.

Each poll (or sooner, when the kernel-log watcher or the Node watch wakes it) the loop thread reads the own Node
(node_facts.OwnNode), runs the probes (checks.py), asks the standing (node_facts.Standing: latches, holds,
clears, the RecoveryGate) for the verdict and hands it to the publisher (publisher.py: the loop over the
act/steps.py STEPS, in the publish order). The
kernel-log watcher, the Event publisher, the fencing worker and the watches run on their own threads; the main
thread only waits for SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import random
import sys
import threading
from typing import Any

from agent import config as config_mod
from agent.act.recovery import actor as recovery
from agent.checks import ChecksThread, CheckSuite, CycleStats
from agent.clock import SYSTEM, Clock
from agent.config import Config, ConfigError
from agent.http import HealthServer
from agent.kernel_log.watcher import KernelLogIngest, KmsgSource, KmsgWatcher
from agent.kernel_log.xid import KernelLogParser, XidClassifier
from agent.kube.client import KubeApi, client_layer, connect
from agent.kube.slice_cache import SliceCache
from agent.logs import get_logger
from agent.model import Check, Observation, Verdict
from agent.node_facts import OwnNode, Standing
from agent.publisher import Publisher
from agent.report.condition import ConditionReporter
from agent.report.metrics import Metrics
from agent.shutdown import on_stop_signals, wait_for_signal
from agent.state import LatchState, read_boot_id

# A kernel-log wake that asks for the level checks (an InfiniBand/RoCE link change; records lost before they were
# read) brings the next cycle forward to at most this long after the last one: a flapping link or a log that loses
# records every 0.2 s costs at most two extra cycles a second, and a single one is judged on the cycle it starts.
WAKE_CYCLE_GAP_S = 0.5


def wake_cycle_at(next_poll: float, last_cycle: float | None) -> float:
    """When the next cycle runs once the kernel log asked for one: WAKE_CYCLE_GAP_S after the last cycle (at once
    when that is past), never later than the poll."""
    return min(next_poll, (last_cycle or 0.0) + WAKE_CYCLE_GAP_S)


class Agent:
    def __init__(
        self, cfg: Config, api: KubeApi | None = None, metrics: Metrics | None = None, clock: Clock = SYSTEM
    ) -> None:
        if not cfg.node_name:
            raise ConfigError("node-name is required (--node or NODE_NAME)")
        self.cfg, self.node, self.clock = cfg, cfg.node_name, clock
        self.log = get_logger(node=self.node)
        self.metrics = m = metrics or Metrics()
        self.api = api or connect(cfg.kubeconfig, cfg.api_timeout)
        m.light_client.set(1 if client_layer().light else 0)
        self.api.on_request = self.api.on_request or m.api_request
        self.api.metadata_answers = True  # status patches: the answer is never read, so only its metadata
        self.stop, self.wake, self.node_changed = threading.Event(), threading.Event(), threading.Event()
        self.rng = random.Random()
        self.state = LatchState(
            cfg.state_dir, read_boot_id(cfg.boot_id_file), on_write_failure=lambda _: m.state_write_failures.inc()
        )
        self.suite = CheckSuite(
            cfg, clock=clock.mono, api=self.api, kernel_log=lambda: self.kmsg.problem, latch_store=self._unsaved
        )
        nvml_probe = self.suite.probe(Check.NVML)
        if nvml_probe is not None:  # the NVLinks seen up in this boot outlive an agent restart
            nvml_probe.links = self.state
        parser = KernelLogParser(XidClassifier(cfg.xid_fatal, cfg.xid_ignore, cfg.unknown_xid_fatal))
        ingest = KernelLogIngest(
            parser, self.state, m, rate=self.suite.xid_rate, clock=clock.mono, links=cfg.infiniband
        )
        self.kmsg = KmsgWatcher(KmsgSource(cfg.kmsg, cfg.kmsg_trust_user), ingest, m, self.wake.set, cfg.poll_interval)
        self.own = OwnNode(self.api, cfg, clock, self.log, on_change=self._node_changed)
        self.publisher = Publisher(
            cfg, self.api, m, clock, self.log, self.rng, self.wake.set, node_labels=self._node_labels
        )  # the publish/act steps (act/steps.py)
        self.standing = Standing(cfg, self.state, clock, self.log, self.publisher.record)
        self.recovery = recovery.build(
            cfg, self.api, self.state, smi=self.suite.smi, kmsg_seq=lambda: self.kmsg.source.last_seq,
            on_event=self.publisher.record, registry=m.registry, log=self.log, wake=self.wake.set,
            brake=self.publisher.brake_engaged,  # the fleet brake holds its evictions and resets
            nvml=self.suite.probe(Check.NVML),  # its session is shut down while a reset runs
        )  # fmt: skip  # per-GPU recovery (docs/recovery.md); None when off
        if cfg.node_watch and (cfg.dra_counting or cfg.fencing):  # slices change rarely: twice the Node's watch
            self.suite.slice_cache = SliceCache(
                self.api, self.node, cfg.dra_driver, watch_timeout_s=2 * cfg.node_watch_timeout, rng=self.rng
            )
        self.obs: Observation | None = None  # the newest level observation
        self.checks = ChecksThread(self.suite.run, self.wake.set)
        self._cycle_started = 0.0
        self._cycle_node: dict[str, Any] | None = None  # the Node as the current cycle read it
        self.cycles = 0
        self.turns = 0  # the loop's turns (each wake or timeout): what a test waits on to know a wake was handled
        self.started_mono = clock.mono()
        self.last_cycle_mono: float | None = None
        self.loop_thread: threading.Thread | None = None
        self.server: HealthServer | None = None

    @property
    def condition(self) -> ConditionReporter:
        return self.publisher.condition

    # -- health --------------------------------------------------------------------------------------

    def healthy(self) -> tuple[bool, str]:
        age = self.clock.mono() - (self.last_cycle_mono or self.started_mono)
        if not self.kmsg.alive:
            return False, "kernel-log watcher thread died"
        if age > self.cfg.stall_limit_s:
            return False, f"no check cycle completed for {age:.0f}s (limit {3 * self.cfg.poll_interval:.0f}s)"
        if self.state.write_problem:  # a restart would lose the latches kept only in memory
            return False, f"latched faults are not persisted: {self.state.write_problem}"
        if self.state.load_problem:  # latched faults (and recovery ladders) were lost: loud, never "ok"
            return False, f"state file: {self.state.load_problem}"
        return True, f"ok: last cycle {age:.1f}s ago"

    def _unsaved(self) -> str | None:
        """The state file's write problem while the Node does not show True yet: never start reporting True while
        a latch would not survive a restart (once True, /healthz carries it)."""
        return self.state.write_problem if self.condition.sent_status != "True" else None

    def ready(self) -> tuple[bool, str]:
        if self.cycles == 0:
            return False, "first check cycle not completed"
        return True, f"ok: {self.cycles} cycles"

    # -- one cycle, one verdict ------------------------------------------------------------------------

    def _node_changed(self) -> None:
        self.node_changed.set()  # on the watch thread: only wake the loop
        self.wake.set()

    def refresh_node(self) -> None:
        """A label or annotation of the Node changed (the watch saw it): apply the clear-before annotation and
        the preflight label now, for the next verdict, without a check cycle (no nvidia-smi run)."""
        node, _ = self.own.read()
        if node is not None and self.standing.adopted:
            self.standing.observe(node, self.kmsg.source.last_seq, self._adopt)

    def cycle(self) -> None:
        """One whole cycle on the calling thread (the loop runs the probes on the checks thread instead)."""
        self._end_cycle(*self.suite.run(*self._begin_cycle()))

    def _begin_cycle(self) -> tuple[dict[str, Any] | None, str | None]:
        self.node_changed.clear()  # this cycle reads the Node
        node, node_err = self.own.read()
        self.standing.check_boot()
        self.standing.observe(node, self.kmsg.source.last_seq, self._adopt)
        self.state.retry()
        self._cycle_started = self.clock.wall()
        self._cycle_node = node
        return node, node_err

    def _end_cycle(self, obs: Observation, stats: CycleStats) -> None:
        self.obs = obs
        if self.recovery is not None:  # its own thread: a drain, reset or proof never delays a cycle
            # the Node's taints: gpu-ready's NoSchedule holds new pods off a GPU being drained on a device-plugin node
            self.recovery.submit(
                self.obs,
                self.suite.allocation,
                self._cycle_started,
                self.suite.results.get(Check.FABRIC),
                self._cycle_node,
            )
        self.metrics.observe_cycle(stats, self.suite.allocation, enabled=self.cfg.pod_resources)
        self.metrics.multinode.publish(self.suite.results)
        self.cycles += 1
        self.last_cycle_mono = self.clock.mono()
        self.metrics.last_cycle.set(self.clock.wall())

    def _adopt(self, existing: Any, node: dict[str, Any]) -> None:
        self.publisher.adopt(existing, node)

    def _node_labels(self) -> dict[str, str] | None:
        """The own Node's labels as last read (None: not yet): the brake admits by rule a node its controller
        does not count (act/brake.py)."""
        return dict((self.own.last[0].get("metadata") or {}).get("labels") or {}) if self.own.last else None

    def evaluate(self) -> Verdict:
        assert self.obs is not None
        return self.standing.evaluate(self.obs, self.cycles)

    def publish(self, v: Verdict) -> None:
        self.publisher.publish(
            v,
            latched=len(self.state.snapshot()),
            latched_fatal=self.standing.latched_fatal,
            gate_open=self.standing.gate_open,
            gpus=self.obs.gpus if self.obs else {},
            fresh=self.kmsg.take_fresh(),
            inventory=self.suite.inventory,
            allocation=self.suite.allocation,
            node=self.own.last,
        )

    # -- the loop ------------------------------------------------------------------------------------------

    def start(self, serve: bool = True) -> None:
        self.standing.state_outcome = outcome = self.state.load()
        if self.state.load_problem:
            self.log.error("state file problem", problem=self.state.load_problem)
        elif outcome == "boot_changed":
            self.log.info("new boot: latched faults from the previous boot dropped", boot_id=self.state.boot_id)
        elif outcome == "loaded" and self.state.faults:
            self.log.warning("latched faults restored from the state file", faults=len(self.state.faults))
        self.kmsg.read_available()  # the whole ring buffer once before the first verdict, then follow it
        self.kmsg.start()
        self.publisher.start()
        if self.recovery is not None:
            self.recovery.start()
        for watch in (self.own.cache, self.suite.slice_cache):
            if watch is not None:
                watch.start()
        if serve:
            self.server = HealthServer(self.cfg.metrics_address, self.metrics.registry, self.healthy, self.ready)
            self.server.start()
            self.log.info("serving /metrics /healthz /readyz", address=self.cfg.metrics_address, port=self.server.port)
        self.loop_thread = threading.Thread(target=self.loop, name="agent-loop", daemon=True)
        self.loop_thread.start()

    def loop(self) -> None:
        """Schedules cycles (the probes run on the checks thread) and publishes on every wake: a fault the kernel
        log latched is published at once, also while a cycle is still running."""
        next_poll = self.clock.mono()
        asked = False  # the kernel log asked for a cycle (a link change, lost records): wake_cycle_at
        while not self.stop.is_set():
            due = next_poll
            try:
                # both taken every turn (`|`, not `or`): the rails and the levels are read on one cycle soon
                asked |= self.kmsg.take_link_change() | self.kmsg.take_rerun()
                done = self.checks.take()
                if done is not None:
                    result, error = done
                    next_poll = due = self.clock.mono() + self.cfg.poll_interval
                    try:
                        if error is not None:
                            raise error
                        self._end_cycle(*result)
                    finally:
                        self.checks.done()
                if not self.checks.busy:
                    due = wake_cycle_at(next_poll, self.last_cycle_mono) if asked else next_poll
                    if self.clock.mono() >= due:
                        asked = False
                        self.checks.submit(*self._begin_cycle())
                if self.node_changed.is_set():
                    self.node_changed.clear()
                    self.refresh_node()
                if self.cycles > 0 and not self.stop.is_set():
                    self.publish(self.evaluate())
            except Exception as e:  # a bug must not stop the agent from reporting
                self.log.exception("agent loop error", error=str(e))
                next_poll = due = self.clock.mono() + self.cfg.error_pause_s
            now = self.clock.mono()
            if self.checks.busy:
                due = now + self.cfg.poll_interval  # the run's end wakes the loop
            held = self.publisher.next_deadline(now)
            self.turns += 1
            self.wake.wait(max(0.0, min(due, held if held is not None else due) - now))
            self.wake.clear()

    def shutdown(self, grace_s: float = 4.0) -> None:
        self.stop.set()
        self.wake.set()
        if self.loop_thread is not None:
            self.loop_thread.join(grace_s)
        self.checks.stop()  # a run in progress ends under its probes' deadlines; its thread never holds up the exit
        # The write in flight (if any) finishes under its own timeout; do not start another.
        self.suite.smi.kill_running()
        self.publisher.close()
        if self.recovery is not None:
            self.recovery.close()
        for watch in (self.own.cache, self.suite.slice_cache):
            if watch is not None:
                watch.stop()
        if self.server is not None:
            self.server.stop()
        self.kmsg.close()


def main(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args)
    from agent.logs import setup_logging

    setup_logging(cfg.log_format, cfg.log_level)
    agent = Agent(cfg)
    stop = on_stop_signals(lambda name: agent.log.info("signal received; shutting down", signal=name))
    agent.log.info(
        "gpu-ready starting",
        poll_interval=cfg.poll_interval,
        kmsg=cfg.kmsg,
        nvml=cfg.nvml,
        state_dir=cfg.state_dir,
        light_client=client_layer().light,  # False: the whole kubernetes client was imported (+30 MiB)
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
