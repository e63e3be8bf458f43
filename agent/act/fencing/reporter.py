"""Per-GPU fencing's side effects (docs/fencing.md): what to fence is decided in act/fencing/plan.py (pure);
`FenceReporter` does one LIST (by label) per reconcile and one write (POST, PUT or DELETE) per rule that changes:
fencing a GPU with k MIG devices costs 1 + k writes, clearing it the same. `FenceWorker` runs it on a thread of
its own, so fencing never delays the condition. Events and metrics are callbacks/objects handed in."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any
from urllib.parse import quote

from prometheus_client import CollectorRegistry, Counter, Gauge

from agent.act.fencing.plan import (
    GROUP,
    LONG_NODE,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    NODE_LABEL,
    TAINT_KEY,
    VERSIONS,
    DesiredRule,
    EventHook,
    ExistingRule,
    FencedDevice,
    FenceEffect,
    FencePlan,
    FenceResult,
    FencingSettings,
    desired_rules,
    fence_view,
    node_label,
    parse_rules,
    plan_fencing,
)
from agent.kube.client import ApiError, KubeApi
from agent.model import Verdict
from agent.probes.dra import DraInventory


class FenceMetrics:
    """`gpu_ready_fenced_device{device, pci_bus_id, reason, effect}` 1 per rule the node has (as last listed or
    written); `gpu_ready_fence_changes_total{change}` rules created, updated, deleted;
    `gpu_ready_fence_errors_total` reconcile requests that failed."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.fenced = Gauge(
            "gpu_ready_fenced_device",
            "1 for each device gpu-ready fences with a DeviceTaintRule",
            ["device", "pci_bus_id", "reason", "effect"],
            registry=registry,
        )
        self.changes = Counter(
            "gpu_ready_fence_changes", "DeviceTaintRules created, updated or deleted", ["change"], registry=registry
        )
        self.errors = Counter("gpu_ready_fence_errors", "DeviceTaintRule requests that failed", registry=registry)

    def observe(self, result: FenceResult) -> None:
        self.fenced.clear()
        for f in result.fenced:
            self.fenced.labels(f.device, f.gpu, f.reason, f.effect).set(1)
        for change, n in result.changed.items():
            self.changes.labels(change).inc(n)
        if result.errors:
            self.errors.inc(len(result.errors))


