"""What real GPUs answer a reset, end to end (docs/recovery.md, "what the reset answered"): the real agent process
against the real apiserver with the chart's RBAC and admission policies (recovery on), the simulated host's
nvidia-smi answering `-r` with the words of real resets (tests/fixtures/reset-*.txt).

- A reset refused while something holds the GPU (a process with /dev/nvidia<minor> open) costs no budget, is tried
  again after a backoff, and ends as GPUResetRefused naming the holder.
- Persistence mode is turned off for the reset (a GPU refused while it is on resets once it is off) and restored
  after a success and after a failure.
- A fabric still training after the reset does not fail the proof; one that never finishes does.
- Two GPUs faulting within the burst window escalate the node with no reset attempted.
- A platform that answers "not supported" is never asked again (the ladder is off for the node).
- SIGKILL during a reset with the state file cut in half: the restarted agent does not reset again, reports the
  state file on /healthz, and the budget still counts the reset."""

from __future__ import annotations

import json
import os
import secrets
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from testkit.controlplane import ControlPlane
from testkit.fixture_files import fixture_path
from testkit.harness import wait_for

pytest.importorskip("grpc")  # the pod-resources stand-in's server (dev extra)

from testkit.podresources import serve_pod_resources
from testkit.recovery import Node, release_of, reset_processes, served_node
from testkit.recovery import recovery_release as make_release

K = 4  # the GPU that faults
REFUSED = fixture_path("reset-refused-persistence-nvsentinel-1690.txt").read_text()


