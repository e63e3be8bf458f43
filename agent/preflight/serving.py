"""The serving gate: `serving.command` (e.g. examples/preflight/vllm-serve-check.sh) exits 0 within
`maxLatencySeconds` and its output matches `expectOutput`. Third-party code: it runs without the node's
credentials (its own process group, scrubbed environment; in the chart's Job a container without the token)."""

from __future__ import annotations

from agent.preflight.command import run_command_gate
from agent.preflight.profile import Profile
from agent.preflight.result import DEFAULT_TIMEOUTS, SKIP, GateResult


def serving_gate(profile: Profile) -> GateResult:
    cmd = profile.serving.get("command")
    if not cmd:
        return GateResult("serving", SKIP, "no serving command configured")
    return run_command_gate(
        "serving",
        cmd,
        profile.timeouts.get("serving", DEFAULT_TIMEOUTS["serving"]),
        profile.serving.get("maxLatencySeconds"),
        profile.serving.get("expectOutput"),
    )
