"""The vocabulary shared by probes, the verdict and the reporters. No I/O here."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache
from typing import Any

_ADDR = re.compile(
    r"^(?:PCI:)?(?:(?P<domain>[0-9A-Fa-f]{1,8}):)?(?P<bus>[0-9A-Fa-f]{1,2}):(?P<device>[0-9A-Fa-f]{1,2})"
    r"(?:\.(?P<function>[0-7]))?$"
)


@dataclass(frozen=True, order=True)
class PciAddress:
    """One GPU identity. Xid `0000:3b:00`, nvidia-smi/NVML `00000000:3B:00.0` and sysfs
    `0000:3b:00.0` all parse to the same value; GPUs are function 0, so the function is dropped."""

    domain: int
    bus: int
    device: int

    @classmethod
    def parse(cls, text: str) -> PciAddress | None:
        return _parse_address(text)

    @property
    def nvml(self) -> str:
        """NVML's and nvidia-smi's form, `00000000:3B:00.0`."""
        return f"{self.domain:08X}:{self.bus:02X}:{self.device:02X}.0"

    @property
    def kernel(self) -> str:
        """The kernel's Xid form, `0000:3b:00`."""
        return f"{self.domain:04x}:{self.bus:02x}:{self.device:02x}"

    def __str__(self) -> str:
        return self.nvml


@lru_cache(maxsize=4096)
def _parse_address(text: str) -> PciAddress | None:
    m = _ADDR.match(text.strip())
    if not m:
        return None
    return PciAddress(int(m["domain"] or "0", 16), int(m["bus"], 16), int(m["device"], 16))


TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")  # the API accepts no others: a bounded label set


class Status(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Reason(StrEnum):
    """The condition reasons, an API for alerts and remediation. Declaration order is priority."""

    GPU_RECOVERY_FAILED = "GPURecoveryFailed"  # a GPU's reset, its proof or its retry budget failed (recovery)
    GPU_RESET_REFUSED = "GPUResetRefused"  # a GPU's reset was refused (in use) until the drain timeout (recovery)
    FATAL_XID = "FatalXid"
    NVIDIA_SMI_FAILED = "NvidiaSmiFailed"
    NVML_HEALTH = "NvmlHealth"
    NVIDIA_SMI_ERR = "NvidiaSmiErr"
    GPU_COUNT_MISMATCH = "GPUCountMismatch"
    DEVICE_PLUGIN_UNHEALTHY = "DevicePluginUnhealthy"
    MIG_CONFIG_FAILED = "MigConfigFailed"  # mig-manager's plan failed, is stuck pending, or is not what exists
    FABRIC_NOT_READY = "FabricNotReady"  # the NVLink fabric is not trained or its manager is down: CUDA cannot start
    GPU_DEGRADED = "GPUDegraded"  # the GPU works but slower or half-usable; below the hard faults
    PREFLIGHT_NOT_PASSED = "PreflightNotPassed"
    CHECK_FAILED = "CheckFailed"
    GPUS_HEALTHY = "GPUsHealthy"


FAULT_REASONS: tuple[Reason, ...] = tuple(r for r in Reason if r not in (Reason.CHECK_FAILED, Reason.GPUS_HEALTHY))


class Check(StrEnum):
    NVIDIA_SMI = "nvidia_smi"
    PCI = "pci"
    DEVICE_PLUGIN = "device_plugin"
    NVML = "nvml"
    XID = "xid"
    PCIE = "pcie"
    DEVICE_NODES = "device_nodes"
    CLOCKS = "clocks"
    XID_RATE = "xid_rate"
    DCGM = "dcgm"
    POD_RESOURCES = "pod_resources"  # kubelet pod-resources (the allocation map; INFO only)
    INFINIBAND = "infiniband"  # the InfiniBand/RoCE rails (agent/probes/infiniband.py)
    MIG_LAYOUT = "mig_layout"  # nvidia.com/mig.config against the MIG instances (agent/mig_layout.py)
    FABRIC = "fabric"  # the NVLink fabric each GPU reports (agent/probes/fabric.py)
    FABRIC_MANAGER = "fabric_manager"  # the fabric manager on NVSwitch systems (agent/probes/fabric_manager.py)
    IMEX = "imex"  # the IMEX daemon's readiness, opt-in (agent/probes/imex.py)


class Severity(StrEnum):
    FAULT = "fault"  # makes the node not ready (with the finding's reason)
    UNCHECKED = "unchecked"  # the source could not be read: never True, at most Unknown
    INFO = "info"  # reported, does not change readiness


@dataclass(frozen=True)
class Finding:
    """What one check saw. Probes only produce findings; the verdict decides."""

    check: Check
    severity: Severity
    message: str
    reason: Reason | None = None  # for FAULT findings
    gpu: PciAddress | None = None
    kind: str = ""  # machine-readable sub-kind, e.g. "timeout", "exit_code", "err_field"

    @classmethod
    def fault(
        cls, check: Check, reason: Reason, message: str, gpu: PciAddress | None = None, kind: str = ""
    ) -> Finding:
        return cls(check, Severity.FAULT, message, reason, gpu, kind)

    @classmethod
    def unchecked(cls, check: Check, message: str, kind: str = "unavailable") -> Finding:
        return cls(check, Severity.UNCHECKED, message, None, None, kind)

    @classmethod
    def info(cls, check: Check, message: str, gpu: PciAddress | None = None, kind: str = "") -> Finding:
        return cls(check, Severity.INFO, message, None, gpu, kind)


@dataclass(frozen=True)
class GpuIdentity:
    address: PciAddress
    index: int | None = None
    name: str | None = None
    mig_enabled: bool | None = None  # None: the source does not say
    mig_devices: int = 0


def gpu_label(addr: PciAddress | None, gpus: Mapping[PciAddress, GpuIdentity]) -> str:
    """How a message names a GPU: `GPU 3 (0000:3b:00.0)` when its index is known; "node" for no GPU."""
    if addr is None:
        return "node"
    ident = gpus.get(addr)
    if ident is not None and ident.index is not None:
        return f"GPU {ident.index} ({addr.nvml})"
    return f"GPU {addr.nvml}"


@dataclass(frozen=True)
class ProbeResult:
    """What every probe returns: findings plus what it counted. `ran` False means the source could not
    be read (a finding says why) and `count` is then None; callers never inspect finding kinds."""

    check: Check
    findings: tuple[Finding, ...] = ()
    gpus: tuple[GpuIdentity, ...] = ()  # every GPU the source listed; a duplicated address appears twice
    count: int | None = None  # GPUs this source counts; None when it could not count
    ran: bool = True
    timed_out: bool = False
    counts: Mapping[str, int | None] = field(default_factory=dict)  # named counts (`Counts` fields among them)
    inventory: bool = False  # `gpus` is an inventory the verdict compares across sources (nvidia-smi, PCI)
    # What the source read beyond findings, for the probes after it in the same cycle and for the actions (NVML's
    # per-GPU samples, the DRA inventory, the allocation map). The verdict never looks at it.
    payload: Any = field(default=None, compare=False)

    @classmethod
    def of(cls, check: Check, findings: Iterable[Finding] = (), **kw: Any) -> ProbeResult:
        """A result whose `ran` follows its findings: False when one says the source could not be read."""
        fs = tuple(findings)
        return cls(check, fs, ran=not any(f.severity is Severity.UNCHECKED for f in fs), **kw)

    @property
    def addresses(self) -> frozenset[PciAddress]:
        return frozenset(g.address for g in self.gpus)


@dataclass
class Counts:
    pci: int | None = None
    nvidia_smi: int | None = None
    plugin_capacity: int | None = None
    plugin_allocatable: int | None = None
    plugin_physical: int | None = None
    dra: int | None = None  # GPUs the node's DRA ResourceSlices publish (None: not a DRA node, or not read)

    def as_dict(self) -> dict[str, int | None]:
        """Every count (None: the source could not count); `dra` only on a DRA node."""
        out = dict(vars(self))
        if out["dra"] is None:
            del out["dra"]
        return out


@dataclass(slots=True)
class XidEvent:
    """One GPU error from the kernel log: an Xid, an NVSwitch SXid, or a fallen-off-the-bus message."""

    xid: int
    address: PciAddress | None  # the GPU (None for SXid, whose address is an NVSwitch)
    raw_address: str
    fatal: bool
    text: str
    source: str = "xid"  # "xid" | "sxid" | "fallen_off_bus"
    name: str = ""
    action: str = ""
    seq: int | None = None
    usec: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "xid": self.xid,
            "source": self.source,
            "pci_bus_id": self.raw_address,
            "fatal": self.fatal,
            "name": self.name,
            "action": self.action,
            "text": self.text,
        }


