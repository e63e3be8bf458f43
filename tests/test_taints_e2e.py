"""gpu-ready's taint end to end: the REAL agent process (`gpu-ready run`, testkit.harness.AgentProc)
on a simulated GPU host, configured by the chart's rendered ConfigMap and holding a token of the chart's
ServiceAccount (the chart's RBAC and CEL admission policies applied to the apiserver), against the real
kube-scheduler (binding) and kube-controller-manager (NoExecute taint eviction).

No kubelet runs: binding and taint eviction are control-plane behaviour; the test sets a bound Pod's phase
where it matters. Times measured here are printed at the end of the module (`pytest -s`)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.act.taints.plan import NO_EXECUTE, NO_SCHEDULE, TAINT_KEY
from agent.kube.client import ApiError, KubeApi
from testkit.chart import Release, apply_release
from testkit.cluster import condition
from testkit.harness import AgentProc, first_times, wait_for
from testkit.scheduling import (
    OTHERS,
    STARTUP_TAINT,
    TOLERATE_OTHERS,
    SchedulerPlane,
    bound_to,
    get_pod,
    gpu_pod,
    node_taints,
    pod_condition,
    register_node,
    unschedulable,
)
from testkit.security import denied_by_policy
from testkit.simhost import SimHost

pytestmark = pytest.mark.apiserver

MEASURED: dict[str, list[float]] = {}


def measured(what: str, seconds: float) -> None:
    MEASURED.setdefault(what, []).append(seconds)


@pytest.fixture(scope="module", autouse=True)
def report_measured() -> Iterator[None]:
    yield
    if MEASURED:
        print(
            "\n[taints e2e] measured: "
            + "; ".join(f"{k}: {', '.join(f'{v:.2f}s' for v in vs)}" for k, vs in MEASURED.items())
        )


# -- the chart on the scheduler plane ------------------------------------------------------------------------

RELEASES = {
    # startup gate, with requirePreflight: the taint goes once the node is True and labelled preflight=passed
    "startup": ["--set", "taints.enabled=true", "--set", "config.requirePreflight=true"],
    # continuous, NoExecute for latched fatal faults, and gpu-operator's condition type
    "continuous": [
        "--set",
        "taints.enabled=true",
        "--set",
        "taints.mode=continuous",
        "--set",
        "taints.noExecuteOnFatal=true",
        "--set",
        "conditionType=nvidia.com/GPUReady",
    ],
    # taints off: no `patch nodes`, and the admission policy lets no taint entry change
    "off": [],
}


@dataclass
class Chart:
    plane: SchedulerPlane
    releases: dict[str, Release]
    workdir: Path

    def config_file(self, name: str) -> Path:
        """The release's rendered ConfigMap, as the DaemonSet mounts it."""
        cm = next(d for d in self.releases[name].docs if d["kind"] == "ConfigMap" and "config.yaml" in d["data"])
        path = self.workdir / f"{name}-config.yaml"
        path.write_text(cm["data"]["config.yaml"])
        return path

    def daemonset_tolerations(self, name: str) -> list[dict[str, Any]]:
        ds = next(d for d in self.releases[name].docs if d["kind"] == "DaemonSet")
        return list(ds["spec"]["template"]["spec"]["tolerations"])

    def token(self, name: str, node: str) -> str:
        """A token of the release's ServiceAccount bound to a Pod on `node`, as the DaemonSet's Pod gets it.
        The Pod carries the DaemonSet's tolerations (gpu-ready's own key with every effect: its NoExecute must
        not evict the agent and end the token) plus the admin's taints on the test nodes (TOLERATE_OTHERS: the
        chart's `tolerations` value in a cluster with such taints; without them the taint-eviction controller
        evicts the Pod for the admin's NoExecute taint, whoever adds gpu-ready's)."""
        rel, admin = self.releases[name], self.plane.admin
        pod = admin.request(
            "POST",
            f"/api/v1/namespaces/{rel.ns}/pods",
            {
                "metadata": {"name": f"gpu-ready-{secrets.token_hex(3)}"},
                "spec": {
                    "nodeName": node,
                    "serviceAccountName": rel.fullname,
                    "automountServiceAccountToken": False,
                    "tolerations": [*self.daemonset_tolerations(name), *TOLERATE_OTHERS],
                    "containers": [{"name": "agent", "image": "gpu-ready:test"}],
                },
            },
        )
        ref = {"kind": "Pod", "apiVersion": "v1", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}
        tr = admin.request(
            "POST",
            f"/api/v1/namespaces/{rel.ns}/serviceaccounts/{rel.fullname}/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {
                    "audiences": ["https://kubernetes.default.svc"],
                    "expirationSeconds": 3600,
                    "boundObjectRef": ref,
                },
            },
        )
        return str(tr["status"]["token"])

    def agent_pod(self, name: str, node: str) -> list[dict[str, Any]]:
        rel = self.releases[name]
        pods = self.plane.admin.request("GET", f"/api/v1/namespaces/{rel.ns}/pods")["items"]
        return [p for p in pods if p["spec"].get("nodeName") == node]


