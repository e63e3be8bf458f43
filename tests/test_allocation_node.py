"""The allocation map against the real kubelet: a test device plugin (testkit/deviceplugin.py) registers
whole GPUs, time-sliced replicas and MIG instances of a simulated host with kubelet's Device Plugin API, real Pods
(hostNetwork, the pause image) request them through the real scheduler, and the agent, a host process pointed at
kubelet's pod-resources socket, reports which pod holds which GPU.

What the Pods were given is read independently of pod-resources: the plugin's Allocate puts the device IDs into
each container's environment, and the test reads them from /proc/<pid>/environ of the container's process.

The tests share one node, one set of plugins and one set of Pods and build on each other in file order
(map -> fenced GPU -> kubelet restart -> blast radius). Figures are printed at the end of the module."""

from __future__ import annotations

import contextlib
import json
import math
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agent.kube.client import KubeApi
from agent.model import PciAddress
from testkit.cluster import EVENT_NAMESPACE
from testkit.controlplane import REPO
from testkit.deviceplugin import DevicePlugin, env_name, mig_ids, read_allocated_env, replica_ids, wait_registered
from testkit.harness import AgentProc, wait_for
from testkit.node import NodeControlPlane, RealNode
from testkit.realnode import real_node, skip_or_fail
from testkit.simhost import SimHost

pytestmark = [pytest.mark.node, pytest.mark.slow]

NODE = "gpu-node-alloc"
GPU = "nvidia.com/gpu"
SHARED = "nvidia.com/gpu.shared"
MIG = "nvidia.com/mig-1g.10gb"
REPLICAS = 4
MIG_PER_GPU = 2
REF_ENV = "GPU_READY_TEST_REF"  # set on every test container: "<namespace>/<pod>/<container>"
TIMES: dict[str, float] = {}

# The scripted mix on the 8 simulated GPUs (positions in bus order):
#   0-3 whole GPUs (nvidia.com/gpu); 4-5 four time-sliced replicas each (nvidia.com/gpu.shared, preferred allocation
#   "spread", so the replicas land on both GPUs); 6-7 two MIG 1g.10gb instances each ("spread" too: MIG instances
#   not packed by parent, as the NVIDIA plugin's `packed` policy does before NVIDIA/k8s-device-plugin#2036).
WHOLE, SHARED_GPUS, MIG_GPUS = (0, 1, 2, 3), (4, 5), (6, 7)
# pod -> container -> (resource, count)
PODS: dict[str, dict[str, tuple[str, int]]] = {
    "whole-a": {"main": (GPU, 1)},
    "whole-b": {"main": (GPU, 1), "side": (GPU, 1)},
    "ts-a": {"main": (SHARED, 1)},
    "ts-b": {"main": (SHARED, 1)},
    "ts-c": {"main": (SHARED, 1)},
    "mig-a": {"main": (MIG, 1)},
    "mig-b": {"main": (MIG, 1)},
}


@dataclass
class Env:
    cp: NodeControlPlane
    node: RealNode
    api: KubeApi
    sim: SimHost
    workdir: Path
    pause: str
    ns: str = ""
    plugins: dict[str, DevicePlugin] = field(default_factory=dict)
    agent: AgentProc | None = None
    expected: dict[PciAddress, dict[str, Any]] = field(default_factory=dict)

    @property
    def pod_resources_socket(self) -> Path:
        return self.node.kubelet_root / "pod-resources" / "kubelet.sock"

    def pr_flags(self) -> list[str]:
        return ["--pod-resources", "true", "--pod-resources-socket", str(self.pod_resources_socket)]

    def uuid_to_bus(self) -> dict[str, PciAddress]:
        return {u: bus for bus, u, _ in self.sim.gpu_uuids()}

    def diag(self) -> str:
        agent = self.agent.logs()[-3000:] if self.agent is not None else ""
        plugins = {r: (len(p.registrations), p.errors[-2:]) for r, p in self.plugins.items()}
        return (
            f"--- plugins (registrations, errors) --- {plugins}\n--- kubelet ---\n{self.node.log_tail('kubelet', 30)}"
            f"\n--- agent ---\n{agent}"
        )

    def check_json(self) -> dict[str, Any]:
        """One `gpu-ready check --json` against the node: the agent's own one-shot read of pod-resources."""
        kc = self.workdir / "admin.kubeconfig"
        args = [sys.executable, "-m", "agent", "check", "--json", "--node", NODE, "--kubeconfig", str(kc)]
        r = subprocess.run(
            [*args, *self.sim.check_args(), *self.pr_flags()], capture_output=True, text=True, timeout=120
        )
        assert r.returncode in (0, 1), f"gpu-ready check exited {r.returncode}: {r.stderr[-2000:]}"
        return dict(json.loads(r.stdout))


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    work = tmp_path_factory.mktemp("allocnode")
    sim = SimHost(work / "sim", gpus=8)
    sim.set_smi(mig={p: MIG_PER_GPU for p in MIG_GPUS})
    labels = {"nvidia.com/gpu.present": "true", "nvidia.com/mig.strategy": "mixed", f"{SHARED}.replicas": str(REPLICAS)}
    with real_node(NODE, labels=labels, tag="allocation node") as booted:
        TIMES["node set-up (control plane + containerd + kubelet + pause image) s"] = booted.setup_s
        booted.cp.kubeconfig(work / "admin.kubeconfig")
        e = Env(booted.cp, booted.node, booted.api, sim, work, booted.pause)
        try:
            yield e
        finally:  # each step may fail; none may keep the node from being stopped (real_node's exit)
            if e.agent is not None:
                with contextlib.suppress(Exception):
                    e.agent.terminate()
            for p in e.plugins.values():
                with contextlib.suppress(Exception):
                    p.stop()
            print("\n[allocation node] figures: " + "; ".join(f"{k}: {v:.1f}" for k, v in TIMES.items()))


