"""`gpu-ready controller` as the tests run it: in this process (agent.controller.main.Controller) with the token of
the chart's controller ServiceAccount (its RBAC and admission policy applied by testkit.chart.apply_release), the
Job template from the chart's rendered ConfigMap, and GPU Nodes of the test's own (a label selector of their own,
so that the session's other Nodes are not in its fleet)."""

from __future__ import annotations

import argparse
import contextlib
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agent.controller.main import Controller, add_arguments
from agent.kube.client import KubeApi
from testkit.chart import Release, by_kind
from testkit.cluster import bound_token, create_node
from testkit.controlplane import ControlPlane

VALUES = [
    "--set",
    "preflight.enabled=true",
    "--set",
    "preflight.auto.enabled=true",
    "--set",
    "taints.enabled=true",
    "--set",
    "taints.mode=continuous",
    "--set",
    "taints.noExecuteOnFatal=true",
]


JOB_CONTROLLERS = ("job-controller", "garbage-collector-controller", "resourcequota-controller")


@contextlib.contextmanager
def jobs_control_plane(controllers: tuple[str, ...] = JOB_CONTROLLERS) -> Iterator[ControlPlane]:
    """A control plane of its own with the real Job controller (and the garbage collector, and the quota
    controller that frees a finished pod's quota): the Jobs the controller's token creates make real pods, so a
    test sees what an admitted Job would run. The chart's RuntimeClass exists (the Job's pods need it)."""
    from testkit.cluster import create_runtime_class
    from testkit.testbin import require_testbin

    cp = ControlPlane(require_testbin("kube-apiserver", "etcd", "kube-controller-manager"))
    try:
        cp.start()
        cp.start_controller_manager(controllers)
        admin = cp.admin()
        create_runtime_class(admin)
        admin.close()
        yield cp
    finally:
        cp.stop()


def apply_quotas(admin: KubeApi, rel: Release) -> list[str]:
    """The release's ResourceQuotas (testkit.chart.apply_release applies RBAC and policies only): the pod and Job
    quotas that bound preflight. Returns their names."""
    names = []
    for name, q in by_kind(rel.docs, "ResourceQuota").items():
        admin.request("POST", f"/api/v1/namespaces/{rel.ns}/resourcequotas", q)
        names.append(name)
    return names


def controller_name(rel: Release) -> str:
    return f"{rel.fullname}-controller"


def job_template(rel: Release, path: Path) -> Path:
    cm = by_kind(rel.docs, "ConfigMap")[f"{controller_name(rel)}-job"]
    path.write_text(cm["data"]["job.yaml"])
    return path


def controller_api(cp: ControlPlane, rel: Release) -> KubeApi:
    """A client with the controller ServiceAccount's token (a Deployment's pod runs on no particular node: the
    token is bound to nothing)."""
    token, _ = bound_token(cp.admin(), rel.ns, controller_name(rel))
    return KubeApi.from_token(cp.host, token, cp.ca_file, timeout_s=10.0)


def controller_args(rel: Release, template: Path, fleet: str, identity: str, **kw: Any) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    argv = [
        f"--namespace={rel.ns}",
        f"--job-template={template}",
        f"--job-prefix={rel.fullname}-preflight",
        f"--identity={identity}",
        f"--lease-name={controller_name(rel)}",
        f"--gpu-selector=gpu-ready.io/test-fleet={fleet}",
        "--metrics-address=127.0.0.1:0",
        "--resync=2",
    ]
    for k, v in kw.items():
        argv.append(f"--{k.replace('_', '-')}={v}")
    return p.parse_args(argv)


class RunningController:
    def __init__(self, cp: ControlPlane, rel: Release, template: Path, fleet: str, identity: str, **kw: Any) -> None:
        self.c = Controller(controller_args(rel, template, fleet, identity, **kw), api=controller_api(cp, rel))
        self.thread = threading.Thread(target=self.c.run, daemon=True, name=f"controller-{identity}")

    def start(self) -> RunningController:
        self.thread.start()
        return self

    def crash(self) -> None:
        """Stops acting without handing the Lease over (as a killed process would)."""
        self.c.stop.set()
        self.c.wake.set()
        self.thread.join(10)
        if self.c.started:
            self.c.nodes.stop()
            self.c.jobs.stop()

    def stop(self) -> None:
        self.c.shutdown()
        self.thread.join(10)


def gpu_node(admin: KubeApi, fleet: str, labels: dict[str, str] | None = None, gpus: int = 8, **kw: Any) -> str:
    name = f"gpu-{secrets.token_hex(4)}"
    create_node(
        admin,
        name,
        {"nvidia.com/gpu.present": "true", "gpu-ready.io/test-fleet": fleet, **(labels or {})},
        {"nvidia.com/gpu": str(gpus)},
        **kw,
    )
    return name


def jobs_of(admin: KubeApi, ns: str) -> list[dict[str, Any]]:
    lst = admin.request(
        "GET", f"/apis/batch/v1/namespaces/{ns}/jobs", query={"labelSelector": "gpu-ready.io/managed-by"}
    )
    return [
        j
        for j in lst.get("items") or []
        if not j["metadata"].get("deletionTimestamp")
        and "gpu-ready.io/preflight-node" in (j["metadata"].get("annotations") or {})
    ]


def job_pods(admin: KubeApi, ns: str, job: str) -> list[dict[str, Any]]:
    lst = admin.request("GET", f"/api/v1/namespaces/{ns}/pods", query={"labelSelector": f"job-name={job}"})
    return list(lst.get("items") or [])


def finish_pod(admin: KubeApi, ns: str, pod: dict[str, Any], ok: bool) -> None:
    """What kubelet reports when the Job's pod ends (this apiserver has no kubelet for these Nodes): phase
    Succeeded or Failed with its containers terminated; the real Job controller then completes or fails the Job."""
    from testkit.cluster import now_rfc3339

    t = now_rfc3339()
    term = {"terminated": {"exitCode": 0 if ok else 1, "reason": "Completed" if ok else "Error", "startedAt": t,
                           "finishedAt": t}}  # fmt: skip
    statuses = [
        {"name": c["name"], "image": c["image"], "imageID": "", "ready": False, "restartCount": 0, "state": term}
        for c in pod["spec"]["containers"]
    ]
    admin.request(
        "PATCH",
        f"/api/v1/namespaces/{ns}/pods/{pod['metadata']['name']}/status",
        {"status": {"phase": "Succeeded" if ok else "Failed", "startTime": t, "containerStatuses": statuses}},
        "application/merge-patch+json",
    )
