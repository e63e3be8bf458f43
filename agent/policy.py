"""The readiness policy over time, pure: no I/O, no clock reads (time is an argument).

`RecoveryGate.step(previous, observation, cycle, latched, facts)` returns the Verdict to publish and
the next GateState. It holds:
- hysteresis: a level fault (nvidia-smi, NVML, counts, plugin) clears only after `recovery_polls`
  consecutive clean cycles; until then the fault that was seen is still reported.
- "could not check": a cycle that cannot check (Unknown) is reported as Unknown at once, never as the
  stale fault forever and never True; it also restarts the clean-cycle count.
- the start-up hold: a GPUReady=False found on the Node at start (see `adopt`) is kept until the
  level checks have been clean for `recovery_polls` cycles, so a restart during a fault never writes
  True. A FatalXid condition from this boot that the state file does not hold (its write failed, the
  file was lost) is kept like a latched fault: until a reboot or an operator clear.
- preflight gating: with `require_preflight`, True only on nodes labelled `<label>=passed`.

`decide_clear` decides what a `gpu-ready.io/clear-before` annotation may clear."""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from agent.model import LatchedFault, Observation, Reason, Status, Verdict
from agent.verdict import MESSAGE_LIMIT, decide

CLOCK_SKEW_S = 60.0  # a clear-before this far ahead of the node's clock is taken as "now"
_RFC3339 = re.compile(
    r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d{1,9})?([Zz]|[+-]\d{2}:\d{2})",
)


def parse_rfc3339(text: Any) -> float | None:
    """Unix seconds of an RFC 3339 time with a zone (`2026-01-02T03:04:05Z`, `...+02:00`); None for
    anything else (no zone, a date alone, a number): never read as local time."""
    if not isinstance(text, str) or len(text) > 64 or not _RFC3339.fullmatch(text.strip()):
        return None
    s = text.strip().upper().replace("Z", "+00:00")
    head, dot, rest = s.partition(".")
    if dot:  # fromisoformat takes at most 6 fraction digits
        digits = re.match(r"\d+", rest)
        frac = digits.group(0) if digits else ""
        s = f"{head}.{frac[:6].ljust(6, '0')}{rest[len(frac) :]}"
    try:
        return datetime.fromisoformat(s).timestamp()
    except (ValueError, OverflowError):
        return None


@dataclass(frozen=True)
class NodeFacts:
    """What the policy needs from the Node object."""

    preflight_required: bool = False
    preflight_passed: bool = False


def node_facts(node: dict[str, Any] | None, label: str, required: bool, previous: NodeFacts) -> NodeFacts:
    """Facts from a Node read this cycle; an unreadable Node keeps the previous facts."""
    if node is None:
        return replace(previous, preflight_required=required)
    labels = (node.get("metadata") or {}).get("labels") or {}
    passed = isinstance(labels, dict) and labels.get(label) == "passed"
    return NodeFacts(required, passed)


@dataclass(frozen=True)
class HeldCondition:
    """A GPUReady=False found on the Node at start."""

    reason: Reason
    message: str
    since: float | None  # its lastTransitionTime
    latched: bool = False  # kept like a latched fault (until a reboot or an operator clear)


def adopt(
    existing: dict[str, Any] | None,
    *,
    latched_faults: int,
    state_outcome: str,
    cleared_before: float,
    boot_time: float | None,
) -> HeldCondition | None:
    """The hold for a condition found on the Node at start; None unless it is False.

    latched_faults: faults the state file restored; state_outcome: LatchState.load()'s answer;
    boot_time: when this boot started (None when unknown)."""
    if not existing or existing.get("status") != Status.FALSE.value:
        return None
    try:
        reason = Reason(str(existing.get("reason")))
    except ValueError:
        reason = Reason.CHECK_FAILED
    message = str(existing.get("message") or "")[:MESSAGE_LIMIT]
    since = parse_rfc3339(existing.get("lastTransitionTime"))
    latched = (
        reason is Reason.FATAL_XID
        and latched_faults == 0
        and state_outcome != "boot_changed"
        and since is not None
        and since > cleared_before
        and (boot_time is None or since >= boot_time)
    )
    return HeldCondition(reason, message, since, latched)


