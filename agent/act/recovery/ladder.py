"""Per-GPU recovery, pure: which remedy a fault calls for, the ladder's next step, and the retry budget.

No I/O and no clock reads here (time is an argument); the side effects (evicting, resetting, proving, lifting the
fence, restarting the device plugin's pod) are agent/act/recovery/actor.py's, and the state lives in the state file
(agent/state.py). docs/recovery.md describes the ladder, the budget and every setting.

- `remedy(action, nvml_action)`: "reset" (the catalog says RESET_GPU, or NVML's GPU recovery action says GPU reset /
  drain and reset), "none" (RESTART_APP, IGNORE: not latched), or "node" (everything else: a reboot or a person).
  NVML's action, when the driver reports one, wins over the catalog.
- `decide(rec, seen, policy, now, brake_engaged)`: one GPU's ladder, `fenced -> draining -> resetting -> proving ->
  healthy`, or `escalated`. It returns the next record and the one action to take now. Each step's start time is in
  the record, so a restarted agent resumes a step where it was (its timeout keeps counting) instead of starting it
  again, and a reset that was started but whose outcome was not recorded is never started a second time: the proof
  judges it.
- The budget: resets started per GPU within `window_s`, kept in the state directory's reset journal (they survive
  agent restarts, reboots and a corrupt state file); a fault that would need one more than `budget` escalates at
  once. Never a loop: an escalated GPU stays escalated until its fault is cleared (reboot or operator clear).
- `classify_reset(bus_id, exit_code, output, ...)`: what a reset answered, from its output and exit code, per GPU
  (`succeeded` only when the output names this GPU; `refused`, `unsupported`, `needs-peers`, `tool-missing`,
  `failed`, `hung`); only `failed`, `hung` and a failed proof after `succeeded` are charged to the budget."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from agent.model import PciAddress
from agent.settings import (
    DAY,
    RUN_ONLY,
    dns_subdomain,
    in_range,
    optional,
    positive,
    setting,
    to_bool,
    to_float,
    to_int,
)

RESET_ACTIONS = frozenset({"RESET_GPU"})
# Faults that always win over an NVML reset action: a reboot-class fault (Xid 79 fell off the bus: RESTART_BM, and
# RESTART_VM) and the NVLink-class records (their remedy concerns the GPU's links to its peers, not the GPU alone).
DOMINANT_ACTIONS = frozenset({"RESTART_BM", "RESTART_VM"})
NVLINK_ACTION_PREFIXES = ("WORKFLOW_NVLINK",)
NOT_LATCHED_ACTIONS = frozenset({"RESTART_APP", "IGNORE", "IGNORED_BY_CONFIG"})
# NVML's GPU recovery action (nvmlDeviceGetFieldValues NVML_FI_DEV_GET_GPU_RECOVERY_ACTION): 0 none, 1 GPU reset,
# 2 node reboot, 3 drain P2P, 4 drain and reset, 5 recover IMEX domain, 6 bus reset, 7 system reboot.
NVML_RESET = frozenset({1, 4})
# The NVML probe's words for them (its finding reads "GPU recovery action: <words>").
NVML_ACTION_WORDS = {
    "GPU reset": 1,
    "node reboot": 2,
    "drain P2P": 3,
    "drain and reset": 4,
    "recover IMEX domain": 5,
    "bus reset": 6,
    "system reboot": 7,
}


def nvml_action_of(message: str) -> int | None:
    """The NVML recovery action code a finding's message names (an unknown word: a node-level action)."""
    words = message.rpartition(": ")[2].strip()
    if not words or words == "None":
        return None
    return NVML_ACTION_WORDS.get(words, 2)


# -- what a reset answered ------------------------------------------------------------------------------------------


