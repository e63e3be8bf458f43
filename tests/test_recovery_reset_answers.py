"""What a GPU reset answered (agent/act/recovery/ladder.py `classify_reset`), over every captured line in tests/fixtures
(reset-*.txt, provenance in SOURCES.md), and the ladder's answer to each outcome: only a failed or hung reset (and a
failed proof after a success) is charged; a refused one is retried with a backoff until the drain timeout and ends
as GPUResetRefused; unsupported, needs-peers and tool-missing go to the node remedy; a GPU still settling (fabric
training, recovery action or row remap pending) is waited for, up to the settle timeout."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agent.act.recovery.ladder import (
    CHARGED,
    REFUSED_PREFIX,
    Do,
    Policy,
    ResetOutcome,
    Seen,
    Step,
    burst,
    classify_reset,
    decide,
    refused_backoff,
    start,
)
from testkit.fixture_files import fixture_path as fixture

R = ResetOutcome
GPU = "00000000:BB:00.0"
T0 = 1_800_000_000.0
P = Policy(drain_timeout_s=100.0, budget=2, window_s=86400.0, settle_timeout_s=30.0, refused_backoff_s=5.0)

# (fixture, the GPU reset, its exit code as the source reports it, the outcome)
CAPTURED = [
    ("reset-refused-persistence-nvsentinel-1690.txt", "00000000:1A:00.0", 255, R.REFUSED),
    ("reset-succeeded-nvsentinel-1690.txt", "00000000:1A:00.0", 0, R.SUCCEEDED),
    ("reset-refused-persistenced-gpu-operator-118.txt", "00000000:C1:00.0", 255, R.REFUSED),
    ("reset-succeeded-gpu-operator-118.txt", "00000000:C1:00.0", 0, R.SUCCEEDED),
    ("reset-refused-nvidia-drm-magic-castle-387.txt", "00000000:00:06.0", 255, R.REFUSED),
    ("reset-refused-compute-process-code-index.txt", "00000000:18:00.0", 255, R.REFUSED),
    ("reset-unsupported-primary-gpu-code-index.txt", "00000000:01:00.0", 255, R.UNSUPPORTED),
    ("reset-unsupported-insufficient-permissions-code-index.txt", "00000000:57:00.0", 4, R.UNSUPPORTED),
    ("reset-unsupported-unknown-error-constructed.txt", GPU, 255, R.UNSUPPORTED),
    ("reset-unsupported-not-supported-constructed.txt", GPU, 3, R.UNSUPPORTED),
    ("reset-needs-peers-constructed.txt", GPU, 255, R.NEEDS_PEERS),
]


def text(name: str) -> str:
    return fixture(name).read_text()


@pytest.mark.parametrize("name, bus, code, want", CAPTURED, ids=[c[0] for c in CAPTURED])
def test_every_captured_reset_answer_is_classified(name, bus, code, want):
    ans = classify_reset(bus, code, text(name))
    assert ans.outcome is want, ans
    assert ans.detail and ans.detail in text(name)  # the line it printed that says so (the Event quotes it)
    if want is R.NEEDS_PEERS:
        assert ans.peers == ("00000000:CB:00.0", "00000000:DB:00.0")  # the peers it named, not the GPU itself


def test_success_counts_only_when_the_output_names_this_gpu():
    ok = text("reset-succeeded-nvsentinel-1690.txt")
    assert classify_reset("00000000:1A:00.0", 0, ok).outcome is R.SUCCEEDED
    assert classify_reset("0000:1a:00.0", 0, ok).outcome is R.SUCCEEDED  # the same GPU in the kernel's spelling
    other = classify_reset(GPU, 0, ok)  # exit 0 naming another GPU: not this GPU's success
    assert other.outcome is R.FAILED and "does not name" in other.detail
    assert classify_reset(GPU, 0, "").outcome is R.FAILED  # a silent exit 0 (a passthrough VM's no-op) is no proof


def test_the_exit_code_alone_and_what_could_not_run():
    assert classify_reset(GPU, 3, "").outcome is R.UNSUPPORTED  # the man page: 3 = not available on this target
    assert classify_reset(GPU, 255, "something else").outcome is R.FAILED
    assert classify_reset(GPU, None, "", error="[Errno 2] No such file").outcome is R.TOOL_MISSING
    hung = classify_reset(GPU, None, "Resetting...", timed_out=True)
    assert hung.outcome is R.HUNG and "killed" in hung.detail


def test_a_reset_printing_more_than_the_cap_is_read_from_what_was_captured_not_called_a_timeout():
    flood = "x" * 1000 + "\n" + text("reset-refused-persistence-nvsentinel-1690.txt").replace("1A", "BB")
    assert classify_reset(GPU, None, flood, timed_out=True, capped=True).outcome is R.REFUSED
    noise = classify_reset(GPU, None, "garbage\n" * 100, timed_out=True, capped=True)
    assert noise.outcome is R.FAILED and "output cap" in noise.detail  # not "hung"
    said_ok = classify_reset(GPU, None, f"GPU {GPU} was successfully reset.\n" + "y" * 100, capped=True)
    assert said_ok.outcome is R.FAILED  # stopped mid-flood: nothing says it finished


def test_classification_is_linear_on_a_huge_output():
    huge = ("In use " * 200_000) + "GPU 00000000:BB:00.0 was successfully reset."
    assert classify_reset(GPU, 0, huge).outcome is R.SUCCEEDED  # only the last 64 KiB are read


def test_only_failed_and_hung_are_charged():
    assert {R.FAILED, R.HUNG} == CHARGED


# -- the ladder's answer to each outcome -----------------------------------------------------------------------


def resetting(now: float = T0) -> object:
    rec = start(GPU, ["k"], now)
    return replace(rec, step=Step.RESETTING, step_since=now, reset_started=now)


def test_refused_retries_with_backoff_uncharged_then_ends_as_reset_refused():
    rec, do = decide(resetting(), Seen(reset_outcome=R.REFUSED, reset_error="In use"), (T0,), P, T0 + 1)
    assert do is Do.REFUND and rec.step is Step.RESETTING and rec.reset_started is None and rec.refusals == 1
    assert rec.retry_at == T0 + 1 + 5.0
    rec2, do = decide(rec, Seen(pods=0, processes=0), (), P, T0 + 3)
    assert do is Do.WAIT and rec2.reset_started is None  # backing off
    rec3, do = decide(rec, Seen(pods=0, processes=0), (), P, T0 + 7)
    assert do is Do.RESET and rec3.reset_started == T0 + 7
    assert [refused_backoff(n, P) for n in (1, 2, 3, 5, 9)] == [5.0, 10.0, 20.0, 60.0, 60.0]
    # refused until the drain timeout: its own end, not a GPU failure
    rec4, do = decide(rec3, Seen(reset_outcome=R.REFUSED, reset_error="In use [holders: 77 (nv-hostengine)]"), (),
                      P, T0 + 101)  # fmt: skip
    assert do is Do.REFUND_END and rec4.step is Step.ESCALATED and rec4.why.startswith(REFUSED_PREFIX)
    assert "nv-hostengine" in rec4.why
    # and when the timeout passes while backing off
    rec5, do = decide(rec, Seen(pods=0, processes=0), (), P, T0 + 101)
    assert do is Do.REFUND_END and rec5.why.startswith(REFUSED_PREFIX)


@pytest.mark.parametrize("outcome", [R.UNSUPPORTED, R.NEEDS_PEERS, R.TOOL_MISSING])
def test_unsupported_needs_peers_and_tool_missing_go_to_the_node_remedy(outcome):
    rec, do = decide(resetting(), Seen(reset_outcome=outcome, reset_error="x"), (T0,), P, T0 + 1)
    assert do is Do.NODE_OFF and rec.step is Step.ESCALATED and outcome.value in rec.why


@pytest.mark.parametrize("outcome", [R.FAILED, R.HUNG])
def test_failed_and_hung_escalate(outcome):
    rec, do = decide(resetting(), Seen(reset_outcome=outcome, reset_error="x"), (T0,), P, T0 + 1)
    assert do is Do.ESCALATE and rec.step is Step.ESCALATED and "reset failed" in rec.why


def test_a_gpu_still_settling_is_waited_for_then_its_proof_fails_at_the_settle_timeout():
    rec, do = decide(resetting(), Seen(reset_outcome=R.SUCCEEDED), (T0,), P, T0 + 1)
    assert rec.step is Step.PROVING and do is Do.WAIT
    training = Seen(cycle_after_reset=True, settle_problem="NVLink fabric In Progress / N/A")
    rec2, do = decide(rec, training, (T0,), P, T0 + 10)
    assert do is Do.WAIT and "settling" in rec2.why
    _, do = decide(rec2, Seen(cycle_after_reset=True, settle_problem=""), (T0,), P, T0 + 12)
    assert do is Do.PROVE  # trained: the proof runs
    rec3, do = decide(rec2, training, (T0,), P, T0 + 32)
    assert do is Do.ESCALATE and "not settled within 30s" in rec3.why


def test_a_second_gpu_within_the_burst_window():
    starts = {"A": T0, "B": T0 - 700}
    assert burst(starts, "C", T0 + 10, 600.0) == ["A"]
    assert burst(starts, "A", T0 + 10, 600.0) == []  # its own earlier ladder is not a second GPU
    assert burst(starts, "C", T0, 0.0) == []  # 0: off


def test_on_a_device_plugin_node_the_ladder_waits_until_no_new_pod_can_land_on_the_gpu():
    rec = start(GPU, ["k"], T0)
    rec2, do = decide(rec, Seen(pods=0, processes=0, fenced=False), (), P, T0 + 1)
    assert do is Do.WAIT and rec2.step is Step.FENCED and "new pods could still land" in rec2.why
    rec3, do = decide(rec2, Seen(pods=0, processes=0, fenced=True), (), P, T0 + 2)
    assert do is Do.RESET and rec3.step is Step.RESETTING  # the plugin has it unhealthy (or the node is tainted)
    _, do = decide(rec, Seen(pods=0, processes=0, fenced=None), (), P, T0 + 1)
    assert do is Do.RESET  # a DRA node (its own fence) or nothing to tell: as before