@dataclass(frozen=True)
class GateState:
    cycle: int = 0  # the last level cycle this state counted
    bad: Observation | None = None  # the last level fault, reported until enough clean cycles
    clean: int = 0  # consecutive clean cycles since then
    hold: HeldCondition | None = None

    def cleared(self, before: float) -> GateState:
        """An operator clear: a latched hold first seen before `before` goes."""
        h = self.hold
        if h is not None and h.latched and (h.since is None or h.since < before):
            return replace(self, hold=None)
        return self

    def new_boot(self) -> GateState:
        """A reboot: a latched hold belongs to the previous boot."""
        return replace(self, hold=None) if self.hold is not None and self.hold.latched else self


class RecoveryGate:
    def __init__(self, recovery_polls: int) -> None:
        self.recovery_polls = max(1, recovery_polls)

    def step(
        self,
        prev: GateState,
        obs: Observation,
        cycle: int,
        latched: Sequence[LatchedFault] = (),
        facts: NodeFacts = NodeFacts(),
    ) -> tuple[Verdict, GateState]:
        """obs: the newest level observation, numbered `cycle`; calling again with the same cycle (a
        kernel-log wake between polls) does not count another clean cycle."""
        level = decide(obs)
        state = prev
        if cycle != prev.cycle:
            state = self._count(prev, obs, cycle, level.status)
        shown = obs
        if level.status is Status.TRUE and state.bad is not None:
            shown = state.bad  # recovering: keep reporting the fault until enough clean cycles
        v = decide(shown, latched, preflight_required=facts.preflight_required, preflight_passed=facts.preflight_passed)
        hold = state.hold
        if hold is not None and (v.status is Status.TRUE or (hold.latched and v.reason is not Reason.FATAL_XID)):
            v = _held(v, hold)
        return v, state

    def _count(self, prev: GateState, obs: Observation, cycle: int, status: Status) -> GateState:
        keep = prev.hold if prev.hold is not None and prev.hold.latched else None
        if status is Status.FALSE:
            # A fault seen now replaces a non-latched start-up hold.
            return GateState(cycle, obs, 0, keep)
        if status is Status.UNKNOWN:
            return replace(prev, cycle=cycle, clean=0)
        if prev.bad is None and (prev.hold is None or prev.hold.latched):
            return replace(prev, cycle=cycle, clean=0)
        clean = prev.clean + 1
        if clean >= self.recovery_polls:
            return GateState(cycle, None, 0, keep)
        return replace(prev, cycle=cycle, clean=clean)


def _held(v: Verdict, hold: HeldCondition) -> Verdict:
    message = hold.message
    if hold.latched:
        note = " (kept from the GPUReady condition: the latch file did not hold it)"
        message = (message[: MESSAGE_LIMIT - len(note)] + note) if message else note.strip(" ()")
        if v.status is Status.FALSE:  # other faults too: keep them in the message
            message = (message + "; " + v.message)[:MESSAGE_LIMIT]
    others = tuple(r for r in v.reasons if r is not hold.reason) if v.status is Status.FALSE else ()
    reasons = (hold.reason, *others)
    return Verdict(Status.FALSE, hold.reason, message, v.gpus, reasons, v.counts)


@dataclass(frozen=True)
class ClearDecision:
    before: float | None = None  # apply: drop latched faults first seen before this time
    problem: str | None = None  # why the value is refused: remember it for this boot, log it once


def decide_clear(
    value: Any,
    now: float,
    *,
    boot_time: float | None,
    cleared_before: float,
    rejected: Collection[str] = (),
) -> ClearDecision | None:
    """What a clear-before annotation may do; None when there is nothing to do.

    A refused value is remembered (`rejected`) for the rest of the boot and logged once:
    - not an RFC 3339 time with a zone: refused (never read as local time);
    - later than now (beyond CLOCK_SKEW_S): refused for the rest of this boot, so a future-dated value
      left on the Node never clears faults seen before it comes due (e.g. of the next boot);
    - earlier than this boot's start: it predates every fault of this boot, nothing to clear;
    - already applied (not newer than the last clear): nothing to do."""
    if value is None or value == "":
        return None
    text = str(value)
    if text in rejected:
        return None
    t = parse_rfc3339(text)
    if t is None:
        return ClearDecision(problem="not an RFC 3339 time with a zone (e.g. 2026-01-02T03:04:05Z)")
    if t > now + CLOCK_SKEW_S:
        return ClearDecision(problem=f"dated {t - now:.0f}s in the future; refused for this boot")
    t = min(t, now)
    if boot_time is not None and t < boot_time:
        return None
    if t <= cleared_before:
        return None
    return ClearDecision(before=t)
