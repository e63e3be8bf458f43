"""The one list-then-watch cache: a background thread that keeps a collection (or one object) current from one
long-lived watch, as client-go's reflector does. The agent's own Node (node_cache.py), its DRA ResourceSlices
(slice_cache.py), the fleet brake's ConfigMap (object_watch.py) and the controller's Nodes and Jobs
(controller/informer.py) are this class with their own store and callbacks.

How a cache starts (`mode`), and starts over after a 410 Gone:
- "stream": a streaming list (`sendInitialEvents=true`, `resourceVersionMatch=NotOlderThan`, `resourceVersion=0`:
  the WatchList protocol, on by default since 1.32): the apiserver sends the current objects from its watch cache
  as ADDED events, then a BOOKMARK annotated `k8s.io/initial-events-end`, then the changes. One request, the
  `watch` verb only, nothing read from etcd; the objects held before are served until that bookmark replaces
  them. An apiserver that refuses it (400/422) gets `fallback` instead: "list" or "watch".
- "list": a LIST at `resourceVersion=0` (from the apiserver's watch cache), then a watch from the list's
  resourceVersion. After a 410 Gone the re-list asks for the version held (`resourceVersionMatch=NotOlderThan`),
  then for any version if that fails too.
- "watch": a watch from `resourceVersion=0`, for one object that exists: the apiserver sends it first, as an ADDED
  event (the cache is current from that first event), then the changes. Needs no `list` verb.

Every watch asks for bookmarks and a `timeoutSeconds` jittered over uniform(1, 2) x `watch_timeout_s`, so the
server ends it and the thread renews it (resuming from the last resourceVersion seen: bookmarks keep it fresh).
Events are bounded (`max_event_bytes`: a longer line is an error, not a buffer that grows); a store may be bounded
too (`max_items`: when an object it could not hold may count again, it starts over). A watch the server ends
sooner than MIN_HEALTHY_WATCH_S is a failure, so a server that ends every watch at once is backed off from.
Failures back off exponentially with jitter, at least what Retry-After asks (kube/backoff.py), and a 401/403
(RBAC without `watch`) retries at most every FORBIDDEN_BACKOFF_CAP_S. Meanwhile `live` is False: the caller
decides what a stale cache is worth (a GET, a LIST, the last copy)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Self

from agent.kube.backoff import BACKOFF_BASE_S, BACKOFF_CAP_S, backoff_delay, error_kind, retry_wait
from agent.kube.client import MAX_WATCH_LINE, ApiError, KubeApi, LineTooLong, WatchStream
from agent.logs import get_logger

# each watch lasts uniform(1, 2) x this: 10-20 min, twice client-go's reflector (5-10 min), so one agent
# renews its watch 4 times an hour; the apiserver's own choice without timeoutSeconds is 30-60 min
WATCH_TIMEOUT_S = 600.0
FORBIDDEN_BACKOFF_CAP_S = 1800.0  # RBAC without watch: retry rarely (RBAC may be fixed live), GET meanwhile
MIN_HEALTHY_WATCH_S = 1.0  # a watch the server ends sooner than this counts as a failure (no hot loop)
INITIAL_EVENTS_END = "k8s.io/initial-events-end"
START_OVER_CODES = (400, 410, 500)  # a watch refused with these starts over instead of resuming

Mode = Literal["stream", "list", "watch"]


@dataclass
class WatchStats:
    """What every cache counts."""

    watches: int = 0  # watches opened
    watch_bytes: int = 0
    events: int = 0  # ADDED/MODIFIED/DELETED
    bookmarks: int = 0
    gone: int = 0  # 410 Gone answers
    errors: int = 0
    lists: int = 0  # LISTs
    relists: int = 0  # starts over (410 Gone, a bounded store that may have missed an object)


class Gone(Exception):
    """The resourceVersion we hold is no longer served (HTTP 410 or a watch ERROR event with code 410)."""


class Resync(Exception):
    """The store may have missed an object (it was full when one was added): start over."""


def rv_of(obj: Mapping[str, Any] | None) -> str:
    return str(((obj or {}).get("metadata") or {}).get("resourceVersion") or "")


def key_of(obj: Mapping[str, Any]) -> str:
    """`namespace/name` ("/name" for a cluster-scoped object)."""
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"


def newer(a: str, b: str) -> bool:
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


class ListWatch:
    """A cache of the objects at `path` that match the selectors, kept by one watch thread: `start()`, `stop()`,
    `wait_synced()`, `live`, `known`, `snapshot()`. The store maps `key_of(obj)` to `transform(obj)` (None: not kept).

    Subclasses adapt it through five hooks, all called on the watch thread: `_notify(old, new)` for each stored
    value that changed (outside the lock), `_replaced()` after a whole new state was stored (a LIST, the end of a
    streaming list), `_opened(how)` as a watch is taken (lock held), `_absent(e)` for an error that is an answer,
    `_older(held, obj)` for an event older than what is held (a lagging apiserver's cache: ignored)."""

    what = "watch"  # how the log names it
    stale = "keeping the last state"  # what the caller does while it is not live (for the log)
    resume_after_error = True  # False: every error starts over (the store is never trusted across a failure)
    watch_list = True  # streaming lists are tried until an apiserver refuses one

    def __init__(
        self,
        api: KubeApi,
        path: str,
        *,
        mode: Mode = "stream",
        fallback: Mode = "list",
        field_selector: str = "",
        label_selector: str = "",
        transform: Callable[[dict[str, Any]], Any] | None = None,
        max_items: int | None = None,
        watch_timeout_s: float = WATCH_TIMEOUT_S,
        rng: random.Random | None = None,
        max_event_bytes: int = MAX_WATCH_LINE,
        backoff_cap_s: float = BACKOFF_CAP_S,
        mono: Callable[[], float] = time.monotonic,
        list_timeout_s: float | None = None,
        stats: WatchStats | None = None,
        log: Any = None,
        name: str = "",
    ) -> None:
        self.api, self.path = api, path
        self.mode: Mode = mode
        self.fallback: Mode = fallback
        self.field_selector, self.label_selector = field_selector, label_selector
        self.transform = transform or (lambda obj: obj)
        self.max_items = max_items
        self.watch_timeout_s = watch_timeout_s
        self.rng = rng or random.Random()
        self.max_event_bytes = max_event_bytes
        self.backoff_cap_s = backoff_cap_s
        self.mono = mono
        self.list_timeout_s = list_timeout_s
        self.stats = stats or WatchStats()
        self.log = log or get_logger(component="watch", path=path)
        self._lock = threading.Lock()
        self._stream: WatchStream | None = None
        self._stop = threading.Event()
        self._synced = threading.Event()
        self._live = False  # the watch is kept: the store is current
        self._rv = ""  # where the next watch resumes ("": start over)
        self._relist_from = ""  # a re-list after 410 Gone: not older than this
        self._items: dict[str, Any] = {}
        self._pending: dict[str, Any] | None = None  # the initial state of a streaming list, until its end
        self._overflow = False  # an object was not stored (the store was full)
        self._failures = 0
        self._streak = 0  # starts over in a row
        self._problem: str | None = None  # logged once per kind of failure
        self.last_error: str | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name=name or f"watch{path}")

    # -- the caller's side ---------------------------------------------------------------------------------------

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

    @property
    def known(self) -> bool:
        """The current state has arrived once (it may have gone stale since: see `live`)."""
        return self._synced.is_set()

    @property
    def live(self) -> bool:
        return self._live

    def snapshot(self) -> dict[str, Any]:
        """The store (a copy of the mapping; the values are shared: read-only)."""
        with self._lock:
            return dict(self._items)

    # -- hooks ---------------------------------------------------------------------------------------------------

    def _notify(self, old: Any, new: Any) -> None:
        """A stored value changed (old or new None: added or removed). On the watch thread, lock not held."""

    def _replaced(self) -> None:
        """A whole new state was stored (a LIST, the end of a streaming list). Lock not held."""

    def _opened(self, how: str) -> None:
        """A watch was taken (lock held): how is "stream", "resume" or "from0"."""
        if how == "resume":
            self._live = True  # resuming from the version we hold: every change since then is on its way

    def _absent(self, e: ApiError) -> float | None:
        """For an error that is an answer (e.g. 404: the API is not served), the wait before trying again."""
        return None

    def _older(self, held: Any, obj: dict[str, Any]) -> bool:
        """Whether `obj` is an older state than the one held (then it is ignored)."""
        return False

    # -- the watch thread ----------------------------------------------------------------------------------------

    def _selectors(self) -> list[tuple[str, str]]:
        q = [("fieldSelector", self.field_selector)] if self.field_selector else []
        return q + ([("labelSelector", self.label_selector)] if self.label_selector else [])

    def _fit(self, items: dict[str, Any], key: str, value: Any) -> None:
        """Stores value under key in `items` (None removes it), within max_items (lock held)."""
        if value is None:
            items.pop(key, None)
            if self._overflow and self.max_items is not None and len(items) < self.max_items:
                raise Resync("an object was removed while the store was full")
        elif key in items or self.max_items is None or len(items) < self.max_items:
            items[key] = value
        else:
            self._overflow = True

    def _replace(self, new: dict[str, Any]) -> None:
        with self._lock:
            old, self._items = self._items, new
            self._live = True
        for key in sorted(old.keys() | new.keys()):
            if old.get(key) is not new.get(key):
                self._notify(old.get(key), new.get(key))
        self._replaced()
        self._synced.set()  # after the callbacks: whoever waits for it sees what they did

    def _list(self) -> None:
        """LIST from the apiserver's cache (not older than the version held after a 410 Gone, else any), then the
        watch resumes from the list's resourceVersion."""
        query = dict(self._selectors())
        since, self._relist_from = self._relist_from, ""  # if this fails too, the next list takes any version
        query["resourceVersion"] = since or "0"
        if since:
            query["resourceVersionMatch"] = "NotOlderThan"
        self.stats.lists += 1
        try:
            lst = self.api.request("GET", self.path, query=query, verb="LIST", timeout_s=self.list_timeout_s)
        except ApiError as e:
            if e.status == 410:
                raise Gone(str(e)) from e
            raise
        objs = lst.get("items")
        if not isinstance(objs, list):
            raise ApiError(0, f"a list of {self.path} without items")
        new: dict[str, Any] = {}
        self._overflow = False
        with self._lock:
            for obj in objs:
                if isinstance(obj, dict) and (meta := obj.get("metadata")) and meta.get("name"):
                    self._fit(new, key_of(obj), self.transform(obj))
        self._rv = rv_of(lst)
        self._replace(new)  # restored once the watch that follows delivers (a 410 right after backs off)

    def _watch(self) -> None:
        timeout = max(1, int(self.watch_timeout_s * (1.0 + self.rng.random())))
        fresh = self._rv == ""
        start = self.mode if self.mode != "stream" or self.watch_list else self.fallback
        if fresh and start == "list":
            self._list()
            fresh = False
        streaming = fresh and start == "stream"
        query = [
            *self._selectors(),
            ("watch", "1"),
            ("allowWatchBookmarks", "true"),
            ("resourceVersion", "0" if fresh else self._rv),
            ("timeoutSeconds", str(timeout)),
        ]
        if streaming:
            query += [("sendInitialEvents", "true"), ("resourceVersionMatch", "NotOlderThan")]
        try:
            stream = self.api.stream(self.path, query, read_timeout_s=timeout + 30.0)
        except ApiError as e:
            if streaming and e.status in (400, 422):  # no streaming lists here: the fallback, at once
                self.watch_list = False
                self.log.info(f"the apiserver refused a streaming list; {self.fallback} instead", error=str(e)[:300])
                return
            if e.status == 410:
                raise Gone(str(e)) from e
            raise
        how = "stream" if streaming else "from0" if fresh else "resume"
        first = [how != "stream"]  # a streaming list is current at its end bookmark

        def on_event(ev: dict[str, Any]) -> None:
            self._apply(ev)
            if first[0]:
                first[0] = False
                if how == "from0":  # the object came first, as an ADDED event: the store is current
                    with self._lock:
                        self._live = True
                    self._synced.set()
                self._ok()

        try:
            self._follow(stream, timeout, on_event, how)
        finally:
            with self._lock:
                if self._pending is not None:  # ended before the initial-events-end bookmark: start over
                    self._pending, self._rv = None, ""

    def _follow(self, stream: WatchStream, timeout: int, on_event: Callable[[dict[str, Any]], None], how: str) -> None:
        """Reads `stream` to its end, passing each event to `on_event`: the stream is held for stop(), events are
        bounded by max_event_bytes, and a watch the server ends before MIN_HEALTHY_WATCH_S (or half its timeout)
        is an error, so a server that ends every watch at once is backed off from, not spun on."""
        with self._lock:
            if self._stop.is_set():
                stream.close()
                return
            self._stream = stream
            self._pending = {} if how == "stream" else None
            if how == "stream":
                self._overflow = False  # a new initial state: nothing missed yet
            self._opened(how)
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
            self._rv = ""  # resuming would replay the event: start over, from the current state
            raise ApiError(0, str(e)) from e
        finally:
            with self._lock:
                self._stream = None
            self.stats.watch_bytes = base + stream.bytes_read
            stream.close()
        lasted = self.mono() - opened
        if lasted < min(MIN_HEALTHY_WATCH_S, timeout / 2) and not self._stop.is_set():
            raise ApiError(0, f"the server ended the watch after {lasted:.2f}s")

    def _apply(self, ev: dict[str, Any]) -> None:
        kind, obj = check_event(ev)
        rv = rv_of(obj)
        if kind == "BOOKMARK":
            self.stats.bookmarks += 1
            annotations = (obj.get("metadata") or {}).get("annotations") or {}
            with self._lock:
                self._rv = rv or self._rv
                pending = self._pending
                ended = pending is not None and annotations.get(INITIAL_EVENTS_END) == "true"
                if ended:
                    self._pending = None
            if ended and pending is not None:  # the initial state is complete
                self._replace(pending)
                self._ok()
            return
        if not (obj.get("metadata") or {}).get("name"):
            raise ApiError(0, f"watch event {kind} of an object without a name")
        self.stats.events += 1
        key = key_of(obj)
        value = None if kind == "DELETED" else self.transform(obj)
        with self._lock:
            store = self._pending if self._pending is not None else self._items
            old = store.get(key)
            if old is not None and self._older(old, obj):  # a lagging apiserver's cache: keep ours
                self._rv = rv_of(old) if self._rv in ("", "0") else self._rv
                return
            self._fit(store, key, value)
            self._rv = rv or self._rv
            changed = store is self._items and old is not store.get(key)
            new = store.get(key)
        if changed:
            self._notify(old, new)

    def _start_over(self) -> None:
        """After 410 Gone or a Resync: the next watch starts from scratch (a re-list in list mode asks for the
        version held first); the store is served until the new state replaces it."""
        if self._streak == 0 and self._rv not in ("", "0"):
            self._relist_from = self._rv
        self._rv, self._overflow = "", False

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._watch()
                if self._stop.is_set():
                    break
                self._ok()  # the server ended a healthy watch: resume from where it left off
            except (Gone, Resync) as e:
                self.stats.gone += isinstance(e, Gone)
                self.stats.relists += 1
                self._start_over()
                self._note("gone", str(e))
                self._streak += 1
                if self._streak > 1:  # again right after a start-over: do not spin
                    self._stop.wait(backoff_delay(self._streak - 1, self.rng, BACKOFF_BASE_S, self.backoff_cap_s))
            except ApiError as e:
                self.stats.errors += 1
                if self._stop.is_set():
                    break
                with self._lock:
                    self._live = False
                    if not self.resume_after_error or e.status in START_OVER_CODES:
                        self._rv = ""
                self._note(error_kind(e), str(e))
                wait = self._absent(e)
                if wait is None:
                    self._failures += 1
                    cap = FORBIDDEN_BACKOFF_CAP_S if e.status in (401, 403) else self.backoff_cap_s
                    wait = retry_wait(self._failures, self.rng, BACKOFF_BASE_S, cap, e.retry_after_s)
                self._stop.wait(wait)
            except Exception as e:  # never die silently: a bug here must not freeze what the caller sees
                self.stats.errors += 1
                with self._lock:
                    self._live = False
                    self._rv = ""
                self.log.exception(f"{self.what} failed unexpectedly; starting over", error=str(e))
                self._failures += 1
                self._stop.wait(backoff_delay(self._failures, self.rng, BACKOFF_BASE_S, self.backoff_cap_s))
        with self._lock:
            self._live = False

    def _ok(self) -> None:
        if self._failures or self._problem not in (None, "gone"):
            self.log.info(f"{self.what} restored", after_failures=self._failures)
        self._failures = 0
        self._streak = 0
        self._problem = None
        self.last_error = None

    def _note(self, kind: str, error: str) -> None:
        self.last_error = error
        if kind != self._problem:
            if kind == "gone":
                self.log.info(f"{self.what} expired (410 Gone); starting over", error=error[:300])
            elif kind == "not-found":
                self.log.info(f"{self.what}: the apiserver does not serve {self.path}", error=error[:300])
            else:
                self.log.warning(
                    f"{self.what} failed; {self.stale} until it is back",
                    watch_state=kind,  # not `state`: that key is the runner's per-request API state
                    error=error[:300],
                )
            self._problem = kind