@pytest.fixture(scope="module")
def chart(sched_plane: SchedulerPlane, tmp_path_factory: pytest.TempPathFactory) -> Chart:
    cp = sched_plane.control_plane
    work = tmp_path_factory.mktemp("taints-e2e")
    kc = cp.kubeconfig(work / "admin.kubeconfig")
    releases = {name: apply_release(cp, kc, f"tt{name[:4]}", values) for name, values in RELEASES.items()}
    c = Chart(sched_plane, releases, work)
    # The policies take a moment to load: wait until each release's agent token is denied, by that release's
    # own-node policy, a condition write on a Node other than its own (RBAC allows it; only the policy says no).
    own, other = register_node(sched_plane, []), register_node(sched_plane, [])
    cond = {"type": "GPUReady", "status": "True", "reason": "Probe", "message": "policy probe"}
    for name, rel in releases.items():
        client = KubeApi.from_token(cp.host, c.token(name, own), cp.ca_file)
        try:
            wait_for(
                lambda client=client, rel=rel: denied_by_policy(
                    lambda: client.patch_node_status(other, {"status": {"conditions": [cond]}}),
                    f"{rel.fullname}-own-node-only",
                ),
                60,
                0.2,
                f"the {name} release's admission policy to take effect",
            )
        finally:
            client.close()
    return c


@pytest.fixture
def launch(chart: Chart, tmp_path: Path) -> Iterator[Callable[..., AgentProc]]:
    procs: list[AgentProc] = []

    def _launch(release: str, node: str, host: SimHost | None = None, **extra: str) -> AgentProc:
        h = host or SimHost(tmp_path / f"host-{node}")
        flags = {"--config": str(chart.config_file(release)), "--event-namespace": "default", **extra}
        p = AgentProc(chart.plane.control_plane, h, node, chart.token(release, node), extra=flags, workdir=tmp_path)
        procs.append(p.start())
        return p

    yield _launch
    for p in procs:
        p.terminate()


# -- helpers -------------------------------------------------------------------------------------------------


def cond_of(plane: SchedulerPlane, node: str, ctype: str) -> dict[str, Any] | None:
    return condition(plane.admin.get_node(node), ctype)


def wait_cond(
    plane: SchedulerPlane, agent: AgentProc, ctype: str, status: str, reason: str | None = None, timeout: float = 60
) -> dict[str, Any]:
    def ok() -> dict[str, Any] | None:
        c = cond_of(plane, agent.node, ctype)
        return c if c and c["status"] == status and (reason is None or c["reason"] == reason) else None

    try:
        return wait_for(ok, timeout, what=f"{ctype}={status} {reason or ''}")
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- agent log ---\n{agent.logs()[-4000:]}{plane.logs()}") from None


def cycles_pass(host: SimHost, n: int, timeout: float = 60) -> None:
    """Waits until the agent has run nvidia-smi n more times (n more check cycles)."""
    start = host.smi_call_count()
    wait_for(lambda: host.smi_call_count() >= start + n, timeout, what=f"{n} more check cycles")


def ours(plane: SchedulerPlane, node: str) -> list[dict[str, Any]]:
    return [t for t in node_taints(plane, node) if t["key"] == TAINT_KEY]


def not_ours(plane: SchedulerPlane, node: str) -> list[dict[str, Any]]:
    return [t for t in node_taints(plane, node) if t["key"] != TAINT_KEY]


def taint_events(plane: SchedulerPlane, node: str) -> list[dict[str, Any]]:
    items = plane.admin.request("GET", "/apis/events.k8s.io/v1/namespaces/default/events")["items"]
    return [
        e
        for e in items
        if e.get("regarding", {}).get("name") == node and e.get("reason") in ("TaintAdded", "TaintRemoved")
    ]


def evicted(plane: SchedulerPlane, name: str) -> dict[str, Any] | None:
    try:
        pod = get_pod(plane, name)
    except ApiError as e:
        return {"deleted": True} if e.status == 404 else None
    c = pod_condition(pod, "DisruptionTarget")
    if pod["metadata"].get("deletionTimestamp") and c and c.get("reason") == "DeletionByTaintManager":
        return c
    return None


