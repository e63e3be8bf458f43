"""The one list-then-watch cache (agent/kube/cache.py) and two of the caches built on it, the object watch
(agent/kube/object_watch.py: the fleet brake's ConfigMap) and the controller's informer
(agent/controller/informer.py), on the real apiserver, with ConfigMaps as the objects. What is counted: the requests
each sends (verb and code), the watches, lists and starts-over, the callbacks. The Node cache and the slice cache
have their own modules (tests/test_node_cache.py, tests/test_slice_cache.py).

A second control plane has streaming lists off (`--feature-gates=WatchList=false`, as an apiserver before 1.32) and
no watch cache (`--watch-cache=false`: a watch resumes from etcd, so compacting etcd makes the version a cache holds
410 Gone): there the caches fall back to a LIST or a plain watch, and start over after a 410."""

from __future__ import annotations

import base64
import secrets
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agent.controller.informer import Informer
from agent.kube.cache import ListWatch
from agent.kube.client import ApiError, KubeApi
from agent.kube.object_watch import MAX_OBJECT_EVENT, ObjectWatch
from testkit.cluster import ensure_namespace
from testkit.controlplane import ControlPlane, etcd_request
from testkit.harness import wait_for
from testkit.testbin import require_testbin

pytestmark = pytest.mark.apiserver

TIMEOUT = 20.0


class Requests:
    """Every request a client sends (verb, code), and the query of every watch and LIST it sends (the client's own
    stream() and request(), passed through)."""

    def __init__(self, api: KubeApi) -> None:
        self.sent: list[tuple[str, int]] = []
        self.watches: list[dict[str, str]] = []
        self.lists: list[dict[str, str]] = []
        api.on_request = lambda verb, code: self.sent.append((verb, code))
        stream, request = api.stream, api.request

        def watch(path: str, query: list[tuple[str, str]], read_timeout_s: float) -> Any:
            self.watches.append(dict(query))
            return stream(path, query, read_timeout_s)

        def send(*args: Any, **kw: Any) -> Any:
            if kw.get("verb") == "LIST":
                self.lists.append(dict(kw.get("query") or {}))
            return request(*args, **kw)

        api.stream = watch  # type: ignore[method-assign]
        api.request = send  # type: ignore[method-assign]