class ResetOutcome(StrEnum):
    """What one `nvidia-smi -r -i <bus id>` answered (docs/recovery.md, "what the reset answered")."""

    SUCCEEDED = "succeeded"  # the output names this GPU as successfully reset
    REFUSED = "refused"  # in use by another client: something holds the GPU; retried, never charged
    UNSUPPORTED = "unsupported"  # this platform cannot reset it (exit 3, not supported, Unknown Error, primary GPU)
    NEEDS_PEERS = "needs-peers"  # the GPU must be reset together with its NVLink peers
    TOOL_MISSING = "tool-missing"  # the reset tool could not be run: a configuration error, never charged
    FAILED = "failed"  # anything else: charged, escalates
    HUNG = "hung"  # killed at the reset timeout: charged, escalates


REFUSED_PREFIX = "reset refused"  # an escalation's reason that starts so is GPUResetRefused, not a GPU failure
CHARGED = frozenset({ResetOutcome.FAILED, ResetOutcome.HUNG})  # kept in the budget; the others are given back
NODE_OUTCOMES = frozenset({ResetOutcome.UNSUPPORTED, ResetOutcome.NEEDS_PEERS, ResetOutcome.TOOL_MISSING})
RESET_OUTPUT_LIMIT = 64 << 10  # characters of a reset's output that are read (the tail is what it concluded)
_BUS = re.compile(r"\b(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]\b")
# Each phrase as the driver's nvidia-smi prints it (tests/fixtures/SOURCES.md names where each was seen).
_REFUSED = (
    "in use by another client",
    "is currently in use by another process",
    "being used by some other process",
    "is currently being used by one or more other processes",
)
_PEERS = ("must be reset together", "reset together with", "nvlink peer", "are nvlink-connected")
_UNSUPPORTED = ("not supported", "unknown error", "is the primary gpu", "insufficient permissions")
_SUCCESS = re.compile(r"gpu\s+(\S+)\s+was\s+successfully\s+reset", re.IGNORECASE)


@dataclass(frozen=True)
class ResetAnswer:
    outcome: ResetOutcome
    detail: str  # one line for the Event and the log: what it printed (or why it did not run)
    peers: tuple[str, ...] = ()  # needs-peers: the other GPUs the output named


def _line_with(text: str, phrases: Sequence[str]) -> str:
    """The first line that says one of `phrases` (what the Event quotes), at most 240 characters."""
    for line in text.splitlines():
        low = line.lower()
        if any(p in low for p in phrases):
            return line.strip()[:240]
    return ""


def _same_bus(text: str, bus_id: str) -> bool:
    a, b = PciAddress.parse(text.strip().strip(".:,")), PciAddress.parse(bus_id)
    return a is not None and a == b


def classify_reset(
    bus_id: str,
    exit_code: int | None,
    output: str,
    *,
    error: str | None = None,
    timed_out: bool = False,
    capped: bool = False,
) -> ResetAnswer:
    """The outcome of one reset of `bus_id` (the NVML bus id, 00000000:BB:00.0) from what it printed and its exit
    code. Linear in the output, which is read up to RESET_OUTPUT_LIMIT characters (the end kept). `capped`: it
    printed more than the supervisor's cap and was stopped there; its classification is still read from what was
    captured (a reset that said it succeeded before flooding the pipe is not a success: nothing says it finished)."""
    if error is not None:
        return ResetAnswer(ResetOutcome.TOOL_MISSING, f"the reset tool could not be run: {error}"[:300])
    text = output[-RESET_OUTPUT_LIMIT:]
    low = text.lower()
    last = " ".join(line.strip() for line in text.strip().splitlines()[-3:])[:240]
    if timed_out and not capped:
        return ResetAnswer(ResetOutcome.HUNG, f"did not finish (killed){': ' + last if last else ''}")
    if any(p in low for p in _REFUSED):
        return ResetAnswer(ResetOutcome.REFUSED, _line_with(text, _REFUSED) or "in use by another client")
    if any(p in low for p in _PEERS):
        peers = tuple(sorted({m.group(0) for m in _BUS.finditer(text) if not _same_bus(m.group(0), bus_id)}))[:16]
        return ResetAnswer(ResetOutcome.NEEDS_PEERS, _line_with(text, _PEERS) or last, peers)
    if exit_code == 3 or any(p in low for p in _UNSUPPORTED):
        why = _line_with(text, _UNSUPPORTED) or last or f"exit {exit_code}: reset not available"
        return ResetAnswer(ResetOutcome.UNSUPPORTED, why)
    why = "printed more than the output cap and was stopped" if capped else ""
    if exit_code == 0 and not capped:
        if any(_same_bus(m.group(1), bus_id) for m in _SUCCESS.finditer(text)):
            return ResetAnswer(ResetOutcome.SUCCEEDED, last)
        return ResetAnswer(ResetOutcome.FAILED, f"exit 0 but the output does not name {bus_id} as reset: {last}"[:300])
    if capped:
        return ResetAnswer(ResetOutcome.FAILED, f"{why}: {last}"[:300])
    return ResetAnswer(ResetOutcome.FAILED, f"exit {exit_code}: {last}"[:300])


