"""Fence one GPU, keep seven serving: DRA-aware GPU counting (agent/probes/dra.py) and per-GPU DeviceTaintRules
(agent/act/fencing/).

Plain-data tests first (parsing, counting, the device-plugin check deferring to DRA, the fencing view and plan),
then tests on a real kube-apiserver 1.37 with the REAL kube-scheduler (allocating ResourceClaims) and the REAL
kube-controller-manager (device-taint-eviction-controller), with the chart's own RBAC and admission policy and
tokens bound to a Pod on the node. No kubelet and no DRA driver run: the ResourceSlices are published by the test
(testkit/dra.py) exactly as the NVIDIA DRA driver publishes them (kubernetes-sigs/dra-driver-nvidia-gpu:
cmd/gpu-kubelet-plugin/deviceinfo.go@0545e9e55d69ba07ccc288283e144efbc9d292fa, GpuInfo.GetDevice and
MigDeviceInfo.GetDevice; mig.go CommonAttributesMig; one pool per node named after the node)."""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent import config
from agent.act.fencing.plan import (
    GPU_ANNOTATION,
    LONG_NODE,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    NODE_LABEL,
    TAINT_KEY,
    ExistingRule,
    FenceEffect,
    FencingSettings,
    fence_view,
    node_label,
    parse_rules,
    plan_fencing,
    rule_prefix,
    slot_of,
)
from agent.act.fencing.reporter import FenceMetrics, FenceReporter, FenceWorker
from agent.kernel_log.xid import KernelLogParser
from agent.kube.client import ApiError, KubeApi
from agent.model import (
    Check,
    Counts,
    Finding,
    GpuIdentity,
    LatchedFault,
    Observation,
    PciAddress,
    Reason,
    Severity,
    Status,
    Verdict,
)
from agent.probes.dra import (
    MAX_SLICES,
    DraInventory,
    SliceRead,
    match_gpus,
    parse_slices,
    probe_dra,
    probe_gpu_serving,
    read_node_slices,
)
from agent.verdict import MESSAGE_LIMIT, decide, with_note
from testkit.chart import apply_release
from testkit.cluster import bound_token, ensure_namespace
from testkit.controlplane import ControlPlane
from testkit.dra import (
    BUSES,
    DRIVER,
    DraPlane,
    allocated_device,
    claim_and_pod,
    device_class,
    get_pod,
    gpu_device,
    gpu_node,
    kube_minor,
    nvidia_slice,
    unschedulable,
    uuid,
)
from testkit.testbin import IN_CI, require_testbin

ADDRS = tuple(PciAddress(0, b, 0) for b in BUSES)
GPU3 = ADDRS[3]
MEASURED: dict[str, float] = {}


def observation(n: int = 8, findings: list[Finding] | None = None) -> Observation:
    gpus = {a: GpuIdentity(a, i, "NVIDIA H100 80GB HBM3") for i, a in enumerate(ADDRS[:n])}
    obs = Observation(findings=list(findings or []), gpus=gpus, counts=Counts(pci=n, nvidia_smi=n))
    obs.seen = {Check.PCI: frozenset(gpus), Check.NVIDIA_SMI: frozenset(gpus)}
    return obs


def xid_fault(addr: PciAddress = GPU3, xid: int = 79) -> LatchedFault:
    """The latched fault the agent keeps after this kernel-log line (parsed by the agent's own parser)."""
    line = f"NVRM: Xid (PCI:{addr.kernel}): {xid}, pid=2231, name=python, GPU has fallen off the bus."
    (ev,) = KernelLogParser().feed(line)
    assert ev.fatal and ev.address == addr
    return LatchedFault(ev.xid, ev.raw_address, ev.address, ev.source, ev.text, time.time())


def fatal_xid_verdict(addr: PciAddress = GPU3) -> Verdict:
    v = decide(observation(), [xid_fault(addr)])
    assert v.status is Status.FALSE and v.reason is Reason.FATAL_XID
    return v


def healthy_verdict() -> Verdict:
    v = decide(observation())
    assert v.status is Status.TRUE
    return v


def plugin_node(gpus: int | None) -> dict[str, Any]:
    res = {"cpu": "16"} if gpus is None else {"cpu": "16", "nvidia.com/gpu": str(gpus)}
    return {"metadata": {"name": "n", "labels": {}}, "status": {"capacity": res, "allocatable": res}}


# -- DRA-aware counting, on plain data ---------------------------------------------------------------------------


def test_counts_gpus_and_mig_devices_by_parent_uuid():
    inv = parse_slices([nvidia_slice("n", mig={6: 2, 7: 2})])
    assert inv.malformed is None and inv.slices == 1
    gpus = inv.gpus
    assert len(gpus) == 8 and inv.mig_devices == 4
    assert [g.pci for g in gpus] == list(ADDRS)
    by_pci = {g.pci: g for g in gpus}
    assert by_pci[ADDRS[0]].device is not None and by_pci[ADDRS[0]].mig == ()
    # static MIG: the GPU itself is not published; its MIG devices are grouped by parentUUID
    g7 = by_pci[ADDRS[7]]
    assert g7.device is None and g7.uuid == uuid(7)
    assert [d.name for d in g7.devices] == ["gpu-7-mig-3g40gb-9-0", "gpu-7-mig-3g40gb-9-4"]
    # dynamic MIG: both the GPU and its MIG devices, the GPU first
    both = {g.pci: g for g in parse_slices([nvidia_slice("n", mig={2: 3}, full_with_mig=True)]).gpus}
    assert [d.name for d in both[ADDRS[2]].devices] == [
        "gpu-2",
        "gpu-2-mig-3g40gb-9-0",
        "gpu-2-mig-3g40gb-9-4",
        "gpu-2-mig-3g40gb-9-8",
    ]
    assert len(both) == 8


def test_only_the_newest_generation_of_a_pool_counts_and_an_incomplete_pool_is_unknown():
    old = nvidia_slice("n", range(8), generation=1)
    new = nvidia_slice("n", range(7), generation=2)
    inv = parse_slices([old, new])
    assert len(inv.gpus) == 7 and inv.slices == 1
    half = parse_slices([nvidia_slice("n", range(4), count=2)])
    assert half.incomplete and "1 of 2" in half.incomplete[0]
    r = probe_dra(half, ADDRS)
    assert not r.ran and r.findings[0].severity is Severity.UNCHECKED
    assert decide(Observation(findings=list(r.findings))).status is Status.UNKNOWN


def test_another_drivers_slices_do_not_count():
    inv = parse_slices([nvidia_slice("n", driver="compute-domain.nvidia.com"), nvidia_slice("n", range(2))])
    assert len(inv.gpus) == 2


