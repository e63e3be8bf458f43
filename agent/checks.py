"""Runs every level check once and gathers their results into one Observation.
Every probe returns a ProbeResult (findings, GPUs, count, whether it ran); this module only combines
them and never looks inside findings. The kernel log is read elsewhere (kmsg_watch, or `check`'s
one-shot read)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.config import Config
from agent.model import Check, GpuIdentity, Observation, PciAddress, ProbeResult
from agent.probes.device_plugin import MigLayout, probe_device_plugin
from agent.probes.nvidia_smi import NvidiaSmiRunner, probe_nvidia_smi
from agent.probes.nvml import NvmlProbe, probe_nvml
from agent.probes.pci import probe_pci


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
    def __init__(self, cfg: Config, nvml: NvmlProbe | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.smi = NvidiaSmiRunner(cfg.nvidia_smi, cfg.nvidia_smi_timeout)
        self.nvml = nvml or NvmlProbe(cfg.nvml, cfg.nvml_timeout, cfg.nvml_nvlink)
        self.clock = clock
        self.started = clock()

    def run(
        self, node: dict[str, Any] | None, node_error: str | None = None, plugin_grace_s: float | None = None
    ) -> tuple[Observation, CycleStats]:
        """node: the Node object (dict) or None when the plugin check is off; node_error: why the
        Node could not be read (the plugin check then could not run)."""
        stats = CycleStats()
        obs = Observation(expected_gpus=self.cfg.expected_gpus)

        smi = self._timed(stats, lambda: probe_nvidia_smi(self.smi))
        pci = self._timed(stats, lambda: probe_pci(self.cfg.sysfs_root))
        nvml = self._timed(stats, lambda: probe_nvml(self.nvml))
        stats.smi_timed_out = smi.timed_out
        obs.counts.nvidia_smi, obs.counts.pci = smi.count, pci.count
        results = [smi, pci, nvml]
        if node is not None or node_error is not None:
            grace = self.cfg.plugin_grace if plugin_grace_s is None else plugin_grace_s
            mig = mig_layout(nvml.gpus) or mig_layout(smi.gpus)
            plugin = self._timed(
                stats,
                lambda: probe_device_plugin(
                    node,
                    node_error,
                    mig,
                    self.cfg.mig_strategy,
                    self.cfg.replicas,
                    grace - (self.clock() - self.started),
                ),
            )
            obs.counts.plugin_capacity = plugin.counts.get("plugin_capacity")
            obs.counts.plugin_allocatable = plugin.counts.get("plugin_allocatable")
            obs.counts.plugin_physical = plugin.count
            results.append(plugin)
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
        return obs, stats

    @staticmethod
    def _timed(stats: CycleStats, fn: Callable[[], ProbeResult]) -> ProbeResult:
        t0 = time.monotonic()
        result = fn()
        stats.durations[result.check] = time.monotonic() - t0
        return result