# -- the tests -----------------------------------------------------------------------------------------------


def test_chart_grants_patch_nodes_only_with_taints_on_and_the_agent_tolerates_its_taint(chart):
    for name, rel in chart.releases.items():
        role = next(d for d in rel.docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == rel.fullname)
        nodes = next(r for r in role["rules"] if r["resources"] == ["nodes"])
        assert ("patch" in nodes["verbs"]) is (name != "off"), name
        assert {"key": TAINT_KEY, "operator": "Exists"} in chart.daemonset_tolerations(name)  # every effect
        cfg = yaml.safe_load(chart.config_file(name).read_text())
        assert cfg["taints"] == {"startup": "startup", "continuous": "continuous", "off": "off"}[name]
        assert cfg["taintKey"] == TAINT_KEY


def test_startup_taint_holds_the_gpu_pod_until_the_agent_reports_ready(chart, launch):
    plane = chart.plane
    node = register_node(plane, [*OTHERS, STARTUP_TAINT])  # joined with the startup taint (kubelet, Karpenter)
    waiting = gpu_pod(plane, node, TOLERATE_OTHERS)
    plane.wait(lambda: unschedulable(plane, waiting), "the GPU Pod to be unschedulable on the tainted node")

    agent = launch("startup", node)
    # requirePreflight: not labelled preflight=passed yet, so False and the startup gate stays closed.
    wait_cond(plane, agent, "GPUReady", "False", "PreflightNotPassed")
    cycles_pass(agent.host, 3)
    assert node_taints(plane, node) == [*OTHERS, STARTUP_TAINT]
    assert unschedulable(plane, waiting)
    wait_for(lambda: agent.metric("gpu_ready_taint", {"effect": NO_SCHEDULE}) == 1, 20, what="gpu_ready_taint 1")

    plane.admin.patch_node(node, {"metadata": {"labels": {"preflight": "passed"}}})
    seen = first_times(
        {
            "true": lambda: (cond_of(plane, node, "GPUReady") or {}).get("status") == "True",
            "untainted": lambda: not ours(plane, node),
            "bound": lambda: bound_to(plane, waiting, node),
        },
        60,
        "GPUReady=True, the taint removed and the Pod bound",
    )
    measured("GPUReady=True -> Pod bound (startup gate)", seen["bound"] - seen["true"])
    measured("taint removed -> Pod bound", seen["bound"] - seen["untainted"])
    assert node_taints(plane, node) == OTHERS  # everyone else's taints, unchanged and in order
    reasons = [e["reason"] for e in plane.wait(lambda: taint_events(plane, node), "a TaintRemoved Event")]
    assert reasons == ["TaintRemoved"]
    assert agent.metric("gpu_ready_taint", {"effect": NO_SCHEDULE}) == 0
    assert agent.metric("gpu_ready_taint_changes_total", {"change": "removed", "effect": NO_SCHEDULE}) == 1

    # Startup mode never adds the taint back, even for a fatal Xid.
    agent.host.append_xid(79, 5)
    wait_cond(plane, agent, "GPUReady", "False", "FatalXid")
    cycles_pass(agent.host, 3)
    assert node_taints(plane, node) == OTHERS
    assert agent.metric("gpu_ready_taint_changes_total", {"change": "added"}) is None
    # The taint went only after the condition said True (one loop thread writes both, in this order).
    logs = agent.logs()
    assert logs.index('"status": "True"') < logs.index('"event": "taint changed"'), logs[-3000:]


