"""gpu-ready's taint on its own Node (agent/act/taints/): the pure planner on plain data, and the reporter against a
real kube-apiserver with the REAL kube-scheduler (binding) and kube-controller-manager (NoExecute taint
eviction). No kubelet runs: binding and taint eviction are control-plane behaviour; pod status is set by
the test where it matters."""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from agent.act.taints.plan import (
    EFFECTS,
    NO_EXECUTE,
    NO_SCHEDULE,
    TAINT_KEY,
    TaintMode,
    TaintPlan,
    TaintSettings,
    apply_plan,
    own_effects,
    plan_taints,
    taint_patch,
)
from agent.act.taints.reporter import TaintReporter
from agent.kube.client import ApiError, KubeApi
from agent.model import LatchedFault, Observation, PciAddress, Reason, Status, Verdict
from agent.report.condition import ConditionReporter
from agent.report.events import EventReporter
from agent.report.metrics import TaintMetrics
from agent.settings import qualified_name
from agent.verdict import decide
from testkit.cluster import AGENT_RULES, service_account_client
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

TAINT_RULES = [*AGENT_RULES, {"apiGroups": [""], "resources": ["nodes"], "verbs": ["patch"]}]
HEALTHY = Verdict(Status.TRUE, Reason.GPUS_HEALTHY, "8 GPUs healthy")
STARTUP = TaintSettings(mode=TaintMode.STARTUP)
CONTINUOUS = TaintSettings(mode=TaintMode.CONTINUOUS)
CONTINUOUS_NX = TaintSettings(mode=TaintMode.CONTINUOUS, no_execute_on_fatal=True)
MEASURED: dict[str, float] = {}


def fatal_xid_verdict() -> Verdict:
    """What the agent's verdict is after an Xid 79 (fallen off the bus) was latched."""
    gpu = PciAddress.parse("0000:3b:00")
    fault = LatchedFault(79, "0000:3b:00", gpu, "xid", "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus", 0)
    v = decide(Observation(), [fault])
    assert v.status is Status.FALSE and v.reason is Reason.FATAL_XID
    return v


# -- the planner, on plain data ------------------------------------------------------------------------------


def plan(
    status: Status,
    taints: list[dict[str, Any]],
    settings: TaintSettings = STARTUP,
    fatal: bool = False,
    gate: bool = True,
) -> TaintPlan:
    return plan_taints(status, "R", fatal, taints, settings, gate)


def test_startup_gate_opens_on_true_and_never_closes():
    assert plan(Status.TRUE, [*OTHERS, STARTUP_TAINT]).remove == (NO_SCHEDULE,)
    assert not plan(Status.TRUE, OTHERS)  # nothing of ours: no change, no request
    for status in (Status.FALSE, Status.UNKNOWN):
        assert not plan(status, OTHERS)  # startup mode never adds
        assert not plan(status, [STARTUP_TAINT])  # and leaves the startup taint while not ready
    assert not plan(Status.FALSE, OTHERS, TaintSettings(TaintMode.STARTUP, True, True), fatal=True)


def test_gate_waits_for_preflight_and_off_mode_does_nothing():
    assert not plan(Status.TRUE, [STARTUP_TAINT], gate=False)  # requirePreflight on, not passed yet
    assert not plan(Status.TRUE, [STARTUP_TAINT, {"key": TAINT_KEY, "effect": NO_EXECUTE}], CONTINUOUS, gate=False)
    off = TaintSettings()
    assert off.mode is TaintMode.OFF  # the default
    assert not plan(Status.TRUE, [STARTUP_TAINT], off)
    assert not plan(Status.FALSE, OTHERS, off, fatal=True)


