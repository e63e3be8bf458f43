"""Per-GPU recovery, fault -> back in service (docs/recovery.md): on the simulated host (an instant `nvidia-smi -r`
stand-in), the real apiserver with the chart's RBAC and admission policies, the agent process (recovery and evict
on, poll 0.5 s) and the pod-resources stand-in. Each repetition: a pod holds GPU 4 and four pods hold GPUs 0-3;
Xid 119 on GPU 4; timed until GPUReady is True again (the pod evicted, the GPU reset, proven, its latch cleared,
the plugin's pod restarted). The other pods' disturbance is counted: pods on GPUs 0-3 deleted or gone from
pod-resources (0 expected)."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import save, summary_ms
from testkit.controlplane import ControlPlane
from testkit.harness import wait_for
from testkit.podresources import serve_pod_resources
from testkit.recovery import Node, recovery_release

K = 4


def run(cp: ControlPlane, reps: int = 10) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    rel, plugin_ns, uid = recovery_release(cp, cp.kubeconfig(tmp / "admin"))
    admin = cp.admin()
    times: list[float] = []
    disturbed = 0
    try:
        n = Node(cp, admin, rel, plugin_ns, uid, tmp)
        with serve_pod_resources() as (sock, k):
            n.kubelet = k
            n.sync(advertised=set(range(8)))
            for i in range(4):
                n.add_pod(f"other-{i}", i)
            n.add_plugin_pod()
            a = n.agent(sock, **{"--recovery-budget": str(reps + 1)})
            try:
                a.wait_status(admin, "True", timeout=60)
                for r in range(reps):
                    n.add_pod(f"train-{r}", K)
                    wait_for(
                        lambda: a.metric("gpu_ready_gpu_pods", {"pci_bus_id": n.gpus[K][0].nvml}) == 1.0,
                        30,
                        0.05,
                        "the agent sees the pod on GPU 4",
                    )
                    before = len(n.host.resets())
                    t0 = time.monotonic()
                    n.host.append_xid(119, gpu=K, text="Timeout after 6s of waiting for RPC response from GPU4 GSP!")
                    n.sync(advertised=set(range(8)) - {K})

                    def back() -> bool:
                        n.kubelet_step()
                        c = n.gpu_ready()
                        return bool(c and c["status"] == "True" and len(n.host.resets()) > before)  # noqa: B023

                    wait_for(back, 120, 0.02, "GPU 4 back in service")
                    times.append(time.monotonic() - t0)
                    wait_for(lambda: (n.kubelet_step(), n.plugin_restarts >= r + 1)[1], 30, 0.05, "plugin restart")  # noqa: B023
                disturbed = sum(1 for i in range(4) if f"other-{i}" not in n.pods)
                for i in range(4):
                    p = admin.request("GET", f"/api/v1/namespaces/{n.ns}/pods/other-{i}")
                    disturbed += bool(p["metadata"].get("deletionTimestamp"))
            finally:
                a.terminate()
    finally:
        admin.close()
    res = {"repetitions": reps, "poll_interval_s": 0.5, "other_pods_disturbed": disturbed, **summary_ms(times)}
    save("recovery", res)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    with ControlPlane() as cp:
        r = run(cp, a.reps)
    print(
        f"recovery, Xid 119 -> GPU back in service over {r['n']} repetitions (simulated host, instant reset, poll "
        f"0.5 s): p50 {r['p50_ms']} ms, p90 {r['p90_ms']} ms, max {r['max_ms']} ms; other GPUs' pods disturbed: "
        f"{r['other_pods_disturbed']}"
    )


if __name__ == "__main__":
    main()
