"""MIG layout health (agent/mig_layout.py): mig-manager's plan and state labels against the MIG instances that exist
and the devices the plugin advertises. Plain data; the label names and states are the GPU Operator mig-manager's
(NVIDIA/mig-parted: `nvidia.com/mig.config`, `nvidia.com/mig.config.state` = pending | success | failed)."""

from __future__ import annotations

import pytest

from agent.mig_layout import (
    MIG_CONFIG_LABEL,
    MIG_STATE_LABEL,
    compare_plan,
    judge_mig_config,
    node_mig_inputs,
)
from agent.model import Check, GpuIdentity, Observation, PciAddress, Reason, Severity, Status
from agent.verdict import decide

A0, A1 = PciAddress(0, 0x19, 0), PciAddress(0, 0x3B, 0)


def gpu(addr: PciAddress, index: int, mig: bool | None, instances: int = 0) -> GpuIdentity:
    return GpuIdentity(addr, index, "H100", mig, instances)


MIG7 = [gpu(A0, 0, True, 7), gpu(A1, 1, True, 7)]
WHOLE = [gpu(A0, 0, False), gpu(A1, 1, False)]


def labels(plan: str | None, state: str | None = "success") -> dict[str, str]:
    out = {}
    if plan is not None:
        out[MIG_CONFIG_LABEL] = plan
    if state is not None:
        out[MIG_STATE_LABEL] = state
    return out


def judge(lbl, gpus=MIG7, ads=None, now=1000.0, since=None, timeout=600.0):
    return judge_mig_config(lbl, gpus, ads, now=now, pending_since=since, timeout_s=timeout)


def faults(result):
    return [f for f in result.findings if f.severity is Severity.FAULT]


def test_no_labels_no_findings():
    r = judge({}, ads={"nvidia.com/gpu": 8})
    assert r.findings == () and r.pending_since is None


def test_failed_state_is_a_mig_config_failed_fault():
    r = judge(labels("all-1g.10gb", "failed"), ads={"nvidia.com/mig-1g.10gb": 14})
    (f,) = faults(r)
    assert f.reason is Reason.MIG_CONFIG_FAILED and f.check is Check.MIG_LAYOUT and f.kind == "mig_config_failed"
    assert f.message.startswith(f"{MIG_STATE_LABEL}=failed") and "all-1g.10gb" in f.message


def test_pending_is_info_until_the_timeout_then_a_fault():
    r = judge(labels("all-1g.10gb", "pending"), now=100.0)
    assert not faults(r) and r.pending_since == 100.0 and r.findings[0].severity is Severity.INFO
    r = judge(labels("all-1g.10gb", "pending"), now=699.0, since=r.pending_since)
    assert not faults(r) and r.pending_since == 100.0
    r = judge(labels("all-1g.10gb", "pending"), now=700.0, since=r.pending_since)
    (f,) = faults(r)
    assert f.kind == "mig_config_pending" and "pending for 600s (limit 600s)" in f.message
    # success ends the spell: the next pending starts counting again
    r = judge(labels("all-1g.10gb", "success"), ads={"nvidia.com/mig-1g.10gb": 14}, now=800.0, since=r.pending_since)
    assert r.findings == () and r.pending_since is None


def test_pending_does_not_compare_the_layout():
    r = judge(labels("all-disabled", "pending"), gpus=MIG7, ads={"nvidia.com/mig-1g.10gb": 14})
    assert not faults(r)


@pytest.mark.parametrize(
    ("gpus", "ads", "problem"),
    [
        (WHOLE, {"nvidia.com/gpu": 2}, None),
        ([gpu(A0, 0, False), gpu(A1, 1, True, 3)], {"nvidia.com/gpu": 1}, "MIG is enabled on GPU 1 (00000000:3B:00.0)"),
        (WHOLE, {"nvidia.com/gpu": 0, "nvidia.com/mig-1g.10gb": 7}, "MIG devices advertised: nvidia.com/mig-1g.10gb=7"),
        ([gpu(A0, 0, None), gpu(A1, 1, None)], None, None),  # nothing says: not judged
    ],
)
def test_all_disabled(gpus, ads, problem):
    found = compare_plan("all-disabled", gpus, ads)
    assert found == ([problem] if problem else [])


