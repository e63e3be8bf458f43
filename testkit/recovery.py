"""Per-GPU recovery on the real apiserver (tests/test_recovery_e2e.py, bench/recovery.py): a GPU node whose workload
Pods are real objects and also in kubelet's pod-resources stand-in, the device plugin DaemonSet's pod, a kubelet
stand-in that finishes deletions (a deleted pod leaves pod-resources; the plugin's pod comes back and advertises
every GPU again), and the chart's release with recovery on."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from agent.kube.client import KubeApi
from agent.proto import podresources_v1_pb2 as pb
from testkit.chart import Release, apply_release
from testkit.cluster import EVENT_NAMESPACE, bound_token, create_node, ensure_namespace
from testkit.controlplane import ControlPlane
from testkit.harness import AgentProc
from testkit.podresources import Kubelet
from testkit.podresources import pod as grpc_pod
from testkit.simhost import SimHost

DS = "nvidia-device-plugin"


class Node:
    """One GPU node: the simulated host, the Node, the workload Pods (real objects in the apiserver and in the
    pod-resources stand-in), the plugin DaemonSet's pod, and a kubelet stand-in that finishes deletions."""

    def __init__(self, cp: ControlPlane, admin: KubeApi, rel: Release, plugin_ns: str, ds_uid: str, tmp: Path):
        self.cp, self.admin, self.rel, self.plugin_ns, self.ds_uid = cp, admin, rel, plugin_ns, ds_uid
        self.host = SimHost(tmp / "host")
        self.name = f"rec-{secrets.token_hex(4)}"
        create_node(admin, self.name, {"nvidia.com/gpu.present": "true"}, self.host.plugin_resources())
        self.ns = f"ml-{secrets.token_hex(3)}"
        ensure_namespace(admin, self.ns)
        self.gpus = self.host.gpu_uuids()
        self.kubelet: Kubelet | None = None
        self.pods: dict[str, int] = {}  # workload pod -> GPU position
        self.deleted: list[str] = []  # pods the kubelet stand-in saw deleted, in order
        self.plugin_pod = ""
        self.plugin_restarts = 0
        self.tmp = tmp
        self.holders: dict[tuple[str, str], Path] = {}  # holder pod -> the file that stands for its open GPU handle

    def add_pod(self, name: str, gpu: int) -> None:
        self.admin.request(
            "POST",
            f"/api/v1/namespaces/{self.ns}/pods",
            {
                "metadata": {"name": name},
                "spec": {
                    "nodeName": self.name,
                    "containers": [{"name": "main", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
                },
            },
        )
        self.pods[name] = gpu
        self.sync()

    def add_plugin_pod(self) -> None:
        self.plugin_pod = f"{DS}-{secrets.token_hex(3)}"
        owner = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": DS, "uid": self.ds_uid, "controller": True}
        self.admin.request(
            "POST",
            f"/api/v1/namespaces/{self.plugin_ns}/pods",
            {
                "metadata": {"name": self.plugin_pod, "ownerReferences": [owner]},
                "spec": {"nodeName": self.name, "containers": [{"name": "plugin", "image": "x"}]},
            },
        )

    def add_holder_pod(self, ds: dict[str, Any], handle: Path) -> tuple[str, str]:
        """A pod of DaemonSet `ds` (e.g. dcgm-exporter) on this node that holds the GPUs while `handle` exists; the
        kubelet stand-in removes the handle when the pod is deleted (its process exits)."""
        ns, dsname = ds["metadata"]["namespace"], ds["metadata"]["name"]
        name = f"{dsname}-{secrets.token_hex(3)}"
        owner = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": dsname, "uid": ds["metadata"]["uid"],
                 "controller": True}  # fmt: skip
        self.admin.request("POST", f"/api/v1/namespaces/{ns}/pods", {
            "metadata": {"name": name, "ownerReferences": [owner]},
            "spec": {"nodeName": self.name, "containers": [{"name": "main", "image": "x"}]},
        })  # fmt: skip
        handle.write_text("open\n")
        self.holders[(ns, name)] = handle
        return ns, name

    def sync(self, advertised: set[int] | None = None) -> None:
        assert self.kubelet is not None
        self.kubelet.pods = [grpc_pod(n, [self.gpus[g][1]], ns=self.ns) for n, g in sorted(self.pods.items())]
        if advertised is not None:
            ids = [self.gpus[i][1] for i in sorted(advertised)]
            self.kubelet.devices = [pb.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=ids)]

    def kubelet_step(self) -> None:
        """What kubelet does with a deleted pod: stops it (gone from pod-resources) and removes the object; the
        plugin DaemonSet's pod comes back (a new one) and advertises every GPU again."""
        for name in list(self.pods):
            p = self.admin.request("GET", f"/api/v1/namespaces/{self.ns}/pods/{name}")
            if p["metadata"].get("deletionTimestamp"):
                del self.pods[name]
                self.deleted.append(name)
                self.sync()
                self.admin.request("DELETE", f"/api/v1/namespaces/{self.ns}/pods/{name}", {"gracePeriodSeconds": 0})
        for (ns, name), handle in list(self.holders.items()):
            p = self.admin.request("GET", f"/api/v1/namespaces/{ns}/pods/{name}")
            if p["metadata"].get("deletionTimestamp"):
                handle.unlink(missing_ok=True)
                del self.holders[(ns, name)]
                self.admin.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{name}", {"gracePeriodSeconds": 0})
        if self.plugin_pod:
            p = self.admin.request("GET", f"/api/v1/namespaces/{self.plugin_ns}/pods/{self.plugin_pod}")
            if p["metadata"].get("deletionTimestamp"):
                self.admin.request(
                    "DELETE", f"/api/v1/namespaces/{self.plugin_ns}/pods/{self.plugin_pod}", {"gracePeriodSeconds": 0}
                )
                self.plugin_restarts += 1
                self.add_plugin_pod()
                self.sync(advertised=set(range(8)))

    def agent(self, sock: str, **flags: str) -> AgentProc:
        tok, _ = bound_token(self.admin, self.rel.ns, self.rel.fullname, self.name)
        extra = {
            "--pod-resources": "true",
            "--pod-resources-socket": sock,
            "--pod-resources-interval": "0.1",
            "--recovery": "",
            "--recovery-evict": "",
            "--recovery-drain-timeout": "60",
            "--recovery-reset-timeout": "20",
            "--recovery-plugin-namespace": self.plugin_ns,
            "--recovery-plugin-daemonset": DS,
            **flags,
        }
        env = {"GPU_READY_EVENT_NAMESPACE": EVENT_NAMESPACE}
        return AgentProc(self.cp, self.host, self.name, tok, extra=extra, workdir=self.tmp, env=env).start()

    def events(self) -> list[str]:
        got = self.admin.request(
            "GET",
            f"/api/v1/namespaces/{EVENT_NAMESPACE}/events",
            query={"fieldSelector": f"involvedObject.name={self.name}"},
        )
        return [x["reason"] for x in got["items"]]

    def gpu_ready(self) -> dict[str, Any] | None:
        node = self.admin.get_node(self.name)
        return next((c for c in node["status"].get("conditions", []) if c["type"] == "GPUReady"), None)