class FenceReporter:
    """Reconciles the node's DeviceTaintRules with the verdict. Needs `list` and `create/update/delete` on
    devicetaintrules (the chart's admission policy limits the token to rules for devices of its own node)."""

    def __init__(
        self,
        api: KubeApi,
        node: str,
        settings: FencingSettings,
        on_event: EventHook | None = None,
        metrics: FenceMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        brake: Callable[[], bool] | None = None,
    ) -> None:
        self.api = api
        self.node = node
        self.settings = settings
        self.on_event = on_event
        self.metrics = metrics
        self.clock = clock
        self.api_version: str | None = None
        self.unsupported: str | None = None
        self.last: FenceResult | None = None
        self._last_key: tuple[Any, ...] | None = None
        self._listed_at = 0.0
        self.node_uid: str | None = None  # read once, only for a node name over LONG_NODE characters
        # The fleet brake (act/brake.py): while it holds this node, NoExecute rules are written as NoSchedule.
        self.brake = brake

    def effective(self) -> FencingSettings:
        """The settings this reconcile applies: the fleet brake turns a NoExecute effect into NoSchedule."""
        s = self.settings
        if s.effect is FenceEffect.NO_EXECUTE and self.brake is not None and self.brake():
            return replace(s, effect=FenceEffect.NO_SCHEDULE)
        return s

    def _key(self, verdict: Verdict, inventory: DraInventory | None) -> tuple[Any, ...]:
        """What a reconcile depends on besides the rules themselves."""
        view = fence_view(verdict)
        want, _, unknown = desired_rules(view, inventory, self.node, self.effective())
        rules = tuple((d.driver, d.pool, d.device, d.reason, d.effect) for d in want)
        unjudged = frozenset(view.unjudged.items())
        return (rules, view.healthy, view.hold_all, view.hold_reasons, unjudged, frozenset(unknown), verdict.status)

    def discover(self, result: FenceResult) -> str | None:
        """The served resource.k8s.io version that has devicetaintrules (v1 preferred); cached once found."""
        if self.api_version is not None:
            return self.api_version
        for v in VERSIONS:
            result.reads += 1
            try:
                res = self.api.request("GET", f"/apis/{GROUP}/{v}")
            except ApiError as e:
                if e.status in (403, 404):
                    continue
                raise
            names = {r.get("name") for r in res.get("resources") or [] if isinstance(r, dict)}
            if "devicetaintrules" in names:
                self.api_version = v
                return v
        self.unsupported = (
            "the cluster serves no DeviceTaintRule API (Kubernetes 1.37, or 1.36 with the DRADeviceTaintRules "
            "feature gate and resource.k8s.io/v1beta2)"
        )
        return None

    def _path(self, version: str, name: str | None = None) -> str:
        base = f"/apis/{GROUP}/{version}/devicetaintrules"
        return f"{base}/{quote(name)}" if name else base

    def list_rules(self, version: str) -> list[ExistingRule]:
        """The node's rules: by label, then only those selecting a device of this node's pool (the label of a long
        node name is a hash no admission policy can check)."""
        selector = f"{MANAGED_BY_LABEL}={MANAGED_BY},{NODE_LABEL}={node_label(self.node)}"
        obj = self.api.request("GET", self._path(version), query={"labelSelector": selector}, verb="LIST")
        return [r for r in parse_rules(obj.get("items")) if r.pool == self.node]

    def uid(self, result: FenceResult) -> str | None:
        """The Node's UID when its name is too long for a rule name (one GET, then remembered); else None."""
        if len(self.node) <= LONG_NODE or self.node_uid:
            return self.node_uid
        result.reads += 1
        uid = (self.api.get_node(self.node).get("metadata") or {}).get("uid")
        self.node_uid = uid if isinstance(uid, str) and uid else None
        return self.node_uid

    def reconcile(self, verdict: Verdict, inventory: DraInventory | None, force: bool = False) -> FenceResult:
        """One LIST, then one write per rule to change. Errors are in the result (never raised); rules that
        failed to change are retried on the next reconcile. When what the verdict asks for is the same as at the
        last clean reconcile less than `resync_s` ago, nothing is requested (`skipped`); the first reconcile
        after a start always lists."""
        result = FenceResult()
        if not self.settings.enabled:
            return result
        key = self._key(verdict, inventory)
        last = self.last
        if (
            not force
            and last is not None
            and not last.errors
            and key == self._last_key
            and self.clock() - self._listed_at < self.settings.resync_s
        ):
            plan = FencePlan(keep=last.plan.keep, notes=last.plan.notes)
            return FenceResult(plan, fenced=last.fenced, unsupported=last.unsupported, skipped=True)
        self._last_key, self._listed_at = key, self.clock()
        try:
            version = self.discover(result)
            if version is None:
                result.unsupported = self.unsupported
                return self._done(result)
            result.reads += 1
            existing = self.list_rules(version)
            uid = self.uid(result)
        except ApiError as e:
            result.errors.append(f"cannot list DeviceTaintRules: {e}")
            return self._done(result)
        view = fence_view(verdict)
        plan = plan_fencing(view, inventory, existing, self.node, self.effective(), verdict.status, uid)
        result.plan = plan
        if plan.waiting:  # names free up with this reconcile's deletes: plan again at the next one
            self._last_key = None
        now: dict[str, ExistingRule | DesiredRule] = {r.name: r for r in existing}
        done = result.changed
        for d in plan.create:
            if self._create(version, d, result):
                now[d.name] = d
                done["created"] = done.get("created", 0) + 1
        for r, d in plan.update:
            if self._update(version, r, d, result):
                now[d.name] = d
                done["updated"] = done.get("updated", 0) + 1
        for r in plan.delete:
            if self._delete(version, r, result):
                now.pop(r.name, None)
                done["deleted"] = done.get("deleted", 0) + 1
        result.fenced = tuple(_fenced(x) for _, x in sorted(now.items()))
        return self._done(result)

    def preview(self, verdict: Verdict, inventory: DraInventory | None) -> FenceResult:
        """What reconcile would do, writing nothing (`gpu-ready check`): discovery and one LIST; `fenced` lists
        the node's rules as they are, `plan` what the agent would create, update and delete."""
        result = FenceResult()
        try:
            version = self.discover(result)
            if version is None:
                result.unsupported = self.unsupported
                return result
            result.reads += 1
            existing = self.list_rules(version)
            uid = self.uid(result)
        except ApiError as e:
            result.errors.append(f"cannot list DeviceTaintRules: {e}")
            return result
        view = fence_view(verdict)
        result.plan = plan_fencing(view, inventory, existing, self.node, self.effective(), verdict.status, uid)
        result.fenced = tuple(_fenced(r) for r in sorted(existing, key=lambda r: r.name))
        return result

    def _done(self, result: FenceResult) -> FenceResult:
        self.last = result
        if self.metrics is not None:
            self.metrics.observe(result)
        return result

    def _write(self, result: FenceResult, method: str, path: str, body: Any) -> dict[str, Any] | None:
        result.writes += 1
        try:
            return self.api.request(method, path, body)
        except ApiError as e:
            if method == "DELETE" and e.status == 404:
                return {}
            result.errors.append(f"{method} {path}: {e}")
            return None

    def _create(self, version: str, d: DesiredRule, result: FenceResult) -> bool:
        if self._write(result, "POST", self._path(version), d.body(version)) is None:
            return False
        self._event("DeviceFenced", d.name, d.device, d.gpu.nvml, f"{TAINT_KEY}={d.reason.value}:{d.effect.value}")
        return True

    def _update(self, version: str, r: ExistingRule, d: DesiredRule, result: FenceResult) -> bool:
        keep_time = r.time_added if r.effect == d.effect.value else None  # an unchanged effect keeps its time
        body = d.body(version, r.resource_version, keep_time)
        if self._write(result, "PUT", self._path(version, d.name), body) is None:
            return False
        self._event("DeviceFenced", d.name, d.device, d.gpu.nvml, f"{TAINT_KEY}={d.reason.value}:{d.effect.value}")
        return True

    def _delete(self, version: str, r: ExistingRule, result: FenceResult) -> bool:
        pre: dict[str, str] = {"resourceVersion": r.resource_version}
        if r.uid:
            pre["uid"] = r.uid
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": pre}
        if self._write(result, "DELETE", self._path(version, r.name), body) is None:
            return False
        self._event("DeviceUnfenced", r.name, r.device, r.gpu.nvml if r.gpu else "", "")
        return True

    def _event(self, reason: str, rule: str, device: str, gpu: str, taint: str) -> None:
        if self.on_event is None:
            return
        on = f" (GPU {gpu})" if gpu else ""
        if reason == "DeviceFenced":
            note = f"DeviceTaintRule {rule} taints {device}{on} with {taint}"
            self.on_event(reason, note, gpu, "Warning", "Fenced")
        else:
            note = f"DeviceTaintRule {rule} deleted: {device}{on} is healthy again"
            self.on_event(reason, note, gpu, "Normal", "Unfenced")


