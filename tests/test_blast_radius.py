"""Publishing the allocation map (agent/report/blast_radius.py): metrics, the blast radius (which pods get an Event,
once per transition), the condition's pod count, the `gpu-ready gpus` table; and the blast-radius Events themselves
on the real apiserver (about the Node, in the events namespace, naming the pod: the agent reads no Pod)."""

from __future__ import annotations

import re
import secrets
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from agent.allocation import (
    AllocationMap,
    ContainerAllocation,
    PodRef,
    ResourceDevices,
    build_map,
)
from agent.kube.client import KubeApi
from agent.model import Counts, GpuStatus, PciAddress, Reason, Status, Verdict
from agent.report.blast_radius import (
    EVENT_REASON,
    HEADER,
    AllocationMetrics,
    BlastRadius,
    affected_note,
    gpus_json,
    render_gpus,
    short_uuid,
)
from agent.report.events import EventReporter
from agent.report.metrics import Metrics
from agent.verdict import with_note
from testkit.allocation import inventory_from
from testkit.cluster import EVENT_NAMESPACE, ensure_namespace
from testkit.harness import wait_for

BUS = [PciAddress(0, b, 0) for b in (0x19, 0x3B, 0x5D, 0x9A)]
UUID = [f"GPU-{i}f2a1b4c-0000-4000-8000-00000000000{i}" for i in range(4)]
MIG = {3: [f"MIG-{j}aaa0000-0000-4000-8000-0000000000{j}0" for j in range(7)]}
INV = inventory_from((UUID[i], BUS[i], i, MIG.get(i, [])) for i in range(4))


def pod(ns: str, name: str, c: str = "main") -> PodRef:
    return PodRef(ns, name, c)


def a_map(extra_pods: int = 0) -> AllocationMap:
    """GPU 0: 4 time-sliced replicas, 2 held (partial); GPU 1 whole and held (full); GPU 2 free; GPU 3 MIG 7 slots,
    1 held (partial), + `extra_pods` pods on GPU 1 replicas... (GPU 1 is whole: extra pods share GPU 0)."""
    allocatable = [
        ResourceDevices("nvidia.com/gpu", (*(f"{UUID[0]}::{n}" for n in range(4)), UUID[1], UUID[2])),
        ResourceDevices("nvidia.com/mig-1g.10gb", tuple(MIG[3])),
    ]
    listed = [
        ContainerAllocation(pod("ml", "train-0"), (ResourceDevices("nvidia.com/gpu", (f"{UUID[0]}::0",)),)),
        ContainerAllocation(pod("ml", "train-0", "side"), (ResourceDevices("nvidia.com/gpu", (f"{UUID[0]}::1",)),)),
        ContainerAllocation(pod("ml", "big"), (ResourceDevices("nvidia.com/gpu", (UUID[1],)),)),
        ContainerAllocation(pod("inf", "small"), (ResourceDevices("nvidia.com/mig-1g.10gb", (MIG[3][0],)),)),
    ]
    listed += [
        ContainerAllocation(pod("ml", f"x-{k}"), (ResourceDevices("nvidia.com/gpu", (f"{UUID[0]}::3",)),))
        for k in range(extra_pods)
    ]
    return build_map(listed, allocatable, INV)


def verdict(bad: dict[int, str] | None = None) -> Verdict:
    bad = bad or {}
    gpus = tuple(
        GpuStatus(i, BUS[i].nvml, "H100", i not in bad, (f"FatalXid: {bad[i]}",) if i in bad else ()) for i in range(4)
    )
    if bad:
        return Verdict(Status.FALSE, Reason.FATAL_XID, "FatalXid: GPU ...", gpus, (Reason.FATAL_XID,), Counts())
    return Verdict(Status.TRUE, Reason.GPUS_HEALTHY, "4 GPUs healthy", gpus, (Reason.GPUS_HEALTHY,), Counts())


