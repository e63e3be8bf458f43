"""The allocation map (agent/allocation.py) on plain data, and the pod-resources parsing around it.

Device-ID formats are those of the NVIDIA k8s-device-plugin:
- NVIDIA/k8s-device-plugin:internal/rm/devices.go@03973a9735632096f5dca01a2bd8e4bfec30a891: a device's ID is its
  NVML UUID (`GPU-...`, or `MIG-...` for a MIG device); a replica is `NewAnnotatedID` = `<id>::<replica>`.
- NVIDIA/k8s-device-plugin:internal/rm/device_map.go@0deecb2d5858f945838148d053409fbb92fc4241: replicas
  0..Replicas-1 of each shared ID (time-slicing/MPS); MIG devices visited as (GPU index i, MIG index j), their index
  `i:j`; a GPU's index `i`.
"""

from __future__ import annotations

import math

import pytest

from agent.allocation import (
    MAX_UNMAPPED,
    ClaimDevice,
    ContainerAllocation,
    DraRef,
    GpuInventory,
    PodRef,
    ResourceDevices,
    build_map,
)
from agent.model import PciAddress
from testkit.allocation import inventory_from

A, B, C, D = (PciAddress(0, b, 0) for b in (0x19, 0x3B, 0x4C, 0x5D))
UA, UB, UC, UD = (
    "GPU-8e1b4c3a-1f2d-4b7e-9a55-0d5c2f1e7a01",
    "GPU-1c7f9d20-6b3e-4a8c-b2d4-5e6f7a8b9c02",
    "GPU-a4d2e6f8-0b1c-4d3e-8f5a-6b7c8d9e0f03",
    "GPU-f0e1d2c3-b4a5-4968-8776-655443322104",
)
MB = [f"MIG-5d3c2b1a-0f9e-5d8c-a7b6-{i:012x}" for i in range(7)]
GPU = "nvidia.com/gpu"
MIG1G = "nvidia.com/mig-1g.10gb"


def pod(name: str, *ids: str, resource: str = GPU, ns: str = "ml", container: str = "main") -> ContainerAllocation:
    return ContainerAllocation(PodRef(ns, name, container), (ResourceDevices(resource, ids),))


def inv4(mig_on_b: int = 0) -> GpuInventory:
    return inventory_from([(UA, A, 0, ()), (UB, B, 1, MB[:mig_on_b]), (UC, C, 2, ()), (UD, D, 3, ())])


def test_whole_gpus_free_full_and_fenced():
    alloc = [ResourceDevices(GPU, (UA, UB, UC))]  # UD left out of allocatable: the plugin fenced it
    m = build_map([pod("train", UA), pod("eval", UB)], alloc, inv4())
    by = {g.gpu: g for g in m.gpus}
    assert [g.gpu for g in m.gpus] == [A, B, C, D]  # sorted by bus id
    assert (by[A].state, by[B].state, by[C].state, by[D].state) == ("full", "full", "free", "fenced")
    assert by[A].pods == (PodRef("ml", "train", "main"),) and by[A].sharing == "none" and by[A].slots == 1
    assert (m.free_whole, m.partial, m.stranded_slots, m.fenced) == (1, 0, 0, 1)
    assert m.packing_ratio == 1.0  # two whole GPUs used, two needed
    assert m.pods_on(A) == (PodRef("ml", "train", "main"),) and m.pods_on(C) == ()
    assert m.resources == (GPU,)


def test_time_sliced_replicas_spread_over_gpus_show_stranded_slots_and_a_packing_ratio_of_two():
    # 4 replicas per GPU (device_map.go: <uuid>::0..3); two pods on two different GPUs where one would do.
    ids = tuple(f"{u}::{r}" for u in (UA, UB) for r in range(4))
    m = build_map([pod("a", f"{UA}::0"), pod("b", f"{UB}::2")], [ResourceDevices(GPU, ids)], inv4())
    by = {g.gpu: g for g in m.gpus}
    assert by[A].sharing == "replicas" and by[A].slots == 4 and by[A].allocated == 1 and by[A].free == 3
    assert (m.partial, m.stranded_slots) == (2, 6)
    assert m.packing_ratio == 2.0  # 2 GPUs touched / ceil(2 used slots / 4 per GPU) = 2 / 1
    assert (by[C].state, by[D].state) == ("fenced", "fenced")  # no replica of theirs is allocatable
    packed = build_map([pod("a", f"{UA}::0"), pod("b", f"{UA}::2")], [ResourceDevices(GPU, ids)], inv4())
    assert packed.packing_ratio == 1.0 and packed.free_whole == 1 and packed.partial == 1


