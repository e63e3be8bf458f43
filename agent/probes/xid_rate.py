"""Non-fatal Xids repeating on one GPU: a sliding window per (GPU, Xid). Pure: events and the time come in
as arguments, nothing is read here.

Application Xids (13, 31, 43, ...) are not fatal one by one, but the same Xid on the same GPU many
times in a short window points at the GPU (EKS node monitoring agent #272: count/window threshold).
A GPU with at least `count` of the same Xid within `window_s` seconds is degraded, and stays degraded
until a full window passes with no such Xid on it (the window is clean). It never latches: no state
survives the window. Fatal Xids are the latch's business (state.py) and are not counted here."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from agent.model import Check, Finding, PciAddress, Reason, XidEvent


@dataclass(frozen=True)
class XidRateThresholds:
    """Settings of the Xid-rate probe (docs/degradation.md has each default and its source)."""

    enabled: bool = True
    count: int = 3  # EKS node monitoring agent #272 proposal: 3 occurrences ...
    window_s: float = 600.0  # ... within 10 minutes
    ignore: frozenset[int] = frozenset({45})  # 45 follows other Xids (NVIDIA/NVSentinel#1712)
    max_keys: int = 1024  # (GPU, Xid) pairs tracked at once; the oldest is dropped beyond this

    def __post_init__(self) -> None:
        if self.count < 1 or self.window_s <= 0 or self.max_keys < 1:
            raise ValueError("Xid rate: count and max_keys must be at least 1 and the window positive")


class XidRateTracker:
    def __init__(self, thresholds: XidRateThresholds = XidRateThresholds()) -> None:
        self.t = thresholds
        self._times: OrderedDict[tuple[PciAddress, int], deque[float]] = OrderedDict()
        self._tripped: set[tuple[PciAddress, int]] = set()

    def observe(self, events: Iterable[XidEvent], now: float) -> None:
        """Counts the non-fatal GPU Xids among `events`, all seen at `now`."""
        if not self.t.enabled:
            return
        for ev in events:
            if ev.fatal or ev.source != "xid" or ev.address is None or ev.xid in self.t.ignore:
                continue
            key = (ev.address, ev.xid)
            q = self._times.get(key)
            if q is None:
                q = self._times[key] = deque(maxlen=max(self.t.count, 1) * 4)
                while len(self._times) > self.t.max_keys:
                    old, _ = self._times.popitem(last=False)
                    self._tripped.discard(old)
            else:
                self._times.move_to_end(key)
            q.append(now)
            if len(q) >= self.t.count and q[-1] - q[-self.t.count] <= self.t.window_s:
                self._tripped.add(key)

    def findings(self, now: float) -> list[Finding]:
        if not self.t.enabled:
            return []
        out: list[Finding] = []
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
                        f"({recent} in the last window)",
                        gpu,
                        kind="xid_rate",
                    )
                )
        return out
