"""`gpu-ready gpus` and `gpu-ready check --json`'s `allocation` section, end to end: the CLI in a subprocess on the
simulated GPU host, reading a gRPC pod-resources server (grpcio from the dev extras, serving the vendored kubelet
proto on a unix socket, as kubelet does) whose device IDs are the simulated GPUs' UUIDs. The real kubelet is in
tests/test_allocation_node.py and tests/test_podresources_kubelet.py; here the CLI's output and exit codes are
pinned."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from agent.report.blast_radius import HEADER

grpc = pytest.importorskip("grpc")  # dev extra; the CLI itself needs no grpcio
pb = pytest.importorskip("agent.proto.podresources_v1_pb2")
from testkit.podresources import Kubelet, pod, serve_pod_resources  # noqa: E402 - after the dev-extra check


@pytest.fixture
def kubelet() -> Iterator[tuple[str, Kubelet]]:
    with serve_pod_resources() as served:
        yield served


def run(simhost: Any, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args, *simhost.check_args()],
        capture_output=True,
        text=True,
        timeout=120,
    )


def serve_layout(simhost: Any, k: Kubelet) -> list[tuple[Any, str, list[str]]]:
    """GPU 0: whole, held by ml/train-0; GPU 1: 4 time-sliced replicas, 2 held by ml/a and ml/b; the rest free;
    the last GPU left out of allocatable (the plugin marked it unhealthy: fenced)."""
    gpus = simhost.gpu_uuids()
    u = [uuid for _, uuid, _ in gpus]
    k.devices = [
        pb.ContainerDevices(
            resource_name="nvidia.com/gpu", device_ids=[u[0], *(f"{u[1]}::{n}" for n in range(4)), *u[2:-1]]
        )
    ]
    k.pods = [pod("train-0", [u[0]]), pod("a", [f"{u[1]}::0"]), pod("b", [f"{u[1]}::1"])]
    return gpus


def test_gpus_table(simhost, kubelet):
    sock, k = kubelet
    gpus = serve_layout(simhost, k)
    r = run(simhost, "gpus", "--pod-resources-socket", sock)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == HEADER
    rows = {line.split()[1]: line for line in lines[1 : 1 + len(gpus)]}
    assert set(rows) == {addr.nvml for addr, _, _ in gpus}
    first, second, last = (rows[gpus[i][0].nvml].split() for i in (0, 1, -1))
    assert first[3:10] == ["none", "1", "1", "full", "healthy", "-", "ml/train-0"]
    assert second[3:7] == ["replicas", "4", "2", "partial"] and second[-2:] == ["ml/a,", "ml/b"]
    assert last[6] == "fenced"
    n = len(gpus)
    assert lines[-1] == (
        f"Summary: {n - 3} free whole GPUs, 1 partial, 2 stranded slots, packing ratio 1.00, 1 fenced"
    ), r.stdout
    print("\n" + r.stdout)


def test_gpus_json(simhost, kubelet):
    sock, k = kubelet
    gpus = serve_layout(simhost, k)
    r = run(simhost, "gpus", "--json", "--pod-resources-socket", sock)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["summary"] == {
        "free_whole": len(gpus) - 3,
        "partial": 1,
        "stranded_slots": 2,
        "packing_ratio": 1.0,
        "fenced": 1,
    }
    g1 = out["gpus"][1]
    assert g1["uuid"] == gpus[1][1] and g1["pci_bus_id"] == gpus[1][0].nvml and g1["index"] == 1
    assert g1["pods"] == ["ml/a", "ml/b"] and g1["state"] == "partial" and g1["health"] == "healthy"


def test_unhealthy_gpu_shows_in_health_column(simhost, kubelet):
    sock, k = kubelet
    gpus = serve_layout(simhost, k)
    simhost.append_xid(79, gpu=0)
    out = json.loads(run(simhost, "gpus", "--json", "--pod-resources-socket", sock).stdout)
    assert [g["health"] for g in out["gpus"]][:2] == ["UNHEALTHY", "healthy"]
    assert out["gpus"][0]["pci_bus_id"] == gpus[0][0].nvml


def test_unreachable_socket_is_one_line_and_exit_2(simhost, tmp_path):
    missing = str(tmp_path / "nope.sock")
    r = run(simhost, "gpus", "--pod-resources-socket", missing)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gpu-ready: cannot read pod-resources at {missing}: "), r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "bad",
    [["--pod-resources-timeout", "0"], ["--pod-resources-timeout", "abc"], ["--xid-rate-window", "-1"]],
)
def test_bad_flags_exit_2_with_one_line(simhost, bad):
    r = run(simhost, "gpus", *bad)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "configuration error" in r.stderr, r.stderr


def test_check_json_has_the_allocation_section(simhost, kubelet):
    sock, k = kubelet
    serve_layout(simhost, k)
    r = run(simhost, "check", "--json", "--pod-resources", "true", "--pod-resources-socket", sock)
    out = json.loads(r.stdout)
    assert out["allocation_error"] is None and out["allocation"]["partial"] == 1
    assert out["allocation"]["gpus"][0]["pods"] == [{"namespace": "ml", "pod": "train-0", "container": "main"}]
    off = json.loads(run(simhost, "check", "--json").stdout)
    assert off["allocation"] is None and off["allocation_error"] == "podResources is off"
    r = run(simhost, "check", "--json", "--pod-resources", "true", "--pod-resources-socket", sock + ".gone")
    gone = json.loads(r.stdout)
    assert gone["allocation"] is None and sock + ".gone" in gone["allocation_error"]
    assert gone["status"] == "True"  # an unreadable socket never changes readiness


def test_a_gpu_whose_rail_is_down(tmp_path, kubelet):
    """An HGX layout: each GPU below its own PCIe port with a ConnectX beside it; the rail of GPU 3 is down."""
    from testkit.simhost import SimHost

    host = SimHost(tmp_path / "hgx", pcie_bridges=True)
    for i in range(8):
        host.add_rail(f"mlx5_{i}", gpu=i)
    host.set_ib_port("mlx5_3", state="1: DOWN", phys_state="3: Disabled")
    sock, k = kubelet
    gpus = serve_layout(host, k)
    r = run(host, "gpus", "--pod-resources-socket", sock)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == [*HEADER.split()[:-1], "RAIL", "PODS"]
    rows = {line.split()[1]: line.split() for line in lines[1 : 1 + len(gpus)]}
    assert rows[gpus[3][0].nvml][9:11] == ["mlx5_3", "DOWN"]
    assert rows[gpus[0][0].nvml][9:11] == ["mlx5_0", "ml/train-0"]
    out = json.loads(run(host, "gpus", "--json", "--pod-resources-socket", sock).stdout)
    assert [g["rail"] for g in out["gpus"]][2:5] == ["mlx5_2", "mlx5_3 DOWN", "mlx5_4"]
    print("\n" + r.stdout)
