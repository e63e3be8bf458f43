"""Least privilege for the automatic flow, proven on the real apiserver with the chart's rendered RBAC and admission
policies: the agent's token (bound to a pod on node A) may add `gpu-ready.io/needs-preflight=true` to its own Node
with preflightAfterFault, and nothing else new (never another value, never removed, never `preflight`, never on
node B, never without the setting); the controller's token cannot write a Node, cannot create a Job outside its
namespace or one whose pod differs from the chart's preflight template in anything but the node, cannot update
or delete a Job it did not create, writes only its Lease and the brake ConfigMap, and reads no Secret; the agent
may watch the brake ConfigMap and read no other."""

from __future__ import annotations

import copy
import itertools
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.kube.client import MERGE_PATCH, ApiError, KubeApi
from testkit.chart import Release, apply_release, by_kind
from testkit.cluster import bound_token, create_node, ensure_namespace
from testkit.controller import VALUES, apply_quotas, controller_api, gpu_node, job_pods, jobs_control_plane
from testkit.controlplane import ControlPlane
from testkit.harness import wait_for
from testkit.security import DocsTable, client_as, denied_by_policy, outcome

NEEDS = "gpu-ready.io/needs-preflight"
MAX_JOBS = 8
MARKS = [*VALUES, "--set", "config.preflightAfterFault=true", "--set", f"preflight.auto.maxJobs={MAX_JOBS}"]


@pytest.fixture(scope="module")
def control_plane() -> Iterator[ControlPlane]:
    """This module's own control plane with the real Job controller: a Job the controller's token gets stored
    makes real pods, so every denied row is also a pod that never existed."""
    with jobs_control_plane() as cp:
        yield cp


