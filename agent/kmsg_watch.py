"""The kernel-log watcher, whole: reads kernel-log records from /dev/kmsg (or a regular file in the same
format), parses each (xid.py), latches fatal GPU errors in the state file and wakes the loop at once, so
detection never waits for the poll. Records are read in bounded batches, so a storm never sits in memory
whole. Non-fatal Xids go to the Xid-rate tracker (probes/xid_rate.py) at their kernel-log time, whose
findings the check suite adds each cycle.

Record format (kernel Documentation/ABI/testing/dev-kmsg): `prio,seq,usec,flags[,more];text\\n`,
then optional continuation lines that start with a space (KEY=value). Non-printable bytes and
backslashes in the text are escaped as \\xNN. prio = facility << 3 | level; facility 0 is the kernel.
On the char device each read() returns one record; EPIPE means records were overwritten before we
read them (the seq gap says how many); EAGAIN in non-blocking mode means "no more for now".

Path of one kernel-log line, four files: here (read, record, ingest: latched, loop woken) -> xid.py
(XidEvent) -> verdict.py (the Verdict: `decide` and the RecoveryGate) -> report/condition.py (the PATCH).
The latch is persisted by state.py on the way; the runner only schedules the cycle that carries it."""

from __future__ import annotations

import errno
import os
import re
import select
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from agent.logs import get_logger
from agent.model import XidEvent
from agent.xid import KernelLogParser

if TYPE_CHECKING:
    from agent.probes.xid_rate import XidRateTracker
    from agent.report.metrics import Metrics
    from agent.state import LatchState

_ESC = re.compile(rb"\\x([0-9a-fA-F]{2})")
KERNEL_FACILITY = 0
READ_SIZE = 8192
FILE_CHUNK = 1 << 20
# One /dev/kmsg read returns at most 8192 bytes (the kernel's CONSOLE_EXT_LOG_MAX: a record's text is at
# most 1024 bytes, up to 4x that once escaped as \xNN). A longer line in a file is cut to MAX_RECORD before
# parsing, so a huge line costs linear time and bounded memory (issue 12 item 10).
MAX_RECORD = 8192


class KmsgRecord(NamedTuple):
    facility: int | None  # None: a plain text line (a saved dmesg), not a kmsg record
    level: int | None
    seq: int | None
    usec: int | None
    text: str

    @property
    def from_kernel(self) -> bool:
        return self.facility == KERNEL_FACILITY


def unescape(text: str) -> str:
    """The kernel escapes bytes (< 0x20, >= 0x7f and backslash) as \\xNN; multi-byte UTF-8 comes back whole."""
    if "\\x" not in text:
        return text
    raw = _ESC.sub(lambda m: bytes([int(m.group(1), 16)]), text.encode("utf-8", "surrogateescape"))
    return raw.decode("utf-8", "replace")


def parse_record(raw: str) -> KmsgRecord | None:
    """Parses one record (its first line; continuation lines are dropped). None for a blank line.
    A line without a valid kmsg header comes back as a plain-text record with facility None."""
    raw = raw[:MAX_RECORD]
    nl = raw.find("\n")
    line = (raw if nl < 0 else raw[:nl]).rstrip("\r")
    if not line or line.isspace():
        return None
    head, sep, text = line.partition(";")
    if sep:
        fields = head.split(",", 4)
        if len(fields) >= 4:
            try:
                prio, seq, usec = int(fields[0]), int(fields[1]), int(fields[2])
            except ValueError:
                pass
            else:
                if prio >= 0 and seq >= 0 and usec >= 0:
                    return KmsgRecord(prio >> 3, prio & 7, seq, usec, unescape(text) if "\\x" in text else text)
    return KmsgRecord(None, None, None, None, line)


def format_record(text: str, seq: int, usec: int = 0, facility: int = KERNEL_FACILITY, level: int = 4) -> str:
    """The inverse of parse_record, as the kernel writes it (used by the simulated host and tests)."""
    escaped = "".join(
        chr(b) if (32 <= b < 127 and b != 0x5C) else f"\\x{b:02x}" for b in text.encode("utf-8", "replace")
    )
    return f"{facility << 3 | level},{seq},{usec},-;{escaped}\n"


