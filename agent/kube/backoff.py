"""Backoff and jitter, in one place: one formula for every retry (exponential with equal jitter, at least what
the apiserver's Retry-After asks for), `Backoff` for a write that retries on its own schedule (the condition,
the taint, Events), the per-request health record that logs each change once, and the jitter that spreads a
fleet's first writes and heartbeats. Pure where it can be: the random source and the clock are arguments."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from agent.kube.client import ApiError

BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0
RETRY_AFTER_MAX_S = 600.0  # a server's Retry-After is honoured up to this long


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


def retry_wait(
    failures: int,
    rng: random.Random,
    base_s: float = BACKOFF_BASE_S,
    cap_s: float = BACKOFF_CAP_S,
    retry_after_s: float | None = None,
) -> float:
    """The wait before the next try: backoff_delay, or longer when the server said how long (429 Too Many
    Requests, 503 with Retry-After; honoured up to RETRY_AFTER_MAX_S even above the cap)."""
    wait = backoff_delay(failures, rng, base_s, cap_s)
    if retry_after_s is not None and retry_after_s > 0:
        wait = max(wait, min(retry_after_s, RETRY_AFTER_MAX_S))
    return wait


class Backoff:
    """One retry schedule: after the n-th failure in a row nothing is tried before `retry_at` (retry_wait); a
    success resets it."""

    def __init__(
        self,
        cap_s: float = BACKOFF_CAP_S,
        *,
        base_s: float = BACKOFF_BASE_S,
        rng: random.Random | None = None,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cap_s, self.base_s, self.rng, self.mono = cap_s, base_s, rng or random.Random(), mono
        self.failures = 0
        self.retry_at = 0.0  # on `mono`; nothing is tried before

    def due(self) -> bool:
        return self.mono() >= self.retry_at

    def failed(self, error: ApiError | None = None) -> float:
        """One more failure in a row: returns the wait, and sets `retry_at`."""
        self.failures += 1
        wait = retry_wait(self.failures, self.rng, self.base_s, self.cap_s, error.retry_after_s if error else None)
        self.retry_at = self.mono() + wait
        return wait

    def succeeded(self) -> None:
        self.failures, self.retry_at = 0, 0.0


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

    def __init__(self, log: Any, cap_s: float, mono: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.states: dict[str, str] = {}
        self.backoff = Backoff(cap_s, mono=mono)

    @property
    def retry_at(self) -> float:
        """No condition write before this (on the monotonic clock)."""
        return self.backoff.retry_at

    @property
    def failures(self) -> int:
        return self.backoff.failures

    def ok(self, what: str) -> None:
        prev = self.states.get(what, "ok")
        if prev != "ok":
            self.log.info("API request succeeds again", request=what, previous=prev)
        self.states[what] = "ok"
        if what == "write status":
            self.backoff.succeeded()

    def failed(self, e: ApiError, what: str) -> None:
        state = {0: "unreachable", 401: "unauthorized", 403: "forbidden", 429: "throttled"}.get(
            e.status, f"http_{e.status}"
        )
        if state != self.states.get(what, "ok"):
            level = self.log.error if state in ("forbidden", "unauthorized") else self.log.warning
            level("API request failed; retrying with backoff", request=what, state=state, error=str(e)[:300])
            self.states[what] = state
        if what == "write status":
            self.backoff.failed(e)
