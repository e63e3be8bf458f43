"""Non-fatal Xids repeating on one GPU: a sliding window per (GPU, Xid). Pure: events and the time come in
as arguments, nothing is read here.

Application Xids (13, 31, 43, ...) are not fatal one by one, but the same Xid on the same GPU many
times in a short window points at the GPU (EKS node monitoring agent #272: count/window threshold).
A GPU with at least `count` of the same Xid within `window_s` seconds is degraded, and stays degraded
until a full window passes with no such Xid on it (the window is clean). It never latches: no state
survives the window.

One fault prints a burst of records: the driver writes an Xid 13 line per SM, TPC and ESR of the exception
(a real H100 capture holds 15 Xid 13 lines within 2 ms from one out-of-range access of one process). Records of
the same (GPU, Xid) within `burst_s` of the last counted one are one occurrence; a stream that goes on longer
still counts once per `burst_s`, so a GPU that keeps faulting trips the rate as before. Fatal Xids are the
latch's business (state.py) and are not counted here.

The kernel-log watcher observes on its own thread while the loop reads findings: one lock guards the
tracker. Times are the caller's clock (seconds); events may carry their own time (observe_at), which is
how the kernel log's history read at start is placed in the window instead of counted as new."""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from agent.model import Check, Finding, PciAddress, ProbeResult, Reason, XidEvent
from agent.probes.base import ProbeContext
from agent.settings import DAY, in_range, positive, setting, to_bool, to_float, to_int, to_int_list


@dataclass(frozen=True)
class XidRateThresholds:
    """Settings of the Xid-rate probe (docs/degradation.md has each default and its source)."""

    enabled: bool = setting(to_bool, True, "count repeated non-fatal Xids per GPU", name="xid_rate")
    # EKS node monitoring agent #272 proposal: 3 occurrences ...
    count: int = setting(
        in_range(to_int, 1, 100_000), 3, "this many of the same non-fatal Xid on one GPU ...", name="xid_rate_count"
    )
    # ... within 10 minutes
    window_s: float = setting(
        positive(to_float, DAY), 600.0, "... within this many seconds: GPUDegraded", name="xid_rate_window"
    )
    # 45 follows other Xids (NVIDIA/NVSentinel#1712)
    ignore: tuple[int, ...] = setting(
        to_int_list, (45,), "Xids the rate never counts (comma list)", name="xid_rate_ignore"
    )
    # records of one fault come within milliseconds: one occurrence
    burst_s: float = setting(
        in_range(to_float, 0.0, 60.0),
        1.0,
        "records of one Xid on one GPU within this many seconds of the last counted one are one occurrence",
        name="xid_rate_burst",
    )
    max_keys: int = 1024  # (GPU, Xid) pairs tracked at once; the oldest is dropped beyond this

    def __post_init__(self) -> None:
        if self.count < 1 or self.window_s <= 0 or self.max_keys < 1 or not 0 <= self.burst_s < self.window_s:
            raise ValueError(
                "Xid rate: count and max_keys must be at least 1, the window positive and the burst shorter than it"
            )


class XidRateTracker:
    def __init__(self, thresholds: XidRateThresholds = XidRateThresholds()) -> None:
        self.t = thresholds
        self._times: OrderedDict[tuple[PciAddress, int], deque[float]] = OrderedDict()
        self._tripped: set[tuple[PciAddress, int]] = set()
        self._lock = threading.Lock()

    def counts(self, ev: XidEvent) -> bool:
        """Whether the rate counts this event: a non-fatal Xid on a GPU, not ignored."""
        return not ev.fatal and ev.source == "xid" and ev.address is not None and ev.xid not in self.t.ignore

    def observe(self, events: Iterable[XidEvent], now: float) -> None:
        """Counts the non-fatal GPU Xids among `events`, all seen at `now`."""
        self.observe_at((ev, now) for ev in events)

    def observe_at(self, timed: Iterable[tuple[XidEvent, float]]) -> None:
        """Counts the non-fatal GPU Xids among `timed`, each at its own time (in the order given)."""
        if not self.t.enabled:
            return
        grouped: dict[tuple[PciAddress, int], list[float]] = {}  # one dict and deque lookup per key and call
        printed: dict[tuple[str, int], list[float]] = {}  # the same lists by the address as printed (cheap to hash)
        for ev, at in timed:
            if self.counts(ev):
                times = printed.get(by_print := (ev.raw_address, ev.xid))
                if times is None:
                    key = (ev.address, ev.xid)
                    times = printed[by_print] = grouped.setdefault(key, [])  # type: ignore[arg-type]  # counts()
                times.append(at)
        with self._lock:
            for key, times in grouped.items():
                self._add(key, times)

    def _add(self, key: tuple[PciAddress, int], times: list[float]) -> None:
        q = self._times.get(key)
        if q is None:
            q = self._times[key] = deque(maxlen=max(self.t.count, 1) * 4)
            while len(self._times) > self.t.max_keys:
                old, _ = self._times.popitem(last=False)
                self._tripped.discard(old)
        else:
            self._times.move_to_end(key)
        n, window, burst = self.t.count, self.t.window_s, self.t.burst_s
        tripped = key in self._tripped
        for at in times:
            if q and at < q[-1]:
                at = q[-1]  # times never go backwards within a key (the window arithmetic relies on it)
            if q and at - q[-1] < burst:
                continue  # a record of the same burst as the last counted one: one occurrence
            q.append(at)
            if not tripped and len(q) >= n and at - q[-n] <= window:
                tripped = True
        if tripped:
            self._tripped.add(key)

    def findings(self, now: float) -> list[Finding]:
        if not self.t.enabled:
            return []
        out: list[Finding] = []
        with self._lock:
            for key in sorted(self._times):
                q = self._times[key]
                if q and q[-1] <= now - self.t.window_s:  # a clean window: forget it
                    del self._times[key]
                    self._tripped.discard(key)
                    continue
                if key in self._tripped:
                    gpu, xid = key
                    recent = sum(1 for x in q if x > now - self.t.window_s)
                    out.append(
                        Finding.fault(
                            Check.XID_RATE,
                            Reason.GPU_DEGRADED,
                            f"Xid {xid} repeated: {self.t.count} or more within {self.t.window_s / 60:g} min "
                            f"({recent} occurrences in the last window)",
                            gpu,
                            kind="xid_rate",
                        )
                    )
        return out


class XidRateProbe:
    """The Xid rate as a probe: the watcher feeds the tracker; each cycle reads its findings at the cycle's time
    (the kernel log's own failure is the kernel-log probe's finding)."""

    check = Check.XID_RATE

    def __init__(self, tracker: XidRateTracker) -> None:
        self.tracker = tracker

    def read(self, context: ProbeContext) -> ProbeResult:
        return ProbeResult(Check.XID_RATE, tuple(self.tracker.findings(context.now)))
