"""A small device plugin for the real kubelet in the tests: kubelet's Device Plugin API v1beta1 (vendored as
testkit/proto/deviceplugin_v1beta1.proto from k8s.io/kubelet@v0.37.2) served by grpcio on a unix socket, one
`DevicePlugin` per resource name, registered over `/var/lib/kubelet/device-plugins/kubelet.sock` (kubelet's fixed
path, whatever its --root-dir).

It advertises devices with the IDs the NVIDIA device plugin gives them, so that the agent reads through kubelet's
pod-resources API exactly what it would read on a GPU node:
- whole GPUs, resource `nvidia.com/gpu`: the GPU's UUID, `GPU-<uuid>`;
- time-sliced / MPS replicas: `GPU-<uuid>::<n>` for n in 0..replicas-1 (NVIDIA/k8s-device-plugin:
  internal/rm/devices.go@v0.20.0 `NewAnnotatedID`, `fmt.Sprintf("%s::%d", id, replica)`; the replicas are made
  per GPU in internal/rm/device_map.go@v0.20.0), under `nvidia.com/gpu` or a renamed resource such as
  `nvidia.com/gpu.shared`;
- MIG instances, resource `nvidia.com/mig-<profile>` (internal/lm/mig-strategy.go@v0.20.0 names the resource
  `"nvidia.com/mig-" + name` under the mixed strategy): the MIG device's UUID, `MIG-<uuid>`.

What it does, as a real plugin does: GetDevicePluginOptions; ListAndWatch sends the device list, then again on
every change (`set_health`); Allocate answers one ContainerAllocateResponse per container with an environment
variable naming the devices (no mounts, no device nodes: the test pods run the pause image); GetPreferredAllocation
(optional: `policy="packed"` fills the GPU with the fewest free slots first, `"spread"` the one with the most);
PreStartContainer. It re-registers when kubelet re-creates its registration socket (a kubelet restart removes the
plugin sockets too): a watcher thread compares the inode and ctime of kubelet.sock and restarts the server on a
fresh socket, as the NVIDIA plugin does on the fsnotify Create event of kubelet.sock.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from testkit.harness import wait_for
from testkit.proto import deviceplugin_v1beta1_pb2 as pb
from testkit.proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc

API_VERSION = "v1beta1"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
# kubelet serves the registration socket at pluginapi.KubeletSocket whatever its --root-dir (the device manager uses
# the constant: kubernetes/kubelet:pkg/apis/deviceplugin/v1beta1/constants.go@v0.37.2 DevicePluginPath), so a test
# node's plugins live there too (one real node per host: testkit/node.py's host lock).
DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
ENV_PREFIX = "GPU_READY_TEST_DEVICES_"  # + the resource name, upper case, non-alphanumerics as "_"


def replica_ids(uuids: Sequence[str], replicas: int) -> dict[str, str]:
    """Time-sliced / MPS replicas `GPU-<uuid>::<n>`: device ID -> parent GPU UUID."""
    return {f"{u}::{i}": u for u in uuids for i in range(replicas)}


def mig_ids(parents: dict[str, Sequence[str]]) -> dict[str, str]:
    """MIG devices `MIG-<uuid>`, given parent GPU UUID -> its MIG device UUIDs: device ID -> parent GPU UUID."""
    return {m: gpu for gpu, migs in parents.items() for m in migs}


def env_name(resource: str) -> str:
    return ENV_PREFIX + re.sub(r"[^A-Za-z0-9]", "_", resource).upper()


@dataclass
class AllocateCall:
    """One Allocate RPC: the device IDs of each container request, in order."""

    containers: list[list[str]]
    at: float = field(default_factory=time.monotonic)


class _Servicer(pb_grpc.DevicePluginServicer):
    def __init__(self, plugin: DevicePlugin) -> None:
        self.p = plugin

    def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(
            pre_start_required=self.p.pre_start_required,
            get_preferred_allocation_available=self.p.policy is not None,
        )

    def ListAndWatch(self, request: pb.Empty, context: grpc.ServicerContext) -> Iterator[pb.ListAndWatchResponse]:
        seen = -1
        while context.is_active() and not self.p._stopping.is_set():
            with self.p._cond:
                if seen == self.p._generation:
                    self.p._cond.wait(0.5)
                if seen == self.p._generation:
                    continue
                seen = self.p._generation
                devices = [pb.Device(ID=i, health=h) for i, h in self.p._health.items()]
            self.p.list_and_watch_sends += 1
            yield pb.ListAndWatchResponse(devices=devices)

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        out = []
        for req in request.container_requests:
            ids = self.p.preferred(list(req.available_deviceIDs), list(req.must_include_deviceIDs), req.allocation_size)
            out.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return pb.PreferredAllocationResponse(container_responses=out)

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        containers = [list(r.devices_ids) for r in request.container_requests]
        unknown = sorted({d for c in containers for d in c} - set(self.p.devices))
        if unknown:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown devices {unknown}")
        with self.p._cond:
            self.p.allocations.append(AllocateCall(containers))
        name = env_name(self.p.resource)
        return pb.AllocateResponse(
            container_responses=[pb.ContainerAllocateResponse(envs={name: ",".join(c)}) for c in containers]
        )

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        with self.p._cond:
            self.p.pre_starts.append(list(request.devices_ids))
        return pb.PreStartContainerResponse()


class DevicePlugin:
    """One resource name's plugin. `devices`: device ID -> the GPU (UUID) it belongs to, in advertising order.

    `start()` serves on `<plugin_dir>/<socket_name>` and registers; `stop()` ends it. Figures:
    `registrations` (each successful Register call's monotonic time), `allocations`, `pre_starts`."""

    def __init__(
        self,
        resource: str,
        devices: dict[str, str],
        plugin_dir: Path = DEVICE_PLUGIN_DIR,
        policy: str | None = "packed",
        pre_start_required: bool = False,
        socket_name: str | None = None,
        watch_interval: float = 0.2,
    ) -> None:
        if policy not in (None, "packed", "spread"):
            raise ValueError(f"policy must be None, 'packed' or 'spread', not {policy!r}")
        self.dir = Path(plugin_dir)
        self.kubelet_sock = self.dir / "kubelet.sock"
        self.resource = resource
        self.devices = dict(devices)
        self.policy = policy
        self.pre_start_required = pre_start_required
        safe = re.sub(r"[^A-Za-z0-9.-]", "-", resource)
        self.socket = self.dir / (socket_name or f"gpu-ready-test-{safe}.sock")
        self.watch_interval = watch_interval
        self.registrations: list[float] = []
        self.allocations: list[AllocateCall] = []
        self.pre_starts: list[list[str]] = []
        self.list_and_watch_sends = 0
        self.errors: list[str] = []
        self._health: dict[str, str] = dict.fromkeys(self.devices, HEALTHY)
        self._generation = 0
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._server: grpc.Server | None = None
        self._kubelet_id: tuple[int, int] | None = None  # inode + ctime of kubelet.sock (inode numbers are reused)
        self._watcher: threading.Thread | None = None

    # -- life cycle -----------------------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> DevicePlugin:
        """Serves and registers (waiting up to `timeout` for kubelet's registration socket), then watches it."""
        self._stopping.clear()
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._serve_and_register()
                break
            except (OSError, grpc.RpcError) as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"device plugin {self.resource}: could not register with kubelet: {e}") from e
                time.sleep(0.2)
        self._watcher = threading.Thread(target=self._watch, name=f"dp-watch-{self.resource}", daemon=True)
        self._watcher.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        if self._watcher is not None:
            self._watcher.join(10)
            self._watcher = None
        self._stop_server()

    def __enter__(self) -> DevicePlugin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _stop_server(self) -> None:
        if self._server is not None:
            self._server.stop(grace=1).wait(5)
            self._server = None
        if self.socket.exists():
            self.socket.unlink()

    def _serve_and_register(self) -> None:
        st = os.stat(self.kubelet_sock)  # FileNotFoundError (OSError) until kubelet serves it
        self._stop_server()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"dp-{self.resource}"))
        pb_grpc.add_DevicePluginServicer_to_server(_Servicer(self), server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server
        with grpc.insecure_channel(f"unix://{self.kubelet_sock}") as ch:
            pb_grpc.RegistrationStub(ch).Register(
                pb.RegisterRequest(
                    version=API_VERSION,
                    endpoint=self.socket.name,
                    resource_name=self.resource,
                    options=pb.DevicePluginOptions(
                        pre_start_required=self.pre_start_required,
                        get_preferred_allocation_available=self.policy is not None,
                    ),
                ),
                timeout=10,
            )
        self._kubelet_id = (st.st_ino, st.st_ctime_ns)
        self.registrations.append(time.monotonic())

    def _watch(self) -> None:
        """Re-registers when kubelet.sock is a new file (kubelet restarted) or our socket was removed."""
        while not self._stopping.wait(self.watch_interval):
            try:
                st = os.stat(self.kubelet_sock)
            except OSError:
                continue  # kubelet is down: wait for the new socket
            if (st.st_ino, st.st_ctime_ns) == self._kubelet_id and self.socket.exists():
                continue
            try:
                self._serve_and_register()
            except (OSError, grpc.RpcError) as e:  # kubelet not answering yet: the next round retries
                self.errors.append(f"re-register: {e}")

    # -- what the test drives -------------------------------------------------------------------------------

    def set_health(self, device_id: str, healthy: bool) -> None:
        """Marks one device (un)healthy; ListAndWatch sends the new list at once."""
        if device_id not in self._health:
            raise KeyError(f"{self.resource} has no device {device_id!r}")
        with self._cond:
            self._health[device_id] = HEALTHY if healthy else UNHEALTHY
            self._generation += 1
            self._cond.notify_all()

    def set_gpu_health(self, gpu_uuid: str, healthy: bool) -> list[str]:
        """Marks every device of one GPU (its replicas or MIG instances) (un)healthy; returns their IDs."""
        ids = [d for d, g in self.devices.items() if g == gpu_uuid]
        with self._cond:
            for d in ids:
                self._health[d] = HEALTHY if healthy else UNHEALTHY
            self._generation += 1
            self._cond.notify_all()
        return ids

    def health(self) -> dict[str, str]:
        with self._cond:
            return dict(self._health)

    def allocated(self) -> list[str]:
        """Every device ID kubelet asked for in Allocate, in order."""
        with self._cond:
            return [d for call in self.allocations for c in call.containers for d in c]

    # -- GetPreferredAllocation -----------------------------------------------------------------------------

    def preferred(self, available: list[str], must: list[str], size: int) -> list[str]:
        """`must` first, then devices of the GPU with the fewest (packed) or most (spread) available devices."""
        chosen = list(dict.fromkeys(must))[:size]
        by_gpu: dict[str, list[str]] = {}
        order = {d: i for i, d in enumerate(self.devices)}
        for d in sorted(available, key=lambda d: order.get(d, len(order))):
            if d not in chosen:
                by_gpu.setdefault(self.devices.get(d, d), []).append(d)
        rank = {g: i for i, g in enumerate(dict.fromkeys(self.devices.values()))}
        sign = 1 if self.policy == "packed" else -1
        while len(chosen) < size and by_gpu:
            g = min(by_gpu, key=lambda g: (sign * len(by_gpu[g]), rank.get(g, len(rank))))
            chosen.append(by_gpu[g].pop(0))
            if not by_gpu[g]:
                del by_gpu[g]
        return chosen


def read_allocated_env(pids: Sequence[int], marker: str) -> dict[str, dict[str, list[str]]]:
    """For each process whose environment holds `marker`=<value> (the test sets it per container, e.g.
    `ns/pod/container`), the device IDs the plugins' Allocate put in its environment: value -> resource env name
    -> device IDs. This is what the container really received from kubelet, read from /proc/<pid>/environ."""
    out: dict[str, dict[str, list[str]]] = {}
    for pid in pids:
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        env = dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)
        if marker not in env:
            continue
        devs = {k: [d for d in v.split(",") if d] for k, v in env.items() if k.startswith(ENV_PREFIX)}
        out[env[marker]] = devs
    return out


def wait_registered(plugin: DevicePlugin, count: int, timeout: float) -> float:
    """Waits until `plugin` has registered `count` times; returns the monotonic time of that registration."""
    wait_for(
        lambda: len(plugin.registrations) >= count,
        timeout,
        0.05,
        f"device plugin {plugin.resource} to register {count} time(s) (errors: {plugin.errors[-3:]})",
    )
    return plugin.registrations[count - 1]
