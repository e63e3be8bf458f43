"""Least privilege for the automatic flow, proven on the real apiserver with the chart's rendered RBAC and admission
policies: the agent's token (bound to a pod on node A) may add `gpu-ready.io/needs-preflight=true` to its own Node
with preflightAfterFault, and nothing else new (never another value, never removed, never `preflight`, never on
node B, never without the setting); the controller's token cannot write a Node, cannot create a Job outside its
namespace or one whose pod differs from the chart's preflight template in anything but the node, cannot update
or delete a Job it did not create, writes only its Lease and the brake ConfigMap, and reads no Secret; the agent
may watch the brake ConfigMap and read no other."""

from __future__ import annotations

import copy
import secrets
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from agent.kube.client import MERGE_PATCH, ApiError, KubeApi
from testkit.chart import Release, apply_release, by_kind
from testkit.cluster import bound_token, create_runtime_class, ensure_namespace
from testkit.controller import VALUES, controller_api, gpu_node
from testkit.controlplane import ControlPlane
from testkit.harness import wait_for
from testkit.security import denied_by, denied_by_policy

NEEDS = "gpu-ready.io/needs-preflight"
MARKS = [*VALUES, "--set", "config.preflightAfterFault=true"]


@pytest.fixture(scope="module")
def setup(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    kc = control_plane.kubeconfig(tmp_path_factory.mktemp("kc") / "admin")
    marks = apply_release(control_plane, kc, "secm", MARKS)
    plain = apply_release(control_plane, kc, "secp", [*VALUES])  # preflightAfterFault unset, requirePreflight off
    admin = control_plane.admin()
    create_runtime_class(admin)
    a, b = gpu_node(admin, "sec", {"preflight": "passed"}), gpu_node(admin, "sec")
    out = {"admin": admin, "a": a, "b": b, "marks": marks, "plain": plain}
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


def code(fn: Callable[[], Any]) -> tuple[int, str]:
    try:
        fn()
    except ApiError as e:
        return e.status, denied_by(str(e))
    return 200, ""


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
    rel: Release = s["marks"]
    job = yaml.safe_load(by_kind(rel.docs, "ConfigMap")[f"{rel.fullname}-controller-job"]["data"]["job.yaml"])
    job["metadata"]["name"] = f"t-{secrets.token_hex(4)}"
    job["metadata"]["namespace"] = rel.ns
    job["metadata"]["labels"]["gpu-ready.io/managed-by"] = "gpu-ready-controller"
    job["spec"]["template"]["spec"]["nodeName"] = node
    return job


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


@pytest.mark.parametrize("what", sorted(OTHER_SPECS))
def test_controller_may_not_create_a_job_other_than_the_template(setup, what):
    s = setup
    job = OTHER_SPECS[what](template_job(s, s["a"]))
    status, who = code(create_job(s, job))
    assert status == 403 and who == "policy controller-bounds", (what, status, who)


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