def test_continuous_mode_follows_the_verdict():
    assert plan(Status.FALSE, OTHERS, CONTINUOUS).add == (NO_SCHEDULE,)
    assert plan(Status.FALSE, OTHERS, CONTINUOUS, fatal=True).add == (NO_SCHEDULE,)  # NoExecute not asked for
    p = plan(Status.FALSE, OTHERS, CONTINUOUS_NX, fatal=True)
    assert (p.add, p.remove) == ((NO_SCHEDULE, NO_EXECUTE), ())
    assert "fatal" in p.why
    both = [STARTUP_TAINT, {"key": TAINT_KEY, "effect": NO_EXECUTE}]
    assert not plan(Status.FALSE, both, CONTINUOUS_NX, fatal=True)  # already as wanted
    # The latch was cleared but the node is still False: NoExecute goes, NoSchedule stays.
    p = plan(Status.FALSE, both, CONTINUOUS_NX, fatal=False)
    assert (p.add, p.remove) == ((), (NO_EXECUTE,))
    p = plan(Status.TRUE, [*OTHERS, *both], CONTINUOUS_NX)
    assert (p.add, p.remove) == ((), (NO_EXECUTE, NO_SCHEDULE))
    # An entry with our key and an effect we never set is ours to correct.
    p = plan(Status.FALSE, [{"key": TAINT_KEY, "effect": "PreferNoSchedule"}], CONTINUOUS)
    assert (p.add, p.remove) == ((NO_SCHEDULE,), ("PreferNoSchedule",))


def test_unknown_leaves_taints_unless_treated_as_false():
    assert not plan(Status.UNKNOWN, OTHERS, CONTINUOUS_NX)
    assert not plan(Status.UNKNOWN, [STARTUP_TAINT], CONTINUOUS_NX)  # and does not remove either
    as_false = TaintSettings(mode=TaintMode.CONTINUOUS, unknown_as_false=True)
    assert plan(Status.UNKNOWN, OTHERS, as_false).add == (NO_SCHEDULE,)


def test_apply_plan_touches_only_our_entries():
    mine = {"key": TAINT_KEY, "value": "pending", "effect": NO_SCHEDULE}
    current = [OTHERS[0], mine, OTHERS[1], OTHERS[2]]
    assert apply_plan(current, TaintPlan(remove=(NO_SCHEDULE,)), 0) == OTHERS
    added = apply_plan(OTHERS, TaintPlan(add=(NO_SCHEDULE, NO_EXECUTE)), 1_796_000_000)
    assert added[:3] == OTHERS
    assert added[3:] == [
        {"key": TAINT_KEY, "effect": NO_SCHEDULE},
        {"key": TAINT_KEY, "effect": NO_EXECUTE, "timeAdded": "2026-11-30T00:53:20Z"},
    ]
    assert apply_plan([mine], TaintPlan(add=(NO_SCHEDULE,)), 0) == [mine]  # never a duplicate key+effect
    ops = taint_patch(None, added)
    assert ops[0] == {"op": "test", "path": "/spec/taints", "value": None}
    assert ops[1]["op"] == "add" and ops[1]["value"] == added


def test_a_configured_key_is_the_only_one_touched():
    custom = TaintSettings(mode=TaintMode.CONTINUOUS, key="example.com/gpu-gate")
    current = [STARTUP_TAINT, {"key": "example.com/gpu-gate", "effect": NO_SCHEDULE}]
    p = plan_taints(Status.TRUE, "R", False, current, custom, True)
    assert p.remove == (NO_SCHEDULE,)
    assert apply_plan(current, p, 0, custom.key) == [STARTUP_TAINT]  # the default key is someone else's now
    assert qualified_name(TAINT_KEY) == TAINT_KEY and qualified_name("plain-name") == "plain-name"
    for bad in ("", "a/", "/b", "Bad_Prefix.io/x", "x/" + "n" * 64, "a b/c", "x/-y"):
        with pytest.raises(ValueError):
            qualified_name(bad)


