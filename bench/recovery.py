"""Per-GPU recovery, fault -> back in service (docs/recovery.md): on the simulated host (an instant `nvidia-smi -r`
stand-in), the real apiserver with the chart's RBAC and admission policies, the agent process (recovery and evict
on, poll 0.5 s) and the pod-resources stand-in. Each repetition: a pod holds GPU 4 and four pods hold GPUs 0-3;
Xid 119 on GPU 4; timed until GPUReady is True again (the pod evicted, the GPU reset, proven, its latch cleared,
the plugin's pod restarted). The other pods' disturbance is counted: pods on GPUs 0-3 deleted or gone from
pod-resources (0 expected). Then two repetitions with real answers (tests/fixtures/reset-*.txt): a reset refused by
a holder that lets go after the first refusal (refused, retried after the backoff, succeeded; nothing charged for
the refusal), and a platform answering "not supported" (the node remedy, no retry). The row reports each outcome
(`succeeded`, `refused`, `unsupported`) as the agent counted it, and the time of each kind."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import save, summary_ms
from testkit.controlplane import ControlPlane
from testkit.fixture_files import fixture_path
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
            a = n.agent(sock, **{"--recovery-budget": str(reps + 3)})  # the two real-answer runs included
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
                extra = _real_answers(n, a)
                outcomes = {
                    name: int(a.metric("gpu_ready_gpu_resets_total", {"result": label}) or 0)
                    for name, label in (("succeeded", "ok"), ("refused", "refused"), ("unsupported", "unsupported"))
                }
            finally:
                a.terminate()
    finally:
        admin.close()
    res = {
        "repetitions": reps, "poll_interval_s": 0.5, "other_pods_disturbed": disturbed, **summary_ms(times),
        "outcomes": outcomes, **extra,
    }  # fmt: skip
    save("recovery", res)
    return res


def _real_answers(n: Node, a: Any) -> dict[str, float]:
    """A refused-then-succeeded reset and an unsupported one, each timed from the fault (seconds)."""
    bus = n.gpus[K][0].nvml
    refused = fixture_path("reset-refused-persistence-nvsentinel-1690.txt").read_text().replace("00000000:1A:00.0", bus)
    holder = n.host.hold_dev_node(K, 4242, "nv-hostengine")
    n.host.set_reset("ok", refused=refused, held_by_files=(holder,))
    t0 = time.monotonic()
    n.host.append_xid(119, gpu=K, text="Timeout after 6s of waiting for RPC response from GPU4 GSP!")
    n.sync(advertised=set(range(8)) - {K})
    wait_for(lambda: (a.metric("gpu_ready_gpu_resets_total", {"result": "refused"}) or 0) >= 1, 60, 0.02, "refused")
    (holder / "fd" / "3").unlink()  # the holder lets go
    holder.joinpath("fd").rmdir()
    holder.joinpath("comm").unlink()
    holder.rmdir()
    wait_for(lambda: (n.kubelet_step(), (n.gpu_ready() or {}).get("status") == "True")[1], 120, 0.02, "back")
    refused_s = time.monotonic() - t0
    no = fixture_path("reset-unsupported-not-supported-constructed.txt").read_text().replace("00000000:BB:00.0", bus)
    n.host.set_reset("answer", answer=no, exit_code=3)
    t0 = time.monotonic()
    n.host.append_xid(119, gpu=K, text="Timeout after 6s of waiting for RPC response from GPU4 GSP!")
    n.sync(advertised=set(range(8)) - {K})
    wait_for(lambda: "reset unsupported" in (n.gpu_ready() or {}).get("message", ""), 60, 0.02, "the node remedy")
    return {"refused_then_back_s": round(refused_s, 2), "unsupported_to_node_remedy_s": round(time.monotonic() - t0, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    with ControlPlane() as cp:
        r = run(cp, a.reps)
    print(
        f"recovery, Xid 119 -> GPU back in service over {r['n']} repetitions (simulated host, instant reset, poll "
        f"0.5 s): p50 {r['p50_ms']} ms, p90 {r['p90_ms']} ms, max {r['max_ms']} ms; other GPUs' pods disturbed: "
        f"{r['other_pods_disturbed']}; outcomes {r['outcomes']}; refused once then back "
        f"{r['refused_then_back_s']} s, unsupported -> node remedy {r['unsupported_to_node_remedy_s']} s"
    )


if __name__ == "__main__":
    main()
