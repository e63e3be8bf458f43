"""Hardware clock slowdowns counted over a window, and the thermal margin, through NVML.

`nvmlDeviceGetCurrentClocksEventReasons` is a bit mask sampled once per poll. Only the hardware
reasons count: HW slowdown 0x8, HW thermal slowdown 0x40, HW power brake 0x80. Idle 0x1, applications
clocks 0x2, SW power cap 0x4 and SW thermal 0x20 are normal operation. A GPU slowed in more than
`max_slowed_share` of the samples in the last `window_s` seconds (and at least `min_samples` of them)
is degraded: a rate over a window, never one sample. `nvmlDeviceGetMarginTemperature` (where the
GPU supports it) at or below `margin_min_c` is degraded too (off by default, as in gpud).

The tracker keeps a bounded history per GPU and takes the time as an argument (no clock inside)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from agent.model import Check, Finding, PciAddress, ProbeResult, Reason, Severity
from agent.probes.base import ProbeContext
from agent.settings import DAY, in_range, optional, positive, setting, share, to_bool, to_float, to_int

HW_SLOWDOWN = 0x8
HW_THERMAL_SLOWDOWN = 0x40
HW_POWER_BRAKE_SLOWDOWN = 0x80
HW_REASONS = {
    HW_SLOWDOWN: "HW slowdown",
    HW_THERMAL_SLOWDOWN: "HW thermal slowdown",
    HW_POWER_BRAKE_SLOWDOWN: "HW power brake",
}
HW_MASK = HW_SLOWDOWN | HW_THERMAL_SLOWDOWN | HW_POWER_BRAKE_SLOWDOWN
NOT_SUPPORTED = 3  # NVML_ERROR_NOT_SUPPORTED


@dataclass(frozen=True)
class ClockThresholds:
    """Settings of the clock-event probe (docs/degradation.md has each default and its source)."""

    enabled: bool = setting(to_bool, True, "count hardware clock slowdowns over a window (NVML)", name="clock_events")
    # gpud hw-slowdown: 10 minute window
    window_s: float = setting(
        positive(to_float, DAY), 600.0, "window for the clock-slowdown share, seconds", name="clock_window"
    )
    # gpud: >= 0.6 events/min over 10 min = 6 of 20 polls at 30 s
    max_slowed_share: float = setting(
        share, 0.3, "share of slowed samples in the window that is degraded", name="clock_max_slowed_share"
    )
    # fewer samples in the window: not judged yet
    min_samples: int = setting(
        in_range(to_int, 1, 100_000), 5, "fewer samples in the window: not judged", name="clock_min_samples"
    )
    # thermal margin at or below this is degraded; None = off (gpud default)
    margin_min_c: float | None = setting(
        optional(in_range(to_float, -100, 200)),
        None,
        "thermal margin (C) at or below which a GPU is degraded (unset: off)",
        name="thermal_margin_min",
    )
    max_samples: int = 1024  # history bound per GPU

    def __post_init__(self) -> None:
        if self.window_s <= 0 or not 0 <= self.max_slowed_share < 1 or self.min_samples < 1 or self.max_samples < 1:
            raise ValueError("clock events: window must be positive, share in [0, 1), sample counts at least 1")


@dataclass(frozen=True)
class ClockSample:
    """One poll of one GPU. mask None: the reasons could not be read (error says why)."""

    mask: int | None
    margin_c: float | None = None
    error: str | None = None


@dataclass
class _History:
    samples: deque[tuple[float, int]] = field(default_factory=deque)
    margin_c: float | None = None
    error: str | None = None


class ClockEventTracker:
    def __init__(self, thresholds: ClockThresholds = ClockThresholds()) -> None:
        self.t = thresholds
        self._gpus: dict[PciAddress, _History] = {}

    def observe(self, gpu: PciAddress, sample: ClockSample, now: float) -> None:
        h = self._gpus.setdefault(gpu, _History(deque(maxlen=max(1, self.t.max_samples))))
        h.error = sample.error if sample.mask is None else None
        h.margin_c = sample.margin_c
        if sample.mask is not None:
            h.samples.append((now, int(sample.mask)))
        self._prune(h, now)

    def forget_except(self, gpus: Iterable[PciAddress]) -> None:
        """Drops GPUs no longer present (bounded memory across hot-unplug)."""
        keep = set(gpus)
        for g in list(self._gpus):
            if g not in keep:
                del self._gpus[g]

    def _prune(self, h: _History, now: float) -> None:
        while h.samples and h.samples[0][0] <= now - self.t.window_s:
            h.samples.popleft()

    def findings(self, now: float) -> list[Finding]:
        if not self.t.enabled:
            return []
        out: list[Finding] = []
        for gpu, h in sorted(self._gpus.items()):
            self._prune(h, now)
            if h.error is not None:
                out.append(
                    Finding(
                        Check.CLOCKS, Severity.UNCHECKED, f"clock event reasons: {h.error}", None, gpu, "unreadable"
                    )
                )
            n = len(h.samples)
            if n >= self.t.min_samples:
                slowed = [m & HW_MASK for _, m in h.samples if m & HW_MASK]
                share = len(slowed) / n
                if share > self.t.max_slowed_share:
                    seen = 0
                    for m in slowed:
                        seen |= m
                    names = ", ".join(v for k, v in HW_REASONS.items() if seen & k)
                    out.append(
                        Finding.fault(
                            Check.CLOCKS,
                            Reason.GPU_DEGRADED,
                            f"clocks slowed by {names} in {len(slowed)} of {n} samples "
                            f"({share:.0%}) over the last {self.t.window_s / 60:g} min",
                            gpu,
                            kind="clock_slowdown",
                        )
                    )
            if self.t.margin_min_c is not None and h.margin_c is not None and h.margin_c <= self.t.margin_min_c:
                out.append(
                    Finding.fault(
                        Check.CLOCKS,
                        Reason.GPU_DEGRADED,
                        f"thermal margin {h.margin_c:g} C, at or below {self.t.margin_min_c:g} C",
                        gpu,
                        kind="thermal_margin",
                    )
                )
        return out


def nvml_clock_sample(nv: Any, handle: Any) -> ClockSample:
    """Reads one ClockSample through nvidia-ml-py. NOT_SUPPORTED reasons: mask 0 (nothing to count);
    another error: the sample says why. The margin is left None where the GPU does not support it.
    Run it where the other NVML calls run (the NVML probe's worker, under its deadline)."""
    margin: float | None = None
    fn = getattr(nv, "nvmlDeviceGetMarginTemperature", None)
    if fn is not None:
        try:
            r = fn(handle)
            margin = float(getattr(r, "margin", r))
        except nv.NVMLError:
            margin = None
    try:
        mask = int(nv.nvmlDeviceGetCurrentClocksEventReasons(handle))
    except nv.NVMLError as e:
        if getattr(e, "value", None) == NOT_SUPPORTED:
            return ClockSample(0, margin)
        return ClockSample(None, margin, str(e))
    return ClockSample(mask, margin)


class ClocksProbe:
    """Hardware clock slowdowns over a window: one NVML sample per GPU and cycle (a hung NVML keeps the
    history), judged on the share of slowed samples."""

    check = Check.CLOCKS

    def __init__(self, tracker: ClockEventTracker) -> None:
        self.tracker = tracker

    def read(self, context: ProbeContext) -> ProbeResult:
        gpus, now = context.gpu_readings(Check.NVML), context.now
        if gpus is not None:
            gpus = [g for g in gpus if g.address is not None]
            for g in gpus:
                if g.clock is not None:
                    self.tracker.observe(g.address, g.clock, now)
            self.tracker.forget_except(g.address for g in gpus)
        return ProbeResult.of(Check.CLOCKS, self.tracker.findings(now))
