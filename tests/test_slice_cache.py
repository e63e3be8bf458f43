"""The node's DRA ResourceSlices from a watch (agent/kube/slice_cache.py), on the real apiserver: the cache holds
the node's slices of its driver and only them, follows a new slice, a device taint and a deletion within a second,
survives watch expiries, a 410 Gone and an apiserver restart, answers "no slices" without a request where the
cluster serves no resource.k8s.io/v1, and the agent's CheckSuite sends no ResourceSlice LIST while the watch is
kept (with RBAC without `watch`: the LIST per poll it falls back to, which shows the count can fail)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest

from agent.kube.client import ApiError, KubeApi
from agent.kube.slice_cache import MAX_STORED, SliceCache
from agent.kube.slices import SLICES_PATH
from agent.probes.dra import node_inventory
from agent.runner import Agent
from testkit.cluster import AGENT_RULES
from testkit.dra import DRIVER, nvidia_slice
from testkit.harness import in_process_agent, wait_cycles, wait_for
from testkit.simhost import SimHost

pytestmark = pytest.mark.apiserver

SLICE_READ = {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"], "verbs": ["list", "watch"]}
SLICE_LIST_ONLY = {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"], "verbs": ["list"]}
PROMPT_S = 1.0  # a change reaches the cache within this


def names(cache: SliceCache) -> list[str]:
    read = cache.items()
    assert read is not None and read.ok, "the cache is not live"
    return [s["metadata"]["name"] for s in read.items]


def create(admin: KubeApi, body: dict[str, Any]) -> str:
    return str(admin.request("POST", SLICES_PATH, body)["metadata"]["name"])


def delete(admin: KubeApi, name: str) -> None:
    try:
        admin.request("DELETE", f"{SLICES_PATH}/{name}")
    except ApiError as e:
        if e.status != 404:
            raise


@pytest.fixture
def slices(admin: KubeApi) -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for n in made:
        delete(admin, n)


@pytest.fixture
def caches() -> Iterator[list[SliceCache]]:
    made: list[SliceCache] = []
    yield made
    for c in made:
        assert c.stop(5.0), "the slice cache thread did not stop"


def started(caches: list[SliceCache], api: KubeApi, node: str, **kw: Any) -> SliceCache:
    cache = SliceCache(api, node, DRIVER, **kw).start()
    caches.append(cache)
    assert cache.wait_synced(20), f"no sync: {cache.last_error}"
    return cache


def lists_counted(api: KubeApi) -> list[str]:
    verbs: list[str] = []
    api.on_request = lambda verb, code: verbs.append(verb)
    return verbs


def taint_device(admin: KubeApi, name: str, device: int, taint: dict[str, str]) -> None:
    s = admin.request("GET", f"{SLICES_PATH}/{name}")
    s["spec"]["devices"][device]["taints"] = [taint]
    admin.request("PUT", f"{SLICES_PATH}/{name}", s)


def test_holds_only_the_nodes_slices_and_follows_changes_within_a_second(admin, sa_client, slices, caches):
    node, other = f"dra-{secrets.token_hex(4)}", f"dra-{secrets.token_hex(4)}"
    mine = create(admin, nvidia_slice(node))
    slices += [mine, create(admin, nvidia_slice(other)), create(admin, nvidia_slice(node, driver="other.example.com"))]
    api, _ = sa_client(rules=[SLICE_READ])
    verbs = lists_counted(api)
    cache = started(caches, api, node)
    assert names(cache) == [mine]  # another node's and another driver's slices are not seen
    inv = node_inventory(cache.items())
    assert inv is not None and len(inv.gpus) == 8 and not inv.malformed

    second = create(admin, nvidia_slice(node, gpus=[], generation=1))
    slices.append(second)
    wait_for(lambda: names(cache) == sorted([mine, second]), PROMPT_S, 0.01, "the new slice in the cache")
    slices.append(create(admin, nvidia_slice(other)))  # another node's new slice: never seen
    taint = {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}
    taint_device(admin, mine, 3, taint)

    def tainted() -> bool:
        inv = node_inventory(cache.items())
        return inv is not None and [d.name for d in inv.devices if d.blocking_taints] == ["gpu-3"]

    wait_for(tainted, PROMPT_S, 0.01, "the device taint in the cache")
    delete(admin, second)
    wait_for(lambda: names(cache) == [mine], PROMPT_S, 0.01, "the deleted slice gone from the cache")
    assert "LIST" not in verbs and verbs.count("WATCH") == 1, verbs  # one streaming list + watch, nothing else
    assert cache.stats.watches == 1 and cache.stats.lists == 0 and cache.stats.errors == 0


def test_a_node_without_slices_is_synced_and_empty(admin, sa_client, caches):
    api, _ = sa_client(rules=[SLICE_READ])
    cache = started(caches, api, f"dra-{secrets.token_hex(4)}")
    read = cache.items()
    assert read is not None and read.ok and read.items == []  # "no slices", known, not "could not read"


def test_the_store_is_bounded_and_starts_over_when_a_slice_it_could_not_hold_may_count(admin, slices, caches):
    """More slices than MAX_STORED: the cache keeps MAX_STORED (parse_slices then says "truncated", as for a LIST of
    that many); when one of them is deleted, one it could not hold may now count, so it starts over and holds all."""
    node = f"dra-{secrets.token_hex(4)}"
    for _ in range(MAX_STORED + 1):
        slices.append(create(admin, nvidia_slice(node, gpus=[], generation=1, count=MAX_STORED + 1)))
    cache = started(caches, admin, node)
    held = names(cache)
    assert len(held) == MAX_STORED and set(held) < set(slices)
    inv = node_inventory(cache.items())
    assert inv is not None and inv.truncated
    delete(admin, held[0])
    want = sorted(set(slices) - {held[0]})
    wait_for(lambda: names(cache) == want, 10, 0.02, "every remaining slice after the start-over")
    assert cache.stats.resyncs == 1 and cache.stats.lists == 0


def test_survives_watch_expiries(admin, slices, caches):
    node = f"dra-{secrets.token_hex(4)}"
    first = create(admin, nvidia_slice(node))
    slices.append(first)
    cache = started(caches, admin, node, watch_timeout_s=1)  # the server ends each watch after 1-2 s
    wait_for(lambda: cache.stats.watches >= 3, 30, what="3 watches (2 expiries)")
    assert cache.stats.resyncs == 0 and cache.live  # an expiry resumes from where it was
    second = create(admin, nvidia_slice(node, gpus=[]))
    slices.append(second)
    wait_for(lambda: names(cache) == sorted([first, second]), PROMPT_S, 0.01, "a slice after the expiries")
    delete(admin, second)
    wait_for(lambda: names(cache) == [first], PROMPT_S, 0.01, "a deletion after the expiries")
    assert cache.stats.lists == 0 and cache.stats.errors == 0


def test_survives_a_410_gone_and_an_apiserver_restart(control_plane, tmp_path, caches):
    """Own control plane: the apiserver goes away and comes back; then a watch resumes from a version the
    apiserver's watch cache does not hold (410 Gone: a new streaming list, the old slices served meanwhile)."""
    from testkit.controlplane import ControlPlane

    cp = ControlPlane(control_plane.bin_dir, workdir=str(tmp_path / "cp")).start()
    try:
        admin = cp.admin()
        node = f"dra-{secrets.token_hex(4)}"
        first = create(admin, nvidia_slice(node))
        cache = started(caches, admin, node, watch_timeout_s=1, backoff_cap_s=1.0)
        assert names(cache) == [first]
        second = create(admin, nvidia_slice(node, gpus=[]))
        wait_for(lambda: names(cache) == sorted([first, second]), PROMPT_S, 0.01, "the second slice")
        cp.stop_apiserver()
        wait_for(lambda: cache.items() is None, 40, what="the cache to notice the apiserver is gone")
        assert cache.stats.errors >= 1  # not live: the caller lists (and that fails: "could not check")
        cp.restart_apiserver()
        wait_for(lambda: cache.live, 60, what="the watch to be back")
        delete(admin, second)  # while the cache re-syncs, or after: either way it must go
        third = create(admin, nvidia_slice(node, gpus=[]))
        wait_for(lambda: names(cache) == sorted([first, third]), PROMPT_S, 0.01, "a slice after the restart")
        # a watch then resumes from a version older than the restarted apiserver's watch cache: 410 Gone, a new
        # streaming list (the old slices served meanwhile)
        real_stream, resumed = admin.stream, []

        def resume_from_before(path: str, query: list[tuple[str, str]], read_timeout_s: float) -> Any:
            if not resumed and ("sendInitialEvents", "true") not in query:  # the next resume: from revision 2
                resumed.append(True)
                query = [(k, "2" if k == "resourceVersion" else v) for k, v in query]
            return real_stream(path, query, read_timeout_s)

        admin.stream = resume_from_before
        wait_for(lambda: cache.stats.gone >= 1, 30, what="the 410 Gone")
        assert cache.live and cache.stats.resyncs == 1
        assert names(cache) == sorted([first, third]) and cache.stats.lists == 0
        delete(admin, third)
        wait_for(lambda: names(cache) == [first], PROMPT_S, 0.01, "a deletion after the 410")
        admin.close()
    finally:
        for c in caches:
            c.stop(5.0)
        caches.clear()
        cp.stop()


