"""`gpu-ready preflight`: five gates before a new or repaired GPU node takes work.

Gates (one module each): spec (the node matches a declared profile), burnin, nvlink (P2P bandwidth), cuda,
serving. Each ends pass, fail or skipped (with the reason), with evidence, its duration and its own timeout,
and runs in its own process group, killed with everything it started when it overruns (process.py). With
--node the outcome is recorded on the Node (onboarding.py): all pass -> label <key>=passed, annotate the time
and a short report, uncordon if preflight cordoned it; a gate fails -> label <key>=failed, keep it cordoned
(cordon it if needed) and emit an Event naming the gate and the evidence. cli.py: the command line and the
cordon / gates / record steps the chart's Job runs as separate containers (the gates without the token)."""

from agent.preflight.burnin import ALLOWED_THROTTLE, THROTTLE_REASONS, BurnInWatch, load_nvml, watched
from agent.preflight.command import run_command_gate
from agent.preflight.cuda import load_cuda
from agent.preflight.gates import Lazy, build_gates, run_gates
from agent.preflight.main import add_arguments, main, read_results, render, write_results
from agent.preflight.onboarding import (
    ANNOTATIONS,
    CORDONED_BY,
    REPORT_ANNOTATION,
    TIME_ANNOTATION,
    cordon_for_preflight,
    onboard,
    record_on_node,
    short_report,
)
from agent.preflight.profile import Profile, ProfileError, version_matches
from agent.preflight.result import DEFAULT_TIMEOUTS, FAIL, GATES, PASS, SKIP, GateFn, GateResult, passed
from agent.preflight.spec import GpuSpec, check_spec, read_spec, read_spec_nvidia_smi, read_spec_nvml

__all__ = [
    "ALLOWED_THROTTLE",
    "ANNOTATIONS",
    "CORDONED_BY",
    "DEFAULT_TIMEOUTS",
    "FAIL",
    "GATES",
    "PASS",
    "REPORT_ANNOTATION",
    "SKIP",
    "THROTTLE_REASONS",
    "TIME_ANNOTATION",
    "BurnInWatch",
    "GateFn",
    "GateResult",
    "GpuSpec",
    "Lazy",
    "Profile",
    "ProfileError",
    "add_arguments",
    "build_gates",
    "check_spec",
    "cordon_for_preflight",
    "load_cuda",
    "load_nvml",
    "main",
    "onboard",
    "passed",
    "read_results",
    "read_spec",
    "read_spec_nvidia_smi",
    "read_spec_nvml",
    "record_on_node",
    "render",
    "run_command_gate",
    "run_gates",
    "short_report",
    "version_matches",
    "watched",
    "write_results",
]