@pytest.mark.parametrize(
    "items",
    [
        "not a list",
        [1],
        [{"spec": "x"}],
        [{"spec": {"driver": DRIVER, "pool": {"name": "n", "generation": "1"}, "devices": []}}],
        [{"spec": {"driver": DRIVER, "pool": {}, "devices": []}}],
        [{"spec": {"driver": DRIVER, "pool": {"name": "n"}, "devices": {"a": 1}}}],
        [{"spec": {"driver": DRIVER, "pool": {"name": "n"}, "devices": [{"name": "gpu-0", "attributes": []}]}}],
        [{"spec": {"driver": DRIVER, "pool": {"name": "n"}, "devices": [{"attributes": {}}]}}],
        [{"spec": {"driver": DRIVER, "pool": {"name": "n"}, "devices": [{"name": "g", "taints": "x"}]}}],
    ],
)
def test_a_malformed_list_is_could_not_check_never_a_traceback(items):
    inv = parse_slices(items)
    assert inv.malformed
    r = probe_gpu_serving(plugin_node(0), None, SliceRead(items), None, pci=ADDRS)
    assert not r.ran and [f.severity for f in r.findings] == [Severity.UNCHECKED]


def test_parsing_is_bounded():
    many = [nvidia_slice(f"n{i}", range(1)) for i in range(MAX_SLICES * 4)]
    for s in many:
        s["spec"]["pool"]["name"] = f"p{secrets.token_hex(4)}"
    inv = parse_slices(many)
    assert inv.truncated and inv.slices == MAX_SLICES and len(inv.devices) == MAX_SLICES
    big = nvidia_slice("n", range(1))
    big["spec"]["devices"] = [gpu_device(0)] * 10_000
    assert len(parse_slices([big]).devices) == 128  # the API's own cap per slice
    huge_attr = nvidia_slice("n", range(1))
    huge_attr["spec"]["devices"][0]["attributes"]["uuid"] = {"string": "x" * 100_000}
    assert parse_slices([huge_attr]).devices[0].uuid is None  # an absurd string is ignored, not kept


def test_a_gpu_on_pci_missing_from_the_slices_is_a_mismatch_on_that_gpu():
    inv = parse_slices([nvidia_slice("n", [0, 1, 2, 4, 5, 6, 7])])
    r = probe_dra(inv, ADDRS)
    assert r.count == 7 and r.counts["dra_gpus"] == 7
    assert [(f.reason, f.gpu, f.kind) for f in r.findings] == [(Reason.GPU_COUNT_MISMATCH, GPU3, "dra_missing")]
    v = decide(observation(findings=list(r.findings)))
    assert v.status is Status.FALSE and v.reason is Reason.GPU_COUNT_MISMATCH
    row = next(g for g in v.gpus if g.pci_bus_id == GPU3.nvml)
    assert row.healthy is False and "ResourceSlice" in row.problems[0]
    # all present: nothing to say
    assert probe_dra(parse_slices([nvidia_slice("n")]), ADDRS).findings == ()
    # published but not on PCI (a bus id that matches nothing): reported, not a fault of its own
    extra = probe_dra(parse_slices([nvidia_slice("n")]), ADDRS[:7])
    assert [(f.severity, f.kind) for f in extra.findings] == [(Severity.INFO, "dra_extra")]
    assert "gpu-7" in extra.findings[0].message


def test_uuid_matches_when_the_driver_publishes_no_pci_bus_id():
    s = nvidia_slice("n", range(2))
    for d in s["spec"]["devices"]:
        del d["attributes"]["resource.kubernetes.io/pciBusID"]
    gpus = parse_slices([s]).gpus
    m = match_gpus(gpus, ADDRS[:2], {uuid(0): ADDRS[0], uuid(1): ADDRS[1]})
    assert set(m.matched) == set(ADDRS[:2]) and not m.missing
    assert match_gpus(gpus, ADDRS[:2]).missing == ADDRS[:2]


def test_a_driver_taint_is_the_analogue_of_unhealthy_plugin_devices():
    xid = {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}
    info = {"key": "gpu.nvidia.com/unmonitored", "effect": "None"}
    r = probe_dra(parse_slices([nvidia_slice("n", taints={3: [xid], 5: [info]})]), ADDRS)
    faults = [f for f in r.findings if f.severity is Severity.FAULT]
    assert [(f.reason, f.gpu) for f in faults] == [(Reason.DEVICE_PLUGIN_UNHEALTHY, GPU3)]
    assert "gpu.nvidia.com/xid=79:NoSchedule" in faults[0].message
    assert [f.gpu for f in r.findings if f.severity is Severity.INFO] == [ADDRS[5]]
    assert r.counts["dra_tainted_devices"] == 1


def test_a_dra_node_never_reads_device_plugin_unhealthy_for_zero_plugin_capacity():
    slices = SliceRead([nvidia_slice("n")])
    for node in (plugin_node(None), plugin_node(0)):
        r = probe_gpu_serving(node, None, slices, None, grace_left_s=-1, pci=ADDRS)
        assert r.ran and r.count == 8 and r.findings == ()
        assert r.counts["plugin_capacity"] == 0 and r.counts["dra_gpus"] == 8
        obs = observation(findings=list(r.findings))
        obs.counts.plugin_physical = r.count
        assert decide(obs).status is Status.TRUE
    # The same node without slices of the driver: the device-plugin check as before (the test can fail).
    r = probe_gpu_serving(plugin_node(0), None, SliceRead([]), None, grace_left_s=-1, pci=ADDRS)
    assert [f.reason for f in r.findings] == [Reason.DEVICE_PLUGIN_UNHEALTHY]
    assert probe_gpu_serving(plugin_node(0), None, None, None, grace_left_s=-1).findings == r.findings


def test_unreadable_slices_defer_to_a_serving_plugin_and_are_unknown_otherwise():
    err = SliceRead(error="cannot list ResourceSlices: HTTP 403: forbidden")
    r = probe_gpu_serving(plugin_node(8), None, err, None, grace_left_s=-1, pci=ADDRS)
    assert r.ran and r.count == 8 and all(f.severity is Severity.INFO for f in r.findings)
    r = probe_gpu_serving(plugin_node(0), None, err, None, grace_left_s=-1, pci=ADDRS)
    assert not r.ran and [f.severity for f in r.findings] == [Severity.UNCHECKED]
    assert "403" in r.findings[0].message
    assert decide(Observation(findings=list(r.findings))).status is Status.UNKNOWN


# -- fencing, on plain data --------------------------------------------------------------------------------------

NS = FencingSettings(enabled=True, effect=FenceEffect.NO_SCHEDULE)