_taint = st.fixed_dictionaries(
    {"key": st.sampled_from([TAINT_KEY, "nvidia.com/gpu", "example.com/a"]), "effect": st.sampled_from(EFFECTS)},
    optional={"value": st.sampled_from(["", "x"]), "timeAdded": st.just("2026-11-30T08:00:00Z")},
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_taint, max_size=8),
    st.sampled_from(list(Status)),
    st.booleans(),
    st.booleans(),
    st.sampled_from([STARTUP, CONTINUOUS, CONTINUOUS_NX, TaintSettings(TaintMode.CONTINUOUS, True, True)]),
)
def test_plans_never_touch_other_taints_and_converge(current, status, fatal, gate, cfg):
    p = plan_taints(status, "R", fatal, current, cfg, gate)
    after = apply_plan(current, p, 0)
    assert [t for t in after if t["key"] != TAINT_KEY] == [t for t in current if t["key"] != TAINT_KEY]
    assert not plan_taints(status, "R", fatal, after, cfg, gate)  # one step reaches the wanted state
    if cfg.mode is TaintMode.STARTUP:
        assert own_effects(after) <= own_effects(current)  # the start-up gate never adds


def test_taint_metrics_show_what_is_on_the_node():
    reg = CollectorRegistry()
    m = TaintMetrics(reg)
    assert reg.get_sample_value("gpu_ready_taint", {"effect": NO_SCHEDULE}) is None  # unknown before a read
    m.observe(own_effects([*OTHERS, STARTUP_TAINT]))
    assert reg.get_sample_value("gpu_ready_taint", {"effect": NO_SCHEDULE}) == 1
    assert reg.get_sample_value("gpu_ready_taint", {"effect": NO_EXECUTE}) == 0
    m.changed(TaintPlan(add=(NO_EXECUTE,), remove=(NO_SCHEDULE,)))
    assert reg.get_sample_value("gpu_ready_taint_changes_total", {"change": "added", "effect": NO_EXECUTE}) == 1
    assert reg.get_sample_value("gpu_ready_taint_changes_total", {"change": "removed", "effect": NO_SCHEDULE}) == 1


# -- on a control plane with the real scheduler and taint-eviction controller (`sched_plane`, tests/conftest.py) --


@pytest.fixture(scope="module", autouse=True)
def report_measured() -> Iterator[None]:
    yield
    if MEASURED:
        print("\n[taints] measured: " + ", ".join(f"{k} {v:.2f}s" for k, v in MEASURED.items()))


@dataclass
class Agent:
    """The agent's reporters on its own Node, as the runner drives them, with a token bound to a Pod on that
    node."""

    api: KubeApi
    condition: ConditionReporter
    taints: TaintReporter
    events: EventReporter
    registry: CollectorRegistry
    pod: str
    namespace: str
    requests: list[tuple[str, int]]

    def publish(self, v: Verdict, latched_fatal: bool, gate_open: bool = True) -> TaintPlan:
        """One publish step: read the Node (the poll's one GET), write the condition, reconcile the taint,
        flush the Events."""
        node = self.api.get_node(self.taints.node)
        if self.condition.due(v):
            self.condition.write(v)
        p = self.taints.reconcile(v, latched_fatal, gate_open, node)
        self.events.flush()
        return p

    def gauge(self, effect: str) -> float | None:
        return self.registry.get_sample_value("gpu_ready_taint", {"effect": effect})


def agent_token(plane: SchedulerPlane, node: str) -> tuple[str, str, str]:
    """A ServiceAccount with the agent's rules plus `patch nodes`, and a token bound to a Pod on `node` that
    tolerates every taint from its creation, as the DaemonSet's pods do (created later, it would be evicted
    by the admin's NoExecute taint before it could be given the toleration). Returns token, namespace, pod."""
    api, info = service_account_client(plane.admin, TAINT_RULES)
    api.close()
    ns, sa = info["namespace"], info["service_account"]
    pod = plane.admin.request(
        "POST",
        f"/api/v1/namespaces/{ns}/pods",
        {
            "metadata": {"name": f"gpu-ready-{secrets.token_hex(3)}"},
            "spec": {
                "nodeName": node,
                "serviceAccountName": sa,
                "tolerations": [{"operator": "Exists"}],
                "containers": [{"name": "agent", "image": "gpu-ready:test"}],
            },
        },
    )
    ref = {"kind": "Pod", "apiVersion": "v1", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}
    spec = {"audiences": ["https://kubernetes.default.svc"], "expirationSeconds": 3600, "boundObjectRef": ref}
    tr = plane.admin.request(
        "POST",
        f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
    )
    return tr["status"]["token"], ns, pod["metadata"]["name"]


