"""The agent's own Node from a watch (agent/kube/node_cache.py), on the real apiserver; the stream splitter
(agent/kube/client.py) and the backoff and jitter helpers (agent/kube/backoff.py) on plain data."""

from __future__ import annotations

import base64
import contextlib
import itertools
import random
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.kube.backoff import BACKOFF_BASE_S, backoff_delay, first_write_delay, heartbeat_delay
from agent.kube.client import ApiError, KubeApi, LineTooLong, split_lines
from agent.kube.node_cache import NodeCache
from bench.fleet import parse_samples, read_metrics_text, total
from testkit.controlplane import etcd_request
from testkit.harness import wait_for
from testkit.hostile import LONG_LINE_CHUNKS

CLEAR = "gpu-ready.io/clear-before"
# the agent's rules with watch on nodes: all the node cache needs (the chart's ClusterRole must grant it);
# `list` stays forbidden
WATCH_RULES: list[dict[str, Any]] = [
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "watch"]},
    {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]},
    {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
]
GET_ONLY_RULES: list[dict[str, Any]] = [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]


# -- plain data --------------------------------------------------------------------------------------------------


@given(
    lines=st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"x")), max_size=30),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=20),
    trailing_newline=st.booleans(),
)
def test_split_lines_matches_split_for_any_chunking(
    lines: list[bytes], cuts: list[int], trailing_newline: bool
) -> None:
    data = b"\n".join(lines) + (b"\n" if trailing_newline else b"")
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    chunks = [data[a:b] for a, b in itertools.pairwise(points)]
    assert list(split_lines(chunks, 100)) == [ln for ln in data.split(b"\n") if ln.strip()]


def test_split_lines_refuses_a_line_over_the_limit() -> None:
    with pytest.raises(LineTooLong):
        list(split_lines([b"a" * 60, b"b" * 60], 100))  # no newline: the buffer would pass 100
    with pytest.raises(LineTooLong):
        list(split_lines([b"x" * 101 + b"\nshort\n"], 100))
    assert list(split_lines([b"x" * 100 + b"\nshort\n"], 100)) == [b"x" * 100, b"short"]


class _Counted(bytes):
    """A chunk that counts the bytes its find() examines."""

    scanned = 0

    def find(self, sub, start=0, *rest):  # type: ignore[no-untyped-def, override]
        _Counted.scanned += len(self) - start
        return super().find(sub, start, *rest)


def test_split_lines_is_linear_in_a_long_line() -> None:
    """4 MB arriving in 100-byte pieces: the newline is looked for in each piece once, never in the buffer built
    so far (rescanning it on every piece would read ~80 GB). The time is bench/parsing.py's."""
    _Counted.scanned = 0
    chunks = [_Counted(c) for c in LONG_LINE_CHUNKS]
    out = list(split_lines(chunks, 8 * 1024 * 1024))
    assert len(out) == 1 and len(out[0]) == 4_000_000
    assert _Counted.scanned == sum(len(c) for c in chunks)  # every byte examined once


def test_backoff_grows_is_capped_and_differs_between_agents() -> None:
    rng = random.Random(1)
    for n in range(1, 25):
        ceiling = min(30.0, 0.5 * 2 ** (n - 1))
        d = backoff_delay(n, rng, 0.5, 30.0)
        assert ceiling / 2 <= d <= ceiling
    firsts = {round(backoff_delay(3, random.Random(seed)), 6) for seed in range(100)}
    assert len(firsts) > 90  # 100 agents failing together do not retry together


def test_first_write_spread_bounds_a_fleet_start() -> None:
    window = 100.0
    delays = [first_write_delay(random.Random(seed), window) for seed in range(10_000)]
    assert all(0.0 <= d < window for d in delays)
    per_second: dict[int, int] = {}
    for d in delays:
        per_second[int(d)] = per_second.get(int(d), 0) + 1
    assert len(per_second) == 100
    assert max(per_second.values()) < 160  # 10,000 agents over 100 s: ~100 per second, not 10,000 at once
    assert first_write_delay(random.Random(1), 0.0) == 0.0


def test_heartbeat_jitter_keeps_the_mean_interval() -> None:
    rng = random.Random(7)
    xs = [heartbeat_delay(rng, 300.0) for _ in range(20_000)]
    assert min(xs) >= 270.0 and max(xs) <= 330.0
    assert abs(sum(xs) / len(xs) - 300.0) < 1.5
    assert max(xs) - min(xs) > 50.0  # really spread
    assert heartbeat_delay(rng, 300.0, fraction=0.0) == 300.0


