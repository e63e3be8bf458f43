"""Per-GPU recovery's side effects (docs/recovery.md): the ladder's decisions are agent/recovery.py's (pure); here
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

import shlex
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import quote

from prometheus_client import CollectorRegistry, Counter, Gauge

from agent.allocation import AllocationMap
from agent.kube.client import ApiError, KubeApi
from agent.model import Check, GpuIdentity, LatchedFault, Observation, PciAddress, Severity
from agent.proc import Run, SupervisedRunner
from agent.recovery import (
    ACTIVE,
    STEPS,
    Do,
    GpuRecovery,
    Policy,
    Remedy,
    Seen,
    Step,
    decide,
    gpu_remedy,
    nvml_action_of,
    prune,
    start,
)
from agent.settings import (
    DAY,
    RUN_ONLY,
    Setting,
    dns_subdomain,
    in_range,
    optional,
    positive,
    to_bool,
    to_float,
    to_int,
)
from agent.state import LatchState

EventHook = Callable[[str, str, str, str, str], None]  # (reason, note, key, type, action)
MAX_PODS_EVICTED = 64  # per ladder: a GPU holds a few pods (replicas, MIG); more is a bug, not a drain
PROOF_FIELDS = ("{index}", "{bus_id}")


@dataclass(frozen=True)
class Submission:
    obs: Observation
    allocation: AllocationMap | None
    started: float  # wall seconds the cycle's checks started


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
    policy: Policy
    nvidia_smi: str = "nvidia-smi"
    reset_timeout_s: float = 120.0
    proof_command: str = ""
    proof_timeout_s: float = 600.0
    plugin_namespace: str | None = None
    plugin_daemonset: str | None = None


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
    ) -> None:
        self.api, self.node, self.state, self.s = api, node, state, settings
        self.smi, self.kmsg_seq, self.on_event, self.metrics, self.log = smi, kmsg_seq, on_event, metrics, log
        self.brake, self.wall = brake, wall
        # The reset and the proof run supervised (agent/proc.py): at their timeout, or when the agent stops
        # (`kill_running`), their process group and whatever they left behind are killed; nothing outlives the agent.
        self.resetter = SupervisedRunner(settings.nvidia_smi, settings.reset_timeout_s, name="nvidia-smi -r")
        self.prover: SupervisedRunner | None = None
        self.stopping = False  # the agent stops: an outcome cut short by that is not an outcome
        self.asked: dict[str, set[tuple[str, str]]] = {}  # per GPU: pods already evicted in this ladder

    # -- one pass ---------------------------------------------------------------------------------------------

    def step(self, sub: Submission) -> bool:
        """One pass over every GPU; returns whether a ladder changed (the loop publishes again)."""
        now = self.wall()
        changed = self._start_and_drop(sub, now)
        attempts = self.state.resets
        for gpu, rec in sorted(self.state.ladders().items()):
            if rec.step not in ACTIVE:
                continue
            addr = PciAddress.parse(gpu)
            if addr is None:
                continue
            new = self._advance(rec, addr, sub, attempts.get(gpu, ()), now)
            changed |= new != rec
        self.state.prune_resets(lambda v: prune(v, now, self.s.policy.window_s))
        self.metrics.show(self.state.ladders())
        return changed

    def _start_and_drop(self, sub: Submission, now: float) -> bool:
        """Ladders for GPUs whose latched faults a reset heals; a ladder whose faults are gone (cleared by an
        operator, a new boot, a proven reset) is dropped; a fault a reset does not heal ends a ladder (node-level)."""
        by_gpu: dict[str, list[LatchedFault]] = {}
        for lf in self.state.snapshot():
            if lf.gpu is not None and lf.source != "sxid":
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
        for gpu, faults in by_gpu.items():
            rem = gpu_remedy([f.action for f in faults], nvml.get(gpu))
            rec = ladders.get(gpu)
            if (rec is None or rec.step is Step.HEALTHY) and rem is Remedy.RESET:
                new = start(gpu, [f.key for f in faults], now)
                self.state.set_ladder(new, gpu)
                self.log.warning("GPU recovery started", gpu=gpu, faults=list(new.faults))
                self._event("GPURecoveryStarted", f"{self._name(gpu, sub)}: a reset heals its fault; recovery starts",
                            gpu, "Normal")  # fmt: skip
                changed = True
            elif rec is not None and rec.step in ACTIVE and rem is not Remedy.RESET:
                self._escalate(rec, gpu, sub, "a fault a reset does not heal came on top", now)
                changed = True
        return changed

    def _advance(
        self, rec: GpuRecovery, addr: PciAddress, sub: Submission, attempts: tuple[float, ...], now: float
    ) -> GpuRecovery:
        gpu = addr.nvml
        policy, brake = self.s.policy, self.brake()
        seen = self._seen(rec, addr, sub)
        for _ in range(len(STEPS) + 2):  # each pass moves one step at most; bounded whatever decide does
            new, do = decide(rec, seen, attempts, policy, now, brake)
            if do is Do.RESET:
                seq = self.kmsg_seq()
                new = replace(new, reset_seq=seq if seq is not None else -1)
                self.state.set_ladder(new, gpu, reset_at=now)  # counted before it starts: a crash cannot re-run it
                attempts = self.state.resets.get(gpu, ())
                ok, why = self._reset(addr, sub)
                if self.stopping:
                    return new  # killed by the agent's stop: the state file says "reset started", no outcome
                now = self.wall()  # reset_done: the checks that prove it start after this
                seen = replace(seen, reset_result=ok, reset_error=why)
                rec = new
                continue
            if do is Do.PROVE:
                ok, why = self._prove(addr, sub, new)
                if self.stopping:
                    return new
                seen = replace(seen, proof=ok, proof_error=why)
                rec = new
                continue
            if do is Do.EVICT:
                self._evict(gpu, sub)
            elif do is Do.RESTORE:
                self._restore(new, addr, sub, now)
            elif do is Do.ESCALATE:
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
        return Seen(
            pods=pods,
            processes=processes,
            fault_after_reset=rec.reset_started is not None and self._noisy(addr, rec),
            cycle_after_reset=after,
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
        for r in (self.resetter, self.prover):
            if r is not None:
                r.kill_running()

    def _reset(self, addr: PciAddress, sub: Submission) -> tuple[bool, str]:
        argv = [self.s.nvidia_smi, "-r", "-i", addr.nvml]
        self.log.warning("resetting GPU", gpu=addr.nvml, command=" ".join(argv), timeout=self.s.reset_timeout_s)
        out = self.resetter.run(argv[1:])
        if out.error is not None:
            self.metrics.resets.labels("error").inc()
            return False, out.error
        if out.exit_code is None:
            self.metrics.resets.labels("timeout").inc()
            return False, f"`{' '.join(argv)}` did not finish within {self.s.reset_timeout_s:g}s (killed)"
        if out.exit_code != 0:
            self.metrics.resets.labels("failed").inc()
            return False, f"`{' '.join(argv)}` exited {out.exit_code}: {out.output.strip()[-200:]}"
        self.metrics.resets.labels("ok").inc()
        return True, ""

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
        note = (
            f"{self._name(addr.nvml, sub)} reset and proven healthy {took:.0f}s after its fault; its fault is cleared"
        )
        self._event("GPURecovered", note, addr.nvml, "Normal")
        if self._plugin_marked(addr, sub):
            self._restart_plugin(addr)

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
        path = f"/api/v1/namespaces/{quote(ns, safe='')}/pods"
        try:
            pods = self.api.request("GET", path, query={"fieldSelector": f"spec.nodeName={self.node}"}, verb="LIST")
        except ApiError as e:
            self.log.warning("cannot list the device plugin's pods", namespace=ns, error=str(e))
            return
        for p in (pods.get("items") or [])[:256]:
            meta = p.get("metadata") or {}
            owners = meta.get("ownerReferences") or []
            if not any(o.get("kind") == "DaemonSet" and o.get("name") == ds for o in owners):
                continue
            pre = {"uid": meta.get("uid")} if meta.get("uid") else None
            body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
            if pre:
                body["preconditions"] = pre
            try:
                self.api.request("DELETE", f"{path}/{quote(str(meta.get('name')), safe='')}", body)
            except ApiError as e:
                if e.status != 404:
                    self.log.warning("cannot restart the device plugin's pod", pod=meta.get("name"), error=str(e))
                continue
            self.log.info("device plugin pod restarted", pod=f"{ns}/{meta.get('name')}", gpu=addr.nvml)
            self._event("DevicePluginRestarted", f"pod {ns}/{meta.get('name')} of DaemonSet {ds} deleted so that "
                        f"it advertises GPU {addr.nvml} again", f"{addr.nvml}/plugin", "Normal")  # fmt: skip

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
        self.passes = 0
        self.thread: threading.Thread | None = None

    def submit(self, obs: Observation, allocation: AllocationMap | None, started: float) -> None:
        """started: wall seconds the cycle's checks started (a proof reads only checks started after the reset)."""
        with self._lock:
            self._pending = Submission(obs, allocation, started)
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
            self.passes += 1
            if changed:
                self.on_change()