@pytest.fixture
def agent_for(sched_plane: SchedulerPlane) -> Iterator[Callable[[str, TaintSettings], Agent]]:
    made: list[Agent] = []

    def _make(node: str, settings: TaintSettings) -> Agent:
        token, ns, pod = agent_token(sched_plane, node)
        requests: list[tuple[str, int]] = []
        api = KubeApi.from_token(
            sched_plane.control_plane.host,
            token,
            sched_plane.control_plane.ca_file,
            on_request=lambda verb, code: requests.append((verb, code)),
        )
        reg = CollectorRegistry()
        events = EventReporter(api, node)
        agent = Agent(
            api,
            ConditionReporter(api, node, heartbeat_s=300),
            TaintReporter(api, node, settings, events, TaintMetrics(reg)),
            events,
            reg,
            pod,
            ns,
            requests,
        )
        made.append(agent)
        return agent

    yield _make
    for a in made:
        a.api.close()


def taint_events(plane: SchedulerPlane, node: str) -> list[dict[str, Any]]:
    items = plane.admin.request("GET", "/apis/events.k8s.io/v1/namespaces/default/events")["items"]
    return [
        e
        for e in items
        if e.get("regarding", {}).get("name") == node and e.get("reason") in ("TaintAdded", "TaintRemoved")
    ]


@pytest.mark.apiserver
def test_startup_taint_holds_gpu_pod_until_gpu_ready(sched_plane, agent_for):
    plane = sched_plane
    node = register_node(plane, [*OTHERS, STARTUP_TAINT])
    agent = agent_for(node, STARTUP)
    waiting = gpu_pod(plane, node, TOLERATE_OTHERS)
    cond = plane.wait(lambda: unschedulable(plane, waiting), "the GPU Pod to be unschedulable")
    # kube-scheduler 1.36 no longer names the key in the message ("node(s) had untolerated taint(s)"); a Pod
    # that tolerates exactly gpu-ready's key is bound to the same node, so it is this taint that holds it.
    assert "untolerated taint" in cond["message"], cond
    control = gpu_pod(plane, node, [*TOLERATE_OTHERS, {"key": TAINT_KEY, "operator": "Exists"}])
    plane.wait(lambda: bound_to(plane, control, node), "the Pod that tolerates the startup taint to be bound")
    assert unschedulable(plane, waiting)

    # Not ready yet: the agent leaves the startup taint (and makes no taint request at all).
    not_ready = Verdict(Status.FALSE, Reason.NVIDIA_SMI_FAILED, "nvidia-smi failed")
    assert not agent.publish(not_ready, latched_fatal=False)
    assert [v for v, _ in agent.requests] == ["GET", "PATCH"]  # the poll's Node read and the condition
    assert node_taints(plane, node) == [*OTHERS, STARTUP_TAINT]
    assert agent.gauge(NO_SCHEDULE) == 1
    # The preflight gate is still closed: True alone does not open the node.
    assert not agent.taints.reconcile(HEALTHY, False, startup_gate_open=False)

    t0 = time.monotonic()
    done = agent.publish(HEALTHY, latched_fatal=False)
    t_patched = time.monotonic()
    assert done.remove == (NO_SCHEDULE,) and not done.add
    plane.wait(lambda: bound_to(plane, waiting, node), "the GPU Pod to be bound after GPUReady=True", timeout=30)
    MEASURED["GPUReady=True -> Pod bound"] = time.monotonic() - t0
    MEASURED["taint removed -> Pod bound"] = time.monotonic() - t_patched
    assert node_taints(plane, node) == OTHERS  # everyone else's taints, unchanged and in order
    assert agent.gauge(NO_SCHEDULE) == 0
    reasons = [e["reason"] for e in plane.wait(lambda: taint_events(plane, node), "a TaintRemoved Event")]
    assert reasons == ["TaintRemoved"]

    # The gate never closes again outside continuous mode, and a steady state costs no taint request.
    n = len(agent.requests)
    assert not agent.publish(fatal_xid_verdict(), latched_fatal=True)
    assert not agent.publish(HEALTHY, latched_fatal=False)
    assert [v for v, _ in agent.requests[n:]] == ["GET", "PATCH", "GET", "PATCH"]  # reads and conditions only
    assert node_taints(plane, node) == OTHERS


