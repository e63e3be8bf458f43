"""The verdict rules and the reason order, on plain data."""

from __future__ import annotations

import itertools

import pytest

from agent.model import (
    FAULT_REASONS,
    Check,
    Counts,
    Finding,
    GpuIdentity,
    LatchedFault,
    Observation,
    PciAddress,
    Reason,
    Status,
)
from agent.verdict import decide

A0, A1 = PciAddress(0, 0x19, 0), PciAddress(0, 0x3B, 0)
GPUS = {A0: GpuIdentity(A0, 0, "H100"), A1: GpuIdentity(A1, 1, "H100")}


def obs(findings=(), counts=None, expected=None, gpus=None):
    return Observation(
        list(findings),
        dict(GPUS if gpus is None else gpus),
        counts or Counts(pci=2, nvidia_smi=2, plugin_capacity=2, plugin_allocatable=2, plugin_physical=2),
        expected,
    )


def latched(xid=79, gpu=A1, source="xid"):
    return LatchedFault(xid, gpu.kernel if gpu else "0000:05:00.0", gpu, source, "text", 1.0)


def test_healthy():
    v = decide(obs())
    assert (v.status, v.reason, v.message) == (Status.TRUE, Reason.GPUS_HEALTHY, "2 GPUs healthy")
    assert all(g.healthy for g in v.gpus)


def test_fatal_xid_names_gpu_by_index_and_bus_id():
    v = decide(obs(), [latched()])
    assert (v.status, v.reason) == (Status.FALSE, Reason.FATAL_XID)
    assert v.message == "FatalXid: GPU 1 (00000000:3B:00.0): Xid 79"
    assert [g.healthy for g in v.gpus] == [True, False]


def test_fatal_xid_on_unknown_address_still_not_ready():
    v = decide(obs(), [latched(gpu=PciAddress(0, 0x99, 0))])
    assert v.status is Status.FALSE and "matches no known GPU" in v.message


def test_fatal_sxid_is_node_level():
    v = decide(obs(), [latched(20034, None, "sxid")])
    assert v.reason is Reason.FATAL_XID and "NVSwitch 0000:05:00.0" in v.message


def test_err_field():
    v = decide(obs([Finding.fault(Check.NVIDIA_SMI, Reason.NVIDIA_SMI_ERR, "ERR! in Fan", A0)]))
    assert v.reason is Reason.NVIDIA_SMI_ERR and "GPU 0 (00000000:19:00.0): ERR! in Fan" in v.message


@pytest.mark.parametrize(
    ("counts", "expected", "text"),
    [
        (Counts(pci=2, nvidia_smi=1), None, "PCI shows 2 GPUs, nvidia-smi 1"),
        (Counts(pci=2, nvidia_smi=2, plugin_physical=1), None, "the device plugin serves 1"),
        (Counts(pci=2, nvidia_smi=2), 4, "expected 4 GPUs, found 2"),
    ],
)
def test_count_mismatch(counts, expected, text):
    v = decide(obs(counts=counts, expected=expected))
    assert v.reason is Reason.GPU_COUNT_MISMATCH and text in v.message


def test_counts_that_were_not_read_do_not_mismatch():
    assert decide(obs(counts=Counts(pci=2, nvidia_smi=None, plugin_physical=None))).status is Status.TRUE


def test_plugin_unhealthy():
    f = Finding.fault(Check.DEVICE_PLUGIN, Reason.DEVICE_PLUGIN_UNHEALTHY, "marked 1 unhealthy")
    assert decide(obs([f])).reason is Reason.DEVICE_PLUGIN_UNHEALTHY


def test_could_not_check_is_unknown_never_true():
    v = decide(obs([Finding.unchecked(Check.NVIDIA_SMI, "nvidia-smi not found")]))
    assert (v.status, v.reason) == (Status.UNKNOWN, Reason.CHECK_FAILED)
    assert all(g.healthy is None for g in v.gpus)


def test_fault_beats_unknown_and_message_mentions_both():
    v = decide(
        obs(
            [
                Finding.unchecked(Check.NVML, "NVML init failed"),
                Finding.fault(Check.NVIDIA_SMI, Reason.NVIDIA_SMI_ERR, "ERR! in Temp", A0),
            ]
        )
    )
    assert v.status is Status.FALSE and "could not check: NVML init failed" in v.message


