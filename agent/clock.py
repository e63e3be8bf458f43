"""The one seam for time: the agent reads the clock only through a `Clock`, so tests drive it with plain numbers.
`mono` orders and spaces things (polls, backoff, holds); `wall` stamps what others read (Events, the clear-before
annotation, latched faults)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Clock:
    mono: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time


SYSTEM = Clock()
