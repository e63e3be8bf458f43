"""The readiness policy over time (RecoveryGate in agent/verdict.py), on plain data: no clock, no I/O."""

from __future__ import annotations

import pytest

from agent.model import (
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
from agent.verdict import (
    CLOCK_SKEW_S,
    GateState,
    HeldCondition,
    NodeFacts,
    RecoveryGate,
    adopt,
    decide_clear,
    node_facts,
    parse_rfc3339,
)

A0 = PciAddress(0, 0x19, 0)
GPUS = {A0: GpuIdentity(A0, 0, "H100")}
T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z


def clean() -> Observation:
    return Observation([], dict(GPUS), Counts(pci=1, nvidia_smi=1))


def err() -> Observation:
    f = Finding.fault(Check.NVIDIA_SMI, Reason.NVIDIA_SMI_ERR, "ERR! in Fan", A0)
    return Observation([f], dict(GPUS), Counts(pci=1, nvidia_smi=1))


def smi_gone() -> Observation:
    f = Finding.unchecked(Check.NVIDIA_SMI, "nvidia-smi not found at 'nvidia-smi'", kind="not_found")
    return Observation([f], dict(GPUS), Counts(pci=1))


def run(gate: RecoveryGate, observations: list[Observation], state: GateState | None = None, **kw):
    """Feeds one observation per cycle; returns the (status, reason) seen after each and the last state."""
    st = state or GateState()
    seen = []
    for i, o in enumerate(observations, start=st.cycle + 1):
        v, st = gate.step(st, o, i, **kw)
        seen.append((v.status, v.reason))
    return seen, st


F_ERR = (Status.FALSE, Reason.NVIDIA_SMI_ERR)
TRUE = (Status.TRUE, Reason.GPUS_HEALTHY)
UNKNOWN = (Status.UNKNOWN, Reason.CHECK_FAILED)


def test_hysteresis_needs_consecutive_clean_cycles():
    seen, _ = run(RecoveryGate(3), [clean(), err(), clean(), clean(), err(), clean(), clean(), clean()])
    assert seen == [TRUE, F_ERR, F_ERR, F_ERR, F_ERR, F_ERR, F_ERR, TRUE]


def test_a_wake_between_polls_does_not_count_a_clean_cycle():
    gate = RecoveryGate(2)
    _, st = run(gate, [err(), clean()])
    for _ in range(5):  # kernel-log wakes re-evaluate the same cycle
        v, st = gate.step(st, clean(), st.cycle)
        assert v.status is Status.FALSE
    v, st = gate.step(st, clean(), st.cycle + 1)
    assert v.status is Status.TRUE


def test_fault_then_nvidia_smi_disappears_says_it_cannot_check():
    """The bug: the old ERR! was reported forever. Now: Unknown at once, naming the check, never True."""
    gate = RecoveryGate(2)
    seen, st = run(gate, [err(), smi_gone(), smi_gone(), smi_gone()])
    assert seen == [F_ERR, UNKNOWN, UNKNOWN, UNKNOWN]
    v, _ = gate.step(st, smi_gone(), st.cycle + 1)
    assert "nvidia-smi not found" in v.message and "ERR!" not in v.message
    # nvidia-smi is back and clean: the fault still needs its clean cycles (counted from the return).
    seen, _ = run(gate, [clean(), clean()], st)
    assert seen == [F_ERR, TRUE]


def test_unknown_interrupts_the_clean_count():
    seen, _ = run(RecoveryGate(2), [err(), clean(), smi_gone(), clean(), clean()])
    assert seen == [F_ERR, F_ERR, UNKNOWN, F_ERR, TRUE]


def test_start_up_hold_keeps_an_existing_false_until_clean_cycles():
    existing = {
        "type": "GPUReady",
        "status": "False",
        "reason": "NvidiaSmiErr",
        "message": "NvidiaSmiErr: GPU 0: ERR! in Fan",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }
    hold = adopt(existing, latched_faults=0, state_outcome="loaded", cleared_before=0.0, boot_time=T0 - 10)
    assert hold == HeldCondition(Reason.NVIDIA_SMI_ERR, existing["message"], T0, latched=False)
    gate = RecoveryGate(3)
    st = GateState(hold=hold)
    v, st = gate.step(st, clean(), 1)
    assert (v.status, v.reason, v.message) == (Status.FALSE, Reason.NVIDIA_SMI_ERR, existing["message"])
    assert v.gpus and v.gpus[0].healthy is True  # per-GPU detail is today's, only the condition is held
    seen, st = run(gate, [clean(), clean()], st)
    assert seen == [F_ERR, TRUE] and st.hold is None


def test_start_up_hold_is_replaced_by_a_real_fault_and_ends_as_unknown_when_unchecked():
    hold = HeldCondition(Reason.NVML_HEALTH, "NvmlHealth: NVLink down", None)
    gate = RecoveryGate(2)
    seen, st = run(gate, [err()], GateState(hold=hold))
    assert seen == [F_ERR] and st.hold is None
    seen, _ = run(gate, [smi_gone()], GateState(hold=hold))
    assert seen == [UNKNOWN]


@pytest.mark.parametrize("status", ["True", "Unknown", None])
def test_nothing_to_hold_unless_false(status):
    existing = None if status is None else {"status": status, "reason": "GPUsHealthy"}
    assert adopt(existing, latched_faults=0, state_outcome="new", cleared_before=0.0, boot_time=None) is None


def fatal_condition(at: str = "2026-01-01T00:00:00Z") -> dict:
    return {"status": "False", "reason": "FatalXid", "message": "FatalXid: GPU 3: Xid 79", "lastTransitionTime": at}


def test_fatal_condition_the_latch_file_lost_is_kept_like_a_latched_fault():
    """A failed latch write + restart + ring-buffer rollover: the condition on the Node is the only copy
    of the fault. It is kept until a reboot or an operator clear, never released by clean cycles."""
    hold = adopt(fatal_condition(), latched_faults=0, state_outcome="corrupt", cleared_before=0.0, boot_time=T0 - 60)
    assert hold is not None and hold.latched
    gate = RecoveryGate(2)
    seen, st = run(gate, [clean()] * 10, GateState(hold=hold))
    assert set(seen) == {(Status.FALSE, Reason.FATAL_XID)}
    v, _ = gate.step(st, clean(), st.cycle)
    assert "Xid 79" in v.message and "latch file did not hold it" in v.message
    v, _ = gate.step(st, err(), st.cycle + 1)  # other faults are added, FatalXid stays first
    assert v.reason is Reason.FATAL_XID and v.reasons == (Reason.FATAL_XID, Reason.NVIDIA_SMI_ERR)
    assert "ERR! in Fan" in v.message
    assert st.cleared(T0 - 1) == st  # a clear from before the fault does not release it
    assert st.cleared(T0 + 1).hold is None
    assert st.new_boot().hold is None


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"latched_faults": 1}, "the state file holds the fault: the latch itself keeps it"),
        ({"state_outcome": "boot_changed"}, "a reboot since: the fault belonged to the previous boot"),
        ({"boot_time": T0 + 5}, "the condition predates this boot"),
        ({"cleared_before": T0 + 5}, "an operator cleared it"),
    ],
)
def test_fatal_condition_is_an_ordinary_hold_when_the_latch_is_not_lost(kw, why):
    args = {"latched_faults": 0, "state_outcome": "loaded", "cleared_before": 0.0, "boot_time": T0 - 60, **kw}
    hold = adopt(fatal_condition(), **args)
    assert hold is not None and not hold.latched, why


