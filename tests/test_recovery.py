"""Per-GPU recovery, pure (agent/act/recovery/ladder.py): the remedy per fault, the ladder's steps, the retry budget,
and the ladder kept in the state file across an agent restart (resumed, never restarted)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agent.act.recovery.ladder import (
    Do,
    Policy,
    Remedy,
    Seen,
    Step,
    budget_left,
    decide,
    gpu_remedy,
    nvml_action_of,
    prune,
    remedy,
    start,
)
from agent.kernel_log.xid import XidClassifier, load_catalog
from agent.model import Check, Finding, GpuIdentity, LatchedFault, Observation, PciAddress, Reason, XidEvent
from agent.state import LatchState
from agent.verdict import decide as verdict

GPU = "00000000:BB:00.0"
A = PciAddress(0, 0xBB, 0)
P = Policy(drain_timeout_s=100.0, evict=False, budget=2, window_s=86400.0)
T0 = 1_800_000_000.0


def run(rec, seen, attempts=(), policy=P, now=T0, brake=False):
    return decide(rec, seen, attempts, policy, now, brake)


# -- the remedy per fault ------------------------------------------------------------------------------------------


def test_every_reset_gpu_row_of_the_catalog_is_a_reset_and_restart_bm_is_node_level():
    cat = load_catalog()
    resets = sorted(x for x, e in cat.items() if e.action == "RESET_GPU")
    assert len(resets) == 14 and 119 in resets and 95 in resets
    assert all(remedy(cat[x].action) is Remedy.RESET for x in resets)
    assert remedy(cat[79].action) is Remedy.NODE  # RESTART_BM: never the ladder
    assert remedy(cat[48].action) is Remedy.NODE  # a workflow: node-level as today
    assert remedy("CONTACT_SUPPORT") is Remedy.NODE and remedy("") is Remedy.NODE  # unknown: node-level
    assert remedy("RESTART_APP") is Remedy.NONE and remedy("IGNORE") is Remedy.NONE


def test_nvml_recovery_action_overrides_the_catalog_but_never_a_reboot_or_nvlink_class_fault():
    # Xid 79 (fell off the bus: RESTART_BM) and NVLink-class records win over an NVML reset action
    assert remedy("RESTART_BM", nvml_action=1) is Remedy.NODE
    assert remedy("RESTART_VM", nvml_action=4) is Remedy.NODE
    assert remedy("WORKFLOW_NVLINK_ERR", nvml_action=1) is Remedy.NODE
    assert remedy("WORKFLOW_NVLINK5_ERR", nvml_action=1) is Remedy.NODE
    assert gpu_remedy(["RESET_GPU", "RESTART_BM"], nvml_action=1) is Remedy.NODE
    assert remedy("CONTACT_SUPPORT", nvml_action=1) is Remedy.RESET  # anything else: NVML's action decides
    assert remedy("RESET_GPU", nvml_action=2) is Remedy.NODE  # node reboot
    assert remedy("RESET_GPU", nvml_action=4) is Remedy.RESET  # drain and reset
    assert remedy("RESET_GPU", nvml_action=0) is Remedy.RESET  # 0: none reported, the catalog decides
    assert nvml_action_of("GPU recovery action: drain and reset") == 4
    assert nvml_action_of("GPU recovery action: node reboot") == 2
    assert nvml_action_of("GPU recovery action: 99") == 2  # unknown word: node-level
    # Xid 154 names the new action in its record
    fatal, _, action = XidClassifier().classify(154, "GPU recovery action changed from 0x0 (None) to 0x1 (Reset)")
    assert fatal and remedy(action) is Remedy.RESET
    _, _, action = XidClassifier().classify(154, "GPU recovery action changed from 0x0 (None) to 0x2 (Reboot)")
    assert remedy(action) is Remedy.NODE


def test_a_gpu_is_reset_only_when_every_latched_fault_on_it_is_healed_by_a_reset():
    assert gpu_remedy(["RESET_GPU", "RESET_GPU"]) is Remedy.RESET
    assert gpu_remedy(["RESET_GPU", "RESTART_BM"]) is Remedy.NODE
    assert gpu_remedy([]) is Remedy.NONE


# -- the ladder -----------------------------------------------------------------------------------------------------


def test_the_whole_ladder_fenced_draining_resetting_proving_healthy():
    rec = start(GPU, ["gpu:119:" + GPU], T0)
    assert rec.step is Step.FENCED
    rec, do = run(rec, Seen(pods=2))
    assert (rec.step, do) == (Step.DRAINING, Do.WAIT) and "2 pod(s)" in rec.why
    rec, do = run(rec, Seen(pods=0, processes=0), now=T0 + 10)
    assert (rec.step, do) == (Step.RESETTING, Do.RESET) and rec.reset_started == T0 + 10
    rec, do = run(rec, Seen(pods=0, reset_result=True), attempts=(T0 + 10,), now=T0 + 15)
    assert (rec.step, do) == (Step.PROVING, Do.WAIT) and rec.reset_done == T0 + 15
    rec, do = run(rec, Seen(pods=0), attempts=(T0 + 10,), now=T0 + 16)
    assert do is Do.WAIT  # no check cycle after the reset yet: nothing to prove with
    rec, do = run(rec, Seen(pods=0, cycle_after_reset=True), attempts=(T0 + 10,), now=T0 + 17)
    assert do is Do.PROVE
    rec, do = run(rec, Seen(pods=0, cycle_after_reset=True, proof=True), attempts=(T0 + 10,), now=T0 + 20)
    assert (rec.step, do) == (Step.HEALTHY, Do.RESTORE)
    assert run(rec, Seen())[1] is Do.WAIT  # healthy stays put: never a loop


def test_evict_only_when_asked_and_never_while_the_brake_is_engaged():
    rec = start(GPU, [], T0)
    _, do = run(rec, Seen(pods=2), policy=replace(P, evict=True))
    assert do is Do.EVICT
    rec2, do = run(rec, Seen(pods=2), policy=replace(P, evict=True), brake=True)
    assert do is Do.WAIT and "brake" in rec2.why
    # and no reset starts while it is engaged
    rec3, do = run(rec, Seen(pods=0, processes=0), brake=True)
    assert rec3.step is Step.RESETTING and do is Do.WAIT and rec3.reset_started is None


def test_drain_timeout_escalates_and_unknown_pods_never_count_as_drained():
    rec = start(GPU, [], T0)
    rec, do = run(rec, Seen(pods=None))
    assert rec.step is Step.DRAINING and do is Do.WAIT
    rec, do = run(rec, Seen(pods=None), now=T0 + 101)
    assert (rec.step, do) == (Step.ESCALATED, Do.ESCALATE) and "pod-resources cannot be read" in rec.why


def test_a_process_holding_the_gpu_refuses_the_reset_until_the_timeout_escalates():
    rec = start(GPU, [], T0)
    rec, do = run(rec, Seen(pods=0, processes=1))
    assert rec.step is Step.RESETTING and do is Do.WAIT and rec.reset_started is None and "process" in rec.why
    rec, do = run(rec, Seen(pods=0, processes=None), now=T0 + 50)
    assert do is Do.WAIT and rec.reset_started is None  # cannot tell: not reset either
    rec, do = run(rec, Seen(pods=0, processes=1), now=T0 + 101)
    assert (rec.step, do) == (Step.ESCALATED, Do.ESCALATE)


@pytest.mark.parametrize(
    "seen, why",
    [
        (Seen(reset_result=False, reset_error="did not finish within 5s (killed)"), "reset failed"),
    ],
)
def test_a_failed_or_hung_reset_escalates(seen, why):
    rec = replace(start(GPU, [], T0), step=Step.RESETTING, reset_started=T0)
    rec, do = run(rec, seen, attempts=(T0,))
    assert (rec.step, do) == (Step.ESCALATED, Do.ESCALATE) and why in rec.why


def test_a_failed_proof_or_a_fault_after_the_reset_escalates():
    proving = replace(start(GPU, [], T0), step=Step.PROVING, reset_started=T0, reset_done=T0 + 1)
    rec, do = run(proving, Seen(cycle_after_reset=True, proof=False, proof_error="exit 1"))
    assert (rec.step, do) == (Step.ESCALATED, Do.ESCALATE) and "proof failed: exit 1" in rec.why
    rec, do = run(proving, Seen(cycle_after_reset=True, fault_after_reset=True))
    assert (rec.step, do) == (Step.ESCALATED, Do.ESCALATE) and "faulted again" in rec.why


def test_the_budget_two_resets_per_day_then_escalation():
    day = 86400.0
    assert budget_left((), T0, P) == 2
    assert budget_left((T0 - 10,), T0, P) == 1
    assert budget_left((T0 - 10, T0 - 5), T0, P) == 0
    assert budget_left((T0 - day - 1, T0 - 5), T0, P) == 1  # the window moves
    assert prune((T0 - day - 1, T0 - 5), T0, day) == (T0 - 5,)
    rec, do = run(start(GPU, [], T0), Seen(pods=0, processes=0), attempts=(T0 - 100, T0 - 50))
    assert (rec.step, do) == (Step.ESCALATED, Do.ESCALATE) and "budget" in rec.why
    # budget 0: recovery is on but never resets
    rec, do = run(start(GPU, [], T0), Seen(pods=0, processes=0), policy=replace(P, budget=0))
    assert do is Do.ESCALATE


def test_a_reset_started_before_a_restart_is_never_run_twice():
    """The attempt is in the state file before the reset starts; an agent restarted while it ran finds the ladder
    in `resetting` with the attempt and no outcome: it goes on to the proof instead of resetting again."""
    rec = replace(start(GPU, [], T0), step=Step.RESETTING, step_since=T0 + 5, reset_started=T0 + 5)
    rec, do = run(rec, Seen(pods=0, processes=0), attempts=(T0 + 5,), now=T0 + 60)
    assert rec.step is Step.PROVING and do is Do.WAIT and rec.reset_started == T0 + 5


# -- the state file: ladders and budget survive a restart; the budget survives a reboot ------------------------------


def _fault(xid: int = 119, seq: int = 1) -> XidEvent:
    return XidEvent(xid, A, A.kernel, True, f"NVRM: Xid (PCI:{A.kernel}): {xid}", "xid", "GSP", "RESET_GPU", seq)


def test_ladder_and_budget_survive_an_agent_restart_mid_ladder_and_resume_the_step(tmp_path):
    s = LatchState(str(tmp_path), "boot-1")
    s.load()
    lf = s.latch(_fault(), T0)
    assert lf is not None and lf.action == "RESET_GPU"
    rec = replace(start(GPU, [lf.key], T0), step=Step.DRAINING, step_since=T0 + 3)
    s.set_ladder(rec, GPU)
    s2 = LatchState(str(tmp_path), "boot-1")
    assert s2.load() == "loaded"
    back = s2.ladders()[GPU]
    assert back == rec and s2.snapshot()[0].action == "RESET_GPU"
    # resumed: the drain timeout counts from the step's first start, not from the restart
    rec2, do = run(back, Seen(pods=1), now=T0 + 3 + 101)
    assert (rec2.step, do) == (Step.ESCALATED, Do.ESCALATE)
    # a reset counted in one write with the ladder
    s2.set_ladder(replace(back, step=Step.RESETTING, reset_started=T0 + 9), GPU, reset_at=T0 + 9)
    s3 = LatchState(str(tmp_path), "boot-2")  # a reboot: the faults and the ladders go, the budget stays
    assert s3.load() == "boot_changed"
    assert s3.snapshot() == [] and s3.ladders() == {} and s3.resets == {GPU: (T0 + 9,)}
    s4 = LatchState(str(tmp_path), "boot-2")
    s4.load()
    assert s4.resets == {GPU: (T0 + 9,)}


def test_clearing_one_gpu_keeps_the_others_and_a_replay_does_not_latch_it_again(tmp_path):
    other = PciAddress(0, 0x3B, 0)
    s = LatchState(str(tmp_path), "b")
    s.load()
    s.latch(_fault(seq=10), T0)
    s.latch(XidEvent(79, other, other.kernel, True, "t", "xid", "FOB", "RESTART_BM", 11), T0)
    gone = s.clear_gpu(A, read_seq=11)
    assert [f.gpu for f in gone] == [A] and [f.gpu for f in s.snapshot()] == [other]
    assert s.latch(_fault(seq=10), T0) is None  # replayed from the ring buffer after a restart
    assert s.latch(_fault(seq=12), T0) is not None  # a new fault on it latches again


# -- the verdict: escalation is node-level GPURecoveryFailed, the fault stays latched ------------------------------


def test_escalated_gpu_makes_the_node_gpurecoveryfailed_and_shows_remedy_and_step():
    obs = Observation(gpus={A: GpuIdentity(A, 4, "H100")})
    lf = LatchedFault(119, A.kernel, A, "xid", "t", T0, "RESET_GPU")
    v = verdict(obs, [lf], recovery={A: ("escalated", "reset failed: exit 3")})
    assert v.reason is Reason.GPU_RECOVERY_FAILED and v.status.value == "False"
    assert Reason.FATAL_XID in v.reasons and "reset failed: exit 3" in v.message
    (row,) = v.gpus
    assert (row.remedy, row.recovery) == ("reset", "escalated") and Reason.FATAL_XID in row.reasons
    v = verdict(obs, [lf], recovery={A: ("draining", "")})
    assert v.reason is Reason.FATAL_XID and v.gpus[0].to_json()["recovery"] == "draining"
    bm = LatchedFault(79, A.kernel, A, "xid", "t", T0, "RESTART_BM")
    assert verdict(obs, [bm]).gpus[0].remedy == "node"
    f = Finding.fault(Check.NVML, Reason.NVML_HEALTH, "GPU recovery action: GPU reset", A, kind="recovery_action")
    assert verdict(Observation(findings=[f], gpus=obs.gpus), [bm]).gpus[0].remedy == "node"  # Xid 79 wins over NVML


def test_check_json_shows_the_remedy_per_gpu(simhost):
    """`gpu-ready check --json` on the simulated host: Xid 119 (RESET_GPU) on GPU 4 says reset, Xid 79 (RESTART_BM)
    on GPU 1 says node, the healthy GPUs say nothing; recovery is off, so no step."""
    import json
    import subprocess
    import sys

    simhost.append_xid(119, gpu=4)
    simhost.append_xid(79, gpu=1)
    args = [sys.executable, "-m", "agent.cli", "check", "--json", *simhost.check_args()]
    r = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    rows = {g["index"]: g for g in json.loads(r.stdout)["gpus"]}
    assert (rows[4]["remedy"], rows[1]["remedy"], rows[0]["remedy"]) == ("reset", "node", None)
    assert all(g["recovery"] is None for g in rows.values())


def test_a_gpurecoveryfailed_condition_found_at_start_is_held_like_a_latched_fault():
    """The state file lost (not boot changed): a GPURecoveryFailed condition on the Node is kept until a reboot or an
    operator clear, as a FatalXid one is."""
    from agent.verdict import adopt

    cond = {
        "status": "False",
        "reason": "GPURecoveryFailed",
        "message": "m",
        "lastTransitionTime": "2027-01-01T00:00:00Z",
    }
    hold = adopt(cond, latched_faults=0, state_outcome="new", cleared_before=0.0, boot_time=None)
    assert hold is not None and hold.latched and hold.reason is Reason.GPU_RECOVERY_FAILED


def test_the_proof_reads_the_hard_checks_of_that_gpu_only():
    from agent.act.recovery.actor import hard_check_problem

    other = PciAddress(0, 0x3B, 0)
    gpus = {A: GpuIdentity(A, 4), other: GpuIdentity(other, 1)}
    seen = {Check.NVIDIA_SMI: frozenset(gpus), Check.PCI: frozenset(gpus)}
    ok = Observation(gpus=gpus, seen=seen)
    assert hard_check_problem(ok, A) == ""
    err = Finding.fault(Check.NVIDIA_SMI, Reason.NVIDIA_SMI_ERR, "ERR! in Temp", A)
    assert "ERR! in Temp" in hard_check_problem(Observation(findings=[err], gpus=gpus, seen=seen), A)
    elsewhere = Finding.fault(Check.NVIDIA_SMI, Reason.NVIDIA_SMI_ERR, "ERR! in Temp", other)
    assert hard_check_problem(Observation(findings=[elsewhere], gpus=gpus, seen=seen), A) == ""
    latched = Finding.fault(Check.XID, Reason.FATAL_XID, "Xid 119", A)  # the latch itself is not a hard check
    assert hard_check_problem(Observation(findings=[latched], gpus=gpus, seen=seen), A) == ""
    gone = {Check.NVIDIA_SMI: frozenset({other}), Check.PCI: frozenset(gpus)}
    assert "does not list it" in hard_check_problem(Observation(gpus=gpus, seen=gone), A)
    blind = Finding.unchecked(Check.NVML, "NVML hung")
    assert "could not check" in hard_check_problem(Observation(findings=[blind], gpus=gpus, seen=seen), A)
    assert "did not run" in hard_check_problem(Observation(gpus=gpus, seen={Check.PCI: frozenset(gpus)}), A)