class Recorded(ListWatch):
    """A ListWatch whose hooks record what they were told."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.changes: list[tuple[Any, Any]] = []
        self.replaced = 0

    def _notify(self, old: Any, new: Any) -> None:
        self.changes.append((old, new))

    def _replaced(self) -> None:
        self.replaced += 1


@pytest.fixture
def started() -> Iterator[Callable[[Any], Any]]:
    made: list[Any] = []

    def _start(cache: Any) -> Any:
        made.append(cache.start())
        return cache

    yield _start
    for c in made:
        assert c.stop(5.0), "the watch thread did not stop"


@pytest.fixture
def ns(admin: KubeApi) -> str:
    name = f"cache-{secrets.token_hex(3)}"
    ensure_namespace(admin, name)
    return name


def cms(ns: str) -> str:
    return f"/api/v1/namespaces/{ns}/configmaps"


def put(admin: KubeApi, ns: str, name: str, data: dict[str, str], labels: dict[str, str] | None = None) -> None:
    body = {"metadata": {"name": name, "labels": labels or {}}, "data": data}
    try:
        admin.request("PUT", f"{cms(ns)}/{name}", body)
    except ApiError as e:
        if e.status != 404:
            raise
        admin.request("POST", cms(ns), body)


def delete(admin: KubeApi, ns: str, name: str) -> None:
    admin.request("DELETE", f"{cms(ns)}/{name}")


def data_of(cache: ListWatch) -> dict[str, Any]:
    return {k.split("/", 1)[1]: (v.get("data") if isinstance(v, dict) else v) for k, v in cache.snapshot().items()}


# -- the generic cache ---------------------------------------------------------------------------------------------


def test_a_streaming_list_holds_what_matches_and_follows_every_change_on_one_request(control_plane, admin, ns, started):
    put(admin, ns, "a", {"v": "1"}, {"keep": "yes"})
    put(admin, ns, "b", {"v": "1"}, {"keep": "yes"})
    put(admin, ns, "c", {"v": "1"}, {"keep": "no"})
    api = control_plane.admin()
    req = Requests(api)
    cache = started(Recorded(api, cms(ns), mode="stream", label_selector="keep=yes"))
    assert cache.wait_synced(TIMEOUT), cache.last_error
    assert data_of(cache) == {"a": {"v": "1"}, "b": {"v": "1"}} and cache.live and cache.known
    assert cache.replaced == 1 and len(cache.changes) == 2  # the initial state: stored once, at its end bookmark

    put(admin, ns, "a", {"v": "2"}, {"keep": "yes"})
    put(admin, ns, "d", {"v": "1"}, {"keep": "yes"})
    put(admin, ns, "c", {"v": "2"}, {"keep": "no"})  # not selected: never seen
    put(admin, ns, "b", {"v": "1"}, {"keep": "no"})  # leaves the selection: removed
    want = {"a": {"v": "2"}, "d": {"v": "1"}}
    wait_for(lambda: data_of(cache) == want, TIMEOUT, 0.01, "the changes in the cache")
    delete(admin, ns, "d")
    wait_for(lambda: len(cache.changes) == 6, TIMEOUT, 0.01, "the deletion told")
    assert data_of(cache) == {"a": {"v": "2"}}
    assert req.sent == [("WATCH", 200)], req.sent  # one streaming list, then its changes: nothing else
    assert req.watches[0]["sendInitialEvents"] == "true" and req.watches[0]["resourceVersion"] == "0"
    assert req.watches[0]["resourceVersionMatch"] == "NotOlderThan" and req.watches[0]["allowWatchBookmarks"] == "true"
    assert cache.stats.watches == 1 and cache.stats.lists == 0 and cache.stats.errors == 0
    assert [new is None for _, new in cache.changes[2:]] == [False, False, True, True]  # a, d; b, d removed
    assert cache.replaced == 1


def test_list_mode_lists_once_from_the_cache_and_keeps_only_what_transform_returns(control_plane, admin, ns, started):
    put(admin, ns, "a", {"v": "1"})
    put(admin, ns, "b", {"other": "x"})  # transform keeps nothing of it
    api = control_plane.admin()
    req = Requests(api)
    cache = started(Recorded(api, cms(ns), mode="list", transform=lambda o: (o.get("data") or {}).get("v")))
    assert cache.wait_synced(TIMEOUT)
    assert data_of(cache) == {"a": "1"}
    put(admin, ns, "b", {"v": "7"})
    wait_for(lambda: data_of(cache) == {"a": "1", "b": "7"}, TIMEOUT, 0.01, "b once it has a v")
    put(admin, ns, "a", {"other": "y"})
    wait_for(lambda: data_of(cache) == {"b": "7"}, TIMEOUT, 0.01, "a gone once it has no v")
    assert req.sent == [("LIST", 200), ("WATCH", 200)], req.sent
    listed_rv = req.watches[0]["resourceVersion"]
    assert listed_rv not in ("", "0") and "sendInitialEvents" not in req.watches[0]  # from the list's version
    assert cache.stats.lists == 1 and cache.replaced == 1


def test_watches_the_server_ends_resume_from_the_version_held(control_plane, admin, ns, started):
    put(admin, ns, "a", {"v": "1"})
    api = control_plane.admin()
    req = Requests(api)
    cache = started(Recorded(api, cms(ns), mode="stream", watch_timeout_s=1))  # the server ends each after 1-2 s
    assert cache.wait_synced(TIMEOUT)
    wait_for(lambda: cache.stats.watches >= 3, 60, 0.05, "two renewals")
    put(admin, ns, "a", {"v": "2"})
    wait_for(lambda: data_of(cache) == {"a": {"v": "2"}}, TIMEOUT, 0.01, "a change after the renewals")
    assert cache.stats.relists == 0 and cache.stats.errors == 0 and cache.stats.lists == 0, cache.stats
    assert cache.replaced == 1  # renewals never replace the store
    assert {v for v, _ in req.sent} == {"WATCH"} and len(req.sent) == cache.stats.watches
    for q in req.watches[1:]:  # each renewal resumes where the last ended: no new initial state
        assert "sendInitialEvents" not in q and q["resourceVersion"] not in ("", "0"), q
        assert 1 <= int(q["timeoutSeconds"]) <= 2


def test_an_event_over_the_limit_is_an_error_and_the_last_state_is_kept(control_plane, admin, ns, started):
    put(admin, ns, "a", {"v": "small"})
    cache = started(Recorded(control_plane.admin(), cms(ns), max_event_bytes=4096, backoff_cap_s=1.0))
    assert cache.wait_synced(TIMEOUT)
    put(admin, ns, "a", {"v": "x" * 8192})
    wait_for(lambda: cache.stats.errors >= 1, TIMEOUT, 0.01, "the oversized event refused")
    assert "over 4096 bytes" in (cache.last_error or "")
    assert data_of(cache) == {"a": {"v": "small"}}  # never the part of an event, never a buffer that grows
    put(admin, ns, "a", {"v": "small again"})  # back within the limit: a new streaming list takes it in
    wait_for(lambda: cache.live and data_of(cache) == {"a": {"v": "small again"}}, 30, 0.02, "the cache back")


# -- the object watch (the fleet brake's ConfigMap) ---------------------------------------------------------------

BRAKE = "the-brake"


def test_object_watch_is_known_at_the_initial_state_and_tells_data_changes(admin, ns, sa_client, started):
    """With RBAC that names the one object and grants only `watch`: absent -> known with no object; created, its data
    changed, deleted -> on_change each time; a label-only change -> the copy is current, no callback. One WATCH
    request for all of it."""
    rules = [{"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [BRAKE], "verbs": ["watch"]}]
    api, _ = sa_client(rules=[], namespace_rules={ns: rules})
    req = Requests(api)
    seen: list[dict[str, Any] | None] = []
    w = ObjectWatch(api, ns, BRAKE, on_change=seen.append)
    assert not w.known and w.get() is None
    started(w)
    wait_for(lambda: w.known, TIMEOUT, 0.01, "the initial state")
    assert w.get() is None and w.live and seen == []  # known absent: no callback (nothing changed)

    put(admin, ns, BRAKE, {"admitted": "a"})
    wait_for(lambda: len(seen) == 1, TIMEOUT, 0.01, "the create")
    put(admin, ns, BRAKE, {"admitted": "a"}, {"touched": "yes"})  # a label only
    put(admin, ns, BRAKE, {"admitted": "a,b"}, {"touched": "yes"})
    wait_for(lambda: len(seen) == 2, TIMEOUT, 0.01, "the data change")
    assert (w.get() or {})["metadata"]["labels"] == {"touched": "yes"}  # the copy followed the label change too
    delete(admin, ns, BRAKE)
    wait_for(lambda: len(seen) == 3, TIMEOUT, 0.01, "the delete")
    assert [(s or {}).get("data") for s in seen] == [{"admitted": "a"}, {"admitted": "a,b"}, None]
    assert w.get() is None and w.known
    assert req.sent == [("WATCH", 200)], req.sent
    assert w.stats.events == 4 and w.stats.errors == 0


def test_object_watch_over_its_event_limit_keeps_the_last_copy_and_is_not_live(control_plane, admin, ns, started):
    put(admin, ns, BRAKE, {"admitted": "a"})
    w = started(ObjectWatch(control_plane.admin(), ns, BRAKE, backoff_cap_s=1.0))
    wait_for(lambda: w.known and w.get() is not None, TIMEOUT, 0.01, "the brake")
    put(admin, ns, BRAKE, {"admitted": "a", "padding": "x" * MAX_OBJECT_EVENT})
    wait_for(lambda: w.stats.errors >= 1 and not w.live, TIMEOUT, 0.01, "the oversized copy refused")
    assert (w.get() or {})["data"] == {"admitted": "a"} and w.known  # the last copy; the caller knows it is stale


# -- the controller's informer ------------------------------------------------------------------------------------


def test_informer_lists_once_and_wakes_only_for_a_change_it_keeps(control_plane, admin, ns, started):
    put(admin, ns, "a", {"v": "1"}, {"app": "x"})
    put(admin, ns, "other", {"v": "1"}, {"app": "y"})
    api = control_plane.admin()
    req = Requests(api)
    wakes: list[int] = []  # the watch events handled when the controller was woken

    def woken() -> None:
        wakes.append(inf.stats.events)

    inf: Informer[str] = Informer(api, cms(ns), lambda o: (o.get("data") or {}).get("v"), "app=x", on_change=woken)
    started(inf)
    assert inf.wait_synced(TIMEOUT) and inf.known
    assert inf.items() == {f"{ns}/a": "1"} and wakes == [0, 0]  # a added; the list done
    admin.request("PATCH", f"{cms(ns)}/a", {"metadata": {"annotations": {"x": "y"}}}, "application/merge-patch+json")
    put(admin, ns, "b", {"v": "2"}, {"app": "x"})
    put(admin, ns, "a", {"v": "3"}, {"app": "x"})
    wait_for(lambda: len(wakes) >= 4, TIMEOUT, 0.01, "two wakes")
    assert wakes == [0, 0, 2, 3], wakes  # b and a's new value; not the annotation (event 1): the view kept is equal
    assert inf.items() == {f"{ns}/a": "3", f"{ns}/b": "2"}
    assert req.sent == [("LIST", 200), ("WATCH", 200)], req.sent
    assert inf.stats.lists == 1 and inf.stats.watches == 1 and inf.stats.errors == 0


# -- an apiserver without streaming lists and without a watch cache -----------------------------------------------


@pytest.fixture(scope="module")
def old_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    cp = ControlPlane(require_testbin("kube-apiserver", "etcd"), workdir=str(tmp_path_factory.mktemp("old") / "cp"))
    cp.extra_args["kube-apiserver"] = ["--feature-gates=WatchList=false", "--watch-cache=false"]
    try:
        yield cp.start()
    finally:
        cp.stop()


@pytest.fixture
def old_ns(old_plane: ControlPlane) -> Iterator[tuple[KubeApi, str]]:
    admin = old_plane.admin()
    name = f"old-{secrets.token_hex(3)}"
    ensure_namespace(admin, name)
    yield admin, name
    admin.close()


def test_a_refused_streaming_list_falls_back_to_list_then_watch(old_plane, old_ns, started):
    admin, ns = old_ns
    put(admin, ns, "a", {"v": "1"})
    api = old_plane.admin()
    req = Requests(api)
    cache = started(Recorded(api, cms(ns), mode="stream", fallback="list"))
    assert cache.wait_synced(TIMEOUT), cache.last_error
    assert data_of(cache) == {"a": {"v": "1"}}
    put(admin, ns, "b", {"v": "1"})
    wait_for(lambda: set(data_of(cache)) == {"a", "b"}, TIMEOUT, 0.01, "b")
    assert req.sent == [("WATCH", 422), ("LIST", 200), ("WATCH", 200)], req.sent  # asked once, then LIST + watch
    assert cache.stats.errors == 0 and not cache.watch_list  # a negotiation, not a failure: no backoff


def test_object_watch_without_streaming_lists_watches_from_0_and_is_known_once_open(old_plane, old_ns, started):
    admin, ns = old_ns
    put(admin, ns, BRAKE, {"admitted": "a"})
    api = old_plane.admin()
    req = Requests(api)
    seen: list[dict[str, Any] | None] = []
    w = started(ObjectWatch(api, ns, BRAKE, on_change=seen.append))
    wait_for(lambda: w.get() is not None, TIMEOUT, 0.01, "the object from the plain watch")
    assert w.known and w.live and len(seen) == 1
    assert req.sent == [("WATCH", 422), ("WATCH", 200)], req.sent
    assert req.watches[1]["resourceVersion"] == "0" and "sendInitialEvents" not in req.watches[1]


def compact(cp: ControlPlane) -> None:
    """Moves etcd on and compacts it: every version before now is gone."""
    for i in range(3):
        r = etcd_request(cp, "/v3/kv/put", {"key": base64.b64encode(f"/compact-{i}".encode()).decode()})
    etcd_request(cp, "/v3/kv/compaction", {"revision": r["header"]["revision"], "physical": True})


def test_informer_after_410_gone_lists_again_not_older_than_what_it_held(old_plane, old_ns, started):
    """The version the informer resumes from is compacted away: 410 Gone, one re-list (not older than the version it
    held), and it follows changes again; the objects were served meanwhile."""
    admin, ns = old_ns
    put(admin, ns, "a", {"v": "1"})
    api = old_plane.admin()
    req = Requests(api)
    inf: Informer[str] = Informer(api, cms(ns), lambda o: (o.get("data") or {}).get("v"), watch_timeout_s=1)
    started(inf)
    assert inf.wait_synced(TIMEOUT)
    wait_for(lambda: inf.stats.watches >= 1, TIMEOUT, 0.01, "the watch")
    compact(old_plane)
    wait_for(lambda: inf.stats.gone >= 1, 60, 0.02, "the 410 Gone at the next renewal")
    assert inf.items() == {f"{ns}/a": "1"}  # served meanwhile
    wait_for(lambda: inf.stats.lists >= 2 and inf.live, TIMEOUT, 0.02, "the re-list")
    put(admin, ns, "a", {"v": "2"})
    wait_for(lambda: inf.items() == {f"{ns}/a": "2"}, TIMEOUT, 0.01, "a change after the re-list")
    first, again = req.lists[0], req.lists[1]
    assert first["resourceVersion"] == "0" and "resourceVersionMatch" not in first
    assert again["resourceVersionMatch"] == "NotOlderThan" and again["resourceVersion"] not in ("", "0"), again
    assert inf.stats.relists == inf.stats.gone and inf.stats.errors == 0, inf.stats
    assert len(req.lists) == inf.stats.lists == 2


def test_stop_returns_within_a_second_with_a_watch_open(control_plane, ns, started):
    cache = Recorded(control_plane.admin(), cms(ns)).start()  # a 10-20 min watch, blocked in a read
    try:
        assert cache.wait_synced(TIMEOUT)
        assert cache.stop(1.0) and not cache.thread.is_alive()
    finally:
        cache.stop(2.0)