def test_replica_ids_without_the_gpu_prefix_map_to_the_gpu():
    bare = UA.removeprefix("GPU-")
    m = build_map([pod("a", f"{bare}::1")], [ResourceDevices(GPU, (f"{bare}::0", f"{bare}::1"))], inv4())
    g = m.gpus[0]
    assert (g.gpu, g.sharing, g.slots, g.allocated, m.unmapped) == (A, "replicas", 2, 1, ())


def test_mig_devices_map_to_their_parent_through_the_inventory():
    # GPU B has 7 MIG instances (NVML MIG handles 0..6); the plugin advertises them under mixed-strategy names.
    alloc = [ResourceDevices(MIG1G, tuple(MB)), ResourceDevices(GPU, (UA, UC, UD))]
    listed = [pod("m0", MB[0], resource=MIG1G), pod("m1", MB[4], resource=MIG1G, container="side")]
    m = build_map(listed, alloc, inv4(mig_on_b=7))
    b = next(g for g in m.gpus if g.gpu == B)
    assert (b.uuid, b.sharing, b.slots, b.allocated, b.state) == (UB, "mig", 7, 2, "partial")
    assert b.pods == (PodRef("ml", "m0", "main"), PodRef("ml", "m1", "side"))
    assert set(b.devices) == set(MB)
    assert (m.free_whole, m.partial, m.stranded_slots, m.packing_ratio) == (3, 1, 5, 1.0)
    assert m.resources == (GPU, MIG1G)


def test_mig_slots_count_instances_nvml_lists_even_when_one_is_not_advertised():
    m = build_map([], [ResourceDevices(MIG1G, tuple(MB[:6]))], inv4(mig_on_b=7))
    b = next(g for g in m.gpus if g.gpu == B)
    assert (b.slots, b.state) == (7, "free")


def test_index_strategy_ids_and_mig_index_ids():
    alloc = [ResourceDevices(GPU, ("0", "2", "3")), ResourceDevices(MIG1G, ("1:0", "1:1", "1:2"))]
    m = build_map([pod("a", "0"), pod("b", "1:2", resource=MIG1G)], alloc, inv4(mig_on_b=3))
    by = {g.gpu: g for g in m.gpus}
    assert by[A].state == "full" and by[B].sharing == "mig" and by[B].allocated == 1 and by[B].slots == 3
    assert m.free_whole == 2 and m.unmapped == ()


def test_index_ids_without_an_inventory_still_count_per_gpu():
    m = build_map([pod("a", "0")], [ResourceDevices(GPU, ("0", "1"))], GpuInventory())
    assert [(g.index, g.uuid, g.gpu, g.state) for g in m.gpus] == [(0, "", None, "full"), (1, "", None, "free")]


def test_unknown_ids_are_unmapped_bounded_and_other_vendors_resources_ignored():
    ids = tuple(f"MIG-unknown-{i:03d}" for i in range(MAX_UNMAPPED + 10))
    alloc = [ResourceDevices(MIG1G, ids), ResourceDevices("example.com/nic", ("eth0", "eth1"))]
    m = build_map([pod("x", "eth0", resource="example.com/nic")], alloc, inv4())
    assert len(m.unmapped) == MAX_UNMAPPED and m.unmapped_total == MAX_UNMAPPED + 10
    assert "eth0" not in m.unmapped and m.resources == (MIG1G,)
    assert m.to_json()["unmapped_total"] == MAX_UNMAPPED + 10


