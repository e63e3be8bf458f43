"""The one place that decides readiness, pure: no I/O, no clock reads (time is an argument).

Two pieces:
- `decide(observation, latched)`: one cycle's findings + latched faults -> Verdict.
- The readiness policy over time: `RecoveryGate.step(previous, observation, cycle, latched, facts)`
  returns the Verdict to publish and the next GateState. It holds:
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
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from agent.act.recovery.ladder import REFUSED_PREFIX, Remedy, Step, gpu_remedy, nvml_action_of
from agent.model import (
    FAULT_REASONS,
    Check,
    Counts,
    Finding,
    GpuIdentity,
    GpuStatus,
    LatchedFault,
    Observation,
    PciAddress,
    Reason,
    Severity,
    Status,
    Verdict,
    gpu_label,
)
from agent.names import PREFLIGHT_PASSED

MESSAGE_LIMIT = 1000  # bytes; the condition message stays under 1 KiB
# The reasons of a latched fault: a FatalXid, and a GPU whose recovery gave up (its fault stays latched).
LATCHED_REASONS = frozenset({Reason.FATAL_XID, Reason.GPU_RECOVERY_FAILED, Reason.GPU_RESET_REFUSED})


def count_mismatches(c: Counts, expected: int | None) -> list[str]:
    out = []
    if c.pci is not None and c.nvidia_smi is not None and c.pci != c.nvidia_smi:
        out.append(f"PCI shows {c.pci} GPUs, nvidia-smi {c.nvidia_smi}")
    if c.pci is not None and c.plugin_physical is not None and c.pci != c.plugin_physical:
        out.append(f"PCI shows {c.pci} GPUs, the device plugin serves {c.plugin_physical}")
    if expected is not None:
        seen = [n for n in (c.pci, c.nvidia_smi) if n is not None]
        if seen and min(seen) < expected:
            out.append(f"expected {expected} GPUs, found {min(seen)}")
    return out


def render_message(groups: list[tuple[str, list[str]]], limit: int = MESSAGE_LIMIT) -> str:
    """ "Reason: item, item; Reason: item" kept under `limit` bytes; what does not fit is counted."""
    total = sum(len(items) for _, items in groups)
    out = ""
    used = 0
    for head, items in groups:
        for i, item in enumerate(items):
            piece = (f"; {head}: " if out else f"{head}: ") + item if i == 0 else ", " + item
            tail = f" (+{total - used - 1} more)" if total - used - 1 else ""
            if len((out + piece + tail).encode()) > limit:
                if not out:  # a single item longer than the limit
                    cut = (piece.encode()[: limit - len(tail.encode()) - 4]).decode("utf-8", "ignore")
                    return cut + "…" + tail
                return out + f" (+{total - used} more)"
            out += piece
            used += 1
    return out


REASON_ORDER = tuple(Reason)  # a GPU's reasons in declaration order


def decide(
    obs: Observation,
    latched: Sequence[LatchedFault] = (),
    *,
    preflight_required: bool = False,
    preflight_passed: bool = True,
    recovery: Mapping[PciAddress, tuple[str, str]] | None = None,
) -> Verdict:
    """recovery: each GPU's recovery ladder (act/recovery/ladder.py) as (step, why); an escalated one makes the node
    GPURecoveryFailed (its fault stays latched and fenced)."""
    gpus = obs.gpus
    recovery = recovery or {}
    by_reason: dict[Reason, list[str]] = {}
    problems: dict[PciAddress, list[str]] = {}
    gpu_reasons: dict[PciAddress, set[Reason]] = {}
    unchecked: list[Finding] = []

    def add(reason: Reason, text: str, addr: PciAddress | None) -> None:
        label = gpu_label(addr, gpus)
        by_reason.setdefault(reason, []).append(f"{label}: {text}" if addr is not None else text)
        if addr is not None:
            problems.setdefault(addr, []).append(f"{reason.value}: {text}")
            gpu_reasons.setdefault(addr, set()).add(reason)

    # Faults on the node's own GPUs first (the actionable ones; they survive message truncation), then
    # addresses that match no GPU and NVSwitch SXids; oldest first within each group.
    for lf in sorted(latched, key=lambda f: (f.gpu is None or f.gpu not in gpus, f.since, f.key)):
        what = {
            "sxid": f"fatal SXid {lf.xid} on NVSwitch {lf.raw_address}",
            "fallen_off_bus": "fell off the bus",
            "row_remap": "row remap pending: a reset applies it (recovery)",
        }.get(lf.source, f"Xid {lf.xid}")
        if lf.source == "xid" and lf.gpu is not None and lf.gpu not in gpus:
            what += " (address matches no known GPU)"
        add(Reason.FATAL_XID, what, lf.gpu)
    for addr, (step, why) in sorted(recovery.items()):
        if step == Step.ESCALATED and any(lf.gpu == addr for lf in latched):
            if why.startswith(REFUSED_PREFIX):  # something held the GPU until the drain timeout: not its failure
                add(Reason.GPU_RESET_REFUSED, why, addr)
                continue
            add(Reason.GPU_RECOVERY_FAILED, f"recovery failed: {why}" if why else "recovery failed", addr)

    smi_ran = True
    for f in obs.findings:
        if f.severity is Severity.FAULT and f.reason is not None:
            add(f.reason, f.message, f.gpu)
            if f.check is Check.NVIDIA_SMI and f.gpu is None:
                smi_ran = False
        elif f.severity is Severity.UNCHECKED:
            unchecked.append(f)
            if f.check is Check.NVIDIA_SMI:
                smi_ran = False

    for text in count_mismatches(obs.counts, obs.expected_gpus):
        by_reason.setdefault(Reason.GPU_COUNT_MISMATCH, []).append(text)
    # Compare addresses, not only counts: a duplicated bus id in nvidia-smi keeps the counts equal.
    on_pci, in_smi = obs.seen.get(Check.PCI), obs.seen.get(Check.NVIDIA_SMI)
    if on_pci is not None and in_smi is not None:
        for addr in sorted(on_pci - in_smi):
            add(Reason.GPU_COUNT_MISMATCH, "on PCI but not in nvidia-smi", addr)

    if preflight_required and not preflight_passed:
        by_reason.setdefault(Reason.PREFLIGHT_NOT_PASSED, []).append("node is not labelled preflight=passed")

    reasons = tuple(r for r in FAULT_REASONS if r in by_reason)
    if reasons:
        status, reason = Status.FALSE, reasons[0]
        groups = [(r.value, by_reason[r]) for r in reasons]
        if unchecked:
            groups.append(("could not check", [f.message for f in unchecked]))
    elif unchecked:
        status, reason, reasons = Status.UNKNOWN, Reason.CHECK_FAILED, (Reason.CHECK_FAILED,)
        groups = [("CheckFailed", [f"{f.check.value}: {f.message}" for f in unchecked])]
    else:
        status, reason, reasons = Status.TRUE, Reason.GPUS_HEALTHY, (Reason.GPUS_HEALTHY,)
        n = obs.counts.nvidia_smi if obs.counts.nvidia_smi is not None else len(gpus)
        groups = [("", [f"{n} GPUs healthy"])]

    # A source that could not run checked no GPU this cycle (per GPU, so a reporter can tell "clean" from
    # "not looked at" for each of its faults: fencing keeps an NVML rule while NVML cannot run).
    not_checked = tuple(c for c in Check if any(f.check is c for f in unchecked)) if unchecked else ()
    actions: dict[PciAddress, list[str]] = {}
    for lf in latched:
        if lf.gpu is not None and lf.source != "sxid":
            actions.setdefault(lf.gpu, []).append(lf.action or ("RESTART_BM" if lf.source == "fallen_off_bus" else ""))
    nvml_actions = {f.gpu: nvml_action_of(f.message) for f in obs.findings if f.kind == "recovery_action" and f.gpu}
    rows = []
    for addr in sorted(set(gpus) | set(problems)):
        ident = gpus.get(addr, GpuIdentity(addr))
        probs = tuple(problems.get(addr, ()))
        healthy: bool | None = False if probs else (True if smi_ran else None)
        mine = gpu_reasons.get(addr, set())
        rem = gpu_remedy(actions.get(addr, ()), nvml_actions.get(addr))
        ladder = recovery.get(addr)
        rows.append(
            GpuStatus(
                ident.index,
                addr.nvml,
                ident.name,
                healthy,
                probs,
                tuple(r for r in REASON_ORDER if r in mine) if mine else (),
                not_checked,
                None if rem is Remedy.NONE else rem.value,
                ladder[0] if ladder is not None else None,
            )
        )
    rows.sort(key=lambda r: (r.index is None, r.index if r.index is not None else 0, r.pci_bus_id))
    message = render_message(groups) if groups[0][0] else groups[0][1][0]
    return Verdict(status, reason, message, tuple(rows), reasons, obs.counts)


def cut_utf8(text: str, limit: int) -> str:
    """The longest head of `text` that is at most `limit` bytes in UTF-8, never splitting a character."""
    return text.encode()[: max(0, limit)].decode("utf-8", "ignore")


def with_note(v: Verdict, note: str, limit: int = MESSAGE_LIMIT) -> Verdict:
    """The verdict with `note` appended to its message ("<message>; <note>"), the whole kept within `limit`
    bytes: the message is cut (with "…") so that the note, which reporters add last, always shows."""
    if not note:
        return v
    note_b = cut_utf8(note, limit // 2)
    room = limit - len(("; " + note_b).encode())
    msg = v.message
    if len(msg.encode()) > room:
        msg = cut_utf8(msg, room - len("…".encode())) + "…"
    message = f"{msg}; {note_b}" if msg else note_b
    return replace(v, message=message)


# -- the readiness policy over time ---------------------------------------------------------------------

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


def node_facts(
    node: dict[str, Any] | None, label: str, required: bool, previous: NodeFacts, needs_label: str | None = None
) -> NodeFacts:
    """Facts from a Node read this cycle; an unreadable Node keeps the previous facts. A node labelled
    `<needs_label>=true` (a GPU fault latched since its last preflight) has not passed, whatever `label` says."""
    if node is None:
        return replace(previous, preflight_required=required)
    labels = (node.get("metadata") or {}).get("labels") or {}
    passed = isinstance(labels, dict) and labels.get(label) == PREFLIGHT_PASSED
    if passed and needs_label and labels.get(needs_label) == "true":
        passed = False
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
        reason in LATCHED_REASONS
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
        recovery: Mapping[PciAddress, tuple[str, str]] | None = None,
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
        gated = facts.preflight_required and not facts.preflight_passed
        if shown is obs and not latched and not gated and not recovery:
            v = level  # the same inputs: decide(obs) again would give the same verdict
        else:
            v = decide(
                shown,
                latched,
                preflight_required=facts.preflight_required,
                preflight_passed=facts.preflight_passed,
                recovery=recovery,
            )
        hold = state.hold
        if hold is not None and (v.status is Status.TRUE or (hold.latched and v.reason not in LATCHED_REASONS)):
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