def _node_allocatable(env: Env) -> dict[str, str]:
    return dict(env.api.request("GET", f"/api/v1/nodes/{NODE}").get("status", {}).get("allocatable", {}))


def _pod_spec(env: Env, pod: str, containers: dict[str, tuple[str, int]]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": pod, "namespace": env.ns},
        "spec": {
            "hostNetwork": True,
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": c,
                    "image": env.pause,
                    "imagePullPolicy": "Never",
                    "env": [{"name": REF_ENV, "value": f"{env.ns}/{pod}/{c}"}],
                    "resources": {"limits": {res: str(n)}},
                }
                for c, (res, n) in containers.items()
            ],
        },
    }


def _phase(env: Env, pod: str) -> str:
    return str(env.api.request("GET", f"/api/v1/namespaces/{env.ns}/pods/{pod}").get("status", {}).get("phase"))


def _expected_from_containers(env: Env) -> dict[PciAddress, dict[str, Any]]:
    """What the Pods' allocations imply, per GPU bus id: the containers holding a slot and how many slots are held,
    from the device IDs each container process really got (its environment) and the plugins' device -> GPU map."""
    got = read_allocated_env(env.node.pod_processes(), REF_ENV)
    want_refs = {f"{env.ns}/{p}/{c}" for p, cs in PODS.items() for c in cs}
    assert set(got) == want_refs, f"containers with the test's environment: {sorted(got)}; want {sorted(want_refs)}"
    to_bus = env.uuid_to_bus()
    out: dict[PciAddress, dict[str, Any]] = {
        bus: {"pods": set(), "allocated": 0, "devices": set()} for bus in to_bus.values()
    }
    for ref, by_env in got.items():
        ns, pod, container = ref.split("/")
        res, n = PODS[pod][container]
        ids = by_env.get(env_name(res), [])
        assert len(ids) == n, f"{ref}: got {ids} for {res}, wanted {n}"
        for d in ids:
            bus = to_bus[env.plugins[res].devices[d]]
            out[bus]["pods"].add((ns, pod, container))
            out[bus]["allocated"] += 1
            out[bus]["devices"].add(d)
    return out


def _slots(env: Env, bus: PciAddress) -> int:
    pos = [b for b, _, _ in env.sim.gpu_uuids()].index(bus)
    return REPLICAS if pos in SHARED_GPUS else MIG_PER_GPU if pos in MIG_GPUS else 1


def _summary_from(env: Env, expected: dict[PciAddress, dict[str, Any]], fenced: set[PciAddress]) -> dict[str, Any]:
    """free whole / partial / stranded / packing ratio by the formula in docs/metrics.md, computed here from the
    expected per-GPU allocation: ratio = GPUs in use / sum over sharing groups of ceil(used slots / slots per GPU)."""
    free_whole = partial = stranded = in_use = 0
    groups: dict[int, int] = {}
    for bus, e in expected.items():
        slots, used = _slots(env, bus), e["allocated"]
        if used == 0 and bus not in fenced:
            free_whole += 1
        if 0 < used < slots:
            partial += 1
            stranded += slots - used
        if used:
            in_use += 1
            groups[slots] = groups.get(slots, 0) + used
    minimum = sum(math.ceil(used / slots) for slots, used in groups.items())
    ratio = in_use / minimum if minimum else None
    return {"free_whole": free_whole, "partial": partial, "stranded_slots": stranded, "packing_ratio": ratio}


