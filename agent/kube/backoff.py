"""Backoff and jitter, in one place: exponential backoff with equal jitter for retries (honouring an
apiserver's Retry-After), the per-request health record that logs each change once, and the jitter that
spreads a fleet's first writes and heartbeats. Pure where it can be: the random source is an argument."""

from __future__ import annotations

import random
import time
from typing import Any

from agent.kube.client import ApiError

BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0


def error_kind(e: ApiError) -> str:
    return {0: "unreachable", 401: "unauthorized", 403: "forbidden", 404: "not-found"}.get(e.status, f"http-{e.status}")


# -- spreading the fleet's writes (pure; the random source is an argument) ---------------------------------


def backoff_delay(
    failures: int, rng: random.Random, base_s: float = BACKOFF_BASE_S, cap_s: float = BACKOFF_CAP_S
) -> float:
    """Exponential backoff with "equal jitter": the n-th failure in a row waits between half and all of
    min(cap, base x 2^(n-1)), so agents that failed together do not retry together."""
    ceiling = min(cap_s, base_s * 2.0 ** min(max(failures, 1) - 1, 30))
    return ceiling / 2 + rng.random() * ceiling / 2


def first_write_delay(rng: random.Random, window_s: float) -> float:
    """Seconds to hold the first condition write after start: uniform over [0, window_s), so a fleet that
    starts together (a DaemonSet roll-out, a fleet reboot) writes at most fleet/window per second."""
    return rng.random() * max(0.0, window_s)


def heartbeat_delay(rng: random.Random, interval_s: float, fraction: float = 0.2) -> float:
    """The wait before the next heartbeat: uniform over interval x [1 - fraction/2, 1 + fraction/2), so
    agents that wrote together drift apart while the mean rate stays one write per interval."""
    f = min(max(fraction, 0.0), 1.0)
    return interval_s * (1.0 + f * (rng.random() - 0.5))


class ApiHealth:
    """Per request ("get node", "write status"): ok or why not, logged once per change; jittered
    exponential backoff for the condition write (reads are simply retried on the next poll)."""

    def __init__(self, log: Any, cap_s: float) -> None:
        self.log, self.cap_s = log, cap_s
        self.states: dict[str, str] = {}
        self.failures = 0
        self.retry_at = 0.0  # monotonic; no condition write before

    def ok(self, what: str) -> None:
        prev = self.states.get(what, "ok")
        if prev != "ok":
            self.log.info("API request succeeds again", request=what, previous=prev)
        self.states[what] = "ok"
        if what == "write status":
            self.failures, self.retry_at = 0, 0.0

    def failed(self, e: ApiError, what: str) -> None:
        state = {0: "unreachable", 401: "unauthorized", 403: "forbidden", 429: "throttled"}.get(
            e.status, f"http_{e.status}"
        )
        if state != self.states.get(what, "ok"):
            level = self.log.error if state in ("forbidden", "unauthorized") else self.log.warning
            level("API request failed; retrying with backoff", request=what, state=state, error=str(e)[:300])
            self.states[what] = state
        if what == "write status":
            self.failures += 1
            delay = min(self.cap_s, 0.5 * 2 ** min(self.failures - 1, 10)) * random.uniform(0.8, 1.2)
            self.retry_at = time.monotonic() + min(delay, self.cap_s)
