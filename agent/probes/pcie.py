"""PCIe link training from sysfs: a GPU (or a bridge above it) whose link trained narrower or slower
than both of its ends can do runs collectives at a fraction of the speed while everything else says
healthy (NVIDIA/NVSentinel#890).

Read per GPU and per upstream bridge/switch port (walking up the real sysfs path):
`current_link_width`, `max_link_width`, `current_link_speed`, `max_link_speed`.

- Width below what both ends of the link can do is degraded at any load (a stable signal).
- Speed drops at idle by design (ASPM / power saving), so it is judged only while the GPU is busy
  (utilisation from NVML at or above `busy_utilization_pct`), from sysfs or from NVML's current vs
  maximum PCIe generation. Unknown utilisation means speed is not judged: never a false alarm at idle.
- A device that does not expose the fields (some VMs) gives an informational finding; fields that
  exist but cannot be read or parsed make the check "could not check"."""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.model import Check, Finding, PciAddress, ProbeResult, Reason, Severity
from agent.probes.base import ProbeContext
from agent.probes.pci import PciScanKey
from agent.probes.sysfs import READER, SysfsReader, read_bytes
from agent.settings import in_range, setting, to_bool, to_int

_BDF = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_SPEED = re.compile(r"^\s*(\d{1,3}(?:\.\d{1,3})?)\s*GT/s")
MAX_BRIDGE_DEPTH = 8  # ancestors walked above a GPU; real trees have 2-4
LINK_FILES = ("current_link_width", "max_link_width", "current_link_speed", "max_link_speed")
GEN_BY_GTS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}