def _agent_gpus(alloc: dict[str, Any]) -> dict[PciAddress, dict[str, Any]]:
    out = {}
    for g in alloc["gpus"]:
        bus = PciAddress.parse(g["pci_bus_id"] or "")
        assert bus is not None, f"GPU without a bus id in the agent's map: {g}"
        out[bus] = g
    return out


def _map_matches(env: Env, alloc: dict[str, Any] | None) -> str:
    """'' when the agent's allocation section equals env.expected; else what differs."""
    if not alloc:
        return "no allocation section"
    got = _agent_gpus(alloc)
    if set(got) != set(env.expected):
        return f"GPUs {sorted(map(str, got))} != {sorted(map(str, env.expected))}"
    for bus, e in env.expected.items():
        g = got[bus]
        pods = {(p["namespace"], p["pod"], p["container"]) for p in g["pods"]}
        if pods != e["pods"] or g["allocated"] != e["allocated"] or g["slots"] != _slots(env, bus):
            return f"{bus}: agent {pods} {g['allocated']}/{g['slots']}; want {e['pods']} {e['allocated']}"
    return ""


# -- the tests --------------------------------------------------------------------------------------------------


def test_plugins_register_and_pods_get_devices(env: Env) -> None:
    """The plugins register over kubelet.sock; kubelet advertises every device on the Node; the Pods are scheduled
    on them and each container receives exactly the devices it asked for (Allocate's environment)."""
    uu = env.sim.gpu_uuids()
    env.plugins = {
        GPU: DevicePlugin(GPU, {uu[p][1]: uu[p][1] for p in WHOLE}),
        SHARED: DevicePlugin(SHARED, replica_ids([uu[p][1] for p in SHARED_GPUS], REPLICAS), policy="spread"),
        MIG: DevicePlugin(MIG, mig_ids({uu[p][1]: uu[p][2] for p in MIG_GPUS}), policy="spread"),
    }
    for p in MIG_GPUS:
        assert len(uu[p][2]) == MIG_PER_GPU and all(m.startswith("MIG-") for m in uu[p][2])
    assert all(u.startswith("GPU-") for _, u, _ in uu)
    t0 = time.monotonic()
    for plugin in env.plugins.values():
        plugin.start()
    want = {GPU: str(len(WHOLE)), SHARED: str(REPLICAS * len(SHARED_GPUS)), MIG: str(MIG_PER_GPU * len(MIG_GPUS))}
    try:
        wait_for(
            lambda: all(_node_allocatable(env).get(k) == v for k, v in want.items()), 120, 0.2, f"allocatable {want}"
        )
    except AssertionError as e:
        raise AssertionError(f"{e}\n{env.diag()}") from None
    TIMES["plugin registration -> Node allocatable s"] = time.monotonic() - t0
    assert all(len(p.registrations) == 1 for p in env.plugins.values())
    assert all(p.list_and_watch_sends >= 1 for p in env.plugins.values()), "kubelet opened ListAndWatch"

    env.ns = f"alloc-{secrets.token_hex(3)}"
    env.api.request("POST", "/api/v1/namespaces", {"metadata": {"name": env.ns}})
    wait_for(
        lambda: env.api.request("GET", f"/api/v1/namespaces/{env.ns}/serviceaccounts/default"), 60, 0.2, "default SA"
    )
    t1 = time.monotonic()
    for pod, containers in PODS.items():  # one at a time: GetPreferredAllocation then sees the earlier ones
        env.api.request("POST", f"/api/v1/namespaces/{env.ns}/pods", _pod_spec(env, pod, containers))
        try:
            wait_for(lambda pod=pod: _phase(env, pod) == "Running", 180, 0.2, f"pod {pod} Running")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{env.diag()}") from None
    TIMES[f"pod start ({len(PODS)} pods, one after another) s"] = time.monotonic() - t1
    env.expected = wait_for(lambda: _expected_from_containers(env), 60, 0.2, "the containers' device environment")
    calls = sum(len(p.allocations) for p in env.plugins.values())
    assert calls == sum(len(cs) for cs in PODS.values()), f"Allocate calls: {calls}"
    # The scripted mix landed as scripted: 3 whole GPUs used, replicas 2+1 on the two shared GPUs, one MIG
    # instance on each MIG GPU.
    used = [env.expected[b]["allocated"] for b, _, _ in env.sim.gpu_uuids()]
    assert sorted(used[:4]) == [0, 1, 1, 1] and used[4:6] == [2, 1] and used[6:] == [1, 1], used


