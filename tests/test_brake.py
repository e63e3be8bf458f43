"""The fleet brake on the real apiserver with simulated GPU nodes: ten real agents (`gpu-ready run`, each on a
simulated host, with the chart's config, RBAC and admission policies and a token bound to a pod on its own Node)
and the controller (in this process, with its own token), maxUnavailable 20 %. Five nodes get a fatal Xid within
a second: every one of them reports False and gets NoSchedule at once, exactly two get NoExecute (the controller
admits two), the others stay NoSchedule only, the brake is visible (ConfigMap, metric, Event); when the nodes
recover (a new boot clears the latch) the taints go and the brake lifts. With no controller installed the agents
take NoExecute as they always did (test_taints_e2e.py covers that path; here: the agent's brake reads "absent")."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.act.brake import engaged_for
from agent.kube.client import ApiError, KubeApi
from testkit.chart import Release, apply_release, by_kind
from testkit.cluster import bound_token, condition
from testkit.controller import VALUES, RunningController, gpu_node, job_template
from testkit.controlplane import ControlPlane
from testkit.harness import AgentProc, wait_for
from testkit.security import denied_by_policy
from testkit.simhost import SimHost

TAINT = "gpu-ready.io/gpu-not-ready"
TIMEOUT = 90.0
BRAKE_VALUES = [*VALUES, "--set", "preflight.auto.brake.maxUnavailable=20%", "--set", "config.preflightAfterFault=true"]


@pytest.fixture(scope="module")
def release(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Release:
    kc = control_plane.kubeconfig(tmp_path_factory.mktemp("kc") / "admin")
    rel = apply_release(control_plane, kc, "brk", BRAKE_VALUES)
    admin = control_plane.admin()
    own, other = gpu_node(admin, "probe"), gpu_node(admin, "probe")
    token, _ = bound_token(admin, rel.ns, rel.sa, own)
    client = KubeApi.from_token(control_plane.host, token, control_plane.ca_file)
    cond = {"type": "GPUReady", "status": "True", "reason": "Probe", "message": "policy probe"}
    assert wait_for(
        lambda: denied_by_policy(
            lambda: client.patch_node_status(other, {"status": {"conditions": [cond]}}), "own-node-only"
        ),
        60,
    )
    client.close()
    admin.close()
    return rel


def taints(admin: KubeApi, node: str) -> set[str]:
    return {t["effect"] for t in admin.get_node(node)["spec"].get("taints") or [] if t["key"] == TAINT}


def brake_cm(admin: KubeApi, rel: Release) -> dict[str, Any] | None:
    try:
        return admin.request("GET", f"/api/v1/namespaces/{rel.ns}/configmaps/{rel.fullname}-brake")
    except ApiError as e:
        if e.status == 404:
            return None
        raise


@pytest.fixture
def fleet(control_plane: ControlPlane, release: Release, tmp_path: Path) -> Iterator[dict[str, Any]]:
    admin = control_plane.admin()
    label = secrets.token_hex(4)
    config = tmp_path / "config.yaml"
    config.write_text(by_kind(release.docs, "ConfigMap")[release.fullname]["data"]["config.yaml"])
    agents: list[AgentProc] = []
    nodes = [gpu_node(admin, label, gpus=2) for _ in range(10)]
    for n in nodes:
        token, _ = bound_token(admin, release.ns, release.sa, n)
        host = SimHost(tmp_path / f"host-{n}", gpus=2)
        flags = {"--config": str(config), "--poll-interval": "5", "--event-namespace": "default"}
        agents.append(AgentProc(control_plane, host, n, token, extra=flags, workdir=tmp_path).start())
    ctl = RunningController(
        control_plane, release, job_template(release, tmp_path / "job.yaml"), label, "a",
        brake=f"{release.fullname}-brake", max_unavailable="20%",
    ).start()  # fmt: skip
    try:
        yield {"admin": admin, "nodes": nodes, "agents": agents, "controller": ctl}
    finally:
        ctl.stop()
        for a in agents:
            a.terminate()
        admin.close()


class NoExecuteSampler:
    """The most nodes seen with gpu-ready's NoExecute at once, sampled until stopped."""

    def __init__(self, admin: KubeApi, nodes: list[str]) -> None:
        self.admin, self.nodes, self.most = admin, nodes, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                n = sum(1 for x in self.nodes if "NoExecute" in taints(self.admin, x))
                self.most = max(self.most, n)
            except ApiError:
                pass
            self.stop.wait(0.05)

    def done(self) -> int:
        self.stop.set()
        self.thread.join(5)
        return self.most


