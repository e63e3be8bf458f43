"""Counting NVIDIA GPUs in sysfs: vendor 0x10de, class 0x0300xx (VGA) or 0x0302xx (3D controller),
not an SR-IOV virtual function (`physfn` link) and not bound to vfio-pci. Audio, USB, UCSI and
NVSwitch functions are NVIDIA functions but not GPUs."""

from __future__ import annotations

import os
from dataclasses import dataclass

from agent.model import Check, Finding, GpuIdentity, PciAddress, ProbeResult

NVIDIA_VENDOR = 0x10DE
GPU_CLASSES = (0x0300, 0x0302)


@dataclass(frozen=True)
class PciGpu:
    address: PciAddress
    sysfs_name: str
    device_id: int
    driver: str | None


def _read_hex(path: str) -> int | None:
    """A sysfs attribute such as `0x10de`; at most 64 bytes are read (a real one is under 10). Plain `os`
    calls: no file object, no pathlib (the scan reads every PCI function's vendor each cycle)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return int(os.read(fd, 64).strip(), 16)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _driver(dev: str) -> str | None:
    try:
        return os.path.basename(os.readlink(dev + "/driver"))
    except OSError:  # no driver bound (no link)
        return None


def list_pci_gpus(sysfs_root: str = "/sys") -> list[PciGpu]:
    """Raises OSError when the PCI device directory cannot be read at all."""
    base = os.path.join(sysfs_root, "bus", "pci", "devices") + "/"
    gpus = []
    for entry in sorted(os.listdir(base)):
        dev = base + entry
        if _read_hex(dev + "/vendor") != NVIDIA_VENDOR:
            continue
        cls = _read_hex(dev + "/class")
        if cls is None or (cls >> 8) not in GPU_CLASSES:
            continue
        if os.path.exists(dev + "/physfn"):
            continue  # SR-IOV virtual function
        driver = _driver(dev)
        if driver == "vfio-pci":
            continue  # passed through to a VM: intentionally not advertised
        addr = PciAddress.parse(entry)
        if addr is None:
            continue
        gpus.append(PciGpu(addr, entry, _read_hex(dev + "/device") or 0, driver))
    return gpus


def probe_pci(sysfs_root: str = "/sys") -> ProbeResult:
    try:
        gpus = list_pci_gpus(sysfs_root)
    except OSError as e:
        why = Finding.unchecked(Check.PCI, f"cannot read PCI devices under {sysfs_root}: {e.strerror}")
        return ProbeResult(Check.PCI, (why,), ran=False)
    unbound = [g for g in gpus if g.driver is None]
    findings = tuple(Finding.info(Check.PCI, "GPU has no driver bound", g.address, kind="no_driver") for g in unbound)
    return ProbeResult(Check.PCI, findings, tuple(GpuIdentity(g.address) for g in gpus), len(gpus))
