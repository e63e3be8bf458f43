"""The agent's own NVML session stands aside while a GPU reset runs: an open NVML session holds every GPU, and
`nvidia-smi -r` refuses a GPU that any client holds ("In use by another client").

`paused(probe)` marks the probe paused (its cycles report "paused" instead of reading, without waiting), waits for
a read in flight to finish (bounded by the probe's own call deadline), shuts NVML down, and on the way out lets the
next read initialise it again. Kept apart from the probe so that the probe's own code stays as it is."""

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
