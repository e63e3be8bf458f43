"""`make demo`: a local control plane with the real kube-scheduler, a simulated 8-GPU node that joins with
gpu-ready's startup taint, and the real agent (taints in continuous mode) walking through
joined (GPU Pod Pending) -> healthy (taint removed, Pod bound) -> ERR! -> Xid 79 (tainted, a new Pod stays
Pending) -> manual clear -> healthy (Pod bound). Prints what `kubectl describe node` and `kubectl get pods`
show at each step, then stops everything it started."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from agent.kube.client import KubeApi
from testkit.cluster import AGENT_RULES, condition, create_node, service_account_client
from testkit.controlplane import ControlPlane, free_port
from testkit.simhost import SimHost

NODE = "gpu-node-1"
NAMESPACE = "ml"
TAINT_KEY = "gpu-ready.io/gpu-not-ready"
# The agent's rules plus `patch nodes` for its taint (the chart grants it only with taints.enabled).
TAINT_RULES = [*AGENT_RULES, {"apiGroups": [""], "resources": ["nodes"], "verbs": ["patch"]}]
POD_COLUMNS = (
    "NAME:.metadata.name,NODE:.spec.nodeName,"
    'SCHEDULED:.status.conditions[?(@.type=="PodScheduled")].status,'
    'REASON:.status.conditions[?(@.type=="PodScheduled")].reason'
)


def kubectl(kubeconfig: Path, *args: str) -> str:
    exe = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    if exe is None:
        return "(kubectl not found; install the dev extras)"
    r = subprocess.run([exe, "--kubeconfig", str(kubeconfig), *args], capture_output=True, text=True, timeout=30)
    return r.stdout.rstrip("\n")


def describe(kubeconfig: Path) -> str:
    """The Taints, Conditions and Events sections of `kubectl describe node`."""
    keep, section = [], None
    for line in kubectl(kubeconfig, "describe", "node", NODE).splitlines():
        if line and not line[0].isspace():
            section = line.split(":", 1)[0]
        if section in ("Taints", "Conditions", "Events"):
            keep.append(line)
    return "\n".join(keep)


def took(seconds: float) -> str:
    return f"{seconds:.2f}s" if seconds >= 0.02 else "within one 20 ms poll"


def wait_for(what: str, pred, timeout: float = 30.0) -> float:
    """Polls pred every 20 ms; returns the monotonic time it first held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return time.monotonic()
        time.sleep(0.02)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def wait(api, status: str, reason: str | None = None, timeout: float = 30.0) -> float:
    def ok() -> bool:
        c = condition(api.get_node(NODE), "GPUReady")
        return bool(c and c["status"] == status and (reason is None or c["reason"] == reason))

    return wait_for(f"GPUReady={status} {reason or ''}", ok, timeout)


def step(title: str, kubeconfig: Path, pods: bool = True) -> None:
    print(f"\n=== {title} " + "=" * max(0, 76 - len(title)))
    print(describe(kubeconfig))
    if pods:
        print(f"\n$ kubectl get pods -n {NAMESPACE}")
        print(kubectl(kubeconfig, "get", "pods", "-n", NAMESPACE, "-o", f"custom-columns={POD_COLUMNS}"))
    sys.stdout.flush()


def join_with_startup_taint(admin: KubeApi) -> None:
    """As a kubelet started with --register-with-taints would leave the Node once it posts Ready: the
    apiserver's not-ready taint gone (the node lifecycle controller's job, not run here), gpu-ready's
    startup taint kept."""
    taints = admin.get_node(NODE)["spec"].get("taints") or []
    keep = [t for t in taints if t.get("key") != "node.kubernetes.io/not-ready"]
    admin.request(
        "PATCH",
        f"/api/v1/nodes/{NODE}",
        [{"op": "test", "path": "/spec/taints", "value": taints}, {"op": "add", "path": "/spec/taints", "value": keep}],
        "application/json-patch+json",
    )


