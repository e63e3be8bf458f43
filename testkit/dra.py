"""Stand-ins for what the NVIDIA DRA driver and a DRA cluster hold, for the DRA-aware counting and the per-GPU
fencing tests (tests/test_dra.py, tests/test_fencing_e2e.py, tests/test_slice_cache.py,
tests/test_slices_api_cost.py): the node's ResourceSlice exactly as the driver publishes it
(kubernetes-sigs/dra-driver-nvidia-gpu: cmd/gpu-kubelet-plugin/deviceinfo.go@0545e9e55d69ba07ccc288283e144efbc9d292fa,
GpuInfo.GetDevice and MigDeviceInfo.GetDevice; mig.go CommonAttributesMig; one pool per node named after the node),
its DeviceClasses, and a control plane with the real kube-scheduler allocating ResourceClaims (DraPlane): DRA Nodes,
claims with the Pods that use them, and what the scheduler made of them."""

from __future__ import annotations

import re
import secrets
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.kube.client import KubeApi
from testkit.chart import Release
from testkit.cluster import bound_token, create_node, drop_not_ready_taint
from testkit.controlplane import ControlPlane
from testkit.harness import wait_for

DRIVER = "gpu.nvidia.com"
BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)  # an HGX H100's eight GPUs
JSON_PATCH = "application/json-patch+json"


def uuid(i: int) -> str:
    return f"GPU-{i:08x}-5c4e-7d2b-9f11-0a6c3e{i:06x}"


def gpu_device(i: int, taints: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """A full GPU as GpuInfo.GetDevice publishes it (device `gpu-<minor>`; attributes in the driver's domain
    plus the standard resource.kubernetes.io/pciBusID)."""
    d: dict[str, Any] = {
        "name": f"gpu-{i}",
        "attributes": {
            "type": {"string": "gpu"},
            "uuid": {"string": uuid(i)},
            "productName": {"string": "NVIDIA H100 80GB HBM3"},
            "brand": {"string": "Nvidia"},
            "architecture": {"string": "Hopper"},
            "cudaComputeCapability": {"version": "9.0.0"},
            "driverVersion": {"version": "580.95.5"},
            "cudaDriverVersion": {"version": "13.0.0"},
            "resource.kubernetes.io/pciBusID": {"string": f"0000:{BUSES[i]:02x}:00.0"},
            "resource.kubernetes.io/pcieRoot": {"string": f"pci0000:{BUSES[i] & 0xF0:02x}"},
        },
        "capacity": {"memory": {"value": "80Gi"}},
    }
    if taints:
        d["taints"] = taints
    return d


def mig_device(parent: int, n: int) -> dict[str, Any]:
    """A MIG device as MigDeviceInfo.GetDevice publishes it: `gpu-<parentMinor>-mig-<profile>-<giProfileId>-
    <placementStart>`, its own uuid, the parent's uuid as parentUUID and the parent's pciBusID."""
    return {
        "name": f"gpu-{parent}-mig-3g40gb-9-{4 * n}",
        "attributes": {
            "type": {"string": "mig"},
            "uuid": {"string": f"MIG-{parent:04x}{n:04x}-1b2c-5d6e-8f90-a1b2c3d4e5f6"},
            "parentUUID": {"string": uuid(parent)},
            "profile": {"string": "3g.40gb"},
            "productName": {"string": "NVIDIA H100 80GB HBM3"},
            "brand": {"string": "Nvidia"},
            "architecture": {"string": "Hopper"},
            "cudaComputeCapability": {"version": "9.0.0"},
            "driverVersion": {"version": "580.95.5"},
            "cudaDriverVersion": {"version": "13.0.0"},
            "resource.kubernetes.io/pciBusID": {"string": f"0000:{BUSES[parent]:02x}:00.0"},
        },
        "capacity": {"memory": {"value": "40Gi"}, "multiprocessors": {"value": "60"}},
    }


def nvidia_slice(
    node: str,
    gpus: range | list[int] = range(8),
    mig: dict[int, int] | None = None,
    full_with_mig: bool = False,
    taints: dict[int, list[dict[str, str]]] | None = None,
    generation: int = 1,
    count: int = 1,
    driver: str = DRIVER,
) -> dict[str, Any]:
    """The node's ResourceSlice. `mig`: GPU minor -> MIG devices on it; as with static MIG the MIG-enabled GPU
    itself is not published unless `full_with_mig` (dynamic MIG publishes both)."""
    mig = mig or {}
    devices = []
    for i in gpus:
        if i not in mig or full_with_mig:
            devices.append(gpu_device(i, (taints or {}).get(i)))
        devices += [mig_device(i, n) for n in range(mig.get(i, 0))]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{driver}-{secrets.token_hex(3)}"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": count},
            "devices": devices,
        },
    }