def test_only_gpu_attributed_faults_fence():
    v = fatal_xid_verdict()
    view = fence_view(v)
    assert dict(view.faulty) == {GPU3: Reason.FATAL_XID}
    assert view.healthy == frozenset(ADDRS) - {GPU3} and not view.hold_all
    err = Finding.fault(Check.NVIDIA_SMI, Reason.NVIDIA_SMI_ERR, "ERR! in power draw", ADDRS[1], "err_field")
    nvml = Finding.fault(Check.NVML, Reason.NVML_HEALTH, "retired pages pending", ADDRS[2])
    view = fence_view(decide(observation(findings=[err, nvml])))
    assert dict(view.faulty) == {ADDRS[1]: Reason.NVIDIA_SMI_ERR, ADDRS[2]: Reason.NVML_HEALTH}
    # node-level faults: nvidia-smi cannot run, an NVSwitch SXid, a count mismatch, the plugin
    smi = Finding.fault(Check.NVIDIA_SMI, Reason.NVIDIA_SMI_FAILED, "nvidia-smi timed out")
    sxid = LatchedFault(24007, "0000:05:00.0", None, "sxid", "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 24007", 0)
    plug = Finding.fault(Check.DEVICE_PLUGIN, Reason.DEVICE_PLUGIN_UNHEALTHY, "capacity 0", ADDRS[4])
    miss = Finding.fault(Check.DEVICE_PLUGIN, Reason.GPU_COUNT_MISMATCH, "in no slice", ADDRS[5], "dra_missing")
    for f, latched in (([smi], []), ([], [sxid]), ([plug, miss], [])):
        v = decide(observation(findings=f), latched)
        assert v.status is Status.FALSE and not fence_view(v).faulty
    # nvidia-smi could not run: no GPU is known healthy, so nothing is cleared
    assert not fence_view(decide(observation(findings=[smi]))).healthy
    assert fence_view(decide(Observation(findings=[Finding.unchecked(Check.NVML, "x")]))).hold_all


SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def valid_name(name: str) -> bool:
    """A valid object name: a DNS subdomain of at most 253 characters."""
    return len(name) <= 253 and SUBDOMAIN.fullmatch(name) is not None


def test_rule_names_are_numbered_per_node_valid_and_bounded():
    assert rule_prefix("gpu-node-7") == "gpu-ready.gpu-node-7."
    fits = ".".join(["a" * 59] * 4)[:LONG_NODE]  # the longest node name spelled out in a rule name
    assert valid_name(f"{rule_prefix(fits)}1023") and len(f"{rule_prefix(fits)}1023") == 253
    long_node = ".".join(["a" * 60] * 4)  # 243 characters: a valid node name, too long to spell out
    assert rule_prefix(long_node) is None  # its UID is needed
    uid = "0e3571df-b1e6-48b8-a89e-1f924561be1d"
    assert rule_prefix(long_node, uid) == f"gpu-ready-uid.{uid}." and valid_name(f"gpu-ready-uid.{uid}.1023")
    assert slot_of("gpu-ready.n.3", "gpu-ready.n.", 4) == 3 and slot_of("gpu-ready.n.0", "gpu-ready.n.", 1) == 0
    for name in ("gpu-ready.n.4", "gpu-ready.n.03", "gpu-ready.n.gpu-3", "gpu-ready.m.1", "gpu-ready.n.1.2"):
        assert slot_of(name, "gpu-ready.n.", 4) is None, name
    assert node_label("gpu-node-7") == "gpu-node-7"
    assert node_label(long_node).startswith("sha256-") and len(node_label(long_node)) <= 63


def rules_of(view_verdict: Verdict, inventory: DraInventory | None, existing: list[ExistingRule]) -> Any:
    return plan_fencing(fence_view(view_verdict), inventory, existing, "n", NS, view_verdict.status)


def as_existing(p: Any) -> list[ExistingRule]:
    """The rules a plan creates, as a later LIST returns them (no memory carried over)."""
    items = [
        {**d.body("v1"), "metadata": {**d.body("v1")["metadata"], "uid": "u", "resourceVersion": "7"}} for d in p.create
    ]
    return parse_rules(json.loads(json.dumps(items)))


def test_a_faulty_gpu_gets_one_rule_per_device_and_loses_them_when_healthy():
    inv = parse_slices([nvidia_slice("n", mig={3: 3}, full_with_mig=True)])
    p = rules_of(fatal_xid_verdict(), inv, [])
    assert p.writes == 4 and not p.delete and not p.update
    assert [(d.name, d.device, d.pool, d.driver, d.reason, d.effect) for d in p.create] == [
        (f"gpu-ready.n.{i}", dev, "n", DRIVER, Reason.FATAL_XID, FenceEffect.NO_SCHEDULE)
        for i, dev in enumerate(("gpu-3", "gpu-3-mig-3g40gb-9-0", "gpu-3-mig-3g40gb-9-4", "gpu-3-mig-3g40gb-9-8"))
    ]
    body = p.create[0].body("v1")
    assert body["metadata"]["labels"] == {MANAGED_BY_LABEL: MANAGED_BY, NODE_LABEL: "n"}
    assert body["metadata"]["annotations"] == {GPU_ANNOTATION: GPU3.nvml}
    assert body["spec"] == {
        "deviceSelector": {"driver": DRIVER, "pool": "n", "device": "gpu-3"},
        "taint": {"key": TAINT_KEY, "value": "FatalXid", "effect": "NoSchedule"},
    }
    existing = as_existing(p)
    again = rules_of(fatal_xid_verdict(), inv, existing)
    assert not again and again.writes == 0 and len(again.keep) == 4  # as wanted: no request
    # The fault clears (hysteresis over, clear-before, new boot): a fresh plan from the listed rules deletes all.
    cleared = rules_of(healthy_verdict(), inv, existing)
    assert cleared.writes == 4 and sorted(r.name for r in cleared.delete) == sorted(r.name for r in existing)
    # The effect changes (settings): one update per rule, no create or delete.
    nx = plan_fencing(
        fence_view(fatal_xid_verdict()),
        inv,
        existing,
        "n",
        FencingSettings(True, FenceEffect.NO_EXECUTE),
        Status.FALSE,
    )
    assert len(nx.update) == 4 and nx.writes == 4


def test_rules_keep_their_number_by_device_and_new_ones_take_the_lowest_free():
    inv = parse_slices([nvidia_slice("n", mig={3: 3}, full_with_mig=True)])
    four = FencingSettings(True, FenceEffect.NO_SCHEDULE, max_rules=4)
    first = plan_fencing(fence_view(fatal_xid_verdict()), inv, [], "n", four, Status.FALSE)
    existing = as_existing(first)
    assert [r.name for r in existing] == [f"gpu-ready.n.{i}" for i in range(4)]
    # GPU 3 healthy, GPU 5 faulty: GPU 3's four rules go; every number is taken until they are gone, so GPU 5
    # waits (a note) and is fenced by the next plan.
    inv5 = parse_slices([nvidia_slice("n", mig={3: 3}, full_with_mig=True)])
    swap = plan_fencing(fence_view(fatal_xid_verdict(ADDRS[5])), inv5, existing, "n", four, Status.FALSE)
    assert len(swap.delete) == 4 and not swap.create and swap.waiting == 1 and "free rule name" in swap.notes[-1]
    later = plan_fencing(fence_view(fatal_xid_verdict(ADDRS[5])), inv5, [], "n", four, Status.FALSE)
    assert [(d.name, d.device) for d in later.create] == [("gpu-ready.n.0", "gpu-5")]
    # A rule keeps its name while its device is fenced, whatever the order of the others.
    kept = plan_fencing(fence_view(fatal_xid_verdict()), inv, list(reversed(existing)), "n", four, Status.FALSE)
    assert not kept and len(kept.keep) == 4


