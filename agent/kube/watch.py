"""One watch thread for the agent's caches (the own Node, the node's ResourceSlices): start, stop (closing the
open stream), wait_synced, and the shared reading of one watch stream with bounded events, byte counts and the
too-short-watch check."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

from agent.kube.client import ApiError, KubeApi, LineTooLong, WatchStream

NodeDict = dict[str, Any]
OnChange = Callable[[NodeDict | None, NodeDict | None], None]

# each watch lasts uniform(1, 2) x this: 10-20 min, twice client-go's reflector (5-10 min), so one agent
# renews its watch 4 times an hour; the apiserver's own choice without timeoutSeconds is 30-60 min
WATCH_TIMEOUT_S = 600.0
FORBIDDEN_BACKOFF_CAP_S = 1800.0  # RBAC without watch: retry rarely (RBAC may be fixed live), GET meanwhile
MIN_HEALTHY_WATCH_S = 1.0  # a watch the server ends sooner than this counts as a failure (no hot loop)


@dataclass
class WatchStats:
    """What every watch thread counts (WatchThread._follow keeps the first two)."""

    watches: int = 0  # watches opened
    watch_bytes: int = 0
    events: int = 0  # ADDED/MODIFIED/DELETED
    bookmarks: int = 0
    gone: int = 0  # 410 Gone answers
    errors: int = 0


class Gone(Exception):
    """The resourceVersion we hold is no longer served (HTTP 410 or a watch ERROR event with code 410)."""


def labels_and_annotations(node: NodeDict | None) -> tuple[Any, Any] | None:
    if node is None:
        return None
    meta = node.get("metadata") or {}
    return meta.get("labels") or {}, meta.get("annotations") or {}


def rv_of(obj: NodeDict | None) -> str:
    return str(((obj or {}).get("metadata") or {}).get("resourceVersion") or "")


def _newer(a: str, b: str) -> bool:
    """Whether resourceVersion a is newer than b. They are opaque strings by contract; the apiserver's
    are decimal etcd revisions, and anything else is taken as newer (the fresher read wins)."""
    if a.isdigit() and b.isdigit():
        return int(a) > int(b)
    return True


def check_event(ev: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The type and object of one watch event. Raises Gone for an ERROR event with code 410 (the version asked
    for is no longer served) and ApiError for any other ERROR, an event without an object or of an unknown type."""
    kind = ev.get("type")
    obj = ev.get("object")
    if not isinstance(obj, dict):
        raise ApiError(0, f"watch event {kind!r} without an object")
    if kind == "ERROR":
        code = obj.get("code")
        if code == 410:
            raise Gone(str(obj.get("message", "resource version too old")))
        raise ApiError(int(code) if isinstance(code, int) else 0, f"watch error: {obj.get('message', '')}")
    if kind not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
        raise ApiError(0, f"unknown watch event type {kind!r}")
    return kind, obj


class WatchThread:
    """What NodeCache and SliceCache (slice_cache.py) share: one background thread that holds a watch stream,
    started and stopped from the caller's side, and reads it (`_follow`); its settings and its state (kept,
    where to resume, failures). Subclasses set `thread` (target: their `_run`) and `stats`."""

    thread: threading.Thread
    stats: WatchStats

    def __init__(
        self,
        api: KubeApi,
        node: str,
        watch_timeout_s: float,
        rng: random.Random | None,
        max_event_bytes: int,
        backoff_cap_s: float,
        mono: Callable[[], float],
    ) -> None:
        self.api = api
        self.node = node
        self.watch_timeout_s = watch_timeout_s
        self.rng = rng or random.Random()
        self.max_event_bytes = max_event_bytes
        self.backoff_cap_s = backoff_cap_s
        self.mono = mono
        self._lock = threading.Lock()
        self._stream: WatchStream | None = None
        self._stop = threading.Event()
        self._synced = threading.Event()
        self._live = False  # the watch is kept: the cache is current
        self._rv = ""  # where the next watch resumes ("": start over)
        self._failures = 0
        self._problem: str | None = None  # logged once per kind of failure
        self.last_error: str | None = None

    def start(self) -> Self:
        self.thread.start()
        return self

    def stop(self, timeout_s: float = 1.0) -> bool:
        """Stops the watch thread (closing an open watch); returns whether it ended within timeout_s."""
        self._stop.set()
        with self._lock:
            stream = self._stream
        if stream is not None:
            stream.shutdown()
        if self.thread.is_alive():
            self.thread.join(timeout_s)
        return not self.thread.is_alive()

    def wait_synced(self, timeout_s: float) -> bool:
        """Waits until the cache first holds the current state; returns whether it happened."""
        return self._synced.wait(timeout_s)

    def _follow(
        self,
        stream: WatchStream,
        timeout: int,
        on_event: Callable[[dict[str, Any]], None],
        on_open: Callable[[], None] | None = None,
    ) -> None:
        """Reads `stream` to its end, passing each event to `on_event` (on this thread): the stream is held for
        stop() (`on_open` runs with the lock held as it is taken), events are bounded by max_event_bytes, and a
        watch the server ends before MIN_HEALTHY_WATCH_S (or half its timeout) is an error, so a server that
        ends every watch at once is backed off from, not spun on."""
        with self._lock:
            if self._stop.is_set():
                stream.close()
                return
            self._stream = stream
            if on_open is not None:
                on_open()
        self.stats.watches += 1
        opened = self.mono()
        base = self.stats.watch_bytes
        try:
            for ev in stream.events(self.max_event_bytes):
                self.stats.watch_bytes = base + stream.bytes_read
                if self._stop.is_set():
                    return
                on_event(ev)
        except LineTooLong as e:
            raise ApiError(0, str(e)) from e
        finally:
            with self._lock:
                self._stream = None
            self.stats.watch_bytes = base + stream.bytes_read
            stream.close()
        lasted = self.mono() - opened
        if lasted < min(MIN_HEALTHY_WATCH_S, timeout / 2) and not self._stop.is_set():
            raise ApiError(0, f"the server ended the watch after {lasted:.2f}s")
