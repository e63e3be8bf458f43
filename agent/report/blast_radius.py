"""Publishing the allocation map (docs/allocation.md): metrics, the blast-radius Events (on the Node, one per pod
that holds a slot of a GPU that turned bad, naming the pod), the pod count for the condition message, and the
`gpu-ready gpus` table.
Reporters only: the map comes from agent/allocation.py (built by the check suite), the health from the verdict.

Labels are bounded: per GPU only `pci_bus_id` (NVML form, as on every per-GPU metric); never pod names."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from agent.allocation import AllocationMap, GpuAllocation, PodRef
from agent.model import GpuStatus, PciAddress, Status, Verdict
from agent.probes.infiniband import RailReport as RailView

EVENT_REASON = "GPUUnhealthy"
EVENTS_PER_CYCLE = 50  # blast-radius Events queued per publish at most; the rest are counted, not written
UUID_SHORT = 12  # characters of a GPU UUID shown in the table


# -- metrics ------------------------------------------------------------------------------------------------


class AllocationMetrics:
    """gpu_ready_gpu_{slots,allocated_slots,pods,fenced}{pci_bus_id} and the per-node figures, served from the
    newest published map (a collector: a GPU that leaves the map loses its series at once). Every series is absent
    while podResources is off; a failed read leaves only gpu_ready_pod_resources_up 0 (and the read time)."""

    PER_GPU = (
        ("gpu_ready_gpu_slots", "Slots of the GPU (1, replicas, or MIG instances)"),
        ("gpu_ready_gpu_allocated_slots", "Slots of the GPU held by containers (pod-resources)"),
        ("gpu_ready_gpu_pods", "Pods holding a slot of the GPU (the blast radius)"),
        ("gpu_ready_gpu_fenced", "1 when the device plugin left every device of the GPU out of allocatable"),
    )
    PER_NODE = (
        ("gpu_ready_free_whole_gpus", "GPUs with every slot free and not fenced"),
        ("gpu_ready_partial_gpus", "GPUs with some but not all slots allocated"),
        ("gpu_ready_stranded_slots", "Free slots on partially used GPUs"),
        ("gpu_ready_fenced_gpus", "GPUs the device plugin left out of allocatable"),
        ("gpu_ready_packing_ratio", "GPUs in use / the fewest GPUs that could hold the used slots (1 = ideal)"),
    )

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # (enabled, map or None, read seconds or None): replaced whole by publish(), read whole by collect()
        self._state: tuple[bool, AllocationMap | None, float | None] = (False, None, None)
        if registry is not None:
            registry.register(self)

    def publish(self, amap: AllocationMap | None, *, enabled: bool, read_seconds: float | None = None) -> None:
        """`amap` None with `enabled`: the read failed (up 0, the map's series absent)."""
        self._state = (enabled, amap if enabled else None, read_seconds if enabled else None)

    def describe(self) -> list[Metric]:
        return []  # the families vary with the state; nothing to check for duplicates at registration

    def collect(self) -> Iterator[Metric]:
        enabled, amap, seconds = self._state
        if not enabled:
            return
        yield GaugeMetricFamily(
            "gpu_ready_pod_resources_up",
            "1 when the last pod-resources read worked, 0 when it failed",
            amap is not None,
        )
        if seconds is not None:
            yield GaugeMetricFamily(
                "gpu_ready_pod_resources_read_seconds", "Duration of the last pod-resources read", seconds
            )
        if amap is None:
            return
        fams = [GaugeMetricFamily(name, text, labels=["pci_bus_id"]) for name, text in self.PER_GPU]
        for g in amap.gpus:
            if g.gpu is None:
                continue  # not tied to a bus id: counted in the node figures only
            bus = [g.gpu.nvml]
            pods = len({(p.namespace, p.pod) for p in g.pods})
            for fam, value in zip(fams, (g.slots, g.allocated, pods, 1 if g.fenced else 0), strict=True):
                fam.add_metric(bus, value)
        yield from fams
        values: tuple[float | None, ...] = (
            amap.free_whole,
            amap.partial,
            amap.stranded_slots,
            amap.fenced,
            amap.packing_ratio,
        )
        for (name, text), node_value in zip(self.PER_NODE, values, strict=True):
            if node_value is not None:
                yield GaugeMetricFamily(name, text, node_value)


# -- the blast radius ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PodEvent:
    """One blast-radius Event to write (on the Node): `pod` in `namespace` holds a slot of the bad GPU."""

    namespace: str
    pod: str
    gpu: str  # the GPU's bus id (the Event's aggregation key with the pod)
    note: str

    @property
    def key(self) -> str:
        return f"{self.gpu}|{self.namespace}/{self.pod}"


def _address(g: GpuStatus) -> PciAddress | None:
    return PciAddress.parse(g.pci_bus_id)


def unhealthy_gpus(v: Verdict) -> dict[PciAddress, GpuStatus]:
    return {a: g for g in v.gpus if g.healthy is False and (a := _address(g)) is not None}


def pods_on_unhealthy(v: Verdict, amap: AllocationMap | None) -> set[tuple[str, str]]:
    """(namespace, pod) of every pod holding a slot of a GPU the verdict calls unhealthy."""
    if amap is None:
        return set()
    bad = unhealthy_gpus(v)
    return {(p.namespace, p.pod) for g in amap.gpus if g.gpu in bad for p in g.pods}


def affected_note(v: Verdict, amap: AllocationMap | None) -> str:
    """The condition message's tail: "3 pods on the affected GPUs" ("" when none or the node is not False)."""
    if v.status is not Status.FALSE:
        return ""
    n = len(pods_on_unhealthy(v, amap))
    if not n:
        return ""
    return f"{n} pod{'s' if n != 1 else ''} on the affected GPUs"


def _containers(pods: Iterable[PodRef], namespace: str, pod: str) -> list[str]:
    return sorted({p.container for p in pods if p.namespace == namespace and p.pod == pod})


def pod_event_note(g: GpuAllocation, status: GpuStatus, node: str, namespace: str, pod: str) -> str:
    where = f"GPU {status.index if status.index is not None else '?'} ({status.pci_bus_id}, {g.uuid or 'uuid unknown'})"
    problems = "; ".join(status.problems) or "unhealthy"
    containers = _containers(g.pods, namespace, pod)
    return (
        f"{where} on node {node} is unhealthy: {problems}; pod {namespace}/{pod} holds {len(containers)} slot(s) of "
        f"it (containers: {', '.join(containers)})"
    )[:1000]


class BlastRadius:
    """Which pods get an Event this cycle: each pod holding a slot of an unhealthy GPU that was not yet told during
    this bad spell of that GPU (so one Event per pod and transition; a pod that takes a slot of a GPU that is already
    bad is told once too). A GPU that recovers ends its spell. At most `limit` Events per cycle: the rest wait for the
    next cycle and are counted in `dropped` (the metric and the condition count every pod)."""

    def __init__(self, node: str, limit: int = EVENTS_PER_CYCLE) -> None:
        self.node = node
        self.limit = limit
        self.bad: set[PciAddress] = set()  # unhealthy at the last step
        self.told: set[tuple[PciAddress, str, str]] = set()  # (gpu, ns, pod) announced during this bad spell
        self.dropped = 0

    def step(self, v: Verdict, amap: AllocationMap | None) -> list[PodEvent]:
        bad = unhealthy_gpus(v)
        self.told = {t for t in self.told if t[0] in bad}  # a GPU that recovered may be announced again
        self.bad = set(bad)
        if amap is None:
            return []
        out: list[PodEvent] = []
        for g in amap.gpus:
            if g.gpu is None or g.gpu not in bad:
                continue
            for ns, pod in sorted({(p.namespace, p.pod) for p in g.pods}):
                key = (g.gpu, ns, pod)
                if key in self.told:
                    continue
                if len(out) >= self.limit:
                    self.dropped += 1
                    continue
                self.told.add(key)
                out.append(PodEvent(ns, pod, g.gpu.nvml, pod_event_note(g, bad[g.gpu], self.node, ns, pod)))
        return out


# -- `gpu-ready gpus` ---------------------------------------------------------------------------------------


def short_uuid(uuid: str) -> str:
    if not uuid:
        return "-"
    return uuid if len(uuid) <= UUID_SHORT else uuid[:UUID_SHORT] + "…"


def pod_names(g: GpuAllocation) -> list[str]:
    seen: dict[str, None] = {}
    for p in g.pods:
        seen.setdefault(f"{p.namespace}/{p.pod}", None)
    return list(seen)


def pods_cell(g: GpuAllocation, shown: int = 3) -> str:
    names = pod_names(g)
    if not names:
        return "-"
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" +{more}" if more > 0 else "")


