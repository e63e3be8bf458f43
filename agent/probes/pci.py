"""Counting NVIDIA GPUs in sysfs: vendor 0x10de, class 0x0300xx (VGA) or 0x0302xx (3D controller),
not an SR-IOV virtual function (`physfn` link) and not bound to vfio-pci. Audio, USB, UCSI and
NVSwitch functions are NVIDIA functions but not GPUs."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from agent.model import Check, Finding, GpuIdentity, PciAddress, ProbeResult
from agent.probes.base import ProbeContext
from agent.probes.bounded import Blocked
from agent.probes.sysfs import READER, SysfsReader, read_bytes
from agent.settings import setting, to_str

NVIDIA_VENDOR = 0x10DE
GPU_CLASSES = (0x0300, 0x0302)


@dataclass(frozen=True)
class PciGpu:
    address: PciAddress
    sysfs_name: str
    device_id: int
    driver: str | None


def _read_hex(path: str) -> int | None:
    """A sysfs attribute such as `0x10de` (probes/sysfs.py: at most 64 bytes, a real one is under 10); None when it
    cannot be read or parsed. A read that does not answer raises Blocked: the scan is then "could not check"."""
    try:
        return int(read_bytes(path).strip(), 16)
    except Blocked:
        raise
    except (OSError, ValueError):
        return None


def _driver(dev: str) -> str | None:
    try:
        return os.path.basename(os.readlink(dev + "/driver"))
    except OSError:  # no driver bound (no link)
        return None


UNREAD = "unread"  # an identity attribute could not be read: not kept, read again on the next scan


def _identity(dev: str, entry: str) -> tuple[PciAddress, int] | str | None:
    """(address, device id) when the function is an NVIDIA GPU that is not an SR-IOV virtual function; None when
    it is something else; UNREAD when vendor or class could not be read (a function being removed).
    Vendor, class and device id are the kernel's copies from enumeration (not live config reads), and a VF's
    `physfn` link is made with it, so none of these changes while the function exists."""
    vendor = _read_hex(dev + "/vendor")
    if vendor != NVIDIA_VENDOR:
        return UNREAD if vendor is None else None
    cls = _read_hex(dev + "/class")
    if cls is None:
        return UNREAD
    if (cls >> 8) not in GPU_CLASSES:
        return None
    if os.path.exists(dev + "/physfn"):
        return None  # SR-IOV virtual function
    addr = PciAddress.parse(entry)
    if addr is None:
        return None
    return addr, _read_hex(dev + "/device") or 0


class PciScanner:
    """The GPU scan, keeping what never changes while a PCI function exists (whether it is an NVIDIA GPU, its
    device id) between scans: a function is read again only when its entry is new or was removed and added
    again (another inode). Each scan lists the directory (one getdents) and reads the bound driver of each GPU
    (it changes on unbind or a vfio bind); on a 202-function node that is 9 system calls instead of ~420.
    `key` names the functions of the last scan with their inodes and drivers: it changes when anything the
    scan saw changed, for the caches built on it (PCIe link paths in probes/pcie.py, device minors in
    probes/device_nodes.py)."""

    def __init__(self, sysfs_root: str = "/sys", reader: SysfsReader = READER) -> None:
        self.base = os.path.join(sysfs_root, "bus", "pci", "devices") + "/"
        self.reader = reader
        self._known: dict[str, tuple[int, tuple[PciAddress, int] | str | None]] = {}
        self.key: tuple[tuple[str, int, str | None], ...] = ()

    def scan(self) -> list[PciGpu]:
        """Raises OSError when the PCI device directory cannot be read at all, Blocked when a new function's files do
        not answer within the deadline (probes/sysfs.py: they are read on its worker, in one hand-off; a scan with
        no new function reads no file, only the listing and the driver links)."""
        with os.scandir(self.base) as it:
            entries = sorted((e.name, e.inode()) for e in it)
        known = self._known
        new = [e for e, ino in entries if (got := known.get(e)) is None or got[0] != ino]
        read = self.reader.run(self._identities, new, what="reading the new PCI functions") if new else {}
        fresh, gpus, key = {}, [], []
        for entry, ino in entries:
            got = known.get(entry)
            ident = got[1] if got is not None and got[0] == ino else read[entry]
            if ident is UNREAD:
                continue  # counted as before (not a GPU this scan), not kept: read again next scan
            fresh[entry] = (ino, ident)
            if not isinstance(ident, tuple):
                continue
            driver = _driver(self.base + entry)
            key.append((entry, ino, driver))
            if driver == "vfio-pci":
                continue  # passed through to a VM: intentionally not advertised
            gpus.append(PciGpu(ident[0], entry, ident[1], driver))
        self._known, self.key = fresh, tuple(key)
        return gpus

    def _identities(self, entries: list[str]) -> dict[str, tuple[PciAddress, int] | str | None]:
        return {e: _identity(self.base + e, e) for e in entries}


def list_pci_gpus(sysfs_root: str = "/sys") -> list[PciGpu]:
    """One scan from nothing (PciScanner keeps what it read for the next). Raises OSError when the PCI device
    directory cannot be read at all."""
    return PciScanner(sysfs_root).scan()


def probe_pci(sysfs_root: str = "/sys", scanner: PciScanner | None = None) -> ProbeResult:
    """scanner: one kept across cycles (reads each function's identity once); None scans from nothing."""
    try:
        gpus = (scanner or PciScanner(sysfs_root)).scan()
    except OSError as e:
        why = Finding.unchecked(Check.PCI, f"cannot read PCI devices under {sysfs_root}: {e.strerror}")
        return ProbeResult(Check.PCI, (why,), ran=False)
    unbound = [g for g in gpus if g.driver is None]
    findings = tuple(Finding.info(Check.PCI, "GPU has no driver bound", g.address, kind="no_driver") for g in unbound)
    return ProbeResult(Check.PCI, findings, tuple(GpuIdentity(g.address) for g in gpus), len(gpus))


class PciProbe:
    """The GPUs on the PCI bus, one scan per cycle (PciScanner keeps what never changes). The GPUs are an
    inventory the verdict compares with nvidia-smi's; the payload is the scan's key, for the caches built on it
    (PCIe link paths, device minors)."""

    check = Check.PCI

    def __init__(self, sysfs_root: str = "/sys", reader: SysfsReader = READER) -> None:
        self.sysfs_root = sysfs_root
        self.scanner = PciScanner(sysfs_root, reader)

    def read(self, context: ProbeContext) -> ProbeResult:
        r = probe_pci(self.sysfs_root, self.scanner)
        return replace(r, counts={"pci": r.count}, inventory=True, payload=PciScanKey(self.scanner.key))


@dataclass(frozen=True)
class PciScanKey:
    """What the last scan saw (functions, inodes, drivers): it changes when anything the scan saw changed."""

    key: tuple[tuple[str, int, str | None], ...]


@dataclass(frozen=True)
class PciSettings:
    """Settings of the PCI probe (the sysfs mount the sysfs probes read)."""

    sysfs_root: str = setting(to_str, "/sys", "sysfs mount to count PCI GPUs in")
