"""Per-GPU recovery's side effects (docs/recovery.md): the ladder's decisions are ladder.py's (pure); here
they are carried out, on a thread of their own so that a drain, a reset or a proof never delays a check cycle.

After each check cycle the loop submits what it saw (the observation, the allocation map, the kernel log's read
position). For each GPU whose latched faults a reset heals, the worker keeps a ladder in the state file and does
what `decide` asks:
- EVICT: for each pod that holds the GPU (kubelet's pod-resources), a dry-run eviction (the apiserver checks the
  PodDisruptionBudgets; 429: not now) and then a DELETE of that pod, which the chart's admission policy allows only
  for a pod on this node that holds a GPU. Each pod once per ladder.
- RESET: only when no pod and no process holds the GPU (`nvidia-smi --query-compute-apps`), `nvidia-smi -r -i <bus
  id>` under the process supervisor (agent/proc.py: its own process group, killed with everything below it at the
  timeout). The attempt is written to the state file before the reset starts.
- PROVE: the hard checks of the first cycle after the reset on that GPU (nvidia-smi lists it with no ERR!, PCI
  has it, no NVML or device-node fault), then `recoveryProofCommand` (`{index}`, `{bus_id}` replaced) judged by its
  exit code, and the kernel log quiet for the GPU since the reset.
- RESTORE: that GPU's latch alone is cleared (the fence goes with it: fencing follows the verdict), and when the
  device plugin had left it out of allocatable, the plugin DaemonSet's pod on this node is deleted (its DaemonSet
  starts it again and it advertises the GPU anew).
- ESCALATE: the fault stays latched; the verdict says GPURecoveryFailed; an Event and a metric.
The fleet brake, when engaged, stops evictions and resets from starting (`brake` is asked before each decision)."""

from __future__ import annotations

import contextlib
import os
import shlex
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import quote

from prometheus_client import CollectorRegistry, Counter, Gauge

from agent.act.recovery.ladder import (
    ACTIVE,
    CHARGED,
    STEPS,
    Do,
    GpuRecovery,
    Policy,
    RecoverySection,
    Remedy,
    ResetAnswer,
    ResetOutcome,
    Seen,
    Step,
    burst,
    classify_reset,
    decide,
    gpu_remedy,
    nvml_action_of,
    prune,
    start,
)
from agent.act.taints.plan import own_effects, taints_of
from agent.allocation import AllocationMap
from agent.config import Config
from agent.kube.client import ApiError, KubeApi
from agent.model import Check, GpuIdentity, LatchedFault, Observation, PciAddress, Severity, XidEvent
from agent.names import TAINT_KEY
from agent.probes import nvml_pause
from agent.probes.device_nodes import read_minor_numbers
from agent.proc import Run, SupervisedRunner
from agent.state import LatchState

EventHook = Callable[[str, str, str, str, str], None]  # (reason, note, key, type, action)
MAX_PODS_EVICTED = 64  # per ladder: a GPU holds a few pods (replicas, MIG); more is a bug, not a drain


# The metric's `result` per outcome (`ok` and `timeout` as before, for dashboards that count them).
RESULT_LABEL = {ResetOutcome.SUCCEEDED: "ok", ResetOutcome.HUNG: "timeout"}
SETTLE_KINDS = frozenset({"fabric_not_ready", "fabric_failed", "fabric_misconfigured", "recovery_action",
                          "row_remap_pending"})  # fmt: skip  # findings that say a reset GPU has not settled yet
AMPERE_NVSWITCH = ("A100", "A800")  # the Ampere GPUs of NVSwitch baseboards (HGX/DGX A100)
MAX_PROC_PIDS = 8192  # /proc entries read when looking for the GPU's holders
MAX_FDS_PER_PID = 1024


@dataclass(frozen=True)
class Submission:
    obs: Observation
    allocation: AllocationMap | None
    started: float  # wall seconds the cycle's checks started
    # Each GPU's NVLink fabric (state, status) where it has one; None: the fabric was not read this cycle.
    fabric: Mapping[PciAddress, tuple[str, str]] | None = None
    node_noschedule: bool = False  # the node carries gpu-ready's own NoSchedule taint


def fabric_states(report: Any) -> dict[PciAddress, tuple[str, str]] | None:
    """(state, status) per GPU that has a fabric, from the fabric probe's result (None when it did not read)."""
    payload = getattr(report, "payload", None)
    gpus = getattr(payload, "gpus", None)
    if gpus is None:
        return None
    return {g.gpu: (str(g.state), str(g.status)) for g in gpus if getattr(g, "applicable", False)}


class RecoveryMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.step = Gauge(
            "gpu_ready_gpu_recovery_step", "1 for the recovery step each GPU in a ladder is at", ["pci_bus_id", "step"],
            registry=r,
        )  # fmt: skip
        self.resets = Counter("gpu_ready_gpu_resets", "GPU resets the agent ran, by result", ["result"], registry=r)
        self.escalations = Counter(
            "gpu_ready_gpu_recovery_escalations", "GPU recoveries given up (GPURecoveryFailed)", registry=r
        )
        self.recovered = Counter("gpu_ready_gpu_recoveries", "GPUs proven healthy after a reset", registry=r)
        self.evictions = Counter(
            "gpu_ready_gpu_recovery_evictions", "Pods evicted from a GPU to reset it, by result", ["result"], registry=r
        )
        self.last_seconds = Gauge(
            "gpu_ready_gpu_recovery_last_seconds", "Seconds from the fault to the GPU back in service, last recovery",
            registry=r,
        )  # fmt: skip
        self._shown: dict[str, str] = {}

    def show(self, ladders: dict[str, GpuRecovery]) -> None:
        now = {g: r.step.value for g, r in ladders.items()}
        for g, s in self._shown.items():
            if now.get(g) != s:
                self.step.remove(g, s)
        for g, s in now.items():
            if self._shown.get(g) != s:
                self.step.labels(g, s).set(1)
        self._shown = now


@dataclass(frozen=True)
class RecoverySettings:
    """What the actor applies: RecoverySection's values, typed (its defaults), and what it reads of other wings."""

    policy: Policy
    nvidia_smi: str = "nvidia-smi"
    reset_timeout_s: float = RecoverySection.recovery_reset_timeout
    proof_command: str = ""
    proof_timeout_s: float = RecoverySection.recovery_proof_timeout
    plugin_namespace: str | None = None
    plugin_daemonset: str | None = None
    # a second GPU's ladder within this: the node escalates (one baseboard)
    burst_window_s: float = RecoverySection.recovery_burst_window
    persistence: bool = True  # turn persistence mode off for the reset, and back on after, whatever the outcome
    proc_root: str = "/proc"  # where the GPU's holders are looked for (the host's only with hostPID)
    release_holders: tuple[tuple[str, str], ...] = ()  # DaemonSets whose pod on this node is deleted before a reset
    per_gpu_fence: bool = False  # DRA fencing is on: a faulty GPU is fenced by itself (DeviceTaintRules)
    taint_key: str = TAINT_KEY  # gpu-ready's own node taint (its NoSchedule holds new pods off)


def find_holders(proc_root: str, minor: int | None, limit: int = 8) -> list[str]:
    """`pid (comm)` of the processes with /dev/nvidia<minor> open, as far as this process can see them (its own
    PID namespace: only with hostPID does that include the host's daemons). Bounded; never signals anything."""
    if minor is None:
        return []
    want = f"/nvidia{minor}"
    out: list[str] = []
    try:
        pids = [p for p in os.listdir(proc_root) if p.isdigit()][:MAX_PROC_PIDS]
    except OSError:
        return []
    for pid in pids:
        fd_dir = os.path.join(proc_root, pid, "fd")
        try:
            fds = os.listdir(fd_dir)[:MAX_FDS_PER_PID]
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if target.endswith(want) and "/dev/" in target:
                try:
                    comm = Path(proc_root, pid, "comm").read_text(errors="replace").strip()[:32]
                except OSError:
                    comm = "?"
                out.append(f"{pid} ({comm})")
                break
        if len(out) >= limit:
            break
    return out


