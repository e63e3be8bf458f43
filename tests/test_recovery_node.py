"""Per-GPU recovery against the real kubelet (docs/recovery.md): kubelet + containerd on this host (testkit/realnode),
the test device plugin (testkit/deviceplugin.py) serving the simulated host's 8 GPUs as time-sliced replicas (two per
GPU), real Pods (the pause image) holding them, a real DaemonSet standing for the device plugin's DaemonSet (the
daemonset controller re-creates its pod), the chart's RBAC and admission policies with recovery on, and the agent a
host process reading kubelet's own pod-resources socket.

Xid 119 on GPU 4 with two Pods on it and four on other GPUs: the plugin marks GPU 4 unhealthy (as the NVIDIA plugin
does on an Xid); the agent evicts exactly the two Pods (kubelet stops them and pod-resources drops them), resets GPU 4
once, proves it, clears its latch, deletes the plugin DaemonSet's pod on the node; the DaemonSet starts a new one,
which advertises GPU 4 healthy again (the test plugin stands for the restarted plugin); a new Pod lands on GPU 4.
Measured: fault -> GPUReady=True again, fault -> a new Pod running on GPU 4, and the other Pods' disturbance (0:
never deleted, never restarted, still listed by kubelet)."""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agent.kube.client import ApiError, KubeApi
from testkit.chart import Release, apply_release
from testkit.cluster import EVENT_NAMESPACE, bound_token, ensure_namespace
from testkit.deviceplugin import DevicePlugin, replica_ids, wait_registered
from testkit.harness import AgentProc, wait_for
from testkit.node import NodeControlPlane, RealNode
from testkit.realnode import real_node
from testkit.simhost import SimHost

pytestmark = [pytest.mark.node, pytest.mark.slow]

NODE = "gpu-node-recovery"
GPU = "nvidia.com/gpu"
REPLICAS = 2
K = 4
DS = "test-device-plugin"
TIMES: dict[str, float] = {}


@dataclass
class Env:
    cp: NodeControlPlane
    node: RealNode
    api: KubeApi
    sim: SimHost
    workdir: Path
    pause: str
    plugin: DevicePlugin | None = None
    agent: AgentProc | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    work = tmp_path_factory.mktemp("recnode")
    sim = SimHost(work / "sim", gpus=8)
    labels = {"nvidia.com/gpu.present": "true", f"{GPU}.replicas": str(REPLICAS)}  # time-slicing, as GFD labels it
    with real_node(NODE, labels=labels, tag="recovery node") as booted:
        e = Env(booted.cp, booted.node, booted.api, sim, work, booted.pause)
        try:
            yield e
        finally:
            if e.agent is not None:
                with contextlib.suppress(Exception):
                    e.agent.terminate()
            if e.plugin is not None:
                with contextlib.suppress(Exception):
                    e.plugin.stop()
            print("\n[recovery node] figures: " + "; ".join(f"{k}: {v:.2f}" for k, v in TIMES.items()))


def pod_spec(e: Env, name: str, ns: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "hostNetwork": True,
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 0,
            "nodeSelector": {"kubernetes.io/hostname": NODE},
            "containers": [
                {"name": "main", "image": e.pause, "imagePullPolicy": "Never", "resources": {"limits": {GPU: "1"}}}
            ],
        },
    }


def daemonset(e: Env) -> dict[str, Any]:
    return {
        "metadata": {"name": DS},
        "spec": {
            "selector": {"matchLabels": {"app": DS}},
            "template": {
                "metadata": {"labels": {"app": DS}},
                "spec": {
                    "hostNetwork": True,
                    "automountServiceAccountToken": False,
                    "terminationGracePeriodSeconds": 0,
                    "nodeSelector": {"kubernetes.io/hostname": NODE},
                    "tolerations": [{"operator": "Exists"}],
                    "containers": [{"name": "plugin", "image": e.pause, "imagePullPolicy": "Never"}],
                },
            },
        },
    }


