"""The chart's controller objects as rendered: off by default, no second copy of the preflight Job (the controller's
ConfigMap holds the same rendering the manual Job has, the node left to pin), no chart-made Job while the
controller runs, the agent told where the brake is, and a controller without preflight refused."""

from __future__ import annotations

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