def _fault_for(reason: Reason):
    if reason is Reason.FATAL_XID:
        return [], [latched()], {}
    if reason is Reason.GPU_COUNT_MISMATCH:
        return [], [], {"counts": Counts(pci=3, nvidia_smi=2)}
    if reason is Reason.PREFLIGHT_NOT_PASSED:
        return [], [], {"pre": True}
    return [Finding.fault(Check.NVIDIA_SMI, reason, f"{reason.value} finding", A0)], [], {}


@pytest.mark.parametrize(("first", "second"), list(itertools.combinations(FAULT_REASONS, 2)))
def test_reason_order(first, second):
    f1, l1, k1 = _fault_for(first)
    f2, l2, k2 = _fault_for(second)
    kw = {**k1, **k2}
    v = decide(obs(f2 + f1, kw.get("counts")), l1 + l2, preflight_required=kw.get("pre", False), preflight_passed=False)
    assert v.reason is first, f"{first} must win over {second}"
    assert v.message.index(first.value) < v.message.index(second.value)
    assert v.reasons[:2] == (first, second)


def test_documented_order_is_exact():
    assert [r.value for r in FAULT_REASONS][:12] == [
        "GPURecoveryFailed",
        "GPUResetRefused",
        "FatalXid",
        "NvidiaSmiFailed",
        "NvmlHealth",
        "NvidiaSmiErr",
        "GPUCountMismatch",
        "DevicePluginUnhealthy",
        "MigConfigFailed",
        "FabricNotReady",
        "GPUDegraded",
        "PreflightNotPassed",
    ]


def test_message_stays_under_one_kib():
    many = [
        Finding.fault(Check.NVIDIA_SMI, Reason.NVIDIA_SMI_ERR, "ERR! in " + "x" * 80, PciAddress(0, b, 0))
        for b in range(64)
    ]
    v = decide(obs(many, gpus={}))
    assert len(v.message.encode()) < 1024 and v.message.endswith("more)")


def test_verdict_is_pure():
    """decide() neither changes its input nor keeps state between calls: the same data in gives the same
    verdict, whatever was decided in between, and the input is unchanged afterwards."""
    import copy

    fault = Finding.fault(Check.NVIDIA_SMI, Reason.NVIDIA_SMI_ERR, "ERR! in Fan", A0)
    o = obs([fault])
    before = copy.deepcopy(o)
    first = decide(o, [latched()])
    decide(obs(), [])  # an unrelated call in between must not leak into the next one
    decide(obs([Finding.unchecked(Check.PCI, "sysfs gone")]), [latched(48, A0)], preflight_required=True)
    again = decide(copy.deepcopy(before), [latched()])
    assert first == again and o == before
    assert first.status is Status.FALSE and decide(obs()).status is Status.TRUE  # the input decides


def test_gpu_missing_from_nvidia_smi_is_found_by_address_even_when_counts_match():
    """A duplicated bus id in nvidia-smi keeps the counts equal (2 and 2): the address sets differ."""
    seen = {Check.PCI: frozenset({A0, A1}), Check.NVIDIA_SMI: frozenset({A0})}
    o = Observation([], {A0: GpuIdentity(A0, 0, "H100"), A1: GpuIdentity(A1)}, Counts(pci=2, nvidia_smi=2))
    o.seen = seen
    v = decide(o)
    assert (v.status, v.reason) == (Status.FALSE, Reason.GPU_COUNT_MISMATCH)
    assert "GPU 00000000:3B:00.0: on PCI but not in nvidia-smi" in v.message
    assert [g.healthy for g in v.gpus] == [True, False]


def test_faults_on_known_gpus_survive_truncation():
    stale = [latched(79, PciAddress(0, b, 0)) for b in range(0x40, 0x80)]  # addresses of no GPU on this node
    new = LatchedFault(79, A1.kernel, A1, "xid", "t", 99.0)
    v = decide(obs(), [*stale, new])
    assert v.message.startswith("FatalXid: GPU 1 (00000000:3B:00.0): Xid 79") and v.message.endswith("more)")
