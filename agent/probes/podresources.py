"""kubelet's pod-resources API: which container holds which device, and which devices are allocatable.

Reads `v1.PodResourcesLister/List` and `GetAllocatableResources` over the unix socket (default
DEFAULT_SOCKET; mount the directory, kubelet re-creates the socket on restart) with the small gRPC client in
grpc_unix.py, never more often than `min_interval` (kubelet rate-limits the endpoint: a read inside the interval
returns the previous one), each call under a deadline. The answer becomes plain data (agent/allocation.py's
inputs), bounded: at most MAX_PODS pods, MAX_CONTAINERS containers per pod, MAX_IDS device IDs in all; what was
cut is said in an INFO finding.

A socket that is missing or refuses, or an RPC error, is an INFO finding and no read (`allocation` None): the
allocation map is a view, never a readiness signal, so it can neither fault the node nor hide another check.

The GPU inventory the map needs (UUID -> bus id, MIG UUID -> parent) comes from NVML (`gpu_inventory`) or, when
NVML did not give UUIDs, from `nvidia-smi -L` joined to nvidia-smi's index -> bus id (`parse_smi_list`).

The protobuf messages (agent/proto/podresources_v1_pb2.py) and h2 are imported on the first read only."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.allocation import (
    AllocationMap,
    ClaimDevice,
    ContainerAllocation,
    DraRef,
    GpuInventory,
    InventoryGpu,
    MigInstance,
    PodRef,
    ResourceDevices,
)
from agent.kube.grpc_unix import GrpcError, unary_call
from agent.model import Check, Finding, PciAddress, ProbeResult
from agent.probes.base import ProbeContext
from agent.probes.shared import Shared
from agent.settings import DAY, RUN_ONLY, WITH_NODE, absolute_path, positive, setting, to_bool, to_float

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
LIST = "/v1.PodResourcesLister/List"
ALLOCATABLE = "/v1.PodResourcesLister/GetAllocatableResources"
MAX_PODS = 2048
MAX_CONTAINERS = 64  # per pod
MAX_IDS = 16384  # device IDs (plugin IDs and DRA claim devices) in all, allocated and allocatable together
MAX_NAME = 256
CHECK = Check.POD_RESOURCES  # kubelet pod-resources: INFO findings only, never readiness

Call = Callable[[str, str, bytes, float], bytes]


@dataclass(frozen=True)
class PodResourcesRead:
    """One read of both calls, as plain data."""

    listed: tuple[ContainerAllocation, ...] = ()
    allocatable: tuple[ResourceDevices, ...] = ()
    pods: int = 0
    truncated: tuple[str, ...] = ()  # what the bounds cut, for people
    at: float = 0.0  # monotonic time of the read


@dataclass
class _Budget:
    """The device IDs still to be taken (`limit` in all) and what the bounds cut."""

    limit: int
    cut: list[str] = field(default_factory=list)
    taken: int = 0

    def take(self, ids: Sequence[str]) -> tuple[str, ...]:
        if self.taken + len(ids) > self.limit:
            if self.taken <= self.limit:  # said once
                self.cut.append(f"more than {self.limit} device IDs, the rest not read")
            ids = ids[: max(0, self.limit - self.taken)]
            self.taken = self.limit + 1
            return tuple(i[:MAX_NAME] for i in ids)
        self.taken += len(ids)
        return tuple(i[:MAX_NAME] for i in ids)


def _str(v: Any) -> str:
    return str(v)[:MAX_NAME]


def parse_list(msg: Any, budget: _Budget) -> tuple[tuple[ContainerAllocation, ...], int]:
    """ListPodResourcesResponse -> containers that hold devices (plugin IDs or DRA claim devices)."""
    out: list[ContainerAllocation] = []
    pods = msg.pod_resources
    if len(pods) > MAX_PODS:
        budget.cut.append(f"{len(pods)} pods, only the first {MAX_PODS} read")
    for pod in pods[:MAX_PODS]:
        containers = pod.containers
        if len(containers) > MAX_CONTAINERS:
            budget.cut.append(f"pod {_str(pod.namespace)}/{_str(pod.name)}: {len(containers)} containers")
        for c in containers[:MAX_CONTAINERS]:
            devices = tuple(
                ResourceDevices(_str(d.resource_name), budget.take(d.device_ids)) for d in c.devices if d.device_ids
            )
            claims: list[ClaimDevice] = []
            for dr in c.dynamic_resources:
                for cr in dr.claim_resources:
                    if budget.take((cr.device_name,)):
                        claims.append(ClaimDevice(_str(cr.driver_name), _str(cr.pool_name), _str(cr.device_name)))
            if devices or claims:
                ref = PodRef(_str(pod.namespace), _str(pod.name), _str(c.name))
                out.append(ContainerAllocation(ref, devices, tuple(claims)))
    return tuple(out), min(len(pods), MAX_PODS)


def parse_allocatable(msg: Any, budget: _Budget) -> tuple[ResourceDevices, ...]:
    """AllocatableResourcesResponse -> device IDs per resource name (several entries per name are merged)."""
    merged: dict[str, list[str]] = {}
    for d in msg.devices:
        merged.setdefault(_str(d.resource_name), []).extend(budget.take(d.device_ids))
    return tuple(ResourceDevices(k, tuple(v)) for k, v in merged.items())


class PodResourcesReader:
    """Reads pod-resources at most once per `min_interval` seconds (a call inside it returns the last read)."""

    def __init__(
        self,
        socket_path: str = DEFAULT_SOCKET,
        timeout: float = 5.0,
        min_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        call: Call | None = None,
    ) -> None:
        self.socket_path, self.timeout, self.min_interval = socket_path, timeout, min_interval
        self.clock = clock
        self._call = call
        self.last: PodResourcesRead | None = None
        self.last_findings: tuple[Finding, ...] = ()
        self._last_at: float | None = None
        self.reads = 0  # RPC rounds made (for tests and metrics)

    def read(self) -> tuple[PodResourcesRead | None, tuple[Finding, ...]]:
        now = self.clock()
        if self._last_at is not None and now - self._last_at < self.min_interval:
            return self.last, self.last_findings
        self._last_at = now
        self.reads += 1
        self.last, self.last_findings = self._read(now)
        return self.last, self.last_findings

    def _read(self, now: float) -> tuple[PodResourcesRead | None, tuple[Finding, ...]]:
        from agent.proto import podresources_v1_pb2 as pb

        call = self._call or unary_call
        try:
            raw_list = call(self.socket_path, LIST, pb.ListPodResourcesRequest().SerializeToString(), self.timeout)
            raw_alloc = call(
                self.socket_path, ALLOCATABLE, pb.AllocatableResourcesRequest().SerializeToString(), self.timeout
            )
        except GrpcError as e:
            return None, (Finding.info(CHECK, f"pod-resources not read: {e}", kind="pod_resources_unreadable"),)
        try:
            listed_msg = pb.ListPodResourcesResponse.FromString(raw_list)
            alloc_msg = pb.AllocatableResourcesResponse.FromString(raw_alloc)
        except Exception as e:  # google.protobuf.message.DecodeError; imported lazily
            why = f"pod-resources answer is not valid protobuf: {e}"
            return None, (Finding.info(CHECK, why, kind="pod_resources_unreadable"),)
        budget = _Budget(MAX_IDS)
        listed, pods = parse_list(listed_msg, budget)
        allocatable = parse_allocatable(alloc_msg, budget)
        cut = tuple(budget.cut)
        findings: tuple[Finding, ...] = ()
        if cut:
            findings = (
                Finding.info(CHECK, f"pod-resources truncated: {'; '.join(cut)}", kind="pod_resources_truncated"),
            )
        return PodResourcesRead(listed, allocatable, pods, cut, now), findings


# ---- the GPU inventory ----


def gpu_inventory(
    nvml_gpus: Iterable[Any],
    smi_list: Sequence[InventoryGpu] = (),
    dra: Iterable[DraRef] = (),
) -> GpuInventory:
    """The map's GPU inventory: NVML GPUs (objects with index, address, uuid and mig_uuids, as
    agent.probes.nvml.NvmlGpu) that have a UUID; else the `nvidia-smi -L` GPUs (`parse_smi_list`)."""
    gpus = [
        InventoryGpu(g.uuid, g.address, g.index, tuple(MigInstance(u, k) for k, u in g.mig_uuids))
        for g in nvml_gpus
        if getattr(g, "uuid", None)
    ]
    return GpuInventory(tuple(gpus) if gpus else tuple(smi_list), tuple(dra))


def dra_refs(devices: Iterable[Any]) -> tuple[DraRef, ...]:
    """agent.probes.dra.DraDevice -> DraRef (typed loosely so this module needs no DRA import)."""
    return tuple(
        DraRef(d.driver, d.pool, d.name, d.type, d.uuid, d.parent_uuid, d.pci, bool(d.blocking_taints)) for d in devices
    )


_SMI_GPU = re.compile(r"^GPU (\d{1,4}): .{0,200}\(UUID: (GPU-[0-9A-Za-z-]{1,64})\)\s*$")
_SMI_MIG = re.compile(r"^\s+MIG .{0,80}Device\s+(\d{1,4}): \(UUID: (MIG-[0-9A-Za-z/-]{1,96})\)\s*$")
MAX_SMI_LIST = 256 * 1024


def parse_smi_list(text: str, buses: Mapping[int, PciAddress]) -> tuple[InventoryGpu, ...]:
    """`nvidia-smi -L` -> GPUs with their MIG devices; `buses` maps nvidia-smi's index to the bus id (from the
    nvidia-smi table of the same poll). Linear, bounded to MAX_SMI_LIST characters; other lines are skipped."""
    gpus: list[InventoryGpu] = []
    for line in text[:MAX_SMI_LIST].splitlines():
        if (m := _SMI_GPU.match(line)) is not None:
            i = int(m[1])
            gpus.append(InventoryGpu(m[2], buses.get(i), i))
        elif (m := _SMI_MIG.match(line)) is not None and gpus:
            g = gpus[-1]
            gpus[-1] = InventoryGpu(g.uuid, g.gpu, g.index, (*g.mig, MigInstance(m[2], int(m[1]))))
    return tuple(gpus)


SMI_LIST_REFRESH_S = 300.0  # `nvidia-smi -L` again at most this often while device IDs stay unplaced


class AllocationProbe:
    """kubelet's pod-resources: which pods hold which GPU (the allocation map, agent/allocation.py), one read at
    most every podResourcesInterval. Its findings are INFO only: an unreadable socket gives no map and never
    changes readiness. The payload is the map (None when unreadable)."""

    check = Check.POD_RESOURCES

    def __init__(self, reader: PodResourcesReader, shared: Shared) -> None:
        self.reader, self.shared = reader, shared
        self.allocation: AllocationMap | None = None
        self._smi_list: tuple[InventoryGpu, ...] = ()  # `nvidia-smi -L` GPUs (when NVML gives no UUIDs)
        self._smi_list_key: tuple[tuple[int, PciAddress], ...] = ()
        self._smi_list_at = 0.0

    def read(self, context: ProbeContext) -> ProbeResult:
        from agent.allocation import build_map
        from agent.probes.dra import DraInventory
        from agent.probes.nvml import NvmlSnapshot

        read, findings = self.reader.read()
        if read is None:
            self.allocation = None
            return ProbeResult(Check.POD_RESOURCES, findings)
        snap = context.payload(Check.NVML, NvmlSnapshot)
        inventory = context.payload(Check.DEVICE_PLUGIN, DraInventory)
        dra = dra_refs(inventory.devices) if inventory is not None else ()
        smi = context.results.get(Check.NVIDIA_SMI)
        gpus = gpu_inventory(
            snap.gpus if snap is not None else (), self._smi_inventory(snap, smi, context.now), dra=dra
        )
        self.allocation = build_map(read.listed, read.allocatable, gpus)
        return ProbeResult(Check.POD_RESOURCES, findings, payload=self.allocation)

    def _smi_inventory(self, snap: Any, smi: ProbeResult | None, now: float) -> tuple[InventoryGpu, ...]:
        """The GPUs with their UUIDs from `nvidia-smi -L` when NVML gave none (NVML off or not loadable), joined
        by index to the bus ids of this poll's nvidia-smi table. UUIDs do not change while the GPUs stay, so `-L`
        runs again only when nvidia-smi's GPUs change, or at most every SMI_LIST_REFRESH_S while the map has
        device IDs it cannot place (a MIG layout was changed)."""
        if (snap is not None and any(getattr(g, "uuid", None) for g in snap.gpus)) or smi is None or not smi.ran:
            return ()
        key = tuple(sorted((g.index, g.address) for g in smi.gpus if g.index is not None))
        if not key:
            return ()
        unplaced = self.allocation is not None and bool(self.allocation.unmapped)
        if key != self._smi_list_key or (unplaced and now - self._smi_list_at >= SMI_LIST_REFRESH_S):
            run = self.shared.smi.run(("-L",))
            self._smi_list_key, self._smi_list_at = key, now
            ok = run.exit_code == 0 and not run.output_capped
            self._smi_list = parse_smi_list(run.output, dict(key)) if ok else ()
        return self._smi_list


@dataclass(frozen=True)
class PodResourcesSettings:
    """Settings of the pod-resources reader (the allocation map)."""

    # `gpus` always reads it
    pod_resources: bool = setting(
        to_bool,
        False,
        "read kubelet's pod-resources API each poll: which pods hold which GPU (docs/allocation.md)",
        commands=WITH_NODE,
    )
    pod_resources_socket: str = setting(
        absolute_path,
        DEFAULT_SOCKET,
        "kubelet's pod-resources socket (mount its directory: kubelet re-creates the socket)",
    )
    pod_resources_interval: float = setting(
        positive(to_float, DAY),
        1.0,
        "read pod-resources at most this often, seconds (kubelet rate-limits the endpoint)",
        commands=RUN_ONLY,
    )
    pod_resources_timeout: float = setting(positive(to_float, 600), 5.0, "timeout for one pod-resources call, seconds")
