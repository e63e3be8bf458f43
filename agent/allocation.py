"""Which pods sit on which GPU: the per-GPU allocation map built from kubelet's pod-resources API (docs/allocation.md).

Pure: no I/O, no imports of probes, reporters or the kube client. The probe (`agent/probes/podresources.py`)
reads `List` and `GetAllocatableResources` into the plain input dataclasses below; the check suite adds the GPU
inventory (NVML UUIDs and MIG device UUIDs, the DRA ResourceSlices when present); `build_map` ties every device
ID kubelet knows to its physical GPU.

Device IDs (the NVIDIA k8s-device-plugin, `deviceIDStrategy` uuid or index; the DRA driver for claims):

| ID | meaning | sharing |
|---|---|---|
| `GPU-<uuid>` | a whole GPU | none |
| `GPU-<uuid>::<n>` or `<uuid>::<n>` | replica n of a GPU (time-slicing or MPS) | replicas |
| `MIG-<uuid>` (also `MIG-<uuid>::<n>`) | a MIG instance; its parent through NVML's MIG handles | mig |
| `<i>`, `<i>::<n>` | GPU index i (`deviceIDStrategy: index`), replica n | none / replicas |
| `<i>:<m>` (also `<i>:<m>::<n>`) | MIG device m (NVML MIG handle index) of GPU i | mig |
| DRA claim device driver/pool/device | the DRA driver's device; its GPU by uuid, parentUUID or pciBusID | dra |

The NVIDIA device plugin gives kubelet UUID-based IDs (NVIDIA/k8s-device-plugin:internal/rm/devices.go: a device's
ID is its NVML UUID, a replica `<id>::<n>`); the index forms are accepted for plugins and configurations that
advertise indexes. Only resources named `nvidia.com/...` count (`resource_filter`).

Per GPU: `slots` = 1 for a whole GPU; the replica IDs seen (allocatable + allocated) for replicas; for MIG the
larger of the MIG slot IDs seen and the MIG instances NVML lists; for DRA the MIG devices the driver publishes for
the GPU, else 1 (never fewer than the slots allocated). `allocated` = distinct slot IDs held by containers
(at most `slots`). `fenced` = the GPU is known (NVML inventory, DRA slice or a device ID) but none of its device
IDs is allocatable (for a DRA GPU: every device it publishes carries a NoSchedule/NoExecute taint).

Per node:

    free_whole     = #GPUs with allocated == 0 and not fenced
    partial        = #GPUs not fenced with 0 < allocated < slots
    stranded_slots = sum(slots - allocated) over the partial GPUs
    in_use         = #GPUs with allocated > 0 (fenced ones included: the work is on them)
    minimum        = sum over groups g of ceil(sum(allocated of g) / slots of g), a group being the GPUs with the
                     same (sharing, slots): the fewest GPUs that could hold the used slots
    packing_ratio  = in_use / minimum, None when nothing is allocated; 1.0 = perfectly packed,
                     2.0 = twice as many GPUs touched as needed

MIG profiles of different sizes count as equal slots (an approximation; the ratio stays exact for one profile).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.model import PciAddress

NVIDIA_PREFIX = "nvidia.com/"
MAX_UNMAPPED = 32  # device IDs listed in `unmapped` (the count says how many there were)
MAX_GPUS = 256  # physical GPUs tracked; IDs that would create more are unmapped
MAX_ID_LEN = 256

SHARING_NONE, SHARING_REPLICAS, SHARING_MIG, SHARING_DRA = "none", "replicas", "mig", "dra"

_INDEX = re.compile(r"^(\d{1,4})$")
_MIG_INDEX = re.compile(r"^(\d{1,4}):(\d{1,4})$")
_REPLICA = re.compile(r"^(.+)::(\d{1,6})$")


# ---- inputs (what the probe and the inventory give) ----


@dataclass(frozen=True, order=True)
class PodRef:
    namespace: str
    pod: str
    container: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"


@dataclass(frozen=True)
class ResourceDevices:
    """The device IDs of one resource name (the proto's ContainerDevices, topology left out)."""

    resource: str
    ids: tuple[str, ...]


@dataclass(frozen=True)
class ClaimDevice:
    """One device of a DRA claim allocated to a container (the proto's ClaimResource)."""

    driver: str
    pool: str
    device: str


@dataclass(frozen=True)
class ContainerAllocation:
    """What kubelet's `List` says one container holds."""

    ref: PodRef
    devices: tuple[ResourceDevices, ...] = ()
    claims: tuple[ClaimDevice, ...] = ()


@dataclass(frozen=True)
class MigInstance:
    uuid: str  # "MIG-..."
    index: int | None = None  # the NVML MIG device handle index on the parent (the `<i>:<m>` of index IDs)


@dataclass(frozen=True)
class InventoryGpu:
    """One physical GPU as NVML (or nvidia-smi) lists it."""

    uuid: str  # "GPU-..." ("" when unknown)
    gpu: PciAddress | None
    index: int | None = None
    mig: tuple[MigInstance, ...] = ()


@dataclass(frozen=True)
class DraRef:
    """One device of the node's DRA ResourceSlices (agent.probes.dra.DraDevice, reduced to what the map needs)."""

    driver: str
    pool: str
    device: str
    type: str = ""  # gpu | mig | vfio | ""
    uuid: str | None = None
    parent_uuid: str | None = None
    pci: PciAddress | None = None
    blocked: bool = False  # a NoSchedule/NoExecute taint


@dataclass(frozen=True)
class GpuInventory:
    gpus: tuple[InventoryGpu, ...] = ()
    dra: tuple[DraRef, ...] = ()


# ---- output ----


@dataclass(frozen=True)
class GpuAllocation:
    uuid: str  # "GPU-..." as NVML/nvidia-smi give it ("" when only an index is known)
    gpu: PciAddress | None  # canonical bus id; None if it could not be mapped
    index: int | None
    sharing: str  # "none" | "replicas" | "mig" | "dra"
    slots: int  # 1, the number of replicas, or the number of MIG instances
    allocated: int  # slots held by containers
    pods: tuple[PodRef, ...]  # who holds a slot of this GPU (sorted, unique)
    devices: tuple[str, ...]  # the device IDs kubelet knows for this GPU (allocatable or allocated)
    fenced: bool  # the GPU exists but none of its devices is allocatable

    @property
    def free(self) -> int:
        return max(0, self.slots - self.allocated)

    @property
    def state(self) -> str:
        if self.fenced:
            return "fenced"
        if self.allocated <= 0:
            return "free"
        return "full" if self.allocated >= self.slots else "partial"

    @property
    def label(self) -> str:
        """How people name this GPU: its bus id, else its UUID, else its index."""
        if self.gpu is not None:
            return self.gpu.nvml
        return self.uuid or (f"index {self.index}" if self.index is not None else "?")

    def to_json(self) -> dict[str, Any]:
        return {
            "uuid": self.uuid,
            "pci_bus_id": self.gpu.nvml if self.gpu is not None else None,
            "index": self.index,
            "sharing": self.sharing,
            "slots": self.slots,
            "allocated": self.allocated,
            "free": self.free,
            "state": self.state,
            "fenced": self.fenced,
            "pods": [{"namespace": p.namespace, "pod": p.pod, "container": p.container} for p in self.pods],
            "devices": list(self.devices),
        }


@dataclass(frozen=True)
class AllocationMap:
    gpus: tuple[GpuAllocation, ...]  # one per physical GPU, sorted by bus id
    free_whole: int  # GPUs with every slot free and not fenced
    partial: int  # GPUs with some but not all slots allocated
    stranded_slots: int  # free slots on partially used GPUs
    packing_ratio: float | None  # in-use GPUs / the fewest GPUs that could hold the used slots (None: none used)
    fenced: int  # GPUs the plugin left out of allocatable
    unmapped: tuple[str, ...]  # device IDs that could not be tied to a GPU (at most MAX_UNMAPPED)
    resources: tuple[str, ...]  # resource names seen (nvidia.com/gpu, nvidia.com/mig-1g.10gb, ...)
    unmapped_total: int = 0  # every unmapped device ID, also those not listed (additive to the contract)

    @property
    def in_use(self) -> int:
        return sum(1 for g in self.gpus if g.allocated > 0)

    def pods_on(self, gpu: PciAddress) -> tuple[PodRef, ...]:
        for g in self.gpus:
            if g.gpu == gpu:
                return g.pods
        return ()

    def to_json(self) -> dict[str, Any]:
        """The `allocation` section of `gpu-ready check --json`."""
        return {
            "free_whole": self.free_whole,
            "partial": self.partial,
            "stranded_slots": self.stranded_slots,
            "packing_ratio": self.packing_ratio,
            "fenced": self.fenced,
            "in_use": self.in_use,
            "resources": list(self.resources),
            "unmapped": list(self.unmapped),
            "unmapped_total": self.unmapped_total,
            "gpus": [g.to_json() for g in self.gpus],
        }


# ---- building ----


@dataclass
class _Gpu:
    uuid: str
    gpu: PciAddress | None
    index: int | None
    mig_instances: int = 0
    dra_devices: list[DraRef] = field(default_factory=list)
    kinds: set[str] = field(default_factory=set)
    ids: dict[str, None] = field(default_factory=dict)  # every ID seen, in order
    allocatable: set[str] = field(default_factory=set)
    allocated: set[str] = field(default_factory=set)
    pods: set[PodRef] = field(default_factory=set)


class _Resolver:
    """Device ID -> (GPU, sharing kind). Lookups are dicts: linear in the IDs."""

    def __init__(self, inventory: GpuInventory) -> None:
        self.gpus: dict[str, _Gpu] = {}
        self.by_uuid: dict[str, str] = {}
        self.by_mig: dict[str, str] = {}
        self.by_index: dict[int, str] = {}
        self.by_mig_index: dict[tuple[int, int], str] = {}
        self.by_pci: dict[PciAddress, str] = {}
        self.dra: dict[tuple[str, str, str], str] = {}
        for g in inventory.gpus[:MAX_GPUS]:
            key = self._add(g.uuid, g.gpu, g.index)
            if key is None:
                continue
            e = self.gpus[key]
            e.mig_instances = max(e.mig_instances, len(g.mig))
            for m in g.mig:
                if m.uuid:
                    self.by_mig[m.uuid.lower()] = key
                if m.index is not None and g.index is not None:
                    self.by_mig_index[(g.index, m.index)] = key
        for d in inventory.dra:
            key = self._dra_gpu(d)
            if key is None:
                continue
            self.gpus[key].dra_devices.append(d)
            self.dra[(d.driver, d.pool, d.device)] = key

    def _add(self, uuid: str, gpu: PciAddress | None, index: int | None) -> str | None:
        """The key of the GPU with this uuid/bus id/index, created when new (None past MAX_GPUS)."""
        for key in (
            self.by_uuid.get(uuid.lower()) if uuid else None,
            self.by_pci.get(gpu) if gpu is not None else None,
            self.by_index.get(index) if index is not None and not uuid and gpu is None else None,
        ):
            if key is not None:
                e = self.gpus[key]
                e.uuid = e.uuid or uuid
                e.gpu = e.gpu or gpu
                e.index = e.index if e.index is not None else index
                self._index(key, e)
                return key
        if len(self.gpus) >= MAX_GPUS:
            return None
        key = uuid.lower() if uuid else (f"pci:{gpu.nvml}" if gpu is not None else f"index:{index}")
        e = _Gpu(uuid, gpu, index)
        self.gpus[key] = e
        self._index(key, e)
        return key

    def _index(self, key: str, e: _Gpu) -> None:
        if e.uuid:
            self.by_uuid.setdefault(e.uuid.lower(), key)
        if e.gpu is not None:
            self.by_pci.setdefault(e.gpu, key)
        if e.index is not None:
            self.by_index.setdefault(e.index, key)

    def _dra_gpu(self, d: DraRef) -> str | None:
        if d.type == "mig":
            if d.parent_uuid and d.parent_uuid.lower() in self.by_uuid:
                return self.by_uuid[d.parent_uuid.lower()]
            if d.uuid and d.uuid.lower() in self.by_mig:
                return self.by_mig[d.uuid.lower()]
            return self._add(d.parent_uuid or "", d.pci, None) if (d.parent_uuid or d.pci) else None
        if d.uuid or d.pci:
            return self._add(d.uuid or "", d.pci, None)
        return None

    def resolve(self, device_id: str) -> tuple[str, str] | None:
        """(GPU key, sharing kind) of a device-plugin ID, or None when it cannot be tied to a GPU."""
        if not device_id or len(device_id) > MAX_ID_LEN:
            return None
        base, replica = device_id, False
        m = _REPLICA.match(device_id)
        if m:
            base, replica = m[1], True
        whole = SHARING_REPLICAS if replica else SHARING_NONE
        low = base.lower()
        if low.startswith("mig-"):
            key = self.by_mig.get(low)
            return (key, SHARING_MIG) if key else None
        if low.startswith("gpu-"):
            key = self.by_uuid.get(low) or self._add(base, None, None)
            return (key, whole) if key else None
        if (mi := _MIG_INDEX.match(base)) is not None:
            gi = int(mi[1])
            key = self.by_mig_index.get((gi, int(mi[2]))) or self.by_index.get(gi) or self._add("", None, gi)
            return (key, SHARING_MIG) if key else None
        if (ix := _INDEX.match(base)) is not None:
            gi = int(ix[1])
            key = self.by_index.get(gi) or self._add("", None, gi)
            return (key, whole) if key else None
        if (key := self.by_uuid.get("gpu-" + low)) is not None:
            return key, whole
        if (key := self.by_mig.get("mig-" + low)) is not None:
            return key, SHARING_MIG
        return None


def _nvidia(resource: str) -> bool:
    return resource.startswith(NVIDIA_PREFIX)


def build_map(
    listed: Sequence[ContainerAllocation],
    allocatable: Sequence[ResourceDevices],
    inventory: GpuInventory,
    resource_filter: Any = _nvidia,
) -> AllocationMap:
    """The allocation map of `listed` (kubelet `List`), `allocatable` (`GetAllocatableResources`) and the node's
    GPU inventory. Only resources for which `resource_filter(name)` is true count (default: `nvidia.com/...`);
    DRA claim devices count when the DRA inventory publishes them. Linear in the input. The formulas are in the
    module docstring."""
    r = _Resolver(inventory)
    unmapped: dict[str, None] = {}
    resources: set[str] = set()

    def note(device_id: str) -> None:
        unmapped.setdefault(device_id[:MAX_ID_LEN], None)

    def placed(rd: ResourceDevices) -> Iterator[tuple[_Gpu, str]]:
        """Each device ID of a counted resource that lies on one of the node's GPUs, with that GPU's entry (its
        kind and ID noted); the others are noted as unmapped."""
        if not resource_filter(rd.resource):
            return
        resources.add(rd.resource)
        for i in rd.ids:
            hit = r.resolve(i)
            if hit is None:
                note(i)
                continue
            e = r.gpus[hit[0]]
            e.kinds.add(hit[1])
            e.ids.setdefault(i, None)
            yield e, i

    for rd in allocatable:
        for e, i in placed(rd):
            e.allocatable.add(i)
    for c in listed:
        for rd in c.devices:
            for e, i in placed(rd):
                e.allocated.add(i)
                e.pods.add(c.ref)
        for cd in c.claims:
            key = r.dra.get((cd.driver, cd.pool, cd.device))
            name = f"{cd.driver}/{cd.pool}/{cd.device}"
            if key is None:
                if inventory.dra:  # only a node with DRA slices can map claims; elsewhere they are not GPUs
                    note(name)
                continue
            e = r.gpus[key]
            e.kinds.add(SHARING_DRA)
            e.ids.setdefault(name, None)
            e.allocated.add(name)
            e.pods.add(c.ref)

    gpus = tuple(
        sorted(
            (_allocation(e) for e in r.gpus.values()),
            key=lambda g: (g.gpu is None, g.gpu or PciAddress(0, 0, 0), g.index is None, g.index or 0, g.uuid),
        )
    )
    return _summarize(gpus, tuple(sorted(unmapped))[:MAX_UNMAPPED], len(unmapped), tuple(sorted(resources)))


def _allocation(e: _Gpu) -> GpuAllocation:
    if SHARING_MIG in e.kinds or (not e.kinds and e.mig_instances and not e.dra_devices):
        sharing = SHARING_MIG
    elif SHARING_REPLICAS in e.kinds:
        sharing = SHARING_REPLICAS
    elif SHARING_DRA in e.kinds or (not e.kinds and e.dra_devices):
        sharing = SHARING_DRA
    else:
        sharing = SHARING_NONE
    plugin_ids = [i for i in e.ids if "/" not in i]  # DRA claim devices are driver/pool/device
    if sharing == SHARING_MIG:
        slots = max(len(plugin_ids), e.mig_instances)
    elif sharing == SHARING_DRA:
        migs = sum(1 for d in e.dra_devices if d.type == "mig")
        slots = migs or 1
    else:
        slots = len(plugin_ids)
    allocated = len(e.allocated)
    slots = max(1, slots, allocated)
    fenced = not e.allocatable and all(d.blocked for d in e.dra_devices)  # all() of no DRA devices is True
    return GpuAllocation(
        uuid=e.uuid,
        gpu=e.gpu,
        index=e.index,
        sharing=sharing,
        slots=slots,
        allocated=allocated,
        pods=tuple(sorted(e.pods)),
        devices=tuple(e.ids),
        fenced=fenced,
    )


def _summarize(
    gpus: tuple[GpuAllocation, ...], unmapped: tuple[str, ...], unmapped_total: int, resources: tuple[str, ...]
) -> AllocationMap:
    states = [g.state for g in gpus]
    used = [g for g in gpus if g.allocated > 0]
    groups: dict[tuple[str, int], int] = {}
    for g in used:
        groups[(g.sharing, g.slots)] = groups.get((g.sharing, g.slots), 0) + g.allocated
    minimum = sum(-(-n // slots) for (_, slots), n in groups.items())
    return AllocationMap(
        gpus=gpus,
        free_whole=states.count("free"),
        partial=states.count("partial"),
        stranded_slots=sum(g.free for g in gpus if g.state == "partial"),
        packing_ratio=round(len(used) / minimum, 4) if minimum else None,
        fenced=states.count("fenced"),
        unmapped=unmapped,
        resources=resources,
        unmapped_total=unmapped_total,
    )
