"""Reading one node's DRA ResourceSlices: the raw list, or why it could not be read (parsing them is
probes/dra.py's). A LIST with field selectors spec.nodeName and spec.driver, served from the apiserver's watch
cache; the watch that keeps them is slice_cache.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.kube.client import ApiError, KubeApi

DEFAULT_DRIVER = "gpu.nvidia.com"
SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"
MAX_SLICES = 64  # one node's slices for one driver (the NVIDIA driver publishes one)


@dataclass(frozen=True)
class SliceRead:
    """The outcome of reading the node's slices: the raw list, or why it could not be read."""

    items: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def read_node_slices(api: KubeApi, node: str, driver: str = DEFAULT_DRIVER) -> SliceRead:
    """One LIST of the node's ResourceSlices of `driver`, from the watch cache. Never raises ApiError."""
    selector = f"spec.nodeName={node},spec.driver={driver}"
    try:
        obj = api.request("GET", SLICES_PATH, query={"fieldSelector": selector, "resourceVersion": "0"}, verb="LIST")
    except ApiError as e:
        if e.status == 404:  # the cluster serves no resource.k8s.io/v1 (before 1.34): no DRA driver
            return SliceRead(items=[])
        return SliceRead(error=f"cannot list ResourceSlices ({selector}): {e}")
    return SliceRead(items=obj.get("items"))