def test_xid_119_on_gpu_4_on_a_real_kubelet(env: Env) -> None:
    e, api = env, env.api
    uu = e.sim.gpu_uuids()
    gpu4 = uu[K][1]
    e.plugin = DevicePlugin(GPU, replica_ids([u for _, u, _ in uu], REPLICAS), policy="spread").start()
    wait_registered(e.plugin, 1, 120)
    wait_for(
        lambda: api.get_node(NODE)["status"].get("allocatable", {}).get(GPU) == str(8 * REPLICAS), 120, 0.2, "alloc"
    )
    ns, plugin_ns = f"ml-{secrets.token_hex(3)}", f"plug-{secrets.token_hex(3)}"
    for n in (ns, plugin_ns):
        ensure_namespace(api, n)
        wait_for(lambda n=n: api.request("GET", f"/api/v1/namespaces/{n}/serviceaccounts/default"), 60, 0.2, "SA")
    api.request("POST", f"/apis/apps/v1/namespaces/{plugin_ns}/daemonsets", daemonset(e))

    def plugin_pods() -> list[dict[str, Any]]:
        items = api.request("GET", f"/api/v1/namespaces/{plugin_ns}/pods")["items"]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    def running(name: str) -> bool:
        p = api.request("GET", f"/api/v1/namespaces/{ns}/pods/{name}")
        return p.get("status", {}).get("phase") == "Running"

    first = wait_for(lambda: [p for p in plugin_pods() if p["status"].get("phase") == "Running"], 180, 0.3, "DS pod")
    plugin_uid = first[0]["metadata"]["uid"]

    # Two pods on GPU 4 (only its replicas healthy while they are placed), then four on the others ("spread").
    for _, u, _ in uu:
        e.plugin.set_gpu_health(u, u == gpu4)
    wait_for(lambda: api.get_node(NODE)["status"]["allocatable"].get(GPU) == str(REPLICAS), 60, 0.2, "only GPU 4")
    for name in ("train-a", "train-b"):
        api.request("POST", f"/api/v1/namespaces/{ns}/pods", pod_spec(e, name, ns))
        wait_for(lambda name=name: running(name), 180, 0.2, f"{name} Running")
    for _, u, _ in uu:
        e.plugin.set_gpu_health(u, True)
    wait_for(lambda: api.get_node(NODE)["status"]["allocatable"].get(GPU) == str(8 * REPLICAS), 60, 0.2, "all")
    others = [f"other-{i}" for i in range(4)]
    for name in others:
        api.request("POST", f"/api/v1/namespaces/{ns}/pods", pod_spec(e, name, ns))
        wait_for(lambda name=name: running(name), 180, 0.2, f"{name} Running")
    holders = {d: g for d, g in e.plugin.devices.items()}
    on4 = [d for d in e.plugin.allocated() if holders[d] == gpu4]
    assert len(on4) == 2, f"GPU 4 holds {on4}; allocations {e.plugin.allocated()}"
    uids = {n: api.request("GET", f"/api/v1/namespaces/{ns}/pods/{n}")["metadata"]["uid"] for n in others}

    # The chart's release with recovery on (evict, the plugin DaemonSet), a token bound to a Pod on the node.
    kc = e.cp.kubeconfig(e.workdir / "admin.kubeconfig")
    values = [
        *("--set", "recovery.enabled=true", "--set", "recovery.evict=true", "--set", "podResources.enabled=true"),
        *("--set", f"recovery.devicePlugin.namespace={plugin_ns}", "--set", f"recovery.devicePlugin.daemonSet={DS}"),
    ]
    rel: Release = apply_release(e.cp, kc, "recn", values)
    tok, _ = bound_token(api, rel.ns, rel.fullname, NODE)
    sock = e.node.kubelet_root / "pod-resources" / "kubelet.sock"
    flags = {
        "--pod-resources": "true",
        "--pod-resources-socket": str(sock),
        "--pod-resources-interval": "0.5",
        "--recovery": "",
        "--recovery-evict": "",
        "--recovery-drain-timeout": "120",
        "--recovery-plugin-namespace": plugin_ns,
        "--recovery-plugin-daemonset": DS,
    }
    env_vars = {"GPU_READY_EVENT_NAMESPACE": EVENT_NAMESPACE}
    e.agent = a = AgentProc(e.cp, e.sim, NODE, tok, extra=flags, workdir=e.workdir, env=env_vars).start()
    a.wait_status(api, "True", timeout=120)
    bus4 = uu[K][0].nvml
    wait_for(lambda: a.metric("gpu_ready_gpu_pods", {"pci_bus_id": bus4}) == 2.0, 60, 0.2, "the agent sees 2 pods")

    # The fault: Xid 119 on GPU 4; the plugin marks it unhealthy, as the NVIDIA plugin does on an Xid.
    t0 = time.monotonic()
    e.sim.append_xid(119, gpu=K, text="Timeout after 6s of waiting for RPC response from GPU4 GSP!")
    e.plugin.set_gpu_health(gpu4, False)

    def restarted_plugin() -> bool:
        pods = plugin_pods()
        fresh = [p for p in pods if p["metadata"]["uid"] != plugin_uid and p["status"].get("phase") == "Running"]
        if fresh:
            e.plugin.set_gpu_health(gpu4, True)  # the restarted plugin advertises GPU 4 again
        return bool(fresh)

    try:
        wait_for(restarted_plugin, 180, 0.1, "the plugin DaemonSet's pod restarted")
        t_plugin = time.monotonic()
        a.wait_status(api, "True", timeout=120)
        t_ready = time.monotonic()
    except AssertionError as err:
        raise AssertionError(f"{err}\n--- agent ---\n{a.logs()[-4000:]}") from None
    assert e.sim.resets() == [f"-r -i {bus4}"]
    gone = {n for n in ("train-a", "train-b") if not _exists(api, ns, n)}
    assert gone == {"train-a", "train-b"}
    for n in others:  # never deleted, never restarted, still running
        p = api.request("GET", f"/api/v1/namespaces/{ns}/pods/{n}")
        assert p["metadata"]["uid"] == uids[n] and not p["metadata"].get("deletionTimestamp")
        assert p["status"]["containerStatuses"][0]["restartCount"] == 0 and p["status"]["phase"] == "Running"

    # A new pod lands on GPU 4: the other GPUs' replicas are made unavailable for the moment it is placed.
    for _, u, _ in uu:
        if u != gpu4:
            e.plugin.set_gpu_health(u, False)
    n_alloc = len(e.plugin.allocated())
    api.request("POST", f"/api/v1/namespaces/{ns}/pods", pod_spec(e, "train-c", ns))
    wait_for(lambda: running("train-c"), 180, 0.2, "train-c Running")
    t_new = time.monotonic()
    (new,) = e.plugin.allocated()[n_alloc:]
    assert holders[new] == gpu4
    for _, u, _ in uu:
        e.plugin.set_gpu_health(u, True)
    TIMES["Xid 119 -> plugin pod restarted s"] = t_plugin - t0
    TIMES["Xid 119 -> GPUReady=True again s"] = t_ready - t0
    TIMES["Xid 119 -> a new pod running on GPU 4 s (includes the test's plugin steps)"] = t_new - t0
    TIMES["other pods disturbed"] = 0
    assert a.metric("gpu_ready_gpu_recoveries_total") == 1.0


def _exists(api: KubeApi, ns: str, name: str) -> bool:
    """Whether the Pod is there; any answer but 404 fails the test."""
    try:
        api.request("GET", f"/api/v1/namespaces/{ns}/pods/{name}")
    except ApiError as e:
        if e.status == 404:
            return False
        raise
    return True
