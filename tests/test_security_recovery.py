"""Least privilege for per-GPU recovery (recovery.enabled, docs/recovery.md), proven on the real apiserver with the
chart's own rendered RBAC and admission policies and a token bound to a Pod on node A.

With recovery on (plugin DaemonSet configured, evict on) the token may: list the plugin namespace's pods; delete the
plugin DaemonSet's pod on node A only; evict only as a dry run (the PodDisruptionBudget check); delete only a pod on
node A that holds a GPU (an nvidia.com/ extended resource or a DRA claim). Everything else on pods is refused: the
plugin's pod on node B, a pod in the plugin namespace that the DaemonSet does not own, a GPU pod on node B, a pod on
node A holding no GPU, a GPU pod in kube-system (recovery.excludeNamespaces; its dry-run eviction too), a delete with
a grace period shorter than the pod's own, a real eviction (the apiserver's admission sees the Eviction, never the
Pod, so it could not be held to the node), creating or changing a pod. With evict off the token cannot evict or delete
workload pods at all (RBAC); with recovery off it has no right on pods (the security matrix of
tests/test_security_pods.py)."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from agent.kube.client import MERGE_PATCH, ApiError, KubeApi
from testkit.chart import Release, apply_release, by_kind, render
from testkit.cluster import bound_token, create_node, ensure_namespace
from testkit.controlplane import ControlPlane
from testkit.harness import wait_for
from testkit.recovery import DS, create_plugin_daemonset
from testkit.security import denied_by, denied_by_policy

POLICY = "policy recovery-pods"


@dataclass
class Env:
    node_a: str
    node_b: str
    plugin_ns: str
    ns: str
    ds_uid: str


@dataclass
class RecCluster:
    cp: ControlPlane
    admin: KubeApi
    full: Release  # recovery on, plugin configured, evict on
    no_evict: Release  # recovery on, plugin configured, evict off
    off: Release  # recovery off
    env: Env

    def token(self, rel: Release, node: str) -> KubeApi:
        tok, _ = bound_token(self.admin, rel.ns, rel.fullname, node)
        return KubeApi.from_token(self.cp.host, tok, self.cp.ca_file)


def values(plugin_ns: str, evict: bool) -> list[str]:
    return [
        *("--set", "recovery.enabled=true", "--set", f"recovery.evict={str(evict).lower()}"),
        *("--set", "podResources.enabled=true"),
        *("--set", f"recovery.devicePlugin.namespace={plugin_ns}", "--set", f"recovery.devicePlugin.daemonSet={DS}"),
    ]


def make_pod(admin: KubeApi, e: Env, kind: str, node: str) -> tuple[str, str]:
    """A pod of `kind` on `node`: plugin (owned by the DaemonSet), stray (in the plugin namespace, no owner),
    gpu (limits nvidia.com/gpu; gpu-system: the same in kube-system), dra (a resource claim), plain (no GPU).
    Returns (namespace, name)."""
    name = f"{kind}-{secrets.token_hex(3)}"
    ns = e.plugin_ns if kind in ("plugin", "stray") else "kube-system" if kind == "gpu-system" else e.ns
    meta: dict[str, Any] = {"name": name}
    container: dict[str, Any] = {"name": "main", "image": "x"}
    spec: dict[str, Any] = {"nodeName": node, "containers": [container]}
    if kind == "plugin":
        meta["ownerReferences"] = [
            {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": DS, "uid": e.ds_uid, "controller": True}
        ]
    if kind in ("gpu", "gpu-system"):
        container["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    if kind == "dra":
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "gpu-claim"}]
        container["resources"] = {"claims": [{"name": "gpu"}]}
    admin.request("POST", f"/api/v1/namespaces/{ns}/pods", {"metadata": meta, "spec": spec})
    return ns, name


@dataclass
class Attempt:
    what: str
    kind: str  # the pod it is made on (make_pod)
    on: str  # "a" or "b": the node of that pod
    op: str  # "delete", "delete grace 0", "evict", "dry-run evict", "list", "patch", "create"
    expect: int
    by: str = ""


def do(api: KubeApi, e: Env, a: Attempt, ns: str, name: str) -> None:
    pod = f"/api/v1/namespaces/{ns}/pods/{name}"
    ev = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": ns}}
    if a.op == "delete":
        api.request("DELETE", pod)
    elif a.op == "delete grace 0":
        api.request("DELETE", pod, {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
    elif a.op == "evict":
        api.request("POST", pod + "/eviction", ev)
    elif a.op == "dry-run evict":
        api.request("POST", pod + "/eviction", ev, query={"dryRun": "All"})
    elif a.op == "list":
        api.request("GET", f"/api/v1/namespaces/{ns}/pods", query={"fieldSelector": f"spec.nodeName={e.node_a}"})
    elif a.op == "patch":
        api.request("PATCH", pod, {"metadata": {"labels": {"x": "y"}}}, MERGE_PATCH)
    elif a.op == "create":
        api.request(
            "POST",
            f"/api/v1/namespaces/{ns}/pods",
            {"metadata": {"name": "x"}, "spec": {"containers": [{"name": "c", "image": "i"}]}},
        )


FULL: list[Attempt] = [
    Attempt("list the plugin namespace's pods", "plugin", "a", "list", 200),
    Attempt("delete the plugin DaemonSet's pod on its node", "plugin", "a", "delete", 200),
    Attempt("delete the plugin DaemonSet's pod on another node", "plugin", "b", "delete", 403, POLICY),
    Attempt("delete a pod in the plugin namespace the DaemonSet does not own", "stray", "a", "delete", 403, POLICY),
    Attempt("dry-run evict a GPU pod on its node (the PDB check)", "gpu", "a", "dry-run evict", 201),
    Attempt("evict a GPU pod on its node for real", "gpu", "a", "evict", 403, POLICY),
    Attempt("evict a pod on another node", "gpu", "b", "evict", 403, POLICY),
    Attempt("delete a GPU pod on its node", "gpu", "a", "delete", 200),
    Attempt("delete a DRA pod on its node", "dra", "a", "delete", 200),
    Attempt("delete a GPU pod on another node", "gpu", "b", "delete", 403, POLICY),
    Attempt("delete a DRA pod on another node", "dra", "b", "delete", 403, POLICY),
    Attempt("delete a pod holding no GPU on its node", "plain", "a", "delete", 403, POLICY),
    Attempt(
        "delete a GPU pod in kube-system on its node (excludeNamespaces)", "gpu-system", "a", "delete", 403, POLICY
    ),
    Attempt(
        "dry-run evict a GPU pod in kube-system (excludeNamespaces)", "gpu-system", "a", "dry-run evict", 403, POLICY
    ),
    Attempt("delete a GPU pod on its node with grace 0 (its own: 30 s)", "gpu", "a", "delete grace 0", 403, POLICY),
    Attempt("list pods in a workload namespace", "gpu", "a", "list", 403, "RBAC"),
    Attempt("patch a GPU pod on its node", "gpu", "a", "patch", 403, "RBAC"),
    Attempt("create a pod in the plugin namespace", "plugin", "a", "create", 403, "RBAC"),
]
NO_EVICT: list[Attempt] = [
    Attempt("delete the plugin DaemonSet's pod on its node", "plugin", "a", "delete", 200),
    Attempt("delete the plugin DaemonSet's pod on another node", "plugin", "b", "delete", 403, POLICY),
    Attempt("dry-run evict a GPU pod on its node", "gpu", "a", "dry-run evict", 403, "RBAC"),
    Attempt("delete a GPU pod on its node", "gpu", "a", "delete", 403, "RBAC"),
    Attempt("delete a pod in the plugin namespace the DaemonSet does not own", "stray", "a", "delete", 403, POLICY),
]
OFF: list[Attempt] = [
    Attempt("list the plugin namespace's pods", "plugin", "a", "list", 403, "RBAC"),
    Attempt("delete the plugin DaemonSet's pod on its node", "plugin", "a", "delete", 403, "RBAC"),
    Attempt("dry-run evict a GPU pod on its node", "gpu", "a", "dry-run evict", 403, "RBAC"),
    Attempt("delete a GPU pod on its node", "gpu", "a", "delete", 403, "RBAC"),
]


@pytest.fixture(scope="module")
def rec_cluster(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Any:
    kc = control_plane.kubeconfig(tmp_path_factory.mktemp("secrec") / "admin")
    admin = control_plane.admin()
    plugin_ns, ns = f"plug-{secrets.token_hex(3)}", f"work-{secrets.token_hex(3)}"
    for n in (plugin_ns, ns):
        ensure_namespace(admin, n)
    ds = create_plugin_daemonset(admin, plugin_ns)
    full = apply_release(control_plane, kc, "secr", values(plugin_ns, True))
    no_evict = apply_release(control_plane, kc, "secs", values(plugin_ns, False))
    off = apply_release(control_plane, kc, "sect", [])
    a, b = (f"secr-{secrets.token_hex(4)}" for _ in range(2))
    for n in (a, b):
        create_node(admin, n, {"nvidia.com/gpu.present": "true"}, {"nvidia.com/gpu": "8"})
    env = Env(a, b, plugin_ns, ns, ds["metadata"]["uid"])
    c = RecCluster(control_plane, admin, full, no_evict, off, env)
    for rel in (full, no_evict):
        api = c.token(rel, a)
        wait_for(  # the policies take a moment to load after creation
            lambda: denied_by_policy(
                lambda: do(api, env, FULL[2], *make_pod(admin, env, "plugin", b)),  # noqa: B023
                f"{rel.fullname}-recovery-pods",  # noqa: B023
            ),
            60,
            0.5,
            "the recovery admission policy to take effect",
        )
        api.close()
    yield c
    for n in (a, b):
        admin.request("DELETE", f"/api/v1/nodes/{n}")
    admin.close()


def attempt(c: RecCluster, rel: Release, a: Attempt) -> tuple[int, str]:
    e = c.env
    ns, name = make_pod(c.admin, e, a.kind, e.node_a if a.on == "a" else e.node_b)
    api = c.token(rel, e.node_a)
    try:
        do(api, e, a, ns, name)
        return (201 if a.op.endswith("evict") or a.op == "create" else 200), ""
    except ApiError as err:
        return err.status, str(err)
    finally:
        api.close()


@pytest.mark.apiserver
@pytest.mark.parametrize("which", ["full", "no_evict", "off"])
def test_recovery_token_deletes_only_the_plugin_pod_and_gpu_pods_on_its_own_node(rec_cluster, which):
    rel, attempts = {
        "full": (rec_cluster.full, FULL),
        "no_evict": (rec_cluster.no_evict, NO_EVICT),
        "off": (rec_cluster.off, OFF),
    }[which]
    problems = []
    for a in attempts:
        code, message = attempt(rec_cluster, rel, a)
        if code != a.expect:
            problems.append(f"{a.what}: expected {a.expect}, got {code} {message[:300]}")
        elif a.by and denied_by(message) != a.by:
            problems.append(f"{a.what}: denied by {denied_by(message)!r}, expected {a.by!r}: {message[:200]}")
    print(f"\n[security-recovery {which}] {len(attempts)} attempts; mismatches: {len(problems)}")
    assert not problems, "\n".join(problems)


@pytest.mark.apiserver
def test_the_agents_own_code_restarts_only_the_plugin_pod_on_its_node(rec_cluster, tmp_path):
    """RecoveryActor._restart_plugin with the token: it lists the plugin namespace on its node and deletes the
    DaemonSet's pod there; the plugin's pod on the other node and a stray pod stay."""
    from prometheus_client import CollectorRegistry

    from agent.act.recovery.actor import RecoveryActor, RecoveryMetrics, RecoverySettings
    from agent.act.recovery.ladder import Policy
    from agent.model import PciAddress
    from agent.proc import SupervisedRunner
    from agent.state import LatchState

    c = rec_cluster
    e = Env(**{**vars(c.env), "node_a": f"secr-{secrets.token_hex(4)}"})  # a node of its own: no pods of other tests
    create_node(c.admin, e.node_a, {"nvidia.com/gpu.present": "true"}, {"nvidia.com/gpu": "8"})
    mine = make_pod(c.admin, e, "plugin", e.node_a)
    theirs = make_pod(c.admin, e, "plugin", e.node_b)
    stray = make_pod(c.admin, e, "stray", e.node_a)
    api = c.token(c.full, e.node_a)
    events: list[tuple[str, ...]] = []
    try:
        actor = RecoveryActor(
            api, e.node_a, LatchState(str(tmp_path), "b"),
            RecoverySettings(Policy(), plugin_namespace=e.plugin_ns, plugin_daemonset=DS),
            smi=SupervisedRunner("true"), kmsg_seq=lambda: None, on_event=lambda *a: events.append(a),
            metrics=RecoveryMetrics(CollectorRegistry()), log=_Log(),
        )  # fmt: skip
        actor._restart_plugin(PciAddress(0, 0xBB, 0))
    finally:
        api.close()

    def terminating(ns_name: tuple[str, str]) -> bool:
        p = c.admin.request("GET", f"/api/v1/namespaces/{ns_name[0]}/pods/{ns_name[1]}")
        return bool(p["metadata"].get("deletionTimestamp"))

    assert terminating(mine) and not terminating(theirs) and not terminating(stray)
    assert [x[0] for x in events] == ["DevicePluginRestarted"]


class _Log:
    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *a, **k: None


def test_recovery_off_renders_nothing_on_pods():
    on, off = render(values("gpu-operator", True)), render([])
    assert "recovery" not in " ".join(by_kind(off, "ClusterRole")) + " ".join(by_kind(off, "Role"))
    assert not [n for n in by_kind(off, "ValidatingAdmissionPolicy") if "recovery" in n]
    assert by_kind(on, "ClusterRole")["gpu-ready-recovery-evict"]["rules"] == [
        {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["delete"]},
    ]
    (role,) = [r for n, r in by_kind(on, "Role").items() if "recovery" in n]
    assert role["metadata"]["namespace"] == "gpu-operator"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "delete"]}]
    no_plugin = render(
        ["--set", "recovery.enabled=true", "--set", "podResources.enabled=true"]
    )  # nothing to restart, nothing to evict: no right
    assert not [n for n in by_kind(no_plugin, "Role") if "recovery" in n]
    assert not [n for n in by_kind(no_plugin, "ClusterRole") if "recovery" in n]


def test_recovery_without_pod_resources_fails_with_one_line():
    from testkit.chart import CHART, helm

    r = helm("template", "x", str(CHART), "--set", "recovery.enabled=true", check=False)
    assert r.returncode != 0
    assert "recovery.enabled needs podResources.enabled" in r.stderr, r.stderr


def test_host_pid_only_with_recovery_and_only_when_asked():
    """`recovery.hostPID` lets a refused reset name the host process holding the GPU; it is off by default and means
    nothing without recovery."""

    def host_pid(vals: list[str]) -> bool | None:
        (ds,) = by_kind(render(vals), "DaemonSet").values()
        return ds["spec"]["template"]["spec"].get("hostPID")

    on = ["--set", "recovery.enabled=true", "--set", "podResources.enabled=true"]
    assert host_pid([]) is None and host_pid(on) is None
    assert host_pid(["--set", "recovery.hostPID=true"]) is None  # recovery off: nothing
    assert host_pid([*on, "--set", "recovery.hostPID=true"]) is True


HOLDER = "nvidia-dcgm-exporter"


def ds_pod(admin: KubeApi, ns: str, ds: dict[str, Any], node: str) -> tuple[str, str]:
    """A pod of DaemonSet `ds` on `node` (owner reference as the DaemonSet controller sets it)."""
    name = f"{ds['metadata']['name']}-{secrets.token_hex(3)}"
    owner = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": ds["metadata"]["name"],
             "uid": ds["metadata"]["uid"], "controller": True}  # fmt: skip
    admin.request("POST", f"/api/v1/namespaces/{ns}/pods", {
        "metadata": {"name": name, "ownerReferences": [owner]},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "x"}]},
    })  # fmt: skip
    return ns, name


@pytest.mark.apiserver
def test_release_holders_lets_the_token_delete_only_those_daemonsets_pods_on_its_own_node(rec_cluster, tmp_path):
    """`recovery.releaseHolders`: the token may delete the pod of a listed DaemonSet (dcgm-exporter here) on its own
    node, before a reset; not the same DaemonSet's pod on another node, not a pod in that namespace the DaemonSet does
    not own; without the value no right at all. The agent's own code deletes exactly the one on its node."""
    from prometheus_client import CollectorRegistry

    from agent.act.recovery.actor import RecoveryActor, RecoveryMetrics, RecoverySettings
    from agent.act.recovery.ladder import Policy
    from agent.model import PciAddress
    from agent.proc import SupervisedRunner
    from agent.state import LatchState

    c = rec_cluster
    hns = f"dcgm-{secrets.token_hex(3)}"
    ensure_namespace(c.admin, hns)
    holder = create_plugin_daemonset(c.admin, hns, HOLDER)
    other = create_plugin_daemonset(c.admin, hns, "something-else")
    kc = c.cp.kubeconfig(tmp_path / "admin")
    vals = [*values(c.env.plugin_ns, False), "--set", f"recovery.releaseHolders[0].namespace={hns}",
            "--set", f"recovery.releaseHolders[0].daemonSet={HOLDER}"]  # fmt: skip
    rel = apply_release(c.cp, kc, "sech", vals)
    a, b = f"sech-{secrets.token_hex(4)}", c.env.node_b
    create_node(c.admin, a, {"nvidia.com/gpu.present": "true"}, {"nvidia.com/gpu": "8"})
    api = c.token(rel, a)
    plain = c.token(c.no_evict, a)

    def status(tok: KubeApi, pod: tuple[str, str]) -> tuple[int, str]:
        try:
            tok.request("DELETE", f"/api/v1/namespaces/{pod[0]}/pods/{pod[1]}")
            return 200, ""
        except ApiError as err:
            return err.status, str(err)

    try:
        wait_for(lambda: status(api, ds_pod(c.admin, hns, holder, b))[0] == 403, 60, 0.5, "the policy in effect")
        code, msg = status(api, ds_pod(c.admin, hns, holder, b))
        assert code == 403 and denied_by(msg) == "policy recovery-pods", msg  # its pod on another node
        code, msg = status(api, ds_pod(c.admin, hns, other, a))
        assert code == 403 and denied_by(msg) == "policy recovery-pods", msg  # a DaemonSet not listed
        refused = ds_pod(c.admin, hns, holder, a)
        code, msg = status(plain, refused)
        assert code == 403 and denied_by(msg) == "RBAC", msg  # a release without releaseHolders: no right
        assert status(api, ds_pod(c.admin, hns, holder, a))[0] == 200  # its pod on the token's own node
        mine, theirs = ds_pod(c.admin, hns, holder, a), ds_pod(c.admin, hns, holder, b)
        events: list[tuple[str, ...]] = []
        actor = RecoveryActor(
            api, a, LatchState(str(tmp_path / "state"), "b"),
            RecoverySettings(Policy(), release_holders=((hns, HOLDER),)),
            smi=SupervisedRunner("true"), kmsg_seq=lambda: None, on_event=lambda *x: events.append(x),
            metrics=RecoveryMetrics(CollectorRegistry()), log=_Log(),
        )  # fmt: skip
        actor._release_holders(PciAddress(0, 0xBB, 0))
    finally:
        api.close()
        plain.close()

    def terminating(ns_name: tuple[str, str]) -> bool:
        p = c.admin.request("GET", f"/api/v1/namespaces/{ns_name[0]}/pods/{ns_name[1]}")
        return bool(p["metadata"].get("deletionTimestamp"))

    assert terminating(mine) and terminating(refused) and not terminating(theirs)  # both of its node, only those
    assert [x[0] for x in events] == ["GPUHolderReleased"] * 2
