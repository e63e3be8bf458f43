"""The ResourceSlice LIST behind DRA-aware counting, on the real apiserver: a node without slices (no DRA driver:
most GPU nodes) lists them once per DRA_EMPTY_RELIST_S, not every poll (120 LISTs per node per hour at the default
poll, 333/s across 10,000 nodes); a node with slices lists every poll, and a driver that starts publishing is seen at
the next relist. Time is the suite's clock argument, so nothing here waits."""

from __future__ import annotations

from collections.abc import Callable

from agent import config
from agent.checks import CheckSuite
from agent.kube.client import KubeApi
from agent.probes.dra import DRA_EMPTY_RELIST_S
from testkit.dra import nvidia_slice
from testkit.simhost import SimHost


def _suite(simhost: SimHost, node: str, api: KubeApi, clock: Callable[[], float]) -> CheckSuite:
    cfg = config.defaults(
        nvidia_smi=str(simhost.nvidia_smi),
        sysfs_root=str(simhost.sysfs),
        kmsg=str(simhost.kmsg),
        nvml="off",
        node_name=node,
    )
    return CheckSuite(cfg, clock=clock, api=api)


def test_a_node_without_slices_lists_them_once_per_relist_interval(admin, make_node, simhost):
    gpus = {"nvidia.com/gpu": "8"}
    name = make_node(capacity=gpus, allocatable=gpus)
    lists: list[str] = []
    admin.on_request = lambda verb, code: lists.append(verb) if verb == "LIST" else None
    now = [1000.0]
    suite = _suite(simhost, name, admin, lambda: now[0])
    node = admin.get_node(name)
    try:
        for _ in range(5):  # five polls, 30 s apart
            obs, _ = suite.run(node)
            now[0] += 30.0
        assert lists == ["LIST"], f"{len(lists)} ResourceSlice LISTs in 5 polls of a node without slices"
        assert obs.counts.plugin_physical == 8 and obs.counts.dra is None  # the device plugin's count, unchanged

        # a DRA driver starts publishing: seen at the next relist, and from then on read every poll
        created = admin.request("POST", "/apis/resource.k8s.io/v1/resourceslices", nvidia_slice(name))
        obs, _ = suite.run(node)
        assert len(lists) == 1 and obs.counts.dra is None  # inside the interval: still the earlier empty read
        now[0] = 1000.0 + DRA_EMPTY_RELIST_S
        obs, _ = suite.run(node)
        assert len(lists) == 2 and obs.counts.dra == 8
        obs, _ = suite.run(node)
        assert len(lists) == 3 and obs.counts.dra == 8  # a node with slices: every poll
    finally:
        admin.on_request = None
        if "created" in locals():
            admin.request("DELETE", f"/apis/resource.k8s.io/v1/resourceslices/{created['metadata']['name']}")
