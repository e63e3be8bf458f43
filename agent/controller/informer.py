"""A list-then-watch cache of one collection (GPU Nodes by label, the controller's Jobs), as client-go's reflector
keeps one: a LIST at resourceVersion=0 (from the apiserver's watch cache, not etcd), then one watch from the
list's resourceVersion with bookmarks, renewed every 10-20 min; a 410 Gone lists again. Each object is kept only
as `transform` makes it (a NodeView is a few fields: 1,000 Nodes cost kilobytes). `on_change` wakes the
controller's loop; it runs on the watch thread and must not block."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from agent.kube.backoff import BACKOFF_BASE_S, BACKOFF_CAP_S, retry_wait
from agent.kube.client import ApiError, KubeApi, LineTooLong
from agent.kube.watch import WATCH_TIMEOUT_S, Gone, check_event, rv_of
from agent.logs import get_logger

T = TypeVar("T")
MAX_EVENT_BYTES = 4 * 1024 * 1024  # one Node or Job as JSON; etcd caps objects at 1.5 MiB


class Informer(Generic[T]):
    def __init__(
        self,
        api: KubeApi,
        path: str,
        transform: Callable[[dict[str, Any]], T | None],
        label_selector: str = "",
        on_change: Callable[[], None] | None = None,
        watch_timeout_s: float = WATCH_TIMEOUT_S,
        rng: random.Random | None = None,
    ) -> None:
        self.api, self.path, self.transform = api, path, transform
        self.label_selector = label_selector
        self.on_change = on_change or (lambda: None)
        self.watch_timeout_s = watch_timeout_s
        self.rng = rng or random.Random()
        self.log = get_logger(component="informer", path=path)
        self._items: dict[str, T] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.synced = threading.Event()
        self._rv = ""
        self._stream: Any = None
        self.lists = self.watches = self.events = self.errors = 0
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"informer{path}")

    def start(self) -> Informer[T]:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        s = self._stream
        if s is not None:
            s.shutdown()
        self.thread.join(2.0)

    def items(self) -> dict[str, T]:
        with self._lock:
            return dict(self._items)

    def _key(self, obj: dict[str, Any]) -> str:
        meta = obj.get("metadata") or {}
        return f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"

    def _list(self) -> None:
        q = {"resourceVersion": "0"}
        if self.label_selector:
            q["labelSelector"] = self.label_selector
        self.lists += 1
        lst = self.api.request("GET", self.path, query=q, verb="LIST", timeout_s=60.0)
        items: dict[str, T] = {}
        for obj in lst.get("items") or []:
            if isinstance(obj, dict):
                v = self.transform(obj)
                if v is not None:
                    items[self._key(obj)] = v
        with self._lock:
            self._items = items
        self._rv = rv_of(lst)
        self.synced.set()
        self.on_change()

    def _watch(self) -> None:
        timeout = max(1, int(self.watch_timeout_s * (1.0 + self.rng.random())))
        query = [("watch", "1"), ("allowWatchBookmarks", "true"), ("resourceVersion", self._rv)]
        if self.label_selector:
            query.append(("labelSelector", self.label_selector))
        query.append(("timeoutSeconds", str(timeout)))
        stream = self.api.stream(self.path, query, read_timeout_s=timeout + 30.0)
        self._stream = stream
        self.watches += 1
        try:
            if self._stop.is_set():
                return
            for ev in stream.events(MAX_EVENT_BYTES):
                if self._stop.is_set():
                    return
                kind, obj = check_event(ev)
                self._rv = rv_of(obj) or self._rv
                if kind == "BOOKMARK":
                    continue
                self.events += 1
                key = self._key(obj)
                v = None if kind == "DELETED" else self.transform(obj)
                with self._lock:
                    old = self._items.get(key)
                    if v is None:
                        self._items.pop(key, None)
                    else:
                        self._items[key] = v
                if old != v:
                    self.on_change()
        except LineTooLong as e:
            raise ApiError(0, str(e)) from e
        finally:
            self._stream = None
            stream.close()

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                if not self._rv:
                    self._list()
                self._watch()
                failures = 0
            except Gone:
                self._rv = ""
            except ApiError as e:
                self.errors += 1
                if self._stop.is_set():
                    break
                failures += 1
                self.log.warning("list/watch failed", error=str(e)[:300], failures=failures)
                if e.status in (400, 410, 500):
                    self._rv = ""
                self._stop.wait(retry_wait(failures, self.rng, BACKOFF_BASE_S, BACKOFF_CAP_S, e.retry_after_s))
            except Exception as e:  # never die silently
                self.errors += 1
                failures += 1
                self._rv = ""
                self.log.exception("informer failed unexpectedly; listing again", error=str(e))
                self._stop.wait(retry_wait(failures, self.rng, BACKOFF_BASE_S, BACKOFF_CAP_S, None))
