"""The reset journal (agent/state.py `ResetJournal`) and the actor's preconditions (agent/act/recovery.py), without
an apiserver: a state file torn in the middle of a write can neither reset the budget nor let a started reset run
again; a GPU in MIG mode, an NVSwitch SXid and a second GPU within the burst window end a ladder before any reset;
the GPU's holders are found through /proc and never signalled."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from agent.act.recovery.actor import RecoveryActor, RecoveryMetrics, RecoverySettings, Submission, find_holders
from agent.act.recovery.ladder import Policy, Step, start
from agent.logs import get_logger
from agent.model import GpuIdentity, Observation, PciAddress, XidEvent
from agent.proc import Run
from agent.state import LatchState

GPU = "00000000:BB:00.0"
A = PciAddress(0, 0xBB, 0)
B = PciAddress(0, 0xCB, 0)
T0 = 1_800_000_000.0


def xid(addr: PciAddress = A, n: int = 119, seq: int = 1, source: str = "xid") -> XidEvent:
    return XidEvent(n, addr, addr.kernel, True, "t", source, action="RESET_GPU", seq=seq)


def test_a_torn_state_file_keeps_the_budget_and_the_reset_in_flight(tmp_path):
    s = LatchState(str(tmp_path), "boot-1")
    s.load()
    s.latch(xid(), T0)
    rec = replace(start(GPU, ["k"], T0), step=Step.RESETTING, reset_started=T0 + 1)
    assert s.set_ladder(rec, GPU, reset_at=T0 + 1)  # recorded before the reset starts
    raw = (tmp_path / "state.json").read_bytes()
    (tmp_path / "state.json").write_bytes(raw[: len(raw) // 2])  # SIGKILL mid-write (without the rename's help)
    s2 = LatchState(str(tmp_path), "boot-1")
    assert s2.load() == "corrupt" and "corrupt state file" in (s2.load_problem or "")
    assert s2.ladders() == {} and s2.snapshot() == []  # what the state file held is gone...
    assert s2.resets == {GPU: (T0 + 1,)}  # ...not the budget
    assert s2.journal.in_flight(GPU) == T0 + 1  # ...nor the reset that may have run
    s2.settle_reset(GPU, T0 + 1, charged=False)  # a refused one is given back
    assert s2.resets == {} and s2.journal.in_flight(GPU) is None
    # another boot: an old reset without outcome counts, but is not "in flight" any more
    s2.set_ladder(None, GPU, reset_at=T0 + 5)
    s3 = LatchState(str(tmp_path), "boot-2")
    s3.load()
    assert s3.resets == {GPU: (T0 + 5,)} and s3.journal.in_flight(GPU) is None
    s3.prune_resets(lambda v: v, T0 + 10)  # out of the window: removed
    assert s3.resets == {}


def test_a_reset_that_cannot_be_recorded_is_not_started(tmp_path):
    s = LatchState(str(tmp_path), "boot-1")
    s.load()
    (tmp_path / "resets").write_text("not a directory")
    assert s.set_ladder(start(GPU, [], T0), GPU, reset_at=T0) is False
    assert s.write_problem and "cannot record a GPU reset" in s.write_problem


def test_the_journal_ignores_names_it_did_not_make(tmp_path):
    s = LatchState(str(tmp_path), "boot-1")
    s.load()
    (tmp_path / "resets").mkdir()
    for junk in ("x", "1.2.3", "abc.00000000_BB_00_0.b.started", "5.00000000_BB_00_0.b.weird"):
        (tmp_path / "resets" / junk).write_text("")
    assert s.resets == {}


# -- the actor's preconditions ------------------------------------------------------------------------------------


class Smi:
    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def run(self, args: list[str]) -> Run:
        self.calls.append(list(args))
        return Run(0, "", 0.0)


def actor(tmp_path: Path, **kw: Any) -> tuple[RecoveryActor, list[tuple[str, str]], LatchState]:
    state = LatchState(str(tmp_path / "state"), "boot-1")
    state.load()
    events: list[tuple[str, str]] = []
    settings = RecoverySettings(Policy(drain_timeout_s=60.0), nvidia_smi="/nonexistent/nvidia-smi", **kw)
    a = RecoveryActor(
        None,  # type: ignore[arg-type]  # no API call happens before a drain
        "n1", state, settings, smi=Smi(), kmsg_seq=lambda: 1,  # type: ignore[arg-type]
        on_event=lambda r, note, *_: events.append((r, note)), metrics=RecoveryMetrics(CollectorRegistry()),
        log=get_logger(), wall=lambda: T0,
    )  # fmt: skip
    return a, events, state


def sub(gpus: dict[PciAddress, GpuIdentity] | None = None) -> Submission:
    obs = Observation(gpus=gpus or {A: GpuIdentity(A, 4), B: GpuIdentity(B, 5)})
    return Submission(obs, None, T0)


def test_a_gpu_in_mig_mode_goes_to_the_node_remedy(tmp_path):
    a, events, state = actor(tmp_path)
    state.latch(xid(), T0)
    a.step(sub({A: GpuIdentity(A, 4, mig_enabled=True, mig_devices=3)}))
    rec = state.ladders()[GPU]
    assert rec.step is Step.ESCALATED and "MIG mode is on" in rec.why
    assert [r for r, _ in events] == ["GPURecoveryStarted", "GPURecoveryFailed"]


def test_an_sxid_wins_over_a_gpu_reset(tmp_path):
    a, _, state = actor(tmp_path)
    state.latch(xid(), T0)
    state.latch(XidEvent(20034, None, "NVSwitch-0", True, "t", "sxid", seq=2), T0)
    a.step(sub())
    assert state.ladders() == {}  # no ladder starts at all


def test_two_gpus_in_one_pass_are_one_baseboard_and_nothing_is_reset(tmp_path):
    a, _, state = actor(tmp_path)
    state.latch(xid(A), T0)
    state.latch(xid(B, seq=2), T0)
    a.step(sub())
    assert {g: r.step for g, r in state.ladders().items()} == {GPU: Step.ESCALATED, B.nvml: Step.ESCALATED}
    assert all("one baseboard" in r.why for r in state.ladders().values())
    assert state.resets == {}  # nothing reset, nothing counted


def test_holders_are_found_through_proc_and_never_signalled(tmp_path):
    proc = tmp_path / "proc"
    for pid, comm, target in ((4242, "nv-hostengine", "/dev/nvidia4"), (77, "python", "/dev/nvidia3")):
        (proc / str(pid) / "fd").mkdir(parents=True)
        (proc / str(pid) / "comm").write_text(comm + "\n")
        os.symlink(target, proc / str(pid) / "fd" / "9")
    assert find_holders(str(proc), 4) == ["4242 (nv-hostengine)"]
    assert find_holders(str(proc), None) == [] and find_holders(str(tmp_path / "none"), 4) == []
    # this process's own NVIDIA-less view of the real /proc: nothing, and no error
    assert find_holders("/proc", 250) == []


def test_a_reset_gpu_settles_only_with_its_fabric_trained_and_nothing_pending():
    from agent.act.recovery.actor import settle_problem
    from agent.model import Check, Finding, Reason

    def sub_with(findings: list[Finding], fabric: dict[PciAddress, tuple[str, str]] | None) -> Submission:
        return Submission(Observation(findings=findings, gpus={A: GpuIdentity(A, 4)}), None, T0, fabric)

    done = {A: ("Completed", "Success")}
    assert settle_problem(sub_with([], done), A, has_fabric=True) == ""
    assert "In Progress" in settle_problem(sub_with([], {A: ("In Progress", "N/A")}), A, has_fabric=True)
    # a system with a fabric: a cycle without a fabric reading is not settled; without one it does not matter
    assert "no NVLink fabric reading" in settle_problem(sub_with([], None), A, has_fabric=True)
    assert settle_problem(sub_with([], None), A, has_fabric=False) == ""
    action = Finding.fault(Check.NVML, Reason.NVML_HEALTH, "GPU recovery action: GPU reset", A, kind="recovery_action")
    remap = Finding.info(Check.NVML, "row remap pending (activates at the next GPU reset)", A, kind="row_remap_pending")
    assert "recovery action" in settle_problem(sub_with([action], done), A, has_fabric=True)
    assert "row remap pending" in settle_problem(sub_with([remap], done), A, has_fabric=True)
    other = Finding.info(Check.NVML, "row remap pending", B, kind="row_remap_pending")
    assert settle_problem(sub_with([other], done), A, has_fabric=True) == ""  # another GPU's


def test_the_agents_nvml_session_is_shut_down_for_a_reset_and_opened_again_after():
    """An open NVML session holds every GPU (the reset would answer "In use by another client"): while a reset runs
    the probe's session is shut down and its cycles report "paused" without waiting; the next read after it opens
    NVML again."""
    from agent.probes.nvml import NvmlProbe
    from agent.probes.nvml_pause import paused
    from testkit.fakes import fake_nvml

    lib = fake_nvml([{"busId": "00000000:BB:00.0"}])
    calls: list[str] = []
    for name in ("nvmlInit", "nvmlShutdown"):
        real = getattr(lib, name, lambda: None)

        def counted(*a: Any, _n: str = name, _f: Any = real) -> Any:
            calls.append(_n)
            return _f(*a)

        counted.__name__ = name
        setattr(lib, name, counted)
    probe = NvmlProbe("on", nvml=lib)
    findings, snap = probe.sample()
    assert snap is not None and calls == ["nvmlInit"]
    with paused(probe) as shut:
        assert shut and calls == ["nvmlInit", "nvmlShutdown"]
        findings, snap = probe.sample()  # a cycle during the reset: no NVML call at all
        assert snap is None and [f.kind for f in findings] == ["paused"] and len(calls) == 2
    findings, snap = probe.sample()
    assert snap is not None and calls == ["nvmlInit", "nvmlShutdown", "nvmlInit"]
    with paused(None) as shut:  # no NVML probe (NVML off): nothing to do
        assert shut is False


def test_the_check_loops_nvidia_smi_stands_aside_during_a_reset():
    from agent.probes.nvidia_smi import NvidiaSmiRunner, probe_nvidia_smi
    from agent.probes.nvml_pause import smi_paused

    runner = NvidiaSmiRunner("true", timeout_s=10)
    with smi_paused(runner):
        r = probe_nvidia_smi(runner)  # a cycle during the reset: no nvidia-smi started, "could not check"
        assert not r.ran and "paused while a GPU reset runs" in r.findings[0].message
    assert runner.run().exit_code == 0  # after it: runs again


def test_a_pending_row_remap_starts_the_ladder_like_a_reset_class_fault(tmp_path):
    from agent.model import Check, Finding
    from agent.verdict import decide as verdict

    a, events, state = actor(tmp_path)
    remap = Finding.info(Check.NVML, "row remap pending (activates at the next GPU reset)", A, kind="row_remap_pending")
    s = Submission(Observation(findings=[remap], gpus={A: GpuIdentity(A, 4)}), None, T0)
    a.step(s)
    (lf,) = state.snapshot()
    assert (lf.source, lf.action, lf.gpu) == ("row_remap", "RESET_GPU", A)
    assert state.ladders()[GPU].step is Step.DRAINING and [r for r, _ in events] == ["GPURecoveryStarted"]
    v = verdict(s.obs, state.snapshot())
    assert "row remap pending: a reset applies it" in v.message and v.gpus[0].remedy == "reset"
    a.step(s)  # the same finding again: latched once
    assert len(state.snapshot()) == 1


def test_an_ampere_nvswitch_board_with_the_fabric_manager_down_goes_to_the_node_remedy(tmp_path):
    from agent.model import Check, Finding, Reason

    fm = Finding.fault(Check.FABRIC_MANAGER, Reason.FABRIC_NOT_READY, "fabric manager down", kind="fm_not_running")
    for name, step in (("NVIDIA A100-SXM4-80GB", Step.ESCALATED), ("NVIDIA H100 80GB HBM3", Step.DRAINING)):
        a, _, state = actor(tmp_path / name)
        state.latch(xid(), T0)
        a.step(Submission(Observation(findings=[fm], gpus={A: GpuIdentity(A, 4, name)}), None, T0))
        rec = state.ladders()[GPU]
        assert rec.step is step, (name, rec.why)
        if step is Step.ESCALATED:
            assert "fabric manager down" in rec.why


def test_a_platform_that_cannot_reset_is_remembered_for_the_boot(tmp_path):
    """`unsupported` / `needs-peers` are facts of the platform: kept in the state file for the boot (a restarted
    agent does not ask again); a new boot forgets them; `tool-missing` (configuration) lasts until a restart."""
    a, _, state = actor(tmp_path)
    assert a.node_off == ""
    state.reset_unavailable = "reset unsupported: exit 3"
    state.save()
    again = LatchState(str(tmp_path / "state"), "boot-1")
    assert again.load() == "loaded" and again.reset_unavailable == "reset unsupported: exit 3"
    a2, _, state2 = actor(tmp_path)  # a restarted agent on the same boot
    assert a2.node_off == "reset unsupported: exit 3"
    state2.latch(xid(), T0)
    a2.step(sub())
    assert "per-GPU reset is off on this node" in state2.ladders()[GPU].why  # never asked again
    fresh = LatchState(str(tmp_path / "state"), "boot-2")
    assert fresh.load() == "boot_changed" and fresh.reset_unavailable == ""
    a3, _, _ = actor(tmp_path)
    a3.tool_missing = "reset tool-missing: not found"
    assert a3.node_off.startswith("reset tool-missing")