@dataclass(frozen=True)
class PcieThresholds:
    """Settings of the PCIe link probe (docs/degradation.md has each default and its source)."""

    enabled: bool = setting(
        to_bool, True, "judge PCIe links from sysfs (width below what both ends can do: GPUDegraded)", name="pcie"
    )
    # also judge the links above the GPU (switch / root ports)
    check_bridges: bool = setting(
        to_bool, True, "also judge the PCIe links above each GPU (switch and root ports)", name="pcie_bridges"
    )
    # judge the speed (only while busy)
    check_speed: bool = setting(
        to_bool, True, "judge PCIe link speed too (only while NVML says the GPU is busy)", name="pcie_speed"
    )
    # GPU utilisation at or above which the speed is judged
    busy_utilization_pct: int = setting(
        in_range(to_int, 0, 100),
        50,
        "NVML GPU utilisation % at which PCIe speed is judged",
        name="pcie_busy_utilization",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.busy_utilization_pct <= 100:
            raise ValueError("PCIe: busy utilisation must be a percentage (0-100)")


@dataclass(frozen=True)
class GpuLoad:
    """What NVML says about a GPU right now (filled by the NVML probe; see nvml_pcie_load)."""

    utilization_pct: int | None = None  # nvmlDeviceGetUtilizationRates().gpu
    current_gen: int | None = None  # nvmlDeviceGetCurrPcieLinkGeneration
    max_gen: int | None = None  # nvmlDeviceGetMaxPcieLinkGeneration (device and system)
    current_width: int | None = None  # nvmlDeviceGetCurrPcieLinkWidth
    max_width: int | None = None  # nvmlDeviceGetMaxPcieLinkWidth


@dataclass(frozen=True)
class PcieLink:
    device: str  # sysfs name, e.g. 0000:3b:00.0
    current_width: int | None
    max_width: int | None
    current_gts: float | None
    max_gts: float | None


class LinkUnreadable(Exception):
    pass


def parse_speed(text: str) -> float | None:
    """`32.0 GT/s PCIe` (kernel >= 5.x), `8 GT/s` (older), `Unknown` -> None."""
    m = _SPEED.match(text)
    return float(m.group(1)) if m else None


def speed_label(gts: float | None) -> str:
    if gts is None:
        return "unknown speed"
    gen = GEN_BY_GTS.get(gts)
    return f"Gen{gen} ({gts:g} GT/s)" if gen else f"{gts:g} GT/s"


def _read_attr(path: str) -> str | None:
    """A sysfs attribute (probes/sysfs.py: at most 64 bytes, under the probe's deadline); None when it does not
    exist. A read that does not answer raises Blocked, an OSError: that link is "could not check"."""
    try:
        return read_bytes(path).decode("utf-8", "replace").strip()
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        raise


class LinkCache:
    """What does not change while the PCI functions stay, kept across cycles: each GPU's path up the device tree
    and each device's maximum link width and speed (its Link Capabilities). `refresh(key)` with the PCI scan's
    key (PciScanner.key) drops both when a GPU was added, removed, replaced or rebound; the current width and
    speed are read every cycle. Halves the attributes read per cycle."""

    def __init__(self) -> None:
        self.key: object = None
        self.paths: dict[PciAddress, list[str]] = {}
        self.maxima: dict[str, dict[str, str | None]] = {}

    def refresh(self, key: object) -> None:
        if key != self.key:
            self.key = key
            self.paths.clear()
            self.maxima.clear()


MAX_FILES = ("max_link_width", "max_link_speed")


def _read_fields(dev: str, name: str, attrs: Sequence[str], raw: dict[str, str | None]) -> None:
    for attr in attrs:
        try:
            raw[attr] = _read_attr(f"{dev}/{attr}")
        except OSError as e:
            raise LinkUnreadable(f"{name}/{attr}: {e.strerror}") from None


def read_link(dev: str | os.PathLike[str], cache: LinkCache | None = None) -> PcieLink | None:
    """None when the device exposes none of the link fields; raises LinkUnreadable when a field is
    there but cannot be read or parsed. cache: the maxima from an earlier read (read and kept when absent)."""
    dev = os.fspath(dev)
    name = os.path.basename(dev)
    raw: dict[str, str | None] = {}
    maxima = cache.maxima.get(dev) if cache is not None else None
    if maxima is None:
        _read_fields(dev, name, LINK_FILES, raw)
        if cache is not None:
            cache.maxima[dev] = {a: raw[a] for a in MAX_FILES}
    else:
        _read_fields(dev, name, ("current_link_width", "current_link_speed"), raw)
        raw.update(maxima)
    if all(v is None for v in raw.values()):
        return None
    widths: list[int | None] = []
    for attr in ("current_link_width", "max_link_width"):
        v = raw[attr]
        if v is None:
            widths.append(None)
            continue
        try:
            widths.append(int(v.lstrip("x"), 10))
        except ValueError:
            raise LinkUnreadable(f"{name}/{attr}: cannot parse {v!r}") from None
    cs, ms = raw["current_link_speed"], raw["max_link_speed"]
    return PcieLink(
        name,
        widths[0],
        widths[1],
        parse_speed(cs) if cs is not None else None,
        parse_speed(ms) if ms is not None else None,
    )


def link_path(sysfs_root: str, gpu: PciAddress) -> list[str]:
    """The GPU's sysfs directory followed by the PCI devices above it (real path order)."""
    devices = f"{sysfs_root}/bus/pci/devices"
    dev = f"{devices}/{gpu.domain:04x}:{gpu.bus:02x}:{gpu.device:02x}.0"
    try:  # the entry is one relative link into the device tree: one readlink, not realpath's lstat per component
        target = os.readlink(dev)
        real = os.path.normpath(os.path.join(devices, target))
        if os.path.islink(real):
            real = os.path.realpath(dev)
    except OSError as e:  # not a link (a plain directory: no device above it in this tree) or gone
        real = dev if e.errno == errno.EINVAL else os.path.realpath(dev)
    out = [real]
    parent = os.path.dirname(real)
    while len(out) <= MAX_BRIDGE_DEPTH and _BDF.match(os.path.basename(parent)):
        out.append(parent)
        parent = os.path.dirname(parent)
    return out


def _partner_max(values: Sequence[float | int | None]) -> float | None:
    known = [float(v) for v in values if v is not None]
    return min(known) if known else None


def pcie_findings(
    sysfs_root: str,
    gpus: Sequence[PciAddress],
    thresholds: PcieThresholds = PcieThresholds(),
    load: Mapping[PciAddress, GpuLoad] | None = None,
    cache: LinkCache | None = None,
) -> list[Finding]:
    """One finding per degraded link, naming it; `load` carries NVML utilisation and generations."""
    if not thresholds.enabled:
        return []
    if not os.path.isdir(os.path.join(sysfs_root, "bus", "pci", "devices")):
        return [Finding.unchecked(Check.PCIE, f"cannot read PCI devices under {sysfs_root}", kind="unavailable")]
    findings: list[Finding] = []
    seen: dict[str, PcieLink | LinkUnreadable | None] = {}  # a bridge above several GPUs is read once per call
    for gpu in gpus:
        findings += _probe_gpu(sysfs_root, gpu, thresholds, (load or {}).get(gpu), seen, cache)
    return findings


def _read_link_once(
    dev: str, seen: dict[str, PcieLink | LinkUnreadable | None], cache: LinkCache | None = None
) -> PcieLink | None:
    if dev not in seen:
        try:
            seen[dev] = read_link(dev, cache)
        except LinkUnreadable as e:
            seen[dev] = e
    got = seen[dev]
    if isinstance(got, LinkUnreadable):
        raise got
    return got


def _probe_gpu(
    sysfs_root: str,
    gpu: PciAddress,
    t: PcieThresholds,
    load: GpuLoad | None,
    seen: dict[str, PcieLink | LinkUnreadable | None] | None = None,
    cache: LinkCache | None = None,
) -> list[Finding]:
    path = cache.paths.get(gpu) if cache is not None else None
    if path is None:
        path = link_path(sysfs_root, gpu)
        if cache is not None:
            cache.paths[gpu] = path
    if not t.check_bridges:
        path = path[:1]
    links: list[PcieLink | None] = []
    for dev in path:
        try:
            links.append(_read_link_once(dev, {} if seen is None else seen, cache))
        except LinkUnreadable as e:
            return [Finding(Check.PCIE, Severity.UNCHECKED, f"PCIe link: {e}", None, gpu, "unreadable")]
    if links[0] is None:
        note = Finding.info(Check.PCIE, "the GPU exposes no PCIe link fields in sysfs", gpu, kind="not_exposed")
        return [note, *_nvml_gen(gpu, t, load)]
    busy = (
        t.check_speed
        and load is not None
        and load.utilization_pct is not None
        and load.utilization_pct >= t.busy_utilization_pct
    )
    out: list[Finding] = []
    flagged_width: set[int] = set()
    flagged_speed: set[int] = set()
    for i, link in enumerate(links):
        if link is None:
            continue
        # The ends of a link: the device itself and its neighbours on the path. A link is degraded when it
        # runs below what both ends can do, so a narrower partner (x8 card under an x16 port) is no alarm.
        neighbours = [n for n in (links[i - 1] if i else None, links[i + 1] if i + 1 < len(links) else None) if n]
        where = "GPU link" if i == 0 else f"upstream bridge {link.device}"
        # Seen from the other end, the link just reported for the device below: report it once.
        prev = links[i - 1] if i else None
        same_as_prev = prev is not None and (prev.current_width, prev.current_gts) == (
            link.current_width,
            link.current_gts,
        )
        if link.current_width is not None and link.max_width is not None:
            nmax = _partner_max([n.max_width for n in neighbours])
            can = min(link.max_width, int(nmax)) if nmax is not None else link.max_width
            if link.current_width < can and not (same_as_prev and (i - 1) in flagged_width):
                flagged_width.add(i)
                out.append(
                    Finding.fault(
                        Check.PCIE,
                        Reason.GPU_DEGRADED,
                        f"PCIe {where} trained to x{link.current_width}, capable of x{can}",
                        gpu,
                        kind="pcie_width",
                    )
                )
        if busy and link.current_gts is not None and link.max_gts is not None:
            nmax_s = _partner_max([n.max_gts for n in neighbours])
            can_s = min(link.max_gts, nmax_s) if nmax_s is not None else link.max_gts
            if link.current_gts < can_s and not (same_as_prev and (i - 1) in flagged_speed):
                flagged_speed.add(i)
                out.append(
                    Finding.fault(
                        Check.PCIE,
                        Reason.GPU_DEGRADED,
                        f"PCIe {where} at {speed_label(link.current_gts)} under load "
                        f"({load.utilization_pct if load else '?'}% busy), capable of {speed_label(can_s)}",
                        gpu,
                        kind="pcie_speed",
                    )
                )
    if not flagged_speed:
        out += _nvml_gen(gpu, t, load)
    return out


def _nvml_gen(gpu: PciAddress, t: PcieThresholds, load: GpuLoad | None) -> list[Finding]:
    """NVML's current vs maximum generation, judged only under load (it drops at idle by design)."""
    if not t.check_speed or load is None or load.utilization_pct is None:
        return []
    if load.utilization_pct < t.busy_utilization_pct or load.current_gen is None or load.max_gen is None:
        return []
    if load.current_gen < load.max_gen:
        return [
            Finding.fault(
                Check.PCIE,
                Reason.GPU_DEGRADED,
                f"PCIe GPU link at Gen{load.current_gen} under load ({load.utilization_pct}% busy), "
                f"capable of Gen{load.max_gen} (NVML)",
                gpu,
                kind="pcie_gen",
            )
        ]
    return []


def nvml_pcie_load(nv: Any, handle: Any) -> GpuLoad:
    """Reads a GpuLoad through nvidia-ml-py; a call NVML does not support leaves its field None.
    Run it where the other NVML calls run (the NVML probe's worker, under its deadline)."""

    def get(name: str, *args: Any) -> Any:
        fn = getattr(nv, name, None)
        if fn is None:
            return None
        try:
            return fn(handle, *args)
        except nv.NVMLError:
            return None

    util = get("nvmlDeviceGetUtilizationRates")
    return GpuLoad(
        utilization_pct=int(util.gpu) if util is not None else None,
        current_gen=get("nvmlDeviceGetCurrPcieLinkGeneration"),
        max_gen=get("nvmlDeviceGetMaxPcieLinkGeneration"),
        current_width=get("nvmlDeviceGetCurrPcieLinkWidth"),
        max_width=get("nvmlDeviceGetMaxPcieLinkWidth"),
    )


class PcieProbe:
    """The PCIe links of the GPUs PCI found this cycle (and the bridges above them); speed judged with NVML's
    load. Link paths and maxima are kept while the PCI scan's key stays (LinkCache)."""

    check = Check.PCIE

    def __init__(self, sysfs_root: str, thresholds: PcieThresholds, reader: SysfsReader = READER) -> None:
        self.sysfs_root, self.thresholds = sysfs_root, thresholds
        self.reader = reader
        self.cache = LinkCache()

    def read(self, context: ProbeContext) -> ProbeResult:
        pci, scan = context.ran(Check.PCI), context.payload(Check.PCI, PciScanKey)
        on_pci = sorted(pci.addresses) if pci is not None else []
        if not on_pci:
            return ProbeResult(Check.PCIE)
        gpus = context.gpu_readings(Check.NVML) or ()
        load = {g.address: g.load for g in gpus if g.address is not None and g.load is not None}
        self.cache.refresh(scan.key if scan is not None else None)
        try:
            findings = self.reader.run(
                pcie_findings, self.sysfs_root, on_pci, self.thresholds, load, self.cache, what="reading the PCIe links"
            )
        except OSError as e:  # Blocked: a link file did not answer within the deadline (a later read of it: per GPU)
            return ProbeResult.of(Check.PCIE, (Finding.unchecked(Check.PCIE, f"PCIe links: {e}", kind="unreadable"),))
        return ProbeResult.of(Check.PCIE, findings)
