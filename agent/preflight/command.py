"""A gate judged by an external command (dcgmi diag, gpu-burn, a serving check): exit code, an optional
latency bound and an optional output regex. The command runs in its own process group, without Kubernetes
credentials in its environment, and is killed with its group on timeout (agent.proc)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable

from agent.preflight.result import FAIL, PASS, GateResult
from agent.proc import run_command


def run_command_gate(
    gate: str,
    command: str,
    timeout_s: float,
    max_latency_s: float | None = None,
    expect_output: str | None = None,
    sample: Callable[[], None] | None = None,
) -> GateResult:
    """`sample` is called about every second while the command runs (the burn-in watch)."""
    try:
        argv = shlex.split(command)
    except ValueError as e:
        return GateResult(gate, FAIL, f"cannot parse command {command!r}: {e}")
    if not argv:
        return GateResult(gate, FAIL, "empty command")
    try:
        out = run_command(argv, timeout_s, sample)
    except FileNotFoundError:
        return GateResult(gate, FAIL, f"cannot run {argv[0]}: it is not installed or not on PATH ({command!r})")
    except OSError as e:
        return GateResult(gate, FAIL, f"cannot run {command!r}: {e.strerror or e}")
    ev = {
        "command": command,
        "exit_code": out.exit_code,
        "seconds": round(out.seconds, 3),
        "output_tail": out.output[-400:],
    }
    if out.exit_code is None:
        return GateResult(gate, FAIL, f"{command!r} timed out after {timeout_s:g}s (killed with its process group)", ev)
    if out.exit_code != 0:
        return GateResult(gate, FAIL, f"{command!r} exited {out.exit_code}", ev)
    if max_latency_s is not None and out.seconds > max_latency_s:
        return GateResult(gate, FAIL, f"took {out.seconds:.2f}s, more than {max_latency_s:g}s", ev)
    if expect_output and not re.search(expect_output, out.output):
        return GateResult(gate, FAIL, f"output does not match {expect_output!r}", ev)
    return GateResult(gate, PASS, f"{command!r} passed in {out.seconds:.2f}s", ev)