@pytest.mark.parametrize(
    ("gpus", "ads", "problems"),
    [
        (MIG7, {"nvidia.com/mig-1g.10gb": 14, "nvidia.com/gpu": 0}, []),
        (MIG7, {"nvidia.com/gpu": 14}, []),  # strategy single: MIG devices advertised as nvidia.com/gpu
        (MIG7, {"nvidia.com/mig-2g.20gb": 6}, ["no nvidia.com/mig-1g.10gb devices advertised"]),
        (MIG7, {"nvidia.com/gpu": 0}, ["no nvidia.com/mig-1g.10gb devices advertised"]),
        ([gpu(A0, 0, True, 7), gpu(A1, 1, False)], {"nvidia.com/mig-1g.10gb": 7}, ["no MIG instances on GPU 1"]),
        ([gpu(A0, 0, True, 0), gpu(A1, 1, True, 7)], {"nvidia.com/mig-1g.10gb": 7}, ["no MIG instances on GPU 0"]),
        (MIG7, None, []),  # advertised counts unknown: only what exists is compared
    ],
)
def test_all_profile(gpus, ads, problems):
    found = compare_plan("all-1g.10gb", gpus, ads)
    assert len(found) == len(problems) and all(f.startswith(p) for f, p in zip(found, problems, strict=True)), found


def test_profiles_with_media_extensions_are_profiles():
    assert compare_plan("all-1g.10gb+me", MIG7, {"nvidia.com/mig-1g.10gb+me": 2}) == []
    assert compare_plan("all-1g.10gb+me", MIG7, {"nvidia.com/mig-1g.10gb": 14}) == [
        "no nvidia.com/mig-1g.10gb+me devices advertised"
    ]


@pytest.mark.parametrize("plan", ["all-balanced", "custom-config", "a100-mixed"])
def test_other_plans_only_need_instances_that_are_advertised(plan):
    assert compare_plan(plan, MIG7, {"nvidia.com/mig-1g.10gb": 4, "nvidia.com/mig-3g.40gb": 2}) == []
    assert compare_plan(plan, WHOLE, {"nvidia.com/gpu": 2}) == ["no MIG instances exist", "no MIG devices advertised"]
    assert compare_plan(plan, MIG7, {"nvidia.com/gpu": 0}) == ["no MIG devices advertised"]
    assert compare_plan(plan, [], {"nvidia.com/mig-1g.10gb": 4}) == []  # no GPU list: what is advertised counts


def test_mismatch_is_a_fault_naming_the_plan_and_the_verdict_ranks_it():
    r = judge(labels("all-disabled"), gpus=MIG7, ads={"nvidia.com/mig-1g.10gb": 14})
    assert [f.kind for f in faults(r)] == ["mig_layout_mismatch", "mig_layout_mismatch"]
    assert all(f.message.startswith(f"{MIG_CONFIG_LABEL}=all-disabled: ") for f in r.findings)
    v = decide(Observation(list(r.findings), {g.address: g for g in MIG7}))
    assert v.status is Status.FALSE and v.reason is Reason.MIG_CONFIG_FAILED


def test_reason_priority_sits_between_the_plugin_and_degradation():
    order = list(Reason)
    assert (
        order.index(Reason.DEVICE_PLUGIN_UNHEALTHY)
        < order.index(Reason.MIG_CONFIG_FAILED)
        < order.index(Reason.GPU_DEGRADED)
    )


def test_a_plan_without_a_state_label_is_compared():
    assert faults(judge(labels("all-disabled", None), gpus=MIG7, ads={}))


def test_long_label_values_are_cut_in_messages():
    r = judge(labels("x" * 5000, "failed"))
    assert len(r.findings[0].message) < 300


def test_node_mig_inputs_reads_labels_and_capacity():
    node = {
        "metadata": {"labels": {MIG_CONFIG_LABEL: "all-1g.10gb", "bad": 3}},
        "status": {
            "capacity": {"nvidia.com/mig-1g.10gb": "14", "nvidia.com/gpu": "0", "cpu": "8", "nvidia.com/x": "1"}
        },
    }
    lbl, ads = node_mig_inputs(node)
    assert lbl == {MIG_CONFIG_LABEL: "all-1g.10gb"}
    assert ads == {"nvidia.com/mig-1g.10gb": 14, "nvidia.com/gpu": 0}
    assert node_mig_inputs(None) == ({}, None)
    assert node_mig_inputs({"metadata": [], "status": {"capacity": {"nvidia.com/gpu": "1e3"}}}) == ({}, {})