@dataclass
class Observation:
    """Everything one check cycle saw; the input of the verdict."""

    findings: list[Finding] = field(default_factory=list)
    gpus: dict[PciAddress, GpuIdentity] = field(default_factory=dict)
    counts: Counts = field(default_factory=Counts)
    expected_gpus: int | None = None
    xids: list[XidEvent] = field(default_factory=list)  # seen this boot (fatal and not)
    seen: dict[Check, frozenset[PciAddress]] = field(default_factory=dict)  # addresses per source that ran


@dataclass(frozen=True)
class GpuStatus:
    index: int | None
    pci_bus_id: str
    name: str | None
    healthy: bool | None
    problems: tuple[str, ...] = ()  # "<Reason>: <text>", for people
    reasons: tuple[Reason, ...] = ()  # the reasons of `problems`, each once, in priority order (for reporters)
    unchecked: tuple[Check, ...] = ()  # sources that could not check this GPU this cycle
    remedy: str | None = None  # what heals its faults (act/recovery/ladder.py): "reset", "node"; None: none
    recovery: str | None = None  # its recovery ladder's step ("draining", "escalated", ...); None: none

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "pci_bus_id": self.pci_bus_id,
            "name": self.name,
            "healthy": self.healthy,
            "problems": list(self.problems),
            "reasons": [r.value for r in self.reasons],
            "unchecked": [c.value for c in self.unchecked],
            "remedy": self.remedy,
            "recovery": self.recovery,
        }


@dataclass(frozen=True)
class Verdict:
    status: Status
    reason: Reason
    message: str
    gpus: tuple[GpuStatus, ...] = ()
    reasons: tuple[Reason, ...] = ()  # every reason that applied, in priority order
    counts: Counts = field(default_factory=Counts)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.status.value, self.reason.value, self.message)


@dataclass(frozen=True)
class LatchedFault:
    """A fatal kernel-log event that keeps the node not ready until reboot or a manual clear."""

    xid: int
    raw_address: str
    gpu: PciAddress | None
    source: str
    text: str
    since: float  # wall-clock seconds when first seen
    action: str = ""  # the catalog's immediate action for it (XidEvent.action; "" in state files written before)

    @property
    def key(self) -> str:
        """One fault per Xid number and GPU: an Xid 79 line and the "GPU has fallen off the bus"
        line that follows it for the same GPU are one fault."""
        if self.source == "sxid" or self.gpu is None:
            return f"{self.source}:{self.xid}:{self.raw_address}"
        return f"gpu:{self.xid}:{self.gpu.nvml}"
