"""The chart's controller objects as rendered: off by default, no second copy of the preflight Job (the controller's
ConfigMap holds the same rendering the manual Job has, the node left to pin), no chart-made Job while the
controller runs, the agent told where the brake is, and a controller without preflight refused."""

from __future__ import annotations

import pytest
import yaml

from testkit.chart import CHART, by_kind, helm, is_hook, render

AUTO = ["--set", "preflight.enabled=true", "--set", "preflight.auto.enabled=true"]


def test_off_by_default_and_the_agent_then_watches_no_brake():
    docs = render(["--set", "preflight.enabled=true"])
    assert not [d for d in docs if d["kind"] == "Deployment"]
    cfg = yaml.safe_load(by_kind(docs, "ConfigMap")["gpu-ready"]["data"]["config.yaml"])
    assert "brakeConfigmap" not in cfg
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Job" and not is_hook(d)] == [
        "gpu-ready-preflight-next"
    ]


def test_the_controller_job_template_is_the_manual_job_but_the_node():
    manual = render(["--set", "preflight.enabled=true", "--set", "preflight.nodeName=gpu-ready-controller-pins-this"])
    job = next(d for d in manual if d["kind"] == "Job")
    docs = render(AUTO)
    assert not [d for d in docs if d["kind"] == "Job" and not is_hook(d)]  # the controller creates them; the chart none
    template = yaml.safe_load(by_kind(docs, "ConfigMap")["gpu-ready-controller-job"]["data"]["job.yaml"])
    assert template == job
    cfg = yaml.safe_load(by_kind(docs, "ConfigMap")["gpu-ready"]["data"]["config.yaml"])
    assert cfg["brakeConfigmap"] == "gpu-ready/gpu-ready-brake"
    dep = by_kind(docs, "Deployment")["gpu-ready-controller"]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--brake=gpu-ready-brake" in args and "--max-unavailable=10%" in args


def test_the_controller_needs_preflight():
    r = helm("template", "x", str(CHART), "--set", "preflight.auto.enabled=true", check=False)
    assert r.returncode != 0 and "preflight.auto.enabled needs preflight.enabled" in r.stderr


def test_brake_off_leaves_the_agents_without_a_watch():
    docs = render([*AUTO, "--set", "preflight.auto.brake.enabled=false"])
    cfg = yaml.safe_load(by_kind(docs, "ConfigMap")["gpu-ready"]["data"]["config.yaml"])
    assert "brakeConfigmap" not in cfg
    assert "gpu-ready-brake" not in by_kind(docs, "Role")


def test_the_job_policy_compares_whole_objects_never_joined_strings():
    docs = render(AUTO)
    vap = next(
        d
        for d in docs
        if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"].endswith("-controller-bounds")
    )
    text = yaml.safe_dump(vap)
    assert ".join(" not in text  # no field is compared as part of a joined string
    assert "dyn(object.spec) ==" in text
    targets = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"
               and d["spec"]["policyName"].endswith("-controller-targets")]  # fmt: skip
    selectors = [b["spec"]["paramRef"]["selector"]["matchExpressions"][0] for b in targets]
    assert {"key": "nvidia.com/gpu.present", "operator": "NotIn", "values": ["true"]} in selectors
    assert {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"} in selectors
    quotas = by_kind(docs, "ResourceQuota")
    assert quotas["gpu-ready-preflight"]["spec"] == {"hard": {"pods": "2"}, "scopes": ["Terminating"]}
    assert quotas["gpu-ready-preflight-jobs"]["spec"]["hard"] == {"count/jobs.batch": "100"}


REFUSED_NAMES = [
    ("conditionType=KernelDeadlock", "Node Problem Detector"),
    ("conditionType=ReadonlyFilesystem", "Node Problem Detector"),
    ("conditionType=FrequentKubeletRestart", "Node Problem Detector"),
    ("taints.key=karpenter.sh/disrupted", "another component"),
    ("taints.key=node.cilium.io/agent-not-ready", "another component"),
    ("taints.key=nvidia.com/gpu.deploy.driver", "another component"),
    ("config.preflightLabel=nvidia.com/gpu.product", "another component"),
    ("preflight.needsLabel=nvidia.com/mig.config", "another component"),
    ("preflight.needsLabel=karpenter.k8s.aws/instance-gpu-count", "another component"),
    ("conditionType=cloud.google.com/gke-nodepool", "another component"),
]


@pytest.mark.parametrize("value,why", REFUSED_NAMES)
def test_the_chart_refuses_names_other_components_own(value, why):
    r = helm("template", "x", str(CHART), "--set", value, check=False)
    assert r.returncode != 0 and why in r.stderr, r.stderr[-400:]


RECOVERY = ["--set", "recovery.enabled=true", "--set", "podResources.enabled=true"]


def test_recovery_evict_needs_node_restriction_and_a_device_plugin_target():
    r = helm("template", "x", str(CHART), *RECOVERY, "--set", "recovery.evict=true",
             "--set", "nodeRestriction.enabled=false", check=False)  # fmt: skip
    assert r.returncode != 0 and "recovery.evict needs nodeRestriction.enabled" in r.stderr
    for ds in ("kube-proxy", "coredns", "cilium"):
        r = helm("template", "x", str(CHART), *RECOVERY, "--set", "recovery.devicePlugin.namespace=kube-system",
                 "--set", f"recovery.devicePlugin.daemonSet={ds}", check=False)  # fmt: skip
        assert r.returncode != 0 and "is not a GPU device plugin" in r.stderr, ds
    ok = render([*RECOVERY, "--set", "recovery.evict=true", "--set", "recovery.devicePlugin.namespace=kube-system",
                 "--set", "recovery.devicePlugin.daemonSet=nvidia-gpu-device-plugin"])  # fmt: skip
    vap = next(
        d for d in ok if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"].endswith("-recovery-pods")
    )
    excluded = next(v for v in vap["spec"]["variables"] if v["name"] == "excluded")
    assert excluded["expression"] == '["kube-system"]'
