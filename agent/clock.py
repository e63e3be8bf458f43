"""The one seam for time: the agent reads the clock only through a `Clock`, so tests drive it with plain numbers.
`mono` orders and spaces things (polls, backoff, holds); `wall` stamps what others read (Events, the clear-before
annotation, latched faults), in the two wire formats below."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime


@dataclass(frozen=True)
class Clock:
    mono: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time


SYSTEM = Clock()


def rfc3339(ts: float) -> str:
    """Unix seconds as a Kubernetes `Time` (RFC 3339, whole seconds, UTC): conditions, taints' timeAdded."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_time(ts: float) -> str:
    """Unix seconds as a Kubernetes `MicroTime` (microseconds, UTC): an Event's eventTime, a Lease's renewTime."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
