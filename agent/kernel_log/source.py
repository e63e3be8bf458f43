"""Reading the kernel log: records from /dev/kmsg (or a regular file in the same format), in bounded batches.

Record format (kernel Documentation/ABI/testing/dev-kmsg): `prio,seq,usec,flags[,more];text\\n`,
then optional continuation lines that start with a space (KEY=value). Non-printable bytes and
backslashes in the text are escaped as \\xNN. prio = facility << 3 | level; facility 0 is the kernel.
On the char device each read() returns one record; EPIPE means records were overwritten before we
read them (the seq gap says how many); EAGAIN in non-blocking mode means "no more for now"."""

from __future__ import annotations

import errno
import os
import re
import select
import stat
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    pass

_ESC = re.compile(rb"\\x([0-9a-fA-F]{2})")
# The header of a record as the kernel writes it, "prio,seq,usec,flags[,more];" in decimal digits: a file's lines
# that start so are read without parse_record's general path (the same record comes out); any other line takes it.
_PLAIN_HEAD = re.compile(rb"(\d{1,19}),(\d{1,19}),(\d{1,19}),[^;]{0,256};")
KERNEL_FACILITY = 0
READ_SIZE = 8192
FILE_CHUNK = 1 << 20
# One /dev/kmsg read returns at most 8192 bytes (the kernel's CONSOLE_EXT_LOG_MAX: a record's text is at
# most 1024 bytes, up to 4x that once escaped as \xNN). A longer line in a file is cut to MAX_RECORD before
# parsing, so a huge line costs linear time and bounded memory.
MAX_RECORD = 8192
KMSG_DEVICE = (1, 11)  # /dev/kmsg's major:minor on every Linux; any other character device is refused
FILE_BYTES_PER_RECORD = 1024  # a file batch reads at most max_records x this (lines dropped unread count too)


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


def _pseudo_devices() -> frozenset[int]:
    """The device numbers of /proc and /sys: their files say size 0 and answer every read anew."""
    out = set()
    for root in ("/proc", "/sys"):
        try:
            out.add(os.stat(root).st_dev)
        except OSError:
            pass
    return frozenset(out)


def _refusal(path: str, st: os.stat_result) -> str | None:
    """Why `path` is not a kernel log to read; None for /dev/kmsg or a regular file."""
    mode = st.st_mode
    if stat.S_ISREG(mode):
        if st.st_dev in _pseudo_devices():
            return f"kernel log {path} is a procfs or sysfs file (no records, never ends): not read"
        return None
    if stat.S_ISCHR(mode):
        dev = (os.major(st.st_rdev), os.minor(st.st_rdev))
        if dev == KMSG_DEVICE:
            return None
        return f"kernel log {path} is the character device {dev[0]}:{dev[1]}, not /dev/kmsg (1:11): not read"
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "not a regular file"
    return f"kernel log {path} is {kind}: only /dev/kmsg or a regular file is read"


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
        self.more = False  # the last read_available() stopped at its bound: more may be there now
        self._buf = b""
        self._offset = 0
        self._ino: int | None = None
        self._notify: _Inotify | None = None

    def open(self) -> None:
        """Opens the log. Only /dev/kmsg (character device 1:11) or a regular file is read: anything else
        (/dev/zero, /dev/null, a FIFO, a directory, a socket) never ends or never holds records, so it is
        refused with KmsgUnavailable (the check then reads "could not check", never healthy)."""
        self.close()
        self.is_device = False
        try:
            st = os.stat(self.path)
            refused = _refusal(self.path, st)
            if refused is None:  # stat first: opening a FIFO or another device can have effects
                self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
                st = os.fstat(self.fd)  # what was opened (the path may have been replaced since the stat)
                refused = _refusal(self.path, st)
        except OSError as e:
            self.close()
            raise KmsgUnavailable(e.errno, f"cannot open kernel log {self.path}: {e.strerror}") from e
        if refused is not None:
            self.close()
            raise KmsgUnavailable(errno.EINVAL, refused)
        self.is_device = stat.S_ISCHR(st.st_mode)
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
        """Yields what is there now, in batches of at most `batch` records, until nothing is left (a batch that
        met its bound with no record that counts is read past, not taken for the end)."""
        while True:
            records, _lost = self.read_available(batch)
            if records:
                yield records
            if not self.more:
                return

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
        self.more = False
        for _ in range(max_records):  # one record per read: at most max_records reads, kept or dropped
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
        else:
            self.more = True
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
        stop_at = self._offset + max(FILE_CHUNK, max_records * FILE_BYTES_PER_RECORD)  # dropped lines count too
        self.more = False
        while True:
            if len(out) >= max_records or self._offset >= stop_at:
                self.more = True
                break
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
            self._accept_lines(lines, out)
        return out

    def _accept_lines(self, lines: list[bytes], out: list[KmsgRecord]) -> None:
        """_accept(parse_record(line)) for each line of a file, the kernel's own header read in place (a storm's hot
        path): a record from outside the kernel is counted without being decoded, unless user records are trusted."""
        head, trust_user = _PLAIN_HEAD.match, self.trust_user
        last, lost, read = self.last_seq, 0, 0
        seq: int | None
        rec: KmsgRecord | None
        for raw in lines:
            m = head(raw)
            rec = None
            if m is not None:
                prio, seq = int(m[1]), int(m[2])
                if prio >> 3 == KERNEL_FACILITY or trust_user:
                    text = raw[m.end() : MAX_RECORD].decode("utf-8", "replace").rstrip("\r")
                    rec = KmsgRecord(prio >> 3, prio & 7, seq, int(m[3]), unescape(text) if "\\x" in text else text)
            elif raw[:1] == b" ":
                continue  # continuation line (KEY=value) of the previous record
            elif (rec := parse_record(raw[:MAX_RECORD].decode("utf-8", "replace"))) is None:
                continue  # a blank line
            else:  # a record of another form, or plain text (a saved dmesg: kept, with facility None)
                seq = rec.seq
                if not (rec.facility is None or rec.from_kernel or trust_user):
                    rec = None
            if seq is not None:
                if last is not None and seq > last + 1:
                    lost += seq - last - 1
                last = seq
            read += 1
            if rec is not None:
                out.append(rec)
        self.last_seq, self.lost_records, self.records_read = last, self.lost_records + lost, self.records_read + read