@pytest.fixture(scope="module")
def recovery_release(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with release_of(control_plane, tmp_path_factory.mktemp("rst"), name="rst") as release:
        yield release


@pytest.fixture
def node(control_plane, recovery_release, tmp_path) -> Iterator[tuple[Node, str]]:
    with served_node(control_plane, recovery_release, tmp_path, dev_nodes=True) as served:
        yield served


def refused_for(n: Node, gpu: int = K) -> str:
    """The NVSentinel#1690 refusal, naming this GPU."""
    return REFUSED.replace("00000000:1A:00.0", n.gpus[gpu][0].nvml)


def journal(n: Node) -> list[str]:
    d = n.host.state_dir / "resets"
    return sorted(p.name.rsplit(".", 1)[1] for p in d.iterdir()) if d.exists() else []


@pytest.mark.apiserver
def test_a_reset_refused_by_a_holder_costs_no_budget_and_ends_as_gpu_reset_refused_naming_it(node):
    n, sock = node
    holder = n.host.hold_dev_node(K, 4242, "nv-hostengine")
    n.host.set_reset("ok", refused=refused_for(n), held_by_files=(holder,))
    a = n.agent(sock, **{"--recovery-drain-timeout": "6"})
    try:
        a.wait_status(n.admin, "True", timeout=60)
        n.host.append_xid(119, gpu=K)
        n.sync(advertised=set(range(8)) - {K})  # the device plugin marks it unhealthy (no new pod lands on it)
        c = a.wait_status(n.admin, "False", "GPUResetRefused", timeout=60)
        assert "nv-hostengine" in c["message"] and "4242" in c["message"], c["message"]
        tries = len(n.host.resets())
        assert tries >= 2  # tried again after the backoff, not escalated at the first refusal
        assert journal(n) == ["free"] * tries  # every refused attempt given back to the budget
        assert a.metric("gpu_ready_gpu_resets_total", {"result": "refused"}) == float(tries)
        assert "FatalXid" in c["message"]  # the fault stays latched
        wait_for(lambda: "GPUResetRefused" in n.events(), 30, 0.2, "the GPUResetRefused Event")
        assert "GPURecoveryFailed" not in n.events()
    finally:
        a.terminate()


@pytest.mark.apiserver
def test_a_holder_daemonsets_pod_is_deleted_before_the_reset_which_then_succeeds(control_plane, tmp_path):
    """`recovery.releaseHolders` (dcgm-exporter here): the stand-in refuses the reset while the holder pod runs; the
    agent deletes that pod on its node first (the chart's policy allows exactly it), the kubelet stand-in stops it,
    and the one reset succeeds. The holder's pod on another node is never touched."""
    from testkit.cluster import ensure_namespace
    from testkit.recovery import create_plugin_daemonset

    admin = control_plane.admin()
    hns = f"dcgm-{secrets.token_hex(3)}"
    ensure_namespace(admin, hns)
    ds = create_plugin_daemonset(admin, hns, "nvidia-dcgm-exporter")
    extra = ["--set", f"recovery.releaseHolders[0].namespace={hns}",
             "--set", "recovery.releaseHolders[0].daemonSet=nvidia-dcgm-exporter"]  # fmt: skip
    rel, plugin_ns, uid = make_release(control_plane, control_plane.kubeconfig(tmp_path / "admin"), "rsh", extra)
    n = Node(control_plane, admin, rel, plugin_ns, uid, tmp_path)
    elsewhere = Node(control_plane, admin, rel, plugin_ns, uid, tmp_path / "b")
    with serve_pod_resources() as (sock, k):
        n.kubelet = k
        n.sync(advertised=set(range(8)))
        handle = tmp_path / "dcgm-handle"
        n.add_holder_pod(ds, handle)
        theirs = elsewhere.add_holder_pod(ds, tmp_path / "other-handle")
        n.host.set_reset("ok", refused=refused_for(n), held_by_files=(handle,))
        a = n.agent(sock, **{"--recovery-release-holders": f"{hns}/nvidia-dcgm-exporter"})
        try:
            a.wait_status(admin, "True", timeout=60)
            n.host.append_xid(119, gpu=K)
            n.sync(advertised=set(range(8)) - {K})
            wait_for(lambda: (n.kubelet_step(), n.host.resets() and (n.gpu_ready() or {}).get("status") == "True")[1],
                     60, 0.05, "the holder released, the GPU reset and proven")  # fmt: skip
            assert not handle.exists() and not n.holders
            # a reset refused before the kubelet stopped the holder is given back; the one success counts
            assert journal(n)[-1] == "charged" and set(journal(n)[:-1]) <= {"free"}
            assert a.metric("gpu_ready_gpu_resets_total", {"result": "ok"}) == 1.0
            p = admin.request("GET", f"/api/v1/namespaces/{theirs[0]}/pods/{theirs[1]}")
            assert not p["metadata"].get("deletionTimestamp")  # the other node's holder: untouched
            wait_for(lambda: "GPUHolderReleased" in n.events(), 30, 0.2, "the GPUHolderReleased Event")
        finally:
            a.terminate()
            admin.close()


@pytest.mark.apiserver
@pytest.mark.parametrize("outcome", ["succeeded", "failed"])
def test_persistence_mode_is_turned_off_for_the_reset_and_restored_whatever_the_outcome(node, outcome):
    n, sock = node
    bus = n.gpus[K][0].nvml
    n.host.set_persistence(K, True)
    if outcome == "succeeded":  # refused while persistence mode is on (NVIDIA/NVSentinel#1690), fine once it is off
        n.host.set_reset("ok", refused=refused_for(n), held_by_pm=True)
    else:
        n.host.set_reset("answer", answer="Unable to reset GPU: something went wrong\n", exit_code=255)
    a = n.agent(sock)
    try:
        a.wait_status(n.admin, "True", timeout=60)
        n.host.append_xid(119, gpu=K)
        n.sync(advertised=set(range(8)) - {K})
        if outcome == "succeeded":
            wait_for(lambda: (n.kubelet_step(), n.host.resets() and (n.gpu_ready() or {}).get("status") == "True")[1],
                     60, 0.1, "reset with persistence off, proven, GPUReady=True")  # fmt: skip
            assert journal(n) == ["charged"]
        else:
            c = a.wait_status(n.admin, "False", "GPURecoveryFailed", timeout=60)
            assert "reset failed" in c["message"], c["message"]
        assert len(n.host.resets()) == 1
        assert n.host.persistence_changes() == [f"{bus} 0", f"{bus} 1"]  # off for the reset, on again after
        assert n.host.persistence(K) == "Enabled"
    finally:
        a.terminate()


@pytest.mark.apiserver
@pytest.mark.parametrize("finishes", [True, False])
def test_a_fabric_still_training_after_the_reset_is_waited_for_and_one_that_never_finishes_fails(node, finishes):
    n, sock = node
    n.host.set_fabric("Completed", "Success", clique_id=1)
    training = (("In Progress", "N/A"),) * 3
    n.host.set_reset("ok", fabric_after=(*training, ("Completed", "Success")) if finishes else training)
    a = n.agent(sock, **{"--recovery-settle-timeout": "60" if finishes else "3"})
    try:
        a.wait_status(n.admin, "True", timeout=60)
        n.host.append_xid(119, gpu=K)
        n.sync(advertised=set(range(8)) - {K})
        if finishes:
            wait_for(lambda: (n.kubelet_step(), n.host.resets() and (n.gpu_ready() or {}).get("status") == "True")[1],
                     60, 0.1, "proven once the fabric completed")  # fmt: skip
            assert a.metric("gpu_ready_gpu_recoveries_total") == 1.0
            sc = json.loads(n.host.scenario.read_text())
            assert sc["q_pending"] == [] and "Completed" in sc["q_output"]  # every training read came before the proof
        else:
            c = a.wait_status(n.admin, "False", "GPURecoveryFailed", timeout=60)
            assert "not settled within 3s" in c["message"] and "In Progress" in c["message"], c["message"]
        assert len(n.host.resets()) == 1
    finally:
        a.terminate()


@pytest.mark.apiserver
def test_two_gpus_faulting_within_the_burst_window_escalate_the_node_with_no_reset(node):
    n, sock = node
    a = n.agent(sock)
    try:
        a.wait_status(n.admin, "True", timeout=60)
        n.host.append_kmsg(n.host.xid_line(119, 3), n.host.xid_line(119, K))
        c = a.wait_status(n.admin, "False", "GPURecoveryFailed", timeout=60)
        assert "one baseboard" in c["message"], c["message"]
        wait_for(lambda: a.metric("gpu_ready_gpu_recovery_escalations_total") == 2.0, 30, 0.1, "both escalated")
        assert n.host.resets() == []
    finally:
        a.terminate()


@pytest.mark.apiserver
def test_a_platform_that_cannot_reset_is_never_asked_again(node):
    n, sock = node
    unsupported = fixture_path("reset-unsupported-not-supported-constructed.txt").read_text()
    n.host.set_reset("answer", answer=unsupported.replace("00000000:BB:00.0", n.gpus[K][0].nvml), exit_code=3)
    a = n.agent(sock, **{"--recovery-burst-window": "0"})  # the second GPU below is not a burst
    try:
        a.wait_status(n.admin, "True", timeout=60)
        n.host.append_xid(119, gpu=K)
        n.sync(advertised=set(range(8)) - {K})  # the device plugin marks it unhealthy (no new pod lands on it)
        c = a.wait_status(n.admin, "False", "GPURecoveryFailed", timeout=60)
        assert "reset unsupported" in c["message"], c["message"]
        wait_for(lambda: "GPUResetUnavailable" in n.events(), 30, 0.2, "the GPUResetUnavailable Event")
        assert journal(n) == ["free"]  # not charged
        n.host.append_xid(119, gpu=2)  # another GPU later: never reset on this node until the agent restarts
        wait_for(lambda: a.metric("gpu_ready_gpu_recovery_escalations_total") == 2.0, 30, 0.1, "GPU 2 escalated")
        assert len(n.host.resets()) == 1
        assert "per-GPU reset is off on this node" in (n.gpu_ready() or {}).get("message", "")
    finally:
        a.terminate()


@pytest.mark.apiserver
def test_sigkill_during_a_reset_with_the_state_file_cut_in_half_never_resets_twice(node):
    """The reset is recorded in the reset journal (a file of its own, created before the reset starts); the state
    file torn in the middle of a write loses the latches and the ladder, not the journal: the restarted agent
    replays the kernel log, finds the reset started with no outcome, and proves it instead of resetting again."""
    n, sock = node
    n.host.set_reset("hang", seconds=3600)
    a = n.agent(sock, **{"--recovery-reset-timeout": "300"})
    try:
        a.wait_status(n.admin, "True", timeout=60)
        n.host.append_xid(119, gpu=K)
        n.sync(advertised=set(range(8)) - {K})  # the device plugin marks it unhealthy (no new pod lands on it)
        wait_for(lambda: reset_processes(n.host) and n.host.resets(), 60, 0.05, "the reset running (hung)")
        assert a.proc is not None
        os.kill(a.proc.pid, signal.SIGKILL)  # no clean-up of any kind
        a.proc.wait(10)
        for pid in reset_processes(n.host):  # what the killed agent could not stop (it ran in its own session)
            os.kill(pid, signal.SIGKILL)
        state = n.host.state_dir / "state.json"
        raw = state.read_bytes()
        state.write_bytes(raw[: len(raw) // 2])  # torn in the middle of a write
        assert journal(n) == ["started"]
        n.host.set_reset("ok")
        a = n.agent(sock)
        wait_for(lambda: (n.gpu_ready() or {}).get("status") == "True" and "corrupt state file" in a.logs(),
                 60, 0.1, "GPUReady=True after the proof")  # fmt: skip
        assert len(n.host.resets()) == 1  # never reset a second time
        assert "a reset started by an earlier agent has no recorded outcome" in a.logs()
        code, body = a.http("/healthz")
        assert code != 200 and "corrupt state file" in body  # loud, not "ok"
        assert journal(n) == ["charged"]  # counted in the budget: it ran (its outcome proven, not known)
    finally:
        a.terminate()
