"""`make demo`: a local control plane, a simulated 8-GPU node, and the real agent walking through
healthy -> ERR! -> Xid 79 -> manual clear -> healthy. Prints what `kubectl describe node` shows at each
step, then stops everything it started."""

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

from testkit.cluster import AGENT_RULES, condition, create_node, service_account_client
from testkit.controlplane import ControlPlane, free_port
from testkit.simhost import SimHost

NODE = "gpu-node-1"


def describe(kubeconfig: Path) -> str:
    """The Conditions and Events sections of `kubectl describe node`."""
    kubectl = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    if kubectl is None:
        return "(kubectl not found; install the dev extras)"
    out = subprocess.run(
        [kubectl, "--kubeconfig", str(kubeconfig), "describe", "node", NODE], capture_output=True, text=True, timeout=30
    ).stdout
    keep, section = [], None
    for line in out.splitlines():
        if line and not line[0].isspace():
            section = line.split(":", 1)[0]
        if section in ("Conditions", "Events"):
            keep.append(line)
    return "\n".join(keep)


def wait(api, status: str, reason: str | None = None, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c = condition(api.get_node(NODE), "GPUReady")
        if c and c["status"] == status and (reason is None or c["reason"] == reason):
            return
        time.sleep(0.1)
    raise TimeoutError(f"GPUReady did not become {status} {reason or ''}")


def step(title: str, kubeconfig: Path) -> None:
    print(f"\n=== {title} " + "=" * max(0, 76 - len(title)))
    print(describe(kubeconfig))
    sys.stdout.flush()


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="gpu-ready-demo-"))
    cp = ControlPlane(workdir=str(work / "cp"))
    agent: subprocess.Popen[bytes] | None = None
    try:
        print(f"Starting kube-apiserver + etcd from {cp.bin_dir} ...")
        cp.start()
        print(f"Control plane ready in {cp.start_seconds:.1f}s at {cp.host}")
        admin = cp.admin()
        host = SimHost(work / "host", gpus=8)
        create_node(
            admin,
            NODE,
            {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            host.plugin_resources(),
        )
        _, info = service_account_client(admin, AGENT_RULES, namespace="gpu-ready", pod_on_node=NODE)
        agent_kc = cp.kubeconfig(work / "agent.kubeconfig", info["token"], user="gpu-ready")
        admin_kc = cp.kubeconfig(work / "admin.kubeconfig")
        print(f"Registered {NODE} with nvidia.com/gpu=8; simulated host in {host.root}")
        log = open(work / "agent.log", "wb")  # noqa: SIM115
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agent.cli",
                "run",
                "--node-name",
                NODE,
                "--kubeconfig",
                str(agent_kc),
                "--poll-interval",
                "1",
                "--recovery-polls",
                "2",
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
        wait(admin, "True")
        step("1. healthy: 8 GPUs, nothing wrong", admin_kc)

        host.set_smi(err={2: ("Fan", "Temp", "Pwr:Usage")})
        wait(admin, "False", "NvidiaSmiErr")
        step("2. nvidia-smi shows ERR! on GPU 2", admin_kc)

        host.set_smi()
        host.append_xid(79, 5)
        wait(admin, "False", "FatalXid")
        step("3. kernel log: Xid 79, GPU 5 fell off the bus (latched until reboot or clear)", admin_kc)

        time.sleep(1.1)
        before = (datetime.now(UTC) + timedelta(seconds=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
        print(f"\n$ kubectl annotate node {NODE} gpu-ready.io/clear-before={before}")
        admin.patch_node(NODE, {"metadata": {"annotations": {"gpu-ready.io/clear-before": before}}})
        wait(admin, "True")
        step("4. operator cleared the latched fault after repair: healthy again", admin_kc)
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
