"""The per-GPU recovery ladder held by the fleet brake, end to end (docs/recovery.md "The fleet brake"): the real
agent process against the real apiserver, with the chart's RBAC and admission policies (recovery on, the controller
and its brake on, so the agent's token may watch the brake ConfigMap by name) and a token bound to a Pod on its
node; the test itself writes the brake ConfigMap in the controller's format (no controller runs).

Xid 119 on GPU 4 (two Pods hold it) and on GPU 5 (no Pod holds it) while the brake is engaged and this node is not
admitted: both latch and are fenced, GPU 4 waits in `draining` (no eviction), GPU 5 in `resetting` (no reset), for
several check cycles. The ConfigMap is then rewritten as the controller writes it once it admits the node: the
Pods on GPU 4 are evicted, each GPU is reset exactly once, GPUReady returns True."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from testkit.controlplane import ControlPlane
from testkit.harness import wait_for

pytest.importorskip("grpc")  # the pod-resources stand-in's server (dev extra)

from testkit.podresources import serve_pod_resources
from testkit.recovery import Node
from testkit.recovery import recovery_release as make_release

HELD, FREE = 4, 5  # GPU 4: two pods hold it; GPU 5: none
XID_TEXT = "Timeout after 6s of waiting for RPC response from GPU{} GSP!"
BRAKE_ON = ["--set", "preflight.enabled=true", "--set", "preflight.auto.enabled=true"]  # the brake's RBAC for the agent
SMI_RUNS = {"check": "nvidia_smi"}  # one per check cycle


@pytest.fixture
def node(control_plane: ControlPlane, tmp_path) -> Iterator[tuple[Node, str]]:
    admin = control_plane.admin()
    rel, plugin_ns, uid = make_release(control_plane, control_plane.kubeconfig(tmp_path / "admin"), "rbk", BRAKE_ON)
    n = Node(control_plane, admin, rel, plugin_ns, uid, tmp_path)
    try:
        with serve_pod_resources() as (sock, k):
            n.kubelet = k
            n.sync(advertised=set(range(8)))
            yield n, sock
    finally:
        admin.close()


def write_brake(n: Node, data: dict[str, str], create: bool = False) -> None:
    """The brake ConfigMap as gpu-ready controller writes it (agent/controller/plan.py `BrakeState.data`)."""
    cms = f"/api/v1/namespaces/{n.rel.ns}/configmaps"
    body: dict[str, Any] = {"metadata": {"name": f"{n.rel.fullname}-brake"}, "data": data}
    n.admin.request("POST" if create else "PUT", cms if create else f"{cms}/{n.rel.fullname}-brake", body)


@pytest.mark.apiserver
def test_an_engaged_brake_holds_eviction_and_reset_until_it_admits_the_node(node):
    n, sock = node
    n.add_pod("train-a", HELD)
    n.add_pod("train-b", HELD)
    n.add_pod("other-0", 0)
    n.add_plugin_pod()
    n.host.set_reset("ok")
    engaged = {"engaged": "true", "admitted": "gpu-a,gpu-b", "unavailable": "3", "maxUnavailable": "2"}
    write_brake(n, {**engaged, "gpuNodes": "10"}, create=True)
    a = n.agent(
        sock,
        # the drain timeout long enough that the held ladders never escalate on a loaded machine
        # two GPUs fault at once here: the burst window (one baseboard) is off, the brake is what is tested
        **{
            "--brake-configmap": f"{n.rel.ns}/{n.rel.fullname}-brake",
            "--recovery-drain-timeout": "600",
            "--recovery-burst-window": "0",
        },
    )
    try:
        a.wait_status(n.admin, "True", timeout=60)
        bus = {g: n.gpus[g][0].nvml for g in (HELD, FREE)}

        def step(g: int, name: str) -> bool:
            return a.metric("gpu_ready_gpu_recovery_step", {"pci_bus_id": bus[g], "step": name}) == 1.0

        def cycles() -> float:
            n.kubelet_step()  # a pod deleted meanwhile would leave pod-resources and be counted below
            return a.metric("gpu_ready_check_duration_seconds_count", SMI_RUNS) or 0.0

        for g in (HELD, FREE):
            n.host.append_xid(119, gpu=g, text=XID_TEXT.format(g))
        n.sync(advertised=set(range(8)) - {HELD, FREE})  # the device plugin marks them unhealthy
        a.wait_status(n.admin, "False", "FatalXid", timeout=60)  # latched: the verdict fences both
        wait_for(lambda: step(HELD, "draining") and step(FREE, "resetting"), 60, 0.1, "both ladders waiting")

        # Several check cycles with the brake engaged: nothing evicted, nothing reset, the faults stay latched.
        c0 = cycles()
        wait_for(lambda: cycles() >= c0 + 6, 60, 0.1, "six more check cycles")
        assert n.host.resets() == []
        assert n.deleted == [] and sorted(n.pods) == ["other-0", "train-a", "train-b"]
        for p in n.pods:
            assert not n.admin.request("GET", f"/api/v1/namespaces/{n.ns}/pods/{p}")["metadata"].get(
                "deletionTimestamp"
            )
        assert step(HELD, "draining") and step(FREE, "resetting")
        assert a.metric("gpu_ready_latched_faults") == 2.0  # both latched
        for g in (HELD, FREE):  # judged unhealthy (fenced) and waiting for a reset
            assert a.metric("gpu_ready_gpu_healthy", {"pci_bus_id": bus[g]}) == 0.0
            assert a.metric("gpu_ready_gpu_remedy", {"pci_bus_id": bus[g], "remedy": "reset"}) == 1.0
        c = n.gpu_ready()
        assert c is not None and c["status"] == "False" and c["reason"] == "FatalXid", c
        ev = n.events()
        assert "GPURecoveryEvicted" not in ev and "GPURecoveryFailed" not in ev
        assert a.metric("gpu_ready_gpu_resets_total", {"result": "ok"}) in (None, 0.0)

        # The controller admits this node (still over its budget: engaged stays "true"): the ladders proceed.
        write_brake(n, {**engaged, "admitted": f"gpu-a,{n.name}", "gpuNodes": "10"})

        def back() -> bool:
            n.kubelet_step()
            c = n.gpu_ready()
            return bool(c and c["status"] == "True" and len(n.host.resets()) == 2)

        wait_for(back, 120, 0.05, "both GPUs reset, proven and GPUReady=True again")
        assert sorted(n.host.resets()) == sorted(f"-r -i {bus[g]}" for g in (HELD, FREE))  # once each
        assert sorted(n.deleted) == ["train-a", "train-b"]  # only the pods on GPU 4, evicted after the lift
        assert sorted(n.pods) == ["other-0"]
        assert a.metric("gpu_ready_gpu_recoveries_total") == 2.0
        assert a.metric("gpu_ready_gpu_resets_total", {"result": "ok"}) == 2.0
        assert a.metric("gpu_ready_gpu_recovery_escalations_total") == 0.0
        assert a.metric("gpu_ready_latched_faults") == 0.0  # each GPU's latch cleared by its proof
        # a few cycles more: no further reset
        c1 = cycles()
        wait_for(lambda: cycles() >= c1 + 3, 60, 0.1, "three more check cycles")
        assert len(n.host.resets()) == 2
    finally:
        a.terminate()
