"""A stand-in for kubelet's pod-resources API: a real grpcio server (the dev extra) serving the vendored
v1.PodResourcesLister proto (agent/proto/podresources_v1.proto) on a unix socket, as kubelet does, answering what
the test puts in its `Kubelet`; and the messages a test puts there."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc

from agent.proto import podresources_v1_pb2 as pb


class Kubelet:
    """A pod-resources server: `pods` and `devices` are what it answers; `fail` makes a method abort."""

    def __init__(self) -> None:
        self.pods: list[Any] = []
        self.devices: list[Any] = []
        self.fail: dict[str, tuple[Any, str]] = {}
        self.calls: list[str] = []

    def list(self, req: Any, ctx: Any) -> Any:
        self.calls.append("List")
        if "List" in self.fail:
            ctx.abort(*self.fail["List"])
        return pb.ListPodResourcesResponse(pod_resources=self.pods)

    def allocatable(self, req: Any, ctx: Any) -> Any:
        self.calls.append("GetAllocatableResources")
        if "GetAllocatableResources" in self.fail:
            ctx.abort(*self.fail["GetAllocatableResources"])
        return pb.AllocatableResourcesResponse(devices=self.devices)


@contextlib.contextmanager
def serve_pod_resources() -> Iterator[tuple[str, Kubelet]]:
    """A gRPC v1.PodResourcesLister on a unix socket answering what the returned Kubelet holds."""
    d = tempfile.mkdtemp(prefix="podres-")  # short: a unix socket path has a 108-byte limit
    sock = os.path.join(d, "kubelet.sock")
    k = Kubelet()
    handlers = grpc.method_handlers_generic_handler(
        "v1.PodResourcesLister",
        {
            "List": grpc.unary_unary_rpc_method_handler(
                k.list,
                request_deserializer=pb.ListPodResourcesRequest.FromString,
                response_serializer=pb.ListPodResourcesResponse.SerializeToString,
            ),
            "GetAllocatableResources": grpc.unary_unary_rpc_method_handler(
                k.allocatable,
                request_deserializer=pb.AllocatableResourcesRequest.FromString,
                response_serializer=pb.AllocatableResourcesResponse.SerializeToString,
            ),
        },
    )
    s = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    s.add_generic_rpc_handlers((handlers,))
    s.add_insecure_port("unix://" + sock)
    s.start()
    try:
        yield sock, k
    finally:
        s.stop(0)
        shutil.rmtree(d, ignore_errors=True)


def pod(name: str, ids: list[str], ns: str = "ml", resource: str = "nvidia.com/gpu") -> Any:
    """A PodResources message: one container holding the devices `ids` of `resource`."""
    cd = pb.ContainerDevices(resource_name=resource, device_ids=ids)
    return pb.PodResources(name=name, namespace=ns, containers=[pb.ContainerResources(name="main", devices=[cd])])