def gpu_pod(admin: KubeApi, name: str) -> None:
    admin.request(
        "POST",
        f"/api/v1/namespaces/{NAMESPACE}/pods",
        {
            "metadata": {"name": name},
            "spec": {
                "containers": [{"name": "train", "image": "cuda:12", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]
            },
        },
    )


def pod_bound(admin: KubeApi, name: str) -> bool:
    return bool(admin.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")["spec"].get("nodeName"))


def pod_unschedulable(admin: KubeApi, name: str) -> bool:
    pod = admin.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conds)


def tainted(admin: KubeApi) -> bool:
    return any(t.get("key") == TAINT_KEY for t in admin.get_node(NODE)["spec"].get("taints") or [])


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="gpu-ready-demo-"))
    cp = ControlPlane(workdir=str(work / "cp"))
    agent: subprocess.Popen[bytes] | None = None
    try:
        print(f"Starting kube-apiserver + etcd + kube-scheduler from {cp.bin_dir} ...")
        cp.start()
        cp.start_scheduler()
        print(f"Control plane ready in {cp.start_seconds:.1f}s at {cp.host}")
        admin = cp.admin()
        host = SimHost(work / "host", gpus=8)
        create_node(
            admin,
            NODE,
            {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            host.plugin_resources(),
            taints=[{"key": TAINT_KEY, "value": "pending", "effect": "NoSchedule"}],
        )
        join_with_startup_taint(admin)
        _, info = service_account_client(admin, TAINT_RULES, namespace="gpu-ready", pod_on_node=NODE)
        agent_kc = cp.kubeconfig(work / "agent.kubeconfig", info["token"], user="gpu-ready")
        admin_kc = cp.kubeconfig(work / "admin.kubeconfig")
        admin.request("POST", "/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})
        print(f"Registered {NODE} with nvidia.com/gpu=8 and the startup taint; simulated host in {host.root}")
        gpu_pod(admin, "train-1")
        wait_for("train-1 to be unschedulable", lambda: pod_unschedulable(admin, "train-1"))
        step("0. the node joined with gpu-ready's startup taint: the GPU Pod waits", admin_kc)
        log = open(work / "agent.log", "wb")  # noqa: SIM115
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agent.cli",
                "run",
                "--node",
                NODE,
                "--kubeconfig",
                str(agent_kc),
                "--poll-interval",
                "1",
                "--recovery-polls",
                "2",
                "--taints",
                "continuous",
                "--metrics-address",
                f"127.0.0.1:{free_port()}",
                "--log-format",
                "json",
                *host.agent_args(),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        t_true = wait(admin, "True")
        t_bound = wait_for("train-1 to be bound", lambda: pod_bound(admin, "train-1"))
        wait_for("the startup taint to go", lambda: not tainted(admin))
        step("1. healthy: 8 GPUs, nothing wrong; taint removed, the Pod is bound", admin_kc)
        print(f"(GPUReady=True -> train-1 bound: {took(t_bound - t_true)})")

        host.set_smi(err={2: ("Fan", "Temp", "Pwr:Usage")})
        wait(admin, "False", "NvidiaSmiErr")
        wait_for("the taint", lambda: tainted(admin))
        step("2. nvidia-smi shows ERR! on GPU 2: tainted (continuous mode)", admin_kc, pods=False)

        host.set_smi()
        t_xid = time.monotonic()
        host.append_xid(79, 5)
        t_false = wait(admin, "False", "FatalXid")
        gpu_pod(admin, "train-2")
        wait_for("train-2 to be unschedulable", lambda: pod_unschedulable(admin, "train-2"))
        step("3. kernel log: Xid 79, GPU 5 fell off the bus (latched until reboot or clear)", admin_kc)
        print(f"(Xid 79 in the kernel log -> GPUReady=False/FatalXid seen: {took(t_false - t_xid)})")

        before = (datetime.now(UTC) + timedelta(seconds=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
        print(f"\n$ kubectl annotate node {NODE} gpu-ready.io/clear-before={before}")
        admin.patch_node(NODE, {"metadata": {"annotations": {"gpu-ready.io/clear-before": before}}})
        t_true = wait(admin, "True")
        t_bound = wait_for("train-2 to be bound", lambda: pod_bound(admin, "train-2"))
        step("4. operator cleared the latched fault after repair: healthy again, train-2 bound", admin_kc)
        print(f"(GPUReady=True -> train-2 bound: {took(t_bound - t_true)})")
        return 0
    finally:
        if agent is not None and agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(agent.pid, signal.SIGKILL)
        cp.stop()
        shutil.rmtree(work, ignore_errors=True)
        print("\nDemo finished; control plane and agent stopped.")


if __name__ == "__main__":
    sys.exit(main())