def test_a_rule_named_as_before_is_replaced_by_a_numbered_one():
    inv = parse_slices([nvidia_slice("n")])
    old = as_existing(rules_of(fatal_xid_verdict(), inv, []))
    legacy = [replace(old[0], name="gpu-ready.n.gpu-3")]
    p = rules_of(fatal_xid_verdict(), inv, legacy)
    assert [r.name for r in p.delete] == ["gpu-ready.n.gpu-3"] and [d.name for d in p.create] == ["gpu-ready.n.0"]
    long_node = "a" * (LONG_NODE + 1)
    v = fence_view(fatal_xid_verdict())
    inv_long = parse_slices([nvidia_slice(long_node)])
    no_uid = plan_fencing(v, inv_long, [], long_node, NS, Status.FALSE)
    assert not no_uid.create and "UID is unknown" in no_uid.notes[-1]
    with_uid = plan_fencing(v, inv_long, [], long_node, NS, Status.FALSE, "u-1")
    assert [d.name for d in with_uid.create] == ["gpu-ready-uid.u-1.0"]


def test_rules_are_held_while_health_is_unknown():
    inv = parse_slices([nvidia_slice("n")])
    existing = as_existing(rules_of(fatal_xid_verdict(), inv, []))
    assert len(existing) == 1
    unknown = decide(Observation(findings=[Finding.unchecked(Check.NVIDIA_SMI, "nvidia-smi timed out")]))
    assert unknown.status is Status.UNKNOWN
    assert not rules_of(unknown, inv, existing)  # could not check: nothing cleared
    smi_failed = decide(observation(findings=[Finding.fault(Check.NVIDIA_SMI, Reason.NVIDIA_SMI_FAILED, "exit 9")]))
    assert not rules_of(smi_failed, inv, existing)  # nvidia-smi down: GPU 3 not known healthy
    # slices unreadable: no creates for a new fault, existing rules of faulty GPUs kept, notes say why
    both = decide(observation(), [xid_fault(GPU3), xid_fault(ADDRS[5])])
    p = rules_of(both, None, existing)
    assert not p.create and not p.delete and len(p.keep) == 1 and len(p.notes) == 2
    # ... while a rule of a GPU that is healthy again goes: deleting needs no slices
    assert [r.name for r in rules_of(fatal_xid_verdict(ADDRS[5]), None, existing).delete] == ["gpu-ready.n.0"]
    # a FatalXid the verdict holds without naming a GPU (kept from the condition after a restart): kept
    held = Verdict(Status.FALSE, Reason.FATAL_XID, "Xid 79 (kept)", healthy_verdict().gpus, (Reason.FATAL_XID,))
    assert not rules_of(held, inv, existing)


def test_a_faulty_gpu_in_no_slice_is_node_level_only_and_the_cap_holds():
    inv = parse_slices([nvidia_slice("n", [0, 1, 2])])
    p = rules_of(fatal_xid_verdict(), inv, [])
    assert not p.create and "node-level only" in p.notes[0]
    many = parse_slices([nvidia_slice("n", mig={3: 7}, full_with_mig=True)])
    capped = plan_fencing(
        fence_view(fatal_xid_verdict()), many, [], "n", FencingSettings(True, max_rules=3), Status.FALSE
    )
    assert len(capped.create) == 3 and any("maxRules" in n for n in capped.notes)


def test_metrics_and_summary_follow_the_result():
    from agent.act.fencing.plan import FencedDevice, FenceResult

    reg = CollectorRegistry()
    m = FenceMetrics(reg)
    r = FenceResult(fenced=(FencedDevice("gpu-ready.n.gpu-3", "gpu-3", GPU3.nvml, "FatalXid", "NoSchedule"),))
    m.observe(r)
    labels = {"device": "gpu-3", "pci_bus_id": GPU3.nvml, "reason": "FatalXid", "effect": "NoSchedule"}
    assert reg.get_sample_value("gpu_ready_fenced_device", labels) == 1
    assert r.summary() == "fenced gpu-3 (NoSchedule)"
    m.observe(FenceResult())
    assert reg.get_sample_value("gpu_ready_fenced_device", labels) is None
    assert FenceResult().summary() == ""


def test_the_verdict_names_each_gpus_reasons_and_fencing_reads_them_not_the_text():
    err = Finding.fault(Check.NVIDIA_SMI, Reason.NVIDIA_SMI_ERR, "ERR! in power draw", GPU3, "err_field")
    v = decide(observation(findings=[err]), [xid_fault(GPU3)])
    row = next(g for g in v.gpus if g.pci_bus_id == GPU3.nvml)
    assert row.reasons == (Reason.FATAL_XID, Reason.NVIDIA_SMI_ERR) and row.unchecked == ()
    assert row.to_json()["reasons"] == ["FatalXid", "NvidiaSmiErr"]
    assert dict(fence_view(v).faulty) == {GPU3: Reason.FATAL_XID}  # the first by priority
    # The problem text alone fences nothing (no string parsing); the reasons alone do.
    text_only = replace(row, reasons=())
    assert not fence_view(Verdict(Status.FALSE, Reason.FATAL_XID, "x", (text_only,), (Reason.FATAL_XID,))).faulty
    reason_only = replace(row, problems=("something else",), reasons=(Reason.NVML_HEALTH,))
    assert dict(fence_view(Verdict(Status.FALSE, Reason.NVML_HEALTH, "x", (reason_only,))).faulty) == {
        GPU3: Reason.NVML_HEALTH
    }


def test_an_nvml_rule_is_kept_while_nvml_cannot_check_even_when_other_faults_decide_the_node():
    """The phase-1 gap: a GPU fenced for an NVML fault, then a cycle where NVML cannot run but nvidia-smi does and
    another GPU's fatal Xid makes the node False (not Unknown): the NVML rule must stay (nobody looked)."""
    inv = parse_slices([nvidia_slice("n")])
    nvml = Finding.fault(Check.NVML, Reason.NVML_HEALTH, "retired pages pending", GPU3)
    existing = as_existing(rules_of(decide(observation(findings=[nvml])), inv, []))
    assert [r.value for r in existing] == ["NvmlHealth"]
    blind = decide(observation(findings=[Finding.unchecked(Check.NVML, "NVML init failed")]), [xid_fault(ADDRS[5])])
    assert blind.status is Status.FALSE and all(g.unchecked == (Check.NVML,) for g in blind.gpus)
    p = rules_of(blind, inv, existing)
    assert not p.delete and [r.name for r in p.keep] == ["gpu-ready.n.0"]
    assert [d.device for d in p.create] == ["gpu-5"]
    # NVML runs again and GPU 3 is clean: the rule goes.
    assert [r.name for r in rules_of(fatal_xid_verdict(ADDRS[5]), inv, existing).delete] == ["gpu-ready.n.0"]


