"""The burn-in gate: sustained load on every GPU (built-in FP32 matmul with cupy, or `burnInCommand`), watched
for Xids in the kernel log, uncorrected ECC errors, new retired pages or remapped rows and clocks throttled for
reasons other than the power and thermal limits. Without NVML the burn-in cannot be judged and fails."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from agent.kernel_log.source import KmsgSource
from agent.kernel_log.xid import KernelLogParser, XidClassifier
from agent.preflight.command import run_command_gate
from agent.preflight.profile import Profile
from agent.preflight.result import DEFAULT_TIMEOUTS, FAIL, PASS, SKIP, GateResult


def cuda_burnin(cp: Any, seconds: float, sample: Callable[[], None] | None = None) -> GateResult:
    """Sustained FP32 matmul on every GPU; checks each result against a reference, reports TFLOP/s."""
    size, per_gpu = 8192, {}
    for dev in range(cp.cuda.runtime.getDeviceCount()):
        with cp.cuda.Device(dev):
            a = cp.random.rand(size, size, dtype=cp.float32)
            b = cp.random.rand(size, size, dtype=cp.float32)
            ref = a @ b
            cp.cuda.Device(dev).synchronize()
            t0, n, wrong = time.monotonic(), 0, 0
            while time.monotonic() - t0 < seconds / max(1, cp.cuda.runtime.getDeviceCount()):
                c = a @ b
                n += 1
                if n % 10 == 0 and not bool(cp.allclose(c, ref, rtol=1e-3)):
                    wrong += 1
                if n % 20 == 0 and sample is not None:
                    sample()
            cp.cuda.Device(dev).synchronize()
            took = time.monotonic() - t0
            per_gpu[dev] = {"tflops": round(2 * size**3 * n / took / 1e12, 1), "iterations": n, "wrong": wrong}
    bad = [d for d, v in per_gpu.items() if v["wrong"]]
    if bad:
        return GateResult("burnin", FAIL, f"wrong matmul results on GPUs {bad}", {"per_gpu": per_gpu})
    return GateResult("burnin", PASS, f"{len(per_gpu)} GPUs sustained load", {"per_gpu": per_gpu})


# -- the watch: Xids, ECC, retired pages / remapped rows, throttling -----------------------------------------

# NVML clock-event (throttle) reasons. The power cap and software thermal slowdown are the configured
# limits a GPU under full load is expected to hit; idle/application/sync-boost/display are benign.
THROTTLE_REASONS = {
    0x1: "GpuIdle",
    0x2: "ApplicationsClocksSetting",
    0x4: "SwPowerCap",
    0x8: "HwSlowdown",
    0x10: "SyncBoost",
    0x20: "SwThermalSlowdown",
    0x40: "HwThermalSlowdown",
    0x80: "HwPowerBrakeSlowdown",
    0x100: "DisplayClockSetting",
}
ALLOWED_THROTTLE = frozenset(
    {"GpuIdle", "ApplicationsClocksSetting", "SwPowerCap", "SyncBoost", "SwThermalSlowdown", "DisplayClockSetting"}
)


class BurnInWatch:
    """Watches a burn-in: any Xid in the kernel log during it, an uncorrected ECC error increment, a new
    retired page or remapped row, or clocks throttled for reasons other than the power and thermal limits.
    NVML is required (`nvml` is the pynvml module, or a stand-in); without it the burn-in cannot be judged."""

    def __init__(
        self, nvml: Any, kmsg_path: str | None, allowed: frozenset[str] = ALLOWED_THROTTLE, trust_user: bool = False
    ) -> None:
        self.nv, self.allowed = nvml, allowed
        self.kmsg = KmsgSource(kmsg_path, trust_user) if kmsg_path else None
        self.before: dict[int, tuple[int, int, int]] = {}
        self.throttled: dict[int, set[str]] = {}
        self.handles: list[Any] = []

    def _counters(self, h: Any) -> tuple[int, int, int]:
        nv = self.nv
        unc = int(nv.nvmlDeviceGetTotalEccErrors(h, 1, 0))  # uncorrected, volatile
        retired = sum(len(nv.nvmlDeviceGetRetiredPages(h, cause)) for cause in (0, 1))
        try:
            corr_rows, unc_rows, _pending, _failure = nv.nvmlDeviceGetRemappedRows(h)
            remapped = int(corr_rows) + int(unc_rows)
        except nv.NVMLError:
            remapped = 0  # not supported (pre-Ampere, MIG)
        return unc, retired, remapped

    def start(self) -> None:
        nv = self.nv
        nv.nvmlInit()
        self.handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        self.before = {i: self._counters(h) for i, h in enumerate(self.handles)}
        if self.kmsg is not None:
            self.kmsg.open()
            for _skipped in self.kmsg.drain():
                pass  # what was logged before the burn-in does not count

    def sample(self) -> None:
        for i, h in enumerate(self.handles):
            mask = int(self.nv.nvmlDeviceGetCurrentClocksEventReasons(h))
            bad = {name for bit, name in THROTTLE_REASONS.items() if mask & bit and name not in self.allowed}
            if bad:
                self.throttled.setdefault(i, set()).update(bad)

    def finish(self) -> list[str]:
        problems = []
        for i, h in enumerate(self.handles):
            (u0, r0, m0), (u1, r1, m1) = self.before[i], self._counters(h)
            if u1 > u0:
                problems.append(f"GPU {i}: {u1 - u0} uncorrected ECC errors during burn-in")
            if r1 > r0:
                problems.append(f"GPU {i}: {r1 - r0} new retired pages")
            if m1 > m0:
                problems.append(f"GPU {i}: {m1 - m0} new remapped rows")
        for i, reasons in sorted(self.throttled.items()):
            problems.append(f"GPU {i}: clocks throttled by {', '.join(sorted(reasons))}")
        if self.kmsg is not None:
            parser = KernelLogParser(XidClassifier(unknown_fatal=True))
            for recs in self.kmsg.drain():
                for r in recs:
                    for ev in parser.feed(r.text, r.seq, r.usec):
                        problems.append(f"Xid {ev.xid} on {ev.raw_address} during burn-in: {ev.text[:120]}")
            self.kmsg.close()
        return problems


def watched(gate: str, run: Callable[[Callable[[], None]], GateResult], watch: BurnInWatch | None) -> GateResult:
    """Runs a burn-in under the watch; `run` gets a callback to sample throttling while it works."""
    if watch is None:
        return GateResult(gate, FAIL, "cannot watch the burn-in (ECC, retired pages, throttling): NVML unavailable")
    try:
        watch.start()
    except Exception as e:
        return GateResult(gate, FAIL, f"cannot watch the burn-in: NVML: {e}")
    res = run(watch.sample)
    problems = watch.finish()
    res.evidence["watch"] = problems
    if problems and res.status == PASS:
        res.status, res.reason = FAIL, "; ".join(problems)[:900]
    return res


def load_nvml() -> Any:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def burnin_gate(
    profile: Profile,
    cuda: Any,
    nvml: Any,
    kmsg: str | None,
    kmsg_trust_user: bool = False,
    tick: Callable[[float], Callable[[], None]] | None = None,
) -> GateResult:
    """`tick(budget_s)`: a progress callback (gates.Ticker) the burn-in calls with every watch sample."""
    if not profile.burnin_command and cuda is None:
        return GateResult("burnin", SKIP, "no CUDA binding (pip install gpu-ready[cuda]) and no burnInCommand")
    watch = BurnInWatch(nvml, kmsg, trust_user=kmsg_trust_user) if nvml is not None else None
    if profile.burnin_command:
        cmd, limit = profile.burnin_command, profile.timeouts.get("burnin", DEFAULT_TIMEOUTS["burnin"])
        progress = tick(limit) if tick is not None else None
        return watched("burnin", lambda s: run_command_gate("burnin", cmd, limit, sample=both(s, progress)), watch)
    progress = tick(profile.burnin_seconds) if tick is not None else None
    return watched("burnin", lambda s: cuda_burnin(cuda, profile.burnin_seconds, both(s, progress)), watch)


def both(sample: Callable[[], None], progress: Callable[[], None] | None) -> Callable[[], None]:
    if progress is None:
        return sample

    def call() -> None:
        sample()
        progress()

    return call
