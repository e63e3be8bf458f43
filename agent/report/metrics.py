"""Prometheus metrics (prefix gpu_ready_), an API: names and labels are documented in docs/metrics.md.
Label values are bounded: reasons, checks, Xid numbers, GPU indices and bus ids; never free text.
`pci_bus_id` has one form on every metric, NVML's `00000000:3B:00.0` (PciAddress.nvml), so that
metrics join on it in PromQL."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)

from agent import __version__
from agent.model import TAINT_EFFECTS, Check, PciAddress, Reason, Status, Verdict
from agent.report.blast_radius import AllocationMetrics
from agent.report.multinode_metrics import MultinodeMetrics

disable_created_metrics()  # *_created series double the series count and nothing here uses them

CHECKS = tuple(c.value for c in Check)  # the `check` label's values: the hard checks and the degradation probes


def bus_id_label(raw: str) -> str:
    """The canonical `pci_bus_id` label value: `00000000:3B:00.0` for any address form the kernel,
    nvidia-smi, NVML or sysfs prints; an unparseable address is kept (bounded) as printed."""
    addr = PciAddress.parse(raw[:32])
    return addr.nvml if addr is not None else raw[:20]


class TaintMetrics:
    """`gpu_ready_taint{effect}`: 1 while the Node carries gpu-ready's taint with that effect, 0 when it
    does not (as last read or written; absent until the first Node read). `gpu_ready_taint_changes_total
    {change, effect}`: taint entries added and removed by this agent."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.taint = Gauge(
            "gpu_ready_taint",
            "1 while the Node carries gpu-ready's taint with this effect, 0 when not",
            ["effect"],
            registry=registry,
        )
        self.changes = Counter(
            "gpu_ready_taint_changes",
            "gpu-ready taint entries added or removed by this agent",
            ["change", "effect"],
            registry=registry,
        )

    def observe(self, ours: Iterable[str]) -> None:
        """`ours`: the effects of gpu-ready's entries now on the Node (own_effects)."""
        for effect in TAINT_EFFECTS:
            self.taint.labels(effect).set(1 if effect in ours else 0)

    def changed(self, plan: Any) -> None:
        """`plan`: an act/taints/plan.py TaintPlan (the entries added and removed)."""
        for effect in plan.add:
            self.changes.labels("added", effect).inc()
        for effect in plan.remove:
            if effect in TAINT_EFFECTS:
                self.changes.labels("removed", effect).inc()


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.status = Gauge(
            "gpu_ready_status",
            "1 for the current GPUReady status and reason, 0 for the others",
            ["status", "reason"],
            registry=r,
        )
        self.gpu_healthy = Gauge(
            "gpu_ready_gpu_healthy",
            "1 healthy, 0 unhealthy; absent when unknown",
            ["gpu", "pci_bus_id", "name"],
            registry=r,
        )
        self.gpu_remedy = Gauge(
            "gpu_ready_gpu_remedy",
            "1 per GPU with a fault, by what heals it: reset (a GPU reset, the recovery ladder) or node (a reboot)",
            ["pci_bus_id", "remedy"],
            registry=r,
        )
        self.gpus = Gauge(
            "gpu_ready_gpus", "GPUs seen by each source; absent when the source was not read", ["source"], registry=r
        )
        self.xid = Counter(
            "gpu_ready_xid",
            "Kernel-log GPU errors (Xid, SXid, fallen off the bus)",
            ["xid", "pci_bus_id", "fatal"],
            registry=r,
        )
        self.latched = Gauge(
            "gpu_ready_latched_faults", "Fatal faults latched until reboot or manual clear", registry=r
        )
        self.check_duration = Histogram(
            "gpu_ready_check_duration_seconds",
            "Duration of one check",
            ["check"],
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.check_failures = Counter("gpu_ready_check_failures", "Checks that could not run", ["check"], registry=r)
        self.smi_timeouts = Counter(
            "gpu_ready_nvidia_smi_timeouts", "nvidia-smi runs killed at the timeout", registry=r
        )
        self.kmsg_records = Counter("gpu_ready_kmsg_records", "Kernel-log records read", registry=r)
        self.kmsg_lost = Counter(
            "gpu_ready_kmsg_lost_records", "Kernel-log records overwritten before they were read", registry=r
        )
        self.api_requests = Counter(
            "gpu_ready_api_requests",
            "Kubernetes API requests by verb and HTTP code (0 = no answer)",
            ["verb", "code"],
            registry=r,
        )
        self.condition_writes = Counter("gpu_ready_condition_writes", "GPUReady condition patches sent", registry=r)
        self.events = Counter(
            "gpu_ready_events", "Kubernetes Events written (create or aggregate patch)", ["reason"], registry=r
        )
        self.last_cycle = Gauge("gpu_ready_last_cycle_timestamp_seconds", "When the last check cycle ended", registry=r)
        self.state_write_failures = Counter(
            "gpu_ready_state_write_failures",
            "Writes of the latched-fault state file that failed (the latch is then kept in memory only)",
            registry=r,
        )
        self.events_dropped = Counter(
            "gpu_ready_events_dropped",
            "Events the API refused for good (not retried); the condition is not affected",
            ["code"],
            registry=r,
        )
        self.build_info = Gauge(
            "gpu_ready_build_info", "Always 1; the version label says which build", ["version"], registry=r
        )
        self.build_info.labels(__version__).set(1)
        self.light_client = Gauge(
            "gpu_ready_light_client",
            "1 when the Kubernetes client's REST layer was imported on the light path (agent/lazy.py), 0 when the "
            "agent fell back to the whole client (an unknown kubernetes package layout, or GPU_READY_FULL_CLIENT)",
            registry=r,
        )
        self.taints = TaintMetrics(r)  # gpu_ready_taint{effect}, gpu_ready_taint_changes_total (docs/taints.md)
        # gpu_ready_gpu_{slots,allocated_slots,pods,fenced}{pci_bus_id}, free whole GPUs, packing ratio, ... from
        # pod-resources (docs/allocation.md); absent while podResources is off
        self.allocation = AllocationMetrics(r)
        self.multinode = MultinodeMetrics(r)
        for c in CHECKS:
            self.check_failures.labels(c)
        self.smi_timeouts.inc(0)
        self.state_write_failures.inc(0)
        self._xid_children: dict[tuple[int, str, bool], Any] = {}
        self._gpu_labels: dict[tuple[str, str, str], int] = {}  # gpu_ready_gpu_healthy series and their values
        self._remedies: set[tuple[str, str]] = set()  # gpu_ready_gpu_remedy series shown
        self._gpu_counts: dict[str, int] = {}  # gpu_ready_gpus{source} as last set
        self._check_children: dict[str, Any] = {}
        self._status_shown: tuple[str, str] | None = None  # the gpu_ready_status series at 1

    def observe_xid_key(self, key: tuple[int, str, bool], n: int = 1) -> None:
        child = self._xid_children.get(key)
        if child is None:
            child = self._xid_children[key] = self.xid.labels(
                str(key[0]), bus_id_label(key[1]), "true" if key[2] else "false"
            )
        child.inc(n)

    def observe_check(self, check: str, seconds: float) -> None:
        """One check's duration (the labelled child is looked up once per check, not every cycle)."""
        child = self._check_children.get(check)
        if child is None:
            child = self._check_children[check] = self.check_duration.labels(check)
        child.observe(seconds)

    def api_request(self, verb: str, code: int) -> None:
        self.api_requests.labels(verb, str(code)).inc()

    def observe_cycle(self, stats: Any, allocation: Any, *, enabled: bool) -> None:
        """One check cycle's figures: durations and failures by check, timeouts, the allocation map."""
        for check, seconds in stats.durations.items():
            self.observe_check(check, seconds)
        for check in stats.failed:
            self.check_failures.labels(check).inc()
        if "nvidia_smi" in stats.timed_out:
            self.smi_timeouts.inc()
        self.allocation.publish(allocation, enabled=enabled, read_seconds=stats.durations.get("pod_resources"))

    def publish(self, v: Verdict, latched: int) -> None:
        shown = (v.status.value, v.reason.value)
        if shown != self._status_shown:  # every status x reason series once, then only the two that change
            if self._status_shown is None:
                for s in Status:
                    for r in Reason:
                        self.status.labels(s.value, r.value).set(0)
            else:
                self.status.labels(*self._status_shown).set(0)
            self.status.labels(*shown).set(1)
            self._status_shown = shown
        # Series are set only when their value changes (a steady node sets none per cycle).
        was, now = self._gpu_labels, {}
        for g in v.gpus:
            key = ("" if g.index is None else str(g.index), g.pci_bus_id, (g.name or "")[:64])
            if g.healthy is None:
                continue
            now[key] = value = 1 if g.healthy else 0
            if was.get(key) != value:
                self.gpu_healthy.labels(*key).set(value)
        for key in was.keys() - now.keys():
            self.gpu_healthy.remove(*key)  # unknown: absent
        self._gpu_labels = now
        remedies = {(g.pci_bus_id, g.remedy) for g in v.gpus if g.remedy is not None}
        for bus, rem in self._remedies - remedies:
            self.gpu_remedy.remove(bus, rem)
        for bus, rem in remedies - self._remedies:
            self.gpu_remedy.labels(bus, rem).set(1)
        self._remedies = remedies
        for src, n in vars(v.counts).items():  # every source, `dra` included, so a vanished one is removed
            if n is None:
                if self._gpu_counts.pop(src, None) is not None:
                    self.gpus.remove(src)
            elif self._gpu_counts.get(src) != n:
                self.gpus.labels(src).set(n)
                self._gpu_counts[src] = n
        self.latched.set(latched)