@pytest.mark.apiserver
def test_continuous_mode_fatal_xid_blocks_new_pods_and_evicts_running_ones(sched_plane, agent_for):
    plane = sched_plane
    node = register_node(plane, list(OTHERS))
    agent = agent_for(node, CONTINUOUS_NX)
    assert not agent.publish(HEALTHY, latched_fatal=False)  # healthy, nothing of ours on the node
    running = gpu_pod(plane, node, TOLERATE_OTHERS)
    plane.wait(lambda: bound_to(plane, running, node), "the running Pod to be bound while healthy")
    plane.admin.request(
        "PATCH",
        f"/api/v1/namespaces/{plane.namespace}/pods/{running}/status",
        {"status": {"phase": "Running"}},
        "application/strategic-merge-patch+json",
    )
    # A Pod that tolerates gpu-ready's NoSchedule but not its NoExecute: evicted as well.
    tolerant = gpu_pod(plane, node, [*TOLERATE_OTHERS, {"key": TAINT_KEY, "operator": "Exists", "effect": NO_SCHEDULE}])
    plane.wait(lambda: bound_to(plane, tolerant, node), "the second Pod to be bound while healthy")

    v = fatal_xid_verdict()
    t0 = time.monotonic()
    done = agent.publish(v, latched_fatal=True)
    assert done.add == (NO_SCHEDULE, NO_EXECUTE) and not done.remove
    mine = plane.wait(lambda: [t for t in node_taints(plane, node) if t["key"] == TAINT_KEY], "gpu-ready's taint")
    MEASURED["fatal verdict -> taint on the Node"] = time.monotonic() - t0
    assert {t["effect"] for t in mine} == {NO_SCHEDULE, NO_EXECUTE}
    assert [t for t in node_taints(plane, node) if t["key"] != TAINT_KEY] == OTHERS

    def evicted(name: str) -> dict[str, Any] | None:
        try:
            pod = get_pod(plane, name)
        except ApiError as e:
            return {"deleted": True} if e.status == 404 else None
        c = pod_condition(pod, "DisruptionTarget")
        if pod["metadata"].get("deletionTimestamp") and c and c.get("reason") == "DeletionByTaintManager":
            return c
        return None

    plane.wait(lambda: evicted(running), "the running Pod to be evicted by the taint-eviction controller")
    MEASURED["fatal verdict -> running Pod evicted"] = time.monotonic() - t0
    plane.wait(lambda: evicted(tolerant), "the NoSchedule-only tolerant Pod to be evicted")
    fresh = gpu_pod(plane, node, TOLERATE_OTHERS)
    plane.wait(lambda: unschedulable(plane, fresh), "a new GPU Pod to stay unscheduled")
    agent_pod = plane.admin.request("GET", f"/api/v1/namespaces/{agent.namespace}/pods/{agent.pod}")
    assert not agent_pod["metadata"].get("deletionTimestamp"), json.dumps(agent_pod)  # the agent tolerates all
    assert (agent.gauge(NO_SCHEDULE), agent.gauge(NO_EXECUTE)) == (1, 1)

    # Recovered (the verdict's hysteresis already passed): both entries go, the waiting Pod is bound.
    t0 = time.monotonic()
    done = agent.publish(HEALTHY, latched_fatal=False)
    assert done.remove == (NO_EXECUTE, NO_SCHEDULE)
    plane.wait(lambda: bound_to(plane, fresh, node), "the new Pod to be bound after recovery", timeout=30)
    MEASURED["recovery: GPUReady=True -> Pod bound"] = time.monotonic() - t0
    assert node_taints(plane, node) == OTHERS
    assert (agent.gauge(NO_SCHEDULE), agent.gauge(NO_EXECUTE)) == (0, 0)
    events = plane.wait(lambda: len(taint_events(plane, node)) == 2 and taint_events(plane, node), "two Events")
    notes = {e["reason"]: e["note"] for e in events}
    assert f"{TAINT_KEY}:{NO_EXECUTE}" in notes["TaintAdded"] and "FatalXid" in notes["TaintAdded"]
    assert "TaintRemoved" in notes