def refused_backoff(refusals: int, policy: Policy) -> float:
    """Seconds before the next attempt after `refusals` refused ones: doubling from the policy's base, at most 60."""
    return min(60.0, policy.refused_backoff_s * (2 ** max(0, min(refusals - 1, 10))))


def burst(starts: Mapping[str, float], gpu: str, now: float, window_s: float) -> list[str]:
    """The other GPUs whose ladder started within `window_s` before `now` (a second one means one bad baseboard,
    not two bad GPUs: the node escalates)."""
    if window_s <= 0:
        return []
    return sorted(g for g, t in starts.items() if g != gpu and now - window_s <= t <= now + 60.0)


class Remedy(StrEnum):
    NONE = "none"  # not latched (RESTART_APP, IGNORE): nothing to recover
    RESET = "reset"  # one GPU reset heals it: the ladder (when recovery is on)
    NODE = "node"  # a reboot, a reseat or a person: node-level, latched until reboot or clear


def remedy(action: str, nvml_action: int | None = None) -> Remedy:
    """The remedy of one fault: the catalog's immediate action, overridden by NVML's recovery action when the
    driver reports one (not None, not 0), except that a reboot-class or NVLink-class fault always stays node-level
    (an NVML reset action does not heal a GPU that fell off the bus)."""
    if action in DOMINANT_ACTIONS or action.startswith(NVLINK_ACTION_PREFIXES):
        return Remedy.NODE
    if nvml_action:
        return Remedy.RESET if nvml_action in NVML_RESET else Remedy.NODE
    if action.startswith("RECOVERY_ACTION_0x"):  # Xid 154: the record names the new recovery action
        try:
            code = int(action.removeprefix("RECOVERY_ACTION_0x"), 16)
        except ValueError:
            return Remedy.NODE
        return Remedy.RESET if code in NVML_RESET else (Remedy.NONE if code == 0 else Remedy.NODE)
    if action in RESET_ACTIONS:
        return Remedy.RESET
    if action in NOT_LATCHED_ACTIONS:
        return Remedy.NONE
    return Remedy.NODE


def gpu_remedy(actions: Iterable[str], nvml_action: int | None = None) -> Remedy:
    """A GPU's remedy over all its latched faults: reset only when every one of them is healed by a reset."""
    rs = [remedy(a, nvml_action) for a in actions] or ([remedy("", nvml_action)] if nvml_action else [])
    if not rs:
        return Remedy.NONE
    if any(r is Remedy.NODE for r in rs):
        return Remedy.NODE
    return Remedy.RESET if any(r is Remedy.RESET for r in rs) else Remedy.NONE


class Step(StrEnum):
    FENCED = "fenced"
    DRAINING = "draining"
    RESETTING = "resetting"
    PROVING = "proving"
    HEALTHY = "healthy"
    ESCALATED = "escalated"