def test_agent_map_equals_the_pods_allocations(env: Env) -> None:
    """`gpu-ready check --json` maps every allocated device to its GPU by bus id with the pod and container that
    hold it, and counts free whole GPUs, partial GPUs, stranded slots and the packing ratio as the mix implies."""
    assert env.expected, "needs test_plugins_register_and_pods_get_devices"
    t0 = time.monotonic()
    out = env.check_json()
    TIMES["gpu-ready check --json (one-shot, with pod-resources) s"] = time.monotonic() - t0
    alloc = out.get("allocation")
    assert alloc is not None, f"no allocation section: {out.get('allocation_error')}"
    assert _map_matches(env, alloc) == "", _map_matches(env, alloc)
    got = _agent_gpus(alloc)
    for bus, e in env.expected.items():
        assert set(got[bus]["devices"]) >= e["devices"], f"{bus}: devices {got[bus]['devices']}"
    pos = {b: i for i, (b, _, _) in enumerate(env.sim.gpu_uuids())}
    for bus, g in got.items():
        kind = "replicas" if pos[bus] in SHARED_GPUS else "mig" if pos[bus] in MIG_GPUS else "none"
        assert g["sharing"] == kind, f"{bus}: sharing {g['sharing']}, want {kind}"
        assert g["fenced"] is False
    want = _summary_from(env, env.expected, set())
    # Scripted: GPU 3 free; GPUs 4-7 partial (2/4, 1/4, 1/2, 1/2) -> 2+3+1+1 stranded; 7 GPUs in use where
    # 3 whole + ceil(3/4) + ceil(2/2) = 5 would do -> 1.4.
    assert want == {"free_whole": 1, "partial": 4, "stranded_slots": 7, "packing_ratio": pytest.approx(1.4)}
    for k, v in want.items():
        assert alloc[k] == (pytest.approx(v) if isinstance(v, float) else v), f"{k}: {alloc[k]} != {v}"
    assert alloc["fenced"] == 0
    assert set(alloc["resources"]) >= {GPU, SHARED, MIG}
    assert alloc["unmapped"] == [] and alloc["unmapped_total"] == 0


def test_agent_process_metrics_show_the_map(env: Env) -> None:
    """The long-running agent (`gpu-ready run` with podResources on) exports the map on /metrics."""
    assert env.expected
    env.agent = AgentProc(
        env.cp, env.sim, NODE, workdir=env.workdir, extra={"--pod-resources": "true", **_pr_socket(env)}
    ).start()
    a = env.agent
    t0 = time.monotonic()
    try:
        wait_for(lambda: a.metric("gpu_ready_pod_resources_up") == 1, 120, 0.2, "gpu_ready_pod_resources_up 1")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{env.diag()}") from None
    TIMES["agent start -> first pod-resources read s"] = time.monotonic() - t0
    want = _summary_from(env, env.expected, set())
    assert a.metric("gpu_ready_free_whole_gpus") == want["free_whole"]
    assert a.metric("gpu_ready_partial_gpus") == want["partial"]
    assert a.metric("gpu_ready_stranded_slots") == want["stranded_slots"]
    assert a.metric("gpu_ready_packing_ratio") == pytest.approx(want["packing_ratio"])
    assert a.metric("gpu_ready_fenced_gpus") == 0
    for bus, e in env.expected.items():
        labels = {"pci_bus_id": bus.nvml}
        assert a.metric("gpu_ready_gpu_allocated_slots", labels) == e["allocated"], bus
        assert a.metric("gpu_ready_gpu_pods", labels) == len({p[:2] for p in e["pods"]}), bus
        assert a.metric("gpu_ready_gpu_slots", labels) == _slots(env, bus), bus


def _pr_socket(env: Env) -> dict[str, str]:
    return {"--pod-resources-socket": str(env.pod_resources_socket)}


