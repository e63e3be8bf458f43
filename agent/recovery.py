"""Per-GPU recovery, pure: which remedy a fault calls for, the ladder's next step, and the retry budget.

No I/O and no clock reads here (time is an argument); the side effects (evicting, resetting, proving, lifting the
fence, restarting the device plugin's pod) are agent/act/recovery.py's, and the state lives in the state file
(agent/state.py). docs/recovery.md describes the ladder, the budget and every setting.

- `remedy(action, nvml_action)`: "reset" (the catalog says RESET_GPU, or NVML's GPU recovery action says GPU reset /
  drain and reset), "none" (RESTART_APP, IGNORE: not latched), or "node" (everything else: a reboot or a person).
  NVML's action, when the driver reports one, wins over the catalog.
- `decide(rec, seen, policy, now, brake_engaged)`: one GPU's ladder, `fenced -> draining -> resetting -> proving ->
  healthy`, or `escalated`. It returns the next record and the one action to take now. Each step's start time is in
  the record, so a restarted agent resumes a step where it was (its timeout keeps counting) instead of starting it
  again, and a reset that was started but whose outcome was not recorded is never started a second time: the proof
  judges it.
- The budget: resets started per GPU within `window_s`, kept in the state file (they survive agent restarts and
  reboots); a fault that would need one more than `budget` escalates at once. Never a loop: an escalated GPU stays
  escalated until its fault is cleared (reboot or operator clear)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

RESET_ACTIONS = frozenset({"RESET_GPU"})
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


class Remedy(StrEnum):
    NONE = "none"  # not latched (RESTART_APP, IGNORE): nothing to recover
    RESET = "reset"  # one GPU reset heals it: the ladder (when recovery is on)
    NODE = "node"  # a reboot, a reseat or a person: node-level, latched until reboot or clear


def remedy(action: str, nvml_action: int | None = None) -> Remedy:
    """The remedy of one fault: the catalog's immediate action, overridden by NVML's recovery action when the
    driver reports one (not None, not 0)."""
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


@dataclass(frozen=True)
class Policy:
    drain_timeout_s: float = 600.0
    evict: bool = False
    budget: int = 2  # resets per GPU within window_s
    window_s: float = 86400.0
    settle_s: float = 0.0  # after a reset, wait this long before the proof (the driver re-initialises)


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

    def at(self, step: Step, now: float, why: str = "", **kw: object) -> GpuRecovery:
        return replace(self, step=step, step_since=now, why=why, **kw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Seen:
    """What the agent saw of one GPU this cycle (None: could not tell)."""

    pods: int | None = None  # pods holding it (pod-resources); None: unknown (off or unreadable)
    processes: int | None = None  # processes with it open (nvidia-smi --query-compute-apps); None: unknown
    reset_result: bool | None = None  # the reset just run: True ok, False failed or hung; None: none ran
    reset_error: str = ""
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
            if seen.reset_result is True:
                return rec.at(Step.PROVING, now, "reset done", reset_done=now), Do.WAIT
            if seen.reset_result is False:
                return rec.at(Step.ESCALATED, now, f"reset failed: {seen.reset_error}"[:300]), Do.ESCALATE
            # Started before a restart and its outcome never recorded: not reset twice; the proof judges it.
            return rec.at(
                Step.PROVING, now, "reset outcome unknown (agent restarted): proving", reset_done=now
            ), Do.WAIT
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
    return rec, Do.PROVE
