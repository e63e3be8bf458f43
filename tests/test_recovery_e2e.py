"""Per-GPU recovery end to end (docs/recovery.md): the real agent process against the real apiserver, with the chart's
own RBAC and admission policies (recovery on) and a token bound to a Pod on its node, the simulated host for the GPUs
(nvidia-smi and its reset stand-in) and kubelet's pod-resources API stand-in for who holds which GPU.

Xid 119 (GSP_RPC_TIMEOUT, RESET_GPU) on GPU 4 while two Pods hold it and four others hold GPUs 0-3: only the two are
evicted (the others are never touched), GPU 4 is reset once with `nvidia-smi -r -i <its bus id>`, proven, its latch
cleared, the device plugin's pod on the node restarted, GPUReady back to True. The refusals: a process holding the
GPU (no reset is attempted), a hung reset (killed, escalated), a failed reset, a RESTART_BM Xid (never the ladder),
and the budget kept across an agent restart (the second fault is reset by the restarted agent, the third within 24 h
escalates)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from testkit.controlplane import ControlPlane
from testkit.harness import wait_for

pytest.importorskip("grpc")  # the pod-resources stand-in's server (dev extra)

from testkit.recovery import Node, release_of, reset_processes, served_node

K = 4  # the GPU that faults


@pytest.fixture(scope="module")
def recovery_release(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with release_of(control_plane, tmp_path_factory.mktemp("rec")) as release:
        yield release


@pytest.fixture
def node(control_plane, recovery_release, tmp_path) -> Iterator[tuple[Node, str]]:
    with served_node(control_plane, recovery_release, tmp_path) as served:
        yield served


@pytest.mark.apiserver
def test_xid_119_on_gpu_4_is_drained_reset_proven_and_back_while_the_other_gpus_keep_serving(node):
    n, sock = node
    for i in range(4):
        n.add_pod(f"other-{i}", i)
    n.add_pod("train-a", K)
    n.add_pod("train-b", K)
    n.add_plugin_pod()
    n.host.set_reset("ok")
    a = n.agent(sock)
    try:
        a.wait_status(n.admin, "True", timeout=60)
        t_fault = time.monotonic()
        n.host.append_xid(119, gpu=K, text="Timeout after 6s of waiting for RPC response from GPU4 GSP!")
        n.sync(advertised=set(range(8)) - {K})  # the device plugin marks it unhealthy, as it does on an Xid

        def back() -> bool:
            n.kubelet_step()
            c = n.gpu_ready()
            return bool(c and c["status"] == "True" and n.host.resets())

        wait_for(back, 90, 0.05, "GPU 4 reset, proven and GPUReady=True again")
        t_back = time.monotonic()
        wait_for(lambda: (n.kubelet_step(), n.plugin_restarts >= 1)[1], 30, 0.1, "the plugin pod restarted")
        print(f"\n[recovery] Xid 119 on GPU 4 -> GPUReady=True again: {t_back - t_fault:.2f}s (poll 0.5s)")
        bus = n.gpus[K][0].nvml
        assert n.host.resets() == [f"-r -i {bus}"]  # one reset, of GPU 4 only
        assert sorted(n.deleted) == ["train-a", "train-b"]  # only the pods on GPU 4 were evicted
        assert sorted(n.pods) == [f"other-{i}" for i in range(4)]  # the others: never touched
        for i in range(4):
            p = n.admin.request("GET", f"/api/v1/namespaces/{n.ns}/pods/other-{i}")
            assert not p["metadata"].get("deletionTimestamp")
        assert n.plugin_restarts == 1
        wait_for(lambda: "GPURecovered" in n.events(), 30, 0.2, "the GPURecovered Event")
        ev = n.events()
        assert ev.count("GPURecoveryEvicted") == 2 and "GPURecoveryStarted" in ev and "DevicePluginRestarted" in ev
        assert "GPURecoveryFailed" not in ev
        assert a.metric("gpu_ready_gpu_recoveries_total") == 1.0
        assert a.metric("gpu_ready_gpu_resets_total", {"result": "ok"}) == 1.0
        assert a.metric("gpu_ready_gpu_recovery_escalations_total") == 0.0
        # a new pod on GPU 4 (the plugin advertises it again): the agent sees it held and healthy
        n.add_pod("train-c", K)
        wait_for(lambda: a.metric("gpu_ready_gpu_pods", {"pci_bus_id": bus}) == 1.0, 30, 0.2, "the new pod on GPU 4")
        assert n.gpu_ready()["status"] == "True"
        # The budget (2 resets per 24 h) is in the state file and survives a restart: the second fault is reset
        # again by the restarted agent, the third within 24 h escalates.
        assert a.terminate() == 0
        a = n.agent(sock)
        a.wait_status(n.admin, "True", timeout=60)
        n.host.append_xid(119, gpu=K, text="Timeout after 6s of waiting for RPC response from GPU4 GSP!")
        n.sync(advertised=set(range(8)) - {K})
        wait_for(lambda: back() and len(n.host.resets()) == 2, 90, 0.05, "the second fault reset and proven")
        assert "train-c" in n.deleted  # the pod on GPU 4 evicted again
        n.add_pod("train-d", K)
        wait_for(lambda: a.metric("gpu_ready_gpu_pods", {"pci_bus_id": bus}) == 1.0, 30, 0.2, "train-d on GPU 4")
        n.host.append_xid(119, gpu=K, text="Timeout after 6s of waiting for RPC response from GPU4 GSP!")
        c = a.wait_status(n.admin, "False", "GPURecoveryFailed", timeout=60)
        assert "retry budget spent: 2 reset(s) within 24 h (budget 2)" in c["message"], c["message"]
        assert len(n.host.resets()) == 2  # no third reset
        assert "train-d" in n.pods  # an escalation evicts nothing
    finally:
        a.terminate()


@pytest.mark.apiserver
def test_a_process_holding_the_gpu_refuses_the_reset_then_escalates(node):
    n, sock = node
    n.host.hold_gpu(K, 4242)
    a = n.agent(sock, **{"--recovery-drain-timeout": "3"})
    try:
        a.wait_status(n.admin, "True", timeout=60)
        n.host.append_xid(119, gpu=K)
        n.sync(advertised=set(range(8)) - {K})  # the device plugin marks it unhealthy (no new pod lands on it)
        c = a.wait_status(n.admin, "False", "GPURecoveryFailed", timeout=60)
        assert "process(es) hold it" in c["message"], c["message"]
        assert n.host.resets() == []  # never attempted
        assert "FatalXid" in c["message"]  # the fault stays latched
        bus = n.gpus[K][0].nvml
        assert a.metric("gpu_ready_gpu_remedy", {"pci_bus_id": bus, "remedy": "reset"}) == 1.0
        assert a.metric("gpu_ready_gpu_recovery_step", {"pci_bus_id": bus, "step": "escalated"}) == 1.0
    finally:
        a.terminate()


@pytest.mark.apiserver
@pytest.mark.parametrize("mode", ["hang", "fail"])
def test_a_hung_or_failed_reset_is_killed_and_escalates(node, mode):
    n, sock = node
    n.host.set_reset(mode, seconds=3600)
    a = n.agent(sock, **{"--recovery-reset-timeout": "2"})
    try:
        a.wait_status(n.admin, "True", timeout=60)
        n.host.append_xid(119, gpu=K)
        n.sync(advertised=set(range(8)) - {K})  # the device plugin marks it unhealthy (no new pod lands on it)
        c = a.wait_status(n.admin, "False", "GPURecoveryFailed", timeout=60)
        assert "reset failed" in c["message"], c["message"]
        assert len(n.host.resets()) == 1  # never a loop: one attempt
        assert reset_processes(n.host) == []  # the hung one was killed with its process group
        result = "timeout" if mode == "hang" else "failed"
        assert a.metric("gpu_ready_gpu_resets_total", {"result": result}) == 1.0
        assert a.metric("gpu_ready_gpu_recovery_escalations_total") == 1.0
        wait_for(lambda: "GPURecoveryFailed" in n.events(), 30, 0.2, "the GPURecoveryFailed Event")
    finally:
        a.terminate()


@pytest.mark.apiserver
def test_a_restart_bm_xid_never_enters_the_ladder(node):
    n, sock = node
    n.add_pod("train-a", K)
    a = n.agent(sock)
    try:
        a.wait_status(n.admin, "True", timeout=60)
        n.host.append_xid(79, gpu=K)
        a.wait_status(n.admin, "False", "FatalXid", timeout=60)
        start = a.metric("gpu_ready_condition_writes_total") or 0
        cycles = lambda: int(float(a.http("/readyz")[1].split()[1]))  # noqa: E731  "ok: N cycles"
        c0 = cycles()
        wait_for(lambda: cycles() >= c0 + 6, 30, 0.1, "six more check cycles")
        assert n.host.resets() == [] and "train-a" in n.pods and not n.deleted
        assert a.metric("gpu_ready_gpu_recovery_step") is None  # no ladder at all
        assert a.metric("gpu_ready_gpu_remedy", {"pci_bus_id": n.gpus[K][0].nvml, "remedy": "node"}) == 1.0
        assert n.gpu_ready()["reason"] == "FatalXid" and start >= 1
    finally:
        a.terminate()


@pytest.mark.apiserver
def test_an_agent_stopped_during_a_reset_kills_it_and_the_next_one_resumes_without_resetting_again(node):
    """SIGTERM while `nvidia-smi -r` hangs: the agent kills it on the way out (nothing outlives the agent). The
    attempt was written before the reset started, so the restarted agent finds the ladder in `resetting` with a
    reset started and no outcome: it goes on to the proof (the GPU answers healthy) instead of resetting again."""
    n, sock = node
    n.host.set_reset("hang", seconds=3600)
    a = n.agent(sock, **{"--recovery-reset-timeout": "300"})
    try:
        a.wait_status(n.admin, "True", timeout=60)
        n.host.append_xid(119, gpu=K)
        n.sync(advertised=set(range(8)) - {K})  # the device plugin marks it unhealthy (no new pod lands on it)
        wait_for(lambda: reset_processes(n.host) and n.host.resets(), 60, 0.05, "the reset running (hung)")
        assert a.terminate() == 0
        assert reset_processes(n.host) == []  # killed with the agent
        assert len(n.host.resets()) == 1
        n.host.set_reset("ok")
        a = n.agent(sock)
        wait_for(lambda: (n.gpu_ready() or {}).get("status") == "True", 60, 0.1, "GPUReady=True after the proof")
        assert len(n.host.resets()) == 1  # resumed at the proof: not reset a second time
        assert a.metric("gpu_ready_gpu_recoveries_total") == 1.0
        assert "reset outcome unknown (agent restarted): proving" in a.logs()
    finally:
        a.terminate()