def _health(g: GpuAllocation, health: dict[PciAddress, GpuStatus]) -> str:
    s = health.get(g.gpu) if g.gpu is not None else None
    return {True: "healthy", False: "UNHEALTHY", None: "unknown"}[s.healthy if s is not None else None]


def _remedy(g: GpuAllocation, health: dict[PciAddress, GpuStatus]) -> str:
    """What heals its fault (`reset`, `node`) and, in a recovery, the step: `reset:draining`; `-` when nothing."""
    s = health.get(g.gpu) if g.gpu is not None else None
    if s is None or s.remedy is None:
        return "-"
    return f"{s.remedy}:{s.recovery}" if s.recovery else s.remedy


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}"


HEADER = (
    f"{'INDEX':<6} {'BUS ID':<17} {'UUID':<13} {'SHARING':<9} {'SLOTS':>5} {'USED':>4} {'STATE':<8} {'HEALTH':<9} "
    f"{'REMEDY':<15} PODS"
)


def summary_line(amap: AllocationMap) -> str:
    return (
        f"Summary: {amap.free_whole} free whole GPUs, {amap.partial} partial, {amap.stranded_slots} stranded slots, "
        f"packing ratio {_ratio(amap.packing_ratio)}, {amap.fenced} fenced"
    )


RAIL_WIDTH = 14


