"""`gpu-ready preflight` while it runs: a line when each gate starts and ends (name, result, duration), the
burn-in's elapsed/budget at most every PROGRESS_EVERY_S seconds, a missing tool named in a sentence, and, as the
chart's Job runs it, one Event on the Node per gate result (written with the preflight token under the chart's
admission policy)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.preflight.burnin import burnin_gate
from agent.preflight.command import run_command_gate
from agent.preflight.gates import PROGRESS_EVERY_S, Ticker, run_gates
from agent.preflight.process import gate_error
from agent.preflight.profile import Profile
from agent.preflight.result import FAIL, PASS, GateResult


def test_a_line_when_each_gate_starts_and_ends() -> None:
    lines: list[str] = []
    gates = {
        "spec": lambda: GateResult("spec", PASS, "8 GPUs match"),
        "serving": lambda: GateResult("serving", FAIL, "output does not match 'Paris'"),
    }
    results = run_gates(gates, {"spec": 30, "serving": 40}, lines.append)
    assert [r.status for r in results] == [PASS, FAIL]
    assert len(lines) == 4
    assert lines[0] == "gate spec: started (timeout 30s)"
    assert lines[1].startswith("gate spec: pass in ") and lines[1].endswith("s: 8 GPUs match")
    assert lines[2] == "gate serving: started (timeout 40s)"
    assert lines[3].startswith("gate serving: fail in ") and "output does not match" in lines[3]


def test_burnin_progress_is_at_most_every_few_seconds() -> None:
    now = [0.0]
    lines: list[str] = []
    tick = Ticker("burnin", 300, lines.append, every_s=10, clock=lambda: now[0])
    for _ in range(350):  # the watch samples every 0.1 s for 35 s
        now[0] += 0.1
        tick()
    assert lines == ["burnin: 10s of 300s", "burnin: 20s of 300s", "burnin: 30s of 300s"]
    assert 1 <= PROGRESS_EVERY_S <= 15


def test_the_burnin_command_reports_progress_with_its_budget() -> None:
    from testkit.fakes import fake_nvml

    budgets: list[float] = []
    calls = [0]

    def tick(budget_s: float) -> Any:
        budgets.append(budget_s)

        def call() -> None:
            calls[0] += 1

        return call

    prof = Profile.from_mapping({"burnInCommand": "sleep 1.5", "timeouts": {"burnin": 77}})
    res = burnin_gate(prof, None, fake_nvml([{"busId": "00000000:19:00.0"}]), None, tick=tick)
    assert res.status == PASS, res.reason
    assert budgets == [77] and calls[0] >= 1  # the command's sample runs about every second


def test_a_missing_tool_is_named_in_a_sentence(tmp_path: Path) -> None:
    e = FileNotFoundError(2, "No such file or directory", "/opt/x/nvidia-smi")
    assert gate_error(e) == (
        "cannot run /opt/x/nvidia-smi: it is not installed or not on PATH (or name its path in the profile)"
    )
    res = run_command_gate("serving", "no-such-tool-x1 --serve", 10)
    assert res.reason == "cannot run no-such-tool-x1: it is not installed or not on PATH ('no-such-tool-x1 --serve')"
    prof = tmp_path / "p.yaml"
    prof.write_text("{}\n")
    r = subprocess.run(
        [sys.executable, "-m", "agent.cli", "preflight", "--profile", str(prof), "--gates", "spec",
         "--nvidia-smi", str(tmp_path / "nvidia-smi")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Errno" not in r.stdout + r.stderr and "FileNotFoundError" not in r.stdout + r.stderr
    assert f"cannot run {tmp_path / 'nvidia-smi'}: it is not installed" in r.stdout
    progress = r.stderr.splitlines()
    assert progress[0] == "preflight: gate spec: started (timeout 60s)"
    assert progress[1].startswith("preflight: gate spec: fail in ") and len(progress) == 2


@pytest.mark.apiserver
def test_record_step_writes_one_event_per_gate(control_plane: Any, admin: Any, make_node: Any, tmp_path: Path) -> None:
    from testkit.chart import apply_release
    from testkit.cluster import bound_token

    kc_admin = control_plane.kubeconfig(tmp_path / "admin")
    rel = apply_release(control_plane, kc_admin, "pfev", ["--set", "preflight.enabled=true"])
    node = make_node(labels={"nvidia.com/gpu.present": "true"})
    token, _ = bound_token(admin, rel.ns, f"{rel.fullname}-preflight", node)
    kc = control_plane.kubeconfig(tmp_path / "preflight", token=token, user="preflight")
    prof = tmp_path / "p.yaml"
    prof.write_text("{}\n")
    results = tmp_path / "results.json"
    gates = [
        {"gate": "spec", "status": "pass", "reason": "8 GPUs match", "duration_s": 1.5},
        {"gate": "burnin", "status": "skipped", "reason": "no CUDA binding", "duration_s": 0.1},
        {"gate": "serving", "status": "fail", "reason": "output does not match 'Paris'", "duration_s": 3.0},
    ]
    results.write_text(json.dumps({"passed": False, "gates": gates}))
    r = subprocess.run(
        [sys.executable, "-m", "agent.cli", "preflight", "--profile", str(prof), "--step", "record", "--node", node,
         "--results", str(results), "--kubeconfig", str(kc), "--label-key", "preflight"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    events = admin.request("GET", "/apis/events.k8s.io/v1/namespaces/default/events")["items"]
    mine = sorted((e["reason"], e["type"], e["note"]) for e in events if e["regarding"]["name"] == node)
    assert [(reason, kind) for reason, kind, _ in mine] == [
        ("PreflightFailed", "Warning"),
        ("PreflightGateFailed", "Warning"),
        ("PreflightGatePassed", "Normal"),
        ("PreflightGateSkipped", "Normal"),
    ]
    notes = {reason: note for reason, _, note in mine}
    assert notes["PreflightGatePassed"] == "preflight gate spec pass in 1.5s: 8 GPUs match"
    assert notes["PreflightGateFailed"].startswith("preflight gate serving fail in 3.0s: output does not match")