def test_the_fenced_devices_fit_in_the_condition_message():
    long = decide(observation(findings=[Finding.fault(Check.NVIDIA_SMI, Reason.NVIDIA_SMI_ERR, "x" * 2000, GPU3)]))
    note = "fenced gpu-3 (NoSchedule)"
    v = with_note(long, note)
    assert len(v.message.encode()) <= MESSAGE_LIMIT and v.message.endswith("; " + note) and "…" in v.message
    assert (v.status, v.reason, v.gpus) == (long.status, long.reason, long.gpus)
    short = with_note(healthy_verdict(), note)
    assert short.message == "8 GPUs healthy; fenced gpu-3 (NoSchedule)"
    assert with_note(short, "") is short
    huge = with_note(long, "fenced " + "é" * 5000)  # a note is bounded too (half the limit), never split mid-character
    assert len(huge.message.encode()) <= MESSAGE_LIMIT and huge.message.encode().decode() == huge.message


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--fencing-effect", "noschedule"),
        ("--fencing-effect", "Evict"),
        ("--fencing-max-rules", "0"),
        ("--fencing-max-rules", "1025"),
        ("--dra-driver", "GPU.NVIDIA.COM"),
        ("--dra-counting", "maybe"),
    ],
)
def test_bad_fencing_settings_exit_2_with_one_line(flag, value, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "agent", "check", "--kmsg", str(tmp_path / "none"), flag, value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    name = flag.lstrip("-")
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.count("\n") == 1 and f"invalid {name} ({flag})" in r.stderr and "Traceback" not in r.stderr


def test_fencing_settings_defaults():
    cfg = config.defaults()
    assert (cfg.dra_counting, cfg.dra_driver, cfg.fencing, cfg.fencing_effect) == (True, DRIVER, False, "None")
    assert (cfg.fencing_max_rules, cfg.fencing_resync) == (128, 300.0)
    assert config.defaults(fencing_effect="NoExecute", fencing_resync="60").fencing_resync == 60.0


# -- on the real apiserver 1.37 with the real scheduler and controller-manager ----------------------------------

BINARIES = ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager")
CONTROLLERS = ("device-taint-eviction-controller",)


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DraPlane]:
    bd = require_testbin(*BINARIES)
    cp = ControlPlane(bd)
    minor = kube_minor(bd)
    version = "v1"
    if minor == 36:  # DeviceTaintRule is beta there: the gate on all three and the beta API on
        version = "v1beta2"
        gate = ["--feature-gates=DRADeviceTaintRules=true"]
        cp.extra_args = {
            "kube-apiserver": [*gate, "--runtime-config=resource.k8s.io/v1beta2=true"],
            "kube-scheduler": gate,
            "kube-controller-manager": gate,
        }
    admin: KubeApi | None = None
    p: DraPlane | None = None
    try:
        cp.start()
        admin = cp.admin()
        served = {r["name"] for r in admin.request("GET", f"/apis/resource.k8s.io/{version}").get("resources", [])}
        if "devicetaintrules" not in served:
            msg = (
                f"this kube-apiserver (1.{minor}, {bd}) serves no DeviceTaintRule: Kubernetes 1.37 (or 1.36) is needed"
            )
            if IN_CI:
                pytest.fail(msg, pytrace=False)
            pytest.skip(msg)
        cp.start_scheduler()
        cp.start_controller_manager(CONTROLLERS)
        print(
            f"\n[control plane] kube-apiserver {cp.start_seconds:.1f}s, "
            + ", ".join(f"{k} {v:.1f}s" for k, v in cp.component_start_seconds.items())
        )
        for cls in (device_class("gpu.nvidia.com", "gpu"), device_class("mig.nvidia.com", "mig")):
            admin.request("POST", "/apis/resource.k8s.io/v1/deviceclasses", cls)
        ns = f"dra-{secrets.token_hex(3)}"
        ensure_namespace(admin, ns)
        p = DraPlane(cp, admin, ns, version)
        kc = cp.kubeconfig(tmp_path_factory.mktemp("dra") / "admin")
        base = ["--set", "fencing.enabled=true"]
        p.releases["ns"] = apply_release(cp, kc, "fence", [*base, "--set", "fencing.effect=NoSchedule"])
        p.releases["nx"] = apply_release(
            cp, kc, "fencenx", [*base, "--set", "fencing.effect=NoExecute", "--set", "fencing.allowNoExecute=true"]
        )
        p.releases["off"] = apply_release(cp, kc, "nofence", [])  # fencing off: RBAC to read slices only
        yield p
    finally:
        if p is not None:
            for c in p.clients:
                c.close()
        if admin is not None:
            admin.close()
        cp.stop()
        if MEASURED:
            print("\n[fencing] measured: " + ", ".join(f"{k} {v:.2f}" for k, v in MEASURED.items()))


def rule_exists(p: DraPlane, name: str) -> bool:
    try:
        p.admin.request("GET", f"{p.rules}/{name}")
        return True
    except ApiError as e:
        if e.status == 404:
            return False
        raise


def reporter(
    api: KubeApi, node: str, effect: FenceEffect, events: list[tuple[str, ...]] | None = None
) -> FenceReporter:
    hook = None if events is None else (lambda *a: events.append(a))
    return FenceReporter(api, node, FencingSettings(True, effect), on_event=hook)


def inventory_as_agent(api: KubeApi, node: str) -> DraInventory:
    read = read_node_slices(api, node)
    assert read.ok, read.error
    return parse_slices(read.items)


@pytest.mark.apiserver
def test_read_node_slices_sees_only_this_nodes_gpu_driver_and_the_plugin_check_defers(plane):
    a = gpu_node(plane)
    b = gpu_node(plane, lambda n: nvidia_slice(n, range(2)))
    plane.admin.request(
        "POST", "/apis/resource.k8s.io/v1/resourceslices", nvidia_slice(a, range(1), driver="compute-domain.nvidia.com")
    )
    agent = plane.agent("off", a)  # fencing off: the chart still grants the list for DRA-aware counting
    read = read_node_slices(agent, a)
    assert read.ok and len(read.items) == 1 and read.items[0]["spec"]["pool"]["name"] == a
    assert len(inventory_as_agent(plane.agent("off", b), b).gpus) == 2
    node = plane.admin.get_node(a)  # a DRA node: no nvidia.com/gpu in its capacity
    r = probe_gpu_serving(node, None, read, None, grace_left_s=-1, pci=ADDRS)
    assert r.ran and r.count == 8 and not r.findings and r.counts["plugin_capacity"] == 0
    # A token without the permission: the read fails, and zero plugin capacity is then "could not check".
    ns = plane.releases["off"].ns
    plane.admin.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": "nobody"}})
    tok, _ = bound_token(plane.admin, ns, "nobody", a)
    nobody = KubeApi.from_token(plane.control_plane.host, tok, plane.control_plane.ca_file)
    plane.clients.append(nobody)
    denied = read_node_slices(nobody, a)
    assert not denied.ok and "403" in (denied.error or "")
    r = probe_gpu_serving(node, None, denied, None, grace_left_s=-1, pci=ADDRS)
    assert not r.ran and r.findings[0].severity is Severity.UNCHECKED


