"""Per-GPU fencing end to end: the REAL agent process (`gpu-ready run`, testkit.harness.AgentProc)
on a simulated 8-GPU host, configured by the chart's rendered ConfigMap (fencing.enabled, effect NoSchedule) and
holding a token of the chart's ServiceAccount bound to a Pod on its node (the chart's RBAC, including the DRA rules
of templates/fencing.yaml, and its admission policies applied to the apiserver), against the REAL kube-scheduler
allocating ResourceClaims on Kubernetes 1.37.

The node is a DRA node: no `nvidia.com/gpu` capacity, and a ResourceSlice publishing its 8 GPUs exactly as the NVIDIA
DRA driver does (testkit/dra.py: nvidia_slice; the simulated host uses the same PCI bus ids). No kubelet and no
DRA driver run. A fatal Xid line appended to the simulated kernel log must make the agent create the DeviceTaintRule
for that GPU, the scheduler then allocates claims only to the 7 other GPUs, and the `gpu-ready.io/clear-before`
annotation makes the agent delete the rule again, also when the agent that deletes it is not the one that created
it (a restart in between). Times and API writes measured here are printed at the end of the module (`pytest -s`)."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.act.fencing.plan import MANAGED_BY, MANAGED_BY_LABEL, NODE_LABEL, TAINT_KEY
from agent.kube.client import ApiError, KubeApi
from testkit.chart import Release, apply_release
from testkit.cluster import bound_token, condition, ensure_namespace
from testkit.controlplane import ControlPlane
from testkit.dra import (
    BUSES,
    DRIVER,
    DraPlane,
    allocated_device,
    claim_and_pod,
    device_class,
    get_pod,
    gpu_node,
    kube_minor,
    nvidia_slice,
    unschedulable,
)
from testkit.harness import AgentProc, first_times, wait_for
from testkit.security import denied_by_policy
from testkit.simhost import SimHost
from testkit.testbin import IN_CI, require_testbin

pytestmark = pytest.mark.apiserver

BINARIES = ("etcd", "kube-apiserver", "kube-scheduler")
VALUES = ["--set", "fencing.enabled=true", "--set", "fencing.effect=NoSchedule"]
CLEAR_ANNOTATION = "gpu-ready.io/clear-before"
MEASURED: dict[str, list[float]] = {}
WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE")


def measured(what: str, value: float) -> None:
    MEASURED.setdefault(what, []).append(value)


class Plane(DraPlane):
    release: Release
    workdir: Path

    def config_file(self) -> Path:
        """The release's rendered ConfigMap, as the DaemonSet mounts it."""
        cm = next(d for d in self.release.docs if d["kind"] == "ConfigMap" and "config.yaml" in d["data"])
        path = self.workdir / "config.yaml"
        path.write_text(cm["data"]["config.yaml"])
        return path


@pytest.fixture(scope="module")
def fplane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    bd = require_testbin(*BINARIES)
    cp = ControlPlane(bd)
    version = "v1"
    if kube_minor(bd) == 36:  # DeviceTaintRule is beta there: the gate and the beta API (docs/fencing.md)
        version = "v1beta2"
        gate = ["--feature-gates=DRADeviceTaintRules=true"]
        cp.extra_args = {
            "kube-apiserver": [*gate, "--runtime-config=resource.k8s.io/v1beta2=true"],
            "kube-scheduler": gate,
        }
    admin: KubeApi | None = None
    p: Plane | None = None
    work = tmp_path_factory.mktemp("fencing-e2e")
    try:
        cp.start()
        cp.start_scheduler()
        admin = cp.admin()
        served = {r["name"] for r in admin.request("GET", f"/apis/resource.k8s.io/{version}").get("resources", [])}
        if "devicetaintrules" not in served:
            msg = f"this kube-apiserver ({bd}) serves no DeviceTaintRule: Kubernetes 1.37 (or 1.36) is needed"
            if IN_CI:
                pytest.fail(msg, pytrace=False)
            pytest.skip(msg)
        admin.request("POST", "/apis/resource.k8s.io/v1/deviceclasses", device_class("gpu.nvidia.com", "gpu"))
        ns = f"fence-e2e-{secrets.token_hex(3)}"
        ensure_namespace(admin, ns)
        p = Plane(cp, admin, ns, version)
        p.workdir = work
        p.release = apply_release(cp, cp.kubeconfig(work / "admin.kubeconfig"), "fe2e", VALUES)
        probe_policy(p)
        yield p
    finally:
        if p is not None:
            for c in p.clients:
                c.close()
        if admin is not None:
            admin.close()
        cp.stop()
        if MEASURED:
            print(
                "\n[fencing e2e] measured: "
                + "; ".join(f"{k}: {', '.join(f'{v:.3g}' for v in vs)}" for k, vs in MEASURED.items())
            )