def create_plugin_daemonset(admin: KubeApi, namespace: str, name: str = DS) -> dict[str, Any]:
    """The device plugin DaemonSet recovery restarts (or, named otherwise, a DaemonSet holding the GPUs, e.g.
    dcgm-exporter), placed nowhere (the tests make its pods themselves)."""
    return admin.request(
        "POST",
        f"/apis/apps/v1/namespaces/{namespace}/daemonsets",
        {
            "metadata": {"name": name},
            "spec": {
                "selector": {"matchLabels": {"app": name}},
                "template": {
                    "metadata": {"labels": {"app": name}},
                    "spec": {"nodeSelector": {"no-such-node": "x"}, "containers": [{"name": "p", "image": "x"}]},
                },
            },
        },
    )


def recovery_release(
    cp: ControlPlane, kc: Path, name: str = "rec", extra: Sequence[str] = ()
) -> tuple[Release, str, str]:
    """The plugin DaemonSet (in a namespace of its own) and the chart's release with recovery, evict and that
    plugin on, plus the `extra` values. Returns (release, plugin namespace, DaemonSet UID)."""
    admin = cp.admin()
    try:
        plugin_ns = f"plug-{secrets.token_hex(3)}"
        ensure_namespace(admin, plugin_ns)
        ds = create_plugin_daemonset(admin, plugin_ns)
    finally:
        admin.close()
    values = [
        *("--set", "recovery.enabled=true", "--set", "recovery.evict=true", "--set", "podResources.enabled=true"),
        *("--set", f"recovery.devicePlugin.namespace={plugin_ns}", "--set", f"recovery.devicePlugin.daemonSet={DS}"),
        *extra,
    ]
    return apply_release(cp, kc, name, values), plugin_ns, str(ds["metadata"]["uid"])


def reset_processes(host: SimHost) -> list[int]:
    """Processes running the simulated host's `nvidia-smi -r` (a hung reset left behind would be one)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        args = cmd.split(b"\0")
        if str(host.nvidia_smi).encode() in args and b"-r" in args:
            out.append(int(pid))
    return out


@contextlib.contextmanager
def release_of(cp: ControlPlane, tmp: Path, name: str = "rec") -> Iterator[tuple[KubeApi, Release, str, str]]:
    """A recovery release (recovery_release) with an admin client, for a module-scoped fixture: (admin, release,
    the plugin's namespace, its DaemonSet's uid)."""
    admin = cp.admin()
    try:
        rel, plugin_ns, uid = recovery_release(cp, cp.kubeconfig(tmp / "admin"), name=name)
        yield admin, rel, plugin_ns, uid
    finally:
        admin.close()


@contextlib.contextmanager
def served_node(
    cp: ControlPlane, release: tuple[KubeApi, Release, str, str], tmp: Path, dev_nodes: bool = False
) -> Iterator[tuple[Node, str]]:
    """A Node of the release with the simulated host (its device nodes made with `dev_nodes`), kubelet's
    pod-resources stand-in serving it and all 8 GPUs advertised: (node, the pod-resources socket)."""
    from testkit.podresources import serve_pod_resources  # grpc: the dev extra

    admin, rel, plugin_ns, uid = release
    n = Node(cp, admin, rel, plugin_ns, uid, tmp)
    if dev_nodes:
        n.host.make_dev_nodes()
    with serve_pod_resources() as (sock, k):
        n.kubelet = k
        n.sync(advertised=set(range(8)))
        yield n, sock
