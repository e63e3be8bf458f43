"""What the NVIDIA device plugin advertises in the Node's capacity and allocatable, turned into the
number of physical GPUs behind it for MIG strategies none/single/mixed and for time-slicing or MPS
replicas. capacity = devices the plugin sees; capacity - allocatable = devices it marked unhealthy
(kubelet devicemanager; the device plugin API, k8s.io/kubelet/pkg/apis/deviceplugin)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.model import Check, Finding, GpuIdentity, ProbeResult, Reason
from agent.settings import (
    DAY,
    RUN_ONLY,
    WITH_NODE,
    choice,
    in_range,
    non_negative,
    optional,
    setting,
    to_float,
    to_int,
)

GPU = "nvidia.com/gpu"
GPU_SHARED = "nvidia.com/gpu.shared"
MIG_PREFIX = "nvidia.com/mig-"
STRATEGY_LABEL = "nvidia.com/mig.strategy"
REPLICAS_LABEL_SUFFIX = ".replicas"


@dataclass
class MigCounts:
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
    malformed: str | None = None  # the Node could not be read as a Node: why (the counts are then empty)

    @property
    def total_capacity(self) -> int:
        return sum(self.capacity.values())

    @property
    def total_allocatable(self) -> int:
        return sum(self.allocatable.values())


class MalformedNode(ValueError):
    """The Node object does not have the shape of a Node (a string where a map belongs, a count that is not
    a whole number)."""


QUANTITY_RE = re.compile(r"(?P<n>[0-9]{1,15})(?P<suffix>k|[KMGTPE]i|[MGTPE])?")
QUANTITY_SUFFIX = {
    "": 1,
    **{s: 1000**i for i, s in enumerate("kMGTPE", 1)},
    **{s + "i": 1024**i for i, s in enumerate("KMGTPE", 1)},
}
STRATEGIES = ("none", "single", "mixed")


def parse_count(v: Any) -> int | None:
    """A whole, non-negative Kubernetes quantity (`8`, `"8"`, `"1k"`) as an int, else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v if 0 <= v < 10**18 else None
    if isinstance(v, str) and len(v) <= 20 and (m := QUANTITY_RE.fullmatch(v)):
        return int(m["n"]) * QUANTITY_SUFFIX[m["suffix"] or ""]
    return None


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number"
    )


