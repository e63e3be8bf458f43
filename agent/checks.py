"""The probe registry and the check suite: every probe, in order, once per cycle, into one Observation.

REGISTRY lists every signal once, in the order they run: the GPU sources first (nvidia-smi, whose index and
name win, then PCI and NVML), what serves them to pods, the degradation signals (docs/degradation.md), the
allocation map, the MIG layout and the kernel log. A probe reads the results of the probes before it through
the context (NVML's samples for the PCIe speed, the clock tracker and dcgm; PCI's scan for the device nodes).
This module combines results and never looks inside findings: counts by name, GPUs from the sources that ran,
the sources' inventories for the verdict. Adding a signal is a probe module and one row here."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from agent.allocation import AllocationMap
from agent.config import Config
from agent.kernel_log.rate import XidRateProbe, XidRateThresholds, XidRateTracker
from agent.kernel_log.watcher import KernelLogProbe
from agent.kube.client import KubeApi
from agent.model import Check, Counts, Observation, ProbeResult
from agent.probes.base import Probe, ProbeContext, ProbeSpec, Shared, merged_gpus
from agent.probes.clocks import ClockEventTracker, ClocksProbe, ClockThresholds
from agent.probes.dcgm import DcgmProbe, DcgmThresholds
from agent.probes.device_nodes import DeviceNodesProbe, DeviceNodeThresholds
from agent.probes.dra import DraInventory, GpuServingProbe
from agent.probes.fabric import FabricProbe
from agent.probes.fabric_manager import FabricManagerProbe, NvswitchScanner
from agent.probes.imex import ImexProbe
from agent.probes.infiniband import FlapThresholds, IbThresholds, InfinibandProbe
from agent.probes.mig_config import MigConfigProbe
from agent.probes.nvidia_smi import NvidiaSmiProbe, NvidiaSmiRunner
from agent.probes.nvml import NvmlProbe
from agent.probes.pci import PciProbe
from agent.probes.pcie import PcieProbe, PcieThresholds


def nvml_reads(cfg: Config, probe: NvmlProbe) -> NvmlProbe:
    """What the NVML probe reads besides health, for the probes after it (also on a probe passed in)."""
    probe.read_load = cfg.pcie and cfg.pcie_speed
    probe.read_clocks = cfg.clock_events
    probe.read_uuids = cfg.dcgm_exporter is not None or cfg.pod_resources
    probe.read_fabric = cfg.fabric in ("auto", "nvml")
    probe.expected_nvlinks, probe.nvlink_profiles = cfg.expected_nvlinks, cfg.nvlink_profiles or ()
    if probe.nvswitches is None:  # on an NVSwitch system every NVLink of every GPU is wired (docs/fabric.md)
        probe.nvswitches = NvswitchScanner(cfg.sysfs_root).scan
    return probe


def _nvml(cfg: Config, shared: Shared) -> Probe:
    return nvml_reads(cfg, NvmlProbe(cfg.nvml, cfg.nvml_timeout, cfg.nvml_nvlink))


def _serving(cfg: Config, shared: Shared) -> Probe:
    return GpuServingProbe(
        shared,
        node_name=cfg.node_name,
        dra_counting=cfg.dra_counting,
        wants_slices=cfg.dra_counting or cfg.fencing,  # fencing needs the devices even when not counting
        driver=cfg.dra_driver,
        strategy=cfg.mig_strategy,
        replicas=cfg.replicas,
        grace_s=cfg.plugin_grace,
    )


def _pcie(cfg: Config, shared: Shared) -> Probe:
    return PcieProbe(
        cfg.sysfs_root, PcieThresholds(cfg.pcie, cfg.pcie_bridges, cfg.pcie_speed, cfg.pcie_busy_utilization)
    )


def _clocks(cfg: Config, shared: Shared) -> Probe:
    t = ClockThresholds(
        cfg.clock_events, cfg.clock_window, cfg.clock_max_slowed_share, cfg.clock_min_samples, cfg.thermal_margin_min
    )
    return ClocksProbe(ClockEventTracker(t))


def _allocation(cfg: Config, shared: Shared) -> Probe:
    from agent.probes.podresources import AllocationProbe, PodResourcesReader

    reader = PodResourcesReader(cfg.pod_resources_socket, cfg.pod_resources_timeout, cfg.pod_resources_interval)
    return AllocationProbe(reader, shared)


def _infiniband(cfg: Config, shared: Shared) -> Probe:
    t = IbThresholds(
        cfg.expected_nics,
        cfg.ib_min_rate_gbps,
        cfg.ib_rate_peers,
        FlapThresholds(cfg.ib_flap_count, cfg.ib_flap_window),
        cfg.require_gpu_direct,
        cfg.rail_devices or (),
    )
    return InfinibandProbe(cfg.sysfs_root, thresholds=t)


def always(cfg: Config) -> bool:
    return True


REGISTRY: tuple[ProbeSpec, ...] = (
    ProbeSpec(Check.NVIDIA_SMI, always, lambda cfg, shared: NvidiaSmiProbe(shared.smi)),
    ProbeSpec(Check.PCI, always, lambda cfg, shared: PciProbe(cfg.sysfs_root)),
    ProbeSpec(Check.NVML, always, _nvml),
    ProbeSpec(Check.DEVICE_PLUGIN, always, _serving),
    ProbeSpec(Check.PCIE, lambda cfg: cfg.pcie, _pcie),
    ProbeSpec(
        Check.DEVICE_NODES,
        lambda cfg: cfg.device_nodes,
        lambda cfg, shared: DeviceNodesProbe(
            DeviceNodeThresholds(cfg.device_nodes, cfg.dev_root, cfg.require_uvm), cfg.proc_root
        ),
    ),
    ProbeSpec(Check.CLOCKS, lambda cfg: cfg.clock_events, _clocks),
    ProbeSpec(Check.XID_RATE, lambda cfg: cfg.xid_rate, lambda cfg, shared: XidRateProbe(shared.xid_rate)),
    ProbeSpec(
        Check.DCGM,
        lambda cfg: cfg.dcgm_exporter is not None,
        lambda cfg, shared: DcgmProbe(
            DcgmThresholds(cfg.dcgm_exporter, cfg.dcgm_required, cfg.dcgm_timeout, node_name=cfg.node_name)
        ),
    ),
    ProbeSpec(Check.INFINIBAND, lambda cfg: cfg.infiniband, _infiniband),
    ProbeSpec(Check.FABRIC, lambda cfg: cfg.fabric != "off", lambda cfg, shared: FabricProbe(cfg.fabric, shared.smi)),
    ProbeSpec(
        Check.FABRIC_MANAGER,
        lambda cfg: cfg.fabric_manager,
        lambda cfg, shared: FabricManagerProbe(cfg.sysfs_root, cfg.fabric_manager_address),
    ),
    ProbeSpec(
        Check.IMEX, lambda cfg: cfg.imex, lambda cfg, shared: ImexProbe(cfg.imex_ctl, cfg.imex_timeout, cfg.imex_daemon)
    ),
    ProbeSpec(Check.POD_RESOURCES, lambda cfg: cfg.pod_resources, _allocation),
    ProbeSpec(Check.MIG_LAYOUT, always, lambda cfg, shared: MigConfigProbe(cfg.mig_pending_timeout)),
    ProbeSpec(Check.XID, always, lambda cfg, shared: KernelLogProbe(shared.kernel_log, shared.latch_store)),
)
COUNT_NAMES = frozenset(f.name for f in fields(Counts))


@dataclass
class CycleStats:
    durations: dict[str, float] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)  # checks that could not run this cycle
    timed_out: set[str] = field(default_factory=set)  # checks whose source timed out this cycle


def build_probes(cfg: Config, shared: Shared, given: Mapping[Check, Probe] | None = None) -> list[Probe]:
    """The registry's probes that these settings turn on; `given` replaces a probe by check (a test's NVML)."""
    given = given or {}
    return [given.get(s.check) or s.build(cfg, shared) for s in REGISTRY if s.enabled(cfg)]


def combine(results: Iterable[ProbeResult], expected_gpus: int | None) -> Observation:
    """One Observation from a cycle's results, in registry order (the first source's GPU identity wins)."""
    results = list(results)
    obs = Observation(expected_gpus=expected_gpus, gpus=merged_gpus(results))
    for r in results:
        obs.findings += r.findings
        for k, v in r.counts.items():
            if k in COUNT_NAMES:
                setattr(obs.counts, k, v)
        if r.ran and r.inventory:
            obs.seen[r.check] = r.addresses
    return obs


class CheckSuite:
    """The registry's probes for one node, kept across cycles (each keeps its own caches and windows)."""

    def __init__(
        self,
        cfg: Config,
        nvml: NvmlProbe | None = None,
        clock: Callable[[], float] = time.monotonic,
        api: KubeApi | None = None,
        *,
        kernel_log: Callable[[], str | None] = lambda: None,
        latch_store: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.cfg, self.clock = cfg, clock
        self.shared = Shared(
            clock=clock,
            smi=NvidiaSmiRunner(cfg.nvidia_smi, cfg.nvidia_smi_timeout),
            xid_rate=XidRateTracker(
                XidRateThresholds(cfg.xid_rate, cfg.xid_rate_count, cfg.xid_rate_window, frozenset(cfg.xid_rate_ignore))
            ),
            api=api,
            started=clock(),
            kernel_log=kernel_log,
            latch_store=latch_store,
        )
        given = {Check.NVML: nvml_reads(cfg, nvml)} if nvml is not None else None
        self.probes: Sequence[Probe] = build_probes(cfg, self.shared, given)
        self.results: dict[Check, ProbeResult] = {}  # the newest cycle's, by check

    def probe(self, check: Check) -> Any:
        """The probe of `check` (None when these settings turn it off)."""
        return next((p for p in self.probes if p.check is check), None)

    @property
    def smi(self) -> NvidiaSmiRunner:
        return self.shared.smi

    @property
    def xid_rate(self) -> XidRateTracker:
        return self.shared.xid_rate

    @property
    def slice_cache(self) -> Any:
        return self.shared.slice_cache

    @slice_cache.setter
    def slice_cache(self, cache: Any) -> None:
        self.shared.slice_cache = cache

    @property
    def inventory(self) -> DraInventory | None:
        """The newest cycle's parsed ResourceSlices (for fencing); None when not read."""
        r = self.results.get(Check.DEVICE_PLUGIN)
        return r.payload if r is not None and isinstance(r.payload, DraInventory) else None

    @property
    def allocation(self) -> AllocationMap | None:
        """The newest cycle's allocation map (pod-resources); None when off or unreadable."""
        r = self.results.get(Check.POD_RESOURCES)
        return r.payload if r is not None and isinstance(r.payload, AllocationMap) else None

    def run(
        self, node: dict[str, Any] | None, node_error: str | None = None, *, one_shot: bool = False
    ) -> tuple[Observation, CycleStats]:
        """node: the own Node (None when it could not be read: `node_error` says why)."""
        stats = CycleStats()
        ctx = ProbeContext(node, node_error, self.clock(), one_shot)
        for probe in self.probes:
            t0 = time.monotonic()
            r = probe.read(ctx)
            stats.durations[str(r.check)] = time.monotonic() - t0
            ctx.results[r.check] = r
            if not r.ran:
                stats.failed.add(str(r.check))
            if r.timed_out:
                stats.timed_out.add(str(r.check))
        self.results = ctx.results
        return combine(ctx.results.values(), self.cfg.expected_gpus), stats
