"""The node's DRA ResourceSlices (of one driver), read from a watch instead of a LIST per poll.

A background thread keeps one watch of `/apis/resource.k8s.io/v1/resourceslices` with the field selectors
`spec.nodeName=<node>,spec.driver=<driver>` (both served for watch by the 1.37 apiserver), bookmarks on, and
`timeoutSeconds` jittered over 10-20 min (node_cache.WATCH_TIMEOUT_S). A node may have any number of slices,
none included, so the first event cannot say "the initial state is complete" as it does for the Node. The
watch therefore starts as a streaming list: `sendInitialEvents=true`, `resourceVersionMatch=NotOlderThan`,
`resourceVersion=0` (the WatchList protocol, on by default since 1.32): the apiserver sends the current slices
from its watch cache as ADDED events, then a BOOKMARK annotated `k8s.io/initial-events-end`, then the changes.
One request, the `watch` verb only, nothing read from etcd. Should an apiserver refuse that (400/422), the
cache lists (`resourceVersion=0`, from the cache) and watches from the list's resourceVersion instead.

A watch the server ends resumes from the last resourceVersion seen (bookmarks keep it fresh); a 410 Gone
starts over with a new streaming list, the old slices served until its end bookmark replaces them. Errors back
off exponentially with jitter (kube/backoff.py); a 401/403 (RBAC without `watch`) retries at most
every 30 min. A 404 (no resource.k8s.io/v1: no DRA on this cluster) stops watching: `items()` answers "no
slices" and the watch is tried again after ABSENT_RETRY_S.

`items()` returns the slices as a SliceRead (probes/dra.py), the shape `read_node_slices` returns, while the
watch is kept; None while it is not (before the first sync, after an error): the caller then lists
(CheckSuite._gpu_serving, with its relist interval for an empty node). The store is bounded: at most
MAX_STORED slices (probes/dra.py parses MAX_SLICES of them) and events of at most max_event_bytes."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.kube.backoff import BACKOFF_BASE_S, BACKOFF_CAP_S, backoff_delay, error_kind, retry_wait
from agent.kube.client import MAX_WATCH_LINE, ApiError, KubeApi
from agent.kube.slices import DEFAULT_DRIVER, MAX_SLICES, SLICES_PATH, SliceRead
from agent.kube.watch import (
    FORBIDDEN_BACKOFF_CAP_S,
    WATCH_TIMEOUT_S,
    Gone,
    WatchStats,
    WatchThread,
    check_event,
    rv_of,
)
from agent.logs import get_logger

INITIAL_EVENTS_END = "k8s.io/initial-events-end"
ABSENT_RETRY_S = 3600.0  # no resource.k8s.io/v1 on the apiserver: look again this rarely (a cluster upgrade)
MAX_STORED = MAX_SLICES + 1  # enough to tell parse_slices "more than MAX_SLICES" (it reports them truncated)
MAX_SLICE_EVENT = 2 * 1024 * 1024  # one ResourceSlice as JSON: etcd caps objects at 1.5 MiB


@dataclass
class SliceCacheStats(WatchStats):
    lists: int = 0  # LISTs (only when the apiserver refused a streaming list)
    resyncs: int = 0  # starts over (410 Gone, a store over MAX_STORED shrinking)
    reads: int = 0  # items() answered from the cache
    misses: int = 0  # items() while the watch was not kept (the caller lists)


class _Resync(Exception):
    """The store may have missed a slice (it was full when one was added): start over."""


def _name(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


class SliceCache(WatchThread):
    stats: SliceCacheStats

    def __init__(
        self,
        api: KubeApi,
        node: str,
        driver: str = DEFAULT_DRIVER,
        watch_timeout_s: float = WATCH_TIMEOUT_S,
        rng: random.Random | None = None,
        max_event_bytes: int = min(MAX_WATCH_LINE, MAX_SLICE_EVENT),
        backoff_cap_s: float = BACKOFF_CAP_S,
        absent_retry_s: float = ABSENT_RETRY_S,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(api, node, watch_timeout_s, rng, max_event_bytes, backoff_cap_s, mono)
        self.driver = driver
        self.absent_retry_s = absent_retry_s
        self.selector = f"spec.nodeName={node},spec.driver={driver}"
        self.stats = SliceCacheStats()
        self.log = get_logger(node=node, component="slice-cache")
        self.watch_list = True  # start with a streaming list (sendInitialEvents); False: LIST, then watch
        self._slices: dict[str, dict[str, Any]] = {}  # name -> ResourceSlice, while live
        self._pending: dict[str, dict[str, Any]] | None = None  # the initial events of a streaming list
        self._overflow = False  # an ADDED was not stored (store full)
        self._absent = False  # the apiserver serves no resource.k8s.io/v1
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"slice-cache-{node}")

    # -- the caller's side ---------------------------------------------------------------------------

    @property
    def live(self) -> bool:
        return self._live or self._absent

    def items(self) -> SliceRead | None:
        """The node's slices as read_node_slices returns them (sorted by name), from the cache, without a
        request; None while the watch is not kept (the caller lists instead). The dicts are shared: read-only."""
        with self._lock:
            if self._absent:
                self.stats.reads += 1
                return SliceRead(items=[])
            if not self._live:
                self.stats.misses += 1
                return None
            self.stats.reads += 1
            return SliceRead(items=[self._slices[k] for k in sorted(self._slices)])

    # -- the watch thread ----------------------------------------------------------------------------

    def _list(self) -> None:
        """LIST from the apiserver's cache, then the watch resumes from the list's resourceVersion."""
        self.stats.lists += 1
        obj = self.api.request(
            "GET", SLICES_PATH, query={"fieldSelector": self.selector, "resourceVersion": "0"}, verb="LIST"
        )
        items = obj.get("items")
        if not isinstance(items, list):
            raise ApiError(0, "a ResourceSlice list without items")
        store: dict[str, dict[str, Any]] = {}
        for s in items:
            if isinstance(s, dict) and _name(s) and len(store) < MAX_STORED:
                store[_name(s)] = s
        with self._lock:
            self._slices, self._overflow = store, len(items) > MAX_STORED
            self._rv = rv_of(obj)
            self._live = True
        self._synced.set()

    def _watch(self) -> None:
        timeout = max(1, int(self.watch_timeout_s * (1.0 + self.rng.random())))
        fresh = self._rv == ""
        if fresh and not self.watch_list:
            self._list()
            fresh = False
        query = [
            ("fieldSelector", self.selector),
            ("watch", "1"),
            ("allowWatchBookmarks", "true"),
            ("resourceVersion", "0" if fresh else self._rv),
            ("timeoutSeconds", str(timeout)),
        ]
        if fresh:  # a streaming list: the current slices, then the initial-events-end bookmark
            query += [("sendInitialEvents", "true"), ("resourceVersionMatch", "NotOlderThan")]
        try:
            stream = self.api.stream(SLICES_PATH, query, read_timeout_s=timeout + 30.0)
        except ApiError as e:
            if fresh and e.status in (400, 422):  # no streaming lists here: LIST, then watch
                self.watch_list = False
                self.log.info("the apiserver refused a streaming list; listing, then watching", error=str(e)[:300])
            raise

        def start_pending() -> None:
            self._pending = {} if fresh else None

        try:
            self._follow(stream, timeout, self._apply, start_pending)
        finally:
            with self._lock:
                if self._pending is not None:  # ended before the initial-events-end bookmark: start over
                    self._pending, self._rv = None, ""

    def _apply(self, ev: dict[str, Any]) -> None:
        kind, obj = check_event(ev)
        rv = rv_of(obj)
        if kind == "BOOKMARK":
            self.stats.bookmarks += 1
            annotations = (obj.get("metadata") or {}).get("annotations") or {}
            with self._lock:
                self._rv = rv or self._rv
                if self._pending is not None and annotations.get(INITIAL_EVENTS_END) == "true":
                    self._slices, self._pending = self._pending, None  # the initial state is complete
                    self._live = True
                    synced = True
                else:
                    synced = False
            if synced:
                self._synced.set()
                self._ok()
            return
        name = _name(obj)
        if not name:
            raise ApiError(0, f"watch event {kind} of a ResourceSlice without a name")
        self.stats.events += 1
        with self._lock:
            store = self._pending if self._pending is not None else self._slices
            if kind == "DELETED":
                store.pop(name, None)
                if self._overflow and len(store) < MAX_STORED:
                    raise _Resync("a ResourceSlice was deleted while the store was full")
            elif name in store or len(store) < MAX_STORED:
                store[name] = obj
            else:
                self._overflow = True
            self._rv = rv or self._rv

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._watch()
                if self._stop.is_set():
                    break
                self._failures = 0  # the server ended a healthy watch: resume from where it left off
            except (Gone, _Resync) as e:
                self.stats.gone += isinstance(e, Gone)
                self.stats.resyncs += 1
                with self._lock:
                    self._rv, self._overflow = "", False  # the old slices are served until the new ones are in
                self._note("gone", str(e))
                self._failures += 1
                if self._failures > 1:  # again right after a start-over: do not spin
                    self._stop.wait(backoff_delay(self._failures - 1, self.rng, BACKOFF_BASE_S, self.backoff_cap_s))
            except ApiError as e:
                self.stats.errors += 1
                if self._stop.is_set():
                    break
                with self._lock:
                    self._live = False
                    self._rv = ""
                    self._absent = e.status == 404
                self._note(error_kind(e), str(e))
                if e.status == 404:
                    self._synced.set()  # "no DRA here" is an answer
                    self._stop.wait(self.absent_retry_s)
                    continue
                self._failures += 1
                cap = FORBIDDEN_BACKOFF_CAP_S if e.status in (401, 403) else self.backoff_cap_s
                self._stop.wait(retry_wait(self._failures, self.rng, BACKOFF_BASE_S, cap, e.retry_after_s))
            except Exception as e:  # never die silently: a bug here must not freeze the slices the agent sees
                self.stats.errors += 1
                with self._lock:
                    self._live = False
                    self._rv = ""
                self.log.exception("ResourceSlice watch failed unexpectedly; starting over", error=str(e))
                self._failures += 1
                self._stop.wait(backoff_delay(self._failures, self.rng, BACKOFF_BASE_S, self.backoff_cap_s))
        with self._lock:
            self._live = False

    def _ok(self) -> None:
        if self._failures or self._problem not in (None, "gone"):
            self.log.info("ResourceSlice watch restored", after_failures=self._failures)
        self._failures = 0
        self._problem = None
        self.last_error = None
        self._absent = False

    def _note(self, kind: str, error: str) -> None:
        self.last_error = error
        if kind != self._problem:
            if kind == "gone":
                self.log.info("ResourceSlice watch expired (410 Gone); starting over", error=error[:300])
            elif kind == "not-found":
                self.log.info("the apiserver serves no resource.k8s.io/v1: no DRA ResourceSlices to watch")
            else:
                self.log.warning(
                    "ResourceSlice watch failed; listing the slices until it is back",
                    watch_state=kind,
                    error=error[:300],
                )
            self._problem = kind
