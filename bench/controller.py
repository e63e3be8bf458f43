"""The controller's cost at fleet scale, and the agent's added cost of the fleet brake.

1. `gpu-ready controller` (the real command, its own process, the chart's Job template) watches N simulated GPU
   Nodes on a real apiserver (default 1,000, shaped like GPU nodes: 50 images in status.images, GPU feature
   discovery labels). Meanwhile kubelet's pattern changes the Nodes: a status PATCH per node every
   `--status-period` seconds (kubelet's nodeStatusReportFrequency is 5 min when nothing changes), each a Node watch
   event the controller decodes. Measured over the window: the controller's own API requests (its
   gpu_ready_controller_api_requests_total, which counts every LIST, WATCH, GET, PUT, POST), its RSS and CPU
   (ProcSampler: the kernel's CPU clock of the process). Requests per hour are scaled from the window; watch
   renewals are arithmetic (two watches, each renewed every 10-20 min: 2 x 3600 / 900 = 8 per hour).
2. The agent's brake watch: one ObjectWatch (agent/kube/object_watch.py, what every agent runs) on the brake
   ConfigMap while the controller engages and releases the brake `--flips` times: requests made (one WATCH, no GET),
   bytes read, events seen. Per hour at rest: the watch renewals only (4 per agent).

python -m bench.controller [--nodes 1000] [--seconds 120]"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agent.kube.client import ApiError, KubeApi
from agent.kube.object_watch import ObjectWatch
from bench.common import ProcSampler, machine, millicores, save
from testkit.chart import apply_release, by_kind
from testkit.cluster import create_node, ensure_namespace, now_rfc3339
from testkit.controller import VALUES
from testkit.controlplane import ControlPlane, free_port, terminate_group
from testkit.harness import wait_for

IMAGES = [{"names": [f"registry.example/image-{i}:v{i}"], "sizeBytes": 1_000_000 + i} for i in range(50)]
LABELS = {
    "nvidia.com/gpu.present": "true",
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    "nvidia.com/gpu.count": "8",
    "nvidia.com/cuda.driver.major": "550",
    "feature.node.kubernetes.io/pci-10de.present": "true",
}


def make_nodes(admin: KubeApi, n: int, prefix: str) -> list[str]:
    names = [f"{prefix}-{i:05d}" for i in range(n)]

    def one(name: str) -> None:
        create_node(admin, name, LABELS, {"nvidia.com/gpu": "8"}, status={"images": IMAGES})

    with ThreadPoolExecutor(16) as ex:
        list(ex.map(one, names))
    return names


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def run(cp: ControlPlane, nodes: int = 1000, seconds: float = 120.0, status_period: float = 300.0, flips: int = 10,
        work: Path | None = None) -> dict[str, Any]:  # fmt: skip
    work = work or Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-controller-{secrets.token_hex(3)}"
    work.mkdir(parents=True, exist_ok=True)
    kc = cp.kubeconfig(work / "admin")
    rel = apply_release(cp, kc, "bctl", [*VALUES, "--set", "preflight.auto.brake.maxUnavailable=10%"])
    admin = cp.admin()
    ensure_namespace(admin, rel.ns)
    t0 = time.monotonic()
    names = make_nodes(admin, nodes, f"g{secrets.token_hex(2)}")
    made_s = time.monotonic() - t0
    template = work / "job.yaml"
    template.write_text(by_kind(rel.docs, "ConfigMap")[f"{rel.fullname}-controller-job"]["data"]["job.yaml"])
    from testkit.cluster import bound_token

    token, _ = bound_token(admin, rel.ns, f"{rel.fullname}-controller")
    ckc = cp.kubeconfig(work / "controller", token)
    port = free_port()
    log = open(work / "controller.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent", "controller", f"--kubeconfig={ckc}", f"--namespace={rel.ns}",
         f"--job-template={template}", f"--job-prefix={rel.fullname}-preflight", "--identity=bench",
         f"--lease-name={rel.fullname}-controller", f"--brake={rel.fullname}-brake", "--max-unavailable=10%",
         f"--metrics-address=127.0.0.1:{port}", "--event-namespace=default"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "GPU_READY_LOG_FORMAT": "json"},
    )  # fmt: skip
    sampler = ProcSampler(proc.pid, 1.0).start()
    result: dict[str, Any] = {"nodes": nodes, "node_create_s": round(made_s, 1)}
    try:
        wait_for(lambda: metric(port, "gpu_ready_fleet_gpu_nodes") >= nodes, 120, 0.5, "the controller's caches")
        sync_s = time.monotonic() - t0 - made_s
        req0 = metric(port, "gpu_ready_controller_api_requests_total")
        s0 = sampler.sample()
        stop = threading.Event()
        patches = [0]

        def kubelet() -> None:  # each node's status PATCH every status_period, spread evenly
            rng = random.Random(1)
            interval = status_period / nodes
            while not stop.is_set():
                n = rng.choice(names)
                try:
                    ready = {
                        "type": "Ready", "status": "True", "reason": "KubeletReady", "message": "ok",
                        "lastHeartbeatTime": now_rfc3339(), "lastTransitionTime": "2026-01-01T00:00:00Z",
                    }  # fmt: skip
                    admin.patch_node_status(n, {"status": {"conditions": [ready]}})
                    patches[0] += 1
                except ApiError:
                    pass
                stop.wait(interval)

        # the brake watch of one agent, as every agent runs it
        agent_api = KubeApi.from_token(cp.host, cp.admin_token, cp.ca_file)
        counts: dict[str, int] = {}
        agent_api.on_request = lambda verb, code: counts.__setitem__(verb, counts.get(verb, 0) + 1)
        seen: list[dict[str, Any] | None] = []
        ow = ObjectWatch(agent_api, rel.ns, f"{rel.fullname}-brake", on_change=seen.append).start()
        ow.wait_synced(30)
        th = threading.Thread(target=kubelet, daemon=True)
        th.start()
        w0 = time.monotonic()
        # engage and release the brake `flips` times by tainting 15 % of the nodes and lifting it again
        taint = {"key": "gpu-ready.io/gpu-not-ready", "effect": "NoSchedule"}
        step = seconds / max(1, 2 * flips)
        held = names[: max(1, int(0.15 * nodes))]
        for _ in range(flips):
            for n in held:
                admin.request("PATCH", f"/api/v1/nodes/{n}", {"spec": {"taints": [taint]}},
                              "application/merge-patch+json")  # fmt: skip
            time.sleep(step)
            for n in held:
                admin.request("PATCH", f"/api/v1/nodes/{n}", {"spec": {"taints": None}}, "application/merge-patch+json")
            time.sleep(step)
        window_s = time.monotonic() - w0
        s1 = sampler.sample()
        req1 = metric(port, "gpu_ready_controller_api_requests_total")
        ev1 = ow.stats.events
        # at rest: only kubelet's status patches (no Node held out of service) for half the window
        time.sleep(step)  # the last release written
        r0, q0, ev2 = sampler.sample(), metric(port, "gpu_ready_controller_api_requests_total"), ow.stats.events
        time.sleep(seconds / 2)
        r1, q1 = sampler.sample(), metric(port, "gpu_ready_controller_api_requests_total")
        rest_s = r1[0] - r0[0]
        stop.set()
        th.join(10)
        ow.stop()
        rss = [s[1] for s in sampler.samples if s[0] >= w0]
        per_h = 3600 / window_s
        result.update({
            "sync_after_nodes_created_s": round(sync_s, 1),
            "window_s": round(window_s, 1),
            "node_status_patches": patches[0],
            "node_taint_changes": 2 * flips * len(held),
            "controller_requests": req1 - req0,
            "controller_requests_per_hour_with_brake_flips": round((req1 - req0) * per_h),
            "controller_watch_renewals_per_hour": 8,
            "controller_rss_mib_max": round(max(rss or [s1[1]]) / 2**20, 1),
            "controller_cpu_millicores": millicores(s1[2] - s0[2], s1[0] - s0[0]),
            "node_events_per_s": round((patches[0] + 2 * flips * len(held)) / window_s, 2),
            "agent_brake_watch_requests": dict(counts),
            "agent_brake_watch_events": ow.stats.events,
            "agent_brake_watch_bytes": ow.stats.watch_bytes,
            "agent_brake_changes_seen": len(seen),
            "agent_brake_requests_per_hour_at_rest": 4,
            "rest_window_s": round(rest_s, 1),
            "controller_requests_per_hour_at_rest": round((q1 - q0) * 3600 / rest_s),
            "controller_cpu_millicores_at_rest": millicores(r1[2] - r0[2], rest_s),
            "agent_brake_watch_events_at_rest": ow.stats.events - ev2,
            "agent_brake_watch_events_flips": ev1,
        })  # fmt: skip
    finally:
        sampler.stop()
        terminate_group(proc)
        log.close()
        admin.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--status-period", type=float, default=300)
    ap.add_argument("--flips", type=int, default=10)
    a = ap.parse_args()
    with ControlPlane() as cp:
        r = run(cp, a.nodes, a.seconds, a.status_period, a.flips)
    r["machine"] = machine()
    save("controller", r)
    print(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