# -- DeviceClasses and a control plane with the real scheduler ----------------------------------------------------


def device_class(name: str, device_type: str) -> dict[str, Any]:
    """The NVIDIA driver's DeviceClasses (gpu.nvidia.com, mig.nvidia.com): its devices of one `type`."""
    expr = f"device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == '{device_type}'"
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": expr}}]},
    }


@dataclass
class DraPlane:
    control_plane: ControlPlane  # the name tests/conftest.py looks for to append the apiserver log on failure
    admin: KubeApi
    namespace: str
    version: str = "v1"  # resource.k8s.io version of DeviceTaintRule: v1 (1.37), v1beta2 (1.36 with the gate)
    releases: dict[str, Release] = field(default_factory=dict)
    clients: list[KubeApi] = field(default_factory=list)

    @property
    def rules(self) -> str:
        return f"/apis/resource.k8s.io/{self.version}/devicetaintrules"

    def logs(self) -> str:
        cp = self.control_plane
        return "".join(
            f"\n--- {c} log (tail) ---\n{cp.log_tail(40, component=c)}"
            for c in ("kube-scheduler", "kube-controller-manager")
        )

    def wait(self, pred: Callable[[], Any], what: str, timeout: float = 90.0) -> Any:
        try:
            return wait_for(pred, timeout, 0.05, what=what)
        except AssertionError as e:
            raise AssertionError(f"{e}{self.logs()}") from None

    def agent(self, release: str, node: str | None) -> KubeApi:
        """A client with the release's agent token, bound to a new Pod on `node` (None: not bound)."""
        rel = self.releases[release]
        tok, _ = bound_token(self.admin, rel.ns, rel.sa, node)
        c = KubeApi.from_token(self.control_plane.host, tok, self.control_plane.ca_file)
        self.clients.append(c)
        return c


def kube_minor(bin_dir: Path) -> int:
    out = subprocess.run([str(bin_dir / "kube-apiserver"), "--version"], capture_output=True, text=True, timeout=60)
    m = re.search(r"v1\.(\d+)\.", out.stdout)
    return int(m.group(1)) if m else 0


def gpu_node(p: DraPlane, slice_: Callable[[str], dict[str, Any]] | None = None) -> str:
    """A Node as a kubelet registers it, Ready, with no device-plugin GPUs (a DRA node), and its ResourceSlice."""
    name = f"dra-{secrets.token_hex(4)}"
    api = p.admin
    create_node(api, name, capacity={"cpu": "64", "memory": "512Gi"})
    drop_not_ready_taint(api, name)
    body = (slice_ or nvidia_slice)(name)
    api.request("POST", "/apis/resource.k8s.io/v1/resourceslices", body)
    return name


def claim_and_pod(
    p: DraPlane, node: str, device_class: str = "gpu.nvidia.com", selector: str | None = None
) -> tuple[str, str]:
    """A ResourceClaim for one device of `device_class` and a Pod using it, pinned to `node` by hostname."""
    name = f"job-{secrets.token_hex(3)}"
    exactly: dict[str, Any] = {"deviceClassName": device_class, "allocationMode": "ExactCount", "count": 1}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    p.admin.request(
        "POST",
        f"/apis/resource.k8s.io/v1/namespaces/{p.namespace}/resourceclaims",
        {"metadata": {"name": name}, "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}},
    )
    pod = {
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "terminationGracePeriodSeconds": 30,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
            "containers": [{"name": "c", "image": "cuda:test", "resources": {"claims": [{"name": "gpu"}]}}],
        },
    }
    p.admin.request("POST", f"/api/v1/namespaces/{p.namespace}/pods", pod)
    return name, name


def allocated_device(p: DraPlane, claim: str) -> str | None:
    c = p.admin.request("GET", f"/apis/resource.k8s.io/v1/namespaces/{p.namespace}/resourceclaims/{claim}")
    results = (((c.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return str(results[0]["device"]) if results else None


def get_pod(p: DraPlane, name: str) -> dict[str, Any]:
    return p.admin.request("GET", f"/api/v1/namespaces/{p.namespace}/pods/{name}")


def unschedulable(p: DraPlane, pod: str) -> bool:
    cond = [c for c in get_pod(p, pod).get("status", {}).get("conditions", []) if c.get("type") == "PodScheduled"]
    return bool(cond) and cond[0].get("status") == "False" and cond[0].get("reason") == "Unschedulable"