def test_continuous_fatal_xid_taints_evicts_and_survives_a_restart_until_cleared(chart, launch):
    plane = chart.plane
    ctype = "nvidia.com/GPUReady"
    node = register_node(plane, list(OTHERS))
    agent = launch("continuous", node)
    wait_cond(plane, agent, ctype, "True", "GPUsHealthy")
    assert cond_of(plane, node, "GPUReady") is None  # only the configured condition type is written
    assert ours(plane, node) == []

    running = gpu_pod(plane, node, TOLERATE_OTHERS)
    plane.wait(lambda: bound_to(plane, running, node), "the Pod to be bound while the node is healthy")
    plane.admin.request(
        "PATCH",
        f"/api/v1/namespaces/{plane.namespace}/pods/{running}/status",
        {"status": {"phase": "Running"}},
        "application/strategic-merge-patch+json",
    )

    t0 = time.monotonic()
    agent.host.append_xid(79, 5)  # GPU 5 fell off the bus: a latched fatal fault
    seen = first_times(
        {
            "false": lambda: (cond_of(plane, node, ctype) or {}).get("status") == "False",
            "tainted": lambda: {t["effect"] for t in ours(plane, node)} == {NO_SCHEDULE, NO_EXECUTE},
        },
        60,
        f"{ctype}=False and both taint entries",
    )
    measured("fatal Xid appended -> NoSchedule+NoExecute on the Node", seen["tainted"] - t0)
    measured("fatal Xid appended -> condition False", seen["false"] - t0)
    assert not_ours(plane, node) == OTHERS
    assert cond_of(plane, node, ctype)["reason"] == "FatalXid"

    plane.wait(lambda: evicted(plane, running), "the running Pod to be evicted by the taint-eviction controller")
    measured("fatal Xid appended -> running Pod evicted", time.monotonic() - t0)
    fresh = gpu_pod(plane, node, TOLERATE_OTHERS)
    plane.wait(lambda: unschedulable(plane, fresh), "a new GPU Pod to stay unscheduled")
    (agent_pod,) = chart.agent_pod("continuous", node)
    assert not agent_pod["metadata"].get("deletionTimestamp")  # the agent tolerates its own taint
    notes = {e["reason"]: e["note"] for e in plane.wait(lambda: taint_events(plane, node), "a TaintAdded Event")}
    assert f"{TAINT_KEY}:{NO_EXECUTE}" in notes["TaintAdded"] and "FatalXid" in notes["TaintAdded"]
    assert ctype in notes["TaintAdded"]

    # Never a patch planned from a stale copy (the poll reads a watch cache that lags the agent's own patch).
    assert not agent.metric("gpu_ready_api_requests_total", {"verb": "PATCH", "code": "422"}), agent.logs()[-3000:]

    # Shutdown never removes the taint, and a restarted agent keeps it: the fault is latched on the host.
    assert agent.terminate() == 0
    assert {t["effect"] for t in ours(plane, node)} == {NO_SCHEDULE, NO_EXECUTE}
    again = launch("continuous", node, host=agent.host)
    wait_for(lambda: again.http("/readyz")[0] == 200, 60, what="the restarted agent's first cycle")
    cycles_pass(again.host, 3)
    assert cond_of(plane, node, ctype)["status"] == "False"
    # It adopted the configured condition type's False from the Node (the first agent found none to hold).
    assert again.logs().count("holding the existing GPUReady=False") == 1
    assert {t["effect"] for t in ours(plane, node)} == {NO_SCHEDULE, NO_EXECUTE}
    assert unschedulable(plane, fresh)

    # The operator clears the latch after the repair: True after the hysteresis, taint gone, Pod bound.
    before = (datetime.now(UTC) + timedelta(seconds=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    plane.admin.patch_node(node, {"metadata": {"annotations": {"gpu-ready.io/clear-before": before}}})
    seen = first_times(
        {
            "true": lambda: (cond_of(plane, node, ctype) or {}).get("status") == "True",
            "bound": lambda: bound_to(plane, fresh, node),
        },
        60,
        f"{ctype}=True and the waiting Pod bound",
    )
    measured("recovery: condition True -> Pod bound", seen["bound"] - seen["true"])
    assert node_taints(plane, node) == OTHERS
    removed = plane.wait(
        lambda: [e for e in taint_events(plane, node) if e["reason"] == "TaintRemoved"], "a TaintRemoved Event"
    )
    assert f"{TAINT_KEY}:{NO_EXECUTE}" in removed[0]["note"]
    assert not again.metric("gpu_ready_api_requests_total", {"verb": "PATCH", "code": "422"}), again.logs()[-3000:]


def test_a_refused_taint_write_never_holds_back_the_condition(chart, launch):
    """Taints on in the agent but the chart's taints off (no `patch nodes`): every taint write is refused,
    the condition is written anyway, the refusal is logged once and counted, and the taint is left as it is."""
    plane = chart.plane
    node = register_node(plane, [STARTUP_TAINT])
    agent = launch("off", node, **{"--taints": "continuous"})
    wait_cond(plane, agent, "GPUReady", "True")
    wait_for(
        lambda: (agent.metric("gpu_ready_api_requests_total", {"verb": "PATCH", "code": "403"}) or 0) >= 2,
        30,
        what="refused taint patches, retried",
    )
    agent.host.append_xid(79, 5)
    wait_cond(plane, agent, "GPUReady", "False", "FatalXid", timeout=30)
    cycles_pass(agent.host, 2)
    assert node_taints(plane, node) == [STARTUP_TAINT]  # never reported as removed, never changed
    logs = agent.logs()
    assert logs.count('"request": "write taint"') == 1 and '"state": "forbidden"' in logs, logs[-3000:]
    assert agent.proc is not None and agent.proc.poll() is None
