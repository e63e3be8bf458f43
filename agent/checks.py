"""Runs every level check once and gathers their findings into one Observation.
The kernel log is read elsewhere (the runner's watcher, or `check`'s one-shot read)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent.config import Config
from agent.model import Check, Counts, Finding, GpuIdentity, Observation, PciAddress
from agent.probes.device_plugin import MigLayout, plugin_counts, plugin_findings
from agent.probes.nvidia_smi import NvidiaSmiRunner, SmiTable, probe_nvidia_smi
from agent.probes.nvml import NvmlProbe, NvmlSnapshot
from agent.probes.pci import probe_pci


@dataclass
class CycleStats:
    durations: dict[str, float] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)  # checks that could not run this cycle
    smi_timed_out: bool = False


def mig_layout(table: SmiTable | None, nvml: NvmlSnapshot | None) -> MigLayout | None:
    """MIG state per GPU from NVML when it answered, else from nvidia-smi's MIG section."""
    if nvml is not None and nvml.gpus:
        per_gpu = [(g.mig_enabled, g.mig_devices) for g in nvml.gpus]
    elif table is not None and table.gpus:
        per_gpu = [(s.mig_mode == "Enabled", s.mig_devices) for s in table.gpus]
    else:
        return None
    lay = MigLayout()
    for enabled, devices in per_gpu:
        lay.mig_enabled_gpus += enabled
        lay.full_gpus += not enabled
        lay.gpus_with_mig_devices += devices > 0
        lay.mig_devices += devices
    return lay


class CheckSuite:
    def __init__(self, cfg: Config, nvml: NvmlProbe | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.smi = NvidiaSmiRunner(cfg.nvidia_smi, cfg.nvidia_smi_timeout)
        self.nvml = nvml or NvmlProbe(cfg.nvml, cfg.nvml_timeout, cfg.nvml_nvlink)
        self.clock = clock
        self.started = clock()

    def _timed(self, stats: CycleStats, name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.monotonic()
        try:
            return fn()
        finally:
            stats.durations[name] = time.monotonic() - t0

    def run(
        self, node: dict[str, Any] | None, node_error: str | None = None, plugin_grace_s: float | None = None
    ) -> tuple[Observation, CycleStats]:
        """node: the Node object (dict) or None when the plugin check is off; node_error: why the
        Node could not be read (the plugin check then could not run)."""
        stats = CycleStats()
        obs = Observation(expected_gpus=self.cfg.expected_gpus)
        gpus: dict[PciAddress, GpuIdentity] = {}

        smi_findings, table, run = self._timed(stats, Check.NVIDIA_SMI, lambda: probe_nvidia_smi(self.smi))
        stats.smi_timed_out = run.timed_out
        obs.findings += smi_findings
        if table is not None and not any(f.kind == "unparseable" for f in smi_findings):
            obs.counts.nvidia_smi = len(table.gpus)
            for g in table.gpus:
                gpus[g.address] = GpuIdentity(g.address, g.index, g.name)
        else:
            stats.failed.add(Check.NVIDIA_SMI)

        pci_findings, pci_gpus = self._timed(stats, Check.PCI, lambda: probe_pci(self.cfg.sysfs_root))
        obs.findings += pci_findings
        if pci_gpus is None:
            stats.failed.add(Check.PCI)
        else:
            obs.counts.pci = len(pci_gpus)
            for p in pci_gpus:
                gpus.setdefault(p.address, GpuIdentity(p.address))

        nvml_findings, snap = self._timed(stats, Check.NVML, self.nvml.probe)
        obs.findings += nvml_findings
        if any(f.severity.value == "unchecked" for f in nvml_findings):
            stats.failed.add(Check.NVML)
        if snap is not None:
            for ng in snap.gpus:
                if ng.address is not None and ng.address not in gpus:
                    gpus[ng.address] = GpuIdentity(ng.address, ng.index, ng.name)

        if node is not None or node_error is not None:
            t0 = time.monotonic()
            obs.findings += self._plugin(node, node_error, obs.counts, mig_layout(table, snap), plugin_grace_s)
            stats.durations[Check.DEVICE_PLUGIN] = time.monotonic() - t0
            if node is None:
                stats.failed.add(Check.DEVICE_PLUGIN)
        obs.gpus = gpus
        return obs, stats

    def _plugin(
        self,
        node: dict[str, Any] | None,
        node_error: str | None,
        counts: Counts,
        mig: MigLayout | None,
        grace_s: float | None,
    ) -> list[Finding]:
        if node is None:
            return [
                Finding.unchecked(Check.DEVICE_PLUGIN, f"cannot read the Node: {node_error}", kind="node_unreadable")
            ]
        pc = plugin_counts(node, mig, self.cfg.mig_strategy, self.cfg.replicas)
        counts.plugin_capacity = pc.total_capacity
        counts.plugin_allocatable = pc.total_allocatable
        # With nothing advertised the plugin finding says so; a "0 physical GPUs" mismatch would only repeat it.
        counts.plugin_physical = pc.physical if pc.total_capacity else None
        grace = self.cfg.plugin_grace if grace_s is None else grace_s
        left = grace - (self.clock() - self.started)
        return plugin_findings(pc, left <= 0, max(left, 0.0))
