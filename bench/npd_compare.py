"""gpu-ready and node-problem-detector side by side: both read the real /dev/kmsg (NPD's kmsg monitor
cannot read anything else) and report to the same apiserver and Node. NPD gets a kernel-monitor rule that
turns Xid 79 into a permanent condition. For each repetition an Xid 79 record is written to /dev/kmsg and
both detection times are taken from one watch on the Node. NPD is restarted per repetition because its
permanent condition never clears otherwise (its restart resets it). Needs root and a writable /dev/kmsg.

Then the steady state side by side: NPD started once more, and after a warm-up both processes are sampled
over the same window (`--steady-seconds`) for RSS and CPU. gpu-ready runs at its default intervals (poll
30 s) with the image's packages only (bench.common.runtime_python); its CPU is given as the process's own and
with what every other process it starts per poll costs added (bench.common.spawned_cpu_ms: nvidia-smi itself
not counted, nothing else: the agent starts nvidia-smi itself); NPD runs no child process. Both agents' CPU and
RSS come from the same sampler over the same window, so the ratios compare one run."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from agent.kernel_log.source import KmsgSource
from agent.kernel_log.xid import KernelLogParser
from bench.common import (
    AGENT_DEFAULTS,
    NodeWatch,
    ProcSampler,
    condition,
    launch,
    percentile,
    save,
    spawned_cpu_ms,
    summary_ms,
    window,
)
from testkit.controlplane import REPO, ControlPlane, free_port, terminate_group

NPD_CONDITION = "GPUFallenOffBus"


def npd_binary() -> str:
    r = subprocess.run([str(REPO / "tools" / "npd" / "build.sh")], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"cannot build node-problem-detector: {r.stderr[-2000:]}")
    return r.stdout.strip()


def npd_config(path: Path) -> Path:
    path.write_text(
        json.dumps(
            {
                "plugin": "kmsg",
                "logPath": "/dev/kmsg",
                "bufferSize": 10,
                "source": "gpu-xid-monitor",
                "conditions": [{"type": NPD_CONDITION, "reason": "NoXid79", "message": "no Xid 79 seen"}],
                "rules": [
                    {
                        "type": "permanent",
                        "condition": NPD_CONDITION,
                        "reason": "Xid79GPUFellOffTheBus",
                        "pattern": r"NVRM: Xid \(PCI:[0-9a-fA-F:]+\): 79,.*",
                    }
                ],
            }
        )
    )
    return path


def addresses_in_ring_buffer() -> set[int]:
    """Bus numbers of Xid records already in the real kernel ring buffer (from earlier runs)."""
    src, parser, buses = KmsgSource("/dev/kmsg", trust_user=True), KernelLogParser(), set()
    for recs in src.drain():
        for r in recs:
            for ev in parser.feed(r.text):
                if ev.address is not None:
                    buses.add(ev.address.bus)
    src.close()
    return buses


def run(cp: ControlPlane, reps: int = 10, steady_s: float = 120.0, warmup_s: float = 15.0) -> dict[str, Any]:
    if os.geteuid() != 0 or not os.access("/dev/kmsg", os.W_OK):
        return {"skipped": "needs root and a writable /dev/kmsg (both agents read the real kernel log)"}
    npd = npd_binary()
    work = Path(tempfile.mkdtemp(prefix="bench-npd-"))
    agent = launch(cp, work, "bench-npd", AGENT_DEFAULTS, kmsg="/dev/kmsg", env={"GPU_READY_KMSG_TRUST_USER": "true"})
    node = agent.node
    kc = cp.kubeconfig(work / "npd.kubeconfig")
    cfg = npd_config(work / "gpu-xid-monitor.json")
    seen: dict[str, Any] = {}
    cv = threading.Condition()

    def on_event(obj: dict[str, Any], t: float) -> None:
        g, n = condition(obj, "GPUReady"), condition(obj, NPD_CONDITION)
        with cv:
            seen["gpu"] = (g or {}).get("message", "")
            seen["npd"] = (n or {}).get("status")
            seen["t"] = t
            # gpu-ready: the first change of its condition after the write (each new latched fault changes
            # the message; with many earlier records in the ring buffer the new GPU may sit in "(+N more)")
            if seen.get("want") and seen["gpu"] != seen.get("before") and "t_gpu" not in seen:
                seen["t_gpu"] = t
            if seen.get("want") and seen["npd"] == "True" and "t_npd" not in seen:
                seen["t_npd"] = t
            cv.notify_all()

    watch = NodeWatch(cp, node, on_event).start()
    gpu_lat, npd_lat, npd_rss, agent_rss = [], [], [], []
    agent_sampler = ProcSampler(agent.proc.pid, 0.5).start()  # type: ignore[union-attr]
    steady: dict[str, Any] = {}

    def start_npd() -> tuple[subprocess.Popen[bytes], Any]:
        log = open(work / "npd.log", "ab")  # noqa: SIM115
        p = subprocess.Popen(
            [
                npd,
                f"--config.system-log-monitor={cfg}",
                f"--hostname-override={node}",
                f"--apiserver-override={cp.host}?inClusterConfig=false&auth={kc}",
                "--address=127.0.0.1",
                f"--port={free_port()}",
                "--prometheus-address=127.0.0.1",
                f"--prometheus-port={free_port()}",
                "--k8s-exporter-heartbeat-period=5m",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return p, log

    used = addresses_in_ring_buffer()  # a GPU already latched from an earlier record would not change anything
    try:
        with cv:
            cv.wait_for(lambda: seen.get("gpu") is not None and seen.get("gpu") != "", 60)
        for _ in range(reps):
            p, log = start_npd()
            sampler = ProcSampler(p.pid, 0.25).start()
            with cv:
                if not cv.wait_for(lambda: seen.get("npd") == "False", 60):
                    raise RuntimeError(
                        "NPD never initialised its condition:\n" + (work / "npd.log").read_text()[-3000:]
                    )
            time.sleep(1.0)  # let NPD's kmsg watcher settle past its start time
            bus = random.choice([b for b in range(0x10, 0xF0) if b not in used])
            used.add(bus)
            addr = f"0000:{bus:02x}:00"
            with cv:
                seen.pop("t_gpu", None)
                seen.pop("t_npd", None)
                seen["before"] = seen.get("gpu")
                seen["want"] = f"GPU 00000000:{bus:02X}:00.0"
            t0 = time.monotonic()
            with open("/dev/kmsg", "w") as fh:
                fh.write(
                    f"<3>NVRM: Xid (PCI:{addr}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
                )
            with cv:
                ok = cv.wait_for(lambda: "t_gpu" in seen and "t_npd" in seen, 30)
            if not ok:
                raise RuntimeError(f"detection timed out: {seen}\n{agent.logs()[-2000:]}")
            gpu_lat.append(seen["t_gpu"] - t0)
            npd_lat.append(seen["t_npd"] - t0)
            sampler.stop()
            npd_rss += [s[1] for s in sampler.samples]
            terminate_group(p)
            log.close()
            with cv:
                seen["want"] = None
                cv.wait_for(lambda: seen.get("npd") != "True", 2)  # NPD restart resets; not waited for
        if steady_s > 0:
            steady = steady_side_by_side(start_npd, agent_sampler, seen, cv, steady_s, warmup_s)
    finally:
        agent_sampler.stop()
        agent_rss = [s[1] for s in agent_sampler.samples]
        watch.stop()
        agent.terminate()
    g, n = summary_ms(gpu_lat), summary_ms(npd_lat)
    res: dict[str, Any] = {
        "repetitions": reps,
        "gpu_ready": g,
        "npd": n,
        "npd_version": Path(npd).parent.name,
        "latency_ratio_p50_npd_over_gpu_ready": round(n["p50_ms"] / g["p50_ms"], 1),
        "gpu_ready_rss_mib": {
            "median": round(percentile(agent_rss, 50) / 2**20, 1),
            "peak": round(max(agent_rss) / 2**20, 1),
        },
        "npd_rss_mib": {"median": round(percentile(npd_rss, 50) / 2**20, 1), "peak": round(max(npd_rss) / 2**20, 1)},
    }
    res["rss_ratio_gpu_ready_over_npd"] = round(res["gpu_ready_rss_mib"]["median"] / res["npd_rss_mib"]["median"], 2)
    if steady:
        res["steady"] = steady
    save("npd_compare", res)
    return res


def steady_side_by_side(
    start_npd: Any,
    agent_sampler: ProcSampler,
    seen: dict[str, Any],
    cv: threading.Condition,
    secs: float,
    warmup: float,
) -> dict[str, Any]:
    """Both agents idle on the same node for `secs` after `warmup`: RSS medians and CPU over one window."""
    p, log = start_npd()
    sampler = ProcSampler(p.pid, 1.0).start()
    try:
        with cv:
            if not cv.wait_for(lambda: seen.get("npd") == "False", 60):
                raise RuntimeError("NPD never initialised its condition (steady phase)")
        t_from = time.monotonic() + warmup
        end = t_from + secs
        while time.monotonic() < end + 1.5:  # the measurement window itself (samples every second)
            time.sleep(0.5)
        sampler.stop()
        g, n = window(agent_sampler, t_from, end + 1.5), window(sampler, t_from, end + 1.5)
    finally:
        sampler.stop()
        terminate_group(p)
        log.close()
    spawned = spawned_cpu_ms()
    poll_s = float(AGENT_DEFAULTS["--poll-interval"])
    g_total = round(g["cpu_millicores"] + spawned["spawned_ms"] / poll_s, 3)
    return {
        "window_s": g["seconds"],
        "warmup_s": warmup,
        "gpu_ready": {
            **g,
            "spawned_cpu_ms_per_poll": spawned["spawned_ms"],
            "agent_cpu_ms_per_nvidia_smi_run": spawned["agent_ms"],
            "cpu_with_spawned_millicores": g_total,
        },
        "npd": n,
        "rss_ratio_gpu_ready_over_npd": round(g["rss_median_mib"] / n["rss_median_mib"], 2),
        "cpu_ratio_gpu_ready_over_npd": round(g["cpu_millicores"] / max(n["cpu_millicores"], 1e-9), 2),
        "cpu_ratio_with_spawned": round(g_total / max(n["cpu_millicores"], 1e-9), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--steady-seconds", type=float, default=120.0, help="side-by-side idle window (0: none)")
    a = ap.parse_args()
    with ControlPlane() as cp:
        r = run(cp, a.reps, a.steady_seconds)
    print(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