@pytest.mark.apiserver
def test_a_concurrent_taint_change_is_never_clobbered(sched_plane, agent_for):
    plane = sched_plane
    node = register_node(plane, [])  # no taints at all: spec.taints absent
    agent = agent_for(node, CONTINUOUS)
    stale = agent.api.get_node(node)
    # Between the agent's read and its write, an admin and the device plugin add taints of their own.
    plane.admin.patch_node(node, {"spec": {"taints": OTHERS[:2]}})
    failing = fatal_xid_verdict()
    done = agent.taints.reconcile(failing, latched_fatal=True, startup_gate_open=True, node=stale)
    assert done.add == (NO_SCHEDULE,)
    assert ("PATCH", 422) in agent.requests  # the test op caught the stale list ...
    assert node_taints(plane, node) == [*OTHERS[:2], {"key": TAINT_KEY, "effect": NO_SCHEDULE}]  # ... and re-planned
    # A watch cache may hand the poll a copy from before the patch, read after it: the reporter plans from its own
    # newer copy instead (by resourceVersion), so it does not patch again.
    newest = agent.taints.newest
    assert newest is not None and agent.taints.freshest(stale, read_at=newest[1] + 60) is newest[0]
    fresh = agent.api.get_node(node)
    assert agent.taints.freshest(fresh, read_at=newest[1] + 60) is fresh

    # A change made while the agent removes its entry survives too.
    stale = agent.api.get_node(node)
    plane.admin.patch_node(node, {"spec": {"taints": [*node_taints(plane, node), OTHERS[2]]}})
    assert agent.taints.reconcile(HEALTHY, False, True, node=stale).remove == (NO_SCHEDULE,)
    assert node_taints(plane, node) == OTHERS

    # Unknown leaves the taint as it is in continuous mode (no request), unless treated as False.
    unknown = Verdict(Status.UNKNOWN, Reason.CHECK_FAILED, "CheckFailed: nvidia_smi: timed out")
    n = len(agent.requests)
    assert not agent.taints.reconcile(unknown, False, True, node=agent.api.get_node(node))
    assert len(agent.requests) == n + 1  # the GET only
    agent.taints.settings = TaintSettings(mode=TaintMode.CONTINUOUS, unknown_as_false=True)
    assert agent.taints.reconcile(unknown, False, True).add == (NO_SCHEDULE,)
    assert node_taints(plane, node)[-1] == {"key": TAINT_KEY, "effect": NO_SCHEDULE}


