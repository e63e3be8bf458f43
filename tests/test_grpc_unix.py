"""The unary gRPC client over h2 on a unix socket (agent/kube/grpc_unix.py) against a real grpcio server that
serves the vendored pod-resources proto, the pod-resources reader's rate limit and bounds, and the generated
protobuf module being what `make protos` makes."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.kube.grpc_unix import GrpcError, unary_call
from agent.probes import podresources
from agent.probes.podresources import ALLOCATABLE, LIST, PodResourcesReader
from agent.proto import podresources_v1_pb2 as pb

grpc = pytest.importorskip("grpc")  # dev extra; the agent itself never imports grpcio
from testkit.allocation import allocatable_counts  # noqa: E402 - after the dev-extra check
from testkit.podresources import Kubelet, serve_pod_resources  # noqa: E402 - after the dev-extra check

ROOT = Path(__file__).resolve().parents[1]
PROTO = ROOT / "agent" / "proto"


@pytest.fixture
def server() -> Iterator[tuple[str, Kubelet]]:
    with serve_pod_resources() as served:
        yield served


def _pod(name: str, devices: dict[str, list[str]], ns: str = "ml") -> Any:
    cds = [pb.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in devices.items()]
    return pb.PodResources(name=name, namespace=ns, containers=[pb.ContainerResources(name="main", devices=cds)])


def test_list_round_trip_with_a_large_answer(server):
    sock, k = server
    k.pods = [_pod(f"p{i}", {"nvidia.com/gpu": [f"GPU-{i:08d}-aaaa-bbbb-cccc-dddddddddddd"]}) for i in range(20000)]
    raw = unary_call(sock, LIST, b"", 20.0)  # ~1.5 MB: more than the default 64 KiB windows
    msg = pb.ListPodResourcesResponse.FromString(raw)
    assert len(msg.pod_resources) == 20000 and msg.pod_resources[-1].name == "p19999"


def test_a_server_error_is_one_clear_grpc_error(server):
    sock, k = server
    k.fail["GetAllocatableResources"] = (grpc.StatusCode.PERMISSION_DENIED, "not allowed: 100% sure")
    with pytest.raises(GrpcError) as e:
        unary_call(sock, ALLOCATABLE, b"", 10.0)
    assert e.value.code == 7 and e.value.status == "PERMISSION_DENIED"
    assert str(e.value).endswith("GetAllocatableResources: PERMISSION_DENIED: not allowed: 100% sure")
    with pytest.raises(GrpcError) as e:
        unary_call(sock, "/v1.PodResourcesLister/Get", b"", 10.0)
    assert e.value.status == "UNIMPLEMENTED"


def test_the_response_size_is_bounded(server):
    sock, k = server
    k.pods = [_pod(f"p{i}", {"nvidia.com/gpu": ["GPU-x" * 10]}) for i in range(5000)]
    with pytest.raises(GrpcError) as e:
        unary_call(sock, LIST, b"", 10.0, max_response=64 * 1024)
    assert e.value.status == "RESOURCE_EXHAUSTED" and "65536 bytes bound" in str(e.value)


def test_a_missing_socket_is_unavailable(tmp_path):
    with pytest.raises(GrpcError) as e:
        unary_call(str(tmp_path / "none.sock"), LIST, b"", 2.0)
    assert e.value.status == "UNAVAILABLE" and "cannot connect" in str(e.value)


def _raw_server(path: str, reply: bytes | None) -> tuple[socket.socket, threading.Event]:
    """A unix listener that answers every connection with `reply` (None: says nothing, keeps it open)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    done = threading.Event()

    def serve() -> None:
        conns = []
        while not done.is_set():
            try:
                srv.settimeout(0.2)
                c, _ = srv.accept()
            except OSError:
                continue
            conns.append(c)
            if reply is not None:
                c.sendall(reply)
                c.close()
        for c in conns:
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv, done


def test_a_server_that_never_answers_hits_the_deadline(tmp_path):
    srv, done = _raw_server(str(tmp_path / "mute.sock"), None)
    try:
        with pytest.raises(GrpcError) as e:
            unary_call(str(tmp_path / "mute.sock"), LIST, b"", 0.5)
        assert e.value.status == "DEADLINE_EXCEEDED" and "0.5s" in str(e.value)
    finally:
        done.set()
        srv.close()


def test_a_server_that_speaks_no_http2_is_a_protocol_error(tmp_path):
    srv, done = _raw_server(str(tmp_path / "http1.sock"), b"HTTP/1.1 400 Bad Request\r\n\r\n")
    try:
        with pytest.raises(GrpcError) as e:
            unary_call(str(tmp_path / "http1.sock"), LIST, b"", 5.0)
        assert e.value.status in ("INTERNAL", "UNAVAILABLE")
    finally:
        done.set()
        srv.close()


def test_reader_maps_a_server_and_respects_the_minimum_interval(server):
    sock, k = server
    k.pods = [_pod("train", {"nvidia.com/gpu": ["GPU-a"]}), _pod("idle", {})]
    k.devices = [pb.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=["GPU-a", "GPU-b"])]
    now = [100.0]
    r = PodResourcesReader(sock, timeout=5.0, min_interval=1.0, clock=lambda: now[0])
    read, findings = r.read()
    assert read is not None and findings == ()
    assert [c.ref.pod for c in read.listed] == ["train"] and read.pods == 2
    assert allocatable_counts(read) == {"nvidia.com/gpu": 2}
    now[0] += 0.5
    assert r.read()[0] is read and k.calls.count("List") == 1  # inside the interval: the last read
    now[0] += 0.6
    r.read()
    assert k.calls.count("List") == 2