def agent_token(p: Plane, node: str) -> str:
    """A token of the release's ServiceAccount bound to a new Pod on `node`, as the DaemonSet's Pod gets it."""
    tok, _ = bound_token(p.admin, p.release.ns, p.release.fullname, node)
    return tok


def probe_policy(p: Plane) -> None:
    """Waits until the release's DeviceTaintRule admission policy is in force: the agent's token of node A may not
    create a rule in node B's pool (RBAC alone would allow it)."""
    a, b = f"probe-{secrets.token_hex(3)}", f"probe-{secrets.token_hex(3)}"
    policy = f"{p.release.fullname}-own-devices-only"
    api = KubeApi.from_token(p.control_plane.host, agent_token(p, a), p.control_plane.ca_file)
    p.clients.append(api)
    rule = {
        "apiVersion": f"resource.k8s.io/{p.version}",
        "kind": "DeviceTaintRule",
        "metadata": {"name": f"gpu-ready.{b}.gpu-0", "labels": {MANAGED_BY_LABEL: MANAGED_BY, NODE_LABEL: b}},
        "spec": {
            "deviceSelector": {"driver": DRIVER, "pool": b, "device": "gpu-0"},
            "taint": {"key": TAINT_KEY, "value": "FatalXid", "effect": "NoSchedule"},
        },
    }

    def denied() -> bool:
        if denied_by_policy(lambda: api.request("POST", p.rules, rule), policy):
            return True
        p.admin.request("DELETE", f"{p.rules}/{rule['metadata']['name']}")  # not yet in force: undo
        return False

    wait_for(denied, 60, 0.2, "the DeviceTaintRule admission policy to take effect")


@pytest.fixture
def launch(fplane: Plane, tmp_path: Path) -> Iterator[Callable[..., AgentProc]]:
    procs: list[AgentProc] = []

    def _launch(node: str, host: SimHost) -> AgentProc:
        flags = {"--config": str(fplane.config_file())}
        proc = AgentProc(fplane.control_plane, host, node, agent_token(fplane, node), extra=flags, workdir=tmp_path)
        procs.append(proc.start())
        return proc

    yield _launch
    for proc in procs:
        proc.terminate()


# -- helpers -------------------------------------------------------------------------------------------------


def dra_host(tmp_path: Path) -> SimHost:
    """The simulated host with the PCI bus ids the ResourceSlice publishes (testkit/dra.py BUSES)."""
    return SimHost(tmp_path / f"host-{secrets.token_hex(2)}", buses=BUSES)


def rule_name(node: str) -> str:
    """The name of the node's first rule: the agent numbers a node's rules from 0 (these tests fence one device)."""
    return f"gpu-ready.{node}.0"


def rule_exists(p: Plane, name: str) -> bool:
    try:
        p.admin.request("GET", f"{p.rules}/{name}")
        return True
    except ApiError as e:
        if e.status == 404:
            return False
        raise


def node_rules(p: Plane, node: str) -> list[dict[str, Any]]:
    items = p.admin.request("GET", p.rules)["items"]
    return [r for r in items if r["spec"]["deviceSelector"].get("pool") == node]


def gpu_ready(p: Plane, node: str) -> dict[str, Any]:
    return condition(p.admin.get_node(node), "GPUReady") or {}