# -- the real apiserver ------------------------------------------------------------------------------------------


class Changes:
    """on_change recorder: (monotonic time, annotations, labels) of every change; `event` is set on each."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, dict[str, str], dict[str, str], bool]] = []
        self.event = threading.Event()

    def __call__(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        meta = (new or {}).get("metadata") or {}
        self.seen.append((time.monotonic(), meta.get("annotations") or {}, meta.get("labels") or {}, new is None))
        self.event.set()

    def wait_for(self, pred: Any, timeout: float = 10.0) -> tuple[float, dict[str, str], dict[str, str], bool]:
        return wait_for(lambda: next((s for s in self.seen if pred(s)), None), timeout, 0.005, "a node change")


class Verbs:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def __call__(self, verb: str, code: int) -> None:
        self.counts[verb] = self.counts.get(verb, 0) + 1


@pytest.fixture
def caches() -> Iterator[list[NodeCache]]:
    made: list[NodeCache] = []
    yield made
    for c in made:
        c.stop(2.0)


def etcd_node_gets(admin: KubeApi) -> float:
    return total(parse_samples(read_metrics_text(admin)), "etcd_requests_total", resource="nodes", operation="get")


def apiserver_node_gets(admin: KubeApi) -> float:
    return total(parse_samples(read_metrics_text(admin)), "apiserver_request_total", resource="nodes", verb="GET")


@pytest.mark.apiserver
def test_cache_sees_clear_before_and_labels_on_the_open_watch(admin, make_node, sa_client, caches) -> None:
    """A label or annotation change reaches on_change on the watch already open: no request is made for it (the
    time it takes is the agent's detection figure in bench/)."""
    node = make_node(labels={"nvidia.com/gpu.present": "true"})
    api, _ = sa_client(rules=WATCH_RULES, pod_on_node=node)
    verbs = Verbs()
    api.on_request = verbs
    changes = Changes()
    cache = NodeCache(api, node, on_change=changes)
    caches.append(cache.start())
    assert cache.wait_synced(30), cache.last_error
    assert cache.get()["metadata"]["name"] == node

    requests = dict(verbs.counts)
    admin.patch_node(node, {"metadata": {"annotations": {CLEAR: "2026-01-02T03:04:05Z"}}})
    changes.wait_for(lambda s: s[1].get(CLEAR) == "2026-01-02T03:04:05Z")
    assert cache.get()["metadata"]["annotations"][CLEAR] == "2026-01-02T03:04:05Z"

    admin.patch_node(node, {"metadata": {"labels": {"preflight": "passed"}}})
    changes.wait_for(lambda s: s[2].get("preflight") == "passed")
    assert verbs.counts == requests  # both arrived on the watch already open: no GET, LIST or new WATCH

    # a status-only change (a condition write, kubelet's heartbeat) updates the cache without a callback
    n_changes = len(changes.seen)
    admin.patch_node_status(node, {"status": {"conditions": [{"type": "GPUReady", "status": "True", "reason": "R"}]}})
    wait_for(
        lambda: any(c.get("type") == "GPUReady" for c in cache.get()["status"].get("conditions") or []),
        10,
        what="the status change in the cache",
    )
    assert len(changes.seen) == n_changes
    assert verbs.counts.get("GET", 0) == 0 and verbs.counts.get("LIST", 0) == 0 and verbs.counts.get("WATCH", 0) >= 1
    assert cache.stats.cache_reads >= 3 and cache.stats.fallback_gets == 0
    with pytest.raises(ApiError) as e:  # the watch needs no list right: listing nodes stays forbidden
        api.list_nodes(f"metadata.name={node}")
    assert e.value.status == 403


def seen_on_the_watch(cache: NodeCache, changes: Any, admin: KubeApi, node: str, value: str, timeout: float = 10):
    """Annotates clear-before=`value` and waits for on_change to see it; asserts it came on a watch (no fallback
    GET, no re-list meanwhile): pushed, not polled. How long it took is the agent's detection figure in bench/."""
    before = (cache.stats.fallback_gets, cache.stats.relists)
    admin.patch_node(node, {"metadata": {"annotations": {CLEAR: value}}})
    changes.wait_for(lambda s: s[1].get(CLEAR) == value, timeout)
    assert (cache.stats.fallback_gets, cache.stats.relists) == before, cache.stats


@pytest.mark.apiserver
def test_watch_is_renewed_across_expiry(admin, make_node, sa_client, caches) -> None:
    node = make_node()
    api, _ = sa_client(rules=WATCH_RULES, pod_on_node=node)
    changes = Changes()
    cache = NodeCache(api, node, on_change=changes, watch_timeout_s=2)  # the server ends each watch after 2-3 s
    caches.append(cache.start())
    assert cache.wait_synced(30)
    wait_for(lambda: cache.stats.watches >= 4, 60, 0.1, "three watch renewals")
    assert cache.stats.errors == 0 and cache.stats.relists == 0, cache.stats  # each resumed from its version
    assert cache.live
    seen_on_the_watch(cache, changes, admin, node, "2026-02-02T00:00:00Z")


class Proxy:
    """A TCP forwarder in front of the apiserver whose connections the test can cut: a network drop in
    the middle of a watch, with the apiserver still up."""

    def __init__(self, port: int) -> None:
        self.upstream = ("127.0.0.1", port)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
                upstream = socket.create_connection(self.upstream, timeout=10)
                upstream.settimeout(None)
            except OSError:
                return
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self.lock:
            conns, self.conns = self.conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self.sock.close()
        self.cut()


@pytest.mark.apiserver
def test_resumes_after_a_dropped_connection_without_relisting(control_plane, admin, make_node, caches) -> None:
    node = make_node()
    proxy = Proxy(control_plane.port)
    try:
        api = KubeApi.from_token(f"https://127.0.0.1:{proxy.port}", control_plane.admin_token, control_plane.ca_file)
        changes = Changes()
        cache = NodeCache(api, node, on_change=changes)
        caches.append(cache.start())
        assert cache.wait_synced(30)
        wait_for(lambda: cache.stats.watches >= 1, 10, what="the watch")
        proxy.cut()
        wait_for(lambda: cache.stats.errors >= 1, 10, 0.01, "the cache to notice the drop")
        wait_for(lambda: cache.live and cache.stats.watches >= 2, 30, 0.01, "the watch to resume")
        assert cache.stats.relists == 0 and cache.stats.gone == 0, cache.stats  # resumed from its version
        seen_on_the_watch(cache, changes, admin, node, "2026-05-05T00:00:00Z")
        fallback = cache.stats.fallback_gets
        cache.get()
        assert cache.stats.fallback_gets == fallback  # live again: served from the cache
    finally:
        proxy.close()


@pytest.mark.apiserver
@pytest.mark.parametrize("initial_list", [False, True], ids=["watch-from-0", "list-then-watch"])
def test_starts_over_after_410_gone_and_survives_an_apiserver_restart(
    control_plane, admin, make_node, caches, initial_list
) -> None:
    node = make_node()
    api = control_plane.admin(timeout_s=5)
    verbs = Verbs()
    api.on_request = verbs
    changes = Changes()
    cache = NodeCache(api, node, on_change=changes, backoff_cap_s=2.0, initial_list=initial_list)
    caches.append(cache.start())
    try:
        assert cache.wait_synced(30)
        control_plane.stop_apiserver()
        wait_for(lambda: not cache.live, 30, 0.05, "the cache to notice the apiserver is gone")
        with pytest.raises(ApiError) as e:
            cache.get()  # the fallback GET cannot reach it either: an error, never a stale answer as fresh
        assert e.value.status == 0
        assert cache.cached() is not None and cache.cached()["metadata"]["name"] == node
        # move etcd on and compact it, so the version the watch resumes from is gone (410 when it is back)
        for i in range(5):
            r = etcd_request(control_plane, "/v3/kv/put", {"key": base64.b64encode(f"/h7-bump/{i}".encode()).decode()})
        etcd_request(control_plane, "/v3/kv/compaction", {"revision": r["header"]["revision"], "physical": True})
    finally:
        control_plane.restart_apiserver()
    wait_for(lambda: cache.live, 60, 0.05, "the watch to be back")
    assert cache.stats.gone >= 1 and cache.stats.relists >= 1, cache.stats
    # list-then-watch re-lists (with the last version, NotOlderThan); watch-from-0 never lists
    assert (verbs.counts.get("LIST", 0) >= 2) if initial_list else ("LIST" not in verbs.counts), verbs.counts
    seen_on_the_watch(cache, changes, admin, node, "2026-03-03T00:00:00Z", 20)
    assert cache.get()["metadata"]["annotations"][CLEAR] == "2026-03-03T00:00:00Z"


@pytest.mark.apiserver
def test_steady_state_makes_no_quorum_reads(admin, make_node, sa_client, caches) -> None:
    node = make_node()
    api, _ = sa_client(rules=WATCH_RULES, pod_on_node=node)
    verbs = Verbs()
    api.on_request = verbs
    cache = NodeCache(api, node)
    caches.append(cache.start())
    assert cache.wait_synced(30)
    wait_for(lambda: cache.stats.watches >= 1, 10, what="the watch")
    etcd0, get0, verbs0 = etcd_node_gets(admin), apiserver_node_gets(admin), dict(verbs.counts)
    for _ in range(50):  # 50 polls
        assert cache.get()["metadata"]["name"] == node
    assert etcd_node_gets(admin) == etcd0
    assert apiserver_node_gets(admin) == get0
    assert verbs.counts == verbs0  # not one request for 50 polls
    # the measure can fail: GET resourceVersion=0 (the fallback) is served from the cache, a plain GET is not
    api.get_node(node, resource_version="0")
    assert etcd_node_gets(admin) == etcd0
    for _ in range(3):
        api.get_node(node)
    assert etcd_node_gets(admin) >= etcd0 + 3


@pytest.mark.apiserver
def test_without_watch_rights_falls_back_to_get_from_the_cache(admin, make_node, sa_client, caches) -> None:
    node = make_node()
    api, _ = sa_client(rules=GET_ONLY_RULES, pod_on_node=node)
    cache = NodeCache(api, node)
    caches.append(cache.start())
    wait_for(lambda: cache.stats.errors >= 1, 30, what="the forbidden watch")
    assert not cache.live and "403" in (cache.last_error or "")
    etcd0 = etcd_node_gets(admin)
    for _ in range(10):
        assert cache.get()["metadata"]["name"] == node
    assert cache.stats.fallback_gets == 10
    assert etcd_node_gets(admin) == etcd0  # resourceVersion=0: the apiserver's cache, not etcd
    # the forbidden watch is retried with backoff, not in a loop: two retries in a row are at least half the base
    # delay apart (equal jitter: the n-th waits between half and all of base x 2^n)
    errors = cache.stats.errors
    wait_for(lambda: cache.stats.errors >= errors + 1, 60, 0.005, "a retry of the forbidden watch")
    t1 = time.monotonic()
    wait_for(lambda: cache.stats.errors >= errors + 2, 60, 0.005, "the next retry")
    assert time.monotonic() - t1 >= BACKOFF_BASE_S / 2 - 0.01
    assert cache.stop(1.0)  # the thread has ended within a second even while backing off


@pytest.mark.apiserver
def test_an_event_over_the_line_limit_falls_back_to_get(admin, make_node, caches, control_plane) -> None:
    node = make_node()
    cache = NodeCache(control_plane.admin(), node, max_event_bytes=512, backoff_cap_s=1.0)
    caches.append(cache.start())
    wait_for(lambda: cache.stats.errors >= 1, 20, 0.02, "the watch to refuse the oversized event")
    assert not cache.live and "over 512 bytes" in (cache.last_error or "")
    admin.patch_node(node, {"metadata": {"annotations": {CLEAR: "2026-04-04T00:00:00Z"}}})
    # via GET resourceVersion=0: the apiserver's cache, which may trail the write by a moment
    wait_for(
        lambda: (cache.get()["metadata"].get("annotations") or {}).get(CLEAR) == "2026-04-04T00:00:00Z",
        10,
        what="the annotation through the fallback GET",
    )
    assert cache.stats.fallback_gets >= 1 and not cache.live


@pytest.mark.apiserver
def test_node_deleted_and_recreated(admin, make_node, control_plane, caches) -> None:
    node = make_node(labels={"gen": "1"})
    changes = Changes()
    cache = NodeCache(control_plane.admin(), node, on_change=changes)
    caches.append(cache.start())
    assert cache.wait_synced(30)
    admin.request("DELETE", f"/api/v1/nodes/{node}")
    changes.wait_for(lambda s: s[3])
    with pytest.raises(ApiError) as e:
        cache.get()
    assert e.value.status == 404
    make_node(labels={"gen": "2"}, name=node)
    changes.wait_for(lambda s: s[2].get("gen") == "2")
    assert cache.get()["metadata"]["labels"]["gen"] == "2"


@pytest.mark.apiserver
def test_stop_returns_within_a_second_with_a_watch_open(make_node, control_plane) -> None:
    node = make_node()
    cache = NodeCache(control_plane.admin(), node).start()  # a 10-20 min watch, blocked in a read
    try:
        assert cache.wait_synced(30)
        wait_for(lambda: cache.stats.watches >= 1, 10, what="the watch")
        assert cache.stop(1.0)  # True: the thread ended within the second
        assert not cache.thread.is_alive()
    finally:
        cache.stop(2.0)
