"""`gpu-ready controller` on the real apiserver with the real kube-controller-manager's Job controller: the
controller runs with the chart's own RBAC and admission policy (its token), creates the chart's preflight Job
pinned to each node labelled needs-preflight, keeps maxConcurrent, gives up at the retry cap with an Event,
adopts a running Job after a crash instead of starting a second one, and a standby takes the Lease. These
Nodes have no kubelet: the test ends a Job's pod the way kubelet would report it (pod status), and the real Job
controller completes or fails the Job."""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.kube.client import ApiError, KubeApi
from testkit.chart import Release, apply_release
from testkit.controller import (
    VALUES,
    RunningController,
    finish_pod,
    gpu_node,
    job_pods,
    job_template,
    jobs_control_plane,
    jobs_of,
)
from testkit.controlplane import ControlPlane
from testkit.harness import wait_for
from testkit.security import denied_by_policy

NEEDS = {"gpu-ready.io/needs-preflight": "true"}
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def jobs_plane() -> Iterator[ControlPlane]:
    with jobs_control_plane() as cp:
        yield cp


@pytest.fixture(scope="module")
def release(jobs_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Release:
    kc = jobs_plane.kubeconfig(tmp_path_factory.mktemp("kc") / "admin")
    rel = apply_release(jobs_plane, kc, "ctl", VALUES)
    admin = jobs_plane.admin()
    # the policy is loaded once it denies a Job of another pod spec (policies take a moment to load)
    api = _ctl_api(jobs_plane, rel)
    bad = {"metadata": {"name": "probe", "labels": {"gpu-ready.io/managed-by": "gpu-ready-controller"}},
           "spec": {"template": {"spec": {"restartPolicy": "Never", "nodeName": "x",
                                          "containers": [{"name": "c", "image": "busybox"}]}}}}  # fmt: skip
    assert wait_for(
        lambda: denied_by_policy(
            lambda: api.request("POST", f"/apis/batch/v1/namespaces/{rel.ns}/jobs", bad), "controller-bounds"
        ),
        TIMEOUT,
    )
    with contextlib.suppress(ApiError):  # made before the policy loaded
        admin.request("DELETE", f"/apis/batch/v1/namespaces/{rel.ns}/jobs/probe")
    admin.close()
    return rel


def _ctl_api(cp: ControlPlane, rel: Release) -> KubeApi:
    from testkit.controller import controller_api

    return controller_api(cp, rel)


@pytest.fixture
def admin(jobs_plane: ControlPlane) -> Iterator[KubeApi]:
    """The admin of this module's control plane (not the session's)."""
    api = jobs_plane.admin()
    yield api
    api.close()


@pytest.fixture
def fleet() -> str:
    return secrets.token_hex(4)


@pytest.fixture
def template(release: Release, tmp_path: Path) -> Path:
    return job_template(release, tmp_path / "job.yaml")


@pytest.fixture
def running(jobs_plane: ControlPlane, release: Release, template: Path, fleet: str) -> Iterator[Any]:
    made: list[RunningController] = []

    def _make(identity: str = "a", **kw: Any) -> RunningController:
        rc = RunningController(jobs_plane, release, template, fleet, identity, **kw)
        made.append(rc.start())
        return rc

    yield _make
    for rc in made:
        rc.stop()
    admin = jobs_plane.admin()
    for j in jobs_of(admin, release.ns):  # the next test starts with no Job in the namespace
        admin.request(
            "DELETE", f"/apis/batch/v1/namespaces/{release.ns}/jobs/{j['metadata']['name']}",
            {"propagationPolicy": "Background"},
        )  # fmt: skip
    assert wait_for(lambda: not jobs_of(admin, release.ns), TIMEOUT)
    admin.close()


def _node_jobs(admin: KubeApi, ns: str, node: str) -> list[dict[str, Any]]:
    return [j for j in jobs_of(admin, ns) if j["metadata"]["annotations"].get("gpu-ready.io/preflight-node") == node]


def _end_job(admin: KubeApi, ns: str, job: dict[str, Any], ok: bool) -> None:
    name = job["metadata"]["name"]
    assert wait_for(lambda: job_pods(admin, ns, name), TIMEOUT), f"the Job controller made no pod for {name}"
    finish_pod(admin, ns, job_pods(admin, ns, name)[0], ok)
    want = "Complete" if ok else "Failed"

    def done() -> bool:
        try:
            j = admin.request("GET", f"/apis/batch/v1/namespaces/{ns}/jobs/{name}")
        except ApiError as e:
            if e.status == 404 and not ok:  # deleted by the controller once failed and not needed: fine here
                return True
            raise
        return any(c["type"] == want and c["status"] == "True" for c in j.get("status", {}).get("conditions") or [])

    assert wait_for(done, TIMEOUT), f"Job {name} never {want}"


def test_a_labelled_node_gets_the_charts_job_pinned_to_it(admin, release, running, fleet, jobs_plane):
    plain = gpu_node(admin, fleet)
    node = gpu_node(admin, fleet, NEEDS)
    running("a")
    assert wait_for(lambda: _node_jobs(admin, release.ns, node), TIMEOUT)
    jobs = jobs_of(admin, release.ns)
    assert len(jobs) == 1, [j["metadata"]["name"] for j in jobs]
    job = jobs[0]
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeName"] == node
    assert pod["serviceAccountName"] == f"{release.fullname}-preflight"
    assert [c["name"] for c in pod["initContainers"]] == ["cordon", "gates"]
    assert [c["name"] for c in pod["containers"]] == ["record"]
    assert "affinity" not in pod
    assert not _node_jobs(admin, release.ns, plain)
    # the real Job controller makes its pod, on that node
    assert wait_for(lambda: job_pods(admin, release.ns, job["metadata"]["name"]), TIMEOUT)
    assert job_pods(admin, release.ns, job["metadata"]["name"])[0]["spec"]["nodeName"] == node


def test_max_concurrent_holds_and_a_finished_job_frees_a_slot(admin, release, running, fleet):
    nodes = [gpu_node(admin, fleet, NEEDS) for _ in range(3)]
    rc = running("a", max_concurrent=2)
    assert wait_for(lambda: len(jobs_of(admin, release.ns)) >= 2, TIMEOUT)
    time_passes(rc, 3)  # several rounds later (a resync every 2 s, and every Job event): still two
    assert len(jobs_of(admin, release.ns)) == 2
    assert rc.c.m.created._value.get() == 2
    first = jobs_of(admin, release.ns)[0]
    node_done = first["metadata"]["annotations"]["gpu-ready.io/preflight-node"]
    # preflight passed there: the record step removes the label (done here as the admin) and the pod succeeds
    admin.patch_node(node_done, {"metadata": {"labels": {"gpu-ready.io/needs-preflight": None, "preflight": "passed"}}})
    _end_job(admin, release.ns, first, ok=True)
    rest = [n for n in nodes if n != node_done]
    assert wait_for(lambda: all(_node_jobs(admin, release.ns, n) for n in rest), TIMEOUT)
    assert sum(1 for j in jobs_of(admin, release.ns) if not j.get("status", {}).get("conditions")) <= 2
    # the passed Job is cleaned up
    assert wait_for(lambda: not _node_jobs(admin, release.ns, node_done), TIMEOUT)


def time_passes(rc: RunningController, rounds: int) -> None:
    """Waits until the controller has reconciled `rounds` more times (it reconciles every resync)."""
    seen = [0]
    orig = rc.c.reconcile

    def counting() -> None:
        seen[0] += 1
        orig()

    rc.c.reconcile = counting  # type: ignore[method-assign]
    assert wait_for(lambda: seen[0] >= rounds, 60)
    rc.c.reconcile = orig  # type: ignore[method-assign]


def test_retry_cap_stops_with_an_event(admin, release, running, fleet):
    node = gpu_node(admin, fleet, NEEDS)
    rc = running("a", max_failures=2, backoff=0)
    for attempt in (1, 2):
        assert wait_for(
            lambda a=attempt: any(
                j["metadata"]["labels"].get("gpu-ready.io/preflight-attempt") == str(a)
                for j in _node_jobs(admin, release.ns, node)
            ),
            TIMEOUT,
        ), f"no attempt {attempt}"
        job = next(
            j for j in _node_jobs(admin, release.ns, node)
            if j["metadata"]["labels"]["gpu-ready.io/preflight-attempt"] == str(attempt)
        )  # fmt: skip
        # the record step of a failed run: preflight=failed, node stays cordoned (as the admin here)
        admin.patch_node(node, {"metadata": {"labels": {"preflight": "failed"}}, "spec": {"unschedulable": True}})
        _end_job(admin, release.ns, job, ok=False)

    def gave_up_event() -> bool:
        evs = admin.request("GET", "/apis/events.k8s.io/v1/namespaces/default/events")["items"]
        return any(e.get("reason") == "PreflightGaveUp" and e["regarding"]["name"] == node for e in evs)

    assert wait_for(gave_up_event, TIMEOUT)
    assert rc.c.m.gave_up._value.get() == 1
    time_passes(rc, 3)
    jobs = _node_jobs(admin, release.ns, node)
    assert len(jobs) == 2 and all(
        any(c["type"] == "Failed" for c in j.get("status", {}).get("conditions") or []) for j in jobs
    )
    n = admin.get_node(node)
    assert n["metadata"]["labels"]["preflight"] == "failed" and n["spec"]["unschedulable"] is True


def test_killed_mid_run_the_standby_takes_the_lease_and_adopts_the_job(admin, release, running, fleet):
    node = gpu_node(admin, fleet, NEEDS)
    a = running("a", lease_duration=6)
    assert wait_for(lambda: a.c.elector.leading, TIMEOUT)
    b = running("b", lease_duration=6)
    assert wait_for(lambda: _node_jobs(admin, release.ns, node), TIMEOUT)
    assert not b.c.elector.leading
    a.crash()
    t0 = time.monotonic()
    assert wait_for(lambda: b.c.elector.leading, 30)
    took = time.monotonic() - t0
    lease = admin.request(
        "GET", f"/apis/coordination.k8s.io/v1/namespaces/{release.ns}/leases/{release.fullname}-controller"
    )
    assert lease["spec"]["holderIdentity"] == "b"
    time_passes(b, 3)
    jobs = _node_jobs(admin, release.ns, node)
    assert len(jobs) == 1, [j["metadata"]["name"] for j in jobs]
    assert b.c.m.created._value.get() == 0  # adopted, not recreated
    assert b.c.m.running._value.get() == 1
    print(f"\n[controller] standby took the Lease {took:.1f}s after the holder stopped (lease 6 s)")


def test_the_controller_rewrites_a_brake_configmap_someone_else_changed(admin, release, running, fleet):
    """Deleted, garbled, "everyone admitted", a value near the 1 MiB object limit: each is replaced with what the
    controller computed (its watch on the one ConfigMap sees the change), never left for the agents to read."""
    gpu_node(admin, fleet)
    held = gpu_node(admin, fleet, taints=[{"key": "gpu-ready.io/gpu-not-ready", "effect": "NoSchedule"}])
    name = f"{release.fullname}-brake"
    path = f"/api/v1/namespaces/{release.ns}/configmaps/{name}"
    rc = running(brake=name, max_unavailable="1")

    def data() -> dict[str, str] | None:
        try:
            return dict(admin.request("GET", path).get("data") or {})
        except ApiError as e:
            assert e.status == 404
            return None

    assert wait_for(lambda: (data() or {}).get("admitted") == held, TIMEOUT)
    good = data()
    assert good is not None and good["selector"] == f"gpu-ready.io/test-fleet={fleet}"
    everyone = ",".join(n["metadata"]["name"] for n in admin.request("GET", "/api/v1/nodes")["items"])
    tampers = [
        ("deleted", lambda: admin.request("DELETE", path)),
        ("garbled", lambda: admin.request("PUT", path, {"metadata": {"name": name}, "data": {"admitted": "\x00??"}})),
        ("everyone admitted", lambda: admin.request("PUT", path, {"metadata": {"name": name},
                                                                  "data": {**good, "admitted": everyone}})),
        ("a 900 KiB value", lambda: admin.request("PUT", path, {"metadata": {"name": name},
                                                                "data": {**good, "pad": "x" * 900_000}})),
    ]  # fmt: skip
    for what, tamper in tampers:
        before = rc.c.brake_repairs
        tamper()
        assert wait_for(lambda: data() == good, TIMEOUT), (what, data())
        assert rc.c.brake_repairs >= before + 1, what