class _Inotify:
    """Wakes a reader when a regular file changes (Linux inotify through libc), so following a file
    costs no polling. `available` is False where inotify cannot be used; callers then poll."""

    IN_MODIFY, IN_ATTRIB, IN_MOVE_SELF, IN_DELETE_SELF = 0x2, 0x4, 0x800, 0x400
    IN_NONBLOCK, IN_CLOEXEC = 0o4000, 0o2000000

    def __init__(self, path: str) -> None:
        self.fd = -1
        try:
            import ctypes
            import ctypes.util

            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fd = libc.inotify_init1(self.IN_NONBLOCK | self.IN_CLOEXEC)
            if fd < 0:
                return
            mask = self.IN_MODIFY | self.IN_ATTRIB | self.IN_MOVE_SELF | self.IN_DELETE_SELF
            if libc.inotify_add_watch(fd, path.encode(), mask) < 0:
                os.close(fd)
                return
            self.fd = fd
        except (OSError, AttributeError):
            self.fd = -1

    @property
    def available(self) -> bool:
        return self.fd >= 0

    def wait(self, timeout: float) -> bool:
        r, _, _ = select.select([self.fd], [], [], timeout)
        if r:
            try:
                while os.read(self.fd, 4096):
                    pass
            except BlockingIOError:
                pass
        return bool(r)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class KmsgUnavailable(OSError):
    """The kernel log could not be opened or read."""


class KmsgSource:
    """Reads records incrementally. On the char device it reads the whole ring buffer first (all
    records since boot), then only new ones; a regular file is read the same way from its start
    and then followed as it grows (a file that shrinks is read again from the start)."""

    def __init__(self, path: str, trust_user: bool = False) -> None:
        self.path = path
        self.trust_user = trust_user
        self.fd: int | None = None
        self.is_device = False
        self.last_seq: int | None = None
        self.lost_records = 0  # total since start
        self.records_read = 0
        self._buf = b""
        self._offset = 0
        self._ino: int | None = None
        self._notify: _Inotify | None = None

    def open(self) -> None:
        self.close()
        try:
            st = os.stat(self.path)
            self.is_device = stat.S_ISCHR(st.st_mode)
            flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
            self.fd = os.open(self.path, flags)
        except OSError as e:
            raise KmsgUnavailable(e.errno, f"cannot open kernel log {self.path}: {e.strerror}") from e
        self._ino = st.st_ino
        self._offset = 0
        self._buf = b""
        if not self.is_device:
            self._notify = _Inotify(self.path)

    def close(self) -> None:
        if self._notify is not None:
            self._notify.close()
            self._notify = None
        if self.fd is not None:
            try:
                os.close(self.fd)
            finally:
                self.fd = None

    def fileno(self) -> int:
        if self.fd is None:
            raise KmsgUnavailable(errno.EBADF, "kernel log not open")
        return self.fd

    def read_available(self, max_records: int = 1_000_000) -> tuple[list[KmsgRecord], int]:
        """Returns (records that count, records lost since the last call). Never blocks."""
        if self.fd is None:
            self.open()
        before = self.lost_records
        out = self._read_device(max_records) if self.is_device else self._read_file(max_records)
        return out, self.lost_records - before

    def drain(self, batch: int = 10_000) -> Iterator[list[KmsgRecord]]:
        """Yields what is there now, in batches of at most `batch` records, until nothing is left."""
        while True:
            records, _lost = self.read_available(batch)
            if not records:
                return
            yield records

    def wait(self, timeout: float) -> bool:
        """Blocks until new data may be there (select() on the device; a cheap size check on a file)."""
        if self.fd is None:
            self.open()
        if self.is_device:
            r, _, _ = select.select([self.fileno()], [], [], timeout)
            return bool(r)
        deadline = time.monotonic() + timeout
        while True:
            try:
                st = os.stat(self.path)
            except OSError:
                return True  # let the reader report it
            if st.st_size != self._offset or st.st_ino != self._ino:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._notify is not None and self._notify.available:
                self._notify.wait(left)  # woken by the kernel when the file changes; then re-check
            else:
                time.sleep(min(0.05, left))

    # -- internals ---------------------------------------------------------------------------

    def _accept(self, rec: KmsgRecord | None, out: list[KmsgRecord]) -> None:
        if rec is None:
            return
        if rec.seq is not None:
            if self.last_seq is not None and rec.seq > self.last_seq + 1:
                self.lost_records += rec.seq - self.last_seq - 1
            self.last_seq = rec.seq
        self.records_read += 1
        if rec.facility is None:
            # Plain text only comes from a regular file an operator pointed us at (a saved dmesg).
            if not self.is_device:
                out.append(rec)
        elif rec.from_kernel or self.trust_user:
            out.append(rec)

    def _read_device(self, max_records: int) -> list[KmsgRecord]:
        out: list[KmsgRecord] = []
        fd = self.fileno()
        while len(out) < max_records:
            try:
                data = os.read(fd, READ_SIZE)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.EPIPE:
                    continue  # overwritten records: the next record's seq shows the gap
                if e.errno == errno.EINTR:
                    continue
                raise KmsgUnavailable(e.errno, f"reading {self.path}: {e.strerror}") from e
            if not data:
                break
            self._accept(parse_record(data.decode("utf-8", "replace")), out)
        return out

    def _read_file(self, max_records: int) -> list[KmsgRecord]:
        out: list[KmsgRecord] = []
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise KmsgUnavailable(e.errno, f"kernel log {self.path} disappeared: {e.strerror}") from e
        if st.st_ino != self._ino or st.st_size < self._offset:
            self.open()  # replaced or truncated: read it again from the start
            self.last_seq = None
        fd = self.fileno()
        while len(out) < max_records:
            try:
                chunk = os.pread(fd, FILE_CHUNK, self._offset)
            except OSError as e:
                raise KmsgUnavailable(e.errno, f"reading {self.path}: {e.strerror}") from e
            if not chunk:
                break
            self._offset += len(chunk)
            lines = chunk.split(b"\n")
            tail = lines.pop()  # partial last line: wait for its newline
            if lines:
                lines[0] = self._buf + lines[0][:MAX_RECORD]
                self._buf = tail[:MAX_RECORD]
            else:
                self._buf = (self._buf + tail[:MAX_RECORD])[:MAX_RECORD]  # a line longer than MAX_RECORD is cut
            for raw in lines:
                raw = raw[:MAX_RECORD]
                if raw[:1] == b" ":
                    continue  # continuation line (KEY=value) of the previous record
                self._accept(parse_record(raw.decode("utf-8", "replace")), out)
        return out