def samples(reg: CollectorRegistry) -> dict[str, float]:
    text = generate_latest(reg).decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("gpu_ready_")
    }


# -- metrics ---------------------------------------------------------------------------------------------------


def test_metrics_per_gpu_and_per_node():
    reg = CollectorRegistry()
    m = AllocationMetrics(reg)
    amap = a_map()
    assert (amap.free_whole, amap.partial, amap.stranded_slots, amap.fenced) == (1, 2, 8, 0)
    m.publish(amap, enabled=True, read_seconds=0.004)
    s = samples(reg)
    b0, b1, b3 = BUS[0].nvml, BUS[1].nvml, BUS[3].nvml
    assert s[f'gpu_ready_gpu_slots{{pci_bus_id="{b0}"}}'] == 4
    assert s[f'gpu_ready_gpu_allocated_slots{{pci_bus_id="{b0}"}}'] == 2
    assert s[f'gpu_ready_gpu_pods{{pci_bus_id="{b0}"}}'] == 1  # two containers of one pod: one pod
    assert s[f'gpu_ready_gpu_pods{{pci_bus_id="{b1}"}}'] == 1
    assert s[f'gpu_ready_gpu_slots{{pci_bus_id="{b3}"}}'] == 7
    assert s[f'gpu_ready_gpu_fenced{{pci_bus_id="{b3}"}}'] == 0
    assert s["gpu_ready_free_whole_gpus"] == 1 and s["gpu_ready_partial_gpus"] == 2
    assert s["gpu_ready_stranded_slots"] == 8 and s["gpu_ready_fenced_gpus"] == 0
    # 3 GPUs in use; the fewest that could hold them: ceil(2/4) + ceil(1/1) + ceil(1/7) = 3
    assert s["gpu_ready_packing_ratio"] == amap.packing_ratio == 1.0
    assert s["gpu_ready_pod_resources_up"] == 1 and s["gpu_ready_pod_resources_read_seconds"] == 0.004
    assert set(re.findall(r'pci_bus_id="([^"]*)"', generate_latest(reg).decode())) == {b.nvml for b in BUS}


def test_a_gpu_that_leaves_the_map_loses_its_series_and_off_means_absent():
    reg = CollectorRegistry()
    m = AllocationMetrics(reg)
    amap = a_map()
    m.publish(amap, enabled=True)
    gone = replace(amap, gpus=amap.gpus[:2])
    m.publish(gone, enabled=True)
    text = generate_latest(reg).decode()
    assert BUS[0].nvml in text and BUS[3].nvml not in text and BUS[2].nvml not in text
    m.publish(None, enabled=True)  # the read failed: only up 0
    assert {k for k in samples(reg)} == {"gpu_ready_pod_resources_up"}
    assert samples(reg)["gpu_ready_pod_resources_up"] == 0
    m.publish(None, enabled=False)
    assert samples(reg) == {}


def test_packing_ratio_is_absent_when_nothing_is_allocated():
    reg = CollectorRegistry()
    m = AllocationMetrics(reg)
    idle = build_map([], [ResourceDevices("nvidia.com/gpu", tuple(UUID[:2]))], INV)
    m.publish(idle, enabled=True)
    s = samples(reg)
    assert "gpu_ready_packing_ratio" not in s and s["gpu_ready_free_whole_gpus"] == 2


def test_packing_ratio_two_when_twice_the_gpus_are_touched():
    """Two replicas of GPU 0 and one of GPU 1 (4 replicas each) could sit on one GPU: ratio 2.0."""
    ids = [f"{UUID[g]}::{n}" for g in (0, 1) for n in range(4)]
    listed = [
        ContainerAllocation(pod("a", f"p{i}"), (ResourceDevices("nvidia.com/gpu", (ids[k],)),))
        for i, k in enumerate((0, 1, 4))
    ]
    amap = build_map(listed, [ResourceDevices("nvidia.com/gpu", tuple(ids))], INV)
    reg = CollectorRegistry()
    AllocationMetrics(reg).publish(amap, enabled=True)
    assert samples(reg)["gpu_ready_packing_ratio"] == 2.0


