"""The probe registry: every signal once, in the order they run, each row naming its settings section.

The GPU sources run first (nvidia-smi, whose index and name win, then PCI and NVML), then what serves them to
pods, the degradation signals (docs/degradation.md), the allocation map, the MIG layout and the kernel log. A
probe reads the results of the probes before it through the context (NVML's samples for the PCIe speed, the
clock tracker and dcgm; PCI's scan for the device nodes).

A row is `ProbeSpec(check, settings=<section>, build=...)`: the section is the probe's own frozen settings
dataclass (agent/settings.py `setting` fields), and the settings table, the flags, the configuration doc and the
chart schema's check are derived from the sections the rows name (agent/config.py gathers them). `build` gets
its own section, what the suite shares, and the other sections by type for the few it reads (the sysfs mount).
Adding a signal is its module (with its section) and one row here."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from agent.kernel_log.rate import XidRateProbe, XidRateThresholds
from agent.kernel_log.watcher import KernelLogProbe, KmsgSettings
from agent.kernel_log.xid import XidSettings
from agent.mig_layout import MigConfigSettings
from agent.model import Check
from agent.probes.base import Probe
from agent.probes.clocks import ClockEventTracker, ClocksProbe, ClockThresholds
from agent.probes.dcgm import DcgmProbe, DcgmThresholds
from agent.probes.device_nodes import DeviceNodesProbe, DeviceNodeThresholds
from agent.probes.device_plugin import DevicePluginSettings
from agent.probes.dra import DraSettings, GpuServingProbe
from agent.probes.fabric import FabricProbe, FabricSettings
from agent.probes.fabric_manager import FabricManagerProbe, FabricManagerSettings, NvswitchScanner
from agent.probes.imex import ImexProbe, ImexSettings
from agent.probes.infiniband import InfinibandProbe, InfinibandSettings
from agent.probes.mig_config import MigConfigProbe
from agent.probes.nvidia_smi import NvidiaSmiProbe, NvidiaSmiSettings
from agent.probes.nvml import NvmlProbe, NvmlSettings
from agent.probes.pci import PciProbe, PciSettings
from agent.probes.pcie import PcieProbe, PcieThresholds
from agent.probes.podresources import PodResourcesSettings
from agent.probes.shared import Shared
from agent.settings import Sections

S = TypeVar("S")


@dataclass(frozen=True)
class ProbeSpec(Generic[S]):
    """One row of the registry: the check, its settings section, whether it runs under that section, and how it
    is built. `also`: other sections the probe reads that no row names (they join the settings table here)."""

    check: Check
    settings: type[S]
    build: Callable[[S, Shared, Sections], Probe]
    enabled: Callable[[S], bool] = lambda s: True
    also: tuple[type, ...] = ()

    def on(self, cfg: Sections) -> bool:
        """Whether these settings turn the probe on."""
        return self.enabled(cfg[self.settings])

    def make(self, cfg: Sections, shared: Shared) -> Probe:
        return self.build(cfg[self.settings], shared, cfg)


def nvml_reads(cfg: Sections, probe: NvmlProbe) -> NvmlProbe:
    """What the NVML probe reads besides health, for the probes after it (also on a probe passed in)."""
    nvml, pcie = cfg[NvmlSettings], cfg[PcieThresholds]
    probe.read_load = pcie.enabled and pcie.check_speed
    probe.read_clocks = cfg[ClockThresholds].enabled
    probe.read_uuids = cfg[DcgmThresholds].address is not None or cfg[PodResourcesSettings].pod_resources
    probe.read_fabric = cfg[FabricSettings].fabric in ("auto", "nvml")
    probe.expected_nvlinks, probe.nvlink_profiles = nvml.expected_nvlinks, nvml.nvlink_profiles or ()
    if probe.nvswitches is None:  # on an NVSwitch system every NVLink of every GPU is wired (docs/fabric.md)
        probe.nvswitches = NvswitchScanner(cfg[PciSettings].sysfs_root).scan
    return probe


def _nvml(s: NvmlSettings, shared: Shared, cfg: Sections) -> Probe:
    return nvml_reads(cfg, NvmlProbe(s.nvml, s.nvml_timeout, s.nvml_nvlink))


def _serving(s: DevicePluginSettings, shared: Shared, cfg: Sections) -> Probe:
    dra = cfg[DraSettings]
    return GpuServingProbe(
        shared,
        node_name=shared.node_name,
        dra_counting=dra.dra_counting,
        wants_slices=dra.dra_counting or shared.fencing,  # fencing needs the devices even when not counting
        driver=dra.dra_driver,
        strategy=s.mig_strategy,
        replicas=s.replicas,
        grace_s=s.plugin_grace,
    )


def _allocation(s: PodResourcesSettings, shared: Shared, cfg: Sections) -> Probe:
    from agent.probes.podresources import AllocationProbe, PodResourcesReader

    reader = PodResourcesReader(s.pod_resources_socket, s.pod_resources_timeout, s.pod_resources_interval)
    return AllocationProbe(reader, shared)


def _sysfs(cfg: Sections) -> str:
    return cfg[PciSettings].sysfs_root


REGISTRY: tuple[ProbeSpec[Any], ...] = (
    ProbeSpec(Check.NVIDIA_SMI, NvidiaSmiSettings, lambda s, shared, cfg: NvidiaSmiProbe(shared.smi)),
    ProbeSpec(Check.PCI, PciSettings, lambda s, shared, cfg: PciProbe(s.sysfs_root)),
    ProbeSpec(Check.NVML, NvmlSettings, _nvml),
    ProbeSpec(Check.DEVICE_PLUGIN, DevicePluginSettings, _serving, also=(DraSettings,)),
    ProbeSpec(Check.PCIE, PcieThresholds, lambda s, shared, cfg: PcieProbe(_sysfs(cfg), s), lambda s: s.enabled),
    ProbeSpec(
        Check.DEVICE_NODES,
        DeviceNodeThresholds,
        lambda s, shared, cfg: DeviceNodesProbe(s, s.proc_root),
        lambda s: s.enabled,
    ),
    ProbeSpec(
        Check.CLOCKS,
        ClockThresholds,
        lambda s, shared, cfg: ClocksProbe(ClockEventTracker(s)),
        lambda s: s.enabled,
    ),
    ProbeSpec(
        Check.XID_RATE, XidRateThresholds, lambda s, shared, cfg: XidRateProbe(shared.xid_rate), lambda s: s.enabled
    ),
    ProbeSpec(
        Check.DCGM,
        DcgmThresholds,
        lambda s, shared, cfg: DcgmProbe(replace(s, node_name=shared.node_name)),
        lambda s: s.address is not None,
    ),
    ProbeSpec(
        Check.INFINIBAND,
        InfinibandSettings,
        lambda s, shared, cfg: InfinibandProbe(_sysfs(cfg), thresholds=s.thresholds()),
        lambda s: s.infiniband,
    ),
    ProbeSpec(
        Check.FABRIC,
        FabricSettings,
        lambda s, shared, cfg: FabricProbe(s.fabric, shared.smi),
        lambda s: s.fabric != "off",
    ),
    ProbeSpec(
        Check.FABRIC_MANAGER,
        FabricManagerSettings,
        lambda s, shared, cfg: FabricManagerProbe(_sysfs(cfg), s.fabric_manager_address),
        lambda s: s.fabric_manager,
    ),
    ProbeSpec(
        Check.IMEX,
        ImexSettings,
        lambda s, shared, cfg: ImexProbe(s.imex_ctl, s.imex_timeout, s.imex_daemon),
        lambda s: s.imex,
    ),
    ProbeSpec(Check.POD_RESOURCES, PodResourcesSettings, _allocation, lambda s: s.pod_resources),
    ProbeSpec(Check.MIG_LAYOUT, MigConfigSettings, lambda s, shared, cfg: MigConfigProbe(s.mig_pending_timeout)),
    ProbeSpec(
        Check.XID,
        XidSettings,
        lambda s, shared, cfg: KernelLogProbe(shared.kernel_log, shared.latch_store),
        also=(KmsgSettings,),
    ),
)


def sections() -> tuple[type, ...]:
    """Every section the rows name, once, in registry order (a row's `also` after its own)."""
    out: dict[type, None] = {}
    for spec in REGISTRY:
        out.update(dict.fromkeys((spec.settings, *spec.also)))
    return tuple(out)


def build_probes(cfg: Sections, shared: Shared, given: Mapping[Check, Probe] | None = None) -> list[Probe]:
    """The registry's probes that these settings turn on; `given` replaces a probe by check (a test's NVML)."""
    given = given or {}
    return [given.get(s.check) or s.make(cfg, shared) for s in REGISTRY if s.on(cfg)]
