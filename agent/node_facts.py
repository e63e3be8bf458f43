"""What the agent knows of its own node beyond the probes, and the verdict over time.

- the own Node: from a watch's cache (kube/node_cache.py), else a GET at resourceVersion=0; while the API is
  away, the last Node seen is judged for up to STALE_NODE_S;
- the boot: a new boot id drops the latched faults of the previous boot;
- adoption: the condition the Node already shows is held at start as the verdict.py `adopt` rule says;
- the operator's clear-before annotation and the preflight label;
- the RecoveryGate's state (verdict.py: pure; here it is only kept).

Nothing here writes to the cluster; the Event it asks for goes through the publisher's `record`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from agent.clock import Clock
from agent.config import Config
from agent.kube.backoff import ApiHealth
from agent.kube.client import ApiError, KubeApi
from agent.kube.node_cache import NodeCache
from agent.model import Observation, PciAddress, Verdict
from agent.names import CLEAR_BEFORE_ANNOTATION
from agent.report.condition import find_condition
from agent.state import LatchState, read_boot_id, read_boot_time
from agent.verdict import GateState, HeldCondition, NodeFacts, RecoveryGate, adopt, decide_clear, node_facts

CLEAR_ANNOTATION = CLEAR_BEFORE_ANNOTATION
STALE_NODE_S = 300.0  # judge the plugin on the last Node read for this long while the API is down

Record = Callable[[str, str, str, str, str], None]  # (reason, note, key, type, action): an Event


class OwnNode:
    """The agent's own Node object, as fresh as the watch keeps it, with the stale fallback."""

    def __init__(self, api: KubeApi, cfg: Config, clock: Clock, log: Any, on_change: Callable[[], None]) -> None:
        assert cfg.node_name
        self.api, self.name, self.clock = api, cfg.node_name, clock
        self.health = ApiHealth(log, cfg.retry_cap_s, mono=clock.mono)
        self.last: tuple[dict[str, Any], float] | None = None  # the last Node read, and when (mono)
        self.cache = (
            NodeCache(api, self.name, on_change=lambda _o, _n: on_change(), watch_timeout_s=cfg.node_watch_timeout)
            if cfg.node_watch
            else None
        )

    def read(self) -> tuple[dict[str, Any] | None, str | None]:
        """The Node, or None and why not."""
        try:
            # from the watch's cache; without it (or while it is down) GET resourceVersion=0: never a quorum read
            node = self.cache.get() if self.cache else self.api.get_node(self.name, resource_version="0")
            self.health.ok("get node")
            self.last = (node, self.clock.mono())
            return node, None
        except ApiError as e:
            self.health.failed(e, "get node")
            if self.last is not None and self.clock.mono() - self.last[1] < STALE_NODE_S:
                return self.last[0], None  # keep judging the plugin on the last Node we saw
            return None, str(e)


class Standing:
    """The node's standing between cycles: latches (state.py), the hold adopted at start, operator clears, the
    preflight label, and the RecoveryGate's hysteresis."""

    def __init__(self, cfg: Config, state: LatchState, clock: Clock, log: Any, record: Record) -> None:
        self.cfg, self.state, self.clock, self.log, self.record = cfg, state, clock, log, record
        self.gate = RecoveryGate(cfg.recovery_polls)
        self.gate_state = GateState()
        self.facts = NodeFacts(cfg.require_preflight, False)
        self.state_outcome = "new"  # LatchState.load()'s answer, set at start
        self.adopted = False

    @property
    def latched_fatal(self) -> bool:
        """A fatal fault is latched (or a latched one is held from before a restart)."""
        hold = self.gate_state.hold
        return bool(self.state.snapshot()) or (hold is not None and hold.latched)

    @property
    def gate_open(self) -> bool:
        return not self.cfg.require_preflight or self.facts.preflight_passed

    def check_boot(self) -> None:
        bid = read_boot_id(self.cfg.boot_id_file)
        if bid not in (self.state.boot_id, "unknown"):
            n = self.state.new_boot(bid)
            self.gate_state = self.gate_state.new_boot()
            self.log.info("boot ID changed: latched faults cleared", boot_id=bid, cleared=n)

    def observe(
        self, node: dict[str, Any] | None, kmsg_seq: int | None, adopt_into: Callable[[Any, dict[str, Any]], None]
    ) -> None:
        """A Node read: adopt its condition once (`adopt_into` takes the existing condition), apply a clear, read
        the preflight label."""
        if node is not None:
            if not self.adopted:
                self._adopt(node, adopt_into)
            self._apply_clear(node, kmsg_seq)
        self.facts = node_facts(
            node, self.cfg.preflight_label, self.cfg.require_preflight, self.facts, self.cfg.needs_preflight_label
        )

    def evaluate(self, obs: Observation, cycles: int) -> Verdict:
        was_bad = self.gate_state.bad is not None
        v, self.gate_state = self.gate.step(
            self.gate_state, obs, cycles, self.state.snapshot(), self.facts, recovery=self.recovery_view()
        )
        if self.gate_state.bad is not None and not was_bad:
            self.log.warning("level fault", reason=v.reason.value, message=v.message)
        elif was_bad and self.gate_state.bad is None:
            self.log.info("level signals clean", polls=self.cfg.recovery_polls)
        return v

    def recovery_view(self) -> dict[PciAddress, tuple[str, str]]:
        """Each GPU's recovery ladder as the verdict shows it (step, why); empty with recovery off."""
        if not self.cfg.recovery:
            return {}
        out = {}
        for gpu, rec in self.state.ladders().items():
            addr = PciAddress.parse(gpu)
            if addr is not None:
                out[addr] = (rec.step.value, rec.why)
        return out

    def _adopt(self, node: dict[str, Any], adopt_into: Callable[[Any, dict[str, Any]], None]) -> None:
        self.adopted = True
        existing = find_condition(node, self.cfg.condition_type)
        adopt_into(existing, node)
        hold: HeldCondition | None = adopt(
            existing,
            latched_faults=len(self.state.snapshot()),
            state_outcome=self.state_outcome,
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

    def _apply_clear(self, node: dict[str, Any], kmsg_seq: int | None) -> None:
        ann = ((node.get("metadata") or {}).get("annotations") or {}).get(CLEAR_ANNOTATION)
        if ann is None:
            return  # nothing to clear (most polls: no /proc/stat read)
        d = decide_clear(
            ann,
            self.clock.wall(),
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
        gone = self.state.clear_before(d.before, kmsg_seq)
        held = self.gate_state.hold
        self.gate_state = self.gate_state.cleared(d.before)
        n = len(gone) + (held is not None and self.gate_state.hold is None)
        if n:
            self.log.info("latched faults cleared by operator", cleared=n, before=ann)
            self.record(
                "FaultsCleared", f"{n} latched fault(s) cleared by {CLEAR_ANNOTATION}={ann}", "", "Normal", "Cleared"
            )