def wait_cond(p: Plane, agent: AgentProc, pred: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
    try:
        return wait_for(lambda: (c := gpu_ready(p, agent.node)) and pred(c) and c, 60, what=what)
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- agent log ---\n{agent.logs()[-4000:]}{p.logs()}") from None


def writes(agent: AgentProc) -> dict[str, float]:
    """The agent's own API write requests so far, by verb (gpu_ready_api_requests_total)."""
    return {v: agent.metric("gpu_ready_api_requests_total", {"verb": v}) or 0.0 for v in WRITE_VERBS}


def fence_log(agent: AgentProc) -> list[dict[str, Any]]:
    """The agent's "fencing changed" log records (one per reconcile that changed rules: its reads and writes)."""
    out = []
    for line in agent.logs().splitlines():
        if '"fencing changed"' in line:
            out.append(json.loads(line))
    return out


def fence_events(p: Plane, node: str) -> list[str]:
    items = p.admin.request("GET", "/apis/events.k8s.io/v1/namespaces/default/events")["items"]
    return sorted(
        e["reason"]
        for e in items
        if e.get("regarding", {}).get("name") == node and e.get("reason") in ("DeviceFenced", "DeviceUnfenced")
    )


def settled_allocation(p: Plane, node: str, jobs: list[tuple[str, str]]) -> dict[str, str | None] | None:
    """All but one claim allocated and the last Pod Unschedulable; None until then."""
    alloc = {c: allocated_device(p, c) for c, _ in jobs}
    waiting = [pod for c, pod in jobs if alloc[c] is None]
    if len(waiting) == 1 and unschedulable(p, waiting[0]):
        return alloc
    return None


def clear_now(p: Plane, node: str) -> None:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    p.admin.patch_node(node, {"metadata": {"annotations": {CLEAR_ANNOTATION: now}}})


# -- the tests -----------------------------------------------------------------------------------------------


def test_the_chart_config_turns_fencing_and_dra_counting_on(fplane):
    cfg = yaml.safe_load(fplane.config_file().read_text())
    assert (cfg["fencing"], cfg["fencingEffect"], cfg["draCounting"], cfg["draDriver"]) == (
        True,
        "NoSchedule",
        True,
        DRIVER,
    )
    role = next(d for d in fplane.release.docs if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-dra"))
    slices = {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"], "verbs": ["list", "watch"]}
    assert slices in role["rules"]


def test_fatal_xid_fences_one_gpu_the_scheduler_serves_seven_and_the_clear_lifts_it(fplane, launch, tmp_path):
    p = fplane
    host = dra_host(tmp_path)
    node = gpu_node(p)  # a DRA node: no nvidia.com/gpu capacity, a ResourceSlice with 8 GPUs
    agent = launch(node, host)
    # DRA-aware counting: zero device-plugin capacity is no DevicePluginUnhealthy on a DRA node.
    c = wait_cond(p, agent, lambda c: c["status"] == "True", "GPUReady=True on the DRA node")
    assert c["reason"] == "GPUsHealthy" and c["message"] == "8 GPUs healthy", c
    wait_for(lambda: agent.metric("gpu_ready_gpus", {"source": "dra"}) == 8, 20, what="gpu_ready_gpus{source=dra} 8")
    assert node_rules(p, node) == []
    before = writes(agent)
    cond_writes = agent.metric("gpu_ready_condition_writes_total") or 0.0

    # A fatal Xid on GPU 3 (bus 5d): the rule for gpu-3, the condition names it, the scheduler keeps off it.
    name = rule_name(node)
    t0 = time.monotonic()
    host.append_xid(79, 3)
    seen = first_times(
        {
            "false": lambda: gpu_ready(p, node).get("reason") == "FatalXid",
            "rule": lambda: rule_exists(p, name),
            "message": lambda: "fenced gpu-3 (NoSchedule)" in gpu_ready(p, node).get("message", ""),
        },
        60,
        "GPUReady=False, the rule for gpu-3 and the message naming it",
    )
    measured("fatal Xid -> GPUReady=False (s)", seen["false"] - t0)
    measured("fatal Xid -> DeviceTaintRule exists (s)", seen["rule"] - t0)
    measured("fatal Xid -> condition message names gpu-3 (s)", seen["message"] - t0)
    (rule,) = node_rules(p, node)
    assert rule["metadata"]["name"] == name
    assert rule["spec"]["deviceSelector"] == {"driver": DRIVER, "pool": node, "device": "gpu-3"}
    assert rule["spec"]["taint"]["key"] == TAINT_KEY and rule["spec"]["taint"]["value"] == "FatalXid"
    assert rule["spec"]["taint"]["effect"] == "NoSchedule"
    msg = gpu_ready(p, node)["message"]
    assert msg.startswith("FatalXid: GPU 3 (00000000:5D:00.0): Xid 79") and len(msg.encode()) <= 1024, msg

    t1 = time.monotonic()
    jobs = [claim_and_pod(p, node) for _ in range(8)]
    alloc = p.wait(lambda: settled_allocation(p, node, jobs), "7 claims allocated and the eighth Pod Unschedulable")
    measured("rule exists -> scheduler placed 7 claims, refused the 8th (s)", time.monotonic() - t1)
    used = sorted(d for d in alloc.values() if d)
    assert used == sorted(f"gpu-{i}" for i in range(8) if i != 3), used
    for claim, pod in jobs:
        if alloc[claim] is not None:
            p.wait(lambda pod=pod: get_pod(p, pod)["spec"].get("nodeName") == node, "the Pod bound")
    eighth_claim, eighth_pod = next((c, pod) for c, pod in jobs if alloc[c] is None)

    # Metrics, the Event, and the cost of the fence.
    wait_for(
        lambda: agent.metric("gpu_ready_fenced_device", {"device": "gpu-3", "reason": "FatalXid"}) == 1,
        20,
        what="gpu_ready_fenced_device{device=gpu-3} 1",
    )
    assert agent.metric("gpu_ready_fence_changes_total", {"change": "created"}) == 1
    wait_for(lambda: fence_events(p, node) == ["DeviceFenced"], 30, what="a DeviceFenced Event")
    (fenced,) = fence_log(agent)
    assert (fenced["created"], fenced["writes"], fenced["fenced"]) == (1, 1, ["gpu-3"])
    measured("DeviceTaintRule writes per fence (GPU without MIG)", fenced["writes"])
    measured("DeviceTaintRule reads per fence (discovery + LIST)", fenced["reads"])
    measured("condition PATCHes per fence", (agent.metric("gpu_ready_condition_writes_total") or 0) - cond_writes)
    after = writes(agent)
    measured("agent API writes per fence, all (rule + condition + Events)", sum(after.values()) - sum(before.values()))

    # Still faulty: polls go by without a rule write.
    start = host.smi_call_count()
    wait_for(lambda: host.smi_call_count() >= start + 4, 30, what="4 more check cycles")
    assert agent.metric("gpu_ready_fence_changes_total", {"change": "created"}) == 1 and len(fence_log(agent)) == 1

    # The operator clears the latched fault: the rule goes, the condition turns True, the eighth claim gets gpu-3.
    before, cond_writes = writes(agent), agent.metric("gpu_ready_condition_writes_total") or 0.0
    t2 = time.monotonic()
    clear_now(p, node)
    seen = first_times(
        {
            "gone": lambda: not rule_exists(p, name),
            "true": lambda: gpu_ready(p, node).get("status") == "True",
            "eighth": lambda: allocated_device(p, eighth_claim) == "gpu-3",
        },
        60,
        "the rule deleted, GPUReady=True and the eighth claim on gpu-3",
    )
    measured("clear-before -> rule deleted (s)", seen["gone"] - t2)
    measured("rule deleted -> eighth claim allocated gpu-3 (s)", seen["eighth"] - seen["gone"])
    p.wait(lambda: get_pod(p, eighth_pod)["spec"].get("nodeName") == node, "the eighth Pod bound")
    wait_cond(p, agent, lambda c: c["message"] == "8 GPUs healthy", "the message without the fenced device")
    wait_for(lambda: len(fence_log(agent)) == 2, 20, what="the unfence logged")
    cleared = fence_log(agent)[1]
    assert (cleared["deleted"], cleared["writes"], cleared["fenced"]) == (1, 1, [])
    measured("DeviceTaintRule writes per clear (GPU without MIG)", cleared["writes"])
    measured("condition PATCHes per clear", (agent.metric("gpu_ready_condition_writes_total") or 0) - cond_writes)
    wait_for(lambda: fence_events(p, node) == ["DeviceFenced", "DeviceUnfenced"], 30, what="a DeviceUnfenced Event")
    measured("agent API writes per clear, all", sum(writes(agent).values()) - sum(before.values()))
    assert agent.metric("gpu_ready_fenced_device", {"device": "gpu-3", "reason": "FatalXid"}) is None
    assert node_rules(p, node) == []


def test_a_restarted_agent_keeps_the_rule_and_deletes_it_on_the_clear(fplane, launch, tmp_path):
    p = fplane
    host = dra_host(tmp_path)
    node = gpu_node(p)
    first = launch(node, host)
    wait_cond(p, first, lambda c: c["status"] == "True", "GPUReady=True")
    host.append_xid(48, 6)  # double-bit ECC on GPU 6 (bus ba): latched until a reboot or a clear
    name = rule_name(node)  # the rule for gpu-6
    p.wait(lambda: rule_exists(p, name), "the rule for gpu-6")
    assert first.terminate() == 0

    # A new agent process (no memory but the latch file): the rule is found by label and kept, not rewritten.
    second = launch(node, host)
    c = wait_cond(p, second, lambda c: "fenced gpu-6 (NoSchedule)" in c["message"], "the message naming gpu-6")
    assert c["status"] == "False" and c["reason"] == "FatalXid"
    start = host.smi_call_count()
    wait_for(lambda: host.smi_call_count() >= start + 3, 30, what="3 check cycles of the new agent")
    assert second.metric("gpu_ready_fence_changes_total", {"change": "created"}) is None
    assert [r["metadata"]["name"] for r in node_rules(p, node)] == [name]

    t0 = time.monotonic()
    clear_now(p, node)
    p.wait(lambda: not rule_exists(p, name), "the restarted agent to delete the rule it did not create")
    measured("clear-before -> rule deleted, by a restarted agent (s)", time.monotonic() - t0)
    assert second.metric("gpu_ready_fence_changes_total", {"change": "deleted"}) == 1
    wait_cond(p, second, lambda c: c["status"] == "True" and c["message"] == "8 GPUs healthy", "GPUReady=True")


def run_check(p: Plane, host: SimHost, node: str, *extra: str) -> tuple[int, dict[str, Any]]:
    kc = p.control_plane.kubeconfig(p.workdir / f"check-{secrets.token_hex(2)}.kubeconfig")
    args = [
        sys.executable,
        "-m",
        "agent",
        "check",
        "--json",
        *host.check_args(),
        "--node",
        node,
        "--kubeconfig",
        str(kc),
    ]
    r = subprocess.run([*args, *extra], capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 1, 3), r.stderr
    return r.returncode, json.loads(r.stdout)


def test_check_counts_from_the_slices_and_lists_the_fenced_devices(fplane, tmp_path):
    p = fplane
    host = dra_host(tmp_path)
    # GPU 6 is on PCI but in no slice: a GPUCountMismatch on that GPU, never DevicePluginUnhealthy for capacity 0.
    node = gpu_node(p, lambda n: nvidia_slice(n, [0, 1, 2, 3, 4, 5, 7]))
    rc, out = run_check(p, host, node)
    assert rc == 1 and out["reason"] == "GPUCountMismatch", out["message"]
    assert out["message"] == "GPUCountMismatch: GPU 6 (00000000:BA:00.0): on PCI but in no gpu.nvidia.com ResourceSlice"
    assert out["counts"]["dra"] == 7 and out["counts"]["plugin_physical"] is None
    assert out["fencing"]["fenced"] == [] and out["fencing"]["errors"] == []
    # With DRA counting off the device-plugin check reads the zero capacity as before.
    rc, out = run_check(p, host, node, "--dra-counting", "false")
    assert rc == 1 and out["reason"] == "DevicePluginUnhealthy" and "dra" not in out["counts"], out

    # A node whose GPU 3 is fenced: check lists the rule, and (the Xid in its kernel log) would keep it.
    node = gpu_node(p)
    rule = {
        "apiVersion": f"resource.k8s.io/{p.version}",
        "kind": "DeviceTaintRule",
        "metadata": {
            "name": rule_name(node),
            "labels": {MANAGED_BY_LABEL: MANAGED_BY, NODE_LABEL: node},
            "annotations": {"gpu-ready.io/gpu": "00000000:5D:00.0"},
        },
        "spec": {
            "deviceSelector": {"driver": DRIVER, "pool": node, "device": "gpu-3"},
            "taint": {"key": TAINT_KEY, "value": "FatalXid", "effect": "NoSchedule"},
        },
    }
    p.admin.request("POST", p.rules, rule)
    host.append_xid(79, 3)
    rc, out = run_check(p, host, node, "--fencing-effect", "NoSchedule")
    assert rc == 1 and out["reason"] == "FatalXid"
    gpu3 = next(g for g in out["gpus"] if g["index"] == 3)
    assert gpu3["reasons"] == ["FatalXid"] and gpu3["unchecked"] == []
    f = out["fencing"]
    assert [(d["device"], d["gpu"], d["effect"]) for d in f["fenced"]] == [("gpu-3", "00000000:5D:00.0", "NoSchedule")]
    assert f["plan"] == {"create": [], "update": [], "delete": []} and f["writes"] == 0
    assert rule_exists(p, rule_name(node))  # check writes nothing
    kc = p.control_plane.kubeconfig(p.workdir / "table.kubeconfig")
    table = subprocess.run(
        [sys.executable, "-m", "agent", "check", *host.check_args(), "--node", node, "--kubeconfig", str(kc)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert table.returncode == 1 and "\nFencing: fenced gpu-3 (NoSchedule)" in table.stdout, table.stdout[-2000:]
    # The Node read from a file: no API, no slices, no fencing section.
    nj = tmp_path / "node.json"
    nj.write_text(json.dumps(p.admin.get_node(node)))
    r = subprocess.run(
        [sys.executable, "-m", "agent", "check", "--json", *host.check_args(), "--node-json", str(nj)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = json.loads(r.stdout)
    assert out["fencing"] is None and "dra" not in out["counts"]


def test_recovery_lifts_the_rule_after_the_proof_and_a_claim_gets_the_gpu_again(fplane, tmp_path):
    """Per-GPU recovery on a DRA node (docs/recovery.md): Xid 119 (RESET_GPU) on GPU 3 fences it; a process holds it,
    so the ladder waits in `resetting` while eight claims come: the scheduler places seven and keeps the eighth off
    gpu-3. The process lets go: GPU 3 is reset once, proven, its latch cleared; the DeviceTaintRule is gone and the
    eighth claim is allocated gpu-3."""
    pytest.importorskip("grpc")  # the pod-resources stand-in (dev extra)
    from testkit.podresources import serve_pod_resources

    p = fplane
    values = [
        *VALUES,
        "--set",
        "recovery.enabled=true",
        "--set",
        "recovery.drainTimeout=300",
        "--set",
        "podResources.enabled=true",
    ]
    rel = apply_release(p.control_plane, p.control_plane.kubeconfig(tmp_path / "admin"), "frec", values)
    cm = next(d for d in rel.docs if d["kind"] == "ConfigMap" and "config.yaml" in d["data"])
    cfg = tmp_path / "config.yaml"
    cfg.write_text(cm["data"]["config.yaml"])
    assert yaml.safe_load(cfg.read_text())["recovery"] is True
    host = dra_host(tmp_path)
    node = gpu_node(p)
    host.hold_gpu(3, 4242)
    with serve_pod_resources() as (sock, _k):
        tok, _ = bound_token(p.admin, rel.ns, rel.fullname, node)
        flags = {
            "--config": str(cfg),
            "--pod-resources": "true",
            "--pod-resources-socket": sock,
            "--pod-resources-interval": "0.1",
        }
        agent = AgentProc(p.control_plane, host, node, tok, extra=flags, workdir=tmp_path).start()
        try:
            wait_cond(p, agent, lambda c: c["status"] == "True", "GPUReady=True on the DRA node")
            name = rule_name(node)
            t0 = time.monotonic()
            host.append_xid(119, 3, text="Timeout after 6s of waiting for RPC response from GPU3 GSP!")
            wait_for(lambda: rule_exists(p, name), 60, 0.05, "the rule for gpu-3")
            bus = "00000000:5D:00.0"
            wait_for(
                lambda: agent.metric("gpu_ready_gpu_recovery_step", {"pci_bus_id": bus, "step": "resetting"}) == 1.0,
                60,
                0.05,
                "the ladder waiting in resetting (a process holds GPU 3)",
            )
            assert host.resets() == []
            jobs = [claim_and_pod(p, node) for _ in range(8)]

            def settled() -> dict[str, str | None] | None:
                alloc = {c: allocated_device(p, c) for c, _ in jobs}
                waiting = [pod for c, pod in jobs if alloc[c] is None]
                placed = sum(d is not None for d in alloc.values()) == 7
                return alloc if placed and len(waiting) == 1 and unschedulable(p, waiting[0]) else None

            alloc = p.wait(settled, "7 claims allocated and the eighth pod Unschedulable")
            assert "gpu-3" not in alloc.values()
            (eighth,) = [c for c, _ in jobs if alloc[c] is None]
            t1 = time.monotonic()
            host.hold_gpu(3)  # the process lets go
            p.wait(lambda: not rule_exists(p, name), "the rule for gpu-3 gone after the proof")
            t_rule = time.monotonic()
            p.wait(lambda: allocated_device(p, eighth) == "gpu-3", "the eighth claim allocated gpu-3")
            measured("recovery: process gone -> rule deleted (s)", t_rule - t1)
            measured("recovery: process gone -> eighth claim on gpu-3 (s)", time.monotonic() - t1)
            measured("recovery: Xid 119 -> rule deleted, with the wait for the process (s)", t_rule - t0)
            assert host.resets() == [f"-r -i {bus}"]
            wait_cond(p, agent, lambda c: c["status"] == "True", "GPUReady=True again")
            assert agent.metric("gpu_ready_gpu_recoveries_total") == 1.0
        finally:
            agent.terminate()
