"""Signals: SIGTERM and SIGINT end `gpu-ready run`. The main thread blocks until one comes, without waking up
in between."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable


def on_stop_signals(handler: Callable[[str], None]) -> threading.Event:
    """Installs handlers for SIGTERM and SIGINT that call `handler(name)` and set the returned event."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        handler(signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


def wait_for_signal(stop: threading.Event) -> None:
    """Blocks the main thread until a signal handler sets `stop`: a signal writes a byte to a pipe
    (signal.set_wakeup_fd) that a blocking read waits on, so one that comes before the read is not lost, and the
    handler has run before the loop looks at `stop` again."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    previous = signal.set_wakeup_fd(w)
    try:
        while not stop.is_set():
            os.read(r, 64)
    finally:
        signal.set_wakeup_fd(previous)
        os.close(r)
        os.close(w)