@pytest.mark.apiserver
def test_fatal_xid_on_gpu3_fences_one_gpu_and_the_scheduler_serves_the_other_seven(plane):
    node = gpu_node(plane)
    agent = plane.agent("ns", node)
    inv = inventory_as_agent(agent, node)
    assert len(inv.gpus) == 8
    events: list[tuple[str, ...]] = []
    reg = CollectorRegistry()
    clock = [1000.0]
    fence = FenceReporter(
        agent,
        node,
        FencingSettings(True, FenceEffect.NO_SCHEDULE),
        lambda *a: events.append(a),
        FenceMetrics(reg),
        clock=lambda: clock[0],
    )

    t0 = time.monotonic()
    verdict = fatal_xid_verdict()  # the Xid 79 line for GPU 3, latched, decided
    res = fence.reconcile(verdict, inv)
    t_rule = time.monotonic() - t0
    name = f"gpu-ready.{node}.0"
    assert not res.errors, res.errors
    assert rule_exists(plane, name)
    assert (
        res.writes == 1 and [f.device for f in res.fenced] == ["gpu-3"] and res.summary() == "fenced gpu-3 (NoSchedule)"
    )
    assert events and events[0][0] == "DeviceFenced" and events[0][2] == GPU3.nvml
    assert reg.get_sample_value("gpu_ready_fence_changes_total", {"change": "created"}) == 1
    MEASURED["fatal Xid verdict -> rule exists (s)"] = t_rule
    MEASURED["API writes per fence (GPU without MIG)"] = res.writes

    # Eight claims, one GPU each: seven are allocated to the seven healthy GPUs, the eighth waits.
    t1 = time.monotonic()
    jobs = [claim_and_pod(plane, node) for _ in range(8)]

    def settled() -> dict[str, str | None] | None:
        alloc = {c: allocated_device(plane, c) for c, _ in jobs}
        done = sum(d is not None for d in alloc.values()) == 7
        waiting = [pod for c, pod in jobs if alloc[c] is None]
        return alloc if done and len(waiting) == 1 and unschedulable(plane, waiting[0]) else None

    alloc = plane.wait(settled, "7 claims allocated and the eighth pod Unschedulable")
    MEASURED["rule exists -> scheduler placed 7, refused the 8th (s)"] = time.monotonic() - t1
    used = sorted(d for d in alloc.values() if d)
    assert used == sorted(f"gpu-{i}" for i in range(8) if i != 3), used
    for c, pod in jobs:
        if alloc[c] is not None:
            assert get_pod(plane, pod)["spec"].get("nodeName") == node
    (eighth,) = [pod for c, pod in jobs if alloc[c] is None]
    msg = json.dumps(get_pod(plane, eighth)["status"]["conditions"])
    assert "Unschedulable" in msg

    # Still faulty on the next poll: no request at all; after the resync interval one LIST and no write.
    again = fence.reconcile(verdict, inventory_as_agent(agent, node))
    assert again.skipped and (again.reads, again.writes) == (0, 0) and [f.device for f in again.fenced] == ["gpu-3"]
    clock[0] += 301
    again = fence.reconcile(verdict, inventory_as_agent(agent, node))
    assert not again.skipped and (again.reads, again.writes) == (1, 0)

    # The agent restarts (no memory) and the fault has cleared: the new instance finds the rule by label.
    restarted = reporter(plane.agent("ns", node), node, FenceEffect.NO_SCHEDULE, events)
    t2 = time.monotonic()
    cleared = restarted.reconcile(healthy_verdict(), inventory_as_agent(agent, node))
    assert not cleared.errors and cleared.writes == 1 and cleared.fenced == ()
    assert not rule_exists(plane, name)
    assert events[-1][0] == "DeviceUnfenced"
    MEASURED["API writes per clear (GPU without MIG)"] = cleared.writes
    eighth_claim = next(c for c, pod in jobs if pod == eighth)
    plane.wait(lambda: allocated_device(plane, eighth_claim) == "gpu-3", "the eighth claim allocated to gpu-3")
    plane.wait(lambda: get_pod(plane, eighth)["spec"].get("nodeName") == node, "the eighth pod bound")
    MEASURED["rule deleted -> eighth claim on gpu-3 (s)"] = time.monotonic() - t2


@pytest.mark.apiserver
def test_mig_devices_of_the_faulty_gpu_are_fenced_with_it(plane):
    node = gpu_node(plane, lambda n: nvidia_slice(n, range(2), mig={1: 2}))
    agent = plane.agent("ns", node)
    fence = reporter(agent, node, FenceEffect.NO_SCHEDULE)
    res = fence.reconcile(fatal_xid_verdict(ADDRS[1]), inventory_as_agent(agent, node))
    assert not res.errors and res.writes == 2
    assert [f.device for f in res.fenced] == ["gpu-1-mig-3g40gb-9-0", "gpu-1-mig-3g40gb-9-4"]
    MEASURED["API writes per fence (GPU with 2 MIG devices)"] = res.writes
    mig_claim, mig_pod = claim_and_pod(plane, node, "mig.nvidia.com")
    gpu_claim, _ = claim_and_pod(plane, node, "gpu.nvidia.com")
    plane.wait(lambda: allocated_device(plane, gpu_claim) == "gpu-0", "the full-GPU claim allocated to gpu-0")
    plane.wait(lambda: unschedulable(plane, mig_pod), "the MIG pod Unschedulable (every MIG device fenced)")
    assert allocated_device(plane, mig_claim) is None
    cleared = fence.reconcile(healthy_verdict(), inventory_as_agent(agent, node))
    assert cleared.writes == 2 and cleared.fenced == ()
    MEASURED["API writes per clear (GPU with 2 MIG devices)"] = cleared.writes
    plane.wait(lambda: (allocated_device(plane, mig_claim) or "").startswith("gpu-1-mig-"), "the MIG claim allocated")


