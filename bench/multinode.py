"""The per-poll cost of the multi-node probes (docs/fabric.md) on simulated sysfs trees in the kernel's formats: the
InfiniBand rails probe on an HGX layout (8 GPUs each beside a ConnectX rail: 8 ports, 8 small files each, and the
GPU-to-rail map from the sysfs paths), the fabric manager's NVSwitch scan (the PCI listing with 4 NVSwitches), and
the fabric probe judging NVML's readings of 8 GPUs (no I/O of its own). Best of the runs: load only adds."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from agent.model import Check, ProbeResult
from agent.probes.base import ProbeContext
from agent.probes.fabric import FabricInfo, FabricProbe
from agent.probes.fabric_manager import FabricManagerProbe
from agent.probes.infiniband import IbThresholds, InfinibandProbe
from agent.probes.nvml import NvmlGpu, NvmlSnapshot
from agent.probes.pci import PciProbe
from bench.parsing import best_ms
from testkit.simhost import SimHost

POLLS = 200  # one timing covers this many polls (a poll is well under a millisecond)


def run() -> dict[str, object]:
    with tempfile.TemporaryDirectory() as d:
        host = SimHost(Path(d) / "hgx", pcie_bridges=True)
        for i in range(8):
            host.add_rail(f"mlx5_{i}", gpu=i)
        ctx = ProbeContext()
        ctx.results[Check.PCI] = PciProbe(str(host.sysfs)).read(ctx)
        ib = InfinibandProbe(str(host.sysfs), thresholds=IbThresholds(expected_nics=8))
        fm = FabricManagerProbe(str(host.sysfs))
        snap = NvmlSnapshot(gpus=[NvmlGpu(i, g.address) for i, g in enumerate(host.gpus)])
        for g in snap.gpus:
            assert g.address is not None
            g.fabric = FabricInfo(g.address, "Completed", "Success", 0, None, {})
        nvml_ctx = ProbeContext()
        nvml_ctx.results[Check.NVML] = ProbeResult(Check.NVML, payload=snap)
        fabric = FabricProbe("auto", smi=None)

        def polls(fn, c):
            def go() -> None:
                for _ in range(POLLS):
                    fn(c)

            return go

        assert ib.read(ctx).payload.gpu_rails, "every GPU has its rail"
        ib_ms = best_ms(polls(ib.read, ctx)) / POLLS
        fm.read(ctx)  # the first scan reads each function's vendor and class; later polls list the directory
        fm_ms = best_ms(polls(fm.read, ctx)) / POLLS
        fabric_ms = best_ms(polls(fabric.read, nvml_ctx)) / POLLS
    total = ib_ms + fm_ms + fabric_ms
    return {
        "infiniband_8_rails_ms": round(ib_ms, 4),
        "fabric_manager_scan_ms": round(fm_ms, 4),
        "fabric_from_nvml_8_gpus_ms": round(fabric_ms, 4),
        "multinode_per_poll_ms": round(total, 4),
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