def test_unhealthy_device_shows_the_gpu_fenced(env: Env) -> None:
    """The plugin marks the free whole GPU unhealthy: kubelet drops it from allocatable and the agent shows it
    fenced (and no longer free); healthy again, it is free again."""
    assert env.expected
    uu = env.sim.gpu_uuids()
    free = [b for b, _, _ in uu[: len(WHOLE)] if env.expected[b]["allocated"] == 0]
    assert len(free) == 1
    bus = free[0]
    gpu_uuid = env.uuid_to_bus()
    uuid = next(u for u, b in gpu_uuid.items() if b == bus)
    env.plugins[GPU].set_health(uuid, False)
    t0 = time.monotonic()

    def fenced() -> dict[str, Any] | None:
        alloc = env.check_json().get("allocation")
        return alloc if alloc and alloc["fenced"] == 1 else None

    try:
        alloc = wait_for(fenced, 120, 0.5, f"{bus} fenced in gpu-ready check")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{env.diag()}") from None
    TIMES["device unhealthy in the plugin -> fenced in check s"] = time.monotonic() - t0
    g = _agent_gpus(alloc)[bus]
    assert g["fenced"] is True and g["state"] == "fenced", g
    assert alloc["free_whole"] == 0
    assert [str(b) for b, x in _agent_gpus(alloc).items() if x["fenced"]] == [str(bus)]
    if env.agent is not None:
        a = env.agent
        wait_for(lambda: a.metric("gpu_ready_fenced_gpus") == 1, 60, 0.2, "gpu_ready_fenced_gpus 1")
        assert a.metric("gpu_ready_gpu_fenced", {"pci_bus_id": bus.nvml}) == 1
    env.plugins[GPU].set_health(uuid, True)
    wait_for(
        lambda: (a := env.check_json().get("allocation")) and a["fenced"] == 0 and a["free_whole"] == 1,
        120,
        0.5,
        "GPU healthy again",
    )


def test_kubelet_restart_is_survived(env: Env) -> None:
    """kubelet restarts (its registration and pod-resources sockets are re-created, the plugin sockets removed):
    every plugin re-registers, and the agent's map is back, equal to the Pods' allocations."""
    assert env.expected
    before = {r: len(p.registrations) for r, p in env.plugins.items()}
    took = env.node.restart_kubelet()
    TIMES["kubelet restart (sockets back, healthz) s"] = took
    t0 = time.monotonic()
    try:
        for r, p in env.plugins.items():
            wait_registered(p, before[r] + 1, 120)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{env.diag()}") from None
    TIMES["kubelet restart -> plugins re-registered s"] = time.monotonic() - t0
    assert env.node.kubelet is not None and env.node.kubelet.poll() is None
    want_alloc = {GPU: str(len(WHOLE)), SHARED: str(REPLICAS * len(SHARED_GPUS)), MIG: str(MIG_PER_GPU * len(MIG_GPUS))}
    wait_for(lambda: all(_node_allocatable(env).get(k) == v for k, v in want_alloc.items()), 120, 0.2, "allocatable")
    # The containers keep their devices (kubelet restores its allocations from its checkpoint).
    assert _expected_from_containers(env) == env.expected
    assert env.agent is not None, "needs test_agent_process_metrics_show_the_map"

    def back() -> bool:
        return (
            _map_matches(env, env.check_json().get("allocation")) == ""
            and env.agent is not None
            and (env.agent.metric("gpu_ready_pod_resources_up") == 1)
        )

    try:
        wait_for(back, 180, 0.5, "the agent's map after the kubelet restart")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{env.diag()}") from None
    TIMES["kubelet restart -> map back s"] = time.monotonic() - t0
    want = _summary_from(env, env.expected, set())
    a = env.agent
    wait_for(lambda: a.metric("gpu_ready_free_whole_gpus") == want["free_whole"], 60, 0.2, "free whole GPUs back")
    assert a.metric("gpu_ready_packing_ratio") == pytest.approx(want["packing_ratio"])
    assert a.proc is not None and a.proc.poll() is None, "the agent survived the kubelet restart"
    for pod in PODS:
        assert _phase(env, pod) == "Running", pod


