"""The agent's own Node, read from a watch instead of a GET per poll: kube/cache.py's ListWatch of
`/api/v1/nodes?fieldSelector=metadata.name=<node>`.

The first watch starts at `resourceVersion=0` (mode "watch"): the apiserver answers from its watch cache with the
current Node as a synthetic ADDED event, then the changes, so one request needs only the `watch` verb (no `list`:
the agent's RBAC keeps `list nodes` forbidden) and costs etcd nothing. With `initial_list=True` it lists first
instead (mode "list", `resourceVersion=0`, from the cache), as client-go's reflector does. A watch resumes from the
last resourceVersion it saw (bookmarks keep it fresh); a 410 Gone (that version fell out of the apiserver's window)
starts over: a re-list with the last resourceVersion (`resourceVersionMatch=NotOlderThan`, from the cache) or a
watch from `resourceVersion=0`; an answer older than the Node held is ignored. Errors back off exponentially with
jitter. `get()` returns the cached Node while the watch is kept; when it cannot be kept (apiserver away, RBAC
without watch), `get()` falls back to one GET with `resourceVersion=0` per call, never to a quorum read.

Label and annotation changes (the `gpu-ready.io/clear-before` annotation among them) reach `on_change` as they
happen, on the watch thread. Status-only changes (our own condition patches, kubelet's heartbeats) update the
cache without a callback."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.kube.backoff import BACKOFF_CAP_S
from agent.kube.cache import WATCH_TIMEOUT_S, ListWatch, WatchStats, newer, rv_of
from agent.kube.client import MAX_WATCH_LINE, ApiError, KubeApi
from agent.logs import get_logger

NodeDict = dict[str, Any]
OnChange = Callable[[NodeDict | None, NodeDict | None], None]


@dataclass
class NodeCacheStats(WatchStats):
    fallback_gets: int = 0  # GET resourceVersion=0 from get() while the watch was not kept
    cache_reads: int = 0  # get() answered from the cache
    changes: int = 0  # label/annotation changes passed to on_change


def labels_and_annotations(node: NodeDict | None) -> tuple[Any, Any] | None:
    if node is None:
        return None
    meta = node.get("metadata") or {}
    return meta.get("labels") or {}, meta.get("annotations") or {}


def _as_node(obj: NodeDict) -> NodeDict:
    obj.setdefault("kind", "Node")  # a list's items carry neither
    obj.setdefault("apiVersion", "v1")
    return obj


class NodeCache(ListWatch):
    stats: NodeCacheStats
    what = "node watch"
    stale = "reading the Node with GET resourceVersion=0"

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
        super().__init__(
            api, "/api/v1/nodes", mode="list" if initial_list else "watch", field_selector=f"metadata.name={node}",
            transform=_as_node, watch_timeout_s=watch_timeout_s, rng=rng, max_event_bytes=max_event_bytes,
            backoff_cap_s=backoff_cap_s, mono=mono, stats=NodeCacheStats(),
            log=get_logger(node=node, component="node-cache"), name=f"node-cache-{node}",
        )  # fmt: skip
        self.node = node
        self.on_change = on_change
        self.initial_list = initial_list
        self._key = f"/{node}"
        self._last: NodeDict | None = None  # the last Node seen, kept after a deletion

    def cached(self) -> NodeDict | None:
        """The last Node seen (from the watch or a fallback GET), without any request. Read-only."""
        with self._lock:
            return self._items.get(self._key) or self._last

    def get(self) -> NodeDict:
        """The Node, as get_node() would return it: from the cache while the watch is kept, else one GET
        with resourceVersion=0. Raises ApiError (404 when the Node does not exist). The dict is shared:
        do not change it."""
        with self._lock:
            if self._live:
                self.stats.cache_reads += 1
                held = self._items.get(self._key)
                if held is None:
                    raise ApiError(404, f'nodes "{self.node}" not found (watch)')
                return held
        self.stats.fallback_gets += 1
        node = self.api.get_node(self.node, resource_version="0")
        with self._lock:
            held = self._items.get(self._key)
            if self._live or (held is not None and not newer(rv_of(node), rv_of(held))):
                return held if held is not None else node
            self._items[self._key] = node
        self._notify(held, node)
        return node

    def _older(self, held: Any, obj: dict[str, Any]) -> bool:
        rv = rv_of(obj)
        return bool(rv) and not newer(rv, rv_of(held))

    def _notify(self, old: Any, new: Any) -> None:
        if new is not None:
            self._last = new
        if self.on_change is None or labels_and_annotations(old) == labels_and_annotations(new):
            return  # a status-only change (a condition write, kubelet's heartbeat)
        self.stats.changes += 1
        try:
            self.on_change(old, new)
        except Exception as e:  # a broken callback must not stop the watch
            self.log.exception("node change callback failed", error=str(e))