def test_no_resource_k8s_io_v1_is_no_dra_without_requests(admin, caches, monkeypatch):
    """An apiserver that serves no resource.k8s.io/v1 answers 404: no slices, and the watch is not retried soon."""
    monkeypatch.setattr("agent.kube.slice_cache.SLICES_PATH", "/apis/resource.k8s.io/v9/resourceslices")
    verbs = lists_counted(admin)
    try:
        cache = started(caches, admin, f"dra-{secrets.token_hex(4)}")
        read = cache.items()
        assert read is not None and read.ok and read.items == [] and cache.live
        assert verbs == ["WATCH"] and cache.stats.watches == 0 and cache.stats.errors == 1
    finally:
        admin.on_request = None


@pytest.mark.parametrize("watch", [True, False], ids=["watch", "list-only-rbac"])
def test_the_agents_polls_send_no_slice_list_while_the_watch_is_kept(
    admin, make_node, sa_client, slices, tmp_path, watch
):
    """The in-process agent (the runner wires the cache into its CheckSuite): 10 polls, not one LIST, the DRA count
    from the cache, and a device taint seen by the next cycle's inventory (what fencing reads). With RBAC that
    grants only `list` (the watch is refused), a LIST per poll instead: the count can fail."""
    host = SimHost(tmp_path / "h")
    node = make_node(labels={"nvidia.com/gpu.present": "true"})
    name = create(admin, nvidia_slice(node))
    slices.append(name)
    base = [r for r in AGENT_RULES if "resourceslices" not in r["resources"]]  # the harness's rules grant the watch
    api, _ = sa_client(rules=[*base, SLICE_READ if watch else SLICE_LIST_ONLY], pod_on_node=node)
    verbs = lists_counted(api)
    agent: Agent = in_process_agent(api, node, host)
    cache = agent.suite.slice_cache
    assert cache is not None
    try:
        agent.start(serve=False)
        if watch:
            assert cache.wait_synced(20)
        wait_cycles(agent, 2)
        start = verbs.count("LIST")
        wait_cycles(agent, 10)
        lists = verbs.count("LIST") - start
        assert agent.obs is not None and agent.obs.counts.dra == 8
        if not watch:
            assert lists >= 9 and not cache.live, f"{lists} LISTs in 10 polls with list-only RBAC"
            return
        assert lists == 0, f"{lists} ResourceSlice LISTs in 10 polls while the watch is kept"
        taint_device(admin, name, 5, {"key": "gpu.nvidia.com/gpu-lost", "effect": "NoExecute"})

        def fenced_view() -> bool:
            inv = agent.suite.inventory
            return inv is not None and [d.name for d in inv.devices if d.blocking_taints] == ["gpu-5"]

        wait_for(fenced_view, 20, 0.02, "the device taint in the suite's inventory")
        assert verbs.count("LIST") == start
    finally:
        agent.shutdown()
        api.on_request = None
