"""The NVIDIA device nodes CUDA needs: `/dev/nvidiactl`, `/dev/nvidia-uvm`, `/dev/nvidia<minor>` for every
GPU, and `/dev/nvidia-caps/` with its capability nodes when MIG is on. nvidia-smi works without
`nvidia-uvm`; every CUDA program fails (NVIDIA/gpu-operator#2685). A node that is missing or is not a
character device is a finding naming it.

The dev root is a parameter: `/dev` in a privileged pod, `/run/nvidia/driver/dev` with the driver
container, or a test directory. Symbolic links are followed (a link to a character device counts)."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.model import Check, Finding, PciAddress, ProbeResult, Reason
from agent.probes.base import ProbeContext
from agent.probes.pci import PciScanKey
from agent.probes.sysfs import READER, SysfsReader, read_bytes
from agent.settings import setting, to_bool, to_str

_GPU_NODE = re.compile(r"^nvidia(\d{1,3})$")
_MINOR = re.compile(r"^Device Minor:\s*(\d{1,3})\s*$", re.MULTILINE)
MAX_ENTRIES = 4096  # entries of the dev root looked at


@dataclass(frozen=True)
class DeviceNodeThresholds:
    """Settings of the device-node probe (docs/degradation.md)."""

    enabled: bool = setting(
        to_bool, True, "check the NVIDIA device nodes (nvidiactl, nvidia-uvm, nvidia<N>)", name="device_nodes"
    )
    dev_root: str = setting(to_str, "/dev", "where the device nodes are (/run/nvidia/driver/dev: driver container)")
    # /dev/nvidia-uvm (CUDA needs it; nvidia-smi does not)
    require_uvm: bool = setting(to_bool, True, "/dev/nvidia-uvm is required (every CUDA program needs it)")
    proc_root: str = setting(to_str, "/proc", "procfs to read GPU minor numbers from (driver/nvidia/gpus/<bdf>)")


def _char_device(path: str) -> bool | None:
    """True: a character device; False: exists but is something else; None: missing."""
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except FileNotFoundError:
        return None
    except OSError:
        return False


def read_minor_numbers(proc_root: str, gpus: Sequence[PciAddress]) -> dict[PciAddress, int]:
    """`Device Minor:` from /proc/driver/nvidia/gpus/<bdf>/information (the driver's own mapping);
    GPUs whose file is missing or unparseable are left out."""
    out: dict[PciAddress, int] = {}
    base = os.path.join(proc_root, "driver", "nvidia", "gpus")
    for g in gpus:
        path = f"{base}/{g.domain:04x}:{g.bus:02x}:{g.device:02x}.0/information"
        try:  # probes/sysfs.py: under the deadline; one that does not answer is left out like a missing one
            text = read_bytes(path, 8192).decode("utf-8", "replace")
        except OSError:
            continue
        m = _MINOR.search(text)
        if m:
            out[g] = int(m.group(1))
    return out


def device_node_findings(
    thresholds: DeviceNodeThresholds = DeviceNodeThresholds(),
    *,
    minors: dict[PciAddress, int] | None = None,
    gpu_count: int | None = None,
    mig_enabled: bool = False,
) -> list[Finding]:
    """minors: the minor number of each GPU (read_minor_numbers or NVML nvmlDeviceGetMinorNumber): its
    /dev/nvidia<minor> must exist. gpu_count: GPUs on the node; for those whose minor is not known, as many
    other /dev/nvidia<N> nodes must exist. mig_enabled: some GPU has MIG on."""
    t = thresholds
    if not t.enabled:
        return []
    root = str(Path(t.dev_root))  # plain strings below (one Path: the same names in messages)
    at = "" if root == "/" else root  # what a node's name follows
    try:
        names = []
        with os.scandir(root) as it:
            for i, entry in enumerate(it):
                if i >= MAX_ENTRIES:
                    break
                names.append(entry.name)
    except OSError as e:
        return [
            Finding.unchecked(
                Check.DEVICE_NODES, f"cannot list device nodes in {root}: {e.strerror}", kind="unavailable"
            )
        ]
    out: list[Finding] = []

    def need(name: str, gpu: PciAddress | None = None, what: str = "") -> None:
        ok = _char_device(f"{at}/{name}")
        if ok is None:
            text = f"device node {at}/{name} is missing{what}"
            out.append(Finding.fault(Check.DEVICE_NODES, Reason.GPU_DEGRADED, text, gpu, kind="missing"))
        elif not ok:
            text = f"device node {at}/{name} is not a character device{what}"
            out.append(Finding.fault(Check.DEVICE_NODES, Reason.GPU_DEGRADED, text, gpu, kind="not_char"))

    need("nvidiactl")
    if t.require_uvm:
        need("nvidia-uvm", what=" (CUDA programs fail without it)")
    for gpu, minor in sorted((minors or {}).items()):
        need(f"nvidia{minor}", gpu)
    known = set((minors or {}).values())
    unplaced = (gpu_count or 0) - len(minors or {})  # GPUs whose minor number is not known: count their nodes
    if unplaced > 0:
        present = sorted(
            n
            for name in names
            if (m := _GPU_NODE.match(name)) and (n := int(m.group(1))) not in known
            if _char_device(f"{at}/{name}")
        )
        if len(present) < unplaced:
            more = f" more (minor numbers known for {len(known)})" if known else ""
            out.append(
                Finding.fault(
                    Check.DEVICE_NODES,
                    Reason.GPU_DEGRADED,
                    f"{len(present)} GPU device nodes {root}/nvidia<N> for {unplaced} GPUs{more} "
                    f"(present: {', '.join(map(str, present)) or 'none'})",
                    kind="missing",
                )
            )
    if mig_enabled:
        caps = f"{at}/nvidia-caps"
        try:
            with os.scandir(caps) as it:
                has_cap = any(_char_device(e.path) for _, e in zip(range(MAX_ENTRIES), it, strict=False))
        except FileNotFoundError:
            has_cap = None
        except OSError:
            has_cap = False
        if not has_cap:
            state = "is missing" if has_cap is None else "holds no capability device nodes"
            out.append(
                Finding.fault(
                    Check.DEVICE_NODES,
                    Reason.GPU_DEGRADED,
                    f"device node directory {caps} {state} (MIG is on; MIG devices cannot be opened)",
                    kind="missing",
                )
            )
    return out


class DeviceNodesProbe:
    """The NVIDIA device nodes of the GPUs PCI found this cycle. The driver's minor number of each GPU is read
    again only when the PCI scan's key changed (a GPU added, removed or rebound) or the last read missed a GPU
    (the driver was still loading)."""

    check = Check.DEVICE_NODES

    def __init__(
        self, thresholds: DeviceNodeThresholds, proc_root: str = "/proc", reader: SysfsReader = READER
    ) -> None:
        self.thresholds, self.proc_root, self.reader = thresholds, proc_root, reader
        self._minors: tuple[object, dict[PciAddress, int]] = ((), {})

    def read(self, context: ProbeContext) -> ProbeResult:
        pci, scan = context.ran(Check.PCI), context.payload(Check.PCI, PciScanKey)
        on_pci = sorted(pci.addresses) if pci is not None else []
        if not on_pci:
            return ProbeResult(Check.DEVICE_NODES)
        key, minors = self._minors
        if scan is None or key != scan.key or len(minors) < len(on_pci):
            try:
                minors = self.reader.run(read_minor_numbers, self.proc_root, on_pci, what="reading the GPU minors")
            except OSError:  # Blocked: the driver's files did not answer; each GPU's node is counted instead
                minors = {}
            self._minors = (scan.key if scan is not None else (), minors)
        mig = any(g.mig_enabled for r in context.results.values() for g in r.gpus)
        findings = device_node_findings(self.thresholds, minors=minors, gpu_count=len(on_pci), mig_enabled=mig)
        return ProbeResult.of(Check.DEVICE_NODES, findings)