@pytest.mark.apiserver
def test_a_token_without_patch_nodes_gets_a_clear_error(sched_plane):
    plane = sched_plane
    node = register_node(plane, [STARTUP_TAINT])
    api, _ = service_account_client(plane.admin, AGENT_RULES, pod_on_node=node)  # no `patch nodes`
    try:
        now = [1000.0]
        reporter = TaintReporter(api, node, STARTUP, mono=lambda: now[0], retry_cap_s=10)
        with pytest.raises(ApiError) as e:
            reporter.reconcile(HEALTHY, False, True)
        assert e.value.status == 403
        assert node_taints(plane, node) == [STARTUP_TAINT]  # never reported as removed
        assert reporter.last_taints is None
        # Its own backoff (the condition writes have theirs): 0.5 s doubling, equal jitter (half to all), capped.
        assert reporter.failures == 1 and 1000.25 <= reporter.retry_at <= 1000.5 and not reporter.due()
        for _ in range(8):
            now[0] = reporter.retry_at
            assert reporter.due()
            with pytest.raises(ApiError):
                reporter.reconcile(HEALTHY, False, True)
        assert reporter.failures == 9 and reporter.retry_at - now[0] <= 10
        # The Node it read is newer than a poll's read from before: plans start from it, not the stale one.
        assert reporter.newest is not None and reporter.freshest({"stale": True}, 999.0) is reporter.newest[0]
        assert reporter.freshest({"fresh": True}, now[0] + 1) == {"fresh": True}
    finally:
        api.close()


# -- settings and the chart's wiring ------------------------------------------------------------------------------


def test_taint_and_condition_settings_are_validated():
    from agent import config

    cfg = config.defaults()
    assert (cfg.taints, cfg.taint_key, cfg.condition_type) == ("off", TAINT_KEY, "GPUReady")
    assert (cfg.taint_no_execute, cfg.taint_unknown_as_false) == (False, False)
    cfg = config.load(
        None,
        environ={
            "GPU_READY_TAINTS": "Continuous",
            "GPU_READY_TAINT_NO_EXECUTE": "true",
            "GPU_READY_CONDITION_TYPE": "nvidia.com/GPUReady",
            "GPU_READY_TAINT_KEY": "startup-taint.cluster-autoscaler.kubernetes.io/gpu-not-ready",
        },
    )
    assert (cfg.taints, cfg.taint_no_execute, cfg.condition_type) == ("continuous", True, "nvidia.com/GPUReady")
    for name, bad in [
        ("taints", "sometimes"),
        ("taint_key", "a b/c"),
        ("taint_key", "x/" + "n" * 64),
        ("condition_type", "nvidia.com/"),
        ("condition_type", "GPU Ready"),
        ("taint_unknown_as_false", "maybe"),
    ]:
        with pytest.raises(config.ConfigError, match=name.replace("_", "-")):
            config.defaults(**{name: bad})


def test_bad_taint_settings_exit_2_with_one_line(tmp_path):
    import subprocess
    import sys

    for flags in (["--taints", "always"], ["--condition-type", "nvidia.com//GPUReady"], ["--taint-key", ""]):
        r = subprocess.run(
            [sys.executable, "-m", "agent", "run", "--node-name", "n1", *flags],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        )
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("gpu-ready: configuration error: invalid "), r.stderr


def test_chart_passes_taint_settings_and_tolerates_the_key_with_every_effect(tmp_path):
    from agent import config
    from testkit.chart import render

    def rendered(*values: str) -> tuple[config.Config, list[dict[str, Any]], list[dict[str, Any]]]:
        docs = render(list(values))
        cm = next(d for d in docs if d["kind"] == "ConfigMap" and "config.yaml" in d["data"])
        f = tmp_path / "config.yaml"
        f.write_text(cm["data"]["config.yaml"])
        ds = next(d for d in docs if d["kind"] == "DaemonSet")
        role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "gpu-ready")
        return config.load(None, environ={"GPU_READY_CONFIG": str(f)}), ds["spec"]["template"]["spec"], role["rules"]

    cfg, pod, rules = rendered()
    assert (cfg.taints, cfg.taint_key, cfg.condition_type) == ("off", TAINT_KEY, "GPUReady")
    assert pod["tolerations"][0] == {"key": TAINT_KEY, "operator": "Exists"}  # no effect: NoSchedule and NoExecute
    nodes_verbs = next(r["verbs"] for r in rules if r["resources"] == ["nodes"])
    assert "get" in nodes_verbs and "patch" not in nodes_verbs  # no `patch nodes` with taints off

    key = "startup-taint.cluster-autoscaler.kubernetes.io/gpu-not-ready"
    cfg, pod, rules = rendered(
        *("--set", "taints.enabled=true", "--set", "taints.mode=continuous", "--set", f"taints.key={key}"),
        *("--set", "taints.noExecuteOnFatal=true", "--set", "taints.unknownAsFalse=true"),
        *("--set", "conditionType=nvidia.com/GPUReady"),
    )
    assert (cfg.taints, cfg.taint_key, cfg.taint_no_execute, cfg.taint_unknown_as_false) == (
        "continuous",
        key,
        True,
        True,
    )
    assert cfg.condition_type == "nvidia.com/GPUReady"
    assert {"key": key, "operator": "Exists"} in pod["tolerations"]
    assert {"key": TAINT_KEY, "operator": "Exists"} not in pod["tolerations"]
    assert "patch" in next(r["verbs"] for r in rules if r["resources"] == ["nodes"])
    cfg, _, _ = rendered("--set", "taints.enabled=true")
    assert cfg.taints == "startup"  # the chart's default mode once enabled


