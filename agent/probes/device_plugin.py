"""What the NVIDIA device plugin advertises in the Node's capacity and allocatable, turned into the
number of physical GPUs behind it for MIG strategies none/single/mixed and for time-slicing or MPS
replicas. capacity = devices the plugin sees; capacity - allocatable = devices it marked unhealthy
(kubelet devicemanager). Sources: shared/reference/gpu-signals.md section 5."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from agent.model import Check, Finding, Reason

GPU = "nvidia.com/gpu"
GPU_SHARED = "nvidia.com/gpu.shared"
MIG_PREFIX = "nvidia.com/mig-"
STRATEGY_LABEL = "nvidia.com/mig.strategy"
REPLICAS_LABEL_SUFFIX = ".replicas"


@dataclass
class MigLayout:
    """MIG state of the node's GPUs, from nvidia-smi's MIG section or NVML."""

    mig_enabled_gpus: int = 0  # GPUs with MIG mode enabled
    gpus_with_mig_devices: int = 0
    mig_devices: int = 0
    full_gpus: int = 0  # GPUs with MIG disabled


@dataclass
class PluginCounts:
    strategy: str
    capacity: dict[str, int] = field(default_factory=dict)
    allocatable: dict[str, int] = field(default_factory=dict)
    replicas: dict[str, int] = field(default_factory=dict)
    physical: int | None = None
    physical_note: str = ""

    @property
    def total_capacity(self) -> int:
        return sum(self.capacity.values())

    @property
    def total_allocatable(self) -> int:
        return sum(self.allocatable.values())


def _quantity(v: Any) -> int:
    try:
        return int(str(v))
    except ValueError:
        return 0


def _gpu_resources(d: dict[str, Any] | None) -> dict[str, int]:
    return {k: _quantity(v) for k, v in (d or {}).items() if k in (GPU, GPU_SHARED) or k.startswith(MIG_PREFIX)}


def plugin_counts(
    node: dict[str, Any], mig: MigLayout | None, strategy: str = "auto", replicas: int | None = None
) -> PluginCounts:
    status = node.get("status") or {}
    labels = (node.get("metadata") or {}).get("labels") or {}
    cap = _gpu_resources(status.get("capacity"))
    alloc = _gpu_resources(status.get("allocatable"))
    if strategy == "auto":
        strategy = labels.get(STRATEGY_LABEL) or ("mixed" if any(k.startswith(MIG_PREFIX) for k in cap) else "none")
    reps = {}
    for res in cap:
        label = labels.get(res + REPLICAS_LABEL_SUFFIX)
        n = _quantity(label) if label is not None else (replicas or 1)
        reps[res] = max(n, 1)
    pc = PluginCounts(strategy, cap, alloc, reps)
    full = sum(cap.get(r, 0) / reps.get(r, 1) for r in (GPU, GPU_SHARED))
    if strategy == "none":
        pc.physical = math.ceil(full)
    elif strategy == "single":
        if mig and mig.gpus_with_mig_devices and mig.mig_devices:
            per_gpu = mig.mig_devices / mig.gpus_with_mig_devices
            pc.physical = math.ceil(full / per_gpu)
            pc.physical_note = f"{full:g} MIG devices / {per_gpu:g} per GPU"
        elif cap.get(GPU, 0) == 0 and cap.get(GPU_SHARED, 0) == 0:
            pc.physical = 0
        else:
            pc.physical_note = "MIG layout unknown (no MIG section from nvidia-smi or NVML)"
    else:  # mixed
        advertised_mig = sum(v / reps.get(k, 1) for k, v in cap.items() if k.startswith(MIG_PREFIX))
        if mig is None:
            pc.physical_note = "MIG layout unknown (no MIG section from nvidia-smi or NVML)"
        else:
            mig_gpus = mig.gpus_with_mig_devices
            if mig.mig_devices and advertised_mig < mig.mig_devices:
                mig_gpus = math.floor(mig.gpus_with_mig_devices * advertised_mig / mig.mig_devices)
            pc.physical = math.ceil(full) + mig_gpus
            pc.physical_note = f"{full:g} full GPUs + {mig_gpus} MIG GPUs ({advertised_mig:g} MIG devices)"
    return pc


def plugin_findings(pc: PluginCounts, grace_over: bool, grace_left_s: float) -> list[Finding]:
    out: list[Finding] = []
    if not pc.capacity or pc.total_capacity == 0:
        msg = (
            "device plugin advertises no nvidia.com/gpu or nvidia.com/mig-* resources"
            if not pc.capacity
            else "device plugin resources have capacity 0 (plugin gone for over 5 min)"
        )
        if grace_over:
            out.append(
                Finding.fault(
                    Check.DEVICE_PLUGIN,
                    Reason.DEVICE_PLUGIN_UNHEALTHY,
                    msg + ": the plugin is not serving",
                    kind="not_serving",
                )
            )
        else:
            out.append(
                Finding.unchecked(
                    Check.DEVICE_PLUGIN,
                    f"{msg}; waiting {grace_left_s:.0f}s more for the plugin to register",
                    kind="grace",
                )
            )
        return out
    unhealthy = {
        r: pc.capacity[r] - pc.allocatable.get(r, 0)
        for r in pc.capacity
        if pc.capacity[r] - pc.allocatable.get(r, 0) > 0
    }
    if unhealthy:
        detail = ", ".join(f"{r} {n} of {pc.capacity[r]}" for r, n in sorted(unhealthy.items()))
        out.append(
            Finding.fault(
                Check.DEVICE_PLUGIN,
                Reason.DEVICE_PLUGIN_UNHEALTHY,
                f"device plugin marked devices unhealthy: {detail}",
                kind="unhealthy_devices",
            )
        )
    if pc.physical is None:
        out.append(
            Finding.info(
                Check.DEVICE_PLUGIN, f"physical GPUs behind the plugin unknown: {pc.physical_note}", kind="layout"
            )
        )
    return out