STEPS = tuple(Step)
ACTIVE = frozenset({Step.FENCED, Step.DRAINING, Step.RESETTING, Step.PROVING})


class Do(StrEnum):
    """The one action a decision asks for."""

    WAIT = "wait"  # nothing now (waiting for pods or processes to go, or held by the fleet brake)
    EVICT = "evict"  # evict the pods that hold this GPU
    RESET = "reset"  # reset this GPU (the attempt is already counted in the record)
    PROVE = "prove"  # run the proof on this GPU
    RESTORE = "restore"  # proven: clear this GPU's latch, lift its fence, restart the plugin's pod
    ESCALATE = "escalate"  # give up: node-level GPUReady=False (GPURecoveryFailed), the fault stays latched
    REFUND = "refund"  # the reset was refused (in use): give its attempt back to the budget; retried after a wait
    REFUND_END = "refund-end"  # refused until the drain timeout: given back, and the ladder ends (GPUResetRefused)
    NODE_OFF = "node-off"  # this node cannot reset a GPU alone (unsupported, needs its peers, no tool): given back,
    # the fault goes to the node remedy, and no ladder starts on this node until the agent restarts


@dataclass(frozen=True)
class RecoverySection:
    """Settings of per-GPU recovery."""

    recovery: bool = setting(
        to_bool,
        False,
        "per-GPU recovery: drain, reset, prove and return a GPU whose fault a reset heals (docs/recovery.md)",
        commands=RUN_ONLY,
    )
    recovery_drain_timeout: float = setting(
        positive(to_float, DAY),
        600.0,
        "seconds to wait for the pods (then the processes) on a GPU to go before its recovery escalates",
        commands=RUN_ONLY,
    )
    recovery_evict: bool = setting(
        to_bool, False, "evict the pods holding a GPU to recover it (else wait)", commands=RUN_ONLY
    )
    recovery_reset_timeout: float = setting(
        positive(to_float, 3600), 120.0, "seconds a GPU reset may take", commands=RUN_ONLY
    )
    recovery_proof_command: str | None = setting(
        optional(lambda v: _proof_command(v)),
        None,
        "command proving one GPU after its reset ({index}, {bus_id} replaced); exit 0 passes (unset: hard checks only)",
        commands=RUN_ONLY,
    )
    recovery_proof_timeout: float = setting(
        positive(to_float, DAY), 600.0, "seconds the proof command may take", commands=RUN_ONLY
    )
    recovery_budget: int = setting(
        in_range(to_int, 0, 100), 2, "GPU resets per GPU within recoveryWindow", commands=RUN_ONLY
    )
    recovery_window: float = setting(
        positive(to_float, 30 * DAY), 86400.0, "the retry budget's window, seconds", commands=RUN_ONLY
    )
    recovery_settle_timeout: float = setting(
        positive(to_float, DAY),
        300.0,
        "seconds a reset GPU may take to settle (fabric trained, no recovery action or row remap pending) before "
        "its proof fails",
        commands=RUN_ONLY,
    )
    recovery_burst_window: float = setting(
        in_range(to_float, 0, DAY),
        600.0,
        "a second GPU needing a reset within this many seconds stops every ladder of the node (one baseboard); 0: off",
        commands=RUN_ONLY,
    )
    recovery_release_holders: tuple[tuple[str, str], ...] = setting(
        lambda v: _holders(v),
        (),
        "namespace/daemonset list: their pod on this node (the device plugin, DCGM, dcgm-exporter) is deleted before "
        "a GPU reset to release its handles (its DaemonSet starts it again)",
        commands=RUN_ONLY,
    )
    recovery_plugin_namespace: str | None = setting(
        optional(dns_subdomain),
        None,
        "namespace of the device plugin DaemonSet restarted after a recovery",
        commands=RUN_ONLY,
    )
    recovery_plugin_daemonset: str | None = setting(
        optional(dns_subdomain),
        None,
        "the device plugin DaemonSet whose pod on this node is restarted after a recovery",
        commands=RUN_ONLY,
    )