def test_reader_turns_an_rpc_error_into_an_info_finding(server):
    sock, k = server
    k.fail["List"] = (grpc.StatusCode.RESOURCE_EXHAUSTED, "rate limited")
    read, findings = PodResourcesReader(sock, min_interval=0.0).read()
    assert read is None and [f.severity.value for f in findings] == ["info"]
    assert "RESOURCE_EXHAUSTED: rate limited" in findings[0].message


def test_reader_bounds_are_said(server, monkeypatch):
    sock, k = server
    monkeypatch.setattr(podresources, "MAX_PODS", 3)
    monkeypatch.setattr(podresources, "MAX_IDS", 4)
    k.pods = [_pod(f"p{i}", {"nvidia.com/gpu": [f"GPU-{i}a", f"GPU-{i}b"]}) for i in range(5)]
    read, findings = PodResourcesReader(sock, min_interval=0.0).read()
    assert read is not None and read.pods == 3
    assert sum(len(rd.ids) for c in read.listed for rd in c.devices) == 4
    assert "5 pods, only the first 3 read" in findings[0].message and "more than" in findings[0].message


def test_smi_list_fallback_parses_gpus_and_mig_devices():
    from testkit.simhost import SimHost, smi_list

    sim = SimHost(tempfile.mkdtemp(prefix="smi-"), gpus=2)
    sim.set_smi(mig={1: 3})
    gpus = podresources.parse_smi_list(smi_list(sim.gpus), {i: g.address for i, g in enumerate(sim.gpus)})
    want = [(a, u, m) for a, u, m in sim.gpu_uuids()]
    assert [(g.gpu, g.uuid, [x.uuid for x in g.mig]) for g in gpus] == want
    assert [x.index for x in gpus[1].mig] == [0, 1, 2]
    assert podresources.parse_smi_list("garbage\n" * 1000 + "GPU x: (UUID: GPU-1)", {}) == ()


def test_h2_and_protobuf_load_only_when_pod_resources_is_on():
    code = (
        "import sys; from agent.checks import CheckSuite; from agent.config import defaults; "
        "CheckSuite(defaults(nvml='off')); "
        "print(sorted(m for m in ('h2', 'google.protobuf', 'agent.proto.podresources_v1_pb2') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_the_committed_generated_code_is_what_make_protos_makes(tmp_path):
    if os.environ.get("CI") != "true":
        pytest.importorskip("grpc_tools")
    shutil.copy(PROTO / "podresources_v1.proto", tmp_path)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            ".",
            "--python_out=.",
            "--pyi_out=.",
            "podresources_v1.proto",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    for name in ("podresources_v1_pb2.py", "podresources_v1_pb2.pyi"):
        assert (tmp_path / name).read_bytes() == (PROTO / name).read_bytes(), f"{name} differs: run `make protos`"


def _suite(sock: str, tmp: Path) -> Any:
    from agent.checks import CheckSuite
    from agent.config import defaults
    from agent.probes.nvml import NvmlProbe
    from testkit.fakes import fake_nvml
    from testkit.simhost import SimHost

    sim = SimHost(tmp / "host", gpus=2)
    nv = fake_nvml([{"busId": g.address.nvml} for g in sim.gpus])
    nv.nvmlDeviceGetUUID = lambda h: sim.gpus[h].uuid.encode()
    cfg = defaults(
        nvml="on",
        nvidia_smi=str(sim.nvidia_smi),
        sysfs_root=str(sim.sysfs),
        pod_resources=True,
        pod_resources_socket=sock,
        pod_resources_interval=0.001,
        pcie=False,
        device_nodes=False,
    )
    return CheckSuite(cfg, nvml=NvmlProbe("on", 10.0, False, nvml=nv)), sim


def test_check_suite_keeps_the_allocation_map_each_poll(server, tmp_path):
    sock, k = server
    suite, sim = _suite(sock, tmp_path)
    (a, ua, _), (b, ub, _) = sim.gpu_uuids()
    k.pods = [_pod("train", {"nvidia.com/gpu": [ua]})]
    k.devices = [pb.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=[ua, ub])]
    obs, _ = suite.run(None)
    m = suite.allocation
    assert m is not None and [(g.gpu, g.state) for g in m.gpus] == [(a, "full"), (b, "free")]
    assert m.pods_on(a)[0].pod == "train"
    from agent.probes.podresources import AllocationProbe

    (probe,) = [p for p in suite.probes if isinstance(p, AllocationProbe)]
    read = probe.reader.last
    assert read is not None and allocatable_counts(read) == {"nvidia.com/gpu": 2}
    assert not [f for f in obs.findings if "pod-resources" in f.message]


def test_check_suite_an_unreadable_socket_is_info_and_no_map(tmp_path):
    from agent.model import Severity
    from agent.verdict import decide

    suite, _ = _suite(str(tmp_path / "gone.sock"), tmp_path)
    obs, stats = suite.run(None)
    assert suite.allocation is None
    mine = [f for f in obs.findings if "pod-resources" in f.message]
    assert [f.severity for f in mine] == [Severity.INFO] and not stats.failed
    assert decide(obs).status.value == "True"  # never a fault, never 'could not check'