def test_latched_faults_are_reported_through_the_gate():
    lf = LatchedFault(79, A0.kernel, A0, "xid", "Xid 79", T0)
    seen, _ = run(RecoveryGate(2), [clean(), clean()], latched=[lf])
    assert seen == [(Status.FALSE, Reason.FATAL_XID)] * 2


def test_preflight_gating():
    gate = RecoveryGate(1)
    v, _ = gate.step(GateState(), clean(), 1, facts=NodeFacts(preflight_required=True, preflight_passed=False))
    assert (v.status, v.reason) == (Status.FALSE, Reason.PREFLIGHT_NOT_PASSED)
    v, _ = gate.step(GateState(), clean(), 1, facts=NodeFacts(preflight_required=True, preflight_passed=True))
    assert v.status is Status.TRUE
    v, _ = gate.step(GateState(), clean(), 1, facts=NodeFacts(preflight_required=False, preflight_passed=False))
    assert v.status is Status.TRUE


def test_node_facts():
    node = {"metadata": {"labels": {"preflight": "passed"}}}
    f = node_facts(node, "preflight", True, NodeFacts())
    assert f == NodeFacts(True, True)
    assert node_facts(None, "preflight", True, f) == f  # unreadable Node: keep what we knew
    assert node_facts({"metadata": {"labels": {"preflight": "failed"}}}, "preflight", True, f) == NodeFacts(True, False)
    assert node_facts({"metadata": {"labels": "junk"}}, "preflight", True, f).preflight_passed is False