def _holders(v: Any) -> tuple[tuple[str, str], ...]:
    """`namespace/daemonset` entries (a list, or a comma-separated string): DaemonSets whose pod on this node holds
    the GPUs (the device plugin, DCGM, dcgm-exporter) and is deleted before a reset."""
    items = v if isinstance(v, list | tuple) else [x for x in str(v).replace(" ", ",").split(",") if x]
    if len(items) > 16:
        raise ValueError(f"at most 16 DaemonSets, got {len(items)}")
    out = []
    for item in items:
        ns, sep, name = str(item).partition("/")
        if not sep:
            raise ValueError(f"expected namespace/daemonset, got {item!r}")
        out.append((dns_subdomain(ns), dns_subdomain(name)))
    return tuple(out)


def _proof_command(v: Any) -> str:
    if not isinstance(v, str) or len(v) > 4096 or "\x00" in v:
        raise ValueError("expected a command line of at most 4096 characters")
    try:
        argv = shlex.split(v)
    except ValueError as e:
        raise ValueError(f"cannot split the command line: {e}") from None
    if not argv:
        raise ValueError("expected a command")
    return v


@dataclass(frozen=True)
class Policy:
    """The ladder's bounds (defaults: RecoverySection's)."""

    drain_timeout_s: float = RecoverySection.recovery_drain_timeout
    evict: bool = RecoverySection.recovery_evict
    budget: int = RecoverySection.recovery_budget  # resets per GPU within window_s
    window_s: float = RecoverySection.recovery_window
    settle_s: float = 0.0  # after a reset, wait this long before the proof (the driver re-initialises)
    # after a reset, how long the GPU may take to settle (fabric, NVML) before the proof fails
    settle_timeout_s: float = RecoverySection.recovery_settle_timeout
    refused_backoff_s: float = 5.0  # the first wait after a refused reset; doubled per refusal, at most 60 s