def test_the_agent_metrics_carry_the_allocation_collector():
    m = Metrics()
    assert "gpu_ready_free_whole_gpus" not in generate_latest(m.registry).decode()
    m.allocation.publish(a_map(), enabled=True)
    assert "gpu_ready_free_whole_gpus 1.0" in generate_latest(m.registry).decode()


# -- the blast radius ------------------------------------------------------------------------------------------


def test_one_event_per_pod_per_transition():
    br = BlastRadius("node-a")
    amap = a_map()
    assert br.step(verdict(), amap) == []
    evs = br.step(verdict({0: "Xid 79"}), amap)
    assert [(e.namespace, e.pod) for e in evs] == [("ml", "train-0")]  # two containers, one Event
    e = evs[0]
    assert e.gpu == BUS[0].nvml and e.key == f"{BUS[0].nvml}|ml/train-0"
    assert e.note.startswith(f"GPU 0 ({BUS[0].nvml}, {UUID[0]}) on node node-a is unhealthy: FatalXid: Xid 79")
    assert "; pod ml/train-0 holds 2 slot(s) of it (containers: main, side)" in e.note
    assert br.step(verdict({0: "Xid 79"}), amap) == []  # still bad: no repeat
    evs = br.step(verdict({0: "Xid 79", 3: "Xid 48"}), amap)  # another GPU turns bad
    assert [(e.namespace, e.pod) for e in evs] == [("inf", "small")]
    assert br.step(verdict(), amap) == []  # recovered
    assert [e.pod for e in br.step(verdict({0: "Xid 79"}), amap)] == ["train-0"]  # bad again: fires again


def test_a_pod_that_takes_a_slot_of_a_bad_gpu_later_is_told_once():
    br = BlastRadius("n")
    br.step(verdict({0: "Xid 79"}), a_map())
    evs = br.step(verdict({0: "Xid 79"}), a_map(extra_pods=1))
    assert [e.pod for e in evs] == ["x-0"]


def test_events_per_cycle_are_bounded():
    br = BlastRadius("n", limit=5)
    evs = br.step(verdict({0: "Xid 79"}), a_map(extra_pods=9))
    assert len(evs) == 5 and br.dropped == 5
    assert len(br.step(verdict({0: "Xid 79"}), a_map(extra_pods=9))) == 5  # the rest next cycle


def test_no_map_no_events_and_no_note():
    br = BlastRadius("n")
    assert br.step(verdict({0: "Xid 79"}), None) == []
    assert affected_note(verdict({0: "Xid 79"}), None) == ""


def test_condition_message_counts_the_affected_pods():
    v = verdict({0: "Xid 79", 1: "Xid 79"})
    note = affected_note(v, a_map(extra_pods=1))
    assert note == "3 pods on the affected GPUs"  # train-0, x-0 on GPU 0; big on GPU 1
    assert with_note(v, note).message.endswith("; 3 pods on the affected GPUs")
    assert affected_note(verdict({1: "Xid 79"}), a_map()) == "1 pod on the affected GPUs"
    assert affected_note(verdict({2: "Xid 79"}), a_map()) == ""  # a free GPU: nobody affected
    assert affected_note(verdict(), a_map()) == ""


# -- the table -------------------------------------------------------------------------------------------------


