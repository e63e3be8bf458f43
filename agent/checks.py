"""Runs every level check once and gathers their results into one Observation.
Every probe returns a ProbeResult (findings, GPUs, count, whether it ran); this module only combines
them and never looks inside findings. The kernel log is read elsewhere (kmsg_watch, or `check`'s
one-shot read); it feeds non-fatal Xids to `xid_rate`, whose findings each cycle adds.

The degradation signals (issue 18, docs/degradation.md) run after the hard checks: the PCIe links of the
GPUs PCI found (speed judged with NVML's load), the device nodes, clock events (a tracker kept across
cycles, fed one NVML sample per GPU and cycle), the Xid rate and the opt-in dcgm-exporter cross-check.
Their faults carry reason GPUDegraded and pass through the same hysteresis (RecoveryGate, verdict.py) as every level
signal."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agent.allocation import AllocationMap, InventoryGpu, build_map
from agent.config import Config
from agent.kube import KubeApi
from agent.miglayout import judge_mig_layout, node_mig_inputs
from agent.model import Check, Finding, GpuIdentity, Observation, PciAddress, ProbeResult
from agent.probes.clocks import ClockEventTracker, ClockThresholds
from agent.probes.dcgm import DcgmThresholds, dcgm_result
from agent.probes.device_nodes import DeviceNodeThresholds, device_nodes_result, read_minor_numbers
from agent.probes.device_plugin import MigLayout
from agent.probes.dra import DraInventory, SliceRead, node_inventory, probe_gpu_serving, read_node_slices
from agent.probes.nvidia_smi import NvidiaSmiRunner, probe_nvidia_smi
from agent.probes.nvml import NvmlProbe, NvmlSnapshot, read_nvml
from agent.probes.pci import PciScanner, probe_pci
from agent.probes.pcie import LinkCache, PcieThresholds, pcie_result
from agent.probes.xid_rate import XidRateThresholds, XidRateTracker

if TYPE_CHECKING:
    from agent.probes.podresources import PodResourcesRead, PodResourcesReader
    from agent.slice_cache import SliceCache


DRA_EMPTY_RELIST_S = 300.0  # a node without ResourceSlices lists them again after this long (a new DRA driver)
SMI_LIST_REFRESH_S = 300.0  # `nvidia-smi -L` again at most this often while device IDs stay unplaced


@dataclass
class CycleStats:
    durations: dict[str, float] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)  # checks that could not run this cycle
    smi_timed_out: bool = False


def mig_layout(gpus: Sequence[GpuIdentity]) -> MigLayout | None:
    """MIG state over the GPUs of one source; None when the source listed none."""
    if not gpus:
        return None
    lay = MigLayout()
    for g in gpus:
        enabled = bool(g.mig_enabled)
        lay.mig_enabled_gpus += enabled
        lay.full_gpus += not enabled
        lay.gpus_with_mig_devices += g.mig_devices > 0
        lay.mig_devices += g.mig_devices
    return lay


class CheckSuite:
    def __init__(
        self,
        cfg: Config,
        nvml: NvmlProbe | None = None,
        clock: Callable[[], float] = time.monotonic,
        api: KubeApi | None = None,
    ) -> None:
        self.cfg = cfg
        self.api = api  # reads the node's ResourceSlices (DRA-aware counting); None: not read
        self.inventory: DraInventory | None = None  # the newest cycle's parsed slices (for fencing); None: unread
        self.smi = NvidiaSmiRunner(cfg.nvidia_smi, cfg.nvidia_smi_timeout)
        self.nvml = nvml or NvmlProbe(cfg.nvml, cfg.nvml_timeout, cfg.nvml_nvlink)
        # What the NVML probe reads for the degradation probes (also on a probe passed in).
        self.nvml.read_load = cfg.pcie and cfg.pcie_speed
        self.nvml.read_clocks = cfg.clock_events
        self.nvml.read_uuids = cfg.dcgm_exporter is not None or cfg.pod_resources
        # kubelet's pod-resources API (issue 17): `allocation` is the newest map, None when off or unreadable;
        # `pod_resources_read` the raw read (its `allocatable_counts`: the pod-resources view of allocatable
        # devices per resource name, e.g. {"nvidia.com/gpu": 8}, for a later cross-check with node.status).
        self.allocation: AllocationMap | None = None
        self.slice_cache: SliceCache | None = None  # the node's slices from a watch (the runner's); None: LIST
        self._slices: SliceRead | None = None  # the last ResourceSlice LIST, and when (see _gpu_serving)
        self._slices_at = 0.0
        self._smi_list: tuple[InventoryGpu, ...] = ()  # `nvidia-smi -L` GPUs (when NVML gives no UUIDs)
        self._smi_list_key: tuple[tuple[int, PciAddress], ...] = ()
        self._smi_list_at = 0.0
        self.mig_pending_since: float | None = None  # when nvidia.com/mig.config.state=pending was first seen
        self.pod_resources_read: PodResourcesRead | None = None
        self.pod_resources: PodResourcesReader | None = None
        if cfg.pod_resources:
            from agent.probes.podresources import PodResourcesReader  # h2 and protobuf load on the first read

            self.pod_resources = PodResourcesReader(
                cfg.pod_resources_socket, cfg.pod_resources_timeout, cfg.pod_resources_interval
            )
        self.clock = clock
        self.started = clock()
        self.pcie = PcieThresholds(cfg.pcie, cfg.pcie_bridges, cfg.pcie_speed, cfg.pcie_busy_utilization)
        # Kept across cycles while the PCI functions stay (the scan's key): what never changes then is read once.
        self.pci_scanner = PciScanner(cfg.sysfs_root)
        self.link_cache = LinkCache()
        self._minors: tuple[object, dict[PciAddress, int]] = ((), {})
        self.device_nodes = DeviceNodeThresholds(cfg.device_nodes, cfg.dev_root, cfg.require_uvm)
        self.clocks = ClockEventTracker(
            ClockThresholds(
                cfg.clock_events,
                cfg.clock_window,
                cfg.clock_max_slowed_share,
                cfg.clock_min_samples,
                cfg.thermal_margin_min,
            )
        )
        self.xid_rate = XidRateTracker(
            XidRateThresholds(cfg.xid_rate, cfg.xid_rate_count, cfg.xid_rate_window, frozenset(cfg.xid_rate_ignore))
        )
        self.dcgm = DcgmThresholds(cfg.dcgm_exporter, cfg.dcgm_required, cfg.dcgm_timeout, node_name=cfg.node_name)

    def run(
        self, node: dict[str, Any] | None, node_error: str | None = None, plugin_grace_s: float | None = None
    ) -> tuple[Observation, CycleStats]:
        """node: the Node object (dict) or None when the plugin check is off; node_error: why the
        Node could not be read (the plugin check then could not run)."""
        stats = CycleStats()
        obs = Observation(expected_gpus=self.cfg.expected_gpus)

        smi = self._timed(stats, lambda: probe_nvidia_smi(self.smi))
        pci = self._timed(stats, lambda: probe_pci(self.cfg.sysfs_root, self.pci_scanner))
        t0 = time.monotonic()
        nvml, snap = read_nvml(self.nvml)
        stats.durations[nvml.check] = time.monotonic() - t0
        stats.smi_timed_out = smi.timed_out
        obs.counts.nvidia_smi, obs.counts.pci = smi.count, pci.count
        results = [smi, pci, nvml]
        if node is not None or node_error is not None:
            grace = self.cfg.plugin_grace if plugin_grace_s is None else plugin_grace_s
            mig = mig_layout(nvml.gpus) or mig_layout(smi.gpus)
            plugin = self._timed(stats, lambda: self._gpu_serving(node, node_error, mig, grace, pci))
            dra = "dra_gpus" in plugin.counts  # the DRA driver's count: no "the device plugin serves N" message
            obs.counts.plugin_capacity = plugin.counts.get("plugin_capacity")
            obs.counts.plugin_allocatable = plugin.counts.get("plugin_allocatable")
            obs.counts.plugin_physical = None if dra else plugin.count
            obs.counts.dra = plugin.count if dra else None
            results.append(plugin)
        results += self._degradation(stats, pci, snap, results)
        if self.pod_resources is not None:
            t0 = time.monotonic()
            obs.findings += self._allocation(snap, smi)
            stats.durations["pod_resources"] = time.monotonic() - t0
        gpus: dict[PciAddress, GpuIdentity] = {}
        for r in results:  # nvidia-smi first: its index and name win
            obs.findings += r.findings
            if not r.ran:
                stats.failed.add(r.check)
                continue
            if r.check in (Check.NVIDIA_SMI, Check.PCI):
                obs.seen[r.check] = r.addresses
            for g in r.gpus:
                gpus.setdefault(g.address, g)
        obs.gpus = gpus
        if node is not None:  # MIG layout health from the Node's mig-manager labels (agent/miglayout.py)
            labels, advertised = node_mig_inputs(node)
            layout = judge_mig_layout(
                labels,
                list(gpus.values()),
                advertised,
                now=self.clock(),
                pending_since=self.mig_pending_since,
                timeout_s=self.cfg.mig_pending_timeout,
            )
            self.mig_pending_since = layout.pending_since  # a one-shot `check` never times a pending plan out
            obs.findings += layout.findings
        return obs, stats

    def _degradation(
        self, stats: CycleStats, pci: ProbeResult, snap: NvmlSnapshot | None, hard: list[ProbeResult]
    ) -> list[ProbeResult]:
        """The degradation probes' results (docs/degradation.md); none when a signal is switched off."""
        cfg, now, out = self.cfg, self.clock(), []
        nv_gpus = [g for g in (snap.gpus if snap is not None else ()) if g.address is not None]
        on_pci = sorted(pci.addresses) if pci.ran else []
        if cfg.pcie and on_pci:
            load = {g.address: g.load for g in nv_gpus if g.address is not None and g.load is not None}
            self.link_cache.refresh(self.pci_scanner.key)
            out.append(
                self._timed(stats, lambda: pcie_result(cfg.sysfs_root, on_pci, self.pcie, load, self.link_cache))
            )
        if cfg.device_nodes and on_pci:
            mig = any(g.mig_enabled for r in hard for g in r.gpus)
            out.append(
                self._timed(
                    stats,
                    lambda: device_nodes_result(
                        self.device_nodes,
                        minors=self._minor_numbers(on_pci),
                        gpu_count=len(on_pci),
                        mig_enabled=mig,
                    ),
                )
            )
        if cfg.clock_events:
            if snap is not None:  # NVML answered this cycle: one sample per GPU (a hung NVML keeps the history)
                for g in nv_gpus:
                    if g.address is not None and g.clock is not None:
                        self.clocks.observe(g.address, g.clock, now)
                self.clocks.forget_except(g.address for g in nv_gpus if g.address is not None)
            out.append(self._timed(stats, lambda: self.clocks.result(now)))
        if cfg.xid_rate:
            out.append(self._timed(stats, lambda: self.xid_rate.result(now)))
        if cfg.dcgm_exporter:
            uuids = {g.uuid: g.address for g in nv_gpus if g.uuid and g.address is not None}
            out.append(self._timed(stats, lambda: dcgm_result(self.dcgm, uuids)))
        return out

    def _minor_numbers(self, on_pci: list[PciAddress]) -> dict[PciAddress, int]:
        """The driver's minor number of each GPU, read again only when the PCI scan's key changed (a GPU added,
        removed or rebound) or the last read missed a GPU (the driver was still loading)."""
        key, minors = self._minors
        if key != self.pci_scanner.key or len(minors) < len(on_pci):
            minors = read_minor_numbers(self.cfg.proc_root, on_pci)
            self._minors = (self.pci_scanner.key, minors)
        return minors

    def _gpu_serving(
        self, node: dict[str, Any] | None, node_error: str | None, mig: MigLayout | None, grace: float, pci: ProbeResult
    ) -> ProbeResult:
        """The device-plugin check, deferring to the node's DRA ResourceSlices where they exist: from the runner's
        watch (slice_cache.py, no request) while it is kept; else a LIST from the apiserver's watch cache
        (probes/dra.py): every poll on a node that has slices, every DRA_EMPTY_RELIST_S on a node whose last LIST
        found none (most nodes: no DRA driver), so a plain device-plugin node costs the API 12 LISTs an hour, not
        120. Keeps the parsed slices for fencing."""
        slices: SliceRead | None = None
        name = self.cfg.node_name or ((node or {}).get("metadata") or {}).get("name")
        wanted = self.cfg.dra_counting or self.cfg.fencing  # fencing needs the devices even when not counting
        if wanted and self.api is not None and node is not None and isinstance(name, str):
            now, last = self.clock(), self._slices
            cached = self.slice_cache.items() if self.slice_cache is not None else None
            if cached is not None:
                slices = cached  # the runner's watch (slice_cache.py): no request
            elif last is not None and last.ok and not last.items and now - self._slices_at < DRA_EMPTY_RELIST_S:
                slices = last  # no DRA driver on this node a moment ago
            else:
                slices = self._slices = read_node_slices(self.api, name, self.cfg.dra_driver)
                self._slices_at = now
        self.inventory = node_inventory(slices, self.cfg.dra_driver)
        return probe_gpu_serving(
            node,
            node_error,
            slices if self.cfg.dra_counting else None,
            mig,
            self.cfg.mig_strategy,
            self.cfg.replicas,
            grace - (self.clock() - self.started),
            pci=pci.addresses if pci.ran else None,
            driver=self.cfg.dra_driver,
            inventory=self.inventory,
        )

    def _smi_inventory(self, snap: NvmlSnapshot | None, smi: ProbeResult) -> tuple[InventoryGpu, ...]:
        """The GPUs with their UUIDs from `nvidia-smi -L` when NVML gave none (NVML off or not loadable), joined
        by index to the bus ids of this poll's nvidia-smi table. UUIDs do not change while the GPUs stay, so `-L`
        runs again only when nvidia-smi's GPUs change, or at most every SMI_LIST_REFRESH_S while the map has
        device IDs it cannot place (a MIG layout was changed)."""
        from agent.probes.podresources import parse_smi_list

        if (snap is not None and any(getattr(g, "uuid", None) for g in snap.gpus)) or not smi.ran:
            return ()
        key = tuple(sorted((g.index, g.address) for g in smi.gpus if g.index is not None))
        if not key:
            return ()
        now = self.clock()
        unplaced = self.allocation is not None and bool(self.allocation.unmapped)
        if key != self._smi_list_key or (unplaced and now - self._smi_list_at >= SMI_LIST_REFRESH_S):
            run = self.smi.run(("-L",))
            self._smi_list_key, self._smi_list_at = key, now
            ok = run.exit_code == 0 and not run.output_capped
            self._smi_list = parse_smi_list(run.output, dict(key)) if ok else ()
        return self._smi_list

    def _allocation(self, snap: NvmlSnapshot | None, smi: ProbeResult) -> list[Finding]:
        """One pod-resources read (at most one per podResourcesInterval) into `self.allocation`. Its findings are
        INFO only: an unreadable socket sets `allocation` to None and never changes readiness."""
        from agent.probes.podresources import dra_refs, gpu_inventory

        assert self.pod_resources is not None
        read, findings = self.pod_resources.read()
        self.pod_resources_read = read
        if read is None:
            self.allocation = None
            return list(findings)
        dra = dra_refs(self.inventory.devices) if self.inventory is not None else ()
        inventory = gpu_inventory(snap.gpus if snap is not None else (), self._smi_inventory(snap, smi), dra=dra)
        self.allocation = build_map(read.listed, read.allocatable, inventory)
        return list(findings)

    @staticmethod
    def _timed(stats: CycleStats, fn: Callable[[], ProbeResult]) -> ProbeResult:
        t0 = time.monotonic()
        result = fn()
        stats.durations[result.check] = time.monotonic() - t0
        return result
