"""The node's DRA ResourceSlices (of one driver), read from a watch instead of a LIST per poll.

kube/cache.py's ListWatch keeps one watch of `/apis/resource.k8s.io/v1/resourceslices` with the field selectors
`spec.nodeName=<node>,spec.driver=<driver>` (both served for watch by the 1.37 apiserver), bookmarks on, and
`timeoutSeconds` jittered over 10-20 min (cache.WATCH_TIMEOUT_S). A node may have any number of slices,
none included, so the first event cannot say "the initial state is complete" as it does for the Node. The
watch therefore starts as a streaming list: `sendInitialEvents=true`, `resourceVersionMatch=NotOlderThan`,
`resourceVersion=0` (the WatchList protocol, on by default since 1.32): the apiserver sends the current slices
from its watch cache as ADDED events, then a BOOKMARK annotated `k8s.io/initial-events-end`, then the changes.
One request, the `watch` verb only, nothing read from etcd. Should an apiserver refuse that (400/422), the
cache lists (`resourceVersion=0`, from the cache) and watches from the list's resourceVersion instead.

A watch the server ends resumes from the last resourceVersion seen (bookmarks keep it fresh); a 410 Gone
starts over with a new streaming list, the old slices served until its end bookmark replaces them; any other error
starts over too (the slices are not served meanwhile). Errors back
off exponentially with jitter (kube/backoff.py); a 401/403 (RBAC without `watch`) retries at most
every 30 min. A 404 (no resource.k8s.io/v1: no DRA on this cluster) stops watching: `items()` answers "no
slices" and the watch is tried again after ABSENT_RETRY_S.

`items()` returns the slices as a SliceRead (probes/dra.py), the shape `read_node_slices` returns, while the
watch is kept; None while it is not (before the first sync, after an error): the caller then lists
(CheckSuite._gpu_serving, with its relist interval for an empty node). The store is bounded: at most
MAX_STORED slices (probes/dra.py parses MAX_SLICES of them) and events of at most max_event_bytes."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from agent.kube.backoff import BACKOFF_CAP_S
from agent.kube.cache import WATCH_TIMEOUT_S, ListWatch, WatchStats
from agent.kube.client import MAX_WATCH_LINE, ApiError, KubeApi
from agent.kube.slices import DEFAULT_DRIVER, MAX_SLICES, SLICES_PATH, SliceRead
from agent.logs import get_logger

ABSENT_RETRY_S = 3600.0  # no resource.k8s.io/v1 on the apiserver: look again this rarely (a cluster upgrade)
MAX_STORED = MAX_SLICES + 1  # enough to tell parse_slices "more than MAX_SLICES" (it reports them truncated)
MAX_SLICE_EVENT = 2 * 1024 * 1024  # one ResourceSlice as JSON: etcd caps objects at 1.5 MiB


@dataclass
class SliceCacheStats(WatchStats):
    reads: int = 0  # items() answered from the cache
    misses: int = 0  # items() while the watch was not kept (the caller lists)

    @property
    def resyncs(self) -> int:
        """Starts over (410 Gone, a store over MAX_STORED shrinking)."""
        return self.relists


class SliceCache(ListWatch):
    stats: SliceCacheStats
    what = "ResourceSlice watch"
    stale = "listing the slices"
    resume_after_error = False

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
        super().__init__(
            api, SLICES_PATH, mode="stream", fallback="list",
            field_selector=f"spec.nodeName={node},spec.driver={driver}", max_items=MAX_STORED,
            watch_timeout_s=watch_timeout_s, rng=rng, max_event_bytes=max_event_bytes,
            backoff_cap_s=backoff_cap_s, mono=mono, stats=SliceCacheStats(),
            log=get_logger(node=node, component="slice-cache"), name=f"slice-cache-{node}",
        )  # fmt: skip
        self.node, self.driver = node, driver
        self.absent_retry_s = absent_retry_s
        self._no_api = False  # the apiserver serves no resource.k8s.io/v1

    @property
    def live(self) -> bool:
        return self._live or self._no_api

    def items(self) -> SliceRead | None:
        """The node's slices as read_node_slices returns them (sorted by name), from the cache, without a
        request; None while the watch is not kept (the caller lists instead). The dicts are shared: read-only."""
        with self._lock:
            if self._no_api:
                self.stats.reads += 1
                return SliceRead(items=[])
            if not self._live:
                self.stats.misses += 1
                return None
            self.stats.reads += 1
            return SliceRead(items=[self._items[k] for k in sorted(self._items)])

    def _absent(self, e: ApiError) -> float | None:
        self._no_api = e.status == 404
        if not self._no_api:
            return None
        self._synced.set()  # "no DRA here" is an answer
        return self.absent_retry_s

    def _ok(self) -> None:
        super()._ok()
        self._no_api = False
