"""The one way a probe reads a sysfs or procfs file: small, bounded, under a deadline.

A sysfs attribute is read by the driver behind it: a wedged HCA's counter, `state` or `rate`, a GPU's PCIe link file
or the driver's /proc information can block in open() or read() for as long as the device does not answer. A probe
therefore reads through `READER`: its sysfs work (`READER.run(fn, ...)`, one hand-off per probe and cycle) runs on a
worker of the bounded-call mechanism (probes/bounded.py, the one NVML's calls use) under `DEADLINE_S`, and every
file inside it is read with `read_bytes` (one open, one read of at most `size` bytes, one close: no file object).

What a wedged read does:
- the probe's call returns at the deadline with `Blocked` (an OSError) naming the file: the probe reports its signal
  as "could not check" (never True) and the cycle goes on;
- that worker stays blocked in the read and is counted; a later read of the same file is refused at once while it
  is (`Blocked`, no new thread, no wait), so the next cycles are not slowed and do not pile up threads;
- at most `MAX_BLOCKED` workers are blocked at once: past that every read is refused at once ("could not check")
  until one returns; a blocked worker whose read returns at last ends and what it read is dropped;
- the workers are daemon threads: they never hold up the process's exit (`gpu-ready check` ends, a liveness
  restart starts clean and meets the same file with the same deadline).

`read_bytes` called outside a probe's call (a test, a one-off read) runs as a bounded call of its own."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from agent.probes.bounded import Blocked, BoundedCalls, current_worker

T = TypeVar("T")

DEADLINE_S = 2.0  # a sysfs attribute answers in microseconds; a wedged one does not answer at all
MAX_BLOCKED = 4  # workers left blocked in reads at once, for the whole process; past that, reads are refused


class SysfsReader:
    """Bounded reads of small kernel files (module docstring); one per process (`READER`), a test makes its own
    with a short deadline."""

    def __init__(self, deadline_s: float = DEADLINE_S, max_blocked: int = MAX_BLOCKED) -> None:
        self.calls = BoundedCalls("sysfs read", deadline_s, max_blocked)

    def run(self, fn: Callable[..., T], *args: Any, what: str | None = None) -> T:
        """fn(*args) on the worker under the deadline; the files it reads with `read_bytes` are read there directly.
        Raises Blocked (naming the file it was reading) when it does not return in time, or at once while
        MAX_BLOCKED workers are blocked."""
        return self.calls.call(fn, *args, what=what)

    def read(self, path: str, size: int = 64) -> bytes:
        return self.calls.call(read_bytes, path, size, what="reading " + path)

    @property
    def blocked(self) -> int:
        """Workers blocked in a read now."""
        return self.calls.blocked


READER = SysfsReader()


def read_bytes(path: str, size: int = 64) -> bytes:
    """At most `size` bytes of the file at `path`. Raises the OSError of open/read (FileNotFoundError for an absent
    attribute), or Blocked when an earlier read of this file is still blocked or the deadline passed. On a bounded
    call's worker it reads directly (the call has the deadline); elsewhere it is one bounded call of `READER`."""
    worker = current_worker()
    if worker is None:
        return READER.read(path, size)
    if worker.owner.key_blocked(path):
        raise Blocked(f"{path}: an earlier read of it is still blocked")
    if worker.abandoned:
        raise Blocked(f"{path}: not read (the call was abandoned at its deadline)")
    worker.current = path
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # a FIFO or a wedged attribute blocks here or in read
        try:
            data = os.read(fd, size)
        finally:
            os.close(fd)
    finally:
        worker.current = None
    if worker.abandoned:  # the caller gave up while this blocked: drop what was read, change nothing after it
        raise Blocked(f"{path}: answered after the deadline")
    return data
