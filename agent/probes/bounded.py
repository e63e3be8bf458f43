"""Calls that may never return, run under a deadline: the one mechanism behind NVML's calls (probes/nvml.py) and the
sysfs and procfs reads (probes/sysfs.py).

A call runs on a worker thread and the caller waits at most `deadline_s` for it. A call that does not return in
time cannot be killed (a read blocked in a driver, an NVML call waiting on the GPU): its thread is abandoned, still
blocked, and counted. While `max_blocked` threads are blocked no further call starts: it is refused at once, so a
wedged source costs at most `max_blocked` threads however many cycles ask it again, and a caller never waits longer
than one deadline. A blocked thread that returns at last is released (it ends; the count goes down), and what it
read is dropped. Every worker is a daemon thread: a blocked one never holds up the process's exit (a liveness
restart, the end of `gpu-ready check`).

`Blocked` is an OSError (errno ETIMEDOUT) so that callers which already turn an unreadable file into "could not
check" treat a wedged one the same way; it says which call and for how long."""

from __future__ import annotations

import errno
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Blocked(OSError):
    """A call did not return within its deadline, or was refused because earlier ones are still blocked."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ETIMEDOUT, message)

    def __str__(self) -> str:
        return str(self.strerror)


class _Job:
    """One call handed to a worker. `done` is a plain lock held until the call ends (the worker releases it): the
    cheapest hand-off there is (a waiting caller wakes once), about 15 us per call."""

    __slots__ = ("args", "done", "error", "finished", "fn", "result")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args
        self.done = threading.Lock()
        self.done.acquire()
        self.finished = False
        self.result: Any = None
        self.error: BaseException | None = None


class Worker(threading.Thread):
    """One daemon thread running jobs in order. `abandoned`: its caller gave up on the job it is running; it ends
    once that job returns. `current`: what the job is doing now (e.g. the path being read), for the message and
    for the per-key refusal of `BoundedCalls.key_blocked`."""

    def __init__(self, owner: BoundedCalls) -> None:
        super().__init__(name=f"{owner.name}-worker", daemon=True)
        self.owner = owner
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.abandoned = False
        self.current: str | None = None

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                job.result = job.fn(*job.args)
            except BaseException as e:  # handed to the caller, never lost on this thread
                job.error = e
            job.finished = True
            job.done.release()
            if self.abandoned:
                self.owner._released(self)
                return


_local = threading.local()


def current_worker() -> Worker | None:
    """The worker this code runs on, when it runs on one (a bounded call's body)."""
    return getattr(_local, "worker", None)


def _on_worker(worker: Worker, fn: Callable[..., T], *args: Any) -> T:
    _local.worker = worker
    try:
        return fn(*args)
    finally:
        _local.worker = None


class BoundedCalls:
    """Runs calls on a worker under a deadline; at most `max_blocked` workers blocked at once (module docstring)."""

    def __init__(self, name: str, deadline_s: float, max_blocked: int = 1) -> None:
        self.name, self.deadline_s, self.max_blocked = name, deadline_s, max_blocked
        self._lock = threading.Lock()  # one call at a time hands work to the live worker
        self._state = threading.Lock()  # the blocked workers and keys
        self._worker: Worker | None = None
        self._blocked: dict[Worker, str | None] = {}  # abandoned workers still running, with the key each holds
        self.timeouts = 0  # calls abandoned at their deadline, since start

    @property
    def blocked(self) -> int:
        """Workers blocked now (abandoned, still running their call)."""
        return len(self._blocked)

    def key_blocked(self, key: str) -> bool:
        """Whether an abandoned worker is still blocked on `key` (e.g. a path): asking it again would block too."""
        return key in self._blocked.values()

    def call(self, fn: Callable[..., T], *args: Any, what: str | None = None) -> T:
        """fn(*args) on the worker, within the deadline. Raises Blocked when it does not return in time (the worker
        is abandoned) or when `max_blocked` workers are blocked already (refused at once); fn's own exceptions
        propagate."""
        label = what or getattr(fn, "__name__", "call")
        with self._lock:
            if len(self._blocked) >= self.max_blocked:
                raise Blocked(self._refusal())
            worker = self._worker
            if worker is None or not worker.is_alive():
                worker = self._worker = Worker(self)
                worker.start()
            job = _Job(_on_worker, (worker, fn, *args))
            worker.jobs.put(job)
            if not job.done.acquire(timeout=self.deadline_s):
                held = None
                with self._state:
                    if not job.finished:  # still running: give up on it and its thread
                        worker.abandoned = True
                        self._blocked[worker] = held = worker.current
                        self._worker = None
                        self.timeouts += 1
                if worker.abandoned:
                    if held:
                        raise Blocked(f"{held} did not answer within {self.deadline_s:g}s ({label})")
                    raise Blocked(f"{label} did not return within {self.deadline_s:g}s")
        if job.error is not None:
            raise job.error
        return job.result

    def _refusal(self) -> str:
        held = sorted(k for k in self._blocked.values() if k)
        where = f" ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''})" if held else ""
        n = len(self._blocked)
        return f"{n} earlier {self.name} call{'s' if n != 1 else ''} still blocked{where}; not starting another"

    def _released(self, worker: Worker) -> None:
        with self._state:
            self._blocked.pop(worker, None)

    def close(self) -> None:
        """Ends the live worker (a blocked one ends when its call returns)."""
        with self._lock:
            if self._worker is not None:
                self._worker.jobs.put(None)
                self._worker = None