# -- clear-before ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-01-01T00:00:00Z", T0),
        ("2026-01-01T01:00:00+01:00", T0),
        ("2026-01-01t00:00:00.123456789z", T0 + 0.123456),
        ("2026-01-01T00:00:00.5-00:30", T0 + 1800.5),
        ("2026-01-01T00:00:00", None),  # no zone: never read as local time
        ("2026-01-01 00:00:00Z", None),
        ("2026-01-01", None),
        ("1767225600", None),
        ("2026-13-01T00:00:00Z", None),
        ("2026-01-01T00:00:00Z" + " " * 100, None),
        (None, None),
        (1767225600, None),
    ],
)
def test_parse_rfc3339_is_strict(text, expected):
    got = parse_rfc3339(text)
    assert got == pytest.approx(expected) if expected is not None else got is None


def clear(value, now=T0 + 3600, boot_time=T0, cleared_before=0.0, rejected=()):
    return decide_clear(value, now, boot_time=boot_time, cleared_before=cleared_before, rejected=rejected)


def test_clear_before_applies_a_past_time_of_this_boot():
    d = clear("2026-01-01T00:30:00Z")
    assert d is not None and d.before == T0 + 1800 and d.problem is None


def test_clear_before_in_the_future_is_refused():
    """A future-dated annotation left on the Node must not clear faults seen before it comes due, e.g. a
    GPU that falls off the bus during the next boot: refused, and remembered as refused for this boot."""
    d = clear("2026-01-01T02:00:01Z", now=T0 + 3600)
    assert d is not None and d.before is None and "future" in (d.problem or "")
    assert clear("2026-01-01T02:00:01Z", now=T0 + 7300, rejected={"2026-01-01T02:00:01Z"}) is None
    d = clear("2026-01-01T01:00:30Z", now=T0 + 3600)  # within the clock skew: taken as now
    assert d is not None and d.before == T0 + 3600 and CLOCK_SKEW_S >= 30


def test_clear_before_that_predates_this_boot_clears_nothing():
    assert clear("2026-01-01T00:30:00Z", boot_time=T0 + 3000) is None


def test_clear_before_already_applied_is_a_no_op():
    assert clear("2026-01-01T00:30:00Z", cleared_before=T0 + 1800) is None
    assert clear("") is None and clear(None) is None


@pytest.mark.parametrize("value", ["2026-01-01 00:30:00", "yesterday", "2026-01-01T00:30:00", "1767227400"])
def test_clear_before_not_rfc3339_is_refused(value):
    d = clear(value)
    assert d is not None and d.before is None and "RFC 3339" in (d.problem or "")