class RecoveryActor:
    """Carries out the ladder for every GPU of this node; `step` is one pass (the worker calls it)."""

    def __init__(
        self,
        api: KubeApi,
        node: str,
        state: LatchState,
        settings: RecoverySettings,
        *,
        smi: SupervisedRunner,
        kmsg_seq: Callable[[], int | None],
        on_event: EventHook,
        metrics: RecoveryMetrics,
        log: Any,
        brake: Callable[[], bool] = lambda: False,
        wall: Callable[[], float] = time.time,
        quiet: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self.api, self.node, self.state, self.s = api, node, state, settings
        self.quiet = quiet  # the agent's own GPU clients stand aside while a reset runs (its NVML session)
        self.tool_missing = ""  # the reset tool could not be run (a configuration error): no reset until a restart
        self.awaiting: dict[str, tuple[float, float, str]] = {}  # GPUs proven, plugin restarted: (deadline, took,
        # name) until the GPU is back in the node's allocatable (then GPURecovered)
        self.starts: dict[str, float] = {}  # when each GPU's last ladder started (the burst window)
        self.smi, self.kmsg_seq, self.on_event, self.metrics, self.log = smi, kmsg_seq, on_event, metrics, log
        self.brake, self.wall = brake, wall
        # The reset and the proof run supervised (agent/proc.py): at their timeout, or when the agent stops
        # (`kill_running`), their process group and whatever they left behind are killed; nothing outlives the agent.
        self.resetter = SupervisedRunner(settings.nvidia_smi, settings.reset_timeout_s, name="nvidia-smi -r")
        # persistence mode around the reset: a runner of its own (the check loop's nvidia-smi is paused meanwhile)
        self.pm = SupervisedRunner(settings.nvidia_smi, 30.0, name="nvidia-smi -pm")
        self.prover: SupervisedRunner | None = None
        self.stopping = False  # the agent stops: an outcome cut short by that is not an outcome
        self.asked: dict[str, set[tuple[str, str]]] = {}  # per GPU: pods already evicted in this ladder

    # -- one pass ---------------------------------------------------------------------------------------------

    def step(self, sub: Submission) -> bool:
        """One pass over every GPU; returns whether a ladder changed (the loop publishes again)."""
        now = self.wall()
        changed = self._start_and_drop(sub, now)
        for gpu, rec in sorted(self.state.ladders().items()):
            if rec.step not in ACTIVE:
                continue
            addr = PciAddress.parse(gpu)
            if addr is None:
                continue
            new = self._advance(rec, addr, sub, self.state.resets.get(gpu, ()), now)
            changed |= new != rec
        self._announce_back(sub, now)
        window = self.s.policy.window_s
        self.state.prune_resets(lambda v: prune(v, now, window), now - window)
        self.metrics.show(self.state.ladders())
        return changed

    def _start_and_drop(self, sub: Submission, now: float) -> bool:
        """Ladders for GPUs whose latched faults a reset heals; a ladder whose faults are gone (cleared by an
        operator, a new boot, a proven reset) is dropped; a fault a reset does not heal ends a ladder (node-level).
        An NVSwitch SXid on the node wins over every GPU's reset; a second GPU starting a ladder within the burst
        window escalates every ladder of the node (one bad baseboard, not two bad GPUs)."""
        self._latch_pending_remaps(sub, now)
        by_gpu: dict[str, list[LatchedFault]] = {}
        sxid = False
        for lf in self.state.snapshot():
            if lf.source == "sxid":
                sxid = True
            elif lf.gpu is not None:
                by_gpu.setdefault(lf.gpu.nvml, []).append(lf)
        nvml = {
            f.gpu.nvml: nvml_action_of(f.message) for f in sub.obs.findings if f.kind == "recovery_action" and f.gpu
        }
        ladders = self.state.ladders()
        changed = False
        for gpu in ladders:
            if gpu not in by_gpu:
                self.state.set_ladder(None, gpu)
                self.asked.pop(gpu, None)
                changed = True
        for gpu, faults in sorted(by_gpu.items()):
            rem = Remedy.NODE if sxid else gpu_remedy([f.action for f in faults], nvml.get(gpu))
            rec = ladders.get(gpu)
            if (rec is None or rec.step is Step.HEALTHY) and rem is Remedy.RESET:
                new = start(gpu, [f.key for f in faults], now)
                if sub.fabric is not None and PciAddress.parse(gpu) in sub.fabric:
                    new = replace(new, fabric=True)
                self.state.set_ladder(new, gpu)
                self.log.warning("GPU recovery started", gpu=gpu, faults=list(new.faults))
                self._event("GPURecoveryStarted", f"{self._name(gpu, sub)}: a reset heals its fault; recovery starts",
                            gpu, "Normal")  # fmt: skip
                changed = True
                self._precheck(new, gpu, sub, now)
            elif rec is not None and rec.step in ACTIVE and rem is not Remedy.RESET:
                why = "an NVSwitch fault (SXid) came on top" if sxid else "a fault a reset does not heal came on top"
                self._escalate(rec, gpu, sub, why, now)
                changed = True
        return changed

    def _latch_pending_remaps(self, sub: Submission, now: float) -> None:
        """A pending row remap (NVML) takes effect only at a reset: with recovery on it is latched as a fault whose
        remedy is that GPU's reset (source `row_remap`), so the ladder starts as for a reset-class Xid; the proven
        reset clears it (and the proof wants none pending)."""
        ladders = self.state.ladders()
        for f in sub.obs.findings:
            if f.kind != "row_remap_pending" or f.gpu is None:
                continue
            rec = ladders.get(f.gpu.nvml)
            if rec is not None and rec.step is not Step.HEALTHY:
                continue  # its ladder runs (or gave up): the proof judges the remap
            ev = XidEvent(0, f.gpu, f.gpu.kernel, True, f.message[:200], "row_remap", "row remap", "RESET_GPU")
            if self.state.latch(ev, now) is not None:
                self.log.warning("row remap pending: latched for a reset", gpu=f.gpu.nvml)

    def _precheck(self, rec: GpuRecovery, gpu: str, sub: Submission, now: float) -> None:
        """What ends a new ladder before any reset: the node cannot reset a GPU alone, the GPU is in MIG mode, a
        second GPU within the burst window; and a reset of it that an earlier agent started with no outcome recorded
        (its state file lost): proven, never run again."""
        others = burst(self.starts, gpu, now, self.s.burst_window_s)
        self.starts[gpu] = now
        addr = PciAddress.parse(gpu)
        ident = sub.obs.gpus.get(addr) if addr is not None else None
        if self.node_off:
            self._escalate(rec, gpu, sub, f"per-GPU reset is off on this node: "
                           f"{self.node_off}", now)  # fmt: skip
        elif self._ampere_without_fm(ident, sub):
            self._escalate(rec, gpu, sub, "an Ampere NVSwitch board with the fabric manager down: a single-GPU reset "
                           "needs it (else all NVLink peers at once); node remedy", now)  # fmt: skip
        elif ident is not None and ident.mig_enabled:
            self._escalate(rec, gpu, sub, "MIG mode is on: a reset drops its MIG instances (and on Hopper MIG mode "
                           "itself); node remedy", now)  # fmt: skip
        elif others:
            why = (f"a second GPU faulted within {self.s.burst_window_s:g}s of {', '.join(others)}: one baseboard, "
                   "not two bad GPUs; node remedy")  # fmt: skip
            for g, r in sorted(self.state.ladders().items()):
                if r.step in ACTIVE:
                    self._escalate(r, g, sub, why, now)
        elif (t := self.state.journal.in_flight(gpu)) is not None:
            why = "a reset started by an earlier agent has no recorded outcome: proving it, not resetting again"
            self.log.warning(why, gpu=gpu)
            seq = self.kmsg_seq()  # what the kernel log said before now is taken as said before the reset
            new = rec.at(Step.PROVING, now, why, reset_started=t, reset_done=now, reset_seq=-1 if seq is None else seq)
            self.state.set_ladder(new, gpu)

    @property
    def node_off(self) -> str:
        """Why no GPU of this node can be reset alone ("" none): `unsupported` and `needs-peers` are remembered for
        the boot (in the state file); `tool-missing`, a configuration error, until the agent restarts."""
        return self.state.reset_unavailable or self.tool_missing

    @staticmethod
    def _ampere_without_fm(ident: GpuIdentity | None, sub: Submission) -> bool:
        """On HGX/DGX A100 (NVSwitch, Ampere) a single-GPU reset needs the fabric manager running; later generations
        do not (the nvidia-smi man page, "GPU Reset")."""
        name = (ident.name or "") if ident is not None else ""
        down = any(f.kind == "fm_not_running" for f in sub.obs.findings)
        return down and any(m in name for m in AMPERE_NVSWITCH)

    def _advance(
        self, rec: GpuRecovery, addr: PciAddress, sub: Submission, attempts: tuple[float, ...], now: float
    ) -> GpuRecovery:
        gpu = addr.nvml
        policy, brake = self.s.policy, self.brake()
        seen = self._seen(rec, addr, sub)
        for _ in range(len(STEPS) + 2):  # each pass moves one step at most; bounded whatever decide does
            new, do = decide(rec, seen, attempts, policy, now, brake)
            if do is Do.RESET and self.node_off:
                new, do = (
                    rec.at(Step.ESCALATED, now, f"per-GPU reset is off on this node: {self.node_off}"),
                    Do.ESCALATE,
                )
            if do is Do.RESET:
                seq = self.kmsg_seq()
                new = replace(new, reset_seq=seq if seq is not None else -1)
                if not self.state.set_ladder(new, gpu, reset_at=now):  # counted before it starts, or not started
                    self.log.error("GPU reset not started: it cannot be recorded first", gpu=gpu)
                    return rec
                attempts = self.state.resets.get(gpu, ())
                ans = self._reset(addr, sub)
                if self.stopping:
                    return new  # killed by the agent's stop: the journal says "reset started", no outcome
                ok = ans.outcome in CHARGED or ans.outcome is ResetOutcome.SUCCEEDED
                self.state.settle_reset(gpu, now, charged=ok)
                attempts = self.state.resets.get(gpu, ())
                now = self.wall()  # reset_done: the checks that prove it start after this
                seen = replace(seen, reset_outcome=ans.outcome, reset_error=ans.detail)
                rec = new
                continue
            if do is Do.PROVE:
                ok, why = self._prove(addr, sub, new)
                if self.stopping:
                    return new
                seen = replace(seen, proof=ok, proof_error=why)
                rec = new
                continue
            if do in (Do.RESTORE, Do.ESCALATE) and new.reset_started is not None:
                self.state.settle_reset(gpu, new.reset_started, charged=True)  # an outcome unknown until now
            if do is Do.EVICT:
                self._evict(gpu, sub)
            elif do is Do.RESTORE:
                self._restore(new, addr, sub, now)
            elif do is Do.ESCALATE:
                self._escalated(new, gpu, sub)
            elif do is Do.REFUND:
                self._event("GPUResetRetry", f"{self._name(gpu, sub)}: {new.why}", f"{gpu}/refused", "Normal")
            elif do is Do.REFUND_END:
                self.metrics.escalations.inc()
                self.log.error("GPU reset refused until the drain timeout; the fault stays latched", gpu=gpu,
                               why=new.why)  # fmt: skip
                self._event("GPUResetRefused", f"{self._name(gpu, sub)}: {new.why}; something still holds it (not a "
                            "hardware failure); the fault stays latched", gpu, "Warning")  # fmt: skip
            elif do is Do.NODE_OFF:
                if new.outcome == ResetOutcome.TOOL_MISSING.value:
                    self.tool_missing = self.tool_missing or new.why
                elif not self.state.reset_unavailable:
                    self.state.reset_unavailable = new.why  # saved with the ladder below: for this boot
                self._event("GPUResetUnavailable", f"{self._name(gpu, sub)}: {new.why}; the fault goes to the node "
                            "remedy and per-GPU reset is off on this node (for the boot; tool-missing: until the "
                            "agent restarts)", "node-off",
                            "Warning")  # fmt: skip
                self._escalated(new, gpu, sub)
            if new != rec:
                if new.step != rec.step:
                    self.log.info("GPU recovery step", gpu=gpu, step=new.step.value, why=new.why)
                self.state.set_ladder(new, gpu)
            return new
        return rec

    # -- what the agent sees ------------------------------------------------------------------------------------

    def _seen(self, rec: GpuRecovery, addr: PciAddress, sub: Submission) -> Seen:
        pods = None if sub.allocation is None else len(sub.allocation.pods_on(addr))
        near = rec.step is Step.RESETTING or (rec.step in (Step.FENCED, Step.DRAINING) and pods == 0)
        processes = self._processes(addr) if near else None
        after = rec.reset_done is not None and sub.started > rec.reset_done
        fenced: bool | None = None
        if not self.s.per_gpu_fence and rec.step is Step.FENCED:  # a device-plugin node: no fence of its own
            unhealthy = sub.allocation is not None and any(g.gpu == addr and g.fenced for g in sub.allocation.gpus)
            fenced = True if unhealthy or sub.node_noschedule else (None if sub.allocation is None else False)
        return Seen(
            fenced=fenced,
            pods=pods,
            processes=processes,
            fault_after_reset=rec.reset_started is not None and self._noisy(addr, rec),
            cycle_after_reset=after,
            settle_problem=settle_problem(sub, addr, rec.fabric) if rec.step is Step.PROVING else None,
        )

    def _noisy(self, addr: PciAddress, rec: GpuRecovery) -> bool:
        return self.state.gpu_records.get(addr, -1) > rec.reset_seq

    def _processes(self, addr: PciAddress) -> int | None:
        """Processes with the GPU open (nvidia-smi --query-compute-apps); None when it cannot tell."""
        run = self.smi.run(["--query-compute-apps=gpu_bus_id,pid", "--format=csv,noheader"])
        if run.exit_code != 0:
            return None
        n = 0
        for line in run.output.splitlines()[:4096]:
            if "No running" in line or not line.strip():
                continue
            bus = PciAddress.parse(line.split(",", 1)[0])
            if bus is None:
                return None  # a line we cannot read: do not guess that the GPU is free
            n += bus == addr
        return n

    # -- actions ------------------------------------------------------------------------------------------------

    def _evict(self, gpu: str, sub: Submission) -> None:
        addr = PciAddress.parse(gpu)
        if addr is None or sub.allocation is None:
            return
        asked = self.asked.setdefault(gpu, set())
        for p in sub.allocation.pods_on(addr):
            key = (p.namespace, p.pod)
            if key in asked or len(asked) >= MAX_PODS_EVICTED:
                continue
            base = f"/api/v1/namespaces/{quote(p.namespace, safe='')}/pods/{quote(p.pod, safe='')}"
            body = {
                "apiVersion": "policy/v1",
                "kind": "Eviction",
                "metadata": {"name": p.pod, "namespace": p.namespace},
            }
            try:  # the apiserver checks the PodDisruptionBudgets; a dry run changes nothing
                self.api.request("POST", base + "/eviction", body, query={"dryRun": "All"}, verb="EVICT")
            except ApiError as e:
                if e.status == 404:
                    asked.add(key)
                    continue
                self.metrics.evictions.labels("refused" if e.status == 429 else "error").inc()
                self.log.info("eviction not allowed now", pod=f"{p.namespace}/{p.pod}", gpu=gpu, error=str(e))
                continue
            try:
                self.api.request("DELETE", base, {"apiVersion": "v1", "kind": "DeleteOptions"})
            except ApiError as e:
                if e.status != 404:
                    self.metrics.evictions.labels("error").inc()
                    self.log.warning("pod not evicted", pod=f"{p.namespace}/{p.pod}", gpu=gpu, error=str(e))
                    continue
            asked.add(key)
            self.metrics.evictions.labels("evicted").inc()
            note = f"pod {p.namespace}/{p.pod} evicted from {self._name(gpu, sub)} to reset it"
            self._event("GPURecoveryEvicted", note, f"{gpu}/{p.namespace}/{p.pod}", "Normal")

    def kill_running(self) -> None:
        """The agent stops: a reset or proof in flight is killed with everything it started. Its outcome is not
        recorded: the state file keeps the reset as started, and the next agent goes on to the proof."""
        self.stopping = True
        for r in (self.resetter, self.prover, self.pm):
            if r is not None:
                r.kill_running()

    def _reset(self, addr: PciAddress, sub: Submission) -> ResetAnswer:
        """Frees the GPU (the agent's own NVML session paused, persistence mode off), resets it, puts everything
        back whatever the outcome, and classifies what the reset answered."""
        argv = [self.s.nvidia_smi, "-r", "-i", addr.nvml]
        ident = sub.obs.gpus.get(addr, GpuIdentity(addr))
        self.log.warning("resetting GPU", gpu=addr.nvml, command=" ".join(argv), timeout=self.s.reset_timeout_s)
        if self.s.release_holders:
            self._release_holders(addr)
        with self.quiet(), nvml_pause.smi_paused(self.smi):
            persistence = self._persistence_off(addr)
            try:
                out = self.resetter.run(argv[1:])
            finally:
                if persistence:
                    self._smi_ok(["-i", addr.nvml, "-pm", "1"], "persistence mode restored", addr)
        ans = classify_reset(
            addr.nvml, out.exit_code, out.output, error=out.error, timed_out=out.timed_out, capped=out.output_capped
        )
        if ans.outcome is ResetOutcome.REFUSED:
            holders = find_holders(self.s.proc_root, read_minor_numbers(self.s.proc_root, [addr]).get(addr))
            seen = ", ".join(holders) if holders else (
                "no process visible to the agent holds it (only those of its own PID namespace are: set "
                "recovery.hostPID to see the host's)")  # fmt: skip
            ans = replace(ans, detail=f"{ans.detail} [holders: {seen}]"[:300])
        self.metrics.resets.labels(RESULT_LABEL.get(ans.outcome, ans.outcome.value)).inc()
        self.log.warning("GPU reset answered", gpu=addr.nvml, outcome=ans.outcome.value, detail=ans.detail,
                         index=ident.index)  # fmt: skip
        return ans

    def _persistence_off(self, addr: PciAddress) -> bool:
        """Turns persistence mode off for the reset when it is on; returns whether it must be turned on again."""
        if not self.s.persistence:
            return False
        run = self.pm.run(["-i", addr.nvml, "--query-gpu=persistence_mode", "--format=csv,noheader"])
        if run.exit_code != 0 or "enabled" not in run.output.lower():
            return False
        return self._smi_ok(["-i", addr.nvml, "-pm", "0"], "persistence mode off for the reset", addr)

    def _smi_ok(self, args: list[str], what: str, addr: PciAddress) -> bool:
        run = self.pm.run(args)
        if run.exit_code == 0:
            self.log.info(what, gpu=addr.nvml)
            return True
        self.log.warning(f"{what}: failed", gpu=addr.nvml, exit_code=run.exit_code, output=run.output[-200:])
        return False

    def _prove(self, addr: PciAddress, sub: Submission, rec: GpuRecovery) -> tuple[bool, str]:
        bad = hard_check_problem(sub.obs, addr)
        if bad:
            return False, bad
        cmd = self.s.proof_command.strip()
        if cmd:
            ident = sub.obs.gpus.get(addr, GpuIdentity(addr))
            argv = [
                a.replace("{index}", "" if ident.index is None else str(ident.index)).replace("{bus_id}", addr.nvml)
                for a in shlex.split(cmd)
            ]
            self.prover = SupervisedRunner(argv[0], self.s.proof_timeout_s, name="the proof command")
            out: Run = self.prover.run(argv[1:])
            if out.error is not None:
                return False, f"cannot run the proof command: {out.error}"
            if out.exit_code is None:
                return False, f"the proof command did not finish within {self.s.proof_timeout_s:g}s"
            if out.exit_code != 0:
                return False, f"the proof command exited {out.exit_code}: {out.output.strip()[-200:]}"
        if self._noisy(addr, rec):
            return False, "the kernel log named the GPU during the proof"
        return True, ""

    def _restore(self, rec: GpuRecovery, addr: PciAddress, sub: Submission, now: float) -> None:
        gone = self.state.clear_gpu(addr, self.kmsg_seq())
        self.asked.pop(addr.nvml, None)
        self.metrics.recovered.inc()
        took = max(0.0, now - rec.since)
        self.metrics.last_seconds.set(took)
        self.log.info("GPU recovered", gpu=addr.nvml, seconds=round(took, 1), cleared=len(gone))
        if self._plugin_marked(addr, sub):
            self._restart_plugin(addr)  # GPURecovered once the plugin advertises the GPU again
            self.awaiting[addr.nvml] = (now + self.s.policy.settle_timeout_s, took, self._name(addr.nvml, sub))
            return
        note = (
            f"{self._name(addr.nvml, sub)} reset and proven healthy {took:.0f}s after its fault; its fault is cleared"
        )
        self._event("GPURecovered", note, addr.nvml, "Normal")

    def _announce_back(self, sub: Submission, now: float) -> None:
        """GPURecovered for a proven GPU once it is back in the node's allocatable after the plugin's restart (its
        advertisement or its DRA slice); a warning when it does not come back within the settle timeout."""
        for gpu, (deadline, took, name) in list(self.awaiting.items()):
            addr = PciAddress.parse(gpu)
            back = sub.allocation is not None and any(g.gpu == addr and not g.fenced for g in sub.allocation.gpus)
            if back:
                note = (f"{name} reset and proven healthy {took:.0f}s after its fault; its fault is cleared and it "
                        "is back in the node's allocatable")  # fmt: skip
                self._event("GPURecovered", note, gpu, "Normal")
            elif now > deadline:
                why = "cannot tell (no allocation view)" if sub.allocation is None else "it is not advertised"
                note = (f"{name} reset and proven healthy, its fault cleared, but it did not come back in the node's "
                        f"allocatable within {self.s.policy.settle_timeout_s:g}s after the device plugin's restart: "
                        f"{why}")  # fmt: skip
                self._event("GPUNotReadvertised", note, gpu, "Warning")
            else:
                continue
            del self.awaiting[gpu]

    def _plugin_marked(self, addr: PciAddress, sub: Submission) -> bool:
        """The device plugin left the GPU out of allocatable (it never takes back a device it marked unhealthy
        without a restart); unknown (no allocation map) counts as marked."""
        if not (self.s.plugin_namespace and self.s.plugin_daemonset):
            return False
        if sub.allocation is None:
            return True
        return any(g.gpu == addr and g.fenced for g in sub.allocation.gpus)

    def _restart_plugin(self, addr: PciAddress) -> None:
        ns, ds = self.s.plugin_namespace or "", self.s.plugin_daemonset or ""
        for pod in self._delete_ds_pods(ns, ds):
            self.log.info("device plugin pod restarted", pod=f"{ns}/{pod}", gpu=addr.nvml)
            self._event("DevicePluginRestarted", f"pod {ns}/{pod} of DaemonSet {ds} deleted so that "
                        f"it advertises GPU {addr.nvml} again", f"{addr.nvml}/plugin", "Normal")  # fmt: skip

    def _release_holders(self, addr: PciAddress) -> None:
        """Deletes the pod of each `release_holders` DaemonSet on this node (its handles on the GPUs go with it; its
        DaemonSet starts it again). The chart's admission policy allows exactly these pods on this node."""
        for ns, ds in self.s.release_holders:
            for pod in self._delete_ds_pods(ns, ds):
                self.log.info("holder pod deleted before a GPU reset", pod=f"{ns}/{pod}", gpu=addr.nvml)
                self._event("GPUHolderReleased", f"pod {ns}/{pod} of DaemonSet {ds} deleted to release GPU "
                            f"{addr.nvml} for its reset", f"{addr.nvml}/holder/{ns}/{pod}", "Normal")  # fmt: skip

    def _delete_ds_pods(self, ns: str, ds: str) -> list[str]:
        """Deletes the pods of DaemonSet `ns`/`ds` on this node (UID-preconditioned); returns the ones deleted."""
        path = f"/api/v1/namespaces/{quote(ns, safe='')}/pods"
        try:
            pods = self.api.request("GET", path, query={"fieldSelector": f"spec.nodeName={self.node}"}, verb="LIST")
        except ApiError as e:
            self.log.warning("cannot list a DaemonSet's pods", namespace=ns, daemonset=ds, error=str(e))
            return []
        gone = []
        for p in (pods.get("items") or [])[:256]:
            meta = p.get("metadata") or {}
            owners = meta.get("ownerReferences") or []
            if meta.get("deletionTimestamp") or not any(
                o.get("kind") == "DaemonSet" and o.get("name") == ds for o in owners
            ):
                continue
            body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
            if meta.get("uid"):
                body["preconditions"] = {"uid": meta.get("uid")}
            try:
                self.api.request("DELETE", f"{path}/{quote(str(meta.get('name')), safe='')}", body)
            except ApiError as e:
                if e.status != 404:
                    self.log.warning("cannot delete a DaemonSet's pod", pod=meta.get("name"), error=str(e))
                continue
            gone.append(str(meta.get("name")))
        return gone

    def _escalate(self, rec: GpuRecovery, gpu: str, sub: Submission, why: str, now: float) -> None:
        new = rec.at(Step.ESCALATED, now, why)
        self.state.set_ladder(new, gpu)
        self._escalated(new, gpu, sub)

    def _escalated(self, rec: GpuRecovery, gpu: str, sub: Submission) -> None:
        self.metrics.escalations.inc()
        self.log.error("GPU recovery failed; the fault stays latched", gpu=gpu, why=rec.why)
        self._event("GPURecoveryFailed", f"{self._name(gpu, sub)}: recovery failed: {rec.why}; the fault stays latched "
                    "until a reboot or an operator clear", gpu, "Warning")  # fmt: skip

    def _event(self, reason: str, note: str, key: str, type_: str) -> None:
        self.on_event(reason, note[:1000], key, type_, "Recovery")

    @staticmethod
    def _name(gpu: str, sub: Submission) -> str:
        addr = PciAddress.parse(gpu)
        ident = sub.obs.gpus.get(addr) if addr is not None else None
        return f"GPU {ident.index} ({gpu})" if ident is not None and ident.index is not None else f"GPU {gpu}"


def settle_problem(sub: Submission, addr: PciAddress, has_fabric: bool) -> str:
    """Why a reset GPU has not settled yet ("" when it has): its fabric still training (or failed), a recovery
    action or a row remap still pending; on a GPU that had a fabric, no fabric reading at all."""
    for f in sub.obs.findings:
        if f.gpu == addr and f.kind in SETTLE_KINDS:
            return f"{f.check.value}: {f.message}"[:200]
    if sub.fabric is not None and addr in sub.fabric:
        state, status = sub.fabric[addr]
        if state != "Completed" or status != "Success":
            return f"NVLink fabric {state} / {status}"
    elif has_fabric:
        return "no NVLink fabric reading for a GPU that has a fabric"
    return ""


def hard_check_problem(obs: Observation, addr: PciAddress) -> str:
    """Why the hard checks of one cycle do not prove the GPU healthy ("" when they do): nvidia-smi and PCI list it,
    no GPU fault finding names it, and every GPU source could check."""
    for check in (Check.NVIDIA_SMI, Check.PCI):
        seen = obs.seen.get(check)
        if seen is None:
            return f"{check.value} did not run"
        if addr not in seen:
            return f"{check.value} does not list it"
    for f in obs.findings:
        if f.check is Check.XID:
            continue
        if f.severity is Severity.FAULT and f.gpu == addr:
            return f"{f.check.value}: {f.message}"[:300]
        if f.severity is Severity.UNCHECKED and f.check in (
            Check.NVIDIA_SMI,
            Check.NVML,
            Check.DEVICE_NODES,
            Check.PCI,
        ):
            return f"{f.check.value} could not check: {f.message}"[:300]
    return ""


class RecoveryWorker:
    """Runs the actor on its own thread: `submit` hands over the newest cycle (a pass in flight finishes first;
    only the newest submission waits); `on_change` wakes the loop when a ladder changed."""

    def __init__(self, actor: RecoveryActor, on_change: Callable[[], None], log: Any) -> None:
        self.actor, self.on_change, self.log = actor, on_change, log
        self._lock = threading.Lock()
        self._pending: Submission | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    def submit(
        self,
        obs: Observation,
        allocation: AllocationMap | None,
        started: float,
        fabric: Any = None,
        node: dict[str, Any] | None = None,
    ) -> None:
        """started: wall seconds the cycle's checks started (a proof reads only checks started after the reset);
        fabric: the fabric probe's result of the cycle (None: not read); node: the own Node as last read (its
        taints)."""
        tainted = "NoSchedule" in own_effects(taints_of(node), self.actor.s.taint_key)
        with self._lock:
            self._pending = Submission(obs, allocation, started, fabric_states(fabric), tainted)
        self._wake.set()

    def start(self) -> RecoveryWorker:
        self.thread = threading.Thread(target=self._run, name="gpu-recovery", daemon=True)
        self.thread.start()
        return self

    def close(self, timeout: float = 0.0) -> None:
        self._stop.set()
        self._wake.set()
        self.actor.kill_running()
        if self.thread is not None and timeout:
            self.thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                sub, self._pending = self._pending, None
            if sub is None or self._stop.is_set():
                continue
            try:
                changed = self.actor.step(sub)
            except Exception as e:  # a bug must not stop the agent; the ladder resumes on the next cycle
                self.log.exception("recovery pass failed", error=str(e))
                continue
            if changed:
                self.on_change()


def build(
    cfg: Config,
    api: KubeApi,
    state: LatchState,
    *,
    smi: SupervisedRunner,
    kmsg_seq: Callable[[], int | None],
    on_event: EventHook,
    registry: CollectorRegistry,
    log: Any,
    wake: Callable[[], None],
    brake: Callable[[], bool] = lambda: False,
    nvml: Any = None,
) -> RecoveryWorker | None:
    """The worker for these settings; None with recovery off (nothing changes). `brake`: whether the fleet brake is
    engaged now (asked before every decision; while it is, no eviction and no reset starts)."""
    s: RecoverySection = cfg[RecoverySection]
    if not s.recovery:
        return None
    policy = Policy(
        s.recovery_drain_timeout,
        s.recovery_evict,
        s.recovery_budget,
        s.recovery_window,
        settle_timeout_s=s.recovery_settle_timeout,
    )
    settings = RecoverySettings(
        policy,
        cfg.nvidia_smi,
        s.recovery_reset_timeout,
        s.recovery_proof_command or "",
        s.recovery_proof_timeout,
        s.recovery_plugin_namespace,
        s.recovery_plugin_daemonset,
        burst_window_s=s.recovery_burst_window,
        proc_root=cfg.proc_root,
        release_holders=tuple(s.recovery_release_holders),
        per_gpu_fence=bool(cfg.fencing),
        taint_key=cfg.taint_key,
    )
    actor = RecoveryActor(
        api, cfg.node_name, state, settings, smi=smi, kmsg_seq=kmsg_seq, on_event=on_event,
        metrics=RecoveryMetrics(registry), log=log, brake=brake, quiet=lambda: nvml_pause.paused(nvml),
    )  # fmt: skip
    return RecoveryWorker(actor, wake, log)