@pytest.mark.apiserver
def test_no_execute_evicts_the_pod_on_gpu3_and_only_that_pod(plane):
    node = gpu_node(plane)
    on3 = f"device.attributes['gpu.nvidia.com'].uuid == '{uuid(3)}'"
    on0 = f"device.attributes['gpu.nvidia.com'].uuid == '{uuid(0)}'"
    c3, p3 = claim_and_pod(plane, node, selector=on3)
    c0, p0 = claim_and_pod(plane, node, selector=on0)
    plane.wait(
        lambda: allocated_device(plane, c3) == "gpu-3" and allocated_device(plane, c0) == "gpu-0", "both allocated"
    )
    plane.wait(lambda: get_pod(plane, p3)["spec"].get("nodeName") == node, "the pod on gpu-3 bound")
    agent = plane.agent("nx", node)
    t0 = time.monotonic()
    res = reporter(agent, node, FenceEffect.NO_EXECUTE).reconcile(fatal_xid_verdict(), inventory_as_agent(agent, node))
    assert not res.errors and res.writes == 1 and res.fenced[0].effect == "NoExecute"

    def evicted() -> bool:
        try:
            pod = get_pod(plane, p3)
        except ApiError as e:
            return e.status == 404
        return bool(pod["metadata"].get("deletionTimestamp"))

    plane.wait(evicted, "the real device-taint-eviction-controller to evict the pod on gpu-3")
    MEASURED["NoExecute rule -> pod on gpu-3 evicted (s)"] = time.monotonic() - t0
    survivor = get_pod(plane, p0)
    assert not survivor["metadata"].get("deletionTimestamp"), "the pod on healthy gpu-0 must keep running"
    rule = plane.admin.request("GET", f"{plane.rules}/gpu-ready.{node}.0")
    assert rule["spec"]["taint"]["effect"] == "NoExecute"


@pytest.mark.apiserver
def test_effect_none_is_a_dry_run_the_controller_reports_on(plane):
    node = gpu_node(plane)
    agent = plane.agent("ns", node)
    res = reporter(agent, node, FenceEffect.NONE).reconcile(fatal_xid_verdict(), inventory_as_agent(agent, node))
    assert not res.errors and res.fenced[0].effect == "None"
    name = f"gpu-ready.{node}.0"
    c3, p3 = claim_and_pod(plane, node, selector=f"device.attributes['gpu.nvidia.com'].uuid == '{uuid(3)}'")
    plane.wait(lambda: allocated_device(plane, c3) == "gpu-3", "a claim for gpu-3 allocated despite the None rule")
    plane.wait(lambda: get_pod(plane, p3)["spec"].get("nodeName") == node, "its pod bound")

    def reported() -> Any:
        conds = plane.admin.request("GET", f"{plane.rules}/{name}").get("status", {}).get("conditions") or []
        return [c for c in conds if c.get("type") == "EvictionInProgress"]

    (cond,) = plane.wait(reported, "the eviction controller's EvictionInProgress condition on the dry-run rule")
    assert cond["status"] == "False"
    assert not get_pod(plane, p3)["metadata"].get("deletionTimestamp")


@pytest.mark.apiserver
def test_rules_are_per_node_and_a_failed_request_is_reported_not_raised(plane):
    a, b = gpu_node(plane), gpu_node(plane)
    agent_a, agent_b = plane.agent("ns", a), plane.agent("ns", b)
    res = reporter(agent_a, a, FenceEffect.NO_SCHEDULE).reconcile(fatal_xid_verdict(), inventory_as_agent(agent_a, a))
    assert res.writes == 1 and rule_exists(plane, f"gpu-ready.{a}.0")
    # node B's agent, healthy, lists only its own node's rules: it deletes nothing of node A's
    res_b = reporter(agent_b, b, FenceEffect.NO_SCHEDULE).reconcile(healthy_verdict(), inventory_as_agent(agent_b, b))
    discovery = 1 if plane.version == "v1" else 2  # v1 is asked first
    assert (res_b.reads, res_b.writes, res_b.fenced) == (discovery + 1, 0, ())  # discovery + one LIST
    assert rule_exists(plane, f"gpu-ready.{a}.0")
    # a token without the devicetaintrules permission (fencing off in its chart): an error in the result
    off = plane.agent("off", b)
    reg = CollectorRegistry()
    off_fence = FenceReporter(off, b, FencingSettings(True, FenceEffect.NO_SCHEDULE), metrics=FenceMetrics(reg))
    res_off = off_fence.reconcile(fatal_xid_verdict(), inventory_as_agent(off, b))
    assert res_off.errors and "403" in res_off.errors[0] and res_off.fenced == () and res_off.writes == 0
    assert reg.get_sample_value("gpu_ready_fence_errors_total") == 1
    assert reg.get_sample_value("gpu_ready_fence_changes_total", {"change": "created"}) is None
    assert not rule_exists(plane, f"gpu-ready.{b}.0")
    reporter(agent_a, a, FenceEffect.NO_SCHEDULE).reconcile(healthy_verdict(), inventory_as_agent(agent_a, a))
    assert not rule_exists(plane, f"gpu-ready.{a}.0")


@pytest.mark.apiserver
def test_the_fencing_thread_reconciles_the_newest_verdict_and_reports_changes_only(plane):
    node = gpu_node(plane)
    agent = plane.agent("ns", node)
    changes: list[tuple[str, ...]] = []
    worker = FenceWorker(reporter(agent, node, FenceEffect.NO_SCHEDULE), on_change=lambda: changes.append(("c",)))
    inv = inventory_as_agent(agent, node)
    worker.start()
    try:
        worker.submit(healthy_verdict(), inv)  # replaced before the thread takes it, or reconciled: no change
        worker.submit(fatal_xid_verdict(), inv)
        plane.wait(lambda: worker.summary() == "fenced gpu-3 (NoSchedule)", "the thread to fence gpu-3")
        assert rule_exists(plane, f"gpu-ready.{node}.0") and len(changes) == 1
        n = worker.reconciles
        worker.submit(fatal_xid_verdict(), inv)  # the same verdict again: skipped, no request, no change
        plane.wait(lambda: worker.reconciles == n + 1, "one more reconcile")
        assert worker.last is not None and worker.last.skipped and len(changes) == 1
    finally:
        worker.close(timeout=10)
    assert worker.thread is not None and not worker.thread.is_alive()
    # A reconcile that cannot list (no permission) keeps the last known fenced set and reports no change.
    off = FenceWorker(FenceReporter(plane.agent("off", node), node, FencingSettings(True, FenceEffect.NO_SCHEDULE)))
    off._fenced = worker.fenced
    res = off.step(healthy_verdict(), inv)
    assert res.errors and off.fenced == worker.fenced
    # The worker's own reporter clears the rule when GPU 3 is healthy again.
    assert worker.step(healthy_verdict(), inv).fenced == () and worker.summary() == "" and len(changes) == 2
    assert not rule_exists(plane, f"gpu-ready.{node}.0")


# -- the admission policy, allowed and denied, with tokens bound to a Pod on node A ------------------------------


