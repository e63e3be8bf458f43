"""One named namespaced object (a ConfigMap), read from a watch: one request held open, no GET per poll.

The thread watches `/api/v1/namespaces/<ns>/<resource>?fieldSelector=metadata.name=<name>` as a streaming list
(`sendInitialEvents=true`, `resourceVersionMatch=NotOlderThan`, `resourceVersion=0`: the apiserver sends the object
from its watch cache, if it exists, then a bookmark marking the end of the initial state, then the changes; no
`list` and no `get` verb needed, RBAC may name the object in resourceNames), bookmarks on, `timeoutSeconds`
jittered as the Node watch's. `known` turns true at that bookmark: only then does "no object" mean absent. An
apiserver that refuses streaming lists (400/422) gets a plain watch from 0, known once it is open. A watch the
server ends resumes from the last resourceVersion seen; 410 Gone starts over with a streaming list; errors back
off with jitter (401/403 rarely).
`get()` never makes a request: it returns the last object seen (None: absent or never seen) and whether the
watch is kept (`live`)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from agent.kube.backoff import BACKOFF_BASE_S, BACKOFF_CAP_S, error_kind, retry_wait
from agent.kube.client import ApiError, KubeApi
from agent.kube.watch import FORBIDDEN_BACKOFF_CAP_S, WATCH_TIMEOUT_S, Gone, WatchStats, WatchThread, check_event, rv_of
from agent.logs import get_logger

INITIAL_EVENTS_END = "k8s.io/initial-events-end"
MAX_OBJECT_EVENT = 256 * 1024  # the objects watched this way are small (a ConfigMap of a few fields)


class ObjectWatch(WatchThread):
    """Keeps the newest copy of one object; `on_change(obj_or_None)` runs on the watch thread when its data
    changes (a create, an update, a delete)."""

    def __init__(
        self,
        api: KubeApi,
        namespace: str,
        name: str,
        resource: str = "configmaps",
        on_change: Callable[[dict[str, Any] | None], None] | None = None,
        watch_timeout_s: float = WATCH_TIMEOUT_S,
        rng: random.Random | None = None,
        backoff_cap_s: float = BACKOFF_CAP_S,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(api, name, watch_timeout_s, rng, MAX_OBJECT_EVENT, backoff_cap_s, mono)
        self.namespace, self.name, self.resource = namespace, name, resource
        self.on_change = on_change
        self.stats = WatchStats()
        self.log = get_logger(component="object-watch", object=f"{namespace}/{name}")
        self._obj: dict[str, Any] | None = None
        self.known = False  # the initial state has arrived: `get() is None` means the object does not exist
        self.watch_list = True
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"watch-{resource}-{name}")

    @property
    def live(self) -> bool:
        return self._live

    def get(self) -> dict[str, Any] | None:
        with self._lock:
            return self._obj

    def _set(self, obj: dict[str, Any] | None) -> None:
        with self._lock:
            old = self._obj
            self._obj = obj
        changed = (old or {}).get("data") != (obj or {}).get("data") or (old is None) != (obj is None)
        if changed and self.on_change is not None:
            try:
                self.on_change(obj)
            except Exception as e:  # a broken callback must not stop the watch
                self.log.exception("object change callback failed", error=str(e))

    def _watch(self) -> None:
        timeout = max(1, int(self.watch_timeout_s * (1.0 + self.rng.random())))
        fresh = self._rv in ("", "0")
        query = [
            ("fieldSelector", f"metadata.name={self.name}"),
            ("watch", "1"),
            ("allowWatchBookmarks", "true"),
            ("resourceVersion", self._rv or "0"),
            ("timeoutSeconds", str(timeout)),
        ]
        if fresh and self.watch_list:
            query += [("sendInitialEvents", "true"), ("resourceVersionMatch", "NotOlderThan")]
        path = f"/api/v1/namespaces/{quote(self.namespace)}/{self.resource}"
        try:
            stream = self.api.stream(path, query, read_timeout_s=timeout + 30.0)
        except ApiError as e:
            if fresh and self.watch_list and e.status in (400, 422):
                self.watch_list = False  # no streaming lists here: a plain watch, known once open
                return
            raise
        streaming = fresh and self.watch_list
        if not streaming:
            self.known = True
        got = [False]  # the object came in the initial state

        def opened() -> None:
            self._live = True  # from 0: the object (if any) comes first; resuming: every change is on its way

        def on_event(ev: dict[str, Any]) -> None:
            kind, obj = check_event(ev)
            self._rv = rv_of(obj) or self._rv
            if kind == "BOOKMARK":
                self.stats.bookmarks += 1
                annotations = (obj.get("metadata") or {}).get("annotations") or {}
                if streaming and annotations.get(INITIAL_EVENTS_END) == "true":
                    if not got[0]:
                        self._set(None)  # absent now (a start over after 410 Gone may have held a deleted copy)
                    self.known = True
                return
            self.stats.events += 1
            got[0] = True
            self._set(None if kind == "DELETED" else obj)

        self._synced.set()
        self._follow(stream, timeout, on_event, opened)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._watch()
                self._failures = 0
            except Gone:
                self.stats.gone += 1
                self._rv = "0"
            except ApiError as e:
                self.stats.errors += 1
                if self._stop.is_set():
                    break
                self._live = False
                self.last_error = str(e)
                if error_kind(e) != self._problem:
                    self._problem = error_kind(e)
                    self.log.warning("watch failed; keeping the last copy", error=str(e)[:300])
                self._failures += 1
                cap = FORBIDDEN_BACKOFF_CAP_S if e.status in (401, 403) else self.backoff_cap_s
                self._stop.wait(retry_wait(self._failures, self.rng, BACKOFF_BASE_S, cap, e.retry_after_s))
            except Exception as e:  # never die silently
                self.stats.errors += 1
                self._live = False
                self._rv = "0"
                self.log.exception("watch failed unexpectedly; starting over", error=str(e))
                self._failures += 1
                self._stop.wait(retry_wait(self._failures, self.rng, BACKOFF_BASE_S, self.backoff_cap_s, None))
        self._live = False