@dataclass(frozen=True)
class GpuRecovery:
    """One GPU's ladder, as kept in the state file."""

    gpu: str  # the NVML bus id, 00000000:BB:00.0
    step: Step
    since: float  # wall seconds the ladder started (the fault latched)
    step_since: float  # wall seconds this step started
    faults: tuple[str, ...] = ()  # the latch keys this ladder is about
    reset_started: float | None = None  # wall seconds the reset of this ladder started (None: not yet)
    reset_done: float | None = None  # wall seconds the reset returned success
    reset_seq: int = -1  # the kernel log's last record read when the reset started (the proof wants none after)
    why: str = ""  # the last decision's reason (escalated: why)
    evicted: bool = False  # evictions were asked for in this ladder
    refusals: int = 0  # resets refused (in use) in this ladder; none of them charged
    retry_at: float = 0.0  # after a refusal: no new attempt before this (wall seconds)
    outcome: str = ""  # the last reset's classification (ResetOutcome value; "" none yet)
    fabric: bool = False  # the GPU had an NVLink fabric when its ladder started (its proof needs a fabric reading)

    def at(self, step: Step, now: float, why: str = "", **kw: object) -> GpuRecovery:
        return replace(self, step=step, step_since=now, why=why, **kw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Seen:
    """What the agent saw of one GPU this cycle (None: could not tell)."""

    pods: int | None = None  # pods holding it (pod-resources); None: unknown (off or unreadable)
    processes: int | None = None  # processes with it open (nvidia-smi --query-compute-apps); None: unknown
    reset_result: bool | None = None  # the reset just run: True ok, False failed or hung; None: none ran
    reset_error: str = ""
    reset_outcome: ResetOutcome | None = None  # its classification (None: use reset_result alone)
    settle_problem: str | None = None  # why the GPU has not settled after its reset ("" settled; None: not read)
    # No new pod can land on the GPU: it is fenced (a DeviceTaintRule), the device plugin has it unhealthy, or the
    # node carries gpu-ready's NoSchedule taint. False: new pods could land on it (the ladder waits); None: unknown.
    fenced: bool | None = None
    proof: bool | None = None  # the proof just run: True passed; None: not run yet
    proof_error: str = ""
    fault_after_reset: bool = False  # a kernel-log record for this GPU since the reset (not quiet)
    cycle_after_reset: bool = False  # the checks ran after the reset returned (the proof reads them)


def resets_in_window(attempts: Sequence[float], now: float, window_s: float) -> int:
    return sum(1 for t in attempts if now - window_s < t <= now + 60.0)


def prune(attempts: Sequence[float], now: float, window_s: float) -> tuple[float, ...]:
    """The attempts that still count (the file keeps only these; at most 64)."""
    return tuple(sorted(t for t in attempts if now - window_s < t <= now + 60.0))[-64:]


def budget_left(attempts: Sequence[float], now: float, policy: Policy) -> int:
    return max(0, policy.budget - resets_in_window(attempts, now, policy.window_s))


def start(gpu: str, faults: Sequence[str], now: float) -> GpuRecovery:
    """A new ladder for a GPU whose latched faults a reset heals: fenced (the fence itself is fencing's)."""
    return GpuRecovery(gpu, Step.FENCED, now, now, tuple(sorted(faults)))


def decide(
    rec: GpuRecovery,
    seen: Seen,
    attempts: Sequence[float],
    policy: Policy,
    now: float,
    brake_engaged: bool = False,
) -> tuple[GpuRecovery, Do]:
    """One GPU's next step. `attempts`: the budget's reset times for this GPU (the record's own reset, once
    started, is among them). While `brake_engaged` no eviction and no reset starts (a step in progress still
    times out and escalates)."""
    s = rec.step
    waited = now - rec.step_since
    if s in (Step.HEALTHY, Step.ESCALATED):
        return rec, Do.WAIT
    if s is Step.FENCED:
        if rec.reset_started is None and budget_left(attempts, now, policy) <= 0:
            n = resets_in_window(attempts, now, policy.window_s)
            why = f"retry budget spent: {n} reset(s) within {policy.window_s / 3600:g} h (budget {policy.budget})"
            return rec.at(Step.ESCALATED, now, why), Do.ESCALATE
        if seen.fenced is False:
            why = ("new pods could still land on it (the device plugin advertises it and the node has no NoSchedule "
                   "taint of gpu-ready): waiting before the drain")  # fmt: skip
            return replace(rec, why=why), Do.WAIT
        return decide(rec.at(Step.DRAINING, now, "waiting for the pods on it to finish"), seen, attempts, policy, now,
                      brake_engaged)  # fmt: skip
    if s is Step.DRAINING:
        if seen.pods == 0:
            return decide(rec.at(Step.RESETTING, now, "drained"), seen, attempts, policy, now, brake_engaged)
        if waited > policy.drain_timeout_s:
            what = "pod-resources cannot be read" if seen.pods is None else f"{seen.pods} pod(s) still hold it"
            why = f"not drained within {policy.drain_timeout_s:g}s: {what}"
            return rec.at(Step.ESCALATED, now, why), Do.ESCALATE
        if seen.pods is None:
            return replace(rec, why="pod-resources cannot be read: cannot tell whether pods hold it"), Do.WAIT
        if policy.evict and not brake_engaged:
            return replace(rec, why=f"evicting {seen.pods} pod(s)", evicted=True), Do.EVICT
        why = f"{seen.pods} pod(s) hold it" + (" (fleet brake engaged: no eviction)" if brake_engaged else "")
        return replace(rec, why=why), Do.WAIT
    if s is Step.RESETTING:
        if rec.reset_started is not None:
            out = seen.reset_outcome
            if out is None and seen.reset_result is not None:
                out = ResetOutcome.SUCCEEDED if seen.reset_result else ResetOutcome.FAILED
            if out is not None:
                rec = replace(rec, outcome=out.value)
            if out is ResetOutcome.SUCCEEDED:
                return rec.at(Step.PROVING, now, "reset done", reset_done=now), Do.WAIT
            if out is ResetOutcome.REFUSED:
                n = rec.refusals + 1
                if waited > policy.drain_timeout_s:
                    why = f"{REFUSED_PREFIX} {n} time(s) within {policy.drain_timeout_s:g}s: {seen.reset_error}"
                    return rec.at(Step.ESCALATED, now, why[:300], reset_started=None, refusals=n), Do.REFUND_END
                wait = refused_backoff(n, policy)
                why = f"reset refused ({seen.reset_error}); trying again in {wait:g}s"[:300]
                return replace(rec, reset_started=None, refusals=n, retry_at=now + wait, why=why), Do.REFUND
            if out in NODE_OUTCOMES:
                why = f"reset {out.value}: {seen.reset_error}"[:300]
                return rec.at(Step.ESCALATED, now, why, reset_started=None), Do.NODE_OFF
            if out is not None:
                return rec.at(Step.ESCALATED, now, f"reset failed: {seen.reset_error}"[:300]), Do.ESCALATE
            # Started before a restart and its outcome never recorded: not reset twice; the proof judges it.
            return rec.at(
                Step.PROVING, now, "reset outcome unknown (agent restarted): proving", reset_done=now
            ), Do.WAIT
        if waited > policy.drain_timeout_s and rec.refusals:
            why = f"{REFUSED_PREFIX} {rec.refusals} time(s) within {policy.drain_timeout_s:g}s: {rec.why}"
            return rec.at(Step.ESCALATED, now, why[:300]), Do.REFUND_END
        if waited > policy.drain_timeout_s:
            what = "process list unreadable" if seen.processes is None else f"{seen.processes} process(es) hold it"
            why = f"not reset within {policy.drain_timeout_s:g}s: {what}"
            return rec.at(Step.ESCALATED, now, why), Do.ESCALATE
        if seen.pods:
            return rec.at(Step.DRAINING, now, f"{seen.pods} pod(s) hold it again"), Do.WAIT
        if seen.processes is None:
            return replace(rec, why="cannot tell whether a process holds it: not reset"), Do.WAIT
        if seen.processes > 0:
            return replace(rec, why=f"{seen.processes} process(es) hold it: not reset"), Do.WAIT
        if brake_engaged:
            return replace(rec, why="fleet brake engaged: no reset starts"), Do.WAIT
        if now < rec.retry_at:
            return rec, Do.WAIT  # backing off after a refusal
        if budget_left(attempts, now, policy) <= 0:
            return rec.at(Step.ESCALATED, now, "retry budget spent"), Do.ESCALATE
        return replace(rec, reset_started=now, why="resetting"), Do.RESET
    # PROVING
    if seen.fault_after_reset:
        return rec.at(Step.ESCALATED, now, "the GPU faulted again after its reset"), Do.ESCALATE
    if seen.proof is True:
        return rec.at(Step.HEALTHY, now, "proven after reset"), Do.RESTORE
    if seen.proof is False:
        return rec.at(Step.ESCALATED, now, f"proof failed: {seen.proof_error}"[:300]), Do.ESCALATE
    done = rec.reset_done if rec.reset_done is not None else rec.step_since
    if not seen.cycle_after_reset or now - done < policy.settle_s:
        return rec, Do.WAIT
    if seen.settle_problem:  # the fabric still training, a recovery action or a row remap still pending
        if now - done > policy.settle_timeout_s:
            why = f"not settled within {policy.settle_timeout_s:g}s after its reset: {seen.settle_problem}"
            return rec.at(Step.ESCALATED, now, why[:300]), Do.ESCALATE
        return replace(rec, why=f"settling after its reset: {seen.settle_problem}"[:300]), Do.WAIT
    return rec, Do.PROVE
