"""The chart's DaemonSet on a real node: kubelet + containerd on this machine (testkit/node.py), the project's image
built from docker/Dockerfile (tools/node-image), the agent pointed at a simulated GPU host through the chart's
values, each step through `helm install` / `helm upgrade` as a user runs them.

Network rule: the agent pod runs with hostNetwork and reaches the apiserver on 127.0.0.1 (explicit
KUBERNETES_SERVICE_HOST/PORT); kubelet probes it on 127.0.0.1; nothing talks to an address off loopback.

The tests share one node and one release and build on each other in file order (install on a node another
controller tainted NoSchedule -> a rail down -> real Xid -> upgrade during the latched fault -> SIGSTOP -> pod
deleted -> token policy -> the preflight Job), then measure the securityContext alternatives on a fresh release,
then the automatic flow with gpu-ready controller (a joining node -> a fatal Xid marks it -> a reboot keeps it out
until preflight passes again -> a failing gate). Run them alone with `make e2e`."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.kube.client import ApiError, KubeApi
from testkit.cluster import condition, create_node, create_runtime_class
from testkit.controlplane import REPO
from testkit.harness import wait_for
from testkit.node import NodeControlPlane, NodeImages, RealNode, build_containerd, build_images
from testkit.realnode import prerequisites, real_node
from testkit.simhost import SimHost, buses_free_in_kmsg

pytestmark = [pytest.mark.node, pytest.mark.slow]

IN_CI = os.environ.get("CI") == "true"
CHART = Path(os.environ.get("GPU_READY_TEST_CHART") or REPO / "charts" / "gpu-ready")  # another chart dir
NODE = "gpu-node-real"
NS = "gpu-ready"
RELEASE = "gpu-ready"
# Records written to /dev/kmsg from user space carry the user facility; this test seam (an environment variable,
# no setting) lets the agent count them.
TRUST_USER = [{"name": "GPU_READY_KMSG_TRUST_USER", "value": "true"}]
COND = "GPUReady"
TIMES: dict[str, float] = {}  # figures measured here, printed at the end of the module


@dataclass
class Env:
    cp: NodeControlPlane
    node: RealNode
    images: NodeImages
    helm: Path
    kubeconfig: Path
    workdir: Path
    api: KubeApi
    sim: SimHost | None = None
    state_dir: Path | None = None
    metrics_port: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def helm_run(self, *args: str, timeout: float = 420.0) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.helm), *args, "--kubeconfig", str(self.kubeconfig)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, f"helm {' '.join(args[:2])} failed:\n{r.stdout}\n{r.stderr}\n{self.diag()}"
        return r

    def diag(self) -> str:
        return (
            f"--- kubelet ---\n{self.node.log_tail('kubelet', 40)}\n"
            f"--- containerd ---\n{self.node.log_tail('containerd', 20)}\n"
            f"--- agent pod log ---\n{self.agent_log()[-3000:]}"
        )

    def pods(self, label: str = "app.kubernetes.io/name=gpu-ready") -> list[dict[str, Any]]:
        items = self.api.request("GET", f"/api/v1/namespaces/{NS}/pods", query={"labelSelector": label})["items"]
        return [
            p
            for p in items
            if p["metadata"].get("labels", {}).get("app.kubernetes.io/component") not in ("preflight", "controller")
        ]

    def agent_pod(self) -> dict[str, Any] | None:
        live = [p for p in self.pods() if not p["metadata"].get("deletionTimestamp")]
        return live[0] if len(live) == 1 else None

    def agent_log(self) -> str:
        return "\n".join(self.node.pod_log(NS, p["metadata"]["name"], "gpu-ready") for p in self.pods())

    def gpu_ready(self) -> dict[str, Any] | None:
        return condition(self.api.request("GET", f"/api/v1/nodes/{NODE}"), COND)

    def values(self, **over: Any) -> Path:
        """The values a user with this node would write: the image, and the simulated GPU host mounted and
        configured as they would add a host directory of their own; everything else the chart's defaults."""
        assert self.sim is not None and self.state_dir is not None
        repo, tag = self.images.agent.rsplit(":", 1)
        v: dict[str, Any] = {
            "image": {"repository": repo, "tag": tag, "pullPolicy": "Never"},
            "hostNetwork": True,
            "metrics": {"port": self.metrics_port},
            "stateDir": str(self.state_dir),
            "config": {
                "nvidiaSmi": str(self.sim.nvidia_smi),
                "sysfsRoot": str(self.sim.sysfs),
                "devRoot": str(self.sim.dev),
                "procRoot": str(self.sim.proc),
            },
            "extraVolumes": [{"name": "simhost", "hostPath": {"path": str(self.sim.root), "type": "Directory"}}],
            "extraVolumeMounts": [{"name": "simhost", "mountPath": str(self.sim.root)}],
            "agent": {
                "extraEnv": [
                    {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
                    {"name": "KUBERNETES_SERVICE_PORT", "value": str(self.cp.port)},
                ]
            },
        }
        for key, val in over.items():  # "config.pollInterval" = 20
            d = v
            *head, last = key.split(".")
            for h in head:
                d = d.setdefault(h, {})
            d[last] = d[last] + val if key == "agent.extraEnv" else val  # the env entries add to the test's own
        path = self.workdir / f"values-{time.monotonic_ns()}.yaml"
        path.write_text(yaml.safe_dump(v))
        return path


def make_sim(root: Path) -> SimHost:
    """A simulated 8-GPU host on bus ids that no record in the real /dev/kmsg names (earlier runs left Xids
    there), its nvidia-smi stand-in run by the image's Python."""
    sim = SimHost(root, buses=buses_free_in_kmsg(8))
    sim.make_dev_nodes()
    text = sim.nvidia_smi.read_text()
    sim.nvidia_smi.write_text("#!/opt/gpu-ready/bin/python3\n" + text.split("\n", 1)[1])
    return sim


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    prerequisites()  # before the image build: a host that cannot run the node is told so at once
    t0 = time.monotonic()
    build_containerd()
    images = build_images()
    TIMES["builds (containerd + images; cached when warm) s"] = time.monotonic() - t0
    work = tmp_path_factory.mktemp("realnode")
    labels = {"nvidia.com/gpu.present": "true"}
    with real_node(NODE, labels=labels, pause=(images.pause, images.pause_tar)) as booted:
        e: Env | None = None
        try:
            t1 = time.monotonic()
            booted.node.load_image(images.agent_tar, images.agent)
            TIMES["agent image import into containerd s"] = time.monotonic() - t1
            create_runtime_class(booted.api)
            TIMES["node set-up (control plane + containerd + kubelet + images) s"] = (
                booted.setup_s + time.monotonic() - t1
            )
            kubeconfig = booted.cp.kubeconfig(work / "admin.kubeconfig")
            e = Env(booted.cp, booted.node, images, booted.bin_dir / "helm", kubeconfig, work, booted.api)
            e.extra["image_mb"] = images.agent_tar.stat().st_size / 1e6
            yield e
        finally:
            for d in e.extra.get("cleanup", []) if e is not None else []:
                shutil.rmtree(d, ignore_errors=True)
            print("[real node] figures: " + "; ".join(f"{k}: {v:.1f}" for k, v in TIMES.items()))


def _advertise_gpus(env: Env, n: int) -> None:
    """Stands in for the NVIDIA device plugin: the extended resource on the Node's status (kubelet keeps
    extended resources it did not set)."""
    gpus = {"nvidia.com/gpu": str(n)}
    env.api.patch_node_status(NODE, {"status": {"capacity": gpus, "allocatable": gpus}})


def _clear_condition(env: Env) -> None:
    """Removes GPUReady from the Node (strategic merge: conditions merge on `type`), so that the next one read
    is the new pod's."""
    env.api.patch_node_status(NODE, {"status": {"conditions": [{"type": COND, "$patch": "delete"}]}})
    assert env.gpu_ready() is None


def _wait_pod_ready(env: Env, timeout: float = 240.0, not_uid: str | None = None) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        p = env.agent_pod()
        if p is None or p["metadata"]["uid"] == not_uid:
            return None
        conds = {c["type"]: c["status"] for c in p.get("status", {}).get("conditions", [])}
        return p if conds.get("Ready") == "True" else None

    try:
        return wait_for(ready, timeout, 0.25, "agent pod Ready")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{env.diag()}") from None


class Sampler:
    """Reads the node's GPUReady condition continuously (every ~100 ms) in a thread."""

    def __init__(self, env: Env) -> None:
        self.api = env.cp.admin()
        self.seen: list[tuple[float, str, str]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                c = condition(self.api.request("GET", f"/api/v1/nodes/{NODE}"), COND)
                if c is not None:
                    self.seen.append((time.monotonic(), c["status"], c.get("reason", "")))
            except ApiError:
                pass
            self._stop.wait(0.1)

    def __enter__(self) -> Sampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(10)
        self.api.close()

    def statuses(self) -> set[str]:
        return {s for _, s, _ in self.seen}


def test_default_install_rolls_out_and_reports_true(env: Env, tmp_path_factory: pytest.TempPathFactory) -> None:
    from testkit.controlplane import free_port

    base = tmp_path_factory.mktemp("host")
    env.sim = make_sim(base / "sim")
    env.state_dir = base / "state"
    env.metrics_port = free_port()
    _advertise_gpus(env, len(env.sim.gpus))
    # A NoSchedule taint of another controller's (a maintenance window) is on the node: the chart's default
    # tolerations (every NoSchedule and NoExecute taint) place the agent there anyway.
    other = {"key": "example.com/maintenance", "value": "planned", "effect": "NoSchedule"}
    env.api.patch_node(NODE, {"spec": {"taints": [*env.api.get_node(NODE)["spec"].get("taints", []), other]}})
    t0 = time.monotonic()
    try:
        env.helm_run("install", RELEASE, str(CHART), "-n", NS, "--create-namespace", "-f", str(env.values()), "--wait")
        TIMES["helm install --wait (DaemonSet rolled out) s"] = time.monotonic() - t0
        pod = _wait_pod_ready(env)
    finally:
        left = [t for t in env.api.get_node(NODE)["spec"].get("taints", []) if t["key"] != other["key"]]
        env.api.patch_node(NODE, {"spec": {"taints": left}})
    assert (
        pod["spec"]["nodeName"] == NODE and {"operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]
    )
    c = wait_for(env.gpu_ready, 120, 0.1, "first GPUReady")
    TIMES["helm install -> first GPUReady s"] = time.monotonic() - t0
    assert c["status"] == "True", f"{c}\n{env.diag()}"
    # The defaults really are the defaults: privileged (the only securityContext that can read /dev/kmsg),
    # read-only root filesystem, seccomp RuntimeDefault on the pod, the probes on loopback.
    spec = pod["spec"]
    sc = spec["containers"][0]["securityContext"]
    assert sc["privileged"] is True and sc["readOnlyRootFilesystem"] is True and sc["runAsUser"] == 0
    assert spec["hostNetwork"] is True and spec["runtimeClassName"] == "nvidia"
    assert spec["containers"][0]["livenessProbe"]["httpGet"]["host"] == "127.0.0.1"
    assert env.sim.smi_call_count() > 0, "the agent ran the simulated host's nvidia-smi"
    assert "cannot open kernel log" not in c["message"], c["message"]
    took = TIMES["helm install -> first GPUReady s"]
    print(f"\n[real node] image {env.extra['image_mb']:.0f} MB; helm install -> GPUReady=True in {took:.1f} s")


def test_rail_down_reaches_the_condition_within_one_poll(env: Env) -> None:
    """Eight InfiniBand rails appear in the simulated host's sysfs (mounted into the pod as a user's host directory
    is); one goes down: the agent in the pod names it in the condition by the poll after the one in flight."""
    assert env.sim is not None
    ib = env.sim.sysfs / "class" / "infiniband"
    try:
        for i in range(8):
            env.sim.set_ib_port(f"mlx5_{i}")
        start = env.sim.smi_call_count()
        wait_for(lambda: env.sim is not None and env.sim.smi_call_count() >= start + 2, 120, 0.2, "two polls")
        assert "InfiniBand" not in (env.gpu_ready() or {}).get("message", "")
        before = env.sim.smi_call_count()
        t0 = time.monotonic()
        env.sim.set_ib_port("mlx5_5", state="1: DOWN", phys_state="3: Disabled")
        label = "InfiniBand rail mlx5_5 port 1 is DOWN (Disabled)"
        try:
            c = wait_for(lambda: (c := env.gpu_ready()) and label in c["message"] and c, 120, 0.1, label)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{env.diag()}") from None
        TIMES["rail down -> named in GPUReady s"] = time.monotonic() - t0
        polls = env.sim.smi_call_count() - before
        assert c["status"] == "False" and polls <= 2, (polls, c)  # the poll in flight, then the one that saw it
        print(f"\n[real node] rail down -> named in the condition after {polls} poll(s), {c['reason']}")
    finally:
        shutil.rmtree(ib, ignore_errors=True)
    # Leave the Node True, as found: a restarted agent holds its first write when it would not change the status
    # the Node shows (start spread), which would slow the next test's Xid.
    wait_for(lambda: (c := env.gpu_ready()) and c["status"] == "True", 240, 0.5, "GPUReady back to True")


def _xid_label(env: Env, gpu: int, xid: int = 79) -> str:
    assert env.sim is not None
    return f"GPU {gpu} ({env.sim.gpus[gpu].address.nvml}): Xid {xid}"


def test_real_kmsg_xid_turns_condition_false(env: Env) -> None:
    """A record written to the real /dev/kmsg reaches the agent inside the pod. Records written from user space
    carry the user facility; GPU_READY_KMSG_TRUST_USER (a test seam, no setting) lets the agent count them."""
    assert env.sim is not None
    old = _wait_pod_ready(env)["metadata"]["uid"]
    env.helm_run(
        "upgrade", RELEASE, str(CHART), "-n", NS, "-f", str(env.values(**{"agent.extraEnv": TRUST_USER})), "--wait"
    )
    _wait_pod_ready(env, not_uid=old)
    label = _xid_label(env, 6)
    assert label not in wait_for(env.gpu_ready, 60, 0.2, "GPUReady")["message"]
    t0 = time.monotonic()
    with open("/dev/kmsg", "w") as fh:
        fh.write(f"<3>{env.sim.xid_line(79, 6)}\n")
    try:
        c = wait_for(lambda: (c := env.gpu_ready()) and label in c["message"] and c, 30, 0.05, label)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{env.diag()}") from None
    TIMES["real /dev/kmsg Xid -> GPUReady=False s"] = time.monotonic() - t0
    assert (c["status"], c["reason"]) == ("False", "FatalXid"), c
    took = TIMES["real /dev/kmsg Xid -> GPUReady=False s"]
    print(f"\n[real node] real /dev/kmsg Xid -> False inside the pod in {took * 1000:.0f} ms")


def test_upgrade_during_latched_fault_never_reads_true_or_unknown(env: Env) -> None:
    label = _xid_label(env, 6)
    assert label in env.gpu_ready()["message"]
    old = _wait_pod_ready(env)["metadata"]["uid"]
    with Sampler(env) as s:
        env.helm_run(
            "upgrade", RELEASE, str(CHART), "-n", NS, "--wait",
            "-f", str(env.values(**{"agent.extraEnv": TRUST_USER, "config.pollInterval": 20})),
        )  # fmt: skip
        new = _wait_pod_ready(env, not_uid=old)
        started = time.monotonic()
        # The new pod has published: its heartbeat is newer than its start.
        wait_for(lambda: len([x for x in s.seen if x[0] > started]) > 20, 60, 0.1, "samples after the new pod")
    assert new["metadata"]["uid"] != old
    assert s.statuses() == {"False"}, f"condition read {s.statuses()} while pods rolled: {s.seen[:5]}...{s.seen[-5:]}"
    c = env.gpu_ready()
    assert label in c["message"] and c["reason"] == "FatalXid", "the latch survives the new pod (hostPath state)"
    assert any(env.state_dir.iterdir()), "latched state is on the hostPath"  # type: ignore[union-attr]


def test_sigstop_agent_liveness_probe_restarts_it(env: Env) -> None:
    pod = _wait_pod_ready(env)
    restarts = pod["status"]["containerStatuses"][0]["restartCount"]
    pids = env.node.find_process(r"gpu-ready run")
    assert pids, f"agent process not found among the node's pod processes\n{env.diag()}"
    with Sampler(env) as s:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()

        def restarted() -> bool:
            p = env.agent_pod()
            return p is not None and p["status"]["containerStatuses"][0]["restartCount"] > restarts

        try:
            wait_for(restarted, 240, 0.5, "kubelet to restart the stopped agent (liveness probe)")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{env.diag()}") from None
        TIMES["SIGSTOP -> restart by liveness probe s"] = time.monotonic() - t0
        _wait_pod_ready(env)
    assert s.statuses() == {"False"}, s.statuses()
    assert _xid_label(env, 6) in env.gpu_ready()["message"]
    events = env.api.request("GET", f"/api/v1/namespaces/{NS}/events")["items"]
    assert any("Liveness probe failed" in (ev.get("message") or "") for ev in events), "kubelet reported the probe"


def test_pod_deleted_is_recreated_nothing_lost(env: Env) -> None:
    pod = _wait_pod_ready(env)
    before = env.gpu_ready()
    env.api.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{pod['metadata']['name']}")
    _wait_pod_ready(env, not_uid=pod["metadata"]["uid"])
    c = wait_for(
        lambda: (c := env.gpu_ready()) and c["lastHeartbeatTime"] != before["lastHeartbeatTime"] and c, 90, 0.2,
        "a heartbeat from the new pod",
    )  # fmt: skip
    assert (c["status"], c["reason"]) == ("False", "FatalXid")
    assert _xid_label(env, 6) in c["message"]


def _projected_token(env: Env, pod: dict[str, Any]) -> str:
    uid = pod["metadata"]["uid"]
    found = list((env.node.kubelet_root / "pods" / uid / "volumes" / "kubernetes.io~projected").glob("*/token"))
    assert found, "kubelet projected no token into the agent pod"
    return found[0].read_text().strip()


def test_own_node_policy_with_the_token_kubelet_projects(env: Env) -> None:
    pod = _wait_pod_ready(env)
    token = _projected_token(env, pod)
    payload = token.split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    assert claims["kubernetes.io"]["node"]["name"] == NODE, claims
    other = f"other-gpu-node-{random.randrange(1 << 16):04x}"
    create_node(env.api, other, {"nvidia.com/gpu.present": "true"}, {"nvidia.com/gpu": "8"}, None)
    agent = KubeApi.from_token(env.cp.host, token, env.cp.ca_file)
    try:
        own = condition(agent.request("GET", f"/api/v1/nodes/{NODE}"), COND)
        assert own is not None
        patch = {"status": {"conditions": [{**own, "message": own["message"]}]}}
        agent.patch_node_status(NODE, patch)  # its own node: allowed
        with pytest.raises(ApiError) as denied:
            agent.patch_node_status(other, patch)
        assert denied.value.status == 403, denied.value
        assert "ValidatingAdmissionPolicy" in str(denied.value) or "denied" in str(denied.value), denied.value
    finally:
        agent.close()
        env.api.request("DELETE", f"/api/v1/nodes/{other}")


# The spec the simulated host matches (its nvidia-smi stand-in prints an 8x H100 80GB, driver 550.90.07).
H100_SPEC = {
    "gpuModel": "H100",
    "gpuCount": 8,
    "memoryPerGpuMiB": 80000,
    "driverVersion": ">=550.54, <600",
    "cudaVersion": ">=12.4",
    "migMode": "disabled",
    "nvlinkLinksPerGpu": 18,
    "pcieGen": 5,
    "pcieWidth": 16,
    "eccEnabled": True,
}
NEEDS = "gpu-ready.io/needs-preflight"


def _world_readable_sim(env: Env, prefix: str) -> SimHost:
    """A simulated host the chart's non-root containers (uid 65532) can read: in /tmp (pytest's own tmp is
    root-only), the stand-in's call counter writable by anyone."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    env.extra.setdefault("cleanup", []).append(base)
    sim = make_sim(base / "sim")
    base.chmod(0o755)
    sim.scenario.parent.chmod(0o777)
    sim.smi_calls.write_text("0")
    sim.smi_calls.chmod(0o666)
    return sim


def test_preflight_job_runs_on_the_node(env: Env) -> None:
    """`helm upgrade --set preflight.enabled=true,preflight.nodeName=<node>`: the chart's Job runs on the real
    node (job controller; nodeName, so no scheduler): cordon -> spec gate on the simulated host -> label ->
    uncordon, with the tokens kubelet projects (hostNetwork, the apiserver on loopback)."""
    _no_controller_sees_the_label_first(env)
    env.api.patch_node(NODE, {"metadata": {"labels": {NEEDS: "true"}}})
    sim = _world_readable_sim(env, "gpu-ready-preflight-")
    values = env.values(
        **{
            "preflight.enabled": True,
            "preflight.nodeName": NODE,
            "preflight.profile": {**H100_SPEC, "allowSkip": ["burnin", "nvlink", "cuda", "serving"]},
            "preflight.extraArgs": [f"--nvidia-smi={sim.nvidia_smi}", "--gates=spec"],
            "extraVolumes": [{"name": "simhost", "hostPath": {"path": str(sim.root.parent), "type": "Directory"}}],
            "extraVolumeMounts": [{"name": "simhost", "mountPath": str(sim.root.parent)}],
            "agent.extraEnv": TRUST_USER,
        }
    )
    # The DaemonSet's simulated host moves too (same extraVolumes): point its nvidia-smi and sysfs there.
    data = yaml.safe_load(values.read_text())
    data["config"].update(nvidiaSmi=str(sim.nvidia_smi), sysfsRoot=str(sim.sysfs), devRoot=str(sim.dev))
    data["config"]["procRoot"] = str(sim.proc)
    values.write_text(yaml.safe_dump(data))
    # Network rule: the Job's pods may talk only to the apiserver on loopback, so the chart must give them
    # hostNetwork and the explicit KUBERNETES_SERVICE_HOST/PORT (agent.extraEnv) as it does the DaemonSet's.
    rendered = env.helm_run("template", RELEASE, str(CHART), "-n", NS, "-f", str(values), "--kube-version", "1.37.2")
    job_spec = next(
        d["spec"]["template"]["spec"] for d in yaml.safe_load_all(rendered.stdout) if d and d.get("kind") == "Job"
    )
    envs = [e.get("name") for c in job_spec.get("initContainers", []) for e in c.get("env", [])]
    assert job_spec.get("hostNetwork") is True and "KUBERNETES_SERVICE_HOST" in envs, (
        "the chart's preflight Job takes no hostNetwork / agent.extraEnv / extraVolumes yet "
        "(templates/preflight.yaml and the preflight container helper need them)"
    )
    seen_cordoned = threading.Event()
    stop = threading.Event()

    def watch_cordon() -> None:
        api = env.cp.admin()
        try:
            while not stop.is_set():
                with contextlib.suppress(ApiError):
                    if api.request("GET", f"/api/v1/nodes/{NODE}").get("spec", {}).get("unschedulable"):
                        seen_cordoned.set()
                stop.wait(0.1)
        finally:
            api.close()

    t = threading.Thread(target=watch_cordon, daemon=True)
    t.start()
    t0 = time.monotonic()
    try:
        env.helm_run("upgrade", RELEASE, str(CHART), "-n", NS, "-f", str(values))

        def job_done() -> dict[str, Any] | None:
            jobs = env.api.request("GET", f"/apis/batch/v1/namespaces/{NS}/jobs")["items"]
            job = next((j for j in jobs if j["metadata"]["name"].endswith(NODE)), None)
            st = (job or {}).get("status", {})
            return job if st.get("succeeded") or st.get("failed") else None

        job = wait_for(job_done, 300, 0.5, "the preflight Job to finish")
    finally:
        stop.set()
        t.join(10)
    TIMES["preflight Job (helm upgrade -> Job succeeded) s"] = time.monotonic() - t0
    logs = "\n".join(
        f"--- {c} ---\n" + env.node.pod_log(NS, p["metadata"]["name"], c)[-1500:]
        for p in env.api.request("GET", f"/api/v1/namespaces/{NS}/pods")["items"]
        if p["metadata"]["name"].startswith("gpu-ready-preflight")
        for c in ("cordon", "gates", "record")
    )
    assert job["status"].get("succeeded") == 1, f"{job['status']}\n{logs}"
    node = env.api.request("GET", f"/api/v1/nodes/{NODE}")
    labels = node["metadata"]["labels"]
    assert labels.get("preflight") == "passed", labels
    assert NEEDS not in labels or labels[NEEDS] != "true", labels
    assert not node["spec"].get("unschedulable"), "uncordoned after passing"
    assert seen_cordoned.is_set(), "the node was cordoned while the gates ran"
    pod = next(
        p
        for p in env.api.request("GET", f"/api/v1/namespaces/{NS}/pods")["items"]
        if p["metadata"]["name"].startswith("gpu-ready-preflight")
    )
    assert pod["spec"]["nodeName"] == NODE and pod["spec"]["hostNetwork"] is True


@pytest.mark.parametrize(
    ("name", "over"),
    [
        ("root + CAP_SYSLOG, not privileged", {"agent.privileged": False}),
        ("non-root (65532) + CAP_SYSLOG", {"agent.privileged": False, "agent.runAsUser": 65532}),
    ],
)
def test_securitycontext_alternatives_cannot_read_kmsg(env: Env, name: str, over: dict[str, Any]) -> None:
    """The measured alternatives to the privileged default (README, Deployment): a hostPath /dev/kmsg gets no
    device-cgroup rule, so every non-privileged container gets EPERM and the node can only be Unknown."""
    env.helm_run("uninstall", RELEASE, "-n", NS, "--wait")

    def gone() -> bool:
        # A pod the DaemonSet controller deleted before kubelet started it can stay Pending with a deletion
        # timestamp (seen once with kubelet 1.37.2 after a rolling update); it holds no port and no state.
        return not [
            p for p in env.pods() if p["status"].get("phase") == "Running" or not p["metadata"].get("deletionTimestamp")
        ]

    try:
        wait_for(gone, 300, 0.25, "old pods gone (garbage collector)")
    except AssertionError as e:
        left = [
            (p["metadata"]["name"], p["metadata"].get("ownerReferences"), p["status"].get("phase")) for p in env.pods()
        ]
        raise AssertionError(f"{e}: {left}\n{env.cp.log_tail(40, component='kube-controller-manager')}") from None
    env.sim = _world_readable_sim(env, "gpu-ready-alt-")  # only /dev/kmsg differs for uid 65532
    env.state_dir = env.sim.root.parent / "state"
    _clear_condition(env)
    env.helm_run("install", RELEASE, str(CHART), "-n", NS, "-f", str(env.values(**over)))
    try:
        c = wait_for(env.gpu_ready, 180, 0.2, "GPUReady from the new pod")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{env.diag()}") from None
    assert c["status"] == "Unknown" and "Operation not permitted" in c["message"], f"{name}: {c}"
    print(f"\n[real node] {name}: {c['status']}/{c['reason']}: {c['message'][:120]}")


def test_controller_runs_preflight_on_a_joining_node_then_a_gpu_pod_binds(env: Env) -> None:
    """The automatic flow on the real node: the node joins labelled needs-preflight with gpu-ready's startup taint;
    the chart's controller Deployment (the project's image, on the real kubelet) takes its Lease and creates the
    preflight Job pinned to the node; the Job runs on the real kubelet, the spec gate passes on the simulated
    host; the node is labelled passed and uncordoned, GPUReady=True (requirePreflight), the agent removes the
    startup taint and a GPU Pod binds. Then a fatal Xid on the real /dev/kmsg: the agent labels needs-preflight."""
    from testkit.controlplane import free_port

    sim = _world_readable_sim(env, "gpu-ready-auto-")
    env.sim = sim
    if env.state_dir is None:
        env.state_dir = Path(tempfile.mkdtemp(prefix="gpu-ready-auto-state-"))
        env.extra.setdefault("cleanup", []).append(env.state_dir)
        env.metrics_port = free_port()
    _advertise_gpus(env, len(sim.gpus))
    startup = {"key": "gpu-ready.io/gpu-not-ready", "value": "joining", "effect": "NoSchedule"}
    _no_controller_sees_the_label_first(env)  # the node joins labelled, before this release's controller exists
    node = env.api.get_node(NODE)
    others = [t for t in node["spec"].get("taints", []) if t["key"] != startup["key"]]
    env.api.patch_node(
        NODE,
        {"metadata": {"labels": {NEEDS: "true", "preflight": None}}, "spec": {"taints": [*others, startup]}},
    )
    values = _auto_preflight_values(env, sim, **{"taints.enabled": True, "taints.mode": "startup"})
    data = yaml.safe_load(values.read_text())
    data["config"].update(nvidiaSmi=str(sim.nvidia_smi), sysfsRoot=str(sim.sysfs), devRoot=str(sim.dev))
    data["config"].update(procRoot=str(sim.proc), requirePreflight=True)
    values.write_text(yaml.safe_dump(data))
    t0 = time.monotonic()
    env.helm_run("upgrade", "--install", RELEASE, str(CHART), "-n", NS, "--create-namespace", "-f", str(values))

    def controller_job() -> dict[str, Any] | None:
        jobs = env.api.request(
            "GET", f"/apis/batch/v1/namespaces/{NS}/jobs", query={"labelSelector": "gpu-ready.io/managed-by"}
        )["items"]
        return jobs[0] if jobs else None

    def diag() -> str:
        pods = env.api.request("GET", f"/api/v1/namespaces/{NS}/pods")["items"]
        ctl = [p for p in pods if p["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "controller"]
        logs = "\n".join(env.node.pod_log(NS, p["metadata"]["name"], "controller")[-2000:] for p in ctl)
        st = [(p["metadata"]["name"], p.get("status", {}).get("phase"), p["spec"].get("nodeName")) for p in pods]
        return f"--- pods ---\n{st}\n--- controller ---\n{logs}\n{env.diag()}"

    try:
        job = wait_for(controller_job, 300, 0.5, "the controller's preflight Job")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{diag()}") from None
    TIMES["auto: helm upgrade -> controller Job created s"] = time.monotonic() - t0
    assert job["spec"]["template"]["spec"]["nodeName"] == NODE
    name = job["metadata"]["name"]

    def finished() -> dict[str, Any] | None:
        j = env.api.request("GET", f"/apis/batch/v1/namespaces/{NS}/jobs/{name}")
        st = j.get("status", {})
        return j if st.get("succeeded") or st.get("failed") else None

    try:
        done = wait_for(finished, 300, 0.5, "the controller's preflight Job to finish")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{diag()}") from None
    assert done["status"].get("succeeded") == 1, f"{done['status']}\n{diag()}"
    pod = next(
        p
        for p in env.api.request("GET", f"/api/v1/namespaces/{NS}/pods", query={"labelSelector": f"job-name={name}"})[
            "items"
        ]
    )
    gates = next(s for s in pod["status"]["initContainerStatuses"] if s["name"] == "gates")["state"]["terminated"]
    gates_s = (
        datetime.fromisoformat(gates["finishedAt"].replace("Z", "+00:00"))
        - datetime.fromisoformat(gates["startedAt"].replace("Z", "+00:00"))
    ).total_seconds()
    labels = env.api.get_node(NODE)["metadata"]["labels"]
    assert labels.get("preflight") == "passed" and NEEDS not in labels, labels
    c = wait_for(lambda: (c := env.gpu_ready()) and c["status"] == "True" and c, 120, 0.2, "GPUReady=True")
    assert c["status"] == "True"
    assert wait_for(
        lambda: all(t["key"] != startup["key"] for t in env.api.get_node(NODE)["spec"].get("taints", [])),
        120,
        0.2,
        "the startup taint removed",
    )
    assert not env.api.get_node(NODE)["spec"].get("unschedulable")
    gpu = f"gpu-work-{int(time.time())}"
    env.api.request(
        "POST",
        f"/api/v1/namespaces/{NS}/pods",
        {
            "metadata": {"name": gpu},
            "spec": {
                "containers": [
                    {"name": "c", "image": env.images.pause, "resources": {"limits": {"nvidia.com/gpu": "1"}}}
                ],
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
            },
        },
    )

    def bound() -> bool:
        # the device plugin's stand-in: kubelet zeroes an extended resource no plugin serves, so keep it advertised
        if env.api.get_node(NODE)["status"].get("allocatable", {}).get("nvidia.com/gpu", "0") == "0":
            _advertise_gpus(env, len(sim.gpus))
        return env.api.request("GET", f"/api/v1/namespaces/{NS}/pods/{gpu}")["spec"].get("nodeName") == NODE

    try:
        wait_for(bound, 120, 0.2, "the GPU Pod bound")
    except AssertionError as e:
        pod = env.api.request("GET", f"/api/v1/namespaces/{NS}/pods/{gpu}")
        raise AssertionError(f"{e}\n{pod.get('status')}\n{env.api.get_node(NODE)['spec']}") from None
    took = time.monotonic() - t0
    TIMES["auto: join (helm upgrade) -> GPU Pod bound s"] = took
    TIMES["auto: of which the gates container s"] = gates_s
    print(f"\n[real node] automatic preflight: join -> GPU Pod bound {took:.1f} s, of which the gates {gates_s:.1f} s")
    env.api.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{gpu}")

    # a fatal Xid on the real /dev/kmsg (a record from user space: the agent counts it with the trust seam on)
    data["agent"]["extraEnv"] = [*data["agent"]["extraEnv"], *TRUST_USER]
    values.write_text(yaml.safe_dump(data))
    env.helm_run("upgrade", RELEASE, str(CHART), "-n", NS, "-f", str(values))
    with open("/dev/kmsg", "w") as fh:
        fh.write(f"<3>{sim.xid_line(79, 3)}\n")
    try:  # only the new agent (trusting user-space records) latches it, and then labels the node
        wait_for(lambda: env.api.get_node(NODE)["metadata"]["labels"].get(NEEDS) == "true", 240, 0.2, NEEDS)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{env.diag()}") from None
    assert wait_for(lambda: (c := env.gpu_ready()) and c["reason"] == "FatalXid", 60, 0.2, "FatalXid")


CONTROLLER = f"{RELEASE}-controller"  # the chart's controller Deployment (gpu-ready.controllerName)
MANAGED = {"labelSelector": "gpu-ready.io/managed-by"}  # the Jobs the controller created


def _no_controller_sees_the_label_first(env: Env) -> None:
    """A case that labels the node needs-preflight before the `helm upgrade` that turns the controller on (or sets
    the profile) relies on no controller running yet: one of an earlier release would see the label first and run
    a Job with its own profile. Asserted, so that a reordering fails here and not as a Job that ran the wrong gate."""
    running = [p["metadata"]["name"] for p in _controller_pods(env)]
    assert not running, f"a controller of an earlier release runs and would see the label first: {running}"
    assert not _managed_jobs(env), "a preflight Job of an earlier controller is left"


def _auto_preflight_values(env: Env, sim: SimHost, gpu_count: int | None = None, **over: Any) -> Path:
    """The values of the automatic flow: gpu-ready controller on (one replica, placed on the tainted node), the
    preflight Job's spec gate on the simulated host mounted into it (its profile expecting `gpu_count` GPUs when
    given), plus `over`."""
    profile = {**H100_SPEC, "allowSkip": ["burnin", "nvlink", "cuda", "serving"]}
    if gpu_count is not None:
        profile["gpuCount"] = gpu_count
    return env.values(
        **{
            "preflight.enabled": True,
            "preflight.auto.enabled": True,
            "preflight.auto.replicas": 1,
            "preflight.auto.tolerations": [{"operator": "Exists"}],
            "preflight.profile": profile,
            "preflight.extraArgs": [f"--nvidia-smi={sim.nvidia_smi}", "--gates=spec"],
            "extraVolumes": [{"name": "simhost", "hostPath": {"path": str(sim.root.parent), "type": "Directory"}}],
            "extraVolumeMounts": [{"name": "simhost", "mountPath": str(sim.root.parent)}],
            **over,
        }
    )


def _managed_jobs(env: Env) -> list[dict[str, Any]]:
    return env.api.request("GET", f"/apis/batch/v1/namespaces/{NS}/jobs", query=MANAGED)["items"]


def _finished(job: dict[str, Any]) -> bool:
    st = job.get("status", {})
    return bool(st.get("succeeded") or st.get("failed"))


def _delete_job(env: Env, name: str) -> None:
    query = {"propagationPolicy": "Background"}  # its pod goes with it (garbage collector)
    env.api.request("DELETE", f"/apis/batch/v1/namespaces/{NS}/jobs/{name}", query=query)


def _scale_controller(env: Env, replicas: int) -> None:
    env.api.request(
        "PATCH",
        f"/apis/apps/v1/namespaces/{NS}/deployments/{CONTROLLER}/scale",
        {"spec": {"replicas": replicas}},
        "application/merge-patch+json",
    )


def _wait_controller_rolled_out(env: Env) -> None:
    """Wait until the controller Deployment runs only pods of its current template, all ready (a `helm upgrade`
    returns before the old replica is gone)."""

    def rolled_out() -> bool:
        d = env.api.request("GET", f"/apis/apps/v1/namespaces/{NS}/deployments/{CONTROLLER}")
        st, want = d.get("status", {}), d["spec"].get("replicas", 1)
        return (
            st.get("observedGeneration", 0) >= d["metadata"]["generation"]
            and st.get("updatedReplicas", 0) == want
            and st.get("readyReplicas", 0) == want
            and st.get("replicas", 0) == want
            and len(_controller_pods(env)) == want
        )

    wait_for(rolled_out, 300, 0.5, "the controller Deployment rolled out")


def _controller_pods(env: Env) -> list[dict[str, Any]]:
    query = {"labelSelector": "app.kubernetes.io/component=controller"}
    return env.api.request("GET", f"/api/v1/namespaces/{NS}/pods", query=query)["items"]


def _gpu_ready_advertised(env: Env, n: int) -> dict[str, Any] | None:
    """GPUReady, keeping the device plugin's stand-in advertisement up (kubelet zeroes an extended resource no
    plugin serves, and the agent would then report the plugin, not what a test waits for)."""
    if env.api.get_node(NODE)["status"].get("allocatable", {}).get("nvidia.com/gpu", "0") == "0":
        _advertise_gpus(env, n)
    return env.gpu_ready()


def test_controller_a_rebooted_node_stays_not_ready_until_preflight_passes_again(env: Env) -> None:
    """Re-admission after a reboot on the real node: the node the previous test left with a latched fatal Xid and
    `needs-preflight=true` reboots (simulated the way the agent sees one: its state file records another boot id,
    and the new boot's kernel log holds no user-space record the agent trusts). The new agent drops the latch, but
    with requirePreflight the node reads False/PreflightNotPassed, never True, while the label stays, although it
    still carries `preflight=passed` from before the fault. Then the controller runs the preflight Job, the spec
    gate passes on the simulated host, the label goes and GPUReady=True."""
    sim, state_dir = env.sim, env.state_dir
    assert sim is not None and state_dir is not None, "runs after the controller test, on the node it left"
    state_file = state_dir / "state.json"
    labels = env.api.get_node(NODE)["metadata"]["labels"]
    assert labels.get(NEEDS) == "true", f"the previous test leaves the node labelled {NEEDS}: {labels}"
    # The reboot's kernel log: the new boot's ring buffer holds none of the old boot's records. The real
    # /dev/kmsg still holds the user-space Xid the previous test wrote, so the agent stops trusting user-space
    # records (the test seam off) before the reboot; the upgrade that does it restarts the agent in the same
    # boot, which keeps the latch (hostPath state). The label is on before this upgrade, so the previous release's
    # controller or this one's may run a Job on it first: either runs the same profile (this upgrade changes only the
    # agent's poll and trust), so the outcome does not depend on which, and the Jobs are cleared below before
    # anything is asserted.
    values = _auto_preflight_values(
        env, sim, **{"taints.enabled": True, "taints.mode": "startup", "config.pollInterval": 5}
    )
    data = yaml.safe_load(values.read_text())
    data["config"].update(nvidiaSmi=str(sim.nvidia_smi), sysfsRoot=str(sim.sysfs), devRoot=str(sim.dev))
    data["config"].update(procRoot=str(sim.proc), requirePreflight=True)
    values.write_text(yaml.safe_dump(data))
    old = _wait_pod_ready(env)["metadata"]["uid"]
    env.helm_run("upgrade", RELEASE, str(CHART), "-n", NS, "-f", str(values))
    _wait_pod_ready(env, not_uid=old)

    # The controller must not act while the reboot is asserted: no replica, and no Job of its left running (one it
    # started on the label the Xid set finishes first: a Job killed mid-run would leave the node cordoned).
    _scale_controller(env, 0)
    wait_for(lambda: not _controller_pods(env), 180, 0.5, "the controller's pods gone")
    wait_for(lambda: all(_finished(j) for j in _managed_jobs(env)), 300, 0.5, "the controller's Jobs finished")
    for j in _managed_jobs(env):
        _delete_job(env, j["metadata"]["name"])
    wait_for(lambda: not _managed_jobs(env), 120, 0.5, "the controller's Jobs deleted")
    # A Job that passed while the fault was latched removed the label; the agent (still latched) put it back.
    try:
        wait_for(lambda: env.api.get_node(NODE)["metadata"]["labels"].get(NEEDS) == "true", 120, 0.2, NEEDS)
        c = wait_for(lambda: (c := env.gpu_ready()) and c["reason"] == "FatalXid" and c, 120, 0.2, "FatalXid")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{env.diag()}") from None
    assert _xid_label(env, 3) in c["message"], c
    node = env.api.get_node(NODE)
    assert not node["spec"].get("unschedulable"), node["spec"]
    assert node["metadata"]["labels"].get("preflight") == "passed", "the node passed preflight before the fault"

    # The reboot: the state file records another boot (rewritten atomically, as the agent writes it). The agent
    # reads it only at start and writes it only on a change, so the running one, with nothing new to latch, leaves
    # it as rewritten; then its pod goes and the DaemonSet starts the agent of the "new boot".
    real_boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    state = json.loads(state_file.read_text())
    assert state["boot_id"] == real_boot and state["faults"], f"the latch is on the hostPath: {state}"
    previous_boot = "00000000-0000-4000-8000-" + os.urandom(6).hex()
    tmp = state_dir / ".state.json.reboot.tmp"
    tmp.write_text(json.dumps({**state, "boot_id": previous_boot}))
    os.replace(tmp, state_file)
    pod = _wait_pod_ready(env)
    with Sampler(env) as s:
        env.api.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{pod['metadata']['name']}")
        new = _wait_pod_ready(env, not_uid=pod["metadata"]["uid"])
        try:
            c = wait_for(
                lambda: (c := _gpu_ready_advertised(env, len(sim.gpus))) and c["reason"] == "PreflightNotPassed" and c,
                240,
                0.2,
                "False/PreflightNotPassed from the new boot's agent",
            )
        except AssertionError as e:
            raise AssertionError(f"{e}: GPUReady {env.gpu_ready()}\n{env.diag()}") from None
    assert c["status"] == "False" and "Xid" not in c["message"], c
    assert s.statuses() == {"False"}, f"the rebooted node read {s.statuses()} before preflight: {s.seen[-5:]}"
    new_log = env.node.pod_log(NS, new["metadata"]["name"], "gpu-ready")
    assert "new boot: latched faults from the previous boot dropped" in new_log, new_log[-2000:]
    state = json.loads(state_file.read_text())
    assert state["boot_id"] == real_boot and state["faults"] == [], state
    labels = env.api.get_node(NODE)["metadata"]["labels"]
    assert labels.get(NEEDS) == "true" and labels.get("preflight") == "passed", labels

    # The controller runs the preflight Job; it passes and removes the label: the node is back.
    t0 = time.monotonic()
    _scale_controller(env, 1)
    try:
        job = wait_for(lambda: (js := _managed_jobs(env)) and js[0], 300, 0.5, "the controller's preflight Job")
        name = job["metadata"]["name"]
        done = wait_for(
            lambda: _finished(j := env.api.request("GET", f"/apis/batch/v1/namespaces/{NS}/jobs/{name}")) and j,
            300,
            0.5,
            "the preflight Job to finish",
        )
    except AssertionError as e:
        raise AssertionError(f"{e}\n{env.diag()}") from None
    assert done["status"].get("succeeded") == 1 and done["spec"]["template"]["spec"]["nodeName"] == NODE, done["status"]
    c = wait_for(
        lambda: (c := _gpu_ready_advertised(env, len(sim.gpus))) and c["status"] == "True" and c, 180, 0.2, "True"
    )
    took = TIMES["re-admission: controller back -> GPUReady=True s"] = time.monotonic() - t0
    node = env.api.get_node(NODE)
    assert node["metadata"]["labels"].get("preflight") == "passed" and NEEDS not in node["metadata"]["labels"]
    assert not node["spec"].get("unschedulable")
    assert c["reason"] == "GPUsHealthy", c
    # The passed Job goes now (the controller deletes it 30 s after it finished): the next test counts the Jobs.
    _delete_job(env, name)
    wait_for(lambda: not _managed_jobs(env), 120, 0.5, "the passed Job deleted")
    print(f"\n[real node] re-admission after a reboot: controller back -> GPUReady=True in {took:.1f} s")


def test_controller_a_failing_gate_leaves_the_node_failed_and_cordoned_and_the_retry_cap_holds(env: Env) -> None:
    """The same automatic flow with a gate that fails (the profile asks for 9 GPUs, the host has 8): each run
    labels preflight=failed and keeps the node cordoned, the PreflightFailed Event names the gate, and after
    maxFailures (2 here, backoff 1 s) the controller stops: PreflightGaveUp, no third Job."""
    import urllib.request

    sim = env.sim or _world_readable_sim(env, "gpu-ready-auto-")
    env.sim = sim
    if env.state_dir is None:
        from testkit.controlplane import free_port

        env.state_dir = Path(tempfile.mkdtemp(prefix="gpu-ready-auto-state-"))
        env.extra.setdefault("cleanup", []).append(env.state_dir)
        env.metrics_port = free_port()
    # The label goes on only once this release's controller is the one running: a previous release's controller
    # (another profile) would otherwise see the label first and run a Job that passes.
    env.api.patch_node(NODE, {"metadata": {"labels": {NEEDS: None, "preflight": None}}})
    values = _auto_preflight_values(
        env, sim, gpu_count=9, **{"preflight.auto.maxFailures": 2, "preflight.auto.backoffSeconds": 1}
    )
    data = yaml.safe_load(values.read_text())
    data["config"].update(nvidiaSmi=str(sim.nvidia_smi), sysfsRoot=str(sim.sysfs), devRoot=str(sim.dev))
    data["config"].update(procRoot=str(sim.proc), requirePreflight=True)
    values.write_text(yaml.safe_dump(data))
    env.helm_run("upgrade", "--install", RELEASE, str(CHART), "-n", NS, "--create-namespace", "-f", str(values))
    _wait_controller_rolled_out(env)
    wait_for(lambda: all(_finished(j) for j in _managed_jobs(env)), 300, 0.5, "earlier preflight Jobs finished")
    for j in _managed_jobs(env):
        _delete_job(env, j["metadata"]["name"])
    wait_for(lambda: not _managed_jobs(env), 120, 0.5, "earlier preflight Jobs deleted")
    env.api.patch_node(NODE, {"metadata": {"labels": {NEEDS: "true"}}})

    def events(reason: str) -> list[dict[str, Any]]:
        items = env.api.request("GET", "/apis/events.k8s.io/v1/namespaces/default/events")["items"]
        return [e for e in items if e.get("reason") == reason and e["regarding"].get("name") == NODE]

    try:
        wait_for(lambda: events("PreflightGaveUp"), 420, 0.5, "PreflightGaveUp")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{env.diag()}") from None
    jobs = env.api.request(
        "GET", f"/apis/batch/v1/namespaces/{NS}/jobs", query={"labelSelector": "gpu-ready.io/managed-by"}
    )["items"]
    assert len(jobs) == 2 and all(j["status"].get("failed") for j in jobs), [j["status"] for j in jobs]
    node = env.api.get_node(NODE)
    assert node["metadata"]["labels"].get("preflight") == "failed" and node["spec"].get("unschedulable") is True
    assert node["metadata"]["labels"].get(NEEDS) == "true"
    failed = events("PreflightFailed")
    assert failed and "spec" in failed[-1]["note"], failed[-1:]
    text = urllib.request.urlopen("http://127.0.0.1:9466/metrics", timeout=5).read().decode()
    assert "gpu_ready_preflight_gave_up_nodes 1.0" in text
    assert (cond := env.gpu_ready()) is not None and cond["status"] == "False"