def test_five_faults_in_a_second_two_noexecute_the_rest_noschedule_then_the_brake_lifts(fleet, release):
    admin, nodes, agents, ctl = fleet["admin"], fleet["nodes"], fleet["agents"], fleet["controller"]
    ctype = "GPUReady"
    assert wait_for(
        lambda: all((condition(admin.get_node(n), ctype) or {}).get("status") == "True" for n in nodes), TIMEOUT
    ), "every agent reports True first"
    cm = brake_cm(admin, release)
    assert wait_for(lambda: (brake_cm(admin, release) or {}).get("data", {}).get("gpuNodes") == "10", TIMEOUT)
    cm = brake_cm(admin, release)
    assert cm is not None and cm["data"]["engaged"] == "false" and cm["data"]["maxUnavailable"] == "2"

    sampler = NoExecuteSampler(admin, nodes)
    bad = nodes[:5]
    for a in agents[:5]:
        a.host.append_xid(79, 1)  # GPU 1 fell off the bus: a latched fatal fault
    assert wait_for(lambda: all(taints(admin, n) >= {"NoSchedule"} for n in bad), TIMEOUT), "NoSchedule on all five"
    assert wait_for(lambda: sum(1 for n in bad if "NoExecute" in taints(admin, n)) == 2, TIMEOUT)
    cm = wait_for(lambda: (c := brake_cm(admin, release)) and c["data"]["engaged"] == "true" and c, TIMEOUT)
    admitted = set(cm["data"]["admitted"].split(","))
    assert len(admitted) == 2 and admitted <= set(bad)
    # the count alone is written at the next resync (what the agents act on is written at once)
    assert wait_for(lambda: (brake_cm(admin, release) or {})["data"]["unavailable"] == "5", TIMEOUT)
    # several agent cycles later still exactly the two admitted ones have NoExecute
    polls = [a.host.smi_call_count() for a in agents[:5]]
    assert wait_for(
        lambda: all(a.host.smi_call_count() >= p + 2 for a, p in zip(agents[:5], polls, strict=True)), TIMEOUT
    )
    with_ne = {n for n in bad if "NoExecute" in taints(admin, n)}
    assert with_ne == admitted
    assert all(taints(admin, n) == {"NoSchedule"} for n in set(bad) - admitted)
    assert all(taints(admin, n) == set() for n in nodes[5:])
    assert ctl.c.m.brake._value.get() == 1
    evs = admin.request("GET", f"/apis/events.k8s.io/v1/namespaces/{release.ns}/events")["items"]
    assert any(e["reason"] == "FleetBrakeEngaged" for e in evs)
    # the agents' own view of the brake: held unless admitted
    assert all(engaged_for(cm, n) == (n not in admitted) for n in nodes)
    # the agent marked each faulted node for preflight
    assert all(admin.get_node(n)["metadata"]["labels"].get("gpu-ready.io/needs-preflight") == "true" for n in bad)

    for a in agents[:5]:
        a.host.new_boot()  # a reboot clears the latch
    assert wait_for(lambda: all(taints(admin, n) == set() for n in bad), TIMEOUT), "taints gone after recovery"

    def lifted() -> bool:
        d = (brake_cm(admin, release) or {}).get("data") or {}
        return (d.get("engaged"), d.get("admitted"), d.get("unavailable")) == ("false", "", "0")

    assert wait_for(lifted, TIMEOUT), brake_cm(admin, release)
    assert sampler.done() == 2  # never more than two nodes with NoExecute at any moment sampled


def test_the_agents_brake_is_one_watch_held_until_known_and_follows_the_configmap(control_plane):
    """agent/act/brake.py on the real apiserver: held until the watch's initial state arrived (fails closed), then
    absent -> not held, admitted elsewhere -> held, admitted here -> not held, deleted -> not held; one WATCH
    request for all of it, no GET."""
    from agent.act.brake import Brake

    admin = control_plane.admin()
    ns = f"brake-{secrets.token_hex(3)}"
    admin.request("POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
    api = control_plane.admin()
    calls: list[str] = []
    api.on_request = lambda verb, code: calls.append(verb)
    brake = Brake(api, "node-a", ns, "the-brake")
    assert brake.brake_engaged()  # not known yet: held
    brake.start()
    try:
        assert wait_for(lambda: not brake.brake_engaged(), 30)  # known: no ConfigMap, no controller
        cms = f"/api/v1/namespaces/{ns}/configmaps"
        admin.request("POST", cms, {"metadata": {"name": "the-brake"}, "data": {"engaged": "true", "admitted": "b"}})
        assert wait_for(brake.brake_engaged, 30)
        admin.request("PUT", f"{cms}/the-brake", {"metadata": {"name": "the-brake"}, "data": {"admitted": "b,node-a"}})
        assert wait_for(lambda: not brake.brake_engaged(), 30)
        admin.request("PUT", f"{cms}/the-brake", {"metadata": {"name": "the-brake"}, "data": {"engaged": "false"}})
        assert wait_for(brake.brake_engaged, 30)  # malformed (no admitted): fails closed
        admin.request("DELETE", f"{cms}/the-brake")
        assert wait_for(lambda: not brake.brake_engaged(), 30)
        assert calls == ["WATCH"], calls
    finally:
        brake.stop()
        api.close()
        admin.close()