def _object(parent: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    v = parent.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise MalformedNode(f"{where} is {_kind(v)}, not an object")
    return v


def _gpu_resources(status: dict[str, Any], key: str) -> dict[str, int]:
    out = {}
    for k, v in _object(status, key, f"status.{key}").items():
        if isinstance(k, str) and (k in (GPU, GPU_SHARED) or k.startswith(MIG_PREFIX)):
            n = parse_count(v)
            if n is None:
                raise MalformedNode(f"status.{key}[{k!r}] is {_shown(v)}, not a whole number")
            out[k] = n
    return out


def plugin_counts(
    node: Any, mig: MigCounts | None, strategy: str = "auto", replicas: int | None = None
) -> PluginCounts:
    """Counts from any JSON value: a value that is not a Node comes back with `malformed` set, never raises."""
    try:
        return _plugin_counts(node, mig, strategy, replicas)
    except MalformedNode as e:
        return PluginCounts(strategy, malformed=str(e))


def _plugin_counts(node: Any, mig: MigCounts | None, strategy: str, replicas: int | None) -> PluginCounts:
    if not isinstance(node, dict):
        raise MalformedNode(f"the Node is {_kind(node)}, not an object")
    status = _object(node, "status", "status")
    labels = _object(_object(node, "metadata", "metadata"), "labels", "metadata.labels")
    for k, v in labels.items():
        if not isinstance(v, str):
            raise MalformedNode(f"label {k!r} is {_kind(v)}, not a string")
    cap = _gpu_resources(status, "capacity")
    alloc = _gpu_resources(status, "allocatable")
    notes = []
    if strategy == "auto":
        strategy = labels.get(STRATEGY_LABEL) or ("mixed" if any(k.startswith(MIG_PREFIX) for k in cap) else "none")
    reps = {}
    for res in cap:
        label = labels.get(res + REPLICAS_LABEL_SUFFIX)
        n = parse_count(label) if label is not None else (replicas or 1)
        if n is None:
            notes.append(f"label {res + REPLICAS_LABEL_SUFFIX}={_shown(label)} is not a count")
        reps[res] = max(n or 1, 1)
    pc = PluginCounts(strategy, cap, alloc, reps)
    full = sum(cap.get(r, 0) / reps.get(r, 1) for r in (GPU, GPU_SHARED))
    if notes:
        pc.physical_note = "; ".join(notes)
    elif strategy not in STRATEGIES:
        pc.physical_note = f"unknown MIG strategy {_shown(strategy)} (label {STRATEGY_LABEL})"
    elif strategy == "none":
        pc.physical = math.ceil(full)
    elif strategy == "single":
        if mig is not None and mig.mig_enabled_gpus == 0 and mig.mig_devices == 0:
            # MIG off on every GPU: under `single` the plugin then serves whole GPUs as nvidia.com/gpu.
            pc.physical = math.ceil(full)
            pc.physical_note = "MIG disabled on every GPU: whole GPUs"
        elif mig and mig.gpus_with_mig_devices and mig.mig_devices:
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
    if pc.malformed is not None:
        return [
            Finding.unchecked(
                Check.DEVICE_PLUGIN,
                f"cannot count the device plugin's GPUs: malformed Node: {pc.malformed}",
                "malformed_node",
            )
        ]
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


def probe_device_plugin(
    node: dict[str, Any] | None,
    node_error: str | None,
    mig: MigCounts | None,
    strategy: str = "auto",
    replicas: int | None = None,
    grace_left_s: float = 0.0,
) -> ProbeResult:
    """The device-plugin check as a ProbeResult; `count` is the physical GPUs behind the plugin (None when
    unknown or nothing is advertised) and `counts` holds capacity and allocatable."""
    if node is None:
        why = Finding.unchecked(Check.DEVICE_PLUGIN, f"cannot read the Node: {node_error}", kind="node_unreadable")
        return ProbeResult(Check.DEVICE_PLUGIN, (why,), ran=False)
    pc = plugin_counts(node, mig, strategy, replicas)
    findings = tuple(plugin_findings(pc, grace_left_s <= 0, max(grace_left_s, 0.0)))
    # With nothing advertised the plugin finding says so; a "0 physical GPUs" mismatch would only repeat it.
    physical = pc.physical if pc.total_capacity else None
    counts = {"plugin_capacity": pc.total_capacity, "plugin_allocatable": pc.total_allocatable}
    return ProbeResult(Check.DEVICE_PLUGIN, findings, count=physical, counts=counts, ran=pc.malformed is None)


def mig_counts(gpus: Sequence[GpuIdentity]) -> MigCounts | None:
    """MIG state over the GPUs of one source; None when the source listed none."""
    if not gpus:
        return None
    counts = MigCounts()
    for g in gpus:
        enabled = bool(g.mig_enabled)
        counts.mig_enabled_gpus += enabled
        counts.full_gpus += not enabled
        counts.gpus_with_mig_devices += g.mig_devices > 0
        counts.mig_devices += g.mig_devices
    return counts


@dataclass(frozen=True)
class DevicePluginSettings:
    """Settings of the device-plugin check."""

    mig_strategy: str = setting(
        choice("auto", "none", "single", "mixed"),
        "auto",
        "device plugin MIG strategy (auto: from the nvidia.com/mig.strategy label)",
        commands=WITH_NODE,
    )
    replicas: int | None = setting(
        optional(in_range(to_int, 1, 1_000_000)),
        None,
        "time-slicing/MPS replicas (default: the nvidia.com/gpu.replicas label, else 1)",
        commands=WITH_NODE,
    )
    plugin_grace: float = setting(
        non_negative(to_float, DAY),
        300.0,
        "seconds after start before a missing device-plugin resource is a fault",
        commands=RUN_ONLY,
    )
