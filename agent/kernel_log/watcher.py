"""The kernel-log watcher: reads records (source.py) on its own thread, parses each (xid.py), latches fatal
GPU errors in the state file and wakes the loop at once, so detection never waits for the poll. Records are
read in bounded batches, so a storm never sits in memory whole. Non-fatal Xids go to the Xid-rate tracker
(rate.py) at their kernel-log time.

Path of one kernel-log line: source.py (the record) -> xid.py (an XidEvent, classified by the catalog) ->
here (latched in state.py, the loop woken) -> verdict.py (the Verdict) -> report/condition.py (the PATCH)."""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from agent.kernel_log.link import LinkChange, parse_link_change
from agent.kernel_log.xid import KernelLogParser
from agent.logs import get_logger
from agent.model import Check, Finding, PciAddress, ProbeResult, XidEvent
from agent.probes.base import ProbeContext
from agent.settings import setting, to_bool, to_str

if TYPE_CHECKING:
    from agent.kernel_log.rate import XidRateTracker
    from agent.state import LatchState

from agent.kernel_log.source import KmsgRecord, KmsgSource, KmsgUnavailable


class _Counter(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class Metrics(Protocol):
    """What the watcher counts (report/metrics.py's Metrics is one; the kernel-log wing does not import it)."""

    @property
    def kmsg_records(self) -> _Counter: ...

    @property
    def kmsg_lost(self) -> _Counter: ...

    def observe_xid_key(self, key: tuple[int, str, bool], n: int = 1) -> None: ...


KMSG_BATCH = 2000  # records parsed per read: bounds memory in a storm
LINK_CHANGES_KEPT = 8  # distinct link changes kept per batch for the log line (all are counted)


def place_events(
    events: Sequence[XidEvent],
    *,
    device: bool,
    now: float,
    kernel_now_s: float | None = None,
    newest_usec: int | None = None,
) -> list[tuple[XidEvent, float]]:
    """Each event's time on the caller's clock (`now` is that clock's present), from its kernel-log stamp:
    - the device: /dev/kmsg stamps records in microseconds of the boot-based monotonic clock, the base of
      CLOCK_MONOTONIC (checked on a real kernel: a record written and read back carries time.monotonic()
      to the millisecond), so an event's age is `kernel_now_s` (default: time.monotonic()) minus its stamp;
    - a regular file (a saved log, the simulated host): its stamps have no known base, so ages are taken
      relative to the newest stamp read (`newest_usec`, default: the newest among `events`).
    An event without a stamp (a plain-text line) is placed at `now`; an age below 0 is 0."""
    stamps = [ev.usec for ev in events if ev.usec is not None]
    if not stamps:
        return [(ev, now) for ev in events]
    if device:
        ref = (time.monotonic() if kernel_now_s is None else kernel_now_s) * 1e6
    else:
        ref = max(stamps) if newest_usec is None else max(newest_usec, *stamps)
    return [(ev, now if ev.usec is None or ev.usec >= ref else now - (ref - ev.usec) / 1e6) for ev in events]


class KernelLogIngest:
    """The kernel-log hot path: parse records, count GPU errors (one metric update per key and batch),
    latch fatal ones, hand non-fatal ones to the Xid-rate tracker. Returns the newly latched events.
    With `links`, InfiniBand/RoCE link-change records (link.py) are noted too: `link_changes` holds the first
    few of the last batch and `link_change_count` how many it had (they latch nothing)."""

    def __init__(
        self,
        parser: KernelLogParser,
        state: LatchState,
        metrics: Metrics,
        rate: XidRateTracker | None = None,
        clock: Callable[[], float] = time.monotonic,
        links: bool = False,
    ) -> None:
        self.parser, self.state, self.metrics = parser, state, metrics
        self.rate, self.clock = rate, clock
        self.links = links
        self.link_changes: list[LinkChange] = []
        self.link_change_count = 0

    def process(self, records: list[KmsgRecord], now: float | None = None, device: bool = False) -> list[XidEvent]:
        """device: the records come from /dev/kmsg (their stamps share the monotonic clock's base)."""
        fresh: list[XidEvent] = []
        rated: list[XidEvent] = []
        now = time.time() if now is None else now
        counts: dict[tuple[int, str, bool], int] = {}
        noted: dict[str, tuple[PciAddress, int]] = {}  # per address as printed: the GPU, its newest record's seq
        feed, latch = self.parser.feed, self.state.latch
        rate_on = self.rate is not None and self.rate.t.enabled
        links_on = self.links
        links: list[LinkChange] = []
        nlinks = 0
        for r in records:
            text = r.text
            if links_on and "mlx5_core" in text and (change := parse_link_change(text)) is not None:
                nlinks += 1
                if len(links) < LINK_CHANGES_KEPT and all(c[:4] != change[:4] for c in links):
                    links.append(change)
            for ev in feed(text, r.seq, r.usec):
                key = (ev.xid, ev.raw_address, ev.fatal)
                counts[key] = counts.get(key, 0) + 1
                if ev.address is not None and ev.seq is not None:
                    seen = noted.get(ev.raw_address)
                    if seen is None or ev.seq > seen[1]:
                        noted[ev.raw_address] = (ev.address, ev.seq)
                if ev.fatal:
                    if latch(ev, now) is not None:
                        fresh.append(ev)
                elif rate_on:
                    rated.append(ev)  # the tracker keeps the ones it counts
        self.link_changes, self.link_change_count = links, nlinks
        for gpu, seq in noted.values():
            self.state.note_gpu_record(gpu, seq)  # a recovery's proof wants the log quiet for the GPU it reset
        for key, n in counts.items():
            self.metrics.observe_xid_key(key, n)
        if rated and self.rate is not None:
            newest = None if device else max((r.usec for r in records if r.usec is not None), default=None)
            self.rate.observe_at(place_events(rated, device=device, now=self.clock(), newest_usec=newest))
        return fresh


class KmsgWatcher:
    """Reads the kernel log on its own thread. `wake()` is called when something the verdict depends on
    changed (a new latched fault, the log became unreadable or readable again, records were lost, an
    InfiniBand/RoCE link changed)."""

    def __init__(
        self,
        source: KmsgSource,
        ingest: KernelLogIngest,
        metrics: Metrics,
        wake: Callable[[], None],
        retry_s: float,
        log: Any = None,
    ) -> None:
        self.source, self.ingest, self.metrics, self.wake = source, ingest, metrics, wake
        self.retry_s = retry_s
        self.log = log or get_logger()
        self.problem: str | None = None  # why the kernel log cannot be read; None when it can
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._fresh: list[XidEvent] = []
        self._rerun = False
        self._link_changed = False
        self.thread: threading.Thread | None = None
        self._stop_r, self._stop_w = os.pipe()  # close() writes here: the blocking wait ends at once
        os.set_blocking(self._stop_w, False)

    # -- what the loop takes --------------------------------------------------------------------------

    def take_fresh(self) -> list[XidEvent]:
        """Fatal events latched since the last call (for Events)."""
        with self._lock:
            fresh, self._fresh = self._fresh, []
        return fresh

    def take_rerun(self) -> bool:
        """Whether records were lost since the last call (the level checks should run again now)."""
        with self._lock:
            rerun, self._rerun = self._rerun, False
        return rerun

    def take_link_change(self) -> bool:
        """Whether an InfiniBand/RoCE link changed since the last call (the rails should be read now)."""
        with self._lock:
            changed, self._link_changed = self._link_changed, False
        return changed

    @property
    def alive(self) -> bool:
        return self.thread is None or self.thread.is_alive() or self.stop.is_set()

    # -- reading --------------------------------------------------------------------------------------

    def read_available(self) -> bool:
        """Reads what is there now, batch by batch; returns whether a fatal event was latched."""
        new = False
        while True:
            more, latched = self._read_batch()
            if latched:
                new = True
                self.wake()  # report at once; keep reading the rest of a storm
            if not more:
                return new

    def _read_batch(self) -> tuple[bool, bool]:
        src = self.source
        try:
            before = src.records_read
            records, lost = src.read_available(KMSG_BATCH)
        except KmsgUnavailable as e:
            if self.problem != str(e):
                self.log.error("kernel log unavailable", check="xid", error=str(e))
                self.problem = str(e)
                self.wake()
            src.close()
            return False, False
        if self.problem is not None:
            self.log.info("kernel log readable again", check="xid", path=src.path)
            self.problem = None
            self.wake()
        if lost:
            self.metrics.kmsg_lost.inc(lost)
            self.log.warning(
                "kernel-log records lost before they were read; re-running level checks", check="xid", lost=lost
            )
            with self._lock:
                self._rerun = True
            self.wake()
        fresh = self.ingest.process(records, device=src.is_device)
        for ev in fresh:
            self.log.warning(
                "fatal GPU error latched", xid=ev.xid, gpu=ev.raw_address, source=ev.source, text=ev.text[:200]
            )
        if fresh:
            with self._lock:
                self._fresh += fresh
        if self.ingest.link_change_count:
            self.log.info(
                "InfiniBand/RoCE link change in the kernel log; reading the rails now",
                check="infiniband",
                records=self.ingest.link_change_count,
                links=[f"{c.subject}: {c.state}" for c in self.ingest.link_changes],
            )
            with self._lock:
                self._link_changed = True
            self.wake()  # a cycle now, not at the next poll
        self.metrics.kmsg_records.inc(src.records_read - before)
        return src.more, bool(fresh)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="kmsg-watcher", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                if self.source.fd is None:
                    if self.problem is not None and self.stop.wait(self.retry_s):
                        return
                    self.read_available()
                    continue
                if self._wait():
                    self.read_available()
            except Exception as e:  # never die silently: log, back off, go on
                self.log.exception("kernel-log watcher error", check="xid", error=str(e))
                self.source.close()
                self.stop.wait(1.0)

    def _wait(self) -> bool:
        """Blocks until the log may hold new records or close() is called, with no periodic wake-up: select()
        on the device (or on the inotify descriptor that follows a regular file) and on the stop pipe. A file
        without inotify is polled (KmsgSource.wait). True: read now."""
        src = self.source
        notify = getattr(src, "_notify", None)  # KmsgSource's inotify watch of a regular file
        if src.is_device:
            fd = src.fileno()
        elif notify is not None and notify.available:
            if src.wait(0):  # written since the last read (or before the watch saw it)
                return True
            fd = notify.fd
        else:
            return src.wait(0.5)
        r, _, _ = select.select([fd, self._stop_r], [], [])
        if fd not in r:
            return False  # stopping
        if notify is not None and not src.is_device:
            notify.wait(0)  # drain the inotify events; the size check above decides next time
        return True

    def close(self) -> None:
        self.stop.set()
        try:
            os.write(self._stop_w, b"x")
        except OSError:  # closed already, or the pipe is full (a byte is waiting anyway)
            pass
        t = self.thread
        if t is not None and t is not threading.current_thread():
            t.join(2.0)  # let it leave its select() before its descriptor is closed
        self.source.close()
        if t is None or not t.is_alive():
            for fd in (self._stop_r, self._stop_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._stop_r = self._stop_w = -1


class KernelLogProbe:
    """The kernel log as a probe. Fatal faults reach the verdict through the latch (state.py), not as findings;
    this says whether the log could be read: when it could not, "could not check", never healthy."""

    check = Check.XID

    def __init__(self, problem: Callable[[], str | None], unsaved: Callable[[], str | None] = lambda: None) -> None:
        self.problem = problem  # why the log cannot be read now (the watcher's, or a one-shot read's); None: fine
        self.unsaved = unsaved  # why a latched fault would not survive a restart now; None: it would

    def read(self, context: ProbeContext) -> ProbeResult:
        why = self.problem()
        if why is None and (store := self.unsaved()) is not None:
            why = f"latched faults cannot be saved: {store}"
        if why is None:
            return ProbeResult(Check.XID)
        return ProbeResult.of(Check.XID, (Finding.unchecked(Check.XID, why, kind="kmsg_unavailable"),))


class KernelLog(NamedTuple):
    """One read of the whole kernel log (`check`, `gpus`)."""

    events: list[XidEvent]
    problem: str | None  # the log could not be read (to the end)
    device: bool  # the kernel's /dev/kmsg: record stamps share the monotonic clock's base
    newest_usec: int | None  # the newest record's stamp (a file's "now")


def read_once(path: str, parser: KernelLogParser, trust_user: bool = False) -> KernelLog:
    """Reads every record in the kernel log once (the whole ring buffer on /dev/kmsg)."""
    src = KmsgSource(path, trust_user=trust_user)
    events: list[XidEvent] = []
    newest: int | None = None
    problem: str | None = None
    try:
        src.open()
        for records in src.drain():
            for r in records:
                events += parser.feed(r.text, r.seq, r.usec)
                if r.usec is not None:
                    newest = r.usec if newest is None else max(newest, r.usec)
    except KmsgUnavailable as e:
        problem = str(e)
    finally:
        src.close()
    return KernelLog(events, problem, src.is_device, newest)


@dataclass(frozen=True)
class KmsgSettings:
    """Settings of the kernel-log watcher."""

    kmsg: str = setting(to_str, "/dev/kmsg", "kernel log to read (a regular file in kmsg format works the same)")
    kmsg_trust_user: bool = setting(
        to_bool,
        False,
        "count records from user-space facilities too (tests that write to /dev/kmsg from user space)",
        public=False,
    )