@pytest.fixture(scope="module")
def setup(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    kc = control_plane.kubeconfig(tmp_path_factory.mktemp("kc") / "admin")
    marks = apply_release(control_plane, kc, "secm", MARKS)
    plain = apply_release(control_plane, kc, "secp", [*VALUES])  # preflightAfterFault unset, requirePreflight off
    admin = control_plane.admin()
    assert apply_quotas(admin, marks)
    a, b = gpu_node(admin, "sec", {"preflight": "passed"}), gpu_node(admin, "sec")
    out = {"admin": admin, "a": a, "b": b, "marks": marks, "plain": plain, "cp": control_plane}
    for key, rel in (("agent", marks), ("agent_plain", plain)):
        token, _ = bound_token(admin, rel.ns, rel.sa, a)
        out[key] = KubeApi.from_token(control_plane.host, token, control_plane.ca_file)
    out["ctl"] = controller_api(control_plane, marks)
    # both agent policies loaded: a label write on B is denied by each release's own-node policy
    for key, rel in (("agent", marks), ("agent_plain", plain)):
        client = out[key]
        assert wait_for(
            lambda c=client, r=rel: denied_by_policy(
                lambda: c.request(
                    "PATCH",
                    f"/api/v1/nodes/{b}",
                    {"metadata": {"labels": {NEEDS: "true"}}},
                    MERGE_PATCH,
                    query={"dryRun": "All"},  # admission runs; nothing is stored while the policy loads
                ),
                f"{r.fullname}-own-node-only",
            ),
            60,
        )
    bad = {"metadata": {"name": "probe", "labels": {"gpu-ready.io/managed-by": "gpu-ready-controller"}},
           "spec": {"template": {"spec": {"restartPolicy": "Never", "nodeName": a,
                                          "containers": [{"name": "c", "image": "busybox"}]}}}}  # fmt: skip
    assert wait_for(
        lambda: denied_by_policy(
            lambda: out["ctl"].request("POST", f"/apis/batch/v1/namespaces/{marks.ns}/jobs", bad), "controller-bounds"
        ),
        60,
    )
    try:
        admin.request("DELETE", f"/apis/batch/v1/namespaces/{marks.ns}/jobs/probe")
    except ApiError:
        pass
    return out


code = outcome


def labels(s: dict[str, Any], node: str) -> dict[str, str]:
    return dict(s["admin"].get_node(node)["metadata"].get("labels") or {})


def patch(api: KubeApi, node: str, body: dict[str, Any]) -> Callable[[], Any]:
    return lambda: api.request("PATCH", f"/api/v1/nodes/{node}", body, MERGE_PATCH)


# -- the agent's token and the needs-preflight label ---------------------------------------------------------


def test_agent_may_add_needs_preflight_true_to_its_own_node(setup):
    s = setup
    assert code(patch(s["agent"], s["a"], {"metadata": {"labels": {NEEDS: "true"}}}))[0] == 200
    assert labels(s, s["a"])[NEEDS] == "true"
    assert labels(s, s["a"])["preflight"] == "passed"  # untouched


@pytest.mark.parametrize(
    "what,preflight,body",
    [
        ("set needs-preflight to false", "passed", {"metadata": {"labels": {NEEDS: "false"}}}),
        ("remove needs-preflight", "passed", {"metadata": {"labels": {NEEDS: None}}}),
        ("set preflight=passed", "failed", {"metadata": {"labels": {"preflight": "passed", NEEDS: "true"}}}),
        ("set preflight=failed", "passed", {"metadata": {"labels": {"preflight": "failed"}}}),
        ("remove preflight", "passed", {"metadata": {"labels": {"preflight": None}}}),
        ("add another label", "passed", {"metadata": {"labels": {"example.com/x": "y"}}}),
        ("change an annotation", "passed", {"metadata": {"annotations": {"gpu-ready.io/preflight-cordoned": "true"}}}),
        ("cordon", "passed", {"spec": {"unschedulable": True}}),
    ],
)
def test_agent_may_change_nothing_else_on_its_node(setup, what, preflight, body):
    s = setup
    s["admin"].request(
        "PATCH", f"/api/v1/nodes/{s['a']}", {"metadata": {"labels": {NEEDS: "true", "preflight": preflight}}},
        MERGE_PATCH,
    )  # fmt: skip
    before = s["admin"].get_node(s["a"])
    status, who = code(patch(s["agent"], s["a"], body))
    assert status == 403 and who.startswith("policy"), (what, status, who)
    after = s["admin"].get_node(s["a"])
    assert after["metadata"].get("labels") == before["metadata"].get("labels")
    assert after["spec"] == before["spec"]


def test_agent_may_not_label_another_node(setup):
    s = setup
    status, who = code(patch(s["agent"], s["b"], {"metadata": {"labels": {NEEDS: "true"}}}))
    assert status == 403 and who.startswith("policy")
    assert NEEDS not in labels(s, s["b"])


def test_without_preflight_after_fault_the_agent_may_not_label(setup):
    s = setup
    s["admin"].request("PATCH", f"/api/v1/nodes/{s['a']}", {"metadata": {"labels": {NEEDS: None}}}, MERGE_PATCH)
    status, who = code(patch(s["agent_plain"], s["a"], {"metadata": {"labels": {NEEDS: "true"}}}))
    assert status == 403, who  # RBAC (no patch nodes with taints on? then the policy): either way, no
    assert NEEDS not in labels(s, s["a"])


def test_agent_may_watch_the_brake_configmap_and_read_no_other(setup):
    s = setup
    rel: Release = s["marks"]
    api: KubeApi = s["agent"]
    path = f"/api/v1/namespaces/{rel.ns}/configmaps"
    stream = api.stream(path, [("fieldSelector", f"metadata.name={rel.fullname}-brake"), ("watch", "1"),
                               ("timeoutSeconds", "1")], 5)  # fmt: skip
    stream.close()
    assert code(lambda: api.request("GET", f"{path}/{rel.fullname}-brake"))[0] == 403  # watch only, no GET
    with pytest.raises(ApiError) as e:
        api.stream(path, [("fieldSelector", f"metadata.name={rel.fullname}-controller-job"), ("watch", "1")], 5)
    assert e.value.status == 403
    assert code(lambda: api.request("GET", path, verb="LIST"))[0] == 403


# -- the controller's token ------------------------------------------------------------------------------------


def template_job(s: dict[str, Any], node: str) -> dict[str, Any]:
    """The Job the controller sends for `node` (its own render_job over the chart's template), a fresh name."""
    from agent.controller.main import render_job

    rel: Release = s["marks"]
    template = yaml.safe_load(by_kind(rel.docs, "ConfigMap")[f"{rel.fullname}-controller-job"]["data"]["job.yaml"])
    return render_job(template, f"{rel.fullname}-preflight", rel.ns, node, next(ATTEMPTS))


ATTEMPTS = itertools.count(1)  # each Job of this module its own attempt number, so its own name


def create_job(s: dict[str, Any], job: dict[str, Any], ns: str | None = None) -> Callable[[], Any]:
    ns = ns or s["marks"].ns
    return lambda: s["ctl"].request("POST", f"/apis/batch/v1/namespaces/{ns}/jobs", job)


def test_controller_creates_the_template_job_pinned_to_a_node(setup):
    s = setup
    job = template_job(s, s["a"])
    assert code(create_job(s, job)) == (200, "")
    name = job["metadata"]["name"]
    assert code(lambda: s["ctl"].request("DELETE", f"/apis/batch/v1/namespaces/{s['marks'].ns}/jobs/{name}"))[0] == 200


def _edit(fn: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def apply(job: dict[str, Any]) -> dict[str, Any]:
        j = copy.deepcopy(job)
        fn(j)
        return j

    return apply


def _pod(j: dict[str, Any]) -> dict[str, Any]:
    return j["spec"]["template"]["spec"]


OTHER_SPECS = {
    "another image": _edit(lambda j: _pod(j)["containers"][0].update(image="busybox:latest")),
    "another command": _edit(lambda j: _pod(j)["containers"][0].update(command=["sh", "-c", "cat /etc/shadow"])),
    "another arg": _edit(lambda j: _pod(j)["initContainers"][1]["args"].append("--burn-in-command=sh")),
    "an env var": _edit(lambda j: _pod(j)["initContainers"][1]["env"].append({"name": "LD_PRELOAD", "value": "/x.so"})),
    "a postStart hook": _edit(
        lambda j: _pod(j)["containers"][0].update(lifecycle={"postStart": {"exec": {"command": ["sh", "-c", "id"]}}})
    ),
    "a workingDir": _edit(lambda j: _pod(j)["initContainers"][0].update(workingDir="/tmp")),
    "privileged": _edit(
        lambda j: _pod(j)["containers"][0]["securityContext"].update(privileged=True, allowPrivilegeEscalation=True)
    ),
    "the token in the gates step": _edit(
        lambda j: _pod(j)["initContainers"][1]["volumeMounts"].append(
            {"name": "api-token", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": True}
        )
    ),
    "a hostPath volume": _edit(
        lambda j: (
            _pod(j)["volumes"].append({"name": "root", "hostPath": {"path": "/"}}),
            _pod(j)["containers"][0]["volumeMounts"].append({"name": "root", "mountPath": "/host"}),
        )
    ),
    "a Secret volume": _edit(lambda j: _pod(j)["volumes"].append({"name": "s", "secret": {"secretName": "x"}})),
    "another service account": _edit(lambda j: _pod(j).update(serviceAccountName="default")),
    "hostPID": _edit(lambda j: _pod(j).update(hostPID=True)),
    "a token automounted": _edit(lambda j: _pod(j).update(automountServiceAccountToken=True)),
    "tolerate everything": _edit(lambda j: _pod(j)["tolerations"].append({"operator": "Exists"})),
    "no node": _edit(lambda j: _pod(j).pop("nodeName")),
    "another backoffLimit": _edit(lambda j: j["spec"].update(backoffLimit=6)),
    "not labelled as the controller's": _edit(lambda j: j["metadata"]["labels"].pop("gpu-ready.io/managed-by")),
}


def _c(j: dict[str, Any], i: int = 0, init: bool = False) -> dict[str, Any]:
    return _pod(j)["initContainers" if init else "containers"][i]


def _vol(j: dict[str, Any], name: str) -> dict[str, Any]:
    return next(v for v in _pod(j)["volumes"] if v["name"] == name)


# One field each, none of which the string signatures of the earlier policy compared (an independent pass on the
# real apiserver had 29 of them stored): the whole-object comparison refuses every one.
SINGLE_FIELD = {
    "parallelism 100": _edit(lambda j: j["spec"].update(parallelism=100)),
    "completions 100": _edit(lambda j: j["spec"].update(completions=100)),
    "priorityClassName system-node-critical": _edit(lambda j: _pod(j).update(priorityClassName="system-node-critical")),
    "a huge cpu request": _edit(lambda j: _c(j).update(resources={"requests": {"cpu": "1000"}})),
    "a huge memory request": _edit(lambda j: _c(j).update(resources={"requests": {"memory": "10Ti"}})),
    "nvidia.com/gpu limits": _edit(lambda j: _c(j, 1, True).update(resources={"limits": {"nvidia.com/gpu": "8"}})),
    "capabilities no longer dropped": _edit(lambda j: _c(j)["securityContext"]["capabilities"].update(drop=[])),
    "a capability added": _edit(lambda j: _c(j, 0, True)["securityContext"]["capabilities"].update(add=["NET_RAW"])),
    "readOnlyRootFilesystem false": _edit(lambda j: _c(j)["securityContext"].update(readOnlyRootFilesystem=False)),
    "seccomp Unconfined": _edit(lambda j: _pod(j)["securityContext"].update(seccompProfile={"type": "Unconfined"})),
    "AppArmor Unconfined": _edit(lambda j: _pod(j)["securityContext"].update(appArmorProfile={"type": "Unconfined"})),
    "runAsGroup 0": _edit(lambda j: _pod(j)["securityContext"].update(runAsGroup=0)),
    "fsGroup 0": _edit(lambda j: _pod(j)["securityContext"].update(fsGroup=0)),
    "supplementalGroups 0": _edit(lambda j: _pod(j)["securityContext"].update(supplementalGroups=[0])),
    "a sysctl": _edit(
        lambda j: _pod(j)["securityContext"].update(sysctls=[{"name": "kernel.shm_rmid_forced", "value": "1"}])
    ),
    "a hostPort": _edit(lambda j: _c(j).update(ports=[{"containerPort": 8080, "hostPort": 80}])),
    "hostAliases for kubernetes.default.svc": _edit(
        lambda j: _pod(j).update(hostAliases=[{"ip": "10.9.9.9", "hostnames": ["kubernetes.default.svc"]}])
    ),
    "a dnsConfig": _edit(lambda j: _pod(j).update(dnsConfig={"nameservers": ["10.9.9.9"]})),
    "imagePullSecrets": _edit(lambda j: _pod(j).update(imagePullSecrets=[{"name": "regcred"}])),
    "a sidecar (restartPolicy Always)": _edit(
        lambda j: _pod(j)["initContainers"].append({"name": "side", "image": "busybox", "restartPolicy": "Always"})
    ),
    "resourceClaims": _edit(lambda j: _pod(j).update(resourceClaims=[{"name": "g", "resourceClaimTemplateName": "x"}])),
    "a projected token of 2^32 s": _edit(
        lambda j: _vol(j, "api-token")["projected"]["sources"][0]["serviceAccountToken"].update(expirationSeconds=2**32)
    ),
    "a 500Gi memory emptyDir": _edit(
        lambda j: _vol(j, "tmp").update(emptyDir={"medium": "Memory", "sizeLimit": "500Gi"})
    ),
    "a subPath": _edit(lambda j: _c(j)["volumeMounts"][1].update(subPath="x")),
    "restartPolicy OnFailure": _edit(lambda j: _pod(j).update(restartPolicy="OnFailure")),
    "managedBy": _edit(lambda j: j["spec"].update(managedBy="example.com/other")),
    "manualSelector": _edit(
        lambda j: (
            j["spec"].update(manualSelector=True, selector={"matchLabels": {"pick": "me"}}),
            j["spec"]["template"]["metadata"]["labels"].update(pick="me"),
        )
    ),
    "hostUsers false": _edit(lambda j: _pod(j).update(hostUsers=False)),
    "an extra Job label": _edit(lambda j: j["metadata"]["labels"].update({"example.com/x": "y"})),
    "an extra pod label": _edit(lambda j: j["spec"]["template"]["metadata"]["labels"].update({"example.com/x": "y"})),
    "a pod annotation": _edit(lambda j: j["spec"]["template"]["metadata"].update(annotations={"example.com/x": "y"})),
    "a Job annotation": _edit(lambda j: j["metadata"]["annotations"].update({"example.com/x": "y"})),
    "a nodeSelector": _edit(lambda j: _pod(j).update(nodeSelector={"example.com/x": "y"})),
    "another scheduler": _edit(lambda j: _pod(j).update(schedulerName="other")),
    "terminationGracePeriodSeconds 0": _edit(lambda j: _pod(j).update(terminationGracePeriodSeconds=0)),
    "the pod's deadline": _edit(lambda j: _pod(j).update(activeDeadlineSeconds=99999)),
    "ttlSecondsAfterFinished": _edit(lambda j: j["spec"].update(ttlSecondsAfterFinished=0)),
    "the Job's deadline": _edit(lambda j: j["spec"].update(activeDeadlineSeconds=99999)),
    "a podFailurePolicy (and the podReplacementPolicy it needs)": _edit(
        lambda j: j["spec"].update(
            podReplacementPolicy="Failed",
            podFailurePolicy={"rules": [{"action": "Ignore", "onExitCodes": {"operator": "In", "values": [1]}}]},
        )
    ),
    "an env from a Secret": _edit(
        lambda j: _c(j)["env"].append({"name": "S", "valueFrom": {"secretKeyRef": {"name": "x", "key": "k"}}})
    ),
    "envFrom a Secret": _edit(lambda j: _c(j).update(envFrom=[{"secretRef": {"name": "x"}}])),
    "stdin and tty": _edit(lambda j: _c(j).update(stdin=True, tty=True)),
    "hostNetwork": _edit(lambda j: _pod(j).update(hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet")),
    "hostIPC": _edit(lambda j: _pod(j).update(hostIPC=True)),
    "shareProcessNamespace": _edit(lambda j: _pod(j).update(shareProcessNamespace=True)),
    "another runtime class": _edit(lambda j: _pod(j).update(runtimeClassName="runc")),
    "service links": _edit(lambda j: _pod(j).update(enableServiceLinks=True)),
    "topologySpreadConstraints": _edit(
        lambda j: _pod(j).update(
            topologySpreadConstraints=[{"maxSkew": 1, "topologyKey": "x", "whenUnsatisfiable": "DoNotSchedule"}]
        )
    ),
    "an owner reference": _edit(
        lambda j: j["metadata"].update(
            ownerReferences=[
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": "00000000-0000-0000-0000-000000000000"}
            ]
        )
    ),
    "a finalizer": _edit(lambda j: j["metadata"].update(finalizers=["example.com/hold"])),
}

# The same strings, other objects: what the joined signatures could not tell apart.
SMUGGLED = {
    "two args joined into one": _edit(lambda j: _c(j).update(args=[" ".join(_c(j)["args"][:2]), *_c(j)["args"][2:]])),
    "NVIDIA_VISIBLE_DEVICES=void inside NODE_NAME's value": _edit(
        lambda j: _c(j, 0, True).update(
            env=[{"name": "NODE_NAME", "value": "field:spec.nodeName,NVIDIA_VISIBLE_DEVICES=void"}]
        )
    ),
    "a toleration smuggled inside another's key": _edit(
        lambda j: _pod(j).update(
            tolerations=[
                {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"},
                {"operator": "Exists"},
            ]
        )
    ),
}


ALL_OTHER = {**OTHER_SPECS, **SINGLE_FIELD, **SMUGGLED}


DOCS = Path(__file__).resolve().parents[1] / "docs" / "controller.md"
TABLE = DocsTable(DOCS, "<!-- controller-jobs-table:begin -->", "<!-- controller-jobs-table:end -->", "Job")


def jobs_table(observed: dict[str, tuple[int, str]]) -> str:
    lines = ["| the Job differs from the template in | result |", "|---|---|"]
    for what in ALL_OTHER:
        status, who = observed[what]
        lines.append(f"| {what} | {status}" + (f" ({who})" if who else "") + " |")
    return "\n".join(lines)


def test_controller_may_not_create_a_job_other_than_the_template(setup):
    """Every row: refused by the controller's policy, and no pod of it ever made (the Job controller runs). The
    table in docs/controller.md is this run's (GPU_READY_UPDATE_DOCS=1 rewrites it)."""
    s = setup
    observed, problems, names = {}, [], []
    for what, edit in ALL_OTHER.items():
        job = edit(template_job(s, s["a"]))
        names.append(job["metadata"]["name"])
        observed[what] = code(create_job(s, job))
        if observed[what] != (403, "policy controller-bounds"):
            problems.append(f"{what}: {observed[what]}")
    assert not problems, "\n".join(problems)
    assert not [n for n in names if job_pods(s["admin"], s["marks"].ns, n)]  # none of them made a pod
    print(f"\n[controller-jobs] {len(ALL_OTHER)} Jobs other than the template, every one refused")
    TABLE.check(jobs_table(observed))


def test_the_template_job_runs_its_pod_under_the_job_controller(setup):
    """The control case of the rows above: the template itself is stored and the real Job controller makes its
    pod, pinned to the node, so a refused row is a refused Job and not a Job controller that is not there."""
    s = setup
    job = template_job(s, s["a"])
    assert code(create_job(s, job)) == (200, "")
    name = job["metadata"]["name"]
    assert wait_for(lambda: job_pods(s["admin"], s["marks"].ns, name), 60)
    pod = job_pods(s["admin"], s["marks"].ns, name)[0]
    assert pod["spec"]["nodeName"] == s["a"] and not pod["spec"].get("priorityClassName")
    s["admin"].request("DELETE", f"/apis/batch/v1/namespaces/{s['marks'].ns}/jobs/{name}",
                       {"propagationPolicy": "Background"})  # fmt: skip


def test_controller_pins_jobs_only_to_the_charts_gpu_nodes(setup):
    s = setup
    admin = s["admin"]
    cp_node = gpu_node(admin, "sec", {"node-role.kubernetes.io/control-plane": ""})
    plain = f"plain-{secrets.token_hex(3)}"
    create_node(admin, plain, {"kubernetes.io/os": "linux"})
    for node in (cp_node, plain):
        assert wait_for(lambda n=node: code(create_job(s, template_job(s, n)))[0] == 403, 30), node
        status, who = code(create_job(s, template_job(s, node)))
        assert (status, who) == (403, "policy controller-targets"), (node, status, who)
    # a Node that does not exist: no policy can look it up; the pod is bound to no kubelet (docs/controller.md)
    ghost = template_job(s, f"ghost-{secrets.token_hex(3)}")
    assert code(create_job(s, ghost))[0] == 200
    admin.request("DELETE", f"/apis/batch/v1/namespaces/{s['marks'].ns}/jobs/{ghost['metadata']['name']}",
                  {"propagationPolicy": "Background"})  # fmt: skip


def test_the_apiserver_bounds_preflight_pods_and_jobs(setup):
    """maxConcurrent (2) preflight pods at once whatever the token creates (a pod quota the Job controller meets),
    and at most maxJobs Jobs in the namespace (the create beyond is refused)."""
    s = setup
    ns = s["marks"].ns
    admin: KubeApi = s["admin"]
    quotas = f"/api/v1/namespaces/{ns}/resourcequotas"
    for q in ("preflight", "preflight-jobs"):  # the quota controller has counted (until then nothing is held)
        path = f"{quotas}/{s['marks'].fullname}-{q}"
        assert wait_for(lambda p=path: (admin.request("GET", p).get("status") or {}).get("used") is not None, 60), q
    made, refused = [], []
    for _ in range(MAX_JOBS + 2):
        job = template_job(s, s["a"])
        status, who = code(create_job(s, job))
        if status == 200:
            made.append(job["metadata"]["name"])
        else:
            refused.append((status, who))
    assert refused and all(r == (403, "") for r in refused), refused  # the quota: neither RBAC nor a policy
    assert len(made) <= MAX_JOBS
    quota = f"{quotas}/{s['marks'].fullname}-preflight"
    assert wait_for(lambda: (admin.request("GET", quota).get("status") or {}).get("used", {}).get("pods") == "2", 60)

    def live() -> list[dict[str, Any]]:
        return [p for n in made for p in job_pods(admin, ns, n) if not p["metadata"].get("deletionTimestamp")]

    assert len(live()) <= 2 < len(made)  # the Job controller's pods beyond the quota are refused
    for n in made:
        admin.request("DELETE", f"/apis/batch/v1/namespaces/{ns}/jobs/{n}", {"propagationPolicy": "Background"})


def test_controller_may_not_create_jobs_elsewhere_or_touch_others(setup):
    s = setup
    admin = s["admin"]
    other = f"other-{secrets.token_hex(3)}"
    ensure_namespace(admin, other)
    status, who = code(create_job(s, template_job(s, s["a"]), ns=other))
    assert (status, who) == (403, "RBAC")
    ns = s["marks"].ns
    theirs = template_job(s, s["a"])
    theirs["metadata"]["labels"].pop("gpu-ready.io/managed-by")
    admin.request("POST", f"/apis/batch/v1/namespaces/{ns}/jobs", theirs)
    name = theirs["metadata"]["name"]
    assert code(lambda: s["ctl"].request("DELETE", f"/apis/batch/v1/namespaces/{ns}/jobs/{name}")) == (
        403,
        "policy controller-bounds",
    )
    mine = template_job(s, s["a"])
    assert code(create_job(s, mine))[0] == 200
    path = f"/apis/batch/v1/namespaces/{ns}/jobs/{mine['metadata']['name']}"
    status, _ = code(lambda: s["ctl"].request("PATCH", path, {"metadata": {"labels": {"x": "y"}}}, MERGE_PATCH))
    assert status == 403  # RBAC has no update/patch on jobs; the policy refuses an UPDATE too


def test_controller_may_not_write_nodes_or_read_secrets(setup):
    s = setup
    ctl: KubeApi = s["ctl"]
    for body in ({"metadata": {"labels": {NEEDS: "true"}}}, {"spec": {"unschedulable": True}}):
        assert code(patch(ctl, s["a"], body)) == (403, "RBAC")
    assert code(lambda: ctl.request("PATCH", f"/api/v1/nodes/{s['a']}/status", {"status": {}}, MERGE_PATCH)) == (
        403,
        "RBAC",
    )
    ns = s["marks"].ns
    assert code(lambda: ctl.request("GET", f"/api/v1/namespaces/{ns}/secrets", verb="LIST"))[0] == 403
    assert code(lambda: ctl.request("GET", f"/api/v1/namespaces/{ns}/secrets/anything"))[0] == 403
    assert code(lambda: ctl.request("GET", "/api/v1/secrets", verb="LIST"))[0] == 403
    # reading Nodes is all it may do with them
    assert code(lambda: ctl.request("GET", "/api/v1/nodes", query={"limit": "1"}, verb="LIST"))[0] == 200


def test_controller_writes_only_its_lease_and_the_brake_configmap(setup):
    s = setup
    ctl: KubeApi = s["ctl"]
    rel: Release = s["marks"]
    cms = f"/api/v1/namespaces/{rel.ns}/configmaps"
    brake = {"metadata": {"name": f"{rel.fullname}-brake"}, "data": {"engaged": "false", "admitted": ""}}
    assert code(lambda: ctl.request("POST", cms, brake))[0] in (200, 409)
    other = {"metadata": {"name": "other"}, "data": {"x": "y"}}
    assert code(lambda: ctl.request("POST", cms, other)) == (403, "policy controller-bounds")
    big = {"metadata": {"name": f"{rel.fullname}-brake"}, "data": {str(i): "x" for i in range(20)}}
    assert code(lambda: ctl.request("PUT", f"{cms}/{rel.fullname}-brake", big)) == (403, "policy controller-bounds")
    leases = f"/apis/coordination.k8s.io/v1/namespaces/{rel.ns}/leases"
    lease = {"metadata": {"name": "not-mine"}, "spec": {"holderIdentity": "x"}}
    assert code(lambda: ctl.request("POST", leases, lease)) == (403, "policy controller-bounds")
    assert code(lambda: ctl.request("GET", f"{leases}/not-mine"))[0] == 403


def test_controller_events_cannot_claim_another_reporter(setup):
    s = setup
    path = "/apis/events.k8s.io/v1/namespaces/default/events"  # Events about a Node: default (events.namespace)

    def event(**over: Any) -> dict[str, Any]:
        ev = {"metadata": {"generateName": "gpu-ready-controller-"}, "eventTime": "2026-01-01T00:00:00.000000Z",
              "reportingController": "gpu-ready-controller", "reportingInstance": "gpu-ready-controller-a",
              "action": "Preflight", "reason": "PreflightGaveUp", "note": "x", "type": "Warning",
              "regarding": {"apiVersion": "v1", "kind": "Node", "name": s["a"]}}  # fmt: skip
        ev.update(over)
        return ev

    assert code(lambda: s["ctl"].request("POST", path, event()))[0] == 200
    for over in ({"reportingInstance": "kubelet"}, {"reportingInstance": "node-controller"},
                 {"reportingController": "kubelet"}):  # fmt: skip
        assert code(lambda o=over: s["ctl"].request("POST", path, event(**o))) == (403, "policy controller-bounds"), (
            over
        )


# -- the preflight token's cordon ------------------------------------------------------------------------------


def _preflight_api(s: dict[str, Any], node: str) -> KubeApi:
    rel: Release = s["marks"]
    token, _ = bound_token(s["admin"], rel.ns, f"{rel.fullname}-preflight", node)
    return KubeApi.from_token(s["cp"].host, token, s["cp"].ca_file)


CORDON_MARK = "gpu-ready.io/preflight-cordoned"


def test_preflight_uncordons_only_a_cordon_still_its_own(setup):
    """A failed run leaves its mark; an admin uncordons, later cordons for maintenance: the old mark does not let
    the preflight token lift the admin's cordon (the field is the admin's now). Its own fresh cordon it may lift."""
    s = setup
    node = gpu_node(s["admin"], "sec")
    pf = _preflight_api(s, node)
    cordon = {"spec": {"unschedulable": True}, "metadata": {"annotations": {CORDON_MARK: "true"}}}
    uncordon = {"spec": {"unschedulable": False}, "metadata": {"annotations": {CORDON_MARK: None}}}
    assert wait_for(lambda: code(patch(pf, node, cordon))[0] == 200, 30)  # the policy loaded with the release
    kubectl = client_as(s["cp"], "kubectl/v1.37.0")
    kubectl.request("PATCH", f"/api/v1/nodes/{node}", {"spec": {"unschedulable": None}}, MERGE_PATCH)  # uncordon
    kubectl.request("PATCH", f"/api/v1/nodes/{node}", {"spec": {"unschedulable": True}}, MERGE_PATCH)  # maintenance
    n = s["admin"].get_node(node)
    assert n["metadata"]["annotations"][CORDON_MARK] == "true"  # the stale mark is still there
    assert code(patch(pf, node, uncordon)) == (403, "policy preflight-own-node-only")
    assert s["admin"].get_node(node)["spec"]["unschedulable"] is True
    from agent.preflight.onboarding import cordoned_by_preflight

    assert not cordoned_by_preflight(s["admin"].get_node(node))  # and the record step does not try
    # its own cordon again: the admin uncordons, preflight cordons (mark and field its own), then may uncordon
    kubectl.request("PATCH", f"/api/v1/nodes/{node}", {"spec": {"unschedulable": False}}, MERGE_PATCH)
    assert code(patch(pf, node, {"metadata": {"annotations": {CORDON_MARK: None}}}))[0] == 200
    assert code(patch(pf, node, cordon))[0] == 200
    assert cordoned_by_preflight(s["admin"].get_node(node))
    assert code(patch(pf, node, uncordon))[0] == 200


def test_preflight_cordons_no_control_plane_or_other_node(setup):
    s = setup
    for labels in ({"nvidia.com/gpu.present": "true", "node-role.kubernetes.io/control-plane": ""},
                   {"nvidia.com/gpu.present": "false"}):  # fmt: skip
        node = f"n-{secrets.token_hex(3)}"
        create_node(s["admin"], node, labels)
        pf = _preflight_api(s, node)
        body = {"spec": {"unschedulable": True}, "metadata": {"annotations": {CORDON_MARK: "true"}}}
        assert code(patch(pf, node, body)) == (403, "policy preflight-own-node-only"), labels
        assert not s["admin"].get_node(node)["spec"].get("unschedulable")


EXAMPLES = Path(__file__).resolve().parents[1] / "charts" / "gpu-ready" / "examples"


@pytest.mark.parametrize("example", sorted(p.stem for p in EXAMPLES.glob("*.yaml")))
def test_each_examples_template_job_is_the_one_the_policy_admits(setup, example, tmp_path):
    """The exact comparison holds for every tested values file, with volumes and env of the user's whose defaults
    the apiserver fills in (a hostPath without type, a configMap without defaultMode, a fieldRef without
    apiVersion): the controller can run."""
    s = setup
    cp: ControlPlane = s["cp"]
    extra = ['extraVolumes=[{"name":"u1","hostPath":{"path":"/x"}},{"name":"u2","configMap":{"name":"y"}}]',
             'extraVolumeMounts=[{"name":"u1","mountPath":"/u1"},{"name":"u2","mountPath":"/u2"}]']  # fmt: skip
    values = ["-f", str(EXAMPLES / f"{example}.yaml"), *VALUES]
    if example == "gke":  # its own hostPath volume (with a type) stays as it is
        extra = []
    extra.append('agent.extraEnv=[{"name":"P","valueFrom":{"fieldRef":{"fieldPath":"metadata.name"}}}]')
    rel = apply_release(
        cp, cp.kubeconfig(tmp_path / "kc"), "ex", [*values, *(x for e in extra for x in ("--set-json", e))]
    )
    ctl = controller_api(cp, rel)
    from agent.controller.main import render_job

    template = yaml.safe_load(by_kind(rel.docs, "ConfigMap")[f"{rel.fullname}-controller-job"]["data"]["job.yaml"])
    jobs = f"/apis/batch/v1/namespaces/{rel.ns}/jobs"

    def probe() -> Any:  # a fresh name each time: one stored before the policy loaded does not collide
        bad = render_job(template, f"{rel.fullname}-preflight", rel.ns, s["a"], next(ATTEMPTS))
        bad["spec"]["parallelism"] = 2
        return ctl.request("POST", jobs, bad)

    assert wait_for(lambda: denied_by_policy(probe, "controller-bounds"), 60)
    job = render_job(template, f"{rel.fullname}-preflight", rel.ns, s["a"], next(ATTEMPTS))
    assert code(lambda: ctl.request("POST", jobs, job)) == (200, ""), example
    s["admin"].request("DELETE", f"{jobs}/{job['metadata']['name']}", {"propagationPolicy": "Background"})