def test_gpus_table():
    text = render_gpus(a_map(extra_pods=4), verdict({1: "Xid 79"}))
    lines = text.splitlines()
    assert lines[0] == HEADER
    assert HEADER.split() == [
        *("INDEX", "BUS", "ID", "UUID", "SHARING", "SLOTS", "USED", "STATE", "HEALTH", "REMEDY", "PODS")
    ]
    row0, row1, row2, row3 = lines[1:5]
    assert row0.split()[:8] == ["0", BUS[0].nvml, short_uuid(UUID[0]), "replicas", "4", "3", "partial", "healthy"]
    assert row0.endswith("ml/train-0, ml/x-0, ml/x-1 +2")
    assert row1.split()[6:10] == ["full", "UNHEALTHY", "-", "ml/big"]  # a verdict without a remedy: "-"
    assert row2.split()[6:10] == ["free", "healthy", "-", "-"]
    assert row3.split()[3:7] == ["mig", "7", "1", "partial"]
    assert lines[-1] == "Summary: 1 free whole GPUs, 2 partial, 7 stranded slots, packing ratio 1.00, 0 fenced"
    # columns line up: every row's BUS ID starts where the header's does
    col = HEADER.index("BUS ID")
    assert all(r[col : col + 16] in (b.nvml for b in BUS) for r in lines[1:5])


def test_short_uuid():
    assert short_uuid("") == "-"
    assert short_uuid("GPU-3f2a1b4c-1111") == "GPU-3f2a1b4c…"
    assert short_uuid("GPU-1") == "GPU-1"


def test_gpus_json():
    j = gpus_json(a_map(), verdict({3: "Xid 48"}))
    assert j["summary"] == {"free_whole": 1, "partial": 2, "stranded_slots": 8, "packing_ratio": 1.0, "fenced": 0}
    g3 = j["gpus"][3]
    assert g3 == {
        "index": 3,
        "pci_bus_id": BUS[3].nvml,
        "uuid": UUID[3],
        "sharing": "mig",
        "slots": 7,
        "allocated": 1,
        "state": "partial",
        "health": "UNHEALTHY",
        "remedy": None,  # the test verdict names no latched fault, so no remedy
        "recovery": None,
        "pods": ["inf/small"],
    }
    assert j["allocation"]["free_whole"] == 1


def test_fenced_gpu_in_table_and_metrics():
    """GPU 2 left out of allocatable (the plugin marked it unhealthy): fenced."""
    allocatable = [ResourceDevices("nvidia.com/gpu", (UUID[0], UUID[1], UUID[3]))]
    amap = build_map([], allocatable, inventory_from((UUID[i], BUS[i], i, []) for i in range(4)))
    assert amap.fenced == 1
    assert "fenced" in render_gpus(amap).splitlines()[3]
    reg = CollectorRegistry()
    AllocationMetrics(reg).publish(amap, enabled=True)
    assert samples(reg)[f'gpu_ready_gpu_fenced{{pci_bus_id="{BUS[2].nvml}"}}'] == 1


# -- blast-radius Events on the real apiserver ---------------------------------------------------------------


def _train_pod(admin: KubeApi) -> tuple[str, dict[str, Any]]:
    """A Pod `train-0` in a new namespace: (namespace, the Pod as created)."""
    ns = f"blast-{secrets.token_hex(3)}"
    ensure_namespace(admin, ns)
    pod = {"metadata": {"name": "train-0"}, "spec": {"containers": [{"name": "main", "image": "x"}]}}
    return ns, admin.request("POST", f"/api/v1/namespaces/{ns}/pods", pod)


