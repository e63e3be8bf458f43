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

The watch itself is kube/watch.py's; backoff and jitter are kube/backoff.py's."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.kube.backoff import BACKOFF_BASE_S, BACKOFF_CAP_S, backoff_delay, error_kind, retry_wait
from agent.kube.client import MAX_WATCH_LINE, ApiError, KubeApi
from agent.kube.watch import (
    FORBIDDEN_BACKOFF_CAP_S,
    WATCH_TIMEOUT_S,
    Gone,
    NodeDict,
    OnChange,
    WatchStats,
    WatchThread,
    _newer,
    check_event,
    labels_and_annotations,
    rv_of,
)
from agent.logs import get_logger


@dataclass
class NodeCacheStats(WatchStats):
    lists: int = 0
    relists: int = 0  # starts over after a 410 Gone: a re-list, or a watch from resourceVersion=0
    fallback_gets: int = 0  # GET resourceVersion=0 from get() while the watch was not kept
    cache_reads: int = 0  # get() answered from the cache
    changes: int = 0  # label/annotation changes passed to on_change


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
                self._stop.wait(retry_wait(self._failures, self.rng, BACKOFF_BASE_S, cap, e.retry_after_s))
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