def test_mode_off_reports_the_taint_it_sees_and_writes_nothing():
    """A node pool that adds the startup taint while the agent's taints are off: no request (the token has no
    `patch nodes`), but gpu_ready_taint shows the taint, so GPUNodeTaintedTooLong can say why the node is out."""
    from typing import cast

    reg = CollectorRegistry()
    reporter = TaintReporter(cast(KubeApi, None), "n1", TaintSettings(), metrics=TaintMetrics(reg))
    assert reporter.due()
    assert not reporter.reconcile(HEALTHY, False, True)  # no Node given: nothing read, nothing reported
    assert reg.get_sample_value("gpu_ready_taint", {"effect": NO_SCHEDULE}) is None
    assert not reporter.reconcile(HEALTHY, False, True, node={"spec": {"taints": [*OTHERS, STARTUP_TAINT]}})
    assert reg.get_sample_value("gpu_ready_taint", {"effect": NO_SCHEDULE}) == 1
    assert reg.get_sample_value("gpu_ready_taint", {"effect": NO_EXECUTE}) == 0
    assert reporter.newest is None and reporter.failures == 0


def test_what_the_node_shows_for_check_and_adopt():
    """`gpu-ready check --node-json` (on_node) and the runner's adopt read the configured condition type; a
    malformed saved Node never raises."""
    from agent.report.condition import find_condition, on_node, render_on_node

    node = {
        "spec": {"taints": [*OTHERS, STARTUP_TAINT, {"key": TAINT_KEY, "effect": NO_EXECUTE}]},
        "status": {
            "conditions": [
                {"type": "GPUReady", "status": "True", "reason": "GPUsHealthy"},
                {"type": "nvidia.com/GPUReady", "status": "False", "reason": "FatalXid", "lastTransitionTime": "t"},
            ]
        },
    }
    shown = on_node(node, "nvidia.com/GPUReady", TAINT_KEY)
    assert shown["condition"]["status"] == "False" and shown["condition"]["reason"] == "FatalXid"
    assert shown["taintEffects"] == [NO_EXECUTE, NO_SCHEDULE]
    assert render_on_node(shown)[-1] == (
        f"On the Node now: nvidia.com/GPUReady=False (FatalXid) since t; {TAINT_KEY}: {NO_EXECUTE}, {NO_SCHEDULE}"
    )
    assert find_condition(node)["status"] == "True"  # the default type
    empty = on_node({}, "GPUReady", "example.com/other")
    assert empty["condition"] is None and empty["taintEffects"] == []
    assert render_on_node(empty)[-1] == "On the Node now: no GPUReady condition; no example.com/other taint"
    for bad in ({"status": []}, {"status": {"conditions": {"a": 1}}}, {"status": {"conditions": [1, None]}}):
        assert find_condition(bad) is None
    for bad_spec in ([], {"taints": {"x": 1}}, {"taints": [1, "x", None]}):
        assert on_node({"spec": bad_spec}, "GPUReady", TAINT_KEY)["taintEffects"] == []