@pytest.mark.apiserver
def test_blast_radius_events_land_on_the_node_naming_the_pod(admin):
    ns, p = _train_pod(admin)
    node = f"node-{secrets.token_hex(3)}"
    rep = EventReporter(admin, node, 300.0, EVENT_NAMESPACE)
    br = BlastRadius(node)
    amap = build_map(
        [ContainerAllocation(PodRef(ns, "train-0", "main"), (ResourceDevices("nvidia.com/gpu", (UUID[0],)),))],
        [ResourceDevices("nvidia.com/gpu", (UUID[0],))],
        INV,
    )
    calls: list[Any] = []
    orig = admin.request
    admin.request = lambda *a, **k: calls.append(a) or orig(*a, **k)  # type: ignore[method-assign]
    try:
        for e in br.step(verdict({0: "Xid 79"}), amap):
            rep.record(EVENT_REASON, e.note, e.key, "Warning", "Detected")
        assert rep.flush() == 1
    finally:
        admin.request = orig  # type: ignore[method-assign]
    assert [c[:2] for c in calls] == [("POST", f"/apis/events.k8s.io/v1/namespaces/{EVENT_NAMESPACE}/events")]
    ev = wait_for(lambda: node_events(admin, node), 30, 0.2, "the blast-radius Event")[0]
    assert ev["regarding"] == {"apiVersion": "v1", "kind": "Node", "name": node}
    assert ev["reason"] == "GPUUnhealthy" and ev["reportingController"] == "gpu-ready" and ev["type"] == "Warning"
    assert ev["note"].startswith(f"GPU 0 ({BUS[0].nvml}, {UUID[0]}) on node {node} is unhealthy: FatalXid: Xid 79")
    assert f"; pod {ns}/train-0 holds 1 slot(s)" in ev["note"]
    # nothing about the Pod itself, where `kubectl describe pod` would look
    core = admin.request(
        "GET", f"/api/v1/namespaces/{ns}/events", query={"fieldSelector": f"involvedObject.uid={p['metadata']['uid']}"}
    )
    assert core["items"] == []


def node_events(admin: KubeApi, node: str) -> list[dict[str, Any]]:
    """The GPUUnhealthy Events about `node` in the events namespace."""
    items = admin.request("GET", f"/apis/events.k8s.io/v1/namespaces/{EVENT_NAMESPACE}/events")["items"]
    return [e for e in items if e["reason"] == "GPUUnhealthy" and e["regarding"].get("name") == node]


# -- the running agent: metrics, condition message and Pod Events ----------------------------------------------


@pytest.mark.apiserver
def test_agent_blast_radius_end_to_end(agent_factory, admin, simhost):
    """The real agent (subprocess) reading a gRPC pod-resources server: a fatal Xid on GPU 0, held by one pod, turns
    the node False with "1 pod on the affected GPUs", writes one GPUUnhealthy Event about its Node naming that Pod
    (with a token that cannot read Pods) and exports gpu_ready_gpu_pods for the GPU."""
    import urllib.request

    pytest.importorskip("grpc")  # dev extra: the pod-resources stand-in's server
    from agent.proto import podresources_v1_pb2 as pb
    from testkit.cluster import AGENT_RULES
    from testkit.podresources import pod as grpc_pod
    from testkit.podresources import serve_pod_resources

    ns, _ = _train_pod(admin)
    gpus = simhost.gpu_uuids()

    with serve_pod_resources() as (sock, k):
        k.devices = [pb.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=[u for _, u, _ in gpus])]
        k.pods = [grpc_pod("train-0", [gpus[0][1]], ns=ns)]
        a = agent_factory(rules=AGENT_RULES, extra={"--pod-resources": "true", "--pod-resources-socket": sock})
        a.wait_status(admin, "True", timeout=60)
        simhost.append_xid(79, gpu=0)
        c = a.wait_status(admin, "False", "FatalXid", timeout=60)
        assert c["message"].endswith("; 1 pod on the affected GPUs"), c["message"]
        (ev,) = wait_for(lambda: node_events(admin, a.node), 60, 0.2, "the GPUUnhealthy Event on the node")
        assert ev["regarding"]["kind"] == "Node" and f"pod {ns}/train-0 holds 1 slot(s)" in ev["note"]
        assert gpus[0][0].nvml in ev["note"] and gpus[0][1] in ev["note"] and "Xid 79" in ev["note"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{a.port}/metrics", timeout=5).read().decode()
        assert f'gpu_ready_gpu_pods{{pci_bus_id="{gpus[0][0].nvml}"}} 1.0' in text
        assert "gpu_ready_pod_resources_up 1.0" in text
        a.terminate()
    assert len(node_events(admin, a.node)) == 1  # one Event per transition, not one per poll
