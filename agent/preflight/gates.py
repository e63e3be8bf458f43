"""Which gates run and how: each in its own process (and process group) under its own timeout, one after the
other; a gate that overruns is killed with everything it started before the next one begins."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from agent.preflight.burnin import burnin_gate
from agent.preflight.cuda import cuda_gate
from agent.preflight.nvlink import nvlink_gate
from agent.preflight.process import run_in_process
from agent.preflight.profile import Profile
from agent.preflight.result import DEFAULT_TIMEOUTS, GATES, GateFn, GateResult
from agent.preflight.serving import serving_gate
from agent.preflight.spec import spec_gate


class Lazy:
    """A binding (cupy, NVML) loaded on first use, which is inside the gate's own process: CUDA must not be
    initialised in the parent before it forks."""

    def __init__(self, load: Callable[[], Any]) -> None:
        self.load = load

    def get(self) -> Any:
        return self.load()


def resolve(binding: Any) -> Any:
    return binding.get() if isinstance(binding, Lazy) else binding


def build_gates(
    profile: Profile,
    nvidia_smi: str,
    cuda: Any = None,
    nvml: Any = None,
    kmsg: str | None = "/dev/kmsg",
    kmsg_trust_user: bool = False,
) -> dict[str, GateFn]:
    """`cuda` and `nvml` are the bindings, None (not available) or Lazy loaders."""
    return {
        "spec": lambda: spec_gate(profile, nvidia_smi, resolve(nvml)),
        "burnin": lambda: burnin_gate(profile, resolve(cuda), resolve(nvml), kmsg, kmsg_trust_user),
        "nvlink": lambda: nvlink_gate(resolve(cuda), profile.p2p_min_gbps),
        "cuda": lambda: cuda_gate(resolve(cuda)),
        "serving": lambda: serving_gate(profile),
    }


def run_gates(gates: dict[str, GateFn], timeouts: dict[str, float]) -> list[GateResult]:
    """Runs each gate in its own process group under its own timeout; a gate that raises or overruns fails
    with the reason, and an overrun gate is killed with its whole process tree before the next gate starts."""
    results = []
    for name in GATES:
        fn = gates.get(name)
        if fn is None:
            continue
        limit = timeouts.get(name, DEFAULT_TIMEOUTS[name])
        t0 = time.monotonic()
        res = run_in_process(name, fn, limit)
        res.gate, res.duration_s, res.timeout_s = name, round(time.monotonic() - t0, 3), limit
        results.append(res)
    return results
