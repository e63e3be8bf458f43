"""GPU inventories and pod-resources reads as the allocation tests build and inspect them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from agent.allocation import DraRef, GpuInventory, InventoryGpu, MigInstance
from agent.model import PciAddress
from agent.probes.podresources import PodResourcesRead


def inventory_from(
    gpus: Iterable[tuple[str, PciAddress | None, int | None, Sequence[str]]], dra: Iterable[DraRef] = ()
) -> GpuInventory:
    """A GpuInventory from (uuid, bus id, index, MIG UUIDs in handle-index order) tuples."""
    return GpuInventory(
        tuple(InventoryGpu(u, a, i, tuple(MigInstance(m, n) for n, m in enumerate(migs))) for u, a, i, migs in gpus),
        tuple(dra),
    )


def allocatable_counts(read: PodResourcesRead) -> dict[str, int]:
    """The pod-resources view of allocatable devices per resource name (distinct IDs kubelet reports healthy),
    e.g. {"nvidia.com/gpu": 8}: what node.status.allocatable should say, read from kubelet itself."""
    out: dict[str, set[str]] = {}
    for rd in read.allocatable:
        out.setdefault(rd.resource, set()).update(rd.ids)
    return {k: len(v) for k, v in sorted(out.items())}