def rule_body(
    node: str,
    device: str = "gpu-0",
    pool: str | None = None,
    name: str | None = None,
    driver: str = DRIVER,
    key: str = TAINT_KEY,
    value: str = "FatalXid",
    effect: str = "NoSchedule",
    labels: dict[str, str] | None = None,
    version: str = "v1",
    number: int = 0,
) -> dict[str, Any]:
    sel: dict[str, str] = {"driver": driver, "pool": pool if pool is not None else node}
    if device:
        sel["device"] = device
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "DeviceTaintRule",
        "metadata": {
            "name": name or f"gpu-ready.{node}.{number}",  # the node's rule number `number`
            "labels": labels if labels is not None else {MANAGED_BY_LABEL: MANAGED_BY, NODE_LABEL: node},
        },
        "spec": {"deviceSelector": sel, "taint": {"key": key, "value": value, "effect": effect}},
    }


def put_latest(api: KubeApi, reader: KubeApi, path: str, body: Callable[[dict[str, Any]], Any]) -> Any:
    """A PUT on the object's latest version, read again when another writer got in between (409), as any client
    replacing an object does: the eviction controller writes a new rule's status moments after it is created."""
    for _ in range(10):
        try:
            return api.request("PUT", path, body(reader.request("GET", path)["metadata"]))
        except ApiError as e:
            if e.status != 409:
                raise
    raise AssertionError(f"PUT {path}: 409 ten times in a row")


def code_of(fn: Callable[[], Any]) -> tuple[int, str]:
    try:
        fn()
        return 200, ""
    except ApiError as e:
        return e.status, str(e)


@pytest.mark.apiserver
def test_the_admission_policy_holds_the_token_to_its_own_nodes_devices(plane):
    a, b = gpu_node(plane), gpu_node(plane)
    RULES = plane.rules

    def rb(node: str, device: str = "gpu-0", **kw: Any) -> dict[str, Any]:
        return rule_body(node, device, version=plane.version, **kw)

    agent_a = plane.agent("ns", a)
    policy = f"{plane.releases['ns'].ns}-gpu-ready-own-devices-only"

    def denied(body: dict[str, Any]) -> bool:
        try:
            agent_a.request("POST", RULES, body)
        except ApiError as e:
            if e.status == 403 and policy in str(e):
                return True
            raise
        plane.admin.request("DELETE", f"{RULES}/{body['metadata']['name']}")
        return False

    plane.wait(lambda: denied(rb(b)), "the DeviceTaintRule admission policy to take effect", 60)

    # Admin-made rules the agent must not touch: one on node B with gpu-ready's labels, one on node A not gpu-ready's.
    theirs_b = rb(b, "gpu-1")
    plane.admin.request("POST", RULES, theirs_b)
    admins_a = rb(a, "gpu-2", name="maintenance-a-gpu-2", key="example.com/maintenance", value="planned", labels={})
    plane.admin.request("POST", RULES, admins_a)

    cases: list[tuple[str, Callable[[], Any], int]] = [
        ("other node's pool", lambda: agent_a.request("POST", RULES, rb(b, "gpu-0")), 403),
        (
            "own pool, name of another node",
            lambda: agent_a.request("POST", RULES, rb(a, name=f"gpu-ready.{b}.0")),
            403,
        ),
        ("own pool, foreign name", lambda: agent_a.request("POST", RULES, rb(a, name="evil")), 403),
        ("whole pool (no device)", lambda: agent_a.request("POST", RULES, rb(a, device="")), 403),
        (
            "another driver",
            lambda: agent_a.request("POST", RULES, rb(a, driver="compute-domain.nvidia.com")),
            403,
        ),
        ("another key", lambda: agent_a.request("POST", RULES, rb(a, key="example.com/x")), 403),
        ("a value that is no reason", lambda: agent_a.request("POST", RULES, rb(a, value="Maintenance")), 403),
        (
            "NoExecute not allowed by the chart",
            lambda: agent_a.request("POST", RULES, rb(a, effect="NoExecute")),
            403,
        ),
        ("without gpu-ready's labels", lambda: agent_a.request("POST", RULES, rb(a, labels={})), 403),
        (
            "node label of another node",
            lambda: agent_a.request("POST", RULES, rb(a, labels={MANAGED_BY_LABEL: MANAGED_BY, NODE_LABEL: b})),
            403,
        ),
        (
            "take over node B's rule",
            lambda: agent_a.request(
                "PUT",
                f"{RULES}/{theirs_b['metadata']['name']}",
                {
                    **rb(a, "gpu-1", name=theirs_b["metadata"]["name"]),
                    "metadata": {
                        **plane.admin.request("GET", f"{RULES}/{theirs_b['metadata']['name']}")["metadata"],
                        "labels": {MANAGED_BY_LABEL: MANAGED_BY, NODE_LABEL: a},
                    },
                },
            ),
            403,
        ),
        ("delete node B's rule", lambda: agent_a.request("DELETE", f"{RULES}/{theirs_b['metadata']['name']}"), 403),
        (
            "delete an admin's rule on its own node",
            lambda: agent_a.request("DELETE", f"{RULES}/maintenance-a-gpu-2"),
            403,
        ),
        ("an unbound token", lambda: plane.agent("ns", None).request("POST", RULES, rb(a)), 403),
        ("own device", lambda: agent_a.request("POST", RULES, rb(a, "gpu-3")), 200),
        (
            "change own rule to effect None",
            lambda: put_latest(
                agent_a,
                plane.admin,
                f"{RULES}/gpu-ready.{a}.0",
                lambda meta: {**rb(a, "gpu-3", effect="None"), "metadata": meta},
            ),
            200,
        ),
        ("delete own rule", lambda: agent_a.request("DELETE", f"{RULES}/gpu-ready.{a}.0"), 200),
        (
            "NoExecute where the chart allows it",
            lambda: plane.agent("nx", a).request("POST", RULES, rb(a, "gpu-4", effect="NoExecute", number=1)),
            200,
        ),
    ]

    def rule_state() -> list[str]:
        """Every rule's name, labels and spec (the status is the eviction controller's to update)."""
        items = plane.admin.request("GET", RULES)["items"]
        return sorted(json.dumps([r["metadata"]["name"], r["metadata"].get("labels"), r["spec"]]) for r in items)

    problems = []
    for what, fn, want in cases:
        before = rule_state()
        code, msg = code_of(fn)
        if code != want:
            problems.append(f"{what}: expected {want}, got {code} {msg[:300]}")
        if want == 403 and policy not in msg:
            problems.append(f"{what}: denied, but not by the admission policy: {msg[:300]}")
        after = rule_state()
        if code >= 400 and after != before:
            problems.append(f"{what}: denied, yet the rules changed")
    assert not problems, "\n".join(problems)
    assert rule_exists(plane, theirs_b["metadata"]["name"]) and rule_exists(plane, "maintenance-a-gpu-2")
