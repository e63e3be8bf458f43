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

PROGRESS_EVERY_S = 10.0  # the burn-in's progress line: at most this often


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
    progress: Callable[[str], None] | None = None,
) -> dict[str, GateFn]:
    """`cuda` and `nvml` are the bindings, None (not available) or Lazy loaders. `progress`: the burn-in's
    elapsed/budget line, at most every PROGRESS_EVERY_S seconds."""

    def tick(budget_s: float) -> Callable[[], None]:
        assert progress is not None
        return Ticker("burnin", budget_s, progress, PROGRESS_EVERY_S)

    return {
        "spec": lambda: spec_gate(profile, nvidia_smi, resolve(nvml)),
        "burnin": lambda: burnin_gate(
            profile, resolve(cuda), resolve(nvml), kmsg, kmsg_trust_user, tick if progress is not None else None
        ),
        "nvlink": lambda: nvlink_gate(resolve(cuda), profile.p2p_min_gbps),
        "cuda": lambda: cuda_gate(resolve(cuda)),
        "serving": lambda: serving_gate(profile),
    }


def run_gates(
    gates: dict[str, GateFn], timeouts: dict[str, float], progress: Callable[[str], None] | None = None
) -> list[GateResult]:
    """Runs each gate in its own process group under its own timeout; a gate that raises or overruns fails
    with the reason, and an overrun gate is killed with its whole process tree before the next gate starts.
    `progress` gets one line when each gate starts and one when it ends (name, result, duration)."""
    results = []
    for name in GATES:
        fn = gates.get(name)
        if fn is None:
            continue
        limit = timeouts.get(name, DEFAULT_TIMEOUTS[name])
        if progress is not None:
            progress(f"gate {name}: started (timeout {limit:g}s)")
        t0 = time.monotonic()
        res = run_in_process(name, fn, limit)
        res.gate, res.duration_s, res.timeout_s = name, round(time.monotonic() - t0, 3), limit
        if progress is not None:
            progress(f"gate {name}: {res.status} in {res.duration_s:.1f}s{': ' + res.reason if res.reason else ''}")
        results.append(res)
    return results


class Ticker:
    """A progress line at most every `every_s` seconds while a long gate works (`burnin: 30s of 300s`): called
    as often as the work likes (the burn-in watch's sample), it prints only when the interval has passed."""

    def __init__(
        self,
        what: str,
        budget_s: float,
        say: Callable[[str], None],
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.budget_s, self.say, self.every_s, self.clock = what, budget_s, say, every_s, clock
        self.start = clock()
        self.last = self.start

    def __call__(self) -> None:
        now = self.clock()
        if now - self.last >= self.every_s:
            self.last = now
            self.say(f"{self.what}: {now - self.start:.0f}s of {self.budget_s:g}s")