def test_a_gpu_uuid_missing_from_the_inventory_is_kept_without_a_bus_id():
    m = build_map([pod("a", "GPU-unknown")], [ResourceDevices(GPU, ("GPU-unknown",))], GpuInventory())
    assert [(g.uuid, g.gpu, g.state) for g in m.gpus] == [("GPU-unknown", None, "full")]


def test_dra_claim_devices_map_through_the_slices():
    dra = (
        DraRef("gpu.nvidia.com", "node-a", "gpu-0", "gpu", UA, None, A),
        DraRef("gpu.nvidia.com", "node-a", "gpu-1", "gpu", UB, None, B),
        DraRef("gpu.nvidia.com", "node-a", "gpu-2", "gpu", UC, None, C, blocked=True),
    )
    claim = ContainerAllocation(PodRef("ml", "dra", "main"), claims=(ClaimDevice("gpu.nvidia.com", "node-a", "gpu-1"),))
    stray = ContainerAllocation(PodRef("ml", "x", "main"), claims=(ClaimDevice("gpu.nvidia.com", "node-a", "gpu-9"),))
    m = build_map([claim, stray], [], GpuInventory(inventory_from([(UA, A, 0, ()), (UB, B, 1, ())]).gpus, dra))
    by = {g.gpu: g for g in m.gpus}
    assert by[B].sharing == "dra" and by[B].state == "full" and by[B].pods == (PodRef("ml", "dra", "main"),)
    assert by[A].state == "free"  # published by the DRA driver, untainted: not fenced though not allocatable
    assert by[C].state == "fenced"  # its only device carries a NoSchedule/NoExecute taint
    assert m.unmapped == ("gpu.nvidia.com/node-a/gpu-9",)


def test_packing_ratio_formula_over_groups():
    # Replicas: 4 per GPU, 5 used on 3 GPUs -> min ceil(5/4) = 2; whole: 1 used -> 1. Ratio (3 + 1) / (2 + 1).
    ids = tuple(f"{u}::{r}" for u in (UA, UB, UC) for r in range(4))
    listed = [pod("p", f"{UA}::0", f"{UA}::1", f"{UA}::2"), pod("q", f"{UB}::0"), pod("r", f"{UC}::3"), pod("w", UD)]
    m = build_map(listed, [ResourceDevices(GPU, (*ids, UD))], inv4())
    assert m.packing_ratio == round(4 / 3, 4)
    assert m.in_use == 4 and m.stranded_slots == 1 + 3 + 3
    assert math.isclose(m.packing_ratio, 4 / (math.ceil(5 / 4) + 1), rel_tol=1e-3)


def test_nothing_allocated_has_no_packing_ratio_and_json_has_every_field():
    m = build_map([], [ResourceDevices(GPU, (UA, UB, UC, UD))], inv4())
    j = m.to_json()
    assert j["packing_ratio"] is None and j["free_whole"] == 4 and j["fenced"] == 0
    assert set(j["gpus"][0]) >= {"uuid", "pci_bus_id", "sharing", "slots", "allocated", "free", "state", "pods"}
    assert j["gpus"][0]["pci_bus_id"] == "00000000:19:00.0"


def test_an_id_allocated_twice_counts_once_and_allocated_never_exceeds_slots():
    listed = [pod("a", UA, container="init"), pod("a", UA, container="main")]
    m = build_map(listed, [ResourceDevices(GPU, (UA,))], inv4())
    g = m.gpus[0]
    assert (g.allocated, g.slots, g.free, len(g.pods)) == (1, 1, 0, 2)


@pytest.mark.parametrize("bad", ["", "::", "GPU-" + "x" * 300, "0:0:0", "-1", "MIG-", "a::b"])
def test_malformed_ids_are_unmapped_never_an_error(bad):
    m = build_map([pod("a", bad)], [], inv4())
    assert all(g.allocated == 0 for g in m.gpus)


def test_linear_time_on_a_large_input():
    ids = tuple(f"{UA}::{r}" for r in range(20000))
    m = build_map([pod(f"p{i}", ids[i]) for i in range(0, 20000, 2)], [ResourceDevices(GPU, ids)], inv4())
    g = m.gpus[0]
    assert (g.slots, g.allocated) == (20000, 10000)
