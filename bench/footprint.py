"""Footprint: `gpu-ready run` at default intervals (poll 30 s, heartbeat 5 min) on a simulated 8-GPU host
for N seconds (default 600): peak and steady RSS, average CPU in millicores (psutil).

CPU is counted three ways, so none hides another: the agent process's own CPU; its children's (each poll's
simulated nvidia-smi, itself a Python script: a real nvidia-smi costs what it costs on any agent); and the
agent plus every other process it starts per poll (`spawned_cpu_ms_per_poll`, measured around /bin/true by
bench.common.spawned_cpu_ms: there is none, the agent starts nvidia-smi itself), the honest
figure for what gpu-ready adds. Also the PCI scan's time on a simulated 200-function sysfs (`pci_scan_*_ms`; the
files it reads are counted in tests/test_footprint.py)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.model import PciAddress
from agent.probes.pci import PciScanner, list_pci_gpus
from bench.common import AGENT_DEFAULTS, ProcSampler, launch, millicores, percentile, save, spawned_cpu_ms
from testkit.controlplane import ControlPlane
from testkit.harness import AgentProc, wait_for
from testkit.simhost import SimHost


def start(cp: ControlPlane, python: str | None = None) -> tuple[AgentProc, Any]:
    """python: the interpreter that runs the agent (default: bench.common.runtime_python(), the image's
    packages only; sys.executable is the dev environment)."""
    work = Path(tempfile.mkdtemp(prefix="bench-footprint-"))
    agent = launch(cp, work, "bench-footprint", AGENT_DEFAULTS, python=python)
    sampler = ProcSampler(agent.proc.pid, 1.0).start()  # type: ignore[union-attr]
    return agent, sampler


def pci_scan_ms(functions: int = 200, runs: int = 30) -> dict[str, float]:
    """The best of `runs` PCI scans (ms) of a simulated sysfs with 8 GPUs among `functions` PCI functions: from
    nothing (list_pci_gpus, as `gpu-ready check` does) and with the scanner kept (the agent's every cycle)."""
    host = SimHost(Path(tempfile.mkdtemp(prefix="bench-pci-")) / "host", gpus=8, pcie_bridges=True)
    n = len(os.listdir(host.devices))
    filler = 0
    while n < functions:  # other vendors' functions (bridges, NICs) on another PCI domain
        host.add_pci_function(PciAddress(1, 0x10 + filler // 8, filler % 8), 0, 0x060400, 0x1234, vendor=0x8086)
        filler, n = filler + 1, n + 1
    root = str(host.sysfs)
    scanner = PciScanner(root)
    scanner.scan()

    def best(scan: Callable[[], object]) -> float:
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            scan()
            times.append(time.perf_counter() - t)
        return round(min(times) * 1000, 3)  # the best run: load on the host only adds

    return {"pci_scan_fresh_ms": best(lambda: list_pci_gpus(root)), "pci_scan_kept_ms": best(scanner.scan)}


def finish(agent: AgentProc, sampler: ProcSampler, seconds: float) -> dict[str, Any]:
    wait_for(lambda: (agent.metric("gpu_ready_condition_writes_total") or 0) >= 1, 60, 0.2, "first report")
    end = sampler.samples[0][0] + seconds
    while time.monotonic() < end:
        time.sleep(1)
    sampler.stop()
    cycles = agent.metric("gpu_ready_check_duration_seconds_count", {"check": "nvidia_smi"})
    agent.terminate()
    s = sampler.samples
    t0, _, c0 = s[0]
    t1, _, c1 = s[-1]
    steady = [x for x in s if x[0] - t0 >= 60] or s
    ts, _, cs = steady[0]
    kids = sampler.children
    kids_steady = kids[-1] - kids[len(s) - len(steady)] if len(kids) == len(s) else 0.0
    rss = [x[1] for x in s]
    spawned = spawned_cpu_ms()
    polls_per_s = (cycles or 0) / max(t1 - t0, 1)
    own_steady = (c1 - cs) / max(t1 - ts, 1) * 1000
    res = {
        "python": "dev environment" if agent.args[0] == sys.executable else "runtime packages only (as the image)",
        "seconds": round(t1 - t0),
        "samples": len(s),
        "check_cycles": cycles,
        "rss_peak_mib": round(max(rss) / 2**20, 1),
        "rss_steady_mib": round(percentile([x[1] for x in steady], 50) / 2**20, 1),
        "cpu_avg_millicores": round((c1 - c0) / (t1 - t0) * 1000, 2),
        "cpu_steady_millicores": round(own_steady, 3),
        "cpu_children_steady_millicores": millicores(kids_steady, t1 - ts),
        "spawned_cpu_ms_per_poll": spawned["spawned_ms"],
        "agent_cpu_ms_per_nvidia_smi_run": spawned["agent_ms"],
        "cpu_steady_with_spawned_millicores": round(own_steady + spawned["spawned_ms"] * polls_per_s, 3),
        **pci_scan_ms(),
    }
    save("footprint", res)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--dev-python", action="store_true", help="run the agent with the dev environment's Python")
    a = ap.parse_args()
    with ControlPlane() as cp:
        agent, sampler = start(cp, sys.executable if a.dev_python else None)
        print(finish(agent, sampler, a.seconds))


if __name__ == "__main__":
    main()
