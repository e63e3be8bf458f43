"""A list-then-watch cache of one collection (GPU Nodes by label, the controller's Jobs): kube/cache.py's ListWatch
in mode "list", as client-go's reflector keeps one: a LIST at resourceVersion=0 (from the apiserver's watch cache,
not etcd), then one watch from the list's resourceVersion with bookmarks, renewed every 10-20 min; a 410 Gone lists
again. Each object is kept only as `transform` makes it (a NodeView is a few fields: 1,000 Nodes cost kilobytes).
`on_change` wakes the controller's loop; it runs on the watch thread and must not block."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from agent.kube.cache import WATCH_TIMEOUT_S, ListWatch
from agent.kube.client import KubeApi
from agent.logs import get_logger

T = TypeVar("T")
MAX_EVENT_BYTES = 4 * 1024 * 1024  # one Node or Job as JSON; etcd caps objects at 1.5 MiB
LIST_TIMEOUT_S = 60.0  # a LIST of every GPU Node of a large fleet


class Informer(ListWatch, Generic[T]):
    what = "informer"

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
        super().__init__(
            api, path, mode="list", label_selector=label_selector, transform=transform, watch_timeout_s=watch_timeout_s,
            rng=rng, max_event_bytes=MAX_EVENT_BYTES, list_timeout_s=LIST_TIMEOUT_S,
            log=get_logger(component="informer", path=path), name=f"informer{path}",
        )  # fmt: skip
        self.on_change = on_change or (lambda: None)

    def items(self) -> dict[str, T]:
        """`namespace/name` -> what `transform` kept of the object (read-only)."""
        return self.snapshot()

    def _notify(self, old: Any, new: Any) -> None:
        if old != new:
            self.on_change()

    def _replaced(self) -> None:
        self.on_change()  # synced (again): the controller plans from the new state
