"""The pod-resources client against the real kubelet: `List` and `GetAllocatableResources` over the
kubelet's own socket, with the pure-Python gRPC client (agent/kube/grpc_unix.py). No device plugin is registered
here, so List returns the pods with no devices (tests/test_allocation_node.py registers a test device plugin).

Also measures the cost of one read (CPU ms in this process) and the RSS the agent process gains when h2, protobuf
and the client load (a fresh interpreter that imports the `run` path first)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.allocation import build_map
from agent.kube.client import KubeApi
from agent.kube.grpc_unix import unary_call
from agent.model import PciAddress
from agent.probes.podresources import LIST, PodResourcesReader
from testkit.allocation import allocatable_counts, inventory_from
from testkit.controlplane import REPO
from testkit.harness import wait_for
from testkit.node import RealNode
from testkit.realnode import real_node

pytestmark = [pytest.mark.node, pytest.mark.slow]

NODE = "gpu-node-podres"
FIGURES: dict[str, float] = {}


@dataclass
class Kubelet:
    node: RealNode
    api: KubeApi
    pause: str

    @property
    def socket(self) -> Path:
        return self.node.kubelet_root / "pod-resources" / "kubelet.sock"


@pytest.fixture(scope="module")
def kubelet() -> Iterator[Kubelet]:
    with real_node(NODE, scheduler=False, tag="pod-resources") as booted:
        try:
            yield Kubelet(booted.node, booted.api, booted.pause)
        finally:
            print("\n[pod-resources] figures: " + "; ".join(f"{k}: {v:.2f}" for k, v in FIGURES.items()))


def _pod(name: str, image: str) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": NODE,
            "hostNetwork": True,
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "idle", "image": image, "imagePullPolicy": "Never"}],
        },
    }


def test_list_and_allocatable_from_the_real_kubelet(kubelet: Kubelet) -> None:
    sock = kubelet.socket
    wait_for(sock.exists, 60, 0.2, "kubelet's pod-resources socket")
    kubelet.api.request("POST", "/api/v1/namespaces/default/pods", _pod("podres-idle", kubelet.pause))

    def running() -> bool:
        p = kubelet.api.request("GET", "/api/v1/namespaces/default/pods/podres-idle")
        return bool(p.get("status", {}).get("phase") == "Running")

    wait_for(running, 240, 0.5, "the idle pod Running")
    reader = PodResourcesReader(str(sock), timeout=10.0, min_interval=0.0)

    def listed() -> bool:
        read, findings = reader.read()
        return not findings and read is not None and read.pods >= 1  # the socket answers: no 'not read' finding

    wait_for(listed, 60, 0.5, "kubelet lists the pod")
    read, findings = reader.read()
    assert read is not None and not findings, findings
    assert read.listed == ()  # no container holds a device: no device plugin is registered
    assert allocatable_counts(read) == {}  # and none is allocatable

    # The raw answer names the pod and its container (the client decodes kubelet's real bytes).
    from agent.proto import podresources_v1_pb2 as pb

    msg = pb.ListPodResourcesResponse.FromString(unary_call(str(sock), LIST, b"", 10.0))
    pods = {(p.namespace, p.name): [c.name for c in p.containers] for p in msg.pod_resources}
    assert pods.get(("default", "podres-idle")) == ["idle"], pods

    # With no allocatable device, every GPU of an inventory is fenced and nothing is unmapped.
    amap = build_map(read.listed, read.allocatable, inventory_from([("GPU-a", PciAddress(0, 0x3B, 0), 0, ())]))
    assert (amap.fenced, amap.free_whole, amap.unmapped, amap.packing_ratio) == (1, 0, (), None)

    # Cost of one read (List + GetAllocatableResources, a new connection each), CPU in this process. kubelet
    # rate-limits the endpoint (token bucket: a burst of 10 calls, then 100 per second): a read it refuses is an
    # INFO finding naming RESOURCE_EXHAUSTED, and the read is taken again when the bucket has refilled.
    n, cpu, wall, refused = 10, 0.0, 0.0, []

    def one_read() -> bool:
        nonlocal cpu, wall
        c0, w0 = time.process_time(), time.monotonic()
        got, why = reader.read()
        if got is None:
            refused.extend(f.message for f in why)
            return False
        cpu += time.process_time() - c0
        wall += time.monotonic() - w0
        return True

    for _ in range(n):
        wait_for(one_read, 30, 0.05, "a pod-resources read kubelet does not rate-limit")
    assert all("RESOURCE_EXHAUSTED" in m for m in refused), refused  # refusals are the rate limit, nothing else
    FIGURES["one read CPU ms"] = cpu / n * 1000
    FIGURES["one read wall ms"] = wall / n * 1000
    FIGURES["reads refused by kubelet's rate limit"] = len(refused)


def test_a_missing_socket_is_a_clear_info_finding(kubelet: Kubelet, tmp_path: Path) -> None:
    reader = PodResourcesReader(str(tmp_path / "absent.sock"), timeout=2.0, min_interval=0.0)
    read, findings = reader.read()
    assert read is None
    assert [f.severity.value for f in findings] == ["info"]
    assert "cannot connect" in findings[0].message and "absent.sock" in findings[0].message


RSS_SCRIPT = r"""
import json, sys, time
def rss():
    with open("/proc/self/status") as fh:
        return {k: int(v.split()[0]) / 1024 for k, v in (l.split(":", 1) for l in fh) if k in ("VmRSS", "VmHWM")}
from agent import cli
import agent.runner, agent.checks
before = rss()
from agent.probes.podresources import PodResourcesReader
r = PodResourcesReader(sys.argv[1], timeout=10.0, min_interval=0.0)
read, findings = r.read()
after = rss()
print(json.dumps({"ok": read is not None, "findings": [f.message for f in findings],
                  "before": before["VmRSS"], "after": after["VmRSS"], "hwm": after["VmHWM"]}))
"""


def test_rss_the_agent_gains_with_pod_resources_on(kubelet: Kubelet) -> None:
    r = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(kubelet.socket)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ok"], out["findings"]
    gained = out["after"] - out["before"]
    FIGURES["RSS added by h2+protobuf+client MiB"] = gained
    FIGURES["agent RSS with pod-resources on MiB"] = out["after"]
    assert gained < 12.0, f"pod-resources added {gained:.1f} MiB RSS (grpcio adds ~21)"