def render_gpus(
    amap: AllocationMap, v: Verdict | None = None, rails: RailView | None = None, wide: bool = False
) -> str:
    """The `gpu-ready gpus` table: one row per physical GPU, then the summary line. With `rails` (the InfiniBand
    probe's report, on a node that has rails) a RAIL column names each GPU's NIC, `DOWN` after a rail that is."""
    health = {a: g for g in (v.gpus if v else ()) if (a := _address(g)) is not None}
    with_rail = rails is not None and bool(rails.gpu_rails)
    uuid_width = max([13, *(len(g.uuid or "") for g in amap.gpus)]) if wide else 13  # -o wide: whole UUIDs
    header = HEADER.replace(f"{'UUID':<13}", f"{'UUID':<{uuid_width}}")
    out = [header.replace(" PODS", f" {'RAIL':<{RAIL_WIDTH}} PODS") if with_rail else header]
    for g in amap.gpus:
        idx = "-" if g.index is None else str(g.index)
        bus = g.gpu.nvml if g.gpu is not None else "-"
        rail = f"{rails.rail_of(g.gpu):<{RAIL_WIDTH}} " if with_rail and rails is not None else ""
        uuid = (g.uuid or "-") if wide else short_uuid(g.uuid)
        out.append(
            f"{idx:<6} {bus:<17} {uuid:<{uuid_width}} {g.sharing:<9} {g.slots:>5} {g.allocated:>4} "
            f"{g.state:<8} {_health(g, health):<9} {_remedy(g, health):<15} {rail}{pods_cell(g)}"
        )
    if not amap.gpus:
        out.append("(no GPUs in the pod-resources view)")
    if amap.unmapped_total:
        out.append(f"({amap.unmapped_total} device IDs not tied to a GPU: {', '.join(amap.unmapped[:4])})")
    out += ["", summary_line(amap)]
    return "\n".join(out)


def gpus_json(amap: AllocationMap, v: Verdict | None = None, rails: RailView | None = None) -> dict[str, Any]:
    health = {a: g for g in (v.gpus if v else ()) if (a := _address(g)) is not None}
    out = {
        "gpus": [
            {
                "index": g.index,
                "pci_bus_id": g.gpu.nvml if g.gpu is not None else None,
                "uuid": g.uuid,
                "sharing": g.sharing,
                "slots": g.slots,
                "allocated": g.allocated,
                "state": g.state,
                "health": _health(g, health),
                **({"rail": rails.rail_of(g.gpu)} if rails is not None and rails.gpu_rails else {}),
                "remedy": (health[g.gpu].remedy if g.gpu in health else None),
                "recovery": (health[g.gpu].recovery if g.gpu in health else None),
                "pods": pod_names(g),
            }
            for g in amap.gpus
        ],
        "summary": {
            "free_whole": amap.free_whole,
            "partial": amap.partial,
            "stranded_slots": amap.stranded_slots,
            "packing_ratio": amap.packing_ratio,
            "fenced": amap.fenced,
        },
        "allocation": amap.to_json(),
    }
    return out
