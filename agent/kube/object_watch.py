"""One named namespaced object (a ConfigMap), read from a watch: one request held open, no GET per poll.

kube/cache.py's ListWatch of `/api/v1/namespaces/<ns>/<resource>?fieldSelector=metadata.name=<name>` as a streaming
list (`sendInitialEvents=true`, `resourceVersionMatch=NotOlderThan`, `resourceVersion=0`: the apiserver sends the
object from its watch cache, if it exists, then a bookmark marking the end of the initial state, then the changes;
no `list` and no `get` verb needed, RBAC may name the object in resourceNames), bookmarks on, `timeoutSeconds`
jittered as the Node watch's. `known` turns true at that bookmark: only then does "no object" mean absent. An
apiserver that refuses streaming lists (400/422) gets a plain watch from 0, known once it is open. A watch the
server ends resumes from the last resourceVersion seen; 410 Gone starts over with a streaming list; errors back
off with jitter (401/403 rarely).
`get()` never makes a request: it returns the last object seen (None: absent or never seen) and whether the
watch is kept (`live`)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from agent.kube.backoff import BACKOFF_CAP_S
from agent.kube.cache import WATCH_TIMEOUT_S, ListWatch
from agent.kube.client import KubeApi
from agent.logs import get_logger

MAX_OBJECT_EVENT = 256 * 1024  # the objects watched this way are small (a ConfigMap of a few fields)


class ObjectWatch(ListWatch):
    """Keeps the newest copy of one object; `on_change(obj_or_None)` runs on the watch thread when its data
    changes (a create, an update, a delete)."""

    what = "object watch"
    stale = "keeping the last copy"

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
        super().__init__(
            api, f"/api/v1/namespaces/{quote(namespace)}/{resource}", mode="stream", fallback="watch",
            field_selector=f"metadata.name={name}", watch_timeout_s=watch_timeout_s, rng=rng,
            max_event_bytes=MAX_OBJECT_EVENT, backoff_cap_s=backoff_cap_s, mono=mono,
            log=get_logger(component="object-watch", object=f"{namespace}/{name}"), name=f"watch-{resource}-{name}",
        )  # fmt: skip
        self.namespace, self.name, self.resource = namespace, name, resource
        self.on_change = on_change
        self._key = f"{namespace}/{name}"

    def get(self) -> dict[str, Any] | None:
        with self._lock:
            return self._items.get(self._key)

    def _opened(self, how: str) -> None:
        self._live = True  # from 0: the object (if any) comes first; resuming: every change is on its way
        if how != "stream":
            self._synced.set()  # a plain watch: known once open

    def _notify(self, old: Any, new: Any) -> None:
        changed = (old or {}).get("data") != (new or {}).get("data") or (old is None) != (new is None)
        if changed and self.on_change is not None:
            try:
                self.on_change(new)
            except Exception as e:  # a broken callback must not stop the watch
                self.log.exception("object change callback failed", error=str(e))
