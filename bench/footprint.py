"""Footprint: `gpu-ready run` at default intervals (poll 30 s, heartbeat 5 min) on a simulated 8-GPU host
for N seconds (default 600): peak and steady RSS, average CPU in millicores (psutil)."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import ProcSampler, percentile, save
from testkit.controlplane import ControlPlane
from testkit.harness import AgentProc, launch_agent, wait_for


def start(cp: ControlPlane) -> tuple[AgentProc, Any]:
    defaults = {
        "--poll-interval": "30",
        "--heartbeat-interval": "300",
        "--nvidia-smi-timeout": "30",
        "--event-interval": "300",
        "--plugin-grace": "300",
        "--api-timeout": "10",
    }
    agent, _ = launch_agent(cp, Path(tempfile.mkdtemp(prefix="bench-footprint-")), "bench-footprint", defaults)
    sampler = ProcSampler(agent.proc.pid, 1.0).start()  # type: ignore[union-attr]
    return agent, sampler


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
    rss = [x[1] for x in s]
    res = {
        "seconds": round(t1 - t0),
        "samples": len(s),
        "check_cycles": cycles,
        "rss_peak_mib": round(max(rss) / 2**20, 1),
        "rss_steady_mib": round(percentile([x[1] for x in steady], 50) / 2**20, 1),
        "cpu_avg_millicores": round((c1 - c0) / (t1 - t0) * 1000, 2),
        "cpu_steady_millicores": round((c1 - cs) / max(t1 - ts, 1) * 1000, 2),
    }
    save("footprint", res)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=600)
    a = ap.parse_args()
    with ControlPlane() as cp:
        agent, sampler = start(cp)
        print(finish(agent, sampler, a.seconds))


if __name__ == "__main__":
    main()
