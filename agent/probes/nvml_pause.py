"""The agent's own GPU clients stand aside while a GPU reset runs: an open NVML session holds every GPU, another
nvidia-smi is a client too, and `nvidia-smi -r` refuses a GPU that any client holds ("In use by another client").

`paused(probe)` marks the probe paused (its cycles report "paused" instead of reading, without waiting), waits for
a read in flight to finish (bounded by the probe's own call deadline), shuts NVML down, and on the way out lets the
next read initialise it again. `smi_paused(runner)` does the same for the check loop's nvidia-smi runs (a cycle
meanwhile reports nvidia-smi as "paused"; a run in flight finishes first). Kept apart from the probes so that their
own code stays as it is."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def paused(probe: Any) -> Iterator[bool]:
    """Yields whether an NVML session was open and has been shut down (False: none was, or no NVML probe)."""
    if probe is None:
        yield False
        return
    probe.paused = True
    shut = False
    try:
        with probe._lock:  # a read in flight finishes first; the next one sees `paused` and does not read
            if probe._initialized:
                try:
                    probe._call(probe._lib().nvmlShutdown)
                    shut = True
                except Exception:  # a hung or failing NVML: nothing more to free here
                    pass
                probe._initialized = False  # the next read initialises NVML again
        yield shut
    finally:
        probe.paused = False


@contextlib.contextmanager
def smi_paused(runner: Any) -> Iterator[None]:
    """No nvidia-smi run of the check loop starts while this holds; one in flight finishes first (the runner's own
    lock, bounded by its timeout)."""
    if runner is None or not hasattr(runner, "paused"):
        yield
        return
    runner.paused = True
    try:
        with runner._lock:  # a run in flight finishes first
            pass
        yield
    finally:
        runner.paused = False
