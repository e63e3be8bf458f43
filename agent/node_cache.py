"""The agent's own Node, read from a watch instead of a GET per poll.

A background thread watches the Node (`fieldSelector=metadata.name=<node>`, bookmarks on,
`timeoutSeconds` jittered so the server ends and the thread renews each watch). The first watch starts
at `resourceVersion=0`: the apiserver answers from its watch cache with the current Node as a synthetic
ADDED event, then the changes, so one request needs only the `watch` verb (no `list`: the agent's RBAC
keeps `list nodes` forbidden) and costs etcd nothing. With `initial_list=True` it lists first instead
(`resourceVersion=0`, from the cache), as client-go's reflector does. A watch resumes from the last
resourceVersion it saw (bookmarks keep it fresh); a 410 Gone (that version fell out of the apiserver's
window) starts over: a re-list with the last resourceVersion (`resourceVersionMatch=NotOlderThan`, from
the cache) or a watch from `resourceVersion=0`; an answer older than the Node held is ignored. Errors
back off exponentially with jitter. `get()` returns the cached Node while the watch is kept; when it
cannot be kept (apiserver away, RBAC without watch), `get()` falls back to one GET with
`resourceVersion=0` per call, never to a quorum read.

Label and annotation changes (the `gpu-ready.io/clear-before` annotation among them) reach
`on_change` as they happen, on the watch thread. Status-only changes (our own condition patches,
kubelet's heartbeats) update the cache without a callback.

The jitter helpers at the end are pure (the random source is an argument) so the runner's start-up
spread and heartbeat jitter are tested on plain numbers."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

from agent.kube import MAX_WATCH_LINE, ApiError, KubeApi, LineTooLong, WatchStream
from agent.logs import get_logger

NodeDict = dict[str, Any]
OnChange = Callable[[NodeDict | None, NodeDict | None], None]

# each watch lasts uniform(1, 2) x this: 10-20 min, twice client-go's reflector (5-10 min), so one agent
# renews its watch 4 times an hour; the apiserver's own choice without timeoutSeconds is 30-60 min
WATCH_TIMEOUT_S = 600.0
BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0
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


@dataclass
class NodeCacheStats(WatchStats):
    lists: int = 0
    relists: int = 0  # starts over after a 410 Gone: a re-list, or a watch from resourceVersion=0
    fallback_gets: int = 0  # GET resourceVersion=0 from get() while the watch was not kept
    cache_reads: int = 0  # get() answered from the cache
    changes: int = 0  # label/annotation changes passed to on_change


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


class NodeCache(WatchThread):
    stats: NodeCacheStats

    def __init__(
        self,
        api: KubeApi,
        node: str,
        on_change: OnChange | None = None,
        watch_timeout_s: float = WATCH_TIMEOUT_S,
        rng: random.Random | None = None,
        max_event_bytes: int = MAX_WATCH_LINE,
        backoff_cap_s: float = BACKOFF_CAP_S,
        mono: Callable[[], float] = time.monotonic,
        initial_list: bool = False,
    ) -> None:
        super().__init__(api, node, watch_timeout_s, rng, max_event_bytes, backoff_cap_s, mono)
        self.on_change = on_change
        self.initial_list = initial_list
        self.selector = f"metadata.name={node}"
        self.stats = NodeCacheStats()
        self.log = get_logger(node=node, component="node-cache")
        self._node: NodeDict | None = None
        self._present = False  # the last list/watch said the Node exists
        self._gone_streak = 0
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"node-cache-{node}")

    # -- the caller's side ---------------------------------------------------------------------------

    @property
    def live(self) -> bool:
        return self._live

    def cached(self) -> NodeDict | None:
        """The last Node seen (from the watch or a fallback GET), without any request. Read-only."""
        with self._lock:
            return self._node

    def get(self) -> NodeDict:
        """The Node, as get_node() would return it: from the cache while the watch is kept, else one GET
        with resourceVersion=0. Raises ApiError (404 when the Node does not exist). The dict is shared:
        do not change it."""
        with self._lock:
            if self._live:
                self.stats.cache_reads += 1
                if self._node is None or not self._present:
                    raise ApiError(404, f'nodes "{self.node}" not found (watch)')
                return self._node
        self.stats.fallback_gets += 1
        node = self.api.get_node(self.node, resource_version="0")
        change = None
        with self._lock:
            if self._live or (self._node is not None and self._present and not _newer(rv_of(node), rv_of(self._node))):
                return self._node if self._node is not None and self._present else node
            change = self._set(node, present=True)
        self._notify(change)
        return node

    # -- the watch thread ----------------------------------------------------------------------------

    def _set(self, node: NodeDict | None, present: bool) -> tuple[NodeDict | None, NodeDict | None] | None:
        """Stores the Node (lock held); returns (old, new) when labels or annotations changed."""
        old = self._node if self._present else None
        self._node = node if node is not None else self._node
        self._present = present
        new = node if present else None
        if labels_and_annotations(old) != labels_and_annotations(new):
            return old, new
        return None

    def _notify(self, change: tuple[NodeDict | None, NodeDict | None] | None) -> None:
        if change is None or self.on_change is None:
            return
        self.stats.changes += 1
        try:
            self.on_change(*change)
        except Exception as e:  # a broken callback must not stop the watch
            self.log.exception("node change callback failed", error=str(e))

    def _list(self, resource_version: str, match: str | None) -> None:
        self.stats.lists += 1
        try:
            lst = self.api.list_nodes(self.selector, resource_version, match)
        except ApiError as e:
            if e.status == 410:
                raise Gone(str(e)) from e
            raise
        items = lst.get("items") or []
        node = items[0] if items else None
        if node is not None:
            node.setdefault("kind", "Node")
            node.setdefault("apiVersion", "v1")
        with self._lock:
            change = self._set(node, present=node is not None)
            self._rv = rv_of(lst) or rv_of(node)
            self._live = True
        self._synced.set()
        self._notify(change)

    def _watch(self) -> None:
        timeout = int(self.watch_timeout_s * (1.0 + self.rng.random()))
        fresh = self._rv in ("", "0")  # from any version: the current Node comes first, as an ADDED event
        stream = self.api.watch_nodes(self.selector, self._rv or "0", max(1, timeout))
        seen = False

        def resuming() -> None:
            if not fresh:
                self._live = True  # resuming from the version we hold: every change since then is on its way

        def on_event(ev: dict[str, Any]) -> None:
            nonlocal seen
            self._apply(ev)
            if not seen:
                seen = True
                with self._lock:
                    self._live = True
                self._synced.set()
                self._ok()

        self._follow(stream, timeout, on_event, resuming)

    def _apply(self, ev: dict[str, Any]) -> None:
        kind, obj = check_event(ev)
        rv = rv_of(obj)
        if kind == "BOOKMARK":
            self.stats.bookmarks += 1
            with self._lock:
                self._rv = rv or self._rv
            return
        self.stats.events += 1
        with self._lock:
            held = rv_of(self._node) if self._node is not None and self._present else ""
            if held and rv and not _newer(rv, held):  # an older state (a lagging apiserver's cache): keep ours
                self._rv = held if self._rv in ("", "0") else self._rv
                return
            change = self._set(obj, present=kind != "DELETED")
            self._rv = rv or self._rv
        self._notify(change)

    def _run(self) -> None:
        # the first list, from the cache (initial_list); else the first watch starts at resourceVersion 0
        relist: tuple[str, str | None] | None = ("0", None) if self.initial_list else None
        while not self._stop.is_set():
            try:
                if relist is not None:
                    self._list(*relist)
                    relist = None
                self._watch()
                self._ok()
            except Gone as e:
                self.stats.gone += 1
                self.stats.relists += 1
                # the version we hold fell out of the window: start over from the cache, not older than it
                if self.initial_list:
                    relist = (self._rv, "NotOlderThan") if relist is None and self._rv not in ("", "0") else ("0", None)
                else:
                    self._rv = "0"
                self._note("gone", str(e))
                self._gone_streak += 1
                if self._gone_streak > 1:  # Gone again right after a re-list: do not spin
                    self._stop.wait(backoff_delay(self._gone_streak - 1, self.rng, BACKOFF_BASE_S, self.backoff_cap_s))
            except ApiError as e:
                self.stats.errors += 1
                if self._stop.is_set():
                    break
                with self._lock:
                    self._live = False
                if e.status in (400, 504) and relist is not None:
                    relist = ("0", None)  # "too large resource version" and the like: any version will do
                self._note(error_kind(e), str(e))
                if self.initial_list and relist is None and not self._rv:
                    relist = ("0", None)
                self._failures += 1
                cap = FORBIDDEN_BACKOFF_CAP_S if e.status in (401, 403) else self.backoff_cap_s
                self._stop.wait(backoff_delay(self._failures, self.rng, BACKOFF_BASE_S, cap))
            except Exception as e:  # never die silently: a bug here must not freeze the Node the agent sees
                self.stats.errors += 1
                with self._lock:
                    self._live = False
                self.log.exception("node watch failed unexpectedly; starting over", error=str(e))
                relist = ("0", None) if self.initial_list else None
                self._rv = "0"
                self._failures += 1
                self._stop.wait(backoff_delay(self._failures, self.rng, BACKOFF_BASE_S, self.backoff_cap_s))
        with self._lock:
            self._live = False

    def _ok(self) -> None:
        if self._failures or self._problem:
            self.log.info("node watch restored", after_failures=self._failures)
        self._failures = 0
        self._gone_streak = 0
        self._problem = None
        self.last_error = None

    def _note(self, kind: str, error: str) -> None:
        self.last_error = error
        if kind != self._problem:
            if kind == "gone":
                self.log.info("node watch expired (410 Gone); starting over from the cache", error=error[:300])
            else:
                self.log.warning(
                    "node watch failed; reading the Node with GET resourceVersion=0 until it is back",
                    watch_state=kind,  # not `state`: that key is the runner's per-request API state
                    error=error[:300],
                )
            self._problem = kind


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