def test_bad_gpu_sends_events_to_the_pods_on_it(env: Env) -> None:
    """A fatal Xid on a shared GPU: one GPUUnhealthy Event (about the Node, naming the pod) for each Pod holding a
    slot of it, none for the others, and the condition message counts the affected pods."""
    assert env.expected and env.agent is not None
    uu = env.sim.gpu_uuids()
    pos = SHARED_GPUS[0]
    bus = uu[pos][0]
    holders = {p for _, p, _ in env.expected[bus]["pods"]}
    others = set(PODS) - holders
    assert len(holders) == 2, holders
    t0 = time.monotonic()
    env.sim.append_xid(79, gpu=pos)

    def events() -> dict[str, list[dict[str, Any]]]:
        """The blast-radius Events about the Node, by the pod each names."""
        items = env.api.request("GET", f"/apis/events.k8s.io/v1/namespaces/{EVENT_NAMESPACE}/events")["items"]
        out: dict[str, list[dict[str, Any]]] = {}
        for ev in items:
            reg = ev.get("regarding") or {}
            named = re.search(rf"; pod {env.ns}/(\S+) holds", ev.get("note") or "")
            if ev.get("reason") == "GPUUnhealthy" and reg.get("kind") == "Node" and reg.get("name") == env.node.name:
                out.setdefault(named.group(1) if named else "", []).append(ev)
        return out

    try:
        got = wait_for(lambda: (e := events()) and set(e) >= holders and e, 120, 0.3, f"Events on {holders}")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{env.diag()}") from None
    TIMES["fatal Xid -> Events on the pods holding the GPU s"] = time.monotonic() - t0
    a = env.agent
    want_msg = f"{len(holders)} pods on the affected GPUs"
    c = wait_for(lambda: (c := a.gpu_ready(env.api)) and want_msg in c["message"] and c, 60, 0.2, want_msg)
    assert c["status"] == "False"
    got = events()
    assert set(got) == holders, f"Events on {sorted(got)}; want only {sorted(holders)} (not {sorted(others)})"
    for pod, evs in got.items():
        assert len(evs) == 1, f"{pod}: {len(evs)} Events"
        ev = evs[0]
        assert bus.nvml in ev["note"] and uu[pos][1] in ev["note"] and "79" in ev["note"], ev["note"]
        assert ev["type"] == "Warning" and ev["reportingController"] == "gpu-ready"
    assert env.agent.metric("gpu_ready_gpu_pods", {"pci_bus_id": bus.nvml}) == len(holders)
    # Still no Event on the others after more polls of the agent.
    n = env.sim.smi_call_count()
    wait_for(lambda: env.sim.smi_call_count() >= n + 3, 60, 0.2, "three more agent polls")
    assert set(events()) == holders


def test_gpus_table_from_the_node(env: Env) -> None:
    """`gpu-ready gpus` on the node: one row per GPU and the summary line (printed for the issue's closing note)."""
    assert env.expected
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent",
            "gpus",
            *env.sim.check_args(),
            *_pr_socket_args(env),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:3] == ["INDEX", "BUS", "ID"], lines[0]
    assert sum(1 for ln in lines if PciAddress.parse(ln.split()[1] if len(ln.split()) > 1 else "")) == 8
    assert any(ln.startswith("Summary:") for ln in lines)
    print("\n[allocation node] gpu-ready gpus:\n" + r.stdout)


def _pr_socket_args(env: Env) -> list[str]:
    return ["--pod-resources-socket", str(env.pod_resources_socket)]


def test_plugin_start_fails_clearly_without_kubelet(tmp_path: Path) -> None:
    """A plugin whose kubelet never serves the registration socket says so instead of hanging."""
    p = DevicePlugin(GPU, {"GPU-x": "GPU-x"}, plugin_dir=tmp_path)
    with pytest.raises(RuntimeError, match="could not register with kubelet"):
        p.start(timeout=0.5)
    assert not p.socket.exists()


def test_device_plugin_stubs_match_the_vendored_proto(tmp_path: Path) -> None:
    """The committed stubs are what `make protos` makes from the vendored proto (same command, same bytes)."""
    try:
        import grpc_tools  # noqa: F401
    except ImportError:
        skip_or_fail("grpcio-tools (dev extra) is not installed")
    src = REPO / "testkit" / "proto"
    (tmp_path / "testkit" / "proto").mkdir(parents=True)
    (tmp_path / "testkit" / "proto" / "deviceplugin_v1beta1.proto").write_bytes(
        (src / "deviceplugin_v1beta1.proto").read_bytes()
    )
    args = [
        "-I",
        ".",
        "--python_out=.",
        "--pyi_out=.",
        "--grpc_python_out=.",
        "testkit/proto/deviceplugin_v1beta1.proto",
    ]
    r = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", *args], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    for name in ("deviceplugin_v1beta1_pb2.py", "deviceplugin_v1beta1_pb2.pyi", "deviceplugin_v1beta1_pb2_grpc.py"):
        assert (tmp_path / "testkit" / "proto" / name).read_bytes() == (src / name).read_bytes(), name