def build(
    cfg: Any,
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
) -> RecoveryWorker | None:
    """The worker for these settings; None with recovery off (nothing changes). `brake`: whether the fleet brake is
    engaged now (asked before every decision; while it is, no eviction and no reset starts)."""
    if not cfg.recovery:
        return None
    policy = Policy(cfg.recovery_drain_timeout, cfg.recovery_evict, cfg.recovery_budget, cfg.recovery_window)
    settings = RecoverySettings(
        policy,
        cfg.nvidia_smi,
        cfg.recovery_reset_timeout,
        cfg.recovery_proof_command or "",
        cfg.recovery_proof_timeout,
        cfg.recovery_plugin_namespace,
        cfg.recovery_plugin_daemonset,
    )
    actor = RecoveryActor(
        api, cfg.node_name, state, settings, smi=smi, kmsg_seq=kmsg_seq, on_event=on_event,
        metrics=RecoveryMetrics(registry), log=log, brake=brake,
    )  # fmt: skip
    return RecoveryWorker(actor, wake, log)


SETTINGS = (
    Setting(
        "recovery",
        to_bool,
        False,
        "per-GPU recovery: drain, reset, prove and return a GPU whose fault a reset heals (docs/recovery.md)",
        commands=RUN_ONLY,
    ),
    Setting(
        "recovery_drain_timeout",
        positive(to_float, DAY),
        600.0,
        "seconds to wait for the pods (then the processes) on a GPU to go before its recovery escalates",
        commands=RUN_ONLY,
    ),
    Setting(
        "recovery_evict", to_bool, False, "evict the pods holding a GPU to recover it (else wait)", commands=RUN_ONLY
    ),
    Setting(
        "recovery_reset_timeout", positive(to_float, 3600), 120.0, "seconds a GPU reset may take", commands=RUN_ONLY
    ),
    Setting(
        "recovery_proof_command",
        optional(lambda v: _proof_command(v)),
        None,
        "command proving one GPU after its reset ({index}, {bus_id} replaced); exit 0 passes (unset: hard checks only)",
        commands=RUN_ONLY,
    ),
    Setting(
        "recovery_proof_timeout",
        positive(to_float, DAY),
        600.0,
        "seconds the proof command may take",
        commands=RUN_ONLY,
    ),
    Setting(
        "recovery_budget", in_range(to_int, 0, 100), 2, "GPU resets per GPU within recoveryWindow", commands=RUN_ONLY
    ),
    Setting(
        "recovery_window",
        positive(to_float, 30 * DAY),
        86400.0,
        "the retry budget's window, seconds",
        commands=RUN_ONLY,
    ),
    Setting(
        "recovery_plugin_namespace",
        optional(dns_subdomain),
        None,
        "namespace of the device plugin DaemonSet restarted after a recovery",
        commands=RUN_ONLY,
    ),
    Setting(
        "recovery_plugin_daemonset",
        optional(dns_subdomain),
        None,
        "the device plugin DaemonSet whose pod on this node is restarted after a recovery",
        commands=RUN_ONLY,
    ),
)


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