# -- the watcher ----------------------------------------------------------------------------------------

KMSG_BATCH = 2000  # records parsed per read: bounds memory in a storm


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
    return [(ev, now if ev.usec is None else now - max(0.0, (ref - ev.usec) / 1e6)) for ev in events]


class KernelLogIngest:
    """The kernel-log hot path: parse records, count GPU errors (one metric update per key and batch),
    latch fatal ones, hand non-fatal ones to the Xid-rate tracker. Returns the newly latched events."""

    def __init__(
        self,
        parser: KernelLogParser,
        state: LatchState,
        metrics: Metrics,
        rate: XidRateTracker | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.parser, self.state, self.metrics = parser, state, metrics
        self.rate, self.clock = rate, clock

    def process(self, records: list[KmsgRecord], now: float | None = None, device: bool = False) -> list[XidEvent]:
        """device: the records come from /dev/kmsg (their stamps share the monotonic clock's base)."""
        fresh: list[XidEvent] = []
        rated: list[XidEvent] = []
        now = time.time() if now is None else now
        counts: dict[tuple[int, str, bool], int] = {}
        feed, latch = self.parser.feed, self.state.latch
        rate_on = self.rate is not None and self.rate.t.enabled
        for r in records:
            for ev in feed(r.text, r.seq, r.usec):
                key = (ev.xid, ev.raw_address, ev.fatal)
                counts[key] = counts.get(key, 0) + 1
                if ev.fatal:
                    if latch(ev, now) is not None:
                        fresh.append(ev)
                elif rate_on:
                    rated.append(ev)  # the tracker keeps the ones it counts
        for key, n in counts.items():
            self.metrics.observe_xid_key(key, n)
        if rated and self.rate is not None:
            newest = None if device else max((r.usec for r in records if r.usec is not None), default=None)
            self.rate.observe_at(place_events(rated, device=device, now=self.clock(), newest_usec=newest))
        return fresh


class KmsgWatcher:
    """Reads the kernel log on its own thread. `wake()` is called when something the verdict depends on
    changed (a new latched fault, the log became unreadable or readable again, records were lost)."""

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
        self.metrics.kmsg_records.inc(src.records_read - before)
        return len(records) >= KMSG_BATCH, bool(fresh)

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