def _fenced(x: ExistingRule | DesiredRule) -> FencedDevice:
    if isinstance(x, DesiredRule):
        return FencedDevice(x.name, x.device, x.gpu.nvml, x.reason.value, x.effect.value)
    return FencedDevice(x.name, x.device, x.gpu.nvml if x.gpu else "", x.value, x.effect)


class FenceWorker:
    """Runs `FenceReporter.reconcile` on its own thread, so that fencing never delays the agent's loop (and so
    never a condition write). The loop hands over each published verdict with `submit`; the worker reconciles
    the newest one (one still waiting is replaced), and calls `on_change` when the set of fenced devices
    changed, so the loop republishes the condition message that lists them. A reconcile that failed is retried
    with the next verdict handed over (every poll). Errors are logged once per change, never raised."""

    def __init__(
        self,
        reporter: FenceReporter,
        on_change: Callable[[], None] | None = None,
        log: Any = None,
    ) -> None:
        self.reporter = reporter
        self.on_change = on_change
        self.log = log
        self.stop = threading.Event()
        self._kick = threading.Event()
        self._lock = threading.Lock()
        self._pending: tuple[Verdict, DraInventory | None] | None = None
        self._fenced: tuple[FencedDevice, ...] = ()
        self._errors: tuple[str, ...] = ()
        self._said_unsupported = False
        self._notes: tuple[str, ...] = ()
        self.last: FenceResult | None = None
        self.reconciles = 0
        self.thread: threading.Thread | None = None

    def submit(self, verdict: Verdict, inventory: DraInventory | None) -> None:
        with self._lock:
            self._pending = (verdict, inventory)
        self._kick.set()

    @property
    def fenced(self) -> tuple[FencedDevice, ...]:
        with self._lock:
            return self._fenced

    def summary(self) -> str:
        """`fenced gpu-3 (NoSchedule)` for the condition message; "" when nothing is fenced."""
        return FenceResult(fenced=self.fenced).summary()

    def start(self) -> FenceWorker:
        self.thread = threading.Thread(target=self._run, name="fencing", daemon=True)
        self.thread.start()
        return self

    def close(self, timeout: float = 0.0) -> None:
        """Stops taking work; a request in flight finishes under its own API timeout (not waited for)."""
        self.stop.set()
        self._kick.set()
        if self.thread is not None and timeout > 0:
            self.thread.join(timeout)

    def _run(self) -> None:
        while not self.stop.is_set():
            self._kick.wait()
            self._kick.clear()
            if self.stop.is_set():
                return
            with self._lock:
                work, self._pending = self._pending, None
            if work is None:
                continue
            try:
                self.step(*work)
            except Exception as e:  # a bug here must not stop fencing for good, nor the agent
                if self.log is not None:
                    self.log.exception("fencing error", error=str(e))

    def step(self, verdict: Verdict, inventory: DraInventory | None) -> FenceResult:
        """One reconcile (the worker thread's body; tests call it directly)."""
        result = self.reporter.reconcile(verdict, inventory)
        self.reconciles += 1
        self.last = result
        changed = False
        with self._lock:
            if result.fenced != self._fenced and not (result.errors and not result.plan and not result.fenced):
                changed, self._fenced = True, result.fenced
        self._log(result)
        if changed and self.on_change is not None:
            self.on_change()
        return result

    def _log(self, result: FenceResult) -> None:
        errors = tuple(result.errors)
        if self.log is not None:
            if errors and errors != self._errors:
                self.log.warning("fencing: DeviceTaintRule requests failed; retried next poll", errors=list(errors))
            elif self._errors and not errors:
                self.log.info("fencing: DeviceTaintRule requests succeed again")
            if result.changed:
                self.log.info(
                    "fencing changed",
                    **result.changed,
                    fenced=[f.device for f in result.fenced],
                    writes=result.writes,
                    reads=result.reads,
                )
            if result.unsupported and not self._said_unsupported:
                self.log.warning("fencing: " + result.unsupported)
            notes = result.plan.notes
            if notes and not result.skipped and notes != self._notes:
                self.log.warning("fencing: not every faulty GPU can be fenced", notes=list(notes))
        if not result.skipped and not errors:
            self._notes = result.plan.notes
        self._said_unsupported = self._said_unsupported or bool(result.unsupported)
        self._errors = errors
